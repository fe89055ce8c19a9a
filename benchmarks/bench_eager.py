"""Eager decode TPOT of the triton runner (CUDA graphs off): steps launched from Python against
steps replayed from the launch tape (backends/triton/tape.py), batch 1, one process per mode.

For each mode: ``tpot_ms`` (median wall time of a step, forward(on_device=True) then
synchronize), ``host_ms`` (median time until forward returned: the host's share), and the
runner's ``launch_tape`` stats. ``--profile`` adds cProfile's top functions over 10 steps.

Usage: ``python benchmarks/bench_eager.py MODEL.gguf [--steps 40] [--kv f16] [--out FILE]``
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import subprocess
import sys
import time


def one(path: str, steps: int, kv: str, profile: bool) -> dict:
    import torch

    from localmoe.backends.triton.runner import TritonRunner
    from localmoe.io.loader import open_model

    r = TritonRunner(open_model(path), n_ctx=2048, kv_spec=kv, device="cuda", cuda_graphs=False)
    s = r.new_sequence()
    r.forward([(s, [5])])
    torch.cuda.synchronize()
    wall, host = [], []
    for i in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        r.forward([(s, [11 + i])], on_device=True)
        h = time.perf_counter()
        torch.cuda.synchronize()
        wall.append(time.perf_counter() - t)
        host.append(h - t)
    skip = max(2, steps // 8)       # the first steps warm up and record
    med = lambda xs: sorted(xs[skip:])[len(xs[skip:]) // 2] * 1e3  # noqa: E731
    row = {"tpot_ms": round(med(wall), 3), "host_ms": round(med(host), 3),
           "launch_tape": r.stats().get("launch_tape")}
    g = r.graphs
    tape = next((gg.tape for gg in g.graphs.values() if gg.tape is not None), None) if g else None
    if tape is not None:
        row["tape_triton_launches"] = tape.n_triton
        row["tape_torch_ops"] = tape.n_torch
    if profile:
        pr = cProfile.Profile()
        pr.enable()
        for i in range(10):
            r.forward([(s, [60 + i])], on_device=True)
        torch.cuda.synchronize()
        pr.disable()
        st = io.StringIO()
        pstats.Stats(pr, stream=st).sort_stats("tottime").print_stats(25)
        row["profile_tottime"] = st.getvalue().splitlines()[:45]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kv", default="f16")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--one", choices=["0", "1"], help=argparse.SUPPRESS)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if a.one is not None:            # child: one mode, one process
        print(json.dumps(one(a.model, a.steps, a.kv, a.profile)))
        return 0
    rows = {}
    for mode, tape in (("python", "0"), ("tape", "1")):
        env = dict(os.environ, LOCALMOE_LAUNCH_TAPE=tape)
        cmd = [sys.executable, __file__, a.model, "--steps", str(a.steps), "--kv", a.kv,
               "--one", tape] + (["--profile"] if a.profile else [])
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if p.returncode:
            rows[mode] = {"error": p.stderr[-2000:]}
        else:
            rows[mode] = json.loads(p.stdout.strip().splitlines()[-1])
        print(mode, {k: v for k, v in rows[mode].items() if k != "profile_tottime"}, flush=True)
    import torch
    import triton

    out = {"machine": platform.node(), "gpu": torch.cuda.get_device_name(0),
           "torch": torch.__version__, "triton": triton.__version__,
           "date": time.strftime("%Y-%m-%d"), "model": os.path.basename(a.model), "kv": a.kv,
           "command": "python benchmarks/bench_eager.py " + " ".join(argv or sys.argv[1:]),
           "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
