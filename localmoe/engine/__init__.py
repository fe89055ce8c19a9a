"""The engine: :class:`LLM` (generation loop, streaming, metrics), sampling, backend registry.

Importing this package is cheap; :class:`LLM` and its result types load on first use.
"""

from __future__ import annotations

_LAZY = ("LLM", "GenerationResult", "StreamEvent", "Timings")


def __getattr__(name):
    if name in _LAZY:
        from localmoe.engine import llm

        return getattr(llm, name)
    raise AttributeError(name)
