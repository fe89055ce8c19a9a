"""Quantized GEMV for decode (1-8 tokens) on GGUF weights kept in their blocks.

``y[t, n] = sum_k x[t, k] * W[n, k]`` with ``W`` a :class:`~localmoe.kernels.qtensor.QuantTensor`
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K; float weights go to ``torch``).

Algorithm (the integer dot product of llama.cpp's CUDA ``mmvq``, written in Triton; one kernel,
the format is the constexpr ``QTYPE``):

1. The activations are quantized *in registers*, per 32-value block, to int8 with one float
   scale (``dx = amax / 127``, ``xq = round_half_even(x * 127 / amax)``: ggml's ``q8_1`` without
   the stored sum) and packed four to a 32-bit word. Every program quantizes the x range it
   reads, so no extra launch and no buffer are needed.
2. Each program owns ``BN`` weight rows and walks its K range in tiles of ``CH`` chunks
   (``CV`` = 32 values, or 64 for Q2_K/Q3_K). The repacked planes (see
   :mod:`localmoe.kernels.qtensor`) put the codes of one 16-value slice in 4 words, so one
   16-byte load per (row, chunk) brings 32 (or 64) codes; a shift and a mask per word select
   a slice, a shift/mask/or adds the high bits. Weights are never converted to float.
3. ``dp4a`` (4 int8 products summed into an int32; inline PTX on the GPU, an exact emulation
   in the interpreter) gives the integer dot of each slice with the x words; the block scales
   are applied once per chunk: ``y += dx * d * (sum_s sc_s * (q_s . xq_s) + m_s * sum(xq_s))``
   (integer inside the brackets where the format allows: Q4_0, Q5_0, Q8_0, Q3_K, Q6_K).
   The per-row sums are reduced over chunks once, at the end.
4. Split-K (``SPLIT_K > 1``, for small N): programs of one row block share the K range and add
   their partial sums into a zeroed float32 output with atomics.

Numerics: exact integer products, float32 scales and accumulation; the only rounding beyond
float32 is the int8 quantization of ``x`` (relative error of order 0.3%, the same scheme as
llama.cpp's GPU path). The torch twin :func:`quant_gemv_ref` reproduces it
(``act_quant=True``) or computes the plain ``x @ dequant(W).T`` in float32 (``act_quant=False``).

Launch choices live in :data:`GEMV_CONFIG` (to move to ``kernels/configs/<device>.json``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from localmoe.kernels.qtensor import (
    FLOAT_QTYPES, QTYPE_NAMES, QUANT_QTYPES, QuantTensor, chunk_values,
)

__all__ = ["quant_gemv", "quant_gemv_ref", "quantize_act_ref", "GEMV_CONFIG", "gemv_config"]

# ---- launch choices: one dict for this kernel; to move into kernels/configs/<device>.json ----
# keyed by the token bucket (1, 2, 4, 8): BN rows per program, CH chunks per tile, warps; the
# split over K is chosen so that the grid has at least MIN_PROGRAMS programs.
GEMV_CONFIG = {
    "tokens": {
        1: {"BN": 8, "CH": 32, "num_warps": 4},
        2: {"BN": 8, "CH": 32, "num_warps": 4},
        4: {"BN": 4, "CH": 32, "num_warps": 4},
        8: {"BN": 4, "CH": 16, "num_warps": 4},
    },
    "min_programs": 264,   # 2 x the H200's 132 SMs
    "max_split": 8,
}
# -----------------------------------------------------------------------------------------------

_Q4_0 = tl.constexpr(2)
_Q4_1 = tl.constexpr(3)
_Q5_0 = tl.constexpr(6)
_Q5_1 = tl.constexpr(7)
_Q8_0 = tl.constexpr(8)
_Q2_K = tl.constexpr(10)
_Q3_K = tl.constexpr(11)
_Q4_K = tl.constexpr(12)
_Q5_K = tl.constexpr(13)
_Q6_K = tl.constexpr(14)


def use_asm() -> bool:
    """Inline PTX (dp4a) on a real GPU; its exact emulation under ``TRITON_INTERPRET=1``."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True")


# -----------------------------------------------------------------------------------------------
# building blocks (shared with fused_moe)
# -----------------------------------------------------------------------------------------------

@triton.jit
def _dp4a(a, b, USE_ASM: tl.constexpr):
    """Elementwise sum of the 4 signed-byte products of int32 words ``a`` and ``b``."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .s32 z; mov.s32 z, 0; dp4a.s32.s32 $0, $1, $2, z; }",
            "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1)
    else:
        r = ((a << 24) >> 24) * ((b << 24) >> 24)
        r += ((a << 16) >> 24) * ((b << 16) >> 24)
        r += ((a << 8) >> 24) * ((b << 8) >> 24)
        r += (a >> 24) * (b >> 24)
        return r


@triton.jit
def _idot(wq, xw, USE_ASM: tl.constexpr):
    """Integer dot of one slice: wq [BN, CH, 4] code words, xw [TP, CH, 4] x words ->
    [TP, BN, CH] int32."""
    a, b = tl.broadcast(wq[None, :, :, :], xw[:, None, :, :])
    return tl.sum(_dp4a(a, b, USE_ASM), axis=3)


@triton.jit
def _x_scale(x_ptr, xoff, tmask, kb, kmask):
    """Per-32-block int8 scale of x: blocks starting at kb [CH] of the token rows at element
    offsets xoff [TP] -> (dx [TP, CH] = amax/127, inv [TP, CH] = 127/amax or 0)."""
    o = tl.arange(0, 32)
    m = tmask[:, None, None] & kmask[None, :, None]
    xa = tl.load(x_ptr + xoff[:, None, None] + kb[None, :, None] + o[None, None, :], mask=m, other=0.0)
    amax = tl.max(tl.abs(xa.to(tl.float32)), axis=2)
    inv = tl.where(amax > 0, 127.0 / tl.maximum(amax, 1e-30), 0.0)
    return amax / 127.0, inv


@triton.jit
def _x_words(x_ptr, xoff, tmask, ks, kmask, inv):
    """x values ks[c] .. ks[c]+15 quantized with inv [TP, CH] -> (words [TP, CH, 4] int32, value
    4w+b in byte b of word w; isum [TP, CH] int32 = sum of the 16 int8 values)."""
    i4 = tl.arange(0, 4)
    off = ks[None, :, None, None] + (i4 * 4)[None, None, :, None] + i4[None, None, None, :]
    m = tmask[:, None, None, None] & kmask[None, :, None, None]
    v = tl.load(x_ptr + xoff[:, None, None, None] + off, mask=m, other=0.0).to(tl.float32)
    v = v * inv[:, :, None, None]
    qi = (v + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000   # round half to even
    words = tl.sum((qi & 255) << (i4 * 8)[None, None, None, :], axis=3)
    isum = tl.sum(tl.sum(qi, axis=3), axis=2)
    return words, isum


@triton.jit
def _qtile(acc, c0, c_end, rows, rmask, x_ptr, xoff, tmask,
           q_ptr, qh_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr,
           q_rs, qh_rs, d_rs, dm_rs, sc_rs, mn_rs,
           QTYPE: tl.constexpr, CV: tl.constexpr, CH: tl.constexpr, USE_ASM: tl.constexpr):
    """acc [TP, BN, CH] += the contributions of chunks c0 .. c0+CH-1 (< c_end) of rows [BN]."""
    cc = c0 + tl.arange(0, CH)
    cm = cc < c_end
    i4 = tl.arange(0, 4)
    r2 = rows[:, None]
    m2 = rmask[:, None] & cm[None, :]
    m3 = m2[:, :, None]
    # ---- x: int8 words of every 16-value slice of the tile's chunks --------------------------
    kb = cc * CV
    dx0, inv0 = _x_scale(x_ptr, xoff, tmask, kb, cm)
    x0, s0 = _x_words(x_ptr, xoff, tmask, kb, cm, inv0)
    x1, s1 = _x_words(x_ptr, xoff, tmask, kb + 16, cm, inv0)
    if CV == 64:
        dx1, inv1 = _x_scale(x_ptr, xoff, tmask, kb + 32, cm)
        x2, s2 = _x_words(x_ptr, xoff, tmask, kb + 32, cm, inv1)
        x3, s3 = _x_words(x_ptr, xoff, tmask, kb + 48, cm, inv1)
    # ---- weights ------------------------------------------------------------------------------
    if QTYPE == _Q8_0:
        wp = q_ptr + r2[:, :, None] * q_rs + (cc * 8)[None, :, None] + i4[None, None, :]
        wlo = tl.load(wp, mask=m3, other=0)
        whi = tl.load(wp + 4, mask=m3, other=0)
        d = tl.load(d_ptr + r2 * d_rs + cc[None, :], mask=m2, other=0.0).to(tl.float32)
        idot = _idot(wlo, x0, USE_ASM) + _idot(whi, x1, USE_ASM)
        acc += dx0[:, None, :] * (d[None, :, :] * idot.to(tl.float32))
    elif CV == 32:
        wv = tl.load(q_ptr + r2[:, :, None] * q_rs + (cc * 4)[None, :, None] + i4[None, None, :],
                     mask=m3, other=0)
        lo = wv & 0x0F0F0F0F
        hi = (wv >> 4) & 0x0F0F0F0F
        if QTYPE == _Q5_0 or QTYPE == _Q5_1 or QTYPE == _Q5_K:
            h = tl.load(qh_ptr + r2 * qh_rs + cc[None, :], mask=m2, other=0)[:, :, None]
            lo = lo | (((h >> i4[None, None, :]) & 0x01010101) << 4)
            hi = hi | (((h >> (i4 + 4)[None, None, :]) & 0x01010101) << 4)
        if QTYPE == _Q6_K:
            hp = qh_ptr + r2 * qh_rs + (cc * 2)[None, :]
            h0 = tl.load(hp, mask=m2, other=0)[:, :, None]
            h1 = tl.load(hp + 1, mask=m2, other=0)[:, :, None]
            lo = lo | (((h0 >> (i4 * 2)[None, None, :]) & 0x03030303) << 4)
            hi = hi | (((h1 >> (i4 * 2)[None, None, :]) & 0x03030303) << 4)
        i_lo = _idot(lo, x0, USE_ASM)
        i_hi = _idot(hi, x1, USE_ASM)
        if QTYPE == _Q6_K:
            sb = cc // 8
            d = tl.load(d_ptr + r2 * d_rs + sb[None, :], mask=m2, other=0.0).to(tl.float32)
            sp = sc_ptr + r2 * sc_rs + (cc * 2)[None, :]
            sc0 = tl.load(sp, mask=m2, other=0).to(tl.int32)
            sc1 = tl.load(sp + 1, mask=m2, other=0).to(tl.int32)
            it = sc0[None] * (i_lo - 32 * s0[:, None, :]) + sc1[None] * (i_hi - 32 * s1[:, None, :])
            acc += dx0[:, None, :] * (d[None] * it.to(tl.float32))
        elif QTYPE == _Q4_K or QTYPE == _Q5_K:
            sb = cc // 8
            d = tl.load(d_ptr + r2 * d_rs + sb[None, :], mask=m2, other=0.0).to(tl.float32)
            dm = tl.load(dm_ptr + r2 * dm_rs + sb[None, :], mask=m2, other=0.0).to(tl.float32)
            sc = tl.load(sc_ptr + r2 * sc_rs + cc[None, :], mask=m2, other=0).to(tl.int32)
            mn = tl.load(mn_ptr + r2 * mn_rs + cc[None, :], mask=m2, other=0).to(tl.int32)
            i_d = sc[None] * (i_lo + i_hi)
            i_m = mn[None] * (s0 + s1)[:, None, :]
            acc += dx0[:, None, :] * (d[None] * i_d.to(tl.float32) - dm[None] * i_m.to(tl.float32))
        else:
            d = tl.load(d_ptr + r2 * d_rs + cc[None, :], mask=m2, other=0.0).to(tl.float32)
            idot = i_lo + i_hi
            if QTYPE == _Q4_0:
                acc += dx0[:, None, :] * (d[None] * (idot - 8 * (s0 + s1)[:, None, :]).to(tl.float32))
            elif QTYPE == _Q5_0:
                acc += dx0[:, None, :] * (d[None] * (idot - 16 * (s0 + s1)[:, None, :]).to(tl.float32))
            else:  # Q4_1, Q5_1: w = d*q + m
                m = tl.load(dm_ptr + r2 * dm_rs + cc[None, :], mask=m2, other=0.0).to(tl.float32)
                xs = (s0 + s1).to(tl.float32)
                acc += dx0[:, None, :] * (d[None] * idot.to(tl.float32) + m[None] * xs[:, None, :])
    else:  # CV == 64: Q2_K, Q3_K (2-bit low codes, 4 slices per chunk)
        wv = tl.load(q_ptr + r2[:, :, None] * q_rs + (cc * 4)[None, :, None] + i4[None, None, :],
                     mask=m3, other=0)
        c0w = wv & 0x03030303
        c1w = (wv >> 2) & 0x03030303
        c2w = (wv >> 4) & 0x03030303
        c3w = (wv >> 6) & 0x03030303
        sp = sc_ptr + r2 * sc_rs + (cc * 4)[None, :]
        sb = cc // 4
        d = tl.load(d_ptr + r2 * d_rs + sb[None, :], mask=m2, other=0.0).to(tl.float32)
        if QTYPE == _Q3_K:
            hp = qh_ptr + r2 * qh_rs + (cc * 2)[None, :]
            h0 = tl.load(hp, mask=m2, other=0)[:, :, None]
            h1 = tl.load(hp + 1, mask=m2, other=0)[:, :, None]
            c0w = c0w | (((h0 >> i4[None, None, :]) & 0x01010101) << 2)
            c1w = c1w | (((h0 >> (i4 + 4)[None, None, :]) & 0x01010101) << 2)
            c2w = c2w | (((h1 >> i4[None, None, :]) & 0x01010101) << 2)
            c3w = c3w | (((h1 >> (i4 + 4)[None, None, :]) & 0x01010101) << 2)
            a0 = tl.load(sp, mask=m2, other=0).to(tl.int32)[None]
            a1 = tl.load(sp + 1, mask=m2, other=0).to(tl.int32)[None]
            a2 = tl.load(sp + 2, mask=m2, other=0).to(tl.int32)[None]
            a3 = tl.load(sp + 3, mask=m2, other=0).to(tl.int32)[None]
            ia = a0 * (_idot(c0w, x0, USE_ASM) - 4 * s0[:, None, :]) \
                + a1 * (_idot(c1w, x1, USE_ASM) - 4 * s1[:, None, :])
            ib = a2 * (_idot(c2w, x2, USE_ASM) - 4 * s2[:, None, :]) \
                + a3 * (_idot(c3w, x3, USE_ASM) - 4 * s3[:, None, :])
            acc += d[None] * (dx0[:, None, :] * ia.to(tl.float32) + dx1[:, None, :] * ib.to(tl.float32))
        else:  # Q2_K: byte = scale | min << 4
            dm = tl.load(dm_ptr + r2 * dm_rs + sb[None, :], mask=m2, other=0.0).to(tl.float32)
            b0 = tl.load(sp, mask=m2, other=0).to(tl.int32)[None]
            b1 = tl.load(sp + 1, mask=m2, other=0).to(tl.int32)[None]
            b2 = tl.load(sp + 2, mask=m2, other=0).to(tl.int32)[None]
            b3 = tl.load(sp + 3, mask=m2, other=0).to(tl.int32)[None]
            ia = (b0 & 15) * _idot(c0w, x0, USE_ASM) + (b1 & 15) * _idot(c1w, x1, USE_ASM)
            ib = (b2 & 15) * _idot(c2w, x2, USE_ASM) + (b3 & 15) * _idot(c3w, x3, USE_ASM)
            ma = (b0 >> 4) * s0[:, None, :] + (b1 >> 4) * s1[:, None, :]
            mb = (b2 >> 4) * s2[:, None, :] + (b3 >> 4) * s3[:, None, :]
            acc += dx0[:, None, :] * (d[None] * ia.to(tl.float32) - dm[None] * ma.to(tl.float32)) \
                + dx1[:, None, :] * (d[None] * ib.to(tl.float32) - dm[None] * mb.to(tl.float32))
    return acc


# -----------------------------------------------------------------------------------------------
# the GEMV kernel
# -----------------------------------------------------------------------------------------------

@triton.jit
def _quant_gemv_kernel(x_ptr, y_ptr, q_ptr, qh_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr,
                       N, T, n_chunks, split_chunks,
                       x_rs, y_rs, q_rs, qh_rs, d_rs, dm_rs, sc_rs, mn_rs,
                       QTYPE: tl.constexpr, CV: tl.constexpr, TP: tl.constexpr, BN: tl.constexpr,
                       CH: tl.constexpr, ATOMIC: tl.constexpr, USE_ASM: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BN + tl.arange(0, BN)
    rmask = rows < N
    rows = rows.to(tl.int64)
    tt = tl.arange(0, TP)
    tmask = tt < T
    xoff = tt.to(tl.int64) * x_rs
    c_begin = pid_k * split_chunks
    c_end = tl.minimum(c_begin + split_chunks, n_chunks)
    acc = tl.zeros([TP, BN, CH], dtype=tl.float32)
    for c0 in range(c_begin, c_end, CH):
        acc = _qtile(acc, c0, c_end, rows, rmask, x_ptr, xoff, tmask,
                     q_ptr, qh_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr,
                     q_rs, qh_rs, d_rs, dm_rs, sc_rs, mn_rs, QTYPE, CV, CH, USE_ASM)
    out = tl.sum(acc, axis=2)
    yp = y_ptr + tt[:, None].to(tl.int64) * y_rs + rows[None, :]
    ym = tmask[:, None] & rmask[None, :]
    if ATOMIC:
        tl.atomic_add(yp, out, mask=ym)
    else:
        tl.store(yp, out.to(y_ptr.dtype.element_ty), mask=ym)


# -----------------------------------------------------------------------------------------------
# launchers and twins
# -----------------------------------------------------------------------------------------------

def plane_args(w: QuantTensor) -> tuple[list[torch.Tensor], list[int]]:
    """The six plane pointers (q, qh, d, dmin, sc, mn; a stand-in where a format has none) and
    their row strides in elements, in the kernels' argument order."""
    p = w.planes
    ptrs, strides = [], []
    for key in ("q", "qh", "d", "dmin", "sc", "mn"):
        t = p.get(key)
        ptrs.append(t if t is not None else p["q"])
        strides.append(t.stride(0) if t is not None else 0)
    return ptrs, strides


def _bucket(t: int) -> int:
    for b in (1, 2, 4, 8):
        if t <= b:
            return b
    return 8


def gemv_config(n: int, k: int, t: int, qtype: int, n_sm: int | None = None) -> dict:
    """Launch choice for ``t`` tokens of an ``[n, k]`` weight: ``BN``, ``CH``, ``num_warps``,
    ``split`` (programs over K) from :data:`GEMV_CONFIG`."""
    cfg = dict(GEMV_CONFIG["tokens"][_bucket(t)])
    n_chunks = k // chunk_values(qtype)
    cfg["CH"] = min(cfg["CH"], triton.next_power_of_2(n_chunks))
    blocks = triton.cdiv(n, cfg["BN"])
    split = 1
    while (blocks * split < GEMV_CONFIG["min_programs"] and split < GEMV_CONFIG["max_split"]
           and n_chunks // (split * 2) >= cfg["CH"]):
        split *= 2
    cfg["split"] = split
    return cfg


def _check_x(x: torch.Tensor, k: int, what: str) -> None:
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"{what}: x must be [T, {k}], got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{what}: x must be float32/float16/bfloat16, got {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError(f"{what}: x rows must be contiguous")


def quant_gemv(x: torch.Tensor, w: QuantTensor, out: torch.Tensor | None = None,
               config: dict | None = None) -> torch.Tensor:
    """``x @ dequant(w).T`` for decode.

    Args:
        x: ``[T, K]`` float32/float16/bfloat16 activations (rows contiguous), ``T`` >= 1
            (the kernel is built for 1-8; more tokens run in groups of 8).
        w: a 2-D ``[N, K]`` :class:`QuantTensor` on ``x``'s device (float weights use torch).
        out: optional ``[T, N]`` output (dtype of your choice among the float ones).
        config: override of :func:`gemv_config` (keys BN, CH, num_warps, split).
    Returns:
        ``[T, N]`` in ``x.dtype`` (or ``out``).
    Raises:
        ValueError / TypeError: shapes, dtypes or devices that do not fit.
    """
    if len(w.shape) != 2:
        raise ValueError(f"quant_gemv: w must be 2-D [N, K], got shape {w.shape}")
    n, k = w.shape
    _check_x(x, k, "quant_gemv")
    if x.device != w.device:
        raise ValueError(f"quant_gemv: x on {x.device}, w on {w.device}")
    t = x.shape[0]
    if out is None:
        out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if w.is_float:
        out.copy_(x.to(w.planes["w"].dtype) @ w.planes["w"].T)
        return out
    if w.qtype not in QUANT_QTYPES:
        raise ValueError(f"quant_gemv: unsupported qtype {QTYPE_NAMES.get(w.qtype, w.qtype)}")
    for t0 in range(0, t, 8):
        _launch_gemv(x[t0:t0 + 8], w, out[t0:t0 + 8], config)
    return out


def _launch_gemv(x, w, out, config):
    n, k = w.shape
    t = x.shape[0]
    cfg = dict(config) if config else gemv_config(n, k, t, w.qtype)
    cv = chunk_values(w.qtype)
    n_chunks = k // cv
    split = cfg.get("split", 1)
    split_chunks = triton.cdiv(triton.cdiv(n_chunks, split), cfg["CH"]) * cfg["CH"]
    split = triton.cdiv(n_chunks, split_chunks)
    y = out
    if split > 1:
        y = out if (out.dtype == torch.float32 and out.stride(1) == 1) else \
            torch.empty((t, n), dtype=torch.float32, device=x.device)
        y.zero_()
    ptrs, strides = plane_args(w)
    grid = (triton.cdiv(n, cfg["BN"]), split)
    _quant_gemv_kernel[grid](
        x, y, *ptrs, n, t, n_chunks, split_chunks, x.stride(0), y.stride(0), *strides,
        QTYPE=w.qtype, CV=cv, TP=triton.next_power_of_2(t), BN=cfg["BN"], CH=cfg["CH"],
        ATOMIC=split > 1, USE_ASM=use_asm(), num_warps=cfg.get("num_warps", 4))
    if y is not out:
        out.copy_(y)


def quantize_act_ref(x: torch.Tensor) -> torch.Tensor:
    """The kernels' activation quantization, dequantized: per 32-value block of each row,
    ``round_half_even(x * (127 / amax)) * (amax / 127)`` in float32 (0 for an all-zero block).

    Args: x ``[T, K]`` float (K a multiple of 32). Returns float32 ``[T, K]``."""
    t, k = x.shape
    xb = x.float().reshape(t, k // 32, 32)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax.clamp_min(1e-30), torch.zeros_like(amax))
    q = torch.round(xb * inv)
    return (q * (amax / 127.0)).reshape(t, k)


def quant_gemv_ref(x: torch.Tensor, w: QuantTensor, act_quant: bool = True) -> torch.Tensor:
    """Torch twin of :func:`quant_gemv`: ``x' @ dequant(w).T`` in float32, ``[T, N]``, where
    ``x' = quantize_act_ref(x)`` if ``act_quant`` (what the kernel computes for quantized
    weights) else ``x`` (the exact float product; the difference is the activation rounding)."""
    xf = quantize_act_ref(x) if (act_quant and not w.is_float) else x.float()
    return xf @ w.dequantize().reshape(-1, w.K).T
