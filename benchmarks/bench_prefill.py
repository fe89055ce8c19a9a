"""Prefill kernels on the GPU: launch-choice sweep of the quantized GEMM and the grouped MoE GEMM
at Qwen3-30B-A3B shapes, and a kernel-time profile of one prefill of the real-geometry file.

For each candidate (BM, BN, warps, stages) the kernel alone is timed with
``triton.testing.do_bench`` (median, ms) at 512 tokens; TFLOP/s counts 2*M*N*K (MoE: the routed
pairs only). ``--model FILE`` adds a ``torch.profiler`` table of one 512-token prefill through
the triton runner (kernel name, calls, total ms).

Usage (GPU machine)::

    python benchmarks/bench_prefill.py [--model /tmp/models/qwen3-30b-a3b.gguf] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

DENSE = [("qkv", 8, 5120, 2048), ("o", 8, 2048, 4096), ("head_q6k", 14, 8192, 2048)]
GEMM_CANDIDATES = [(64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 3), (64, 128, 8, 3),
                   (128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 4), (32, 128, 4, 3),
                   (128, 128, 8, 4), (64, 256, 8, 3)]
MOE_CANDIDATES = [(16, 64, 4, 3), (32, 64, 4, 3), (32, 128, 4, 3), (32, 128, 8, 3),
                  (64, 64, 4, 3), (64, 128, 8, 3), (16, 128, 4, 3), (32, 64, 4, 4),
                  (32, 256, 8, 3), (64, 128, 4, 4)]


def bench(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def sweep_dense(m: int) -> list[dict]:
    from localmoe.kernels.qtensor import QuantTensor, random_gguf_blocks
    from localmoe.kernels.quant_gemm import quant_gemm

    rows = []
    for name, qt, n, k in DENSE:
        w = QuantTensor.from_gguf(random_gguf_blocks(qt, (n, k), seed=1, scale=0.002), qt, (n, k), "cuda")
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        out = torch.empty(m, n, device="cuda", dtype=torch.float16)
        ref = x.float() @ w.dequantize().T
        cublas_w = w.dequantize().half()
        t_cublas = bench(lambda: torch.matmul(x, cublas_w.T))
        for bm, bn, nw, ns in GEMM_CANDIDATES:
            cfg = {"BM": bm, "BN": bn, "num_warps": nw, "num_stages": ns}
            try:
                quant_gemm(x, w, out=out, config=cfg)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                ms = bench(lambda: quant_gemm(x, w, out=out, config=cfg))
            except Exception as e:  # out of resources etc.
                rows.append({"shape": name, **cfg, "error": type(e).__name__})
                continue
            rows.append({"shape": name, "m": m, "n": n, "k": k, **cfg, "ms": round(ms, 4),
                         "tflops": round(2 * m * n * k / ms / 1e9, 1), "rel_err": err,
                         "cublas_fp16_ms": round(t_cublas, 4)})
            print(rows[-1], flush=True)
    return rows


def sweep_moe(t: int) -> list[dict]:
    from localmoe.kernels.qtensor import QuantTensor, random_gguf_blocks
    from localmoe.kernels.quant_gemm import moe_prefill

    e, f, d, k = 128, 768, 2048, 8

    def make(shape, seed):
        return QuantTensor.from_gguf(random_gguf_blocks(12, shape, seed=seed, scale=0.002), 12, shape, "cuda")

    gu = QuantTensor.interleave_rows(make((e, f, d), 1), make((e, f, d), 2))
    dn = make((e, d, f), 3)
    logits = torch.randn(t, e, device="cuda")
    w, ids = torch.topk(torch.softmax(logits, -1), k)
    x = torch.randn(t, d, device="cuda", dtype=torch.float16)
    flops = 2 * t * k * (2 * f * d + d * f)
    rows = []
    for bm, bn, nw, ns in MOE_CANDIDATES:
        cfg = {"BM": bm, "BN": bn, "num_warps": nw, "num_stages": ns}
        try:
            moe_prefill(x, gu, dn, ids, w, config=cfg)
            ms = bench(lambda: moe_prefill(x, gu, dn, ids, w, config=cfg))
        except Exception as ex:
            rows.append({"shape": "moe", **cfg, "error": type(ex).__name__})
            continue
        rows.append({"shape": "moe_qwen3", "tokens": t, **cfg, "ms": round(ms, 4),
                     "tflops": round(flops / ms / 1e9, 1)})
        print(rows[-1], flush=True)
    return rows


def profile_prefill(path: str, m: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    from localmoe.backends.triton.runner import TritonRunner
    from localmoe.io.loader import open_model

    r = TritonRunner(open_model(path), n_ctx=2048, device="cuda")
    prompt = torch.randint(0, r.spec.vocab_size, (m,)).tolist()
    for _ in range(2):
        s = r.new_sequence()
        r.forward([(s, prompt)])
        r.free_sequence(s)
    torch.cuda.synchronize()
    s = r.new_sequence()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        r.forward([(s, prompt)])
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    agg: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            a = agg.setdefault(ev.name[:90], [0, 0.0])
            a[0] += 1
            a[1] += (ev.device_time if hasattr(ev, "device_time") else ev.cuda_time) / 1e3
    rows = [{"kernel": k, "calls": v[0], "ms": round(v[1], 3)} for k, v in agg.items()]
    rows.sort(key=lambda r: -r["ms"])
    total = sum(r["ms"] for r in rows)
    print(f"prefill {m} tokens: wall {wall:.1f} ms, kernels {total:.1f} ms", flush=True)
    for row in rows[:25]:
        print(row, flush=True)
    return [{"wall_ms": round(wall, 2), "kernel_ms": round(total, 2)}] + rows[:40]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--model", default=None)
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    out = {"gpu": torch.cuda.get_device_name(0), "command": "python benchmarks/bench_prefill.py "
           + " ".join(sys.argv[1:] if argv is None else argv)}
    if a.model:
        out["profile"] = profile_prefill(a.model, a.tokens)
    if not a.skip_sweep:
        out["moe"] = sweep_moe(a.tokens)
        out["dense"] = sweep_dense(a.tokens)
    text = json.dumps(out, indent=1)
    if a.out:
        open(a.out, "w").write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
