"""What a user waits through on the default path: ``localmoe generate -n 8 hi`` with stderr on a
pseudo-terminal (as in a shell) and stdout a pipe.

Per run, seconds from the start of the process to

* ``first_feedback``: the first byte the user sees (the load spinner on the terminal, else
  the answer),
* ``first_token`` / ``last_token``: the first and last byte of the answer on stdout,
* ``exit``: the process is gone,

and ``after_last_token`` = exit - last_token. Also ``ctrl_c_to_exit``: seconds from SIGINT
(0.3 s after the first token of a long answer) until the process is gone. Medians over
``--repeat`` runs (the machine is shared and noisy); the model must be in the store
(``localmoe pull smollm2``).

Usage::

    python benchmarks/bench_cli_feedback.py [--model smollm2] [--repeat 7]
                                            [--out benchmarks/results/cli_feedback_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import pty
import selectors
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path


def one_run(cmd: list[str]) -> dict:
    master, slave = pty.openpty()
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    sel = selectors.DefaultSelector()
    sel.register(master, selectors.EVENT_READ, "term")
    sel.register(p.stdout, selectors.EVENT_READ, "out")
    t: dict[str, float] = {}
    open_ = 2
    while open_:
        for key, _ in sel.select(timeout=60):
            try:
                b = os.read(key.fd, 65536)
            except OSError:
                b = b""
            now = time.monotonic() - t0
            if not b:
                sel.unregister(key.fd)
                open_ -= 1
                continue
            if key.data == "term":
                t.setdefault("first_feedback", now)
            elif b.strip():
                t.setdefault("first_token", now)
                t["last_token"] = now
    p.wait()
    t["exit"] = time.monotonic() - t0
    os.close(master)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited with {p.returncode}")
    t["first_feedback"] = min(t.get("first_feedback", t["first_token"]), t["first_token"])
    t["after_last_token"] = t["exit"] - t["last_token"]
    return t


def interrupt_run(cmd: list[str]) -> float:
    """Seconds from Ctrl-C (SIGINT, 0.3 s into the answer) to the end of the process."""
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL)
    os.read(p.stdout.fileno(), 64)  # the first token
    time.sleep(0.3)
    t = time.monotonic()
    p.send_signal(signal.SIGINT)
    p.wait()
    if p.returncode != 130:
        raise SystemExit(f"{' '.join(cmd)}: exit status {p.returncode} after Ctrl-C, not 130")
    return time.monotonic() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--out", default=None)
    ap.add_argument("--baseline", default=None, metavar="SCRIPT",
                    help="also time SCRIPT (a Python file that runs another checkout's CLI, "
                         "e.g. the commit before a change), interleaved run by run")
    a = ap.parse_args(argv)
    args = ["generate", "-m", a.model, "-n", "8", "--seed", "1", "hi"]
    entries = {"current": [sys.executable, "-m", "localmoe"]}
    if a.baseline:
        entries["baseline"] = [sys.executable, a.baseline]
    runs: dict[str, list[dict]] = {k: [] for k in entries}
    long_args = ["generate", "-m", a.model, "-n", "400", "Tell me a long story about a dragon"]
    for _ in range(a.repeat):
        for k, e in entries.items():
            runs[k].append(one_run(e + args))
            runs[k][-1]["ctrl_c_to_exit"] = interrupt_run(e + long_args)
    keys = ("first_feedback", "first_token", "last_token", "exit", "after_last_token",
            "ctrl_c_to_exit")
    res = {"machine": platform.node(), "cpu": platform.processor() or platform.machine(),
           "cpu_count": os.cpu_count(), "load_avg": os.getloadavg(),
           "command": " ".join(["localmoe"] + args), "repeat": a.repeat,
           "baseline_script": a.baseline}
    for k, rs in runs.items():
        res[k] = {"median_s": {x: round(statistics.median(r[x] for r in rs), 3) for x in keys},
                  "runs": [{x: round(r[x], 3) for x in keys} for r in rs]}
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
