"""Reference pieces the PyTorch-based runners compose: a shared transformer with its paged KV
cache, the ragged-batch forward step over them, and the reference attention over the cache.

* :func:`load_paged_model`: the :class:`~localmoe.model.transformer.Transformer` (weights
  dequantized once at load, or GGUF blocks kept packed on the CPU) and a
  :class:`~localmoe.kv.cache.PagedKVCache` whose format comes from the KVSpec.
* :func:`run_batch`: one ``forward`` of a runner -- checks, KV reservation, the model's blocks
  with the runner's attention hook, commit, logits.
* :class:`PagedAttention`: write each sequence's new K/V into the cache, read the dequantized
  K/V back (``cache.read``) and run :func:`localmoe.model.ops.attention` (the reference path).
* :class:`CacheSequences`: the Runner contract's sequence calls on ``self.cache``.

:mod:`localmoe.backends.torch_backend` (the reference runner) is these pieces and nothing else;
:mod:`localmoe.backends.triton` adds fused kernels beside them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch

from localmoe.errors import ContextOverflowError, InvalidRequestError, LocalMoEError


@dataclass
class SeqSlice:
    """One sequence of a ragged batch: its id, first cached position, and rows ``[lo, hi)`` of
    the flattened token dimension."""

    seq_id: int
    start: int
    lo: int
    hi: int

    @property
    def n(self) -> int:
        return self.hi - self.lo


#: attention of a whole ragged batch for one layer:
#: ``(layer, q [N,H,D], k [N,Hkv,D], v [N,Hkv,Dv], seqs) -> [N,H,Dv]``
BatchAttnFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, "list[SeqSlice]"],
                       torch.Tensor]


class PagedModel(NamedTuple):
    """What :func:`load_paged_model` built: the model, its KV cache and the settings used."""

    model: Any          # localmoe.model.transformer.Transformer
    cache: Any          # localmoe.kv.cache.PagedKVCache
    dtype: torch.dtype
    n_ctx: int
    kv_spec: Any        # localmoe.kv.spec.KVSpec


def load_paged_model(model_file, device: torch.device, *, dtype: torch.dtype | None = None,
                     n_ctx: int | None = None, kv_spec: Any = None, max_seqs: int = 1,
                     block_size: int = 16, experts: Any = None, numerics: str = "exact",
                     packed_weights: bool | None = None,
                     model_loader: Callable[..., Any] | None = None) -> PagedModel:
    """Load ``model_file`` onto ``device`` and allocate its paged KV cache.

    ``dtype`` defaults to float32 and is float32 on the CPU whatever was asked (the CPU
    reference computes in fp32); ``n_ctx`` defaults to min(training context, 4096) tokens;
    ``kv_spec`` (a KVSpec or a string) to ``"f16"``. The block pool holds ``max_seqs``
    full-context sequences of ``block_size``-token blocks. ``model_loader(model_file, device,
    dtype)``, when given, builds the model instead (a backend's own weights, e.g. quantized on
    the GPU). Other arguments as :meth:`localmoe.model.transformer.Transformer.from_model_file`.

    Raises:
        ModelLoadError / UnsupportedModelError: the file cannot be run.
        KVCacheFormatError: unknown KV format.
        ValueError: unknown ``numerics``, ``packed_weights=True`` where it cannot apply.
    """
    from localmoe.kv.cache import PagedKVCache
    from localmoe.kv.spec import KVSpec
    from localmoe.model.transformer import Transformer

    dtype = dtype or torch.float32
    if device.type == "cpu":
        dtype = torch.float32
    if model_loader is not None:
        model = model_loader(model_file, device, dtype)
    else:
        model = Transformer.from_model_file(model_file, device=device, dtype=dtype,
                                            experts=experts, numerics=numerics,
                                            packed=packed_weights)
    spec = model.spec
    n_ctx = int(n_ctx or min(spec.n_ctx_train or 4096, 4096))
    kv_spec = KVSpec.parse(kv_spec if kv_spec is not None else "f16")
    cache = PagedKVCache(spec, kv_spec, n_ctx, int(max_seqs), block_size=block_size,
                         device=device)
    return PagedModel(model, cache, dtype, n_ctx, kv_spec)


def load_runner(runner, model_file, *, device: str, dtype: torch.dtype | None,
                n_threads: int | None, max_seqs: int = 1, **load_kw: Any) -> "PagedAttention":
    """The common start of every runner over the shared transformer.

    Loads ``model_file`` with :func:`load_paged_model` (``load_kw``: its ``n_ctx``, ``kv_spec``,
    ``block_size``, ``experts``, ``numerics``, ``packed_weights``, ``model_loader``) onto
    ``device`` and sets on
    ``runner``: ``model_file, device, model, cache, dtype, n_ctx, kv_spec, spec, max_seqs,
    n_threads, threads_reason, load_s`` (seconds) and ``tokens_processed``. CPU threads are
    checked before the load and set after it (:class:`localmoe.cpu.threads.RunnerThreads`).

    Returns:
        the reference :class:`PagedAttention` over the runner's cache.

    Raises:
        as :func:`load_paged_model`; InvalidRequestError for a bad ``n_threads``.
    """
    from localmoe.cpu.threads import RunnerThreads

    t0 = time.perf_counter()
    runner.model_file = model_file
    runner.device = str(device)
    dev = torch.device(runner.device)
    threads = RunnerThreads(n_threads, on_cpu=dev.type == "cpu")
    runner.model, runner.cache, runner.dtype, runner.n_ctx, runner.kv_spec = load_paged_model(
        model_file, dev, dtype=dtype, max_seqs=max_seqs, **load_kw)
    runner.spec = runner.model.spec
    runner.max_seqs = int(max_seqs)
    attn = PagedAttention(runner.model, runner.cache, runner.kv_spec)
    runner.n_threads, runner.threads_reason = threads.apply()
    runner.load_s = time.perf_counter() - t0
    runner.tokens_processed = 0
    return attn


def _validate(batch, vocab_size: int, cache) -> None:
    if not batch:
        raise InvalidRequestError("forward() needs at least one (seq_id, tokens) pair", "batch")
    seen = set()
    for sid, toks in batch:
        if sid in seen:
            raise InvalidRequestError(f"sequence {sid} appears twice in one batch", "batch")
        seen.add(sid)
        if len(toks) == 0:
            raise InvalidRequestError(f"sequence {sid} has no new tokens", "batch")
        bad = [t for t in toks if not (0 <= int(t) < vocab_size)]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", "tokens")
        cache.seq_len(sid)  # raises for unknown ids


def prepare_batch(model, cache, n_ctx: int, batch: list[tuple[int, list[int]]]) -> None:
    """Check a forward call's batch and reserve KV space for its new tokens (nothing is
    reserved when any sequence fails a check).

    Raises:
        ContextOverflowError, InvalidRequestError, LocalMoEError: as :func:`run_batch`.
    """
    _validate(batch, model.spec.vocab_size, cache)
    for sid, toks in batch:  # check every sequence before reserving anything
        if cache.seq_len(sid) + len(toks) > n_ctx:
            raise ContextOverflowError(cache.seq_len(sid) + len(toks), n_ctx)
    for sid, toks in batch:
        cache.reserve(sid, len(toks))


@torch.inference_mode()
def run_batch(model, cache, n_ctx: int, batch: list[tuple[int, list[int]]],
              attention_layer: BatchAttnFn, all_logits: bool = False
              ) -> tuple[list[torch.Tensor], int]:
    """Append each sequence's new tokens after its cached ones and return logits (the body of
    a runner's ``forward``).

    Args:
        model: the Transformer; cache: its PagedKVCache; n_ctx: tokens per sequence.
        batch: ``[(seq_id, token_ids), ...]`` (ragged: any lengths >= 1).
        attention_layer: the runner's attention of a whole batch for one layer (it writes the
            new K/V into ``cache`` and attends).
        all_logits: return logits of every new token instead of only the last.

    Returns:
        ``(logits, n_tokens)``: per sequence a float32 CPU tensor, ``[vocab]`` (last new token)
        or ``[T_i, vocab]``; and the number of new tokens in the batch.

    Raises:
        ContextOverflowError: ``seq_len + T_i > n_ctx`` (nothing is appended).
        InvalidRequestError: empty batch/sequence, token id outside the vocabulary.
        LocalMoEError: unknown sequence id, KV block pool exhausted.
    """
    prepare_batch(model, cache, n_ctx, batch)
    dev = model.device
    seqs, pos, ids = [], [], []
    lo = 0
    for sid, toks in batch:
        start = cache.seq_len(sid)
        seqs.append(SeqSlice(sid, start, lo, lo + len(toks)))
        lo += len(toks)
        ids.extend(int(t) for t in toks)
        pos.extend(range(start, start + len(toks)))
    tokens = torch.tensor(ids, dtype=torch.long, device=dev)
    positions = torch.tensor(pos, dtype=torch.long, device=dev)

    def attn(layer, q, k, v):
        return attention_layer(layer, q, k, v, seqs)

    hidden = model.forward_hidden(tokens, positions, attn)
    for s in seqs:
        cache.commit(s.seq_id, s.n)
    if all_logits:
        logits = model.logits(hidden).cpu()
        return [logits[s.lo:s.hi] for s in seqs], lo
    last = torch.tensor([s.hi - 1 for s in seqs], device=dev)
    logits = model.logits(hidden.index_select(0, last)).cpu()
    return [logits[i] for i in range(len(seqs))], lo


class PagedAttention:
    """The reference attention over a paged KV cache (one call per layer of a forward step).

    K/V are written through ``cache.write`` (the codecs) and read back dequantized with
    ``cache.read``; plain float K/V on the CPU are written and read as slices of the store when
    a sequence's slots are consecutive (same values, no per-layer slot gathers), and a CPU
    decode step of a packed-weights model runs the C attention kernel of
    :mod:`localmoe.cpu.qmatmul` (same function).

    Args:
        model: the Transformer (``layer_window``, ``scale``, ``packed``, ``numerics``, ``spec``).
        cache: its PagedKVCache.
        kv_spec: the cache's KVSpec.
    """

    def __init__(self, model, cache, kv_spec):
        from localmoe.kv.codec import FloatCodec

        self.model = model
        self.cache = cache
        self.kv_spec = kv_spec
        self._float_kv = (cache.device.type == "cpu" and type(cache.k_codec) is FloatCodec
                          and type(cache.v_codec) is FloatCodec)
        self._kv_range_memo: dict = {}

    def _float_kv_range(self, seq_id: int, start: int, end: int) -> int | None:
        """First slot of positions ``[start, end)`` when they sit in consecutive slots of a
        plain float K/V store on the CPU (a single sequence's blocks usually do), else None.
        Then K/V are read and written as slices of the store (same values as through the
        codec, without the per-layer slot gathers). Memoized per slot tensor (one per step)."""
        if not self._float_kv:
            return None
        slots = self.cache.slots(seq_id, start, end)
        hit = self._kv_range_memo.get((seq_id, start, end))
        if hit is not None and hit[0] is slots:
            return hit[1]
        n = end - start
        a = int(slots[0]) if n else 0
        ok = n > 0 and int(slots[-1]) - a == n - 1 and (n == 1 or bool((slots.diff() == 1).all()))
        if len(self._kv_range_memo) > 64:
            self._kv_range_memo.clear()
        self._kv_range_memo[(seq_id, start, end)] = (slots, a if ok else None)
        return a if ok else None

    def write_kv(self, layer: int, seq: SeqSlice, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one sequence's new K ``[T, Hkv, D]`` / V ``[T, Hkv, Dv]`` at its positions."""
        a = self._float_kv_range(seq.seq_id, seq.start, seq.start + k.shape[0])
        if a is not None:
            t = k.shape[0]
            self.cache.k_stores[layer]["data"][a:a + t].copy_(k)
            self.cache.v_stores[layer]["data"][a:a + t].copy_(v)
            return
        self.cache.write(layer, seq.seq_id, seq.start, k, v)

    def attend(self, layer: int, q: torch.Tensor, seq_id: int, start: int) -> torch.Tensor:
        """Attention of one sequence's new queries over its cached K/V (new tokens included).

        Args:
            layer: block index.
            q: ``[T, H, D]`` queries after RoPE, at positions ``start .. start+T-1``.
            seq_id: KV cache sequence.
            start: position of the first query (= cached tokens before this step).

        Returns:
            ``[T, H, Dv]`` attention output.
        """
        from localmoe.model.ops import attention

        model, cache = self.model, self.cache
        end = start + q.shape[0]
        window = model.layer_window(layer)
        k_start = max(0, start - window + 1) if window else 0
        a = self._float_kv_range(seq_id, k_start, end)
        if a is not None:
            n = end - k_start
            K = cache.k_stores[layer]["data"][a:a + n]
            V = cache.v_stores[layer]["data"][a:a + n]
            if (q.shape[0] == 1 and model.packed and not model.spec.attn_logit_softcap
                    and q.dtype == torch.float32 and q.is_contiguous()
                    and K.dtype in (torch.float32, torch.float16) and K.dtype == V.dtype):
                # decode with the packed-weights CPU kernels: one C call over exactly the keys
                # the query sees ([k_start, end) is the window), same function as below
                from localmoe.cpu.qmatmul import attention_decode

                try:
                    return attention_decode(q, K, V, model.scale)
                except ValueError:  # a layout the C kernel does not take: the torch path below
                    pass
        else:
            K, V = cache.read(layer, seq_id, end, start=k_start)
        return attention(q, K.to(q.dtype), V.to(q.dtype), q_start=start - k_start,
                         scale=model.scale, window=window,
                         softcap=model.spec.attn_logit_softcap,
                         ggml_f16=model.numerics == "ggml" and self.kv_spec.k.name == "f16")

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 seqs: list[SeqSlice]) -> torch.Tensor:
        """Attention of a whole ragged batch for one layer: writes each sequence's K/V, then
        attends. ``q [N, H, D]``, ``k [N, Hkv, D]``, ``v [N, Hkv, Dv]`` -> ``[N, H, Dv]``."""
        outs = []
        for s in seqs:
            self.write_kv(layer, s, k[s.lo:s.hi], v[s.lo:s.hi])
            outs.append(self.attend(layer, q[s.lo:s.hi], s.seq_id, s.start))
        return outs[0] if len(outs) == 1 else torch.cat(outs, 0)


class CacheSequences:
    """The Runner contract's sequence calls, on the runner's ``self.cache`` (PagedKVCache)."""

    cache: Any

    def new_sequence(self) -> int:
        """Start an empty sequence; returns its id. Raises LocalMoEError when max_seqs are live."""
        return self.cache.new_seq()

    def free_sequence(self, seq_id: int) -> None:
        """Release a sequence's KV blocks."""
        self.cache.free_seq(seq_id)

    def seq_len(self, seq_id: int) -> int:
        """Cached tokens of ``seq_id``."""
        return self.cache.seq_len(seq_id)

    def truncate(self, seq_id: int, n_tokens: int) -> None:
        """Keep the first ``n_tokens`` cached tokens (prefix reuse)."""
        self.cache.truncate(seq_id, n_tokens)


def runner_stats(runner) -> dict:
    """``{"device", "dtype", "kv_bytes", "kv_format", "load_s", "weights_bytes",
    "tokens_processed"}`` of a runner built from these pieces (``runner.model``, ``.cache``,
    ``.kv_spec``, ``.device``, ``.dtype``, ``.load_s``, ``.n_threads``/``.threads_reason``,
    ``.tokens_processed``), plus the thread count on the CPU and the expert provider's
    counters."""
    m = runner.model
    wbytes = sum(t.nbytes for L in m.layers for t in L.values())  # packed layers too
    for t in {id(x): x for x in (m.tok_embd, m.output, m.output_t) if x is not None}.values():
        wbytes += t.nbytes
    out = {"device": runner.device, "dtype": str(runner.dtype).replace("torch.", ""),
           "kv_bytes": runner.cache.footprint(), "kv_format": str(runner.kv_spec),
           "load_s": round(runner.load_s, 3), "weights_bytes": int(wbytes),
           "tokens_processed": runner.tokens_processed}
    if runner.n_threads is not None:
        out["n_threads"] = runner.n_threads
        out["threads_reason"] = runner.threads_reason
    if m.experts is not None:
        if hasattr(m.experts, "nbytes"):
            out["expert_bytes"] = int(m.experts.nbytes())
        out.update(m.experts.stats())
    return out


def torch_supports(model_format: str, kv_spec: Any = None) -> str | None:
    """Why a PyTorch-based backend cannot run ``model_format`` with ``kv_spec`` (unknown
    format or KV codec), or None (``Backend.supports``)."""
    if model_format not in ("gguf", "safetensors"):
        return f"unknown model format {model_format!r}"
    if kv_spec is not None:
        from localmoe.kv.registry import get_codec_class

        try:
            get_codec_class(kv_spec.k.name)
            get_codec_class(kv_spec.v.name)
        except LocalMoEError as e:
            return str(e)
    return None
