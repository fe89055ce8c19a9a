"""Residual add + RMSNorm + int8 activation quantization in one launch, for the decode step.

For each token row ``t`` of the residual stream ``x [T, D]``::

    r[t] = x[t] + sum(deltas)[t]                       (float32 sum, stored in x's dtype)
    h[t] = r[t] * rsqrt(mean(r[t]^2) + eps) * w        (RMSNorm, float32 math, rounded to x's dtype)
    hq[t] = quantize_act(h[t])                         (int8 per 32 values, a QuantAct)

A delta is a ``[T, D]`` tensor (the MoE output, a shared expert's output) or the ``[S, T, D]``
float32 split-K partials of a GEMV (:func:`localmoe.kernels.quant_gemv.quant_gemv_partials`,
e.g. the O projection), whose ``S`` slices are summed here instead of by atomics into a zeroed
buffer.

Launches replaced (per call of a 1-8 token decode step): the residual add (1, or 2-3 with
several deltas), the split-K output zeroing and copy of the GEMV that produced a partials
delta (1-2), :func:`localmoe.kernels.rms_norm.rms_norm` (1) and
:func:`localmoe.kernels.quant_gemv.quantize_act` (1) become this one kernel: 3-6 graph nodes
become 1, twice per layer.

Numerics (chosen to reproduce the unfused chain ``x + d -> rms_norm -> quantize_act`` bit for
bit where it rounds the same way):

* the deltas are summed in float32: each partials tensor over its slices in order
  (``p[0] + p[1] + ...``, :func:`localmoe.kernels.quant_gemv.sum_partials`), then
  ``((x + d0) + d1) + d2``; ``r`` is rounded once to ``x``'s dtype. With one delta this is
  torch's own ``x + d`` (which computes half-precision adds in float32 and rounds once);
  with several, the unfused chain's intermediate roundings are skipped.
* the norm reads ``r`` *after* that rounding (what the next layer reads too), with the exact
  expression and program shape of :func:`localmoe.kernels.rms_norm.rms_norm` (rows per
  program, block, warps), so its float32 reduction runs in the same order.
* ``h`` is rounded to ``x``'s dtype and the quantization reads the rounded values, as the
  unfused path does (``rms_norm`` returns ``x``'s dtype, ``quantize_act`` widens it): the
  QuantAct is bit-identical to ``quantize_act(h)`` of the ``h`` this kernel returns. The
  optional float output (``want_float``) is that same rounded ``h`` in the dtype asked for
  (float32 for the router logits: exact widening of the values that were quantized).

One program normalizes ``ROWS`` token rows of ``D`` values (``D`` padded to a power of two and
masked, at most 8192); the 32-value quantization blocks are a reshape of the same registers.
The torch twin is :func:`add_rms_norm_quant_ref`.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from localmoe.kernels.pdl import pdl_args, pdl_begin
from localmoe.kernels.quant_gemv import (
    QuantAct, _act_codes_ref, pack_store_blocks, sum_partials, wide_default,
)
from localmoe.kernels.host import cdiv, next_pow2

__all__ = ["add_rms_norm_quant", "add_rms_norm_quant_ref", "MAX_DELTAS", "MAX_D"]

#: deltas one launch sums
MAX_DELTAS = 3
#: the widest row one program holds in registers
MAX_D = 8192


@triton.jit
def _add_delta(acc, d_ptr, d_ss, d_rs, S, r64, c, m):
    """acc += the delta at d_ptr ([T, D], or S slices d_ss apart, summed in order first)."""
    p = d_ptr + r64[:, None] * d_rs + c[None, :]
    d = tl.load(p, mask=m, other=0.0).to(tl.float32)
    for s in range(1, S):
        d += tl.load(p + s * d_ss, mask=m, other=0.0).to(tl.float32)
    return acc + d


@triton.jit
def _add_rms_norm_quant_kernel(
        x_ptr, d0_ptr, d1_ptr, d2_ptr, w_ptr, r_ptr, h_ptr, q_ptr, s_ptr,
        T, D, x_rs, d0_ss, d0_rs, S0, d1_ss, d1_rs, S1, d2_ss, d2_rs, S2,
        r_rs, h_rs, q_rs, s_rs, eps,
        ND: tl.constexpr, HAS_W: tl.constexpr, STORE_R: tl.constexpr, STORE_H: tl.constexpr,
        QUANT: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr,
        PDL: tl.constexpr, WIDE: tl.constexpr = False):
    pdl_begin(PDL)
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BLOCK)
    rm = row < T
    cm = c < D
    m = rm[:, None] & cm[None, :]
    r64 = row.to(tl.int64)
    acc = tl.load(x_ptr + r64[:, None] * x_rs + c[None, :], mask=m, other=0.0).to(tl.float32)
    if ND >= 1:
        acc = _add_delta(acc, d0_ptr, d0_ss, d0_rs, S0, r64, c, m)
    if ND >= 2:
        acc = _add_delta(acc, d1_ptr, d1_ss, d1_rs, S1, r64, c, m)
    if ND >= 3:
        acc = _add_delta(acc, d2_ptr, d2_ss, d2_rs, S2, r64, c, m)
    res = acc.to(x_ptr.dtype.element_ty)
    if STORE_R:
        tl.store(r_ptr + r64[:, None] * r_rs + c[None, :], res, mask=m)
    # ---- RMSNorm: the expression of kernels/rms_norm.py on the rounded residual ------------
    v = res.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(v * v, axis=1) / D + eps)
    y = v * inv[:, None]
    if HAS_W:
        wv = tl.load(w_ptr + c, mask=cm, other=0.0).to(tl.float32)
        y = y * wv[None, :]
    h = y.to(x_ptr.dtype.element_ty).to(tl.float32)       # the activation dtype's rounding
    if STORE_H:
        tl.store(h_ptr + r64[:, None] * h_rs + c[None, :], h.to(h_ptr.dtype.element_ty), mask=m)
    # ---- int8 per 32 values, the layout of quantize_act ------------------------------------
    if QUANT:
        h4 = tl.reshape(h, (ROWS * NB, 2, 4, 4))             # [row*block, slice, word, byte]
        rb = tl.arange(0, ROWS * NB)
        rr = (tl.program_id(0) * ROWS + rb // NB)
        blk = rb % NB
        bm = ((rr < T) & (blk < D // 32))[:, None, None, None]
        rr4 = rr.to(tl.int64)[:, None, None, None]
        pack_store_blocks(h4, blk[:, None, None, None], bm, q_ptr + rr4 * q_rs,
                          s_ptr + rr4 * s_rs, WIDE)


def _fail(msg: str):
    raise ValueError(f"add_rms_norm_quant: {msg}")


def _delta_args(x: torch.Tensor, d: torch.Tensor, i: int) -> tuple:
    """(tensor, slice stride, row stride, slices) of delta ``i``, checked against ``x``."""
    t, n = x.shape
    if not isinstance(d, torch.Tensor):
        _fail(f"delta {i} is a {type(d).__name__}, not a tensor")
    if d.device != x.device:
        _fail(f"delta {i} on {d.device}, x on {x.device}")
    if d.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"add_rms_norm_quant: delta {i} must be float32/float16/bfloat16, "
                        f"got {d.dtype}")
    if d.dim() == 2 and tuple(d.shape) == (t, n):
        if d.stride(1) != 1:
            _fail(f"delta {i} rows must be contiguous")
        return d, 0, d.stride(0), 1
    if d.dim() == 3 and tuple(d.shape[1:]) == (t, n) and d.shape[0] >= 1:
        if d.dtype != torch.float32:
            raise TypeError(f"add_rms_norm_quant: partials delta {i} must be float32, got {d.dtype}")
        if d.stride(2) != 1:
            _fail(f"delta {i} rows must be contiguous")
        return d, d.stride(0), d.stride(1), d.shape[0]
    _fail(f"delta {i} must be [T, D] = [{t}, {n}] or partials [S, {t}, {n}], "
          f"got {tuple(d.shape)}")


def _program_shape(n: int) -> tuple[int, int, int]:
    """(rows per program, block, warps): kernels/rms_norm.py's choice for rows of ``n``."""
    block = next_pow2(n)
    rows = max(1, min(16, 4096 // block))
    return rows, block, 4 if block >= 1024 else 1


def add_rms_norm_quant(x: torch.Tensor, deltas: Sequence[torch.Tensor], w: torch.Tensor | None,
                       eps: float, *, residual_out: torch.Tensor | None,
                       want_float: torch.dtype | None = None, quant: bool = True,
                       quant_out: QuantAct | None = None, float_out: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor | None, QuantAct | None, torch.Tensor | None]:
    """Residual add, RMSNorm and int8 activation quantization of ``x`` in one launch.

    Args:
        x: the residual stream ``[T, D]``, float16/bfloat16/float32, rows contiguous; ``T`` >= 0,
            ``D`` a multiple of 32 (when ``quant``), at most 8192.
        deltas: up to 3 tensors added to ``x`` first, each ``[T, D]`` (any float dtype) or
            float32 split-K partials ``[S, T, D]`` (its ``S`` slices summed); may be empty.
        w: the norm weight ``[D]`` (any float dtype) or None (no scaling).
        eps: the norm's epsilon.
        residual_out: ``[T, D]`` in ``x``'s dtype, rows contiguous, receives ``r = x + sum(deltas)``;
            may be ``x`` itself or another buffer; None: ``r`` is not stored (a final norm).
        want_float: None, or the dtype of an extra output of the normed rows ``h`` (float32 for
            router logits; the values are ``h`` rounded to ``x``'s dtype, see the module doc).
        quant: produce the int8 QuantAct of ``h``.
        quant_out: optional preallocated QuantAct ``[T, D]`` (static buffers for CUDA graphs).
        float_out: optional preallocated ``[T, D]`` float output (its dtype wins over
            ``want_float``).
    Returns:
        ``(residual_out, hq, hf)``: ``hq`` the :class:`QuantAct` (``q`` int32 ``[T, D/4]``,
        ``s`` int32 ``[T, D/32]``, ``d`` float32 ``[T, D/32]``) or None without ``quant``;
        ``hf`` the ``[T, D]`` float output or None.
    Raises:
        ValueError: shapes, devices or strides that do not fit, ``D % 32 != 0`` with ``quant``,
            ``D`` > 8192, more than 3 deltas.
        TypeError: a dtype that does not fit (partials must be float32; ``residual_out`` must
            have ``x``'s dtype).
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        _fail(f"x must be a [T, D] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"add_rms_norm_quant: x must be float32/float16/bfloat16, got {x.dtype}")
    t, n = x.shape
    if x.stride(1) != 1:
        _fail("x rows must be contiguous")
    if quant and n % 32:
        _fail(f"D = {n} is not a multiple of 32 (the int8 block size)")
    if n > MAX_D or n < 1:
        _fail(f"D = {n} is outside 1..{MAX_D}")
    deltas = list(deltas or ())
    if len(deltas) > MAX_DELTAS:
        _fail(f"{len(deltas)} deltas, at most {MAX_DELTAS} per launch")
    dargs = [_delta_args(x, d, i) for i, d in enumerate(deltas)]
    if w is not None and (not isinstance(w, torch.Tensor) or w.numel() != n
                          or w.device != x.device):
        _fail(f"weight of {getattr(w, 'numel', lambda: '?')()} values on "
              f"{getattr(w, 'device', '?')} for rows of {n} on {x.device}")
    if w is not None and w.dim() != 1:
        w = w.reshape(n)
    if residual_out is not None:
        if tuple(residual_out.shape) != (t, n) or residual_out.device != x.device:
            _fail(f"residual_out must be [{t}, {n}] on {x.device}, got "
                  f"{tuple(residual_out.shape)} on {residual_out.device}")
        if residual_out.dtype != x.dtype:
            raise TypeError(f"add_rms_norm_quant: residual_out must be {x.dtype}, "
                            f"got {residual_out.dtype}")
        if residual_out.stride(1) != 1:
            _fail("residual_out rows must be contiguous")
    hf = float_out
    if hf is None and want_float is not None:
        hf = torch.empty((t, n), dtype=want_float, device=x.device)
    if hf is not None:
        if tuple(hf.shape) != (t, n) or hf.device != x.device or hf.stride(1) != 1:
            _fail(f"float_out must be [{t}, {n}] on {x.device} with contiguous rows")
        if not hf.dtype.is_floating_point:
            raise TypeError(f"add_rms_norm_quant: want_float must be a float dtype, got {hf.dtype}")
    hq = None
    if quant:
        hq = quant_out if quant_out is not None else QuantAct.empty(t, n, x.device)
        if not hq.is_packed(t, n, x.device):
            _fail(f"quant_out must be a QuantAct for [{t}, {n}] on {x.device}")
    if t:
        rows, block, warps = _program_shape(n)
        while len(dargs) < MAX_DELTAS:
            dargs.append((x, 0, 0, 1))
        (d0, d0s, d0r, s0), (d1, d1s, d1r, s1), (d2, d2s, d2r, s2) = dargs
        r = residual_out if residual_out is not None else x
        h = hf if hf is not None else x
        qq, qs = (hq.q, hq.s) if hq is not None else (x, x)
        _add_rms_norm_quant_kernel[(cdiv(t, rows),)](
            x, d0, d1, d2, w if w is not None else x, r, h, qq, qs,
            t, n, x.stride(0), d0s, d0r, s0, d1s, d1r, s1, d2s, d2r, s2,
            r.stride(0), h.stride(0),
            qq.stride(0) if hq is not None else 0, qs.stride(0) if hq is not None else 0,
            float(eps),
            ND=len(deltas), HAS_W=w is not None, STORE_R=residual_out is not None,
            STORE_H=hf is not None, QUANT=quant, ROWS=rows, BLOCK=block,
            NB=block // 32, WIDE=hq is not None and hq.wide, num_warps=warps,
            **pdl_args(x.device))
    return residual_out, hq, hf


def pack_act_ref(h: torch.Tensor, wide: bool | None = None) -> QuantAct:
    """Torch twin of :func:`localmoe.kernels.quant_gemv.quantize_act` that returns the packed
    :class:`QuantAct` (codes ``round_half_even(h * (127 / amax))`` per 32 values, four to a
    little-endian int32 word; the two 16-value code sums as int16 halves; ``amax / 127``; with
    ``wide`` (None: the activation precision in effect is ``"int16"``) the residual codes and
    their sums after each block's, the kernels' layout).

    Args: h ``[T, K]`` float, K a multiple of 32. Returns a QuantAct on ``h``'s device."""
    wide = wide_default(wide)
    t, k = h.shape
    q, r, d = _act_codes_ref(h, wide)                    # [T, K/32, 32], [T, K/32, 1]
    planes = [q] if r is None else [q, r]
    codes = torch.stack(planes, 2).to(torch.int32)       # [T, K/32, W, 32]
    q = codes.to(torch.int8).reshape(t, -1).contiguous().view(torch.int32)
    sums = codes.reshape(t, k // 32, len(planes), 2, 16).sum(-1, dtype=torch.int32)
    packed = (sums[..., 0] & 0xFFFF) | (sums[..., 1] << 16)          # [T, K/32, W]
    sd = torch.zeros((t, k // 32, 2 * len(planes)), dtype=torch.int32, device=h.device)
    sd[..., 0::2] = packed
    sd[..., 1] = d.reshape(t, k // 32).contiguous().view(torch.int32)
    return QuantAct(q, sd[..., 0], sd.view(torch.float32)[..., 1], wide)


def add_rms_norm_quant_ref(x: torch.Tensor, deltas: Sequence[torch.Tensor],
                           w: torch.Tensor | None, eps: float, *,
                           want_float: torch.dtype | None = None, quant: bool = True
                           ) -> tuple[torch.Tensor, QuantAct | None, torch.Tensor | None]:
    """Torch twin of :func:`add_rms_norm_quant`: ``(r, hq, hf)`` with the same roundings
    (float32 delta sums in the kernel's order, ``r`` and ``h`` rounded to ``x``'s dtype, the
    quantization of the rounded ``h``). Only the norm's float32 reduction order differs."""
    acc = x.float()
    for d in deltas:
        acc = acc + (sum_partials(d) if d.dim() == 3 else d.float())
    r = acc.to(x.dtype)
    rf = r.float()
    y = rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps)
    if w is not None:
        y = y * w.float().reshape(-1)
    h = y.to(x.dtype)
    hq = pack_act_ref(h) if quant else None
    hf = h.to(want_float) if want_float is not None else None
    return r, hq, hf
