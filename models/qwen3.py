"""qwen3: per-head q/k RMSNorm before RoPE (detected from ``attn_q_norm``), NEOX RoPE."""

from localmoe.models.family import Family, register_family


@register_family("qwen3")
class Qwen3(Family):
    gguf_rope_style = "neox"
