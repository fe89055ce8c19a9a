"""``triton`` backend: the torch engine with fused Triton KV-cache kernels on CUDA.

Everything except attention and the KV write is inherited from the reference
:class:`~localmoe.backends.torch_backend.TorchRunner` (the fast-path issue replaces the rest).
Overrides:

* K/V write: quantized formats are packed straight into the paged store by
  :func:`localmoe.kernels.kv_quant_append.kv_quant_append` (float formats are a plain copy;
  per-channel keys go through the codec's ``write``, torch ops on the GPU: a page is
  quantized once per ``block_size`` tokens).
* Decode (every sequence of the batch adds one token): one launch of
  :func:`localmoe.kernels.decode_attention.decode_attention` for the whole batch, reading the
  packed blocks and dequantizing in registers (split-K over the sequence).
* Prefill (a sequence adds several tokens): the reference path — K/V of the attended range are
  dequantized by the codec (torch ops on the GPU) and fed to SDPA.

Unsupported cases fall back to the reference path per call (non power-of-two head sizes,
attention logit softcapping, the ``ggml`` numerics mode).
"""

from __future__ import annotations

import contextlib

from typing import Any

import torch

from localmoe.errors import BackendUnavailableError
from localmoe.engine.registry import register_backend

from .torch_backend import SeqSlice, TorchBackend, TorchRunner


class TritonRunner(TorchRunner):
    """A :class:`TorchRunner` on CUDA whose KV write and decode attention are Triton kernels.

    Same arguments as :class:`TorchRunner` (``device`` defaults to ``"cuda"`` and ``dtype`` to
    float16).
    """

    backend_name = "triton"

    def __init__(self, model_file, *, device: str | None = None, dtype: torch.dtype | None = None,
                 **kw: Any):
        super().__init__(model_file, device=device or "cuda", dtype=dtype or torch.float16, **kw)
        c = self.cache
        pow2 = all(d >= 16 and d & (d - 1) == 0 for d in (self.spec.head_dim, self.spec.v_head_dim))
        self._fused = (pow2 and not self.spec.attn_logit_softcap
                       and self.model.numerics != "ggml" and c.block_size & (c.block_size - 1) == 0)
        self._quant_k = hasattr(c.k_codec, "quantize_rows")
        self._quant_v = hasattr(c.v_codec, "quantize_rows")
        self.n_fused_calls = 0
        # per forward call: slots/positions of each sequence's new tokens and the decode
        # launch's block table, lengths and rows, built at the first layer and reused by the
        # others (one set of host-to-device copies per token instead of one per layer)
        self._step = 0
        self._memo_step = -1
        self._memo: dict = {}

    def forward(self, batch, all_logits: bool = False):
        """:meth:`TorchRunner.forward`; starts a new per-call memo of launch metadata. Runs with
        the runner's GPU as the current CUDA device: Triton launches on the current device, so
        a runner on ``cuda:1`` would otherwise launch its kernels on GPU 0."""
        self._step += 1
        dev = torch.device(self.device)
        with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
            return super().forward(batch, all_logits)

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
            return super().write_kv(layer, seq, k, v)
        from localmoe.kernels.kv_quant_append import kv_quant_append

        c = self.cache
        n = k.shape[0]
        slots, pos, row = self._per_call(("w", seq.seq_id, seq.start, n), lambda: (
            c.slots(seq.seq_id, seq.start, seq.start + n),
            torch.arange(seq.start, seq.start + n, device=c.device), c.seq_row(seq.seq_id)))
        for codec, store, x in ((c.k_codec, c.k_stores[layer], k), (c.v_codec, c.v_stores[layer], v)):
            if hasattr(codec, "quantize_rows") and not getattr(codec, "channel", False):
                kv_quant_append(codec, store, slots, x, pos, row, start=seq.start)
            else:
                codec.write(store, slots, x, pos, seq_row=row, start=seq.start)

    # ---- attention -------------------------------------------------------------------------
    def attention_layer(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        seqs: list[SeqSlice]) -> torch.Tensor:
        """Write every sequence's K/V, then one fused decode launch when each sequence adds a
        single token; otherwise the reference per-sequence path."""
        if not self._fused or any(s.n != 1 for s in seqs):
            return super().attention_layer(layer, q, k, v, seqs)
        from localmoe.kernels.decode_attention import decode_attention

        for s in seqs:
            self.write_kv(layer, s, k[s.lo:s.hi], v[s.lo:s.hi])
        c = self.cache

        def launch_meta():
            tables = [c._tables[s.seq_id] for s in seqs]
            width = max(len(t) for t in tables)
            bt = torch.zeros(len(seqs), width, dtype=torch.int32)
            for i, t in enumerate(tables):
                bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
            lens = [s.start + 1 for s in seqs]
            rows = torch.tensor([c.seq_row(s.seq_id) for s in seqs], dtype=torch.int32)
            return (bt.to(c.device), torch.tensor(lens, dtype=torch.int32, device=c.device),
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

    def stats(self) -> dict:
        out = super().stats()
        out["fused_decode_calls"] = self.n_fused_calls
        out["fused_attention"] = self._fused
        return out


@register_backend("triton")
class TritonBackend(TorchBackend):
    """Fused GPU path (Triton kernels over the paged, possibly quantized KV cache)."""

    description = "CUDA + Triton: fused sub-byte KV-cache decode attention (torch for the rest)"

    def available(self) -> str | None:
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton not installed"
        if not torch.cuda.is_available():
            return "no CUDA device"
        return None

    def load(self, model, *, n_ctx: int | None = None, kv_spec: Any = None,
             device: str | None = None, **options: Any) -> TritonRunner:
        """Build a :class:`TritonRunner` (options as for the torch backend).

        Raises:
            BackendUnavailableError: no CUDA device or Triton missing.
        """
        why = self.available()
        if why:
            raise BackendUnavailableError(f"backend 'triton' is not available: {why}")
        if device and not str(device).startswith("cuda"):
            raise BackendUnavailableError("the triton backend runs on CUDA devices only")
        return TritonRunner(model, n_ctx=n_ctx, kv_spec=kv_spec, device=device, **options)
