"""One generation inside the engine: prefill with prefix reuse, the decode loop, the end.

:class:`Generation` runs while :class:`~localmoe.engine.engine.Engine` holds its lock::

    prefill (new suffix only) -> decode loop { logits -> [grammar mask] -> Sampler -> token ->
    StopChecker -> IncrementalDetokenizer -> StreamEvent; runner.forward([token]) } -> flush
    held-back text

A grammar (``params.grammar``: JSON schema, JSON object, tool calls) masks the logits of every
step, so it works the same on every backend: on the host for the NumPy sampler, as a packed
bitmask uploaded to the GPU sampler when the runner returns CUDA logits; when the grammar is complete and
allows nothing but an end-of-generation token, the generation ends there (finish ``"stop"``)
without another forward pass. A cut by ``max_tokens`` or the context end inside the grammar
leaves incomplete output with finish ``"length"``.

Greedy requests (temperature 0) do not reuse a cached prefix unless
``$LOCALMOE_GREEDY_PREFIX_REUSE=1``: K/V computed in other batch shapes round differently and
could change the answer (docs/LIMITS.md).

It updates the engine's record of the cached tokens (``Engine._cached``) as the runner's KV
state grows; error handling and the lock stay with the engine.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Iterator, Sequence

from localmoe.errors import ModelLoadError
from localmoe.io.env import env_flag
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
        if hasattr(p, "with_grammar"):
            p = p.with_grammar(tok)  # json_schema / json_object -> grammar (cached)
        self.engine, self.ids, self.p, self.cancel = engine, ids, p, cancel
        self.n_prompt = len(ids)
        self.budget = engine.n_ctx - self.n_prompt
        if p.max_tokens is not None:
            self.budget = min(self.budget, int(p.max_tokens))
        eog = set(getattr(tok, "eog_ids", ()) or ())
        self.sampler = Sampler(p, tok.vocab_size, exempt_ids=eog | engine._control_ids())
        # a runner that can leave the logits on the GPU (triton) does so: the Sampler then
        # samples there and reads back only the id (LOCALMOE_DEVICE_SAMPLING=0 turns it off)
        self._fwd_kw = ({"on_device": True} if getattr(engine.runner, "supports_device_logits",
                                                       False) is True
                        and self.sampler.device_sampling is not False else {})
        # ... and one that takes a decode step's token from a device tensor gets the next step
        # launched before the sampled id is read (LOCALMOE_PIPELINE=0 turns it off)
        self._pipe = bool(self._fwd_kw) and getattr(
            engine.runner, "supports_device_tokens", False) is True and \
            env_flag("LOCALMOE_PIPELINE", True)
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
        self.constraint = p.grammar.start() if getattr(p, "grammar", None) is not None else None
        self.want_lp = getattr(p, "logprobs", None) is not None
        self.token_logprobs: list = []   # TokenLogprob per generated token
        self.prompt_logprobs: list | None = None
        self._lp_sent = 0  # token_logprobs already attached to an event
        self._plp_pending: list | None = None  # prompt logprobs for the first event

    def events(self) -> Iterator[StreamEvent]:
        """The text events (not the final ``done`` one; see :meth:`result`)."""
        if self.budget <= 0:
            if getattr(self.p, "prompt_logprobs", False) and self.n_prompt:
                self._prefill()  # scoring only (echo with max_tokens 0)
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
            cached_tokens=self.n_reused,
            logprobs=list(self.token_logprobs) if self.want_lp else None,
            prompt_logprobs=self.prompt_logprobs)

    def _event(self, text: str, t_id) -> StreamEvent:
        """A text event carrying the log-probabilities of the tokens since the last one."""
        lps = None
        if self.want_lp:
            lps = self.token_logprobs[self._lp_sent:]
            self._lp_sent = len(self.token_logprobs)
        plp, self._plp_pending = self._plp_pending, None
        return StreamEvent(text, t_id, logprobs=lps, prompt_logprobs=plp)

    def _cancelled(self) -> bool:
        return (self.cancel is not None and self.cancel.is_set()) or self.engine._abort.is_set()

    def _reuse_prefix(self) -> int:
        """Cut the runner's sequence to the longest cached prefix of the prompt (at least one
        prompt token is left to compute); returns the number of tokens kept."""
        eng, ids = self.engine, self.ids
        runner, seq = eng.runner, eng._seq
        n_reused = min(_common_prefix(eng._cached, ids), self.n_prompt - 1)
        if getattr(self.p, "prompt_logprobs", False):
            n_reused = 0  # every prompt position's logits are needed
        if _greedy(self.p) and not greedy_prefix_reuse():
            # cached K/V were computed in other batch shapes (decode steps of one token, other
            # prefill chunks), whose float sums round differently: reusing them can change a
            # greedy answer, so greedy requests prefill from scratch (docs/LIMITS.md)
            n_reused = 0
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
        want_all = bool(getattr(self.p, "prompt_logprobs", False))
        logits = eng.runner.forward([(eng._seq, new)], all_logits=want_all,
                                    **({} if want_all else self._fwd_kw))[0]
        if want_all:
            rows = logits.reshape(len(new), -1)
            self.prompt_logprobs = self._prompt_logprobs(rows)
            self._plp_pending = self.prompt_logprobs
            logits = rows[-1]
        # torch tensors from every runner. A greedy argmax over NaN picks token 0 (often
        # end-of-text): an empty reply with finish "stop" would hide the damaged file; llama.cpp
        # gives all-zero logits for NaN block scales, which sample uniformly (NUL bytes)
        import torch

        lo, hi = torch.stack(logits.aminmax()).tolist()   # NaN propagates: one host read
        what = ("non-finite logits (NaN/inf)" if not (math.isfinite(lo) and math.isfinite(hi))
                else "the same logit for every token" if lo == hi else None)
        if what:
            raise ModelLoadError(
                f"the model computed {what} for the prompt: its weights are probably "
                f"corrupt or damaged; download {_model_source(eng)} again")
        eng._cached = list(self.ids)
        self.n_prefilled = len(new)
        self.t_prefill_end = time.perf_counter()
        return logits

    def _prompt_logprobs(self, rows) -> list:
        """Log-probabilities of prompt tokens 1..n-1 from the logits rows (``[T, vocab]``,
        the raw model distribution: no penalties or constraint); None for the first token."""
        import torch

        from localmoe.engine.sampling import token_logprob

        n_top = int(self.p.logprobs or 0)
        vocab = self.engine.tokenizer.vocab_size
        x = rows[:, :vocab].to("cpu", torch.float32).numpy()
        return [None] + [token_logprob(x[i - 1], self.ids[i], n_top)
                         for i in range(1, self.n_prompt)]

    def _decode(self, logits) -> Iterator[StreamEvent]:
        """Sample, stop-check, detokenize and step until a stop, the budget or a cancel.

        With logits on the GPU (``self._fwd_kw``), the next forward pass is launched as soon
        as the token is known not to end the generation by itself (not an end token, budget
        and grammar not exhausted): the runner returns before the GPU finishes, so the host
        detokenizes, checks stop strings and hands the event to the consumer while the GPU
        computes. A stop string found then leaves that one forward unused (the runner's cache
        and ``Engine._cached`` both hold the token, consistently).

        With a runner that also takes tokens on the device (``self._pipe``; no
        log-probabilities), the forward of the sampled token is launched before the token is
        read at all: the sampler's kernels, the copy of the id into the step's input and the
        step follow each other on the GPU with no wait for the host, which reads the id while
        the step runs (and, under a grammar, accepts it and computes the next mask then, with
        no worker thread). Only a step that the budget rules out is not launched; one after an
        end token, a stop string or a complete grammar is spent (both records hold that
        token).
        """
        stopper, cons = self.stopper, self.constraint
        history = list(self.ids)
        next_allowed = None  # the mask computed during the last forward pass
        ahead_ok = bool(self._fwd_kw)
        while True:
            if self._cancelled():
                self.finish = "cancelled"
                return
            # a sampler on the GPU takes the grammar engine's packed bitmask as it is (no
            # unpacking on the host); the NumPy sampler takes the bool mask
            mask_fn = None if cons is None else (
                cons.allowed_bits if self.sampler.uses_device(logits) else cons.allowed)
            if cons is not None:
                allowed = next_allowed if next_allowed is not None else mask_fn()
                next_allowed = None
            else:
                allowed = None
            launched = (self._pipe and len(self.generated) + 1 < self.budget
                        and self.sampler.can_launch(logits))
            if launched:
                pend = self.sampler.launch(logits, history, allowed)
                logits = self._step_on_device(pend)
                t_id = self.sampler.finish(pend, history)
                self.engine._cached.append(t_id)
            else:
                t_id = int(self.sampler.sample(logits, history, allowed))
            if self.t_first is None:
                self.t_first = time.perf_counter()
            self.generated.append(t_id)
            history.append(t_id)
            if self.want_lp:
                self.token_logprobs.append(self.sampler.last_logprob)
            if cons is not None:
                cons.accept(t_id)  # masked: always allowed (an end token included)
            if stopper.push_token(t_id):
                self.finish = "stop"
                return
            pending = None
            # read before any mask job starts: the matcher must not be used from two threads
            done = cons is not None and cons.done
            ahead = (not launched and ahead_ok and len(self.generated) < self.budget
                     and not done and not self._cancelled())
            if ahead:
                pending, logits = self._step(t_id, mask_fn)
            try:
                delta = self.detok.push(t_id)
                emit, stopped = stopper.push_text(delta) if delta else ("", False)
                if emit:
                    self.parts.append(emit)
                    yield self._event(emit, t_id)
            except BaseException:
                _wait_quietly(pending)  # the matcher is not left in use by the pool
                raise
            if stopped:
                _wait_quietly(pending)
                self.finish, self.string_stop = "stop", True
                return
            if done:  # complete: only an end token could follow
                self.finish = "stop"
                return
            if len(self.generated) >= self.budget:
                _wait_quietly(pending)
                self.finish = "length"
                return
            if self._cancelled():
                _wait_quietly(pending)
                self.finish = "cancelled"
                return
            if not ahead and not launched:
                pending, logits = self._step(t_id, mask_fn)
            if pending is not None:
                next_allowed = pending.result()

    def _step_on_device(self, pend):
        """The forward pass of the token ``pend`` holds on the device (not read yet); the
        caller records the token once read. Returns the logits."""
        eng = self.engine
        return eng.runner.forward([(eng._seq, [0])], tokens_on_device=pend.ids,
                                  **self._fwd_kw)[0]

    def _step(self, t_id: int, mask_fn):
        """The forward pass of ``t_id``; with a grammar, its next mask is computed on a worker
        thread meanwhile (the grammar engine and the backends release the GIL, so on a GPU
        the mask costs no time per token). Returns ``(pending mask future or None, logits)``.
        """
        eng = self.engine
        pending = _MASK_POOL.submit(mask_fn) if mask_fn is not None else None
        try:
            logits = eng.runner.forward([(eng._seq, [t_id])], **self._fwd_kw)[0]
        except BaseException:
            _wait_quietly(pending)  # the matcher is not left in use by the pool
            raise
        eng._cached.append(t_id)
        return pending, logits

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
            yield self._event(emit, self.generated[-1] if self.generated else None)


def _model_source(eng: Any) -> str:
    """What to download again: the model file's path where the engine knows it, else its
    name."""
    path = getattr(getattr(eng, "model_file", None), "path", None)
    return str(path) if path else (eng.model_name or "the model")


def greedy_prefix_reuse() -> bool:
    """Whether greedy requests reuse cached prompt prefixes (``$LOCALMOE_GREEDY_PREFIX_REUSE``
    1/true/yes/on; off by default so that temperature 0 gives the same tokens for the same
    request). A value that is neither on nor off (0/false/no/off) leaves it off, with a
    logged warning (:func:`localmoe.io.env.env_flag`): reuse can change greedy answers, so
    only a clear yes turns it on."""
    return bool(env_flag("LOCALMOE_GREEDY_PREFIX_REUSE", False))


def _greedy(p: Any) -> bool:
    """True when ``p`` samples greedily (see :mod:`localmoe.engine.sampling`)."""
    from localmoe.engine.sampling import GREEDY_TEMPERATURE

    return (float(getattr(p, "temperature", 1.0)) <= GREEDY_TEMPERATURE
            or getattr(p, "top_k", 0) == 1 or getattr(p, "top_p", 1.0) == 0)


def _wait_quietly(fut) -> None:
    if fut is None:
        return
    try:
        fut.result()
    except BaseException:  # noqa: BLE001 -- the caller is raising its own error
        pass


class _MaskPool:
    """The worker threads (created on first use) that compute grammar masks during forward
    passes."""

    def __init__(self):
        self._ex = None
        self._lock = threading.Lock()

    def submit(self, fn):
        with self._lock:
            if self._ex is None:
                from concurrent.futures import ThreadPoolExecutor

                self._ex = ThreadPoolExecutor(max_workers=2, thread_name_prefix="localmoe-mask")
        return self._ex.submit(fn)


_MASK_POOL = _MaskPool()


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
