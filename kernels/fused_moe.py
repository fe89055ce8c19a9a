"""Fused MoE for decode (1-8 tokens): two launches over GGUF-quantized stacked experts.

For every token ``t`` and each of its ``top_k`` routed experts ``e = topk_ids[t, j]``:
``h = act(x[t] @ W_gate[e].T) * (x[t] @ W_up[e].T)`` and
``out[t] = sum_j topk_weights[t, j] * (h_j @ W_down[e_j].T)``
(``act`` = SiLU, or GELU-tanh for GeGLU families).

* Launch 1 (:func:`_moe_gate_up_kernel`, :func:`moe_gate_up`), grid ``(cdiv(F, BN), T*top_k)``:
  one program per (row block, token, routed expert) reads ``BN`` gate rows and the ``BN``
  matching up rows (adjacent in the fused ``[E, 2F, D]`` tensor of
  :meth:`QuantTensor.interleave_rows`: row ``2f`` = gate ``f``, ``2f+1`` = up ``f``, so a
  program streams one contiguous range), computes both with the integer-dot tile of
  :mod:`localmoe.kernels.quant_gemv`, and writes ``h = act(gate) * up`` already quantized
  (a :class:`QuantAct` ``[T*top_k, F]``: ``BN`` is a multiple of 32, so each program owns
  whole int8 blocks of h). With ``split`` S > 1 the grid gains a third axis: S programs share
  a row block's K range, each stores its partial sums in a float32 scratch slice, and the last
  of them to finish (an acq_rel counter per row block) adds the S slices in slice order
  (deterministic whatever the finishing order), finishes the block as above and resets the
  counter: S times the programs for the few (row block, expert) pairs of one token. Off (S = 1)
  in the H200 table until measured (``benchmarks/bench_quant_kernels.py --sweep`` tries 2 and 4).
* Launch 2 (:func:`_moe_down_kernel`, :func:`moe_down`), grid ``(cdiv(D, BN), T)``: one
  program per (row block, token) walks the token's ``top_k`` experts (unrolled, so their
  id -> slot -> weight loads overlap), computes ``BN`` rows of each down GEMV and accumulates
  them weighted by the routing weights in registers (no atomics, no zeroing, deterministic),
  then writes ``out [T, D]`` once. With ``experts_tile`` the token's experts are instead the
  first dimension of one ``[top_k, BN, CH, 4]`` tile (padded to a power of two), so every
  expert's rows are requested together rather than one expert's K loop after another: at one
  token on the H200 8.38 against 9.49 us for Qwen3-30B-A3B (the H200 table's rule for
  ``d_ff <= 1024``; more tokens keep the loop, 36.75 against 43.30 us at 8).

With ``route`` (a :class:`localmoe.kernels.router.Routing`: the router logits from
:func:`localmoe.kernels.router.norm_router_logits`) launch 1 also routes: every program
computes its token's top-k from the logits (softmax gating without a selection bias: one
bitonic top-k, :func:`_route_top`; otherwise the router's own
:func:`localmoe.kernels.router.route_pick`) and the token's first program writes the ids and
weights launch 2 reads. The router kernel then ends with its logits: its counter and the
last program's read-back of the logits (two round trips to L2) leave the decode step's
critical path. Measured on the H200 (``benchmarks/results/moe_route_h200-2026-12-04-s21.json``):
the router kernel 7.0 -> 2.8 us per layer, the gate/up launch +1.3 us (the top-k; +2.3 with
``route_pick``'s eight reductions), the Qwen3-30B-A3B decode graph 1.992 -> 1.845 ms.

``x`` comes as a :class:`QuantAct` (from the kernel that produces it, e.g. the router/norm
kernel of the decode step) or as floats (then :func:`fused_moe` adds one ``quantize_act``
launch). Expert ids are read on the device, through ``slot_of[e]`` (int32 ``[n_experts]``:
the slot of expert ``e`` in the stacked tensors, the offload manager's seam), or with
``slot_of=None`` (every expert resident in its own slot, what the decode step passes today)
as slot ``e`` itself, without that dependent load: nothing on the host looks at the routing.
Only the routed experts' rows are read.
Weight layout: :mod:`localmoe.kernels.qtensor` planes (ggml block formats).

Measured on the H200 (benchmarks/results/quant_kernels_h200-2026-12-02.json, Q4_K experts,
CUDA graph, routings rotating over disjoint experts): Qwen3-30B-A3B 1 token 22.5 us for the
20.8 MiB of its 8 experts (23% of 4.27 TB/s; launch 1 ~13.6 us, launch 2 ~9.4 us), OLMoE 30%,
Mixtral 43%; 8 tokens 22-32%. Both launches are latency-bound: launch 1 has only
``T*top_k*F/32`` programs (192 for Qwen3) of 64 rows, each starting with a serial
id -> slot -> weights chain, and Triton does not pipeline the K loop's loads.

A register cap (``maxnreg``, on either launch) measured no faster (gate/up 11.73 -> 11.95 us at
128 registers; quant_tune_h200-2026-12-03-s13c.json). ncu of gate/up at one token
(quant_tune_h200-2026-12-03-s13.json): 140 registers, 3 programs of 4 warps per SM (18.75%
occupancy), DRAM 21% of peak, 59% of the stall cycles waiting on L1TEX loads: latency-bound
on the many small scale loads of the K-quant planes.

Tried and dropped (session 25, ``benchmarks/results/moe_pfdown_h200-2026-12-05-s25.json``):
launch 1's programs asking L2 for their expert's down rows (``prefetch.global.L2``, before or
after their K loop), so that launch 2 reads L2 (its bound, weights already in L2: 7.03 ->
5.81 us at one token). Both launches at one token 17.53 -> 18.46 us (before) / 17.82 (after),
at 8 tokens 89.9 -> 98.2 / 98.4; the Qwen3 decode graph 1.857-1.861 -> 1.910-1.912 /
1.878-1.882 ms. Like sessions 16 and 21's prefetches: the extra requests delay the running
launch's own loads more than the next launch gains.

Also tried and dropped (session 28, ``pdl_early_h100-2026-12-05-s28.json``,
``moe_one_launch-2026-12-05-s28.json``): launch 2 started while launch 1 runs (launch 1
signalling PDL right after its wait, launch 2 routing again from the logits and prefetching
its rows before its own wait): both launches at one token 18.68 -> 22.1-23.1 us, the decode
graph +153 us (H100); and the one-token MoE as one launch (work items by an atomic ticket or
statically, the down items waiting on a counter for all of h): 17.5 -> 25.2-25.8 us (H200).
At one token launch 1's 384 programs of ~128-140 registers fill the SMs (3 per SM).

Where the time goes, program by program (``trace``: :mod:`localmoe.kernels.trace` stamps,
``benchmarks/trace_moe.py``; ``benchmarks/results/moe_trace_h100-2026-12-05-s29.json``, H100,
Qwen3-30B-A3B at one token, 18.6 us): gate/up's 384 programs route for 1.5 us, run their two
K tiles for 7.3 us (58% of the H100's copy rate while they load), store and count their
parts for 0.7 us and combine for 1.1 us; down starts 0.58 us after gate/up's last exit and its
three K tiles take 5.1 us (41%). Launching down before gate/up has drained (PDL signalled
after the K loop) placed its programs unevenly and was 2 us slower.

Launch choices (BN, CH, warps, xb of each launch) come from the ``moe_gate_up`` and
``moe_down`` knobs of ``kernels/configs/<device>.json`` (:mod:`localmoe.kernels.launch_config`,
tuned by ``benchmarks/bench_quant_kernels.py --sweep --write-config``): :func:`moe_config`.
The twin is :func:`fused_moe_ref` (float32, from ``QuantTensor.dequantize`` of the routed
experts).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from localmoe.kernels.host import cdiv, next_pow2
from localmoe.kernels.keys import PAD_KEY, key_low, key_score, score_key
from localmoe.kernels.launch_config import device_table
from localmoe.kernels.pdl import pdl_args, pdl_begin
from localmoe.kernels.router import GATING, Routing, route_pick
from localmoe.kernels.qtensor import QUANT_QTYPES, QTYPE_NAMES, QuantTensor, chunk_values
from localmoe.kernels.scratch import grown
from localmoe.kernels.trace import RECORD, RECORD_C, stamp, stamp_end
from localmoe.kernels.quant_gemv import (
    QuantAct, _qk_loop, _x_rows, dequantize_act, lookahead_arg, pack_store_blocks, plane_args,
    quantize_act, quantize_act_ref, use_asm, wide_default,
)

__all__ = ["fused_moe", "fused_moe_ref", "moe_gate_up", "moe_down", "moe_config", "moe_programs",
           "ACTIVATIONS"]

ACTIVATIONS = {"silu": 0, "gelu": 1}


def moe_config(stage: str, tokens: int, top_k: int, n_experts: int, d_model: int, d_ff: int,
               qtype: int, device=None) -> dict:
    """Launch choice of one launch of :func:`fused_moe` (``stage`` ``"gate_up"`` or ``"down"``)
    for ``tokens`` tokens routed to ``top_k`` of ``n_experts`` experts of width ``d_model`` and
    ``d_ff`` (per expert), weights of GGUF type ``qtype``, on ``device`` (a torch device or its
    name; None: the table of a CUDA device without a file of its own, the H200's): ``BN`` rows
    per program (gate_up: a multiple of 32, so launch 1 writes h as int8 blocks), ``CH``
    chunks per tile, ``num_warps``, ``xb``, ``stages``, ``maxnreg``, ``split`` (gate_up) or
    ``experts_tile`` (down), and ``lookahead`` where the rule sets it (the next K tile's loads
    issued before this tile's dots), from the ``moe_gate_up`` / ``moe_down`` knob of the
    device's launch table (:mod:`localmoe.kernels.launch_config`)."""
    return device_table(device).lookup(
        f"moe_{stage}", tokens=tokens, top_k=top_k, n_experts=n_experts, d_model=d_model,
        d_ff=d_ff, qtype=QTYPE_NAMES[qtype])


@triton.jit
def _moe_gate_up_kernel(xq_ptr, xs_ptr, hq_ptr, hs_ptr, ids_ptr, slot_ptr,
                        q_ptr, qh_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr, p_ptr, cnt_ptr,
                        lg_ptr, rb_ptr, rw_ptr, tr_ptr,
                        F, n_chunks, split_chunks, xq_rs, xs_rs, hq_rs, hs_rs,
                        q_rs, qh_rs, d_rs, dm_rs, sc_rs, mn_rs, p_ss, p_rs, E, lg_rs, rscale,
                        TOP_K: tl.constexpr, QTYPE: tl.constexpr, CV: tl.constexpr,
                        BN: tl.constexpr, CH: tl.constexpr, ACT: tl.constexpr,
                        EVEN: tl.constexpr, XB: tl.constexpr, USE_ASM: tl.constexpr,
                        SPLIT: tl.constexpr, PDL: tl.constexpr, WIDE: tl.constexpr = False,
                        STAGES: tl.constexpr = 1, ROUTE: tl.constexpr = False,
                        EP: tl.constexpr = 1, KP: tl.constexpr = 1, GATE: tl.constexpr = 0,
                        HAS_BIAS: tl.constexpr = False, NORM: tl.constexpr = False,
                        PACKED: tl.constexpr = True, SLOTS: tl.constexpr = True,
                        TRACE: tl.constexpr = False, LOOKAHEAD: tl.constexpr = False):
    pid_n = tl.program_id(0)
    pid = tl.program_id(1)               # t * TOP_K + j
    if TRACE:   # one record per program (localmoe.kernels.trace): entry, waited, routed, ...
        rec = tr_ptr + ((pid_n * tl.num_programs(1) + pid) * tl.num_programs(2)
                        + tl.program_id(2)).to(tl.int64) * RECORD_C
        stamp(rec, 0, pid_n)
    pdl_begin(PDL)
    if TRACE:
        stamp(rec, 1, pid_n)
    t = pid // TOP_K
    if ROUTE:
        # the token's routing from its logits, in every program; the first program of the
        # token writes the ids and weights for launch 2
        ee = tl.arange(0, EP)
        em = ee < E
        lg = tl.load(lg_ptr + t.to(tl.int64) * lg_rs + ee, mask=em, other=float("-inf"))
        kk = tl.arange(0, KP)
        lead = pid_n + tl.program_id(2) + (pid - t * TOP_K)     # 0: the token's first program
        if GATE == 0 and not HAS_BIAS:
            top = _route_top(lg, ee, em, EP, KP)
            r_ids = tl.where(kk < TOP_K, (EP - 1) - key_low(top), 0)
        else:   # sigmoid gating or a selection bias: the router's own selection loop
            r_ids, r_wts = route_pick(lg, ee, em, rb_ptr, rscale, EP, TOP_K, KP, GATE,
                                      HAS_BIAS, NORM, PACKED)
        e = tl.sum(tl.where(kk == pid - t * TOP_K, r_ids, 0), axis=0)
        if lead == 0:
            if GATE == 0 and not HAS_BIAS:   # only the program that stores them: the weights
                r_wts = _route_weights(lg, top, KP, NORM, rscale, TOP_K)
            tl.store(ids_ptr + t * TOP_K + kk, r_ids, mask=kk < TOP_K)
            tl.store(rw_ptr + t * TOP_K + kk, r_wts, mask=kk < TOP_K)
    else:
        e = tl.load(ids_ptr + pid)
    if TRACE:
        stamp(rec, 2, e)
    slot = _slot(slot_ptr, e, e >= 0, SLOTS)
    loc = pid_n * (2 * BN) + tl.arange(0, 2 * BN)      # rows of the fused [2F] gate/up block
    rmask4 = (loc < 2 * F)[None, :, None, None]
    rows4 = (slot * (2 * F) + loc)[None, :, None, None]
    tt = tl.zeros([1], dtype=tl.int32) + t
    tmask4 = (tt >= 0)[:, None, None, None]
    xb4, xsb4 = _x_rows(xq_rs, xs_rs, tt, rows4, XB)
    acc = tl.zeros([1, 2 * BN, CH, 1], dtype=tl.float32)
    c_begin = tl.program_id(2) * split_chunks
    c_end = tl.minimum(c_begin + split_chunks, n_chunks)
    acc = _qk_loop(acc, c_begin, c_end, rows4, rmask4, tmask4, xq_ptr, xs_ptr, xb4, xsb4,
                   q_ptr, qh_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr,
                   q_rs, qh_rs, d_rs, dm_rs, sc_rs, mn_rs, QTYPE, CV, CH, EVEN, USE_ASM,
                   WIDE, STAGES, LOOKAHEAD)
    gu = tl.sum(tl.sum(acc, axis=3), axis=2)                 # [1, 2BN]
    if TRACE:
        stamp(rec, 3, tl.sum(gu).to(tl.int32, bitcast=True))
    if SPLIT > 1:
        # split-K: every K part stores its partial sums in its slice of the scratch; the last
        # part of this (row block, token, expert) to finish (an acq_rel counter; the barrier
        # orders the program's stores before it) adds the slices in slice order (the result
        # does not depend on which part finished last), finishes the block and resets the
        # counter for the next launch
        row = pid.to(tl.int64)
        lp = p_ptr + row * p_rs + loc[None, :]
        lm = (loc < 2 * F)[None, :]
        tl.store(lp + tl.program_id(2).to(tl.int64) * p_ss, gu, mask=lm)
        tl.debug_barrier()
        cp = cnt_ptr + pid * tl.num_programs(0) + pid_n
        old = tl.atomic_add(cp, 1, sem="acq_rel")
        if TRACE:
            stamp_end(rec, 4, old)     # (stamp 5: the part that combines)
        if old == SPLIT - 1:
            gu = tl.zeros([1, 2 * BN], dtype=tl.float32)
            for k in tl.static_range(SPLIT):
                gu += tl.load(lp + k * p_ss, mask=lm, other=0.0, cache_modifier=".cg")
            _gate_up_epilogue(gu, pid, pid_n, F, hq_ptr, hs_ptr, hq_rs, hs_rs, BN, ACT, WIDE)
            tl.atomic_xchg(cp, 0)
            if TRACE:
                stamp(rec, 5, tl.sum(gu).to(tl.int32, bitcast=True))
    else:
        _gate_up_epilogue(gu, pid, pid_n, F, hq_ptr, hs_ptr, hq_rs, hs_rs, BN, ACT, WIDE)
        if TRACE:
            stamp_end(rec, 4, tl.sum(gu).to(tl.int32, bitcast=True))


@triton.jit
def _slot(slot_ptr, e, mask, SLOTS: tl.constexpr):
    """int64 slot of expert ``e`` in the stacked tensors: ``slot_of[e]`` (a dependent load
    before the weights' loads), or ``e`` itself without ``SLOTS`` (every expert resident in
    its own slot: the identity table, not read)."""
    if SLOTS:
        s = tl.load(slot_ptr + e, mask=mask, other=0).to(tl.int64)
    else:
        s = tl.where(mask, e, 0).to(tl.int64)
    return s


@triton.jit
def _route_top(x, e, em, EP: tl.constexpr, KP: tl.constexpr):
    """The ``KP`` largest packed keys (:mod:`localmoe.kernels.keys`, low word ``EP - 1 -
    expert``: ties to the lower expert) of one token's logits ``x [EP]`` (padding masked by
    ``em``), in descending order: one bitonic top-k (``tl.topk``, whose last merge leaves
    its ``KP`` keys sorted; session 31 dropped the second sort of them, 53 instructions at
    the head of every gate/up program on sm_90). The routing of
    :func:`localmoe.kernels.router.route_pick` (softmax gating, no selection bias)."""
    key = tl.where(em, score_key(x, EP - 1 - e), PAD_KEY)
    return tl.topk(key, KP)


@triton.jit
def _route_weights(x, top, KP: tl.constexpr, NORM: tl.constexpr, scale, TOP_K: tl.constexpr):
    """Softmax weights ``exp(x - max) / sum`` (over all of ``x [EP]``) of the experts picked
    in ``top`` (:func:`_route_top`; ``[KP]``, 0 past ``TOP_K``), renormalized over the picks
    with ``NORM`` (norm_topk_prob), times ``scale``; float32."""
    kk = tl.arange(0, KP)
    m = tl.max(x, axis=0)
    ssum = tl.sum(tl.exp(x - m), axis=0)
    wts = tl.where(kk < TOP_K, tl.exp(key_score(top) - m) / ssum, 0.0)
    if NORM:
        wts = wts / tl.maximum(tl.sum(wts, axis=0), 1.1754943508222875e-38)
    return wts * scale


@triton.jit
def _gate_up_epilogue(gu, pid, pid_n, F, hq_ptr, hs_ptr, hq_rs, hs_rs,
                      BN: tl.constexpr, ACT: tl.constexpr, WIDE: tl.constexpr = False):
    """h = act(gate) * up of the ``2*BN`` interleaved sums ``gu [1, 2BN]``, quantized like
    quantize_act: the program owns BN/32 whole 32-value blocks of row ``pid`` of h."""
    g, u = tl.split(tl.reshape(gu, [BN, 2]))
    if ACT == 0:   # SiLU (exponent clamped: silu(g < -80) is 0 to float32 anyway)
        a = g / (1.0 + tl.exp(tl.minimum(-g, 80.0)))
    else:  # GELU, tanh approximation: tanh(z) = 2*sigmoid(2z) - 1
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = g / (1.0 + tl.exp(tl.minimum(-2.0 * z, 80.0)))
    NB: tl.constexpr = BN // 32
    hv = tl.reshape(a * u, [NB, 2, 4, 4])                   # [block, slice, word, byte]
    b4 = (pid_n * NB + tl.arange(0, NB))[:, None, None, None]
    row = pid.to(tl.int64)
    pack_store_blocks(hv, b4, b4 * 32 < F, hq_ptr + row * hq_rs, hs_ptr + row * hs_rs, WIDE)


@triton.jit
def _moe_down_kernel(hq_ptr, hs_ptr, out_ptr, ids_ptr, wts_ptr, slot_ptr,
                     q_ptr, qh_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr, tr_ptr,
                     D, n_chunks, hq_rs, hs_rs, out_rs,
                     q_rs, qh_rs, d_rs, dm_rs, sc_rs, mn_rs,
                     TOP_K: tl.constexpr, QTYPE: tl.constexpr, CV: tl.constexpr,
                     BN: tl.constexpr, CH: tl.constexpr, EVEN: tl.constexpr, XB: tl.constexpr,
                     USE_ASM: tl.constexpr, PDL: tl.constexpr, ET: tl.constexpr = False,
                     TKP: tl.constexpr = 1, WIDE: tl.constexpr = False,
                     STAGES: tl.constexpr = 1, SLOTS: tl.constexpr = True,
                     TRACE: tl.constexpr = False, LOOKAHEAD: tl.constexpr = False):
    pid_n = tl.program_id(0)
    t = tl.program_id(1)
    if TRACE:   # one record per program (localmoe.kernels.trace): entry, waited, ids, ...
        rec = tr_ptr + (pid_n * tl.num_programs(1) + t).to(tl.int64) * RECORD_C
        stamp(rec, 0, pid_n)
    pdl_begin(PDL)
    if TRACE:
        stamp(rec, 1, pid_n)
    loc = pid_n * BN + tl.arange(0, BN)
    rmask4 = (loc < D)[None, :, None, None]
    loc4 = loc[None, :, None, None]
    op = out_ptr + t.to(tl.int64) * out_rs + loc[None, :]
    if ET:
        # the token's experts are the tile's first dimension [TKP, BN, CH, 4|1]: one load of
        # ids, weights and slots, then every expert's weight rows are requested in the same
        # tile (with an unrolled loop over experts, each expert's K loop waits for its own
        # loads before the next expert's are issued)
        jj = tl.arange(0, TKP)
        jm = jj < TOP_K
        pidv = t * TOP_K + jj
        e = tl.load(ids_ptr + pidv, mask=jm, other=0)
        wgt = tl.load(wts_ptr + pidv, mask=jm, other=0.0).to(tl.float32)
        if TRACE:
            stamp(rec, 2, tl.sum(e))
        slot = _slot(slot_ptr, e, jm, SLOTS)
        rows4 = slot[:, None, None, None] * D + loc4
        tmask4 = jm[:, None, None, None]
        xb4, xsb4 = _x_rows(hq_rs, hs_rs, pidv, rows4, XB)
        acc = tl.zeros([TKP, BN, CH, 1], dtype=tl.float32)
        acc = _qk_loop(acc, 0, n_chunks, rows4, rmask4 & tmask4, tmask4, hq_ptr, hs_ptr,
                       xb4, xsb4, q_ptr, qh_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr,
                       q_rs, qh_rs, d_rs, dm_rs, sc_rs, mn_rs, QTYPE, CV, CH, EVEN, USE_ASM,
                       WIDE, STAGES, LOOKAHEAD)
        y = tl.sum(tl.sum(acc, axis=3), axis=2)                  # [TKP, BN]
        total = tl.sum(wgt[:, None] * y, axis=0, keep_dims=True)  # [1, BN]
    else:
        total = _down_experts_unrolled(
            hq_ptr, hs_ptr, ids_ptr, wts_ptr, slot_ptr, q_ptr, qh_ptr, d_ptr, dm_ptr,
            sc_ptr, mn_ptr, t, D, loc4, rmask4, n_chunks, hq_rs, hs_rs,
            q_rs, qh_rs, d_rs, dm_rs, sc_rs, mn_rs, TOP_K, QTYPE, CV, BN, CH, EVEN, XB, USE_ASM,
            WIDE, STAGES, SLOTS, LOOKAHEAD)
    if TRACE:
        stamp(rec, 3, tl.sum(total).to(tl.int32, bitcast=True))
    tl.store(op, total.to(out_ptr.dtype.element_ty), mask=(loc < D)[None, :])
    if TRACE:
        stamp_end(rec, 4, tl.sum(total).to(tl.int32, bitcast=True))


@triton.jit
def _down_experts_unrolled(hq_ptr, hs_ptr, ids_ptr, wts_ptr, slot_ptr, q_ptr, qh_ptr,
                           d_ptr, dm_ptr, sc_ptr, mn_ptr, t, D, loc4, rmask4, n_chunks,
                           hq_rs, hs_rs, q_rs, qh_rs, d_rs, dm_rs, sc_rs, mn_rs,
                           TOP_K: tl.constexpr, QTYPE: tl.constexpr, CV: tl.constexpr,
                           BN: tl.constexpr, CH: tl.constexpr, EVEN: tl.constexpr,
                           XB: tl.constexpr, USE_ASM: tl.constexpr, WIDE: tl.constexpr = False,
                           STAGES: tl.constexpr = 1, SLOTS: tl.constexpr = True,
                           LOOKAHEAD: tl.constexpr = False):
    """The weighted sum ``[1, BN]`` of the token's experts, one expert's K loop after another."""
    total = tl.zeros([1, BN], dtype=tl.float32)
    # the experts' loops are unrolled: their id -> slot -> weight loads do not wait on each other
    for j in tl.static_range(TOP_K):
        pid = t * TOP_K + j
        e = tl.load(ids_ptr + pid)
        wgt = tl.load(wts_ptr + pid).to(tl.float32)
        slot = _slot(slot_ptr, e, e >= 0, SLOTS)
        rows4 = slot * D + loc4
        tt = tl.zeros([1], dtype=tl.int32) + pid
        tmask4 = (tt >= 0)[:, None, None, None]
        xb4, xsb4 = _x_rows(hq_rs, hs_rs, tt, rows4, XB)
        acc = tl.zeros([1, BN, CH, 1], dtype=tl.float32)
        acc = _qk_loop(acc, 0, n_chunks, rows4, rmask4, tmask4, hq_ptr, hs_ptr,
                       xb4, xsb4, q_ptr, qh_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr,
                       q_rs, qh_rs, d_rs, dm_rs, sc_rs, mn_rs, QTYPE, CV, CH, EVEN, USE_ASM,
                       WIDE, STAGES, LOOKAHEAD)
        total += wgt * tl.sum(tl.sum(acc, axis=3), axis=2)
    return total


def _check(x, w_gate_up, w_down, topk_ids, topk_weights, slot_of):
    if len(w_gate_up.shape) != 3 or len(w_down.shape) != 3:
        raise ValueError(f"fused_moe: stacked experts must be 3-D, got {w_gate_up.shape} and {w_down.shape}")
    e, f2, d = w_gate_up.shape
    e2, d2, f = w_down.shape
    if f2 != 2 * f or d2 != d or e2 != e:
        raise ValueError(f"fused_moe: gate/up [E, 2F, D] = {w_gate_up.shape} and down [E, D, F] = "
                         f"{w_down.shape} do not fit")
    for w in (w_gate_up, w_down):
        if w.qtype not in QUANT_QTYPES:
            raise ValueError(f"fused_moe: experts in {QTYPE_NAMES.get(w.qtype, w.qtype)} are not "
                             "supported by the kernel (quantized types only)")
    if isinstance(x, QuantAct):
        if x.shape[1] != d or x.d.shape != (x.q.shape[0], d // 32):
            raise ValueError(f"fused_moe: quantized x must be q [T, {d // 4}], d [T, {d // 32}]")
    elif x.dim() != 2 or x.shape[1] != d or x.stride(1) != 1:
        raise ValueError(f"fused_moe: x must be [T, {d}] with contiguous rows, got {tuple(x.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe: topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [T, top_k] with T = {x.shape[0]}")
    if slot_of is not None and (slot_of.dim() != 1 or slot_of.dtype != torch.int32):
        raise ValueError("fused_moe: slot_of must be int32 [n_experts]")
    for name, t in (("topk_ids", topk_ids), ("w_gate_up", w_gate_up), ("w_down", w_down)):
        if t.device != x.device:
            raise ValueError(f"fused_moe: {name} on {t.device}, x on {x.device}")


def fused_moe(x: torch.Tensor | QuantAct, w_gate_up: QuantTensor, w_down: QuantTensor,
              topk_ids: torch.Tensor | None, topk_weights: torch.Tensor | None,
              slot_of: torch.Tensor | None = None, activation: str = "silu",
              out: torch.Tensor | None = None, config: dict | None = None,
              route: Routing | None = None,
              trace: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Routed-expert MLP for decode, in two launches, with no host sync.

    Args:
        x: ``[T, D]`` float32/float16/bfloat16 (the FFN input after its norm), rows contiguous
            (quantized to int8 inside launch 1), or a :class:`QuantAct` of it.
        w_gate_up: ``[E, 2F, D]`` gate and up rows interleaved (``QuantTensor.interleave_rows``).
        w_down: ``[E, D, F]``.
        topk_ids: ``[T, top_k]`` int32/int64 expert ids (device tensor; never read on the host).
        topk_weights: ``[T, top_k]`` routing weights (float).
        slot_of: int32 ``[E]`` expert -> slot in the stacked tensors, read on the device
            (the offload manager's seam); None: expert ``e`` is in slot ``e`` and no table is
            read (one dependent load less before each program's weight loads).
        activation: ``"silu"`` (SwiGLU) or ``"gelu"`` (GeGLU, tanh approximation).
        out: optional ``[T, D]`` output.
        config: overrides of :func:`moe_config` (``{"gate_up": {...}, "down": {...}}``).
        route: instead of ``topk_ids``/``topk_weights`` (pass None for both): the router
            logits (:class:`localmoe.kernels.router.Routing`, from
            :func:`localmoe.kernels.router.norm_router_logits`); launch 1 routes every token
            itself and fills ``route.ids`` / ``route.weights`` (the same ids and weights as
            :func:`localmoe.kernels.router.router`).
        trace: a measuring tool (GPU only): int64 buffers ``(gate_up, down)`` of
            :func:`localmoe.kernels.trace.trace_buffer` shape, one record per program of each
            launch (:func:`moe_programs`); the kernels then write their time stamps there.
    Returns:
        ``[T, D]`` in ``x.dtype`` (float32 for a QuantAct) or ``out``.
    Raises:
        ValueError: shapes, types or devices that do not fit; unknown activation.
    """
    if route is not None:
        topk_ids, topk_weights = route.ids, route.weights
        lg = route.logits
        if (lg.shape != (x.shape[0], w_gate_up.shape[0]) or lg.dtype != torch.float32
                or lg.stride(1) != 1):
            raise ValueError(f"fused_moe: router logits {tuple(lg.shape)} {lg.dtype} must be "
                             f"float32 [{x.shape[0]}, {w_gate_up.shape[0]}], rows contiguous")
        if (topk_ids.dtype != torch.int32 or topk_weights.dtype != torch.float32
                or not (topk_ids.is_contiguous() and topk_weights.is_contiguous())):
            raise ValueError("fused_moe: the routing's ids / weights buffers must be contiguous "
                             "int32 / float32 (the first launch writes them)")
    _check(x, w_gate_up, w_down, topk_ids, topk_weights, slot_of)
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_moe: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    cfg = {"gate_up": {}, "down": {}}
    for k, v in (config or {}).items():
        cfg[k].update(v)
    ids = topk_ids.contiguous()
    xa = x if isinstance(x, QuantAct) else quantize_act(x, wide=wide_default(None, experts=True))
    tg, td = trace if trace is not None else (None, None)
    h = moe_gate_up(xa, w_gate_up, ids, slot_of, activation, cfg["gate_up"], route=route,
                    trace=tg)
    dt = torch.float32 if isinstance(x, QuantAct) else x.dtype
    return moe_down(h, w_down, ids, topk_weights.contiguous(), slot_of, out=out, dtype=dt,
                    config=cfg["down"], trace=td)


def moe_programs(stage: str, w: QuantTensor, tokens: int, top_k: int,
                 config: dict | None = None) -> int:
    """Programs of one :func:`moe_gate_up` (``stage`` ``"gate_up"``, ``w`` the ``[E, 2F, D]``
    experts) or :func:`moe_down` (``"down"``, ``w`` ``[E, D, F]``) launch of ``tokens``
    tokens: the records a trace buffer needs."""
    if stage == "gate_up":
        e, f2, d = w.shape
        c = dict(moe_config("gate_up", tokens, top_k, e, d, f2 // 2, w.qtype, w.device),
                 **(config or {}))
        _, _, split = _gate_up_k_parts(c, d // chunk_values(w.qtype))
        return cdiv(f2 // 2, c["BN"]) * tokens * top_k * split
    e, d, f = w.shape
    c = dict(moe_config("down", tokens, top_k, e, d, f, w.qtype, w.device), **(config or {}))
    return cdiv(d, c["BN"]) * tokens


def _gate_up_k_parts(c: dict, n_chunks: int) -> tuple[int, int, int]:
    """``(CH, chunks per K part, K parts)`` of a gate/up launch choice ``c`` over ``n_chunks``
    chunks: K parts of whole tiles; ``split`` asks for that many, fewer when K has too few
    tiles."""
    ch = min(c["CH"], next_pow2(n_chunks))
    split_chunks = cdiv(cdiv(n_chunks, max(1, c.get("split", 1))), ch) * ch
    return ch, split_chunks, cdiv(n_chunks, split_chunks)


def _trace_args(trace: torch.Tensor | None, programs: int, fallback: torch.Tensor):
    """(buffer, constexprs) of a launch's optional trace buffer (checked: int64, one
    :data:`localmoe.kernels.trace.RECORD` record per program)."""
    if trace is None:
        return fallback, {}
    if not use_asm() or trace.device.type != "cuda":
        raise ValueError("fused_moe: a trace needs a CUDA GPU (the stamps are PTX; the "
                         "interpreter cannot run them)")
    if (trace.dtype != torch.int64 or trace.dim() != 2 or trace.shape[1] != RECORD
            or trace.shape[0] < programs or not trace.is_contiguous()):
        raise ValueError(f"fused_moe: a trace buffer must be contiguous int64 "
                         f"[>= {programs}, {RECORD}], got {tuple(trace.shape)} {trace.dtype}")
    return trace, {"TRACE": True}


def moe_gate_up(x: QuantAct, w_gate_up: QuantTensor, topk_ids: torch.Tensor,
                slot_of: torch.Tensor | None, activation: str = "silu",
                config: dict | None = None, route: Routing | None = None,
                trace: torch.Tensor | None = None) -> QuantAct:
    """Launch 1 of :func:`fused_moe` (inputs checked there): ``h`` ``[T*top_k, F]`` as a
    :class:`QuantAct`, row ``t*top_k + j`` = ``act(gate) * up`` of token ``t``'s ``j``-th expert
    (each program owns ``BN`` (a multiple of 32) values of a row and quantizes them).
    ``route``: ``topk_ids`` is ``route.ids``, written here from ``route.logits``.
    ``slot_of`` None: expert ``e`` is in slot ``e`` (no table is read). ``trace``: see
    :func:`fused_moe`."""
    e, f2, d = w_gate_up.shape
    f = f2 // 2
    t, top_k = topk_ids.shape
    c = dict(moe_config("gate_up", t, top_k, e, d, f, w_gate_up.qtype, topk_ids.device),
             **(config or {}))
    if c["BN"] % 32 or f % 32:
        raise ValueError(f"moe_gate_up: BN ({c['BN']}) and d_ff ({f}) must be multiples of 32")
    cv = chunk_values(w_gate_up.qtype)
    h = QuantAct.empty(t * top_k, f, topk_ids.device, wide=x.wide)
    ptrs, strides = plane_args(w_gate_up)
    n_chunks = d // cv
    ch, split_chunks, split = _gate_up_k_parts(c, n_chunks)
    blocks = cdiv(f, c["BN"])
    if split > 1:
        p, cnt = _split_scratch(split, t * top_k, 2 * f, blocks, topk_ids.device)
    else:
        p = cnt = h.d
    if route is not None:
        lg, wts = route.logits, route.weights
        rb = route.selection_bias if route.selection_bias is not None else lg
        rargs = dict(ROUTE=True, EP=next_pow2(e), KP=next_pow2(top_k), GATE=GATING[route.gating],
                     HAS_BIAS=route.selection_bias is not None, NORM=route.norm_topk_prob)
        rscale, lg_rs = route.expert_weights_scale, lg.stride(0)
    else:
        lg = rb = wts = h.d
        rargs, rscale, lg_rs = {}, 1.0, 0
    tr, targs = _trace_args(trace, blocks * t * top_k * split, h.d)
    _moe_gate_up_kernel[(blocks, t * top_k, split)](
        x.q, x.s, h.q, h.s, topk_ids, topk_ids if slot_of is None else slot_of, *ptrs, p, cnt,
        lg, rb, wts, tr, f, n_chunks,
        split_chunks, x.q.stride(0), x.s.stride(0), h.q.stride(0), h.s.stride(0),
        *strides, p.stride(0) if split > 1 else 0, p.stride(1) if split > 1 else 0,
        e, lg_rs, float(rscale),
        TOP_K=top_k, QTYPE=w_gate_up.qtype, CV=cv, BN=c["BN"], CH=ch,
        ACT=ACTIVATIONS[activation],
        EVEN=(f % c["BN"] == 0 and split_chunks % ch == 0 and n_chunks % split_chunks == 0),
        XB=c.get("xb", False), USE_ASM=c.get("asm", use_asm()), SPLIT=split, WIDE=x.wide,
        STAGES=int(c.get("stages", 1)), num_warps=c.get("num_warps", 4), **_reg_cap(c),
        SLOTS=slot_of is not None, **lookahead_arg(c), **rargs, **targs, **pdl_args(h.q.device))
    return h


def _reg_cap(c: dict) -> dict:
    """``maxnreg`` (registers per thread the compiler may use) of a launch choice, when it
    sets one (0 or absent: the compiler's choice); the interpreter ignores it."""
    n = int(c.get("maxnreg") or 0)
    return {"maxnreg": n} if n > 0 and use_asm() else {}   # use_asm: not the interpreter


_SCRATCH: dict = {}


def _split_scratch(split: int, rows: int, width: int, blocks: int, device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 partial sums ``[split, rows, width]`` and zeroed int32 counters ``[rows *
    blocks]`` of a split-K :func:`moe_gate_up` launch: one pair per device
    (:func:`localmoe.kernels.scratch.grown`), reused by every launch (the kernel leaves the
    counters at zero)."""
    key = str(device)
    p, cnt = _SCRATCH.get(key, (None, None))
    p = grown(p, (split, rows, width), torch.float32, device)
    cnt = grown(cnt, (max(rows * blocks, 1024),), torch.int32, device, zero=True)
    _SCRATCH[key] = (p, cnt)
    return p, cnt


def moe_down(h: QuantAct, w_down: QuantTensor, topk_ids: torch.Tensor,
             topk_weights: torch.Tensor, slot_of: torch.Tensor | None,
             out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
             config: dict | None = None, trace: torch.Tensor | None = None) -> torch.Tensor:
    """Launch 2 of :func:`fused_moe`: ``out [T, D] = sum_j topk_weights[t, j] * (h[t*top_k+j]
    @ W_down[e_j].T)`` (``dtype`` when ``out`` is None); ``h`` from :func:`moe_gate_up`;
    ``slot_of`` None: expert ``e`` is in slot ``e``; ``trace``: see :func:`fused_moe`."""
    e, d, f = w_down.shape
    t, top_k = topk_ids.shape
    c = dict(moe_config("down", t, top_k, e, d, f, w_down.qtype, topk_ids.device),
             **(config or {}))
    cv = chunk_values(w_down.qtype)
    if out is None:
        out = torch.empty((t, d), dtype=dtype, device=topk_ids.device)
    ptrs, strides = plane_args(w_down)
    ch = min(c["CH"], next_pow2(f // cv))
    et = bool(c.get("experts_tile", False))
    tkp = next_pow2(top_k) if et else 1
    tr, targs = _trace_args(trace, cdiv(d, c["BN"]) * t, h.s)
    _moe_down_kernel[(cdiv(d, c["BN"]), t)](
        h.q, h.s, out, topk_ids, topk_weights, topk_ids if slot_of is None else slot_of, *ptrs,
        tr, d, f // cv,
        h.q.stride(0), h.s.stride(0), out.stride(0), *strides,
        TOP_K=top_k, QTYPE=w_down.qtype, CV=cv, BN=c["BN"], CH=ch,
        EVEN=(d % c["BN"] == 0 and (f // cv) % ch == 0 and tkp in (1, top_k)),
        XB=c.get("xb", False), USE_ASM=c.get("asm", use_asm()), num_warps=c.get("num_warps", 4),
        ET=et, TKP=tkp, WIDE=h.wide, STAGES=int(c.get("stages", 1)), **_reg_cap(c),
        SLOTS=slot_of is not None, **lookahead_arg(c), **targs, **pdl_args(out.device))
    return out


def fused_moe_ref(x: torch.Tensor, w_gate_up: QuantTensor, w_down: QuantTensor,
                  topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  slot_of: torch.Tensor | None = None, activation: str = "silu",
                  act_quant: bool = True) -> torch.Tensor:
    """Torch twin of :func:`fused_moe` (float32 ``[T, D]``; a Python loop over tokens and
    experts, for tests). ``act_quant`` applies the kernels' int8 rounding of ``x`` and ``h``."""
    e, f2, d = w_gate_up.shape
    f = f2 // 2
    t, top_k = topk_ids.shape
    slots = (torch.arange(e) if slot_of is None else slot_of.cpu()).long()
    wide = x.wide if isinstance(x, QuantAct) else wide_default(None, experts=True)
    q = (lambda v: quantize_act_ref(v, wide=wide)) if act_quant else (lambda v: v.float())
    xq = dequantize_act(x) if isinstance(x, QuantAct) else q(x)
    out = torch.zeros((t, d), dtype=torch.float32, device=topk_ids.device)
    for ti in range(t):
        for j in range(top_k):
            s = int(slots[int(topk_ids[ti, j])])
            gu = w_gate_up.dequantize(slice(s * f2, (s + 1) * f2))
            y = xq[ti:ti + 1] @ gu.T                       # [1, 2F] interleaved
            g, u = y[0, 0::2], y[0, 1::2]
            if activation == "silu":
                a = g * torch.sigmoid(g)
            else:
                a = 0.5 * g * (1.0 + torch.tanh(0.7978845608028654 * (g + 0.044715 * g ** 3)))
            hq = q((a * u)[None])
            wd = w_down.dequantize(slice(s * d, (s + 1) * d))
            out[ti] += float(topk_weights[ti, j]) * (hq @ wd.T)[0]
    return out
