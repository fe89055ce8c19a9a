"""Where a moefied model loses its quality: perplexity of a preset with some layers' FFNs put back
to the dense source's (the rest stay MoE), on held-out text.

The preset's plan is loaded from the store (``<store>/moefy/<preset>.plan.npz``, built by
``python -m localmoe.testing.moefy --preset``); the MoE is the in-memory reference of that plan
(:func:`localmoe.testing.moefy.moe_model.moe_transformer`); a "dense" layer runs the source's own
FFN through the same block. Held-out text: Python standard-library docstrings (PSF-2.0) and
tests/data/gpl3_excerpt.txt (GPL-3.0 text), as benchmarks/moefy_quality.py.

Usage: ``python benchmarks/moefy_hybrid.py --preset smollm2-moe-16x4 --dense 0 1 0-2 0-14 15-29
[--out FILE]`` (each argument one experiment: a layer or an inclusive range).
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


def _layers(spec: str) -> set[int]:
    a, _, b = spec.partition("-")
    return set(range(int(a), int(b or a) + 1))


def main(argv=None) -> int:
    from localmoe.io.loader import open_model
    from localmoe.testing.moefy import preset_path
    from localmoe.testing.moefy.collect import load_dense, token_chunks
    from localmoe.testing.moefy.evaluate import perplexity
    from localmoe.testing.moefy.experts import stored_experts
    from localmoe.testing.moefy.moe_model import moe_transformer
    from localmoe.testing.moefy.plan import MoePlan
    from localmoe.testing.moefy.texts import corpus

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", required=True)
    ap.add_argument("--dense", nargs="+", default=["0"], help="layers (N or A-B) made dense, per run")
    ap.add_argument("--eval-tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    plan = MoePlan.load(preset_path(a.preset).with_suffix(".plan.npz"))
    mf = open_model(plan.source)
    dense, tok = load_dense(mf)
    add_bos = bool(mf.metadata.get("tokenizer.ggml.add_bos_token", False))
    held = {"docstrings": token_chunks(tok, corpus("python-docstrings", heldout=True),
                                       a.eval_tokens, plan.cfg.seq_len, add_bos),
            "gpl3": token_chunks(tok, (ROOT / "tests" / "data" / "gpl3_excerpt.txt").read_text(),
                                 a.eval_tokens, plan.cfg.seq_len, add_bos)}
    stored = {l: stored_experts(mf, l, lp) for l, lp in enumerate(plan.layers)}
    moe = moe_transformer(mf, plan, stored, dense=load_dense(mf)[0])
    inner = moe.moe
    ppl = lambda m: {h: round(perplexity(m, c)[0], 3) for h, c in held.items()}  # noqa: E731
    res = {"preset": a.preset, "dense": ppl(dense), "moe": ppl(moe), "hybrid": {},
           "machine": platform.node(), "cpu_count": os.cpu_count(), "threads": a.threads,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "command": "python benchmarks/moefy_hybrid.py " + " ".join(argv or sys.argv[1:])}
    print(f"dense {res['dense']}  moe {res['moe']}", file=sys.stderr, flush=True)
    for spec in a.dense:
        keep = _layers(spec)
        moe.moe = lambda layer, x, keep=keep: (dense._glu(layer, x, "gate_up", "down")
                                                if layer in keep else inner(layer, x))
        res["hybrid"][spec] = ppl(moe)
        print(f"dense layers {spec}: {res['hybrid'][spec]}", file=sys.stderr, flush=True)
    moe.moe = inner
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
