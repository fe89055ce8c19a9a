"""Stop conditions: end-of-generation tokens and stop strings.

``StopChecker`` sits between the detokenizer and the stream. Stop strings may span several
tokens, so text that could be the start of a stop string is held back until it either
completes a stop string (then it is dropped, and everything before it emitted) or can no longer
become one (then it is emitted). Nothing of a stop string ever reaches the stream. When
generation ends for another reason (max_tokens, end-of-generation token, cancel), the caller
calls :meth:`StopChecker.flush` to release the held-back text.

The model's end-of-generation token set (eos, eot, eom and turn-ending control tokens such as
``<|im_end|>``, ``<end_of_turn>``) comes from ``Tokenizer.eog_ids``; such a token ends the
generation and its text is never emitted.
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["StopChecker"]


class StopChecker:
    """Tracks stop tokens and stop strings for one generation.

    Args:
        stop_strings: non-empty strings that end generation when they appear in the output
            (the stop string itself is not part of the output).
        eog_ids: token ids that end generation.

    Attributes:
        stopped: True once a stop token or string was seen.
        reason: ``"eog"`` / ``"stop_string"`` / None.
        matched: the stop string that matched, or the eog token id, or None.
    """

    def __init__(self, stop_strings: Iterable[str] = (), eog_ids: Iterable[int] = ()):
        if isinstance(stop_strings, str):
            stop_strings = (stop_strings,)
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.eog_ids = frozenset(int(i) for i in eog_ids)
        self._held = ""
        self._max_len = max((len(s) for s in self.stop_strings), default=0)
        self.stopped = False
        self.reason: str | None = None
        self.matched: str | int | None = None

    def push_token(self, token_id: int) -> bool:
        """Feed the next sampled token id (before detokenizing it).

        Returns:
            True if it is an end-of-generation token (do not detokenize or emit it).
        """
        if int(token_id) in self.eog_ids:
            self.stopped = True
            self.reason = "eog"
            self.matched = int(token_id)
            return True
        return False

    def push_text(self, delta: str) -> tuple[str, bool]:
        """Feed newly decoded text.

        Returns:
            ``(emit, stopped)``: text safe to show now (may be ``""``) and whether a stop
            string completed (then ``emit`` is the text before it and the rest is dropped).
        """
        if self.stopped:
            return "", True
        if not self.stop_strings:
            return delta, False
        buf = self._held + delta
        # earliest stop string occurrence (ties: the longer string)
        best = -1
        best_s = None
        for s in self.stop_strings:
            j = buf.find(s)
            if j >= 0 and (best < 0 or j < best or (j == best and len(s) > len(best_s))):
                best, best_s = j, s
        if best >= 0:
            self.stopped = True
            self.reason = "stop_string"
            self.matched = best_s
            self._held = ""
            return buf[:best], True
        # hold back the longest suffix of buf that is a proper prefix of some stop string
        hold = 0
        for k in range(min(len(buf), self._max_len - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stop_strings):
                hold = k
                break
        if hold:
            self._held = buf[-hold:]
            return buf[:-hold], False
        self._held = ""
        return buf, False

    @property
    def held(self) -> str:
        """Text currently held back as a possible stop-string prefix."""
        return self._held

    def flush(self) -> str:
        """Generation ended otherwise: release (and clear) the held-back text."""
        out, self._held = self._held, ""
        if self.reason == "stop_string":
            return ""
        return out
