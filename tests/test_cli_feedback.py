"""What a user sees around an answer: a spinner on a terminal while the model loads (nothing
off a terminal), and an exit without the interpreter's slow teardown once the command is done."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.ptyio import start_drain

pty = pytest.importorskip("pty")


def _run_on_a_terminal_stderr(cmd: list[str], env: dict) -> tuple[int, str, str]:
    """Run ``cmd`` with stderr on a pseudo-terminal (stdout a pipe); (status, stdout, what the
    terminal received)."""
    master, slave = pty.openpty()
    t, got = start_drain(master)  # keep the terminal's buffer empty, or the child blocks
    try:
        p = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave,
                           env=env, timeout=300)
    finally:
        os.close(slave)
    t.join(10)
    os.close(master)
    return p.returncode, p.stdout.decode(), b"".join(got).decode("utf-8", "replace")


@pytest.fixture
def tiny(tmp_path):
    from localmoe.testing.synthetic import write_gguf

    return str(write_gguf(tmp_path / "tinymodel.gguf", "tiny-llama"))


def _env(tmp_path) -> dict:
    return dict(os.environ, LOCALMOE_HOME=str(tmp_path / "home"), COLUMNS="100")


def test_a_spinner_runs_on_a_terminal_while_the_model_loads(tiny, tmp_path):
    rc, out, term = _run_on_a_terminal_stderr(
        [sys.executable, "-m", "localmoe", "generate", "-m", tiny, "--backend", "torch",
         "-n", "3", "--raw", "hello"], _env(tmp_path))
    assert rc == 0, term
    assert out.strip(), out  # the answer went to stdout, not through the spinner
    assert "loading tinymodel" in term, term
    assert "\x1b[?25h" in term and term.rstrip().endswith("\x1b[2K"), term  # gone, cursor back


def test_no_spinner_off_a_terminal(tiny, tmp_path):
    p = subprocess.run([sys.executable, "-m", "localmoe", "generate", "-m", tiny, "--backend",
                        "torch", "-n", "3", "--raw", "hello"], capture_output=True, text=True,
                       env=_env(tmp_path), timeout=300)
    assert p.returncode == 0, p.stderr
    assert "loading" not in p.stderr and "\x1b" not in p.stderr, p.stderr


_EXIT_SCRIPT = r"""
import atexit, sys
if sys.argv[1] == "heavy":
    import torch  # noqa: F401  -- as after any command that loaded a model
class Late:
    def __del__(self):
        print("torn down", flush=True)
keep = Late()
atexit.register(lambda: print("atexit ran", flush=True))
from localmoe.cli import main
main(sys.argv[2:])
"""


@pytest.mark.parametrize("heavy", [True, False])
def test_the_cli_exits_without_the_interpreter_teardown_after_torch(tmp_path, heavy):
    """With torch imported the interpreter's teardown takes about half a second (more on a
    busy machine) after the answer is out: the CLI ends with os._exit once atexit handlers
    have run and the output is flushed, keeping the exit status. Without a heavy module it
    exits normally."""
    env = _env(tmp_path)
    for args, status in ((["models"], 0), (["rm", "no-such-model"], 1)):
        p = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, "heavy" if heavy else "light",
                            *args], capture_output=True, text=True, env=env, timeout=120)
        assert p.returncode == status, p.stderr
        assert "atexit ran" in p.stdout, p.stdout
        assert ("torn down" in p.stdout) is not heavy, p.stdout
        if status == 0:
            assert "store:" in p.stdout  # the command's own output was flushed first
        else:
            assert "error:" in p.stderr
