"""OpenAI request parsing and validation (``/v1/chat/completions``, ``/v1/completions``).

Every check raises :class:`~localmoe.errors.InvalidRequestError` with ``param`` naming the
offending field (``messages[2].content``, ``tool_choice``, ``max_tokens``, ...) before any
generation starts; unknown fields are ignored. No model is needed except for the token-id
range checks and the model's sampling defaults (see :func:`validate_request`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from localmoe.errors import InvalidRequestError, require_utf8, require_utf8_in
from localmoe.errors import json_value as _json_value
from localmoe.text.tool_calls import new_call_id

_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_SAMPLING_NUM = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                 "repeat_penalty")
_SAMPLING_INT = ("top_k", "repeat_last_n", "seed")
#: the chat request fields beside ``model``, ``messages``, ``tools``, ``tool_choice`` and
#: ``stream`` that the chat path reads (sampling, output shape, logprobs, legacy functions)
CHAT_FIELDS = frozenset(_SAMPLING_NUM + _SAMPLING_INT + (
    "max_tokens", "max_completion_tokens", "stop", "logit_bias", "response_format", "logprobs",
    "top_logprobs", "n", "parallel_tool_calls", "stream_options", "reasoning_format",
    "functions", "function_call", "user", "text"))


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
            raise InvalidRequestError(f"{k} must be a number, got {_json_value(v)}", k)
        out[k] = float(v)
    for k in _SAMPLING_INT:
        v = req.get(k)
        if v is None:
            continue
        if not _is_int(v):
            raise InvalidRequestError(f"{k} must be an integer, got {_json_value(v)}", k)
        out[k] = v
    # value ranges are checked by SamplingParams.validate (temperature 0..100, top_p 0..1, ...)
    for k in ("max_completion_tokens", "max_tokens"):
        v = req.get(k)
        if v is None:
            continue
        if not _is_int(v) or v < 1:
            raise InvalidRequestError(f"{k} must be a positive integer, got {_json_value(v)}",
                                      k)
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
                raise InvalidRequestError(f"logit_bias key {_json_value(k)} is not a token id",
                                          "logit_bias") from None
            if tid < 0 or (vocab_size is not None and tid >= vocab_size):
                top = "" if vocab_size is None else f" (0..{vocab_size - 1})"
                raise InvalidRequestError(
                    f"logit_bias token id {tid} is outside the vocabulary{top}", "logit_bias")
            if not _is_num(v) or not -100 <= v <= 100:
                raise InvalidRequestError(f"logit_bias value for {k} must be a number in "
                                          f"[-100, 100], got {_json_value(v)}", "logit_bias")
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
    if n is not None and not _is_int(n):
        raise InvalidRequestError(f"n must be an integer, got {_json_value(n)}", "n")
    if n is not None and n != 1:
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
    model = req.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequestError("model must be a string", "model")
    user = req.get("user")  # an end-user id (OpenAI's is a string), ignored here
    if user is not None and not isinstance(user, str):
        raise InvalidRequestError(f"user must be a string, got {_json_kind(user)}", "user")
    return stream, include_usage


def _chat_logprobs(req: dict) -> int | None:
    """``logprobs`` (bool) and ``top_logprobs`` (0..20) of a chat request as the sampler's
    ``logprobs`` count: None = off, else the number of alternatives."""
    from localmoe.engine.sampling import MAX_TOP_LOGPROBS

    lp = req.get("logprobs")
    top = req.get("top_logprobs")
    if lp is not None and not isinstance(lp, bool):
        raise InvalidRequestError("logprobs must be true or false (top_logprobs sets how many "
                                  "alternatives)", "logprobs")
    if top is not None:
        if not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(
                f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got "
                f"{_json_value(top)}",
                "top_logprobs")
        if not lp:
            raise InvalidRequestError("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if lp else None


def _completion_logprobs(req: dict) -> int | None:
    """``logprobs`` of a ``/v1/completions`` request (an integer 0..20: alternatives per
    token; OpenAI allows at most 5, lm-evaluation-harness asks for up to 10)."""
    from localmoe.engine.sampling import MAX_TOP_LOGPROBS

    lp = req.get("logprobs")
    if lp is None or lp is False:
        return None
    if not _is_int(lp) or not 0 <= lp <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(
            f"logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS} (alternatives per "
            f"token), got {_json_value(lp)}", "logprobs")
    return lp


def _response_format(rf) -> tuple[str, Any, bool]:
    """(kind, schema, strict) of a ``response_format``: kind ``text``, ``json_object`` or
    ``json_schema``; the schema is checked for shape and against the grammar engine (no
    model needed), so a bad one gets its 400 before anything is queued. A ``json_schema``
    without a ``schema`` constrains the reply as ``json_object`` does (one JSON object; a bare
    ``{}`` schema would also let a small model answer ``null``)."""
    if rf is None:
        return "text", None, False
    if not isinstance(rf, dict):
        raise InvalidRequestError("response_format must be an object with a type",
                                  "response_format")
    kind = rf.get("type")
    if kind == "text":
        return "text", None, False
    if kind == "json_object":
        return "json_object", None, False
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise InvalidRequestError(
                "response_format.json_schema must be an object {\"name\", \"schema\", "
                "\"strict\"}", "response_format.json_schema")
        name = js.get("name")
        if name is not None and not isinstance(name, str):
            raise InvalidRequestError("response_format.json_schema.name must be a string",
                                      "response_format.json_schema.name")
        strict = js.get("strict", False)
        if strict is None:
            strict = False
        if not isinstance(strict, bool):
            raise InvalidRequestError("response_format.json_schema.strict must be a boolean",
                                      "response_format.json_schema.strict")
        if js.get("schema") is None:   # no schema given: a JSON object, as json_object mode
            return "json_object", None, False
        schema = js["schema"]
        from localmoe.text.grammar import validate_schema

        schema = validate_schema(schema, strict, "response_format.json_schema.schema")
        return "json_schema", schema, strict
    raise InvalidRequestError(
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got "
        f"{_json_value(kind)}", "response_format.type")


def _refuse_other_shapes(req: dict) -> None:
    """A clear 400 for the deprecated ``functions`` fields and the Responses API's fields,
    which this endpoint does not read (silently ignoring them would drop the constraint)."""
    if req.get("functions") is not None or req.get("function_call") is not None:
        which = "functions" if req.get("functions") is not None else "function_call"
        raise InvalidRequestError(
            f"{which} is the deprecated function-calling API; send tools "
            f"([{{\"type\": \"function\", \"function\": {{...}}}}]) and tool_choice instead",
            which)
    text = req.get("text")
    if isinstance(text, dict) and "format" in text:
        raise InvalidRequestError(
            "text.format is the Responses API's field; /v1/chat/completions takes "
            "response_format ({\"type\": \"json_schema\", \"json_schema\": {\"name\", "
            "\"schema\", \"strict\"}})", "text.format")
    for k in ("input", "instructions", "max_output_tokens"):
        if req.get(k) is not None:
            raise InvalidRequestError(
                f"{k} is a Responses API field (/v1/responses is not served); send messages "
                f"to /v1/chat/completions", k)


def _text_content(content, param: str, allow_none: bool) -> str | None:
    """A message's content (at ``param``, ``messages[i].content``) as one string; a text
    UTF-8 cannot encode (a lone surrogate, JSON ``"\\ud800"``) is refused naming its field,
    ``messages[i].content`` or ``messages[i].content[j].text`` for a content part."""
    if content is None:
        if allow_none:
            return None
        raise InvalidRequestError(f"{param} is required", param)
    if isinstance(content, str):
        require_utf8(content, param, param)
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise InvalidRequestError(
                    f"{param}[{j}] is {_json_kind(part)}; a content part is an object "
                    f"{{\"type\": \"text\", \"text\": ...}}", f"{param}[{j}]")
            if part.get("type") not in ("text", "input_text"):
                raise InvalidRequestError(
                    f"{param}[{j}] has type {_json_value(part.get('type'))}; only text content "
                    f"parts are supported", f"{param}[{j}]")
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidRequestError(f"{param}[{j}].text must be a string",
                                          f"{param}[{j}].text")
            require_utf8(text, f"{param}[{j}].text", f"{param}[{j}].text")
            parts.append(text)
        return "".join(parts)
    raise InvalidRequestError(f"{param} must be a string or a list of text parts", param)


def _check_tools(tools) -> list[dict]:
    from localmoe.text.grammar import check_schema

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
            raise InvalidRequestError(f"duplicate tool name {_json_value(name)}",
                                      f"{p}.function.name")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidRequestError(f"{p}.function.parameters must be a JSON Schema object",
                                      f"{p}.function.parameters")
        if params is not None:
            # shape and types for every tool choice (the grammar compile of tool_choice
            # "required" checks more); an unknown "type" was accepted under "auto"
            check_schema(params, f"{p}.function.parameters")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise InvalidRequestError(f"{p}.function.description must be a string",
                                      f"{p}.function.description")
        clean = {"name": name}
        if desc is not None:
            clean["description"] = desc
        clean["parameters"] = params if params is not None else {"type": "object", "properties": {}}
        require_utf8_in(clean, f"{p}.function")   # it may be rendered into a system message
        out.append({"type": "function", "function": clean})
    return out


def _check_tool_choice(tc, tools: list[dict]) -> tuple[str, str | None]:
    """Returns (mode, name) with mode in none|auto|required|named."""
    if tc is None:
        return ("auto" if tools else "none"), None
    if isinstance(tc, str):
        if tc not in ("none", "auto", "required"):
            raise InvalidRequestError(
                f"tool_choice must be 'none', 'auto', 'required' or a named function, got "
                f"{_json_value(tc)}", "tool_choice")
        if tc == "required" and not tools:
            raise InvalidRequestError("tool_choice 'required' needs a non-empty tools list",
                                      "tool_choice")
        return (tc if tools else "none"), None
    if isinstance(tc, dict) and tc.get("type") == "function" and isinstance(tc.get("function"), dict):
        name = tc["function"].get("name")
        names = [t["function"]["name"] for t in tools]
        if name not in names:
            raise InvalidRequestError(
                f"tool_choice names function {_json_value(name)} which is not in tools "
                f"({', '.join(names) or 'none given'})", "tool_choice")
        return "named", name
    raise InvalidRequestError(
        "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
        "\"function\": {\"name\": ...}}", "tool_choice")


def _json_kind(v) -> str:
    """How a JSON value's type reads in an error ("a string", "null", ...)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    return {str: "a string", dict: "an object", list: "an array", int: "a number",
            float: "a number"}.get(type(v), type(v).__name__)


def _check_messages(msgs) -> list[dict]:
    """The request's messages as the templates take them. Every text field used is checked
    here, naming it (``messages[i].content[j].text``), for text UTF-8 cannot encode (a lone
    surrogate): the template's own check of it would name the messages the template sees,
    with the parts joined and, for a template without tools, tool traffic rewritten."""
    if msgs is None:  # absent or null: "got null" read as if the client had sent a null
        raise InvalidRequestError(
            "messages is required: a non-empty list of {\"role\": ..., \"content\": ...} "
            "objects", "messages")
    if not isinstance(msgs, list):
        raise InvalidRequestError(
            "messages must be a list of {\"role\": ..., \"content\": ...} objects, got "
            f"{_json_kind(msgs)}", "messages")
    if not msgs:
        raise InvalidRequestError("messages must be a non-empty list", "messages")
    out = []
    call_ids: list[str] = []  # ids of the tool calls of the assistant messages so far
    anonymous_calls = False   # an earlier call came without an id: any tool_call_id may be its
    for i, m in enumerate(msgs):
        p = f"messages[{i}]"
        role = _check_role(p, m, call_ids, anonymous_calls)
        msg: dict[str, Any] = {"role": role}
        calls = m.get("tool_calls") if role == "assistant" else None
        content = _text_content(m.get("content"), f"{p}.content",
                                allow_none=(role == "assistant"))
        msg["content"] = content
        if calls is not None:
            clean_calls, ids, anonymous = _check_message_tool_calls(p, calls)
            call_ids += ids
            anonymous_calls = anonymous_calls or anonymous
            if clean_calls:
                msg["tool_calls"] = clean_calls
        if content is None and "tool_calls" not in msg:
            raise InvalidRequestError(f"{p}.content is required", f"{p}.content")
        if role == "tool":
            tcid = m.get("tool_call_id")
            if tcid is not None:
                require_utf8_in(tcid, f"{p}.tool_call_id")
                msg["tool_call_id"] = str(tcid)
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise InvalidRequestError(f"{p}.name must be a string, got {_json_kind(name)}",
                                      f"{p}.name")
        if name is not None:
            require_utf8(name, f"{p}.name", f"{p}.name")
            msg["name"] = name
        out.append(msg)
    return out


def _check_role(p: str, m, call_ids: list[str], anonymous_calls: bool) -> str:
    """The role of message ``m`` (at ``p``) as the templates know it (developer -> system,
    function -> tool); a tool message must answer an earlier tool call by its id."""
    if not isinstance(m, dict):
        raise InvalidRequestError(f"{p} must be an object", p)
    role = m.get("role")
    if not isinstance(role, str) or role not in _ROLES:  # a list or object is unhashable
        raise InvalidRequestError(
            f"{p}.role must be one of system, developer, user, assistant, tool; got "
            f"{_json_value(role)}", f"{p}.role")
    if role == "tool" and not isinstance(m.get("tool_call_id"), str):  # OpenAI requires it
        raise InvalidRequestError(
            f"{p}.tool_call_id (a string) is required for a tool message: the id of the "
            f"assistant's tool call it answers", f"{p}.tool_call_id")
    if role == "tool" and m["tool_call_id"] not in call_ids and not anonymous_calls:
        known = (f"the tool call ids before it: {', '.join(map(_json_value, call_ids))}"
                 if call_ids else "no assistant message before it has tool_calls")
        raise InvalidRequestError(
            f"{p}.tool_call_id {_json_value(m['tool_call_id'])} matches no tool call of an earlier "
            f"assistant message ({known}); a tool message answers one of the assistant's "
            f"tool_calls by its id", f"{p}.tool_call_id")
    if role == "developer":
        role = "system"
    if role == "function":  # the deprecated function role: name, no tool_call_id
        role = "tool"
    return role


def _check_message_tool_calls(p: str, calls) -> tuple[list[dict], list[str], bool]:
    """An assistant message's ``tool_calls`` (at ``p``) with arguments as dicts; returns
    (clean calls, the ids given, whether a call came without an id)."""
    if not isinstance(calls, list):
        raise InvalidRequestError(f"{p}.tool_calls must be a list", f"{p}.tool_calls")
    clean_calls, ids, anonymous = [], [], False
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
            except RecursionError:
                raise InvalidRequestError(f"{q}.function.arguments is nested too deeply",
                                          f"{q}.function.arguments") from None
        if not isinstance(args, dict):
            raise InvalidRequestError(f"{q}.function.arguments must be a JSON object",
                                      f"{q}.function.arguments")
        require_utf8_in({"id": c.get("id"), "function": {"name": fn["name"], "arguments": args}},
                        q)
        if c.get("id"):
            ids.append(str(c["id"]))
        else:
            anonymous = True
        clean_calls.append({"id": c.get("id") or new_call_id(), "type": "function",
                            "function": {"name": fn["name"], "arguments": args}})
    return clean_calls, ids, anonymous


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
        parallel_tool_calls: False keeps only the first parsed call. A required tool call
            is constrained to one call unless the request set ``parallel_tool_calls: true``
            (``parallel_tool_calls_given``), as llama.cpp's server does: small models
            otherwise repeat calls until max_tokens; a named function is always one call.
        response_format: ``"text"``, ``"json_object"`` or ``"json_schema"`` (with
            ``json_schema``, ``json_strict``).
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
    response_format: str = "text"
    json_schema: Any = None
    json_strict: bool = False
    parallel_tool_calls_given: bool = False


def parse_chat_request(req: dict, vocab_size: int | None = None, llm=None) -> ChatRequest:
    """Validate a ``/v1/chat/completions`` body.

    Raises:
        InvalidRequestError: naming the offending parameter.
    """
    if not isinstance(req, dict):
        raise InvalidRequestError("request body must be a JSON object")
    stream, include_usage = _common_checks(req)
    _refuse_other_shapes(req)
    messages = _check_messages(req.get("messages"))
    tools = _check_tools(req.get("tools"))
    mode, name = _check_tool_choice(req.get("tool_choice"), tools)
    ptc = req.get("parallel_tool_calls", True)
    if ptc is None:
        ptc = True
    if not isinstance(ptc, bool):
        raise InvalidRequestError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    rf_kind, rf_schema, rf_strict = _response_format(req.get("response_format"))
    if rf_kind != "text" and mode in ("required", "named"):
        raise InvalidRequestError(
            "response_format json_object/json_schema cannot be combined with a required or "
            "named tool_choice: the reply is either a tool call or the JSON", "response_format")
    rfmt = req.get("reasoning_format", "auto")
    if rfmt is None:
        rfmt = "auto"
    if rfmt not in ("auto", "none"):
        raise InvalidRequestError("reasoning_format must be 'auto' (split <think> blocks into "
                                  "reasoning_content) or 'none' (keep them in content)",
                                  "reasoning_format")
    kw = sampling_kwargs(req, vocab_size)
    lp = _chat_logprobs(req)
    if lp is not None:
        kw["logprobs"] = lp
    params = _make_params(kw, llm)
    return ChatRequest(messages, tools, mode, name, params, stream, include_usage,
                       req.get("model"), ptc, rfmt, rf_kind, rf_schema, rf_strict,
                       req.get("parallel_tool_calls") is not None)


def parse_completion_request(request: dict, vocab: int | None, llm=None):
    """Validate a ``/v1/completions`` body; returns (prompt, params, stream, include_usage,
    echo). ``vocab`` None skips the token-id range checks; ``llm`` None uses the library's
    sampling defaults as the base.

    ``echo`` puts the prompt before the completion; with ``logprobs`` the prompt tokens get
    log-probabilities too (the first token's is null), and ``max_tokens: 0`` then scores the
    prompt without generating (lm-evaluation-harness's loglikelihood requests)."""
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
    elif not isinstance(prompt, str):
        # "" is a prompt, as in OpenAI's API: the tokenizer's BOS alone, or the engine's
        # "the prompt is empty" where the model adds none
        raise InvalidRequestError("prompt must be a string, a list with one string, or a list "
                                  "of token ids", "prompt")
    echo = request.get("echo", False)
    if echo is None:
        echo = False
    if not isinstance(echo, bool):
        raise InvalidRequestError("echo must be a boolean", "echo")
    if request.get("suffix"):
        raise InvalidRequestError("suffix is not supported by this server", "suffix")
    bo = request.get("best_of")
    if bo is not None and not _is_int(bo):
        raise InvalidRequestError(f"best_of must be an integer, got {_json_value(bo)}",
                                  "best_of")
    if bo is not None and bo != 1:
        raise InvalidRequestError("best_of must be 1", "best_of")
    lp = _completion_logprobs(request)
    mt0 = _is_int(request.get("max_tokens")) and request["max_tokens"] == 0  # not false
    score_only = echo and lp is not None and mt0
    kw = sampling_kwargs(dict(request, max_tokens=None) if score_only else request, vocab)
    if lp is not None:
        kw["logprobs"] = lp
        if echo:
            kw["prompt_logprobs"] = True
    if score_only:
        kw["max_tokens"] = 0
    elif mt0:
        raise InvalidRequestError("max_tokens 0 is only for scoring a prompt: give echo: true "
                                  "and logprobs", "max_tokens")
    rf_kind, rf_schema, rf_strict = _response_format(request.get("response_format"))
    tok = getattr(llm, "tokenizer", None)
    if rf_kind != "text" and tok is not None and hasattr(tok, "token_bytes"):
        from localmoe.text.grammar import Grammar

        kw["grammar"] = (Grammar.json_object(tok) if rf_kind == "json_object" else
                         Grammar.json_schema(tok, rf_schema, strict=rf_strict))
    params = _make_params(kw, llm)
    return prompt, params, stream, include_usage, echo


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
        parse_completion_request(request, None)
    else:
        raise ValueError(f"unknown endpoint kind {endpoint!r}")
