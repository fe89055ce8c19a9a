"""KV-cache quality on real models: perplexity, KL/top-1 vs the fp16 cache, needle retrieval.

For each KV configuration (format, key rotation, outliers, sinks) on the torch backend (CPU,
fp32 compute; the codecs are the twins of the Triton kernels, so the numbers hold for the GPU
path):

* **Perplexity** over the first ``--ppl-tokens`` tokens of tests/data/gpl3_excerpt.txt (with the
  needle sentence below inserted), fed in chunks of ``--chunk`` tokens so that every chunk
  attends to the *stored* (quantized) K/V of the earlier ones (the torch backend also reads the
  current chunk back from the cache).
* **KL divergence and top-1 agreement** against the fp16 cache over a long greedy generation:
  the fp16 run generates ``--gen`` tokens after the document + question; every other
  configuration is teacher-forced along the same tokens and compared step by step
  (KL(p_f16 || p_cfg) in nats, mean and max; fraction of steps whose argmax matches).
* **Needle retrieval**: the prompt is the same GPL text with "The secret passkey is NNNNN."
  inserted at 40% depth (``--depth``, ``--passkey``), followed by a question; a configuration
  retrieves the needle when its own greedy answer (identical to the teacher-forced argmax until
  the first disagreement, then its own token there) contains the passkey. ``needle_p``: the
  probability the configuration gives, teacher-forced, to the tokens that spell the passkey in
  the fp16 answer (a continuous measure; a first answer token near a tie flips the greedy
  check).

``--key-error N`` measures instead, per configuration, the relative reconstruction error
``||K_hat - K|| / ||K||`` of every layer's keys of the first N text tokens (from an fp16
prefill): a deterministic check of key formats that perplexity differences of a few tenths of a
percent cannot settle.

Gemma-3-270M's local layers use a 512-token sliding window; the texts are longer, so windowed
attention over quantized keys past the boundary is exercised.

Usage: ``python benchmarks/kv_quality.py --model /tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf
--out benchmarks/results/kv_quality_smollm2.json``; ``python benchmarks/kv_quality.py --table
results.json ...`` prints the markdown tables of docs/KV-QUALITY.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "tests" / "data" / "gpl3_excerpt.txt"

# name -> (KVSpec.parse kwargs, rotate keys). ":t" = keys per token (groups along head_dim),
# ":c" = keys per channel over each 16-token page (KIVI); values are always per token. Any
# other name is parsed as a KVSpec string, e.g. "k=int4:c,v=int4:g16,sinks=4,window=128".
CONFIGS = {
    "f16": (dict(kv="f16"), False),
    "int8": (dict(kv="int8:t"), False),
    "int4:t": (dict(kv="int4:t"), False),
    "int3:t": (dict(kv="int3:t"), False),
    "int2:t": (dict(kv="int2:t"), False),
    "fp4": (dict(kv="fp4"), False),
    "k=int4:t,v=int2": (dict(kv="f16", k="int4:t", v="int2"), False),
    "int4:t+hadamardK": (dict(kv="int4:t"), True),
    "int3:t+hadamardK": (dict(kv="int3:t"), True),
    "int2:t+hadamardK": (dict(kv="int2:t"), True),
    "int4:t+out4%": (dict(kv="int4:t", outlier_frac=0.04), False),
    "int3:t+out4%+sink4": (dict(kv="int3:t", outlier_frac=0.04, sink_tokens=4), False),
    "int2:t+out4%+sink4": (dict(kv="int2:t", outlier_frac=0.04, sink_tokens=4), False),
    "int2:t+out4%+sink4+win64": (dict(kv="int2:t", outlier_frac=0.04, sink_tokens=4, window=64),
                                 False),
    "fp4+out4%": (dict(kv="fp4", outlier_frac=0.04), False),
    # per-channel keys (KIVI-style, per 16-token page)
    "k=int4:c,v=f16": (dict(kv="f16", k="int4:c"), False),
    "k=int4:c,v=int4": (dict(kv="f16", k="int4:c", v="int4:g32"), False),
    "k=int4:c,v=int4:g16": (dict(kv="f16", k="int4:c", v="int4:g16"), False),
    "k=int4:c,v=int4:g16,sinks=4": (dict(kv="f16", k="int4:c", v="int4:g16", sink_tokens=4),
                                    False),
    "k=int4:c,v=int4:g16,window=64": (dict(kv="f16", k="int4:c", v="int4:g16", window=64), False),
    "k=int3:c,v=int3:g16,sinks=4": (dict(kv="f16", k="int3:c", v="int3:g16", sink_tokens=4),
                                    False),
    "k=int3:c,v=int3:g16,sinks=4,window=128": (dict(kv="f16", k="int3:c", v="int3:g16",
                                                    sink_tokens=4, window=128), False),
    "k=int4:c,v=int2:g16,sinks=4,window=128": (dict(kv="f16", k="int4:c", v="int2:g16",
                                                    sink_tokens=4, window=128), False),
    "k=int2:c,v=int2:g16,sinks=4,window=128": (dict(kv="f16", k="int2:c", v="int2:g16",
                                                    sink_tokens=4, window=128), False),
    "k=int2:c,v=int2,sinks=4,window=128": (dict(kv="f16", k="int2:c", v="int2:g32",
                                                sink_tokens=4, window=128), False),
    "k=int2:c,v=int2:g16,outliers=0.04,sinks=4,window=128": (
        dict(kv="f16", k="int2:c", v="int2:g16", outlier_frac=0.04, sink_tokens=4, window=128),
        False),
}


def make_runner(mf, name, n_ctx, block_size=16):
    import localmoe.kv.quant_codec as kv_quant
    from localmoe.backends.torch_backend import TorchRunner
    from localmoe.kv.spec import KVSpec

    if name in CONFIGS:
        kw, rot = CONFIGS[name]
        spec = KVSpec.parse(**kw)
    else:  # any KVSpec string, e.g. "k=int4:c,v=int4:g16,window=64"
        spec, rot = KVSpec.parse(name), False
    old = kv_quant.DEFAULT_KEY_ROTATE
    kv_quant.DEFAULT_KEY_ROTATE = rot
    try:
        return TorchRunner(mf, n_ctx=n_ctx, kv_spec=spec, max_seqs=1, block_size=block_size)
    finally:
        kv_quant.DEFAULT_KEY_ROTATE = old


def perplexity(runner, ids, chunk):
    sid = runner.new_sequence()
    nll, n = 0.0, 0
    for i in range(0, len(ids) - 1, chunk):
        part = ids[i:i + chunk]
        logits = runner.forward([(sid, part)], all_logits=True)[0]
        tgt = ids[i + 1:i + 1 + len(part)]
        lp = torch.log_softmax(logits[:len(tgt)].float(), -1)
        nll -= lp.gather(1, torch.tensor(tgt)[:, None]).sum().item()
        n += len(tgt)
    runner.free_sequence(sid)
    return math.exp(nll / n)


def prefill(runner, sid, ids, chunk):
    logits = None
    for i in range(0, len(ids), chunk):
        logits = runner.forward([(sid, ids[i:i + chunk])])[0]
    return logits


def needle_prompt(tok, text_ids, n_tokens, passkey, depth=0.4):
    body = text_ids[:n_tokens]
    cut = int(len(body) * depth)
    needle = tok.encode(f" The secret passkey is {passkey}. Remember it. ", add_special=False)
    q = tok.encode("\n\nQuestion: What is the secret passkey mentioned in the text above?\n"
                   "Answer: The secret passkey is", add_special=False)
    return body[:cut] + needle + body[cut:] + q, len(q)


def key_error(runner, mf, text_ids, configs, n_tokens):
    """Relative key reconstruction error of each configuration: the keys of every layer after an
    fp16 prefill of the first ``n_tokens`` text tokens, written to a one-layer cache of the
    configuration in one call and read back; ``||K_hat - K|| / ||K||`` (Frobenius, per layer).

    Returns ``{config: {"mean": float, "layers": [float, ...]}}``.
    """
    from localmoe.kv.cache import PagedKVCache
    from localmoe.kv.spec import KVSpec

    ids = text_ids[:n_tokens]
    sid = runner.new_sequence()
    runner.forward([(sid, ids)])
    n = len(ids)
    keys = [runner.cache.read(layer, sid, n)[0] for layer in range(runner.spec.n_layers)]
    runner.free_sequence(sid)
    out = {}
    for name in configs:
        spec = KVSpec.parse(name)
        errs = []
        for k in keys:
            c = PagedKVCache(runner.spec, spec, n_ctx=n + 16)
            s = c.new_seq()
            c.reserve(s, n)
            c.write(0, s, 0, k, k)
            errs.append(((c.read(0, s, n)[0] - k).norm() / k.norm()).item())
        out[name] = {"mean": sum(errs) / len(errs), "layers": errs}
        print(f"{name:44s} key error {out[name]['mean'] * 100:.2f}% (layers "
              f"{min(errs) * 100:.2f}..{max(errs) * 100:.2f}%)", flush=True)
    return out


def passkey_span(tok, tokens, passkey):
    """``(first, last)`` indices of the shortest run of ``tokens`` whose decoded text contains
    ``passkey``, or None when the text never does."""
    for e in range(len(tokens)):
        if passkey in tok.decode(tokens[:e + 1]):
            for s in range(e, -1, -1):
                if passkey in tok.decode(tokens[s:e + 1]):
                    return s, e
    return None


def markdown(path):
    """Markdown table of a results JSON written by this script."""
    d = json.loads(Path(path).read_text())
    if "key_error" in d:
        lines = [f"{d['model']} ({d['file']}): relative key error over the first "
                 f"{d['n_tokens']} tokens, mean of {d['n_layers']} layers", "",
                 "| KV config | bits K | key error | min..max over layers |", "|---|---|---|---|"]
        for name, r in d["key_error"].items():
            lines.append(f"| {name} | {r['bits_k']:.2f} | {r['mean'] * 100:.2f}% | "
                         f"{min(r['layers']) * 100:.2f}..{max(r['layers']) * 100:.2f}% |")
        return "\n".join(lines)
    res = d["results"]
    base = res["f16"]["ppl"]
    lines = [f"{d['model']} ({d['file']}): perplexity over {d['ppl_tokens']} tokens, "
             f"KL/top-1 over {d['gen']} greedy tokens after a {d['prompt_tokens']}-token prompt, "
             f"needle {d.get('passkey', '48213')} at {d.get('depth', 0.4):.0%} depth",
             "", "| KV config | bits K/V | ppl | vs f16 | KL mean (max) | top-1 | needle | "
             "p(passkey) |", "|---|---|---|---|---|---|---|---|"]
    for name, r in res.items():
        p = r.get("needle_p")
        lines.append(f"| {name} | {r['bits_k']:.2f}/{r['bits_v']:.2f} | {r['ppl']:.3f} | "
                     f"{(r['ppl'] / base - 1) * 100:+.1f}% | {r['kl_mean']:.4f} ({r['kl_max']:.3f}) "
                     f"| {r['top1'] * 100:.1f}% | {'yes' if r['needle_found'] else 'no'} | "
                     f"{'-' if p is None else f'{p:.2f}'} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS))
    ap.add_argument("--ppl-tokens", type=int, default=2048)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--text", nargs="*", default=None,
                    help="document file(s), concatenated (default tests/data/gpl3_excerpt.txt); "
                         "longer needle runs use e.g. /usr/share/common-licenses/{GPL-3,...}")
    ap.add_argument("--depth", type=float, default=0.4,
                    help="needle position as a fraction of the document (default 0.4)")
    ap.add_argument("--passkey", default="48213", help="the needle's five digits")
    ap.add_argument("--block-size", type=int, default=16,
                    help="KV cache page in tokens (per-channel keys: the tokens sharing a scale)")
    ap.add_argument("--key-error", type=int, default=0, metavar="N",
                    help="instead: relative key reconstruction error of each config over the "
                         "keys of the first N text tokens (fp16 prefill), see key_error()")
    ap.add_argument("--out", default=None)
    ap.add_argument("--append", action="store_true",
                    help="keep the rows already in --out (same model, text and lengths) and "
                         "add or replace this run's; KL/top-1 are against this run's f16")
    return ap


def _run_key_error(a, mf, text_ids, paths) -> int:
    """``--key-error N``: each configuration's key reconstruction error, written to ``--out``."""
    from localmoe.kv.spec import KVSpec

    r = make_runner(mf, "f16", a.key_error + 16)
    res = key_error(r, mf, text_ids, [c for c in a.configs if c != "f16"], a.key_error)
    for name, row in res.items():
        row["bits_k"] = KVSpec.parse(name).bits_per_value("k", r.spec.head_dim, 16)
    if a.out:
        Path(a.out).write_text(json.dumps(dict(
            model=mf.name, file=Path(a.model).name, text=[p.name for p in paths],
            n_tokens=min(a.key_error, len(text_ids)), n_layers=r.spec.n_layers,
            key_error=res), indent=1))
    return 0


def _needle_ids(tok, text_ids, a):
    """``(ids, n_question)``: BOS (when the model adds one), the first ``--ppl-tokens`` document
    tokens with the needle at ``--depth``, then the question's ``n_question`` tokens."""
    body = text_ids[1:] if (tok.add_bos and text_ids and text_ids[0] == tok.bos_id) else text_ids
    nids, n_q = needle_prompt(tok, body, a.ppl_tokens, a.passkey, a.depth)
    if tok.add_bos and tok.bos_id is not None:
        nids = [tok.bos_id] + nids
    return nids, n_q


def _stored_results(ap, a, n_prompt: int) -> dict:
    """With ``--append``, the rows already in ``--out`` (which must match this run), else {}."""
    if not (a.append and a.out and Path(a.out).is_file()):
        return {}
    old = json.loads(Path(a.out).read_text())
    if (old.get("file"), old.get("prompt_tokens"), old.get("gen"), old.get("depth", 0.4),
            old.get("passkey", "48213")) != (Path(a.model).name, n_prompt, a.gen, a.depth,
                                             a.passkey):
        ap.error(f"--append: {a.out} holds another model, prompt or --gen")
    return old["results"]


def _ppl_and_answer(r, nids, n_text, a, ref_tokens):
    """Perplexity over the document (needle sentence included), fed chunk by chunk, then
    ``--gen`` steps after the question: greedy, or teacher-forced along ``ref_tokens``.

    Returns ``(ppl, n_scored, lps, toks)``: ``lps`` the per-step log-probabilities ([vocab]
    float32 tensors), ``toks`` the per-step argmax token ids.
    """
    sid = r.new_sequence()
    nll, n = 0.0, 0
    for i in range(0, n_text, a.chunk):
        part = nids[i:min(i + a.chunk, n_text)]
        logits = r.forward([(sid, part)], all_logits=True)[0]
        tgt = nids[i + 1:i + 1 + len(part)]
        lp = torch.log_softmax(logits[:len(tgt)].float(), -1)
        nll -= lp.gather(1, torch.tensor(tgt)[:, None]).sum().item()
        n += len(tgt)
    ppl = math.exp(nll / n)
    logits = r.forward([(sid, nids[n_text:])])[0]
    lps, toks = [], []
    for step in range(a.gen):
        lp = torch.log_softmax(logits.float(), -1)
        lps.append(lp)
        t = int(lp.argmax()) if ref_tokens is None else ref_tokens[step]
        toks.append(int(lp.argmax()))
        if step + 1 < a.gen:
            logits = r.forward([(sid, [t])])[0]
    return ppl, n, lps, toks


def _score(r, a, tok, ppl, lps, toks, ref) -> dict:
    """One configuration's row. The first call (f16) fills ``ref`` (``lp``, ``tokens``,
    ``span``); later ones are compared against it (KL, top-1, needle)."""
    row = {"kv_spec": str(r.kv_spec), "ppl": ppl,
           "kv_bytes_per_token": r.kv_spec.bytes_per_token(r.spec, a.block_size),
           "bits_k": r.kv_spec.bits_per_value("k", r.spec.head_dim, a.block_size),
           "bits_v": r.kv_spec.bits_per_value("v", r.spec.v_head_dim, a.block_size)}
    if a.block_size != 16:
        row["block_size"] = a.block_size
    if ref.get("tokens") is None:
        ref.update(lp=torch.stack(lps), tokens=toks, span=passkey_span(tok, toks, a.passkey))
        answer = tok.decode(toks)
        row.update(kl_mean=0.0, kl_max=0.0, top1=1.0)
    else:
        lp = torch.stack(lps)
        kl = (ref["lp"].exp() * (ref["lp"] - lp)).sum(-1).clamp(min=0)
        agree = [int(x == y) for x, y in zip(toks, ref["tokens"])]
        row.update(kl_mean=kl.mean().item(), kl_max=kl.max().item(),
                   top1=sum(agree) / len(agree))
        first_miss = agree.index(0) if 0 in agree else len(agree)
        answer = tok.decode(ref["tokens"][:first_miss] + toks[first_miss:first_miss + 1])
    row["needle_answer"] = answer[:60]
    row["needle_found"] = a.passkey in answer
    span = ref["span"]
    if span is not None:
        # teacher-forced probability of the fp16 answer's passkey tokens: a continuous
        # retrieval measure next to the all-or-nothing greedy check
        lp = torch.stack(lps)
        row["needle_p"] = math.exp(sum(lp[i, ref["tokens"][i]].item()
                                       for i in range(span[0], span[1] + 1)))
    return row


def _print_row(name, row) -> None:
    print(f"{name:24s} ppl {row['ppl']:8.3f}  KL {row['kl_mean']:.4f} (max {row['kl_max']:.3f})  "
          f"top1 {row['top1']*100:5.1f}%  needle {row['needle_found']!s:5s} "
          f"p {row.get('needle_p', float('nan')):.2f}  "
          f"bits K/V {row['bits_k']:.2f}/{row['bits_v']:.2f}  [{row['seconds']} s]",
          flush=True)


def _run_configs(ap, a, mf, tok, paths, nids, n_q) -> int:
    """f16 first, then every other configuration: one row each, ``--out`` rewritten after each."""
    n_ctx = len(nids) + a.gen + 16
    results = _stored_results(ap, a, len(nids))
    ref = {}
    configs = ["f16"] + [c for c in a.configs if c != "f16"]
    n_text = len(nids) - n_q
    for name in configs:
        t0 = time.time()
        r = make_runner(mf, name, n_ctx, a.block_size)
        ppl, n, lps, toks = _ppl_and_answer(r, nids, n_text, a, ref.get("tokens"))
        row = _score(r, a, tok, ppl, lps, toks, ref)
        row["seconds"] = round(time.time() - t0, 1)
        key = name if (a.block_size == 16 or name == "f16") else f"{name} (page {a.block_size})"
        if key in results and name == "f16" and abs(results[key]["ppl"] / ppl - 1) > 1e-4:
            print(f"warning: f16 ppl {ppl:.4f} differs from the stored {results[key]['ppl']:.4f} "
                  "(KL of the stored rows is against that run)", flush=True)
        results[key] = row
        _print_row(name, row)
        r.close()
        if a.out:
            Path(a.out).write_text(json.dumps(dict(model=mf.name, file=Path(a.model).name,
                                                   text=[p.name for p in paths],
                                                   ppl_tokens=n, prompt_tokens=len(nids),
                                                   gen=a.gen, chunk=a.chunk, depth=a.depth,
                                                   passkey=a.passkey, results=results),
                                              indent=1))
    return 0


def main(argv=None):
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--table":
        for p in sys.argv[2:]:
            print(markdown(p) + "\n")
        return 0
    ap = _parser()
    a = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    if a.threads:
        torch.set_num_threads(a.threads)

    from localmoe.io.loader import open_model
    from localmoe.text.tokenizer import Tokenizer

    mf = open_model(a.model)
    tok = Tokenizer.from_model(mf)
    paths = [Path(p) for p in a.text] if a.text else [TEXT]
    text_ids = tok.encode("\n\n".join(p.read_text() for p in paths))
    if a.key_error:
        return _run_key_error(a, mf, text_ids, paths)
    if len(text_ids) < a.ppl_tokens:
        print(f"warning: the text has only {len(text_ids)} tokens (< --ppl-tokens)", flush=True)
    nids, n_q = _needle_ids(tok, text_ids, a)
    print(f"model {mf.name}: document {len(nids) - n_q} tokens (needle at {a.depth:.0%}), question "
          f"{n_q}, gen {a.gen}", flush=True)
    return _run_configs(ap, a, mf, tok, paths, nids, n_q)


if __name__ == "__main__":
    sys.exit(main())
