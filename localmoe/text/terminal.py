"""Model text shown on a terminal: control characters made visible instead of obeyed.

A model (a random-weight one readily) can emit ESC sequences, BEL, backspaces or C1 controls;
written to a terminal as they are they would move the cursor, recolour or clear the screen,
set the window title or ring the bell. :func:`visible_controls` renders them harmlessly: C0
controls and DEL as their Unicode control pictures (ESC -> U+241B, BEL -> U+2407, DEL ->
U+2421), C1 controls as ``<U+009B>`` (as ``less`` shows them); newline, tab and a carriage
return that ends a line (``\\r\\n``) stay. Only what is displayed changes: piped output, JSON,
the server and the stored chats keep the model's text exactly.
"""

from __future__ import annotations

import re

__all__ = ["visible_controls", "TerminalText"]

_TABLE: dict[int, str] = {c: chr(0x2400 + c) for c in range(0x20) if c not in (0x09, 0x0A, 0x0D)}
_TABLE[0x7F] = "\u2421"
_TABLE.update({c: f"<U+{c:04X}>" for c in range(0x80, 0xA0)})
_LONE_CR = re.compile(r"\r(?!\n)")


def visible_controls(text: str) -> str:
    """``text`` with its control characters rendered visibly (see the module docstring); a
    ``\\r`` not followed by ``\\n`` (which would overwrite the line) becomes U+240D."""
    if "\r" in text:
        text = _LONE_CR.sub("\u240d", text)
    return text.translate(_TABLE)


class TerminalText:
    """:func:`visible_controls` over a stream of pieces: a ``\\r`` that ends a piece waits for
    the next one (a ``\\r\\n`` split between two pieces stays a line end)."""

    def __init__(self) -> None:
        self._cr = False

    def feed(self, piece: str) -> str:
        """The displayable form of the next piece (possibly without its last ``\\r``)."""
        if self._cr:
            piece, self._cr = "\r" + piece, False
        if piece.endswith("\r"):
            piece, self._cr = piece[:-1], True
        return visible_controls(piece)

    def flush(self) -> str:
        """What is held back at the end of the stream."""
        held, self._cr = self._cr, False
        return "\u240d" if held else ""
