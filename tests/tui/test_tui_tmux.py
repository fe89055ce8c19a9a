"""Runs tests/tui/tui_tmux.sh: the chat TUI in a real terminal under tmux (skipped without tmux).

The script starts the app, types a question, waits for the streamed answer, captures the
screen, quits with Ctrl+Q and checks the saved chat. The fake-engine run is quick; the run on
the real SmolLM2 model is marked slow.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "tui_tmux.sh"

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


def _run(tmp_path: Path, *args: str, timeout: float) -> str:
    out = tmp_path / "screen.txt"
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(SCRIPT), *args, str(out)], env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"tui_tmux.sh failed ({proc.returncode}):\n{proc.stderr}"
    return out.read_text()


def test_tui_in_tmux_fake_engine(tmp_path):
    screen = _run(tmp_path, timeout=180)
    assert "You" in screen and "What is 2+3? Answer briefly." in screen
    assert "def add(a, b):" in screen and "return a + b" in screen  # highlighted fence text
    assert "fake · cpu" in screen and "TTFT 12 ms" in screen          # stats bar
    assert "Esc" in screen or "esc" in screen                         # footer bindings


@pytest.mark.slow
def test_tui_in_tmux_real_smollm2(tmp_path, smollm2_path):
    screen = _run(tmp_path, "--real", str(smollm2_path), timeout=600)
    assert "What is 2+3? Answer briefly." in screen
    assert "Assistant" in screen and "tokens" in screen
    assert "ctx " in screen and "/192" in screen
