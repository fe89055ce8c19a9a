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

import torch
import triton
import triton.language as tl

from localmoe.errors import UnsupportedModelError
from localmoe.kernels.launch_config import device_table

__all__ = ["router", "router_ref", "router_config"]

GATING = {"softmax": 0, "sigmoid": 1}


@triton.jit
def _router_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, E, l_rs, ids_rs, w_rs, scale,
                   EP: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr, GATE: tl.constexpr,
                   HAS_BIAS: tl.constexpr, NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, EP)
    em = e < E
    x = tl.load(logits_ptr + t * l_rs + e, mask=em, other=float("-inf")).to(tl.float32)
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
    for j in tl.static_range(TOP_K):
        m = tl.max(sel, axis=0)
        idx = tl.min(tl.where(sel == m, e, EP), axis=0)       # lowest index among equal maxima
        wj = tl.sum(tl.where(e == idx, p, 0.0), axis=0)
        ids = tl.where(kk == j, idx, ids)
        wts = tl.where(kk == j, wj, wts)
        sel = tl.where(e == idx, float("-inf"), sel)
    if NORM:
        wts = wts / tl.maximum(tl.sum(wts, axis=0), 1.1754943508222875e-38)
    wts = wts * scale
    km = kk < TOP_K
    tl.store(ids_ptr + t * ids_rs + kk, ids, mask=km)
    tl.store(w_ptr + t * w_rs + kk, wts, mask=km)


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
        EP=triton.next_power_of_2(e), TOP_K=top_k, KP=triton.next_power_of_2(top_k),
        GATE=GATING[gating], HAS_BIAS=selection_bias is not None, NORM=bool(norm_topk_prob),
        num_warps=cfg["num_warps"])
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
