"""qwen2: llama block with q/k/v biases (detected from ``attn_q.bias``) and NEOX RoPE."""

from localmoe.models.family import Family, register_family


@register_family("qwen2")
class Qwen2(Family):
    gguf_rope_style = "neox"
