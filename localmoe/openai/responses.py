"""OpenAI response shaping: ``ChatCompletion`` / ``ChatCompletionChunk`` and
``text_completion`` objects from the engine's generations.

:func:`chat_completion` and :func:`completion` are the entry points (request dict in, response
dict or chunk iterator out); :func:`prepare_chat` / :func:`prepare_completion` validate first
and return a job to run later (the server validates before it queues).
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from typing import Any, Iterator

from localmoe.openai.requests import (ChatRequest, parse_chat_request,
                                            parse_completion_request)
from localmoe.openai.tools import ChatGeneration
from localmoe.text.tool_calls import new_call_id

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
        self.gen = ChatGeneration(llm, creq, cancel)
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
    prompt, params, stream, include_usage = parse_completion_request(request, vocab, llm)
    model = model_name or request.get("model") or getattr(llm, "model_name", "localmoe")
    return CompletionJob(llm, prompt, params, stream, include_usage, cancel, model)


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
