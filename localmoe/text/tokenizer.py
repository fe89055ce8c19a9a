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
  port of that algorithm (:class:`_SpmModel`): exact, and free of the ~10 s it took to express a
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
of their concatenation (invalid sequences replaced by U+FFFD). :class:`IncrementalDetokenizer`
streams the same text in valid UTF-8 pieces.
"""

from __future__ import annotations

import codecs
import json
import threading
from pathlib import Path
from typing import Any, Iterable

from localmoe.errors import InvalidRequestError, ModelLoadError, UnsupportedModelError

__all__ = ["Tokenizer", "IncrementalDetokenizer", "TURN_END_TOKENS", "PRE_TOKENIZER_REGEXES"]

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

# Pre-tokenizer regexes by llama.cpp pre-type (applied in order, each splitting the pieces of the
# previous one, matches and gaps both kept).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|"
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|"
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK3 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|"
    r" ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)

PRE_TOKENIZER_REGEXES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "llama3": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "smollm": (r"\p{N}", _GPT2),
    "gpt2": (_GPT2,),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"),
    "gpt4o": (_GPT4O,),
    "tekken": (_TEKKEN,),
    "deepseek3": _DEEPSEEK3,
    "chatglm4": (_LLAMA3,),
    "deepseek-llm": (
        r"[\r\n]",
        # (escapes where NFC would change the character: U+1F7D, U+1FBE, U+1FD3, U+1FDB,
        # U+2126, U+212A)
        "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚ"
        "Ḁ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ"
        "\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ"
        "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
        "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
        r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
        r"\s+$",
        r"[一-龥ࠀ-一가-퟿]+",
        r"\p{N}+",
    ),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"),
    "poro": (r" ?[^(\s|.,!?…。，、।۔،)]+",),
    "viking": (r" ?[^(\s|.,!?…。，、।۔،)]+", r"\p{N}"),
    "seed-coder": (
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
        r"\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "bailingmoe": (
        r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
        r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    ),
}

# tokenizer.ggml.pre name -> (regex family, ignore_merges, add_bos default), as llama.cpp's
# llama_vocab::impl::load maps them (the file's add_bos_token key overrides the default).
_PRE_ALIASES: dict[str, tuple[str, bool, bool]] = {"default": ("default", False, False)}
for _names, _fam, _ign, _bos in (
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
     "llama3", True, True),
    (("dbrx", "smaug-bpe"), "llama3", False, False),
    (("qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2", "hunyuan", "grok-2"),
     "qwen2", False, False),
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
     "smollm", False, False),
    (("gpt2", "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
      "a.x-4.0", "mellum", "exaone4", "mpt", "olmo", "jais", "trillion", "granite-docling"),
     "gpt2", False, False),
    (("falcon",), "falcon", False, False),
    (("gpt-4o", "llama4", "minimax-m2"), "gpt4o", False, False),
    (("tekken",), "tekken", True, True),
    (("deepseek-v3", "hunyuan-dense"), "deepseek3", False, False),
    (("chatglm-bpe", "glm4"), "chatglm4", False, False),
    (("deepseek-llm",), "deepseek-llm", False, False),
    (("deepseek-coder",), "deepseek-coder", False, False),
    (("poro-chat", "bloom", "gpt3-finnish"), "poro", False, False),
    (("viking",), "viking", False, False),
    (("seed-coder",), "seed-coder", False, False),
    (("bailingmoe", "bailingmoe2", "llada-moe"), "bailingmoe", False, False),
):
    for _n in _names:
        _PRE_ALIASES[_n] = (_fam, _ign, _bos)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table (256 entries)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_ENCODER = _bytes_to_unicode()
_BYTE_DECODER = {c: b for b, c in _BYTE_ENCODER.items()}
_SPM_SPACE = "\u2581"


def _byte_level_to_bytes(text: str) -> bytes:
    """Undo GPT-2's byte-to-unicode mapping (characters outside the table are kept as UTF-8)."""
    out = bytearray()
    for ch in text:
        b = _BYTE_DECODER.get(ch)
        if b is None:
            out += ch.encode("utf-8")
        else:
            out.append(b)
    return bytes(out)


def _parse_byte_token(text: str) -> int | None:
    """``"<0x0A>"`` -> 10, anything else -> None."""
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return int(text[3:5], 16)
        except ValueError:
            return None
    return None


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
        self._tk = None  # tokenizers.Tokenizer running the model on raw fragments
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
            model_file: a ``localmoe.io.loader.ModelFile``; GGUF files use ``.metadata``, HF
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
        """Build from a GGUF metadata dict (``tokenizer.ggml.*`` keys, arrays as lists).

        Raises:
            ModelLoadError: tokens/merges missing or inconsistent.
            UnsupportedModelError: unknown ``tokenizer.ggml.model`` or ``tokenizer.ggml.pre``.
        """
        md = metadata
        model = md.get("tokenizer.ggml.model")
        tokens = md.get("tokenizer.ggml.tokens")
        if model is None or not tokens:
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
        self = cls()
        self.vocab_size = n
        self._tokens = tokens
        self._types = types
        pre_default_add_bos = False
        if model == "gpt2":
            self.kind = "bpe"
            pre = md.get("tokenizer.ggml.pre") or "default"
            if pre not in _PRE_ALIASES:
                raise UnsupportedModelError(
                    f"unsupported pre-tokenizer tokenizer.ggml.pre={pre!r}; known: "
                    f"{', '.join(sorted(_PRE_ALIASES))}"
                )
            family, ignore_merges, pre_default_add_bos = _PRE_ALIASES[pre]
            merges = md.get("tokenizer.ggml.merges")
            if not merges:
                raise ModelLoadError("byte-level BPE vocabulary without tokenizer.ggml.merges")
            self._tk = _build_bpe(tokens, merges, PRE_TOKENIZER_REGEXES[family], ignore_merges)
            tokset = set(tokens)
            self._missing_bytes = frozenset(b for b, c in _BYTE_ENCODER.items() if c not in tokset)
            self.add_space_prefix = False
        elif model == "llama":
            self.kind = "spm"
            scores = md.get("tokenizer.ggml.scores") or [0.0] * n
            if len(scores) != n:
                raise ModelLoadError(
                    f"tokenizer.ggml.scores has {len(scores)} entries but there are {n} tokens"
                )
            unk = md.get("tokenizer.ggml.unknown_token_id")
            self._tk = _SpmModel(tokens, [float(s) for s in scores],
                                 int(unk) if unk is not None and 0 <= int(unk) < n else None)
            self._missing_bytes = frozenset(
                b for b in range(256) if self._tk.byte_ids[b] is None)
            asp = md.get("tokenizer.ggml.add_space_prefix")
            self.add_space_prefix = True if asp is None else bool(asp)
            pre_default_add_bos = True
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

        self.bos_id = tid("tokenizer.ggml.bos_token_id")
        self.eos_id = tid("tokenizer.ggml.eos_token_id")
        add_bos = md.get("tokenizer.ggml.add_bos_token")
        add_eos = md.get("tokenizer.ggml.add_eos_token")
        self.add_bos = pre_default_add_bos if add_bos is None else bool(add_bos)
        self.add_eos = False if add_eos is None else bool(add_eos)
        if self.bos_id is None:
            self.add_bos = False
        if self.eos_id is None:
            self.add_eos = False

        types = list(types)
        self.eog_ids = _llamacpp_special_fixups(md, tokens, types, tid)
        self._types = types

        # token bytes (decode), as llama.cpp's token_to_piece(special=True)
        bl = []
        for text, tt in zip(tokens, types):
            if tt in (TT_CONTROL, TT_USER_DEFINED, TT_UNKNOWN):
                bl.append(text.encode("utf-8"))
            elif tt == TT_UNUSED:
                bl.append(b"")
            elif tt == TT_BYTE and _parse_byte_token(text) is not None:
                bl.append(bytes([_parse_byte_token(text)]))
            elif self.kind == "bpe":
                bl.append(_byte_level_to_bytes(text))
            else:
                bl.append(text.replace(_SPM_SPACE, " ").encode("utf-8"))
        self._bytes = bl

        # special-token partition (llama.cpp cache_special_tokens, longest text first)
        specials = [
            (text, i, tt == TT_USER_DEFINED)
            for i, (text, tt) in enumerate(zip(tokens, types))
            if tt in (TT_CONTROL, TT_USER_DEFINED, TT_UNKNOWN) and text
        ]
        specials.sort(key=lambda s: -len(s[0].encode("utf-8")))
        self._special_order = specials
        self._index_specials()
        return self

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        """Build from an HF model directory holding ``tokenizer.json`` (and optionally
        ``tokenizer_config.json``, ``config.json``, ``generation_config.json``).

        Raises:
            ModelLoadError: ``tokenizer.json`` missing or unreadable.
        """
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
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

        def read_json(name: str) -> dict:
            p = path / name
            if p.is_file():
                try:
                    return json.loads(p.read_text(encoding="utf-8"))
                except Exception:
                    return {}
            return {}

        tcfg, cfg, gcfg = (read_json("tokenizer_config.json"), read_json("config.json"),
                           read_json("generation_config.json"))
        self = cls()
        self.kind = "hf"
        self._tk = tk
        n = tk.get_vocab_size(with_added_tokens=True)
        vocab = tk.get_vocab(with_added_tokens=True)
        n = max(n, max(vocab.values()) + 1 if vocab else 0)
        self.vocab_size = n
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
            if types[i] == TT_NORMAL and _parse_byte_token(t) is not None:
                types[i] = TT_BYTE
        self._tokens, self._types = id_to_tok, types
        dec = json.dumps(spec.get("decoder") or {})
        byte_level = '"ByteLevel"' in dec
        norm = json.dumps(spec.get("normalizer") or {}) + json.dumps(spec.get("pre_tokenizer") or {})
        self.add_space_prefix = ('"Prepend"' in norm) or (
            '"Metaspace"' in norm and '"never"' not in norm and '"add_prefix_space": false' not in norm
        )
        bl = []
        for t, tt in zip(id_to_tok, types):
            if tt in (TT_CONTROL, TT_USER_DEFINED):
                bl.append(t.encode("utf-8"))
            elif tt == TT_BYTE:
                bl.append(bytes([_parse_byte_token(t)]))
            elif byte_level:
                bl.append(_byte_level_to_bytes(t))
            else:
                bl.append(t.replace(_SPM_SPACE, " ").encode("utf-8"))
        self._bytes = bl

        def tok_id(v: Any) -> int | None:
            if isinstance(v, dict):
                v = v.get("content")
            if isinstance(v, str):
                return vocab.get(v)
            return None

        self.bos_id = tok_id(tcfg.get("bos_token"))
        self.eos_id = tok_id(tcfg.get("eos_token"))
        if self.bos_id is None and isinstance(cfg.get("bos_token_id"), int):
            self.bos_id = cfg["bos_token_id"]
        if self.eos_id is None and isinstance(cfg.get("eos_token_id"), int):
            self.eos_id = cfg["eos_token_id"]
        # does the post-processor add BOS / EOS?
        with_sp = tk.encode("a", add_special_tokens=True).ids
        without = tk.encode("a", add_special_tokens=False).ids
        self.add_bos = (self.bos_id is not None and len(with_sp) > len(without)
                        and with_sp[0] == self.bos_id)
        if "add_bos_token" in tcfg and self.bos_id is not None:
            self.add_bos = bool(tcfg["add_bos_token"])
        self.add_eos = (self.eos_id is not None and len(with_sp) > len(without)
                        and with_sp[-1] == self.eos_id)
        if "add_eos_token" in tcfg and self.eos_id is not None:
            self.add_eos = bool(tcfg["add_eos_token"])
        eog = set()
        for src in (cfg, gcfg):
            v = src.get("eos_token_id")
            for x in (v if isinstance(v, list) else [v]):
                if isinstance(x, int) and 0 <= x < n:
                    eog.add(x)
        if self.eos_id is not None:
            eog.add(self.eos_id)
        # llama.cpp's text-based detection, limited to added tokens (the ones HF treats as
        # tokens of their own)
        eos_id = self.eos_id
        detected = _llamacpp_special_fixups(
            {}, id_to_tok, list(types), lambda key: eos_id if key.endswith("eos_token_id") else None)
        eog |= {i for i in detected if i in added}
        self.eog_ids = eog
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
            return self._tk.encode(text.replace(" ", _SPM_SPACE))
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
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # lone surrogates: undecodable bytes from argv/stdin/JSON
            raise InvalidRequestError(
                f"the text is not valid UTF-8 (an undecodable byte or a lone surrogate at "
                f"character {e.start})", "prompt") from None
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
        if self.kind == "spm" and _SPM_SPACE in text:
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


def _llamacpp_special_fixups(md: dict, tokens: list[str], types: list[int], tid) -> set[int]:
    """Mirror llama.cpp's special-token auto-detection (``llama_vocab::impl::load``).

    Tokens found by text (EOT, EOM, FIM, end-of-generation texts) become control tokens in
    ``types`` (modified in place); gpt-oss channel tokens become user-defined. Returns the
    end-of-generation id set: eos, eot, eom, FIM pad/repo/sep and the :data:`TURN_END_TOKENS`
    present, minus llama.cpp's two exceptions (``<|end|>`` next to ``<|return|>``/``<|call|>``,
    ``</s>`` next to ``<|tool_response>``).
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


def _build_bpe(tokens: list[str], merges: list[str], regexes: tuple[str, ...],
               ignore_merges: bool):
    """A ``tokenizers`` byte-level BPE pipeline equal to llama.cpp's for these regexes."""
    from tokenizers import Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab[t] = i
    # Byte symbols the vocabulary lacks get placeholder ids past its end: they stay symbols
    # that block merges across them (as in llama.cpp) and are dropped from the output.
    extra = len(tokens)
    for b in range(256):
        c = _BYTE_ENCODER[b]
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


class _SpmModel:
    """llama.cpp's SentencePiece tokenizer (``llm_tokenizer_spm_session``) on one fragment.

    Symbols start as the fragment's characters; the adjacent pair whose concatenation is a
    vocabulary entry with the highest score is merged first (leftmost on ties), until no pair
    merges. A final symbol outside the vocabulary becomes its UTF-8 bytes as ``<0xXX>`` tokens
    (byte fallback; the unknown token when the vocabulary has no byte tokens). This is exact
    (including score ties) and needs no build step, which matters for 256k-entry vocabularies:
    expressing it as ``tokenizers`` BPE merges took ~10 s per load.
    """

    def __init__(self, tokens: list[str], scores: list[float], unk_id: int | None):
        self.vocab: dict[str, int] = {}
        for i, t in enumerate(tokens):
            self.vocab[t] = i
        self.scores = scores
        self.byte_ids = [self.vocab.get(f"<0x{b:02X}>") for b in range(256)]
        self.unk_id = unk_id

    def encode(self, text: str) -> list[int]:
        import heapq

        vocab, scores = self.vocab, self.scores
        syms = list(text)
        n = len(syms)
        if n == 0:
            return []
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prev = list(range(-1, n - 1))
        heap: list = []
        push = heapq.heappush

        for i in range(n - 1):
            t = syms[i] + syms[i + 1]
            tid = vocab.get(t)
            if tid is not None:
                heap.append((-scores[tid], i, t))
        heapq.heapify(heap)
        pop = heapq.heappop
        while heap:
            _, left, t = pop(heap)
            right = nxt[left]
            if right < 0 or not syms[left] or syms[left] + syms[right] != t:
                continue  # stale
            syms[left] = t
            syms[right] = ""
            nr = nxt[right]
            nxt[left] = nr
            if nr >= 0:
                prev[nr] = left
            pl = prev[left]
            if pl >= 0:
                t2 = syms[pl] + t
                tid = vocab.get(t2)
                if tid is not None:
                    push(heap, (-scores[tid], pl, t2))
            if nr >= 0:
                t2 = t + syms[nr]
                tid = vocab.get(t2)
                if tid is not None:
                    push(heap, (-scores[tid], left, t2))
        out: list[int] = []
        i = 0
        while i >= 0:
            sym = syms[i]
            tid = vocab.get(sym)
            if tid is not None:
                out.append(tid)
            else:
                for b in sym.encode("utf-8"):
                    bid = self.byte_ids[b]
                    if bid is None:
                        bid = self.unk_id
                    if bid is not None:
                        out.append(bid)
            i = nxt[i]
        return out


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that are always valid UTF-8.

    Bytes of an incomplete UTF-8 sequence (a character split across tokens, e.g. emoji in
    byte-fallback tokens) are held back until completed; invalid bytes become U+FFFD exactly as
    :meth:`Tokenizer.decode` does, so ``"".join(push(i) for i in ids) + flush() ==
    tokenizer.decode(ids, skip_special, strip_prefix_space=False)``. Spaces are never lost
    (SentencePiece U+2581 pieces are decoded per token as " ").

    Args:
        tokenizer: the :class:`Tokenizer`.
        skip_special: drop control / unknown / unused tokens from the text (default False,
            like ``decode``). The engine stops on end-of-generation tokens before pushing them.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""  # everything emitted so far

    def push(self, token_id: int) -> str:
        """Add one token; returns the new text (maybe ``""``)."""
        if self.skip_special and self.tokenizer.is_special(token_id):
            return ""
        delta = self._dec.decode(self.tokenizer.token_bytes(token_id), final=False)
        self.text += delta
        return delta

    def flush(self) -> str:
        """End of stream: returns held-back bytes (as U+FFFD if they never completed)."""
        delta = self._dec.decode(b"", final=True)
        self._dec.reset()
        self.text += delta
        return delta
