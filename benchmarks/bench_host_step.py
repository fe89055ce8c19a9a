"""Host time of the decode step's input staging, the part of the triton runner's per-token
work outside the CUDA graph that grows with the context: ``prepare_batch`` (checks and KV
reservation) and ``DecodeGraphs._fill`` (token, position, slot, length and the block-table
row written into the pinned buffer, then one copy). Runs on any machine: the tiny synthetic
qwen3moe model on the CPU (the staging code is the same as on a GPU; nothing is launched).

``--wrappers``: also the host time of the fused decode step's Python (the kernel wrappers:
launch choices, buffers, arguments) with every Triton launch replaced by a no-op, on a
2-layer Qwen3-30B-A3B-shaped model: what an eager step (``--no-cuda-graph``) spends per layer
before Triton's own launcher.

Usage: ``python benchmarks/bench_host_step.py --depths 0 16384 [--wrappers] [--out FILE]``
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


def measure_wrappers(reps: int) -> dict:
    """Microseconds per decode step (and per layer) of ``FusedDecode.step``'s host code with
    the Triton launches made no-ops (``JITFunction``/``InterpretedFunction.__getitem__``)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from localmoe.backends.reference import prepare_batch
    from localmoe.backends.triton.runner import TritonRunner
    from localmoe.io.loader import open_model
    from localmoe.testing.synthetic import write_gguf

    saved = JITFunction.__getitem__, InterpretedFunction.__getitem__
    with tempfile.TemporaryDirectory() as d:
        path = write_gguf(Path(d) / "m.gguf", "qwen3-30b-a3b", seed=0, n_layers=2)
        r = TritonRunner(open_model(str(path)), n_ctx=1024, device="cpu")
        s = r.new_sequence()
        g = r.graphs
        gg = g._new(1, g.bucket(1))
        batch = [(s, [5])]
        prepare_batch(r.model, r.cache, r.n_ctx, batch)
        g._fill(gg, batch)
        noop = lambda self, grid: (lambda *a, **k: None)  # noqa: E731
        JITFunction.__getitem__ = InterpretedFunction.__getitem__ = noop
        try:
            for _ in range(5):
                g._step(gg)
            t = time.perf_counter()
            for _ in range(reps):
                g._step(gg)
            dt = (time.perf_counter() - t) / reps
        finally:
            JITFunction.__getitem__, InterpretedFunction.__getitem__ = saved
        n = r.spec.n_layers
        r.close()
    row = {"model": "qwen3-30b-a3b shapes, 2 layers", "step_us": round(dt * 1e6, 1),
           "per_layer_us": round(dt * 1e6 / n, 1)}
    print(json.dumps(row), flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[0, 16384])
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--wrappers", action="store_true",
                    help="also time the fused step's Python with no-op launches")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rows = measure(a.depths, a.reps)
    wrappers = measure_wrappers(max(10, a.reps // 50)) if a.wrappers else None
    if a.out:
        Path(a.out).write_text(json.dumps({
            "machine": f"{platform.node()} ({os.cpu_count()} CPUs)",
            "date": time.strftime("%Y-%m-%d"),
            "command": "python benchmarks/bench_host_step.py " + " ".join(sys.argv[1:]),
            "rows": rows, **({"wrappers": wrappers} if wrappers else {})}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
