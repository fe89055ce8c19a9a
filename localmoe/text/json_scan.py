"""A resumable scanner for the extent of a JSON object or array inside free text.

Model output mixes text and JSON; :func:`scan_json` finds where a value that starts at a given
``{``/``[`` ends, understanding strings, escapes and nesting (so braces and quotes inside string
values never confuse it), and can resume on a longer text as a stream grows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["ScanState", "scan_json", "skip_ws", "WHITESPACE"]

WHITESPACE = " \t\r\n"  # JSON's insignificant whitespace

_STRUCT = re.compile(r'[{}\[\]"]')
_IN_STR = re.compile(r'["\\]')


@dataclass
class ScanState:
    """Where an unfinished :func:`scan_json` stopped: next index to read, the open brackets,
    and whether it is inside a string."""

    pos: int
    stack: list
    in_str: bool = False


def scan_json(s: str, start: int, state: ScanState | None = None) -> tuple[str, int, ScanState | None]:
    """Find the end of the JSON object or array that starts at ``s[start]``.

    Only structure is checked (brackets, strings, escapes); the caller validates the span with
    ``json.loads``. Scanning can resume: pass back the returned state with a longer ``s`` (same
    prefix) to continue where the last call stopped.

    Args:
        s: text.
        start: index of the opening ``{`` or ``[``.
        state: resume state from a previous ``"incomplete"`` answer, or None.

    Returns:
        ``("done", end, None)`` where ``s[start:end]`` is the balanced span;
        ``("incomplete", len(s), state)`` when the text ends inside the value;
        ``("invalid", i, None)`` for a mismatched bracket at ``i`` or when ``s[start]`` is not
        ``{``/``[``.
    """
    if state is None:
        if start >= len(s) or s[start] not in "{[":
            return "invalid", start, None
        state = ScanState(pos=start + 1, stack=[s[start]])
    pos, stack, in_str = state.pos, state.stack, state.in_str
    n = len(s)
    while pos < n:
        if in_str:
            m = _IN_STR.search(s, pos)
            if m is None:
                pos = n
                break
            if m.group() == "\\":
                if m.end() >= n:  # escape at the very end: resume before the backslash
                    pos = m.start()
                    break
                pos = m.end() + 1
                continue
            in_str = False
            pos = m.end()
            continue
        m = _STRUCT.search(s, pos)
        if m is None:
            pos = n
            break
        c = m.group()
        pos = m.end()
        if c == '"':
            in_str = True
        elif c in "{[":
            stack.append(c)
        else:
            opener = stack.pop()
            if (opener == "{") != (c == "}"):
                return "invalid", m.start(), None
            if not stack:
                return "done", pos, None
    return "incomplete", n, ScanState(pos=pos, stack=stack, in_str=in_str)


def skip_ws(s: str, i: int) -> int:
    """First index at or after ``i`` that is not :data:`WHITESPACE` (``len(s)`` if none)."""
    n = len(s)
    while i < n and s[i] in WHITESPACE:
        i += 1
    return i
