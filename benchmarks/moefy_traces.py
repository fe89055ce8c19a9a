"""Routing traces of the moefied models on chat, code and prose, and their statistics.

For each preset (built or reused from the store's ``moefy/`` folder, see
``python -m localmoe.testing.moefy --preset``) the in-memory reference of the same plan
(:func:`localmoe.testing.moefy.moe_model.moe_transformer`, what the GGUF computes) runs with a
:class:`~localmoe.testing.moefy.trace.RoutingRecorder` over:

* **teacher-forced real text** (the statistics below): each text is cut to ``--tokens`` tokens;
  the first ``--prompt`` tokens count as the prompt (prefill), the rest as decode steps. Routing
  is per token, so one pass over the text routes every token exactly as token-by-token decoding
  of that text would; this keeps a degraded model's own repetitive output out of the cache
  statistics.
  - prose: held-out Python standard-library docstrings (PSF-2.0) and tests/data/gpl3_excerpt.txt
    (GPL-3.0 text);
  - code: the source of two standard-library modules (``heapq``, ``json.decoder``; PSF-2.0);
  - chat: a short conversation written for this script, through the model's chat template
    (SmolLM2) or as ``User:/Assistant:`` text (Gemma-3 base has no template).
* **free greedy generation** (``gen-*`` traces, reported separately): the model's own
  continuation of the chat questions, decoded token by token through the torch backend's KV
  cache.

Writes ``<out>/moefy_traces_<preset>.npz`` (format: :mod:`localmoe.testing.moefy.trace`) and
``<out>/moefy_traces_<preset>.json`` (statistics), and prints the markdown tables of
docs/MOEFY.md.

Usage: ``python benchmarks/moefy_traces.py --preset smollm2-moe-16x4 [--threads 1]``
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
GPL = ROOT / "tests" / "data" / "gpl3_excerpt.txt"
CHAT = [("user", "Hi! Can you help me plan a short trip to Paris?"),
        ("assistant", "Of course. How many days will you stay, and what do you enjoy most?"),
        ("user", "Three days. I like museums, old streets and good bread."),
        ("assistant", "Then start at the Louvre, walk through the Marais in the afternoon, and "
                      "buy a baguette from a local bakery each morning."),
        ("user", "What should I see on the second day?")]
QUESTIONS = ("What is the capital of France?", "Write a Python function that adds two numbers.",
             "Give me three tips for sleeping well.")


def _texts(mf, tok) -> list[tuple[str, str, list[int]]]:
    import heapq
    import json.decoder

    from localmoe.testing.moefy.texts import corpus
    from localmoe.text.chat_template import ChatTemplate

    add = bool(mf.metadata.get("tokenizer.ggml.add_bos_token", False))
    enc = lambda s: tok.encode(s, add_special=add)  # noqa: E731
    tpl = ChatTemplate.from_model(mf, tok)
    msgs = [{"role": r, "content": c} for r, c in CHAT]
    chat = (tpl.encode(tok, msgs, add_generation_prompt=True) if tpl is not None else
            enc("\n".join(f"{r.capitalize()}: {c}" for r, c in CHAT) + "\nAssistant:"))
    doc = corpus("python-docstrings", heldout=True)
    return [("prose-docstrings", "prose", enc(doc[20000:40000])),
            ("prose-gpl3", "prose", enc(GPL.read_text())),
            ("code-heapq", "code", enc(inspect.getsource(heapq))),
            ("code-json", "code", enc(inspect.getsource(json.decoder))),
            ("chat-paris", "chat", chat)]


def _record_text(model, tokens, ahead):
    from localmoe.testing.moefy.evaluate import _attn
    from localmoe.testing.moefy.trace import RoutingRecorder

    with torch.no_grad(), RoutingRecorder(model, ahead=ahead) as rec:
        t = torch.tensor(tokens, dtype=torch.int64)
        model.forward_hidden(t, torch.arange(len(tokens)), _attn(model))
        return rec.take()


def _record_gen(runner, name, prompt, n_new, ahead, stops, tok):
    """Greedy decoding through the runner's KV cache, recorded as ``localmoe generate
    --record-routing`` records it (:class:`~localmoe.backends.recording.RunnerRecorder`)."""
    from localmoe.testing.moefy.trace import RunnerRecorder

    seq = runner.new_sequence()
    rec = RunnerRecorder(runner, ahead=ahead)
    with torch.no_grad(), rec:
        nxt = int(runner.forward([(seq, prompt)])[0].argmax())
        out = [nxt]
        while len(out) < n_new and nxt not in stops:
            nxt = int(runner.forward([(seq, [nxt])])[0].argmax())
            out.append(nxt)
    runner.free_sequence(seq)
    return rec.take_trace(name, "gen", tok.decode(out))


def record(preset: str, a) -> tuple[dict, list]:
    from localmoe.io.loader import open_model
    from localmoe.testing.moefy import PRESETS, build_preset
    from localmoe.testing.moefy.evaluate import prompt_tokens
    from localmoe.testing.moefy.experts import stored_experts
    from localmoe.testing.moefy.moe_model import moe_runner
    from localmoe.testing.moefy.plan import MoePlan
    from localmoe.testing.moefy.trace import Trace
    from localmoe.text.tokenizer import Tokenizer

    path = build_preset(preset, progress=lambda m: print(m, file=sys.stderr))
    plan = MoePlan.load(path.with_suffix(".plan.npz"))
    mf = open_model(plan.source)
    tok = Tokenizer.from_model(mf)
    stored = {l: stored_experts(mf, l, lp) for l, lp in enumerate(plan.layers)}
    runner = moe_runner(mf, plan, stored, n_threads=a.threads)
    traces = []
    for name, kind, toks in _texts(mf, tok):
        toks = toks[:a.tokens]
        ids, ws, ah = _record_text(runner.model, toks, a.ahead)
        traces.append(Trace(name, kind, min(a.prompt, len(toks) - 1), np.array(toks), ids, ws, ah))
        print(f"{preset} {name}: {len(toks)} tokens", file=sys.stderr, flush=True)
    stops = set(tok.control_ids) | {tok.eos_id}
    for i, q in enumerate(QUESTIONS):
        traces.append(_record_gen(runner, f"gen-{i}", prompt_tokens(mf, tok, q), a.gen, a.ahead,
                                  stops, tok))
    meta = {"preset": preset, "model": mf.name, "source": Path(plan.source).name,
            "config": plan.cfg.__dict__, "n_layers": len(plan.layers),
            "n_experts": plan.cfg.n_experts, "top_k": plan.cfg.top_k, "ahead": a.ahead,
            "note": "moefied model (not a published MoE); see docs/MOEFY.md"}
    return meta, traces


def _fmt(v):
    return "n/a" if v is None or (isinstance(v, float) and np.isnan(v)) else f"{v:.2f}"


def tables(meta: dict, stats: dict) -> str:
    """Markdown: per-layer reuse, LRU/LFU hits and next-layer prediction, plus means."""
    L, k, E = meta["n_layers"], meta["top_k"], meta["n_experts"]
    s = stats["text"]
    head = ("| layer | reuse | LRU 1x | LRU 2x | LRU 4x | LFU 1x | LFU 2x | LFU 4x | "
            "pred l+1 top1 | l+1 recall | l+2 recall | l+3 recall |")
    lines = [head, "|" + "---|" * 12]
    rows = list(range(L)) + ["mean"]
    for l in rows:
        def g(x):
            x = np.asarray(x, dtype=float)
            return float(np.nanmean(x)) if l == "mean" else float(x[l])
        lines.append(f"| {l} | {_fmt(g(s['reuse']))} | " +
                     " | ".join(_fmt(g(s[p][m])) for p in ("lru", "lfu") for m in ("1", "2", "4")) +
                     f" | {_fmt(g(np.asarray(s['pred_top1'])[:, 0]))} | " +
                     " | ".join(_fmt(g(np.asarray(s['pred_recall'])[:, d])) for d in range(3)) + " |")
    lines.append(f"\nchance reuse k/E = {k}/{E} = {k / E:.2f}; cache of m x k slots "
                 f"(4x = {min(4 * k, E)} of {E} experts); {s['decode_tokens']} decode tokens")
    return "\n".join(lines)


def _jsonable(st):
    out = {}
    for key, v in st.items():
        if isinstance(v, dict):
            out[key] = {str(m): np.asarray(x).tolist() for m, x in v.items()}
        elif isinstance(v, np.ndarray):
            out[key] = v.tolist()
        else:
            out[key] = v
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", action="append", required=True)
    ap.add_argument("--tokens", type=int, default=320, help="tokens per teacher-forced text")
    ap.add_argument("--prompt", type=int, default=32, help="of which prompt (prefill) tokens")
    ap.add_argument("--gen", type=int, default=64, help="greedy tokens per generated trace")
    ap.add_argument("--ahead", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from localmoe.testing.moefy.trace import save_trace
    from localmoe.testing.moefy.trace_stats import summarize

    for preset in a.preset:
        t0 = time.perf_counter()
        meta, traces = record(preset, a)
        E, k = meta["n_experts"], meta["top_k"]
        text = [t for t in traces if t.kind != "gen"]
        gen = [t for t in traces if t.kind == "gen"]
        stats = {"text": _jsonable(summarize(text, E, k)), "gen": _jsonable(summarize(gen, E, k)),
                 "by_kind": {kind: _jsonable(summarize([t for t in text if t.kind == kind], E, k))
                             for kind in ("prose", "code", "chat")},
                 "seconds": round(time.perf_counter() - t0, 1), "machine": platform.node(),
                 "threads": a.threads,
                 "command": "python benchmarks/moefy_traces.py " + " ".join(argv or sys.argv[1:])}
        out = Path(a.out)
        save_trace(out / f"moefy_traces_{preset}.npz", traces, meta)
        (out / f"moefy_traces_{preset}.json").write_text(json.dumps({"meta": meta, "stats": stats}))
        print(f"\n### {preset}\n\n" + tables(meta, stats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
