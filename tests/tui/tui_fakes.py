"""A scripted fake engine for the TUI tests (pilot tests, snapshots, the tmux script).

It implements the part of ``localmoe.LLM`` the TUI uses (tui/engine_api.py EngineProtocol):
``chat_stream`` yields the next scripted reply word by word, honours ``cancel`` by ending with
``finish_reason="cancelled"``, and can be told to pause (``hold``) or raise. Nothing here runs
a model.

Run as a script it starts the real app on this fake (used by tests/tui/tui_tmux.sh):
``python tests/tui/tui_fakes.py [--db PATH]``.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from localmoe.errors import ContextOverflowError


@dataclass
class FakeTimings:
    ttft_ms: float
    tpot_ms: float
    prefill_tok_s: float
    decode_tok_s: float
    total_ms: float


@dataclass
class FakeResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    timings: FakeTimings


@dataclass
class FakeEvent:
    delta: str
    token_id: int | None
    done: bool
    result: FakeResult | None


class FakeRunner:
    """``runner.stats()`` with a device and KV bytes; expert keys only when given."""

    def __init__(self, extra: dict | None = None):
        self.extra = dict(extra or {})

    def stats(self) -> dict:
        return {"device": "cpu", "kv_bytes": 3 * 1024 * 1024, **self.extra}


@dataclass
class FakeModelFile:
    metadata: dict = field(default_factory=dict)
    name: str = "fake-model"


class FakeEngine:
    """Streams scripted replies.

    Args:
        replies: reply texts used in turn (the last one repeats); a callable gets the
            messages and returns the text.
        token_delay: seconds between streamed tokens.
        n_ctx: context size; a prompt whose word count (see :meth:`count_tokens`) exceeds it
            raises ContextOverflowError like the real engine.
        hold_after: when set, stream this many tokens then wait until ``release`` is set or
            the request is cancelled.
        raise_on_stream: an exception to raise when a stream starts.
        metadata: ``model_file.metadata`` (e.g. ``general.sampling.temp``).
        runner_extra: extra ``runner.stats()`` keys.
    """

    backend_name = "fake"
    model_name = "fake-model"

    def __init__(self, replies: list[str | Callable] | None = None, *, token_delay: float = 0.0,
                 n_ctx: int = 4096, hold_after: int | None = None,
                 raise_on_stream: Exception | None = None, metadata: dict | None = None,
                 runner_extra: dict | None = None):
        self.replies = list(replies or ["Hello! I am a **fake** model."])
        self.token_delay = token_delay
        self.n_ctx = n_ctx
        self.hold_after = hold_after
        self.release = threading.Event()
        self.raise_on_stream = raise_on_stream
        self.model_file = FakeModelFile(dict(metadata or {}))
        self.runner = FakeRunner(runner_extra)
        self.calls: list[tuple[list[dict], Any]] = []
        self.tokens_streamed = 0
        self.streaming = threading.Event()
        self.closed = False
        self._n = 0

    def count_tokens(self, text: str) -> int:
        """One token per whitespace-separated word (deterministic, good enough for tests)."""
        return len(text.split())

    def _prompt_tokens(self, messages: list[dict]) -> int:
        return sum(self.count_tokens(m["content"]) + 8 for m in messages)

    def chat_stream(self, messages, params, tools=None, cancel=None):
        """Yield ``FakeEvent``s for the next reply (see class doc)."""
        self.calls.append(([dict(m) for m in messages], params))
        if self.raise_on_stream is not None:
            raise self.raise_on_stream
        n_prompt = self._prompt_tokens(messages)
        if n_prompt > self.n_ctx:
            raise ContextOverflowError(n_prompt, self.n_ctx)
        reply = self.replies[min(self._n, len(self.replies) - 1)]
        self._n += 1
        if callable(reply):
            reply = reply(messages)
        pieces = re.findall(r"\s*\S+|\s+", reply)
        max_tokens = getattr(params, "max_tokens", None)
        t0 = time.perf_counter()
        text, finish, n = "", "stop", 0
        self.streaming.set()
        try:
            for i, piece in enumerate(pieces):
                if cancel is not None and cancel.is_set():
                    finish = "cancelled"
                    break
                if max_tokens is not None and n >= max_tokens:
                    finish = "length"
                    break
                if self.hold_after is not None and i == self.hold_after:
                    while not self.release.is_set():
                        if cancel is not None and cancel.wait(0.005):
                            break
                    if cancel is not None and cancel.is_set():
                        finish = "cancelled"
                        break
                if self.token_delay:
                    time.sleep(self.token_delay)
                text += piece
                n += 1
                self.tokens_streamed += 1
                yield FakeEvent(piece, 1000 + i, False, None)
        finally:
            self.streaming.clear()
        total = (time.perf_counter() - t0) * 1e3
        result = FakeResult(text, list(range(n)), n_prompt, n, finish,
                            FakeTimings(12.0, 5.0, 800.0, 42.0, total))
        yield FakeEvent("", None, True, result)

    def close(self) -> None:
        self.closed = True


class FakeFactory:
    """An ``engine_factory`` for ChatApp: reports progress, then returns ``engine`` or raises.

    Args:
        engine: the FakeEngine to hand out (the same one for every load).
        error: an exception to raise instead.
        gate: when set, loading waits for this event after reporting 50 %.
    """

    def __init__(self, engine: FakeEngine | None = None, error: Exception | None = None,
                 gate: threading.Event | None = None):
        self.engine = engine or FakeEngine()
        self.error = error
        self.gate = gate
        self.loads: list[dict] = []

    def __call__(self, model, *, backend="auto", n_ctx=None, kv_cache="f16", progress=None):
        self.loads.append(dict(model=model, backend=backend, n_ctx=n_ctx, kv_cache=kv_cache))
        if progress:
            progress(0.5, "reading tensors")
        if self.gate is not None:
            self.gate.wait(30)
        if self.error is not None:
            raise self.error
        if progress:
            progress(1.0, "ready")
        return self.engine


CODE_REPLY = ("Here is code:\n\n```python\ndef add(a, b):\n    return a + b\n```\n\n"
              "And it **works**.")


def main(argv: list[str] | None = None) -> None:
    """Run the real app on a fake engine (for tests/tui/tui_tmux.sh)."""
    import argparse
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from localmoe.tui.app import ChatApp
    from localmoe.tui.store import ChatStore

    ap = argparse.ArgumentParser()
    ap.add_argument("--db", default=None)
    args = ap.parse_args(argv)
    engine = FakeEngine([CODE_REPLY], token_delay=0.02)
    app = ChatApp("fake-model", engine_factory=FakeFactory(engine),
                  store=ChatStore(args.db) if args.db else None)
    app.run()


if __name__ == "__main__":
    main()
