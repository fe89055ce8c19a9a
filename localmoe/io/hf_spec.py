"""ModelSpec from an HF ``config.json``: :func:`spec_from_hf_config`, :data:`HF_ARCHS`.

HF stores Q/K projections unpermuted (half-split rotary, ``rotate_half`` in transformers), so
every HF model gets ``spec.rope_style = "neox"``, including llama/mixtral whose GGUF files use
the interleaved ("norm") layout after llama.cpp's converter permutes Q/K.
"""

from __future__ import annotations

import math
from typing import Any

from localmoe.errors import ModelLoadError, UnsupportedModelError
from localmoe.io.spec import ModelSpec

__all__ = ["HF_ARCHS", "check_model_type", "spec_from_hf_config"]

#: transformers model_type -> GGUF architecture name
HF_ARCHS = {
    "llama": "llama",
    "mistral": "llama",
    "mixtral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "olmoe": "olmoe",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
}


def _cfg_get(cfg: dict, *keys, default=None):
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    return default


def _rope(cfg: dict) -> tuple[float, dict]:
    rp = cfg.get("rope_parameters") or {}
    if isinstance(rp, dict) and "full_attention" in rp and isinstance(rp["full_attention"], dict):
        rp = rp["full_attention"]  # gemma3 in transformers 5: per layer type
    base = _cfg_get(cfg, "rope_theta", default=None)
    if base is None:
        base = rp.get("rope_theta", 10000.0) if isinstance(rp, dict) else 10000.0
    scaling = cfg.get("rope_scaling") or {}
    if not scaling and isinstance(rp, dict) and rp.get("rope_type", "default") != "default":
        scaling = rp
    rs: dict[str, Any] = {}
    if scaling:
        t = scaling.get("rope_type", scaling.get("type"))
        if t and t != "default":
            rs["type"] = t
            for k, v in scaling.items():
                if k not in ("rope_type", "type", "rope_theta"):
                    rs[k] = v
            if "original_max_position_embeddings" in rs:
                rs["original_context_length"] = rs.pop("original_max_position_embeddings")
    return float(base), rs


def check_model_type(cfg: dict, where: str = "config.json") -> None:
    """Refuse a ``config.json`` whose ``model_type`` localmoe does not run, naming the ones it
    does (checked before the tensors: their unknown names are a consequence, not the cause).
    ``where``: how the message names the file (its path when known).

    Raises:
        UnsupportedModelError: model_type not in :data:`HF_ARCHS`.
    """
    mt = cfg.get("model_type")
    if mt == "gemma3" and isinstance(cfg.get("text_config"), dict):
        mt = "gemma3_text"
    if mt is None:
        raise UnsupportedModelError(
            f"{where} has no model_type (the architecture of an HF transformers model); "
            f"localmoe runs: {', '.join(sorted(HF_ARCHS))}")
    if mt not in HF_ARCHS:
        raise UnsupportedModelError(
            f"{where}: model_type {mt!r} is not supported; localmoe runs: {', '.join(sorted(HF_ARCHS))}"
        )


def spec_from_hf_config(cfg: dict, tensor_names: set[str] | None = None) -> ModelSpec:
    """ModelSpec from an HF ``config.json`` dict (+ canonical tensor names when known).

    Raises:
        UnsupportedModelError: model_type not in :data:`HF_ARCHS` or a layout ModelSpec cannot
            express (e.g. MoE layers interleaved with dense ones other than leading ones).
        ModelLoadError: a required field is missing or inconsistent.
    """
    if cfg.get("model_type") == "gemma3" and isinstance(cfg.get("text_config"), dict):
        cfg = dict(cfg["text_config"], model_type="gemma3_text")
    check_model_type(cfg)
    arch = HF_ARCHS[cfg["model_type"]]
    names = tensor_names or set()
    spec = _base_spec(cfg, arch, names)
    if arch in ("qwen2", "qwen2moe"):
        spec.attn_bias = ("blk.0.attn_q.bias" in names) if names else bool(cfg.get("qkv_bias", True))
    elif names:
        spec.attn_bias = "blk.0.attn_q.bias" in names
    if arch in ("qwen3", "qwen3moe", "olmoe", "gemma3"):
        spec.qk_norm = True if not names else "blk.0.attn_q_norm.weight" in names
    if arch == "olmoe":
        spec.qk_norm_full = True
    if arch == "gemma3":
        _gemma3(spec, cfg)
    n_exp = int(_cfg_get(cfg, "num_experts", "num_local_experts", "n_routed_experts", default=0) or 0)
    if n_exp and arch in ("llama", "qwen2moe", "qwen3moe", "olmoe"):
        _moe(spec, cfg, n_exp, names)
    return spec


def _pos_int(cfg: dict, k: str) -> int:
    v = cfg.get(k)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ModelLoadError(f"config.json field {k!r} = {v!r} is missing or not a positive integer")
    return v


def _base_spec(cfg: dict, arch: str, names: set[str]) -> ModelSpec:
    """Sizes, norm, rope and tied embeddings (what every architecture has)."""
    n_layers = _pos_int(cfg, "num_hidden_layers")
    d_model = _pos_int(cfg, "hidden_size")
    n_heads = _pos_int(cfg, "num_attention_heads")
    n_kv = _cfg_get(cfg, "num_key_value_heads", default=n_heads)
    head_dim = _cfg_get(cfg, "head_dim", default=d_model // n_heads)
    if n_heads % n_kv:
        raise ModelLoadError(f"config.json num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}")
    rope_base, rope_scaling = _rope(cfg)
    spec = ModelSpec(
        arch=arch, n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=int(n_kv),
        head_dim=int(head_dim), vocab_size=_pos_int(cfg, "vocab_size"),
        d_ff=int(_cfg_get(cfg, "intermediate_size", default=0)),
        n_ctx_train=int(_cfg_get(cfg, "max_position_embeddings", default=2048)),
        norm_eps=float(_cfg_get(cfg, "rms_norm_eps", "layer_norm_eps", default=1e-6)),
        rope_base=rope_base, rope_style="neox", rope_scaling=rope_scaling,
        # as in GGUF: tied means "no output.weight tensor" (a checkpoint may store a copy of a tied head)
        tie_embeddings=("output.weight" not in names) if names else bool(cfg.get("tie_word_embeddings", False)),
        name=str(cfg.get("_name_or_path", "")),
    )
    for what, v, zero_ok in (("rms_norm_eps", spec.norm_eps, True), ("rope_theta", spec.rope_base, False)):
        if not math.isfinite(v) or v < 0 or (v == 0 and not zero_ok):
            raise ModelLoadError(f"config.json {what} = {v!r} is not a {'non-negative' if zero_ok else 'positive'} "
                                 f"finite number; the config is corrupt")
    rd = cfg.get("partial_rotary_factor")
    if rd:
        spec.rope_dim = int(head_dim * float(rd))
    return spec


def _gemma3(spec: ModelSpec, cfg: dict) -> None:
    """Gemma-3: GELU, four norms per block with ``1 + w`` weights, embedding scale, sliding
    window (pattern from ``layer_types``), local rope base, query scale, soft-capping."""
    spec.act = "gelu_tanh"
    spec.post_norms = True
    spec.norm_weight_offset = 1.0   # HF Gemma RMSNorm computes x * (1 + w)
    spec.embed_scale = math.sqrt(spec.d_model)
    spec.sliding_window = cfg.get("sliding_window")
    lt = cfg.get("layer_types")
    if isinstance(lt, list) and "full_attention" in lt:
        spec.sliding_window_pattern = lt.index("full_attention") + 1
    else:
        spec.sliding_window_pattern = int(cfg.get("sliding_window_pattern", 6))
    rp = cfg.get("rope_parameters") or {}
    local = rp.get("sliding_attention", {}).get("rope_theta") if isinstance(rp, dict) else None
    spec.rope_base_local = float(_cfg_get(cfg, "rope_local_base_freq", default=local or 10000.0))
    qs = cfg.get("query_pre_attn_scalar")
    if qs:
        spec.attn_scale = float(qs) ** -0.5
    for k, f in (("attn_logit_softcapping", "attn_logit_softcap"), ("final_logit_softcapping", "final_logit_softcap")):
        if cfg.get(k):
            setattr(spec, f, float(cfg[k]))


def _moe(spec: ModelSpec, cfg: dict, n_exp: int, names: set[str]) -> None:
    """Experts, top-k, their FFN size, top-k normalization, leading dense layers, shared expert."""
    top_k = int(_cfg_get(cfg, "num_experts_per_tok", default=0))
    if not 0 < top_k <= n_exp:
        raise ModelLoadError(f"config.json num_experts_per_tok = {top_k} must be in 1..{n_exp} (the expert count)")
    spec.n_experts, spec.top_k = n_exp, top_k
    spec.d_ff_expert = int(_cfg_get(cfg, "moe_intermediate_size", default=spec.d_ff))
    if cfg.get("model_type") == "mixtral":
        spec.norm_topk_prob = True   # softmax over the selected logits == renormalized top-k
        spec.d_ff = 0
    else:
        spec.norm_topk_prob = bool(cfg.get("norm_topk_prob", False))
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense = sorted(cfg.get("mlp_only_layers") or [])
    if step != 1:
        raise UnsupportedModelError(f"config.json decoder_sparse_step = {step}: interleaved dense/MoE layers are not supported")
    if dense and dense != list(range(len(dense))):
        raise UnsupportedModelError(f"config.json mlp_only_layers = {dense}: only leading dense layers are supported")
    spec.leading_dense_layers = len(dense)
    sh = int(_cfg_get(cfg, "shared_expert_intermediate_size", default=0) or 0)
    if sh:
        spec.n_shared_experts = 1
        spec.d_ff_shared = sh
        spec.shared_expert_gate = ("blk.0.ffn_gate_inp_shexp.weight" in names) if names else spec.arch == "qwen2moe"
