"""moefy: real small MoE models made from dense ones (MoEfication) for testing and measuring.

No published MoE weights are reachable offline, so this package turns the two real dense models
(SmolLM2-135M, Gemma-3-270M) into MoE models whose routers see real hidden states:

1. calibration: the dense model (the project's reference Transformer) runs over English text
   from the standard library (:mod:`.texts`); every layer's FFN input is recorded
   (:mod:`.collect`);
2. split: each FFN's hidden neurons are cut into ``n_experts`` equal experts by balanced
   clustering of their co-activation, or at random (:mod:`.partition`);
3. router and output fit: a linear router per layer trained on the calibration hidden states,
   gating as llama.cpp computes it (softmax, top-k, renormalized), and the down projections
   refitted by least squares for the sparse mixture (:mod:`.router`, :mod:`.plan`);
4. a GGUF in llama.cpp's layout (:mod:`.gguf_out`): SmolLM2 -> Mixtral-style ``llama``
   (:mod:`.arch_llama`), Gemma-3 -> ``gemma4``, the only llama.cpp MoE block with Gemma's
   sandwich norms and GeGLU (:mod:`.arch_gemma4`); gate/up rows copied block for block from the
   source, down projections re-quantized to the source's type (or llama.cpp's fallback).

Everything is deterministic given ``MoefyConfig.seed``. These are *not* published MoE models:
their quality is what moefication without retraining gives (docs/MOEFY.md).

API::

    from localmoe.testing.moefy import moefy, MoefyConfig, build_preset
    moefy("smollm2", "/tmp/smollm2-moe.gguf", MoefyConfig(n_experts=16, top_k=4))
    build_preset("smollm2-moe-16x4")   # cached under <store>/moefy/

CLI: ``python -m localmoe.testing.moefy --help``.
"""

from localmoe.testing.moefy.build import build_preset, moefy, preset_path, resolve_source
from localmoe.testing.moefy.config import PRESETS, MoefyConfig, check_request

__all__ = ["moefy", "MoefyConfig", "PRESETS", "check_request", "build_preset", "preset_path",
           "resolve_source"]
