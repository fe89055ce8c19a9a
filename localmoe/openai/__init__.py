"""OpenAI Chat Completions / Completions shaping on top of the engine (no HTTP here).

:func:`chat_completion` takes an OpenAI ``/v1/chat/completions`` request body (a dict) and an
``LLM`` and returns a ``ChatCompletion`` dict, or for ``stream=True`` an iterator of
``ChatCompletionChunk`` dicts. :func:`completion` does the same for ``/v1/completions``.
``LLM.chat`` (:mod:`localmoe.api`) and the HTTP server both go through here, so the Python API and the server return
the same objects.

Request handling:

* Validation raises :class:`~localmoe.errors.InvalidRequestError` with ``param`` naming the
  offending field (``messages[2].content``, ``tool_choice``, ``max_tokens``, ...) before any
  generation starts. Unknown fields are ignored (clients send ``user``, ``metadata``, ...).
* Sampling: ``temperature, top_p, top_k, min_p, frequency_penalty, presence_penalty,
  repeat_penalty, repeat_last_n, seed, logit_bias, stop, max_tokens / max_completion_tokens``
  map onto :class:`~localmoe.engine.sampling.SamplingParams`; unspecified fields keep the model's
  defaults (``LLM.default_sampling()``: the file's ``general.sampling.*`` over the library's).
  ``n`` must be 1; ``suffix``, ``best_of > 1``, the deprecated ``functions`` /
  ``function_call`` and Responses-API fields are refused with a 400-style error rather than
  silently ignored.
* Structured output (docs/STRUCTURED_OUTPUT.md): ``response_format`` ``json_object`` /
  ``json_schema`` (strict and not) constrain the reply by a grammar mask; a schema the engine
  cannot enforce is refused naming the keyword.
* Log-probabilities: chat ``logprobs`` / ``top_logprobs`` (<= 20), completions ``logprobs``
  (<= 20) and ``echo`` (prompt tokens scored; ``max_tokens: 0`` scores only), streamed too.
* Tools: the tool-call syntax is chosen from the chat template (:mod:`localmoe.text.tool_calls`).
  Templates without tool support get the tool list as a Hermes-style system prompt, and past
  assistant tool calls / ``tool`` results are rewritten as ``<tool_call>`` / ``<tool_response>``
  text so any template can render them. ``tool_choice="required"`` or a named function is
  enforced by constrained decoding: only calls to the declared tools, with arguments valid
  under their schemas, in the template's syntax; a call cut by ``max_tokens`` never leaks
  into ``content`` (an ``error`` object explains it).
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

Modules: :mod:`~localmoe.openai.requests` (parsing, validation),
:mod:`~localmoe.openai.tools` (tool calls, reasoning, template adaption),
:mod:`~localmoe.openai.responses` (response objects and chunks).
"""

from __future__ import annotations

from localmoe.openai.requests import (ChatRequest, parse_chat_request, sampling_kwargs,
                                            validate_request)
from localmoe.openai.responses import (ChatJob, CompletionJob, chat, chat_completion,
                                             completion, prepare_chat, prepare_completion)

__all__ = ["chat_completion", "completion", "chat", "prepare_chat", "prepare_completion",
           "parse_chat_request", "validate_request", "sampling_kwargs", "ChatRequest", "ChatJob",
           "CompletionJob"]
