"""MoE routing: router logits -> (top-k expert ids, mixing weights).

Conventions follow llama.cpp's ``build_moe_ffn`` (src/llama-graph.cpp) and the HF reference
implementations (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE):

1. probabilities over *all* experts: ``softmax(logits)`` (Shazeer et al. 2017, "Outrageously
   Large Neural Networks"; Mixtral, Qwen-MoE, OLMoE) or ``sigmoid(logits)`` (DeepSeek-V3 style);
2. select the ``top_k`` largest probabilities; equal probabilities are broken toward the
   **lower expert index** (a stable descending sort), so the choice is deterministic;
3. optionally renormalize the selected weights to sum to 1 (``norm_topk_prob``; Qwen3-MoE and
   Mixtral do, Qwen2-MoE and OLMoE do not). For softmax gating this equals a softmax over the
   selected logits (Mixtral's formulation);
4. multiply by ``expert_weights_scale`` (GGUF ``{arch}.expert_weights_scale``, 1.0 by default).

Shared experts (Qwen2-MoE) are added outside the routed mixture, scaled by
``sigmoid(x . w_gate_shexp)`` (:func:`shared_expert_gate`).
"""

from __future__ import annotations

import torch

from localmoe.errors import UnsupportedModelError

GATING_FUNCS = ("softmax", "sigmoid")


def gate_probs(logits: torch.Tensor, gating: str = "softmax") -> torch.Tensor:
    """Router probabilities over all experts.

    Args:
        logits: ``[N, n_experts]`` router logits (any float dtype); computed in float32.
        gating: ``"softmax"`` or ``"sigmoid"``.

    Returns:
        ``[N, n_experts]`` float32 probabilities.

    Raises:
        UnsupportedModelError: unknown gating function.
    """
    x = logits.float()
    if gating == "softmax":
        return torch.softmax(x, dim=-1)
    if gating == "sigmoid":
        return torch.sigmoid(x)
    raise UnsupportedModelError(
        f"unknown MoE gating function {gating!r}; supported: {', '.join(GATING_FUNCS)}")


def select_topk(probs: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k selection with ties broken toward the lower expert index.

    Args:
        probs: ``[N, n_experts]`` float scores.
        top_k: number of experts per token, ``1 <= top_k <= n_experts``.

    Returns:
        ``(values [N, top_k] same dtype, ids [N, top_k] int64)`` in descending order of value;
        among equal values the lower index comes first.

    Raises:
        ValueError: ``top_k`` out of range.
    """
    n_exp = probs.shape[-1]
    if not 1 <= top_k <= n_exp:
        raise ValueError(f"top_k={top_k} must be in [1, {n_exp}]")
    # A stable descending sort keeps equal elements in index order -> lower index wins ties.
    vals, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    return vals[..., :top_k], ids[..., :top_k]


def route(logits: torch.Tensor, top_k: int, *, gating: str = "softmax",
          norm_topk_prob: bool = False, expert_weights_scale: float = 1.0,
          selection_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Route tokens to experts.

    Args:
        logits: ``[N, n_experts]`` router logits (``x @ ffn_gate_inp.T``).
        top_k: experts per token.
        gating: ``"softmax"`` | ``"sigmoid"`` (applied over all experts before selection).
        norm_topk_prob: renormalize the selected weights to sum to 1.
        expert_weights_scale: constant factor on the final weights.
        selection_bias: optional ``[n_experts]`` bias added to the probabilities for the
            *selection only* (DeepSeek-V3 ``exp_probs_b``); the weights stay unbiased.

    Returns:
        ``(weights [N, top_k] float32, ids [N, top_k] int64)``.

    Raises:
        UnsupportedModelError: unknown gating function.
        ValueError: ``top_k`` out of range.
    """
    probs = gate_probs(logits, gating)
    if selection_bias is not None:
        _, ids = select_topk(probs + selection_bias.float(), top_k)
        weights = probs.gather(-1, ids)
    else:
        weights, ids = select_topk(probs, top_k)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    if expert_weights_scale != 1.0:
        weights = weights * float(expert_weights_scale)
    return weights, ids


def shared_expert_gate(x: torch.Tensor, gate_w: torch.Tensor) -> torch.Tensor:
    """Qwen2-MoE shared-expert gate ``sigmoid(x . w)``.

    Args:
        x: ``[N, d_model]`` hidden states (the FFN input after its norm).
        gate_w: ``[d_model]`` or ``[1, d_model]`` (GGUF ``ffn_gate_inp_shexp.weight``).

    Returns:
        ``[N, 1]`` gate values in (0, 1), dtype of ``x``.
    """
    w = gate_w.reshape(-1, 1).to(x.dtype)
    return torch.sigmoid(x @ w)
