"""One generation inside the engine: prefill with prefix reuse, the decode loop, the end.

:class:`Generation` runs while :class:`~localmoe.engine.engine.Engine` holds its lock::

    prefill (new suffix only) -> decode loop { logits -> Sampler -> token -> StopChecker ->
    IncrementalDetokenizer -> StreamEvent; runner.forward([token]) } -> flush held-back text

It updates the engine's record of the cached tokens (``Engine._cached``) as the runner's KV
state grows; error handling and the lock stay with the engine.
"""

from __future__ import annotations

import time
from typing import Any, Iterator, Sequence

from localmoe.errors import ModelLoadError
from localmoe.engine.results import GenerationResult, StreamEvent, measure_timings


class Generation:
    """The state of one generation of ``engine`` for prompt ``ids``.

    Args:
        engine: the Engine (its ``runner``, ``tokenizer``, ``n_ctx``, cached tokens).
        ids: prompt token ids (len <= ``engine.n_ctx``).
        p: validated SamplingParams.
        cancel: a ``threading.Event`` or None; set = finish ``"cancelled"`` after the token.
        t0: ``time.perf_counter()`` at the start of the request (for :class:`Timings`).
    """

    def __init__(self, engine: Any, ids: list[int], p: Any, cancel: Any, t0: float):
        from localmoe.engine.sampling import Sampler
        from localmoe.text.stopping import StopChecker
        from localmoe.text.detokenizer import IncrementalDetokenizer

        tok = engine.tokenizer
        self.engine, self.ids, self.p, self.cancel = engine, ids, p, cancel
        self.n_prompt = len(ids)
        self.budget = engine.n_ctx - self.n_prompt
        if p.max_tokens is not None:
            self.budget = min(self.budget, int(p.max_tokens))
        eog = set(getattr(tok, "eog_ids", ()) or ())
        self.sampler = Sampler(p, tok.vocab_size, exempt_ids=eog | engine._control_ids())
        self.stopper = StopChecker(tuple(p.stop or ()), eog)
        self.detok = IncrementalDetokenizer(tok)
        self.generated: list[int] = []
        self.parts: list[str] = []
        self.finish = "length"
        self.string_stop = False
        self.t0 = self.t_p0 = t0
        self.t_first: float | None = None
        self.t_prefill_end: float | None = None
        self.n_reused = 0
        self.n_prefilled = 0

    def events(self) -> Iterator[StreamEvent]:
        """The text events (not the final ``done`` one; see :meth:`result`)."""
        if self.budget <= 0:
            return
        logits = self._prefill()
        yield from self._decode(logits)
        if not self.string_stop:
            yield from self._flush()

    def result(self) -> GenerationResult:
        """The outcome, once :meth:`events` is exhausted."""
        n_gen = len(self.generated)
        return GenerationResult(
            text="".join(self.parts), token_ids=self.generated, prompt_tokens=self.n_prompt,
            completion_tokens=n_gen, finish_reason=self.finish,
            timings=measure_timings(self.t0, self.t_p0, self.t_prefill_end, self.t_first,
                                    time.perf_counter(), self.n_prefilled, n_gen),
            cached_tokens=self.n_reused)

    def _cancelled(self) -> bool:
        return (self.cancel is not None and self.cancel.is_set()) or self.engine._abort.is_set()

    def _reuse_prefix(self) -> int:
        """Cut the runner's sequence to the longest cached prefix of the prompt (at least one
        prompt token is left to compute); returns the number of tokens kept."""
        eng, ids = self.engine, self.ids
        runner, seq = eng.runner, eng._seq
        n_reused = min(_common_prefix(eng._cached, ids), self.n_prompt - 1)
        if n_reused < len(eng._cached):
            runner.truncate(seq, n_reused)
            eng._cached = eng._cached[:n_reused]
            if runner.seq_len(seq) != n_reused:  # the backend could not cut there
                runner.truncate(seq, 0)
                eng._cached, n_reused = [], 0
        return n_reused

    def _prefill(self):
        """Compute the prompt's new suffix; returns the logits after the last prompt token.

        Raises:
            ModelLoadError: the logits are not finite (damaged weights).
        """
        eng = self.engine
        self.n_reused = self._reuse_prefix()
        new = self.ids[self.n_reused:]
        self.t_p0 = time.perf_counter()
        logits = eng.runner.forward([(eng._seq, new)])[0]
        if not bool(logits.isfinite().all()):  # torch tensors from every runner
            # a greedy argmax over NaN picks token 0 (often end-of-text): an empty reply with
            # finish "stop" would hide the damaged file
            raise ModelLoadError(
                f"the model computed non-finite logits (NaN/inf) for the prompt: its weights "
                f"are probably corrupt or damaged; download "
                f"{eng.model_name or 'the model'} again")
        eng._cached = list(self.ids)
        self.n_prefilled = len(new)
        self.t_prefill_end = time.perf_counter()
        return logits

    def _decode(self, logits) -> Iterator[StreamEvent]:
        """Sample, stop-check, detokenize and step until a stop, the budget or a cancel."""
        eng, stopper = self.engine, self.stopper
        history = list(self.ids)
        while True:
            if self._cancelled():
                self.finish = "cancelled"
                return
            t_id = int(self.sampler.sample(logits, history))
            if self.t_first is None:
                self.t_first = time.perf_counter()
            self.generated.append(t_id)
            history.append(t_id)
            if stopper.push_token(t_id):
                self.finish = "stop"
                return
            delta = self.detok.push(t_id)
            emit, stopped = stopper.push_text(delta) if delta else ("", False)
            if emit:
                self.parts.append(emit)
                yield StreamEvent(emit, t_id)
            if stopped:
                self.finish, self.string_stop = "stop", True
                return
            if len(self.generated) >= self.budget:
                self.finish = "length"
                return
            if self._cancelled():
                self.finish = "cancelled"
                return
            logits = eng.runner.forward([(eng._seq, [t_id])])[0]
            eng._cached.append(t_id)

    def _flush(self) -> Iterator[StreamEvent]:
        """The text held back at the end (not after a stop string).

        Bytes of a character still incomplete when the generation was cut (max_tokens,
        context end, cancel) are dropped: the text ends at the last whole character. After an
        end-of-generation token they are released (as U+FFFD, like Tokenizer.decode): the
        model ended there.
        """
        stopper = self.stopper
        tail = self.detok.flush() if self.finish == "stop" else ""
        if stopper.stopped:  # ended by an end-of-generation token
            rest = stopper.flush() + tail
            cuts = [rest.find(s) for s in (self.p.stop or ()) if s and s in rest]
            emit = rest[:min(cuts)] if cuts else rest
        else:
            emit, stopped = stopper.push_text(tail) if tail else ("", False)
            if stopped:
                self.finish = "stop"
            else:
                emit += stopper.flush()
        if emit:
            self.parts.append(emit)
            yield StreamEvent(emit, self.generated[-1] if self.generated else None)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
