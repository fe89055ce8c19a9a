"""End-to-end check of the `triton` backend against the `torch` backend on CUDA.

For each synthetic preset and KV format: prefill a 200-token prompt, then decode 64 tokens
teacher-forced with the same token ids on both runners; report the max |logit difference|,
greedy top-1 agreement per step and the median decode step time (ms, CUDA synchronized).

Usage (GPU machine): python benchmarks/gpu_e2e.py [--presets tiny-qwen3moe tiny-llama]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from localmoe.kv.spec import KVSpec
from localmoe.io.loader import open_model
from localmoe.backends.registry import get_backend
from localmoe.testing.synthetic import write_gguf


def run(runner, prompt, forced, device):
    seq = runner.new_sequence()
    runner.forward([(seq, prompt)])
    logits, times = [], []
    for t in forced:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = runner.forward([(seq, [t])])[0]
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        logits.append(out)
    runner.free_sequence(seq)
    return torch.stack(logits), statistics.median(times[4:] or times)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["tiny-qwen3moe", "tiny-llama"])
    ap.add_argument("--formats", nargs="+", default=["f16", "int8", "int4", "int2", "fp4"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backends", nargs="+", default=["torch", "triton"])
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    rows = []
    for preset in a.presets:
        mf = open_model(write_gguf(f"/tmp/{preset}.gguf", preset))
        vocab = mf.spec.vocab_size
        prompt = torch.randint(5, vocab - 8, (200,), generator=g).tolist()
        forced = torch.randint(5, vocab - 8, (64,), generator=g).tolist()
        for kv in a.formats:
            res = {}
            for b in a.backends:
                r = get_backend(b).load(mf, n_ctx=512, kv_spec=KVSpec.parse(kv), device=a.device)
                res[b] = run(r, prompt, forced, a.device)
                r.close()
            row = {"preset": preset, "kv": kv}
            for b, (lg, ms) in res.items():
                row[f"{b}_ms"] = round(ms, 3)
            if len(res) == 2:
                (l0, _), (l1, _) = res.values()
                row["max_abs_diff"] = round((l0 - l1).abs().max().item(), 5)
                row["logit_range"] = round((l0.max() - l0.min()).item(), 3)
                row["top1_agree"] = (l0.argmax(-1) == l1.argmax(-1)).float().mean().item()
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
