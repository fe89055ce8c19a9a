"""Host time of the decode step's input staging, the part of the triton runner's per-token
work outside the CUDA graph that grows with the context: ``prepare_batch`` (checks and KV
reservation) and ``DecodeGraphs._fill`` (token, position, slot, length and the block-table
row written into the pinned buffer, then one copy). Runs on any machine: the tiny synthetic
qwen3moe model on the CPU (the staging code is the same as on a GPU; nothing is launched).

Usage: ``python benchmarks/bench_host_step.py --depths 0 16384 [--out FILE]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch


def measure(depths: list[int], reps: int) -> list[dict]:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from localmoe.backends.reference import prepare_batch
    from localmoe.backends.triton.runner import TritonRunner
    from localmoe.io.loader import open_model
    from localmoe.testing.synthetic import write_gguf

    with tempfile.TemporaryDirectory() as d:
        path = write_gguf(Path(d) / "m.gguf", "tiny-qwen3moe", seed=1)
        r = TritonRunner(open_model(str(path)), n_ctx=max(depths) + 2 * reps + 64,
                         device="cpu", dtype=torch.float32)
    g, c = r.graphs, r.cache
    if g is None:
        raise SystemExit(f"no static-buffer decode step here: {r.stats().get('cuda_graphs')}")
    rows = []
    for depth in depths:
        s = r.new_sequence()
        if depth:
            c.reserve(s, depth)
            c.commit(s, depth)
        gg = g._new(1, g.bucket(depth + 1))
        fill = prep = 0.0
        for i in range(reps):       # each step appends a token: block boundaries included
            batch = [(s, [5])]
            t = time.perf_counter()
            prepare_batch(r.model, c, r.n_ctx, batch)
            t1 = time.perf_counter()
            g._fill(gg, batch)
            t2 = time.perf_counter()
            c.commit(s, 1)
            if i >= reps // 10:     # the first tenth warms up
                prep += t1 - t
                fill += t2 - t1
        n = reps - reps // 10
        rows.append({"ctx": depth, "prepare_batch_us": round(prep / n * 1e6, 1),
                     "fill_us": round(fill / n * 1e6, 1)})
        print(json.dumps(rows[-1]), flush=True)
        r.free_sequence(s)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[0, 16384])
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rows = measure(a.depths, a.reps)
    if a.out:
        Path(a.out).write_text(json.dumps({
            "machine": f"{platform.node()} ({os.cpu_count()} CPUs)",
            "date": time.strftime("%Y-%m-%d"),
            "command": "python benchmarks/bench_host_step.py " + " ".join(sys.argv[1:]),
            "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
