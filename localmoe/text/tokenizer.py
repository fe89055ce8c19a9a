"""Tokenizer for GGUF vocabularies and Hugging Face ``tokenizer.json`` files.

Token ids are meant to be identical to llama.cpp's tokenizer on the same GGUF file
(``src/llama-vocab.cpp``), which is what users compare us with:

* ``tokenizer.ggml.model == "gpt2"`` -- byte-level BPE. The text is split by the pre-tokenizer
  regexes named by ``tokenizer.ggml.pre`` (same expressions, same order as llama.cpp's
  ``llm_tokenizer_bpe``), each piece is mapped to GPT-2's byte-to-unicode alphabet and merged by
  rank with the file's ``tokenizer.ggml.merges``. ``llama-bpe``/``llama3`` (and ``tekken``) use
  ``ignore_merges``: a piece that is a whole vocabulary entry is emitted as is.
* ``tokenizer.ggml.model == "llama"`` -- SentencePiece BPE with byte fallback (Llama-2, Gemma).
  Spaces become U+2581, an optional space prefix is added, and symbols (UTF-8 characters) are
  merged greedily by the *score* of the merged piece (highest first, leftmost on ties); a symbol
  left outside the vocabulary becomes ``<0xXX>`` byte tokens. This runs as a small heap-based
  port of that algorithm (:class:`~localmoe.text.spm.SpmModel`): exact, and free of the ~10 s it took to express a
  256k-entry vocabulary as ``tokenizers`` BPE merges at every load.

Byte-level BPE runs on the ``tokenizers`` library (Rust); its regex engine (Oniguruma) and
llama.cpp's own Unicode tables can disagree on the category of very recent code points (seen:
U+11BC5), which is the one known source of id differences (about 4 in 10,000 random strings of
exotic characters; none on ordinary text). Before the model runs, the text is
partitioned on special-token text the way llama.cpp's ``tokenizer_st_partition`` does: control
and unknown tokens are matched only when ``parse_special=True``; user-defined tokens
(token_type 4) always. Longer special texts are matched first.

A ``tokenizer.json`` (HF model directory) is run through ``tokenizers`` directly; tokens marked
``special`` are "control" tokens here and follow the same ``parse_special`` rule.

Decoding works on bytes: :meth:`Tokenizer.token_bytes` gives each token's bytes (byte-level
alphabet undone, U+2581 back to a space, ``<0xXX>`` to its byte), and text is the UTF-8 decoding
of their concatenation (invalid sequences replaced by U+FFFD).
:class:`~localmoe.text.detokenizer.IncrementalDetokenizer` streams the same text in valid UTF-8
pieces.

Layout: this module holds :class:`Tokenizer` (encode, decode, queries); the vocabulary loaders
are :mod:`localmoe.text.vocab_gguf` and :mod:`localmoe.text.vocab_hf`, with the shared pieces in
:mod:`localmoe.text.vocab` (token types, special-token detection), :mod:`localmoe.text.bytelevel`
and :mod:`localmoe.text.pretokenizers`.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Iterable

from localmoe.errors import require_utf8
from localmoe.text.bytelevel import SPM_SPACE
from localmoe.text.vocab import (TT_BYTE, TT_CONTROL, TT_NORMAL, TT_UNKNOWN, TT_UNUSED,
                                 VocabParts)
from localmoe.text.vocab_gguf import load_gguf_vocab
from localmoe.text.vocab_hf import load_hf_vocab

__all__ = ["Tokenizer"]


class Tokenizer:
    """Text <-> token ids for one model.

    Build with :meth:`from_model` (a loaded ``ModelFile``), :meth:`from_gguf_metadata` (a GGUF
    metadata dict) or :meth:`from_hf_dir` (a directory with ``tokenizer.json``).

    Attributes:
        vocab_size: number of token ids (int).
        bos_id / eos_id: ids of the BOS / EOS tokens, or None.
        eog_ids: set of ids that end generation (eos, eot, eom and turn-ending control tokens).
        add_bos: whether :meth:`encode` with ``add_special=True`` prepends BOS.
        add_eos: whether :meth:`encode` with ``add_special=True`` appends EOS.
        kind: ``"bpe"`` (byte-level), ``"spm"`` (SentencePiece-style) or ``"hf"``.
    """

    def __init__(self) -> None:  # use the from_* constructors
        self._tk = None  # runs the model on raw fragments: tokenizers.Tokenizer or SpmModel
        self._lock = threading.Lock()
        self.kind = ""
        self.vocab_size = 0
        self.bos_id: int | None = None
        self.eos_id: int | None = None
        self.eog_ids: set[int] = set()
        self.add_bos = False
        self.add_eos = False
        self.add_space_prefix = False
        self._tokens: list[str] = []
        self._types: list[int] = []
        self._bytes: list[bytes] = []
        self._special_order: list[tuple[str, int, bool]] = []  # (text, id, always_parsed)
        self._special_by_first: dict[str, list[int]] = {}
        self._text_to_id: dict[str, int] | None = None
        self._missing_bytes: frozenset[int] = frozenset()  # bytes the vocabulary cannot spell

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_model(cls, model_file: Any) -> "Tokenizer":
        """Build the tokenizer of a loaded model.

        Args:
            model_file: a ``localmoe.io.model_file.ModelFile``; GGUF files use ``.metadata``, HF
                directories (``.format == "safetensors"``) their ``tokenizer.json``.
        Raises:
            ModelLoadError: no usable vocabulary in the model.
            UnsupportedModelError: a tokenizer type or pre-tokenizer localmoe does not know.
        """
        fmt = getattr(model_file, "format", "gguf")
        if fmt == "safetensors":
            return cls.from_hf_dir(Path(model_file.path))
        return cls.from_gguf_metadata(model_file.metadata)

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any]) -> "Tokenizer":
        """Build from a GGUF metadata dict (``tokenizer.ggml.*`` keys, arrays as lists); see
        :mod:`localmoe.text.vocab_gguf`.

        Raises:
            ModelLoadError: tokens/merges missing or inconsistent.
            UnsupportedModelError: unknown ``tokenizer.ggml.model`` or ``tokenizer.ggml.pre``.
        """
        return cls._from_parts(load_gguf_vocab(metadata))

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        """Build from an HF model directory holding ``tokenizer.json`` (and optionally
        ``tokenizer_config.json``, ``config.json``, ``generation_config.json``); see
        :mod:`localmoe.text.vocab_hf`.

        Raises:
            ModelLoadError: ``tokenizer.json`` missing or unreadable.
        """
        return cls._from_parts(load_hf_vocab(path))

    @classmethod
    def _from_parts(cls, parts: VocabParts) -> "Tokenizer":
        """A tokenizer over a vocabulary a loader built."""
        self = cls()
        self.kind = parts.kind
        self._tk = parts.model
        self.vocab_size = len(parts.tokens)
        self._tokens, self._types, self._bytes = parts.tokens, parts.types, parts.token_bytes
        self.bos_id, self.eos_id, self.eog_ids = parts.bos_id, parts.eos_id, parts.eog_ids
        self.add_bos, self.add_eos = parts.add_bos, parts.add_eos
        self.add_space_prefix = parts.add_space_prefix
        self._missing_bytes = parts.missing_bytes
        self._special_order = parts.specials
        self._index_specials()
        return self

    # ------------------------------------------------------------------ queries
    def token_bytes(self, token_id: int) -> bytes:
        """Bytes of one token as it appears in decoded text (control tokens: their text).

        Raises:
            IndexError: id outside ``[0, vocab_size)``.
        """
        if not 0 <= token_id < len(self._bytes):
            raise IndexError(f"token id {token_id} outside the vocabulary (0..{self.vocab_size - 1})")
        return self._bytes[token_id]

    @property
    def max_token_chars(self) -> int:
        """The most characters one token stands for (the byte length of the longest token's
        text, at least 1): a text of more than ``n * max_token_chars`` characters cannot be
        encoded in ``n`` tokens."""
        m = getattr(self, "_max_chars", None)
        if m is None:
            m = max([1] + [len(b) for b in self._bytes] + [len(t.encode("utf-8", "replace"))
                                                            for t in self._tokens])
            self._max_chars = m
        return m

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry of a token as stored (byte-level / U+2581 form)."""
        return self._tokens[token_id]

    def token_to_id(self, text: str) -> int | None:
        """Id of the vocabulary entry ``text`` (stored form; the last one if duplicated, as in
        llama.cpp), or None."""
        if self._text_to_id is None:
            self._text_to_id = {t: i for i, t in enumerate(self._tokens)}
        return self._text_to_id.get(text)

    def is_control(self, token_id: int) -> bool:
        """True for control tokens (GGUF token_type 3 / HF ``special`` added tokens)."""
        return 0 <= token_id < len(self._types) and self._types[token_id] == TT_CONTROL

    def is_special(self, token_id: int) -> bool:
        """True for control, unknown and unused tokens (what ``skip_special`` drops)."""
        return 0 <= token_id < len(self._types) and self._types[token_id] in (
            TT_CONTROL, TT_UNKNOWN, TT_UNUSED)

    @property
    def control_ids(self) -> set[int]:
        """All control token ids (e.g. for the sampler's penalty exemption)."""
        return {i for i, t in enumerate(self._types) if t == TT_CONTROL}

    # ------------------------------------------------------------------ encode
    def _index_specials(self) -> None:
        """Group the partition order by first character (a cheap pre-filter for _partition)."""
        by_first: dict[str, list[int]] = {}
        for k, (text, _, _) in enumerate(self._special_order):
            by_first.setdefault(text[0], []).append(k)
        self._special_by_first = by_first

    def _partition(self, text: str, parse_special: bool,
                   plain_spans: list[tuple[int, int]] = ()) -> list[str | int]:
        """Split ``text`` into raw fragments (str) and special token ids (int), llama.cpp style
        (``tokenizer_st_partition``): for each special token, longest text first, split every
        raw fragment on its occurrences. Control tokens are matched only if ``parse_special``,
        and never inside ``plain_spans`` (character ranges that must stay text)."""
        frags: list[tuple[int, int] | int] = [(0, len(text))]
        by_first = self._special_by_first
        cand = sorted(k for ch in set(text) if ch in by_first for k in by_first[ch])
        order = self._special_order
        for k in cand:
            stext, sid, always = order[k]
            if not (always or parse_special):
                continue
            if stext not in text:
                continue
            out: list[tuple[int, int] | int] = []
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                    continue
                start, end = f
                pos = start
                while True:
                    j = text.find(stext, pos, end)
                    if j < 0:
                        break
                    k = j + len(stext)
                    if not always and any(a < k and j < b for a, b in plain_spans):
                        pos = j + 1  # user text, not a token: look further
                        continue
                    if j > start:
                        out.append((start, j))
                    out.append(sid)
                    start = pos = k
                if start < end:
                    out.append((start, end))
            frags = out
        return [f if isinstance(f, int) else text[f[0]:f[1]] for f in frags]

    def _encode_raw(self, text: str, is_first: bool) -> list[int]:
        if self.kind == "spm":
            if self.add_space_prefix and is_first:
                text = " " + text
            return self._tk.encode(text.replace(" ", SPM_SPACE))
        ids = self._tk.encode(text, add_special_tokens=False).ids
        if self._missing_bytes:
            n = self.vocab_size
            ids = [i for i in ids if i < n]  # bytes the vocabulary cannot spell (llama.cpp drops them)
        return ids

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False,
               plain_spans: list[tuple[int, int]] = ()) -> list[int]:
        """Text -> token ids.

        Args:
            text: the text (str).
            add_special: prepend BOS / append EOS as the model's flags say (``add_bos``,
                ``add_eos``). Pass False when the chat template already emitted BOS
                (see ``ChatTemplate.renders_bos``).
            parse_special: if True, control-token text in ``text`` (``<|im_end|>``) becomes the
                control token; if False (default) it is encoded as plain text. User-defined
                tokens are matched either way (as llama.cpp does).
            plain_spans: with ``parse_special``, character ranges ``(start, end)`` of ``text``
                where control-token text stays plain text (user content inside a rendered
                chat, see ``ChatTemplate.encode``).
        Returns:
            list of int token ids.

        Raises:
            InvalidRequestError: ``text`` holds characters UTF-8 cannot encode (lone
                surrogates, which is how Python carries undecodable input bytes).
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() expects str, got {type(text).__name__}")
        require_utf8(text, "the text", "prompt")
        ids: list[int] = []
        if add_special and self.add_bos:
            ids.append(self.bos_id)
        if self.kind == "hf":
            ids.extend(self._encode_hf(text, parse_special, plain_spans))
        else:
            prev_special = True
            for f in self._partition(text, parse_special, plain_spans) if text else []:
                if isinstance(f, int):
                    ids.append(f)
                    prev_special = True
                else:
                    ids.extend(self._encode_raw(f, prev_special))
                    prev_special = False
        if add_special and self.add_eos:
            ids.append(self.eos_id)
        return ids

    def _encode_hf(self, text: str, parse_special: bool, plain_spans) -> list[int]:
        if parse_special and plain_spans:
            out: list[int] = []
            pos = 0
            for a, b in sorted(plain_spans):
                if a > pos:
                    out.extend(self._encode_hf(text[pos:a], True, ()))
                out.extend(self._encode_hf(text[max(a, pos):b], False, ()))
                pos = max(pos, b)
            if pos < len(text):
                out.extend(self._encode_hf(text[pos:], True, ()))
            return out
        with self._lock:
            self._tk.encode_special_tokens = not parse_special
            try:
                return self._tk.encode(text, add_special_tokens=False).ids
            finally:
                self._tk.encode_special_tokens = False

    def encode_with_plain_spans(self, text: str, plain_spans: list[tuple[int, int]],
                                add_special: bool = True) -> list[int]:
        """Encode a rendered chat: control-token text is parsed except inside ``plain_spans``
        (the spans ``ChatTemplate.render_marked`` reports for user content)."""
        return self.encode(text, add_special=add_special, parse_special=True, plain_spans=plain_spans)

    def is_lossless(self, text: str) -> bool:
        """True when ``decode(encode(text)) == text`` is guaranteed byte-wise: every byte of
        ``text`` that may need byte fallback has a token. Some vocabularies lack a few byte
        tokens (SmolLM2: 0x04, 0xF1, ...); llama.cpp drops such bytes and so do we (the ids must
        match), so text using them does not round-trip."""
        if self.kind == "spm" and SPM_SPACE in text:
            return False  # a literal U+2581 is SentencePiece's space marker: it decodes as " "
        if not self._missing_bytes:
            return True
        return not any(b in self._missing_bytes for b in text.encode("utf-8"))

    def count(self, text: str) -> int:
        """Number of tokens of ``text`` as a plain completion prompt (with BOS if added)."""
        return len(self.encode(text))

    # ------------------------------------------------------------------ decode
    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        """Concatenated bytes of ``ids`` (see :meth:`token_bytes`)."""
        out = bytearray()
        for i in ids:
            if skip_special and self.is_special(i):
                continue
            out += self.token_bytes(i)
        return bytes(out)

    def decode(self, ids: Iterable[int], skip_special: bool = False,
               strip_prefix_space: bool | None = None) -> str:
        """Token ids -> text (UTF-8; invalid byte sequences become U+FFFD).

        Args:
            ids: token ids.
            skip_special: drop control / unknown / unused tokens (e.g. BOS, ``<|im_end|>``).
            strip_prefix_space: remove the one space a SentencePiece ``add_space_prefix``
                vocabulary puts before the first word (from the first ordinary token; default:
                ``add_space_prefix``), so that ``decode(encode(s)) == s``.
        """
        if strip_prefix_space is None:
            strip_prefix_space = self.add_space_prefix
        if not (strip_prefix_space and self.add_space_prefix):
            return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")
        out = bytearray()
        first = True
        for i in ids:
            special = self.is_special(i)
            if skip_special and special:
                continue
            piece = self.token_bytes(i)
            if first and not special:
                # llama.cpp's remove_space: the first word's prefix space is not text (only
                # ordinary pieces carry it; a user-defined token is text as it stands)
                if piece.startswith(b" ") and self._types[i] in (TT_NORMAL, TT_BYTE):
                    piece = piece[1:]
                first = False
            out += piece
        return bytes(out).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return (f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, bos={self.bos_id}, "
                f"eos={self.eos_id}, eog={sorted(self.eog_ids)}, add_bos={self.add_bos})")
