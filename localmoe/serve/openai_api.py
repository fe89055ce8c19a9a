"""OpenAI Chat Completions / Completions shaping on top of the engine.

:func:`chat_completion` takes an OpenAI ``/v1/chat/completions`` request body (a dict) and an
``LLM`` and returns a ``ChatCompletion`` dict, or for ``stream=True`` an iterator of
``ChatCompletionChunk`` dicts. :func:`completion` does the same for ``/v1/completions``.
``LLM.chat`` and the HTTP server both go through here, so the Python API and the server return
the same objects.

Request handling:

* Validation raises :class:`~localmoe.errors.InvalidRequestError` with ``param`` naming the
  offending field (``messages[2].content``, ``tool_choice``, ``max_tokens``, ...) before any
  generation starts. Unknown fields are ignored (clients send ``user``, ``metadata``, ...).
* Sampling: ``temperature, top_p, top_k, min_p, frequency_penalty, presence_penalty,
  repeat_penalty, repeat_last_n, seed, logit_bias, stop, max_tokens / max_completion_tokens``
  map onto :class:`~localmoe.engine.sampling.SamplingParams`; unspecified fields keep the model's
  defaults (``LLM.default_sampling()``: the file's ``general.sampling.*`` over the library's).
  ``n`` must be 1; ``logprobs``, ``echo``, ``suffix``, ``best_of > 1`` and non-text
  ``response_format`` are refused with a 400-style error rather than silently ignored.
* Tools: the tool-call syntax is chosen from the chat template (:mod:`localmoe.text.tool_calls`).
  Templates without tool support get the tool list as a Hermes-style system prompt, and past
  assistant tool calls / ``tool`` results are rewritten as ``<tool_call>`` / ``<tool_response>``
  text so any template can render them. ``tool_choice="required"`` or a named function is
  enforced by starting the assistant turn with the call's opening text (e.g.
  ``<tool_call>\\n{"name": "get_weather", "arguments": ``) and letting the model complete it.
* Streaming and non-streaming go through the same incremental parser, so the concatenated
  stream equals the non-streamed message, tool calls included (ids aside).
* Reasoning: with a template that knows ``<think>`` (Qwen3, DeepSeek-R1 style), a leading
  ``<think>...</think>`` block goes to the message's ``reasoning_content`` (stream deltas
  likewise), as llama.cpp's and vLLM's servers do; ``"reasoning_format": "none"`` keeps it in
  ``content``.
* ``finish_reason`` is ``"tool_calls"`` when calls were parsed, else the engine's ``"stop"`` or
  ``"length"`` (a cancelled generation reports ``"stop"``).
* Responses carry a non-standard ``timings`` object (TTFT/TPOT in ms, tok/s) next to ``usage``.

Errors: ``InvalidRequestError`` (bad request), ``ContextOverflowError`` (prompt over the
context; raised when the stream is first advanced for ``stream=True``), ``TemplateError``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import time
import uuid
from typing import Any, Iterator

from localmoe.errors import InvalidRequestError
from localmoe.text.tool_calls import ReasoningSplitter, StreamingToolParser, detect_format, new_call_id

__all__ = ["chat_completion", "completion", "chat", "prepare_chat", "prepare_completion",
           "parse_chat_request", "validate_request", "sampling_kwargs", "ChatRequest", "ChatJob", "CompletionJob"]

_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_SAMPLING_NUM = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                 "repeat_penalty")
_SAMPLING_INT = ("top_k", "repeat_last_n", "seed")


# ----------------------------------------------------------------------------- validation

def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def sampling_kwargs(req: dict, vocab_size: int | None = None) -> dict[str, Any]:
    """Map OpenAI request fields to ``SamplingParams`` keyword arguments.

    Args:
        req: the request body.
        vocab_size: for checking ``logit_bias`` token ids (None: not checked).

    Returns:
        dict of SamplingParams fields present in the request (absent or null ones omitted).

    Raises:
        InvalidRequestError: a field has the wrong type or value (``param`` names it).
    """
    out: dict[str, Any] = {}
    for k in _SAMPLING_NUM:
        v = req.get(k)
        if v is None:
            continue
        if not _is_num(v):
            raise InvalidRequestError(f"{k} must be a number, got {type(v).__name__}", k)
        out[k] = float(v)
    for k in _SAMPLING_INT:
        v = req.get(k)
        if v is None:
            continue
        if not _is_int(v):
            raise InvalidRequestError(f"{k} must be an integer, got {v!r}", k)
        out[k] = v
    # value ranges are checked by SamplingParams.validate (temperature 0..100, top_p 0..1, ...)
    for k in ("max_completion_tokens", "max_tokens"):
        v = req.get(k)
        if v is None:
            continue
        if not _is_int(v) or v < 1:
            raise InvalidRequestError(f"{k} must be a positive integer, got {v!r}", k)
        out.setdefault("max_tokens", v)  # max_completion_tokens wins when both are given
    stop = req.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if (not isinstance(stop, list) or len(stop) > 16
                or not all(isinstance(s, str) and s for s in stop)):
            raise InvalidRequestError(
                "stop must be a non-empty string or a list of at most 16 non-empty strings", "stop")
        out["stop"] = tuple(stop)
    lb = req.get("logit_bias")
    if lb is not None:
        if not isinstance(lb, dict):
            raise InvalidRequestError("logit_bias must be an object mapping token ids to numbers",
                                      "logit_bias")
        bias: dict[int, float] = {}
        for k, v in lb.items():
            try:
                tid = int(k)
            except (TypeError, ValueError):
                raise InvalidRequestError(f"logit_bias key {k!r} is not a token id",
                                          "logit_bias") from None
            if tid < 0 or (vocab_size is not None and tid >= vocab_size):
                raise InvalidRequestError(
                    f"logit_bias token id {tid} is outside the vocabulary (0..{vocab_size})",
                    "logit_bias")
            if not _is_num(v) or not -100 <= v <= 100:
                raise InvalidRequestError(f"logit_bias value for {k} must be in [-100, 100]",
                                          "logit_bias")
            bias[tid] = float(v)
        out["logit_bias"] = bias
    return out


def _make_params(kwargs: dict[str, Any], llm=None):
    """SamplingParams: the model's defaults (``llm.default_sampling()``, from the file's
    ``general.sampling.*``, else the library's) with the request's fields over them."""
    from localmoe.engine.sampling import SamplingParams

    base = None
    fn = getattr(llm, "default_sampling", None)
    if callable(fn):
        try:
            base = fn()
        except Exception:  # noqa: BLE001 -- a broken default must not fail requests
            base = None
    try:
        params = (dataclasses.replace(base, **kwargs) if isinstance(base, SamplingParams)
                  else SamplingParams(**kwargs))
    except TypeError as e:  # a field this SamplingParams does not know
        raise InvalidRequestError(f"unsupported sampling parameter: {e}") from None
    params.validate()
    return params


def _common_checks(req: dict) -> tuple[bool, bool]:
    """Checks shared by both endpoints; returns (stream, include_usage)."""
    n = req.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise InvalidRequestError("n must be 1: this server generates one choice per request", "n")
    stream = req.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise InvalidRequestError("stream must be a boolean", "stream")
    so = req.get("stream_options")
    include_usage = False
    if so is not None:
        if not stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true",
                                      "stream_options")
        if not isinstance(so, dict):
            raise InvalidRequestError("stream_options must be an object", "stream_options")
        iu = so.get("include_usage", False)
        if not isinstance(iu, bool):
            raise InvalidRequestError("stream_options.include_usage must be a boolean",
                                      "stream_options.include_usage")
        include_usage = iu
    if req.get("logprobs"):
        raise InvalidRequestError("logprobs are not supported by this server", "logprobs")
    if req.get("top_logprobs"):
        raise InvalidRequestError("top_logprobs is not supported by this server", "top_logprobs")
    model = req.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequestError("model must be a string", "model")
    return stream, include_usage


def _text_content(content, param: str, allow_none: bool) -> str | None:
    if content is None:
        if allow_none:
            return None
        raise InvalidRequestError(f"{param} is required", param)
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidRequestError(
                    f"{param}[{j}] has type {kind!r}; only text content parts are supported",
                    f"{param}[{j}]")
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidRequestError(f"{param}[{j}].text must be a string",
                                          f"{param}[{j}].text")
            parts.append(text)
        return "".join(parts)
    raise InvalidRequestError(f"{param} must be a string or a list of text parts", param)


def _check_tools(tools) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidRequestError("tools must be a list", "tools")
    out = []
    seen = set()
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise InvalidRequestError(f"{p} must be an object with type 'function'", f"{p}.type")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise InvalidRequestError(f"{p}.function must be an object", f"{p}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise InvalidRequestError(
                f"{p}.function.name must be 1-64 characters of a-z, A-Z, 0-9, '_', '-', '.'",
                f"{p}.function.name")
        if name in seen:
            raise InvalidRequestError(f"duplicate tool name {name!r}", f"{p}.function.name")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidRequestError(f"{p}.function.parameters must be a JSON Schema object",
                                      f"{p}.function.parameters")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise InvalidRequestError(f"{p}.function.description must be a string",
                                      f"{p}.function.description")
        clean = {"name": name}
        if desc is not None:
            clean["description"] = desc
        clean["parameters"] = params if params is not None else {"type": "object", "properties": {}}
        out.append({"type": "function", "function": clean})
    return out


def _check_tool_choice(tc, tools: list[dict]) -> tuple[str, str | None]:
    """Returns (mode, name) with mode in none|auto|required|named."""
    if tc is None:
        return ("auto" if tools else "none"), None
    if isinstance(tc, str):
        if tc not in ("none", "auto", "required"):
            raise InvalidRequestError(
                f"tool_choice must be 'none', 'auto', 'required' or a named function, got {tc!r}",
                "tool_choice")
        if tc == "required" and not tools:
            raise InvalidRequestError("tool_choice 'required' needs a non-empty tools list",
                                      "tool_choice")
        return (tc if tools else "none"), None
    if isinstance(tc, dict) and tc.get("type") == "function" and isinstance(tc.get("function"), dict):
        name = tc["function"].get("name")
        names = [t["function"]["name"] for t in tools]
        if name not in names:
            raise InvalidRequestError(
                f"tool_choice names function {name!r} which is not in tools ({', '.join(names) or 'none given'})",
                "tool_choice")
        return "named", name
    raise InvalidRequestError(
        "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
        "\"function\": {\"name\": ...}}", "tool_choice")


def _check_messages(msgs) -> list[dict]:
    if not isinstance(msgs, list) or not msgs:
        raise InvalidRequestError("messages must be a non-empty list", "messages")
    out = []
    call_ids: list[str] = []  # ids of the tool calls of the assistant messages so far
    anonymous_calls = False   # an earlier call came without an id: any tool_call_id may be its
    for i, m in enumerate(msgs):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidRequestError(f"{p} must be an object", p)
        role = m.get("role")
        if role not in _ROLES:
            raise InvalidRequestError(
                f"{p}.role must be one of system, developer, user, assistant, tool; got {role!r}",
                f"{p}.role")
        if role == "tool" and not isinstance(m.get("tool_call_id"), str):  # OpenAI requires it
            raise InvalidRequestError(
                f"{p}.tool_call_id (a string) is required for a tool message: the id of the "
                f"assistant's tool call it answers", f"{p}.tool_call_id")
        if role == "tool" and m["tool_call_id"] not in call_ids and not anonymous_calls:
            known = (f"the tool call ids before it: {', '.join(map(repr, call_ids))}" if call_ids
                     else "no assistant message before it has tool_calls")
            raise InvalidRequestError(
                f"{p}.tool_call_id {m['tool_call_id']!r} matches no tool call of an earlier "
                f"assistant message ({known}); a tool message answers one of the assistant's "
                f"tool_calls by its id", f"{p}.tool_call_id")
        if role == "developer":
            role = "system"
        if role == "function":  # the deprecated function role: name, no tool_call_id
            role = "tool"
        msg: dict[str, Any] = {"role": role}
        calls = m.get("tool_calls") if role == "assistant" else None
        content = _text_content(m.get("content"), f"{p}.content",
                                allow_none=(role == "assistant"))
        msg["content"] = content
        if calls is not None:
            if not isinstance(calls, list):
                raise InvalidRequestError(f"{p}.tool_calls must be a list", f"{p}.tool_calls")
            clean_calls = []
            for j, c in enumerate(calls):
                q = f"{p}.tool_calls[{j}]"
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise InvalidRequestError(f"{q}.function.name is required", f"{q}.function")
                args = fn.get("arguments", "{}")
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except ValueError:
                        raise InvalidRequestError(f"{q}.function.arguments is not valid JSON",
                                                  f"{q}.function.arguments") from None
                if not isinstance(args, dict):
                    raise InvalidRequestError(f"{q}.function.arguments must be a JSON object",
                                              f"{q}.function.arguments")
                if c.get("id"):
                    call_ids.append(str(c["id"]))
                else:
                    anonymous_calls = True
                clean_calls.append({"id": c.get("id") or new_call_id(), "type": "function",
                                    "function": {"name": fn["name"], "arguments": args}})
            if clean_calls:
                msg["tool_calls"] = clean_calls
        if content is None and "tool_calls" not in msg:
            raise InvalidRequestError(f"{p}.content is required", f"{p}.content")
        if role == "tool":
            tcid = m.get("tool_call_id")
            if tcid is not None:
                msg["tool_call_id"] = str(tcid)
        name = m.get("name")
        if isinstance(name, str):
            msg["name"] = name
        out.append(msg)
    return out


@dataclasses.dataclass
class ChatRequest:
    """A validated chat request.

    Attributes:
        messages: normalized messages (text content; tool-call arguments as dicts).
        tools: normalized tool list (possibly empty).
        tool_mode: "none" | "auto" | "required" | "named"; tool_name for "named".
        params: SamplingParams.
        stream, include_usage: streaming flags.
        model: the requested model name or None.
        parallel_tool_calls: False keeps only the first parsed call.
    """

    messages: list[dict]
    tools: list[dict]
    tool_mode: str
    tool_name: str | None
    params: Any
    stream: bool
    include_usage: bool
    model: str | None
    parallel_tool_calls: bool = True
    reasoning_format: str = "auto"


def parse_chat_request(req: dict, vocab_size: int | None = None, llm=None) -> ChatRequest:
    """Validate a ``/v1/chat/completions`` body.

    Raises:
        InvalidRequestError: naming the offending parameter.
    """
    if not isinstance(req, dict):
        raise InvalidRequestError("request body must be a JSON object")
    stream, include_usage = _common_checks(req)
    messages = _check_messages(req.get("messages"))
    tools = _check_tools(req.get("tools"))
    mode, name = _check_tool_choice(req.get("tool_choice"), tools)
    ptc = req.get("parallel_tool_calls", True)
    if ptc is None:
        ptc = True
    if not isinstance(ptc, bool):
        raise InvalidRequestError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    rf = req.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise InvalidRequestError(
            "response_format other than {\"type\": \"text\"} is not supported", "response_format")
    rfmt = req.get("reasoning_format", "auto")
    if rfmt is None:
        rfmt = "auto"
    if rfmt not in ("auto", "none"):
        raise InvalidRequestError("reasoning_format must be 'auto' (split <think> blocks into "
                                  "reasoning_content) or 'none' (keep them in content)",
                                  "reasoning_format")
    params = _make_params(sampling_kwargs(req, vocab_size), llm)
    return ChatRequest(messages, tools, mode, name, params, stream, include_usage,
                       req.get("model"), ptc, rfmt)


# ------------------------------------------------------------------------ template adaption

TOOL_SYSTEM_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    "{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


def _template_source(llm) -> str | None:
    tpl = getattr(llm, "template", None)
    if tpl is None:
        return None
    for attr in ("source", "template_source", "text"):
        v = getattr(tpl, attr, None)
        if isinstance(v, str):
            return v
    return None


def _template_knows_tools(src: str | None) -> bool:
    return bool(src) and "tools" in src and ("tool_calls" in src or "tool_call" in src
                                             or "ipython" in src or "[TOOL_CALLS]" in src)


def _prepare_messages(messages: list[dict], tools: list[dict], knows_tools: bool,
                      use_tools: bool) -> tuple[list[dict], list[dict] | None]:
    """Messages and the tools argument for the template.

    Templates that know tools get the tools list and the messages as they are (content None
    becomes ""). Other templates get a Hermes-style tool system prompt and tool traffic
    rewritten as plain text.
    """
    if knows_tools:
        msgs = [dict(m, content=m["content"] if m["content"] is not None else "") for m in messages]
        return msgs, (tools if use_tools and tools else None)
    msgs: list[dict] = []
    for m in messages:
        role, content = m["role"], m["content"] or ""
        if role == "assistant" and m.get("tool_calls"):
            blocks = [
                "<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                              "arguments": c["function"]["arguments"]},
                                             ensure_ascii=False) + "\n</tool_call>"
                for c in m["tool_calls"]]
            content = (content + "\n" if content else "") + "\n".join(blocks)
            msgs.append({"role": "assistant", "content": content})
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if msgs and msgs[-1]["role"] == "user" and msgs[-1].get("_tool"):
                msgs[-1]["content"] += "\n" + block
            else:
                msgs.append({"role": "user", "content": block, "_tool": True})
        else:
            msgs.append({"role": role, "content": content})
    for m in msgs:
        m.pop("_tool", None)
    if use_tools and tools:
        sys_text = TOOL_SYSTEM_PROMPT.format(
            tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if msgs and msgs[0]["role"] == "system":
            msgs[0] = {"role": "system", "content": msgs[0]["content"] + "\n\n" + sys_text}
        else:
            msgs.insert(0, {"role": "system", "content": sys_text})
    return msgs, None


def _forced_prefix(fmt: str, mode: str, name: str | None) -> str:
    """Opening text of a tool call that the assistant turn is started with."""
    if mode == "named":
        head = '{"name": ' + json.dumps(name) + ', "%s": '
    else:
        head = '{"name": "'
    if fmt == "llama3":
        return head.replace("%s", "parameters")
    head = head.replace("%s", "arguments")
    if fmt == "mistral":
        return "[TOOL_CALLS][" + head
    return "<tool_call>\n" + head


def _forced_prompt_ids(llm, messages: list[dict], tools, prefix: str) -> list[int]:
    """Token ids of the chat prompt followed by ``prefix`` as the start of the reply.

    The template's control tokens are encoded as control tokens, message text as plain text
    (``ChatTemplate.encode``); the prefix's own markup (``<tool_call>``, ``[TOOL_CALLS]``) is
    parsed as special tokens where the vocabulary has them.
    """
    tok = llm.tokenizer
    tpl = getattr(llm, "template", None)
    chat_ids = getattr(llm, "_chat_ids", None)  # the engine's own chat encoding (one BOS)
    if callable(chat_ids):
        ids = list(chat_ids(messages, tools))
    elif tpl is not None and hasattr(tpl, "encode"):
        ids = list(tpl.encode(tok, messages, tools=tools, add_generation_prompt=True))
    else:
        ids = list(tok.encode(llm.render_chat(messages, tools=tools), add_special=True,
                              parse_special=False))
    return ids + list(tok.encode(prefix, add_special=False, parse_special=True))


# ------------------------------------------------------------------------------- shaping

def _now() -> int:
    return int(time.time())


def _timings_dict(result) -> dict | None:
    t = getattr(result, "timings", None)
    if t is None:
        return None
    if hasattr(t, "to_dict"):
        return t.to_dict()
    if dataclasses.is_dataclass(t):
        return dataclasses.asdict(t)
    if isinstance(t, dict):
        return dict(t)
    return None


def _usage(result) -> dict:
    p = int(getattr(result, "prompt_tokens", 0) or 0)
    c = int(getattr(result, "completion_tokens", 0) or 0)
    out = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
    cached = getattr(result, "cached_tokens", None)
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": int(cached)}
    return out


def _finish(result, n_calls: int) -> str:
    if n_calls:
        return "tool_calls"
    fr = getattr(result, "finish_reason", "stop") if result is not None else "stop"
    return "length" if fr == "length" else "stop"


def _fingerprint(llm) -> str:
    from localmoe import __version__

    return f"localmoe-{__version__}-{getattr(llm, 'backend_name', 'unknown')}"


class _Gen:
    """One chat generation: engine events -> (content delta | tool call) events."""

    def __init__(self, llm, creq: ChatRequest, cancel: threading.Event | None):
        self.llm = llm
        self.creq = creq
        self.cancel = cancel
        src = _template_source(llm)
        self.fmt = detect_format(src)
        knows = _template_knows_tools(src)
        use_tools = creq.tool_mode != "none"
        self.messages, self.tpl_tools = _prepare_messages(creq.messages, creq.tools, knows,
                                                          use_tools)
        self.parser = (StreamingToolParser(self.fmt, [t["function"]["name"] for t in creq.tools])
                       if use_tools and creq.tools else None)
        self.result = None
        self.n_calls = 0
        self.splitter = None
        if (src and "<think>" in src and creq.reasoning_format != "none"
                and creq.tool_mode not in ("required", "named")):
            try:  # a template whose generation prompt opens the block itself
                prompt = self.llm.render_chat(self.messages, tools=self.tpl_tools)
                opened = prompt.rstrip().endswith("<think>")
            except Exception:  # noqa: BLE001 -- the engine reports template errors itself
                opened = False
            self.splitter = ReasoningSplitter(start_in_think=opened)

    def _engine_events(self):
        creq = self.creq
        if creq.tool_mode in ("required", "named"):
            prefix = _forced_prefix(self.fmt, creq.tool_mode, creq.tool_name)
            ids = _forced_prompt_ids(self.llm, self.messages, self.tpl_tools, prefix)
            self.parser.push(prefix)  # nothing can be settled inside an open call
            return self.llm.generate(ids, stream=True, cancel=self.cancel, params=creq.params)
        return self.llm.chat_stream(self.messages, creq.params, tools=self.tpl_tools,
                                    cancel=self.cancel)

    def events(self) -> Iterator[tuple[str, Any]]:
        """Yields ("start", None) once the engine produced its first event (so prompt errors
        surface before anything is sent), then ("content", str) / ("call", ToolCall)."""
        it = iter(self._engine_events())
        try:
            started = False
            for ev in it:
                if not started:
                    started = True
                    yield ("start", None)
                if ev.delta:
                    if self.splitter is None:
                        yield from self._content(ev.delta)
                    else:
                        for kind, text in self.splitter.push(ev.delta):
                            if kind == "reasoning":
                                yield ("reasoning", text)
                            else:
                                yield from self._content(text)
                if ev.done:
                    self.result = ev.result
                    break
            if not started:
                yield ("start", None)
            if self.splitter is not None:
                for kind, text in self.splitter.finish():
                    if kind == "reasoning":
                        yield ("reasoning", text)
                    else:
                        yield from self._content(text)
            if self.parser is not None:
                yield from self._filter(self.parser.finish())
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def _content(self, text: str):
        if self.parser is None:
            yield ("content", text)
        else:
            yield from self._filter(self.parser.push(text))

    def _filter(self, evs):
        for kind, val in evs:
            if kind == "call":
                if self.n_calls and not self.creq.parallel_tool_calls:
                    continue
                self.n_calls += 1
            yield kind, val


class ChatJob:
    """A validated chat request bound to an LLM, ready to run once.

    Attributes:
        stream: whether the request asked for a stream.
        model: model id reported in responses.
        result: the engine's GenerationResult once finished (None before).
        t_first: ``time.perf_counter()`` when the engine produced its first event (or None).
        t_end: ``time.perf_counter()`` when generation ended (or None).
    """

    def __init__(self, llm, creq: ChatRequest, cancel, model: str):
        self.gen = _Gen(llm, creq, cancel)
        self.stream = creq.stream
        self.include_usage = creq.include_usage
        self.model = model
        self.id = "chatcmpl-" + uuid.uuid4().hex[:24]
        self.created = _now()
        self.fp = _fingerprint(llm)
        self.t_first: float | None = None
        self.t_end: float | None = None

    @property
    def result(self):
        return self.gen.result

    def _events(self):
        try:
            for kind, val in self.gen.events():
                if kind == "start":
                    self.t_first = time.perf_counter()
                yield kind, val
        finally:
            self.t_end = time.perf_counter()

    def response(self) -> dict:
        """Run to completion; the ChatCompletion dict."""
        content: list[str] = []
        reasoning: list[str] = []
        calls: list[dict] = []
        for kind, val in self._events():
            if kind == "content":
                content.append(val)
            elif kind == "reasoning":
                reasoning.append(val)
            elif kind == "call":
                calls.append({"id": new_call_id(self.gen.fmt), "type": "function",
                              "function": {"name": val.name, "arguments": val.arguments}})
        text = "".join(content)
        msg: dict[str, Any] = {"role": "assistant",
                               "content": text if (text or not calls) else None}
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
        if calls:
            msg["tool_calls"] = calls
        out = {"id": self.id, "object": "chat.completion", "created": self.created,
               "model": self.model, "system_fingerprint": self.fp,
               "choices": [{"index": 0, "message": msg, "logprobs": None,
                            "finish_reason": _finish(self.result, len(calls))}],
               "usage": _usage(self.result)}
        t = _timings_dict(self.result)
        if t is not None:
            out["timings"] = t
        return out

    def chunks(self) -> Iterator[dict]:
        """Run as a stream of ChatCompletionChunk dicts; closing it cancels generation."""
        usage_field = {"usage": None} if self.include_usage else {}

        def chunk(delta: dict, finish=None) -> dict:
            return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.model, "system_fingerprint": self.fp,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                 "finish_reason": finish}], **usage_field}

        events = self._events()
        try:
            n_calls = 0
            for kind, val in events:
                if kind == "start":
                    yield chunk({"role": "assistant", "content": ""})
                elif kind == "content":
                    yield chunk({"content": val})
                elif kind == "reasoning":
                    yield chunk({"reasoning_content": val})
                else:
                    yield chunk({"tool_calls": [{"index": n_calls, "id": new_call_id(self.gen.fmt),
                                                 "type": "function",
                                                 "function": {"name": val.name,
                                                              "arguments": ""}}]})
                    yield chunk({"tool_calls": [{"index": n_calls,
                                                 "function": {"arguments": val.arguments}}]})
                    n_calls += 1
            last = chunk({}, _finish(self.result, n_calls))
            t = _timings_dict(self.result)
            if t is not None:
                last["timings"] = t
            yield last
            if self.include_usage:
                yield {"id": self.id, "object": "chat.completion.chunk",
                       "created": self.created, "model": self.model,
                       "system_fingerprint": self.fp, "choices": [],
                       "usage": _usage(self.result)}
        finally:
            events.close()


def prepare_chat(llm, request: dict, *, cancel: threading.Event | None = None,
                 model_name: str | None = None) -> ChatJob:
    """Validate a chat request and bind it to ``llm`` without generating anything yet.

    Raises:
        InvalidRequestError: naming the offending parameter.
    """
    vocab = getattr(getattr(llm, "tokenizer", None), "vocab_size", None)
    creq = parse_chat_request(request, vocab, llm)
    model = model_name or creq.model or getattr(llm, "model_name", "localmoe")
    return ChatJob(llm, creq, cancel, model)


def chat_completion(llm, request: dict, *, cancel: threading.Event | None = None,
                    model_name: str | None = None) -> dict | Iterator[dict]:
    """Run an OpenAI chat completion request on ``llm``.

    Args:
        llm: an engine ``LLM`` (uses ``chat_stream``, ``generate``, ``render_chat``,
            ``template``, ``tokenizer``, ``model_name``, ``backend_name``).
        request: the request body (dict) as OpenAI's API takes it.
        cancel: a threading.Event that stops generation when set.
        model_name: the model id reported in responses (default: request's ``model`` or
            ``llm.model_name``).

    Returns:
        A ChatCompletion dict, or for ``stream=True`` an iterator of ChatCompletionChunk dicts
        (the last one carries ``usage`` when ``stream_options.include_usage``). Closing the
        iterator cancels the generation.

    Raises:
        InvalidRequestError: invalid request (``param`` names the field).
        ContextOverflowError: prompt longer than the context (for streams: on first ``next``).
        TemplateError: the chat template refused the messages.
    """
    job = prepare_chat(llm, request, cancel=cancel, model_name=model_name)
    return job.chunks() if job.stream else job.response()


# --------------------------------------------------------------------------- completions

class CompletionJob:
    """A validated ``/v1/completions`` request bound to an LLM (see :class:`ChatJob`)."""

    def __init__(self, llm, prompt, params, stream: bool, include_usage: bool, cancel,
                 model: str):
        self.llm, self.prompt, self.params, self.cancel = llm, prompt, params, cancel
        self.stream, self.include_usage, self.model = stream, include_usage, model
        self.id = "cmpl-" + uuid.uuid4().hex[:24]
        self.created = _now()
        self.fp = _fingerprint(llm)
        self.result = None
        self.t_first: float | None = None
        self.t_end: float | None = None

    def _chunk(self, text: str, finish=None) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "system_fingerprint": self.fp,
                "choices": [{"index": 0, "text": text, "logprobs": None,
                             "finish_reason": finish}]}

    def _events(self):
        prompt = self.prompt
        if isinstance(prompt, str):
            # like llama.cpp's server: special-token text in a raw prompt (<|im_start|>, ...)
            # becomes those tokens, so hand-written chat markup works
            tok = self.llm.tokenizer
            prompt = tok.encode(prompt, add_special=True,
                                parse_special=True)
        it = iter(self.llm.generate(prompt, stream=True, raw=True, cancel=self.cancel,
                                    params=self.params))
        try:
            for ev in it:
                if self.t_first is None:
                    self.t_first = time.perf_counter()
                yield ev
                if ev.done:
                    self.result = ev.result
                    break
        finally:
            self.t_end = time.perf_counter()
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def response(self) -> dict:
        """Run to completion; the ``text_completion`` dict."""
        parts = [ev.delta or "" for ev in self._events()]
        out = self._chunk("".join(parts), _finish(self.result, 0))
        out["usage"] = _usage(self.result)
        t = _timings_dict(self.result)
        if t is not None:
            out["timings"] = t
        return out

    def chunks(self) -> Iterator[dict]:
        """Run as a stream of ``text_completion`` chunks; closing it cancels generation."""
        events = self._events()
        try:
            for ev in events:
                if ev.delta:
                    yield self._chunk(ev.delta)
            last = self._chunk("", _finish(self.result, 0))
            t = _timings_dict(self.result)
            if t is not None:
                last["timings"] = t
            yield last
            if self.include_usage:
                u = self._chunk("")
                u["choices"] = []
                u["usage"] = _usage(self.result)
                yield u
        finally:
            events.close()


def prepare_completion(llm, request: dict, *, cancel: threading.Event | None = None,
                       model_name: str | None = None) -> CompletionJob:
    """Validate a ``/v1/completions`` body and bind it to ``llm``.

    ``prompt`` is a string, a one-element list of strings, or a list of token ids.

    Raises:
        InvalidRequestError: naming the offending parameter.
    """
    vocab = getattr(getattr(llm, "tokenizer", None), "vocab_size", None)
    prompt, params, stream, include_usage = _parse_completion_request(request, vocab, llm)
    model = model_name or request.get("model") or getattr(llm, "model_name", "localmoe")
    return CompletionJob(llm, prompt, params, stream, include_usage, cancel, model)


def _parse_completion_request(request: dict, vocab: int | None, llm=None):
    """Validate a ``/v1/completions`` body; returns (prompt, params, stream, include_usage).
    ``vocab`` None skips the token-id range checks; ``llm`` None uses the library's sampling
    defaults as the base."""
    if not isinstance(request, dict):
        raise InvalidRequestError("request body must be a JSON object")
    stream, include_usage = _common_checks(request)
    prompt = request.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not prompt or not all(_is_int(t) and t >= 0 and (vocab is None or t < vocab)
                                 for t in prompt):
            raise InvalidRequestError(
                "prompt must be a string, a list with one string, or a list of token ids "
                "inside the vocabulary (one prompt per request)", "prompt")
    elif not isinstance(prompt, str) or not prompt:
        raise InvalidRequestError("prompt must be a non-empty string", "prompt")
    if request.get("echo"):
        raise InvalidRequestError("echo is not supported by this server", "echo")
    if request.get("suffix"):
        raise InvalidRequestError("suffix is not supported by this server", "suffix")
    bo = request.get("best_of")
    if bo is not None and bo != 1:
        raise InvalidRequestError("best_of must be 1", "best_of")
    params = _make_params(sampling_kwargs(request, vocab), llm)
    return prompt, params, stream, include_usage


def validate_request(endpoint: str, request: dict) -> None:
    """Check a request body without a model (the server does this while the model loads, so
    a bad request gets its 400 at once instead of a 503).

    Checks everything that does not need the model: JSON shape, fields, types, value ranges,
    messages, tools, tool_choice. Token ids (``logit_bias``, token prompts) are checked against
    the vocabulary only once the model is there.

    Args:
        endpoint: ``"chat"`` (``/v1/chat/completions``) or ``"completion"`` (``/v1/completions``).
        request: the request body.

    Raises:
        InvalidRequestError: naming the offending parameter.
        ValueError: unknown ``endpoint``.
    """
    if endpoint == "chat":
        parse_chat_request(request)
    elif endpoint == "completion":
        _parse_completion_request(request, None)
    else:
        raise ValueError(f"unknown endpoint kind {endpoint!r}")


def completion(llm, request: dict, *, cancel: threading.Event | None = None,
               model_name: str | None = None) -> dict | Iterator[dict]:
    """Run an OpenAI legacy ``/v1/completions`` request (raw prompt, no chat template).

    Returns a ``text_completion`` dict or, for ``stream=True``, an iterator of them.

    Raises:
        InvalidRequestError, ContextOverflowError: as :func:`chat_completion`.
    """
    job = prepare_completion(llm, request, cancel=cancel, model_name=model_name)
    return job.chunks() if job.stream else job.response()


# ------------------------------------------------------------------------------ Python API

def chat(llm, messages: list[dict], *, tools: list[dict] | None = None, tool_choice=None,
         stream: bool = False, cancel: threading.Event | None = None,
         **sampling) -> dict | Iterator[dict]:
    """``LLM.chat``: the Python API over :func:`chat_completion`.

    Args:
        messages: OpenAI-style messages.
        tools, tool_choice: as in the OpenAI API.
        stream: return an iterator of chunks instead of one ChatCompletion.
        cancel: threading.Event that stops the generation.
        **sampling: SamplingParams fields or OpenAI names (temperature, top_p, top_k, min_p,
            repeat_penalty, frequency_penalty, presence_penalty, seed, stop, max_tokens,
            max_completion_tokens, logit_bias, stream_options, parallel_tool_calls).

    Returns/Raises: as :func:`chat_completion`.
    """
    req: dict[str, Any] = {"messages": messages, "stream": stream}
    if tools is not None:
        req["tools"] = tools
    if tool_choice is not None:
        req["tool_choice"] = tool_choice
    for k, v in sampling.items():
        if k == "stop" and isinstance(v, tuple):
            v = list(v)
        req[k] = v
    return chat_completion(llm, req, cancel=cancel)
