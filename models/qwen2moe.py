"""qwen2moe: qwen2 attention (q/k/v bias) + routed experts *without* top-k renormalization
(llama.cpp ``build_qwen2moe``: ``norm_w=false``) + a shared expert scaled by
``sigmoid(x . ffn_gate_inp_shexp)`` (HF ``Qwen2MoeSparseMoeBlock``)."""

from localmoe.models.family import Family, register_family


@register_family("qwen2moe")
class Qwen2MoE(Family):
    gguf_rope_style = "neox"
    gguf_norm_topk_prob = False
