"""KV codecs: how one side (K or V) of one layer stores its values, and the float formats.

A codec turns float rows ``[T, n_kv_heads, head_dim]`` into the tensors of a *store* (a dict
of named tensors, one per layer and side, made by :meth:`KVCodec.alloc`) and back. The float
formats are :class:`FloatCodec` here, the quantized ones
:class:`~localmoe.kv.quant_codec.QuantCodec`; :mod:`localmoe.kv.registry` maps format names to
codec classes. A codec sees the cache's :class:`~localmoe.kv.spec.KVSpec` as ``kv_spec`` (it
reads ``outlier_frac``, ``key_outliers()``, ``sink_tokens`` and ``window``).
"""

from __future__ import annotations

from typing import Any

import torch

from localmoe.errors import KVCacheFormatError
from localmoe.kv.formats import KVFormat

__all__ = ["KVCodec", "FloatCodec"]


class KVCodec:
    """Storage of one tensor kind (K or V) of one layer in one format.

    Subclasses implement :meth:`alloc`, :meth:`write`, :meth:`read` and
    :meth:`bits_per_value`. Shapes: ``slots`` LongTensor[T]; ``x`` float Tensor[T, n_kv_heads,
    head_dim]; ``positions`` LongTensor[T] (token positions, for sink/window rules).
    """

    def __init__(self, fmt: KVFormat, n_kv_heads: int, head_dim: int, kv_spec: Any):
        self.fmt = fmt
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.kv_spec = kv_spec

    def alloc(self, n_slots: int, device: Any) -> dict[str, torch.Tensor]:
        """Zeroed storage for ``n_slots`` token slots on ``device``: name -> Tensor."""
        raise KVCacheFormatError(f"KV format {self.fmt.name} has no storage implementation")

    def write(self, store: dict[str, torch.Tensor], slots: torch.Tensor, x: torch.Tensor,
              positions: torch.Tensor, seq_row: int | None = None, *,
              start: int | None = None) -> None:
        """Store ``x`` at ``slots``; ``seq_row`` is the sequence's row in per-sequence buffers.
        ``start`` (Python int, optional): ``positions`` is known to be ``start .. start+T-1``,
        so a codec can decide sink/window/page membership without reading ``positions`` back
        from the device (:class:`~localmoe.kv.cache.PagedKVCache` passes it to codecs whose
        ``write`` takes it)."""
        raise KVCacheFormatError(f"KV format {self.fmt.name} cannot be written")

    def read(self, store: dict[str, torch.Tensor], slots: torch.Tensor,
             positions: torch.Tensor | None = None, seq_row: int | None = None, *,
             start: int | None = None) -> torch.Tensor:
        """float32 [L, n_kv_heads, head_dim] of ``slots``; ``positions``/``seq_row`` let a
        codec serve sink/window tokens from its full-precision buffers; ``start`` as for
        :meth:`write`."""
        raise KVCacheFormatError(f"KV format {self.fmt.name} cannot be read")

    @classmethod
    def bits_per_value(cls, fmt: KVFormat, head_dim: int, kv_spec: Any, *, role: str = "k",
                       block_size: int = 16) -> float:
        """Stored bits per value of ``fmt`` for ``role`` ("k"/"v") with ``block_size``-token
        pages."""
        return float(fmt.bits)

    def bytes_per_token(self) -> float:
        """Bytes per token for this layer and tensor kind (all kv heads)."""
        return self.bits_per_value(self.fmt, self.head_dim, self.kv_spec,
                                   role=getattr(self, "role", "k"),
                                   block_size=getattr(self, "block_size", 16)) * self.head_dim \
            * self.n_kv_heads / 8.0


_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


class FloatCodec(KVCodec):
    """Plain float storage: ``data`` Tensor[n_slots, n_kv_heads, head_dim] of f32/f16/bf16.
    Sinks and windows need nothing here (everything is full precision already)."""

    def alloc(self, n_slots, device):
        return {"data": torch.zeros(n_slots, self.n_kv_heads, self.head_dim,
                                    dtype=_DTYPES[self.fmt.name], device=device)}

    def write(self, store, slots, x, positions, seq_row=None, *, start=None):
        store["data"][slots] = x.to(store["data"].dtype)

    def read(self, store, slots, positions=None, seq_row=None, *, start=None):
        return store["data"][slots].float()
