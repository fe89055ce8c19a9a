"""ModelSpec from GGUF metadata: :func:`spec_from_gguf_metadata`.

Keys are llama.cpp's (``llama-arch.cpp``); the per-architecture facts a GGUF file does not carry
(rope style, q/k-norm flavour, top-k renormalization) are the ones llama.cpp hard-codes in
``llama-model.cpp``.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

from localmoe.errors import ModelLoadError, UnsupportedModelError
from localmoe.io.spec import ModelSpec

if TYPE_CHECKING:
    from localmoe.io.model_file import ModelFile

__all__ = ["spec_from_gguf_metadata", "SUPPORTED_ARCHS"]

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "olmoe", "gemma3")

# per-arch facts llama.cpp hard-codes (src/llama-model.cpp build_* functions)
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(rope_style="norm", norm_topk_prob=True),           # Mixtral: softmax over top-k
    "qwen2": dict(rope_style="neox", attn_bias=True),
    "qwen3": dict(rope_style="neox", qk_norm=True),
    "qwen2moe": dict(rope_style="neox", attn_bias=True, norm_topk_prob=False),
    "qwen3moe": dict(rope_style="neox", qk_norm=True, norm_topk_prob=True),
    "olmoe": dict(rope_style="neox", qk_norm=True, qk_norm_full=True, norm_topk_prob=False),
    "gemma3": dict(rope_style="neox", qk_norm=True, act="gelu_tanh", post_norms=True,
                   sliding_window_pattern=6, rope_base_local=10000.0),
}


def _req(md: dict[str, Any], key: str) -> Any:
    if key not in md:
        raise ModelLoadError(
            f"required metadata key {key!r} is missing; the file is incomplete or was written by a "
            f"converter localmoe does not understand; re-convert it with a current llama.cpp"
        )
    return md[key]


_BLK_RE = re.compile(r"blk\.(\d+)\.")


def _pos_int(md: dict[str, Any], key: str, required: bool = True, default: int = 0) -> int:
    v = _req(md, key) if required else md.get(key, default)
    if isinstance(v, list):  # per-layer arrays (e.g. head_count_kv): must be uniform here
        vals = set(v)
        if len(vals) != 1:
            raise UnsupportedModelError(
                f"metadata {key!r} varies per layer ({sorted(vals)[:6]}...); per-layer values are not supported"
            )
        v = v[0]
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ModelLoadError(f"metadata {key!r} = {v!r} is not a non-negative integer; the file is corrupt")
    if required and v == 0:
        raise ModelLoadError(f"metadata {key!r} = 0; the file is corrupt")
    return v


def _num(md: dict[str, Any], key: str, default: float) -> float:
    v = md.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ModelLoadError(f"metadata {key!r} = {v!r} is not a finite number; the file is corrupt")
    return float(v)


def _pos_num(md: dict[str, Any], key: str, default: float, zero_ok: bool = False) -> float:
    """A finite number above zero (or zero with ``zero_ok``): rope bases and norm epsilons."""
    v = _num(md, key, default)
    if v < 0 or (v == 0 and not zero_ok):
        raise ModelLoadError(f"metadata {key!r} = {v!r} must be {'>= 0' if zero_ok else '> 0'}; the file is corrupt")
    return v


def spec_from_gguf_metadata(md: dict[str, Any], model: ModelFile | None = None) -> ModelSpec:
    """Build a :class:`ModelSpec` from GGUF metadata (+ tensor presence when ``model`` is given).

    Keys: ``{arch}.block_count, embedding_length, feed_forward_length, attention.head_count[_kv],
    attention.key_length/value_length, rope.*, expert_*`` (llama.cpp ``llama-arch.cpp``). The
    rope style, q/k-norm flavour and top-k renormalization are per-architecture facts from
    llama.cpp's ``llama-model.cpp``; ``expert_weights_norm`` / ``expert_gating_func`` in the file
    override the defaults.

    Raises:
        UnsupportedModelError: architecture not in :data:`SUPPORTED_ARCHS`.
        ModelLoadError: a required key is missing or inconsistent (e.g. ``expert_used_count >
            expert_count``).
    """
    arch = _req(md, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(
            f"architecture {arch!r} (general.architecture) is not supported; localmoe runs: "
            f"{', '.join(SUPPORTED_ARCHS)}"
        )
    a = arch + "."
    spec = _base_spec(md, arch, model)
    _read_rope(spec, md, a)
    if arch == "gemma3":
        _read_gemma3_window(spec, md, a)
    _read_scales(spec, md, a)
    n_exp = _pos_int(md, a + "expert_count", required=False, default=0)
    if n_exp:
        _read_moe(spec, md, a, model, n_exp)
    else:
        spec.norm_topk_prob = False
        if model is not None and any(n.endswith("ffn_gate_exps.weight") for n in model.tensor_names()):
            raise ModelLoadError(f"the file has expert tensors but no {a}expert_count; re-convert it")
    if model is not None:
        _read_tensor_presence(spec, model)
    return spec


def _base_spec(md: dict[str, Any], arch: str, model: ModelFile | None) -> ModelSpec:
    """The spec's sizes (layers, widths, heads, vocabulary, context, norm, rope base) and the
    architecture's defaults (:data:`_ARCH_DEFAULTS`)."""
    a = arch + "."
    n_layers = _pos_int(md, a + "block_count")
    d_model = _pos_int(md, a + "embedding_length")
    n_heads = _pos_int(md, a + "attention.head_count")
    n_kv = _pos_int(md, a + "attention.head_count_kv", required=False, default=n_heads) or n_heads
    if n_heads % n_kv:
        raise ModelLoadError(
            f"{a}attention.head_count = {n_heads} is not a multiple of head_count_kv = {n_kv}; the file is corrupt"
        )
    head_dim = _pos_int(md, a + "attention.key_length", required=False, default=0) or d_model // n_heads
    head_dim_v = _pos_int(md, a + "attention.value_length", required=False, default=0) or head_dim
    vocab = _vocab_size(md, a, model)
    if model is not None:
        _check_block_count(model, a, n_layers)
    spec = ModelSpec(
        arch=arch,
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        head_dim_v=head_dim_v if head_dim_v != head_dim else None,
        vocab_size=int(vocab),
        d_ff=_pos_int(md, a + "feed_forward_length", required=False, default=0),
        # absent: 2048 (old conversions); present and 0: corrupt (nothing to size a context by)
        n_ctx_train=_pos_int(md, a + "context_length", required=a + "context_length" in md,
                             default=2048),
        norm_eps=_pos_num(md, a + "attention.layer_norm_rms_epsilon",
                          _pos_num(md, a + "attention.layer_norm_epsilon", 1e-5), zero_ok=True),
        norm_type="rms" if (a + "attention.layer_norm_epsilon") not in md or (a + "attention.layer_norm_rms_epsilon") in md else "layer",
        rope_base=_pos_num(md, a + "rope.freq_base", 10000.0),
        name=str(md.get("general.name", "")),
    )
    for k, v in _ARCH_DEFAULTS[arch].items():
        setattr(spec, k, v)
    return spec


def _vocab_size(md: dict[str, Any], a: str, model: ModelFile | None) -> int:
    """``{arch}.vocab_size``, else the rows of ``token_embd.weight``, else the token list's length."""
    tokens = md.get("tokenizer.ggml.tokens")
    vocab = md.get(a + "vocab_size")
    if vocab is None and model is not None and model.has_tensor("token_embd.weight"):
        vocab = model.tensor_info("token_embd.weight").shape[0]
    if vocab is None and isinstance(tokens, list):
        vocab = len(tokens)
    if vocab is None:
        raise ModelLoadError(f"cannot tell the vocabulary size: no {a}vocab_size, token_embd.weight or tokenizer.ggml.tokens")
    return vocab


def _check_block_count(model: ModelFile, a: str, n_layers: int) -> None:
    """``block_count`` must equal the blocks the tensors hold: more would drive per-layer loops
    past the file, fewer would silently drop layers (llama.cpp refuses both)."""
    blocks = {int(m.group(1)) for m in map(_BLK_RE.match, model.tensor_names()) if m}
    # the blocks present, counted (a lone tensor named blk.999999999.x must not count 1e9)
    n_blocks = len(blocks) if blocks == set(range(len(blocks))) else -1
    if n_layers != n_blocks:  # fewer would silently drop the last layers
        raise ModelLoadError(
            f"metadata {a}block_count = {n_layers} but the file has tensors for "
            f"{f'{n_blocks} blocks' if n_blocks >= 0 else 'blocks not numbered 0..n-1'}; "
            f"the file is corrupt or incomplete (re-download it)")


def _read_rope(spec: ModelSpec, md: dict[str, Any], a: str) -> None:
    """Partial rotary (``rope.dimension_count``), ``rope.scaling.*`` and the SWA rope base."""
    rd = md.get(a + "rope.dimension_count")
    if rd is not None and int(rd) != spec.head_dim:
        spec.rope_dim = int(rd)
    rs: dict[str, Any] = {}
    st = md.get(a + "rope.scaling.type")
    if st is not None and st not in ("none", "linear", "yarn"):
        # llama.cpp asserts (aborts) on a type it does not know
        raise UnsupportedModelError(
            f"{a}rope.scaling.type = {str(st)[:40]!r} is not supported (none, linear, yarn)")
    if st and st != "none":
        rs["type"] = st
        for k in ("factor", "original_context_length", "attn_factor", "yarn_log_multiplier",
                  "yarn_ext_factor", "yarn_attn_factor", "yarn_beta_fast", "yarn_beta_slow"):
            if a + "rope.scaling." + k in md:
                key = a + "rope.scaling." + k
                v = _num(md, key, 0.0)
                if v < 0 and k != "yarn_ext_factor":
                    raise ModelLoadError(f"metadata {key!r} = {v!r} is negative; the file is corrupt")
                rs[k] = md[key]
    spec.rope_scaling = rs
    if a + "rope.freq_base_swa" in md:
        spec.rope_base_local = _num(md, a + "rope.freq_base_swa", 10000.0)


def _read_gemma3_window(spec: ModelSpec, md: dict[str, Any], a: str) -> None:
    """Gemma-3's embedding scale and sliding window. llama.cpp models/gemma3.cpp: SWA only when
    the key is present and > 0; pattern default 6."""
    sw = md.get(a + "attention.sliding_window")
    spec.embed_scale = math.sqrt(spec.d_model)
    spec.sliding_window = int(sw) if isinstance(sw, int) and sw > 0 else None
    pat = md.get(a + "attention.sliding_window_pattern")
    if spec.sliding_window is None:
        spec.sliding_window_pattern = None
    elif isinstance(pat, int) and pat > 0:
        spec.sliding_window_pattern = pat
    elif isinstance(pat, list) and pat:
        # per-layer flags (True = sliding): must be "N-1 sliding, then 1 global", repeated
        n = next((i + 1 for i, v in enumerate(pat) if not v), None)
        if n is None or any(bool(v) != ((i + 1) % n != 0) for i, v in enumerate(pat)):
            raise UnsupportedModelError(
                f"{a}attention.sliding_window_pattern {pat[:12]}... is not periodic; not supported"
            )
        spec.sliding_window_pattern = n


def _read_scales(spec: ModelSpec, md: dict[str, Any], a: str) -> None:
    """Logit soft-capping and an explicit attention scale."""
    for key, field_ in (("attn_logit_softcapping", "attn_logit_softcap"), ("final_logit_softcapping", "final_logit_softcap")):
        if md.get(a + key):
            setattr(spec, field_, _num(md, a + key, 0.0))
    if md.get(a + "attention.scale"):
        spec.attn_scale = _num(md, a + "attention.scale", 0.0)


def _read_moe(spec: ModelSpec, md: dict[str, Any], a: str, model: ModelFile | None, n_exp: int) -> None:
    """Top-k, expert and shared-expert FFN sizes, gating and top-k normalization of a model
    with ``n_exp`` experts."""
    top_k = _pos_int(md, a + "expert_used_count", required=False, default=0)
    if top_k == 0:
        raise ModelLoadError(f"{a}expert_count = {n_exp} but {a}expert_used_count is missing or 0; the file is corrupt")
    if top_k > n_exp:
        raise ModelLoadError(
            f"{a}expert_used_count = {top_k} exceeds {a}expert_count = {n_exp}; the file's metadata "
            f"is corrupt; re-convert it"
        )
    spec.n_experts, spec.top_k = n_exp, top_k
    groups = _pos_int(md, a + "expert_group_count", required=False, default=0)
    if groups > 1:  # llama.cpp asserts on inconsistent group counts; none of our archs group
        raise UnsupportedModelError(
            f"{a}expert_group_count = {groups}: grouped expert routing is not supported")
    dfe = _pos_int(md, a + "expert_feed_forward_length", required=False, default=0)
    if not dfe and model is not None:  # llama (Mixtral) and olmoe: size from the expert tensors
        for i in range(spec.n_layers):
            nm = f"blk.{i}.ffn_up_exps.weight"
            if model.has_tensor(nm):
                dfe = model.tensor_info(nm).shape[1]
                break
    spec.d_ff_expert = dfe or spec.d_ff
    spec.leading_dense_layers = _pos_int(md, a + "leading_dense_block_count", required=False, default=0)
    if spec.arch == "llama":
        # Mixtral files have no dense FFN
        spec.d_ff = spec.d_ff if spec.leading_dense_layers else 0
    _read_shared_experts(spec, md, a, model)
    _read_gating(spec, md, a)


def _read_shared_experts(spec: ModelSpec, md: dict[str, Any], a: str, model: ModelFile | None) -> None:
    """Shared expert count and size (from the metadata, else from ``ffn_up_shexp`` tensors) and
    whether a shared-expert gate is present."""
    n_layers = spec.n_layers
    n_sh = _pos_int(md, a + "expert_shared_count", required=False, default=0)
    d_sh = _pos_int(md, a + "expert_shared_feed_forward_length", required=False, default=0)
    has_shexp = model is not None and any(
        model.has_tensor(f"blk.{i}.ffn_up_shexp.weight") for i in range(n_layers))
    if has_shexp and model is not None:
        for i in range(n_layers):
            nm = f"blk.{i}.ffn_up_shexp.weight"
            if model.has_tensor(nm):
                d_sh = d_sh or model.tensor_info(nm).shape[0]
                break
        n_sh = n_sh or 1
    spec.n_shared_experts = n_sh if (d_sh or has_shexp) else 0
    spec.d_ff_shared = d_sh if spec.n_shared_experts else 0
    if model is not None:
        spec.shared_expert_gate = any(model.has_tensor(f"blk.{i}.ffn_gate_inp_shexp.weight") for i in range(n_layers))
    else:
        spec.shared_expert_gate = spec.arch == "qwen2moe" and spec.n_shared_experts > 0


def _read_gating(spec: ModelSpec, md: dict[str, Any], a: str) -> None:
    """``expert_gating_func``, ``expert_weights_norm`` and ``expert_weights_scale`` overrides."""
    g = md.get(a + "expert_gating_func")
    if g is not None:
        if int(g) == 1:
            spec.gating = "softmax"
        elif int(g) == 2:
            spec.gating = "sigmoid"
        else:
            raise UnsupportedModelError(f"{a}expert_gating_func = {g} is not supported (1 softmax, 2 sigmoid)")
    if a + "expert_weights_norm" in md:
        spec.norm_topk_prob = bool(md[a + "expert_weights_norm"])
    if md.get(a + "expert_weights_scale"):
        spec.expert_weights_scale = _num(md, a + "expert_weights_scale", 1.0)


def _read_tensor_presence(spec: ModelSpec, model: ModelFile) -> None:
    """Facts the tensors tell: tied embeddings, attention biases, q/k norms (and their span)."""
    arch = spec.arch
    spec.tie_embeddings = not model.has_tensor("output.weight")
    if not model.has_tensor("token_embd.weight"):
        raise ModelLoadError("tensor 'token_embd.weight' is missing; the file is incomplete")
    if arch in ("qwen2", "qwen2moe"):
        spec.attn_bias = model.has_tensor("blk.0.attn_q.bias")
    if arch in ("qwen3", "qwen3moe", "olmoe", "gemma3"):
        spec.qk_norm = model.has_tensor("blk.0.attn_q_norm.weight")
        if arch == "olmoe" and spec.qk_norm:
            # olmoe's q norm spans the whole projection (n_heads*head_dim)
            spec.qk_norm_full = model.tensor_info("blk.0.attn_q_norm.weight").shape[0] == spec.n_heads * spec.head_dim
    if arch == "llama" and model.has_tensor("blk.0.attn_q_norm.weight"):
        spec.qk_norm = True
