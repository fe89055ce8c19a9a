"""The triton runner's decode step as one CUDA graph (batch 1-8, each sequence adds one token).

A decode step of the quantized model is ~3,200 kernel launches (48 layers of Qwen3-30B-A3B);
launched one by one from Python they take ~110 ms of host time for ~3 ms of GPU work. Captured
once as a CUDA graph (``torch.cuda.CUDAGraph``) and replayed, the host only writes the step's
inputs and reads the logits.

Everything the step reads that changes between steps lives in static device buffers written
before each replay (one pinned host buffer, one non-blocking copy): token ids, positions, KV
slots, the block table (padded to the context's width), sequence lengths and side-buffer rows.
The kernels read lengths from the device, so one graph serves every length up to its bucket's
``max_len`` (the attention's split sizes are planned for the bucket); buckets are powers of two
from 256 up to ``n_ctx``, and one graph is captured per (batch size, bucket) on first use (the
first step of a bucket runs eagerly, warming up every kernel, then captures).

A capture that fails (driver, memory) logs one warning and the runner decodes eagerly from then
on (``stats()["cuda_graphs"]`` gives the reason); ``cuda_graphs=False`` or
``LOCALMOE_CUDA_GRAPHS=0`` turn graphs off.

With ``LOCALMOE_GRAPH_REFRESH=1`` a decode graph is captured again when the CUDA caching
allocator has reserved more device memory since its capture (:class:`Refresh`; off by
default, see below). Measured on the H200 (``benchmarks/results/graph_history_h200-2026-12-05-s25.json``, Qwen3-30B-A3B
file): after a 512-token prompt decoded past its end, a 4,096-token prompt and one more device
allocation, the context-0 graph captured first replays in 2.016-2.020 ms instead of
1.857-1.863; captured again it takes 1.846-1.850. ``cuGraphUpload`` and ``empty_cache`` do not
restore it. The cause is not known, and the allocator's growth is not its signal: measured
again (``benchmarks/results/graph_refresh_h200-2026-12-05-s26.json``), the re-captures after
the two prompts do happen, but the allocation that then slows the graph is served from the
allocator's cache (reserved memory unchanged) and the graph goes to 2.003-2.007 ms all the
same. So the re-capture is off by default, kept for that experiment.

Not decode graphs (prompts of a new sequence have :class:`PrefillGraphs`; the rest takes the
runner's eager path): prompts, ``all_logits``, KV formats with sink, window or outlier side
buffers, rotated or per-channel keys (their writes take host-side positions), and non-CUDA
devices.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger("localmoe.triton")

MAX_BATCH = 8
MIN_BUCKET = 256


class Refresh:
    """When to capture a decode graph again: the CUDA caching allocator has reserved more
    device memory than when the graph was captured (a prompt's eager run or a prefill graph
    mapped new segments, see the module's docstring).

    The allocator is read (``torch.cuda.memory_reserved``, a host-side query, no sync) at most
    every ``every`` decode steps, and at the next step after :meth:`soon` (the runner calls it
    after every prompt), not at every step. Graphs are captured again for at most ``limit``
    growths of the allocator over the object's life, so a workload whose memory keeps growing
    cannot keep re-capturing.

    Args:
        reserved: () -> bytes reserved by the allocator now.
        every: decode steps between reads of the allocator.
        limit: growths of the allocator that may lead to captures.
    """

    def __init__(self, reserved, every: int = 64, limit: int = 16):
        self.reserved = reserved
        self.every = every
        self.limit = limit
        #: graphs captured again so far
        self.count = 0
        #: times a read found more bytes reserved than any read before
        self.growths = 0
        self._wait = 0           # steps until the next read
        self._now = 0            # bytes at the last read
        self._high = None        # the most bytes any read found

    def soon(self) -> None:
        """Read the allocator at the next step (after a prompt, which may have grown it)."""
        self._wait = 0

    def _read(self) -> None:
        self._now = int(self.reserved())
        if self._high is None or self._now > self._high:
            if self._high is not None:
                self.growths += 1
                if self.growths == self.limit + 1:
                    log.info("the CUDA allocator grew %d times; decode graphs are not captured "
                             "again after this", self.limit)
            self._high = self._now

    def stamp(self) -> int:
        """Bytes reserved now (after a capture: the graph's stamp)."""
        self._read()
        return self._now

    def stale(self, stamp: int) -> bool:
        """Whether a graph captured when ``stamp`` bytes were reserved should be captured
        again before this step (counts it)."""
        self._wait -= 1
        if self._wait <= 0:
            self._wait = self.every
            self._read()
        if self._now <= stamp or self.growths > self.limit:
            return False
        self.count += 1
        return True


def graph_unavailable(runner) -> str | None:
    """Why ``runner``'s decode steps cannot be captured, or None."""
    if torch.device(runner.device).type != "cuda":
        return "not a CUDA device"
    return static_unavailable(runner)


def static_unavailable(runner) -> str | None:
    """Why ``runner``'s decode steps cannot run on static buffers (captured or not), or None."""
    from localmoe.kernels.launch_config import _has_extras

    if not runner._fused:
        return "the fused attention kernels do not cover this model"
    m = runner.model
    if m.experts is not None and type(m.moe).__name__ != "TritonMoE":
        return "the MoE layers read expert ids on the host (weights not quantized)"
    c = runner.cache
    if runner.fused is not None:        # its K/V append takes positions and rows on the device
        return None
    for codec in (c.k_codec, c.v_codec):
        if _has_extras(codec) or getattr(codec, "channel", False):
            return "KV side buffers (sinks, window, outliers, rotation or per-channel keys)"
    return None


def _capture(g, step, pool, what: str):
    """First use of ``g``: run ``step(g)`` eagerly (compiles and warms every kernel; this
    call's result), then record the same work into ``g.graph`` for the next calls. Returns
    ``(output, None)``, or ``(output, why)`` when the capture failed (driver, memory: logged,
    the caller goes on eagerly)."""
    out = step(g)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            g.out = step(g)
    except Exception as e:  # noqa: BLE001 -- any capture failure falls back to eager
        why = f"capture failed ({type(e).__name__}: {str(e)[:200]})"
        log.warning("CUDA graph %s; %s eagerly from now on", why, what)
        return out, why
    g.graph = graph
    return out, None


@dataclass
class _Graph:
    batch: int
    max_len: int
    staging: Any                     # pinned int64 [4*B + B*W] on the host (decode: a list of
                                     # two, written in turn)
    dev_staging: torch.Tensor        # the same on the device: tokens, positions, slots,
                                     # len | row << 32, block table rows
    out: torch.Tensor | None = None
    graph: Any = None
    replays: int = 0
    host: Any = None                 # numpy views of ``staging`` (cheap element writes)
    tables: list = field(default_factory=list)   # per buffer, per row: (seq id, table
                                                  # version) written there
    copied: list = field(default_factory=list)   # per buffer: CUDA event after its last copy
    turn: int = 0                    # the buffer the next step writes
    eager_runs: int = 0              # eager steps launched from Python (no graph)
    reserved: int = 0                # device bytes the allocator held after the capture
    tape: Any = None                 # the eager step's launch tape (backends.triton.tape)


class DecodeGraphs:
    """CUDA graphs of a :class:`~localmoe.backends.triton.runner.TritonRunner`'s decode step.

    Args:
        runner: the runner (its ``model``, ``cache``, ``n_ctx``, ``device``, ``fused``: the
            :class:`~localmoe.backends.triton.fused_step.FusedDecode` step or None).
        capture: record and replay graphs (False: the same step launched eagerly, e.g.
            ``--no-cuda-graph``).
    """

    def __init__(self, runner, capture: bool = True):
        self.runner = runner
        #: False: run the step eagerly on the same static buffers (no graph)
        self.capture = capture
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        c = runner.cache
        self.width = -(-runner.n_ctx // c.block_size)
        self.captures = 0
        self.replays = 0
        #: why a capture failed (then the runner drops its graphs and decodes eagerly), or None
        self.failed: str | None = None
        #: eager steps (no graph) replay a launch tape (backends.triton.tape) unless this says
        #: why not (``LOCALMOE_LAUNCH_TAPE=0``, or a step the tape could not record)
        self.tape_off: str | None = ("LOCALMOE_LAUNCH_TAPE=0"
                                     if os.environ.get("LOCALMOE_LAUNCH_TAPE", "1") == "0" else None)
        self.tapes = 0
        self.tape_replays = 0
        #: when a graph is captured again (None: never, the default;
        #: ``LOCALMOE_GRAPH_REFRESH=1`` turns it on)
        self.refresh: Refresh | None = None
        if capture and os.environ.get("LOCALMOE_GRAPH_REFRESH", "0") == "1":
            dev = torch.device(runner.device)
            self.refresh = Refresh(lambda: torch.cuda.memory_reserved(dev))

    @property
    def refreshes(self) -> int:
        """Decode graphs captured again because the allocator grew (:class:`Refresh`)."""
        return self.refresh.count if self.refresh is not None else 0

    def bucket(self, max_len: int) -> int:
        b = MIN_BUCKET
        while b < max_len:
            b *= 2
        return min(b, max(self.runner.n_ctx, MIN_BUCKET))

    def _new(self, batch: int, max_len: int) -> _Graph:
        dev = torch.device(self.runner.device)
        w = self.width
        n = 4 * batch + batch * w
        cuda = dev.type == "cuda"
        staging = [torch.zeros(n, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        return _Graph(batch, max_len, staging=staging,
                      dev_staging=torch.zeros(n, dtype=torch.int64, device=dev),
                      host=[t.numpy() for t in staging], tables=[[None] * batch, [None] * batch],
                      copied=[None, None])

    def _fill(self, g: _Graph, batch: list[tuple[int, list[int]]],
              tokens_on_device: torch.Tensor | None = None) -> None:
        """Write the step's inputs into a pinned buffer (through its numpy view: a torch
        element write costs microseconds) and copy them to the device. A block-table row is
        written only when its sequence or that sequence's table changed since the row was
        last written to that buffer (every ``block_size`` tokens, not every step: at 16k
        tokens the row is 1,024 entries).

        Two pinned buffers take turns: the host may fill the next step's while the copy of
        this one is still queued behind GPU work (a step launched before the previous token
        was read, see ``tokens_on_device``); a buffer is rewritten only after the event
        recorded after its last copy.

        ``tokens_on_device``: int64 ``[B]`` device tensor of the new tokens (the ids in
        ``batch`` are then ignored): copied over the staged ones on the device, in stream
        order, so nothing waits for it."""
        c = self.runner.cache
        bs, b, w = c.block_size, g.batch, self.width
        k = g.turn
        g.turn ^= 1
        if g.copied[k] is not None:
            g.copied[k].synchronize()
        s, tables = g.host[k], g.tables[k]
        for i, (sid, toks) in enumerate(batch):
            pos = c.seq_len(sid)
            table = c.host_block_table(sid)
            s[i] = int(toks[0])
            s[b + i] = pos
            s[2 * b + i] = table[pos // bs] * bs + pos % bs
            s[3 * b + i] = (pos + 1) | (c.seq_row(sid) << 32)
            ver = (sid, c.table_version(sid))
            if tables[i] != ver:
                row = s[4 * b + i * w: 4 * b + (i + 1) * w]
                row[len(table):] = 0
                row[:len(table)] = table
                tables[i] = ver
        cuda = g.dev_staging.is_cuda
        g.dev_staging.copy_(g.staging[k], non_blocking=cuda)
        if cuda:
            if g.copied[k] is None:
                g.copied[k] = torch.cuda.Event()
            g.copied[k].record()
        if tokens_on_device is not None:
            g.dev_staging[:b].copy_(tokens_on_device.reshape(-1)[:b])

    def _step(self, g: _Graph) -> torch.Tensor:
        """The decode step on the static buffers (what the graph records)."""
        from localmoe.kernels.decode_attention import decode_attention
        from localmoe.kernels.kv_quant_append import kv_quant_append

        r = self.runner
        m, c = r.model, r.cache
        b, d = g.batch, g.dev_staging
        tokens, positions, slots = d[0:b], d[b:2 * b], d[2 * b:3 * b]
        lens = (d[3 * b:4 * b] & 0xFFFFFFFF).to(torch.int32)
        rows = (d[3 * b:4 * b] >> 32).to(torch.int32)
        block_table = d[4 * b:].view(b, self.width).to(torch.int32)

        def attn(layer, q, k, v):
            for codec, store, x in ((c.k_codec, c.k_stores[layer], k),
                                    (c.v_codec, c.v_stores[layer], v)):
                if hasattr(codec, "quantize_rows"):
                    kv_quant_append(codec, store, slots, x, positions, None)
                else:
                    codec.write(store, slots, x, positions)
            out = decode_attention(
                q, c.k_codec, c.k_stores[layer], c.v_codec, c.v_stores[layer], block_table,
                lens, page_size=c.block_size, sm_scale=m.scale, seq_rows=rows,
                sliding_window=m.layer_window(layer) or 0, max_len=g.max_len)
            return out.to(q.dtype)

        if r.fused is not None:
            return r.fused.step(tokens, positions, slots, lens, rows, block_table, g.max_len)
        hidden = m.forward_hidden(tokens, positions, attn)
        return m.logits(hidden)

    def run(self, batch: list[tuple[int, list[int]]],
            tokens_on_device: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, vocab]`` float32 on the device of one decode step (inputs checked and
        KV space reserved by the caller; the caller commits the tokens). ``tokens_on_device``:
        see :meth:`_fill`."""
        c = self.runner.cache
        max_len = max(c.seq_len(sid) + 1 for sid, _ in batch)
        key = (len(batch), self.bucket(max_len))
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = self._new(*key)
        self._fill(g, batch, tokens_on_device)
        if not self.capture:       # eager: the same static-buffer step, launched op by op
            return self._eager(g)
        if g.graph is not None and self.refresh is not None and self.refresh.stale(g.reserved):
            log.info("decode graph (batch %d, up to %d tokens): the allocator grew since its "
                     "capture, capturing it again", g.batch, g.max_len)
            g.graph = g.out = None       # frees its memory in the pool for the new capture
        if g.graph is None:
            out, self.failed = _capture(g, self._step, self.pool, "decoding")
            if self.failed:
                self.graphs.pop(key, None)
            else:
                self.captures += 1
                if self.refresh is not None:
                    g.reserved = self.refresh.stamp()
            return out
        g.graph.replay()
        g.replays += 1
        self.replays += 1
        return g.out

    def _eager(self, g: _Graph) -> torch.Tensor:
        """The step without a graph: launched from Python the first time (warming up every
        kernel, as before a capture), recorded into a launch tape the second time, replayed
        from the tape after that (:mod:`localmoe.backends.triton.tape`)."""
        t = g.tape
        if t is not None and t.usable():
            self.tape_replays += 1
            return t.replay()
        g.eager_runs += 1
        if self.tape_off is not None or g.eager_runs < 2:
            return self._step(g)
        from localmoe.backends.triton.tape import record

        out, g.tape, why = record(lambda: self._step(g))
        if why is not None:
            self.tape_off = f"not recorded: {why}"
            log.info("eager decode steps launch from Python: %s", why)
        else:
            self.tapes += 1
            log.info("eager decode step (batch %d, up to %d tokens) recorded: %d Triton launches, "
                     "%d PyTorch operators", g.batch, g.max_len, g.tape.n_triton, g.tape.n_torch)
        return out


#: prompts of a new sequence up to this many tokens prefill through a graph
MAX_PREFILL = 4096
MIN_PREFILL_BUCKET = 64


def prefill_unavailable(runner) -> str | None:
    """Why a new sequence's prompt cannot prefill through :class:`PrefillGraphs`, or None."""
    if runner.fused is None:
        return "no fused step"
    m = runner.model
    if any(m.layer_window(i) for i in range(m.spec.n_layers)):
        return "sliding-window layers"
    return None


class PrefillGraphs:
    """CUDA graphs of the prompt of a new sequence (position 0 on), one per length bucket
    (powers of two from 64 to :data:`MAX_PREFILL`, at most ``n_ctx``): the prompt is padded to
    its bucket and run through :meth:`~localmoe.backends.triton.fused_step.FusedDecode.prefill`.
    A 512-token prefill launches ~3,000 kernels eagerly (the host, not the GPU, bounds it); a
    replay costs the GPU work alone. Captured on first use of a bucket (an eager run first, then
    the capture, logged); a failed capture logs one warning and prompts go back to the eager
    path.

    Args:
        runner: the runner (its fused step, cache, ``n_ctx``).
        pool: the CUDA graph memory pool to share (the decode graphs').
    """

    def __init__(self, runner, pool=None):
        self.runner = runner
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.graphs: dict[int, _Graph] = {}
        self.max_tokens = min(MAX_PREFILL, runner.n_ctx)
        self.captures = 0
        self.replays = 0
        self.failed: str | None = None

    def usable(self, batch: list[tuple[int, list[int]]]) -> bool:
        """One sequence, empty so far, whose prompt fits a bucket."""
        if len(batch) != 1 or self.failed:
            return False
        sid, toks = batch[0]
        return (self.runner.cache.seq_len(sid) == 0 and 1 < len(toks)
                and self.bucket(len(toks)) <= self.max_tokens)

    @staticmethod
    def bucket(n: int) -> int:
        b = MIN_PREFILL_BUCKET
        while b < n:
            b *= 2
        return b

    def _step(self, g: _Graph) -> torch.Tensor:
        d, p = g.dev_staging, g.batch
        return self.runner.fused.prefill(d[:p], d[p:2 * p], d[2 * p:3 * p], d[3 * p:3 * p + 1])

    def run(self, sid: int, toks: list[int]) -> torch.Tensor:
        """Logits ``[1, vocab]`` float32 (device) after ``toks``, the first tokens of ``sid``
        (checked and reserved by the caller; the caller commits them). A quantized KV cache is
        written after the replay, from the graph's K/V of the ``len(toks)`` real tokens
        (:meth:`~localmoe.backends.triton.fused_step.FusedDecode.prefill`)."""
        c = self.runner.cache
        n = len(toks)
        p = self.bucket(n)
        c.reserve(sid, p)               # the padding's slots: overwritten by later tokens
        g = self.graphs.get(p)
        if g is None:
            dev = torch.device(self.runner.device)
            staging = torch.zeros(3 * p + 1, dtype=torch.int64, pin_memory=dev.type == "cuda")
            g = self.graphs[p] = _Graph(p, p, staging, torch.zeros_like(staging, device=dev))
        s = g.staging
        s[:n] = torch.tensor(toks, dtype=torch.int64)
        s[n:p] = int(toks[-1])
        s[p:2 * p] = torch.arange(p)
        table = torch.tensor(c.host_block_table(sid), dtype=torch.int64)
        pos = torch.arange(p)
        s[2 * p:3 * p] = table[pos // c.block_size] * c.block_size + pos % c.block_size
        s[3 * p] = n - 1
        g.dev_staging.copy_(s, non_blocking=True)
        if g.graph is None:
            t = time.perf_counter()
            out, self.failed = _capture(g, self._step, self.pool, "prefilling")
            if self.failed:
                self.graphs.pop(p, None)
            else:
                self.captures += 1
                log.info("captured the %d-token prefill graph in %.2f s", p,
                         time.perf_counter() - t)
        else:
            g.graph.replay()
            g.replays += 1
            self.replays += 1
            out = g.out
        logits, pending = out
        self.runner.write_prompt_kv(sid, n, pending)   # a quantized cache's K/V, exact length
        return logits
