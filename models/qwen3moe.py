"""qwen3moe: qwen3 attention (per-head q/k RMSNorm) + routed experts with renormalized top-k
softmax (llama.cpp ``build_qwen3moe``: ``norm_w=true``; HF ``norm_topk_prob=True``)."""

from localmoe.models.family import Family, register_family


@register_family("qwen3moe")
class Qwen3MoE(Family):
    gguf_rope_style = "neox"
    gguf_norm_topk_prob = True
