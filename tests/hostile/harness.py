"""Run one hostile input in a child process under a memory cap and a timeout, and judge the
outcome: loaded, or refused with one ``error:`` line; never a signal, a hang or a traceback."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

#: address-space cap of a child (torch and llama.cpp map ~2 GB of libraries and thread stacks)
MEM_CAP = int(os.environ.get("LOCALMOE_HOSTILE_MEM", 6 * 2**30))
TIMEOUT = float(os.environ.get("LOCALMOE_HOSTILE_TIMEOUT", 120))
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Outcome:
    """What a child did: exit status (negative: killed by that signal; None: timed out),
    its output and how long it ran (s)."""

    rc: int | None
    out: str
    err: str
    seconds: float

    def problems(self, expect: str) -> list[str]:
        """Why this outcome breaks the rules for an input expected to ``"load"`` or be
        refused (``"reject"``); empty when it is fine."""
        p = []
        if self.rc is None:
            p.append(f"hung (no exit within {TIMEOUT:.0f} s)")
        elif self.rc < 0:
            p.append(f"killed by signal {-self.rc}")
        if "Traceback" in self.err or "Traceback" in self.out:
            p.append("printed a traceback")
        lines = [ln for ln in self.err.splitlines() if ln.strip()]
        if expect == "load" and self.rc not in (0, None) and self.rc >= 0:
            p.append(f"refused a valid input: {lines[-1] if lines else self.rc}")
        if expect == "reject":
            if self.rc == 0:
                p.append("accepted an input it must refuse")
            elif self.rc is not None and self.rc > 0:
                errs = [ln for ln in lines if ln.startswith("error:")]
                if len(errs) != 1 or len(lines) != 1:
                    p.append(f"not one clear error line: {lines[-5:]}")
        return p


def _cap() -> None:  # runs in the child before exec
    resource.setrlimit(resource.RLIMIT_AS, (MEM_CAP, MEM_CAP))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_capped(args: list[str], stdin: bytes | None = None, timeout: float = TIMEOUT,
               env: dict | None = None) -> Outcome:
    """Run ``python -m localmoe ARGS`` (or ``args`` itself when it starts with an executable
    path) under :data:`MEM_CAP` and ``timeout``."""
    cmd = args if os.path.sep in args[0] else [sys.executable, "-m", "localmoe", *args]
    e = dict(os.environ, PYTHONPATH=str(ROOT), LOCALMOE_THREADS="1", GGML_NO_BACKTRACE="1")
    e.pop("LOCALMOE_DEBUG", None)
    if env:
        e.update(env)
    t0 = time.monotonic()
    try:
        r = subprocess.run(cmd, input=stdin if stdin is not None else b"", capture_output=True,
                           timeout=timeout, preexec_fn=_cap, env=e, cwd=str(ROOT))
        rc = r.returncode
        out, err = r.stdout, r.stderr
    except subprocess.TimeoutExpired as te:
        rc, out, err = None, te.stdout or b"", te.stderr or b""
    return Outcome(rc, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"),
                   time.monotonic() - t0)
