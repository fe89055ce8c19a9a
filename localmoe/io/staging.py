"""Host-to-device copies of file bytes through a small ring of reusable pinned buffers.

A copy from pageable memory (a memory-mapped GGUF file) to a CUDA device is synchronous: the
driver stages it through its own pinned buffer and, for host-to-device copies, first waits for
the stream to drain, so the GPU work queued behind one chunk (its repack) cannot overlap the
next chunk's read. :class:`PinnedStager` has ``n_workers`` threads copy the coming pieces into
``n_buffers`` page-locked buffers (plain memcpy from the page cache, by numpy, which drops the
GIL) while the caller queues an asynchronous device copy of the current one and its work on
the device; a buffer is refilled once its device copy has finished (a CUDA event). Peak host
memory beyond the page cache stays ``n_buffers * buffer_bytes``.

The workers are threads, not OpenMP: torch's parallel CPU copy waits at a barrier for all its
threads at every call, and on a machine whose cores are busy (a compiler beside the load, in
session 20's measurement on the H200 host) one piece of a few MB then took milliseconds, the
load 3.5x longer than with no staging at all.

On a device other than CUDA (the CPU, for the Triton interpreter's tests) the buffers are plain
memory and the device copies synchronous; the bookkeeping is the same.
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Iterator

import numpy as np
import torch

log = logging.getLogger(__name__)

#: default size of one staging buffer (bytes); a larger source is copied in pieces
BUFFER_BYTES = 32 << 20


class PinnedStager:
    """A ring of ``n_buffers`` host buffers of ``buffer_bytes`` each, filled by ``n_workers``
    threads, for copies of host tensors to ``device``.

    Args:
        device: the destination (a CUDA device; anything else copies synchronously).
        buffer_bytes: bytes per buffer (>= 1).
        n_buffers: buffers in the ring (>= 1): how many pieces may be read ahead of the one the
            caller is using.
        n_workers: threads copying pieces into buffers (>= 1).
    Raises:
        ValueError: an argument below 1.

    The buffers are allocated on the first copy. If page-locked memory cannot be had (a memlock
    limit), the stager logs it once and falls back to plain copies (:attr:`fallback` says
    why). :attr:`bytes_staged` counts the bytes that went through the buffers. Call
    :meth:`close` (or use it as a context manager) to wait for the copies in flight and free
    the buffers and threads.
    """

    def __init__(self, device: str | torch.device, buffer_bytes: int = BUFFER_BYTES,
                 n_buffers: int = 4, n_workers: int = 2):
        if min(buffer_bytes, n_buffers, n_workers) < 1:
            raise ValueError(f"PinnedStager needs buffer_bytes, n_buffers and n_workers >= 1, got "
                             f"{buffer_bytes}, {n_buffers} and {n_workers}")
        self.device = torch.device(device)
        self.buffer_bytes = int(buffer_bytes)
        self.n_buffers = int(n_buffers)
        self.n_workers = int(n_workers)
        self.cuda = self.device.type == "cuda"
        self._bufs: list[torch.Tensor] | None = None
        self._views: list[np.ndarray] = []
        self._events: list = []
        self._pool: ThreadPoolExecutor | None = None
        self._next = 0
        self.bytes_staged = 0
        self.fallback: str | None = None

    def _alloc(self) -> bool:
        if self._bufs is not None:
            return True
        if self.fallback is not None:
            return False
        try:
            self._bufs = [torch.empty(self.buffer_bytes, dtype=torch.uint8, pin_memory=self.cuda)
                          for _ in range(self.n_buffers)]
        except RuntimeError as e:          # memlock limit, no CUDA driver: plain copies
            self.fallback = f"no page-locked staging buffers ({str(e).splitlines()[0]})"
            log.info("loading without pinned staging: %s", self.fallback)
            return False
        self._views = [b.numpy() for b in self._bufs]
        self._events = [None] * self.n_buffers
        self._pool = ThreadPoolExecutor(self.n_workers, thread_name_prefix="localmoe-stage")
        return True

    @staticmethod
    def _bytes(src: torch.Tensor) -> torch.Tensor:
        flat = src.reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat

    def _fill(self, i: int, piece: np.ndarray, ev) -> None:
        if ev is not None:
            ev.synchronize()               # buffer i's previous device copy has left it
        np.copyto(self._views[i][:piece.size], piece)

    def iter_to_device(self, srcs: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
        """Device copies of the host tensors ``srcs``, in order (same dtype and shape each).

        The pieces after the one just returned are read into the free buffers meanwhile, so
        the caller's work on a returned tensor overlaps the next reads. A returned tensor's
        copy may still be in flight on the current CUDA stream (work queued after it there sees
        the data). ``srcs`` must stay readable until the iterator is exhausted.
        """
        srcs = list(srcs)
        if not self._alloc():
            for s in srcs:
                yield s.to(self.device)
            return
        raws = [self._bytes(s) for s in srcs]
        # each output is allocated at its first piece and dropped here once yielded, so the
        # device holds only the outputs the caller keeps (a tensor's chunks one at a time)
        outs: list[torch.Tensor | None] = [None] * len(raws)
        pieces = [(j, a, min(r.numel(), a + self.buffer_bytes))
                  for j, r in enumerate(raws) for a in range(0, r.numel(), self.buffer_bytes)]
        arrays = [r.numpy() for r in raws]
        pending: deque = deque()
        pos = 0

        def submit() -> None:
            nonlocal pos
            j, a, b = pieces[pos]
            i = self._next
            self._next = (i + 1) % self.n_buffers
            pending.append((i, self._pool.submit(self._fill, i, arrays[j][a:b], self._events[i])))
            self._events[i] = None
            pos += 1

        done_upto = -1
        try:
            for j, a, b in pieces:
                while pos < len(pieces) and len(pending) < self.n_buffers:
                    submit()
                i, fut = pending.popleft()
                fut.result()
                if outs[j] is None:
                    outs[j] = torch.empty(raws[j].numel(), dtype=torch.uint8, device=self.device)
                outs[j][a:b].copy_(self._bufs[i][:b - a], non_blocking=self.cuda)
                if self.cuda:
                    ev = torch.cuda.Event()
                    ev.record(torch.cuda.current_stream(self.device))
                    self._events[i] = ev
                self.bytes_staged += b - a
                if b == raws[j].numel():   # tensor j complete (its pieces come in order)
                    for jj in range(done_upto + 1, j + 1):
                        yield self._take(outs, jj, srcs[jj])
                    done_upto = j
            for jj in range(done_upto + 1, len(srcs)):      # empty tensors at the end
                yield self._take(outs, jj, srcs[jj])
        finally:
            for _, fut in pending:         # abandoned early: no fill may outlive its turn
                fut.exception()

    def _take(self, outs: list, j: int, src: torch.Tensor) -> torch.Tensor:
        out = outs[j]
        outs[j] = None
        if out is None:                    # an empty source
            out = torch.empty(0, dtype=torch.uint8, device=self.device)
        return out.view(src.dtype).reshape(src.shape)

    def to_device(self, src: torch.Tensor) -> torch.Tensor:
        """A copy of the host tensor ``src`` on :attr:`device` (see :meth:`iter_to_device`)."""
        return next(iter(self.iter_to_device([src])))

    def close(self) -> None:
        """Wait for the copies in flight, free the buffers and stop the threads (the stager
        can be used again)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for ev in self._events:
            if ev is not None:
                ev.synchronize()
        self._events = []
        self._views = []
        self._bufs = None
        self._next = 0

    def __enter__(self) -> "PinnedStager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
