"""Packed int64 sort keys of float32 scores, for top-k selection in Triton kernels.

A key holds the score's bits, made order-preserving as an int32 (negative floats have their
magnitude bits flipped, so int32 order is float order; -0.0 is first made +0.0), in its high
word and a caller's tie-breaker in its low word (a non-negative int32, larger wins). One int64
max, or one ``tl.topk`` / ``tl.sort``, then selects by score and breaks ties by the low word in
the same operation, and the score and the tie-breaker come back out of the key: no gather.
NaN scores must be replaced before (the callers map them to -inf or drop them).

Used by the MoE routing (:func:`localmoe.kernels.router.route_pick`, the fused MoE's
``_route_topk``: low word ``EP - 1 - expert``, ties to the lower expert) and the sampler's
top-k candidates (:mod:`localmoe.kernels.sampling`: low word ``2**31 - 1 - token id``).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["PAD_KEY", "score_key", "key_score", "key_low"]

#: the key of an entry that must never be picked (below every real key; a constexpr, so
#: kernels can use it)
PAD_KEY = tl.constexpr(-9223372036854775807)


@triton.jit
def score_key(x, low):
    """int64 keys of float32 scores ``x`` (any shape) with the int32 tie-breakers ``low``
    (same shape or broadcastable, 0 <= low < 2**31)."""
    b = (x + 0.0).to(tl.int32, bitcast=True)           # + 0.0: -0.0 becomes +0.0
    mono = tl.where(b >= 0, b, b ^ 0x7FFFFFFF)         # int32 order = float order
    return (mono.to(tl.int64) << 32) | low.to(tl.int64)


@triton.jit
def key_score(key):
    """The float32 score of int64 keys made by :func:`score_key`."""
    hi = (key >> 32).to(tl.int32)
    return tl.where(hi >= 0, hi, hi ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def key_low(key):
    """The int32 tie-breaker (low word) of int64 keys made by :func:`score_key`."""
    return (key & 0xFFFFFFFF).to(tl.int32)
