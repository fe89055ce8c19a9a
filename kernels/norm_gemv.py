"""Residual add + RMSNorm + int8 quantization fused into the quantized GEMV that reads them
(the attention's q/k/v projection of the decode step): one launch instead of two.

The decode step's layer starts with :func:`localmoe.kernels.fused_norm.add_rms_norm_quant`
(one program: ``r = x + sum(deltas)``, ``h = rms_norm(r) * w``, ``hq = int8(h)``) followed by
:func:`localmoe.kernels.quant_gemv.quant_gemv_partials` of ``hq`` with the q/k/v weight. At
batch 1 the first is a single program whose latency (load, a cross-warp reduction, the
quantization, the store; ~2 us on the H200) plus one launch gap sits on the step's critical
path once per layer. Here every GEMV program computes ``hq`` of its 1-8 token rows itself,
right after PDL's wait:

* each program runs the exact code of the norm kernel
  (:func:`~localmoe.kernels.fused_norm.add_norm_rows`, one token row at a time, then
  :func:`~localmoe.kernels.fused_norm.quant_store_rows`) and stores the int8 blocks into its
  **own** slot of a scratch buffer (no two programs write the same bytes), then a CTA barrier
  makes them visible to the program's threads, and the unchanged GEMV body
  (:func:`~localmoe.kernels.quant_gemv.gemv_tokens`) reads them from there (L1/L2);
* program (0, 0) alone stores the residual ``r``, into a buffer other than ``x`` (every program
  reads ``x``);
* the redundant work is ~12 KB of L2 reads and ~2.5 KB of stores per program and token (D =
  2048); the weights it multiplies are ~10 MB per launch.

Numerics: each program computes ``r``, ``h`` and the QuantAct exactly as the norm kernel does
(the same jitted code, module doc of :mod:`localmoe.kernels.fused_norm`); only the float32
order of the norm's sum of squares may differ from the unfused kernel's on the GPU (its
program shape differs), so the partials equal the unfused chain's bit for bit in the
interpreter and within the fp16 tolerance on the GPU. The torch twin is
:func:`norm_gemv_partials_ref`.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from localmoe.kernels.fused_norm import (
    MAX_DELTAS, add_norm_rows, add_rms_norm_quant, add_rms_norm_quant_ref, norm_args,
    quant_store_rows, x_shape_checked,
)
from localmoe.kernels.host import cdiv, next_pow2
from localmoe.kernels.pdl import pdl_args, pdl_prefetch
from localmoe.kernels.qtensor import QTYPE_NAMES, QUANT_QTYPES, QuantTensor, chunk_values
from localmoe.kernels.quant_gemv import (
    QuantAct, _PREFETCH_MAX, _plan, gemv_program, gemv_tokens, lookahead_arg, plane_args,
    quant_gemv_partials, quant_gemv_ref, use_asm, wide_default,
)
from localmoe.kernels.scratch import grown

__all__ = ["norm_gemv_partials", "norm_gemv_partials_ref", "MAX_TOKENS"]

#: token rows one launch normalizes and multiplies (more: the unfused two launches per group)
MAX_TOKENS = 8

# per device: the programs' activation slots (int32 words, then (sums, scale) pairs)
_SCRATCH: dict = {}


@triton.jit
def _norm_gemv_kernel(
        x_ptr, d0_ptr, d1_ptr, d2_ptr, nw_ptr, r_ptr, aq_ptr, as_ptr, y_ptr,
        q_ptr, qh_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr,
        N, T, D, n_chunks, split_chunks,
        x_rs, d0_ss, d0_rs, S0, d1_ss, d1_rs, S1, d2_ss, d2_rs, S2, r_rs,
        a_ps, aq_rs, as_rs, y_rs, y_ss, q_rs, qh_rs, d_rs, dm_rs, sc_rs, mn_rs, eps,
        ND: tl.constexpr, HAS_W: tl.constexpr, STORE_R: tl.constexpr, BLOCK: tl.constexpr,
        NB: tl.constexpr, QTYPE: tl.constexpr, CV: tl.constexpr, TP: tl.constexpr,
        BN: tl.constexpr, CH: tl.constexpr, EVEN: tl.constexpr, XB: tl.constexpr,
        USE_ASM: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr = False,
        LINE: tl.constexpr = 32, WIDE: tl.constexpr = False, STAGES: tl.constexpr = 1,
        LOOKAHEAD: tl.constexpr = False):
    pid_k, rows, rmask4, rows4, c_begin, c_end = gemv_program(
        q_ptr, q_rs, N, n_chunks, split_chunks, QTYPE, BN, PREFETCH, LINE, PDL)
    # this program's activation slot: TP rows of int32 words, then TP rows of pairs
    slot = (pid_k * tl.num_programs(0) + tl.program_id(0)).to(tl.int64) * a_ps
    aq = aq_ptr + slot
    as_ = as_ptr + slot
    r_lim = T * ((tl.program_id(0) + pid_k) == 0).to(tl.int32)   # rows program (0, 0) stores
    for ti in tl.static_range(TP):
        res, h, m, r64, c = add_norm_rows(x_ptr, d0_ptr, d1_ptr, d2_ptr, nw_ptr, ti, T, D, x_rs,
                                          d0_ss, d0_rs, S0, d1_ss, d1_rs, S1, d2_ss, d2_rs, S2,
                                          eps, ND, HAS_W, 1, BLOCK)
        if STORE_R:
            tl.store(r_ptr + r64[:, None] * r_rs + c[None, :], res,
                     mask=m & (r64[:, None] < r_lim))
        quant_store_rows(h, ti, T, D, aq, as_, aq_rs, as_rs, 1, NB, WIDE)
    tl.debug_barrier()          # the slot's stores are visible to every thread of the program
    gemv_tokens(aq, as_, y_ptr, q_ptr, qh_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr,
                N, T, rows, rows4, rmask4, c_begin, c_end, pid_k,
                aq_rs, as_rs, y_rs, y_ss, q_rs, qh_rs, d_rs, dm_rs, sc_rs, mn_rs,
                QTYPE, CV, TP, BN, CH, EVEN, XB, False, USE_ASM, WIDE, STAGES, LOOKAHEAD)


def _fail(msg: str):
    raise ValueError(f"norm_gemv_partials: {msg}")


def _slots(device, words: int) -> torch.Tensor:
    """The device's scratch of at least ``words`` int32 (reused by every launch; grown)."""
    key = str(device)
    buf = _SCRATCH[key] = grown(_SCRATCH.get(key), (words,), torch.int32, device)
    return buf


def norm_gemv_partials(x: torch.Tensor, deltas: Sequence[torch.Tensor],
                       norm_w: torch.Tensor | None, eps: float, w: QuantTensor, *,
                       residual_out: torch.Tensor | None, config: dict | None = None,
                       wide: bool | None = None, out: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``add_rms_norm_quant`` of ``x`` and ``quant_gemv_partials`` of its normed rows with
    ``w``, in one launch per 8 tokens.

    Args:
        x: the residual stream ``[T, D]``, float16/bfloat16/float32, rows contiguous; ``D`` a
            multiple of 32, at most 8192, equal to ``w``'s K.
        deltas: up to 3 tensors added to ``x`` first, each ``[T, D]`` or float32 split-K
            partials ``[S, T, D]`` (as :func:`~localmoe.kernels.fused_norm.add_rms_norm_quant`).
        norm_w: the RMSNorm weight ``[D]`` or None; eps: its epsilon.
        w: a quantized 2-D ``[N, D]`` :class:`QuantTensor` on ``x``'s device.
        residual_out: ``[T, D]`` in ``x``'s dtype, rows contiguous, not sharing ``x``'s memory
            (every program reads ``x``): receives ``r = x + sum(deltas)``; None: not stored.
        config: override of the launch choice (the ``norm_gemv`` knob of the device's launch
            table; fields as for :func:`~localmoe.kernels.quant_gemv.quant_gemv`; its
            ``split`` fixes ``S``).
        wide: the int16 activation precision (None: the one in effect,
            :func:`~localmoe.kernels.quant_gemv.act_precision`).
        out: optional float32 ``[S, T, N]`` (rows contiguous).
    Returns:
        ``(residual_out, partials)``: ``partials`` float32 ``[S, T, N]``, whose sum over ``S``
        is ``int8(rms_norm(r) * norm_w) @ dequant(w).T``.
    Raises:
        ValueError / TypeError: shapes, dtypes, devices or buffers that do not fit (the
            messages of ``add_rms_norm_quant`` and ``quant_gemv_partials``), float or
            unsupported weight types, ``residual_out`` sharing ``x``'s memory.
    """
    t, k = x_shape_checked(x, True)
    dargs, norm_w = norm_args(x, deltas, norm_w, residual_out)
    if not isinstance(w, QuantTensor) or len(w.shape) != 2 or w.shape[1] != k:
        _fail(f"w must be a 2-D QuantTensor [N, {k}], got "
              f"{getattr(w, 'shape', type(w).__name__)}")
    if w.is_float or w.qtype not in QUANT_QTYPES:
        _fail(f"w must be a quantized GGUF type the GEMV reads, got "
              f"{QTYPE_NAMES.get(w.qtype, w.qtype)}")
    if w.device != x.device:
        _fail(f"x on {x.device}, w on {w.device}")
    if residual_out is not None and t and residual_out.data_ptr() == x.data_ptr():
        _fail("residual_out must not be x (every program reads x)")
    wide = wide_default(wide)
    n = w.shape[0]
    cfg, n_chunks, split, split_chunks = _plan(w, max(1, min(t, MAX_TOKENS)), config,
                                               knob="norm_gemv")
    if out is None:
        out = torch.empty((split, t, n), dtype=torch.float32, device=x.device)
    elif (tuple(out.shape) != (split, t, n) or out.dtype != torch.float32
          or out.device != x.device or out.stride(2) != 1):
        _fail(f"out must be float32 [{split}, {t}, {n}] on {x.device} with contiguous rows, "
              f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    if t > MAX_TOKENS:          # the GEMV is built for 1-8 tokens: the unfused launches
        r, hq, _ = add_rms_norm_quant(x, deltas, norm_w, eps, residual_out=residual_out,
                                      quant_out=QuantAct.empty(t, k, x.device, wide))
        quant_gemv_partials(hq, w, config=dict(cfg, split=split), out=out)
        return r, out
    if not t:
        return residual_out, out
    nd = len(dargs)
    while len(dargs) < MAX_DELTAS:
        dargs.append((x, 0, 0, 1))
    (d0, d0s, d0r, s0), (d1, d1s, d1r, s1), (d2, d2s, d2r, s2) = dargs
    tp = next_pow2(t)
    wd = 2 if wide else 1
    aq_rs, as_rs = k // 4 * wd, k // 32 * 2 * wd
    a_ps = tp * (aq_rs + as_rs)                  # one program's slot, int32 words
    grid = (cdiv(n, cfg["BN"]), split)
    buf = _slots(x.device, grid[0] * grid[1] * a_ps)
    ptrs, strides = plane_args(w)
    block = next_pow2(k)
    r = residual_out if residual_out is not None else x
    _norm_gemv_kernel[grid](
        x, d0, d1, d2, norm_w if norm_w is not None else x, r, buf, buf[tp * aq_rs:], out,
        *ptrs, n, t, k, n_chunks, split_chunks,
        x.stride(0), d0s, d0r, s0, d1s, d1r, s1, d2s, d2r, s2, r.stride(0),
        a_ps, aq_rs, as_rs, out.stride(1), out.stride(0), *strides, float(eps),
        ND=nd, HAS_W=norm_w is not None, STORE_R=residual_out is not None, BLOCK=block,
        NB=block // 32, QTYPE=w.qtype, CV=chunk_values(w.qtype), TP=tp, BN=cfg["BN"],
        CH=cfg["CH"],
        EVEN=(n % cfg["BN"] == 0 and split_chunks % cfg["CH"] == 0
              and n_chunks % split_chunks == 0 and t == tp),
        XB=cfg.get("xb", False), USE_ASM=cfg.get("asm", use_asm()),
        PREFETCH=pdl_prefetch(x.device) and w.nbytes <= _PREFETCH_MAX,
        LINE=128 // ptrs[0].element_size(), WIDE=wide, STAGES=int(cfg.get("stages", 1)),
        num_warps=cfg.get("num_warps", 4), **lookahead_arg(cfg), **pdl_args(x.device))
    return residual_out, out


def norm_gemv_partials_ref(x: torch.Tensor, deltas: Sequence[torch.Tensor],
                           norm_w: torch.Tensor | None, eps: float, w: QuantTensor,
                           wide: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of :func:`norm_gemv_partials`: ``(r, y)`` with ``r`` the residual and ``y``
    float32 ``[T, N]`` the product of the quantized normed rows with ``dequant(w)`` (the sum
    of the kernel's partials; :func:`~localmoe.kernels.fused_norm.add_rms_norm_quant_ref`,
    then :func:`~localmoe.kernels.quant_gemv.quant_gemv_ref`)."""
    from localmoe.kernels.fused_norm import pack_act_ref

    r, _, hf = add_rms_norm_quant_ref(x, deltas, norm_w, eps, want_float=x.dtype, quant=False)
    return r, quant_gemv_ref(pack_act_ref(hf, wide), w)
