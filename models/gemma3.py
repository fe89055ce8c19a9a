"""gemma3 (Gemma 3 text): GeGLU FFN (tanh GELU), embeddings scaled by sqrt(d_model), per-head
q/k RMSNorm, post-attention and post-FFN norms, interleaved sliding-window layers (every 6th
layer global) whose RoPE base is 10 000 while global layers use ``rope.freq_base`` (1e6).

Source: llama.cpp ``build_gemma3`` / ``LLM_ARCH_GEMMA3`` hparams (``set_swa_pattern(6)``,
``rope_freq_base_train_swa = 10000``) and HF ``Gemma3TextModel``. GGUF norm weights already
include Gemma's ``1 + w`` (HF files do not: the HF loader sets ``norm_weight_offset = 1``).
The attention scale stays ``1/sqrt(head_dim)`` (query_pre_attn_scalar = head_dim for the
sizes llama.cpp treats this way; the loader sets ``attn_scale`` otherwise).
"""

import dataclasses
import math

from localmoe.models.family import Family, register_family


@register_family("gemma3")
class Gemma3(Family):
    gguf_rope_style = "neox"
    act = "gelu_tanh"
    # Gemma's residual stream and FFN activations pass float16's 65504 (measured: Gemma-3-270M
    # gives NaN logits from the first token in float16, in the torch and triton runners alike);
    # the reference implementations run it in bfloat16 or float32
    gpu_dtype = "bfloat16"

    def configure(self, spec, model_format, tensor_names):
        spec = super().configure(spec, model_format, tensor_names)
        upd = {"post_norms": True}
        if not spec.embed_scale:
            upd["embed_scale"] = math.sqrt(spec.d_model)
        if spec.sliding_window and not spec.sliding_window_pattern:
            upd["sliding_window_pattern"] = 6
        if spec.rope_base_local is None:
            upd["rope_base_local"] = 10000.0
        return dataclasses.replace(spec, **upd)
