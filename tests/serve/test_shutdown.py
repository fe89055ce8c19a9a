"""How ``localmoe serve`` ends, in real processes: a model that fails to load stops the server
(one ``error:`` line, exit status 1) instead of leaving it answering 503 forever, and SIGTERM
drains the requests in flight (streams end with a final chunk and ``data: [DONE]``) and exits
0; SIGINT still exits 130. Its log, the access log included, is on stderr, not stdout.

The SIGTERM tests run ``localmoe serve`` through :func:`localmoe.cli.main` in a child process
that first imports ``tests.serve.test_server`` (which registers its scripted backend: ``slow``
in the prompt streams ~400 tokens at 50 ms each) and sets the shutdown grace period.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]

_SERVE_SCRIPTED = """
import sys
import tests.serve.test_server  # registers the scripted-test backend
import localmoe.serve.server as server
server.SHUTDOWN_GRACE_S = float(sys.argv[1])
from localmoe.cli import main
main(sys.argv[2:])
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.kill()
        p.communicate(timeout=30)


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


def _serve_scripted(smollm2_path, grace: float):
    """``localmoe serve`` of the scripted backend in a child process, ready: (process, URL)."""
    port = _free_port()
    p = subprocess.Popen([sys.executable, "-c", _SERVE_SCRIPTED, str(grace), "serve", "-m",
                          str(smollm2_path), "--backend", "scripted-test", "-c", "512",
                          "--port", str(port)], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        assert p.poll() is None, p.communicate()[1]
        assert time.time() < deadline, "the server did not become ready"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return p, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)


def _events(lines) -> list:
    """The SSE events of a stream: parsed chunks, and ``"[DONE]"``."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _stream_then_signal(url: str, p: subprocess.Popen, content: str, sig: int,
                        max_tokens: int | None = None, after=None) -> list:
    """Start a stream (usage included), send ``sig`` to the server once its first chunks
    arrived (then call ``after()``), read the stream to its end: its events."""
    body = {"stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": content}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    events = []
    with httpx.Client(timeout=60) as hc, \
            hc.stream("POST", url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            events += _events([line])
            if len(events) >= 3:
                break
        p.send_signal(sig)
        if after is not None:
            after()
        try:
            for line in lines:
                events += _events([line])
        except httpx.RemoteProtocolError:  # the server cut the stream: what came is checked
            pass
    return events


def _assert_ended_properly(events: list, finish: str) -> tuple[str, int]:
    """A final chunk with ``finish``, the usage chunk, then ``[DONE]``: (the streamed text,
    the completion tokens)."""
    assert events and events[-1] == "[DONE]", events[-3:]
    assert events[-2]["choices"] == [] and events[-2]["usage"], events[-2]
    chunks = events[:-2]
    assert chunks[-1]["choices"][0]["finish_reason"] == finish, chunks[-1]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    return text, events[-2]["usage"]["completion_tokens"]


def test_sigterm_lets_a_stream_in_flight_finish_then_exits_0(smollm2_path):
    """SIGTERM while a stream runs: no new connection is accepted, the stream (~1 s left)
    ends as it would have, with its final chunk and [DONE], then the server exits 0 (it was
    cut after uvicorn's 3 s with no final chunk and no [DONE], and the process died of the
    signal: status 143)."""
    p, url = _serve_scripted(smollm2_path, grace=20)
    try:
        refused: list = []

        def new_connection():
            time.sleep(0.5)
            try:
                httpx.get(url + "/health", timeout=2)
            except httpx.TransportError as e:
                refused.append(e)

        t0 = time.time()
        # "slow" at 50 ms a token: 40 tokens take ~2 s
        events = _stream_then_signal(url, p, "slow please", signal.SIGTERM, max_tokens=40,
                                     after=new_connection)
        _, err = p.communicate(timeout=60)
        text, n = _assert_ended_properly(events, "length")
        assert n == 40 and text.split()[:3] == ["s0", "s1", "s2"], (n, text)
        assert p.returncode == 0, err
        assert time.time() - t0 < 20
        assert refused, "a new connection was accepted after SIGTERM"
        assert "Traceback" not in err and "Cancel" not in err, err
    finally:
        _stop(p)


def test_the_access_log_goes_to_stderr_and_stdout_stays_empty(smollm2_path):
    """uvicorn writes its access log to stdout; ``serve``'s other logs go to stderr. Every
    log line of the server, one a request included, is on stderr in uvicorn's format; stdout
    stays empty."""
    p, url = _serve_scripted(smollm2_path, grace=1)
    try:
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "echo 3"}]})
        assert r.status_code == 200, r.text
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        assert out == "", out
        access = [l for l in err.splitlines() if '"POST /v1/chat/completions HTTP/1.1" 200' in l]
        assert len(access) == 1 and access[0].startswith("INFO:"), err
        assert "Uvicorn running" in err, err
    finally:
        _stop(p)


def test_sigterm_ends_a_long_stream_after_the_grace_period_with_a_final_chunk(smollm2_path):
    """A stream that would run ~20 s more: after the grace period (1 s here) its generation
    is stopped and the stream ends properly, a final chunk with finish_reason "length" (the
    answer is cut short) and [DONE]; exit status 0, well before the stream's own end."""
    p, url = _serve_scripted(smollm2_path, grace=1)
    try:
        t0 = time.time()
        events = _stream_then_signal(url, p, "slow please", signal.SIGTERM)
        _, err = p.communicate(timeout=60)
        text, n = _assert_ended_properly(events, "length")
        assert 0 < n < 150 and text.startswith("s0 s1"), (n, text)
        assert p.returncode == 0, err
        assert time.time() - t0 < 10, "the stream was not ended at the grace period"
        assert "Traceback" not in err and "Cancel" not in err, err
    finally:
        _stop(p)


def test_sigint_still_exits_130_and_ends_the_stream_properly(smollm2_path):
    """Ctrl-C keeps its status 130 ('interrupted'); the open stream ends as under SIGTERM."""
    p, url = _serve_scripted(smollm2_path, grace=1)
    try:
        events = _stream_then_signal(url, p, "slow please", signal.SIGINT)
        _, err = p.communicate(timeout=60)
        _assert_ended_properly(events, "length")
        assert p.returncode == 130, err
        assert "interrupted" in err and "Traceback" not in err, err
    finally:
        _stop(p)


def test_sigterm_ends_a_json_answer_cut_short_and_refuses_the_queued_request(smollm2_path):
    """After the grace period a non-streamed answer in flight is sent with what was generated
    and finish_reason "length"; a request still waiting for the model gets a 503
    server_shutting_down (no generation starts during the shutdown); exit status 0."""
    import localmoe.serve.server as server

    assert server.SHUTDOWN_GRACE_S == 5.0  # the default the docs give
    p, url = _serve_scripted(smollm2_path, grace=1)
    got: dict = {}

    def post(name: str, content: str):
        got[name] = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": content}]})

    def metric(name: str) -> float:
        for line in httpx.get(url + "/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        raise AssertionError(name)

    def wait_for(name: str, value: float):
        deadline = time.time() + 30
        while metric(name) < value:
            assert time.time() < deadline, name
            time.sleep(0.05)

    try:
        running = threading.Thread(target=post, args=("running", "slow please"))
        running.start()
        wait_for("localmoe_requests_running", 1)
        queued = threading.Thread(target=post, args=("queued", "echo 5"))
        queued.start()
        wait_for("localmoe_queue_depth", 1)
        t0 = time.time()
        p.send_signal(signal.SIGTERM)
        running.join(30)
        queued.join(30)
        _, err = p.communicate(timeout=60)
        r = got["running"]
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length", choice
        assert choice["message"]["content"].startswith("s0 s1"), choice
        assert 0 < r.json()["usage"]["completion_tokens"] < 150
        r = got["queued"]
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down", r.text
        assert p.returncode == 0, err
        assert time.time() - t0 < 10
        assert "Traceback" not in err and "Cancel" not in err, err
    finally:
        _stop(p)
