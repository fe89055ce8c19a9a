"""The moefied model in memory, as the project's reference :class:`Transformer`.

:func:`moe_transformer` loads the dense source (float32, exact numerics) and turns every FFN
into the plan's MoE: router ``layers[l]["router"]`` (``[d_model, E]``), experts from a
:class:`~localmoe.model.experts.ResidentExpertProvider` holding the *stored* (dequantized)
expert tensors, spec fields ``n_experts, top_k, d_ff_expert, gating="softmax",
norm_topk_prob=True``. Routing and expert compute are the reference MoE hook
(:class:`~localmoe.model.moe.ReferenceMoE`). A plan with a shared expert (qwen2moe) adds the
Transformer's shared-expert weights (``sh_gate_up``, ``sh_down``, ``sh_gate``: the stored,
dequantized tensors) and routes without renormalizing the top-k weights.

For the ``gemma4`` target the hook's output is RMS-normalized (no weight) before the block's
post-FFN norm, as llama.cpp's gemma4 MoE block does (``post_ffw_norm_2`` = ones, then
``post_ffw_norm``): the double normalization drops the post-FFN norm's ``eps`` (see
docs/MOEFY.md), so the reference computes what the written file computes.
"""

from __future__ import annotations

import dataclasses

import torch

from localmoe.testing.moefy.config import TARGET_ARCH

__all__ = ["moe_transformer", "moe_runner", "PostNormedMoE", "set_top_k"]


class PostNormedMoE:
    """MoE hook wrapper: ``rmsnorm(inner(layer, x))`` without a weight (gemma4's MoE branch)."""

    def __init__(self, inner, model):
        self.inner = inner
        self.model = model

    def __call__(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self.model.ops.norm(self.inner(layer, x), None, self.model.spec.norm_eps)


def set_top_k(model, top_k: int) -> None:
    """Route ``model`` (a moefied Transformer) with ``top_k`` experts per token from now on."""
    if not 1 <= top_k <= model.spec.n_experts:
        raise ValueError(f"top_k={top_k} must be in [1, {model.spec.n_experts}]")
    model.spec = dataclasses.replace(model.spec, top_k=int(top_k))


def moe_transformer(model_file, plan, stored: dict, *, dense=None):
    """The moefied model of ``plan`` in memory.

    Args:
        model_file: the dense source the plan was built from.
        plan: :class:`.plan.MoePlan`.
        stored: ``{layer: .experts.StoredExperts}`` (what the file holds).
        dense: an already loaded dense Transformer of ``model_file`` to convert in place
            (default: load one).

    Returns:
        the Transformer (``spec.top_k = plan.cfg.top_k``; change it with :func:`set_top_k`).
    """
    from localmoe.model.experts import ExpertWeights, ResidentExpertProvider
    from localmoe.model.moe import ReferenceMoE
    from localmoe.testing.moefy.collect import load_dense

    model = dense if dense is not None else load_dense(model_file)[0]
    E, Fe = plan.layers[0].groups.shape
    weights = {}
    fs = 0
    for l, lp in enumerate(plan.layers):
        L = model.layers[l]
        gate_up, down = L.pop("gate_up", None), L.pop("down", None)
        L["router"] = lp.router.t().contiguous().to(model.dtype)
        weights[l] = ExpertWeights(*(t.to(model.dtype) for t in stored[l].floats()))
        if stored[l].shared is not None:
            # the shared expert in the dense layer's float layout (gate_up [D, 2 F_s], down [F_s, D])
            g, u, d = (t.to(model.dtype) for t in stored[l].shared_floats())
            fs = g.shape[0]
            L["sh_gate_up"] = torch.cat([g, u], 0).t().contiguous()
            L["sh_down"] = d.t().contiguous()
            L["sh_gate"] = lp.sh_gate.to(model.dtype)
            assert gate_up is None or gate_up.shape[0] == g.shape[1], "unexpected dense layout"
    model.experts = ResidentExpertProvider(weights)
    model.spec = dataclasses.replace(model.spec, n_experts=E, top_k=plan.cfg.top_k,
                                     d_ff_expert=Fe, gating="softmax",
                                     norm_topk_prob=plan.cfg.norm_topk,
                                     expert_weights_scale=1.0, n_shared_experts=int(fs > 0),
                                     d_ff_shared=fs, shared_expert_gate=fs > 0)
    model.moe = ReferenceMoE(model)
    if TARGET_ARCH[plan.source_arch] == "gemma4":
        model.moe = PostNormedMoE(model.moe, model)
    return model


def moe_runner(model_file, plan, stored: dict, *, n_ctx: int = 2048, n_threads: int | None = None):
    """A torch-backend runner (paged KV cache) whose model is the plan's MoE: the dense source
    loaded with float weights, then converted in place (:func:`moe_transformer`). Works for the
    gemma4 target too, which the project's loader does not read (docs/MOEFY.md)."""
    from localmoe.backends.torch_backend import TorchRunner

    runner = TorchRunner(model_file, n_ctx=n_ctx, n_threads=n_threads, packed_weights=False)
    moe_transformer(model_file, plan, stored, dense=runner.model)
    return runner
