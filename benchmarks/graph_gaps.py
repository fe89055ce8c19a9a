"""Is the slower launch gap of a process's later CUDA graphs a property of each graph or of the
process? (GPU only; session 30's question, docs/GPU-FAST-PATH.md.)

Sessions 29-31 traced the fused MoE's two launches (``trace_moe.py``): the first graph timed in a
process had ~0.6 us between one launch's last exit and the next launch's first entry, every
later graph ~0.95 us, the same launch choice again included; 5 s idle, ``gc`` +
``empty_cache`` and allocations in between changed nothing, and the clocks stayed at
1980/2619 MHz. The decode graph's slow state after a prompt history (session 25) costs about
as much per launch. This tool keeps graphs alive and times them in the order of ``--steps``:

- ``capN``: capture graph N (the Qwen3-30B-A3B-shaped fused MoE at one token from router
  logits, as ``trace_moe.py`` launches it: 16 calls over disjoint experts) after two eager
  rounds on a side stream;
- ``tN``: replay graph N (median microseconds per call over 25 replays);
- ``delN``: drop graph N; ``eager``: two eager rounds; ``sleep``: 5 s idle.

Usage (on the GPU machine)::

    python benchmarks/graph_gaps.py --steps capA,tA,capB,tB,tA,delB,tA,capC,tC,tA --out gaps.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time

import torch


def _calls(model: str = "qwen3-30b-a3b"):
    import bench_quant_kernels as B
    from localmoe.kernels.fused_moe import fused_moe
    from localmoe.kernels.quant_gemv import quantize_act

    m = B.MODELS[model]
    gu, wd = B.moe_weights(m, "cuda")[:2]
    gen = torch.Generator().manual_seed(0)
    rts = B.moe_routings(m, 1, gu, wd, "cuda", gen)
    x = quantize_act(torch.randn(1, m["d"], generator=gen).to("cuda", torch.bfloat16))
    rls = [B._routing_of(i, m["e"]) for i, _ in rts]
    return [lambda r=r: fused_moe(x, gu, wd, None, None, route=r) for r in rls]


def run(steps: list[str], calls) -> list[dict]:
    """The rows of ``steps`` (see the module's docstring); raises ValueError on an unknown
    step or a graph used before its capture."""
    import bench_quant_kernels as B

    graphs: dict[str, torch.cuda.CUDAGraph] = {}
    rows = []
    for st in steps:
        t0 = time.perf_counter()
        row: dict = {"step": st}
        if st.startswith("cap"):
            graphs[st[3:]] = B.capture_calls(calls)
        elif st.startswith("del"):
            graphs.pop(st[3:])
            torch.cuda.synchronize()
        elif st == "eager":
            B.warm_calls(calls)
        elif st == "sleep":
            time.sleep(5.0)
        elif st.startswith("t") and st[1:] in graphs:
            row["us_per_call"] = round(B.time_graph(graphs[st[1:]], len(calls)), 3)
        else:
            raise ValueError(f"graph_gaps: unknown step or graph not captured: {st!r}")
        row["host_s"] = round(time.perf_counter() - t0, 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", default="capA,tA,capB,tB,tA,delB,tA,capC,tC,tA")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("graph_gaps: needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = run(a.steps.split(","), _calls())
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"machine": platform.node(), "gpu": torch.cuda.get_device_name(0),
                       "date": datetime.date.today().isoformat(),
                       "command": "python benchmarks/graph_gaps.py --steps " + a.steps,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
    raise SystemExit(main())
