"""Token sampling: parameters, validation and the sampler chain.

Sampler order (the same chain as llama.cpp's default sampler, minus DRY/XTC/typical):

1. **penalties** over the last ``repeat_last_n`` tokens of the history (prompt + generated;
   ``-1`` = all of it, ``0`` = off): repetition penalty (a logit > 0 is divided by
   ``repeat_penalty``, a logit <= 0 multiplied, CTRL paper / llama.cpp), then
   ``logit -= frequency_penalty * count + presence_penalty * (count > 0)`` (OpenAI). Ids in
   ``exempt_ids`` (end-of-turn and control tokens, given by the engine) are never penalized.
2. **logit bias**: ``logit[id] += bias`` (OpenAI ``logit_bias``, -100..100; -100 effectively
   bans a token).
2b. **constraint**: tokens a grammar forbids at this step (``allowed`` mask from
   :class:`localmoe.text.grammar.Constraint`: JSON schema, JSON mode, forced tool calls) get
   ``-inf``. Log-probabilities (``logprobs``) are taken here: log-softmax at temperature 1 of
   the logits after penalties, bias and the constraint, before truncation and temperature (the
   distribution the model and the request's constraints define, as OpenAI reports it).
3. **greedy short-cut**: ``temperature <= 1e-5``, ``top_k == 1`` or ``top_p == 0`` -> argmax
   (lowest id on ties). Nothing random happens, so the seed does not matter.
4. **top_k**: keep the k largest logits (0 = off).
5. **top_p** (nucleus): softmax at temperature 1, keep the smallest prefix of the sorted
   tokens whose mass reaches ``top_p`` (at least one token; 1.0 = off).
6. **min_p**: keep tokens whose probability is >= ``min_p`` times the top probability
   (0 = off).
7. **temperature**: divide the surviving logits by ``temperature``.
8. **sample** from the softmax with the sampler's own NumPy ``Generator`` (PCG64): seeded
   from ``seed`` (same seed + same logits -> same tokens), or from OS entropy when ``seed`` is
   None; independent of the global torch/NumPy random state.

Non-finite logits are handled: NaN counts as -inf; if nothing finite remains the sampler falls
back to the argmax of the raw logits with NaN removed, so it never returns an out-of-range id
or raises.

**On the device.** When the logits are a CUDA tensor (the triton runner's), the same chain runs
on the GPU (:mod:`localmoe.kernels.sampling`): penalties from per-token counts kept on the
device (built from the history at the first call, then updated by one token in and one out
per step), the bias uploaded once, the grammar mask uploaded per step as a packed bitmask
(``ceil(vocab/32)`` int32 words through a pinned buffer), and only the sampled id (with its
log-probability when asked) read back. Greedy ids are identical to the NumPy path; random
draws follow the same distribution but use a Philox stream keyed by the seed, so a seeded
request samples other tokens on a GPU than on the CPU (each reproducible on its own).
``top_logprobs`` still moves the processed row to the host. ``Sampler(device_sampling=True)``
or ``$LOCALMOE_DEVICE_SAMPLING=1`` forces that path for CPU tensors too (the Triton
interpreter under ``TRITON_INTERPRET=1``, else the kernels' torch twin); ``False`` / ``0``
keeps every call on the NumPy path.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from localmoe.errors import InvalidRequestError, json_value, require_utf8
from localmoe.io.env import env_flag

__all__ = ["SamplingParams", "Sampler", "TokenLogprob", "GREEDY_TEMPERATURE", "MAX_TOP_LOGPROBS"]

GREEDY_TEMPERATURE = 1e-5  # temperatures at or below this sample greedily
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs


@dataclasses.dataclass
class TokenLogprob:
    """The log-probability of one token and the most likely alternatives at its position.

    Attributes:
        token_id: the token (int).
        logprob: its natural-log probability (float, <= 0; ``-inf`` when the constraint or a
            -100 bias excluded it, e.g. a prompt token).
        top: ``[(token_id, logprob), ...]``, the ``n`` most likely tokens, most likely first
            (ties: lowest id first); empty when no alternatives were asked for.
    """

    token_id: int
    logprob: float
    top: list = dataclasses.field(default_factory=list)


def _num(name: str, v: Any, lo: float | None = None, hi: float | None = None,
         lo_open: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InvalidRequestError(f"{name} must be a number, got {v!r}", param=name)
    v = float(v)
    if math.isnan(v) or math.isinf(v):
        raise InvalidRequestError(f"{name} must be a finite number, got {v}", param=name)
    if lo is not None and (v <= lo if lo_open else v < lo):
        rng = f"> {lo}" if lo_open else f">= {lo}"
        raise InvalidRequestError(f"{name} must be {rng}" + (f" and <= {hi}" if hi is not None else "")
                                  + f", got {v:g}", param=name)
    if hi is not None and v > hi:
        raise InvalidRequestError(f"{name} must be <= {hi}, got {v:g}", param=name)
    return v


#: the seeds :class:`SamplingParams` takes: int64's and uint64's (a larger one would share
#: its 64 bits, and so its random stream on the device sampler, with a smaller one)
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1


def _int(name: str, v: Any, lo: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise InvalidRequestError(f"{name} must be an integer, got {v!r}", param=name)
    if lo is not None and v < lo:
        raise InvalidRequestError(f"{name} must be >= {lo}, got {v}", param=name)
    return int(v)


@dataclasses.dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    Attributes:
        temperature: softmax temperature, 0..100 (<= 1e-5 = greedy).
        top_k: keep the k most likely tokens, >= 0 (0 = off).
        top_p: nucleus mass, 0..1 (1 = off, 0 = greedy).
        min_p: minimum probability relative to the top token, 0..1 (0 = off).
        repeat_penalty: repetition penalty factor, > 0 (1 = off).
        repeat_last_n: how many recent tokens the penalties look at (-1 = all, 0 = off).
        frequency_penalty / presence_penalty: OpenAI penalties, -2..2 (0 = off).
        logit_bias: ``{token_id: bias}``, bias in -100..100; keys may be strings of ints (JSON).
        seed: int for reproducible sampling, None for fresh randomness per request.
        max_tokens: cap on generated tokens (>= 1; 0 with ``prompt_logprobs`` scores the
            prompt only), None = until the context is full.
        stop: stop strings (a string or a sequence of non-empty strings).
        logprobs: None = off; an int 0..20 = report each generated token's log-probability
            and that many most likely alternatives (``GenerationResult.logprobs``).
        prompt_logprobs: also report the prompt tokens' log-probabilities (the first token
            has none); needs a prefill of the whole prompt (no prefix reuse).
        grammar: a :class:`localmoe.text.grammar.Grammar` the output must match (JSON
            schema, JSON object, tool calls), or None.
        json_schema: a JSON Schema (dict or JSON text) the output must be valid under
            (compiled into ``grammar`` with the model's tokenizer when generation starts).
        json_object: True = the output must be one JSON object (OpenAI's JSON mode).
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict | None = None
    seed: int | None = None
    max_tokens: int | None = None
    stop: Sequence[str] | str = ()
    logprobs: int | None = None
    prompt_logprobs: bool = False
    grammar: Any = None
    json_schema: Any = None
    json_object: bool = False

    @classmethod
    def greedy(cls, **overrides: Any) -> "SamplingParams":
        """Deterministic argmax decoding (temperature 0, no penalties)."""
        kw = dict(temperature=0.0, top_k=1, top_p=1.0, min_p=0.0)
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def model_defaults(cls, metadata: dict | None) -> dict:
        """Sampling defaults a model file recommends (GGUF ``general.sampling.*``: ``temp``,
        ``top_k``, ``top_p``, ``min_p``, ``penalty_repeat``, ``penalty_last_n``), as a dict of
        :class:`SamplingParams` field overrides; out-of-range values are ignored."""
        keys = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                "penalty_repeat": "repeat_penalty", "penalty_last_n": "repeat_last_n"}
        out: dict = {}
        for k, field in keys.items():
            v = (metadata or {}).get(f"general.sampling.{k}")
            if v is None:
                continue
            try:
                cls(**{field: v}).validate()
            except InvalidRequestError:
                continue
            out[field] = int(v) if field in ("top_k", "repeat_last_n") else float(v)
        return out

    def with_grammar(self, tokenizer: Any) -> "SamplingParams":
        """These params with ``json_schema`` / ``json_object`` compiled into ``grammar`` for
        ``tokenizer`` (self when there is nothing to compile; compiled grammars are cached
        per schema).

        Raises:
            InvalidRequestError: an invalid or unsupported schema (naming the keyword), a
                compile that timed out, or both a grammar and a schema given.
        """
        if self.json_schema is None and not self.json_object:
            return self
        if self.grammar is not None:
            raise InvalidRequestError("give grammar or json_schema/json_object, not both",
                                      param="grammar")
        from localmoe.text.grammar import Grammar

        g = (Grammar.json_object(tokenizer, param="json_object") if self.json_object else
             Grammar.json_schema(tokenizer, self.json_schema, param="json_schema"))
        return dataclasses.replace(self, grammar=g, json_schema=None, json_object=False)

    @property
    def is_greedy(self) -> bool:
        """True when the sampler will always take the argmax."""
        return (self.temperature <= GREEDY_TEMPERATURE or self.top_k == 1 or self.top_p <= 0.0)

    def validate(self) -> "SamplingParams":
        """Check every field; normalizes ``stop`` to a tuple and ``logit_bias`` keys to ints.

        Returns:
            self.
        Raises:
            InvalidRequestError: a value is out of range or of the wrong type; ``.param`` names it.
        """
        self.temperature = _num("temperature", self.temperature, 0.0, 100.0)
        self.top_k = _int("top_k", self.top_k, 0)
        self.top_p = _num("top_p", self.top_p, 0.0, 1.0)
        self.min_p = _num("min_p", self.min_p, 0.0, 1.0)
        self.repeat_penalty = _num("repeat_penalty", self.repeat_penalty, 0.0, 100.0, lo_open=True)
        self.repeat_last_n = _int("repeat_last_n", self.repeat_last_n, -1)
        self.frequency_penalty = _num("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        self.presence_penalty = _num("presence_penalty", self.presence_penalty, -2.0, 2.0)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidRequestError("logit_bias must be an object {token_id: bias}",
                                          param="logit_bias")
            lb = {}
            for k, v in self.logit_bias.items():
                try:
                    kid = int(k)
                    if isinstance(k, float) and not float(k).is_integer():
                        raise ValueError
                except (TypeError, ValueError):
                    raise InvalidRequestError(f"logit_bias key {k!r} is not a token id",
                                              param="logit_bias") from None
                if kid < 0:
                    raise InvalidRequestError(f"logit_bias token id {kid} is negative",
                                              param="logit_bias")
                lb[kid] = _num("logit_bias", v, -100.0, 100.0)
            self.logit_bias = lb
        if self.seed is not None:
            self.seed = _int("seed", self.seed)
            if not SEED_MIN <= self.seed <= SEED_MAX:  # a 64-bit key (the device sampler's)
                raise InvalidRequestError(
                    f"seed must be a 64-bit integer, from {SEED_MIN} to {SEED_MAX}, got "
                    f"{self.seed}", param="seed")
        if self.max_tokens is not None:
            # 0 only to score a prompt (prompt_logprobs; OpenAI's echo with max_tokens 0)
            self.max_tokens = _int("max_tokens", self.max_tokens,
                                   0 if self.prompt_logprobs is True else 1)
        stop = self.stop
        if stop is None:
            stop = ()
        if isinstance(stop, str):
            stop = (stop,)
        if isinstance(stop, (bytes, bytearray)):
            raise InvalidRequestError("stop must be a string or a list of strings, not bytes",
                                      param="stop")
        try:
            stop = tuple(stop)
        except TypeError:
            raise InvalidRequestError("stop must be a string or a list of strings", param="stop") from None
        for s in stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(
                    f"stop strings must be non-empty strings, got {json_value(s)}", param="stop")
            # no generated text could match it
            require_utf8(s, f"stop string {json_value(s)}", "stop")
        self.stop = stop
        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs, 0)
            if self.logprobs > MAX_TOP_LOGPROBS:
                raise InvalidRequestError(
                    f"logprobs asks for {self.logprobs} alternatives; at most "
                    f"{MAX_TOP_LOGPROBS}", param="top_logprobs")
        if not isinstance(self.prompt_logprobs, bool):
            raise InvalidRequestError("prompt_logprobs must be true or false",
                                      param="prompt_logprobs")
        if self.grammar is not None and not callable(getattr(self.grammar, "start", None)):
            raise InvalidRequestError(
                "grammar must be a localmoe.text.grammar.Grammar (use json_schema= or "
                "json_object=True)", param="grammar")
        if not isinstance(self.json_object, bool):
            raise InvalidRequestError("json_object must be true or false", param="json_object")
        if self.json_schema is not None and not isinstance(self.json_schema, (dict, str, bool)):
            raise InvalidRequestError("json_schema must be a JSON Schema (an object or its JSON "
                                      "text)", param="json_schema")
        if self.json_object and self.json_schema is not None:
            raise InvalidRequestError("give json_schema or json_object, not both",
                                      param="json_schema")
        return self


class Sampler:
    """Picks the next token from logits (see the module docstring for the order).

    The math runs in NumPy on CPU (single-threaded, no per-op dispatch cost) and the filters
    avoid full sorts: ``top_k`` by partition, ``min_p`` by a logit threshold
    (``logit >= max + ln(min_p)``), ``top_p`` by a partial sort of the best 512 candidates that
    falls back to a full sort only for very flat distributions without ``min_p``/``top_k``.

    Args:
        params: validated :class:`SamplingParams` (validated again here).
        vocab_size: number of token ids; logits may be longer (padded vocabularies) -- the
            extra positions are never sampled.
        exempt_ids: ids the penalties never touch (end-of-turn and control tokens).
        device_sampling: None = on the device when the logits are a CUDA tensor (default;
            ``$LOCALMOE_DEVICE_SAMPLING`` on/off, e.g. 1/0, overrides it); True = always the device path
            (CPU tensors and arrays included); False = always the NumPy path.
    Raises:
        InvalidRequestError: bad params, or a ``logit_bias`` id >= vocab_size.
    """

    _TOP_P_PARTIAL = 512

    def __init__(self, params: SamplingParams, vocab_size: int, exempt_ids: Iterable[int] = (),
                 device_sampling: bool | None = None):
        self.params = params.validate()
        self.vocab_size = int(vocab_size)
        self.exempt_ids = frozenset(int(i) for i in exempt_ids if 0 <= int(i) < self.vocab_size)
        self._bias_ids = self._bias_vals = None
        if params.logit_bias:
            bad = [i for i in params.logit_bias if i >= self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"logit_bias token id {bad[0]} is outside the vocabulary (size {self.vocab_size})",
                    param="logit_bias")
            self._bias_ids = np.array(list(params.logit_bias), dtype=np.int64)
            self._bias_vals = np.array(list(params.logit_bias.values()), dtype=np.float32)
        seed = params.seed
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1)
        self.seed = seed
        self.last_logprob: TokenLogprob | None = None
        self.rng = np.random.Generator(np.random.PCG64(seed & ((1 << 128) - 1) if seed >= 0
                                                       else (-seed) | (1 << 127)))
        if device_sampling is None:
            device_sampling = env_flag("LOCALMOE_DEVICE_SAMPLING", None)
        self.device_sampling = device_sampling
        self._dev: _DeviceState | None = None

    def uses_device(self, logits) -> bool:
        """Whether :meth:`sample` takes the device path for ``logits`` (see ``device_sampling``;
        logits shorter than the vocabulary always take the NumPy path)."""
        if self.device_sampling is False:
            return False
        if isinstance(logits, torch.Tensor):
            if logits.numel() < self.vocab_size:
                return False
            return bool(self.device_sampling) or logits.is_cuda
        return bool(self.device_sampling) and np.size(logits) >= self.vocab_size

    # -- steps ---------------------------------------------------------------------------------
    def apply_penalties(self, logits, history: Sequence[int]):
        """Step 1, in place on ``logits`` (float32 ``[vocab]``, NumPy array or torch tensor
        sharing memory); returns it."""
        p = self.params
        if p.repeat_last_n == 0 or not len(history):
            return logits
        if p.repeat_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0:
            return logits
        x = logits.numpy() if isinstance(logits, torch.Tensor) else logits
        window = history if p.repeat_last_n < 0 else history[-p.repeat_last_n:]
        ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
        keep = (ids >= 0) & (ids < self.vocab_size)
        if self.exempt_ids:
            keep &= np.fromiter((int(i) not in self.exempt_ids for i in ids), dtype=bool, count=ids.size)
        ids, counts = ids[keep], counts[keep].astype(np.float32)
        if ids.size == 0:
            return logits
        sel = x[ids]
        if p.repeat_penalty != 1.0:
            sel = np.where(sel > 0, sel / p.repeat_penalty, sel * p.repeat_penalty)
        sel = sel - (counts * p.frequency_penalty + p.presence_penalty)
        x[ids] = sel.astype(np.float32)
        return logits

    def sample(self, logits, history: Sequence[int] = (), allowed=None) -> int:
        """Pick the next token id.

        Args:
            logits: ``[vocab]`` (or ``[1, vocab]``) float tensor / NumPy array, any float dtype;
                a CUDA tensor is sampled on its GPU (see the module docstring).
            history: token ids so far (prompt + generated), for the penalties.
            allowed: None, or a grammar's next step: a bool ``[vocab_size]`` NumPy mask, or the
                same packed as int32 ``[ceil(vocab_size/32)]`` words (bit ``i % 32`` of word
                ``i // 32`` = token ``i``, :meth:`Constraint.allowed_bits
                <localmoe.text.grammar.Constraint.allowed_bits>`): only allowed ids can be
                picked (if it allows none, the lowest id is returned).
        Returns:
            token id in ``[0, vocab_size)``. With ``params.logprobs`` set, its
            :class:`TokenLogprob` is in :attr:`last_logprob` afterwards.
        """
        if self.uses_device(logits):
            return self._sample_device(logits, history, allowed)
        if allowed is not None:
            allowed = _bool_mask(allowed, self.vocab_size)
        x, nan = self._processed(logits, history, allowed)
        t = self._pick(x, nan, allowed)
        if self.params.logprobs is not None:
            self.last_logprob = token_logprob(x, t, self.params.logprobs)
        return t

    def _device_input(self, logits):
        """``(x, state)``: the logits as a float ``[1, V']`` tensor and the sampler's tensors
        on its device."""
        x = logits if isinstance(logits, torch.Tensor) else torch.from_numpy(np.asarray(logits))
        x = x.detach().reshape(1, -1)
        if not x.is_floating_point():
            x = x.float()
        st = self._dev
        if st is None or st.device != x.device:
            st = self._dev = _DeviceState(self, x.device)
        return x, st

    def _sample_device(self, logits, history, allowed) -> int:
        """:meth:`sample` on the logits' device (one read of the id, and of its logprob)."""
        from localmoe.kernels.sampling import sample_device

        x, st = self._device_input(logits)
        counts = st.counts_for(history) if st.params.has_penalties else None
        bits = st.upload_mask(allowed) if allowed is not None else None
        n_top = self.params.logprobs
        out = sample_device(x, st.params, counts=counts, bitmask=bits,
                            want_logprobs=n_top is not None, want_processed=bool(n_top),
                            workspace=st.workspace)
        if n_top:  # top_logprobs: the processed row on the host, as the NumPy path reports
            row = out.processed[0].cpu().numpy()
            t = int(out.ids[0])
            self.last_logprob = token_logprob(row, t, n_top)
        elif n_top is not None:
            t, lp = torch.stack([out.ids[0].double(), out.logprobs[0].double()]).tolist()
            t = int(t)
            self.last_logprob = TokenLogprob(t, lp if math.isfinite(lp) else -math.inf, [])
        else:
            t = int(out.ids[0])
        st.seen(history, t)
        return t

    # -- sampling split in two: the device work, then the read of the id ------------------------
    def can_launch(self, logits) -> bool:
        """Whether :meth:`launch` can sample ``logits``: the device path and no
        log-probabilities (those are read with the id)."""
        return self.params.logprobs is None and self.uses_device(logits)

    def launch(self, logits, history: Sequence[int] = (), allowed=None) -> "PendingToken":
        """Start sampling ``logits`` on their device and return at once (nothing waits for the
        GPU): the id stays on the device (``.ids``, int64 ``[1]``) for the caller to feed into
        the next forward pass before reading it with :meth:`finish` (the same token
        :meth:`sample` would return; ``allowed`` as there). Only where :meth:`can_launch` says
        so.
        """
        from localmoe.kernels.sampling import sample_device

        x, st = self._device_input(logits)
        counts = st.counts_for(history) if st.params.has_penalties else None
        bits = st.upload_mask(allowed) if allowed is not None else None
        out = sample_device(x, st.params, counts=counts, bitmask=bits, workspace=st.workspace)
        return st.read_later(out.ids)

    def finish(self, pending: "PendingToken", history: Sequence[int] = ()) -> int:
        """The id :meth:`launch` sampled (waits for the sampler's kernels and the copy of the
        id, not for work queued after them). ``history`` is the one given to :meth:`launch`."""
        t = pending.read()
        self._dev.seen(history, t)
        return t

    def _processed(self, logits, history, allowed):
        """Float32 NumPy logits after NaN removal, penalties, bias and the mask (a copy)."""
        if isinstance(logits, torch.Tensor):
            x = logits.detach().reshape(-1)[: self.vocab_size].to("cpu", torch.float32).numpy().copy()
        else:
            x = np.array(logits, dtype=np.float32).reshape(-1)[: self.vocab_size].copy()
        if x.size == 0:
            raise InvalidRequestError("empty logits", param="logits")
        nan = None
        if not math.isfinite(float(x.sum(dtype=np.float64))):  # cheap screen for NaN / inf
            nan = np.isnan(x)
            if nan.any():
                x[nan] = -np.inf
        self.apply_penalties(x, history)
        if self._bias_ids is not None:
            x[self._bias_ids] += self._bias_vals
        if allowed is not None:
            n = min(x.size, allowed.size)
            np.putmask(x[:n], ~allowed[:n], -np.inf)
            if n < x.size:
                x[n:] = -np.inf
        return x, nan

    def _pick(self, x, nan, allowed) -> int:
        p = self.params
        top = int(np.argmax(x))  # lowest id on ties
        if not np.isfinite(x[top]):
            if x[top] == np.inf:  # +inf logits: only those can win
                x = np.where(x == np.inf, 0.0, -np.inf).astype(np.float32)
            elif allowed is not None:  # nothing allowed is finite: the first allowed id
                return int(np.argmax(allowed[: x.size])) if allowed[: x.size].any() else top
            else:  # nothing finite left
                return top if nan is None or not nan[top] else int(np.argmin(nan))
        if p.is_greedy:
            return top
        n = x.size
        k = p.top_k if 0 < p.top_k < n else n
        log_min_p = math.log(p.min_p) if p.min_p > 0.0 else -math.inf
        # top_p and min_p each keep a prefix of the sorted candidates (min_p's ratio test does
        # not change under renormalization), so the survivors are the shorter prefix and the
        # cheap one can be applied first without changing the result.
        if k < n:
            idx = _top_m(x, k, float(x[top]))
            vals = x[idx]
            lse = _logsumexp(vals)
        else:
            lse = _logsumexp(x)
            if p.min_p > 0.0:
                idx = np.flatnonzero(x >= x[top] + log_min_p)
                if p.top_p >= 1.0:
                    return int(idx[self._draw(x[idx], x[top])])
                idx = idx[np.argsort(-x[idx], kind="stable")]
                vals = x[idx]
            elif p.top_p < 1.0:
                idx = vals = None
                m = self._TOP_P_PARTIAL
                if m < n:
                    cand = _top_m(x, m, float(x[top]))
                    mass = np.cumsum(np.exp(x[cand].astype(np.float64) - lse))
                    if mass[-1] >= p.top_p:
                        idx, vals = cand, x[cand]
                if idx is None:
                    idx = np.argsort(-x, kind="stable")
                    vals = x[idx]
            else:
                idx = np.flatnonzero(np.isfinite(x))
                return int(idx[self._draw(x[idx], x[top])])
        # top_p: probabilities at temperature 1, normalized over the top_k survivors
        if p.top_p < 1.0:
            cum = np.cumsum(np.exp(vals.astype(np.float64) - lse))
            keep = int(np.searchsorted(cum, p.top_p, side="left")) + 1
            keep = max(1, min(keep, vals.size))
            idx, vals = idx[:keep], vals[:keep]
        # min_p relative to the best token
        if p.min_p > 0.0 and vals.size > 1:
            mask = vals >= vals[0] + log_min_p
            mask[0] = True
            idx, vals = idx[mask], vals[mask]
        return int(idx[self._draw(vals, vals[0])])

    def _draw(self, vals, vmax) -> int:
        """Temperature, then one categorical draw; returns a position in ``vals``."""
        t = self.params.temperature
        z = (vals.astype(np.float64) - float(vmax)) / t  # shift first: no overflow
        w = np.exp(z)
        c = np.cumsum(w)
        total = c[-1]
        if not np.isfinite(total) or total <= 0:
            return int(np.argmax(vals))
        u = self.rng.random() * total
        return int(min(np.searchsorted(c, u, side="right"), vals.size - 1))


class _DeviceState:
    """A :class:`Sampler`'s tensors on one device: the parameters, the penalty window's token
    counts and the buffers the grammar mask and the count updates travel through."""

    def __init__(self, sampler: Sampler, device: torch.device):
        from localmoe.kernels.sampling import DeviceSamplingParams

        self.sampler = sampler
        self.device = device
        self.vocab = v = sampler.vocab_size
        self.params = DeviceSamplingParams.build([sampler.params], v, device,
                                                 seeds=[sampler.seed])
        pin = device.type == "cuda"
        self.words = (v + 31) // 32
        self.bits_host = torch.zeros((1, self.words), dtype=torch.int32, pin_memory=pin)
        self.bits_dev = (torch.empty((1, self.words), dtype=torch.int32, device=device)
                         if pin else None)
        self.small_host = torch.zeros(2, dtype=torch.int64, pin_memory=pin)
        self.id_host = torch.zeros(1, dtype=torch.int64, pin_memory=pin)
        self.id_event = torch.cuda.Event() if device.type == "cuda" else None
        self.workspace: dict = {}  # sample_device's buffers, reused every step
        self.counts: torch.Tensor | None = None
        self.hist_len = -1
        self.last_id: int | None = None

    def upload_mask(self, allowed) -> torch.Tensor:
        """The grammar mask (bool or packed, see :meth:`Sampler.sample`) as an int32
        ``[1, words]`` tensor on the device (copied without waiting for the stream)."""
        a = np.asarray(allowed)
        if a.dtype == bool:
            from localmoe.kernels.sampling import pack_mask

            a = pack_mask(a[: self.vocab])
        a = a.reshape(-1).view(np.int32)
        n = min(self.words, a.size)
        h = self.bits_host.numpy()
        h[0, :n] = a[:n]
        if n < self.words:
            h[0, n:] = 0
        if self.bits_dev is None:
            return self.bits_host
        return self.bits_dev.copy_(self.bits_host, non_blocking=True)

    def counts_for(self, history: Sequence[int]) -> torch.Tensor:
        """The window counts for ``history``: updated by one token in and one out when the
        history is the last one plus the token sampled then, else rebuilt."""
        from localmoe.kernels.sampling import counts_from_history, update_counts

        s, n = self.sampler, len(history)
        win = s.params.repeat_last_n
        if (self.counts is not None and self.last_id is not None and n == self.hist_len + 1
                and int(history[-1]) == self.last_id):
            new = self._countable(history[-1])
            out = self._countable(history[n - 1 - win]) if 0 < win < n else -1
            if new >= 0 or out >= 0:
                self.small_host[0], self.small_host[1] = new, out
                d = self.small_host.to(self.device, non_blocking=True)
                update_counts(self.counts, d[0:1], d[1:2])
        else:
            self.counts = counts_from_history([history], self.vocab, win, s.exempt_ids,
                                              self.device).contiguous()
        self.hist_len = n
        return self.counts

    def read_later(self, ids: torch.Tensor) -> "PendingToken":
        """Queue the copy of ``ids[0]`` into the pinned host buffer behind the sampler's
        kernels, with an event after it (one pending read at a time per sampler)."""
        self.id_host.copy_(ids[:1], non_blocking=self.id_event is not None)
        if self.id_event is not None:
            self.id_event.record()
        return PendingToken(ids, self.id_host, self.id_event)

    def _countable(self, tid) -> int:
        t = int(tid)
        return t if 0 <= t < self.vocab and t not in self.sampler.exempt_ids else -1

    def seen(self, history: Sequence[int], token_id: int) -> None:
        """Record the call (the next history is expected to be this one plus ``token_id``)."""
        self.hist_len = len(history)
        self.last_id = int(token_id)


class PendingToken:
    """A token id sampled on the device and not read yet (:meth:`Sampler.launch`).

    Attributes:
        ids: int64 ``[1]`` device tensor holding the id (overwritten by the sampler's next
            call).
    """

    def __init__(self, ids: torch.Tensor, host: torch.Tensor, event):
        self.ids, self._host, self._event = ids, host, event

    def read(self) -> int:
        """The id: waits for the event recorded after its copy (not for later work)."""
        if self._event is not None:
            self._event.synchronize()
        return int(self._host[0])


def _bool_mask(allowed, vocab_size: int) -> np.ndarray:
    """``allowed`` as a bool mask: packed int32 words are unpacked to ``vocab_size`` entries."""
    a = np.asarray(allowed)
    if a.dtype == bool:
        return a
    bits = np.unpackbits(a.reshape(-1).view(np.uint8), bitorder="little")[:vocab_size]
    return bits.view(bool)


def _top_m(x, m: int, xmax: float):
    """Indices of the ``m`` largest entries of ``x`` (fewer if fewer are finite), sorted by
    value descending. Pre-selects candidates with a cheap threshold (``x >= xmax - gap``, gap
    widened until ``m`` qualify) so the partition runs on a few hundred entries, not the whole
    vocabulary."""
    n = x.size
    gap = 8.0
    while True:
        cand = np.flatnonzero(x >= xmax - gap)
        if cand.size >= m or gap > 1e6:
            break
        gap *= 8.0
    if cand.size < m:
        cand = np.flatnonzero(x > -np.inf) if cand.size < n else cand
    if cand.size > m:
        cand = cand[np.argpartition(x[cand], cand.size - m)[cand.size - m:]]
    return cand[np.argsort(-x[cand], kind="stable")]


def token_logprob(x, token_id: int, n_top: int) -> TokenLogprob:
    """:class:`TokenLogprob` of ``token_id`` under logits ``x`` (float32 NumPy ``[vocab]``,
    ``-inf`` = excluded) at temperature 1, with the ``n_top`` most likely alternatives."""
    lse = _logsumexp(x)
    if not math.isfinite(lse):  # nothing finite: no distribution to report
        return TokenLogprob(int(token_id), -math.inf, [])
    lp = float(x[token_id]) - lse
    top = []
    if n_top > 0:
        idx = _top_m(x, min(n_top, x.size), float(np.max(x)))
        top = [(int(i), float(x[i]) - lse) for i in idx if np.isfinite(x[i])]
    return TokenLogprob(int(token_id), lp if math.isfinite(lp) else -math.inf, top)


def _logsumexp(v) -> float:
    m = float(np.max(v))
    if not math.isfinite(m):
        return m
    return m + math.log(float(np.sum(np.exp(v.astype(np.float64) - m))))
