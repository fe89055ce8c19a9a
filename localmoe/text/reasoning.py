"""Reasoning blocks: the ``<think>...</think>`` part of a reply, split off as it streams."""

from __future__ import annotations

__all__ = ["ReasoningSplitter"]

_WS = " \t\r\n"


class ReasoningSplitter:
    """Splits a leading ``<think>...</think>`` block (Qwen3, DeepSeek-R1 style) off a reply.

    Feed text deltas with :meth:`push`, end with :meth:`finish`; both return events
    ``("reasoning", text)`` or ``("content", text)``. Only a block at the very start of the
    reply (after whitespace) counts; ``start_in_think=True`` is for templates whose generation
    prompt already opened the block (the reply then only closes it). Whitespace around the
    reasoning and right after ``</think>`` is dropped. A block never closed (output cut by
    ``max_tokens``) is all reasoning. As with
    :class:`~localmoe.text.tool_calls.StreamingToolParser`, the events' concatenation does not
    depend on how the text was split.
    """

    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self, start_in_think: bool = False):
        self._state = "think" if start_in_think else "start"
        self._buf = ""
        self._started = False  # reasoning text emitted yet (leading whitespace dropped)

    def push(self, delta: str) -> list[tuple[str, str]]:
        """Add a text delta; returns the events it settles."""
        self._buf += delta
        return self._drain(False)

    def finish(self) -> list[tuple[str, str]]:
        """End of output: settle everything held back."""
        return self._drain(True)

    def _drain(self, final: bool) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        while True:
            buf = self._buf
            if self._state == "start":
                t = buf.lstrip(_WS)
                if t.startswith(self.OPEN):
                    self._state, self._buf = "think", t[len(self.OPEN):]
                    continue
                if not final and self.OPEN.startswith(t):  # "" or a prefix of <think>
                    break
                self._state = "content"
                continue
            if self._state == "think":
                if not self._started:
                    buf = self._buf = buf.lstrip(_WS)
                i = buf.find(self.CLOSE)
                if i >= 0:
                    text = buf[:i].rstrip(_WS)
                    if text:
                        out.append(("reasoning", text))
                    self._state, self._buf = "after", buf[i + len(self.CLOSE):]
                    continue
                if final:
                    text = buf.rstrip(_WS)
                    keep = len(buf)
                else:
                    keep = len(buf)
                    for k in range(max(0, len(buf) - len(self.CLOSE) + 1), len(buf)):
                        if self.CLOSE.startswith(buf[k:]):
                            keep = k
                            break
                    text = buf[:keep].rstrip(_WS)
                    keep = len(text)
                if text:
                    out.append(("reasoning", text))
                    self._started = True
                self._buf = buf[keep:] if not final else ""
                break
            if self._state == "after":
                t = buf.lstrip(_WS)
                if not t and not final:
                    self._buf = ""
                    break
                self._state, self._buf = "content", t
                continue
            # content: pass through
            if buf:
                out.append(("content", buf))
            self._buf = ""
            break
        merged: list[tuple[str, str]] = []
        for kind, text in out:
            if merged and merged[-1][0] == kind:
                merged[-1] = (kind, merged[-1][1] + text)
            else:
                merged.append((kind, text))
        return merged
