"""Token sampling: parameters, validation and the sampler chain.

Sampler order (the same chain as llama.cpp's default sampler, minus DRY/XTC/typical):

1. **penalties** over the last ``repeat_last_n`` tokens of the history (prompt + generated;
   ``-1`` = all of it, ``0`` = off): repetition penalty (a logit > 0 is divided by
   ``repeat_penalty``, a logit <= 0 multiplied, CTRL paper / llama.cpp), then
   ``logit -= frequency_penalty * count + presence_penalty * (count > 0)`` (OpenAI). Ids in
   ``exempt_ids`` (end-of-turn and control tokens, given by the engine) are never penalized.
2. **logit bias**: ``logit[id] += bias`` (OpenAI ``logit_bias``, -100..100; -100 effectively
   bans a token).
3. **greedy short-cut**: ``temperature <= 1e-5``, ``top_k == 1`` or ``top_p == 0`` -> argmax
   (lowest id on ties). Nothing random happens, so the seed does not matter.
4. **top_k**: keep the k largest logits (0 = off).
5. **top_p** (nucleus): softmax at temperature 1, keep the smallest prefix of the sorted
   tokens whose mass reaches ``top_p`` (at least one token; 1.0 = off).
6. **min_p**: keep tokens whose probability is >= ``min_p`` times the top probability
   (0 = off).
7. **temperature**: divide the surviving logits by ``temperature``.
8. **sample** from the softmax with the sampler's own ``torch.Generator``: seeded from
   ``seed`` (same seed + same logits -> same tokens), or from OS entropy when ``seed`` is None.

Non-finite logits are handled: NaN counts as -inf; if nothing finite remains the sampler falls
back to the argmax of the raw logits with NaN removed, so it never returns an out-of-range id
or raises.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Iterable, Sequence

import torch

from localmoe.errors import InvalidRequestError

__all__ = ["SamplingParams", "Sampler", "GREEDY_TEMPERATURE"]

GREEDY_TEMPERATURE = 1e-5  # temperatures at or below this sample greedily


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
        max_tokens: cap on generated tokens (>= 1), None = until the context is full.
        stop: stop strings (a string or a sequence of non-empty strings).
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

    @classmethod
    def greedy(cls, **overrides: Any) -> "SamplingParams":
        """Deterministic argmax decoding (temperature 0, no penalties)."""
        kw = dict(temperature=0.0, top_k=1, top_p=1.0, min_p=0.0)
        kw.update(overrides)
        return cls(**kw)

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
        if self.max_tokens is not None:
            self.max_tokens = _int("max_tokens", self.max_tokens, 1)
        stop = self.stop
        if stop is None:
            stop = ()
        if isinstance(stop, str):
            stop = (stop,)
        try:
            stop = tuple(stop)
        except TypeError:
            raise InvalidRequestError("stop must be a string or a list of strings", param="stop") from None
        for s in stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(f"stop strings must be non-empty strings, got {s!r}",
                                          param="stop")
        self.stop = stop
        return self


class Sampler:
    """Picks the next token from logits (see the module docstring for the order).

    Args:
        params: validated :class:`SamplingParams` (validated again here).
        vocab_size: number of token ids; logits may be longer (padded vocabularies) -- the
            extra positions are never sampled.
        exempt_ids: ids the penalties never touch (end-of-turn and control tokens).
    Raises:
        InvalidRequestError: bad params, or a ``logit_bias`` id >= vocab_size.
    """

    def __init__(self, params: SamplingParams, vocab_size: int, exempt_ids: Iterable[int] = ()):
        self.params = params.validate()
        self.vocab_size = int(vocab_size)
        self.exempt_ids = {int(i) for i in exempt_ids if 0 <= int(i) < self.vocab_size}
        self._exempt_t = (torch.tensor(sorted(self.exempt_ids), dtype=torch.long)
                          if self.exempt_ids else None)
        self._bias_ids = self._bias_vals = None
        if params.logit_bias:
            bad = [i for i in params.logit_bias if i >= self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"logit_bias token id {bad[0]} is outside the vocabulary (size {self.vocab_size})",
                    param="logit_bias")
            self._bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
            self._bias_vals = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
        seed = params.seed
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1)
        self.seed = seed
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(seed & ((1 << 64) - 1))

    # -- steps ---------------------------------------------------------------------------------
    def apply_penalties(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        """Step 1 (in place on ``logits``, float32 [vocab]); returns it."""
        p = self.params
        if p.repeat_last_n == 0 or not history:
            return logits
        if p.repeat_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0:
            return logits
        window = history if p.repeat_last_n < 0 else history[-p.repeat_last_n:]
        ids = torch.tensor([t for t in window if 0 <= t < self.vocab_size], dtype=torch.long)
        if ids.numel() == 0:
            return logits
        counts = torch.bincount(ids, minlength=self.vocab_size)[: self.vocab_size].to(torch.float32)
        if self._exempt_t is not None:
            counts[self._exempt_t] = 0
        seen = counts > 0
        if not bool(seen.any()):
            return logits
        lg = logits[: self.vocab_size]
        if p.repeat_penalty != 1.0:
            sel = lg[seen]
            lg[seen] = torch.where(sel > 0, sel / p.repeat_penalty, sel * p.repeat_penalty)
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            lg -= counts * p.frequency_penalty + seen.to(torch.float32) * p.presence_penalty
        return logits

    def sample(self, logits: torch.Tensor, history: Sequence[int] = ()) -> int:
        """Pick the next token id.

        Args:
            logits: float tensor ``[vocab]`` (any float dtype/device; copied to CPU float32).
            history: token ids so far (prompt + generated), for the penalties.
        Returns:
            token id in ``[0, vocab_size)``.
        """
        p = self.params
        x = logits.detach().reshape(-1).to("cpu", torch.float32).clone()
        x = x[: self.vocab_size]
        if x.numel() == 0:
            raise InvalidRequestError("empty logits", param="logits")
        raw = x
        x = torch.nan_to_num(x, nan=float("-inf"))
        x = self.apply_penalties(x, history)
        if self._bias_ids is not None:
            x[self._bias_ids] += self._bias_vals
        if not bool(torch.isfinite(x).any()):
            return int(torch.argmax(torch.nan_to_num(raw, nan=-1e30, posinf=1e30, neginf=-1e30)))
        if p.is_greedy:
            return int(torch.argmax(torch.nan_to_num(x, posinf=3e38)))
        # +inf logits: only those can win
        if bool(torch.isposinf(x).any()):
            x = torch.where(torch.isposinf(x), torch.zeros_like(x), torch.full_like(x, float("-inf")))
        # top_k
        k = p.top_k if 0 < p.top_k < x.numel() else x.numel()
        if k < x.numel():
            vals, idx = torch.topk(x, k)
        else:
            vals, idx = torch.sort(x, descending=True)
        # top_p (at temperature 1)
        if p.top_p < 1.0:
            probs = torch.softmax(vals, dim=0)
            cum = torch.cumsum(probs, dim=0)
            # keep tokens until the mass reaches top_p (the token crossing it included)
            keep = int(torch.searchsorted(cum, torch.tensor([p.top_p]), right=False).item()) + 1
            keep = max(1, min(keep, vals.numel()))
            vals, idx = vals[:keep], idx[:keep]
        # min_p (relative to the top probability)
        if p.min_p > 0.0 and vals.numel() > 1:
            probs = torch.softmax(vals, dim=0)
            mask = probs >= p.min_p * probs[0]
            mask[0] = True
            vals, idx = vals[mask], idx[mask]
        # temperature
        vals = vals / p.temperature
        probs = torch.softmax(vals - vals.max(), dim=0)
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
            return int(idx[0])
        choice = torch.multinomial(probs, 1, generator=self.generator)
        return int(idx[int(choice)])
