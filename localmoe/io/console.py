"""Status lines on stderr that survive a missing stderr.

A process started with file descriptor 2 closed (``exec 2>&-``, some service managers) has
``sys.stderr`` None: ``sys.stderr.isatty()`` raises AttributeError, and ``print(...,
file=sys.stderr)`` quietly prints on stdout instead (``file=None`` means stdout), into a
command's answer. Code that writes progress or notes on stderr goes through these two
functions; without a stderr the notes are dropped and there is no terminal.
"""

from __future__ import annotations

import sys

__all__ = ["stderr_is_terminal", "note"]


def stderr_is_terminal() -> bool:
    """Whether stderr is a terminal; False when there is no stderr or it is closed."""
    err = sys.stderr
    try:
        return err is not None and err.isatty()
    except (AttributeError, ValueError, OSError):  # a closed or stripped-down stream
        return False


def note(line: str) -> None:
    """Write ``line`` and a newline on stderr, flushed; nothing when there is no stderr (or
    it cannot be written: a status line is not worth failing the command for)."""
    err = sys.stderr
    if err is None:
        return
    try:
        print(line, file=err, flush=True)
    except (OSError, ValueError):
        pass
