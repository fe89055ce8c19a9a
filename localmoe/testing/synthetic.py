"""Random-weight model files in llama.cpp's exact GGUF layout (and tiny HF checkpoints).

No real MoE weights are reachable offline, so MoE architectures are tested on files this module
writes with ``gguf.GGUFWriter``: tensor names, ggml shapes and metadata keys are those llama.cpp's
converter (``convert_hf_to_gguf.py``) writes and ``src/llama-model.cpp`` expects for
``qwen3moe``, ``qwen2moe`` (shared expert + sigmoid gate), ``olmoe``, Mixtral-style ``llama``
(stacked ``ffn_*_exps``) and dense ``llama``, ``qwen3`` and ``qwen2``. Each file carries a small byte-level BPE tokenizer
(:mod:`localmoe.testing.bpe`; ``tokenizer.ggml.model = gpt2``: 256 byte tokens, merges learned from a built-in English text,
ChatML control tokens, a ChatML chat template) so llama.cpp accepts it.

Presets (:data:`PRESETS`):

* ``tiny-*``: 2 layers, d_model 256, for CI. Default storage mix like real downloads: Q8_0
  attention and embeddings, Q4_K experts / FFN, Q6_K output, F32 norms and routers; quantized with
  ``gguf.quants.quantize`` (Q4_0..Q8_0) or :mod:`localmoe.testing.quants`' K-quant quantizers
  (``gguf`` has no K-quant quantizer). ``quant="f32"`` / ``"f16"`` writes unquantized weights instead.
* ``qwen3-30b-a3b``, ``olmoe-1b-7b``, ``mixtral-8x7b``: real geometries for benchmarks (Q4_K
  experts, Q8_0 attention, Q6_K output). Their blocks are random *valid* blocks generated directly
  (quantizing 30 B random floats would take hours); ``n_layers=`` writes a truncated copy.

API: ``write_gguf(path, preset, seed=0) -> Path``, ``write_hf(dir, preset, seed=0) -> Path``.
CLI: ``python -m localmoe.testing.synthetic --preset tiny-qwen3moe --out /tmp/x.gguf [--hf] [--force]``
(an existing ``--out`` file is replaced only with ``--force``).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from localmoe.testing.bpe import CHATML_TEMPLATE, SPECIALS, Tokenizer, build_tokenizer
from localmoe.testing.hf_kernels import installed_kernels_first
from localmoe.testing.quants import quantize_blocks, random_blocks

__all__ = [
    "Preset",
    "PRESETS",
    "write_gguf",
    "write_hf",
]

# ---------------------------------------------------------------------------------------------
# presets
# ---------------------------------------------------------------------------------------------

WRITABLE_QUANTS = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K",
                   "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
"""Storage types :func:`write_gguf`'s ``quant`` can write (``quants.quantize_blocks``)."""
_MIXED = {"embd": "Q8_0", "attn": "Q8_0", "ffn": "Q4_K", "exps": "Q4_K", "shexp": "Q4_K", "output": "Q6_K"}


@dataclass(frozen=True)
class Preset:
    """Geometry and storage of a synthetic model (project vocabulary; see ModelSpec)."""

    name: str
    arch: str                      # GGUF general.architecture
    hf_arch: str | None            # transformers model_type for write_hf, None if not offered
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int | None = None  # None: tokenizer size (tiny presets)
    d_ff: int = 0                  # dense FFN (dense llama)
    n_experts: int = 0
    top_k: int = 0
    d_ff_expert: int = 0
    d_ff_shared: int = 0           # qwen2moe shared expert
    n_ctx: int = 4096
    rope_base: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    add_bos: bool = False
    tokenizer_pre: str = "qwen2"
    qtypes: dict = field(default_factory=lambda: dict(_MIXED))
    real_geometry: bool = False    # random valid blocks instead of quantizing floats
    extra_kv: dict = field(default_factory=dict)

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0


def _tiny(name, arch, hf_arch, **kw) -> Preset:
    base = dict(n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, n_ctx=2048)
    base.update(kw)
    return Preset(name=name, arch=arch, hf_arch=hf_arch, **base)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        _tiny("tiny-qwen3moe", "qwen3moe", "qwen3_moe", n_experts=8, top_k=2, d_ff_expert=256,
              d_ff=768, rope_base=1e6),
        _tiny("tiny-qwen2moe", "qwen2moe", "qwen2_moe", n_experts=8, top_k=2, d_ff_expert=256,
              d_ff_shared=512, d_ff=768, rope_base=1e6),
        _tiny("tiny-olmoe", "olmoe", "olmoe", n_kv_heads=4, n_experts=8, top_k=2, d_ff_expert=256,
              d_ff=256, norm_eps=1e-5),
        _tiny("tiny-mixtral", "llama", "mixtral", n_experts=4, top_k=2, d_ff_expert=256, d_ff=256,
              rope_base=1e6, norm_eps=1e-5, add_bos=True, tokenizer_pre="llama-bpe"),
        _tiny("tiny-llama", "llama", "llama", d_ff=512, norm_eps=1e-5, add_bos=True,
              tokenizer_pre="llama-bpe", tie_embeddings=True),
        _tiny("tiny-qwen3", "qwen3", "qwen3", d_ff=512, rope_base=1e6),
        _tiny("tiny-qwen2", "qwen2", "qwen2", d_ff=512, rope_base=1e6, tie_embeddings=True),
        Preset("qwen3-30b-a3b", "qwen3moe", "qwen3_moe", n_layers=48, d_model=2048, n_heads=32,
               n_kv_heads=4, head_dim=128, vocab_size=151936, d_ff=6144, n_experts=128, top_k=8,
               d_ff_expert=768, n_ctx=40960, rope_base=1e6, real_geometry=True),
        Preset("olmoe-1b-7b", "olmoe", "olmoe", n_layers=16, d_model=2048, n_heads=16, n_kv_heads=16,
               head_dim=128, vocab_size=50304, d_ff=1024, n_experts=64, top_k=8, d_ff_expert=1024,
               n_ctx=4096, norm_eps=1e-5, real_geometry=True),
        Preset("mixtral-8x7b", "llama", "mixtral", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8,
               head_dim=128, vocab_size=32000, d_ff=14336, n_experts=8, top_k=2, d_ff_expert=14336,
               n_ctx=32768, rope_base=1e6, norm_eps=1e-5, add_bos=True, tokenizer_pre="llama-bpe",
               real_geometry=True),
    ]
}


def _resolve(preset: str | Preset, n_layers: int | None, quant: str | None) -> Preset:
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise KeyError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
        preset = PRESETS[preset]
    if n_layers is not None:
        preset = replace(preset, n_layers=int(n_layers))
    if quant is not None:
        q = quant.upper()
        if q == "MIXED":
            preset = replace(preset, qtypes=dict(_MIXED))
        else:
            preset = replace(preset, qtypes={k: q for k in _MIXED})
    return preset


# ---------------------------------------------------------------------------------------------
# tensor plan (llama.cpp layout)
# ---------------------------------------------------------------------------------------------

@dataclass
class _T:
    name: str
    shape: tuple[int, ...]     # torch order
    role: str                  # norm | router | bias | embd | attn | ffn | exps | shexp | output
    std: float
    mean: float = 0.0


def _plan(p: Preset, vocab: int) -> list[_T]:
    D, H, KV, hd = p.d_model, p.n_heads, p.n_kv_heads, p.head_dim
    s_in = 1.0 / math.sqrt(D)
    out: list[_T] = [_T("token_embd.weight", (vocab, D), "embd", 1.0)]
    for i in range(p.n_layers):
        b = f"blk.{i}."
        out += [
            _T(b + "attn_norm.weight", (D,), "norm", 0.1, 1.0),
            _T(b + "attn_q.weight", (H * hd, D), "attn", s_in),
            _T(b + "attn_k.weight", (KV * hd, D), "attn", s_in),
            _T(b + "attn_v.weight", (KV * hd, D), "attn", s_in),
            _T(b + "attn_output.weight", (D, H * hd), "attn", 1.0 / math.sqrt(H * hd)),
            _T(b + "ffn_norm.weight", (D,), "norm", 0.1, 1.0),
        ]
        if p.arch in ("qwen2moe", "qwen2"):
            out += [_T(b + "attn_q.bias", (H * hd,), "bias", 0.1), _T(b + "attn_k.bias", (KV * hd,), "bias", 0.1),
                    _T(b + "attn_v.bias", (KV * hd,), "bias", 0.1)]
        if p.arch in ("qwen3moe", "qwen3"):
            out += [_T(b + "attn_q_norm.weight", (hd,), "norm", 0.1, 1.0), _T(b + "attn_k_norm.weight", (hd,), "norm", 0.1, 1.0)]
        if p.arch == "olmoe":
            out += [_T(b + "attn_q_norm.weight", (H * hd,), "norm", 0.1, 1.0),
                    _T(b + "attn_k_norm.weight", (KV * hd,), "norm", 0.1, 1.0)]
        if p.is_moe:
            E, F = p.n_experts, p.d_ff_expert
            out += [
                _T(b + "ffn_gate_inp.weight", (E, D), "router", s_in),
                _T(b + "ffn_gate_exps.weight", (E, F, D), "exps", s_in),
                _T(b + "ffn_up_exps.weight", (E, F, D), "exps", s_in),
                _T(b + "ffn_down_exps.weight", (E, D, F), "exps", 1.0 / math.sqrt(F)),
            ]
            if p.d_ff_shared:
                Fs = p.d_ff_shared
                out += [
                    _T(b + "ffn_gate_inp_shexp.weight", (D,), "router", s_in),
                    _T(b + "ffn_gate_shexp.weight", (Fs, D), "shexp", s_in),
                    _T(b + "ffn_up_shexp.weight", (Fs, D), "shexp", s_in),
                    _T(b + "ffn_down_shexp.weight", (D, Fs), "shexp", 1.0 / math.sqrt(Fs)),
                ]
        else:
            F = p.d_ff
            out += [
                _T(b + "ffn_gate.weight", (F, D), "ffn", s_in),
                _T(b + "ffn_up.weight", (F, D), "ffn", s_in),
                _T(b + "ffn_down.weight", (D, F), "ffn", 1.0 / math.sqrt(F)),
            ]
    out.append(_T("output_norm.weight", (D,), "norm", 0.1, 1.0))
    if not p.tie_embeddings:
        out.append(_T("output.weight", (vocab, D), "output", 2.0 * s_in))
    return out


def _storage(p: Preset, t: _T) -> str:
    if t.role in ("norm", "router", "bias"):
        return "F32"
    q = p.qtypes.get(t.role, "F32")
    if q in ("F32", "F16", "BF16"):
        return q
    import gguf

    bs = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[q]][0]
    if t.shape[-1] % bs:
        # llama.cpp falls back the same way for rows that do not fill a block
        return "Q8_0" if t.shape[-1] % 32 == 0 else "F16"
    return q


def _gen(rng: np.random.Generator, p: Preset, t: _T, qtype: str):
    """Array to write for tensor t: float array (F32/F16/BF16 via gguf) or uint8 blocks."""
    import gguf

    if p.real_geometry and qtype not in ("F32", "F16", "BF16"):
        return random_blocks(rng, qtype, t.shape, t.std)
    x = rng.standard_normal(t.shape, dtype=np.float32) * np.float32(t.std) + np.float32(t.mean)
    if qtype == "F32":
        return x
    if qtype == "F16":
        return x.astype(np.float16)
    if qtype == "BF16":
        return gguf.quants.quantize(x, gguf.GGMLQuantizationType.BF16)
    return quantize_blocks(x, qtype)


def _metadata(p: Preset, tok: Tokenizer,
              chat_template: str | None = CHATML_TEMPLATE) -> list[tuple[str, str, Any]]:
    a = p.arch
    kv: list[tuple[str, str, Any]] = [
        ("general.name", "str", f"synthetic {p.name}"),
        ("general.type", "str", "model"),
        ("general.quantization_version", "u32", 2),
        (f"{a}.context_length", "u32", p.n_ctx),
        (f"{a}.embedding_length", "u32", p.d_model),
        (f"{a}.block_count", "u32", p.n_layers),
        (f"{a}.attention.head_count", "u32", p.n_heads),
        (f"{a}.attention.head_count_kv", "u32", p.n_kv_heads),
        (f"{a}.rope.freq_base", "f32", p.rope_base),
        (f"{a}.attention.layer_norm_rms_epsilon", "f32", p.norm_eps),
        (f"{a}.vocab_size", "u32", len(tok.tokens)),
    ]
    if p.head_dim != p.d_model // p.n_heads or a in ("qwen3moe", "qwen3"):
        kv += [(f"{a}.attention.key_length", "u32", p.head_dim), (f"{a}.attention.value_length", "u32", p.head_dim)]
    kv.append((f"{a}.rope.dimension_count", "u32", p.head_dim))
    if p.is_moe:
        # llama (Mixtral) and olmoe size their experts with feed_forward_length
        ff = p.d_ff_expert if a in ("llama", "olmoe") else (p.d_ff or p.d_ff_expert)
        kv += [
            (f"{a}.feed_forward_length", "u32", ff),
            (f"{a}.expert_count", "u32", p.n_experts),
            (f"{a}.expert_used_count", "u32", p.top_k),
        ]
        if a in ("qwen3moe", "qwen2moe"):
            kv.append((f"{a}.expert_feed_forward_length", "u32", p.d_ff_expert))
        if p.d_ff_shared:
            kv.append((f"{a}.expert_shared_feed_forward_length", "u32", p.d_ff_shared))
    else:
        kv.append((f"{a}.feed_forward_length", "u32", p.d_ff))
    kv += [
        ("tokenizer.ggml.model", "str", "gpt2"),
        ("tokenizer.ggml.pre", "str", p.tokenizer_pre),
        ("tokenizer.ggml.tokens", "arr", tok.tokens),
        ("tokenizer.ggml.token_type", "arr_i32", tok.token_types),
        ("tokenizer.ggml.merges", "arr", tok.merges),
        ("tokenizer.ggml.bos_token_id", "u32", tok.bos_id),
        ("tokenizer.ggml.eos_token_id", "u32", tok.eos_id),
        ("tokenizer.ggml.padding_token_id", "u32", tok.pad_id),
        ("tokenizer.ggml.add_bos_token", "bool", p.add_bos),
    ]
    if chat_template is not None:
        kv.append(("tokenizer.chat_template", "str", chat_template))
    for k, v in p.extra_kv.items():
        kv.append((k.replace("{arch}", a), "auto", v))
    return kv


def _add_kv(w, key: str, kind: str, val: Any) -> None:
    import gguf

    if kind == "str":
        w.add_string(key, val)
    elif kind == "u32":
        w.add_uint32(key, int(val))
    elif kind == "f32":
        w.add_float32(key, float(val))
    elif kind == "bool":
        w.add_bool(key, bool(val))
    elif kind == "arr":
        w.add_array(key, val)
    elif kind == "arr_i32":
        w.add_key_value(key, list(val), gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
    elif kind == "auto":
        if isinstance(val, bool):
            w.add_bool(key, val)
        elif isinstance(val, int):
            w.add_uint32(key, val)
        elif isinstance(val, float):
            w.add_float32(key, val)
        elif isinstance(val, str):
            w.add_string(key, val)
        else:
            w.add_array(key, val)
    else:  # pragma: no cover
        raise ValueError(kind)


def write_gguf(path: str | Path, preset: str | Preset, seed: int = 0, *, quant: str | None = None,
               n_layers: int | None = None, split_max_tensors: int = 0,
               chat_template: str | None = CHATML_TEMPLATE) -> Path:
    """Write a random-weight GGUF file for ``preset`` (a :data:`PRESETS` key or a :class:`Preset`).

    Args:
        path: output file. With ``split_max_tensors > 0`` llama.cpp-style shards
            ``<stem>-0000k-of-0000n.gguf`` are written next to it and the first shard's path is
            returned.
        seed: RNG seed; the same (preset, seed, quant) gives byte-identical files.
        quant: override the storage of every weight matrix: ``"f32"``, ``"f16"``, ``"q8_0"``,
            ``"q4_k"``, ... or ``"mixed"`` (norms and routers stay F32).
        n_layers: write only this many layers (e.g. a 4-layer Qwen3-30B-A3B for quick benchmarks).
        chat_template: the ``tokenizer.chat_template`` text (default ChatML; None writes no
            template, as a base model has none; any text is written as is, a broken one too).
    Returns:
        Path of the file (first shard when split).

    Tensors are generated and written one at a time, so memory stays at one tensor even for the
    real-geometry presets (Qwen3-30B-A3B is ~17 GB on disk).
    """
    import gguf

    p = _resolve(preset, n_layers, quant)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(vocab_size=p.vocab_size)
    vocab = len(tok.tokens)
    plan = _plan(p, vocab)
    w = gguf.GGUFWriter(path, p.arch, split_max_tensors=split_max_tensors)
    for key, kind, val in _metadata(p, tok, chat_template):
        _add_kv(w, key, kind, val)
    storages = []
    for t in plan:
        q = _storage(p, t)
        qt = gguf.GGMLQuantizationType[q]
        bs, ts = gguf.GGML_QUANT_SIZES[qt]
        nbytes = math.prod(t.shape) // bs * ts
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), nbytes, raw_dtype=qt)
        storages.append(q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for t, q in zip(plan, storages):
        arr = _gen(rng, p, t, q)
        w.write_tensor_data(np.ascontiguousarray(arr))
    w.close()
    if split_max_tensors and len(w.tensors) > 1:
        return w.format_shard_names(path)[0]
    return path


# ---------------------------------------------------------------------------------------------
# HF checkpoints
# ---------------------------------------------------------------------------------------------

def _hf_config(p: Preset, vocab: int, tok: Tokenizer):
    import transformers as tf

    common = dict(
        vocab_size=vocab, hidden_size=p.d_model, num_hidden_layers=p.n_layers,
        num_attention_heads=p.n_heads, num_key_value_heads=p.n_kv_heads,
        max_position_embeddings=p.n_ctx, rms_norm_eps=p.norm_eps, rope_theta=p.rope_base,
        tie_word_embeddings=p.tie_embeddings, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id, initializer_range=0.5 / math.sqrt(p.d_model) * 2,
    )
    t = p.hf_arch
    if t == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(intermediate_size=p.d_ff or p.d_ff_expert, moe_intermediate_size=p.d_ff_expert,
                                num_experts=p.n_experts, num_experts_per_tok=p.top_k, norm_topk_prob=True,
                                head_dim=p.head_dim, decoder_sparse_step=1, mlp_only_layers=[], **common)
    elif t == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(intermediate_size=p.d_ff or p.d_ff_expert, moe_intermediate_size=p.d_ff_expert,
                                shared_expert_intermediate_size=p.d_ff_shared, num_experts=p.n_experts,
                                num_experts_per_tok=p.top_k, norm_topk_prob=False, decoder_sparse_step=1,
                                mlp_only_layers=[], **common)
    elif t == "olmoe":
        cfg = tf.OlmoeConfig(intermediate_size=p.d_ff_expert, num_experts=p.n_experts,
                             num_experts_per_tok=p.top_k, norm_topk_prob=False, **common)
    elif t == "mixtral":
        cfg = tf.MixtralConfig(intermediate_size=p.d_ff_expert, num_local_experts=p.n_experts,
                               num_experts_per_tok=p.top_k, head_dim=p.head_dim, **common)
    elif t == "llama":
        cfg = tf.LlamaConfig(intermediate_size=p.d_ff, head_dim=p.head_dim, **common)
    elif t == "qwen3":
        cfg = tf.Qwen3Config(intermediate_size=p.d_ff, head_dim=p.head_dim, **common)
    elif t == "qwen2":
        cfg = tf.Qwen2Config(intermediate_size=p.d_ff, **common)
    else:
        raise ValueError(f"preset {p.name} has no HF architecture")
    return cfg


def _hf_tokenizer_files(out: Path, tok: Tokenizer) -> None:
    """tokenizer.json (byte-level BPE via the ``tokenizers`` library) + tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer as HFTok, decoders, models, pre_tokenizers

    n_regular = len(tok.tokens) - len(SPECIALS)
    vocab = {t: i for i, t in enumerate(tok.tokens[:n_regular])}
    merges = [tuple(m.split(" ", 1)) for m in tok.merges]
    t = HFTok(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    t.save(str(out / "tokenizer.json"))
    cfg = {
        "bos_token": tok.tokens[tok.bos_id], "eos_token": tok.tokens[tok.eos_id],
        "pad_token": tok.tokens[tok.pad_id], "chat_template": CHATML_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))


def write_hf(dir: str | Path, preset: str | Preset, seed: int = 0, *, max_shard_size: str | None = None) -> Path:
    """Write a tiny random HF checkpoint (config.json + safetensors + tokenizer files).

    The model is built by ``transformers`` itself (``AutoModelForCausalLM.from_config`` under
    ``torch.manual_seed(seed)``, initializer_range ~ 1/sqrt(d_model) so logits are not flat) and
    saved with ``save_pretrained`` (safetensors; ``max_shard_size="100KB"`` gives several shards +
    ``model.safetensors.index.json``), so it loads with ``AutoModelForCausalLM.from_pretrained``.

    Returns:
        the directory.
    Raises:
        ValueError: the preset has no HF architecture.
    """
    import torch

    installed_kernels_first()   # run from the repository root, kernels/ would shadow HF's
    from transformers import AutoModelForCausalLM

    p = _resolve(preset, None, None)
    if p.real_geometry:
        raise ValueError(f"write_hf writes tiny checkpoints only; {p.name} is a real geometry")
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(vocab_size=p.vocab_size)
    cfg = _hf_config(p, len(tok.tokens), tok)
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state alone
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():  # norms: 1 + noise, so a wrong norm mapping shows in the logits
            for n, prm in model.named_parameters():
                if prm.ndim == 1 and "norm" in n:
                    prm.add_(torch.randn_like(prm) * 0.1)
                elif prm.ndim == 1 and n.endswith("bias"):
                    prm.copy_(torch.randn_like(prm) * 0.1)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, safe_serialization=True, **kw)
    _hf_tokenizer_files(out, tok)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m localmoe.testing.synthetic",
                                 description="write a random-weight GGUF file (or HF dir) in llama.cpp's layout")
    ap.add_argument("--preset", required=True, choices=sorted(PRESETS))
    ap.add_argument("--out", required=True, help="output .gguf path (or directory with --hf)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quant", default=None, help="f32, f16, q8_0, q4_k, ... or mixed (default: preset's mix)")
    ap.add_argument("--n-layers", type=int, default=None, help="write only the first N layers")
    ap.add_argument("--split-max-tensors", type=int, default=0,
                    help="write llama.cpp split shards of at most N tensors each (0: one file)")
    ap.add_argument("--hf", action="store_true", help="write an HF safetensors checkpoint directory")
    ap.add_argument("--force", action="store_true", help="replace an existing --out file")
    a = ap.parse_args(argv)
    if a.quant is not None and a.quant.upper() not in WRITABLE_QUANTS + ("MIXED",):
        ap.error(f"--quant {a.quant!r} is not one this writer makes; choose from "
                 f"{', '.join(q.lower() for q in WRITABLE_QUANTS)} or mixed")
    for flag, v, low in (("--seed", a.seed, 0), ("--n-layers", a.n_layers, 1),
                         ("--split-max-tensors", a.split_max_tensors, 0)):
        if v is not None and v < low:
            ap.error(f"{flag} must be at least {low}, got {v}")
    out = Path(a.out)
    if not a.hf and out.is_dir():
        ap.exit(1, f"error: --out {a.out} is a directory; give a file path such as {out / 'model.gguf'}\n")
    if not a.hf and out.exists() and not a.force:
        ap.exit(1, f"error: --out {a.out} exists; pass --force to replace it\n")
    if not out.parent.is_dir() and out.parent.exists():
        ap.exit(1, f"error: cannot write {a.out}: {out.parent} is not a folder\n")
    if a.hf:
        installed_kernels_first()   # `python -m` from the repository root: sys.path[0] is it
        try:
            import transformers  # noqa: F401  (write_hf builds the model with it)
        except ImportError:
            ap.exit(1, "error: --hf needs the transformers package (pip install transformers, "
                       "or the project's [test] extra)\n")
    try:
        if a.hf:
            print(write_hf(a.out, a.preset, a.seed))
        else:
            print(write_gguf(a.out, a.preset, a.seed, quant=a.quant, n_layers=a.n_layers,
                             split_max_tensors=a.split_max_tensors))
    except OSError as e:
        ap.exit(1, f"error: cannot write {a.out}: {e.strerror or e}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
