"""Vocabulary facts shared by the GGUF and Hugging Face tokenizer builders.

GGUF token types, llama.cpp's special-token auto-detection (``llama_vocab::impl::load`` in
``src/llama-vocab.cpp``: which texts end generation and which become control tokens) and the
bytes every vocabulary entry stands for when decoded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from localmoe.text.bytelevel import SPM_SPACE, byte_level_to_bytes, parse_byte_token

__all__ = ["TT_NORMAL", "TT_UNKNOWN", "TT_CONTROL", "TT_USER_DEFINED", "TT_UNUSED", "TT_BYTE",
           "TURN_END_TOKENS", "VocabParts", "llamacpp_special_fixups", "token_bytes_table"]

# GGUF token types (llama.cpp LLAMA_TOKEN_TYPE_*).
TT_NORMAL, TT_UNKNOWN, TT_CONTROL, TT_USER_DEFINED, TT_UNUSED, TT_BYTE = 1, 2, 3, 4, 5, 6

# Token texts llama.cpp (src/llama-vocab.cpp) auto-detects. Each detected token is made a
# control token (so its text in user content stays plain text) -- we mirror that exactly so that
# ids and the end-of-generation set match llama.cpp's.
TURN_END_TOKENS = (  # end of generation
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
)
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<end_of_utterance>")
_FIM_TEXTS = {  # metadata key suffix -> texts; pad/rep/sep also end generation
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "<|code_prefix|>",
                "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "<|code_suffix|>",
                "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "<|code_middle|>",
                "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss


def llamacpp_special_fixups(tokens: list[str], types: list[int],
                            tid: Callable[[str], int | None]) -> set[int]:
    """Mirror llama.cpp's special-token auto-detection (``llama_vocab::impl::load``).

    Tokens found by text (EOT, EOM, FIM, end-of-generation texts) become control tokens in
    ``types`` (modified in place); gpt-oss channel tokens become user-defined. Returns the
    end-of-generation id set: eos, eot, eom, FIM pad/repo/sep and the :data:`TURN_END_TOKENS`
    present, minus llama.cpp's two exceptions (``<|end|>`` next to ``<|return|>``/``<|call|>``,
    ``</s>`` next to ``<|tool_response>``).

    Args:
        tokens: vocabulary entries by id.
        types: token types by id (``TT_*``), updated in place.
        tid: metadata key (``"tokenizer.ggml.eot_token_id"``, ...) -> token id or None.
    """
    last_id = {t: i for i, t in enumerate(tokens)}  # llama.cpp's token_to_id keeps the last

    def make_control(i: int) -> None:
        if types[i] != TT_CONTROL:
            types[i] = TT_CONTROL

    def detect(key: str, texts) -> int | None:
        i = tid(key)
        if i is None:
            for t in texts:
                if t in last_id:
                    i = last_id[t]
                    break
            else:
                return None
            make_control(i)
        return i

    eot = detect("tokenizer.ggml.eot_token_id", _EOT_TEXTS)
    eom = detect("tokenizer.ggml.eom_token_id", ("<|eom_id|>",))
    fim = {name: detect(f"tokenizer.ggml.{name}_token_id", texts) for name, texts in _FIM_TEXTS.items()}
    eog: set[int] = {fim[n] for n in ("fim_pad", "fim_rep", "fim_sep") if fim[n] is not None}
    for t in TURN_END_TOKENS:
        i = last_id.get(t)
        if i is not None:
            eog.add(i)
            make_control(i)
    for t in _ALWAYS_RENDERED:
        i = last_id.get(t)
        if i is not None:
            types[i] = TT_USER_DEFINED
    for i in (tid("tokenizer.ggml.eos_token_id"), eot, eom):
        if i is not None:
            eog.add(i)
    texts = {tokens[i]: i for i in eog}
    if "<|end|>" in texts and (("<|return|>" in texts and "<|call|>" in texts)
                               or ("<|calls|>" in texts and "<|flush|>" in texts)):
        eog.discard(texts["<|end|>"])
        types[texts["<|end|>"]] = TT_USER_DEFINED
    if "<|tool_response>" in texts and "</s>" in texts:
        eog.discard(texts["</s>"])
        types[texts["</s>"]] = TT_NORMAL
    return eog


def token_bytes_table(tokens: list[str], types: list[int], byte_level: bool) -> list[bytes]:
    """Bytes of every token as it appears in decoded text, as llama.cpp's
    ``token_to_piece(special=True)``: control, user-defined and unknown tokens are their text,
    unused tokens nothing, ``<0xXX>`` byte tokens their byte, other entries their byte-level
    form undone (``byte_level``) or their SentencePiece form with U+2581 back to a space."""
    bl = []
    for text, tt in zip(tokens, types):
        if tt in (TT_CONTROL, TT_USER_DEFINED, TT_UNKNOWN):
            bl.append(text.encode("utf-8"))
        elif tt == TT_UNUSED:
            bl.append(b"")
        elif tt == TT_BYTE and parse_byte_token(text) is not None:
            bl.append(bytes([parse_byte_token(text)]))
        elif byte_level:
            bl.append(byte_level_to_bytes(text))
        else:
            bl.append(text.replace(SPM_SPACE, " ").encode("utf-8"))
    return bl


@dataclass
class VocabParts:
    """A loaded vocabulary, as the GGUF and HF loaders hand it to
    :class:`~localmoe.text.tokenizer.Tokenizer` (whose attributes of the same names it fills).

    Attributes:
        kind: ``"bpe"`` (byte-level), ``"spm"`` (SentencePiece-style) or ``"hf"``.
        model: what encodes a raw fragment: a ``tokenizers.Tokenizer`` (bpe, hf) or a
            :class:`~localmoe.text.spm.SpmModel` (spm).
        tokens: vocabulary entries by id (stored form); ``len(tokens)`` is the vocabulary size.
        types: token types by id (``TT_*``).
        token_bytes: decoded bytes of every token (:func:`token_bytes_table`).
        bos_id, eos_id: BOS / EOS ids or None.
        eog_ids: ids that end generation.
        add_bos, add_eos: whether encoding with ``add_special`` adds BOS / EOS.
        add_space_prefix: SentencePiece space prefix before the first word.
        missing_bytes: bytes the vocabulary cannot spell.
        specials: special-token partition order ``(text, id, always_parsed)``, longest text
            first (empty for ``hf``, where ``tokenizers`` matches special tokens itself).
    """

    kind: str
    model: Any
    tokens: list[str]
    types: list[int]
    token_bytes: list[bytes]
    bos_id: int | None = None
    eos_id: int | None = None
    eog_ids: set[int] = field(default_factory=set)
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool = False
    missing_bytes: frozenset[int] = frozenset()
    specials: list[tuple[str, int, bool]] = field(default_factory=list)
