"""Device buffers that kernels of a CUDA-graphed step reuse across launches (counters the
kernels leave at zero, partial-sum scratch): one per device and purpose, grown when a launch
needs more. A captured graph records a buffer's address, so an outgrown buffer is kept alive,
never freed. Launches that share a buffer must not overlap on two streams."""

from __future__ import annotations

import torch

__all__ = ["grown"]

_RETIRED: list = []


def grown(buf: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device,
          zero: bool = False) -> torch.Tensor:
    """``buf`` if it is at least ``shape`` in every dimension, else a new buffer of the larger
    of the two in each (zeroed with ``zero``; ``buf`` is kept alive)."""
    if buf is not None and all(have >= want for have, want in zip(buf.shape, shape)):
        return buf
    if buf is not None:
        _RETIRED.append(buf)
        shape = tuple(max(have, want) for have, want in zip(buf.shape, shape))
    make = torch.zeros if zero else torch.empty
    return make(shape, dtype=dtype, device=device)
