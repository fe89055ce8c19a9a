"""localmoe generate on the llamacpp backend vs raw llama-cpp-python, and CLI startup time.

Measures decode tok/s (time from the first to the last generated token, per token) and TTFT for

* ``raw``: llama-cpp-python's own ``Llama.create_completion`` (sampling in C), and
* ``localmoe``: ``localmoe.LLM(backend="llamacpp")`` (our tokenizer, sampler, stop checker and
  streaming detokenizer in Python over the same llama.cpp context type),

with the same model file, context size, thread count and sampling settings, interleaved run by
run (the machine is shared and noisy) and reported as medians. Sampling modes: ``greedy`` and
the default chain (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05, fixed seed). End-of-
generation tokens are biased away on both sides so every run generates exactly N tokens.

Also times ``localmoe generate --json`` end to end as a subprocess (decode tok/s from its own
timings) and ``localmoe --help`` startup.

Usage::

    python benchmarks/bench_generate.py [--model PATH] [-n 128] [--repeat 5] [--threads T]
                                        [--out benchmarks/results/generate.json]
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
from pathlib import Path

PROMPT = "Once upon a time, in a small village by the sea, there lived"
MODES = {
    "greedy": dict(temperature=0.0, top_k=1, top_p=1.0, min_p=0.0),
    "default": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
}


def find_model() -> str:
    from localmoe.io.store import ModelStore

    p = ModelStore().find("smollm2")
    if p is None and Path("/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf").exists():
        p = Path("/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    if p is None:
        sys.exit("SmolLM2 not found: run `localmoe pull smollm2` or pass --model")
    return str(p)


def run_raw(llm, n: int, mode: str, eog: list[int], seed: int) -> dict:
    llm.reset()
    kw = dict(MODES[mode])
    times = []
    t0 = time.perf_counter()
    n_tok = 0
    for chunk in llm.create_completion(PROMPT, max_tokens=n, stream=True, seed=seed,
                                       logit_bias={i: -1e9 for i in eog}, **kw):
        times.append(time.perf_counter())
        n_tok += 1
    # llama-cpp-python streams one chunk per token (text may be empty for partial UTF-8)
    return _summarize(t0, times, n_tok)


def run_ours(llm, n: int, mode: str, eog: list[int], seed: int) -> dict:
    llm.reset()
    r = llm.generate(PROMPT, max_tokens=n, seed=seed, logit_bias={i: -100.0 for i in eog},
                     **MODES[mode])
    t = r.timings
    return {"ttft_ms": t.ttft_ms, "decode_tok_s": t.decode_tok_s, "tokens": r.completion_tokens}


def _summarize(t0: float, times: list[float], n_tok: int) -> dict:
    if len(times) < 2:
        return {"ttft_ms": float("nan"), "decode_tok_s": float("nan"), "tokens": n_tok}
    return {"ttft_ms": (times[0] - t0) * 1000, "tokens": n_tok,
            "decode_tok_s": (len(times) - 1) / (times[-1] - times[0])}


def cli_run(model: str, n: int, threads: int) -> dict:
    env = dict(os.environ, LOCALMOE_THREADS=str(threads))
    r = subprocess.run([sys.executable, "-m", "localmoe", "generate", "-m", model, "--backend",
                        "llamacpp", "--raw", "--greedy", "-n", str(n), "-c", "512", "--json",
                        PROMPT], capture_output=True, text=True, env=env, timeout=600)
    if r.returncode != 0:
        return {"error": r.stderr.strip()[-300:]}
    d = json.loads(r.stdout)
    return {"decode_tok_s": d["timings"]["decode_tok_s"], "ttft_ms": d["timings"]["ttft_ms"],
            "tokens": d["completion_tokens"]}


def help_startup(repeat: int = 5) -> dict:
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "localmoe", "--help"], capture_output=True, check=True)
        ts.append((time.perf_counter() - t) * 1000)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    bare = (time.perf_counter() - t) * 1000
    return {"median_ms": statistics.median(ts), "min_ms": min(ts), "python_bare_ms": bare}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("-n", type=int, default=128, help="tokens to generate per run")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 1) // 2))
    ap.add_argument("--out", default="benchmarks/results/generate.json")
    args = ap.parse_args()
    model = args.model or find_model()

    import llama_cpp

    from localmoe.api import LLM
    from localmoe.backends.llamacpp_backend import raw_llama

    raw = raw_llama(model, n_ctx=512, n_threads=args.threads, n_threads_batch=args.threads,
                    verbose=False)
    ours = LLM(model, backend="llamacpp", n_ctx=512, n_threads=args.threads)
    eog = sorted(ours.tokenizer.eog_ids)
    results: dict = {"machine": platform.node(), "cpu": platform.processor() or platform.machine(),
                     "cpu_count": os.cpu_count(), "load_avg": os.getloadavg(),
                     "model": model, "threads": args.threads, "n": args.n,
                     "repeat": args.repeat, "llama_cpp_python": llama_cpp.__version__,
                     "modes": {}}
    for mode in MODES:
        run_raw(raw, 8, mode, eog, 0)  # warm-up
        run_ours(ours, 8, mode, eog, 0)
        rs, os_ = [], []
        for i in range(args.repeat):  # interleaved
            rs.append(run_raw(raw, args.n, mode, eog, 1234 + i))
            os_.append(run_ours(ours, args.n, mode, eog, 1234 + i))
        med = lambda xs, k: statistics.median(x[k] for x in xs)
        m = {"raw_decode_tok_s": med(rs, "decode_tok_s"), "ours_decode_tok_s": med(os_, "decode_tok_s"),
             "raw_ttft_ms": med(rs, "ttft_ms"), "ours_ttft_ms": med(os_, "ttft_ms"),
             "raw_tokens": rs[0]["tokens"], "ours_tokens": os_[0]["tokens"],
             "per_run_ratio": [o["decode_tok_s"] / r["decode_tok_s"] for r, o in zip(rs, os_)]}
        m["ratio"] = m["ours_decode_tok_s"] / m["raw_decode_tok_s"]
        m["median_paired_ratio"] = statistics.median(m["per_run_ratio"])
        results["modes"][mode] = m
    raw.close()
    ours.close()
    results["cli_generate_greedy"] = cli_run(model, args.n, args.threads)
    results["help_startup"] = help_startup()

    print(f"machine {results['machine']} ({results['cpu_count']} CPUs, load {results['load_avg'][0]:.1f}), "
          f"{Path(model).name}, {args.threads} threads, {args.n} tokens x {args.repeat}")
    print(f"{'mode':<8} {'raw tok/s':>10} {'ours tok/s':>11} {'ratio':>7} {'paired':>7} "
          f"{'raw TTFT':>9} {'ours TTFT':>10}")
    for mode, m in results["modes"].items():
        print(f"{mode:<8} {m['raw_decode_tok_s']:>10.1f} {m['ours_decode_tok_s']:>11.1f} "
              f"{m['ratio']:>7.3f} {m['median_paired_ratio']:>7.3f} {m['raw_ttft_ms']:>7.1f}ms "
              f"{m['ours_ttft_ms']:>8.1f}ms")
    print(f"localmoe generate (CLI, greedy): {results['cli_generate_greedy']}")
    h = results["help_startup"]
    print(f"localmoe --help: median {h['median_ms']:.0f} ms (bare python {h['python_bare_ms']:.0f} ms)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
