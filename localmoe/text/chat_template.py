"""Chat templates: render OpenAI-style messages into a prompt with the model's Jinja template.

Templates come from the model (GGUF ``tokenizer.chat_template``, HF ``tokenizer_config.json``)
and are untrusted code: they run in Jinja2's ``ImmutableSandboxedEnvironment``. The environment
matches what transformers' ``apply_chat_template`` gives templates, so that output is
byte-identical where both can render a template:

* ``trim_blocks=True, lstrip_blocks=True``, the ``loopcontrols`` extension (``break`` /
  ``continue``) and a ``{% generation %}`` block tag (rendered as its body);
* globals ``raise_exception(msg)``, ``strftime_now(fmt)`` (local time), ``namespace`` (no
  underscore-prefixed attributes) and ``dict``;
* the ``tojson`` filter is ``json.dumps`` (non-ASCII kept, no HTML escaping; ``indent``,
  ``separators``, ``sort_keys``, ``ensure_ascii`` accepted);
* variables ``messages``, ``tools``, ``add_generation_prompt``, ``bos_token``, ``eos_token``
  plus any extra keyword (``enable_thinking=False``, ...).

Messages are normalized first: objects with ``model_dump()`` become dicts, keys whose value is
``None`` are dropped except ``content``, which becomes ``""``; a ``content`` list made only of
``{"type": "text"}`` parts is joined into one string; tool-call ``arguments`` given as a JSON
string (the OpenAI wire format) are decoded into objects, since templates render them with
``tojson``; ``reasoning``/``thinking`` are aliased to ``reasoning_content`` as transformers does.

Rendering is bounded (:class:`TemplateLimits`, docs/LIMITS.md): wall time, output size and
memory growth, checked on every line the compiled template runs (a line tracer on the
template's own frames) and before the few operations that can make a huge value in one step
(``*``, ``**``, ``%``, ``+``, ``lipsum``, padding and ``replace`` with huge arguments). A render
can be cancelled (``cancel=`` a ``threading.Event``). A limit hit raises
:class:`TemplateLimitError` naming the limit.

Control tokens in the prompt must come only from the template: :meth:`ChatTemplate.encode`
marks control-token text inside user-supplied strings before rendering and has the tokenizer
encode those spans as plain text.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Iterable

from localmoe.errors import TemplateError, require_utf8_in

__all__ = ["ChatTemplate", "normalize_messages", "TemplateLimits", "TemplateLimitError", "LIMITS",
           "MAX_SOURCE_CHARS"]


class TemplateLimitError(TemplateError):
    """A chat template render was stopped by a limit.

    Attributes:
        limit: ``"time"``, ``"output"``, ``"memory"``, ``"size"`` (one operation's result) or
            ``"cancelled"``.
    """

    def __init__(self, limit: str, message: str):
        self.limit = limit
        if limit != "cancelled":
            message += f" (template {limit} limit, see docs/LIMITS.md)"
        super().__init__(message)


def _env_num(name: str, default: float) -> float:
    """A positive number from environment variable ``name``, else ``default`` (also for a
    value that is not one: logged once as a warning)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        v = float(raw)
    except ValueError:
        v = float("nan")
    if v > 0 and v != float("inf"):
        return v
    _warn_env(name, raw, default)
    return default


@functools.lru_cache(maxsize=None)
def _warn_env(name: str, raw: str, default: float) -> None:
    """The warning of a bad limit variable, once: into the log where one is set up (the
    server's, which names the level), else on stderr as the command line's other warnings
    (``warning: ...``). The default reads as the user would write it (8388608, not 8.38861e+06)."""
    shown = str(int(default)) if float(default).is_integer() else f"{default:g}"
    warn(f"{name}={raw!r} is not a positive number; using {shown}")


def warn(msg: str) -> None:
    """One warning about a chat template: into the log where one is set up (the server's,
    which names the level), else on stderr as the command line's other warnings
    (``warning: ...``; logging's last resort would print it bare)."""
    log = logging.getLogger(__name__)
    if log.hasHandlers():
        log.warning(msg)
    elif sys.stderr is not None:  # closed: print(file=None) would write on stdout (the
        # answer); text may not import localmoe.io.console, whose note() says this
        print(f"warning: {msg}", file=sys.stderr, flush=True)


@dataclass
class TemplateLimits:
    """Bounds of one chat-template render.

    Attributes:
        seconds: wall time (s), default 2 (``$LOCALMOE_TEMPLATE_SECONDS``).
        max_chars: characters of output, and of any one string/list a template operation
            makes, default 8 Mi (``$LOCALMOE_TEMPLATE_MAX_CHARS``).
        max_memory: growth of the process's resident memory while rendering (bytes), default
            512 MiB (``$LOCALMOE_TEMPLATE_MAX_MEMORY``).
    """

    seconds: float = field(default_factory=lambda: _env_num("LOCALMOE_TEMPLATE_SECONDS", 2.0))
    max_chars: int = field(default_factory=lambda: int(_env_num("LOCALMOE_TEMPLATE_MAX_CHARS", 8 << 20)))
    max_memory: int = field(default_factory=lambda: int(_env_num("LOCALMOE_TEMPLATE_MAX_MEMORY", 512 << 20)))


#: longest template source compiled (the largest real chat templates are a few tens of kB)
MAX_SOURCE_CHARS = 1 << 20

#: the limits every render uses (change the attributes to change them process-wide)
LIMITS = TemplateLimits()

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss() -> int | None:
    """Resident bytes of this process (Linux /proc), or None where unknown."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


class _Guard:
    """The limits of one render in one thread: a line tracer on the template's frames checks
    time, cancellation and (every 2 ms) memory; the sandbox hooks check operation sizes."""

    def __init__(self, limits: TemplateLimits, cancel: Any = None):
        self.limits, self.cancel = limits, cancel
        self.t0 = time.monotonic()
        self.deadline = self.t0 + limits.seconds
        self.rss0 = _rss()
        self.next_mem = self.t0 + 0.002

    def check(self) -> None:
        now = time.monotonic()
        if now > self.deadline:
            raise TemplateLimitError("time", f"the chat template ran longer than the {self.limits.seconds:g} s "
                                     f"limit and was stopped")
        if self.cancel is not None and self.cancel.is_set():
            raise TemplateLimitError("cancelled", "the request was cancelled while its chat template rendered")
        if self.rss0 is not None and now >= self.next_mem:
            self.next_mem = now + 0.002
            rss = _rss()
            if rss is not None and rss - self.rss0 > self.limits.max_memory:
                raise TemplateLimitError(
                    "memory", f"the chat template used more than {self.limits.max_memory >> 20} MiB of "
                    f"memory and was stopped")

    def size(self, n: int, what: str) -> None:
        if n > self.limits.max_chars:
            raise TemplateLimitError(
                "size", f"the chat template tried to make {what} of {n:,} items, over the "
                f"{self.limits.max_chars:,} limit, and was stopped")

    def trace(self, frame, event, arg):  # sys.settrace hook: template frames only
        if frame.f_code.co_filename == "<template>":
            self.check()
            return self._line
        return None

    def _line(self, frame, event, arg):
        self.check()
        return self._line


_ACTIVE = threading.local()


def _guard() -> _Guard | None:
    return getattr(_ACTIVE, "guard", None)


def _length(x: Any) -> int | None:
    return len(x) if isinstance(x, (str, list, tuple, bytes)) else None


_FMT_WIDTH = re.compile(r"%[-+ #0]*(\d+)|\{[^{}]*?(\d{4,})[^{}]*\}")

# Private-use markers wrapped around control-token text found in user strings.
_MARK_START = "\U000F8FF0"
_MARK_END = "\U000F8FF1"


def _to_plain(value: Any) -> Any:
    """Rebuild ``value`` from plain JSON types (str/int/float/bool/None/dict/list)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_to_plain(k): _to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return _to_plain(dump())
    return str(value)


def _normalize_tool_call(tc: Any) -> Any:
    tc = _to_plain(tc)
    if not isinstance(tc, dict):
        return tc
    tc = {k: v for k, v in tc.items() if v is not None}
    fn = tc.get("function")
    if isinstance(fn, dict):
        fn = {k: v for k, v in fn.items() if v is not None}
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args) if args.strip() else {}
            except ValueError:
                pass  # not JSON: leave the string, templates usually print strings as-is
        tc["function"] = fn
    return tc


def normalize_messages(messages: Iterable[Any]) -> list[dict]:
    """OpenAI chat messages -> plain dicts a chat template can render (see module docstring).

    Raises:
        TemplateError: a message is not a mapping or has no role.
    """
    out = []
    for k, m in enumerate(messages):
        m = _to_plain(m)
        if not isinstance(m, dict):
            raise TemplateError(f"message {k} must be an object with 'role' and 'content', got {m!r}")
        if "role" not in m:
            raise TemplateError(f"message {k} has no 'role'")
        msg = {key: val for key, val in m.items() if val is not None or key == "content"}
        content = msg.get("content")
        if content is None:
            msg["content"] = ""
        elif isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" for p in content
        ):
            msg["content"] = "".join(str(p.get("text", "")) for p in content)
        if isinstance(msg.get("tool_calls"), list):
            msg["tool_calls"] = [_normalize_tool_call(tc) for tc in msg["tool_calls"]]
        reasoning = next((msg[f] for f in ("reasoning_content", "thinking", "reasoning")
                          if msg.get(f) is not None), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


def _mark(obj: Any, specials: list[str]) -> Any:
    """Wrap control-token texts in user strings with the private-use markers."""
    if isinstance(obj, str):
        s = obj.replace(_MARK_START, "").replace(_MARK_END, "")
        for t in specials:  # longest first; markers cannot be part of any token text
            if t in s:
                s = s.replace(t, _MARK_START + t + _MARK_END)
        return s
    if isinstance(obj, dict):
        return {k: _mark(v, specials) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_mark(v, specials) for v in obj]
    return obj


def _unmark(text: str) -> tuple[str, list[tuple[int, int]]]:
    """Remove markers; return the clean text and the spans (start, end) that were marked.
    A lone marker (a template split the string) is dropped."""
    out: list[str] = []
    spans: list[tuple[int, int]] = []
    pos = 0
    i = 0
    n = len(text)
    while i < n:
        j = text.find(_MARK_START, i)
        k_end = text.find(_MARK_END, i)
        if j < 0 and k_end < 0:
            out.append(text[i:])
            break
        if j < 0 or (0 <= k_end < j):  # lone end marker
            out.append(text[i:k_end])
            pos += k_end - i
            i = k_end + 1
            continue
        out.append(text[i:j])
        pos += j - i
        e = text.find(_MARK_END, j + 1)
        nxt = text.find(_MARK_START, j + 1)
        if e < 0 or (0 <= nxt < e):  # lone start marker
            i = j + 1
            continue
        inner = text[j + 1:e]
        out.append(inner)
        spans.append((pos, pos + len(inner)))
        pos += len(inner)
        i = e + 1
    return "".join(out), spans


def _make_env():
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (HF assistant masks): renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # same signature trick as jinja's Namespace
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"templates cannot store underscore-prefixed attributes on a namespace ({name!r})")

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class StrictSandbox(ImmutableSandboxedEnvironment):
        """Reaching for an unsafe attribute (dunders, ``_private``, function internals) raises
        at once instead of rendering as an empty Undefined; operations that can make a huge
        value in one step are sized first (see :class:`_Guard`)."""

        intercepted_binops = frozenset(["*", "**", "%", "+"])

        def unsafe_undefined(self, obj, attribute):
            raise jinja2.exceptions.SecurityError(
                f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is not allowed")

        def call_binop(self, context, operator, left, right):
            g = _guard()
            if g is not None:
                g.check()
                _size_binop(g, operator, left, right)
            return super().call_binop(context, operator, left, right)

        def wrap_str_format(self, value):
            f = super().wrap_str_format(value)
            if f is None:
                return None
            fmt = value.__self__

            def sized(*args, **kwargs):
                g = _guard()
                if g is not None:
                    _size_format(g, fmt.replace("{", "%{"), list(args) + list(kwargs.values()))
                return f(*args, **kwargs)

            return sized

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
            g = _guard()
            if g is not None:
                g.check()
                args = _size_call(g, __obj, args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

    env = StrictSandbox(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    for name in ("center", "indent", "replace", "format", "wordwrap", "join", "tojson"):
        env.filters[name] = _sized_filter(env.filters[name], name)
    env.globals["lipsum"] = _sized_lipsum(env.globals["lipsum"])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["namespace"] = TemplateNamespace
    env.globals["dict"] = TemplateDict()
    return env


def _size_binop(g: _Guard, op: str, left: Any, right: Any) -> None:
    """Refuse ``left op right`` when its result would be over the size limit."""
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            ln = _length(seq)
            if ln is not None and isinstance(n, int):
                g.size(ln * max(n, 0), "a repeated string or list")
    elif op == "**":
        if isinstance(left, (int, float)) and isinstance(right, (int, float)) and abs(left) > 1 \
                and right > 4096:
            g.size(int(abs(right)) * 1024, "a power")
    elif op == "+":
        a, b = _length(left), _length(right)
        if a is not None and b is not None:
            g.size(a + b, "a concatenation")
    elif op == "%" and isinstance(left, str):
        _size_format(g, left, right if isinstance(right, tuple) else (right,))


def _size_format(g: _Guard, fmt: str, args: Iterable[Any]) -> None:
    widths = [int(w) for m in _FMT_WIDTH.finditer(fmt) for w in m.groups() if w]
    widths += [a for a in args if isinstance(a, int) and "*" in fmt]
    g.size(len(fmt) + sum(widths), "a formatted string")


_WIDTH_METHODS = {"center", "ljust", "rjust", "zfill", "expandtabs", "format", "join", "replace"}


def _size_call(g: _Guard, obj: Any, args: tuple, kwargs: dict) -> tuple:
    """Size a call of a str method that can grow its string a lot in one step; returns the
    arguments to call with (an iterator given to ``join`` is read into a list first)."""
    owner = getattr(obj, "__self__", None)
    name = getattr(obj, "__name__", "")
    if not isinstance(owner, str) or name not in _WIDTH_METHODS:
        return args
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        n = owner.count(args[0]) if args[0] else len(owner) + 1
        g.size(len(owner) + n * max(0, len(args[1]) - len(args[0])), "a replaced string")
    elif name == "join" and args:
        items = args[0]
        if not hasattr(items, "__len__"):
            got = []
            for x in items:
                got.append(x)
                if len(got) > g.limits.max_chars:
                    g.size(len(got), "a joined list")
            items = got
            args = (got,) + tuple(args[1:])
        if isinstance(items, (list, tuple)):
            g.size(sum(len(x) for x in items if isinstance(x, str)) + len(owner) * len(items),
                   "a joined string")
    elif name == "format":
        _size_format(g, owner.replace("{", "%{"), list(args) + list(kwargs.values()))
    else:
        ints = [a for a in list(args) + list(kwargs.values()) if isinstance(a, int)]
        if ints:
            g.size(len(owner) * (8 if name == "expandtabs" else 1) + max(ints) *
                   (owner.count("\t") + 1 if name == "expandtabs" else 1), "a padded string")
    return args


def _sized_filter(fn: Any, name: str) -> Any:
    """Filter ``fn`` with its result size checked first (``center``, ``indent``, ``replace``,
    ``format``, ``wordwrap`` can make a huge string from a small one)."""
    import functools

    @functools.wraps(fn)
    def f(*args, **kwargs):
        g = _guard()
        if g is not None:
            plain = [a for a in args if not hasattr(a, "environment")]  # drop eval/env context
            s = next((a for a in plain if isinstance(a, str)), "")
            ints = [a for a in list(plain) + list(kwargs.values()) if isinstance(a, int) and not isinstance(a, bool)]
            if name == "join" and plain:
                seq = plain[0]
                sep = plain[1] if len(plain) > 1 else kwargs.get("d", "")
                n_items = len(seq) if hasattr(seq, "__len__") else 0
                if isinstance(sep, str) and n_items:
                    g.size(len(sep) * n_items, "a joined string")
            elif name == "tojson":
                ind = kwargs.get("indent", plain[1] if len(plain) > 1 else None)
                if isinstance(ind, int) and ind > 64:
                    g.size(ind * 1024, "indented JSON")
            elif name == "replace" and len(plain) >= 3 and all(isinstance(a, str) for a in plain[:3]):
                _size_call(g, plain[0].replace, tuple(plain[1:3]), {})
            elif name == "format":
                _size_format(g, s, plain[1:] + list(kwargs.values()))
            elif name == "indent" and ints:
                g.size(len(s) + max(ints) * (s.count("\n") + 1), "an indented string")
            elif ints:
                g.size(len(s) + max(ints), f"a {name} result")
        return fn(*args, **kwargs)

    return f


def _sized_lipsum(fn: Any) -> Any:
    def lipsum(n=5, html=True, min=20, max=100):  # noqa: A002 - jinja's parameter names
        g = _guard()
        if g is not None and isinstance(n, int) and isinstance(max, int):
            g.size(n * max * 12, "lorem ipsum text")
        return fn(n, html, min, max)

    return lipsum


_ENV = None


def _env():
    global _ENV
    if _ENV is None:
        _ENV = _make_env()
    return _ENV


class ChatTemplate:
    """A compiled chat template.

    Args:
        source: the Jinja template text.
        bos_token / eos_token: texts exposed to the template as ``bos_token`` / ``eos_token``.
        control_tokens: texts of the vocabulary's control tokens (used by :meth:`encode` to keep
            control-token text in user content plain). ``from_model`` fills it.
        tool_source: optional second template used when ``tools`` are given (HF/GGUF
            ``tool_use`` variant, as transformers picks it).
    Raises:
        TemplateError: the template does not parse (message names the line).
    """

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "",
                 control_tokens: Iterable[str] = (), tool_source: str | None = None):
        if not isinstance(source, str) or not source.strip():
            raise TemplateError("the chat template is empty")
        self.source = source
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        self.control_tokens = sorted({t for t in control_tokens if t}, key=len, reverse=True)
        self._tpl = self._compile(source)
        self.tool_source = tool_source if isinstance(tool_source, str) and tool_source.strip() else None
        self._tool_tpl = self._compile(self.tool_source) if self.tool_source else None
        self._renders_bos: bool | None = None
        #: why the model's ``tool_use`` variant was dropped (``from_model(strict=False)``)
        self.tool_error: str | None = None

    @staticmethod
    def _compile(source: str):
        import jinja2

        if len(source) > MAX_SOURCE_CHARS:
            raise TemplateError(
                f"the chat template is {len(source):,} characters, over the {MAX_SOURCE_CHARS:,} limit "
                f"(real templates are under 100 k); the file is corrupt or hostile")
        try:
            return _env().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"the chat template has a syntax error at line {e.lineno}: {e.message}") from e
        except Exception as e:
            raise TemplateError(f"the chat template cannot be compiled: {e}") from e

    @classmethod
    def compile_error(cls, model_file: Any) -> str | None:
        """Why ``model_file``'s default chat template does not compile (the TemplateError the
        constructor would raise), or None: it compiles, or the model has none."""
        src = cls.model_source(model_file)
        if src is None:
            return None
        try:
            cls._compile(src)
        except TemplateError as e:
            return str(e)
        return None

    @staticmethod
    def model_source(model_file: Any) -> str | None:
        """The default template text of ``model_file``, or None when it has none."""
        src = getattr(model_file, "chat_template", None)
        if src is None:
            src = (getattr(model_file, "metadata", None) or {}).get("tokenizer.chat_template")
        return src if src and isinstance(src, str) and src.strip() else None

    @classmethod
    def from_model(cls, model_file: Any, tokenizer: Any, *,
                   strict: bool = True) -> "ChatTemplate | BrokenChatTemplate | None":
        """The template of a loaded model, or None when the model has none (base models).

        Args:
            model_file: a ``ModelFile`` (``.chat_template`` or ``.metadata["tokenizer.chat_template"]``).
            tokenizer: the model's ``Tokenizer`` (BOS/EOS texts, control-token texts).
            strict: False keeps a model whose template does not compile usable without it
                (as llama.cpp and Ollama do): a :class:`BrokenChatTemplate` in its place
                (every render raises its TemplateError), and a ``tool_use`` variant that does
                not compile is dropped (the default template serves requests with tools too;
                ``.tool_error`` says why). Reporting either is the caller's.
        Raises:
            TemplateError: with ``strict``, the template (or its ``tool_use`` variant) does not
                parse.
        """
        md = getattr(model_file, "metadata", None) or {}
        src = cls.model_source(model_file)
        if src is None:
            return None

        def text(i):
            if i is None:
                return ""
            return tokenizer.token_bytes(i).decode("utf-8", "replace")

        ctl = []
        try:
            ctl = [text(i) for i in tokenizer.control_ids]
        except Exception:
            pass
        bos, eos = text(tokenizer.bos_id), text(tokenizer.eos_id)
        try:
            return cls(src, bos_token=bos, eos_token=eos, control_tokens=ctl,
                       tool_source=md.get("tokenizer.chat_template.tool_use"))
        except TemplateError as e:
            if strict:
                raise
            first = e
        try:  # the default template alone (it compiles first: the error may be its own)
            tpl = cls(src, bos_token=bos, eos_token=eos, control_tokens=ctl)
        except TemplateError as e:
            return BrokenChatTemplate(src, e, bos_token=bos, eos_token=eos)
        tpl.tool_error = str(first)  # the tool_use variant's
        return tpl

    # ------------------------------------------------------------------ render
    def _render(self, messages: list[dict], tools, add_generation_prompt: bool, extra: dict,
                cancel: Any = None) -> str:
        import jinja2
        from jinja2.exceptions import SecurityError

        kwargs = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        kwargs.update(_to_plain(extra))
        tpl = self._tool_tpl if (tools and self._tool_tpl is not None) else self._tpl
        guard = _Guard(LIMITS, cancel)
        outer, old_trace = _guard(), sys.gettrace()
        _ACTIVE.guard = guard
        sys.settrace(guard.trace)
        try:
            parts, n = [], 0
            for piece in tpl.generate(messages=messages, tools=tools,
                                      add_generation_prompt=bool(add_generation_prompt), **kwargs):
                n += len(piece)
                if n > LIMITS.max_chars:
                    raise TemplateLimitError(
                        "output", f"the chat template's output passed the {LIMITS.max_chars:,}-character "
                        f"limit and was stopped")
                parts.append(piece)
            return "".join(parts)
        except TemplateLimitError:
            raise
        except MemoryError as e:
            raise TemplateLimitError("memory", "the chat template ran out of memory and was stopped") from e
        except SecurityError as e:
            raise TemplateError(f"the chat template tried an unsafe operation and was stopped: {e}") from e
        except jinja2.TemplateError as e:
            raise TemplateError(f"the chat template raised an error: {e.message or e}") from e
        except RecursionError as e:
            raise TemplateError("the chat template recursed too deeply") from e
        except Exception as e:  # TypeError, KeyError, ... inside template expressions
            raise TemplateError(f"the chat template failed: {type(e).__name__}: {e}") from e
        finally:
            sys.settrace(old_trace)
            _ACTIVE.guard = outer

    def _prepare(self, messages, tools):
        msgs = normalize_messages(messages)
        tools_plain = None if tools is None else _to_plain(list(tools))
        # text UTF-8 cannot encode (a lone surrogate: an undecodable byte or a "\ud800"
        # escape) is refused before it reaches the template, naming the field
        # (messages[1].content) as message and param (the server checks the request's own
        # fields first: it rewrites tool traffic for templates without tools)
        require_utf8_in(msgs, "messages")
        require_utf8_in(tools_plain, "tools")
        return msgs, tools_plain

    def render(self, messages: Iterable[Any], tools: list | None = None,
               add_generation_prompt: bool = True, *, cancel: Any = None, **extra: Any) -> str:
        """Render ``messages`` (OpenAI format) into prompt text.

        Args:
            messages: list of ``{"role", "content", ["tool_calls", "tool_call_id", "name"]}``.
            tools: OpenAI tool schemas (``[{"type": "function", "function": {...}}]``) or None.
            add_generation_prompt: append the assistant turn header.
            cancel: a ``threading.Event``; once set, the render stops.
            **extra: more template variables (``enable_thinking=False``, ...).
        Returns:
            the prompt text, BOS text included when the template writes it.
        Raises:
            TemplateError: the template raised (message carried), failed, or tried to reach
                Python internals. TemplateLimitError (a TemplateError): a limit of
                :data:`LIMITS` was hit or ``cancel`` was set (``.limit`` says which).
        """
        msgs, tools_plain = self._prepare(messages, tools)
        return self._render(msgs, tools_plain, add_generation_prompt, extra, cancel)

    def render_marked(self, messages: Iterable[Any], tools: list | None = None,
                      add_generation_prompt: bool = True, *, cancel: Any = None,
                      **extra: Any) -> tuple[str, list[tuple[int, int]]]:
        """Like :meth:`render`, also returning the character spans of control-token text that
        came from messages or tools (not from the template) -- those must be encoded as text."""
        msgs, tools_plain = self._prepare(messages, tools)
        if self.control_tokens:
            msgs = _mark(msgs, self.control_tokens)
            tools_plain = _mark(tools_plain, self.control_tokens)
            extra = _mark(_to_plain(extra), self.control_tokens)
        text = self._render(msgs, tools_plain, add_generation_prompt, extra, cancel)
        return _unmark(text)

    def encode(self, tokenizer: Any, messages: Iterable[Any], tools: list | None = None,
               add_generation_prompt: bool = True, *, cancel: Any = None, **extra: Any) -> list[int]:
        """Render and tokenize a chat prompt safely.

        Control tokens come only from the template (the same text inside a message is encoded
        as plain text); BOS is added only if the model adds one and the template did not
        already write it.

        Returns:
            list of int token ids.
        Raises:
            TemplateError: as :meth:`render`.
        """
        text, spans = self.render_marked(messages, tools, add_generation_prompt, cancel=cancel, **extra)
        add_special = not (self.bos_token and text.startswith(self.bos_token))
        return tokenizer.encode_with_plain_spans(text, spans, add_special=add_special)

    @property
    def renders_bos(self) -> bool:
        """True when the rendered prompt starts with the BOS text (the engine must then not add
        another BOS). Determined by rendering a one-message probe conversation."""
        if self._renders_bos is None:
            self._renders_bos = False
            if self.bos_token:
                for probe in ([{"role": "user", "content": "Hi"}],
                              [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]):
                    try:
                        out = self.render(probe, add_generation_prompt=True)
                    except TemplateError:
                        continue
                    self._renders_bos = out.startswith(self.bos_token)
                    break
        return self._renders_bos

    def __repr__(self) -> str:
        return f"ChatTemplate({len(self.source)} chars, bos={self.bos_token!r}, eos={self.eos_token!r})"


class BrokenChatTemplate:
    """The chat template of a model whose template does not compile: the model loads and
    serves plain completions; everything that needs the template raises the compile error
    (:meth:`render`, :meth:`render_marked`, :meth:`encode`), as loading used to.

    Args:
        source: the template text that does not compile.
        error: its TemplateError (the message is raised again, unchanged, by every render).
        bos_token / eos_token: as for :class:`ChatTemplate`.
    """

    control_tokens: tuple[str, ...] = ()
    tool_source = None
    tool_error = None
    renders_bos = False

    def __init__(self, source: str, error: TemplateError, bos_token: str = "",
                 eos_token: str = ""):
        self.source = source
        self.error = str(error)
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""

    def _fail(self):
        raise TemplateError(self.error)

    def render(self, *args: Any, **kwargs: Any) -> str:
        """Raises TemplateError: the template does not compile."""
        self._fail()

    def render_marked(self, *args: Any, **kwargs: Any) -> tuple[str, list[tuple[int, int]]]:
        """Raises TemplateError: the template does not compile."""
        self._fail()

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        """Raises TemplateError: the template does not compile."""
        self._fail()

    def __repr__(self) -> str:
        return f"BrokenChatTemplate({len(self.source)} chars: {self.error})"
