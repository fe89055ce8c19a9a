"""MoE router for decode in one small kernel: logits -> softmax / sigmoid -> top-k -> weights.

Semantics are exactly :func:`localmoe.model.routing.route` (llama.cpp ``build_moe_ffn`` and the
HF references): probabilities over *all* experts (softmax, Shazeer et al. 2017; or sigmoid,
DeepSeek-V3 style); the ``top_k`` largest selected, equal values broken toward the **lower
expert index**; optional selection-only bias (``exp_probs_b``: added for the choice, not to the
weights); optional renormalization of the selected weights (``norm_topk_prob``: Qwen3-MoE,
Mixtral); a constant ``expert_weights_scale``.

Algorithm: one program per token holds the token's ``E`` logits (padded to a power of two with
-inf) in registers, computes the probabilities in float32, then selects ``top_k`` times the
maximum (the lowest index among equal maxima) and masks it out. Expert ids (int32) and weights
(float32) stay on the device for :func:`localmoe.kernels.fused_moe.fused_moe`.
The twin is :func:`router_ref` (= ``route``). Warps per program come from the ``router`` knob of
``kernels/configs/<device>.json`` (:func:`router_config`, :mod:`localmoe.kernels.launch_config`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from localmoe.errors import UnsupportedModelError
from localmoe.kernels.keys import PAD_KEY, key_low, score_key
from localmoe.kernels.launch_config import device_table
from localmoe.kernels.pdl import pdl_args, pdl_begin, pdl_prefetch, prefetch_rows_l2
from localmoe.kernels.quant_gemv import pack_store_blocks
from localmoe.kernels.scratch import grown
from localmoe.kernels.host import cdiv, next_pow2

__all__ = ["router", "router_fused", "router_ref", "router_config", "norm_router_fused",
           "norm_router_logits", "Routing", "route_pick", "GATING"]

GATING = {"softmax": 0, "sigmoid": 1}


@triton.jit
def _router_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, E, l_rs, ids_rs, w_rs, scale,
                   EP: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr, GATE: tl.constexpr,
                   HAS_BIAS: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, EP)
    em = e < E
    x = tl.load(logits_ptr + t * l_rs + e, mask=em, other=float("-inf")).to(tl.float32)
    _route_row(x, e, em, t, bias_ptr, ids_ptr, w_ptr, ids_rs, w_rs, scale,
               EP, TOP_K, KP, GATE, HAS_BIAS, NORM, False)


@triton.jit
def _router_logits_kernel(h_ptr, wr_ptr, logits_ptr, cnt_ptr, bias_ptr, ids_ptr, w_ptr,
                          D, E, h_rs, wr_rs, l_rs, ids_rs, w_rs, scale,
                          EB: tl.constexpr, BD: tl.constexpr, EP: tl.constexpr,
                          TOP_K: tl.constexpr, KP: tl.constexpr, GATE: tl.constexpr,
                          HAS_BIAS: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr,
                          PREFETCH: tl.constexpr = False, LINE: tl.constexpr = 32,
                          PACKED: tl.constexpr = False):
    # program (t, j): logits of experts j*EB .. j*EB+EB-1 of token t, each a contiguous row
    # of the expert-major weight [E, D]; the last program of token t routes it
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    eb = j * EB + tl.arange(0, EB)
    ebm = eb < E
    if PREFETCH:   # the router weights are constant: fetch them while the norm kernel runs
        prefetch_rows_l2(wr_ptr, eb, ebm, wr_rs, 0, D, LINE, PDL)
    pdl_begin(PDL)
    acc = tl.zeros([EB, BD], dtype=tl.float32)
    dd = tl.arange(0, BD)
    for d0 in range(0, D, BD):
        dm = (d0 + dd) < D
        h = tl.load(h_ptr + t * h_rs + d0 + dd, mask=dm, other=0.0).to(tl.float32)
        w = tl.load(wr_ptr + eb[:, None].to(tl.int64) * wr_rs + (d0 + dd)[None, :],
                    mask=ebm[:, None] & dm[None, :], other=0.0).to(tl.float32)
        acc += w * h[None, :]
    _store_logits_route_last(tl.sum(acc, axis=1), eb, ebm, t, E, logits_ptr, l_rs, cnt_ptr,
                             bias_ptr, ids_ptr, w_ptr, ids_rs, w_rs, scale,
                             EP, TOP_K, KP, GATE, HAS_BIAS, NORM, PACKED)


@triton.jit
def _store_logits_route_last(logit, eb, ebm, t, E, logits_ptr, l_rs, cnt_ptr, bias_ptr, ids_ptr,
                             w_ptr, ids_rs, w_rs, scale, EP: tl.constexpr, TOP_K: tl.constexpr,
                             KP: tl.constexpr, GATE: tl.constexpr, HAS_BIAS: tl.constexpr,
                             NORM: tl.constexpr, PACKED: tl.constexpr):
    """Store this program's logits ``logit [EB]`` (experts ``eb``) of token ``t``; the last
    program of the token to do so (an acq_rel counter orders the others' stores before it)
    routes the token and resets the counter for the next launch."""
    tl.store(logits_ptr + t * l_rs + eb, logit, mask=ebm)
    cnt = tl.atomic_add(cnt_ptr + t, 1, sem="acq_rel")
    if cnt == tl.num_programs(1) - 1:
        e = tl.arange(0, EP)
        em = e < E
        x = tl.load(logits_ptr + t * l_rs + e, mask=em, other=float("-inf"),
                    cache_modifier=".cg")
        _route_row(x, e, em, t, bias_ptr, ids_ptr, w_ptr, ids_rs, w_rs, scale,
                   EP, TOP_K, KP, GATE, HAS_BIAS, NORM, PACKED)
        tl.atomic_xchg(cnt_ptr + t, 0)


@triton.jit
def _route_row(x, e, em, t, bias_ptr, ids_ptr, w_ptr, ids_rs, w_rs, scale,
               EP: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr, GATE: tl.constexpr,
               HAS_BIAS: tl.constexpr, NORM: tl.constexpr, PACKED: tl.constexpr):
    """:func:`route_pick` of one token's logits, stored: ids and weights of row ``t``."""
    ids, wts = route_pick(x, e, em, bias_ptr, scale, EP, TOP_K, KP, GATE, HAS_BIAS, NORM,
                          PACKED)
    kk = tl.arange(0, KP)
    km = kk < TOP_K
    tl.store(ids_ptr + t * ids_rs + kk, ids, mask=km)
    tl.store(w_ptr + t * w_rs + kk, wts, mask=km)


@triton.jit
def route_pick(x, e, em, bias_ptr, scale, EP: tl.constexpr, TOP_K: tl.constexpr,
               KP: tl.constexpr, GATE: tl.constexpr, HAS_BIAS: tl.constexpr,
               NORM: tl.constexpr, PACKED: tl.constexpr):
    """Gating, top-k and weights of one token's logits ``x [EP]`` (padding -inf; ``e`` the
    expert indices, ``em`` the real ones): ``(ids [KP] int32, weights [KP] float32)``, entries
    past ``TOP_K`` 0. Also called by the fused MoE's first launch
    (:func:`localmoe.kernels.fused_moe.moe_gate_up` with a :class:`Routing`).

    ``PACKED``: each pick is one int64 max over keys ``(order-preserving int32 of the score)
    << 32 | (EP - 1 - expert)`` (the highest score, ties to the lower expert), the weights one
    gather after the loop: TOP_K + 1 reductions instead of 3 * TOP_K (the same ids and
    weights; -0.0 scores count as +0.0)."""
    if GATE == 0:
        z = tl.exp(x - tl.max(x, axis=0))
        p = z / tl.sum(z, axis=0)
    else:
        p = 1.0 / (1.0 + tl.exp(-x))
    p = tl.where(em, p, 0.0)
    sel = p
    if HAS_BIAS:
        sel = p + tl.load(bias_ptr + e, mask=em, other=0.0).to(tl.float32)
    sel = tl.where(em, sel, float("-inf"))
    kk = tl.arange(0, KP)
    ids = tl.zeros([KP], dtype=tl.int32)
    wts = tl.zeros([KP], dtype=tl.float32)
    if PACKED:
        key = score_key(sel, EP - 1 - e)
        for j in tl.static_range(TOP_K):
            km = tl.max(key, axis=0)
            idx = (EP - 1) - key_low(km)
            ids = tl.where(kk == j, idx, ids)
            key = tl.where(e == idx, PAD_KEY, key)
        wts = tl.sum(tl.where(e[None, :] == ids[:, None], p[None, :], 0.0), axis=1)
        wts = tl.where(kk < TOP_K, wts, 0.0)
    else:
        for j in tl.static_range(TOP_K):
            m = tl.max(sel, axis=0)
            idx = tl.min(tl.where(sel == m, e, EP), axis=0)   # lowest index among equal maxima
            wj = tl.sum(tl.where(e == idx, p, 0.0), axis=0)
            ids = tl.where(kk == j, idx, ids)
            wts = tl.where(kk == j, wj, wts)
            sel = tl.where(e == idx, float("-inf"), sel)
    if NORM:
        wts = wts / tl.maximum(tl.sum(wts, axis=0), 1.1754943508222875e-38)
    return ids, wts * scale


def router_config(tokens: int, n_experts: int, top_k: int, device=None) -> dict:
    """Launch choice (``num_warps``) of :func:`router` for ``tokens`` rows of ``n_experts``
    logits and ``top_k`` on ``device`` (a torch device or its name; None: the table of a CUDA
    device without a file of its own), from the ``router`` knob of the device's launch table."""
    return device_table(device).lookup("router", tokens=tokens, n_experts=n_experts, top_k=top_k)


def router(logits: torch.Tensor, top_k: int, *, gating: str = "softmax", norm_topk_prob: bool = False,
           expert_weights_scale: float = 1.0, selection_bias: torch.Tensor | None = None,
           config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Route tokens to experts on the device (one launch, no host sync).

    Args:
        logits: ``[T, n_experts]`` router logits (float; rows contiguous).
        top_k: experts per token, ``1 <= top_k <= n_experts``.
        gating: ``"softmax"`` | ``"sigmoid"``.
        norm_topk_prob: renormalize the selected weights to sum to 1.
        expert_weights_scale: constant factor on the weights.
        selection_bias: optional ``[n_experts]`` bias for the selection only.
        config: override of :func:`router_config` (``{"num_warps": 4}``).
    Returns:
        ``(weights [T, top_k] float32, ids [T, top_k] int32)``, in descending order of the
        selection score, ties toward the lower expert index (as ``route``).
    Raises:
        UnsupportedModelError: unknown gating function. ValueError: top_k out of range.
    """
    if gating not in GATING:
        raise UnsupportedModelError(f"unknown MoE gating function {gating!r}; supported: "
                                    f"{', '.join(GATING)}")
    t, e = logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k={top_k} must be in [1, {e}]")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    ids = torch.empty((t, top_k), dtype=torch.int32, device=logits.device)
    w = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    bias = selection_bias if selection_bias is not None else logits
    cfg = dict(router_config(t, e, top_k, logits.device), **(config or {}))
    _router_kernel[(t,)](
        logits, bias, ids, w, e, logits.stride(0), ids.stride(0), w.stride(0),
        float(expert_weights_scale),
        EP=next_pow2(e), TOP_K=top_k, KP=next_pow2(top_k),
        GATE=GATING[gating], HAS_BIAS=selection_bias is not None, NORM=bool(norm_topk_prob),
        num_warps=cfg["num_warps"], **pdl_args(logits.device))
    return w, ids


_COUNTERS: dict = {}


def _counters(n: int, device) -> torch.Tensor:
    """Zeroed int32 per-token counters of :func:`router_fused` (at least ``n``), one buffer
    per device (:func:`localmoe.kernels.scratch.grown`), left at zero by every launch."""
    key = str(device)
    c = _COUNTERS[key] = grown(_COUNTERS.get(key), (max(n, 64),), torch.int32, device, zero=True)
    return c


def _expert_major(w_router: torch.Tensor, d: int, top_k: int, gating: str, what: str
                  ) -> torch.Tensor:
    """The router weight ``[D, E]`` as its expert-major ``[E, D]`` view (copied when that
    view's rows are not contiguous), after checking ``gating``, the shape and ``top_k``."""
    if gating not in GATING:
        raise UnsupportedModelError(f"unknown MoE gating function {gating!r}; supported: "
                                    f"{', '.join(GATING)}")
    if w_router.dim() != 2 or w_router.shape[0] != d:
        raise ValueError(f"{what}: w_router must be [{d}, E], got {tuple(w_router.shape)}")
    wt = w_router.t()
    if wt.stride(1) != 1:
        wt = wt.contiguous()
    if not 1 <= top_k <= wt.shape[0]:
        raise ValueError(f"top_k={top_k} must be in [1, {wt.shape[0]}]")
    return wt


def router_fused(h: torch.Tensor, w_router: torch.Tensor, top_k: int, *, gating: str = "softmax",
                 norm_topk_prob: bool = False, expert_weights_scale: float = 1.0,
                 selection_bias: torch.Tensor | None = None, config: dict | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits and routing in one launch: ``logits = h @ w_router`` in float32 (the
    matmul and :func:`router` of the unfused path, two or three launches), then the gating and
    top-k of :func:`router` on them.

    Programs ``(token, expert block)`` each compute ``experts_per_program`` logits from
    contiguous rows of the expert-major weight; the last program of a token to finish (an
    acq_rel atomic counter, reset by that program) routes it.

    Args:
        h: ``[T, D]`` float router input (the FFN input after its norm), rows contiguous.
        w_router: ``[D, E]`` float32 router weight whose transpose ``[E, D]`` is contiguous
            (``ffn_gate_inp`` as stored in the file, seen transposed), or a contiguous
            ``[D, E]`` (copied to expert-major first: slower).
        top_k, gating, norm_topk_prob, expert_weights_scale, selection_bias: as :func:`router`.
        config: overrides of the ``router_fused`` knob of the device's launch table
            (:mod:`localmoe.kernels.launch_config`): ``num_warps``, ``experts_per_program``
            (logits per program, a power of two), ``packed_topk`` (the routing's picks as one
            packed-key reduction each; same result).
    Returns:
        ``(weights [T, top_k] float32, ids [T, top_k] int32)`` as :func:`router`.
    Raises:
        UnsupportedModelError: unknown gating. ValueError: shapes or top_k that do not fit.
    """
    t, d = h.shape
    wt = _expert_major(w_router, d, top_k, gating, "router_fused")
    e = wt.shape[0]
    if h.stride(1) != 1:
        h = h.contiguous()
    dev = h.device
    logits = torch.empty((t, e), dtype=torch.float32, device=dev)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=dev)
    w = torch.empty((t, top_k), dtype=torch.float32, device=dev)
    if t == 0:
        return w, ids
    cfg = dict(device_table(dev).lookup("router_fused", tokens=t, n_experts=e, top_k=top_k),
               **(config or {}))
    eb = min(int(cfg["experts_per_program"]), next_pow2(e))
    bias = selection_bias if selection_bias is not None else logits
    _router_logits_kernel[(t, cdiv(e, eb))](
        h, wt, logits, _counters(t, dev), bias, ids, w, d, e, h.stride(0),
        wt.stride(0), logits.stride(0), ids.stride(0), w.stride(0),
        float(expert_weights_scale), EB=eb, BD=max(64, min(1024, 2048 // eb)),
        EP=next_pow2(e), TOP_K=top_k, KP=next_pow2(top_k),
        GATE=GATING[gating], HAS_BIAS=selection_bias is not None, NORM=bool(norm_topk_prob),
        num_warps=int(cfg["num_warps"]), PREFETCH=pdl_prefetch(dev), LINE=128 // wt.element_size(),
        PACKED=bool(cfg["packed_topk"]), **pdl_args(dev))
    return w, ids


def router_ref(logits: torch.Tensor, top_k: int, *, gating: str = "softmax",
               norm_topk_prob: bool = False, expert_weights_scale: float = 1.0,
               selection_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of :func:`router`, in plain torch ops (no import of the model layer).

    Same semantics as the model's reference ``localmoe.model.routing.route`` (the tests check
    the two agree): probabilities over all experts in float32, the top-k by a stable descending
    sort (ties go to the lower expert index), a selection bias that steers only the choice,
    optional renormalization and a constant scale.

    Returns:
        ``(weights [T, top_k] float32, ids [T, top_k] int32)``.

    Raises:
        UnsupportedModelError: unknown gating function.
    """
    if gating not in GATING:
        raise UnsupportedModelError(f"unknown MoE gating function {gating!r}")
    x = logits.float()
    probs = torch.softmax(x, dim=-1) if gating == "softmax" else torch.sigmoid(x)
    score = probs if selection_bias is None else probs + selection_bias.float()
    ids = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :top_k]
    w = probs.gather(-1, ids)
    if norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return w * float(expert_weights_scale), ids.to(torch.int32)


# -----------------------------------------------------------------------------------------------
# residual add + RMSNorm + int8 quantization + router logits + routing, one launch
# -----------------------------------------------------------------------------------------------

@triton.jit
def _norm_router_kernel(x_ptr, dl_ptr, nw_ptr, r_ptr, hf_ptr, q_ptr, s_ptr,
                        wr_ptr, logits_ptr, cnt_ptr, bias_ptr, ids_ptr, w_ptr,
                        D, E, S, x_rs, dl_ss, dl_rs, r_rs, hf_rs, q_rs, s_rs, wr_rs,
                        l_rs, ids_rs, w_rs, eps, scale,
                        EB: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr,
                        EP: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr,
                        GATE: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                        HAS_DELTA: tl.constexpr, HAS_W: tl.constexpr, STORE_H: tl.constexpr,
                        PACKED: tl.constexpr, PDL: tl.constexpr, WIDE: tl.constexpr = False,
                        ROUTE: tl.constexpr = True):
    # program (t, j): the whole row of token t is summed and normalized by every program (its
    # expert block's logits need all of h); program j == 0 also stores the residual, the
    # int8 blocks of h and the optional float h. The router weights are constant: their loads
    # are issued before the wait for the previous kernel's outputs.
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    c = tl.arange(0, BLOCK)
    cm = c < D
    eb = j * EB + tl.arange(0, EB)
    ebm = eb < E
    wr = tl.load(wr_ptr + eb[:, None].to(tl.int64) * wr_rs + c[None, :],
                 mask=ebm[:, None] & cm[None, :], other=0.0)
    pdl_begin(PDL)
    acc = tl.load(x_ptr + t * x_rs + c, mask=cm, other=0.0).to(tl.float32)
    if HAS_DELTA:   # a [T, D] delta, or S float32 split-K slices summed in order first
        dp = dl_ptr + t * dl_rs + c
        d = tl.load(dp, mask=cm, other=0.0).to(tl.float32)
        for s in range(1, S):
            d += tl.load(dp + s * dl_ss, mask=cm, other=0.0).to(tl.float32)
        acc = acc + d
    res = acc.to(x_ptr.dtype.element_ty)
    v = res.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / D + eps)
    y = v * inv
    if HAS_W:
        y = y * tl.load(nw_ptr + c, mask=cm, other=0.0).to(tl.float32)
    h = y.to(x_ptr.dtype.element_ty).to(tl.float32)        # the activation dtype's rounding
    if j == 0:
        tl.store(r_ptr + t * r_rs + c, res, mask=cm)
        if STORE_H:
            tl.store(hf_ptr + t * hf_rs + c, h.to(hf_ptr.dtype.element_ty), mask=cm)
        blk = tl.arange(0, NB)
        pack_store_blocks(tl.reshape(h, (NB, 2, 4, 4)), blk[:, None, None, None],
                          (blk < D // 32)[:, None, None, None], q_ptr + t * q_rs,
                          s_ptr + t * s_rs, WIDE)
    logit = tl.sum(wr.to(tl.float32) * h[None, :], axis=1)
    if ROUTE:
        _store_logits_route_last(logit, eb, ebm, t, E, logits_ptr, l_rs, cnt_ptr, bias_ptr,
                                 ids_ptr, w_ptr, ids_rs, w_rs, scale, EP, TOP_K, KP, GATE,
                                 HAS_BIAS, NORM, PACKED)
    else:   # the logits only: the fused MoE's first launch routes (fused_moe.Routing)
        tl.store(logits_ptr + t * l_rs + eb, logit, mask=ebm)


def norm_router_fused(x: torch.Tensor, delta: torch.Tensor | None, norm_w: torch.Tensor | None,
                      eps: float, w_router: torch.Tensor, top_k: int, *,
                      residual_out: torch.Tensor, want_float: torch.dtype | None = None,
                      gating: str = "softmax", norm_topk_prob: bool = False,
                      expert_weights_scale: float = 1.0,
                      selection_bias: torch.Tensor | None = None, config: dict | None = None):
    """The MoE layer's input in one launch: residual add, RMSNorm and int8 quantization of
    :func:`localmoe.kernels.fused_norm.add_rms_norm_quant`, then the router logits and routing
    of :func:`router_fused` on the normed rows (one kernel instead of two).

    Programs ``(token, expert block)`` each sum and normalize the token's whole row (every
    logit needs all of ``h``; the row is read from L2 by each), compute ``experts_per_program``
    logits, and the last program of a token to finish routes it; program 0 of each token
    stores the residual, the int8 blocks of ``h`` and the optional float ``h``. The router
    weights are loaded before the wait for the previous kernel (programmatic dependent
    launch, :mod:`localmoe.kernels.pdl`).

    Args:
        x: the residual stream ``[T, D]`` (float16/bfloat16/float32, rows contiguous; ``D`` a
            multiple of 32, at most 8192). Not written.
        delta: ``[T, D]`` added to ``x`` first, or float32 split-K partials ``[S, T, D]``, or
            None.
        norm_w: the norm weight ``[D]`` or None; eps: its epsilon.
        w_router: ``[D, E]`` float32 router weight (as :func:`router_fused`).
        top_k, gating, norm_topk_prob, expert_weights_scale, selection_bias, config: as
            :func:`router_fused` (its ``router_fused`` launch knob).
        residual_out: ``[T, D]`` in ``x``'s dtype, rows contiguous, a buffer other than ``x``
            (the programs of a token all read ``x``): receives ``x + delta``.
        want_float: dtype of an extra float output of the normed rows, or None.
    Returns:
        ``(residual_out, hq, hf, weights, ids)``: ``hq`` the :class:`QuantAct` of the normed
        rows, ``hf`` the float rows or None, ``weights [T, top_k]`` float32 and ``ids
        [T, top_k]`` int32 as :func:`router`.
    Raises:
        UnsupportedModelError: unknown gating. ValueError: shapes, strides or devices that do
        not fit, ``residual_out`` sharing ``x``'s memory. TypeError: dtypes that do not fit.
    """
    r, hq, hf, logits, w, ids = _norm_router(
        x, delta, norm_w, eps, w_router, top_k, residual_out, want_float, gating,
        norm_topk_prob, expert_weights_scale, selection_bias, config, route=True)
    return r, hq, hf, w, ids


class Routing(NamedTuple):
    """Router logits whose routing is left to the fused MoE's first launch
    (:func:`localmoe.kernels.fused_moe.fused_moe` with ``route=``): every program of that
    launch computes its token's top-k from them (a bitonic top-k for softmax gating without
    a selection bias, else :func:`route_pick`; the same ids and weights), and one per token
    writes ``ids`` and ``weights`` for the second launch. Saves the router kernel's last
    step (an acq_rel counter, then the logits read back by the last program: two round
    trips to L2) on the decode step's critical path.

    Attributes:
        logits: float32 ``[T, E]``.
        top_k, gating, norm_topk_prob, expert_weights_scale, selection_bias: as :func:`router`.
        ids, weights: int32 / float32 ``[T, top_k]`` buffers the MoE launch fills.
    """

    logits: torch.Tensor
    top_k: int
    gating: str
    norm_topk_prob: bool
    expert_weights_scale: float
    selection_bias: torch.Tensor | None
    ids: torch.Tensor
    weights: torch.Tensor


def norm_router_logits(x: torch.Tensor, delta: torch.Tensor | None,
                       norm_w: torch.Tensor | None, eps: float, w_router: torch.Tensor,
                       top_k: int, *, residual_out: torch.Tensor,
                       want_float: torch.dtype | None = None, gating: str = "softmax",
                       norm_topk_prob: bool = False, expert_weights_scale: float = 1.0,
                       selection_bias: torch.Tensor | None = None, config: dict | None = None):
    """:func:`norm_router_fused` without the routing: the residual add, norm, quantization
    and router logits in one launch, returning ``(residual_out, hq, hf, routing)`` where
    ``routing`` is a :class:`Routing` for :func:`localmoe.kernels.fused_moe.fused_moe`
    (arguments and errors as :func:`norm_router_fused`)."""
    r, hq, hf, logits, w, ids = _norm_router(
        x, delta, norm_w, eps, w_router, top_k, residual_out, want_float, gating,
        norm_topk_prob, expert_weights_scale, selection_bias, config, route=False)
    return r, hq, hf, Routing(logits, top_k, gating, bool(norm_topk_prob),
                              float(expert_weights_scale), selection_bias, ids, w)


def _norm_router(x, delta, norm_w, eps, w_router, top_k, residual_out, want_float, gating,
                 norm_topk_prob, expert_weights_scale, selection_bias, config, route: bool):
    """The launch of :func:`norm_router_fused` (``route``) / :func:`norm_router_logits`:
    ``(residual_out, hq, hf, logits, weights, ids)``."""
    from localmoe.kernels.fused_norm import MAX_D, _delta_args
    from localmoe.kernels.quant_gemv import QuantAct, wide_default

    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("norm_router_fused: x must be [T, D] with contiguous rows")
    t, d = x.shape
    if d % 32 or not 1 <= d <= MAX_D:
        raise ValueError(f"norm_router_fused: D = {d} must be a multiple of 32 up to {MAX_D}")
    dl, dl_ss, dl_rs, s = (_delta_args(x, delta, 0) if delta is not None else (x, 0, 0, 1))
    if (not isinstance(residual_out, torch.Tensor) or tuple(residual_out.shape) != (t, d)
            or residual_out.dtype != x.dtype or residual_out.stride(1) != 1
            or residual_out.device != x.device):
        raise ValueError(f"norm_router_fused: residual_out must be [{t}, {d}] {x.dtype} with "
                         f"contiguous rows on {x.device}")
    if residual_out.data_ptr() == x.data_ptr() and t:
        raise ValueError("norm_router_fused: residual_out must not be x (every program reads x)")
    wt = _expert_major(w_router, d, top_k, gating, "norm_router_fused")
    e = wt.shape[0]
    if norm_w is not None:
        norm_w = norm_w.reshape(d)
    dev = x.device
    hq = QuantAct.empty(t, d, dev, wide_default(None, experts=True))   # the experts' input
    hf = torch.empty((t, d), dtype=want_float, device=dev) if want_float is not None else None
    logits = torch.empty((t, e), dtype=torch.float32, device=dev)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=dev)
    w = torch.empty((t, top_k), dtype=torch.float32, device=dev)
    if t == 0:
        return residual_out, hq, hf, logits, w, ids
    cfg = dict(device_table(dev).lookup("router_fused", tokens=t, n_experts=e, top_k=top_k),
               **(config or {}))
    eb = min(int(cfg["experts_per_program"]), next_pow2(e))
    block = next_pow2(d)
    bias = selection_bias if selection_bias is not None else logits
    h_out = hf if hf is not None else residual_out
    _norm_router_kernel[(t, cdiv(e, eb))](
        x, dl, norm_w if norm_w is not None else x, residual_out, h_out, hq.q, hq.s,
        wt, logits, _counters(t, dev), bias, ids, w,
        d, e, s, x.stride(0), dl_ss, dl_rs, residual_out.stride(0), h_out.stride(0),
        hq.q.stride(0), hq.s.stride(0), wt.stride(0), logits.stride(0),
        ids.stride(0), w.stride(0), float(eps), float(expert_weights_scale),
        EB=eb, BLOCK=block, NB=block // 32, EP=next_pow2(e), TOP_K=top_k, KP=next_pow2(top_k),
        GATE=GATING[gating], HAS_BIAS=selection_bias is not None, NORM=bool(norm_topk_prob),
        HAS_DELTA=delta is not None, HAS_W=norm_w is not None, STORE_H=hf is not None,
        PACKED=bool(cfg["packed_topk"]), WIDE=hq.wide, num_warps=int(cfg["num_warps"]),
        ROUTE=route, **pdl_args(dev))
    return residual_out, hq, hf, logits, w, ids
