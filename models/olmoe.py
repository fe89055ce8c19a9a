"""olmoe: q/k RMSNorm over the *whole* projection (``[n_heads*head_dim]``, before the head
split; HF ``OlmoeAttention``), routed experts without renormalization (llama.cpp
``build_olmoe``: ``norm_w=false``)."""

from localmoe.models.family import Family, register_family


@register_family("olmoe")
class OLMoE(Family):
    gguf_rope_style = "neox"
    gguf_norm_topk_prob = False
    qk_norm_full = True
