"""What a generation returns: :class:`GenerationResult`, its :class:`Timings`, and the
:class:`StreamEvent` pieces of a stream."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Timings:
    """Timing of one generation.

    Attributes:
        ttft_ms: time to first token (ms), from the start of the request to the first sampled
            token (tokenization, queueing behind another generation, prefill and one sampling).
        tpot_ms: mean time per output token after the first (ms); 0 with fewer than 2 tokens.
        prefill_tok_s: prompt tokens processed per second during prefill (tokens reused from
            the cache are not counted).
        decode_tok_s: generated tokens per second after the first (1000 / tpot_ms).
        total_ms: wall time of the whole request (ms).
    """

    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    total_ms: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in self.__dict__.items()}


@dataclass
class GenerationResult:
    """Outcome of one generation.

    Attributes:
        text: generated text (stop strings and end-of-generation tokens excluded).
        token_ids: generated token ids (an end-of-generation token that ended it included).
        prompt_tokens: number of prompt tokens.
        completion_tokens: ``len(token_ids)``.
        finish_reason: ``"stop"`` (end-of-generation token or stop string), ``"length"``
            (max_tokens or context full) or ``"cancelled"``.
        timings: :class:`Timings`.
        cached_tokens: prompt tokens reused from the previous request's KV cache.
        logprobs: with ``SamplingParams.logprobs`` set, one
            :class:`~localmoe.engine.sampling.TokenLogprob` per entry of ``token_ids``; else
            None.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``, one per prompt token (the
            first is None: nothing predicts it); else None.
    """

    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    timings: Timings = field(default_factory=Timings)
    cached_tokens: int = 0
    logprobs: list | None = None
    prompt_logprobs: list | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "finish_reason": self.finish_reason,
                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "cached_tokens": self.cached_tokens, "timings": self.timings.to_dict()}


@dataclass
class StreamEvent:
    """One streamed piece.

    Text events carry ``delta`` (non-empty, valid UTF-8, never part of a stop string) and the
    ``token_id`` that completed it (a delta may cover several tokens when bytes or a possible
    stop-string prefix were held back). The last event has ``done=True``, ``delta=""`` and the
    :class:`GenerationResult`. Concatenating all deltas gives ``result.text``.
    With ``SamplingParams.logprobs`` set, ``logprobs`` lists the
    :class:`~localmoe.engine.sampling.TokenLogprob` of the tokens sampled since the previous
    event (tokens that add no text, like an end-of-generation token, are only in
    ``result.logprobs``). The first text event also carries ``prompt_logprobs`` when they
    were asked for (as ``result.prompt_logprobs``).
    """

    delta: str
    token_id: int | None = None
    done: bool = False
    result: GenerationResult | None = None
    logprobs: list | None = None
    prompt_logprobs: list | None = None


def measure_timings(t0, t_p0, t_prefill_end, t_first, t_end, n_prefilled, n_gen) -> Timings:
    """:class:`Timings` of one generation from ``time.perf_counter()`` stamps (seconds): request
    start ``t0``, prefill start ``t_p0`` and end ``t_prefill_end`` (None: no prefill), first
    sampled token ``t_first`` (None: none), end ``t_end``; ``n_prefilled`` prompt tokens
    computed, ``n_gen`` tokens generated."""
    ms = 1000.0
    tm = Timings(total_ms=(t_end - t0) * ms)
    if t_first is not None:
        tm.ttft_ms = (t_first - t0) * ms
        if n_gen > 1 and t_end > t_first:
            tm.tpot_ms = (t_end - t_first) * ms / (n_gen - 1)
            tm.decode_tok_s = (n_gen - 1) / (t_end - t_first)
    if t_prefill_end is not None and t_prefill_end > t_p0 and n_prefilled:
        tm.prefill_tok_s = n_prefilled / (t_prefill_end - t_p0)
    return tm
