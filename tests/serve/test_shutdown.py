"""How ``localmoe serve`` ends, in real processes: a model that fails to load stops the server
(one ``error:`` line, exit status 1) instead of leaving it answering 503 forever.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import httpx
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_model_that_fails_to_load_stops_the_server_with_generates_error_line(tmp_path):
    """A valid GGUF without one expert tensor passes the checks before the bind and is refused
    by the backend while loading: the server logged "model failed to load", then answered
    every request 503 model_load_failed forever (under systemd or docker it looked alive).
    Now it exits 1 with one ``error:`` line, word for word what ``generate`` prints for the
    file, after shutting uvicorn down (no traceback, no "Cancel ... task(s)")."""
    from tests.hostile.gen import build, drop_tensor

    bad = build(tmp_path / "noexpert.gguf", plan=drop_tensor("blk.1.ffn_gate_exps.weight"))
    gen = subprocess.run([sys.executable, "-m", "localmoe", "generate", "-m", str(bad),
                          "--backend", "torch", "-n", "2", "hi"], capture_output=True, text=True,
                         timeout=300)
    assert gen.returncode == 1, gen.stderr
    want = gen.stderr.strip().splitlines()[-1]
    assert want.startswith("error: ") and "ffn_gate_exps" in want, gen.stderr

    port = _free_port()
    r = subprocess.run([sys.executable, "-m", "localmoe", "serve", "-m", str(bad), "--backend",
                        "torch", "--port", str(port)], capture_output=True, text=True,
                       timeout=60)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode == 1, r.stderr
    assert lines[-1] == want, r.stderr
    assert r.stderr.count("ffn_gate_exps") == 1, r.stderr  # not logged before the line too
    assert "Uvicorn running" in r.stderr and "Application shutdown complete" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "Cancel" not in r.stderr, r.stderr
    with pytest.raises(httpx.ConnectError):  # nothing is left listening
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
