"""Size limits checked before a prompt is tokenized.

A text that could never fit in the context is refused before the tokenizer sees it (a 300 MB
prompt otherwise makes the tokenizer allocate gigabytes): one token stands for at most
``tokenizer.max_token_chars`` characters, so a prompt of more than ``n_ctx *
max_token_chars`` characters cannot be encoded in ``n_ctx`` tokens. The check counts
characters (Python ``len``), which never exceed the UTF-8 bytes, so it is exact for the bound
and costs nothing (the longest token counts at most :data:`MAX_TOKEN_CHARS`). Texts up to :data:`TOKENIZE_ANYWAY` characters are tokenized even above the
bound, so that a prompt a little too long gets its exact token count in the error. Documented
in docs/LIMITS.md.
"""

from __future__ import annotations

from typing import Any, Iterable

from localmoe.errors import ContextOverflowError, InvalidRequestError

#: texts up to this many characters are tokenized (for an exact count) even when they cannot fit
TOKENIZE_ANYWAY = 1 << 20

__all__ = ["MAX_TOKEN_CHARS", "TOKENIZE_ANYWAY", "prompt_char_limit", "check_text_fits", "message_chars",
           "check_token_ids", "check_vocab_fits"]


#: the longest token counted for the bound: a hostile vocabulary with one huge entry must not
#: lift the bound out of reach (no real vocabulary has a token this long)
MAX_TOKEN_CHARS = 4096


def _per_token(tokenizer: Any) -> int:
    return min(MAX_TOKEN_CHARS, max(1, int(getattr(tokenizer, "max_token_chars", 1) or 1)))


def prompt_char_limit(n_ctx: int, tokenizer: Any) -> int:
    """Characters above which a text cannot fit in ``n_ctx`` tokens of ``tokenizer``."""
    return int(n_ctx) * _per_token(tokenizer)


def check_text_fits(n_chars: int, n_ctx: int, tokenizer: Any, what: str = "prompt") -> None:
    """Refuse a text of ``n_chars`` characters that no tokenization fits in ``n_ctx`` tokens.

    Raises:
        ContextOverflowError: ``n_chars`` above :func:`prompt_char_limit` and above
            :data:`TOKENIZE_ANYWAY` (its ``n_prompt`` is the least number of tokens the text
            can take).
    """
    per = _per_token(tokenizer)
    if n_chars > max(int(n_ctx) * per, TOKENIZE_ANYWAY):
        n_min = -(-int(n_chars) // per)
        raise ContextOverflowError(
            n_min, n_ctx,
            f"the {what} is {n_chars:,} characters, at least {n_min:,} tokens (no token of this "
            f"model covers more than {per} characters), but the context holds {n_ctx} tokens",
            hint="shorten it or raise the context size (--ctx-size, n_ctx)")


def message_chars(messages: Iterable[Any]) -> int:
    """Characters of text in OpenAI-style ``messages`` (string contents and text parts)."""
    n = 0
    for m in messages or ():
        if not isinstance(m, dict):
            continue
        c = m.get("content")
        if isinstance(c, str):
            n += len(c)
        elif isinstance(c, list):
            for part in c:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    n += len(part["text"])
    return n


def check_vocab_fits(tokenizer: Any, model_file: Any) -> None:
    """Refuse a tokenizer that can produce ids past the embedding table (an HF tokenizer.json
    with more entries than config.json's ``vocab_size`` rows), before the weights load.

    Raises:
        ModelLoadError: both sizes named.
    """
    from localmoe.errors import ModelLoadError

    rows = getattr(getattr(model_file, "spec", None), "vocab_size", None)
    n = getattr(tokenizer, "vocab_size", None)
    if isinstance(rows, int) and isinstance(n, int) and n > rows:
        raise ModelLoadError(
            f"the tokenizer has {n} tokens but the model's embedding has {rows} rows: token ids past "
            f"the table cannot be looked up; the tokenizer does not belong to these weights")


def check_token_ids(ids: list[int], n_vocab: int) -> None:
    """Refuse token ids outside ``[0, n_vocab)`` (a prompt given as ids).

    Raises:
        InvalidRequestError: the first id out of range, with its position.
    """
    for i, t in enumerate(ids):
        if not 0 <= t < n_vocab:
            raise InvalidRequestError(
                f"token id {t} at position {i} of the prompt is outside the vocabulary "
                f"(0..{n_vocab - 1})", param="prompt")
