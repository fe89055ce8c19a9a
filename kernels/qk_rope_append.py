"""q/k RMSNorm + RoPE + KV-cache append after the fused QKV projection, in one launch.

After the QKV GEMV the unfused decode step runs q-norm and k-norm (:mod:`.rms_norm`), RoPE of
q and of k (:mod:`.rope`) and one append per side (:mod:`.kv_quant_append` for the quantized
formats, a cast and an index-put for the float ones): 6-8 launches (2 fewer without q/k norm),
plus the sum of split-K partials and the bias add when the GEMV leaves them, and for
per-channel keys or sink/window buffers the codec's torch ops. :func:`qk_rope_append` does all
of it in one launch and returns the rotated queries.

Algorithm: one program per (token, head) over the ``H`` query, ``Hkv`` key and ``Hkv`` value
heads (grid ``(T, H + 2 Hkv)``). A program loads its head's ``D`` values and, for the rotated
dims, the RoPE partner of each (pairs ``(i, i + R/2)`` for "neox", ``(2i, 2i+1)`` for "norm"),
summing the split-K slices and adding the bias; norms them with the head's (or, for the
full-row q/k norm of OLMoE, the whole row's) ``rsqrt(mean(x^2) + eps)`` and the weight; rotates
``y = x cos + rot(x) sin`` over the first ``R`` dims; then stores q, or writes K/V into the
paged store at the token's slot: a float row for f32/f16/bf16 stores, or quantized and packed
with :func:`.kv_quant_append.quant_store_row` (int8/int4/int3/int2 with group scales, fp4 with
E4M3 scales, per-token outliers) for the quantized ones.

Numerics: float32 math, with the values rounded to the activation dtype wherever the unfused
path stores a tensor (after the split-K sum, after the bias, after the norm, after RoPE), so the
result is the twin's :func:`qk_rope_append_ref` (``rms_norm_ref``, ``rope_ref``,
``codec.write``) up to float32 rounding order in the norm's sum of squares (which can move an
fp16 value by one unit in the last place, and a quantized code by one step).

Side buffers (decode only: one token per sequence per call, ``positions`` and ``seq_rows``
given): the fp16 copies of sink tokens and of the recent window (ring + position tags) in the
token's sequence row; per-channel keys (KIVI, ``int4:c``, the default grouping of int4/int3/int2
keys) go to the ring and, when a token completes its cache page, the page is quantized per
channel (earlier tokens from the ring, the sink buffer, or the page's old codes when the ring
forgot them) -- :meth:`QuantCodec.write_channel` for one token.

Not fused (:func:`fusable` says why): Hadamard-rotated keys, per-channel keys with outliers,
quantized head dims that are not a power of two, and, unless the caller asks with
``fusable(..., decode=True)``, codecs with side buffers or per-channel keys (prefill has many
tokens per sequence). For those the caller keeps the unfused path, or uses :func:`qk_rope`
(norm + RoPE in one launch, ``k``/``v`` returned for the codec's own write).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from localmoe.kernels.kv_quant_append import quant_store_row
from localmoe.kernels.pdl import pdl_args, pdl_begin
from localmoe.kernels.rms_norm import rms_norm_ref
from localmoe.kernels.rope import rope_partner, rope_ref
from localmoe.kernels.host import next_pow2

__all__ = ["qk_rope_append", "qk_rope_append_ref", "qk_rope", "fusable"]

_FLOAT_FORMATS = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
_ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --- kernel ------------------------------------------------------------------------------------

@triton.jit
def _load_row(Xt, Bias, cols, m, stride_xs, ACT: tl.constexpr, S: tl.constexpr,
              HAS_BIAS: tl.constexpr):
    """float32 values of columns ``cols`` of one token: the ``S`` split-K slices summed (in
    order), rounded to the activation dtype, the bias added and rounded again."""
    x = tl.load(Xt + cols, mask=m, other=0.0).to(tl.float32)
    for s in tl.static_range(1, S):
        x += tl.load(Xt + s * stride_xs + cols, mask=m, other=0.0).to(tl.float32)
    x = x.to(ACT).to(tl.float32)
    if HAS_BIAS:
        b = tl.load(Bias + cols, mask=m, other=0.0).to(tl.float32)
        x = (x + b).to(ACT).to(tl.float32)
    return x


@triton.jit
def _norm_rope(Xt, Bias, W, Cos, Sin, t, j, c0, stride_xs, stride_ct, R, eps,
               NH: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BROW: tl.constexpr,
               ACT: tl.constexpr, S: tl.constexpr, HAS_BIAS: tl.constexpr,
               NORM: tl.constexpr, NEOX: tl.constexpr):
    """Head ``j`` of the q or k block (columns ``c0 ..``) of one token, normed (NORM 0 none,
    1 per head, 2 over the whole row of ``NH`` heads) and rotated: float32 [BD] holding values
    of the activation dtype (dims >= D are 0)."""
    d = tl.arange(0, BD)
    dm = d < D
    rot = d < R
    partner, sign = rope_partner(d, R, NEOX)
    pm = dm & rot
    base = c0 + j * D
    x = _load_row(Xt, Bias, base + d, dm, stride_xs, ACT, S, HAS_BIAS)
    xp = _load_row(Xt, Bias, base + partner, pm, stride_xs, ACT, S, HAS_BIAS)
    if NORM == 1:
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        w = tl.load(W + d, mask=dm, other=0.0).to(tl.float32)
        wp = tl.load(W + partner, mask=pm, other=0.0).to(tl.float32)
        x = (x * inv * w).to(ACT).to(tl.float32)
        xp = (xp * inv * wp).to(ACT).to(tl.float32)
    elif NORM == 2:
        r = tl.arange(0, BROW)
        xr = _load_row(Xt, Bias, c0 + r, r < NH * D, stride_xs, ACT, S, HAS_BIAS)
        inv = 1.0 / tl.sqrt(tl.sum(xr * xr, axis=0) / (NH * D) + eps)
        w = tl.load(W + j * D + d, mask=dm, other=0.0).to(tl.float32)
        wp = tl.load(W + j * D + partner, mask=pm, other=0.0).to(tl.float32)
        x = (x * inv * w).to(ACT).to(tl.float32)
        xp = (xp * inv * wp).to(ACT).to(tl.float32)
    c = tl.load(Cos + t * stride_ct + d, mask=rot, other=1.0)
    s = tl.load(Sin + t * stride_ct + d, mask=rot, other=0.0)
    y = tl.where(rot, x * c + sign * xp * s, x)
    return y.to(ACT).to(tl.float32)


@triton.jit
def _channel_page(xh, j, slot, pos, row, Q, QH, CScale, CZero, Sink, Ring, RPos, n_slots,
                  n_sink, W, HKV: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                  PAGE: tl.constexpr, SINK: tl.constexpr):
    """Per-channel keys (KIVI): the token at ``pos`` completes its page, so quantize the
    page's ``PAGE`` tokens of head ``j`` per channel: the earlier tokens from the ring (or the
    sink buffer, or the page's current codes when the ring forgot them), this one from ``xh``
    (float32 [D] holding fp16 values); fp16 ``cscale``/``czero`` of (head, page, channel) from
    the channel's min/max over the page, codes packed into the page's slots. The twin is
    ``QuantCodec.write_channel`` (without outliers)."""
    o = tl.arange(0, PAGE)
    d = tl.arange(0, D)
    blk = slot // PAGE
    prow = j * n_slots + blk * PAGE + o                       # packed rows of the page [PAGE]
    pp = pos - (PAGE - 1) + o                                 # their positions
    P: tl.constexpr = 2 if BITS == 3 else BITS
    PACK: tl.constexpr = 8 // P
    RB: tl.constexpr = D // PACK
    RB2: tl.constexpr = D // 8
    QMAX: tl.constexpr = (1 << BITS) - 1
    # the page's current codes (stale but for a page a truncation made the ring forget)
    b = tl.load(Q + prow[:, None] * RB + (d % RB)[None, :]).to(tl.int32)
    code = (b >> ((d // RB) * P)[None, :]) & ((1 << P) - 1)
    if BITS == 3:
        bh = tl.load(QH + prow[:, None] * RB2 + (d % RB2)[None, :]).to(tl.int32)
        code = code | (((bh >> (d // RB2)[None, :]) & 1) << 2)
    cbase = (j * (n_slots // PAGE) + blk) * D + d
    cs = tl.load(CScale + cbase).to(tl.float32)
    cz = tl.load(CZero + cbase).to(tl.float32)
    v = code.to(tl.float32) * cs[None, :] + cz[None, :]
    if SINK:
        ms = (pp < n_sink)[:, None]
        sv = tl.load(Sink + ((row * HKV + j) * n_sink + pp)[:, None] * D + d[None, :], mask=ms,
                     other=0.0)
        v = tl.where(ms, sv.to(tl.float32), v)
    r = pp % W
    mr = (tl.load(RPos + row * W + r) == pp)[:, None]
    rv = tl.load(Ring + ((row * HKV + j) * W + r)[:, None] * D + d[None, :], mask=mr, other=0.0)
    v = tl.where(mr, rv.to(tl.float32), v)
    v = tl.minimum(tl.maximum(v, -65504.0), 65504.0).to(tl.float16).to(tl.float32)
    v = tl.where((o == PAGE - 1)[:, None], xh[None, :], v)
    # per-channel min/max over the page -> fp16 scale and zero, codes
    mn = tl.min(v, axis=0)
    mx = tl.max(v, axis=0)
    zero16 = mn.to(tl.float16)
    zero = zero16.to(tl.float32)
    scale16 = tl.minimum((mx - zero) / QMAX, 65504.0).to(tl.float16)
    scale = scale16.to(tl.float32)
    tl.store(CScale + cbase, scale16)
    tl.store(CZero + cbase, zero16)
    inv = tl.where(scale > 0, 1.0 / scale, 0.0)
    c = tl.floor((v - zero[None, :]) * inv[None, :] + 0.5)
    c = tl.minimum(tl.maximum(c, 0.0), QMAX).to(tl.int32)
    lo = tl.reshape(c & ((1 << P) - 1), [PAGE, PACK, RB])
    sh = (tl.arange(0, PACK) * P)[None, :, None]
    byte = tl.sum(lo << sh, axis=1)
    tl.store(Q + prow[:, None] * RB + tl.arange(0, RB)[None, :], byte.to(tl.uint8))
    if BITS == 3:
        hi = tl.reshape((c >> 2) & 1, [PAGE, 8, RB2])
        sh2 = tl.arange(0, 8)[None, :, None]
        byte2 = tl.sum(hi << sh2, axis=1)
        tl.store(QH + prow[:, None] * RB2 + tl.arange(0, RB2)[None, :], byte2.to(tl.uint8))


@triton.jit
def _append(y, t, j, Slots, Pos, Rows, Data, sd0, sd1, Q, QH, Scale, Zero, OIdx, OVal, CScale,
            CZero, Sink, Ring, RPos, n_slots, n_sink, W,
            HKV: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, SLOT_IS_T: tl.constexpr,
            QUANT: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, IS_FP4: tl.constexpr,
            N_OUT: tl.constexpr, SINK: tl.constexpr, RING: tl.constexpr, CHAN: tl.constexpr,
            PAGE: tl.constexpr):
    """Write head ``j`` of token ``t`` (``y`` float32 [BD]) to its slot: a float row of
    ``Data`` [n_slots, Hkv, D] (strides ``sd0``, ``sd1``), a quantized packed row, or (per-channel
    keys) the ring and, when the token completes its page, the page's codes; plus the fp16
    copies in the sink buffer (positions < n_sink) and the recent-window ring of the token's
    sequence row."""
    if SLOT_IS_T:
        slot = t
    else:
        slot = tl.load(Slots + t).to(tl.int64)
    d = tl.arange(0, BD)
    if CHAN:
        pass
    elif QUANT:
        quant_store_row(y, j * n_slots + slot, Q, QH, Scale, Zero, OIdx, OVal,
                        D, BITS, G, IS_FP4, N_OUT)
    else:
        tl.store(Data + slot * sd0 + j * sd1 + d, y.to(Data.dtype.element_ty), mask=d < D)
    if SINK or RING:
        pos = tl.load(Pos + t).to(tl.int64)
        row = tl.load(Rows + t).to(tl.int64)
        xh = tl.minimum(tl.maximum(y, -65504.0), 65504.0).to(tl.float16)
        if SINK:
            if pos < n_sink:
                tl.store(Sink + ((row * HKV + j) * n_sink + pos) * D + d, xh, mask=d < D)
        if RING:
            r = pos % W
            tl.store(Ring + ((row * HKV + j) * W + r) * D + d, xh, mask=d < D)
            if j == 0:
                tl.store(RPos + row * W + r, pos.to(tl.int32))
        if CHAN:
            if (pos + 1) % PAGE == 0:
                _channel_page(xh.to(tl.float32), j, slot, pos, row, Q, QH, CScale, CZero, Sink,
                              Ring, RPos, n_slots, n_sink, W, HKV, D, BITS, PAGE, SINK)


@triton.jit
def _qk_rope_append_kernel(
    X, Bias, QW, KW, Cos, Sin, Slots, Pos, Rows, Qo,
    KData, ksd0, ksd1, KQ, KQH, KScale, KZero, KOIdx, KOVal, KCScale, KCZero, KSink, KRing,
    KRPos, k_slots, k_nsink, k_w,
    VData, vsd0, vsd1, VQ, VQH, VScale, VZero, VOIdx, VOVal, VCScale, VCZero, VSink, VRing,
    VRPos, v_slots, v_nsink, v_w,
    stride_xs, stride_xt, stride_ct, stride_qt, R, eps,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BD: tl.constexpr, BDV: tl.constexpr, BQROW: tl.constexpr, BKROW: tl.constexpr,
    S: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, NEOX: tl.constexpr,
    SLOT_IS_T: tl.constexpr,
    K_QUANT: tl.constexpr, K_BITS: tl.constexpr, K_G: tl.constexpr, K_FP4: tl.constexpr,
    K_NOUT: tl.constexpr, K_SINK: tl.constexpr, K_RING: tl.constexpr, K_CHAN: tl.constexpr,
    K_PAGE: tl.constexpr,
    V_QUANT: tl.constexpr, V_BITS: tl.constexpr, V_G: tl.constexpr, V_FP4: tl.constexpr,
    V_NOUT: tl.constexpr, V_SINK: tl.constexpr, V_RING: tl.constexpr, V_CHAN: tl.constexpr,
    V_PAGE: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    Xt = X + t * stride_xt
    if h < H:
        y = _norm_rope(Xt, Bias, QW, Cos, Sin, t, h, 0, stride_xs, stride_ct, R, eps,
                       H, D, BD, BQROW, Qo.dtype.element_ty, S, HAS_BIAS, NORM, NEOX)
        d = tl.arange(0, BD)
        tl.store(Qo + t * stride_qt + h * D + d, y.to(Qo.dtype.element_ty), mask=d < D)
    elif h < H + HKV:
        j = h - H
        y = _norm_rope(Xt, Bias, KW, Cos, Sin, t, j, H * D, stride_xs, stride_ct, R, eps,
                       HKV, D, BD, BKROW, Qo.dtype.element_ty, S, HAS_BIAS, NORM, NEOX)
        _append(y, t, j, Slots, Pos, Rows, KData, ksd0, ksd1, KQ, KQH, KScale, KZero, KOIdx,
                KOVal, KCScale, KCZero, KSink, KRing, KRPos, k_slots, k_nsink, k_w,
                HKV, D, BD, SLOT_IS_T, K_QUANT, K_BITS, K_G, K_FP4, K_NOUT, K_SINK, K_RING,
                K_CHAN, K_PAGE)
    else:
        j = h - H - HKV
        dv = tl.arange(0, BDV)
        y = _load_row(Xt, Bias, (H + HKV) * D + j * DV + dv, dv < DV, stride_xs,
                      Qo.dtype.element_ty, S, HAS_BIAS)
        _append(y, t, j, Slots, Pos, Rows, VData, vsd0, vsd1, VQ, VQH, VScale, VZero, VOIdx,
                VOVal, VCScale, VCZero, VSink, VRing, VRPos, v_slots, v_nsink, v_w,
                HKV, DV, BDV, SLOT_IS_T, V_QUANT, V_BITS, V_G, V_FP4, V_NOUT, V_SINK, V_RING,
                V_CHAN, V_PAGE)


# --- host side ---------------------------------------------------------------------------------

def _is_quant(codec) -> bool:
    return hasattr(codec, "quantize_rows")


def _codec_reason(codec, side: str, decode: bool) -> str | None:
    """Why ``codec`` (one side, "K"/"V") cannot be written by the fused kernel, or None."""
    name = getattr(getattr(codec, "fmt", None), "name", None)
    if _is_quant(codec):
        if getattr(codec, "rotate", False):
            return f"{side} cache {codec.fmt} is Hadamard-rotated"
        hd = int(codec.head_dim)
        if hd & (hd - 1):
            return f"{side} cache {codec.fmt} with head_dim {hd}: the quantizer needs a power of two"
        channel = getattr(codec, "channel", False)
        if channel and codec.n_out:
            return f"{side} cache {codec.fmt} is grouped per channel with outliers"
        if channel and int(codec.block_size) & (int(codec.block_size) - 1):
            return f"{side} cache {codec.fmt} is grouped per channel over pages of " \
                   f"{codec.block_size} tokens (not a power of two)"
        if not decode and (channel or codec.n_sink or codec.window):
            what = "is grouped per channel" if channel else "keeps sink/window side buffers"
            return f"{side} cache {codec.fmt} {what}: fused only with one token per sequence"
        return None
    if name in _FLOAT_FORMATS:
        return None
    return f"{side} cache format {name or type(codec).__name__} has no fused append"


def fusable(k_codec, v_codec, *, decode: bool = False) -> str | None:
    """None when :func:`qk_rope_append` can write both codecs, else a one-line reason (the
    caller then keeps the unfused path, e.g. :func:`qk_rope` + ``codec.write``).

    Fusable: float codecs (f32/f16/bf16) and quantized codecs (int8/int4/int3/int2 with group
    scales, fp4, per-token outliers). With ``decode=True`` -- the caller promises at most one
    token per sequence in a call and passes ``positions`` and ``seq_rows`` -- also codecs with
    sink/window side buffers and per-channel keys (without outliers). Never: Hadamard-rotated
    keys, quantized head dims that are not a power of two.
    """
    return _codec_reason(k_codec, "K", decode) or _codec_reason(v_codec, "V", decode)


def _side_needed(codec) -> bool:
    return _is_quant(codec) and bool(codec.channel or codec.n_sink or codec.window)


def _store_args(codec, store, side: str, n_heads: int, hd: int, dev) -> tuple:
    """Kernel arguments (Data, sd0, sd1, Q, QH, Scale, Zero, OIdx, OVal, CScale, CZero, Sink,
    Ring, RPos, n_slots, n_sink, window) and the constexprs (QUANT, BITS, G, IS_FP4, N_OUT,
    SINK, RING, CHAN, PAGE) of one side's store."""
    if int(codec.n_kv_heads) != n_heads or int(codec.head_dim) != hd:
        raise ValueError(f"qk_rope_append: the {side} codec is for [{codec.n_kv_heads} heads, "
                         f"{codec.head_dim} dims], the projection gives [{n_heads}, {hd}]")
    if _is_quant(codec):
        q = store.get("q")
        if q is None or q.dim() != 3 or q.shape[0] != n_heads or not q.is_contiguous():
            raise ValueError(f"qk_rope_append: the {side} store is not a {codec.fmt} store of "
                             f"{n_heads} heads (codec.alloc)")
        if q.device != dev:
            raise ValueError(f"qk_rope_append: the {side} store is on {q.device}, qkv on {dev}")
        need = ["scale"] if not codec.channel else ["cscale", "czero"]
        need += ["sink"] if codec.n_sink else []
        need += ["ring", "ring_pos"] if codec.window else []
        missing = [k for k in need if k not in store]
        if missing:
            raise ValueError(f"qk_rope_append: the {side} store has no {', '.join(missing)} "
                             f"(codec.alloc)")
        g = store.get
        ptrs = (q, 0, 0, q, g("q_hi", q), g("scale", q), g("zero", q), g("oidx", q),
                g("oval", q), g("cscale", q), g("czero", q), g("sink", q), g("ring", q),
                g("ring_pos", q), q.shape[1], int(codec.n_sink), int(codec.window))
        return ptrs, (True, int(codec.bits), int(codec.group), bool(codec.is_fp4),
                      0 if codec.channel else int(codec.n_out), bool(codec.n_sink),
                      bool(codec.window), bool(codec.channel), int(codec.block_size))
    data = store.get("data")
    if data is None or data.dim() != 3 or tuple(data.shape[1:]) != (n_heads, hd) \
            or data.stride(2) != 1:
        raise ValueError(f"qk_rope_append: the {side} store has no float 'data' tensor "
                         f"[slots, {n_heads}, {hd}] (codec.alloc)")
    if data.device != dev:
        raise ValueError(f"qk_rope_append: the {side} store is on {data.device}, qkv on {dev}")
    return _float_args(data)


def _float_args(data):
    return ((data, data.stride(0), data.stride(1)) + (data,) * 11 + (data.shape[0], 0, 1),
            (False, 8, 32, False, 0, False, False, False, 1))


def _prepare(qkv, n_heads, n_kv_heads, head_dim, v_head_dim, q_norm_w, k_norm_w, norm_full,
             cos, sin, style, bias, q_dtype):
    """Checks shared by the launchers; returns (x3 [S, T, N], act dtype, cos [T, R],
    sin [T, R], norm mode)."""
    if style not in ("neox", "norm"):
        raise ValueError(f"qk_rope_append: unknown rope style {style!r}; expected 'neox' or "
                         "'norm'")
    if min(n_heads, n_kv_heads, head_dim, v_head_dim) < 1:
        raise ValueError("qk_rope_append: head counts and head dims must be positive")
    n = (n_heads + n_kv_heads) * head_dim + n_kv_heads * v_head_dim
    if qkv.dim() == 2:
        x3 = qkv.unsqueeze(0)
        act = q_dtype or qkv.dtype
    elif qkv.dim() == 3:
        if qkv.dtype != torch.float32:
            raise ValueError(f"qk_rope_append: split-K partials [S, T, N] must be float32, got "
                             f"{qkv.dtype}")
        x3 = qkv
        act = q_dtype or torch.float16
    else:
        raise ValueError(f"qk_rope_append: qkv must be [T, N] or partials [S, T, N], got shape "
                         f"{tuple(qkv.shape)}")
    if x3.dtype not in _ACT_DTYPES or act not in _ACT_DTYPES:
        raise ValueError(f"qk_rope_append: qkv {x3.dtype} / activation {act}: expected float16, "
                         "bfloat16 or float32")
    if x3.shape[-1] != n:
        raise ValueError(f"qkv rows have {x3.shape[-1]} values; {n_heads} q heads, {n_kv_heads} "
                         f"kv heads of {head_dim} (v {v_head_dim}) need {n}")
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    t = x3.shape[1]
    dev = x3.device
    if cos.dim() == 3 and cos.shape[1] == 1:
        cos, sin = cos.reshape(cos.shape[0], -1), sin.reshape(sin.shape[0], -1)
    r = cos.shape[-1] if cos.dim() == 2 else -1
    if cos.dim() != 2 or cos.shape[0] != t or sin.shape != cos.shape or r < 2 or r % 2 \
            or r > head_dim:
        raise ValueError(f"qk_rope_append: rope tables {tuple(cos.shape)}/{tuple(sin.shape)} do "
                         f"not fit {t} tokens of head_dim {head_dim} (expected [T, R], R even, "
                         f"2 <= R <= head_dim)")
    if cos.device != dev or sin.device != dev:
        raise ValueError(f"qk_rope_append: rope tables on {cos.device}, qkv on {dev}")
    cos = cos.float().contiguous()
    sin = sin.float().contiguous()
    if (q_norm_w is None) != (k_norm_w is None):
        raise ValueError("qk_rope_append: give both q_norm_w and k_norm_w, or neither")
    norm = 0
    if q_norm_w is not None:
        norm = 2 if norm_full else 1
        want_q = n_heads * head_dim if norm_full else head_dim
        want_k = n_kv_heads * head_dim if norm_full else head_dim
        if q_norm_w.numel() != want_q or k_norm_w.numel() != want_k:
            raise ValueError(f"qk_rope_append: q/k norm weights of {q_norm_w.numel()}/"
                             f"{k_norm_w.numel()} values; the {'full-row' if norm_full else 'per-head'}"
                             f" norm needs {want_q}/{want_k}")
        if q_norm_w.device != dev or k_norm_w.device != dev:
            raise ValueError("qk_rope_append: q/k norm weights on another device than qkv")
    if bias is not None and (bias.numel() != n or bias.device != dev):
        raise ValueError(f"qk_rope_append: bias of {bias.numel()} values on {bias.device}; "
                         f"expected {n} on {dev}")
    return x3, act, cos, sin, norm


def _launch(x3, act, cos, sin, norm, *, n_heads, n_kv_heads, head_dim, v_head_dim, q_norm_w,
            k_norm_w, eps, style, bias, slots, positions, seq_rows, k_args, v_args, slot_is_t):
    t = x3.shape[1]
    q = torch.empty((t, n_heads, head_dim), dtype=act, device=x3.device)
    if t == 0:
        return q
    (kp, kc), (vp, vc) = k_args, v_args
    qw = q_norm_w.contiguous() if q_norm_w is not None else q
    kw = k_norm_w.contiguous() if k_norm_w is not None else q
    bd, bdv = next_pow2(head_dim), next_pow2(v_head_dim)
    full = norm == 2
    bq = next_pow2(n_heads * head_dim) if full else 1
    bk = next_pow2(n_kv_heads * head_dim) if full else 1
    warps = 4 if full and bq >= 2048 else (2 if max(bd, bdv) >= 128 or full else 1)
    _qk_rope_append_kernel[(t, n_heads + 2 * n_kv_heads)](
        x3, bias.contiguous() if bias is not None else q, qw, kw, cos, sin, slots,
        positions if positions is not None else slots,
        seq_rows if seq_rows is not None else slots, q, *kp, *vp,
        x3.stride(0), x3.stride(1), cos.stride(0), q.stride(0), cos.shape[1], float(eps),
        H=n_heads, HKV=n_kv_heads, D=head_dim, DV=v_head_dim, BD=bd, BDV=bdv, BQROW=bq,
        BKROW=bk, S=x3.shape[0], HAS_BIAS=bias is not None, NORM=norm, NEOX=style == "neox",
        SLOT_IS_T=slot_is_t,
        K_QUANT=kc[0], K_BITS=kc[1], K_G=kc[2], K_FP4=kc[3], K_NOUT=kc[4], K_SINK=kc[5],
        K_RING=kc[6], K_CHAN=kc[7], K_PAGE=kc[8],
        V_QUANT=vc[0], V_BITS=vc[1], V_G=vc[2], V_FP4=vc[3], V_NOUT=vc[4], V_SINK=vc[5],
        V_RING=vc[6], V_CHAN=vc[7], V_PAGE=vc[8],
        num_warps=warps, **pdl_args(x3.device))
    return q


def qk_rope_append(qkv: torch.Tensor, *, n_heads: int, n_kv_heads: int, head_dim: int,
                   v_head_dim: int, q_norm_w: torch.Tensor | None, k_norm_w: torch.Tensor | None,
                   norm_full: bool, eps: float, cos: torch.Tensor, sin: torch.Tensor, style: str,
                   k_codec, k_store: dict, v_codec, v_store: dict, slots: torch.Tensor,
                   positions: torch.Tensor | None, seq_rows: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None, q_dtype: torch.dtype | None = None
                   ) -> torch.Tensor:
    """q/k RMSNorm, RoPE and the K/V cache append of one layer in one launch; returns q.

    Args:
        qkv: the fused QKV projection, ``[T, N]`` float16/bfloat16/float32 with ``N = (H +
            Hkv) * D + Hkv * Dv`` (columns q | k | v), or float32 split-K partials ``[S, T, N]``
            whose slices are summed first.
        n_heads, n_kv_heads, head_dim, v_head_dim: ``H``, ``Hkv``, ``D``, ``Dv``.
        q_norm_w, k_norm_w: RMSNorm weights, both None (no q/k norm), per head (``[D]`` each)
            or, with ``norm_full``, over the whole row (``[H*D]`` and ``[Hkv*D]``, OLMoE).
        eps: RMSNorm epsilon.
        cos, sin: float32 RoPE tables ``[T, R]`` (or ``[T, 1, R]``, :func:`rope_tables`), ``R``
            even and ``<= D``; dims past ``R`` pass through. Any scaling is in the tables.
        style: "neox" (pairs ``(i, i + R/2)``) or "norm" (pairs ``(2i, 2i+1)``).
        k_codec, k_store, v_codec, v_store: the layer's codecs and stores (``codec.alloc``):
            f32/f16/bf16 float codecs, or quantized codecs that :func:`fusable` accepts
            (with ``decode=True`` when ``seq_rows`` is given).
        slots: int64 ``[T]`` device tensor, the cache slot of each token (per-channel keys:
            page-aligned, position ``p`` at ``block * block_size + p % block_size``).
        positions: int64 ``[T]`` device tensor of token positions; needed (with ``seq_rows``)
            by codecs with sink/window buffers or per-channel keys, else only checked.
        seq_rows: int32/int64 ``[T]`` device tensor, each token's sequence row in the codecs'
            side buffers; needed by the codecs that keep them. With them, a call may hold at
            most one token per sequence (decode): two tokens of a sequence would race on its
            ring and page.
        bias: optional ``[N]`` QKV bias (qwen2), added after the partial sum.
        q_dtype: activation dtype (default: ``qkv.dtype``, float16 for partials). The rows are
            rounded to it after the sum and after the bias, like the unfused path's tensors.

    Returns:
        q ``[T, H, D]`` in the activation dtype, normed and rotated. K (normed and rotated) and
        V are written at ``slots`` (and the side buffers); every other slot is untouched.

    Raises:
        ValueError: shapes, dtypes, devices or styles that do not fit, missing
            ``positions``/``seq_rows`` for codecs with side buffers, or codecs that
            ``fusable(..., decode=True)`` rejects (with its reason).
    """
    why = fusable(k_codec, v_codec, decode=True)
    if why:
        raise ValueError(f"qk_rope_append: {why}; use the unfused path")
    x3, act, cos, sin, norm = _prepare(qkv, n_heads, n_kv_heads, head_dim, v_head_dim,
                                       q_norm_w, k_norm_w, norm_full, cos, sin, style, bias,
                                       q_dtype)
    t, dev = x3.shape[1], x3.device
    for name, ten in (("slots", slots), ("positions", positions), ("seq_rows", seq_rows)):
        if ten is None:
            continue
        if ten.dim() != 1 or ten.numel() != t or ten.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"qk_rope_append: {name} must be an integer tensor [T={t}], got "
                             f"{ten.dtype} {tuple(ten.shape)}")
        if ten.device != dev:
            raise ValueError(f"qk_rope_append: {name} on {ten.device}, qkv on {dev}")
    if (_side_needed(k_codec) or _side_needed(v_codec)) and (positions is None or seq_rows is None):
        raise ValueError("qk_rope_append: codecs with sink/window buffers or per-channel keys "
                         "need positions and seq_rows (one token per sequence)")
    k_args = _store_args(k_codec, k_store, "K", n_kv_heads, head_dim, dev)
    v_args = _store_args(v_codec, v_store, "V", n_kv_heads, v_head_dim, dev)
    return _launch(x3, act, cos, sin, norm, n_heads=n_heads, n_kv_heads=n_kv_heads,
                   head_dim=head_dim, v_head_dim=v_head_dim, q_norm_w=q_norm_w,
                   k_norm_w=k_norm_w, eps=eps, style=style, bias=bias, slots=slots,
                   positions=positions, seq_rows=seq_rows, k_args=k_args, v_args=v_args,
                   slot_is_t=False)


def qk_rope(qkv: torch.Tensor, *, n_heads: int, n_kv_heads: int, head_dim: int, v_head_dim: int,
            q_norm_w: torch.Tensor | None, k_norm_w: torch.Tensor | None, norm_full: bool,
            eps: float, cos: torch.Tensor, sin: torch.Tensor, style: str,
            bias: torch.Tensor | None = None, q_dtype: torch.dtype | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same kernel without the cache: returns ``(q [T, H, D], k [T, Hkv, D], v [T, Hkv,
    Dv])`` in the activation dtype (q and k normed and rotated, v summed/biased), for codecs
    :func:`fusable` rejects and for prefill (the caller writes k and v with ``codec.write``).
    Arguments and errors as for :func:`qk_rope_append`."""
    x3, act, cos, sin, norm = _prepare(qkv, n_heads, n_kv_heads, head_dim, v_head_dim,
                                       q_norm_w, k_norm_w, norm_full, cos, sin, style, bias,
                                       q_dtype)
    t, dev = x3.shape[1], x3.device
    k = torch.empty((t, n_kv_heads, head_dim), dtype=act, device=dev)
    v = torch.empty((t, n_kv_heads, v_head_dim), dtype=act, device=dev)
    q = _launch(x3, act, cos, sin, norm, n_heads=n_heads, n_kv_heads=n_kv_heads,
                head_dim=head_dim, v_head_dim=v_head_dim, q_norm_w=q_norm_w, k_norm_w=k_norm_w,
                eps=eps, style=style, bias=bias, slots=k, positions=None, seq_rows=None,
                k_args=_float_args(k), v_args=_float_args(v), slot_is_t=True)
    return q, k, v


# --- the torch twin -------------------------------------------------------------------------

def _ref_split(qkv, n_heads, n_kv_heads, head_dim, v_head_dim, q_norm_w, k_norm_w, norm_full,
               eps, cos, sin, style, bias, q_dtype):
    if qkv.dim() == 3:
        act = q_dtype or torch.float16
        x = qkv[0].float()
        for s in range(1, qkv.shape[0]):
            x = x + qkv[s].float()
        x = x.to(act)
    else:
        act = q_dtype or qkv.dtype
        x = qkv.to(act)
    if bias is not None:
        x = (x.float() + bias.float()).to(act)
    t = x.shape[0]
    q, k, v = x.split([n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * v_head_dim], -1)
    if q_norm_w is not None and norm_full:
        q, k = rms_norm_ref(q, q_norm_w, eps), rms_norm_ref(k, k_norm_w, eps)
    q = q.reshape(t, n_heads, head_dim)
    k = k.reshape(t, n_kv_heads, head_dim)
    v = v.reshape(t, n_kv_heads, v_head_dim)
    if q_norm_w is not None and not norm_full:
        q, k = rms_norm_ref(q, q_norm_w, eps), rms_norm_ref(k, k_norm_w, eps)
    c2 = cos.reshape(t, 1, -1).float()
    s2 = sin.reshape(t, 1, -1).float()
    return rope_ref(q, c2, s2, style), rope_ref(k, c2, s2, style), v


def qk_rope_append_ref(qkv: torch.Tensor, *, n_heads: int, n_kv_heads: int, head_dim: int,
                       v_head_dim: int, q_norm_w, k_norm_w, norm_full: bool, eps: float,
                       cos: torch.Tensor, sin: torch.Tensor, style: str, k_codec, k_store: dict,
                       v_codec, v_store: dict, slots: torch.Tensor,
                       positions: torch.Tensor | None, seq_rows: torch.Tensor | None = None,
                       bias: torch.Tensor | None = None, q_dtype: torch.dtype | None = None
                       ) -> torch.Tensor:
    """The torch twin of :func:`qk_rope_append` from the unfused pieces (split-K sum and bias
    add, :func:`rms_norm_ref`, :func:`rope_ref`, ``codec.write``; with ``seq_rows`` one write
    per token into its sequence row); it also writes codecs the kernel rejects."""
    q, k, v = _ref_split(qkv, n_heads, n_kv_heads, head_dim, v_head_dim, q_norm_w, k_norm_w,
                         norm_full, eps, cos, sin, style, bias, q_dtype)
    if positions is None:
        positions = torch.zeros(q.shape[0], dtype=torch.int64, device=q.device)
    if seq_rows is None:
        k_codec.write(k_store, slots, k, positions)
        v_codec.write(v_store, slots, v, positions)
        return q
    for i, row in enumerate(seq_rows.tolist()):
        sl = slice(i, i + 1)
        k_codec.write(k_store, slots[sl], k[sl], positions[sl], int(row))
        v_codec.write(v_store, slots[sl], v[sl], positions[sl], int(row))
    return q
