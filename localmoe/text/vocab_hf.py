"""Loading a Hugging Face tokenizer folder (``tokenizer.json`` and its config files).

The ``tokenizers`` pipeline of ``tokenizer.json`` runs as is; added tokens marked ``special``
become control tokens and the other added tokens user-defined ones. BOS/EOS come from
``tokenizer_config.json`` (else ``config.json``), the add-BOS/EOS flags from what the
post-processor does (overridden by ``add_bos_token``/``add_eos_token``), and the
end-of-generation set from the configs' ``eos_token_id`` plus llama.cpp's text-based detection
limited to added tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from localmoe.errors import ModelLoadError
from localmoe.text.bytelevel import parse_byte_token
from localmoe.text.vocab import (TT_BYTE, TT_CONTROL, TT_NORMAL, TT_USER_DEFINED, VocabParts,
                                 llamacpp_special_fixups, token_bytes_table)

__all__ = ["load_hf_vocab"]


def load_hf_vocab(path: str | Path) -> VocabParts:
    """The vocabulary of an HF model directory holding ``tokenizer.json`` (and optionally
    ``tokenizer_config.json``, ``config.json``, ``generation_config.json``).

    Raises:
        ModelLoadError: ``tokenizer.json`` missing or unreadable.
    """
    path = Path(path)
    tk, spec = _read_tokenizer_json(path)
    tcfg, cfg, gcfg = (_read_json(path / "tokenizer_config.json"), _read_json(path / "config.json"),
                       _read_json(path / "generation_config.json"))
    vocab = tk.get_vocab(with_added_tokens=True)
    id_to_tok, types, added = _tokens_and_types(tk, spec, vocab)
    dec = json.dumps(spec.get("decoder") or {})
    norm = json.dumps(spec.get("normalizer") or {}) + json.dumps(spec.get("pre_tokenizer") or {})
    add_space_prefix = ('"Prepend"' in norm) or (
        '"Metaspace"' in norm and '"never"' not in norm and '"add_prefix_space": false' not in norm
    )
    parts = VocabParts("hf", tk, id_to_tok, types,
                       token_bytes_table(id_to_tok, types, byte_level='"ByteLevel"' in dec),
                       add_space_prefix=add_space_prefix)
    _set_bos_eos(parts, tk, tcfg, cfg, vocab)
    parts.eog_ids = _eog_ids(parts, cfg, gcfg, added)
    return parts


def _read_tokenizer_json(path: Path) -> tuple[Any, dict]:
    """The ``tokenizers.Tokenizer`` of ``path/tokenizer.json`` and the file's JSON.

    Raises:
        ModelLoadError: the file is missing, not JSON, or has a component ``tokenizers`` lacks.
    """
    from tokenizers import Tokenizer as HFTokenizer

    tj = path / "tokenizer.json"
    if not tj.is_file():
        raise ModelLoadError(
            f"{path} has no tokenizer.json; localmoe needs the fast-tokenizer file "
            "(save it with transformers' AutoTokenizer.save_pretrained)"
        )
    try:
        tk = HFTokenizer.from_file(str(tj))
        spec = json.loads(tj.read_text(encoding="utf-8"))
    except Exception as e:  # corrupt json, unknown component
        raise ModelLoadError(f"cannot read {tj}: {e}") from e
    return tk, spec


def _read_json(p: Path) -> dict:
    """A config file's JSON, or ``{}`` when it is missing or unreadable."""
    if p.is_file():
        try:
            return json.loads(p.read_text(encoding="utf-8"))
        except Exception:
            return {}
    return {}


def _tokens_and_types(tk: Any, spec: dict, vocab: dict[str, int]
                      ) -> tuple[list[str], list[int], dict[int, dict]]:
    """Entries by id (added tokens by their content), their types (special added tokens are
    control, other added tokens user-defined, ``<0xXX>`` entries byte tokens) and the added
    tokens of ``tokenizer.json`` by id."""
    n = tk.get_vocab_size(with_added_tokens=True)
    n = max(n, max(vocab.values()) + 1 if vocab else 0)
    id_to_tok = [""] * n
    for t, i in vocab.items():
        id_to_tok[i] = t
    added = {int(a["id"]): a for a in spec.get("added_tokens", [])}
    types = [TT_NORMAL] * n
    for i, a in added.items():
        if i < n:
            types[i] = TT_CONTROL if a.get("special") else TT_USER_DEFINED
            id_to_tok[i] = a["content"]
    for i, t in enumerate(id_to_tok):
        if types[i] == TT_NORMAL and parse_byte_token(t) is not None:
            types[i] = TT_BYTE
    return id_to_tok, types, added


def _set_bos_eos(parts: VocabParts, tk: Any, tcfg: dict, cfg: dict, vocab: dict[str, int]
                 ) -> None:
    """BOS/EOS ids (``tokenizer_config.json`` tokens, else ``config.json`` ids) and whether
    they are added (what the post-processor does to ``"a"``, unless the tokenizer config's
    ``add_bos_token``/``add_eos_token`` says otherwise)."""
    def tok_id(v: Any) -> int | None:
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            return vocab.get(v)
        return None

    parts.bos_id = tok_id(tcfg.get("bos_token"))
    parts.eos_id = tok_id(tcfg.get("eos_token"))
    if parts.bos_id is None and isinstance(cfg.get("bos_token_id"), int):
        parts.bos_id = cfg["bos_token_id"]
    if parts.eos_id is None and isinstance(cfg.get("eos_token_id"), int):
        parts.eos_id = cfg["eos_token_id"]
    # does the post-processor add BOS / EOS?
    with_sp = tk.encode("a", add_special_tokens=True).ids
    without = tk.encode("a", add_special_tokens=False).ids
    parts.add_bos = (parts.bos_id is not None and len(with_sp) > len(without)
                     and with_sp[0] == parts.bos_id)
    if "add_bos_token" in tcfg and parts.bos_id is not None:
        parts.add_bos = bool(tcfg["add_bos_token"])
    parts.add_eos = (parts.eos_id is not None and len(with_sp) > len(without)
                     and with_sp[-1] == parts.eos_id)
    if "add_eos_token" in tcfg and parts.eos_id is not None:
        parts.add_eos = bool(tcfg["add_eos_token"])


def _eog_ids(parts: VocabParts, cfg: dict, gcfg: dict, added: dict[int, dict]) -> set[int]:
    """End-of-generation ids: ``eos_token_id`` of ``config.json`` and
    ``generation_config.json`` (an id or a list), EOS, and the added tokens llama.cpp's
    text-based detection would pick (the ones HF treats as tokens of their own)."""
    n = len(parts.tokens)
    eog = set()
    for src in (cfg, gcfg):
        v = src.get("eos_token_id")
        for x in (v if isinstance(v, list) else [v]):
            if isinstance(x, int) and 0 <= x < n:
                eog.add(x)
    if parts.eos_id is not None:
        eog.add(parts.eos_id)
    eos_id = parts.eos_id
    detected = llamacpp_special_fixups(
        parts.tokens, list(parts.types),
        lambda key: eos_id if key.endswith("eos_token_id") else None)
    eog |= {i for i in detected if i in added}
    return eog
