"""What the terminal UI needs from an inference engine, and nothing that does inference.

The app talks to an object satisfying :class:`EngineProtocol` (``localmoe.LLM`` does); tests
inject a scripted fake through the App's ``engine_factory``. This module also turns per-chat
settings plus the model file's ``general.sampling.*`` metadata into ``SamplingParams`` and
formats ``runner.stats()`` for the stats bar -- reading only the numbers the engine reports.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterator, Protocol

from .store import ChatSettings

__all__ = [
    "EngineProtocol",
    "EngineFactory",
    "default_engine_factory",
    "sampling_defaults",
    "build_sampling_params",
    "expert_stats",
    "format_bytes",
]

ProgressCallback = Callable[[float, str], None]


class EngineProtocol(Protocol):
    """The subset of ``localmoe.LLM`` (docs/INTERFACES.md, "Engine / Python API") the TUI uses.

    ``chat_stream`` yields ``StreamEvent(delta, token_id, done, result)``; the last event has
    ``done=True`` and ``result`` a ``GenerationResult`` (``finish_reason`` "stop" | "length" |
    "cancelled", ``prompt_tokens``, ``completion_tokens``, ``timings.ttft_ms``,
    ``timings.decode_tok_s``). It raises ``ContextOverflowError`` when the prompt does not fit
    and other ``LocalMoEError`` subclasses (e.g. ``TemplateError``) for user-causable failures.
    """

    n_ctx: int
    backend_name: str
    model_name: str
    runner: Any
    model_file: Any

    def chat_stream(self, messages: list[dict], params: Any, tools: Any = None,
                    cancel: threading.Event | None = None) -> Iterator[Any]: ...

    def count_tokens(self, text: str) -> int: ...

    def close(self) -> None: ...


EngineFactory = Callable[..., EngineProtocol]
"""``factory(model, backend=, n_ctx=, kv_cache=, progress=[, device=]) -> engine``; may raise
``LocalMoEError`` (``ModelNotFoundError``, ``ModelLoadError``, ...). Called in a worker thread.
``device`` is passed only when the user chose one (``localmoe chat --device``)."""


def default_engine_factory(model: str, *, backend: str = "auto", n_ctx: int | None = None,
                           kv_cache: str = "f16", progress: ProgressCallback | None = None,
                           device: str | None = None) -> EngineProtocol:
    """Load ``localmoe.LLM`` (imported lazily, it pulls in torch).

    ``kv_cache`` is any string ``KVSpec.parse`` takes (``"int4"``, ``"k=int8,v=int4"``,
    ``"int2,sinks=4"``); ``device`` ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or None (backend's
    default)."""
    from localmoe.api import LLM

    return LLM(model, backend=backend, n_ctx=n_ctx, kv_cache=kv_cache, device=device,
               progress=progress)


# GGUF general.sampling.* keys (gguf-py constants.Keys.General) -> SamplingParams fields.
_SAMPLING_KEYS = {
    "general.sampling.temp": ("temperature", float),
    "general.sampling.top_k": ("top_k", int),
    "general.sampling.top_p": ("top_p", float),
    "general.sampling.min_p": ("min_p", float),
    "general.sampling.penalty_repeat": ("repeat_penalty", float),
    "general.sampling.penalty_last_n": ("repeat_last_n", int),
}


def sampling_defaults(metadata: dict[str, Any] | None) -> dict[str, Any]:
    """SamplingParams keyword defaults found in a model file's metadata.

    Args:
        metadata: ``model_file.metadata`` (GGUF key -> value); None or missing keys are fine.

    Returns:
        e.g. ``{"temperature": 0.6, "top_p": 0.95}``: only keys present (and parseable).
    """
    out: dict[str, Any] = {}
    for key, (name, conv) in _SAMPLING_KEYS.items():
        if metadata and key in metadata:
            try:
                out[name] = conv(metadata[key])
            except (TypeError, ValueError):
                pass
    return out


def effective_sampling(settings: ChatSettings, defaults: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams keyword arguments: model defaults overridden by the chat's settings."""
    kw = dict(defaults)
    for name in ("temperature", "top_p", "top_k", "max_tokens", "seed"):
        v = getattr(settings, name)
        if v is not None:
            kw[name] = v
    return kw


def build_sampling_params(settings: ChatSettings, defaults: dict[str, Any]):
    """A validated ``localmoe.engine.sampling.SamplingParams`` for a chat.

    Raises:
        localmoe.errors.InvalidRequestError: a setting is out of range.
    """
    from localmoe.engine.sampling import SamplingParams

    params = SamplingParams(**effective_sampling(settings, defaults))
    params.validate()
    return params


def _num(stats: dict, *names: str) -> float | None:
    for n in names:
        v = stats.get(n)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def expert_stats(stats: dict[str, Any]) -> tuple[float | None, float | None]:
    """Expert-cache hit rate (0..1) and host->device GB/s from ``runner.stats()``.

    Either is None unless the runner reports it (an offloading expert provider does); nothing
    is estimated. Accepted keys: ``expert_cache_hit_rate`` / ``expert_hit_rate``, or
    ``expert_cache_hits`` + ``expert_cache_misses`` (also ``expert_hits`` / ``expert_misses``);
    ``h2d_gbps``, or ``h2d_bytes`` + ``h2d_seconds`` (also ``h2d_time_s``).
    """
    hit = _num(stats, "expert_cache_hit_rate", "expert_hit_rate")
    if hit is None:
        h = _num(stats, "expert_cache_hits", "expert_hits")
        m = _num(stats, "expert_cache_misses", "expert_misses")
        if h is not None and m is not None and h + m > 0:
            hit = h / (h + m)
    gbps = _num(stats, "h2d_gbps", "h2d_GBps")
    if gbps is None:
        b = _num(stats, "h2d_bytes")
        s = _num(stats, "h2d_seconds", "h2d_time_s")
        if b is not None and s is not None and s > 0:
            gbps = b / s / 1e9
    return hit, gbps


def format_bytes(n: float) -> str:
    """Human-readable byte count with binary units (``1536`` -> ``"1.5 KiB"``)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover
