"""The triton backend's availability check: without a CUDA device it says so without importing
triton (0.2 s or more of every command's start-up on a CPU machine)."""

from __future__ import annotations

import subprocess
import sys

_SCRIPT = r"""
import sys
import torch
from localmoe.backends.registry import get_backend
why = get_backend("triton").available()
print(repr(why), "triton" in sys.modules, torch.cuda.is_available(), sep="|")
"""


def test_no_cuda_is_told_without_importing_triton():
    r = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    why, imported, cuda = r.stdout.strip().split("|")
    if cuda == "True":
        assert why == "None"
        return
    assert why in ("'no CUDA device'", "'triton not installed'") and imported == "False", r.stdout
