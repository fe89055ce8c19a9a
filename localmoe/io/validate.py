"""Checks that a model file's metadata agrees with itself and with its tensors.

Run when a file is opened (:class:`~localmoe.io.gguf_file.GGUFModelFile` and
:class:`~localmoe.io.hf.HFModelFile`), before any backend sees it, so that a corrupt or
hostile file is refused with one line naming the key or tensor, for every backend alike:

* :func:`check_gguf_metadata`: ``general.type`` (adapters are not models), the tokenizer
  arrays' value types and lengths, duplicate vocabulary entries (llama.cpp asserts on them) and
  vocabulary entries that are not UTF-8.
* :func:`check_tensor_shapes`: every dimension the model uses (``d_model``, heads, head sizes,
  FFN and expert sizes, expert count, vocabulary) against the shape of every tensor that holds
  it, and the presence of the tensors each layer needs.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from localmoe.errors import ModelLoadError, UnsupportedModelError

if TYPE_CHECKING:
    from localmoe.io.model_file import ModelFile
    from localmoe.io.spec import ModelSpec

__all__ = ["check_gguf_metadata", "check_tensor_shapes", "MAX_METADATA_DEPTH", "MAX_ARRAY_ITEMS"]

#: nesting depth of GGUF arrays of arrays the reader accepts (llama.cpp itself reads none)
MAX_METADATA_DEPTH = 8
#: items of one metadata array (the largest vocabularies and merge lists hold under 1 M)
MAX_ARRAY_ITEMS = 1 << 22

_TOKEN_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")


def check_gguf_metadata(md: dict[str, Any], name: str, bad_utf8: dict[str, int] | None = None) -> None:
    """Refuse metadata no backend can run from.

    Args:
        md: GGUF key -> value (arrays as lists).
        name: the file's name, for messages.
        bad_utf8: key -> index of the first string array entry that was not valid UTF-8.
    Raises:
        UnsupportedModelError: ``general.type`` is not ``model`` (e.g. a LoRA adapter).
        ModelLoadError: tokenizer arrays of the wrong value type or length, duplicate
            vocabulary entries, vocabulary entries that are not UTF-8.
    """
    gtype = md.get("general.type")
    if gtype is not None and gtype != "model":
        hint = (" (a LoRA adapter: load its base model instead; localmoe does not apply adapters)"
                if gtype == "adapter" else "")
        raise UnsupportedModelError(f"{name}: general.type = {str(gtype)[:40]!r}, not a model{hint}")
    tokens = md.get("tokenizer.ggml.tokens")
    if tokens is None:
        return
    for key in _TOKEN_ARRAYS:
        v = md.get(key)
        if v is None:
            continue
        if not isinstance(v, list) or not all(isinstance(t, str) for t in v):
            raise ModelLoadError(f"{name}: {key} is not an array of strings; the file is corrupt")
        if bad_utf8 and key in bad_utf8:
            i = bad_utf8[key]
            raise ModelLoadError(
                f"{name}: {key} entry {i} is not valid UTF-8; the file is corrupt (re-convert it)")
    n = len(tokens)
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        v = md.get(key)
        if v is None:
            continue
        num = (int,) if key.endswith("type") else (int, float)
        if not isinstance(v, list) or not all(isinstance(t, num) and not isinstance(t, bool) for t in v):
            kind = "integers" if key.endswith("type") else "numbers"
            raise ModelLoadError(f"{name}: {key} is not an array of {kind}; the file is corrupt")
        if len(v) != n:
            raise ModelLoadError(
                f"{name}: {key} has {len(v)} entries but tokenizer.ggml.tokens has {n}; the file is corrupt")
    if len(set(tokens)) != n:
        seen: dict[str, int] = {}
        for i, t in enumerate(tokens):
            if t in seen:
                raise ModelLoadError(
                    f"{name}: vocabulary entries {seen[t]} and {i} are the same token {t[:40]!r}; "
                    f"the file is corrupt (llama.cpp refuses it too)")
            seen[t] = i


_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def _expected_shapes(s: ModelSpec, model: ModelFile, names: set[str]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> the torch-order shape the spec implies, for every tensor the spec sizes."""
    D, H, KV, hd, hdv = s.d_model, s.n_heads, s.n_kv_heads, s.head_dim, s.v_head_dim
    exp: dict[str, tuple[int, ...]] = {"token_embd.weight": (s.vocab_size, D), "output.weight": (s.vocab_size, D),
                                       "output_norm.weight": (D,)}
    full_qk = s.qk_norm_full or (
        "blk.0.attn_q_norm.weight" in names and model.tensor_info("blk.0.attn_q_norm.weight").shape == (H * hd,)
        and H > 1)
    for i in range(s.n_layers):
        b = f"blk.{i}."
        exp.update({
            b + "attn_norm.weight": (D,), b + "ffn_norm.weight": (D,),
            b + "post_attention_norm.weight": (D,), b + "post_ffw_norm.weight": (D,),
            b + "attn_q.weight": (H * hd, D), b + "attn_k.weight": (KV * hd, D),
            b + "attn_v.weight": (KV * hdv, D), b + "attn_output.weight": (D, H * hdv),
            b + "attn_q.bias": (H * hd,), b + "attn_k.bias": (KV * hd,), b + "attn_v.bias": (KV * hdv,),
            b + "attn_output.bias": (D,),
            b + "attn_q_norm.weight": (H * hd,) if full_qk else (hd,),
            b + "attn_k_norm.weight": (KV * hd,) if full_qk else (hd,),
        })
        if s.layer_is_moe(i):
            E, F = s.n_experts, s.d_ff_expert
            exp.update({b + "ffn_gate_inp.weight": (E, D), b + "ffn_gate_exps.weight": (E, F, D),
                        b + "ffn_up_exps.weight": (E, F, D), b + "ffn_down_exps.weight": (E, D, F)})
            if s.d_ff_shared:
                Fs = s.d_ff_shared
                exp.update({b + "ffn_gate_shexp.weight": (Fs, D), b + "ffn_up_shexp.weight": (Fs, D),
                            b + "ffn_down_shexp.weight": (D, Fs)})
        elif s.d_ff:
            F = s.d_ff
            exp.update({b + "ffn_gate.weight": (F, D), b + "ffn_up.weight": (F, D),
                        b + "ffn_down.weight": (D, F)})
    return exp


def _required(s: ModelSpec) -> list[str]:
    """Tensors every layer of ``s`` needs."""
    req = ["token_embd.weight"]
    for i in range(s.n_layers):
        b = f"blk.{i}."
        req += [b + n for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight")]
        if s.layer_is_moe(i):
            req += [b + n for n in ("ffn_gate_inp.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")]
        else:
            req += [b + n for n in ("ffn_up.weight", "ffn_down.weight")]
    return req


def check_tensor_shapes(spec: ModelSpec, model: ModelFile, source: str = "metadata") -> None:
    """Cross-check the spec's dimensions against the tensors of ``model``.

    Args:
        spec: the spec read from the file's metadata (``source`` names where it came from,
            ``"metadata"`` or ``"config.json"``).
        model: the opened file (only tensor names and shapes are read; no data is touched).
    Raises:
        ModelLoadError: a layer count other than the blocks the tensors hold, a tensor a layer
            needs is missing, a tensor's shape differs from the
            one the spec implies (the message names both), the vocabulary holds more entries
            than the embedding has rows, or a rotary dimension that is odd or above the head size.
    """
    names = set(model.tensor_names())
    where = getattr(model, "path", None)
    fname = getattr(where, "name", str(where))
    blocks = {int(m.group(1)) for m in map(_LAYER_RE.match, names) if m}
    # the blocks present, counted (a lone tensor named blk.999999999.x must not count 1e9)
    n_blocks = len(blocks) if blocks == set(range(len(blocks))) else -1
    if spec.n_layers != n_blocks:  # before any per-layer loop: the count may be absurd
        raise ModelLoadError(
            f"{fname}: the {source} says {spec.n_layers} layers but the tensors hold "
            f"{n_blocks if n_blocks >= 0 else 'blocks not numbered 0..n-1'}; "
            f"the files are corrupt or do not belong together")
    for n in _required(spec):
        if n not in names:
            raise ModelLoadError(
                f"{fname}: tensor {n!r} is missing; the file is incomplete or not a {spec.arch} model")
    exp = _expected_shapes(spec, model, names)
    for n in sorted(names & exp.keys(), key=_order):
        got = tuple(model.tensor_info(n).shape)
        want = exp[n]
        if got == want or (len(got) == 2 and got[0] == 1 and got[1:] == want):
            continue
        raise ModelLoadError(
            f"{fname}: tensor {n!r} has shape {list(got)} but the {source} implies {list(want)} "
            f"({_dims(spec)}); the file is corrupt or its {source} contradicts its weights")
    n_tok = len((getattr(model, "metadata", None) or {}).get("tokenizer.ggml.tokens") or [])
    if n_tok > spec.vocab_size:
        raise ModelLoadError(
            f"{fname}: the vocabulary has {n_tok} entries but the embedding has {spec.vocab_size} rows; "
            f"token ids past the table cannot be looked up: the file is corrupt")
    rd = spec.rope_dim
    if rd is not None and (rd <= 0 or rd % 2 or rd > spec.head_dim):
        raise ModelLoadError(
            f"{fname}: rope dimension {rd} must be even and at most the head size {spec.head_dim}; "
            f"the file is corrupt")


def _order(name: str) -> tuple[int, str]:
    m = _LAYER_RE.match(name)
    return (int(m.group(1)) + 1, m.group(2)) if m else (0, name)


def _dims(s: ModelSpec) -> str:
    parts = [f"d_model={s.d_model}", f"heads={s.n_heads}/{s.n_kv_heads}", f"head_dim={s.head_dim}",
             f"vocab={s.vocab_size}"]
    if s.is_moe:
        parts += [f"experts={s.n_experts}", f"d_ff_expert={s.d_ff_expert}"]
    elif s.d_ff:
        parts.append(f"d_ff={s.d_ff}")
    return ", ".join(parts)
