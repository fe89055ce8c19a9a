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


_LP_FLOOR = -9999.0  # OpenAI's stand-in for an excluded token's -inf (JSON has no infinity)


def _lp(v: float) -> float:
    return max(float(v), _LP_FLOOR)


def _token_str(tok, tid: int) -> tuple[str, list[int]]:
    b = tok.token_bytes(int(tid)) if tok is not None else b""
    return b.decode("utf-8", errors="replace"), list(b)


def chat_logprobs(tok, lps: list) -> list[dict]:
    """OpenAI chat ``logprobs.content`` entries for TokenLogprobs ``lps``: ``token``,
    ``logprob``, ``bytes`` and ``top_logprobs`` (``-inf`` reported as -9999.0)."""
    out = []
    for lp in lps:
        text, b = _token_str(tok, lp.token_id)
        top = []
        for tid, v in lp.top:
            t2, b2 = _token_str(tok, tid)
            top.append({"token": t2, "logprob": _lp(v), "bytes": b2})
        out.append({"token": text, "logprob": _lp(lp.logprob), "bytes": b, "top_logprobs": top})
    return out


def completion_logprobs(tok, lps: list, offset: int = 0) -> dict:
    """The legacy ``/v1/completions`` logprobs object for TokenLogprobs ``lps`` (None entries:
    a prompt's first token): ``tokens``, ``token_logprobs``, ``top_logprobs`` (dicts token ->
    logprob) and ``text_offset`` (character offsets from ``offset``)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = offset
    for lp in lps:
        text, _ = _token_str(tok, lp.token_id)
        tokens.append(text)
        offsets.append(pos)
        pos += len(text)
        token_lps.append(lp.logprob if lp.logprob is None else _lp(lp.logprob))
        tops.append(None if lp.logprob is None else {_token_str(tok, t)[0]: _lp(v)
                                                     for t, v in lp.top})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


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
        self.tok = getattr(llm, "tokenizer", None)
        self.want_lp = getattr(creq.params, "logprobs", None) is not None
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
        lps: list = []
        for kind, val in self._events():
            if self.want_lp:
                lps += self.gen.take_logprobs()
            if kind == "content":
                content.append(val)
            elif kind == "reasoning":
                reasoning.append(val)
            elif kind == "call":
                calls.append({"id": new_call_id(self.gen.fmt), "type": "function",
                              "function": {"name": val.name, "arguments": val.arguments}})
        if self.want_lp:
            lps += self.gen.take_logprobs()
        text = "".join(content)
        msg: dict[str, Any] = {"role": "assistant",
                               "content": text if (text or not calls) else None}
        if self.gen.error is not None and not text:
            msg["content"] = None
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
        if calls:
            msg["tool_calls"] = calls
        out = {"id": self.id, "object": "chat.completion", "created": self.created,
               "model": self.model, "system_fingerprint": self.fp,
               "choices": [{"index": 0, "message": msg,
                            "logprobs": ({"content": chat_logprobs(self.tok, lps),
                                          "refusal": None} if self.want_lp else None),
                            "finish_reason": _finish(self.result, len(calls))}],
               "usage": _usage(self.result)}
        if self.gen.error is not None:
            out["error"] = self.gen.error
        t = _timings_dict(self.result)
        if t is not None:
            out["timings"] = t
        return out

    def chunks(self) -> Iterator[dict]:
        """Run as a stream of ChatCompletionChunk dicts; closing it cancels generation."""
        usage_field = {"usage": None} if self.include_usage else {}

        def chunk(delta: dict, finish=None) -> dict:
            lp = None
            if self.want_lp:
                lp = {"content": chat_logprobs(self.tok, self.gen.take_logprobs()),
                      "refusal": None}
            return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.model, "system_fingerprint": self.fp,
                    "choices": [{"index": 0, "delta": delta, "logprobs": lp,
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
            if self.gen.error is not None:
                last["error"] = self.gen.error
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
                 model: str, echo: bool = False):
        self.llm, self.prompt, self.params, self.cancel = llm, prompt, params, cancel
        self.echo = echo
        self.tok = getattr(llm, "tokenizer", None)
        self.want_lp = getattr(params, "logprobs", None) is not None
        self._offset = 0  # characters of text sent so far (text_offset)
        self.stream, self.include_usage, self.model = stream, include_usage, model
        self.id = "cmpl-" + uuid.uuid4().hex[:24]
        self.created = _now()
        self.fp = _fingerprint(llm)
        self.result = None
        self.t_first: float | None = None
        self.t_end: float | None = None

    def _chunk(self, text: str, finish=None, lps: list | None = None) -> dict:
        lp = None
        if self.want_lp:
            lp = completion_logprobs(self.tok, lps or [], self._offset)
        self._offset += len(text)
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "system_fingerprint": self.fp,
                "choices": [{"index": 0, "text": text, "logprobs": lp,
                             "finish_reason": finish}]}

    def _prompt_ids(self) -> list[int]:
        prompt = self.prompt
        if isinstance(prompt, str):
            # like llama.cpp's server: special-token text in a raw prompt (<|im_start|>, ...)
            # becomes those tokens, so hand-written chat markup works
            tok = self.llm.tokenizer
            return tok.encode(prompt, add_special=True, parse_special=True)
        return list(prompt)

    def _echo_text(self, ids: list[int]) -> str:
        """The prompt as echoed: the given string, or the decoded token ids."""
        if isinstance(self.prompt, str):
            return self.prompt
        return self.tok.decode(ids)

    def _tail_logprobs(self, seen: int) -> list:
        """Log-probabilities of the generated tokens no event carried (the end token
        excluded)."""
        lps = getattr(self.result, "logprobs", None) or []
        eog = set(getattr(self.tok, "eog_ids", ()) or ())
        return [lp for lp in lps[seen:] if lp.token_id not in eog]

    def _prompt_lps(self, ids: list[int], lps: list | None) -> list:
        """The prompt's TokenLogprobs as echoed: the first token's logprob is None (nothing
        predicts it); a BOS the tokenizer added to a string prompt is left out (it is not
        part of the echoed text), so the first echoed token has the logprob given BOS."""
        from localmoe.engine.sampling import TokenLogprob

        lps = list(lps or [])
        if lps and lps[0] is None and ids:
            lps[0] = TokenLogprob(ids[0], None, [])
        if (isinstance(self.prompt, str) and ids and getattr(self.tok, "add_bos", False)
                and ids[0] == getattr(self.tok, "bos_id", None) and lps):
            lps = lps[1:]
        return lps

    def _events(self):
        prompt = self._prompt_ids()
        self._ids = prompt
        it = iter(self.llm.generate(prompt, stream=True, raw=True, cancel=self.cancel,
                                    params=self.params, fit_max_tokens=True))
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
        parts, lps = [], []
        for ev in self._events():
            parts.append(ev.delta or "")
            lps += ev.logprobs or []
        text = "".join(parts)
        if self.want_lp:
            lps += self._tail_logprobs(len(lps))
        if self.echo:
            text = self._echo_text(self._ids) + text
            lps = self._prompt_lps(self._ids, getattr(self.result, "prompt_logprobs", None)) + lps
        out = self._chunk(text, _finish(self.result, 0), lps)
        out["usage"] = _usage(self.result)
        t = _timings_dict(self.result)
        if t is not None:
            out["timings"] = t
        return out

    def chunks(self) -> Iterator[dict]:
        """Run as a stream of ``text_completion`` chunks; closing it cancels generation."""
        events = self._events()
        try:
            n_lp = 0
            for ev in events:
                if self.echo and not ev.done:
                    # the prompt (and with logprobs its scores, known once it was computed)
                    head = self._echo_text(self._ids)
                    self.echo = False
                    plp = (self._prompt_lps(self._ids, ev.prompt_logprobs or
                                            getattr(ev.result, "prompt_logprobs", None))
                           if self.want_lp else None)
                    if head:
                        yield self._chunk(head, lps=plp)
                if ev.delta:
                    n_lp += len(ev.logprobs or [])
                    yield self._chunk(ev.delta, lps=ev.logprobs)
            if self.echo:  # no event came before the end: the prompt alone
                head = self._echo_text(self._ids)
                if head:
                    yield self._chunk(head, lps=self._prompt_lps(
                        self._ids, getattr(self.result, "prompt_logprobs", None))
                        if self.want_lp else None)
            last = self._chunk("", _finish(self.result, 0),
                               self._tail_logprobs(n_lp) if self.want_lp else None)
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
    prompt, params, stream, include_usage, echo = parse_completion_request(request, vocab, llm)
    model = model_name or request.get("model") or getattr(llm, "model_name", "localmoe")
    return CompletionJob(llm, prompt, params, stream, include_usage, cancel, model, echo)


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
            max_completion_tokens, logit_bias, stream_options, parallel_tool_calls,
            response_format, logprobs, top_logprobs); ``json_schema=`` (a schema) and
            ``json_object=True`` are shorthands for the two ``response_format`` kinds, as in
            ``LLM.generate``.

    Returns/Raises: as :func:`chat_completion`.
    """
    req: dict[str, Any] = {"messages": messages, "stream": stream}
    if tools is not None:
        req["tools"] = tools
    if tool_choice is not None:
        req["tool_choice"] = tool_choice
    schema = sampling.pop("json_schema", None)
    if sampling.pop("json_object", False):
        req["response_format"] = {"type": "json_object"}
    if schema is not None:
        req["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": schema, "strict": True}}
    for k, v in sampling.items():
        if k == "stop" and isinstance(v, tuple):
            v = list(v)
        req[k] = v
    return chat_completion(llm, req, cancel=cancel)
