"""Tool calls and reasoning in a chat generation: the template adaption of tool traffic, the
forced start of a required call, and :class:`ChatGeneration`, which turns the engine's text
events into content, reasoning and tool-call events.

The tool-call syntax is chosen from the chat template (:mod:`localmoe.text.tool_calls`).
Templates without tool support get the tool list as a Hermes-style system prompt, and past
assistant tool calls / ``tool`` results are rewritten as ``<tool_call>`` / ``<tool_response>``
text so any template can render them.

``tool_choice="required"`` or a named function is enforced by constrained decoding
(:meth:`localmoe.text.grammar.Grammar.tool_calls`): the reply can only be calls, in the
template's syntax, to the declared tools with arguments valid under their parameter schemas.
Without the grammar engine the turn is started with the call's opening text instead (e.g.
``<tool_call>\\n{"name": "get_weather", "arguments": ``). In both modes markup that does not
parse never reaches ``content`` while it is generated: the reply then has no tool calls and
:attr:`ChatGeneration.error` says why; ``content`` is null, except for a call cut by
``max_tokens`` (finish reason "length"), whose text so far (the forced opening included) is
the ``content``, as OpenAI and vLLM answer a cut reply.
``response_format`` json_object / json_schema constrain the reply the same way.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from typing import Any, Iterator

from localmoe.openai.requests import ChatRequest
from localmoe.text.reasoning import ReasoningSplitter
from localmoe.text.tool_calls import StreamingToolParser, detect_format

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


class ChatGeneration:
    """One chat generation: engine events -> (content delta | reasoning | tool call) events.

    Args:
        llm: the engine (``generate``, ``chat_stream``, ``render_chat``, ``template``,
            ``tokenizer``).
        creq: the validated request.
        cancel: a ``threading.Event`` that stops generation when set (or None).

    Attributes:
        fmt: the tool-call syntax (:func:`localmoe.text.tool_calls.detect_format`).
        result: the engine's GenerationResult once finished (None before).
    """

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
        self.forced = creq.tool_mode in ("required", "named")
        self.unparsed: list[str] = []  # markup of a forced call that did not parse
        self.error: dict | None = None
        self._lp_pending: list = []
        self._lp_seen = 0
        self.params, self.constrained = self._constrain(creq)
        if (src and "<think>" in src and creq.reasoning_format != "none"
                and not self.forced and creq.response_format == "text"):
            try:  # a template whose generation prompt opens the block itself
                prompt = self.llm.render_chat(self.messages, tools=self.tpl_tools)
                opened = prompt.rstrip().endswith("<think>")
            except Exception:  # noqa: BLE001 -- the engine reports template errors itself
                opened = False
            self.splitter = ReasoningSplitter(start_in_think=opened)

    def _constrain(self, creq: ChatRequest):
        """(params with the request's grammar, whether a grammar constrains the reply).

        Raises:
            InvalidRequestError: a schema the grammar engine refuses (naming the field).
        """
        from localmoe.text import grammar as g

        tok = getattr(self.llm, "tokenizer", None)
        if tok is None or not hasattr(tok, "token_bytes"):
            gram = None
        elif self.forced:
            if g.available() is not None:
                return creq.params, False  # the forced-prefix fallback
            gram = g.Grammar.tool_calls(tok, creq.tools, fmt=self.fmt,
                                        name=creq.tool_name if creq.tool_mode == "named" else None,
                                        parallel=(creq.tool_mode == "required"
                                                  and creq.parallel_tool_calls
                                                  and creq.parallel_tool_calls_given))
        elif creq.response_format == "json_object":
            gram = g.Grammar.json_object(tok)
        elif creq.response_format == "json_schema":
            gram = g.Grammar.json_schema(tok, creq.json_schema, strict=creq.json_strict)
        else:
            gram = None
        if gram is None:
            return creq.params, False
        return dataclasses.replace(creq.params, grammar=gram), True

    def _engine_events(self):
        creq = self.creq
        if self.forced and not self.constrained:
            prefix = _forced_prefix(self.fmt, creq.tool_mode, creq.tool_name)
            ids = _forced_prompt_ids(self.llm, self.messages, self.tpl_tools, prefix)
            self.parser.push(prefix)  # nothing can be settled inside an open call
            return self.llm.generate(ids, stream=True, cancel=self.cancel, params=self.params,
                                     fit_max_tokens=True)
        # a max_tokens beyond the context is refused, as OpenAI's API and vLLM answer it
        return self.llm.chat_stream(self.messages, self.params, tools=self.tpl_tools,
                                    cancel=self.cancel, fit_max_tokens=True)

    def take_logprobs(self) -> list:
        """The TokenLogprobs of the tokens behind the events yielded so far (each once)."""
        out, self._lp_pending = self._lp_pending, []
        return out

    def _note_logprobs(self, ev) -> None:
        lps = getattr(ev, "logprobs", None)
        if lps:
            self._lp_pending.extend(lps)
            self._lp_seen += len(lps)
        if ev.done and ev.result is not None and ev.result.logprobs is not None:
            # tokens that made no text event: held back, cut by a stop string; not the end token
            eog = set(getattr(getattr(self.llm, "tokenizer", None), "eog_ids", ()) or ())
            self._lp_pending.extend(lp for lp in ev.result.logprobs[self._lp_seen:]
                                    if lp.token_id not in eog)

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
                self._note_logprobs(ev)
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
            if self.forced and not self.n_calls:
                self.error = self._forced_error()
                if getattr(self.result, "finish_reason", None) == "length" and self.unparsed:
                    # cut by max_tokens: what was generated is the content (finish "length"),
                    # as OpenAI/vLLM answer a cut reply
                    yield ("content", "".join(self.unparsed))
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def _content(self, text: str):
        if self.parser is None:
            yield ("content", text)
        else:
            yield from self._filter(self.parser.push(text))

    def _forced_error(self) -> dict:
        """The error object of a required/named tool call that did not come out whole."""
        fr = getattr(self.result, "finish_reason", "stop")
        if fr == "length":
            why = ("the tool call was cut by max_tokens (or the context end) before it was "
                   "complete; raise max_tokens")
        elif fr == "cancelled":
            why = "the generation was cancelled before the tool call was complete"
        else:
            why = ("the model's output did not parse as a tool call (a stop string may have "
                   "cut it)")
        return {"message": why, "type": "invalid_response_error", "param": "tool_choice",
                "code": "tool_call_incomplete"}

    def _filter(self, evs):
        for kind, val in evs:
            if kind == "content" and self.forced:
                self.unparsed.append(val)  # raw markup: content only once cut (events())
                continue
            if kind == "call":
                if self.n_calls and not self.creq.parallel_tool_calls:
                    continue
                self.n_calls += 1
            yield kind, val
