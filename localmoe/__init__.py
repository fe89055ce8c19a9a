"""localmoe: fast local inference for Mixture-of-Experts language models."""

from __future__ import annotations

__version__ = "0.1.0"

from localmoe.errors import LocalMoEError  # noqa: F401


def __getattr__(name):  # lazy: importing localmoe must stay cheap (CLI startup)
    if name == "LLM":
        from localmoe.api import LLM

        return LLM
    raise AttributeError(name)
