"""Streaming detokenization: token ids in, valid UTF-8 text deltas out."""

from __future__ import annotations

import codecs

from localmoe.text.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer"]


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
