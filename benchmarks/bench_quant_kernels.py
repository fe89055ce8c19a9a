"""Per-kernel benchmark of the quantized decode GEMV and the fused MoE (GGUF blocks on the GPU).

Shapes: Qwen3-30B-A3B (d_model 2048, 32 q / 4 kv heads of 128, 128 experts top-8, d_ff_expert
768, vocab 151936), OLMoE-1B-7B (2048, 16/16 heads, 64 experts top-8, d_ff_expert 1024, vocab
50304) and Mixtral-8x7B (4096, 32/8 heads, 8 experts top-2, d_ff 14336, vocab 32000); 1 and 8
tokens. Types as in a Q4_K_M-style file: attention QKV and O in Q8_0, experts' gate/up/down in
Q4_K, output head in Q6_K. Weights are random *valid* blocks (``random_gguf_blocks``: random
codes and sub-block scales, finite fp16 scales), never zeros.

Method: each timed call reads weights that are not in the 60 MB L2: GEMVs rotate over enough
row-disjoint copies of the weight (>= 256 MiB in all), MoE calls rotate over routings whose
expert sets are disjoint (T=1) or random (T=8). The rotation is captured in one CUDA graph;
the figure is the median over graph replays of the replay time divided by the calls in it (so
the in-graph launch gap, ~1 us, is included, as it is in a decode step). Bytes counted are the
weight bytes the call must read, in the device layout (``QuantTensor.nbytes`` of the rows
touched; for MoE only the distinct routed experts' rows); ``ggml_bytes`` are the same rows in
the file's layout. ``pct`` = achieved GB/s over the 4.27 TB/s copy ceiling (read+write counted,
measured on this H200). A cuBLAS fp16 GEMV of the same logical shape (torch.matmul, same
rotation) is the reference row. Before timing, every kernel is checked against its torch twin
on the GPU at the benchmarked shape.

``--sweep`` times launch variants (BN, CH, num_warps, split) at the Qwen3 shapes and prints
the best per shape; winners go into the kernels' launch dicts (to move to
``kernels/configs/<device>.json``).

Usage: ``python benchmarks/bench_quant_kernels.py [--out FILE] [--sweep] [--tiny]``
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import statistics
import sys
import time

import torch

from localmoe.kernels.fused_moe import fused_moe, fused_moe_ref, moe_down, moe_gate_up
from localmoe.kernels.qtensor import QTYPE_NAMES, QuantTensor, qtype_id, random_gguf_blocks
from localmoe.kernels.quant_gemv import gemv_config, quant_gemv, quant_gemv_ref, quantize_act

CEILING = 4.27e12
L2_DEFEAT = 256 << 20
MODELS = {
    "qwen3-30b-a3b": dict(d=2048, hq=32, hkv=4, hd=128, e=128, k=8, f=768, vocab=151936),
    "olmoe-1b-7b": dict(d=2048, hq=16, hkv=16, hd=128, e=64, k=8, f=1024, vocab=50304),
    "mixtral-8x7b": dict(d=4096, hq=32, hkv=8, hd=128, e=8, k=2, f=14336, vocab=32000),
}
TINY = dict(d=256, hq=2, hkv=1, hd=64, e=4, k=2, f=256, vocab=96)


def gemv_shapes(m):
    """(name, qtype, N, K) of the model's dense decode GEMVs."""
    return [("qkv", "Q8_0", (m["hq"] + 2 * m["hkv"]) * m["hd"], m["d"]),
            ("o", "Q8_0", m["d"], m["hq"] * m["hd"]),
            ("head", "Q6_K", m["vocab"], m["d"])]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def make(qt, shape, seed, dev):
    return QuantTensor.from_gguf(random_gguf_blocks(qt, shape, seed=seed), qt, shape, device=dev)


def copies(w: QuantTensor, n: int, c: int) -> list[QuantTensor]:
    """Row-disjoint [n, K] views of a [c*n, K] tensor."""
    return [QuantTensor(w.qtype, (n, w.K), {k: v[i * n:(i + 1) * n] for k, v in w.planes.items()})
            for i in range(c)]


def time_calls(calls, reps=25) -> float:
    """Median microseconds per call of ``calls`` (a list of closures), replayed as one CUDA graph."""
    if not torch.cuda.is_available():           # --tiny smoke run on the CPU interpreter
        t0 = time.perf_counter()
        for f in calls:
            f()
        return (time.perf_counter() - t0) * 1e6 / len(calls)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            for f in calls:
                f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in calls:
            f()
    g.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / len(calls))
    return statistics.median(out)


def row(kind, model, name, qtype, shape, tokens, us, nbytes, ggml_bytes=None, **extra):
    gbps = nbytes / (us * 1e-6) / 1e9
    r = dict(kernel=kind, model=model, name=name, qtype=qtype, shape=list(shape), tokens=tokens,
             us=round(us, 2), bytes=nbytes, ggml_bytes=ggml_bytes, gbps=round(gbps, 1),
             pct=round(100 * gbps * 1e9 / CEILING, 1))
    r.update(extra)
    print(f"{kind:12s} {model:14s} {name:8s} {qtype:5s} T={tokens}  {us:8.2f} us  "
          f"{nbytes / 2**20:8.2f} MiB  {gbps:7.1f} GB/s  {r['pct']:5.1f}%  {extra.get('config', '')}",
          flush=True)
    return r


# ---------------------------------------------------------------------------------------------
def bench_gemv(model, m, tokens_list, dev, check=True, configs=None, only=None):
    rows = []
    for name, qt, n, k in gemv_shapes(m):
        if only and name not in only:
            continue
        w1 = make(qt, (n, k), 1, dev)
        c = max(1, min(32, math.ceil(L2_DEFEAT / w1.nbytes))) if dev == "cuda" else 2
        big = make(qt, (c * n, k), 2, dev)
        ws = copies(big, n, c)
        for t in tokens_list:
            x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
            if check:
                e = rel(quant_gemv(x, w1), quant_gemv_ref(x, w1))
                assert e < 1e-2, f"gemv {model} {name} T={t}: rel err {e:.2e} vs twin"
            xa = quantize_act(x)
            variants = configs or [dict(mode="float"), dict(mode="xq")]
            for var in variants:
                cfg = {k: v for k, v in var.items() if k != "mode"}
                mode = var.get("mode", "xq")
                xin = xa if mode == "xq" else x
                outs = [torch.empty(t, n, device=dev, dtype=torch.bfloat16) for _ in ws]
                try:
                    us = time_calls([lambda w=w, o=o: quant_gemv(xin, w, out=o, config=cfg or None)
                                     for w, o in zip(ws, outs)])
                except Exception as ex:  # a variant that does not compile/run: report, go on
                    print(f"  variant {var} failed: {type(ex).__name__}: {str(ex)[:300]}", flush=True)
                    continue
                used = dict(gemv_config(n, k, t, qtype_id(qt)), **cfg)
                rows.append(row("gemv" if mode == "xq" else "quant+gemv", model, name, qt, (n, k), t,
                                us, ws[0].nbytes, ws[0].ggml_nbytes, config=used))
            if configs is None:
                wf = torch.randn(c * n, k, device=dev, dtype=torch.float16)
                wfs = [wf[i * n:(i + 1) * n] for i in range(c)]
                xf = x.to(torch.float16)
                us = time_calls([lambda w=w: torch.matmul(xf, w.T) for w in wfs])
                rows.append(row("cublas_fp16", model, name, "F16", (n, k), t, us, n * k * 2))
        del big, ws, w1
        torch.cuda.empty_cache() if dev == "cuda" else None
    return rows


def routings(m, t, r, gen):
    """r routings of t tokens: disjoint expert sets at T=1, random distinct top-k per token else."""
    e, k = m["e"], m["k"]
    out = []
    perm = torch.randperm(e, generator=gen)
    for i in range(r):
        if t == 1:
            j = (i * k) % e
            ids = perm[j:j + k][None]
        else:
            ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
        w = torch.rand(t, k, generator=gen) + 0.1
        out.append((ids.to(torch.int32), w / w.sum(-1, keepdim=True)))
    return out


def bench_moe(model, m, tokens_list, dev, check=True, configs=None, stages=("both", "both_xq")):
    rows = []
    e, f, d, k = m["e"], m["f"], m["d"], m["k"]
    g = make("Q4_K", (e, f, d), 3, dev)
    u = make("Q4_K", (e, f, d), 4, dev)
    gu = QuantTensor.interleave_rows(g, u)
    del g, u
    wd = make("Q4_K", (e, d, f), 5, dev)
    slot = torch.arange(e, dtype=torch.int32, device=dev)
    gen = torch.Generator().manual_seed(0)
    row_gu, row_d = gu.nbytes // gu.rows, wd.nbytes // wd.rows
    grow_gu, grow_d = gu.ggml_nbytes // gu.rows, wd.ggml_nbytes // wd.rows
    for t in tokens_list:
        per_call = (2 * f * row_gu + d * row_d) * k * t
        r = max(2, min(64, math.ceil(L2_DEFEAT / per_call))) if dev == "cuda" else 2
        if t == 1:
            r = max(r, e // k)
        rts = [(i.to(dev), w.to(dev)) for i, w in routings(m, t, r, gen)]
        distinct = [len(set(i.flatten().tolist())) for i, _ in rts]
        nb = statistics.mean(distinct) * (2 * f * row_gu + d * row_d)
        nb_gu = statistics.mean(distinct) * 2 * f * row_gu
        nb_d = statistics.mean(distinct) * d * row_d
        gnb = statistics.mean(distinct) * (2 * f * grow_gu + d * grow_d)
        x = torch.randn(t, d, device=dev, dtype=torch.bfloat16)
        if check:
            ids, w = rts[0]
            err = rel(fused_moe(x, gu, wd, ids, w, slot_of=slot), fused_moe_ref(x, gu, wd, ids, w))
            assert err < 1e-2, f"moe {model} T={t}: rel err {err:.2e} vs twin"
        xa = quantize_act(x)
        for cfg in (configs or [None]):
            for stage in stages:
                try:
                    if stage in ("both", "both_xq"):
                        xin = xa if stage == "both_xq" else x
                        calls = [lambda i=i, w=w, xin=xin: fused_moe(xin, gu, wd, i, w, slot_of=slot,
                                                                     config=cfg)
                                 for i, w in rts]
                        nbytes = nb
                    elif stage == "gate_up":
                        gcfg = (cfg or {}).get("gate_up")
                        calls = [lambda i=i: moe_gate_up(xa, gu, i, slot, "silu", gcfg) for i, _ in rts]
                        nbytes = nb_gu
                    else:
                        hs = [quantize_act(torch.randn(t * k, f, device=dev)) for _ in rts]
                        dcfg = (cfg or {}).get("down")
                        calls = [lambda i=i, w=w, h=h: moe_down(h, wd, i, w, slot, config=dcfg)
                                 for (i, w), h in zip(rts, hs)]
                        nbytes = nb_d
                    us = time_calls(calls)
                except Exception as ex:
                    print(f"  variant {cfg} {stage} failed: {type(ex).__name__}: {str(ex)[:300]}", flush=True)
                    continue
                kind = {"both": "quant+moe", "both_xq": "moe", "gate_up": "moe_gate_up", "down": "moe_down"}[stage]
                rows.append(row(kind, model, "experts", "Q4_K", (e, f, d, k), t, us, int(nbytes),
                                int(gnb) if stage.startswith("both") else None,
                                config=cfg or "default", experts_touched=statistics.mean(distinct)))
    del gu, wd
    if dev == "cuda":
        torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------
def sweep(dev):
    m = MODELS["qwen3-30b-a3b"]
    rows = []
    # GEMV, 1 token: BN rows per program over num_warps warps; xb: x loaded once per row
    v = lambda bn, ch, nw, **kw: dict(BN=bn, CH=ch, num_warps=nw, split=1, **kw)  # noqa: E731
    gemv_vars = [v(1, 64, 1), v(1, 32, 1), v(2, 64, 2), v(2, 64, 1), v(4, 64, 4), v(4, 64, 4, xb=True),
                 v(2, 64, 2, xb=True), v(1, 128, 1), v(1, 64, 1, asm=False)]
    rows += bench_gemv("qwen3-30b-a3b", m, [1], dev, check=False, configs=gemv_vars, only=("qkv", "o"))
    head_vars = [v(4, 64, 4), v(2, 64, 2), v(1, 64, 1), v(4, 64, 4, xb=True), v(8, 64, 8)]
    rows += bench_gemv("qwen3-30b-a3b", m, [1], dev, check=False, configs=head_vars, only=("head",))
    t8 = [v(1, 64, 1), v(2, 64, 2), v(4, 32, 4), v(4, 64, 4), v(1, 32, 1)]
    rows += bench_gemv("qwen3-30b-a3b", m, [8], dev, check=False, configs=t8, only=("qkv", "o"))
    g = lambda bn, ch, nw, **kw: {"gate_up": dict(BN=bn, CH=ch, num_warps=nw, **kw)}  # noqa: E731
    gu_vars = [g(32, 16, 8), g(32, 16, 8, xb=True), g(32, 32, 8, xb=True), g(32, 16, 16),
               g(32, 8, 8), g(32, 32, 16)]
    rows += bench_moe("qwen3-30b-a3b", m, [1], dev, check=False, configs=gu_vars, stages=("gate_up",))
    dn = lambda bn, ch, nw, **kw: {"down": dict(BN=bn, CH=ch, num_warps=nw, **kw)}  # noqa: E731
    d_vars = [dn(1, 32, 1), dn(1, 16, 1), dn(2, 32, 2), dn(4, 32, 4), dn(2, 16, 1), dn(2, 32, 2, xb=True)]
    rows += bench_moe("qwen3-30b-a3b", m, [1], dev, check=False, configs=d_vars, stages=("down",))
    best = {}
    for r in rows:
        key = (r["kernel"], r["name"], r["tokens"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    print("\nbest per shape:")
    for key, r in best.items():
        print(f"  {key}: {r['us']} us {r['gbps']} GB/s {r['pct']}%  {r['config']}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="results JSON path")
    ap.add_argument("--sweep", action="store_true", help="time launch variants at the Qwen3 shapes")
    ap.add_argument("--tiny", action="store_true", help="toy shapes (a smoke test; CPU interpreter ok)")
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--tokens", nargs="*", type=int, default=[1, 8])
    a = ap.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.time()
    if a.sweep:
        rows = sweep(dev)
    else:
        rows = []
        models = {"tiny": TINY} if a.tiny else {k: MODELS[k] for k in a.models}
        for name, m in models.items():
            rows += bench_gemv(name, m, a.tokens, dev)
            rows += bench_moe(name, m, a.tokens, dev)
    res = {
        "suite": "quant_kernels",
        "machine": platform.node(),
        "gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "command": "python " + " ".join(sys.argv),
        "ceiling_tb_s": CEILING / 1e12,
        "seconds": round(time.time() - t0, 1),
        "rows": rows,
    }
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
