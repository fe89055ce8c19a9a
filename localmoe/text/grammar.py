"""Constrained decoding: JSON schemas and tool calls compiled to a per-step token mask.

The grammar engine is `llguidance <https://github.com/guidance-ai/llguidance>`_ (chosen over
xgrammar by measurement on our two tokenizers: ``benchmarks/bench_grammar.py``, results in
``benchmarks/results/grammar_engines_cpu.json``). It is a small dependency
(one 3 MB wheel, no dependencies of its own); a broken install makes constrained requests fail
with one line saying what to install, not the server.

Pieces:

* :func:`grammar_tokenizer` -- the engine's view of *our* vocabulary (``Tokenizer.token_bytes``
  for every id, control tokens marked as special, every end-of-generation id an EOS), built
  once per :class:`~localmoe.text.tokenizer.Tokenizer` and cached on it. Because it comes from
  our tokenizer, the same mask works for every backend (reference, torch, triton, llamacpp):
  the engine samples on the host for all of them.
* :class:`Grammar` -- a compiled constraint: :meth:`Grammar.json_schema`,
  :meth:`Grammar.json_object` and :meth:`Grammar.tool_calls` build one (cached per schema and
  tokenizer; compile time for a typical tool schema is a few ms), and refuse schemas the engine
  does not support with :class:`~localmoe.errors.InvalidRequestError` naming the keyword.
* :class:`Constraint` -- the per-generation state: :meth:`Constraint.allowed` gives the mask of
  the next step (bool ``[vocab_size]`` NumPy array), :meth:`Constraint.accept` advances it by
  the sampled token.

JSON is generated compactly (``", "`` and ``": "`` separators, no other whitespace): small
models otherwise tend to spend their budget on newlines inside an object.
"""

from __future__ import annotations

import collections
import json
import re
import threading
import time
from typing import Any, Iterable

import numpy as np

from localmoe.errors import InvalidRequestError, json_value

__all__ = ["Grammar", "Constraint", "grammar_tokenizer", "available", "COMPILE_TIMEOUT_S",
           "tool_call_schema", "validate_schema", "check_schema"]

COMPILE_TIMEOUT_S = 10.0  # a schema that takes longer to compile is refused
_CACHE_SIZE = 128
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_INSTALL_HINT = ("structured output (JSON schema, JSON mode, required tool calls) needs the "
                 "llguidance package, which did not import: pip install llguidance")


def available() -> str | None:
    """None when the grammar engine can be imported, else the reason (one line)."""
    try:
        import llguidance  # noqa: F401
    except Exception:  # noqa: BLE001 -- a broken install is as good as none
        return _INSTALL_HINT
    return None


def _ll():
    try:
        import llguidance
    except Exception:  # noqa: BLE001
        raise InvalidRequestError(_INSTALL_HINT, param="response_format") from None
    return llguidance


class _Wrapper:
    """What llguidance's ``TokenizerWrapper`` reads from a tokenizer object."""

    def __init__(self, tok: Any):
        n = int(tok.vocab_size)
        is_control = getattr(tok, "is_control", lambda i: False)
        tokens = []
        special = []
        for i in range(n):
            b = tok.token_bytes(i)
            if is_control(i):
                # llguidance's convention: special tokens carry a 0xff prefix, so no text ever
                # matches them; grammars can still name them
                b = b"\xff" + b
                special.append(i)
            tokens.append(b)
        self.tokens = tokens
        self.special_token_ids = special
        eog = sorted(int(i) for i in (getattr(tok, "eog_ids", None) or ()) if 0 <= int(i) < n)
        eos = getattr(tok, "eos_id", None)
        self.eos_token_id = eos if eos is not None else (eog[0] if eog else n - 1)
        self.bos_token_id = getattr(tok, "bos_id", None)
        self._tok = tok
        self.eog = eog or [self.eos_token_id]

    def __call__(self, s) -> list[int]:
        if isinstance(s, bytes):
            s = s.decode("utf-8", errors="replace")
        return list(self._tok.encode(s, add_special=False, parse_special=False))


_TOK_LOCK = threading.Lock()


def grammar_tokenizer(tok: Any):
    """llguidance's ``LLTokenizer`` for our tokenizer ``tok`` (built once, cached on ``tok``).

    Args:
        tok: a :class:`~localmoe.text.tokenizer.Tokenizer` (``vocab_size``, ``token_bytes``,
            ``is_control``, ``eog_ids``, ``eos_id``, ``encode``).
    Raises:
        InvalidRequestError: llguidance is not installed.
    """
    ll = _ll()
    with _TOK_LOCK:
        cached = getattr(tok, "_llg_tokenizer", None)
        if cached is not None:
            return cached
        w = _Wrapper(tok)
        try:    # recent llguidance takes every end-of-generation id
            lt = ll.LLTokenizer(ll.TokenizerWrapper(w), n_vocab=len(w.tokens), eos_token=w.eog)
        except TypeError:   # older releases take one: the tokenizer's EOS
            lt = ll.LLTokenizer(ll.TokenizerWrapper(w), n_vocab=len(w.tokens),
                                eos_token=w.eos_token_id)
        try:
            setattr(tok, "_llg_tokenizer", lt)
        except Exception:  # noqa: BLE001 -- an object without attributes: no cache
            pass
        return lt


# --------------------------------------------------------------------------- schema checks

_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


def check_schema(schema: Any, param: str) -> dict:
    """A JSON schema given as a dict or a JSON text, checked for shape.

    Returns:
        the schema as a dict (booleans ``true`` / ``false`` are accepted as schemas too, as
        ``{}`` / ``{"not": {}}``).
    Raises:
        InvalidRequestError: not an object, not JSON, an unknown ``type`` (``param`` names
            the request field).
    """
    if isinstance(schema, (bytes, bytearray)):
        schema = schema.decode("utf-8", errors="replace")
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise InvalidRequestError(f"{param} is not valid JSON: {e}", param=param) from None
    if schema is True:
        return {}
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{param} must be a JSON Schema object", param=param)
    _check_types(schema, param, 0)
    return schema


def _check_types(node: Any, path: str, depth: int) -> None:
    if depth > 64:
        raise InvalidRequestError(f"{path}: the schema nests deeper than 64 levels", param=path)
    if isinstance(node, dict):
        t = node.get("type")
        ts = t if isinstance(t, list) else [t] if t is not None else []
        for x in ts:
            if not isinstance(x, str) or x not in _TYPES:
                raise InvalidRequestError(
                    f"{path}: unknown type {json_value(x)}; JSON Schema types are "
                    f"{', '.join(sorted(_TYPES))}", param=path)
        for k, v in node.items():
            if isinstance(v, (dict, list)):
                _check_types(v, path, depth + 1)
    elif isinstance(node, list):
        for v in node:
            if isinstance(v, (dict, list)):
                _check_types(v, path, depth + 1)


DECIMALS = 6  # fraction digits a "number" gets when its schema has no multipleOf


def closed_objects(schema: Any) -> Any:
    """A copy of ``schema`` tightened for generation, still valid under the original (it
    allows a subset of what the original allows):

    * every object schema that lists ``properties`` and says nothing of
      ``additionalProperties`` / ``patternProperties`` gets ``"additionalProperties": false``
      (xgrammar's strict mode and OpenAI's strict structured outputs do the same; say
      ``"additionalProperties": true`` to allow more keys);
    * every ``"type": "number"`` without ``multipleOf`` gets ``multipleOf`` 10^-:data:`DECIMALS`
      (at most 6 fraction digits, no exponent).

    Without these, small models keep inventing keys, or digits, until max_tokens.
    """
    if isinstance(schema, list):
        return [closed_objects(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in ("properties", "$defs", "definitions", "patternProperties") and isinstance(v, dict):
            out[k] = {name: closed_objects(sub) for name, sub in v.items()}
        elif k in ("enum", "const", "default", "examples", "required"):
            out[k] = v  # values, not schemas
        else:
            out[k] = closed_objects(v)
    if ("properties" in out and "additionalProperties" not in out
            and "patternProperties" not in out):
        out["additionalProperties"] = False
    t = out.get("type")
    if (t == "number" or (isinstance(t, list) and "number" in t)) and "multipleOf" not in out:
        out["multipleOf"] = 10.0 ** -DECIMALS
    return out


def validate_schema(schema: Any, strict: bool = True, param: str = "json_schema") -> dict:
    """Check ``schema`` for constrained decoding without a tokenizer (the server does this
    before the model is needed): shape, types, and that the grammar engine accepts it.

    Returns:
        the schema as a dict.
    Raises:
        InvalidRequestError: invalid or unsupported (naming the keyword); llguidance missing.
    """
    ll = _ll()
    schema = check_schema(schema, param)
    try:
        text = ll.LLMatcher.grammar_from_json_schema(
            schema, overrides=dict(_JSON_OPTIONS, lenient=not strict))
    except (ValueError, TypeError) as e:
        raise _explain(str(e), param) from None
    err = ll.LLMatcher.validate_grammar(text, None, limits=_limits(ll))
    if err and not err.startswith("WARNING"):
        raise _explain(err, param)
    return schema


_UNIMPL = re.compile(r"Unimplemented keys?: \[([^\]]*)\]")


def _explain(err: str, param: str) -> InvalidRequestError:
    """The engine's compile error as a request error naming the keyword when it is one."""
    m = _UNIMPL.search(err)
    if m:
        keys = [k.strip().strip('"') for k in m.group(1).split(",") if k.strip()]
        return InvalidRequestError(
            f"{param}: unsupported JSON Schema keyword{'s' if len(keys) > 1 else ''} "
            f"{', '.join(map(json_value, keys))} (docs/STRUCTURED_OUTPUT.md lists the supported "
            f"ones; on the server a non-strict json_schema ignores unsupported keywords)", param=param)
    return InvalidRequestError(f"{param}: the schema cannot be used for constrained decoding: "
                               f"{_one_line(err)[:300]}", param=param)


_MIN_PROPS = re.compile(r"minProperties \(\d+\) is greater than number of properties \(\d+\)")


def _one_line(err: str) -> str:
    """The grammar engine's error text as one line: a regex error's detail (``unclosed
    group``) joins its first line, caret-only lines and the ``<non-verbose/>`` marker go, and
    the engine's codes get a plain-words hint."""
    lines = [l.strip() for l in err.strip().splitlines()]
    lines = [l for l in lines if l and l != "<non-verbose/>" and l.strip("^ ~")]
    if not lines:
        return "unknown error"
    if lines[0].startswith("regex parse error"):  # regex syntax: "(( ", "^", "error: ..."
        detail = [l[len("error:"):].strip() for l in lines[1:] if l.startswith("error:")]
        pattern = [l for l in lines[1:] if not l.startswith("error:")]
        out = "regex parse error: " + (detail[0] if detail else "invalid pattern")
        return out + (f" in pattern {json_value(pattern[0], None)}" if pattern else "")
    out = " ".join(lines)
    # the engine counts minProperties after subtracting the required keys: its numbers mislead
    out = _MIN_PROPS.sub("minProperties is greater than the number of properties the schema "
                         "allows", out)
    if out == "NoExtensionBias":
        out = ("no token can continue the output (is the schema satisfiable? a $ref that only "
               "refers to itself matches nothing)")
    return out


# --------------------------------------------------------------------------- grammars

def tool_call_schema(tools: list[dict], name: str | None = None, args_key: str = "arguments",
                     strict_args: bool = True) -> dict:
    """The JSON schema of one tool call ``{"name": ..., "<args_key>": {...}}`` over ``tools``
    (OpenAI tool dicts, ``{"type": "function", "function": {"name", "parameters"}}``); only
    the named one when ``name`` is given.

    Raises:
        InvalidRequestError: ``name`` is not among ``tools``.
    """
    alts = []
    for t in tools:
        fn = t.get("function", t)
        if name is not None and fn.get("name") != name:
            continue
        params = fn.get("parameters")
        if not isinstance(params, dict) or not params:
            params = {"type": "object", "properties": {}}
        params = closed_objects(params)
        alts.append({"type": "object",
                     "properties": {"name": {"const": fn["name"]}, args_key: params},
                     "required": ["name", args_key], "additionalProperties": False})
    if not alts:
        raise InvalidRequestError(f"no tool named {name!r} among the tools", param="tool_choice")
    return alts[0] if len(alts) == 1 else {"anyOf": alts}


def lark_literal(tok: Any, text: str) -> str:
    """``text`` as a Lark literal for ``tok``'s vocabulary: the token itself (``<[id]>``) when
    it is one control token there (Mistral's ``[TOOL_CALLS]``, Qwen-style ``<tool_call>`` in
    some files), since control tokens never match plain text; else the quoted string."""
    find = getattr(tok, "token_to_id", None)
    tid = find(text) if find is not None else None
    if tid is not None and getattr(tok, "is_control", lambda i: False)(tid):
        return f"<[{tid}]>"
    return json.dumps(text)


_LRU_LOCK = threading.Lock()
_LRU: "collections.OrderedDict[tuple, str]" = collections.OrderedDict()


class Grammar:
    """A compiled constraint for one tokenizer (immutable; share it between generations).

    Build with :meth:`json_schema`, :meth:`json_object`, :meth:`tool_calls` or
    :meth:`lark`; every builder checks the grammar against the engine before returning, so
    an unusable schema fails at request time, not mid-generation.

    Attributes:
        kind: ``"json_schema"``, ``"json_object"``, ``"tool_calls"`` or ``"lark"``.
        compile_ms: milliseconds the first compile of this grammar took (0.0 from the cache).
    """

    def __init__(self, tok: Any, grammar: str, kind: str, compile_ms: float = 0.0):
        self.tokenizer = tok
        self.text = grammar
        self.kind = kind
        self.compile_ms = compile_ms
        self._lt = grammar_tokenizer(tok)
        self._proto = None  # a fresh matcher, deep-copied per generation (cheaper than building)

    # -- builders ------------------------------------------------------------------------------
    @classmethod
    def json_schema(cls, tok: Any, schema: Any, *, strict: bool = True,
                    param: str = "response_format.json_schema.schema") -> "Grammar":
        """Output must be one JSON value valid under ``schema`` (dict or JSON text).

        ``strict=False`` ignores keywords the engine does not implement (OpenAI's non-strict
        mode promises no validity); ``strict=True`` refuses them.

        Raises:
            InvalidRequestError: invalid or unsupported schema (naming the keyword), a compile
                over :data:`COMPILE_TIMEOUT_S`, or llguidance missing.
        """
        schema = closed_objects(check_schema(schema, param))
        opts = dict(_JSON_OPTIONS, lenient=not strict)
        return cls._build(tok, ("schema", json.dumps(schema, sort_keys=True), strict), "json_schema",
                          lambda ll: ll.LLMatcher.grammar_from_json_schema(schema, overrides=opts),
                          param)

    @classmethod
    def json_object(cls, tok: Any, param: str = "response_format") -> "Grammar":
        """Output must be one JSON object (OpenAI's ``{"type": "json_object"}``)."""
        return cls._build(tok, ("object",), "json_object",
                          lambda ll: ll.LLMatcher.grammar_from_json_schema(
                              {"type": "object"}, overrides=dict(_JSON_OPTIONS)), param)

    @classmethod
    def tool_calls(cls, tok: Any, tools: list[dict], *, fmt: str = "hermes",
                   name: str | None = None, parallel: bool = True,
                   param: str = "tool_choice") -> "Grammar":
        """Output must be one or more tool calls (one with ``parallel=False``) to the declared
        ``tools``, each with arguments valid under its ``parameters`` schema, in the model's
        tool-call syntax ``fmt`` (:data:`localmoe.text.tool_calls.FORMATS`): ``hermes``
        ``<tool_call>\\n{json}\\n</tool_call>``, ``llama3`` bare ``{"name", "parameters"}``
        objects separated by ``; ``, ``mistral`` ``[TOOL_CALLS][{...}, ...]``.

        Raises:
            InvalidRequestError: a parameters schema the engine cannot use (naming the tool).
        """
        args_key = "parameters" if fmt == "llama3" else "arguments"
        names = [t.get("function", t).get("name") for t in tools]
        for t in tools:  # each schema on its own first, so an error names the tool
            fn = t.get("function", t)
            if name is None or fn.get("name") == name:
                cls.json_schema(tok, fn.get("parameters") or {"type": "object"}, strict=True,
                                param=f"tools[{names.index(fn.get('name'))}].function.parameters")
        call = tool_call_schema(tools, name, args_key)
        # the JSON of one call is embedded in a Lark grammar as %json{...}; its options go in
        # the schema's x-guidance field
        body = json.dumps(dict(call, **{"x-guidance": _JSON_OPTIONS}))
        if fmt == "mistral":
            lark = (f'start: {lark_literal(tok, "[TOOL_CALLS]")} "[" call '
                    + ('(", " call)* ' if parallel else "") + '"]"\n')
        elif fmt == "llama3":
            lark = "start: call " + ('("; " call)*' if parallel else "") + "\n"
        else:
            lark = ('start: tc ' + ('("\\n" tc)*' if parallel else "") + "\n"
                    f'tc: {lark_literal(tok, "<tool_call>")} "\\n" call "\\n" '
                    f'{lark_literal(tok, "</tool_call>")}\n')
        lark += f"call: %json{body}\n"
        return cls._build(tok, ("tools", lark), "tool_calls",
                          lambda ll: ll.LLMatcher.grammar_from_lark(lark), param)

    @classmethod
    def lark(cls, tok: Any, grammar: str, param: str = "grammar") -> "Grammar":
        """Output must match a Lark grammar (llguidance's dialect; ``start`` is the root)."""
        if not isinstance(grammar, str) or not grammar.strip():
            raise InvalidRequestError(f"{param} must be a non-empty grammar text", param=param)
        return cls._build(tok, ("lark", grammar), "lark",
                          lambda ll: ll.LLMatcher.grammar_from_lark(grammar), param)

    @classmethod
    def _build(cls, tok: Any, key: tuple, kind: str, make, param: str) -> "Grammar":
        ll = _ll()
        lt = grammar_tokenizer(tok)
        ck = (id(lt),) + key
        with _LRU_LOCK:
            text = _LRU.get(ck)
            if text is not None:
                _LRU.move_to_end(ck)
                g = _LRU_GRAMMARS.get(ck)
                if g is not None:
                    return g
        t0 = time.perf_counter()
        try:
            text = make(ll)
        except (ValueError, TypeError) as e:
            raise _explain(str(e), param) from None
        proto = _compile(ll, lt, text, param)
        g = cls(tok, text, kind, (time.perf_counter() - t0) * 1000.0)
        g._proto = proto
        with _LRU_LOCK:
            _LRU[ck] = text
            _LRU_GRAMMARS[ck] = g
            while len(_LRU) > _CACHE_SIZE:
                old, _ = _LRU.popitem(last=False)
                _LRU_GRAMMARS.pop(old, None)
        return g

    # -- use -----------------------------------------------------------------------------------
    def start(self) -> "Constraint":
        """A fresh :class:`Constraint` at the start of the output."""
        return Constraint(self._proto.deep_copy(), self.tokenizer.vocab_size)

    def __repr__(self) -> str:
        return f"Grammar({self.kind}, {len(self.text)} chars)"


_LRU_GRAMMARS: dict = {}


def _limits(ll):
    # fuel limits bound the work of one compile and of one mask step: a pathological schema
    # ends in an error instead of a hang (the defaults allow ~20 s of lexer work)
    return ll.LLParserLimits(initial_lexer_fuel=2_000_000, step_lexer_fuel=400_000,
                             max_grammar_size=400_000, verbose_errors=False)


def _compile(ll, lt, text: str, param: str):
    """An LLMatcher for ``text``, built in a worker thread (llguidance drops the GIL) and
    refused after :data:`COMPILE_TIMEOUT_S`."""
    out: dict = {}

    def work():
        try:
            out["m"] = ll.LLMatcher(lt, text, log_level=0, limits=_limits(ll))
        except BaseException as e:  # noqa: BLE001 -- reported to the caller
            out["e"] = e

    th = threading.Thread(target=work, name="localmoe-grammar", daemon=True)
    th.start()
    th.join(COMPILE_TIMEOUT_S)
    if th.is_alive():
        raise InvalidRequestError(
            f"{param}: the schema did not compile within {COMPILE_TIMEOUT_S:g} s; simplify it "
            f"(fewer alternatives, shorter patterns, smaller bounds)", param=param)
    if "e" in out:
        raise _explain(str(out["e"]), param)
    m = out["m"]
    if m.is_error():
        raise _explain(m.get_error(), param)
    return m


class Constraint:
    """The state of one constrained generation.

    Args:
        matcher: an llguidance ``LLMatcher`` at the start of the output.
        vocab_size: number of token ids the sampler sees.
    """

    def __init__(self, matcher: Any, vocab_size: int):
        self.m = matcher
        self.vocab_size = int(vocab_size)
        n_words = (self.vocab_size + 31) // 32
        self._bits = np.zeros(n_words, dtype=np.int32)
        self.mask_s = 0.0  # seconds spent computing masks (benchmarks read it)
        self.n_masks = 0

    def allowed(self) -> np.ndarray:
        """The next step's mask: bool ``[vocab_size]``, True = the token may be sampled.

        Raises:
            InvalidRequestError: the grammar needed more work for one step than its limit
                allows (a pathological schema); the generation cannot go on.
        """
        t0 = time.perf_counter()
        self._compute()
        ok = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.vocab_size]
        self.mask_s += time.perf_counter() - t0
        self.n_masks += 1
        return ok.view(bool)

    def allowed_bits(self) -> np.ndarray:
        """The next step's mask packed as the grammar engine computes it (no unpacking; what
        the GPU sampler uploads): int32 ``[ceil(vocab_size/32)]``, bit ``i % 32`` of word
        ``i // 32`` set = token ``i`` may be sampled; a new array.

        Raises:
            InvalidRequestError: as :meth:`allowed`.
        """
        t0 = time.perf_counter()
        self._compute()
        out = self._bits.copy()
        self.mask_s += time.perf_counter() - t0
        self.n_masks += 1
        return out

    def _compute(self) -> None:
        self.m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self.m.is_error():
            raise InvalidRequestError(
                f"the schema's grammar could not compute the next token: "
                f"{_one_line(self.m.get_error())[:200]}; simplify the schema",
                param="response_format")

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token (one the last mask allowed).

        Raises:
            InvalidRequestError: the grammar engine failed on an allowed token (e.g. a
                pattern with a huge repetition count needs more regex states than its limit),
                so the output could not be kept valid under the schema.
        """
        ok = bool(self.m.consume_token(int(token_id)))
        if self.m.is_error():
            raise InvalidRequestError(
                f"the schema's grammar could not go on after the token it allowed: "
                f"{_one_line(self.m.get_error())[:200]}; simplify the schema (e.g. smaller "
                f"repetition counts)", param="response_format")
        return ok

    @property
    def done(self) -> bool:
        """True when the grammar allows nothing more than an end-of-generation token."""
        return bool(self.m.is_stopped())

    @property
    def accepting(self) -> bool:
        """True when the output so far is complete under the grammar."""
        return bool(self.m.is_accepting())


def schema_keywords(schema: Any) -> Iterable[str]:
    """Every key used in ``schema`` (for messages and tests)."""
    if isinstance(schema, dict):
        for k, v in schema.items():
            yield k
            yield from schema_keywords(v)
    elif isinstance(schema, list):
        for v in schema:
            yield from schema_keywords(v)
