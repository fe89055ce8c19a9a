"""Load benchmark: open time, full dequantization time and peak RSS per model file.

Each model runs in a fresh child process so its peak RSS (``ru_maxrss``) is its own.

Measured per model:
  * ``open_s``        open_model(): header parse + validation + ModelSpec (no weights touched)
  * ``rss_open_mb``   resident set after open (MiB)
  * ``dequant_s``     load_tensor() of every tensor to float32 on the CPU, one at a time
  * ``dequant_cpu_s`` CPU time of that pass (all threads; wall time suffers on a shared box)
  * ``dequant_gbs``   fp32 output GB/s of that pass (wall)
  * ``raw_touch_s``   reading every tensor's block bytes through raw_tensor() (page-in cost)
  * ``peak_rss_mb``   peak resident set of the child (MiB)
  * with --reader:    gguf.GGUFReader() open time, for comparison

Usage:
  python benchmarks/bench_load.py                      # the real models (SmolLM2-135M, Gemma-3-270M)
  python benchmarks/bench_load.py --model PATH [...]   # any .gguf files / HF dirs
  python benchmarks/bench_load.py --synthetic qwen3-30b-a3b --n-layers 4 --dir /tmp/synth
        # writes (once) a real-geometry random file truncated to N layers, then benchmarks it
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

REAL = ["SmolLM2-135M-Instruct.Q4_1.gguf", "gemma-3-270m-q4_k_m.gguf"]


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def child(path: str, reader: bool, skip_dequant: bool, threads: int) -> dict:
    import numpy as np
    import torch

    from localmoe.io.loader import open_model

    torch.set_num_threads(threads or os.cpu_count() or 1)
    out: dict = {"model": Path(path).name, "threads": torch.get_num_threads()}
    t = time.perf_counter()
    m = open_model(path)
    out["open_s"] = time.perf_counter() - t
    out["rss_open_mb"] = _rss_mb()
    out["arch"] = m.spec.arch
    names = m.tensor_names()
    out["n_tensors"] = len(names)
    out["file_gb"] = sum(m.tensor_info(n).nbytes for n in names) / 1e9
    if m.format == "gguf":
        t = time.perf_counter()
        acc = 0
        for n in names:
            acc ^= int(np.bitwise_xor.reduce(m.raw_tensor(n).data.reshape(-1)[:: 4096]))  # touch one byte per page
        out["raw_touch_s"] = time.perf_counter() - t
    if not skip_dequant:
        t, c = time.perf_counter(), time.process_time()
        total = 0
        for n in names:
            w = m.load_tensor(n)
            total += w.numel()
            del w
        dt = time.perf_counter() - t
        out["dequant_s"] = dt
        out["dequant_cpu_s"] = time.process_time() - c
        out["dequant_gbs"] = total * 4 / dt / 1e9
    m.close()
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if reader:
        import gguf

        t = time.perf_counter()
        gguf.GGUFReader(path)
        out["gguf_reader_open_s"] = time.perf_counter() - t
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", default=[], help=".gguf file or HF dir (repeatable)")
    ap.add_argument("--models-dir", default=os.environ.get("LOCALMOE_TEST_MODELS", "/tmp/models"))
    ap.add_argument("--synthetic", action="append", default=[], help="real-geometry preset name (repeatable)")
    ap.add_argument("--n-layers", type=int, default=None, help="truncate synthetic presets to N layers")
    ap.add_argument("--dir", default="/tmp/localmoe-bench", help="where synthetic files are written")
    ap.add_argument("--reader", action="store_true", help="also time gguf.GGUFReader() for comparison")
    ap.add_argument("--no-dequant", action="store_true", help="skip the full dequantization pass")
    ap.add_argument("--threads", type=int, default=0, help="torch threads in the child (0 = torch default)")
    ap.add_argument("--json", default=None, help="write results to this JSON file")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.reader, a.no_dequant, a.threads)))
        return 0
    paths = list(a.model)
    if not paths and not a.synthetic:
        paths = [str(Path(a.models_dir) / f) for f in REAL if (Path(a.models_dir) / f).is_file()]
    for preset in a.synthetic:
        from localmoe.testing.synthetic import write_gguf

        suffix = f"-{a.n_layers}L" if a.n_layers else ""
        p = Path(a.dir) / f"{preset}{suffix}.gguf"
        if not p.is_file():
            t = time.perf_counter()
            write_gguf(p, preset, n_layers=a.n_layers)
            print(f"wrote {p} ({p.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        paths.append(str(p))
    if not paths:
        print("no models found; pass --model or set LOCALMOE_TEST_MODELS", file=sys.stderr)
        return 1
    results = []
    for p in paths:
        cmd = [sys.executable, __file__, "--child", p] + (["--reader"] if a.reader else []) + (
            ["--no-dequant"] if a.no_dequant else []) + ["--threads", str(a.threads)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            print(f"{p}: failed\n{r.stderr[-2000:]}", file=sys.stderr)
            continue
        results.append(json.loads(r.stdout.strip().splitlines()[-1]))
    host = f"{platform.node()} {platform.processor() or platform.machine()} cpus={os.cpu_count()}"
    print(f"# bench_load on {host}")
    cols = ["model", "arch", "file_gb", "n_tensors", "threads", "open_s", "rss_open_mb", "raw_touch_s", "dequant_s",
            "dequant_cpu_s", "dequant_gbs", "peak_rss_mb", "gguf_reader_open_s"]
    cols = [c for c in cols if any(c in r for r in results)]
    print(" | ".join(cols))
    for r in results:
        print(" | ".join(f"{r[c]:.3f}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols))
    if a.json:
        Path(a.json).write_text(json.dumps({"host": host, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
