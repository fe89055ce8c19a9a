"""The engine: :class:`Engine` (generation loop, streaming, metrics), sampling, backend registry.

The engine opens models by :class:`~localmoe.io.model_file.ModelFile` or path and knows nothing
of the model store or HTTP; :class:`localmoe.LLM` (:mod:`localmoe.api`) is the public facade
over it. Importing this package is cheap; :class:`Engine` and its result types load on first
use.
"""

from __future__ import annotations

_LAZY = {"Engine": "engine", "GenerationResult": "results", "StreamEvent": "results",
         "Timings": "results"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"localmoe.engine.{_LAZY[name]}"), name)
    raise AttributeError(name)
