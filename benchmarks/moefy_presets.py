"""Build the moefy presets into the store's ``moefy/`` folder (timed) and measure how llama.cpp
agrees with the project's reference on them, next to the same measure on the dense source.

For each preset: wall time of the build (calibration walk, per-layer fits, GGUF write) at
``--threads``; then on two held-out texts (tests/data/gpl3_excerpt.txt, the first 320 tokens as
docs/PARITY_LLAMACPP.md uses; Python standard-library docstrings, 256 tokens):

* ours vs llama.cpp on the MoE file (ours = the in-memory reference of the same plan,
  :func:`localmoe.testing.moefy.moe_model.moe_transformer`, exact float numerics);
* ours vs llama.cpp on the dense source (the band docs/PARITY_LLAMACPP.md explains);
* llama.cpp with flash attention vs without, on the MoE file (llama.cpp's own sensitivity).

Usage: ``python benchmarks/moefy_presets.py [--preset NAME ...] [--threads 2]
[--out benchmarks/results/moefy_presets.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _texts(tok):
    from localmoe.testing.moefy.texts import corpus

    gpl = (ROOT / "tests" / "data" / "gpl3_excerpt.txt").read_text()
    return {"gpl3": tok.encode(gpl, add_special=True)[:320],
            "docstrings": tok.encode(corpus("python-docstrings", heldout=True)[:4000],
                                     add_special=True)[:256]}


def _flash(path, ids):
    import numpy as np

    from localmoe.backends.llamacpp_backend import raw_llama

    m = raw_llama(model_path=str(path), n_ctx=len(ids) + 8, logits_all=True, verbose=False,
                  n_threads=1, flash_attn=True)
    try:
        m.eval(list(ids))
        return np.array(m.scores[:len(ids)], dtype=np.float32)
    finally:
        m.close()


def parity(path, plan) -> dict:
    from localmoe.io.loader import open_model
    from localmoe.testing.moefy.collect import load_dense
    from localmoe.testing.moefy.evaluate import llamacpp_logits, logit_agreement
    from localmoe.testing.moefy.experts import stored_experts
    from localmoe.testing.moefy.moe_model import moe_transformer

    mf = open_model(plan.source)
    dense, tok = load_dense(mf)
    stored = {l: stored_experts(mf, l, lp) for l, lp in enumerate(plan.layers)}
    moe = moe_transformer(mf, plan, stored, dense=load_dense(mf)[0])
    out = {}
    for name, ids in _texts(tok).items():
        t = torch.tensor(ids)
        with torch.no_grad():
            ours_moe, ours_dense = moe.forward_full(t), dense.forward_full(t)
        lc_moe = llamacpp_logits(path, ids)
        out[name] = {"moe": logit_agreement(ours_moe, lc_moe),
                     "dense": logit_agreement(ours_dense, llamacpp_logits(plan.source, ids)),
                     "llamacpp_flash_vs_plain_moe": logit_agreement(_flash(path, ids), lc_moe)}
    return out


def main(argv=None) -> int:
    from localmoe.testing.moefy import PRESETS, build_preset
    from localmoe.testing.moefy.plan import MoePlan

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", action="append", choices=sorted(PRESETS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reuse", action="store_true", help="keep cached presets (time nothing)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "moefy_presets.json"))
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    results = {}
    for preset in a.preset or list(PRESETS):
        t0, c0, load0 = time.perf_counter(), time.process_time(), os.getloadavg()[0]
        path = build_preset(preset, force=not a.reuse,
                            progress=lambda m: print(m, file=sys.stderr, flush=True))
        secs = round(time.perf_counter() - t0, 1)
        # the machine is shared: CPU seconds of this process (all threads) and the load average
        # around the build say how much of the wall time was waiting for a core
        cpu = {"build_cpu_s": round(time.process_time() - c0, 1),
               "loadavg_1min_before_after": [round(load0, 2), round(os.getloadavg()[0], 2)]}
        plan = MoePlan.load(path.with_suffix(".plan.npz"))
        results[preset] = {"path": str(path), "build_s": secs, **cpu, "threads": a.threads,
                           "bytes": path.stat().st_size, "plan_stats": plan.stats,
                           "calib_rel_err": [round(l.info["calib_rel_err"], 4) for l in plan.layers],
                           "router_recall": [round(l.info["router_recall"], 4) for l in plan.layers],
                           "parity": parity(path, plan)}
        print(json.dumps({preset: results[preset]}, indent=1))
    results["_run"] = {"machine": platform.node(), "cpu_count": os.cpu_count(),
                       "threads": a.threads, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "command": "python benchmarks/moefy_presets.py " + " ".join(argv or sys.argv[1:])}
    Path(a.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
