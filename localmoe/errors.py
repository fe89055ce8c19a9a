"""Exception types for errors a user can cause.

Every error a user can trigger (a bad or truncated model file, an unsupported quant type, a
prompt longer than the context, a malformed request, an unavailable backend) is raised as a
subclass of :class:`LocalMoEError` whose message says what was wrong and what to do. The CLI,
server and TUI catch ``LocalMoEError`` and show the message; anything else is a bug.
"""

from __future__ import annotations

import json
from typing import Any


class LocalMoEError(Exception):
    """Base class of every user-facing localmoe error."""


class ModelLoadError(LocalMoEError):
    """A model file or directory could not be read (missing, truncated, corrupt, wrong format)."""


class UnsupportedModelError(ModelLoadError):
    """The file is valid but uses something localmoe does not run (architecture, quant type)."""


class ModelNotFoundError(LocalMoEError):
    """A model name or path does not resolve to a file in the store or on disk."""


class BackendUnavailableError(LocalMoEError):
    """The requested backend cannot run here (no CUDA device, package not installed, ...)."""


class KVCacheFormatError(LocalMoEError):
    """An unknown KV cache format, or a K/V format pair the chosen backend cannot run."""


class ContextOverflowError(LocalMoEError):
    """The prompt does not fit in the context window.

    The message is ``reason`` (what does not fit), then ``hint`` (what to do about it, for a
    user of the CLI or the Python API; the server puts its own).

    Attributes:
        n_prompt: number of prompt tokens (int).
        n_ctx: context size in tokens (int).
        n_completion: the ``max_tokens`` asked for when it is the prompt and ``max_tokens``
            together that do not fit (:meth:`with_max_tokens`), else None.
        reason, hint: the two parts of the message (str; ``hint`` may be empty).
    """

    DEFAULT_HINT = ("shorten the prompt or raise the context size (--ctx-size on the command "
                    "line, n_ctx in the Python API)")

    def __init__(self, n_prompt: int, n_ctx: int, message: str | None = None,
                 hint: str | None = None):
        self.n_prompt = int(n_prompt)
        self.n_ctx = int(n_ctx)
        self.n_completion: int | None = None
        self.reason = message or f"prompt is {self.n_prompt} tokens but the context holds {self.n_ctx}"
        self.hint = self.DEFAULT_HINT if hint is None else hint
        super().__init__(f"{self.reason}; {self.hint}" if self.hint else self.reason)

    @classmethod
    def fills_context(cls, n_prompt: int, n_ctx: int, hint: str | None = None
                      ) -> "ContextOverflowError":
        """The error for a prompt that takes every position of the context (``n_prompt ==
        n_ctx``): nothing could be generated."""
        s = "s" if n_prompt != 1 else ""
        return cls(n_prompt, n_ctx, f"prompt is {n_prompt} token{s} and fills the whole context "
                                    f"({n_ctx}), leaving no room to generate", hint=hint)

    @classmethod
    def with_max_tokens(cls, n_prompt: int, max_tokens: int, n_ctx: int,
                        hint: str | None = None) -> "ContextOverflowError":
        """The error for a prompt that fits but leaves less room than the ``max_tokens``
        asked for (OpenAI and vLLM refuse such a request rather than cut the answer short)."""
        e = cls(n_prompt, n_ctx, f"this model's maximum context length is {n_ctx} tokens, but "
                                 f"{n_prompt + max_tokens} were requested ({n_prompt} in the "
                                 f"prompt, {max_tokens} in the completion)",
                hint=("lower max_tokens, shorten the prompt or raise the context size (n_ctx)"
                      if hint is None else hint))
        e.n_completion = int(max_tokens)
        return e


class TemplateError(LocalMoEError):
    """The chat template failed to render (its own raise_exception message is included)."""


class InvalidRequestError(LocalMoEError):
    """A request or parameter value is invalid.

    Attributes:
        param: name of the offending parameter, or None.
    """

    def __init__(self, message: str, param: str | None = None):
        self.param = param
        super().__init__(message)


def json_value(v: Any, limit: int | None = 60) -> str:
    """A request value for an error message, as the client wrote it in JSON (``true``,
    ``"5"``, ``null``, ``["user"]``), not as Python's repr (``True``, ``'5'``, ``None``).

    Printable non-ASCII text is kept as written (``"робот"``, not ``"\\u0440..."``); other
    characters a terminal or log would act on (controls, lone surrogates, bidi overrides) show
    as their JSON escapes, so the message stays one line of valid UTF-8. A value JSON cannot
    spell (a Python API caller's object) shows as its repr; a long one is cut at ``limit``
    characters (None: never).
    """
    try:
        s = json.dumps(v, ensure_ascii=False)
    except (TypeError, ValueError):
        s = repr(v)
    except RecursionError:
        return "(a value nested too deeply to show)"
    if not s.isprintable():
        s = "".join(c if c.isprintable() else _json_escape(c) for c in s)
    return s if limit is None or len(s) <= limit else s[:limit - 3] + "..."


def _json_escape(c: str) -> str:
    """``c`` as JSON's ``\\uXXXX`` escape (a surrogate pair beyond the BMP)."""
    b = c.encode("utf-16-be", "surrogatepass")
    return "".join(f"\\u{int.from_bytes(b[i:i + 2], 'big'):04x}" for i in range(0, len(b), 2))


def require_utf8(text: str, what: str, param: str | None) -> None:
    """Refuse text UTF-8 cannot encode: lone surrogates, which is how Python carries
    undecodable bytes from argv, stdin or JSON.

    Raises:
        InvalidRequestError: ``"<what> is not valid UTF-8 (...at character N)"`` with ``param``.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"{what} is not valid UTF-8 (an undecodable byte or a lone "
                                  f"surrogate at character {e.start})", param) from None


def require_utf8_in(obj: Any, where: str) -> None:
    """:func:`require_utf8` for every string in ``obj`` (nested dicts and lists, any depth),
    each named by its path from ``where``, as message and ``param``: ``messages[1].content``,
    ``messages[0].content[2].text``, ``tools[0].function.description``.

    Raises:
        InvalidRequestError: for the first string UTF-8 cannot encode.
    """
    todo = [(obj, where)]
    while todo:   # a loop, not recursion: parsed JSON can nest ~1000 deep
        o, w = todo.pop()
        if isinstance(o, str):
            require_utf8(o, w, w)
        elif isinstance(o, dict):
            todo.extend((v, f"{w}.{k}") for k, v in reversed(list(o.items())))
        elif isinstance(o, (list, tuple)):
            todo.extend((v, f"{w}[{i}]") for i, v in reversed(list(enumerate(o))))


class StoreError(LocalMoEError):
    """A model store operation failed (download, checksum mismatch, disk)."""
