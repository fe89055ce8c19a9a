"""CPU decode speed of the torch reference backend next to llama-cpp-python on the same file.

For each backend (each in its own subprocess, so load time and peak RSS are its own) the script
loads the model, prefills one prompt, then decodes ``--tokens`` tokens greedily one at a time and
reports:

* ``load_s``: model load wall time (s); ``peak_rss_mb``: peak resident memory of the process (MiB);
* ``prefill_tok_s``: prompt tokens / prefill wall time;
* ``decode_tok_s``: generated tokens / decode wall time (the headline number);
* ``decode_cpu_ms_per_tok``: process CPU time per decoded token (ms) -- on a shared machine the
  wall-clock number moves with the load average, this one much less;
* ``load_avg``: 1-minute load average when the run started.

Backends: ``torch`` (default options: packed GGUF weights on the CPU when the kernel builds),
``torch-float`` (``packed_weights=False``: every weight dequantized to float32, the plain
PyTorch reference), ``llamacpp``. With ``--repeats N`` the backends run interleaved
(A, B, A, B, ...) so that a shared machine's load hits them alike; the table shows per-backend
medians and every run is kept in the JSON (``runs``).

All backends see the same token ids (llama.cpp's tokenizer when available, else localmoe's).
Usage::

    python benchmarks/bench_cpu_decode.py                      # SmolLM2 Q4_1, 64 tokens
    python benchmarks/bench_cpu_decode.py --model gemma3 --tokens 32
    python benchmarks/bench_cpu_decode.py --model /path/file.gguf --threads 2 --json out.json
    python benchmarks/bench_cpu_decode.py --backends torch,torch-float,llamacpp --repeats 5

Prints one JSON document (``--json`` also writes it) and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

PROMPT = ("The GNU General Public License is a free, copyleft license for software and other "
          "kinds of works. Summarize what it allows in one paragraph:")
MODELS = {"smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf", "gemma3": "gemma-3-270m-q4_k_m.gguf"}


def _resolve_model(name: str) -> str:
    if os.path.isfile(name):
        return name
    fname = MODELS.get(name, name)
    for d in (os.environ.get("LOCALMOE_TEST_MODELS"), "/tmp/models"):
        if d and os.path.isfile(os.path.join(d, fname)):
            return os.path.join(d, fname)
    try:
        from localmoe.io.store import ModelStore

        p = ModelStore().find({"gemma3": "gemma3-270m"}.get(name, name))
        if p:
            return str(p)
    except Exception:
        pass
    sys.exit(f"model {name!r} not found; pass a .gguf path or set LOCALMOE_TEST_MODELS")


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _tokens(path: str) -> list[int]:
    try:
        import llama_cpp

        llm = llama_cpp.Llama(model_path=path, n_ctx=256, vocab_only=True, verbose=False)
        return llm.tokenize(PROMPT.encode(), add_bos=True, special=False)
    except ImportError:
        from localmoe.io.loader import open_model
        from localmoe.text.tokenizer import Tokenizer

        return Tokenizer.from_model(open_model(path)).encode(PROMPT)


def _child_torch(path: str, toks: list[int], n: int, threads: int, packed: bool | None = None
                 ) -> dict:
    import torch

    torch.set_num_threads(threads)
    from localmoe.io.loader import open_model
    from localmoe.backends.registry import get_backend

    t0 = time.perf_counter()
    runner = get_backend("torch").load(open_model(path), n_ctx=len(toks) + n + 8, max_seqs=1,
                                       packed_weights=packed, n_threads=threads)
    load_s = time.perf_counter() - t0
    sid = runner.new_sequence()
    t0 = time.perf_counter()
    logits = runner.forward([(sid, toks)])[0]
    prefill_s = time.perf_counter() - t0
    out = []
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        nxt = int(torch.argmax(logits))
        out.append(nxt)
        logits = runner.forward([(sid, [nxt])])[0]
    dec_s, dec_cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"load_s": load_s, "prefill_s": prefill_s, "decode_s": dec_s, "decode_cpu_s": dec_cpu,
            "generated": out, "dtype": str(runner.dtype).replace("torch.", "")
            + ("+packed" if runner.model.packed else ""), "kv": str(runner.kv_spec),
            "weights_mb": runner.stats()["weights_bytes"] / 2**20}


def _child_llamacpp(path: str, toks: list[int], n: int, threads: int) -> dict:
    import numpy as np
    import llama_cpp

    from localmoe.backends.llamacpp_backend import raw_llama

    t0 = time.perf_counter()
    llm = raw_llama(model_path=path, n_ctx=len(toks) + n + 8, n_threads=threads,
                    n_threads_batch=threads, n_batch=512, verbose=False)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    n_vocab = llm.n_vocab()

    def last_logits():
        # only the last token has logits (logits_all=False); read llama.cpp's buffer directly
        ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(n_vocab,))

    llm.eval(toks)
    prefill_s = time.perf_counter() - t0
    out = []
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        nxt = int(np.argmax(last_logits()))
        out.append(nxt)
        llm.eval([nxt])
    dec_s, dec_cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"load_s": load_s, "prefill_s": prefill_s, "decode_s": dec_s, "decode_cpu_s": dec_cpu,
            "generated": out, "dtype": "gguf-native", "kv": "f16"}


def _child(args) -> None:
    toks = json.loads(args.child_tokens)
    if args.child == "llamacpp":
        res = _child_llamacpp(args.model_path, toks, args.tokens, args.threads)
    else:
        res = _child_torch(args.model_path, toks, args.tokens, args.threads,
                           packed=False if args.child == "torch-float" else None)
    res["peak_rss_mb"] = _peak_rss_mb()
    print("RESULT " + json.dumps(res))


def _parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 | gemma3 | path to a .gguf")
    ap.add_argument("--tokens", type=int, default=64, help="tokens to decode")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--backends", default="torch,llamacpp",
                    help="comma list of torch | torch-float | llamacpp")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run the backends this many times, interleaved; report medians")
    ap.add_argument("--json", default=None, help="also write the JSON here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-tokens", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model-path", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _run_one(be: str, rep: int, path: str, toks: list[int], args) -> dict:
    """One backend run in a child process: its row (rates rounded), or ``{"error": ...}``."""
    load_avg = os.getloadavg()[0]
    cmd = [sys.executable, __file__, "--child", be, "--model-path", path, "--tokens",
           str(args.tokens), "--threads", str(args.threads), "--child-tokens",
           json.dumps(toks)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not line:
        return {"backend": be, "repeat": rep, "error": (p.stderr or p.stdout)[-800:]}
    r = json.loads(line[-1][7:])
    n = args.tokens
    row = {
        "backend": be, "repeat": rep, "dtype": r["dtype"], "kv": r["kv"],
        "load_s": round(r["load_s"], 2), "peak_rss_mb": round(r["peak_rss_mb"], 1),
        "prefill_tok_s": round(len(toks) / r["prefill_s"], 1),
        "decode_tok_s": round(n / r["decode_s"], 2),
        "decode_cpu_ms_per_tok": round(1000 * r["decode_cpu_s"] / n, 1),
        "load_avg": round(load_avg, 2), "generated": r["generated"]}
    if "weights_mb" in r:
        row["weights_mb"] = round(r["weights_mb"], 1)
    print(f"# {be} run {rep}: {row['decode_tok_s']} tok/s "
          f"({row['decode_cpu_ms_per_tok']} ms CPU/tok), load avg {row['load_avg']}",
          file=sys.stderr)
    return row


def _medians(runs: list[dict], backends: list[str]) -> list[dict]:
    """Per backend: the median of each number over its good runs, or its first error."""
    results = []
    num = ["load_s", "peak_rss_mb", "prefill_tok_s", "decode_tok_s", "decode_cpu_ms_per_tok",
           "load_avg", "weights_mb"]
    for be in backends:
        good = [r for r in runs if r["backend"] == be and "error" not in r]
        if not good:
            results.append({"backend": be, "error": next(
                (r["error"] for r in runs if r["backend"] == be and "error" in r), "no run")})
            continue
        med = {k: round(statistics.median(r[k] for r in good), 2) for k in num if k in good[0]}
        results.append({"backend": be, "dtype": good[0]["dtype"], "kv": good[0]["kv"],
                        "n_runs": len(good), **med, "generated": good[0]["generated"],
                        "decode_tok_s_all": [r["decode_tok_s"] for r in good]})
    return results


def _identical_prefix(results: list[dict]) -> dict | None:
    """First position where each backend's greedy tokens leave the first one's (None: < 2)."""
    gens = {r["backend"]: r["generated"] for r in results if "generated" in r}
    if len(gens) < 2:
        return None
    names = list(gens)
    ref = gens[names[0]]
    return {b: next((i for i, (a, c) in enumerate(zip(ref, gens[b])) if a != c), len(ref))
            for b in names[1:]}


def _print_table(doc: dict) -> None:
    cols = ["backend", "dtype", "load_s", "peak_rss_mb", "prefill_tok_s", "decode_tok_s",
            "decode_cpu_ms_per_tok", "load_avg"]
    print()
    print(" | ".join(f"{c:>12}" for c in cols))
    for r in doc["results"]:
        if "error" in r:
            print(f"{r['backend']:>12} | error: {r['error'].splitlines()[-1] if r['error'] else '?'}")
            continue
        print(" | ".join(f"{str(r.get(c, '')):>12}" for c in cols))


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.child:
        _child(args)
        return 0
    path = _resolve_model(args.model)
    toks = _tokens(path)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    runs = [_run_one(be, rep, path, toks, args)
            for rep in range(max(1, args.repeats)) for be in backends]
    results = _medians(runs, backends)
    doc = {"model": os.path.basename(path), "prompt_tokens": len(toks), "decode_tokens": args.tokens,
           "threads": args.threads, "machine": f"{platform.processor() or platform.machine()}, "
           f"{os.cpu_count()} cpus, {platform.system()}",
           "greedy_tokens_identical_prefix": _identical_prefix(results),
           "repeats": max(1, args.repeats), "statistic": "median over repeats",
           "results": [{k: v for k, v in r.items() if k != "generated"} for r in results],
           "runs": [{k: v for k, v in r.items() if k != "generated"} for r in runs]}
    txt = json.dumps(doc, indent=1)
    print(txt)
    if args.json:
        with open(args.json, "w") as f:
            f.write(txt)
    _print_table(doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
