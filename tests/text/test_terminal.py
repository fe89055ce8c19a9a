"""Model text shown on a terminal (localmoe/text/terminal.py) and `localmoe generate`'s
output on a terminal and through a pipe."""

from __future__ import annotations

import io

import pytest

from localmoe.engine.results import StreamEvent
from localmoe.text.terminal import TerminalText, visible_controls

HOSTILE = "a\x1b]2;PWNED\x07 \x1b[2J\x1b[31mred\x08\x7f \x9b31m\x00z"


def test_controls_are_shown_not_obeyed():
    out = visible_controls(HOSTILE)
    assert out == ("a\u241b]2;PWNED\u2407 \u241b[2J\u241b[31mred\u2408\u2421 <U+009B>31m"
                   "\u2400z")
    assert not any(ord(c) < 0x20 or 0x7f <= ord(c) < 0xa0 for c in out)
    # text, newlines, tabs, line-ending CRs and non-ASCII stay as they are
    plain = "line 1\r\n\tline 2\nÄ ü € 😀 \u2028"
    assert visible_controls(plain) == plain
    # a lone CR (which would overwrite the line) is shown
    assert visible_controls("rm -rf /\rls") == "rm -rf /\u240dls"


def test_streamed_pieces_keep_a_split_crlf():
    t = TerminalText()
    pieces = ["one\r", "\ntwo\r", "x\x1b", "[0m\r"]
    assert "".join(t.feed(p) for p in pieces) + t.flush() == \
        "one\r\ntwo\u240dx\u241b[0m\u240d"


class _Out(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty", [True, False])
def test_generate_shows_controls_on_a_terminal_and_keeps_them_in_a_pipe(monkeypatch, tty):
    """A random-weight model's ESC sequences and BELs reached the terminal through
    `localmoe generate` (they set the window title, cleared the screen, rang the bell); on a
    terminal they are shown as control pictures, piped they stay byte for byte."""
    import sys

    from localmoe.cli import generate as gen

    out = _Out(tty)
    monkeypatch.setattr(sys, "stdout", out)
    pieces = [HOSTILE[:5], HOSTILE[5:17], HOSTILE[17:], "\r", "\nend\r"]
    events = [StreamEvent(p, 1) for p in pieces] + [StreamEvent("", None, True, "RESULT")]
    assert gen._stream(None, iter(events), as_json=False) == "RESULT"
    if tty:
        assert out.getvalue() == visible_controls(HOSTILE) + "\r\nend\u240d\n"
        assert "\x1b" not in out.getvalue() and "\x07" not in out.getvalue()
    else:
        assert out.getvalue() == HOSTILE + "\r\nend\r\n"
