"""Loading a GGUF vocabulary (``tokenizer.ggml.*`` metadata) the way llama.cpp does.

``tokenizer.ggml.model == "gpt2"`` becomes a ``tokenizers`` byte-level BPE pipeline split by the
pre-tokenizer regexes of ``tokenizer.ggml.pre`` (:mod:`localmoe.text.pretokenizers`);
``"llama"`` becomes a :class:`~localmoe.text.spm.SpmModel`. Special ids, the add-BOS/EOS flags,
llama.cpp's special-token detection and the special-token partition order follow
``llama_vocab::impl::load``.
"""

from __future__ import annotations

from typing import Any

from localmoe.errors import ModelLoadError, UnsupportedModelError
from localmoe.text.bytelevel import BYTE_ENCODER
from localmoe.text.pretokenizers import PRE_ALIASES, PRE_TOKENIZER_REGEXES
from localmoe.text.spm import SpmModel
from localmoe.text.vocab import (TT_CONTROL, TT_NORMAL, TT_UNKNOWN, TT_USER_DEFINED, VocabParts,
                                 llamacpp_special_fixups, token_bytes_table)

__all__ = ["load_gguf_vocab", "build_bpe"]


def load_gguf_vocab(md: dict[str, Any]) -> VocabParts:
    """The vocabulary of a GGUF metadata dict (``tokenizer.ggml.*`` keys, arrays as lists).

    Raises:
        ModelLoadError: tokens/merges missing or inconsistent.
        UnsupportedModelError: unknown ``tokenizer.ggml.model`` or ``tokenizer.ggml.pre``.
    """
    tokens, types = _read_tokens(md)
    n = len(tokens)
    model = md.get("tokenizer.ggml.model")
    if model == "gpt2":
        parts, default_add_bos = _load_bpe(md, tokens, types)
    elif model == "llama":
        parts, default_add_bos = _load_spm(md, tokens, types)
    else:
        raise UnsupportedModelError(
            f"unsupported tokenizer model tokenizer.ggml.model={model!r} "
            "(localmoe runs 'gpt2' byte-level BPE and 'llama' SentencePiece vocabularies)"
        )

    def tid(key: str) -> int | None:
        v = md.get(key)
        if v is None:
            return None
        v = int(v)
        return v if 0 <= v < n else None

    parts.bos_id = tid("tokenizer.ggml.bos_token_id")
    parts.eos_id = tid("tokenizer.ggml.eos_token_id")
    add_bos = md.get("tokenizer.ggml.add_bos_token")
    add_eos = md.get("tokenizer.ggml.add_eos_token")
    parts.add_bos = default_add_bos if add_bos is None else bool(add_bos)
    parts.add_eos = False if add_eos is None else bool(add_eos)
    if parts.bos_id is None:
        parts.add_bos = False
    if parts.eos_id is None:
        parts.add_eos = False

    types = list(types)
    parts.eog_ids = llamacpp_special_fixups(tokens, types, tid)
    parts.types = types
    parts.token_bytes = token_bytes_table(tokens, types, byte_level=parts.kind == "bpe")
    parts.specials = _special_order(tokens, types)
    return parts


def _read_tokens(md: dict[str, Any]) -> tuple[list[str], list[int]]:
    """``tokenizer.ggml.tokens`` as str and ``tokenizer.ggml.token_type`` as int (all normal
    when absent).

    Raises:
        ModelLoadError: no tokenizer model or tokens, or a token-type count that differs.
    """
    tokens = md.get("tokenizer.ggml.tokens")
    if md.get("tokenizer.ggml.model") is None or not tokens:
        raise ModelLoadError(
            "the model file has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens "
            "missing); re-convert it with llama.cpp's convert_hf_to_gguf.py"
        )
    tokens = [t if isinstance(t, str) else bytes(t).decode("utf-8", "replace") for t in tokens]
    n = len(tokens)
    types = md.get("tokenizer.ggml.token_type") or [TT_NORMAL] * n
    types = [int(t) for t in types]
    if len(types) != n:
        raise ModelLoadError(
            f"tokenizer.ggml.token_type has {len(types)} entries but there are {n} tokens; "
            "the file is corrupt"
        )
    return tokens, types


def _load_bpe(md: dict[str, Any], tokens: list[str], types: list[int]
              ) -> tuple[VocabParts, bool]:
    """Byte-level BPE parts and the pre-type's ``add_bos`` default.

    Raises:
        UnsupportedModelError: unknown ``tokenizer.ggml.pre``.
        ModelLoadError: no merges, or ``tokenizers`` refuses the vocabulary.
    """
    pre = md.get("tokenizer.ggml.pre") or "default"
    if pre not in PRE_ALIASES:
        raise UnsupportedModelError(
            f"unsupported pre-tokenizer tokenizer.ggml.pre={pre!r}; known: "
            f"{', '.join(sorted(PRE_ALIASES))}"
        )
    family, ignore_merges, default_add_bos = PRE_ALIASES[pre]
    merges = md.get("tokenizer.ggml.merges")
    if not merges:
        raise ModelLoadError("byte-level BPE vocabulary without tokenizer.ggml.merges")
    tk = build_bpe(tokens, merges, PRE_TOKENIZER_REGEXES[family], ignore_merges)
    tokset = set(tokens)
    missing = frozenset(b for b, c in BYTE_ENCODER.items() if c not in tokset)
    parts = VocabParts("bpe", tk, tokens, types, [], add_space_prefix=False,
                       missing_bytes=missing)
    return parts, default_add_bos


def _load_spm(md: dict[str, Any], tokens: list[str], types: list[int]
              ) -> tuple[VocabParts, bool]:
    """SentencePiece parts and the ``add_bos`` default (True).

    Raises:
        ModelLoadError: a score count that differs from the token count.
    """
    n = len(tokens)
    scores = md.get("tokenizer.ggml.scores") or [0.0] * n
    if len(scores) != n:
        raise ModelLoadError(
            f"tokenizer.ggml.scores has {len(scores)} entries but there are {n} tokens"
        )
    unk = md.get("tokenizer.ggml.unknown_token_id")
    spm = SpmModel(tokens, [float(s) for s in scores],
                   int(unk) if unk is not None and 0 <= int(unk) < n else None)
    missing = frozenset(b for b in range(256) if spm.byte_ids[b] is None)
    asp = md.get("tokenizer.ggml.add_space_prefix")
    parts = VocabParts("spm", spm, tokens, types, [],
                       add_space_prefix=True if asp is None else bool(asp), missing_bytes=missing)
    return parts, True


def _special_order(tokens: list[str], types: list[int]) -> list[tuple[str, int, bool]]:
    """Special-token partition order as llama.cpp's ``cache_special_tokens``: control,
    user-defined and unknown tokens with text, longest UTF-8 text first;
    ``(text, id, always_parsed)`` where user-defined tokens are always parsed."""
    specials = [
        (text, i, tt == TT_USER_DEFINED)
        for i, (text, tt) in enumerate(zip(tokens, types))
        if tt in (TT_CONTROL, TT_USER_DEFINED, TT_UNKNOWN) and text
    ]
    specials.sort(key=lambda s: -len(s[0].encode("utf-8")))
    return specials


def build_bpe(tokens: list[str], merges: list[str], regexes: tuple[str, ...],
              ignore_merges: bool) -> Any:
    """A ``tokenizers`` byte-level BPE pipeline equal to llama.cpp's for these regexes.

    Args:
        tokens: vocabulary entries by id (byte-level alphabet).
        merges: ``"a b"`` merge rules by rank (str or bytes); rules whose parts or result are
            not in the vocabulary are skipped.
        regexes: pre-tokenizer split expressions, applied in order.
        ignore_merges: emit a piece that is a whole vocabulary entry as is.
    Returns:
        a ``tokenizers.Tokenizer``.
    Raises:
        ModelLoadError: ``tokenizers`` refuses the vocabulary or merges.
    """
    from tokenizers import Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab[t] = i
    # Byte symbols the vocabulary lacks get placeholder ids past its end: they stay symbols
    # that block merges across them (as in llama.cpp) and are dropped from the output.
    extra = len(tokens)
    for b in range(256):
        c = BYTE_ENCODER[b]
        if c not in vocab:
            vocab[c] = extra
            extra += 1
    pairs = []
    for m in merges:
        if isinstance(m, bytes):
            m = m.decode("utf-8", "replace")
        k = m.find(" ", 1)
        if k < 0:
            continue
        a, b = m[:k], m[k + 1:]
        if a in vocab and b in vocab and (a + b) in vocab:
            pairs.append((a, b))
    try:
        model = models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges,
                           fuse_unk=False, byte_fallback=False)
    except Exception as e:
        raise ModelLoadError(f"cannot build the BPE vocabulary: {e}") from e
    tk = HFTokenizer(model)
    pts = [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in regexes]
    pts.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tk.pre_tokenizer = pre_tokenizers.Sequence(pts)
    tk.decoder = decoders.ByteLevel()
    return tk

