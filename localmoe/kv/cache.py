"""Paged KV cache with pluggable storage formats.

Layout: the cache owns a pool of fixed-size token blocks (``block_size`` tokens each) per layer;
every sequence has a block table mapping its logical block ``p // block_size`` to a physical
block, as in vLLM's PagedAttention (Kwon et al., 2023). A token at position ``p`` of a sequence
lives in *slot* ``block_table[p // block_size] * block_size + p % block_size``.

How a slot's K (or V) values are stored is decided by a *codec*, one per format name
(``f16``, ``int4``, ...), looked up in :mod:`localmoe.kv.registry`: the float formats are
:class:`~localmoe.kv.codec.FloatCodec`, the quantized ones
:class:`~localmoe.kv.quant_codec.QuantCodec`. The cache never subclasses per bit width: one
:class:`PagedKVCache` drives any (K codec, V codec) pair. The formats themselves are
:class:`~localmoe.kv.spec.KVSpec` and :class:`~localmoe.kv.formats.KVFormat`.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any

import torch

from localmoe.errors import ContextOverflowError, LocalMoEError
from localmoe.kv.codec import KVCodec
from localmoe.kv.formats import KVFormat
from localmoe.kv.registry import get_codec_class
from localmoe.kv.spec import KVSpec

__all__ = ["PagedKVCache"]


def _make_codec(cls: type, fmt: KVFormat, n_kv_heads: int, head_dim: int, kv_spec: KVSpec,
                role: str, max_seqs: int, block_size: int = 16) -> KVCodec:
    """Instantiate a codec, passing ``role``/``max_seqs``/``block_size`` to codecs that take
    them (the quantized ones: key grouping and rotation, per-sequence sink/window buffers,
    per-page channel scales)."""
    try:
        return cls(fmt, n_kv_heads, head_dim, kv_spec, role=role, max_seqs=max_seqs,
                   block_size=block_size)
    except TypeError:
        return cls(fmt, n_kv_heads, head_dim, kv_spec)


def _takes_start(method: Any) -> bool:
    """Whether a codec's ``write``/``read`` accepts the ``start`` keyword (codecs registered
    from outside may predate it)."""
    try:
        return "start" in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


class PagedKVCache:
    """Paged K/V storage for all layers of a model and several sequences.

    Args:
        spec: ModelSpec (n_layers, n_kv_heads, head_dim, v_head_dim used).
        kv_spec: storage formats.
        n_ctx: maximum tokens per sequence.
        max_seqs: sequences that may be live at once (the block pool holds
            ``max_seqs * ceil(n_ctx / block_size)`` blocks unless ``n_blocks`` is given).
        block_size: tokens per block.
        device: torch device of the storage.

    Raises:
        KVCacheFormatError: a format has no codec.
    """

    def __init__(self, spec: Any, kv_spec: KVSpec, n_ctx: int, max_seqs: int = 1,
                 block_size: int = 16, device: Any = "cpu", n_blocks: int | None = None):
        self.spec = spec
        self.kv_spec = kv_spec
        self.n_ctx = int(n_ctx)
        self.max_seqs = int(max_seqs)
        self.block_size = int(block_size)
        self.device = torch.device(device)
        self.blocks_per_seq = math.ceil(self.n_ctx / self.block_size)
        self.n_blocks = int(n_blocks or self.max_seqs * self.blocks_per_seq)
        n_slots = self.n_blocks * self.block_size
        kcls = get_codec_class(kv_spec.k.name)
        vcls = get_codec_class(kv_spec.v.name)
        # sinks/window beyond the context hold every token anyway: size the side buffers to it
        cspec = dataclasses.replace(kv_spec, sink_tokens=min(kv_spec.sink_tokens, self.n_ctx),
                                    window=min(kv_spec.window, self.n_ctx))
        self.k_codec = _make_codec(kcls, kv_spec.k, spec.n_kv_heads, spec.head_dim, cspec,
                                   "k", self.max_seqs, self.block_size)
        self.v_codec = _make_codec(vcls, kv_spec.v, spec.n_kv_heads, spec.v_head_dim, cspec,
                                   "v", self.max_seqs, self.block_size)
        # codecs that take ``start`` get it, so the decode path needs no host-device sync
        self._start_kw = {side: (_takes_start(c.write), _takes_start(c.read))
                          for side, c in (("k", self.k_codec), ("v", self.v_codec))}
        self.k_stores = [self.k_codec.alloc(n_slots, self.device) for _ in range(spec.n_layers)]
        self.v_stores = [self.v_codec.alloc(n_slots, self.device) for _ in range(spec.n_layers)]
        self._free_blocks = list(range(self.n_blocks - 1, -1, -1))
        self._tables: dict[int, list[int]] = {}
        self._versions: dict[int, int] = {}      # seq id -> changes of its block table
        self._lens: dict[int, int] = {}
        self._rows: dict[int, int] = {}          # seq id -> row of the per-sequence side buffers
        self._free_rows = list(range(self.max_seqs - 1, -1, -1))
        self._next_id = 0

    # --- sequence bookkeeping -------------------------------------------------------------
    def new_seq(self) -> int:
        """Start an empty sequence and return its id.

        Raises:
            LocalMoEError: ``max_seqs`` sequences are already live.
        """
        if len(self._tables) >= self.max_seqs:
            raise LocalMoEError(
                f"the KV cache holds at most {self.max_seqs} concurrent sequences; "
                "free one or create the runner with a larger max_seqs")
        sid = self._next_id
        self._next_id += 1
        self._tables[sid] = []
        self._versions[sid] = 0
        self._lens[sid] = 0
        row = self._free_rows.pop()
        self._rows[sid] = row
        for codec, stores in ((self.k_codec, self.k_stores), (self.v_codec, self.v_stores)):
            if hasattr(codec, "reset_row"):
                for st in stores:
                    codec.reset_row(st, row)
        return sid

    def seq_row(self, seq_id: int) -> int:
        """Row (0 .. max_seqs-1) of a live sequence in the per-sequence sink/window buffers."""
        self._check(seq_id)
        return self._rows[seq_id]

    def _check(self, seq_id: int) -> None:
        if seq_id not in self._tables:
            raise LocalMoEError(f"unknown KV cache sequence id {seq_id}")

    def free_seq(self, seq_id: int) -> None:
        """Release a sequence's blocks (unknown ids are ignored)."""
        blocks = self._tables.pop(seq_id, None)
        self._versions.pop(seq_id, None)
        self._lens.pop(seq_id, None)
        row = self._rows.pop(seq_id, None)
        if row is not None:
            self._free_rows.append(row)
        if blocks:
            self._free_blocks.extend(reversed(blocks))

    def seq_len(self, seq_id: int) -> int:
        """Committed tokens of a sequence."""
        self._check(seq_id)
        return self._lens[seq_id]

    def truncate(self, seq_id: int, n: int) -> None:
        """Keep the first ``n`` committed tokens; blocks past them go back to the pool.

        Codecs need no notice: side-buffer entries are tagged with their positions, and a
        per-channel key page cut in the middle keeps its codes and scales until a later write
        completes it again (its tokens before ``n`` are then re-quantized from the ring or from
        those codes)."""
        self._check(seq_id)
        n = max(0, min(int(n), self._lens[seq_id]))
        self._lens[seq_id] = n
        keep = math.ceil(n / self.block_size)
        table = self._tables[seq_id]
        if len(table) > keep:
            self._versions[seq_id] += 1
        while len(table) > keep:
            self._free_blocks.append(table.pop())

    def reserve(self, seq_id: int, n_new: int) -> None:
        """Make room for ``n_new`` more tokens.

        Raises:
            ContextOverflowError: the sequence would exceed ``n_ctx``.
            LocalMoEError: the shared block pool is exhausted.
        """
        self._check(seq_id)
        total = self._lens[seq_id] + int(n_new)
        if total > self.n_ctx:
            raise ContextOverflowError(total, self.n_ctx)
        table = self._tables[seq_id]
        need = math.ceil(total / self.block_size) - len(table)
        if need > len(self._free_blocks):
            raise LocalMoEError("the KV cache block pool is exhausted; lower the number of "
                                "concurrent sequences or the context size")
        if need > 0:
            self._versions[seq_id] += 1
        for _ in range(need):
            table.append(self._free_blocks.pop())

    def commit(self, seq_id: int, n_new: int) -> None:
        """Count ``n_new`` written tokens as part of the sequence (after all layers wrote)."""
        self._check(seq_id)
        self._lens[seq_id] += int(n_new)

    # --- data -----------------------------------------------------------------------------
    def _memo(self) -> dict:
        """Small cache of index tensors built from the block tables (every layer of a forward
        step asks for the same ones); entries are checked against the table before reuse."""
        m = self.__dict__.get("_index_memo")
        if m is None or len(m) > 256:
            m = self.__dict__["_index_memo"] = {}
        return m

    def block_table(self, seq_id: int) -> torch.Tensor:
        """Physical block ids of a sequence, IntTensor[n_blocks_used] on the cache device
        (shared between calls while the table is unchanged: do not modify it)."""
        self._check(seq_id)
        table = tuple(self._tables[seq_id])
        memo = self._memo()
        hit = memo.get(("bt", seq_id))
        if hit is not None and hit[0] == table:
            return hit[1]
        out = torch.tensor(table, dtype=torch.int32, device=self.device)
        memo[("bt", seq_id)] = (table, out)
        return out

    def host_block_table(self, seq_id: int) -> list[int]:
        """Physical block ids of a sequence as the host's Python list (do not modify it)."""
        self._check(seq_id)
        return self._tables[seq_id]

    def table_version(self, seq_id: int) -> int:
        """A number that changes whenever the sequence's block table does (blocks added or
        released): a copy of the table made at one version is still exact while the version
        is the same. Sequence ids are never reused."""
        self._check(seq_id)
        return self._versions[seq_id]

    def slots(self, seq_id: int, start: int, end: int) -> torch.Tensor:
        """Slot indices (LongTensor[end-start], cache device) of positions [start, end)
        (shared between calls while the blocks holding them are unchanged: do not modify it).
        When the blocks holding the range are physically consecutive (always for a range inside
        one block, e.g. a decode token) the tensor is made on the device with ``arange``, so no
        host-to-device copy (and no stream sync) is needed.

        Raises:
            LocalMoEError: ``end`` beyond the reserved blocks.
        """
        self._check(seq_id)
        table = self._tables[seq_id]
        bs = self.block_size
        if end > len(table) * bs:
            raise LocalMoEError("KV cache positions beyond the reserved blocks; call reserve()")
        span = tuple(table[start // bs:-(-end // bs)]) if end > start else ()
        memo = self._memo()
        hit = memo.get((seq_id, start, end))
        if hit is not None and hit[0] == span:
            return hit[1]
        if span and all(b - a == 1 for a, b in zip(span, span[1:])):
            first = span[0] * bs + start % bs
            out = torch.arange(first, first + end - start, device=self.device)
        else:
            pos = torch.arange(start, end)
            blocks = torch.tensor(table, dtype=torch.long)[pos // bs]
            out = (blocks * bs + pos % bs).to(self.device)
        memo[(seq_id, start, end)] = (span, out)
        return out

    def write(self, layer: int, seq_id: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K[T, n_kv_heads, head_dim] and V[T, n_kv_heads, v_head_dim] at positions
        ``start .. start+T-1`` of ``layer`` (space must be reserved first).

        ``start`` (a Python int) is passed on to the codecs, which therefore never read the
        position tensor back to the host: a one-token decode write issues no host-device sync
        (the slot tensor is built from the Python block table)."""
        start = int(start)
        t = k.shape[0]
        slots = self.slots(seq_id, start, start + t)
        pos = torch.arange(start, start + t, device=self.device)
        row = self._rows[seq_id]
        for side, codec, store, x in (("k", self.k_codec, self.k_stores[layer], k),
                                      ("v", self.v_codec, self.v_stores[layer], v)):
            kw = {"start": start} if self._start_kw[side][0] else {}
            codec.write(store, slots, x, pos, seq_row=row, **kw)

    def read(self, layer: int, seq_id: int, end: int, start: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K[L, n_kv_heads, head_dim], V[L, n_kv_heads, v_head_dim] (float32) of
        positions [start, end) — the reference path; fused kernels read the stores directly."""
        start = int(start)
        slots = self.slots(seq_id, start, end)
        pos = torch.arange(start, end, device=self.device)
        row = self._rows[seq_id]
        out = []
        for side, codec, store in (("k", self.k_codec, self.k_stores[layer]),
                                   ("v", self.v_codec, self.v_stores[layer])):
            kw = {"start": start} if self._start_kw[side][1] else {}
            out.append(codec.read(store, slots, positions=pos, seq_row=row, **kw))
        return out[0], out[1]

    # --- accounting -----------------------------------------------------------------------
    def footprint(self) -> int:
        """Bytes allocated for K/V storage over all layers (sink/window buffers included)."""
        total = 0
        for store in self.k_stores + self.v_stores:
            for t in store.values():
                total += t.numel() * t.element_size()
        return total

    def used_bytes(self) -> int:
        """Bytes of K/V data held by live sequences' committed tokens (format-exact)."""
        per_tok = self.kv_spec.bytes_per_token(self.spec, self.block_size)
        return int(per_tok * sum(self._lens.values()))
