"""llama (SmolLM2, Llama 2/3) and Mixtral-style llama with experts.

GGUF llama Q/K rows are permuted for interleaved ("norm") RoPE (llama.cpp convert_hf_to_gguf
``LlamaModel.permute``); Mixtral (llama + ``ffn_*_exps``) renormalizes its top-k softmax
(llama.cpp ``build_moe_ffn(..., norm_w=true)``; HF ``MixtralSparseMoeBlock``).
"""

from localmoe.models.family import Family, register_family


@register_family("llama")
class Llama(Family):
    gguf_rope_style = "norm"
    gguf_norm_topk_prob = True
