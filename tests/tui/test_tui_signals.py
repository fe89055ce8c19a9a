"""``localmoe chat`` ended by a signal (``kill``, ``timeout``, a closed terminal window) leaves
the terminal as Ctrl+Q does: the alternate screen left, mouse reporting and bracketed paste
off, the cursor shown; then it exits 128 + the signal's number with one line on stderr, as
``generate`` does. Real processes on a pseudo-terminal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.ptyio import start_drain

pty = pytest.importorskip("pty")
pytest.importorskip("textual")

#: what a Textual app writes when it quits cleanly (each turns a mode on at start, with h)
RESETS = ("\x1b[?1049l", "\x1b[?1000l", "\x1b[?2004l", "\x1b[?25h")


@pytest.fixture
def tiny(tmp_path):
    from localmoe.testing.synthetic import write_gguf

    return str(write_gguf(tmp_path / "tinymodel.gguf", "tiny-llama"))


def _default_signals() -> None:
    """In the child: SIGTERM and SIGHUP at their defaults (a test run under ``nohup`` ignores
    SIGHUP, and the chat leaves an ignored signal ignored)."""
    for name in ("SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)


def _chat_then_signal(tiny, tmp_path, sig) -> tuple[int, str]:
    """Start ``localmoe chat`` on a pseudo-terminal, wait until its UI is up and the model
    loaded (the footer's keys drawn), send ``sig``; (exit status, everything it wrote)."""
    master, slave = pty.openpty()
    env = dict(os.environ, LOCALMOE_HOME=str(tmp_path / "home"), TERM="xterm-256color",
               COLUMNS="100", LINES="30")
    p = subprocess.Popen([sys.executable, "-m", "localmoe", "chat", "-m", tiny, "--backend",
                          "torch"], stdin=slave, stdout=slave, stderr=slave, env=env,
                         start_new_session=True, preexec_fn=_default_signals)
    os.close(slave)
    t, got = start_drain(master)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and p.poll() is None:
            text = b"".join(got).decode("utf-8", "replace")
            if "\x1b[?1049h" in text and "Settings" in text and "tinymodel" in text:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the chat UI did not come up: " + b"".join(got).decode("utf-8", "replace")[-2000:])
        time.sleep(1.0)          # the load finishes and the UI idles
        p.send_signal(sig)
        rc = p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    t.join(10)
    os.close(master)
    return rc, b"".join(got).decode("utf-8", "replace")


@pytest.mark.parametrize("name,line", [("SIGTERM", "terminated"), ("SIGHUP", "hangup")])
def test_a_signal_quits_the_chat_ui_and_restores_the_terminal(tiny, tmp_path, name, line):
    sig = getattr(signal, name, None)
    if sig is None:
        pytest.skip(f"no {name} here")
    rc, out = _chat_then_signal(tiny, tmp_path, sig)
    assert rc == 128 + sig, out[-2000:]
    tail = out[out.rfind("\x1b[?1049h"):]
    for seq in RESETS:
        assert seq in tail, (repr(seq), tail[-1000:])
    assert line in tail.split("\x1b[?1049l")[-1], tail[-500:]
    assert "Traceback" not in out


_STUCK = """
import asyncio, os, signal, threading, time
from tui.app import quit_on_signals

class App:                      # a UI whose event loop never gets to its exit
    def exit(self, return_code=0):
        raise AssertionError("the stuck loop ran the exit")

async def main():
    threading.Timer(0.5, os.kill, args=(os.getpid(), signal.SIGHUP)).start()
    while True:
        time.sleep(0.05)        # blocked, as on a full write queue to a dead terminal

with quit_on_signals(App()):
    asyncio.run(main())
"""


def test_a_quit_signal_ends_the_process_even_when_the_ui_loop_is_stuck():
    """A terminal that stopped reading and then closed left ``localmoe chat`` blocked on
    Textual's write queue for good (its input thread spinning): SIGHUP / SIGTERM now end the
    process after a grace period even when the UI never gets to quit."""
    start = time.monotonic()
    p = subprocess.run([sys.executable, "-c", _STUCK], preexec_fn=_default_signals,
                       capture_output=True, text=True, timeout=30,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert p.returncode == 128 + signal.SIGHUP, p.stderr
    assert time.monotonic() - start < 30
