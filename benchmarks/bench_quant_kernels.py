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

``--sweep`` re-tunes the launch choices at the Qwen3 shapes: it times candidate choices
(:data:`GEMV_CANDIDATES`, ... : BN, CH, num_warps, xb; the router's num_warps) of the knobs
``gemv`` (projections, and output heads at N >= :data:`LARGE_N` as their own class),
``moe_gate_up`` (with K split 1, 2 or 4 ways), ``moe_down`` (per token count of
``--tune-tokens``), ``router`` and ``router_fused`` (the decode step's logits + routing launch:
warps and logits per program; per expert count of :data:`ROUTER_EXPERTS`), takes the fastest per point (summed over the shapes of a
class), merges neighbouring points with the same winner into one rule
(:func:`localmoe.kernels.launch_config.tuned_rules`) and prints the rules; ``gemv_split`` is
2 programs per SM, at most 8 ways (not swept). With ``--write-config [FILE]`` it writes them
into the device's file (default ``kernels/configs/<device_key>.json``; an existing file keeps
its other knobs, a new one extends ``default.json``), each rule's ``why`` naming the
measurement. So a new GPU gets its file by running this one script (decode attention's knobs
are tuned by bench_attention.py).

Usage: ``python benchmarks/bench_quant_kernels.py [--out FILE] [--tiny]``, or
``... --sweep [--write-config [FILE]] [--tune-tokens 1 2 4 8] [--tune-knobs gemv router ...]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from localmoe.kernels import launch_config as lc
from localmoe.kernels.fused_moe import fused_moe, fused_moe_ref, moe_down, moe_gate_up
from localmoe.kernels.qtensor import QuantTensor, qtype_id, random_gguf_blocks
from localmoe.kernels.quant_gemv import gemv_config, quant_gemv, quant_gemv_ref, quantize_act
from localmoe.kernels.router import router, router_fused

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
    return time_graph(capture_calls(calls), len(calls), reps)


def warm_calls(calls) -> None:
    """Two eager rounds of ``calls`` on a side stream (compiles, and allocates what they keep),
    then a device sync."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            for f in calls:
                f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()


def capture_calls(calls) -> "torch.cuda.CUDAGraph":
    """``calls`` warmed (:func:`warm_calls`), captured as one CUDA graph and replayed once."""
    warm_calls(calls)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in calls:
            f()
    g.replay()
    torch.cuda.synchronize()
    return g


def time_graph(g, n_calls: int, reps: int = 25) -> float:
    """Median microseconds per call of graph ``g`` holding ``n_calls`` calls, over ``reps``
    replays each timed by its own CUDA events."""
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / n_calls)
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
def gemv_weights(qt, n, k, dev):
    """One ``[n, k]`` weight and row-disjoint copies of it, >= 256 MiB in all on CUDA."""
    w1 = make(qt, (n, k), 1, dev)
    c = max(1, min(32, math.ceil(L2_DEFEAT / w1.nbytes))) if dev == "cuda" else 2
    return w1, copies(make(qt, (c * n, k), 2, dev), n, c)


def bench_gemv(model, m, tokens_list, dev, check=True, configs=None, only=None):
    rows = []
    for name, qt, n, k in gemv_shapes(m):
        if only and name not in only:
            continue
        w1, ws = gemv_weights(qt, n, k, dev)
        c = len(ws)
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
                used = dict(gemv_config(n, k, t, qtype_id(qt), device=dev), **cfg)
                rows.append(row("gemv" if mode == "xq" else "quant+gemv", model, name, qt, (n, k), t,
                                us, ws[0].nbytes, ws[0].ggml_nbytes, config=used))
            if configs is None:
                wf = torch.randn(c * n, k, device=dev, dtype=torch.float16)
                wfs = [wf[i * n:(i + 1) * n] for i in range(c)]
                xf = x.to(torch.float16)
                us = time_calls([lambda w=w: torch.matmul(xf, w.T) for w in wfs])
                rows.append(row("cublas_fp16", model, name, "F16", (n, k), t, us, n * k * 2))
        del ws, w1
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


def moe_weights(m, dev, qtype: str = "Q4_K", slot_table: bool = False):
    """``qtype`` experts of model ``m``: fused gate/up ``[E, 2F, D]``, down ``[E, D, F]``,
    and the slot table the kernels read (the identity), or None as the decode step passes
    while every expert is resident (no table read)."""
    e, f, d = m["e"], m["f"], m["d"]
    gu = QuantTensor.interleave_rows(make(qtype, (e, f, d), 3, dev), make(qtype, (e, f, d), 4, dev))
    slot = torch.arange(e, dtype=torch.int32, device=dev) if slot_table else None
    return gu, make(qtype, (e, d, f), 5, dev), slot


def moe_routings(m, t, gu, wd, dev, gen):
    """Routings of ``t`` tokens for one timed rotation: enough that the weights they read
    exceed the L2 (disjoint expert sets at T=1)."""
    e, f, d, k = m["e"], m["f"], m["d"], m["k"]
    per_call = (2 * f * (gu.nbytes // gu.rows) + d * (wd.nbytes // wd.rows)) * k * t
    r = max(2, min(64, math.ceil(L2_DEFEAT / per_call))) if dev == "cuda" else 2
    if t == 1:
        r = max(r, e // k)
    return [(i.to(dev), w.to(dev)) for i, w in routings(m, t, r, gen)]


def _routing_of(ids: torch.Tensor, n_experts: int):
    """A :class:`Routing` whose logits pick ``ids [T, top_k]`` (softmax, norm_topk_prob)."""
    from localmoe.kernels.router import Routing

    t, k = ids.shape
    lg = torch.full((t, n_experts), -4.0, device=ids.device)
    lg.scatter_(1, ids.long(), (4.0 - 0.1 * torch.arange(k, device=ids.device)).expand(t, k).contiguous())
    return Routing(lg, k, "softmax", True, 1.0, None, torch.empty_like(ids),
                   torch.empty(t, k, device=ids.device))


def bench_moe(model, m, tokens_list, dev, check=True, configs=None, stages=("both", "both_xq"),
              qtype: str = "Q4_K", l2: bool = False, slot_table: bool = False,
              route: bool = False):
    """Rows of the fused MoE (``stages``: ``both`` from float x, ``both_xq`` from int8 blocks,
    ``gate_up`` / ``down`` alone); ``l2``: the gate/up and down launches also timed with their
    weights in L2 (rows ``moe_gate_up_l2`` / ``moe_down_l2``); ``slot_table``: the kernels
    read expert ids through an (identity) slot table, as with offloaded experts; ``route``:
    ``both_xq`` routes from router logits as the decode step does (launch 1 computes the
    top-k), the logits picking each rotation's experts."""
    rows = []
    if l2:
        stages = tuple(stages) + tuple(s for s in ("gate_up", "down") if s not in stages)
    e, f, d, k = m["e"], m["f"], m["d"], m["k"]
    gu, wd, slot = moe_weights(m, dev, qtype, slot_table)
    gen = torch.Generator().manual_seed(0)
    row_gu, row_d = gu.nbytes // gu.rows, wd.nbytes // wd.rows
    grow_gu, grow_d = gu.ggml_nbytes // gu.rows, wd.ggml_nbytes // wd.rows
    for t in tokens_list:
        rts = moe_routings(m, t, gu, wd, dev, gen)
        distinct = [len(set(i.flatten().tolist())) for i, _ in rts]
        nb = statistics.mean(distinct) * (2 * f * row_gu + d * row_d)
        nb_gu = statistics.mean(distinct) * 2 * f * row_gu
        nb_d = statistics.mean(distinct) * d * row_d
        gnb = statistics.mean(distinct) * (2 * f * grow_gu + d * grow_d)
        x = torch.randn(t, d, generator=gen).to(dev, torch.bfloat16)   # (seeded: the twin check)
        if check:
            ids, w = rts[0]
            err = rel(fused_moe(x, gu, wd, ids, w, slot_of=slot), fused_moe_ref(x, gu, wd, ids, w))
            assert err < 1e-2, f"moe {model} T={t}: rel err {err:.2e} vs twin"
        xa = quantize_act(x)
        for cfg in (configs or [None]):
            for stage in stages:
                try:
                    if stage == "both_xq" and route:
                        rls = [_routing_of(i, e) for i, _ in rts]
                        calls = [lambda r=r: fused_moe(xa, gu, wd, None, None, slot_of=slot,
                                                       config=cfg, route=r) for r in rls]
                        nbytes = nb
                    elif stage in ("both", "both_xq"):
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
                    if l2 and stage in ("gate_up", "down"):
                        # each call twice in a row: the second reads its rows from L2, so
                        # 2 * (time per call of the doubled list) - (time of one) is the launch
                        # with its weights already in L2, the bound of any prefetch scheme
                        us2 = 2 * time_calls([c for c in calls for _ in range(2)]) - us
                        rows.append(row(f"moe_{stage}_l2", model, "experts", qtype,
                                        (e, f, d, k), t, us2, int(nbytes), None,
                                        config=cfg or "default",
                                        experts_touched=statistics.mean(distinct)))
                except Exception as ex:
                    print(f"  variant {cfg} {stage} failed: {type(ex).__name__}: {str(ex)[:300]}", flush=True)
                    continue
                kind = {"both": "quant+moe", "both_xq": "moe", "gate_up": "moe_gate_up", "down": "moe_down"}[stage]
                rows.append(row(kind, model, "experts", qtype, (e, f, d, k), t, us, int(nbytes),
                                int(gnb) if stage.startswith("both") else None,
                                config=cfg or "default", experts_touched=statistics.mean(distinct)))
    del gu, wd
    if dev == "cuda":
        torch.cuda.empty_cache()
    return rows


# ---- tuning (--sweep): candidate launch choices, the timer, rules for kernels/configs ----------
def _q(bn, ch, nw, xb=False, stages=1):
    return {"BN": bn, "CH": ch, "num_warps": nw, "xb": xb, "stages": stages}


GEMV_CANDIDATES = [_q(1, 64, 1), _q(1, 32, 1), _q(2, 64, 2), _q(2, 64, 1), _q(4, 64, 4), _q(4, 32, 4),
                   _q(4, 64, 4, True), _q(2, 64, 2, True), _q(1, 128, 1),
                   _q(1, 32, 1, stages=3), _q(2, 32, 2, stages=3), _q(4, 32, 4, stages=3)]
"""``gemv`` candidates for projections (N < LARGE_N): BN rows per program, CH chunks per tile,
warps, xb (x loaded once per row), stages (the K loop's loads pipelined through shared
memory with that many buffers: Triton's ``tl.range(num_stages=)``, cp.async on the GPU)."""
HEAD_CANDIDATES = [_q(4, 64, 4), _q(2, 64, 2), _q(1, 64, 1), _q(4, 64, 4, True), _q(8, 64, 8),
                   _q(4, 32, 4, stages=3), _q(2, 32, 2, stages=3)]
"""``gemv`` candidates for output heads (N >= LARGE_N)."""
GATE_UP_CANDIDATES = [dict(c, split=s, maxnreg=0) for c in (
    _q(32, 16, 8), _q(32, 16, 8, True), _q(32, 32, 8, True), _q(32, 16, 16), _q(32, 8, 8),
    _q(32, 32, 16)) for s in (1,)] + [dict(_q(32, ch, nw, xb), split=s, maxnreg=r)
                                       for s in (2, 4)
                                       for ch, nw, xb in ((16, 8, True), (8, 4, True), (16, 4, False))
                                       for r in ((0, 128, 96) if (s, ch, nw) == (2, 16, 4) else (0,))] + [
    dict(_q(bn, 8, nw), split=4, maxnreg=0) for bn, nw in ((64, 2), (128, 4))] + [
    dict(_q(32, ch, nw, stages=st), split=s, maxnreg=0)
    for ch, nw, s in ((16, 4, 2), (16, 4, 1), (8, 4, 2), (16, 8, 1)) for st in (2, 3)]
"""``moe_gate_up`` candidates: the unsplit tiles, and K split in 2 or 4 parts (more programs
for the few (row block, expert) pairs of one token); ``maxnreg`` caps the registers per
thread (0: the compiler's choice; at 140 registers 3 programs of 4 warps fit an SM, at 128
four); ``stages`` 2-3 pipelines the K loop's loads through shared memory (72 instead of 128
registers for the one-token tile, 46 KB of shared memory). The 64- and 128-row tiles issue
fewer loads per byte (the activations' words are loaded once per chunk of a thread, whatever
its rows): slower at one token, ~6% faster at eight on the H200
(gate_up_candidates_h200-2026-12-04-s19.json)."""
DOWN_CANDIDATES = [dict(_q(bn, ch, nw, xb), experts_tile=False, maxnreg=0) for bn, ch, nw, xb in (
    (1, 32, 1, False), (1, 16, 1, False), (2, 32, 2, False), (4, 32, 4, False), (2, 16, 1, False),
    (2, 32, 2, True))] + [dict(_q(bn, ch, nw), experts_tile=True, maxnreg=r) for bn, ch, nw, r in (
        (1, 8, 1, 0), (2, 8, 2, 0), (4, 8, 4, 0), (4, 16, 4, 0), (4, 16, 4, 128), (4, 16, 4, 96),
        (8, 8, 8, 0), (8, 16, 8, 0), (4, 8, 2, 0))] + [
    dict(_q(bn, ch, nw, stages=st), experts_tile=et, maxnreg=0)
    for bn, ch, nw, et in ((4, 8, 2, True), (4, 8, 4, True), (1, 8, 1, False)) for st in (2, 3)]
"""``moe_down`` candidates: the experts' K loops one after another (unrolled), or the
token's experts as the tile's first dimension (``experts_tile``: every expert's rows are
requested at once); ``stages`` as for gate/up."""
ROUTER_CANDIDATES = [{"num_warps": w} for w in (1, 2, 4, 8)]
ROUTER_EXPERTS = (8, 64, 128, 256)
LARGE_N = 32768
"""Weights with at least this many rows (output heads, vocab rows) are their own GEMV class."""
ROUTER_FUSED_CANDIDATES = [{"num_warps": w, "experts_per_program": eb, "packed_topk": pk}
                           for w in (1, 2, 4, 8) for eb in (1, 2, 4) for pk in (False, True)]
"""``router_fused`` candidates (the decode step's logits + routing launch)."""
TUNED_KNOBS = ("gemv", "moe_gate_up", "moe_down", "router", "router_fused")
TUNE_MODEL = "qwen3-30b-a3b"


class SweepTimer:
    """The sweep's timer: ``timer(knob, case, candidates)`` -> microseconds per call of each
    candidate (None: it failed to compile or run), by :func:`time_calls` (a CUDA graph over
    weights out of the L2); each timing is also kept as a result row in ``rows``.
    Cases: ``gemv`` ``{model, name, qtype, n, k, tokens}``, ``moe_gate_up``/``moe_down``
    ``{model, tokens}`` (Q4_K experts), ``router`` ``{tokens, n_experts, top_k}``,
    ``router_fused`` the same and ``d_model``."""

    def __init__(self, dev):
        self.dev, self.rows, self._cache = dev, [], {}
        self._gen = torch.Generator().manual_seed(0)

    def __call__(self, knob, case, cands):
        fn = {"gemv": self._gemv, "router": self._router,
              "router_fused": self._router_fused}.get(knob, self._moe)
        return fn(knob, case, cands)

    def _weights(self, key, build):
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def _time(self, knob, cand, calls, record):
        try:
            us = time_calls(calls)
        except Exception as ex:  # a candidate that does not compile/run: report, go on
            print(f"  {knob} {cand} failed: {type(ex).__name__}: {str(ex)[:300]}", flush=True)
            return None
        self.rows.append(record(us))
        return us

    def _gemv(self, knob, case, cands):
        qt, n, k, t = case["qtype"], case["n"], case["k"], case["tokens"]
        _, ws = self._weights(("gemv", qt, n, k), lambda: gemv_weights(qt, n, k, self.dev))
        xa = quantize_act(torch.randn(t, k, device=self.dev, dtype=torch.bfloat16))
        outs = [torch.empty(t, n, device=self.dev, dtype=torch.bfloat16) for _ in ws]
        res = []
        for cand in cands:
            cfg = dict(cand, split=1)
            calls = [lambda w=w, o=o, cfg=cfg: quant_gemv(xa, w, out=o, config=cfg) for w, o in zip(ws, outs)]
            res.append(self._time(knob, cand, calls, lambda us, cfg=cfg: row(
                "gemv", case["model"], case["name"], qt, (n, k), t, us, ws[0].nbytes, ws[0].ggml_nbytes,
                config=cfg)))
        return res

    def _moe(self, knob, case, cands):
        m, t = MODELS[case["model"]], case["tokens"]
        gu, wd, slot = self._weights(("moe", case["model"]), lambda: moe_weights(m, self.dev))
        rts = moe_routings(m, t, gu, wd, self.dev, self._gen)
        distinct = statistics.mean(len(set(i.flatten().tolist())) for i, _ in rts)
        if knob == "moe_gate_up":
            xa = quantize_act(torch.randn(t, m["d"], device=self.dev, dtype=torch.bfloat16))
            nbytes = distinct * 2 * m["f"] * (gu.nbytes // gu.rows)

            def calls(c):
                return [lambda i=i: moe_gate_up(xa, gu, i, slot, "silu", c) for i, _ in rts]
        else:
            hs = [quantize_act(torch.randn(t * m["k"], m["f"], device=self.dev)) for _ in rts]
            nbytes = distinct * m["d"] * (wd.nbytes // wd.rows)

            def calls(c):
                return [lambda i=i, w=w, h=h: moe_down(h, wd, i, w, slot, config=c)
                        for (i, w), h in zip(rts, hs)]
        shape = (m["e"], m["f"], m["d"], m["k"])
        return [self._time(knob, c, calls(c), lambda us, c=c: row(
            knob, case["model"], "experts", "Q4_K", shape, t, us, int(nbytes), config=c,
            experts_touched=distinct)) for c in cands]

    def _router_fused(self, knob, case, cands):
        t, e, k, d = case["tokens"], case["n_experts"], case["top_k"], case["d_model"]
        n = 64 if self.dev == "cuda" else 2      # weights out of the L2 between calls
        ws = [torch.randn(e, d, device=self.dev).t() for _ in range(n)]   # expert-major
        h = torch.randn(t, d, device=self.dev)
        return [self._time(knob, c, [lambda w=w, c=c: router_fused(h, w, k, config=c) for w in ws],
                           lambda us, c=c: row("router_fused", "-", f"E={e}", "F32", (e, d), t, us,
                                               e * d * 4, config=c, top_k=k)) for c in cands]

    def _router(self, knob, case, cands):
        t, e, k = case["tokens"], case["n_experts"], case["top_k"]
        logits = [torch.randn(t, e, device=self.dev) for _ in range(64 if self.dev == "cuda" else 2)]
        return [self._time(knob, c, [lambda x=x, c=c: router(x, k, config=c) for x in logits],
                           lambda us, c=c: row("router", "-", f"E={e}", "F32", (t, e), t, us, t * e * 4,
                                               config=c, top_k=k)) for c in cands]


def _points(timer, knob, values, cases_at, cands):
    """``(value, [(candidate, us summed over the cases at value)])`` per value."""
    points = []
    for v in values:
        total = [0.0] * len(cands)
        for case in cases_at(v):
            for i, us in enumerate(timer(knob, case, cands)):
                total[i] = None if us is None or total[i] is None else total[i] + us
        points.append((v, list(zip(cands, total))))
    return points


def tune(timer, tokens=(1, 2, 4, 8), knobs=TUNED_KNOBS, device="", n_sm=132, model=TUNE_MODEL):
    """Launch rules (knob -> rule list, the layout of kernels/configs) from ``timer``'s timings
    (:class:`SweepTimer`, or a fake in the tests) of the candidates at ``model``'s shapes:
    ``gemv`` per token count of ``tokens`` for the projections and, as a class of their own
    (N >= LARGE_N), the output head; ``gemv_split`` 2 programs per SM of ``n_sm``;
    ``moe_gate_up``/``moe_down`` per token count; ``router`` per expert count of
    :data:`ROUTER_EXPERTS`. ``device`` names the GPU in the rules' ``why``."""
    m = MODELS[model]
    ctx = f"{device} {datetime.date.today()}, bench_quant_kernels.py --sweep: "
    tokens = sorted(tokens)
    out = {}
    if "gemv" in knobs:
        out["gemv"] = []
        for cands, when in ((HEAD_CANDIDATES, {"n": {"min": LARGE_N}}), (GEMV_CANDIDATES, None)):
            shapes = [s for s in gemv_shapes(m) if (s[2] >= LARGE_N) == (when is not None)]
            if not shapes:
                continue
            label = model + " " + " + ".join(f"{nm} {n}x{k} {qt}" for nm, qt, n, k in shapes)
            pts = _points(timer, "gemv", tokens, lambda t, shapes=shapes: [
                dict(model=model, name=nm, qtype=qt, n=n, k=k, tokens=t) for nm, qt, n, k in shapes],
                cands)
            out["gemv"] += lc.tuned_rules("gemv", "tokens", pts, label, when=when,
                                          fallback=when is None, context=ctx)
        out["gemv_split"] = [{"min_programs": 2 * n_sm, "max_split": 8, "why": (
            f"{ctx}small N: K split until 2 programs per SM ({n_sm} SMs), at most 8 ways (not swept)")}]
    for knob, cands in (("moe_gate_up", GATE_UP_CANDIDATES), ("moe_down", DOWN_CANDIDATES)):
        if knob in knobs:
            label = f"{model} experts Q4_K ({m['e']} x {m['f']} x {m['d']}, top-{m['k']})"
            pts = _points(timer, knob, tokens, lambda t: [dict(model=model, tokens=t)], cands)
            out[knob] = lc.tuned_rules(knob, "tokens", pts, label, context=ctx)
    if "router" in knobs:
        pts = _points(timer, "router", ROUTER_EXPERTS, lambda e: [
            dict(tokens=1, n_experts=e, top_k=max(1, min(8, e // 2)))], ROUTER_CANDIDATES)
        out["router"] = lc.tuned_rules("router", "n_experts", pts, "router, 1 token, top-k min(8, E/2)",
                                       context=ctx)
    if "router_fused" in knobs:
        pts = _points(timer, "router_fused", ROUTER_EXPERTS, lambda e: [
            dict(tokens=1, n_experts=e, top_k=max(1, min(8, e // 2)), d_model=m["d"])],
            ROUTER_FUSED_CANDIDATES)
        out["router_fused"] = lc.tuned_rules(
            "router_fused", "n_experts", pts,
            f"fused router logits + routing, 1 token, d_model {m['d']}, top-k min(8, E/2)",
            context=ctx)
    return out


def run_sweep(dev, tokens, knobs, write_config=None):
    """Re-tune on ``dev`` (prints the rules; ``write_config``: a path, or "auto" for
    kernels/configs/<device_key>.json, to write them to). Returns (result rows, rules)."""
    cuda = dev == "cuda"
    name = torch.cuda.get_device_name() if cuda else "cpu (interpreter)"
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count if cuda else 132
    timer = SweepTimer(dev)
    rules = tune(timer, tokens, knobs, name, n_sm)
    print("\ntuned rules:\n" + lc.format_config(rules), flush=True)
    if write_config:
        path = (lc.CONFIG_DIR / f"{lc.device_key(name)}.json" if write_config == "auto"
                else Path(write_config))
        lc.write_config(path, rules, about=(
            f"Launch choices tuned on {name} by benchmarks/bench_quant_kernels.py --sweep "
            f"--write-config ({datetime.date.today()}); knobs not given here come from default.json."))
        print(f"wrote {path}", flush=True)
    return timer.rows, rules

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="results JSON path")
    ap.add_argument("--sweep", action="store_true",
                    help="re-tune the launch choices (kernels/configs) at the Qwen3 shapes")
    ap.add_argument("--write-config", nargs="?", const="auto", default=None, metavar="FILE",
                    help="with --sweep: write the tuned rules into FILE (default: "
                         "kernels/configs/<device>.json; an existing file keeps its other knobs)")
    ap.add_argument("--tune-tokens", nargs="*", type=int, default=[1, 2, 4, 8],
                    help="token counts the sweep times (default 1 2 4 8)")
    ap.add_argument("--tune-knobs", nargs="*", default=list(TUNED_KNOBS), choices=TUNED_KNOBS,
                    help="knobs the sweep tunes (default all)")
    ap.add_argument("--tiny", action="store_true", help="toy shapes (a smoke test; CPU interpreter ok)")
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--tokens", nargs="*", type=int, default=[1, 8])
    ap.add_argument("--expert-qtypes", nargs="*", default=["Q4_K"], metavar="QTYPE",
                    help="GGUF types of the timed experts (default Q4_K, as in a Q4_K_M file; "
                         "e.g. IQ4_XS Q3_K Q2_K)")
    ap.add_argument("--slot-table", action="store_true",
                    help="the MoE kernels read expert ids through a slot table (as with "
                         "offloaded experts) instead of the identity the decode step passes")
    ap.add_argument("--route", action="store_true",
                    help="the MoE from router logits (launch 1 routes, as in the decode step)")
    ap.add_argument("--moe-only", action="store_true", help="skip the GEMV rows")
    ap.add_argument("--l2", action="store_true",
                    help="also time each MoE launch alone, cold and with its weights in L2 (what a "
                         "prefetch of the down rows during gate/up could reach)")
    a = ap.parse_args(argv)
    if a.write_config and not a.sweep:
        ap.error("--write-config needs --sweep")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.time()
    rules = None
    if a.sweep:
        rows, rules = run_sweep(dev, a.tune_tokens, a.tune_knobs, a.write_config)
    else:
        rows = []
        models = {"tiny": TINY} if a.tiny else {k: MODELS[k] for k in a.models}
        for name, m in models.items():
            if not a.moe_only:
                rows += bench_gemv(name, m, a.tokens, dev)
            for qt in a.expert_qtypes:
                rows += bench_moe(name, m, a.tokens, dev, qtype=qt.upper(), l2=a.l2,
                                  slot_table=a.slot_table, route=a.route,
                                  stages=("both_xq",) if a.route else ("both", "both_xq"))
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
    if rules is not None:
        res["tuned_rules"] = rules
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
