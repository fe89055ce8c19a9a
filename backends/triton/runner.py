"""The ``triton`` backend's runner: the shared transformer with quantized weights and fused
Triton kernels on CUDA.

The runner owns its pieces by composition (:mod:`localmoe.backends.reference`): the
transformer and its paged KV cache (``load_paged_model``), the batch step (``run_batch``) and
the reference attention (``PagedAttention``) for what the kernels do not cover. Its own parts:

* Weights (GGUF files): kept in their quantized blocks on the GPU
  (:func:`localmoe.backends.triton.quant_model.load_quant_model`): every matmul runs through
  the quantized GEMV (decode) or GEMM (prefill) kernels, the embedding is a row gather, and the
  MoE layers go through :class:`localmoe.backends.triton.moe.TritonMoE` (router + fused MoE
  kernels, no host sync); RMSNorm and RoPE are one launch each (:mod:`localmoe.kernels.rms_norm`,
  :mod:`localmoe.kernels.rope`). Files the kernels cannot read (safetensors, a quant type
  without a kernel, ``numerics="ggml"``, a custom expert provider, ``packed_weights=False``)
  are dequantized to the compute dtype as before; ``stats()["weights"]`` says which and why.

* K/V write: quantized formats are packed straight into the paged store by
  :func:`localmoe.kernels.kv_quant_append.kv_quant_append` (float formats are a plain copy;
  per-channel keys go through the codec's ``write``, torch ops on the GPU: a page is
  quantized once per ``block_size`` tokens).
* Decode (every sequence of the batch adds one token): one launch of
  :func:`localmoe.kernels.decode_attention.decode_attention` for the whole batch, reading the
  packed blocks and dequantizing in registers (split-K over the sequence).
* Prefill (a sequence adds several tokens): the K/V write above, then the reference attention
  -- K/V of the attended range dequantized by the codec (torch ops on the GPU) and fed to SDPA.

Unsupported cases take the reference path per call (non power-of-two head sizes, attention
logit softcapping, the ``ggml`` numerics mode).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from localmoe.backends.reference import (CacheSequences, PagedAttention, SeqSlice,
                                         load_paged_model, load_runner, prepare_batch, run_batch,
                                         runner_stats)

PROMPT_KV_ROWS = 32768
"""Tokens x layers of a prompt's per-channel keys quantized in one group by
:meth:`TritonRunner.write_prompt_kv` (float32 pages of Qwen3's 4 x 128 keys: 64 MiB)."""


class TritonRunner(CacheSequences):
    """A loaded model on CUDA whose KV write and decode attention are Triton kernels (the
    Runner contract of INTERFACES.md).

    Same arguments as :class:`localmoe.backends.torch_backend.TorchRunner` (``device``
    defaults to ``"cuda"`` and ``dtype`` to the family's ``gpu_dtype``: float16, bfloat16 for
    Gemma-3, whose activations overflow float16; ``packed_weights=False`` dequantizes the
    weights instead of keeping them quantized), plus ``cuda_graphs``: decode steps (1-8
    sequences adding one token each) replay CUDA graphs (:mod:`localmoe.backends.triton.graphs`)
    -- ``None`` (default): on where possible unless ``LOCALMOE_CUDA_GRAPHS=0``; and
    ``load_progress(bytes_done, bytes_total)``, called as quantized weights reach the GPU (the
    Engine turns it into its load progress); and ``act_precision``: the activations of the
    decode step's integer-dot kernels, ``"int8"`` (llama.cpp's q8_1 scheme, the fastest) or
    ``"int16"`` (an int8 residual per value on top: closer to the float reference, twice the
    ``dp4a``; :mod:`localmoe.kernels.quant_gemv`) or ``"mixed"`` (int16 except the routed
    experts' inputs, where the second dot costs the most), None: ``$LOCALMOE_ACT_PRECISION``
    or int8.

    Raises:
        ModelLoadError / UnsupportedModelError: the file cannot be run.
        KVCacheFormatError: unknown KV format.
        InvalidRequestError: an unknown ``act_precision`` (or ``$LOCALMOE_ACT_PRECISION``).
    """

    backend_name = "triton"
    #: activation precision of the integer-dot kernels, set by ``__init__`` (None: leave the
    #: precision in effect alone)
    act_precision: str | None = None

    def __init__(self, model_file, *, n_ctx: int | None = None, kv_spec: Any = None,
                 device: str | None = None, dtype: torch.dtype | None = None, max_seqs: int = 1,
                 block_size: int = 16, experts: Any = None, numerics: str = "exact",
                 packed_weights: bool | None = None, n_threads: int | None = None,
                 cuda_graphs: bool | None = None,
                 load_progress: Callable[[int, int], None] | None = None,
                 act_precision: str | None = None):
        from localmoe.backends.triton.quant_model import load_quant_model, quant_unavailable
        from localmoe.kernels.quant_gemv import act_precision as _default_precision
        from localmoe.kernels.quant_gemv import check_act_precision

        act_precision = (_default_precision() if act_precision is None
                         else check_act_precision(act_precision))
        #: activation precision of the integer-dot kernels ("int8" or "int16")
        self.act_precision = act_precision

        why = ("packed_weights=False" if packed_weights is False else
               "a custom expert provider" if experts is not None else
               quant_unavailable(model_file, numerics))
        if why and packed_weights:
            raise ValueError(f"quantized GPU weights requested but unavailable: {why}")
        loader = None if why else (lambda mf, dev, dt: load_quant_model(
            mf, device=dev, dtype=dt, progress=load_progress))
        #: the reference attention, for prefill and the cases the kernels do not cover
        self.ref = load_runner(self, model_file, device=device or "cuda",
                               dtype=dtype or default_gpu_dtype(model_file), n_threads=n_threads,
                               max_seqs=max_seqs, n_ctx=n_ctx, kv_spec=kv_spec,
                               block_size=block_size, experts=experts, numerics=numerics,
                               packed_weights=None, model_loader=loader)
        #: "quantized" (GGUF blocks on the GPU) or "<dtype> (<why not quantized>)"
        self.weights = "quantized" if loader else f"{str(self.dtype).replace('torch.', '')} ({why})"
        if loader and self.model.experts is not None:
            from localmoe.backends.triton.moe import TritonMoE

            self.model.moe = TritonMoE(self.model)
        if loader:       # one launch each instead of ~8 torch ops
            from localmoe.kernels.rms_norm import rms_norm
            from localmoe.kernels.rope import rope

            self.model.ops.norm, self.model.ops.rope = rms_norm, rope
        c = self.cache
        pow2 = all(d >= 16 and d & (d - 1) == 0 for d in (self.spec.head_dim, self.spec.v_head_dim))
        self._fused = (pow2 and not self.spec.attn_logit_softcap
                       and self.model.numerics != "ggml" and c.block_size & (c.block_size - 1) == 0)
        self.n_fused_calls = 0
        #: the fused decode step (localmoe.backends.triton.fused_step) or None, and why not
        self.fused, self.fused_off = None, None
        self._setup_fused()
        #: decode steps on static buffers (localmoe.backends.triton.graphs): replayed as CUDA
        #: graphs unless graphs_off says why not; None when the static step cannot run at all
        self.graphs, self.graphs_off = None, None
        self._setup_graphs(cuda_graphs)
        # per forward call: slots/positions of each sequence's new tokens and the decode
        # launch's block table, lengths and rows, built at the first layer and reused by the
        # others (one set of host-to-device copies per token instead of one per layer)
        self._step = 0
        self._memo_step = -1
        self._memo: dict = {}

    #: forward(..., on_device=True) may return logits on the GPU (for GPU sampling)
    supports_device_logits = True
    #: forward(..., tokens_on_device=ids) takes a decode step's tokens from a device tensor
    supports_device_tokens = True

    def forward(self, batch: list[tuple[int, list[int]]], all_logits: bool = False,
                on_device: bool = False, tokens_on_device: torch.Tensor | None = None
                ) -> list[torch.Tensor]:
        """Append each sequence's new tokens and return logits (as
        :meth:`localmoe.backends.torch_backend.TorchRunner.forward`); starts a new per-call memo
        of launch metadata. Runs with the runner's GPU as the current CUDA device: Triton
        launches on the current device, so a runner on ``cuda:1`` would otherwise launch its
        kernels on GPU 0.

        ``on_device=True``: decode steps return their float32 logits on the GPU (a copy, not
        the graph's buffer), so a GPU sampler reads them without moving ``[vocab]`` floats to
        the host; other steps return CPU tensors as usual.

        ``tokens_on_device``: int64 ``[len(batch)]`` tensor on the runner's device holding
        each sequence's one new token (the ids in ``batch`` are placeholders, e.g. ``[0]``):
        a decode step on the static buffers reads them on the device, so a caller can launch
        this step before reading the token its GPU sampler picked from the previous logits
        (:meth:`localmoe.engine.sampling.Sampler.launch`); other steps read them first.

        Raises:
            ContextOverflowError, InvalidRequestError, LocalMoEError: as the torch runner.
        """
        from localmoe.kernels.quant_gemv import use_act_precision

        self._step += 1
        dev = torch.device(self.device)
        with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext(), \
                use_act_precision(self.act_precision):
            return self._forward(batch, all_logits, on_device, tokens_on_device)

    def _setup_fused(self) -> None:
        import os

        from localmoe.backends.triton.fused_step import FusedDecode, unavailable

        why = ("LOCALMOE_FUSED_STEP=0" if os.environ.get("LOCALMOE_FUSED_STEP", "1") == "0"
               else unavailable(self))
        if why is None:
            try:
                self.fused = FusedDecode(self)
            except (ImportError, ValueError) as e:   # a kernel missing, a KV format it lacks
                why = f"{type(e).__name__}: {e}"
        self.fused_off = why

    def _setup_graphs(self, wanted: bool | None) -> None:
        import os

        from localmoe.backends.triton.graphs import DecodeGraphs, static_unavailable

        if wanted is None:
            wanted = os.environ.get("LOCALMOE_CUDA_GRAPHS", "1") != "0"
            why = None if wanted else "LOCALMOE_CUDA_GRAPHS=0"
        else:
            why = None if wanted else "cuda_graphs=False"
        static = static_unavailable(self)
        if torch.device(self.device).type != "cuda":
            why = why or "not a CUDA device"
        if static is None and (why is None or self.fused is not None):
            # no graphs (not wanted, or not CUDA): the fused step runs eagerly on the buffers
            self.graphs = DecodeGraphs(self, capture=why is None)
        self.graphs_off = why or static
        from localmoe.backends.triton.graphs import PrefillGraphs, prefill_unavailable

        self.prefill_graphs = None
        self.prefill_graphs_off = (why or static or prefill_unavailable(self)
                                   or ("LOCALMOE_PREFILL_GRAPHS=0" if os.environ.get(
                                       "LOCALMOE_PREFILL_GRAPHS", "1") == "0" else None))
        if self.prefill_graphs_off is None:
            self.prefill_graphs = PrefillGraphs(self, pool=self.graphs.pool)

    def _forward(self, batch, all_logits: bool, on_device: bool = False,
                 tokens_on_device: torch.Tensor | None = None) -> list[torch.Tensor]:
        from localmoe.backends.triton.graphs import MAX_BATCH

        if tokens_on_device is not None and (
                len(batch) != tokens_on_device.numel() or any(len(t) != 1 for _, t in batch)):
            raise ValueError("tokens_on_device needs one new token per sequence")
        if (self.graphs is not None and not all_logits and len(batch) <= MAX_BATCH
                and all(len(t) == 1 for _, t in batch)):
            return self._graph_forward(batch, on_device, tokens_on_device)
        if tokens_on_device is not None:   # not a static-buffer step: read the tokens here
            batch = [(sid, [int(t)]) for (sid, _), t in zip(batch, tokens_on_device.tolist())]
        if self.graphs is not None and self.graphs.refresh is not None:
            self.graphs.refresh.soon()     # a prompt may grow the allocator (graphs.Refresh)
        pg = self.prefill_graphs
        if pg is not None and not all_logits and pg.usable(batch):
            with torch.inference_mode():
                prepare_batch(self.model, self.cache, self.n_ctx, batch)
                (sid, toks), = batch
                logits = pg.run(sid, toks)
                if pg.failed:
                    self.prefill_graphs, self.prefill_graphs_off = None, pg.failed
                self.cache.commit(sid, len(toks))
                self.tokens_processed += len(toks)
                return [logits[0].clone() if on_device else logits[0].cpu()]
        out, n = run_batch(self.model, self.cache, self.n_ctx, batch, self.attention_layer,
                           all_logits)
        self.tokens_processed += n
        return out

    @torch.inference_mode()
    def _graph_forward(self, batch, on_device: bool = False,
                       tokens_on_device: torch.Tensor | None = None) -> list[torch.Tensor]:
        """One decode step (every sequence adds one token) on the static buffers (its CUDA
        graph, or the same step launched eagerly)."""
        prepare_batch(self.model, self.cache, self.n_ctx, batch)
        logits = self.graphs.run(batch, tokens_on_device)
        if self.graphs.failed:
            self.graphs_off = self.graphs.failed
            if self.fused is not None:
                self.graphs.capture = False     # the fused step goes on eagerly
            else:
                self.graphs = None
        for sid, _ in batch:
            self.cache.commit(sid, 1)
        # a copy either way: ``logits`` is the static step's buffer, which the next step
        # overwrites (on a CPU device ``.cpu()`` would return that buffer itself)
        out = logits.clone() if on_device or logits.device.type == "cpu" else logits.cpu()
        self.tokens_processed += len(batch)
        return [out[i] for i in range(len(batch))]

    def _per_call(self, key, make):
        """``make()`` once per forward call and ``key`` (the cache's block tables only grow
        during a call, at its first layer's writes)."""
        if self._memo_step != self._step:
            self._memo, self._memo_step = {}, self._step
        val = self._memo.get(key)
        if val is None:
            val = self._memo[key] = make()
        return val

    # ---- KV write --------------------------------------------------------------------------
    def write_kv(self, layer: int, seq: SeqSlice, k: torch.Tensor, v: torch.Tensor) -> None:
        """Pack one sequence's new K ``[T, Hkv, D]`` / V ``[T, Hkv, Dv]`` with the append kernel."""
        if not self._fused:
            return self.ref.write_kv(layer, seq, k, v)
        c = self.cache
        n = k.shape[0]
        slots, pos, row = self._per_call(("w", seq.seq_id, seq.start, n), lambda: (
            c.slots(seq.seq_id, seq.start, seq.start + n),
            torch.arange(seq.start, seq.start + n, device=c.device), c.seq_row(seq.seq_id)))
        for codec, store, x in ((c.k_codec, c.k_stores[layer], k), (c.v_codec, c.v_stores[layer], v)):
            _write_codec(codec, store, slots, x, pos, row, seq.start)

    def write_prompt_kv(self, seq_id: int, n: int, pending: list) -> None:
        """Write the first ``n`` rows of a prefill graph's K/V (``pending``: per layer None or
        ``(k, v)``, each ``[P, Hkv, D]`` or None, see
        :meth:`~localmoe.backends.triton.fused_step.FusedDecode.prefill`) for ``seq_id``'s
        positions ``0 .. n-1`` into the quantized stores."""
        if not any(pending):
            return
        c = self.cache
        slots = c.slots(seq_id, 0, n)
        pos = torch.arange(n, device=c.device)
        row = c.seq_row(seq_id)
        for side, (codec, stores) in enumerate(((c.k_codec, c.k_stores),
                                                (c.v_codec, c.v_stores))):
            todo = [(layer, kv[side]) for layer, kv in enumerate(pending)
                    if kv is not None and kv[side] is not None]
            if getattr(codec, "channel", False):
                # per-channel keys: the layers' pages quantized together, in groups of at most
                # PROMPT_KV_ROWS tokens x layers (bounds the float32 temporaries)
                g = max(1, PROMPT_KV_ROWS // max(n, 1))
                for i in range(0, len(todo), g):
                    part = todo[i:i + g]
                    codec.write_channel_layers([stores[layer] for layer, _ in part], slots,
                                               torch.stack([x[:n] for _, x in part]), row, 0)
                continue
            for layer, x in todo:
                _write_codec(codec, stores[layer], slots, x[:n], pos, row, 0)

    # ---- attention -------------------------------------------------------------------------
    def attention_layer(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        seqs: list[SeqSlice]) -> torch.Tensor:
        """Write every sequence's K/V, then one fused decode launch when each sequence adds a
        single token; otherwise the reference attention per sequence. ``q [N, H, D]``,
        ``k [N, Hkv, D]``, ``v [N, Hkv, Dv]`` -> ``[N, H, Dv]``."""
        if not self._fused:
            return self.ref(layer, q, k, v, seqs)
        if any(s.n != 1 for s in seqs):
            outs = []
            for s in seqs:
                self.write_kv(layer, s, k[s.lo:s.hi], v[s.lo:s.hi])
                outs.append(self.ref.attend(layer, q[s.lo:s.hi], s.seq_id, s.start))
            return outs[0] if len(outs) == 1 else torch.cat(outs, 0)
        for s in seqs:
            self.write_kv(layer, s, k[s.lo:s.hi], v[s.lo:s.hi])
        return self._decode(layer, q, seqs)

    def _decode(self, layer: int, q: torch.Tensor, seqs: list[SeqSlice]) -> torch.Tensor:
        """One fused decode-attention launch over the batch (each sequence adds one token whose
        K/V are already written)."""
        from localmoe.kernels.decode_attention import decode_attention

        c = self.cache

        def launch_meta():
            # block tables padded with 0 to the longest: [n_seqs, width] int32 on the device
            bt = torch.nn.utils.rnn.pad_sequence([c.block_table(s.seq_id) for s in seqs],
                                                 batch_first=True)
            lens = [s.start + 1 for s in seqs]
            rows = torch.tensor([c.seq_row(s.seq_id) for s in seqs], dtype=torch.int32)
            return (bt, torch.tensor(lens, dtype=torch.int32, device=c.device),
                    rows.to(c.device), max(lens))

        bt, lens, rows, max_len = self._per_call(
            ("a",) + tuple((s.seq_id, s.start) for s in seqs), launch_meta)
        window = self.model.layer_window(layer) or 0
        out = decode_attention(
            q, c.k_codec, c.k_stores[layer], c.v_codec, c.v_stores[layer], bt, lens,
            page_size=c.block_size, sm_scale=self.model.scale, seq_rows=rows,
            sliding_window=window, max_len=max_len)
        self.n_fused_calls += 1
        return out.to(q.dtype)

    # ---- misc ------------------------------------------------------------------------------
    def stats(self) -> dict:
        """The torch runner's stats plus ``fused_decode_calls``, ``fused_attention``,
        ``weights`` (``"quantized"`` or why the weights were dequantized), ``act_precision``,
        ``pdl`` (programmatic dependent launch: ``"on (at_exit)"`` or ``"off (why)"``),
        ``cuda_graphs`` (captures, replays, and graphs captured again because the allocator
        grew: :class:`~localmoe.backends.triton.graphs.Refresh`), ``fused_step``,
        ``launch_tape`` and ``prefill_graphs``."""
        out = runner_stats(self)
        out["fused_decode_calls"] = self.n_fused_calls
        out["fused_attention"] = self._fused
        out["weights"] = self.weights
        out["act_precision"] = self.act_precision
        from localmoe.kernels.pdl import pdl_status

        out["pdl"] = pdl_status(self.device)
        g = self.graphs
        out["cuda_graphs"] = ({"captured": g.captures, "replays": g.replays,
                               "recaptured": g.refreshes}
                              if g is not None and g.capture else f"off ({self.graphs_off})")
        out["fused_step"] = "on" if self.fused is not None else f"off ({self.fused_off})"
        if g is not None and not g.capture:
            out["launch_tape"] = ({"recorded": g.tapes, "replays": g.tape_replays}
                                  if g.tape_off is None else f"off ({g.tape_off})")
        pg = self.prefill_graphs
        out["prefill_graphs"] = ({"captured": pg.captures, "replays": pg.replays}
                                 if pg is not None else f"off ({self.prefill_graphs_off})")
        return out

    def close(self) -> None:
        """Drop weights and cache (the runner is unusable afterwards)."""
        self.model = None
        self.cache = None
        self.ref = None
        self.graphs = None
        self.prefill_graphs = None


def default_gpu_dtype(model_file) -> torch.dtype:
    """The activation dtype of a GPU runner for ``model_file`` when none is asked for: its
    family's ``gpu_dtype`` (:class:`localmoe.models.family.Family`), float16 for an unknown
    architecture (the load reports that one itself)."""
    from localmoe.errors import UnsupportedModelError
    from localmoe.models.family import get_family

    try:
        return getattr(torch, get_family(model_file.spec.arch).gpu_dtype)
    except (UnsupportedModelError, AttributeError):   # the loader reports an unknown family
        return torch.float16


def _write_codec(codec, store: dict, slots: torch.Tensor, x: torch.Tensor, pos: torch.Tensor,
                 row: int, start: int) -> None:
    """Append ``x [T, Hkv, D]`` at ``slots`` (positions ``start ..``) in ``codec``'s format: the
    append kernel for per-token quantized formats, the codec's own write otherwise."""
    from localmoe.kernels.kv_quant_append import kv_quant_append

    if hasattr(codec, "quantize_rows") and not getattr(codec, "channel", False):
        kv_quant_append(codec, store, slots, x, pos, row, start=start)
    else:
        codec.write(store, slots, x, pos, seq_row=row, start=start)
