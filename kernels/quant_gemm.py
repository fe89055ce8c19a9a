"""Quantized GEMM for prefill, dense and grouped by expert, on GGUF weights kept in their blocks.

``y[m, n] = sum_k x[m, k] * W[n, k]`` for many tokens ``m`` (prefill), with ``W`` a
:class:`~localmoe.kernels.qtensor.QuantTensor` (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K,
Q5_K, Q6_K, IQ4_NL, IQ4_XS). Each program owns a ``[BM, BN]`` output tile and walks K one
*chunk* at a time (32 values, 64 for Q2_K/Q3_K; the repacked planes of
:mod:`localmoe.kernels.qtensor`):
:func:`_dequant_chunk` turns the chunk's ``BN`` weight rows into floats in registers (codes
shifted out of their words, high bits or'ed in, block and sub-block scales applied as in ggml's
``dequantize_row_*``), and ``tl.dot`` multiplies them with the ``[BM, CV]`` activation tile on
the tensor cores (operands in the activations' dtype, float32 accumulation). No float copy of
the weights is ever written to memory.

* :func:`quant_gemm`: dense ``x [M, K] @ W.T``.
* :func:`moe_align`: the ``N * top_k`` (token, expert) assignments sorted by expert and padded
  to whole ``BM`` blocks on the device (torch ops, no host sync; the role of vLLM's
  ``moe_align_block_size``): ``sorted_ids`` (assignment index per padded row, ``N*top_k`` for
  padding), the expert of every block, and the padded total.
* :func:`moe_gemm_gate_up` / :func:`moe_gemm_down`: one launch each over the blocks of
  :func:`moe_align` -- block ``b`` multiplies its rows by expert ``block_expert[b]`` (through
  ``slot_of``, the offload seam of :mod:`localmoe.kernels.fused_moe`). Gate/up reads the
  interleaved ``[E, 2F, D]`` tensor and writes ``act(gate) * up`` ``[N*top_k, F]``; down writes
  each assignment's routing-weighted output ``[N*top_k, D]`` (float32 accumulation, stored in
  the activations' dtype by :func:`moe_prefill`, as the torch reference's expert outputs are),
  summed over the ``top_k`` experts of each token (in float32) by :func:`moe_prefill`, which
  runs a long prompt in chunks of :data:`MOE_PREFILL_CHUNK` tokens so that these
  intermediates (``top_k`` rows per token) stay bounded: they set the memory a prefill CUDA
  graph keeps in its pool.

The torch twins are ``x @ W.dequantize().T`` (:func:`quant_gemm_ref`) and
:func:`localmoe.kernels.fused_moe.fused_moe_ref` with ``act_quant=False``. Launch choices (BM,
BN, warps, stages) are the ``gemm`` / ``moe_gemm`` knobs of ``kernels/configs/<device>.json``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from localmoe.kernels.launch_config import device_table
from localmoe.kernels.qtensor import QTYPE_NAMES, QUANT_QTYPES, QuantTensor, chunk_values
from localmoe.kernels.quant_gemv import (
    iq4_lookup, k_chunk_scales, k_super_scales, plane_args, use_asm,
)
from localmoe.kernels.host import cdiv

__all__ = ["quant_gemm", "quant_gemm_ref", "dequantize_rows", "moe_align", "moe_gemm_gate_up",
           "moe_gemm_down", "moe_prefill", "gemm_config", "MOE_PREFILL_CHUNK"]

#: tokens per :func:`moe_prefill` pass: its intermediates are ``top_k * (d_ff + d_model)``
#: values per token (Qwen3-30B-A3B: 44 KB per token in float16, 176 MiB per 4,096-token pass).
#: A longer prompt runs in passes of this many tokens. Passes of 2,048 tokens saved another
#: 0.24 GiB of peak VRAM on the H200 but cost 13% of the TTFT at 4,096 tokens (197 against
#: 175 ms), so the largest prefill graph (4,096 tokens) keeps one pass.
MOE_PREFILL_CHUNK = 4096

_Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0 = tl.constexpr(2), tl.constexpr(3), tl.constexpr(6), tl.constexpr(7), tl.constexpr(8)
_Q2_K, _Q3_K, _Q4_K, _Q5_K, _Q6_K = tl.constexpr(10), tl.constexpr(11), tl.constexpr(12), tl.constexpr(13), tl.constexpr(14)
_IQ4_NL, _IQ4_XS = tl.constexpr(20), tl.constexpr(23)


@triton.jit
def _dequant_chunk(rows, rmask, c, q_ptr, qh_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr,
                   q_rs, qh_rs, d_rs, dm_rs, sc_rs, mn_rs,
                   QTYPE: tl.constexpr, CV: tl.constexpr, USE_ASM: tl.constexpr = False):
    """Float32 values ``[BN, CV]`` of chunk ``c`` of the weight rows ``rows`` ([BN] int64;
    masked rows give 0). Value ``16s + 4w + b`` of a chunk sits in byte ``b`` of word ``w`` of
    slice ``s`` (qtensor's layout), so a [BN, S, 4, 4] tile of shifted codes reshapes to the
    values in order."""
    r4 = rows[:, None, None, None]
    m4 = rmask[:, None, None, None]
    w4 = tl.arange(0, 4)[None, None, :, None]          # word in a slice
    b4 = tl.arange(0, 4)[None, None, None, :]          # byte in a word
    if QTYPE == _Q8_0:
        s4 = tl.arange(0, 2)[None, :, None, None]
        wv = tl.load(q_ptr + r4 * q_rs + c * 8 + s4 * 4 + w4, mask=m4, other=0)
        code = ((wv << (24 - 8 * b4)) >> 24).to(tl.float32)      # signed byte
        d = tl.load(d_ptr + r4 * d_rs + c, mask=m4, other=0.0).to(tl.float32)
        val = d * code
    elif CV == 32:
        s4 = tl.arange(0, 2)[None, :, None, None]
        wv = tl.load(q_ptr + r4 * q_rs + c * 4 + w4, mask=m4, other=0)
        if QTYPE == _IQ4_NL or QTYPE == _IQ4_XS:
            # the code-book values of both 16-value slices as int8 words, then signed bytes
            lo, hi = iq4_lookup(wv, USE_ASM)
            code = (tl.where(s4 == 0, lo, hi) << (24 - 8 * b4)) >> 24
        else:
            code = (wv >> (8 * b4 + 4 * s4)) & 15
        if QTYPE == _Q5_0 or QTYPE == _Q5_1 or QTYPE == _Q5_K:
            h = tl.load(qh_ptr + r4 * qh_rs + c, mask=m4, other=0)
            code = code | (((h >> (8 * b4 + 4 * s4 + w4)) & 1) << 4)
        if QTYPE == _Q6_K:
            h = tl.load(qh_ptr + r4 * qh_rs + c * 2 + s4, mask=m4, other=0)
            code = code | (((h >> (8 * b4 + 2 * w4)) & 3) << 4)
        codef = code.to(tl.float32)
        if QTYPE == _Q6_K:
            d = tl.load(d_ptr + r4 * d_rs + c // 8, mask=m4, other=0.0).to(tl.float32)
            sc = tl.load(sc_ptr + r4 * sc_rs + c * 2 + s4, mask=m4, other=0).to(tl.float32)
            val = (d * sc) * (codef - 32.0)
        elif QTYPE == _Q4_K or QTYPE == _Q5_K:
            d, dm = k_super_scales(tl.load(d_ptr + r4 * d_rs + c // 8, mask=m4, other=0))
            sc, mn = k_chunk_scales(tl.load(sc_ptr + r4 * sc_rs + c, mask=m4, other=0))
            val = (d * sc.to(tl.float32)) * codef - dm * mn.to(tl.float32)
        elif QTYPE == _IQ4_XS:
            d = tl.load(d_ptr + r4 * d_rs + c // 8, mask=m4, other=0.0).to(tl.float32)
            sc = tl.load(sc_ptr + r4 * sc_rs + c, mask=m4, other=0).to(tl.float32)
            val = (d * sc) * codef
        else:
            d = tl.load(d_ptr + r4 * d_rs + c, mask=m4, other=0.0).to(tl.float32)
            if QTYPE == _IQ4_NL:
                val = d * codef
            elif QTYPE == _Q4_0:
                val = d * (codef - 8.0)
            elif QTYPE == _Q5_0:
                val = d * (codef - 16.0)
            else:  # Q4_1, Q5_1: w = d*q + m
                m = tl.load(dm_ptr + r4 * dm_rs + c, mask=m4, other=0.0).to(tl.float32)
                val = d * codef + m
    else:  # CV == 64: Q2_K, Q3_K
        s4 = tl.arange(0, 4)[None, :, None, None]
        wv = tl.load(q_ptr + r4 * q_rs + c * 4 + w4, mask=m4, other=0)
        code = (wv >> (8 * b4 + 2 * s4)) & 3
        d = tl.load(d_ptr + r4 * d_rs + c // 4, mask=m4, other=0.0).to(tl.float32)
        scb = tl.load(sc_ptr + r4 * sc_rs + c * 4 + s4, mask=m4, other=0).to(tl.int32)
        if QTYPE == _Q3_K:
            h = tl.load(qh_ptr + r4 * qh_rs + c * 4 + w4, mask=m4, other=0).to(tl.int32)
            code = code | (((h >> (4 * s4 + b4)) & 1) << 2)
            val = (d * scb.to(tl.float32)) * (code.to(tl.float32) - 4.0)
        else:  # Q2_K: byte = scale | min << 4
            dm = tl.load(dm_ptr + r4 * dm_rs + c // 4, mask=m4, other=0.0).to(tl.float32)
            val = (d * (scb & 15).to(tl.float32)) * code.to(tl.float32) \
                - dm * (scb >> 4).to(tl.float32)
    return tl.reshape(val, (rows.shape[0], CV))


# -----------------------------------------------------------------------------------------------
# dense GEMM
# -----------------------------------------------------------------------------------------------

@triton.jit
def _gemm_tile(x_ptr, xrow, xmask, x_rs, rows, nmask, n_chunks,
               q_ptr, qh_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr, q_rs, qh_rs, d_rs, dm_rs, sc_rs, mn_rs,
               QTYPE: tl.constexpr, CV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               USE_ASM: tl.constexpr = False):
    """float32 ``[BM, BN]`` = x rows ``xrow`` ([BM] int64, masked by ``xmask``) times the weight
    rows ``rows`` ([BN], masked by ``nmask``) over all ``n_chunks`` chunks of K: each chunk
    dequantized in registers, one ``tl.dot`` in the activations' dtype."""
    xp = x_ptr + xrow[:, None] * x_rs + tl.arange(0, CV)[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for c in range(0, n_chunks):
        x = tl.load(xp + c * CV, mask=xmask[:, None], other=0.0)
        w = _dequant_chunk(rows, nmask, c, q_ptr, qh_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr,
                           q_rs, qh_rs, d_rs, dm_rs, sc_rs, mn_rs, QTYPE, CV, USE_ASM)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    return acc


@triton.jit
def _quant_gemm_kernel(x_ptr, y_ptr, q_ptr, qh_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr,
                       M, N, n_chunks, x_rs, y_rs, q_rs, qh_rs, d_rs, dm_rs, sc_rs, mn_rs,
                       QTYPE: tl.constexpr, CV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       USE_ASM: tl.constexpr = False):
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(0)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mmask = rm < M
    nmask = rn < N
    rows = rn.to(tl.int64)
    acc = _gemm_tile(x_ptr, rm.to(tl.int64), mmask, x_rs, rows, nmask, n_chunks,
                     q_ptr, qh_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr, q_rs, qh_rs, d_rs, dm_rs, sc_rs,
                     mn_rs, QTYPE, CV, BM, BN, USE_ASM)
    yp = y_ptr + rm.to(tl.int64)[:, None] * y_rs + rn[None, :]
    tl.store(yp, acc.to(y_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _dequant_rows_kernel(ids_ptr, y_ptr, q_ptr, qh_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr,
                         R, n_chunks, y_rs, q_rs, qh_rs, d_rs, dm_rs, sc_rs, mn_rs,
                         QTYPE: tl.constexpr, CV: tl.constexpr, BR: tl.constexpr,
                         USE_ASM: tl.constexpr = False):
    pid = tl.program_id(0)
    c = tl.program_id(1)
    ri = pid * BR + tl.arange(0, BR)
    rmask = ri < R
    rows = tl.load(ids_ptr + ri, mask=rmask, other=0).to(tl.int64)
    w = _dequant_chunk(rows, rmask, c, q_ptr, qh_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr,
                       q_rs, qh_rs, d_rs, dm_rs, sc_rs, mn_rs, QTYPE, CV, USE_ASM)
    yp = y_ptr + ri.to(tl.int64)[:, None] * y_rs + c * CV + tl.arange(0, CV)[None, :]
    tl.store(yp, w.to(y_ptr.dtype.element_ty), mask=rmask[:, None])


def gemm_config(m: int, n: int, k: int, qtype: int, device=None) -> dict:
    """Launch choice of :func:`quant_gemm` (``BM``, ``BN``, ``num_warps``, ``num_stages``)
    for ``m`` tokens of an ``[n, k]`` weight of GGUF type ``qtype`` on ``device``, from the
    ``gemm`` knob of the device's launch table (:mod:`localmoe.kernels.launch_config`)."""
    return device_table(device).lookup("gemm", tokens=m, n=n, k=k, qtype=QTYPE_NAMES[qtype])


def _check_w(w: QuantTensor, what: str) -> None:
    if w.qtype not in QUANT_QTYPES:
        raise ValueError(f"{what}: unsupported qtype {QTYPE_NAMES.get(w.qtype, w.qtype)} "
                         "(quantized types only; float weights use torch)")


def quant_gemm(x: torch.Tensor, w: QuantTensor, out: torch.Tensor | None = None,
               config: dict | None = None) -> torch.Tensor:
    """``x @ dequant(w).T`` for prefill (any number of tokens), dequantizing in registers.

    Args:
        x: ``[M, K]`` float16/bfloat16/float32 activations, rows contiguous (the dot runs in
            this dtype; float32 uses TF32 on the GPU).
        w: a 2-D ``[N, K]`` quantized :class:`QuantTensor` on ``x``'s device.
        out: optional ``[M, N]`` output (any float dtype, unit column stride).
        config: override of :func:`gemm_config` (keys BM, BN, num_warps, num_stages).
    Returns:
        ``[M, N]`` in ``x.dtype`` or ``out``.
    Raises:
        ValueError / TypeError: shapes, dtypes or devices that do not fit.
    """
    if len(w.shape) != 2:
        raise ValueError(f"quant_gemm: w must be 2-D [N, K], got shape {w.shape}")
    _check_w(w, "quant_gemm")
    n, k = w.shape
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"quant_gemm: x must be [M, {k}] with contiguous rows, got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"quant_gemm: x must be float32/float16/bfloat16, got {x.dtype}")
    if x.device != w.device:
        raise ValueError(f"quant_gemm: x on {x.device}, w on {w.device}")
    m = x.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = dict(gemm_config(m, n, k, w.qtype, w.device), **(config or {}))
    cv = chunk_values(w.qtype)
    ptrs, strides = plane_args(w)
    grid = (cdiv(n, cfg["BN"]), cdiv(m, cfg["BM"]))
    _quant_gemm_kernel[grid](
        x, out, *ptrs, m, n, k // cv, x.stride(0), out.stride(0), *strides,
        QTYPE=w.qtype, CV=cv, BM=cfg["BM"], BN=cfg["BN"], USE_ASM=use_asm(),
        num_warps=cfg.get("num_warps", 4),
        num_stages=cfg.get("num_stages", 2))
    return out


def dequantize_rows(w: QuantTensor, ids: torch.Tensor, dtype: torch.dtype = torch.float16,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``ids`` of a quantized ``w`` (``[R, K]`` viewed 2-D) as floats: the embedding
    lookup of a quantized token table (one launch, no float copy of the table).

    Args:
        w: quantized :class:`QuantTensor` (rows = ``prod(shape[:-1])``).
        ids: ``[T]`` int32/int64 row indices on ``w``'s device, ``0 <= id < rows`` (the caller
            checks; out-of-range ids are not read: they are clamped by the caller's validation).
        dtype: output dtype (when ``out`` is None).
    Returns:
        ``[T, K]``. Same values as ``w.dequantize(ids)`` rounded to ``dtype``.
    """
    _check_w(w, "dequantize_rows")
    t, k = ids.numel(), w.K
    if out is None:
        out = torch.empty((t, k), dtype=dtype, device=w.device)
    if t == 0:
        return out
    cv = chunk_values(w.qtype)
    ptrs, strides = plane_args(w)
    br = 16
    _dequant_rows_kernel[(cdiv(t, br), k // cv)](
        ids.reshape(-1).contiguous(), out, *ptrs, t, k // cv, out.stride(0), *strides,
        QTYPE=w.qtype, CV=cv, BR=br, USE_ASM=use_asm(), num_warps=4)
    return out


def quant_gemm_ref(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    """Torch twin of :func:`quant_gemm`: ``x @ dequant(w).T`` in float32 ``[M, N]``."""
    return x.float() @ w.dequantize().reshape(-1, w.K).T


# -----------------------------------------------------------------------------------------------
# grouped by expert (MoE prefill)
# -----------------------------------------------------------------------------------------------

def moe_align(topk_ids: torch.Tensor, n_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the (token, expert) assignments by expert in ``block_m``-row blocks, on the device.

    Args:
        topk_ids: ``[T, top_k]`` int expert ids (device tensor, never read on the host).
        n_experts: number of experts ``E``.
        block_m: rows per block.
    Returns:
        ``(sorted_ids, block_expert, n_padded)``: ``sorted_ids`` int32 ``[P]`` (``P`` = the
        bound ``T*top_k + min(E, T*top_k) * (block_m - 1)`` rounded up to ``block_m``): the
        assignment index ``t*top_k + j`` of every padded row, experts in ascending order, each
        expert's rows padded to a multiple of ``block_m`` with ``T*top_k``; ``block_expert``
        int32 ``[P / block_m]``: each block's expert (blocks past the padded total repeat the
        last expert and are skipped by the kernels); ``n_padded`` int32 ``[1]``: rows in use.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    dev = flat.device
    # scatter_add, not bincount: bincount on CUDA reads the largest id on the host (a sync)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    end_pad = torch.cumsum(padded, 0)
    start_pad = end_pad - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    e_sorted = flat[order]
    rank = torch.arange(n, device=dev) - start[e_sorted]
    bound = n + min(n_experts, n) * (block_m - 1)
    bound = (bound + block_m - 1) // block_m * block_m
    sorted_ids = torch.full((bound,), n, dtype=torch.int32, device=dev)
    sorted_ids[start_pad[e_sorted] + rank] = order.to(torch.int32)
    blocks = torch.arange(bound // block_m, device=dev) * block_m
    block_expert = torch.searchsorted(end_pad, blocks, right=True).clamp_(max=n_experts - 1)
    return sorted_ids, block_expert.to(torch.int32), end_pad[-1:].to(torch.int32)


@triton.jit
def _moe_gemm_kernel(x_ptr, y_ptr, sorted_ptr, bexp_ptr, npad_ptr, slot_ptr, wts_ptr,
                     q_ptr, qh_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr,
                     n_assign, NW, n_chunks, x_rs, y_rs, q_rs, qh_rs, d_rs, dm_rs, sc_rs, mn_rs,
                     TOP_K: tl.constexpr, GATE_UP: tl.constexpr, ACT: tl.constexpr,
                     QTYPE: tl.constexpr, CV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     USE_ASM: tl.constexpr = False):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    if pid_m * BM >= tl.load(npad_ptr):
        return
    e = tl.load(bexp_ptr + pid_m)
    slot = tl.load(slot_ptr + e).to(tl.int64)
    a = tl.load(sorted_ptr + pid_m * BM + tl.arange(0, BM))
    amask = a < n_assign
    if GATE_UP:
        xrow = (a // TOP_K).to(tl.int64)
    else:
        xrow = a.to(tl.int64)
    rn = pid_n * BN + tl.arange(0, BN)
    nmask = rn < NW
    rows = slot * NW + rn.to(tl.int64)
    acc = _gemm_tile(x_ptr, xrow, amask, x_rs, rows, nmask, n_chunks,
                     q_ptr, qh_ptr, d_ptr, dm_ptr, sc_ptr, mn_ptr, q_rs, qh_rs, d_rs, dm_rs, sc_rs,
                     mn_rs, QTYPE, CV, BM, BN, USE_ASM)
    arow = a.to(tl.int64)
    if GATE_UP:
        # columns alternate gate, up (QuantTensor.interleave_rows): h = act(gate) * up
        g, u = tl.split(tl.reshape(acc, (BM, BN // 2, 2)))
        if ACT == 0:
            act = g * tl.sigmoid(g)
        else:
            z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            act = g * tl.sigmoid(2.0 * z)      # 0.5 * g * (1 + tanh(z))
        h = act * u
        hn = pid_n * (BN // 2) + tl.arange(0, BN // 2)
        yp = y_ptr + arow[:, None] * y_rs + hn[None, :]
        tl.store(yp, h.to(y_ptr.dtype.element_ty), mask=amask[:, None] & (hn < NW // 2)[None, :])
    else:
        wt = tl.load(wts_ptr + a, mask=amask, other=0.0).to(tl.float32)
        yp = y_ptr + arow[:, None] * y_rs + rn[None, :]
        tl.store(yp, (acc * wt[:, None]).to(y_ptr.dtype.element_ty),
                 mask=amask[:, None] & nmask[None, :])


def _moe_gemm(x, w: QuantTensor, y, align, slot_of, wts, top_k: int, gate_up: bool, act: int,
              cfg: dict) -> None:
    sorted_ids, block_expert, n_pad = align
    e, nw, k = w.shape
    cv = chunk_values(w.qtype)
    ptrs, strides = plane_args(w)
    grid = (cdiv(nw, cfg["BN"]), block_expert.numel())
    _moe_gemm_kernel[grid](
        x, y, sorted_ids, block_expert, n_pad, slot_of, wts if wts is not None else y,
        *ptrs, y.shape[0], nw, k // cv, x.stride(0), y.stride(0), *strides,
        TOP_K=top_k, GATE_UP=gate_up, ACT=act, QTYPE=w.qtype, CV=cv, BM=cfg["BM"], BN=cfg["BN"],
        USE_ASM=use_asm(), num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 2))


def moe_gemm_config(tokens: int, top_k: int, n_experts: int, d_model: int, d_ff: int,
                    qtype: int, device=None) -> dict:
    """Launch choice (BM, BN, num_warps, num_stages) of the grouped launches of
    :func:`moe_prefill`, from the ``moe_gemm`` knob of the device's launch table."""
    return device_table(device).lookup("moe_gemm", tokens=tokens, top_k=top_k,
                                       n_experts=n_experts, d_model=d_model, d_ff=d_ff,
                                       qtype=QTYPE_NAMES[qtype])


def moe_gemm_gate_up(x: torch.Tensor, w_gate_up: QuantTensor, align, slot_of: torch.Tensor,
                     top_k: int, activation: int = 0, config: dict | None = None) -> torch.Tensor:
    """``h [T*top_k, F]`` (x's dtype): row ``t*top_k + j`` = ``act(gate) * up`` of token ``t``
    through its ``j``-th expert; ``align`` from :func:`moe_align` with the same ``BM``."""
    e, f2, d = w_gate_up.shape
    n = int(x.shape[0]) * top_k
    h = torch.empty((n, f2 // 2), dtype=x.dtype, device=x.device)
    _moe_gemm(x, w_gate_up, h, align, slot_of, None, top_k, True, activation, config)
    return h


def moe_gemm_down(h: torch.Tensor, w_down: QuantTensor, align, slot_of: torch.Tensor,
                  topk_weights: torch.Tensor, top_k: int, config: dict | None = None,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``y [T*top_k, D]`` in ``dtype`` (float32 accumulation): each assignment's down
    projection times its routing weight."""
    e, d, f = w_down.shape
    y = torch.empty((h.shape[0], d), dtype=dtype, device=h.device)
    _moe_gemm(h, w_down, y, align, slot_of, topk_weights.reshape(-1).float().contiguous(),
              top_k, False, 0, config)
    return y


def moe_prefill(x: torch.Tensor, w_gate_up: QuantTensor, w_down: QuantTensor,
                topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                slot_of: torch.Tensor | None = None, activation: str = "silu",
                config: dict | None = None, chunk: int | None = None) -> torch.Tensor:
    """Routed-expert MLP for many tokens: :func:`moe_align`, then one grouped launch for gate/up
    and one for down, then the sum over each token's ``top_k`` experts (float32, written in
    ``x.dtype``). No host sync.

    Args and shapes as :func:`localmoe.kernels.fused_moe.fused_moe` (``x`` ``[T, D]`` float,
    rows contiguous); ``chunk``: tokens per pass (None: :data:`MOE_PREFILL_CHUNK`), which
    bounds the intermediates (``h [chunk*top_k, F]`` and the weighted expert outputs
    ``[chunk*top_k, D]``, both in ``x.dtype``). Returns ``[T, D]`` in ``x.dtype``.
    Raises:
        ValueError: shapes, qtypes or devices that do not fit; unknown activation; ``chunk``
            below 1.
    """
    from localmoe.kernels.fused_moe import ACTIVATIONS, _check

    _check(x, w_gate_up, w_down, topk_ids, topk_weights, slot_of)
    if activation not in ACTIVATIONS:
        raise ValueError(f"moe_prefill: activation must be one of {sorted(ACTIVATIONS)}, "
                         f"got {activation!r}")
    chunk = MOE_PREFILL_CHUNK if chunk is None else int(chunk)
    if chunk < 1:
        raise ValueError(f"moe_prefill: chunk must be >= 1 token, got {chunk}")
    e, f2, d = w_gate_up.shape
    t, top_k = topk_ids.shape
    if slot_of is None:
        slot_of = torch.arange(e, dtype=torch.int32, device=x.device)
    out = torch.empty((t, d), dtype=x.dtype, device=x.device)
    for a in range(0, t, chunk):
        b = min(t, a + chunk)
        cfg = dict(moe_gemm_config(b - a, top_k, e, d, f2 // 2, w_gate_up.qtype, x.device),
                   **(config or {}))
        ids = topk_ids[a:b]
        align = moe_align(ids, e, cfg["BM"])
        h = moe_gemm_gate_up(x[a:b], w_gate_up, align, slot_of, top_k,
                             ACTIVATIONS[activation], cfg)
        y = moe_gemm_down(h, w_down, align, slot_of, topk_weights[a:b], top_k, cfg,
                          dtype=x.dtype)
        del h
        torch.sum(y.view(b - a, top_k, d), 1, out=out[a:b])   # float32 accumulation
        del y
    return out
