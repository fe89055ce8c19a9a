"""Structured output on a real model: validity rate over the schema bank, required tool calls,
and the per-token cost of the grammar mask against the time per output token.

* ``schemas``: for each schema of ``localmoe.testing.schema_bank.SCHEMAS``, ``--n`` chat
  requests (``response_format`` json_schema, strict, temperature 1, seeds 0..n-1); the reply
  must parse and validate with ``jsonschema``. Records valid / n, finish reasons, tokens.
* ``tools``: ``--n`` requests with ``tool_choice: "required"`` over the bank's tools and
  prompts; every call must name a declared tool with arguments valid under its schema.
* ``mask``: the engine's extra work per token under a constraint, measured by replaying each
  constrained reply's tokens through a fresh :class:`~localmoe.text.grammar.Constraint`
  (mask computation + applying it to a logits vector, as the sampler does), against the TPOT
  of the same generations; and the TPOT of unconstrained replies to the same prompts.
* ``overlap``: TPOT with the next mask computed during the forward pass (as the engine does)
  against computing it after the forward pass, on the same greedy tokens.
* ``device`` (with CUDA, in ``mask``): the mask on the GPU sampler's path, replaying the same
  constrained replies: the host work (``Constraint.allowed_bits``, no unpacking; the engine
  overlaps it with the forward pass) and the sampler's extra time per token with the packed
  bitmask uploaded and applied in the kernel against the same sampler without a mask
  (``Sampler`` on CUDA logits of the model's vocabulary, timed to the id read), as a share of
  the constrained TPOT.  Whether the engine itself sampled on the GPU is recorded
  (``device_sampling``: the runner returns CUDA logits).

Run: ``python benchmarks/bench_structured.py --model smollm2 --n 100
--out benchmarks/results/structured_smollm2_cpu.json`` (``LOCALMOE_HOME`` as for the tests).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import sys
import time


def run_schemas(llm, n: int, max_tokens: int) -> dict:
    import jsonschema

    from localmoe.testing.schema_bank import SCHEMAS

    out = {}
    for name, prompt, schema in SCHEMAS:
        valid, finishes, toks, tpots, fails, replies = 0, collections.Counter(), [], [], [], []
        t0 = time.perf_counter()
        for seed in range(n):
            r = llm.chat([{"role": "user", "content": prompt}], seed=seed, temperature=1.0,
                         max_tokens=max_tokens,
                         response_format={"type": "json_schema", "json_schema": {
                             "name": name, "schema": schema, "strict": True}})
            c = r["choices"][0]
            finishes[c["finish_reason"]] += 1
            toks.append(r["usage"]["completion_tokens"])
            tpots.append(r["timings"]["tpot_ms"])
            try:
                jsonschema.validate(json.loads(c["message"]["content"]), schema)
                valid += 1
                if len(replies) < 2:
                    replies.append(c["message"]["content"])
            except Exception as e:  # noqa: BLE001 -- recorded
                fails.append({"seed": seed, "finish": c["finish_reason"],
                              "content": (c["message"]["content"] or "")[:300],
                              "error": str(e)[:200]})
        out[name] = {"n": n, "valid": valid, "rate": valid / n, "finish": dict(finishes),
                     "mean_tokens": statistics.mean(toks), "mean_tpot_ms": statistics.mean(tpots),
                     "seconds": round(time.perf_counter() - t0, 1), "examples": replies,
                     "failures": fails[:5]}
        print(name, {k: v for k, v in out[name].items() if k not in ("examples", "failures")},
              flush=True)
    return out


def run_tools(llm, n: int, max_tokens: int) -> dict:
    import jsonschema

    from localmoe.testing.schema_bank import TOOL_PROMPTS, TOOLS, tool_schema

    names = {t["function"]["name"] for t in TOOLS}
    declared = valid = calls = 0
    finishes, fails = collections.Counter(), []
    for i in range(n):
        prompt = TOOL_PROMPTS[i % len(TOOL_PROMPTS)]
        r = llm.chat([{"role": "user", "content": prompt}], tools=TOOLS, tool_choice="required",
                     seed=i, temperature=1.0, max_tokens=max_tokens)
        c = r["choices"][0]
        finishes[c["finish_reason"]] += 1
        ok_decl = ok_valid = bool(c["message"].get("tool_calls"))
        for tc in c["message"].get("tool_calls") or []:
            calls += 1
            name = tc["function"]["name"]
            ok_decl &= name in names
            try:
                jsonschema.validate(json.loads(tc["function"]["arguments"]), tool_schema(name))
            except Exception as e:  # noqa: BLE001 -- recorded
                ok_valid = False
                fails.append({"seed": i, "call": tc["function"], "error": str(e)[:200]})
        declared += ok_decl
        valid += ok_valid
        if not c["message"].get("tool_calls"):
            fails.append({"seed": i, "finish": c["finish_reason"], "error": r.get("error")})
    res = {"n": n, "declared_only": declared, "args_valid": valid, "calls": calls,
           "rate_declared": declared / n, "rate_valid": valid / n, "finish": dict(finishes),
           "failures": fails[:5]}
    print("tools", res, flush=True)
    return res


def run_mask(llm, n: int, max_tokens: int) -> dict:
    import numpy as np

    from localmoe.testing.schema_bank import SCHEMAS
    from localmoe.text.grammar import Grammar

    tok = llm.tokenizer
    mask_us, tpot_c, tpot_free, replies = [], [], [], []
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(tok.vocab_size).astype(np.float32)
    for k in range(n):
        name, prompt, schema = SCHEMAS[k % len(SCHEMAS)]
        msgs = [{"role": "user", "content": prompt}]
        r = llm.generate(prompt, raw=False, json_schema=schema, seed=k, temperature=1.0,
                         max_tokens=max_tokens)
        if r.completion_tokens > 1:
            tpot_c.append(r.timings.tpot_ms)
        free = llm.generate(prompt, raw=False, seed=k, temperature=1.0,
                            max_tokens=max(r.completion_tokens, 2))
        if free.completion_tokens > 1:
            tpot_free.append(free.timings.tpot_ms)
        replies.append((schema, list(r.token_ids)))
        c = Grammar.json_schema(tok, schema).start()
        for t in r.token_ids:
            t0 = time.perf_counter()
            allowed = c.allowed()
            x = logits.copy()
            np.putmask(x, ~allowed, -np.inf)
            mask_us.append((time.perf_counter() - t0) * 1e6)
            if not c.accept(t):
                break
        del msgs
    copy_us = []
    for _ in range(200):  # the logits copy is not extra work (the sampler copies anyway)
        t0 = time.perf_counter()
        logits.copy()
        copy_us.append((time.perf_counter() - t0) * 1e6)
    per_tok = statistics.mean(mask_us) - statistics.mean(copy_us)
    tpot = statistics.median(tpot_c)
    res = {"requests": n, "tokens": len(mask_us), "mask_us_mean": round(per_tok, 1),
           "mask_us_p50": round(statistics.median(mask_us), 1),
           "mask_us_p99": round(sorted(mask_us)[int(0.99 * len(mask_us))], 1),
           "tpot_ms_constrained_median": round(tpot, 2),
           "tpot_ms_unconstrained_median": round(statistics.median(tpot_free), 2),
           "overhead_pct_of_tpot": round(100 * per_tok / 1000 / tpot, 3)}
    print("mask", res, flush=True)
    import torch

    if torch.cuda.is_available():
        res["device"] = run_mask_device(tok, replies, tpot)
        print("mask device", res["device"], flush=True)
    return res


def run_mask_device(tok, replies, tpot_ms: float) -> dict:
    """The grammar mask's cost on the GPU sampler's path (see the module docstring)."""
    import numpy as np
    import torch

    from localmoe.engine.sampling import Sampler, SamplingParams
    from localmoe.text.grammar import Grammar

    V = tok.vocab_size
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal(V).astype(np.float32)).cuda()
    p = SamplingParams(temperature=1.0, seed=0)  # the engine's defaults: top_k 40, min_p
    plain = Sampler(p, V, device_sampling=True)
    masked = Sampler(p, V, device_sampling=True)
    hist = [1, 2, 3]
    for _ in range(20):  # compile and warm up both
        plain.sample(x, hist)
        masked.sample(x, hist, np.full((V + 31) // 32, -1, dtype=np.int32))
    bits_us, plain_us, masked_us = [], [], []
    for schema, ids in replies:
        c = Grammar.json_schema(tok, schema).start()
        for t in ids:
            t0 = time.perf_counter()
            bits = c.allowed_bits()
            bits_us.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            plain.sample(x, hist)
            t1 = time.perf_counter()
            masked.sample(x, hist, bits)
            t2 = time.perf_counter()
            plain_us.append((t1 - t0) * 1e6)
            masked_us.append((t2 - t1) * 1e6)
            if not c.accept(t):
                break
    extra = statistics.median(masked_us) - statistics.median(plain_us)
    return {"tokens": len(bits_us), "vocab": V,
            "allowed_bits_us_mean": round(statistics.mean(bits_us), 1),
            "allowed_bits_us_p50": round(statistics.median(bits_us), 1),
            "sample_us_p50_no_mask": round(statistics.median(plain_us), 1),
            "sample_us_p50_with_mask": round(statistics.median(masked_us), 1),
            "mask_extra_us_in_sampler": round(extra, 1),
            "overhead_pct_of_tpot_if_overlapped": round(100 * extra / 1000 / tpot_ms, 3),
            "overhead_pct_of_tpot_if_not_overlapped": round(
                100 * (extra + statistics.mean(bits_us)) / 1000 / tpot_ms, 3)}


def run_overlap(llm, repeats: int) -> dict:
    """TPOT with the next mask computed during the forward pass (the engine's way) against
    computing it after (sequential), on the same greedy tokens, interleaved; and without a
    constraint (other tokens, for scale)."""
    import concurrent.futures as cf

    from localmoe.engine import generation as gen
    from localmoe.testing.schema_bank import SCHEMAS

    class Sequential:
        def submit(self, fn):
            f = cf.Future()
            f.set_result(fn())
            return f

    real = gen._MASK_POOL
    tp: dict = {"overlap": [], "sequential": [], "unconstrained": []}
    try:
        for _ in range(repeats):
            for _name, prompt, schema in SCHEMAS:
                for mode in tp:
                    gen._MASK_POOL = Sequential() if mode == "sequential" else real
                    kw = {} if mode == "unconstrained" else {"json_schema": schema}
                    r = llm.generate(prompt, raw=False, temperature=0, max_tokens=80, **kw)
                    tp[mode].append(r.timings.tpot_ms)
    finally:
        gen._MASK_POOL = real
    res = {f"tpot_ms_median_{k}": round(statistics.median(v), 3) for k, v in tp.items()}
    res["runs_per_mode"] = len(tp["overlap"])
    print("overlap", res, flush=True)
    return res


def _engine_samples_on_device(llm) -> bool:
    """Whether the engine's sampler takes the GPU path (the runner returns CUDA logits)."""
    from localmoe.engine import sampling

    seen = []
    orig = sampling.Sampler.uses_device

    def probe(self, logits):
        seen.append(orig(self, logits))
        return seen[-1]

    sampling.Sampler.uses_device = probe
    try:
        llm.generate("Hi", raw=True, max_tokens=2, temperature=0)
    finally:
        sampling.Sampler.uses_device = orig
    return any(seen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--n", type=int, default=100, help="requests per schema and tool requests")
    ap.add_argument("--mask-n", type=int, default=24, help="requests for the mask overhead")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--parts", default="schemas,tools,mask,overlap")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from localmoe import LLM
    from localmoe.testing.schema_bank import MAX_TOKENS

    extra = {"n_threads": a.threads} if a.threads else {}
    llm = LLM(a.model, backend=a.backend, n_ctx=1024, **extra)
    res = {"machine": platform.node() or "vm", "cpu": platform.machine(),
           "cpu_count": os.cpu_count(), "load_avg_start": list(os.getloadavg()),
           "command": "python " + " ".join(sys.argv), "model": a.model,
           "backend": llm.backend_name, "max_tokens": MAX_TOKENS,
           "device_sampling": _engine_samples_on_device(llm)}
    parts = a.parts.split(",")
    if "schemas" in parts:
        res["schemas"] = run_schemas(llm, a.n, MAX_TOKENS)
        tot = sum(v["n"] for v in res["schemas"].values())
        ok = sum(v["valid"] for v in res["schemas"].values())
        res["schemas_total"] = {"n": tot, "valid": ok, "rate": ok / tot}
    if "tools" in parts:
        res["tools"] = run_tools(llm, a.n, MAX_TOKENS)
    if "mask" in parts:
        res["mask"] = run_mask(llm, a.mask_n, MAX_TOKENS)
    if "overlap" in parts:
        res["overlap"] = run_overlap(llm, 3)
    res["load_avg_end"] = list(os.getloadavg())
    llm.close()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
