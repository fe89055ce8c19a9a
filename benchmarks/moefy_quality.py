"""Quality of moefied models against their dense source: perplexity on held-out text at several
top-k, random vs clustered split, trained vs untrained router, with and without the down refit;
greedy answers to a few prompts.

Calibration: ``python-reference`` (Python Language Reference, PSF-2.0; 8192 tokens by default).
Held-out: ``python-docstrings`` (standard-library docstrings, PSF-2.0) and
tests/data/gpl3_excerpt.txt (GPL-3.0 text), never seen in calibration. All variants of one run
share the calibration activations, so they differ only in what the row says.

Every perplexity is measured on the in-memory reference of the plan
(:func:`localmoe.testing.moefy.moe_model.moe_transformer`: the experts as stored in the GGUF,
dequantized), which is what the written file computes (llama.cpp agreement: docs/MOEFY.md).

Shared expert: ``--shared-frac 0.125 0.25`` also builds the main variant with an always-on
shared expert of that fraction of each FFN (written as qwen2moe); ``active_frac`` in the result
is the fraction of FFN neurons each token computes (shared + top-k routed), next to which
``--sweep`` gives shared-less plans fitted for a larger k.

Several top-k: ``--eval-top-k 2 8`` routes the main plan (fitted for ``--top-k``) with other k
(no refit; mixing weights scaled by k'/k, as the plans' weights are near uniform); ``--sweep 2 8``
fits a plan for each k. ``--plan <store>/moefy/<preset>.plan.npz``
reuses a preset's saved plan for the main variant instead of building it again.

Usage: ``python benchmarks/moefy_quality.py --source smollm2 --experts 16 --top-k 4
--out benchmarks/results/moefy_quality_smollm2-16x4.json``; ``--table FILE...`` prints the
markdown of docs/MOEFY.md from saved results.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
GPL = ROOT / "tests" / "data" / "gpl3_excerpt.txt"
MAIN = "cluster+trained+refit"
VARIANTS = {  # name -> MoefyConfig overrides
    MAIN: {},
    "cluster+trained (scales only)": {"refit_down": False},
    "cluster+centroid+refit": {"router": "centroid"},
    "random+trained+refit": {"split": "random"},
    "random+centroid (scales only)": {"split": "random", "router": "centroid", "refit_down": False},
}


def _say(m):
    print(m, file=sys.stderr, flush=True)


def _heldout(tok, add_bos, n_tokens, seq_len):
    from localmoe.testing.moefy.collect import token_chunks
    from localmoe.testing.moefy.texts import corpus

    return {"docstrings": token_chunks(tok, corpus("python-docstrings", heldout=True), n_tokens,
                                       seq_len, add_bos),
            "gpl3": token_chunks(tok, GPL.read_text(), n_tokens // 2, seq_len, add_bos)}


def _answers(model, mf, tok, top_k=None):
    from localmoe.testing.moefy.evaluate import CHAT_PROMPTS, greedy, prompt_tokens
    from localmoe.testing.moefy.moe_model import set_top_k

    if top_k is not None:
        set_top_k(model, top_k)
    stops = set(tok.control_ids) | {tok.eos_id}
    out = {}
    for q in CHAT_PROMPTS:
        ids = greedy(model, prompt_tokens(mf, tok, q), 40, stops)
        out[q] = tok.decode([t for t in ids if t not in stops])
    return out


def _eval(mf, dense, cfg, held, plan_file=None):
    """Build (or, with ``plan_file`` saved for the same config, reuse) a plan and measure it."""
    from localmoe.testing.moefy.collect import load_dense
    from localmoe.testing.moefy.evaluate import perplexity
    from localmoe.testing.moefy.experts import stored_experts
    from localmoe.testing.moefy.moe_model import moe_transformer
    from localmoe.testing.moefy.plan import MoePlan, build_plan

    t = time.perf_counter()
    plan = MoePlan.load(plan_file) if plan_file else None
    if plan is not None and plan.cfg != cfg:
        raise SystemExit(f"{plan_file} was built for {plan.cfg}, not {cfg}")
    plan = plan or build_plan(mf, cfg, dense=dense)
    build_s = round(time.perf_counter() - t, 1) if not plan_file else plan.stats.get("plan_s")
    stored = {l: stored_experts(mf, l, lp) for l, lp in enumerate(plan.layers)}
    moe = moe_transformer(mf, plan, stored, dense=load_dense(mf)[0])
    return moe, {h: perplexity(moe, v)[0] for h, v in held.items()}, build_s


def _checkpoint(a, res):
    """Write the results so far (a long run stopped midway keeps what it measured)."""
    if a.out:
        Path(a.out).write_text(json.dumps(dict(res, partial=True), indent=1))


def run(a) -> dict:
    from localmoe.io.loader import open_model
    from localmoe.testing.moefy import MoefyConfig, resolve_source
    from localmoe.testing.moefy.collect import load_dense
    from localmoe.testing.moefy.evaluate import perplexity
    from localmoe.testing.moefy.moe_model import set_top_k

    main_moe = None
    mf = open_model(resolve_source(a.source))
    dense = load_dense(mf)
    model, tok = dense
    add_bos = bool(mf.metadata.get("tokenizer.ggml.add_bos_token", False))
    base = MoefyConfig(a.experts, a.top_k, calib_tokens=a.calib_tokens, seed=a.seed)
    held = _heldout(tok, add_bos, a.eval_tokens, base.seq_len)
    res = {"source": mf.name, "experts": a.experts, "top_k": a.top_k,
           "calib_tokens": a.calib_tokens, "ppl": {}, "sweep": {}, "eval_top_k": {}, "answers": {},
           "build_s": {},
           "machine": platform.node(), "cpu_count": os.cpu_count(), "threads": a.threads,
           "command": "python benchmarks/moefy_quality.py " + " ".join(sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "eval_tokens": {k: sum(len(c) - 1 for c in v) for k, v in held.items()}}
    res["ppl"]["dense"] = {k: perplexity(model, v)[0] for k, v in held.items()}
    _say(f"dense {res['ppl']['dense']}")
    if a.answers:
        res["answers"]["dense"] = _answers(model, mf, tok)
    for name in a.variants:
        moe, ppl, build_s = _eval(mf, dense, base.with_(**VARIANTS[name]), held,
                                  a.plan if name == MAIN else None)
        res["ppl"][name], res["build_s"][name] = ppl, build_s
        _say(f"{name} top-{a.top_k}: {ppl} ({build_s} s)")
        _checkpoint(a, res)
        if name == MAIN:
            main_moe = moe
        if a.answers and name == MAIN:
            res["answers"][f"{name} top-{a.top_k}"] = _answers(moe, mf, tok)
    if a.eval_top_k:   # the main plan (fitted for --top-k) routed with other k, no refit
        main = main_moe if main_moe is not None else _eval(
            mf, dense, base.with_(**VARIANTS[MAIN]), held, a.plan)[0]
        for k in a.eval_top_k:
            if k == a.top_k or k > a.experts:
                continue
            # the plans pick (near) uniform weights, 1/k each, and fold the rest into the down
            # projections: with k' experts the weights are scaled by k'/k to stay 1/k each
            # (the same model with its down projections scaled by k'/k)
            set_top_k(main, k)
            main.spec = dataclasses.replace(main.spec, expert_weights_scale=k / a.top_k)
            res["eval_top_k"][k] = {h: perplexity(main, v)[0] for h, v in held.items()}
            _say(f"{MAIN} (fitted for top-{a.top_k}) routed with top-{k}: {res['eval_top_k'][k]}")
        set_top_k(main, a.top_k)
        main.spec = dataclasses.replace(main.spec, expert_weights_scale=1.0)
    d_ff = model.spec.d_ff
    res["active_frac"] = {MAIN: a.top_k / a.experts}
    for f in a.shared_frac:   # the main variant with an always-on shared expert (qwen2moe)
        cfg = base.with_(shared_frac=f, **VARIANTS[MAIN])
        fs, fe = cfg.split_sizes(d_ff)
        moe, ppl, build_s = _eval(mf, dense, cfg, held)
        name = f"{MAIN} shared {f:g}"
        res["ppl"][name], res["build_s"][name] = ppl, build_s
        # neurons computed per token: the shared expert plus top_k routed experts
        res["active_frac"][name] = (fs + a.top_k * fe) / d_ff
        res.setdefault("shared", {})[name] = {"shared_frac": f, "d_ff_shared": fs,
                                               "d_ff_expert": fe, "d_ff": d_ff}
        _say(f"{name} top-{a.top_k}: {ppl} ({build_s} s; active {res['active_frac'][name]:.3f})")
        _checkpoint(a, res)
        if a.answers:
            res["answers"][f"{name} top-{a.top_k}"] = _answers(moe, mf, tok)
    for k in a.sweep:
        res["active_frac"][f"{MAIN} top-{k}"] = k / a.experts
        if k == a.top_k or k > a.experts:
            continue
        moe, ppl, bs = _eval(mf, dense, base.with_(top_k=k, **VARIANTS[MAIN]), held)
        res["build_s"][f"{MAIN} top-{k}"] = bs
        res["sweep"][k] = ppl
        _say(f"{MAIN} fitted for top-{k}: {ppl}")
        _checkpoint(a, res)
        if a.answers and k == 2 * a.top_k:
            res["answers"][f"{MAIN} top-{k}"] = _answers(moe, mf, tok)
    return res


def table(results: list[dict]) -> str:
    lines = []
    for r in results:
        d = r["ppl"]["dense"]
        lines.append(f"\n#### {r['source']}: {r['experts']} experts, top-k {r['top_k']} "
                     f"(calibration {r['calib_tokens']} tokens; held-out tokens {r['eval_tokens']})\n")
        lines.append("| model | docstrings ppl | gpl3 ppl | ratio to dense (docstrings / gpl3) | build s |")
        lines.append("|---|---|---|---|---|")
        rows = [("dense", d, None)] + [(f"{n}, top-{r['top_k']}", p, r["build_s"].get(n))
                                       for n, p in r["ppl"].items() if n != "dense"]
        rows += [(f"{MAIN} (fitted for top-{r['top_k']}), routed with top-{k} (weights x {k}/{r['top_k']})",
                  p, None)
                 for k, p in sorted(r.get("eval_top_k", {}).items(), key=lambda kv: int(kv[0]))]
        rows += [(f"{MAIN}, fitted for top-{k}", p, None) for k, p in sorted(
            r.get("sweep", {}).items(), key=lambda kv: int(kv[0]))]
        for name, p, bs in rows:
            lines.append(f"| {name} | {p['docstrings']:.2f} | {p['gpl3']:.2f} | "
                         f"{p['docstrings'] / d['docstrings']:.2f} / {p['gpl3'] / d['gpl3']:.2f} | "
                         f"{'' if bs is None else bs} |")
        for who, ans in r.get("answers", {}).items():
            lines.append(f"\n{who}:\n")
            for q, t in ans.items():
                lines.append(f"* {q} -> {json.dumps(t[:160])}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source")
    ap.add_argument("--experts", type=int)
    ap.add_argument("--top-k", type=int)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--sweep", type=int, nargs="*", default=[],
                    help="more top-k values, each a plan fitted for it (main variant)")
    ap.add_argument("--plan", help="the main variant's saved plan (e.g. the preset's "
                    "<store>/moefy/<preset>.plan.npz) instead of building it again")
    ap.add_argument("--eval-top-k", type=int, nargs="*", default=[],
                    help="route the main plan with these top-k too (no refit)")
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--shared-frac", type=float, nargs="*", default=[],
                    help="also build the main variant with these shared-expert fractions "
                         "(qwen2moe; active neurons per token = shared + top-k routed)")
    ap.add_argument("--eval-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-answers", dest="answers", action="store_false")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out")
    ap.add_argument("--table", nargs="*", help="print the markdown of saved result files")
    a = ap.parse_args(argv)
    if a.table:
        print(table([json.loads(Path(p).read_text()) for p in a.table]))
        return 0
    torch.set_num_threads(a.threads)
    res = run(a)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    print(table([json.loads(json.dumps(res))]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
