"""The triton backend's MoE hook: router and routed experts in Triton kernels, no host sync.

Replaces the shared transformer's reference hook (:class:`localmoe.model.moe.ReferenceMoE`,
which reads the used expert ids on the host) for models loaded by
:func:`localmoe.backends.triton.quant_model.load_quant_model`:

1. router logits ``x @ router`` in float32 (``[N, E]``);
2. :func:`localmoe.kernels.router.router`: gating (softmax or sigmoid), top-k, optional
   selection bias, ``norm_topk_prob`` and scale, one launch; ids and weights stay on the device
   (1-8 tokens: steps 1 and 2 in one launch, :func:`localmoe.kernels.router.router_fused`);
3. the routed experts: :func:`localmoe.kernels.fused_moe.fused_moe` (two launches) for 1-8
   tokens (decode), :func:`localmoe.kernels.quant_gemm.moe_prefill` (align + two grouped GEMM
   launches) for more. Expert ids go through ``QuantExperts.slot_of[layer]``.

Shared experts (Qwen2-MoE) stay dense FFNs of the block (their weights are QuantLinears).
"""

from __future__ import annotations

import torch

from localmoe.backends.triton.quant_model import GEMV_MAX_TOKENS

_ACT = {"silu": "silu", "gelu_tanh": "gelu", "gelu_pytorch_tanh": "gelu"}


class TritonMoE:
    """MoE hook ``moe(layer, x [N, d_model]) -> [N, d_model]`` over :class:`QuantExperts`.

    Args:
        model: the Transformer (reads ``spec``, ``layers[layer]["router"]`` ``[d_model, E]``
            float32 and the optional ``"exp_bias"``, and ``experts``, a QuantExperts).

    Raises:
        UnsupportedModelError: an activation the fused kernels do not implement (at
            construction).
    """

    def __init__(self, model):
        from localmoe.errors import UnsupportedModelError

        self.model = model
        act = model.spec.act
        if act not in _ACT:
            raise UnsupportedModelError(f"the fused MoE kernels implement SiLU and tanh-GELU "
                                        f"gates, not {act!r} (use --backend torch)")
        self.activation = _ACT[act]
        self.calls = 0
        # routers expert-major ([E, D] contiguous, kept as its [D, E] view): the fused decode
        # router reads each expert's weights as one contiguous row
        for L in model.layers:
            if "router" in L and L["router"].stride(0) != 1:
                L["router"] = L["router"].t().contiguous().t()

    def route(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [N, top_k] float32, ids [N, top_k] int32)`` of ``x [N, d_model]``."""
        from localmoe.kernels.router import router, router_fused

        s, L = self.model.spec, self.model.layers[layer]
        kw = self.route_kwargs(layer)
        if x.shape[0] <= GEMV_MAX_TOKENS:    # decode: logits and routing in one launch
            return router_fused(x, L["router"], s.top_k, **kw)
        return router(x.float() @ L["router"], s.top_k, **kw)

    def route_kwargs(self, layer: int) -> dict:
        """The routing options of ``layer`` for the router kernels (gating, norm_topk_prob,
        expert_weights_scale, selection_bias)."""
        s, bias = self.model.spec, self.model.layers[layer].get("exp_bias")
        return dict(gating=s.gating, norm_topk_prob=s.norm_topk_prob,
                    expert_weights_scale=s.expert_weights_scale,
                    selection_bias=None if bias is None else bias.float())

    def __call__(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        from localmoe.kernels.fused_moe import fused_moe
        from localmoe.kernels.quant_gemm import moe_prefill

        ex = self.model.experts
        w, ids = self.route(layer, x)
        x = x.contiguous()
        gu, dn, slot = ex.gate_up[layer], ex.down[layer], ex.slot_of[layer]
        self.calls += 1
        if x.shape[0] <= GEMV_MAX_TOKENS:
            return fused_moe(x, gu, dn, ids, w, slot_of=ex.slots(layer), activation=self.activation)
        return moe_prefill(x, gu, dn, ids, w, slot_of=slot, activation=self.activation)
