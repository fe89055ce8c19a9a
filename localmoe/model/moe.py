"""The MoE layer: router + routed experts, the reference implementation of the MoE hook.

The shared transformer calls its MoE layers through a hook (``Transformer.moe``, an
:data:`MoEFn`); :class:`ReferenceMoE` is the default. It routes (localmoe.model.routing), tells
the :class:`~localmoe.model.experts.ExpertProvider` which experts the batch uses, then runs each
used expert once on the tokens routed to it (:func:`moe_ffn`: argsort by expert id, gather,
``index_add_`` back). On the host this loop reads the used expert ids (``.tolist()``), a host
sync per layer that a fused GPU hook avoids. Shared experts (Qwen2-MoE) are dense FFNs of the
block, outside this layer.

Sources: Shazeer et al. 2017 (sparsely-gated MoE); llama.cpp ``build_moe_ffn``; HF Mixtral /
Qwen-MoE / OLMoE sparse MoE blocks.
"""

from __future__ import annotations

from typing import Callable

import torch

from localmoe.model.experts import ExpertProvider
from localmoe.model.routing import route

#: MoE hook: ``moe(layer, x [N, d_model]) -> [N, d_model]``, the routed mixture of ``layer`` on
#: the FFN input (after the FFN norm)
MoEFn = Callable[[int, torch.Tensor], torch.Tensor]


def moe_ffn(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, provider: ExpertProvider,
            layer: int, act: Callable[[torch.Tensor], torch.Tensor],
            quant_h: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Routed expert mixture, tokens grouped by expert (no Python loop over tokens).

    The ``N * top_k`` (token, expert) assignments are sorted by expert id (stable argsort); each
    used expert then runs once on its gathered tokens and the weighted outputs are scattered
    back with ``index_add_``.

    Args:
        x: ``[N, d_model]`` FFN input (after the FFN norm).
        weights: ``[N, top_k]`` float mixing weights (localmoe.model.routing.route).
        ids: ``[N, top_k]`` int64 expert ids.
        provider: where expert weights come from (``prepare`` is called with the used ids).
        layer: block index.
        act: gate activation.
        quant_h: optional rounding of the hidden activations before ``down`` (ggml numerics).

    Returns:
        ``[N, d_model]`` dtype of ``x``.
    """
    N, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // k
    w_sorted = weights.reshape(-1)[order].to(x.dtype)
    counts = torch.bincount(flat, minlength=provider.n_experts)
    used = torch.nonzero(counts).flatten()
    provider.prepare(layer, used)
    ends = torch.cumsum(counts, 0)
    out = torch.zeros_like(x)
    used_l = used.tolist()
    ends_l = ends[used].tolist()
    cnt_l = counts[used].tolist()
    for e, end, c in zip(used_l, ends_l, cnt_l):
        start = end - c
        t = tok[start:end]
        xs = x.index_select(0, t)
        g, u, d = provider.expert(layer, e)
        h = act(xs @ g.t()) * (xs @ u.t())
        if quant_h is not None:
            h = quant_h(h)
        y = (h @ d.t()) * w_sorted[start:end, None]
        out.index_add_(0, t, y)
    return out



class ReferenceMoE:
    """The reference MoE hook of a :class:`~localmoe.model.transformer.Transformer`: router
    logits ``x @ router`` (float, unrounded), :func:`localmoe.model.routing.route` with the
    spec's gating, then :func:`moe_ffn` over the model's expert provider, with the input and
    hidden roundings of the model's op set (``ops.moe_input`` / ``ops.moe_hidden``).

    Args:
        model: the transformer (reads ``spec``, ``layers[layer]["router"]`` ``[d_model,
            n_experts]`` and the optional ``"exp_bias"``, ``experts``, ``ops`` at each call).
    """

    def __init__(self, model):
        self.model = model

    def __call__(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Routed mixture of ``layer`` on ``x [N, d_model]``; returns ``[N, d_model]``.

        Raises:
            UnsupportedModelError: unknown gating function; ValueError: bad ``top_k``.
        """
        m = self.model
        s, L, ops = m.spec, m.layers[layer], m.ops
        logits = x @ L["router"]
        w, ids = route(logits, s.top_k, gating=s.gating, norm_topk_prob=s.norm_topk_prob,
                       expert_weights_scale=s.expert_weights_scale,
                       selection_bias=L.get("exp_bias"))
        return moe_ffn(ops.moe_input(layer, x), w, ids, m.experts, layer, ops.act,
                       quant_h=ops.moe_hidden(layer))
