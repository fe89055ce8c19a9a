"""Quantized GEMV for decode (1-8 tokens) on GGUF weights kept in their blocks.

``y[t, n] = sum_k x[t, k] * W[n, k]`` with ``W`` a :class:`~localmoe.kernels.qtensor.QuantTensor`
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS; float weights go
to ``torch``).

Algorithm (the integer dot product of llama.cpp's CUDA ``mmvq``, written in Triton; one kernel,
the format is the constexpr ``QTYPE``):

1. Activations are quantized once, per 32-value block, to int8 with one float scale
   (``dx = amax / 127``, ``xq = round_half_even(x * 127 / amax)``; ggml's ``q8_1``):
   :func:`quantize_act` (one small launch) or the kernel that produces x returns a
   :class:`QuantAct`: codes packed four to an int32 word ``q [T, K/4]``, the sums of each
   16-value slice as two int16 halves ``s [T, K/32]``, scales ``d [T, K/32]``.
2. Each program owns ``BN`` weight rows and walks its K range in tiles of ``CH`` chunks (``CV``
   = 32 values, or 64 for Q2_K/Q3_K), once per token. The repacked planes (see
   :mod:`localmoe.kernels.qtensor`) put the codes of a 16-value slice in 4 words: one 16-byte
   load per (row, chunk) brings 32 (or 64) codes; a shift and a mask select a slice, a
   shift/mask/or adds the high bits (IQ4_NL/IQ4_XS: :func:`iq4_lookup` turns the 4-bit
   indices into their int8 code-book values). Weights are never converted to float.
3. ``dp4a`` (4 int8 products summed into an int32; inline PTX on the GPU, an exact emulation
   in the interpreter) gives the integer dot of each slice; block scales are applied once per
   chunk: ``y += dx * d * (sum_s sc_s * (q_s . xq_s) + m_s * sum(xq_s))`` (integer inside the
   brackets where the format allows). Per-row sums are reduced over chunks once, at the end.
4. Every operand of a tile is loaded as one 4-D tensor ``[1, BN, CH, 4|1]`` (x and its scales
   broadcast over rows by a zero-stride pointer, or loaded once per thread with ``xb``), so
   Triton gives them one register layout and no data moves between threads inside the loop
   (checked in the PTX: no ``bar.sync``/shuffles in the K loop at BN <= num_warps).
5. Split-K (``split > 1``, for small N): programs of one row block share the K range and add
   their partial sums into a zeroed float32 output with atomics (:func:`quant_gemv`: 2-3
   launches, the zeroing, the GEMV and a copy to a half output), or store them with plain
   stores into slice ``s`` of a float32 ``[S, T, N]`` partials tensor
   (:func:`quant_gemv_partials`: one launch, no zeroing, deterministic), summed by the
   consumer (e.g. :func:`localmoe.kernels.fused_norm.add_rms_norm_quant`) or
   :func:`sum_partials`.

Numerics: exact integer products, float32 scales and accumulation; the only rounding beyond
float32 is the int8 quantization of ``x`` (relative error ~0.3-1% on random data, the scheme of
llama.cpp's GPU path). The torch twin :func:`quant_gemv_ref` reproduces it (``act_quant=True``)
or computes the plain ``x @ dequant(W).T`` in float32 (``act_quant=False``).

Measured on the H200 (benchmarks/results/quant_kernels_h200-2026-12-02.json, 1 token, the
kernel alone, CUDA graph, weights not in L2): Qwen3-30B-A3B QKV 5120x2048 Q8_0 4.9 us (53% of
the 4.27 TB/s copy ceiling), O 2048x4096 Q8_0 4.5 us (46%), head 151936x2048 Q6_K 80 us (75%);
Mixtral QKV 6144x4096 Q8_0 73%. Small GEMVs are bounded by the ~2 us a kernel costs in a graph
however little it reads (cuBLAS fp16: 60% on the same QKV at twice the bytes). 8 tokens: 13-19%
(one K pass per token re-decodes the weights; a tensor-core path is the next step).

Launch choices (BN, CH, warps, xb, the split over K) come from the ``gemv`` and ``gemv_split``
knobs of ``kernels/configs/<device>.json`` (:mod:`localmoe.kernels.launch_config`, tuned by
``benchmarks/bench_quant_kernels.py --sweep --write-config``): :func:`gemv_config`.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Iterator, NamedTuple

import torch
import triton
import triton.language as tl

from localmoe.kernels.host import cdiv, next_pow2
from localmoe.kernels.launch_config import device_table
from localmoe.kernels.pdl import pdl_args, pdl_begin, pdl_prefetch, prefetch_rows_l2
from localmoe.kernels.qtensor import (
    FLOAT_QTYPES, IQ4_VALUES, Q2_K, Q3_K, QTYPE_NAMES, QUANT_QTYPES, QuantTensor, chunk_values,
)

__all__ = ["quant_gemv", "quant_gemv_ref", "quantize_act", "quantize_act_ref", "QuantAct",
           "gemv_config", "quant_gemv_partials", "gemv_partials_split", "sum_partials",
           "act_precision", "use_act_precision", "ACT_PRECISIONS"]

#: activation precisions of the integer-dot kernels: ``"int8"`` (one int8 code per value and a
#: scale per 32 values: ggml's q8_1, llama.cpp's GPU scheme), ``"int16"`` (the same plus the
#: int8 codes of the rounding error at a 254 times finer scale: ~15 bits, twice the dp4a) or
#: ``"mixed"`` (int16 for the attention projections, dense FFNs, shared experts and the output
#: head; int8 for the routed experts, whose second dot costs the most: 18.5 -> 22.8 us per MoE
#: layer of Qwen3-30B-A3B on the H200, against 4.5 -> 5.0 us for its O projection)
ACT_PRECISIONS = ("int8", "int16", "mixed")
_ACT = contextvars.ContextVar("localmoe_act_precision", default=None)


def wide_default(wide: bool | None, experts: bool = False) -> bool:
    """``wide`` itself, or for None whether the :func:`act_precision` in effect gives int16
    activations: ``"int16"``, or ``"mixed"`` for activations that do not feed the routed
    experts (``experts``: the input of the experts' gate/up launch)."""
    if wide is not None:
        return wide
    p = act_precision()
    return p == "int16" or (p == "mixed" and not experts)


def act_precision() -> str:
    """The activation precision new :class:`QuantAct` buffers get: the innermost
    :func:`use_act_precision`, else ``$LOCALMOE_ACT_PRECISION``, else ``"int8"``.

    Raises:
        InvalidRequestError: ``$LOCALMOE_ACT_PRECISION`` is not one of :data:`ACT_PRECISIONS`."""
    p = _ACT.get()
    if p is None:
        p = os.environ.get("LOCALMOE_ACT_PRECISION", "").strip() or "int8"
        check_act_precision(p, "LOCALMOE_ACT_PRECISION")
    return p


def check_act_precision(p, param: str = "act_precision") -> str:
    """``p`` if it is one of :data:`ACT_PRECISIONS`.

    Raises:
        InvalidRequestError: any other value (``param`` names where it came from)."""
    if p not in ACT_PRECISIONS:
        from localmoe.errors import InvalidRequestError

        raise InvalidRequestError(f"{param}={p!r} is not an activation precision; use one of "
                                  f"{', '.join(ACT_PRECISIONS)}", param=param)
    return p


@contextlib.contextmanager
def use_act_precision(precision: str | None) -> Iterator[None]:
    """Within the block, new :class:`QuantAct` buffers (and so the kernels that read them) use
    ``precision`` (one of :data:`ACT_PRECISIONS`; None: leave it as it is).

    Raises:
        InvalidRequestError: an unknown precision."""
    if precision is None:
        yield
        return
    check_act_precision(precision)
    tok = _ACT.set(precision)
    try:
        yield
    finally:
        _ACT.reset(tok)

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
_IQ4_NL = tl.constexpr(20)
_IQ4_XS = tl.constexpr(23)


def _iq4_table_words() -> tuple[int, int]:
    """The IQ4 code book (:data:`localmoe.kernels.qtensor.IQ4_VALUES`) as two little-endian int64
    words of 8 signed bytes: entries 0-7 and 8-15."""
    b = [v & 0xFF for v in IQ4_VALUES]
    lo, hi = (sum(x << (8 * i) for i, x in enumerate(b[j:j + 8])) for j in (0, 8))
    return tuple(w - (1 << 64) if w >= 1 << 63 else w for w in (lo, hi))


_IQ4_WORDS = _iq4_table_words()
_IQ4_T = [f"0x{(w >> s) & 0xFFFFFFFF:08X}" for w in _IQ4_WORDS for s in (0, 32)]
_IQ4_LO64, _IQ4_HI64 = (tl.constexpr(w) for w in _IQ4_WORDS)
# A code word holds 8 codes (byte i: code l | code 16+l << 4). ``prmt`` reads its selector's
# 4 low nibbles: codes masked to 3 bits index a table half (8 bytes in two registers) for the
# four codes of two bytes at a time, from both halves; a third ``prmt`` keeps each code's
# half (its bit 3 moved to the selector's bit 2, 0x3210 the positions), and two more sort the
# values of the low nibbles and of the high nibbles into one word each: 14 instructions
# for 8 codes (the scheme of llama.cpp's ``get_int_from_table_16``, written anew here)
_IQ4_PTX = tl.constexpr(
    "{ .reg .b32 q, s, t0, t1, t2, t3, a, b, r0, r1;\n"
    f"mov.b32 t0, {_IQ4_T[0]};\n"
    f"mov.b32 t1, {_IQ4_T[1]};\n"
    f"mov.b32 t2, {_IQ4_T[2]};\n"
    f"mov.b32 t3, {_IQ4_T[3]};\n"
    "and.b32 q, $2, 0x77777777;\n"
    "shr.b32 s, $2, 1;\n"
    "and.b32 s, s, 0x44444444;\n"
    "or.b32 s, s, 0x32103210;\n"
    "prmt.b32 a, t0, t1, q;\n"
    "prmt.b32 b, t2, t3, q;\n"
    "prmt.b32 r0, a, b, s;\n"
    "shr.b32 q, q, 16;\n"
    "shr.b32 s, s, 16;\n"
    "prmt.b32 a, t0, t1, q;\n"
    "prmt.b32 b, t2, t3, q;\n"
    "prmt.b32 r1, a, b, s;\n"
    "prmt.b32 $0, r0, r1, 0x6420;\n"
    "prmt.b32 $1, r0, r1, 0x7531; }")


@triton.jit
def iq4_lookup(w, USE_ASM: tl.constexpr):
    """Int32 code words ``w`` of IQ4_NL / IQ4_XS (byte ``b``: code ``b`` of the chunk's first
    16-value slice in the low nibble, code ``b`` of the second in the high one) -> the two words
    ``(lo, hi)`` of signed int8 code-book values (ggml ``kvalues_iq4nl``) of the low and of the
    high nibbles, ready for ``dp4a``. On the GPU 8 ``prmt`` byte permutes and 6 shifts and
    logic operations (:data:`_IQ4_PTX`); in the interpreter the same selection by shifts of the
    table's two 8-byte halves."""
    if USE_ASM:
        return tl.inline_asm_elementwise(_IQ4_PTX, "=r,=r,r", [w], dtype=(tl.int32, tl.int32),
                                         is_pure=True, pack=1)
    else:
        lo = w * 0
        hi = w * 0
        for i in tl.static_range(8):
            c = (w >> (4 * i)) & 15
            half = tl.where(c >= 8, _IQ4_HI64, _IQ4_LO64)
            v = ((half >> ((c & 7) * 8).to(tl.int64)) & 0xFF).to(tl.int32)
            if i % 2 == 0:
                lo = lo | (v << (8 * (i // 2)))
            else:
                hi = hi | (v << (8 * (i // 2)))
        return lo, hi


def lookahead_arg(cfg: dict) -> dict:
    """The ``LOOKAHEAD`` constexpr of a launch choice that asks for it (``"lookahead": true``:
    :func:`_qk_loop` issues the next K tile's loads before this tile's dots); absent or false:
    nothing (the kernels' default, the plain loop)."""
    return {"LOOKAHEAD": True} if cfg.get("lookahead") else {}


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
    """Integer dot of one 16-value slice per (token, row, chunk): code words wq [1, BN, CH, 4]
    and x words xw [TP, BN, CH, 4] -> [TP, BN, CH, 1] int32."""
    a, b = tl.broadcast(wq, xw)
    return tl.sum(_dp4a(a, b, USE_ASM), axis=3, keep_dims=True)


@triton.jit
def _quant_block(v, amax):
    """int8 codes (int32 lanes) of float32 ``v`` with its block's amax broadcast to ``v``'s shape:
    ``round_half_even(v * 127 / amax)`` (0 where amax is 0)."""
    inv = tl.where(amax > 0, 127.0 / tl.maximum(amax, 1e-30), 0.0)
    return _rint(v * inv)


@triton.jit
def _rint(v):
    """float32 ``v`` (|v| < 2**22) rounded half to even, as int32: the bits of ``v + 1.5 * 2**23``
    minus those of ``1.5 * 2**23``."""
    return (v + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000


@triton.jit
def _slice_sums(qi):
    """The code sums of the two 16-value slices of blocks ``qi`` [NB, 2, 4, 4] (int32 lanes) as
    two int16 halves of one int32 [NB, 1, 1, 1] (low half: values 0-15)."""
    i2 = tl.arange(0, 2)[None, :, None, None]
    sums = tl.sum(tl.sum(qi, axis=3, keep_dims=True), axis=2, keep_dims=True)   # [NB, 2, 1, 1]
    return tl.sum((sums & 0xFFFF) << (i2 * 16), axis=1, keep_dims=True)


@triton.jit
def pack_store_blocks(v, b4, bm, q_row, sd_row, WIDE: tl.constexpr = False):
    """Quantize and store 32-value blocks the :class:`QuantAct` way: ``v`` float32
    ``[NB, 2, 4, 4]`` (block, 16-value slice, word, byte) holds blocks ``b4`` (``[NB, 1, 1, 1]``
    block indices in the row, ``bm`` their mask); ``q_row`` points at the row's code words,
    ``sd_row`` at its (slice sums, scale) pairs (``QuantAct.s``'s row: one 8-byte store each).
    ``WIDE`` (a ``wide`` QuantAct): each block also gets the int8 codes of its rounding error
    at a 254 times finer scale, stored after its own (8 words and one (sums, 0) pair each)."""
    i2 = tl.arange(0, 2)[None, :, None, None]
    i4w = tl.arange(0, 4)[None, None, :, None]
    i4b = tl.arange(0, 4)[None, None, None, :]
    amax = tl.max(tl.max(tl.max(tl.abs(v), axis=3, keep_dims=True), axis=2, keep_dims=True),
                  axis=1, keep_dims=True)
    qi = _quant_block(v, amax)
    W: tl.constexpr = 2 if WIDE else 1
    words = tl.sum((qi & 255) << (i4b * 8), axis=3, keep_dims=True)   # [NB, 2, 4, 1]
    tl.store(q_row + b4 * (8 * W) + i2 * 4 + i4w, words, mask=bm)
    packed = _slice_sums(qi)                                          # [NB, 1, 1, 1]
    d = amax / 127.0
    dbits = d.to(tl.int32, bitcast=True)
    pair = (packed.to(tl.int64) & 0xFFFFFFFF) | (dbits.to(tl.int64) << 32)
    sd64 = sd_row.to(tl.pointer_type(tl.int64))
    tl.store(sd64 + b4 * W, pair, mask=bm)
    if WIDE:
        # the residual v - d*q lies within d/2 of 0: codes at scale d/254 span [-127, 127]
        # (clamped against the rounding of d itself)
        r = (v - qi.to(tl.float32) * d) * tl.where(amax > 0, 254.0 / tl.maximum(d, 1e-30), 0.0)
        r = tl.minimum(tl.maximum(r, -127.0), 127.0)
        qr = _rint(r)
        wr = tl.sum((qr & 255) << (i4b * 8), axis=3, keep_dims=True)
        tl.store(q_row + b4 * 16 + 8 + i2 * 4 + i4w, wr, mask=bm)
        tl.store(sd64 + b4 * 2 + 1, _slice_sums(qr).to(tl.int64) & 0xFFFFFFFF, mask=bm)


@triton.jit
def _quantize_act_kernel(x_ptr, xq_ptr, xs_ptr, n_blocks, x_rs, xq_rs, xs_rs, NB: tl.constexpr,
                         WIDE: tl.constexpr = False):
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1) * NB + tl.arange(0, NB)
    bm = (blk < n_blocks)[:, None, None, None]
    i2 = tl.arange(0, 2)[None, :, None, None]
    i4w = tl.arange(0, 4)[None, None, :, None]
    i4b = tl.arange(0, 4)[None, None, None, :]
    b4 = blk[:, None, None, None]
    v = tl.load(x_ptr + t * x_rs + b4 * 32 + i2 * 16 + i4w * 4 + i4b, mask=bm, other=0.0)
    pack_store_blocks(v.to(tl.float32), b4, bm, xq_ptr + t * xq_rs, xs_ptr + t * xs_rs, WIDE)


@triton.jit
def _ld(ptr, mask, other, EVEN: tl.constexpr):
    """Masked load, or a plain one when the launcher proved every lane in bounds (EVEN)."""
    if EVEN:
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=mask, other=other)


@triton.jit
def _x_load(xq_ptr, xs_ptr, xb4, xsb4, kb, mx, EVEN: tl.constexpr, WIDE: tl.constexpr = False):
    """The loads of the quantized x of the 32-value blocks starting at value offsets kb
    [1, 1, CH, 1], broadcast over the BN rows (xb4 / xsb4: the token rows' offsets as
    [TP, BN, 1, 1]), and no arithmetic on them: the words of its two 16-value slices
    [TP, BN, CH, 4] each, the (slice sums, scale) pairs [TP, BN, CH, 1] as int64, and with
    ``WIDE`` the residual codes' words and pairs (else the same tiles again)."""
    W: tl.constexpr = 2 if WIDE else 1
    i4 = tl.arange(0, 4)[None, None, None, :]
    xw = xq_ptr + xb4 + (kb // 4) * W + i4
    x0 = _ld(xw, mx, 0, EVEN)
    x1 = _ld(xw + 4, mx, 0, EVEN)
    sd = xs_ptr.to(tl.pointer_type(tl.int64)) + xsb4 // 2 + (kb // 32) * W
    pair = _ld(sd, mx, 0, EVEN)
    if WIDE:
        return x0, x1, pair, _ld(xw + 8, mx, 0, EVEN), _ld(xw + 12, mx, 0, EVEN), \
            _ld(sd + 1, mx, 0, EVEN)
    else:
        return x0, x1, pair, x0, x1, pair


@triton.jit
def _x_unpack(xl, WIDE: tl.constexpr = False):
    """:func:`_x_load`'s tuple -> ``(x0, x1, x0r, x1r, s0, s1, dx)``: the two word tiles,
    the residual ones (``WIDE``; else ``x0``, ``x1`` again), the int8 sums of the two slices
    and the block scale [TP, BN, CH, 1] (``WIDE``: float32 sums ``hi + lo / 254``)."""
    x0, x1, pair, x0r, x1r, pr = xl
    sp = pair.to(tl.int32)
    dx = (pair >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    s0 = (sp << 16) >> 16
    s1 = sp >> 16
    if WIDE:
        spr = pr.to(tl.int32)
        s0f = s0.to(tl.float32) + ((spr << 16) >> 16).to(tl.float32) * (1.0 / 254.0)
        s1f = s1.to(tl.float32) + (spr >> 16).to(tl.float32) * (1.0 / 254.0)
        return x0, x1, x0r, x1r, s0f, s1f, dx
    else:
        return x0, x1, x0, x1, s0, s1, dx


@triton.jit
def _idot_x(wq, xw, xr, USE_ASM: tl.constexpr, WIDE: tl.constexpr):
    """:func:`_idot` of code words ``wq`` with x's words ``xw``; ``WIDE``: plus the residual
    codes' dot ``xr`` / 254, in float32."""
    if WIDE:
        return (_idot(wq, xw, USE_ASM).to(tl.float32)
                + _idot(wq, xr, USE_ASM).to(tl.float32) * (1.0 / 254.0))
    else:
        return _idot(wq, xw, USE_ASM)


@triton.jit
def k_super_scales(w):
    """Q4_K/Q5_K ``d`` plane words (float16 bits of d | dmin << 16) -> (d, dmin) float32."""
    d = w.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    dm = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return d, dm


@triton.jit
def k_chunk_scales(v):
    """Q4_K/Q5_K ``sc`` plane int16 (6-bit scale | 6-bit min << 8) -> (scale, min) int32."""
    v = v.to(tl.int32)
    return v & 0xFF, v >> 8


@triton.jit
def _qtile_load(c0, c_end, rows4, rmask4, tmask4, xq_ptr, xs_ptr, xb4, xsb4,
                q_ptr, qh_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr,
                q_rs, qh_rs, d_rs, dm_rs, sc_rs, mn_rs,
                QTYPE: tl.constexpr, CV: tl.constexpr, CH: tl.constexpr, EVEN: tl.constexpr,
                WIDE: tl.constexpr = False):
    """Every load of the tile of chunks c0 .. c0+CH-1 (< c_end) that :func:`_qtile_dot`
    multiplies, and nothing computed from them: ``(x, x2, w)`` with ``x`` / ``x2`` the
    :func:`_x_load` tuples of the chunk's first and (Q2_K/Q3_K) second 32 values, ``w`` six
    weight-plane tiles (which planes depends on ``QTYPE``; 0 where unused).

    Every operand is loaded as a 4-D tile [TP|1, BN, CH, 4|1] (x broadcast over rows by a
    zero-stride pointer). x's words reach the dots through shared memory, and a load written
    after that exchange is issued only once x has arrived, one more round trip per tile (seen
    in the sm_90 SASS of the fused MoE and the Q6_K head: ``benchmarks/sass_quant.py``,
    ``late_loads``): so every load of a tile comes before any arithmetic, and
    :func:`_qk_loop`'s look-ahead can issue the next tile's loads before this tile's dots."""
    cc = c0 + tl.arange(0, CH)
    c4 = cc[None, None, :, None]
    cm4 = (cc < c_end)[None, None, :, None]
    i4 = tl.arange(0, 4)[None, None, None, :]
    mw = rmask4 & cm4
    mx = tmask4 & cm4
    # ---- x: int8 words + sums of each 16-value slice, one scale per 32 values ----------------
    kb = c4 * CV
    xl = _x_load(xq_ptr, xs_ptr, xb4, xsb4, kb, mx, EVEN, WIDE)
    if CV == 64:
        xl2 = _x_load(xq_ptr, xs_ptr, xb4, xsb4, kb + 32, mx, EVEN, WIDE)
    else:
        xl2 = xl
    # ---- weight loads -------------------------------------------------------------------------
    w1 = 0
    w2 = 0
    w3 = 0
    w4 = 0
    w5 = 0
    if QTYPE == _Q8_0:
        wp = q_ptr + rows4 * q_rs + c4 * 8 + i4
        w0 = _ld(wp, mw, 0, EVEN)
        w1 = _ld(wp + 4, mw, 0, EVEN)
        w2 = _ld(d_ptr + rows4 * d_rs + c4, mw, 0.0, EVEN)
    elif CV == 32:
        w0 = _ld(q_ptr + rows4 * q_rs + c4 * 4 + i4, mw, 0, EVEN)
        if QTYPE == _Q5_0 or QTYPE == _Q5_1 or QTYPE == _Q5_K:
            w1 = _ld(qh_ptr + rows4 * qh_rs + c4, mw, 0, EVEN)
        if QTYPE == _Q6_K:
            hp = qh_ptr + rows4 * qh_rs + c4 * 2
            w1 = _ld(hp, mw, 0, EVEN)
            w2 = _ld(hp + 1, mw, 0, EVEN)
            w3 = _ld(d_ptr + rows4 * d_rs + c4 // 8, mw, 0.0, EVEN)
            sp = sc_ptr + rows4 * sc_rs + c4 * 2
            w4 = _ld(sp, mw, 0, EVEN)
            w5 = _ld(sp + 1, mw, 0, EVEN)
        elif QTYPE == _Q4_K or QTYPE == _Q5_K:
            w3 = _ld(d_ptr + rows4 * d_rs + c4 // 8, mw, 0, EVEN)
            w4 = _ld(sc_ptr + rows4 * sc_rs + c4, mw, 0, EVEN)
        elif QTYPE == _IQ4_XS:
            w3 = _ld(d_ptr + rows4 * d_rs + c4 // 8, mw, 0.0, EVEN)
            w4 = _ld(sc_ptr + rows4 * sc_rs + c4, mw, 0, EVEN)
        else:
            w3 = _ld(d_ptr + rows4 * d_rs + c4, mw, 0.0, EVEN)
            if QTYPE == _Q4_1 or QTYPE == _Q5_1:
                w4 = _ld(dm_ptr + rows4 * dm_rs + c4, mw, 0.0, EVEN)
    else:  # CV == 64: Q2_K, Q3_K (2-bit low codes, 4 slices per chunk)
        # the chunk's 4 scale bytes as one 32-bit word (plane_args checks the plane's
        # alignment); Q3_K's high bits as a tile beside the codes, one int16 per code word, so
        # the codes, their high bits and x keep one layout (vectorized loads)
        w0 = _ld(q_ptr + rows4 * q_rs + c4 * 4 + i4, mw, 0, EVEN)
        w1 = _ld((sc_ptr + rows4 * sc_rs + c4 * 4).to(tl.pointer_type(tl.int32)), mw, 0, EVEN)
        w2 = _ld(d_ptr + rows4 * d_rs + c4 // 4, mw, 0.0, EVEN)
        if QTYPE == _Q3_K:
            w3 = _ld(qh_ptr + rows4 * qh_rs + c4 * 4 + i4, mw, 0, EVEN)
        else:
            w3 = _ld(dm_ptr + rows4 * dm_rs + c4 // 4, mw, 0.0, EVEN)
    return xl, xl2, (w0, w1, w2, w3, w4, w5)


@triton.jit
def _qtile_dot(acc, tile, QTYPE: tl.constexpr, CV: tl.constexpr, USE_ASM: tl.constexpr,
               WIDE: tl.constexpr = False):
    """acc [TP, BN, CH, 1] += the contributions of one tile loaded by :func:`_qtile_load`."""
    xl, xl2, w = tile
    w0, w1, w2, w3, w4, w5 = w
    i4 = tl.arange(0, 4)[None, None, None, :]
    x0, x1, x0r, x1r, s0, s1, dx0 = _x_unpack(xl, WIDE)
    if CV == 64:
        x2, x3, x2r, x3r, s2, s3, dx1 = _x_unpack(xl2, WIDE)
    if QTYPE == _Q8_0:
        idot = _idot_x(w0, x0, x0r, USE_ASM, WIDE) + _idot_x(w1, x1, x1r, USE_ASM, WIDE)
        acc += dx0 * (w2.to(tl.float32) * idot.to(tl.float32))
    elif CV == 32:
        wv = w0
        if QTYPE == _IQ4_NL or QTYPE == _IQ4_XS:
            lo, hi = iq4_lookup(wv, USE_ASM)
        else:
            lo = wv & 0x0F0F0F0F
            hi = (wv >> 4) & 0x0F0F0F0F
        if QTYPE == _Q5_0 or QTYPE == _Q5_1 or QTYPE == _Q5_K:
            lo = lo | (((w1 >> i4) & 0x01010101) << 4)
            hi = hi | (((w1 >> (i4 + 4)) & 0x01010101) << 4)
        if QTYPE == _Q6_K:
            lo = lo | (((w1 >> (i4 * 2)) & 0x03030303) << 4)
            hi = hi | (((w2 >> (i4 * 2)) & 0x03030303) << 4)
        i_lo = _idot_x(lo, x0, x0r, USE_ASM, WIDE)
        i_hi = _idot_x(hi, x1, x1r, USE_ASM, WIDE)
        if QTYPE == _Q6_K:
            it = w4.to(tl.int32) * (i_lo - 32 * s0) + w5.to(tl.int32) * (i_hi - 32 * s1)
            acc += dx0 * (w3.to(tl.float32) * it.to(tl.float32))
        elif QTYPE == _Q4_K or QTYPE == _Q5_K:
            d, dm = k_super_scales(w3)
            sc, mn = k_chunk_scales(w4)
            i_d = (sc * (i_lo + i_hi)).to(tl.float32)
            i_m = (mn * (s0 + s1)).to(tl.float32)
            acc += dx0 * (d * i_d - dm * i_m)
        elif QTYPE == _IQ4_XS:
            acc += dx0 * (w3.to(tl.float32) * (w4.to(tl.int32) * (i_lo + i_hi)).to(tl.float32))
        else:
            idot = i_lo + i_hi
            d = w3.to(tl.float32)
            if QTYPE == _IQ4_NL:
                acc += dx0 * (d * idot.to(tl.float32))
            elif QTYPE == _Q4_0:
                acc += dx0 * (d * (idot - 8 * (s0 + s1)).to(tl.float32))
            elif QTYPE == _Q5_0:
                acc += dx0 * (d * (idot - 16 * (s0 + s1)).to(tl.float32))
            else:  # Q4_1, Q5_1: w = d*q + m
                acc += dx0 * (d * idot.to(tl.float32) + w4.to(tl.float32) * (s0 + s1).to(tl.float32))
    else:
        wv = w0
        sw = w1
        d = w2.to(tl.float32)
        c0w = wv & 0x03030303
        c1w = (wv >> 2) & 0x03030303
        c2w = (wv >> 4) & 0x03030303
        c3w = (wv >> 6) & 0x03030303
        if QTYPE == _Q3_K:
            hw = w3.to(tl.int32)
            # int8 scales, sign-extended
            b0 = (sw << 24) >> 24
            b1 = (sw << 16) >> 24
            b2 = (sw << 8) >> 24
            b3 = sw >> 24
            # slice s's 4 high bits (bits 4s..4s+3 of hw) spread to bit 2 of each byte: the
            # four shifted copies of a nibble x*(4 + 2^9 + 2^16 + 2^23) do not overlap
            c0w = c0w | ((hw & 0xF) * 0x00810204) & 0x04040404
            c1w = c1w | (((hw >> 4) & 0xF) * 0x00810204) & 0x04040404
            c2w = c2w | (((hw >> 8) & 0xF) * 0x00810204) & 0x04040404
            c3w = c3w | (((hw >> 12) & 0xF) * 0x00810204) & 0x04040404
            ia = (b0 * (_idot_x(c0w, x0, x0r, USE_ASM, WIDE) - 4 * s0)
                  + b1 * (_idot_x(c1w, x1, x1r, USE_ASM, WIDE) - 4 * s1))
            ib = (b2 * (_idot_x(c2w, x2, x2r, USE_ASM, WIDE) - 4 * s2)
                  + b3 * (_idot_x(c3w, x3, x3r, USE_ASM, WIDE) - 4 * s3))
            acc += d * (dx0 * ia.to(tl.float32) + dx1 * ib.to(tl.float32))
        else:  # Q2_K: byte = scale | min << 4
            dm = w3.to(tl.float32)
            b0 = sw & 0xFF
            b1 = (sw >> 8) & 0xFF
            b2 = (sw >> 16) & 0xFF
            b3 = (sw >> 24) & 0xFF
            ia = ((b0 & 15) * _idot_x(c0w, x0, x0r, USE_ASM, WIDE)
                  + (b1 & 15) * _idot_x(c1w, x1, x1r, USE_ASM, WIDE))
            ib = ((b2 & 15) * _idot_x(c2w, x2, x2r, USE_ASM, WIDE)
                  + (b3 & 15) * _idot_x(c3w, x3, x3r, USE_ASM, WIDE))
            ma = (b0 >> 4) * s0 + (b1 >> 4) * s1
            mb = (b2 >> 4) * s2 + (b3 >> 4) * s3
            acc += dx0 * (d * ia.to(tl.float32) - dm * ma.to(tl.float32)) \
                + dx1 * (d * ib.to(tl.float32) - dm * mb.to(tl.float32))
    return acc


@triton.jit
def _qtile(acc, c0, c_end, rows4, rmask4, tmask4, xq_ptr, xs_ptr, xb4, xsb4,
           q_ptr, qh_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr,
           q_rs, qh_rs, d_rs, dm_rs, sc_rs, mn_rs,
           QTYPE: tl.constexpr, CV: tl.constexpr, CH: tl.constexpr, EVEN: tl.constexpr,
           USE_ASM: tl.constexpr, WIDE: tl.constexpr = False):
    """acc [TP, BN, CH, 1] += contributions of chunks c0 .. c0+CH-1 (< c_end) of the rows4
    [1, BN, 1, 1] (int64 plane rows) for the quantized x rows at xb4 / xsb4: every load of
    the tile (:func:`_qtile_load`), then its dots (:func:`_qtile_dot`)."""
    tile = _qtile_load(c0, c_end, rows4, rmask4, tmask4, xq_ptr, xs_ptr, xb4, xsb4,
                       q_ptr, qh_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr,
                       q_rs, qh_rs, d_rs, dm_rs, sc_rs, mn_rs, QTYPE, CV, CH, EVEN, WIDE)
    return _qtile_dot(acc, tile, QTYPE, CV, USE_ASM, WIDE)


@triton.jit
def _qk_loop(acc, c_begin, c_end, rows4, rmask4, tmask4, xq_ptr, xs_ptr, xb4, xsb4,
             q_ptr, qh_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr,
             q_rs, qh_rs, d_rs, dm_rs, sc_rs, mn_rs,
             QTYPE: tl.constexpr, CV: tl.constexpr, CH: tl.constexpr, EVEN: tl.constexpr,
             USE_ASM: tl.constexpr, WIDE: tl.constexpr = False, STAGES: tl.constexpr = 1,
             LOOKAHEAD: tl.constexpr = False):
    """The K loop over chunks ``c_begin .. c_end - 1`` (``c_end > c_begin``) in tiles of
    ``CH``: :func:`_qtile` per tile (``STAGES`` > 1: Triton's software pipeline through
    shared memory), or with ``LOOKAHEAD`` the next tile's loads issued into registers before
    the current tile's dots (the first tile loaded before the loop, the last multiplied after
    it: no load past ``c_end``), so a program has two tiles' bytes in flight while it
    computes. Returns ``acc``."""
    if LOOKAHEAD:
        cur = _qtile_load(c_begin, c_end, rows4, rmask4, tmask4, xq_ptr, xs_ptr, xb4, xsb4,
                          q_ptr, qh_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr,
                          q_rs, qh_rs, d_rs, dm_rs, sc_rs, mn_rs, QTYPE, CV, CH, EVEN, WIDE)
        for c0 in tl.range(c_begin + CH, c_end, CH):
            nxt = _qtile_load(c0, c_end, rows4, rmask4, tmask4, xq_ptr, xs_ptr, xb4, xsb4,
                              q_ptr, qh_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr,
                              q_rs, qh_rs, d_rs, dm_rs, sc_rs, mn_rs, QTYPE, CV, CH, EVEN,
                              WIDE)
            acc = _qtile_dot(acc, cur, QTYPE, CV, USE_ASM, WIDE)
            cur = nxt
        acc = _qtile_dot(acc, cur, QTYPE, CV, USE_ASM, WIDE)
    else:
        for c0 in tl.range(c_begin, c_end, CH, num_stages=STAGES):
            acc = _qtile(acc, c0, c_end, rows4, rmask4, tmask4, xq_ptr, xs_ptr, xb4, xsb4,
                         q_ptr, qh_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr,
                         q_rs, qh_rs, d_rs, dm_rs, sc_rs, mn_rs, QTYPE, CV, CH, EVEN, USE_ASM,
                         WIDE)
    return acc


@triton.jit
def _x_rows(xq_rs, xs_rs, xrow, rows4, BROADCAST_ROWS: tl.constexpr = False):
    """Word / (sum, scale) offsets [TP, BN, 1, 1] (int64) of the x rows ``xrow`` [TP],
    broadcast over the BN rows of ``rows4`` (a zero-stride dimension)."""
    r = xrow.to(tl.int64)[:, None, None, None]
    if BROADCAST_ROWS:
        z = rows4 * 0
        return r * xq_rs + z, r * xs_rs + z
    else:
        return r * xq_rs, r * xs_rs


# -----------------------------------------------------------------------------------------------
# the GEMV kernel
# -----------------------------------------------------------------------------------------------

@triton.jit
def _words(QTYPE: tl.constexpr):
    """Elements of the code plane per chunk (int32 words: 8 for Q8_0, 4 for the others)."""
    if QTYPE == _Q8_0:
        return 8
    else:
        return 4


@triton.jit
def _quant_gemv_kernel(xq_ptr, xs_ptr, y_ptr, q_ptr, qh_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr,
                       N, T, n_chunks, split_chunks,
                       xq_rs, xs_rs, y_rs, y_ss, q_rs, qh_rs, d_rs, dm_rs, sc_rs, mn_rs,
                       QTYPE: tl.constexpr, CV: tl.constexpr, TP: tl.constexpr, BN: tl.constexpr,
                       CH: tl.constexpr, EVEN: tl.constexpr, XB: tl.constexpr, ATOMIC: tl.constexpr,
                       USE_ASM: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr = False,
                       LINE: tl.constexpr = 32, WIDE: tl.constexpr = False,
                       STAGES: tl.constexpr = 1, LOOKAHEAD: tl.constexpr = False):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BN + tl.arange(0, BN)
    rmask4 = (rows < N)[None, :, None, None]
    rows4 = rows.to(tl.int64)[None, :, None, None]
    c_begin = pid_k * split_chunks
    c_end = tl.minimum(c_begin + split_chunks, n_chunks)
    if PREFETCH:   # the weights are constant: fetch them while the previous kernel finishes
        prefetch_rows_l2(q_ptr, rows, rows < N, q_rs, c_begin * _words(QTYPE),
                       c_end * _words(QTYPE), LINE, PDL)
    pdl_begin(PDL)
    # one pass over the K range per token: every tile then has the weights' register layout;
    # passes after the first re-read this program's rows from L1/L2, not from HBM
    for ti in tl.static_range(TP):
        tt = tl.zeros([1], dtype=tl.int32) + ti
        tmask4 = (tt < T)[:, None, None, None]
        xb4, xsb4 = _x_rows(xq_rs, xs_rs, tt, rows4, XB)
        acc = tl.zeros([1, BN, CH, 1], dtype=tl.float32)
        acc = _qk_loop(acc, c_begin, c_end, rows4, rmask4, tmask4, xq_ptr, xs_ptr, xb4, xsb4,
                       q_ptr, qh_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr,
                       q_rs, qh_rs, d_rs, dm_rs, sc_rs, mn_rs, QTYPE, CV, CH, EVEN, USE_ASM,
                       WIDE, STAGES, LOOKAHEAD)
        out = tl.sum(tl.sum(acc, axis=3), axis=2)                    # [1, BN]
        # y_ss: the partials' slice stride (0: every split adds into one output)
        yp = y_ptr + pid_k.to(tl.int64) * y_ss + tt[:, None].to(tl.int64) * y_rs + rows[None, :]
        ym = (tt < T)[:, None] & (rows < N)[None, :]
        if ATOMIC:
            tl.atomic_add(yp, out, mask=ym)
        else:
            tl.store(yp, out.to(y_ptr.dtype.element_ty), mask=ym)


# -----------------------------------------------------------------------------------------------
# launchers and twins
# -----------------------------------------------------------------------------------------------

class QuantAct(NamedTuple):
    """Activations quantized the kernels' way (:func:`quantize_act`), ``K`` a multiple of 32.

    Attributes:
        q: int32 ``[T, K/4]``: int8 codes, value ``4w+b`` in byte ``b`` of word ``w``.
        s: int32 ``[T, K/32]``: the sums of the codes of the two 16-value slices of each 32-value
            block as two int16 halves (low half: values 0-15).
        d: float32 ``[T, K/32]``: the scale of each 32-value block (``amax / 127``).
        wide: ``"int16"`` activation precision (:func:`act_precision`): each block also holds
            the int8 codes ``r`` of its rounding error at the scale ``d / 254``
            (``x ~ d * (q + r / 254)``, about 15 bits per value), which the kernels dot with the
            same weight codes (twice the ``dp4a``). Then ``q`` is ``[T, K/2]`` (block ``b``'s 8
            words at ``16b``, its residual's at ``16b + 8``) and the pairs buffer holds
            ``(sums, scale), (residual sums, 0)`` per block.

    ``s`` and ``d`` are views of one int32 buffer ``[T, K/32, 2]`` (``[T, K/32, 4]`` wide: a
    block's sums, then its scale's bits), so a kernel reads both with one 8-byte load
    (:meth:`empty` allocates them so; :meth:`is_packed` checks it).
    """

    q: torch.Tensor
    s: torch.Tensor
    d: torch.Tensor
    wide: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.q.shape[1] * (2 if self.wide else 4))

    @property
    def device(self) -> torch.device:
        return self.q.device

    def pairs(self) -> torch.Tensor:
        """The int32 buffer that ``s`` and ``d`` view, ``[T, K/32, 2]`` (``[T, K/32, 4]`` wide:
        the residual codes' sums third), in the kernels' layout (:meth:`is_packed`)."""
        t, k = self.shape
        w = 2 if self.wide else 1
        return self.s.as_strided((t, k // 32, 2 * w), (self.s.stride(0), 2 * w, 1))

    def rows(self, a: int, b: int) -> "QuantAct":
        return QuantAct(self.q[a:b], self.s[a:b], self.d[a:b], self.wide)

    def is_packed(self, t: int, k: int, device) -> bool:
        """Whether this is a QuantAct of ``[t, k]`` on ``device`` in the kernels' layout (``q``
        rows contiguous, ``s``/``d`` interleaved in one buffer as :meth:`empty` makes them)."""
        q, s, d, wide = self
        w = 2 if wide else 1
        dev = torch.device(device)        # "cuda" (no index) means the current device
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return (q.shape == (t, k // 4 * w) and s.shape == (t, k // 32) and d.shape == (t, k // 32)
                and q.dtype == torch.int32 and s.dtype == torch.int32 and d.dtype == torch.float32
                and q.device == dev and s.device == q.device
                and d.device == q.device and q.stride(1) == 1 and s.stride(1) == 2 * w
                and d.stride(1) == 2 * w and s.stride(0) == d.stride(0)
                and (s.numel() == 0 or (d.data_ptr() == s.data_ptr() + 4
                                        and s.data_ptr() % 8 == 0)))

    @staticmethod
    def empty(t: int, k: int, device, wide: bool | None = None) -> "QuantAct":
        """Uninitialized buffers for ``[t, k]`` activations; ``wide`` None: the precision in
        effect (:func:`act_precision`)."""
        wide = wide_default(wide)
        w = 2 if wide else 1
        sd = torch.empty((t, k // 32, 2 * w), dtype=torch.int32, device=device)
        return QuantAct(torch.empty((t, k // 4 * w), dtype=torch.int32, device=device),
                        sd[..., 0], sd.view(torch.float32)[..., 1], wide)


def quantize_act(x: torch.Tensor, blocks_per_program: int = 16,
                 wide: bool | None = None) -> QuantAct:
    """Quantize ``x [T, K]`` (float, K a multiple of 32, rows contiguous) to int8 per 32-value
    block (one launch); ``wide`` (None: the :func:`act_precision` in effect is ``"int16"``)
    adds the residual codes. The torch twin is :func:`quantize_act_ref`."""
    t, k = x.shape
    if k % 32 or x.stride(1) != 1:
        raise ValueError(f"quantize_act: x must be [T, K] with K % 32 == 0 and contiguous rows, "
                         f"got {tuple(x.shape)}")
    xa = QuantAct.empty(t, k, x.device, wide)
    nb = k // 32
    _quantize_act_kernel[(t, cdiv(nb, blocks_per_program))](
        x, xa.q, xa.s, nb, x.stride(0), xa.q.stride(0), xa.s.stride(0),
        NB=blocks_per_program, WIDE=xa.wide, num_warps=2)
    return xa


def plane_args(w: QuantTensor) -> tuple[list[torch.Tensor], list[int]]:
    """The six plane pointers (q, qh, d, dmin, sc, mn; a stand-in where a format has none) and
    their row strides in elements, in the kernels' argument order."""
    p = w.planes
    if w.qtype in (Q2_K, Q3_K):   # the tile loads a chunk's 4 scale bytes at once
        t = p["sc"]
        if t.data_ptr() % 4 or (t.stride(0) * t.element_size()) % 4:
            raise ValueError(f"{QTYPE_NAMES[w.qtype]} scale plane is not 4-byte aligned (rows "
                             "and start); the kernels read it in words")
    ptrs, strides = [], []
    for key in ("q", "qh", "d", "dmin", "sc", "mn"):
        t = p.get(key)
        ptrs.append(t if t is not None else p["q"])
        strides.append(t.stride(0) if t is not None else 0)
    return ptrs, strides


def gemv_config(n: int, k: int, t: int, qtype: int, device=None) -> dict:
    """Launch choice for ``t`` tokens of an ``[n, k]`` weight of GGUF type ``qtype`` on
    ``device`` (a torch device or its name; None: the table of a CUDA device without a file of
    its own, the H200's): ``BN`` rows per program, ``CH`` chunks per tile (at most the K chunks
    rounded up to a power of two), ``num_warps``, ``xb``, ``stages``, ``lookahead`` where the
    rule sets it (:func:`_qk_loop`), and ``split`` programs over K
    (doubled while the grid has fewer than ``min_programs`` programs, at most ``max_split``
    ways, each part keeping at least ``CH`` chunks), from the ``gemv`` and ``gemv_split``
    knobs of the device's launch table (:mod:`localmoe.kernels.launch_config`)."""
    table = device_table(device)
    feats = {"tokens": t, "n": n, "k": k, "qtype": QTYPE_NAMES[qtype]}
    cfg = table.lookup("gemv", **feats)
    sp = table.lookup("gemv_split", **feats)
    n_chunks = k // chunk_values(qtype)
    cfg["CH"] = min(cfg["CH"], next_pow2(n_chunks))
    blocks = cdiv(n, cfg["BN"])
    split = 1
    while (blocks * split < sp["min_programs"] and split < sp["max_split"]
           and n_chunks // (split * 2) >= cfg["CH"]):
        split *= 2
    cfg["split"] = split
    return cfg


def _check_x(x, k: int, what: str) -> None:
    if isinstance(x, QuantAct):
        if x.q.dim() != 2 or not x.is_packed(x.q.shape[0], k, x.q.device):
            raise ValueError(f"{what}: quantized x must be a QuantAct [T, {k}] as "
                             "QuantAct.empty or quantize_act makes it")
        return
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"{what}: x must be [T, {k}], got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{what}: x must be float32/float16/bfloat16, got {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError(f"{what}: x rows must be contiguous")


def _check_xw(x, w: QuantTensor, what: str) -> tuple[int, int]:
    """``(N, K)`` of a 2-D weight ``w`` that ``x`` fits (shapes, dtypes, device), else raise."""
    if len(w.shape) != 2:
        raise ValueError(f"{what}: w must be 2-D [N, K], got shape {w.shape}")
    n, k = w.shape
    _check_x(x, k, what)
    if x.device != w.device:
        raise ValueError(f"{what}: x on {x.device}, w on {w.device}")
    return n, k


def quant_gemv(x: torch.Tensor | QuantAct, w: QuantTensor, out: torch.Tensor | None = None,
               config: dict | None = None) -> torch.Tensor:
    """``x @ dequant(w).T`` for decode.

    Args:
        x: ``[T, K]`` float32/float16/bfloat16 activations (rows contiguous; quantized first by
            one :func:`quantize_act` launch), or a :class:`QuantAct` (e.g. made once for several
            weights, or by the kernel that produces x). ``T`` >= 1: the kernel is built for 1-8
            tokens; more run in groups of 8.
        w: a 2-D ``[N, K]`` :class:`QuantTensor` on ``x``'s device (float weights use torch).
        out: optional ``[T, N]`` output (any float dtype).
        config: override of :func:`gemv_config` (keys BN, CH, num_warps, split; ``xb`` True
            loads x once per row instead of once per thread; ``asm`` False runs the
            plain-integer dp4a emulation, for comparisons).
    Returns:
        ``[T, N]`` in ``x.dtype`` (float32 for a QuantAct) or ``out``.
    Raises:
        ValueError / TypeError: shapes, dtypes or devices that do not fit.
    """
    n, k = _check_xw(x, w, "quant_gemv")
    t = x.shape[0]
    if out is None:
        dt = torch.float32 if isinstance(x, QuantAct) else x.dtype
        out = torch.empty((t, n), dtype=dt, device=x.device)
    if w.is_float:
        if isinstance(x, QuantAct):
            raise ValueError("quant_gemv: float weights take float activations")
        out.copy_(x.to(w.planes["w"].dtype) @ w.planes["w"].T)
        return out
    if w.qtype not in QUANT_QTYPES:
        raise ValueError(f"quant_gemv: unsupported qtype {QTYPE_NAMES.get(w.qtype, w.qtype)}")
    if not isinstance(x, QuantAct):
        x = quantize_act(x)
    for t0 in range(0, t, 8):
        _launch_gemv(x.rows(t0, t0 + 8), w, out[t0:t0 + 8], config)
    return out


def _plan(w: QuantTensor, t: int, config: dict | None) -> tuple[dict, int, int, int]:
    """(config, K chunks, programs over K, chunks per K program) of ``t`` tokens."""
    n, k = w.shape
    cfg = dict(gemv_config(n, k, t, w.qtype, device=w.device), **(config or {}))
    n_chunks = k // chunk_values(w.qtype)
    split = cfg.get("split", 1)
    split_chunks = cdiv(cdiv(n_chunks, split), cfg["CH"]) * cfg["CH"]
    return cfg, n_chunks, cdiv(n_chunks, split_chunks), split_chunks


# weights at most this large are prefetched into L2 (50 MB on the H200) before PDL's wait; an
# output head (~250 MB) is not: its programs run in many waves, the prefetch would only add
# instructions to a kernel that already streams at ~75% of the bandwidth
_PREFETCH_MAX = 24 << 20


def _launch_gemv(x: QuantAct, w: QuantTensor, out: torch.Tensor, config: dict | None,
                 partials: bool = False):
    """One launch for <= 8 tokens; ``partials``: ``out`` is ``[S, t, N]`` float32 (S = the
    plan's split), slice ``s`` written by the programs of K part ``s`` with plain stores."""
    n, k = w.shape
    t = x.shape[0]
    cfg, n_chunks, split, split_chunks = _plan(w, t, config)
    cv = chunk_values(w.qtype)
    y = out
    if partials:
        if out.shape[0] != split:
            raise ValueError(f"quant_gemv_partials: out has {out.shape[0]} slices, the launch "
                             f"splits K {split} ways")
    elif split > 1:
        y = out if (out.dtype == torch.float32 and out.stride(1) == 1) else \
            torch.empty((t, n), dtype=torch.float32, device=out.device)
        y.zero_()
    ptrs, strides = plane_args(w)
    grid = (cdiv(n, cfg["BN"]), split)
    _quant_gemv_kernel[grid](
        x.q, x.s, y, *ptrs, n, t, n_chunks, split_chunks,
        x.q.stride(0), x.s.stride(0), y.stride(-2),
        y.stride(0) if partials else 0, *strides,
        QTYPE=w.qtype, CV=cv, TP=next_pow2(t), BN=cfg["BN"], CH=cfg["CH"],
        EVEN=(n % cfg["BN"] == 0 and split_chunks % cfg["CH"] == 0 and n_chunks % split_chunks == 0
              and t == next_pow2(t)),
        XB=cfg.get("xb", False), ATOMIC=split > 1 and not partials, USE_ASM=cfg.get("asm", use_asm()),
        PREFETCH=pdl_prefetch(y.device) and w.nbytes <= _PREFETCH_MAX,
        LINE=128 // ptrs[0].element_size(), WIDE=x.wide, STAGES=int(cfg.get("stages", 1)),
        num_warps=cfg.get("num_warps", 4), **lookahead_arg(cfg), **pdl_args(y.device))
    if y is not out:
        out.copy_(y)


def gemv_partials_split(w: QuantTensor, t: int, config: dict | None = None) -> int:
    """``S``, the slices of :func:`quant_gemv_partials`'s output for ``t`` tokens of ``w``
    with ``config`` (1 for float weights): size static buffers with it."""
    if w.is_float:
        return 1
    return _plan(w, max(1, min(t, 8)), config)[2]


def quant_gemv_partials(x: torch.Tensor | QuantAct, w: QuantTensor, config: dict | None = None,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequant(w).T`` as split-K partial sums: one launch, plain stores, no zeroed
    output and no atomics (:func:`quant_gemv` with ``split > 1`` is a zeroing, the GEMV with
    atomic adds, and for a half output a copy: 2-3 graph nodes; this is 1).

    Program (row block, K part ``s``) stores its partial sums into slice ``s``; the sum over
    slices (:func:`sum_partials`, or the consumer, e.g.
    :func:`localmoe.kernels.fused_norm.add_rms_norm_quant`) is ``x @ dequant(w).T``, equal to
    :func:`quant_gemv`'s output up to the float32 order of the additions.

    Args:
        x: ``[T, K]`` float activations (quantized first by one :func:`quantize_act` launch) or
            a :class:`QuantAct`.
        w: a 2-D ``[N, K]`` :class:`QuantTensor` on ``x``'s device; float weights give one
            slice (``x @ W.T`` by torch; they take float ``x`` only).
        config: as for :func:`quant_gemv`; its ``split`` fixes ``S`` (after rounding the K
            range to whole tiles: :func:`gemv_partials_split` gives the ``S`` of a config).
            Groups of 8 tokens share one launch plan, so every token has the same ``S``.
        out: optional float32 ``[S, T, N]`` (rows contiguous), e.g. a CUDA graph's static
            buffer.
    Returns:
        float32 ``[S, T, N]`` (``S`` = 1 when K is not split).
    Raises:
        ValueError / TypeError: shapes, dtypes or devices that do not fit.
    """
    n, k = _check_xw(x, w, "quant_gemv_partials")
    t = x.shape[0]
    plan = None
    if w.is_float:
        split = 1
    else:
        if w.qtype not in QUANT_QTYPES:
            raise ValueError(f"quant_gemv_partials: unsupported qtype "
                             f"{QTYPE_NAMES.get(w.qtype, w.qtype)}")
        cfg, _, split, _ = _plan(w, max(1, min(t, 8)), config)
        plan = dict(cfg, split=split)
    if out is None:
        out = torch.empty((split, t, n), dtype=torch.float32, device=x.device)
    elif (tuple(out.shape) != (split, t, n) or out.dtype != torch.float32
          or out.device != x.device or out.stride(2) != 1):
        raise ValueError(f"quant_gemv_partials: out must be float32 [{split}, {t}, {n}] on "
                         f"{x.device} with contiguous rows, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    if w.is_float:
        if isinstance(x, QuantAct):
            raise ValueError("quant_gemv_partials: float weights take float activations")
        out[0].copy_(x.to(w.planes["w"].dtype) @ w.planes["w"].T)
        return out
    if not isinstance(x, QuantAct):
        x = quantize_act(x)
    for t0 in range(0, t, 8):
        _launch_gemv(x.rows(t0, t0 + 8), w, out[:, t0:t0 + 8], plan, partials=True)
    return out


def sum_partials(p: torch.Tensor) -> torch.Tensor:
    """The sum over the slices of split-K partials ``p [S, T, N]`` in float32, in slice order
    (``(p[0] + p[1]) + p[2] ...``, the order :func:`localmoe.kernels.fused_norm.add_rms_norm_quant`
    adds them): ``[T, N]`` float32."""
    if p.dim() != 3 or p.shape[0] < 1:
        raise ValueError(f"sum_partials: p must be [S, T, N] with S >= 1, got {tuple(p.shape)}")
    acc = p[0].float().clone()
    for s in range(1, p.shape[0]):
        acc += p[s].float()
    return acc


def _act_codes_ref(x: torch.Tensor, wide: bool) -> tuple[torch.Tensor, ...]:
    """(codes, residual codes or None, scale) of ``x [T, K]`` per 32-value block, float32
    ``[T, K/32, 32]`` / ``[T, K/32, 1]``: what :func:`pack_store_blocks` stores."""
    t, k = x.shape
    xb = x.float().reshape(t, k // 32, 32)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    # tensor / tensor: torch's CPU ``127.0 / tensor`` is a reciprocal times 127, one ulp off the
    # kernels' IEEE quotient (which moves the exact .5 codes that float16 inputs often give)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax.clamp_min(1e-30),
                      torch.zeros_like(amax))
    q = torch.round(xb * inv)
    d = amax / 127.0
    if not wide:
        return q, None, d
    rs = torch.where(amax > 0, torch.full_like(d, 254.0) / d.clamp_min(1e-30), torch.zeros_like(d))
    r = torch.round(((xb - q * d) * rs).clamp(-127.0, 127.0))
    return q, r, d


def quantize_act_ref(x: torch.Tensor, wide: bool | None = None) -> torch.Tensor:
    """The kernels' activation quantization, dequantized: per 32-value block of each row,
    ``round_half_even(x * (127 / amax)) * (amax / 127)`` in float32 (0 for an all-zero block);
    ``wide`` (None: the :func:`act_precision` in effect is ``"int16"``) adds the residual
    codes' ``r * d / 254``.

    Args: x ``[T, K]`` float (K a multiple of 32). Returns float32 ``[T, K]``."""
    wide = wide_default(wide)
    t, k = x.shape
    q, r, d = _act_codes_ref(x, wide)
    if r is not None:
        return ((q + r * (1.0 / 254.0)) * d).reshape(t, k)
    return (q * d).reshape(t, k)


def dequantize_act(xa: QuantAct) -> torch.Tensor:
    """Float32 ``[T, K]`` values of a :class:`QuantAct` (codes plus residual codes / 254 when
    ``wide``, times the block scale)."""
    t, k = xa.shape
    w = 2 if xa.wide else 1
    codes = xa.q.contiguous().view(torch.int8).float().reshape(t, k // 32, w, 32)
    v = codes[:, :, 0] + (codes[:, :, 1] * (1.0 / 254.0) if xa.wide else 0.0)
    return (v * xa.d.float()[..., None]).reshape(t, k)


def quant_gemv_ref(x: torch.Tensor | QuantAct, w: QuantTensor, act_quant: bool = True) -> torch.Tensor:
    """Torch twin of :func:`quant_gemv`: ``x' @ dequant(w).T`` in float32, ``[T, N]``, where
    ``x' = quantize_act_ref(x)`` if ``act_quant`` (what the kernel computes for quantized
    weights) else ``x`` (the exact float product; the difference is the activation rounding)."""
    if isinstance(x, QuantAct):
        return dequantize_act(x) @ w.dequantize().reshape(-1, w.K).T
    xf = quantize_act_ref(x) if (act_quant and not w.is_float) else x.float()
    return xf @ w.dequantize().reshape(-1, w.K).T
