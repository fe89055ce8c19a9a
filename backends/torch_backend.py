"""Reference backend ``torch``: plain PyTorch on CPU or CUDA.

Every other backend is checked against this one. Weights are dequantized once at load
(``ModelFile.load_tensor``) to float32 (CPU) or the requested dtype -- except, on the CPU, GGUF
block-quantized matmul weights, which by default stay packed and run through the exact kernel
of :mod:`localmoe.cpu.qmatmul` (``packed_weights=False`` gives the plain-PyTorch float path); K/V
live in a
:class:`localmoe.kv.cache.PagedKVCache` whose format comes from the KVSpec; attention reads the
dequantized K/V back through ``cache.read`` (the reference path).

Subclassing: :class:`TorchRunner` keeps the per-layer attention in two overridable methods,
:meth:`TorchRunner.write_kv` and :meth:`TorchRunner.attend` (one call per sequence of a ragged
batch), plus :meth:`TorchRunner.attention_layer` which loops over the sequences of a batch; a
faster backend overrides one of them and inherits batching, bookkeeping and logits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from localmoe.errors import BackendUnavailableError, InvalidRequestError, LocalMoEError
from localmoe.cpu.threads import _LAST_SET, _CPUBusy, check_threads, default_threads, env_threads
from localmoe.engine.registry import Backend, register_backend


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


class TorchRunner:
    """A loaded model on the reference backend (the Runner contract of INTERFACES.md).

    Args:
        model_file: an open :class:`localmoe.io.loader.ModelFile`.
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
            Default :func:`localmoe.cpu.threads.default_threads`: ``$LOCALMOE_THREADS``, else the physical cores
            minus the cores other processes kept busy while the model loaded.

    Raises:
        ModelLoadError / UnsupportedModelError: the file cannot be run.
        KVCacheFormatError: unknown KV format.
    """

    backend_name = "torch"

    def __init__(self, model_file, *, n_ctx: int | None = None, kv_spec: Any = None,
                 device: str | None = None, dtype: torch.dtype | None = None, max_seqs: int = 1,
                 block_size: int = 16, experts: Any = None, numerics: str = "exact",
                 packed_weights: bool | None = None, n_threads: int | None = None):
        from localmoe.kv.cache import PagedKVCache
        from localmoe.kv.spec import KVSpec
        from localmoe.model.transformer import Transformer

        t0 = time.perf_counter()
        self.model_file = model_file
        self.device = str(device or "cpu")
        dev = torch.device(self.device)
        if n_threads is not None:
            check_threads(n_threads)
        if n_threads is None and dev.type == "cpu":
            env_threads()  # a bad $LOCALMOE_THREADS is refused before the weights load
        busy = _CPUBusy().start() if dev.type == "cpu" and n_threads is None else None
        self.dtype = dtype or torch.float32
        if dev.type == "cpu":
            self.dtype = torch.float32   # the CPU reference computes in fp32
        self.model = Transformer.from_model_file(model_file, device=dev, dtype=self.dtype,
                                                 experts=experts, numerics=numerics,
                                                 packed=packed_weights)
        self.spec = self.model.spec
        self.n_ctx = int(n_ctx or min(self.spec.n_ctx_train or 4096, 4096))
        self.kv_spec = KVSpec.parse(kv_spec if kv_spec is not None else "f16")
        self.max_seqs = int(max_seqs)
        self.cache = PagedKVCache(self.spec, self.kv_spec, self.n_ctx, self.max_seqs,
                                  block_size=block_size, device=dev)
        from localmoe.kv.codec import FloatCodec

        # plain float K/V on the CPU: read/write slices of the store when slots are consecutive
        self._float_kv = (dev.type == "cpu" and type(self.cache.k_codec) is FloatCodec
                          and type(self.cache.v_codec) is FloatCodec)
        self._kv_range_memo: dict = {}
        self.n_threads: int | None = None
        self.threads_reason = ""
        if dev.type == "cpu":
            if n_threads is not None:
                self.n_threads, self.threads_reason = int(n_threads), "requested"
            else:  # the load itself was the sampling interval (at least 0.2 s)
                self.n_threads, self.threads_reason = default_threads(busy.cores())
            torch.set_num_threads(self.n_threads)
            _LAST_SET[0] = self.n_threads
        self.load_s = time.perf_counter() - t0
        self._n_forward_tokens = 0

    # ---- sequences -------------------------------------------------------------------------
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

    # ---- attention seam (overridable) ------------------------------------------------------
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
        from localmoe.model.transformer import attention

        end = start + q.shape[0]
        window = self.model.layer_window(layer)
        k_start = max(0, start - window + 1) if window else 0
        a = self._float_kv_range(seq_id, k_start, end)
        if a is not None:
            n = end - k_start
            K = self.cache.k_stores[layer]["data"][a:a + n]
            V = self.cache.v_stores[layer]["data"][a:a + n]
            if (q.shape[0] == 1 and self.model.packed and not self.spec.attn_logit_softcap
                    and q.dtype == torch.float32 and q.is_contiguous()
                    and K.dtype in (torch.float32, torch.float16) and K.dtype == V.dtype):
                # decode with the packed-weights CPU kernels: one C call over exactly the keys
                # the query sees ([k_start, end) is the window), same function as below
                from localmoe.cpu.qmatmul import attention_decode

                try:
                    return attention_decode(q, K, V, self.model.scale)
                except ValueError:  # a layout the C kernel does not take: the torch path below
                    pass
        else:
            K, V = self.cache.read(layer, seq_id, end, start=k_start)
        return attention(q, K.to(q.dtype), V.to(q.dtype), q_start=start - k_start,
                         scale=self.model.scale, window=window,
                         softcap=self.spec.attn_logit_softcap,
                         ggml_f16=self.model.numerics == "ggml" and self.kv_spec.k.name == "f16")

    def attention_layer(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        seqs: list[SeqSlice]) -> torch.Tensor:
        """Attention of a whole ragged batch for one layer: writes each sequence's K/V, then
        attends. ``q [N, H, D]``, ``k [N, Hkv, D]``, ``v [N, Hkv, Dv]`` -> ``[N, H, Dv]``."""
        outs = []
        for s in seqs:
            self.write_kv(layer, s, k[s.lo:s.hi], v[s.lo:s.hi])
            outs.append(self.attend(layer, q[s.lo:s.hi], s.seq_id, s.start))
        return outs[0] if len(outs) == 1 else torch.cat(outs, 0)

    # ---- forward ---------------------------------------------------------------------------
    def _validate(self, batch) -> None:
        if not batch:
            raise InvalidRequestError("forward() needs at least one (seq_id, tokens) pair", "batch")
        seen = set()
        V = self.spec.vocab_size
        for sid, toks in batch:
            if sid in seen:
                raise InvalidRequestError(f"sequence {sid} appears twice in one batch", "batch")
            seen.add(sid)
            if len(toks) == 0:
                raise InvalidRequestError(f"sequence {sid} has no new tokens", "batch")
            bad = [t for t in toks if not (0 <= int(t) < V)]
            if bad:
                raise InvalidRequestError(
                    f"token id {bad[0]} is outside the vocabulary [0, {V})", "tokens")
            self.cache.seq_len(sid)  # raises for unknown ids

    @torch.inference_mode()
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
        self._validate(batch)
        for sid, toks in batch:  # check every sequence before reserving anything
            if self.cache.seq_len(sid) + len(toks) > self.n_ctx:
                from localmoe.errors import ContextOverflowError

                raise ContextOverflowError(self.cache.seq_len(sid) + len(toks), self.n_ctx)
        for sid, toks in batch:
            self.cache.reserve(sid, len(toks))
        dev = self.model.device
        seqs, pos, ids = [], [], []
        lo = 0
        for sid, toks in batch:
            start = self.cache.seq_len(sid)
            seqs.append(SeqSlice(sid, start, lo, lo + len(toks)))
            lo += len(toks)
            ids.extend(int(t) for t in toks)
            pos.extend(range(start, start + len(toks)))
        tokens = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.tensor(pos, dtype=torch.long, device=dev)

        def attn(layer, q, k, v):
            return self.attention_layer(layer, q, k, v, seqs)

        hidden = self.model.forward_hidden(tokens, positions, attn)
        for s in seqs:
            self.cache.commit(s.seq_id, s.n)
        self._n_forward_tokens += lo
        if all_logits:
            logits = self.model.logits(hidden).cpu()
            return [logits[s.lo:s.hi] for s in seqs]
        last = torch.tensor([s.hi - 1 for s in seqs], device=dev)
        logits = self.model.logits(hidden.index_select(0, last)).cpu()
        return [logits[i] for i in range(len(seqs))]

    # ---- misc ------------------------------------------------------------------------------
    def stats(self) -> dict:
        """``{"device", "dtype", "kv_bytes", "kv_format", "load_s", "weights_bytes", ...}``
        (plus the expert provider's counters)."""
        m = self.model
        wbytes = sum(t.nbytes for L in m.layers for t in L.values())  # packed layers too
        for t in {id(x): x for x in (m.tok_embd, m.output, m.output_t) if x is not None}.values():
            wbytes += t.nbytes
        out = {"device": self.device, "dtype": str(self.dtype).replace("torch.", ""),
               "kv_bytes": self.cache.footprint(), "kv_format": str(self.kv_spec),
               "load_s": round(self.load_s, 3), "weights_bytes": int(wbytes),
               "tokens_processed": self._n_forward_tokens}
        if self.n_threads is not None:
            out["n_threads"] = self.n_threads
            out["threads_reason"] = self.threads_reason
        if m.experts is not None:
            if hasattr(m.experts, "nbytes"):
                out["expert_bytes"] = int(m.experts.nbytes())
            out.update(m.experts.stats())
        return out

    def close(self) -> None:
        """Drop weights and cache (the runner is unusable afterwards)."""
        self.model = None
        self.cache = None


@register_backend("torch")
class TorchBackend(Backend):
    """Reference PyTorch backend (CPU fp32, or CUDA)."""

    description = "reference PyTorch (CPU fp32 or CUDA); runs GGUF and safetensors models"

    def available(self) -> str | None:
        try:
            import torch  # noqa: F401
        except ImportError:
            return "torch not installed"
        return None

    def supports(self, model_format: str, kv_spec: Any = None) -> str | None:
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
