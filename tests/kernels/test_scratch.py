"""Scratch buffers of the CUDA-graphed step: an outgrown buffer is replaced by a larger one
and kept alive (a graph captured earlier still writes to its address)."""

import torch

from localmoe.kernels import scratch
from localmoe.kernels.decode_attention import _LOCKS, _locks


def test_grown_keeps_the_outgrown_buffer_alive():
    a = scratch.grown(None, (4, 8), torch.float32, "cpu", zero=True)
    assert a.shape == (4, 8) and not a.any()
    assert scratch.grown(a, (2, 8), torch.float32, "cpu") is a       # big enough: reused
    b = scratch.grown(a, (3, 16), torch.float32, "cpu", zero=True)
    assert b.shape == (4, 16) and not b.any()                        # the larger of each dim
    assert any(t is a for t in scratch._RETIRED)


def test_attention_split_counters_grow_without_freeing_the_old_buffer():
    _LOCKS.pop("cpu", None)
    small = _locks(4, torch.device("cpu"))
    assert small.numel() == 256 and small.dtype == torch.int32 and not small.any()
    assert _locks(200, torch.device("cpu")) is small
    big = _locks(1000, torch.device("cpu"))
    assert big.numel() == 1000 and not big.any()
    assert any(t is small for t in scratch._RETIRED)
    _LOCKS.pop("cpu", None)
