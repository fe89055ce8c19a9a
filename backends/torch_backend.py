"""Reference backend ``torch``: plain PyTorch on CPU or CUDA.

Every other backend is checked against this one. Weights are dequantized once at load
(``ModelFile.load_tensor``) to float32 (CPU) or the requested dtype -- except, on the CPU, GGUF
block-quantized matmul weights, which by default stay packed and run through the exact kernel
of :mod:`localmoe.cpu.qmatmul` (``packed_weights=False`` gives the plain-PyTorch float path); K/V
live in a :class:`localmoe.kv.cache.PagedKVCache` whose format comes from the KVSpec; attention
reads the dequantized K/V back through ``cache.read`` (the reference path).

The runner is the reference pieces of :mod:`localmoe.backends.reference` put together: the
model and cache (:func:`~localmoe.backends.reference.load_paged_model`), the batch step
(:func:`~localmoe.backends.reference.run_batch`) and the reference attention
(:class:`~localmoe.backends.reference.PagedAttention`, reachable as :meth:`TorchRunner.write_kv`,
:meth:`TorchRunner.attend` and :meth:`TorchRunner.attention_layer`, the per-layer hook
``forward`` calls; a subclass may override it). CPU threads: :mod:`localmoe.cpu.threads`.
"""

from __future__ import annotations

from typing import Any

import torch

from localmoe.backends.reference import (CacheSequences, PagedAttention, SeqSlice,  # noqa: F401
                                         load_paged_model, load_runner, run_batch, runner_stats,
                                         torch_supports)
from localmoe.backends.registry import Backend, register_backend
from localmoe.errors import BackendUnavailableError


class TorchRunner(CacheSequences):
    """A loaded model on the reference backend (the Runner contract of INTERFACES.md).

    Args:
        model_file: an open :class:`localmoe.io.model_file.ModelFile`.
        n_ctx: context size in tokens per sequence (default: min(training context, 4096)).
        kv_spec: :class:`localmoe.kv.spec.KVSpec` or a string (default ``"f16"``).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"`` (default: cpu).
        dtype: weight/activation dtype (default float32; on CUDA float16/bfloat16 allowed).
        max_seqs: concurrently live sequences; the KV block pool is allocated up front for
            ``max_seqs`` full-context sequences (``max_seqs * ceil(n_ctx / block_size)`` blocks).
            Default 1: an ``LLM`` (generate, chat, the Python API and the server, which runs
            one generation at a time) keeps a single sequence, so the pool is the one-sequence
            size ``localmoe info`` reports. Raise it only to run several sequences at once.
        block_size: KV cache block size in tokens.
        experts: a custom :class:`localmoe.model.experts.ExpertProvider` (default resident).
        numerics: ``"exact"`` (default: float matmuls on dequantized weights) or ``"ggml"``
            (GGUF: round matmul inputs as llama.cpp's CPU backend does; see
            :meth:`localmoe.model.transformer.Transformer.from_model_file`).
        packed_weights: keep GGUF block-quantized matmul weights packed and use the exact CPU
            kernel (:mod:`localmoe.cpu.qmatmul`): ``None`` (default) = automatically on the CPU
            in float32 with ``numerics="exact"``, ``False`` = always dequantize to float32,
            ``True`` = require it (ValueError when unavailable).
        n_threads: CPU threads (``torch.set_num_threads``, process-wide; CPU device only).
            Default :func:`localmoe.cpu.threads.default_threads`: ``$LOCALMOE_THREADS``, else
            the physical cores minus the cores other processes kept busy while the model
            loaded.

    Raises:
        ModelLoadError / UnsupportedModelError: the file cannot be run.
        KVCacheFormatError: unknown KV format.
    """

    backend_name = "torch"

    def __init__(self, model_file, *, n_ctx: int | None = None, kv_spec: Any = None,
                 device: str | None = None, dtype: torch.dtype | None = None, max_seqs: int = 1,
                 block_size: int = 16, experts: Any = None, numerics: str = "exact",
                 packed_weights: bool | None = None, n_threads: int | None = None):
        #: the reference attention over the paged cache
        self.attn = load_runner(self, model_file, device=device or "cpu", dtype=dtype,
                                n_threads=n_threads, max_seqs=max_seqs, n_ctx=n_ctx,
                                kv_spec=kv_spec, block_size=block_size, experts=experts,
                                numerics=numerics, packed_weights=packed_weights)

    # ---- attention (the reference PagedAttention) ------------------------------------------
    def write_kv(self, layer: int, seq: SeqSlice, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one sequence's new K ``[T, Hkv, D]`` / V ``[T, Hkv, Dv]`` at its positions."""
        self.attn.write_kv(layer, seq, k, v)

    def attend(self, layer: int, q: torch.Tensor, seq_id: int, start: int) -> torch.Tensor:
        """Attention of one sequence's new queries ``q [T, H, D]`` (positions ``start ..
        start+T-1``) over its cached K/V, new tokens included; returns ``[T, H, Dv]``."""
        return self.attn.attend(layer, q, seq_id, start)

    def attention_layer(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        seqs: list[SeqSlice]) -> torch.Tensor:
        """Attention of a whole ragged batch for one layer: writes each sequence's K/V, then
        attends. ``q [N, H, D]``, ``k [N, Hkv, D]``, ``v [N, Hkv, Dv]`` -> ``[N, H, Dv]``."""
        return self.attn(layer, q, k, v, seqs)

    # ---- forward ---------------------------------------------------------------------------
    def forward(self, batch: list[tuple[int, list[int]]], all_logits: bool = False
                ) -> list[torch.Tensor]:
        """Append each sequence's new tokens after its cached ones and return logits.

        Args:
            batch: ``[(seq_id, token_ids), ...]`` (ragged: any lengths >= 1).
            all_logits: return logits of every new token instead of only the last.

        Returns:
            per sequence a float32 CPU tensor: ``[vocab]`` (last new token) or ``[T_i, vocab]``.

        Raises:
            ContextOverflowError: ``seq_len + T_i > n_ctx`` (nothing is appended).
            InvalidRequestError: empty batch/sequence, token id outside the vocabulary.
            LocalMoEError: unknown sequence id, KV block pool exhausted.
        """
        out, n = run_batch(self.model, self.cache, self.n_ctx, batch, self.attention_layer,
                           all_logits)
        self.tokens_processed += n
        return out

    # ---- misc ------------------------------------------------------------------------------
    def stats(self) -> dict:
        """``{"device", "dtype", "kv_bytes", "kv_format", "load_s", "weights_bytes", ...}``
        (plus the expert provider's counters)."""
        return runner_stats(self)

    def close(self) -> None:
        """Drop weights and cache (the runner is unusable afterwards)."""
        self.model = None
        self.cache = None
        self.attn = None


@register_backend("torch")
class TorchBackend(Backend):
    """Reference PyTorch backend (CPU fp32, or CUDA)."""

    description = "reference PyTorch (CPU fp32 or CUDA); runs GGUF and safetensors models"

    options = ("dtype", "max_seqs", "block_size", "experts", "numerics", "packed_weights",
               "n_threads")

    def available(self) -> str | None:
        try:
            import torch  # noqa: F401
        except ImportError:
            return "torch not installed"
        return None

    def supports(self, model_format: str, kv_spec: Any = None) -> str | None:
        return torch_supports(model_format, kv_spec)

    def load(self, model, *, n_ctx: int | None = None, kv_spec: Any = None,
             device: str | None = None, **options: Any) -> TorchRunner:
        """Build a :class:`TorchRunner`; ``options``: dtype, max_seqs, block_size, experts,
        numerics, packed_weights, n_threads.

        Raises:
            BackendUnavailableError: CUDA requested but absent.
        """
        why = self.check_device(device)
        if why:
            raise BackendUnavailableError(why)
        return TorchRunner(model, n_ctx=n_ctx, kv_spec=kv_spec, device=device, **options)
