"""Tool-call parsing of model output, per model family, streaming and non-streaming.

Models write tool calls as text in a family-specific syntax:

* ``hermes`` (Hermes, Qwen2/2.5/3, most ChatML tool templates)::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

  several blocks may follow each other; text may come before and after. A missing
  ``</tool_call>`` is tolerated at the end of the output or before the next ``<tool_call>``.
* ``llama3`` (Llama-3.1/3.2/3.3 JSON tool calling): a bare JSON object
  ``{"name": "f", "parameters": {...}}`` (``arguments`` is accepted too), optionally after
  ``<|python_tag|>``; several objects may be separated by ``;``.
* ``mistral``: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`` (v3 tokenizers) or
  ``[TOOL_CALLS]f[ARGS]{...}`` (v11+ tokenizers, optionally ``f[CALL_ID]id[ARGS]{...}``).

The format is chosen from the chat template source (:func:`detect_format`).

Guarantees (tested in ``tests/text/test_tool_calls.py``):

* JSON is located with a real scanner (:func:`~localmoe.text.json_scan.scan_json`) that understands strings, escapes
  and nesting, so braces and quotes inside string values never confuse it.
* Invalid or truncated JSON is never an error: the text stays in the message content.
* Streaming (:class:`StreamingToolParser`) and one-shot parsing (:func:`parse_tool_calls`)
  give identical results for every split of the text into chunks: the one-shot parser *is*
  the streaming parser fed one chunk. The streaming parser only emits content once it is
  sure the text cannot start a tool call, and emits a tool call once its block is complete.
* Model output is untrusted: JSON nested deeper than :data:`MAX_JSON_DEPTH`, ``NaN`` /
  ``Infinity`` (not JSON) and calls to tools the request did not declare stay content; lone
  surrogates (``"\\ud800"`` escapes) in arguments stay escaped in the arguments text, so it
  always encodes as UTF-8.
* Whitespace directly around a tool-call block is dropped (so ``"\\n<tool_call>..."`` leaves no
  stray newline content); other content is preserved byte for byte.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Iterable

from localmoe.text.json_scan import WHITESPACE as _WS, ScanState, scan_json, skip_ws

FORMATS = ("hermes", "llama3", "mistral")

#: deepest nesting of arrays/objects accepted in a tool call (deeper: the block stays content)
MAX_JSON_DEPTH = 64

__all__ = ["MAX_JSON_DEPTH", "FORMATS", "ToolCall", "ParsedOutput", "detect_format", "parse_tool_calls",
           "StreamingToolParser", "new_call_id"]


_ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def new_call_id(fmt: str | None = None) -> str:
    """A fresh tool call id.

    OpenAI style (``"call_"`` + 24 hex characters), except for the ``mistral`` format, whose
    chat templates only accept 9 alphanumeric characters (they raise on anything else when the
    id comes back in the conversation).
    """
    if fmt == "mistral":
        return "".join(_ALNUM[b % 62] for b in uuid.uuid4().bytes[:9])
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolCall:
    """One parsed tool call.

    Attributes:
        name: function name (str).
        arguments: the arguments as a JSON text (str), as OpenAI's ``function.arguments``.
            Objects are re-serialized with ``json.dumps(..., ensure_ascii=False)``.
    """

    name: str
    arguments: str


@dataclass
class ParsedOutput:
    """Result of parsing a complete model output.

    Attributes:
        content: text outside tool calls (str; may be ``""``).
        tool_calls: parsed calls in order of appearance.
    """

    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


def detect_format(template_source: str | None) -> str:
    """Pick the tool-call syntax a chat template teaches its model.

    Args:
        template_source: the Jinja chat template text, or None.

    Returns:
        ``"mistral"`` when the template mentions ``[TOOL_CALLS]``, ``"hermes"`` when it mentions
        ``<tool_call>``, ``"llama3"`` for Llama-3 style templates (``<|python_tag|>`` or
        ``<|start_header_id|>`` together with tools), else ``"hermes"`` (the generic format
        localmoe itself teaches to templates without tool support).
    """
    src = template_source or ""
    if "[TOOL_CALLS]" in src:
        return "mistral"
    if "<tool_call>" in src:
        return "hermes"
    if "<|python_tag|>" in src or ("<|start_header_id|>" in src and "tools" in src):
        return "llama3"
    return "hermes"


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_BRACKET = re.compile(r"[\[\]{}]")


def _too_deep(text: str) -> bool:
    """True when ``text`` nests arrays/objects deeper than :data:`MAX_JSON_DEPTH`."""
    depth = 0
    for m in _BRACKET.finditer(_STRING.sub("", text)):
        depth += 1 if m.group() in "[{" else -1
        if depth > MAX_JSON_DEPTH:
            return True
    return False


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _loads(text: str):
    """``json.loads`` for model output: ValueError for ``NaN``/``Infinity`` and for nesting
    over :data:`MAX_JSON_DEPTH` (never RecursionError)."""
    if _too_deep(text):
        raise ValueError("nested too deeply")
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _dumps(obj) -> str:
    """JSON text of ``obj``, non-ASCII kept, except that a lone surrogate is written as its
    ``\\uXXXX`` escape (the text stays encodable as UTF-8)."""
    text = json.dumps(obj, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(obj, ensure_ascii=True)
    return text


def _args_text(args) -> str | None:
    """OpenAI ``arguments`` text for a parsed arguments value, or None when unusable."""
    if args is None:
        return "{}"
    if isinstance(args, dict):
        return _dumps(args)
    if isinstance(args, str):  # some models put the JSON text in a string
        try:
            inner = _loads(args)
        except ValueError:
            return None
        return _dumps(inner) if isinstance(inner, dict) else None
    return None


def _call_from_obj(obj, names: frozenset[str] | None, strict_keys: bool) -> ToolCall | None:
    """A ToolCall from a decoded ``{"name": ..., "arguments"|"parameters": ...}`` object."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    if names is not None and name not in names:
        return None  # a tool the request did not declare: not a call
    if "arguments" in obj and "parameters" in obj:
        return None
    if strict_keys:  # bare-JSON formats: refuse look-alikes that carry other keys
        if set(obj) - {"name", "arguments", "parameters", "type"}:
            return None
        if "arguments" not in obj and "parameters" not in obj:
            return None
    args = _args_text(obj.get("arguments", obj.get("parameters")))
    if args is None:
        return None
    return ToolCall(name=name, arguments=args)


# ---------------------------------------------------------------------------- block parsers
# Each block parser looks at buf[i:], where buf[i:] starts with one of the format's markers,
# and answers one of
#   ("call", [ToolCall...], end)   -- complete calls occupying buf[i:end]
#   ("incomplete",)                -- more text could change the answer (only when not final)
#   ("invalid", skip)              -- not a call; buf[i:skip] is plain content
# Answers other than "incomplete" must never change when more text is appended: that is what
# makes streamed and one-shot parsing identical.


class _JsonCache:
    """Resumable scan state for the JSON value pending at one position of the buffer."""

    def __init__(self):
        self.key: int | None = None
        self.state: ScanState | None = None

    def scan(self, buf: str, start: int):
        st = self.state if self.key == start else None
        res, end, new_state = scan_json(buf, start, st)
        if res == "incomplete":
            self.key, self.state = start, new_state
        else:
            self.key, self.state = None, None
        return res, end

    def shift(self, k: int) -> None:
        """The buffer lost its first k characters."""
        if self.key is not None:
            if self.key >= k:
                self.key -= k
                self.state.pos -= k
            else:
                self.key, self.state = None, None


def _partial_prefix(s: str, i: int, lit: str) -> str:
    """'full' if s[i:] starts with lit, 'partial' if s[i:] is a proper prefix of lit, else 'no'."""
    rest = s[i:i + len(lit)]
    if rest == lit:
        return "full"
    if lit.startswith(rest):  # includes rest == "" (end of text)
        return "partial"
    return "no"


class _Format(ABC):
    markers: tuple[str, ...] = ()

    def __init__(self, names: frozenset[str] | None):
        self.names = names
        self.cache = _JsonCache()

    def find_marker(self, buf: str, start: int) -> int:
        """Index of the first marker at or after start, or -1."""
        best = -1
        for mk in self.markers:
            j = buf.find(mk, start)
            if j >= 0 and (best < 0 or j < best):
                best = j
        return best

    def held_suffix(self, buf: str, start: int) -> int:
        """Index from which buf[start:] might be the beginning of a marker (len(buf) if none)."""
        n = len(buf)
        for k in range(max(start, n - max(len(m) for m in self.markers) + 1), n):
            tail = buf[k:]
            if any(m.startswith(tail) for m in self.markers):
                return k
        return n

    @abstractmethod
    def parse_block(self, buf: str, i: int, final: bool):
        """Parse one call block starting at ``buf[i]`` (a marker); ``final``: no more text."""


class _Hermes(_Format):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    markers = (OPEN,)

    def parse_block(self, buf, i, final):
        j = skip_ws(buf, i + len(self.OPEN))
        if j >= len(buf):
            return ("invalid", i + len(self.OPEN)) if final else ("incomplete",)
        if buf[j] != "{":
            return ("invalid", i + len(self.OPEN))
        res, end = self.cache.scan(buf, j)
        if res == "incomplete":
            return ("invalid", i + len(self.OPEN)) if final else ("incomplete",)
        if res == "invalid":
            return ("invalid", i + len(self.OPEN))
        try:
            obj = _loads(buf[j:end])
        except ValueError:
            return ("invalid", end)
        call = _call_from_obj(obj, self.names, strict_keys=False)
        if call is None:
            return ("invalid", end)
        k = skip_ws(buf, end)
        close = _partial_prefix(buf, k, self.CLOSE)
        if close == "full":
            return ("call", [call], k + len(self.CLOSE))
        nxt = _partial_prefix(buf, k, self.OPEN)
        if nxt == "full":
            return ("call", [call], end)
        if k >= len(buf) or close == "partial" or nxt == "partial":
            if not final:
                return ("incomplete",)
            # end of output: a missing or cut-off closing tag still ends the call
            return ("call", [call], len(buf) if close == "partial" else end)
        return ("invalid", end)  # JSON followed by stray text: not a well-formed block


class _Llama3(_Format):
    TAG = "<|python_tag|>"
    markers = (TAG, "{")

    def parse_block(self, buf, i, final):
        tagged = buf.startswith(self.TAG, i)
        j = skip_ws(buf, i + len(self.TAG)) if tagged else i
        calls: list[ToolCall] = []
        while True:
            if j >= len(buf):
                if not final:
                    return ("incomplete",)
                break
            if buf[j] != "{":
                break
            res, end = self.cache.scan(buf, j)
            if res == "incomplete":
                if not final:
                    return ("incomplete",)
                break
            if res == "invalid":
                break
            try:
                obj = _loads(buf[j:end])
            except ValueError:
                obj = None
            call = _call_from_obj(obj, self.names, strict_keys=True)
            if call is None:
                if not calls:  # a plain JSON value in the text: content, skip it whole
                    return ("invalid", end if not tagged else i + len(self.TAG))
                break
            calls.append(call)
            k = skip_ws(buf, end)
            if k >= len(buf):
                if not final:
                    return ("incomplete",)
                j = end
                break
            if buf[k] == ";":
                k2 = skip_ws(buf, k + 1)
                if k2 >= len(buf) and not final:
                    return ("incomplete",)
                if k2 < len(buf) and buf[k2] == "{":
                    j = k2
                    continue
            j = end
            break
        if not calls:
            return ("invalid", i + (len(self.TAG) if tagged else 1))
        return ("call", calls, j)


class _Mistral(_Format):
    TAG, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    markers = (TAG,)
    _NAME = re.compile(r"[A-Za-z0-9_.\-]+")

    def parse_block(self, buf, i, final):
        j = skip_ws(buf, i + len(self.TAG))
        bad = ("invalid", i + len(self.TAG))
        if j >= len(buf):
            return bad if final else ("incomplete",)
        if buf[j] in "[{":  # v3: JSON array (or a single object)
            res, end = self.cache.scan(buf, j)
            if res == "incomplete":
                return bad if final else ("incomplete",)
            if res == "invalid":
                return bad
            try:
                obj = _loads(buf[j:end])
            except ValueError:
                return ("invalid", end)
            items = obj if isinstance(obj, list) else [obj]
            calls = [_call_from_obj(o, self.names, strict_keys=False) for o in items]
            if not calls or any(c is None for c in calls):
                return ("invalid", end)
            return ("call", calls, end)
        # v11: name[ARGS]{...} or name[CALL_ID]id[ARGS]{...}
        m = self._NAME.match(buf, j)
        if m is None:
            return bad
        name, k = m.group(), m.end()
        if k >= len(buf):
            return bad if final else ("incomplete",)
        if buf.startswith(self.CALL_ID, k):
            m2 = re.compile(r"[A-Za-z0-9_\-]*").match(buf, k + len(self.CALL_ID))
            k = m2.end()
            if k >= len(buf):
                return bad if final else ("incomplete",)
        st = _partial_prefix(buf, k, self.ARGS)
        if st != "full":
            if "partial" in (st, _partial_prefix(buf, k, self.CALL_ID)) and not final:
                return ("incomplete",)
            return bad
        k += len(self.ARGS)
        if k >= len(buf):
            return bad if final else ("incomplete",)
        res, end = self.cache.scan(buf, k)
        if res == "incomplete":
            return bad if final else ("incomplete",)
        if res == "invalid":
            return bad
        try:
            args = _loads(buf[k:end])
        except ValueError:
            return ("invalid", end)
        call = _call_from_obj({"name": name, "arguments": args}, self.names, strict_keys=False)
        if call is None:
            return ("invalid", end)
        return ("call", [call], end)


_FORMAT_CLASSES = {"hermes": _Hermes, "llama3": _Llama3, "mistral": _Mistral}


# ---------------------------------------------------------------------------- the parser


class StreamingToolParser:
    """Incremental tool-call parser.

    Feed the model's text deltas with :meth:`push` and finish with :meth:`finish`; each returns
    a list of events, each either ``("content", text)`` or ``("call", ToolCall)``. The
    concatenation of all events does not depend on how the text was split into deltas.

    Args:
        fmt: one of :data:`FORMATS`.
        tool_names: names of the request's tools; a call to any other name stays content
            (None: any name).

    Raises:
        ValueError: unknown format name.
    """

    def __init__(self, fmt: str = "hermes", tool_names: Iterable[str] | None = None):
        if fmt not in _FORMAT_CLASSES:
            raise ValueError(f"unknown tool-call format {fmt!r}; expected one of {FORMATS}")
        names = frozenset(tool_names) if tool_names is not None else None
        self.fmt = fmt
        self._f = _FORMAT_CLASSES[fmt](names)
        self._buf = ""
        self._after_call = False  # drop whitespace that follows a call block
        self._done = False
        self.n_calls = 0

    def push(self, delta: str) -> list[tuple[str, object]]:
        """Add a text delta; returns the events it settles (maybe none)."""
        if self._done:
            raise RuntimeError("push() after finish()")
        if not delta:
            return []
        self._buf += delta
        return self._drain(final=False)

    def finish(self) -> list[tuple[str, object]]:
        """End of output: settle everything still held back."""
        if self._done:
            return []
        self._done = True
        return self._drain(final=True)

    def _consume(self, k: int) -> None:
        self._buf = self._buf[k:]
        self._f.cache.shift(k)

    def _drain(self, final: bool) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        f = self._f
        while self._buf:
            buf = self._buf
            if self._after_call:
                k = skip_ws(buf, 0)
                self._consume(k)
                if not self._buf:
                    break
                self._after_call = False
                buf = self._buf
            i = f.find_marker(buf, 0)
            if i < 0:
                hold = len(buf) if final else f.held_suffix(buf, 0)
            else:
                hold = i
            # content before the (possible) marker; whitespace right before a marker is held
            text = buf[:hold]
            ws_start = len(text.rstrip(_WS))
            if i >= 0 or not final:
                emit = text[:ws_start]
            else:
                emit = text
            if emit:
                out.append(("content", emit))
            if i < 0:
                if final:
                    self._consume(len(buf))
                else:
                    self._consume(len(emit))
                break
            # a marker at index i; whitespace buf[ws_start:i] waits for the block's fate
            ans = f.parse_block(buf, i, final)
            if ans[0] == "incomplete":
                self._consume(len(emit))
                break
            if ans[0] == "call":
                for c in ans[1]:
                    out.append(("call", c))
                    self.n_calls += 1
                self._consume(ans[2])
                self._after_call = True
                continue
            skip = ans[1]
            out.append(("content", buf[ws_start:skip]))
            self._consume(skip)
        return _merge(out)


def _merge(events: list[tuple[str, object]]) -> list[tuple[str, object]]:
    """Join adjacent content events and drop empty ones."""
    out: list[tuple[str, object]] = []
    for kind, val in events:
        if kind == "content":
            if not val:
                continue
            if out and out[-1][0] == "content":
                out[-1] = ("content", out[-1][1] + val)
                continue
        out.append((kind, val))
    return out


def parse_tool_calls(text: str, fmt: str = "hermes",
                     tool_names: Iterable[str] | None = None) -> ParsedOutput:
    """Parse a complete model output into content and tool calls.

    Args:
        text: the model's whole reply.
        fmt: one of :data:`FORMATS` (see :func:`detect_format`).
        tool_names: as for :class:`StreamingToolParser`.

    Returns:
        ParsedOutput; never raises on malformed model output (it stays content).
    """
    p = StreamingToolParser(fmt, tool_names)
    events = p.push(text) + p.finish()
    res = ParsedOutput()
    parts = []
    for kind, val in events:
        if kind == "content":
            parts.append(val)
        else:
            res.tool_calls.append(val)
    res.content = "".join(parts)
    return res
