"""How much could a better router give a moefied model? Perplexity under oracle routing.

A router (trained, distilled or otherwise) only chooses which ``top_k`` of a layer's
``n_experts`` run for a token. This script builds the main plan of
``benchmarks/moefy_quality.py`` (clustered split, trained router, down projections refitted),
then measures its perplexity on the same held-out text twice: routed by its trained routers,
and routed by an oracle that sees the dense model. For every token of every layer the oracle
evaluates all experts of the plan (as stored in the file: the refitted down weights) and picks,
greedily, the ``top_k`` whose mixture (weights ``1/top_k``, as the plans' near-uniform weights)
comes closest in L2 to the dense FFN's output on the same input. A router can do no better than
choosing well; if the oracle stays far from the dense perplexity, no router training or
distillation closes the gap, only changing the experts themselves (continued training) can.

Held-out text and calibration as ``benchmarks/moefy_quality.py`` (python-docstrings PSF-2.0
and the GPL-3.0 excerpt; calibration python-reference).

Usage: ``python benchmarks/moefy_oracle.py --source smollm2 --experts 16 --top-k 4
--out benchmarks/results/moefy_oracle_smollm2-16x4.json``
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

sys.path.insert(0, str(Path(__file__).resolve().parent))


class OracleMoE:
    """MoE hook: per token, the ``top_k`` experts (greedy forward selection) whose mean output
    is closest to the dense FFN's output ``dense_out(layer, x)``."""

    def __init__(self, model, dense_out):
        self.model = model
        self.dense_out = dense_out
        self.agree: list[float] = []       # share of the trained router's picks the oracle keeps

    def __call__(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        from localmoe.model.moe import moe_ffn
        from localmoe.model.routing import route

        m = self.model
        s, ops = m.spec, m.ops
        n, E, k = x.shape[0], s.n_experts, s.top_k
        xin = ops.moe_input(layer, x)
        one = torch.ones((n, 1), dtype=torch.float32)
        ys = torch.stack([moe_ffn(xin, one, torch.full((n, 1), e, dtype=torch.int64), m.experts,
                                  layer, ops.act, quant_h=ops.moe_hidden(layer)).float()
                          for e in range(E)], 1)                        # [N, E, D]
        target = self.dense_out(layer, x).float()                       # [N, D]
        acc = torch.zeros_like(target)
        chosen = torch.zeros((n, E), dtype=torch.bool)
        for _ in range(k):
            err = (target[:, None] - (acc[:, None] + ys) / k).pow(2).sum(-1)   # [N, E]
            err = err.masked_fill(chosen, float("inf"))
            pick = err.argmin(-1)
            chosen[torch.arange(n), pick] = True
            acc = acc + ys[torch.arange(n), pick]
        _, ids = route(x @ m.layers[layer]["router"], k, gating=s.gating,
                       norm_topk_prob=s.norm_topk_prob)
        self.agree.append(float(chosen.gather(1, ids.long()).float().mean()))
        return (acc / k).to(x.dtype)


def run(a) -> dict:
    from localmoe.io.loader import open_model
    from localmoe.testing.moefy import MoefyConfig, resolve_source
    from localmoe.testing.moefy.collect import dense_ffn, load_dense
    from localmoe.testing.moefy.evaluate import perplexity
    from localmoe.testing.moefy.experts import stored_experts
    from localmoe.testing.moefy.moe_model import moe_transformer
    from localmoe.testing.moefy.plan import MoePlan, build_plan, glu_hidden
    from moefy_quality import _heldout

    torch.set_num_threads(a.threads)
    mf = open_model(resolve_source(a.source))
    dense_model, tok = load_dense(mf)
    add_bos = bool(mf.metadata.get("tokenizer.ggml.add_bos_token", False))
    cfg = MoefyConfig(a.experts, a.top_k, calib_tokens=a.calib_tokens, seed=a.seed)
    held = _heldout(tok, add_bos, a.eval_tokens, cfg.seq_len)
    res = {"source": mf.name, "experts": a.experts, "top_k": a.top_k,
           "calib_tokens": a.calib_tokens, "plan": str(cfg),
           "machine": platform.node(), "cpu_count": os.cpu_count(), "threads": a.threads,
           "command": "python benchmarks/moefy_oracle.py " + " ".join(sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "eval_tokens": {k: sum(len(c) - 1 for c in v) for k, v in held.items()},
           "ppl": {"dense": {k: perplexity(dense_model, v)[0] for k, v in held.items()}}}
    print("dense", res["ppl"]["dense"], file=sys.stderr, flush=True)
    ffns = {l: dense_ffn(dense_model, l) for l in range(dense_model.spec.n_layers)}

    def dense_out(layer, x):
        f = ffns[layer]
        return glu_hidden(dense_model, f, x.float()) @ f.down.t()

    t = time.perf_counter()
    plan = MoePlan.load(a.plan) if a.plan else build_plan(mf, cfg, dense=(dense_model, tok))
    res["plan_s"] = round(time.perf_counter() - t, 1)
    stored = {l: stored_experts(mf, l, lp) for l, lp in enumerate(plan.layers)}
    moe = moe_transformer(mf, plan, stored)
    res["ppl"]["trained router"] = {k: perplexity(moe, v)[0] for k, v in held.items()}
    print("trained router", res["ppl"]["trained router"], file=sys.stderr, flush=True)
    trained = moe.moe
    oracle = OracleMoE(moe, dense_out)
    moe.moe = oracle
    res["ppl"]["oracle routing"] = {k: perplexity(moe, v)[0] for k, v in held.items()}
    moe.moe = trained
    res["router_picks_kept_by_oracle"] = round(sum(oracle.agree) / max(len(oracle.agree), 1), 3)
    print("oracle routing", res["ppl"]["oracle routing"], file=sys.stderr, flush=True)
    d = res["ppl"]["dense"]
    res["ratio_to_dense"] = {key: {h: round(v[h] / d[h], 2) for h in v}
                             for key, v in res["ppl"].items() if key != "dense"}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", default="smollm2")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--eval-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plan", default=None, help="a saved plan (.npz) of the same config")
    ap.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1))
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if not 1 <= a.top_k <= a.experts:
        ap.error(f"--top-k must be in [1, {a.experts}]")
    res = run(a)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({"ratio_to_dense": res["ratio_to_dense"],
                      "router_picks_kept_by_oracle": res["router_picks_kept_by_oracle"]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
