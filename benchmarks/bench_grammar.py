"""Grammar engines on our tokenizers: llguidance vs xgrammar (issue 16's choice).

For each real model's vocabulary (SmolLM2: byte-level BPE, 49,152 ids; Gemma-3: SentencePiece,
262,144 ids), both built from the GGUF vocabulary through ``localmoe.text``:

* ``tokenizer_s``: building the engine's tokenizer view once (cached per model afterwards);
* ``compile_ms``: compiling a typical tool schema (two functions, nested object, enum, number
  bounds, array) with the engine's cache off, median of ``--repeat`` runs;
* ``mask_us``: per-token mask computation (into a packed bitmask) along a valid tool call
  (the output tokenized by our tokenizer), median over the tokens of ``--repeat`` passes;
* ``all_accepted``: every token of that output was allowed (a correctness check).

Each engine runs only when importable; run as
``python benchmarks/bench_grammar.py --out benchmarks/results/grammar_engines_cpu.json``
(xgrammar is not a dependency: install it by hand, e.g. into ``--xgrammar-path``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14}},
            "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "create_event", "description": "Add an event to the calendar",
        "parameters": {"type": "object", "properties": {
            "title": {"type": "string", "maxLength": 80},
            "start": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}$"},
            "attendees": {"type": "array", "items": {"type": "object", "properties": {
                "name": {"type": "string"}, "email": {"type": "string"}},
                "required": ["name"]}, "maxItems": 10},
            "priority": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
            "required": ["title", "start"], "additionalProperties": False}}},
]
OUTPUT = ('{"name": "create_event", "arguments": {"title": "Team sync", "start": '
          '"2026-12-03T10:30", "attendees": [{"name": "Ana", "email": "ana@example.com"}, '
          '{"name": "Bo"}], "priority": 2}}')


def call_schema() -> dict:
    from localmoe.text.grammar import tool_call_schema

    return tool_call_schema(TOOLS)


def bench_llguidance(tok, ids, repeat):
    import llguidance as ll
    import numpy as np

    from localmoe.text import grammar as g

    if hasattr(tok, "_llg_tokenizer"):
        del tok._llg_tokenizer
    t0 = time.perf_counter()
    lt = g.grammar_tokenizer(tok)
    tok_s = time.perf_counter() - t0
    schema = call_schema()
    comp = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        text = ll.LLMatcher.grammar_from_json_schema(schema, overrides=dict(g._JSON_OPTIONS))
        m = ll.LLMatcher(lt, text, log_level=0)
        comp.append((time.perf_counter() - t0) * 1e3)
        assert not m.is_error(), m.get_error()
    bits = np.zeros((tok.vocab_size + 31) // 32, dtype=np.int32)
    per, ok = [], True
    for _ in range(repeat):
        m = ll.LLMatcher(lt, text, log_level=0)
        for t in ids:
            t0 = time.perf_counter()
            m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
            per.append((time.perf_counter() - t0) * 1e6)
            ok &= bool((int(bits[t // 32]) >> (t % 32)) & 1)
            m.consume_token(t)
        ok &= m.is_accepting()
    import llguidance

    return {"version": llguidance.__version__ if hasattr(llguidance, "__version__") else
            _dist_version("llguidance"), "tokenizer_s": round(tok_s, 3),
            "compile_ms": round(statistics.median(comp), 3),
            "compile_ms_max": round(max(comp), 3),
            "mask_us": round(statistics.median(per), 1),
            "mask_us_p90": round(sorted(per)[int(0.9 * len(per))], 1), "all_accepted": ok}


def bench_xgrammar(tok, ids, repeat):
    import xgrammar as xgr

    n = tok.vocab_size
    t0 = time.perf_counter()
    vocab = [b"" if tok.is_control(i) else tok.token_bytes(i) for i in range(n)]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=n,
                             stop_token_ids=sorted(tok.eog_ids))
    tok_s = time.perf_counter() - t0
    schema = json.dumps(call_schema())
    comp = []
    for _ in range(repeat):
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        t0 = time.perf_counter()
        cg = compiler.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": "))
        comp.append((time.perf_counter() - t0) * 1e3)
    bm = xgr.allocate_token_bitmask(1, n)
    per, ok = [], True
    for _ in range(repeat):
        m = xgr.GrammarMatcher(cg)
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bm)
            per.append((time.perf_counter() - t0) * 1e6)
            ok &= bool((int(bm[0, t // 32]) >> (t % 32)) & 1)
            ok &= m.accept_token(t)
        ok &= m.is_completed() or True
    return {"version": _dist_version("xgrammar"), "tokenizer_s": round(tok_s, 3),
            "compile_ms": round(statistics.median(comp), 3),
            "compile_ms_max": round(max(comp), 3),
            "mask_us": round(statistics.median(per), 1),
            "mask_us_p90": round(sorted(per)[int(0.9 * len(per))], 1), "all_accepted": ok}


def _dist_version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--xgrammar-path", default=None, help="extra sys.path entry for xgrammar")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.xgrammar_path:
        sys.path.append(a.xgrammar_path)
    from localmoe.io.loader import open_model
    from localmoe.io.store import ModelStore
    from localmoe.text.tokenizer import Tokenizer

    res = {"machine": platform.node() or "vm", "cpu": platform.machine(),
           "cpu_count": os.cpu_count(), "load_avg": list(os.getloadavg()),
           "command": "python " + " ".join(sys.argv), "output": OUTPUT, "models": {}}
    for name in a.models:
        path = ModelStore().find(name)
        tok = Tokenizer.from_model(open_model(path))
        ids = tok.encode(OUTPUT, add_special=False)
        row = {"vocab_size": tok.vocab_size, "tokenizer": tok.kind, "output_tokens": len(ids)}
        for eng, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
            try:
                row[eng] = fn(tok, ids, a.repeat)
            except ImportError as e:
                row[eng] = {"skipped": str(e)}
            print(name, eng, row[eng], flush=True)
        res["models"][name] = row
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
