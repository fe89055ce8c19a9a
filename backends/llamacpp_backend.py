"""``llamacpp`` backend: the whole model on the CPU through llama-cpp-python.

A thin Runner (docs/INTERFACES.md) over llama.cpp's C API: it feeds token ids with
``llama_decode`` and returns float32 logits; sampling, chat templates, stop strings and
detokenization stay in localmoe's engine, so this backend produces the same text as the others
for the same logits. GGUF files only.

KV cache formats map onto llama.cpp cache types (``type_k`` / ``type_v``)::

    f32 -> F32    f16 -> F16    bf16 -> BF16    int8 (group 32) -> Q8_0    int4 (group 32) -> Q4_0

(Q8_0/Q4_0 are symmetric blocks of 32 values with one fp16 scale: 8.5 and 4.5 bits per value.)
A quantized V cache needs flash attention, which is then switched on. The backend maps what
llama.cpp supports and refuses the rest, in :meth:`LlamaCppBackend.supports` (so ``auto`` skips
it) and again in ``load`` before any weights load: int3, int2, fp4, other group sizes, fp16
outlier channels (``outliers=``, ``koutliers=`` above 0), sink tokens, recent windows, and keys
grouped per channel. llama.cpp's
blocks group keys per token, so a plain ``int4`` (whose localmoe default is per-channel keys)
runs as per-token q4_0 and the runner reports ``int4:t``; an explicit per-channel request
(``int4:c``, ``kgroup=channel``: the spec's ``named_key_grouping``, see
:func:`localmoe.engine.options.parse_kv_request`) is refused.

Sequences: llama.cpp's context holds ``max_seqs`` sequences (default 1) in one KV cache of
``n_ctx`` tokens; ``truncate`` maps to ``llama_memory_seq_rm``.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import logging
import os
from typing import Any, Iterator

from localmoe.errors import (BackendUnavailableError, ContextOverflowError, KVCacheFormatError,
                             LocalMoEError, ModelLoadError, UnsupportedModelError)
from localmoe.backends.registry import (Backend, check_threads, cuda_device_problem, env_threads,
                               register_backend)
from localmoe.io.env import env_flag

# localmoe KV format name -> (ggml type id, llama.cpp name, bytes per block, values per block)
KV_TYPE_MAP: dict[str, tuple[int, str, int, int]] = {
    "f32": (0, "f32", 4, 1),
    "f16": (1, "f16", 2, 1),
    "bf16": (30, "bf16", 2, 1),
    "int8": (8, "q8_0", 34, 32),
    "int4": (2, "q4_0", 18, 32),
}


def _kv_reason(kv_spec: Any) -> str | None:
    """Why llama.cpp cannot hold ``kv_spec`` (None when it can)."""
    if kv_spec is None:
        return None
    for side in ("k", "v"):
        fmt = getattr(kv_spec, side)
        if fmt.name not in KV_TYPE_MAP:
            return (f"llama.cpp has no {fmt.name} KV cache ({side.upper()}); use --kv-cache "
                    f"f16|bf16|int8|int4 with this backend, or --backend torch/triton for {fmt.name}")
        if not getattr(fmt, "is_float", False) and fmt.group_size != KV_TYPE_MAP[fmt.name][3]:
            return (f"llama.cpp's {KV_TYPE_MAP[fmt.name][1]} KV cache uses groups of "
                    f"{KV_TYPE_MAP[fmt.name][3]}, not {fmt.group_size}; drop the :g option or "
                    f"use --backend torch/triton")
    k = kv_spec.k
    if getattr(k, "grouping", "") == "channel":
        from localmoe.kv.formats import default_key_grouping

        named = getattr(kv_spec, "named_key_grouping", None)
        if named == "channel" or default_key_grouping(k.name) != "channel":
            return (f"llama.cpp's {KV_TYPE_MAP[k.name][1]} KV cache groups keys per token; "
                    f"per-channel keys ({k.name}:c, kgroup=channel) need --backend torch/triton "
                    f"(plain --kv-cache {k.name} runs here with per-token keys)")
    if getattr(kv_spec, "outlier_frac", 0) or getattr(kv_spec, "sink_tokens", 0) \
            or getattr(kv_spec, "window", 0) or getattr(kv_spec, "key_outlier_frac", None):
        return ("llama.cpp cannot keep fp16 outlier channels, sink tokens or a full-precision "
                "window in its KV cache; use --backend torch/triton for those options")
    return None


def _as_run(kv_spec: Any) -> Any:
    """The KVSpec llama.cpp actually holds for an accepted ``kv_spec``: int keys per token."""
    import dataclasses

    from localmoe.kv.formats import KVFormat

    k = kv_spec.k
    if k.is_float or k.grouping == "token":
        return kv_spec
    return dataclasses.replace(kv_spec, k=KVFormat(k.name, k.bits, k.group_size, "token"))


_LOG_CB = None
#: llama.cpp's recent error lines, kept while a model loads (its load errors name the cause:
#: "tensor 'x' has wrong shape", "key y has wrong type", ...) to put them in our error message
_LOAD_LOG: list[str] | None = None

log = logging.getLogger("localmoe.backends.llamacpp")


def amx_build(llama_cpp: Any) -> bool:
    """Whether this llama.cpp build multiplies with Intel AMX (``AMX_INT8 = 1`` in its system
    info: built natively on a CPU with AMX, e.g. Sapphire Rapids)."""
    try:
        return b"AMX_INT8 = 1" in llama_cpp.llama_print_system_info()
    except Exception:  # noqa: BLE001 -- an older binding: assume not
        return False


@contextlib.contextmanager
def safe_model_params(llama_cpp: Any) -> Iterator[bool]:
    """Around a ``llama_cpp.Llama(...)`` call: on an AMX build, its models are loaded without
    llama.cpp's extra CPU buffer types (``use_extra_bufts = False``: no AMX or repacked weight
    copies). The AMX matrix multiply crashes llama.cpp with a segmentation fault on some
    machines (ggml-org/llama.cpp#20824; seen here with llama-cpp-python 0.3.36 on a
    Sapphire Rapids VM, on the first decode of a Q4_1 model). ``LOCALMOE_LLAMACPP_AMX=1``
    keeps them. Yields whether the extra buffers were turned off."""
    low = getattr(llama_cpp, "llama_cpp", None)
    default = getattr(low, "llama_model_default_params", None)
    off = (default is not None and amx_build(llama_cpp)
           and not env_flag("LOCALMOE_LLAMACPP_AMX", False)
           and any(f[0] == "use_extra_bufts" for f in getattr(default(), "_fields_", ())))
    if not off:
        yield False
        return

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    low.llama_model_default_params = params
    try:
        yield True
    finally:
        low.llama_model_default_params = default


class _UnusedChatFormatter:
    """Stands in for ``llama_chat_format.Jinja2ChatFormatter`` while this backend loads a
    model: llama-cpp-python compiles every chat template in the file's metadata when it
    builds a ``Llama``, unsandboxed from our limits and with any Jinja2 error escaping
    (a template that does not compile made the whole load fail). localmoe applies chat
    templates itself (``localmoe.text.chat_template``) and never calls
    ``create_chat_completion``, so the metadata templates are not compiled at all."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        pass

    def to_chat_handler(self) -> Any:
        def handler(*args: Any, **kw: Any) -> Any:
            raise LocalMoEError("llama-cpp-python's chat handlers are not loaded by localmoe's "
                                "llamacpp backend (localmoe applies the chat template itself)")
        return handler


@contextlib.contextmanager
def _no_metadata_templates(llama_cpp: Any) -> Iterator[None]:
    """Around a ``llama_cpp.Llama(...)`` call: the GGUF's chat templates are not compiled by
    llama-cpp-python (see :class:`_UnusedChatFormatter`)."""
    fmt = getattr(llama_cpp, "llama_chat_format", None)
    real = getattr(fmt, "Jinja2ChatFormatter", None)
    if real is None:
        yield
        return
    fmt.Jinja2ChatFormatter = _UnusedChatFormatter
    try:
        yield
    finally:
        fmt.Jinja2ChatFormatter = real


#: limits of the llama.cpp llama-cpp-python ships (src/llama-hparams.h), asserted (abort) on load
LLAMA_MAX_EXPERTS = 512
LLAMA_MAX_LAYERS = 512


def _quiet_llama_logs(llama_cpp: Any) -> None:
    """Route llama.cpp's log lines: errors only (all with ``$LOCALMOE_DEBUG``), so they do not
    interleave with streamed text on the terminal. While a model loads they are collected
    instead (see :func:`_load_llama`)."""
    global _LOG_CB
    if _LOG_CB is not None or env_flag("LOCALMOE_DEBUG", False):
        return
    import sys

    # ggml_log_level in this llama.cpp: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5
    @llama_cpp.llama_log_callback
    def _cb(level, text, user_data):
        if level == 4:
            try:
                msg = text.decode("utf-8", "replace")
                if _LOAD_LOG is not None:
                    _LOAD_LOG.append(msg)
                    del _LOAD_LOG[:-20]
                else:
                    sys.stderr.write(msg)
            except Exception:
                pass

    _LOG_CB = _cb  # keep the ctypes callback alive
    llama_cpp.llama_log_set(_cb, ctypes.c_void_p(0))


def _llama_limits(model: Any) -> str | None:
    """Why llama.cpp would refuse or abort on ``model`` (None when it would not): the
    hyper-parameters it asserts on while loading (a failed assert kills the process, so they
    are checked here first) and the vocabulary size it requires of the embedding."""
    s = model.spec
    if s.n_experts > LLAMA_MAX_EXPERTS:
        return (f"the model has {s.n_experts} experts, above llama.cpp's limit of {LLAMA_MAX_EXPERTS} "
                f"(LLAMA_MAX_EXPERTS)")
    if s.n_layers > LLAMA_MAX_LAYERS:
        return f"the model has {s.n_layers} layers, above llama.cpp's limit of {LLAMA_MAX_LAYERS}"
    if s.rope_dim is not None and s.rope_dim != s.head_dim:
        return (f"its rope dimension ({s.rope_dim}) differs from the head size ({s.head_dim}), which "
                f"llama.cpp's {s.arch} graph asserts on")
    if s.v_head_dim != s.head_dim:
        return (f"its key and value head sizes differ ({s.head_dim} vs {s.v_head_dim}), which "
                f"llama.cpp's {s.arch} graph asserts on")
    n_tok = len(getattr(model, "metadata", {}).get("tokenizer.ggml.tokens") or [])
    if n_tok and n_tok != s.vocab_size:
        return (f"its vocabulary has {n_tok} entries but the embedding {s.vocab_size} rows "
                f"(llama.cpp needs them equal)")
    return None


def raw_llama(*args: Any, **kw: Any) -> Any:
    """``llama_cpp.Llama(*args, **kw)`` loaded as this backend loads its models
    (:func:`safe_model_params`): for references and benchmarks that call llama-cpp-python
    directly, so they compute as the backend does and do not crash on AMX builds."""
    import llama_cpp

    with safe_model_params(llama_cpp), _no_metadata_templates(llama_cpp):
        return llama_cpp.Llama(*args, **kw)


def _load_llama(llama_cpp: Any, path: str, **kw: Any) -> Any:
    """``llama_cpp.Llama(path, **kw)`` with llama.cpp's own error lines in the exception.

    llama-cpp-python sends stdout/stderr to /dev/null while loading (``verbose=False``), which
    also swallows the message of a native abort. Here the descriptors stay, its Python-side
    prints are captured, and llama.cpp's error log lines are collected for the message.

    Raises:
        ModelLoadError: llama.cpp could not load the file (with what llama.cpp said).
    """
    import io

    global _LOAD_LOG
    try:  # llama-cpp-python encodes the path as UTF-8 (a ValueError naming a surrogate)
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise ModelLoadError(
            f"llama.cpp could not load {path!r}: its path is not valid UTF-8, which llama.cpp "
            f"needs; rename the file (or its folder), or use --backend torch") from None
    # a failed GGML_ASSERT must print its one line and stop, not attach a debugger first
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    _LOAD_LOG = []
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink), \
                safe_model_params(llama_cpp) as off, _no_metadata_templates(llama_cpp):
            llm = llama_cpp.Llama(model_path=path, verbose=True, **kw)
        if off:
            log.info("llama.cpp built with AMX: weights loaded without the AMX/repacked copies "
                     "(llama.cpp#20824; LOCALMOE_LLAMACPP_AMX=1 keeps them)")
        return llm
    except (ValueError, RuntimeError, OSError) as e:
        said = " ".join(" ".join(_LOAD_LOG).split())
        said = f" (llama.cpp: {said[-400:]})" if said else ""
        raise ModelLoadError(f"llama.cpp could not load {path}: {e}{said}") from e
    finally:
        _LOAD_LOG = None


def _no_offload_reason(device: str | None) -> str:
    """Why a CUDA ``device`` cannot run on a llama-cpp-python built without GPU offload, with
    the way out that exists here: the triton/torch backends only where torch sees that GPU."""
    why = cuda_device_problem(device)
    if why:
        return f"{why} (and this llama-cpp-python build has no GPU support)"
    return ("this llama-cpp-python build has no GPU support; use --device cpu or "
            "--backend triton/torch")


def _default_threads() -> int:
    env = env_threads()  # refuses a value that is no thread count
    if env is not None:
        return env
    # llama-cpp-python's own default: half the logical CPUs (= physical cores with SMT). Its
    # threads spin at barriers, so oversubscribing a busy machine is far slower than fewer.
    return max(1, (os.cpu_count() or 1) // 2)


@register_backend("llamacpp")
class LlamaCppBackend(Backend):
    """Whole-model CPU fallback through llama-cpp-python (GGUF only)."""

    description = "llama.cpp through llama-cpp-python: GGUF on the CPU (f16/bf16/int8/int4 KV)"
    options = ("n_threads", "n_batch", "max_seqs")

    def accepts(self, option: str) -> bool:
        """Its own options, and the named parameters of ``llama_cpp.Llama`` (passed through)
        when llama-cpp-python is installed."""
        if option in self.options:
            return True
        if self.available():
            return False
        import inspect

        import llama_cpp

        params = inspect.signature(llama_cpp.Llama.__init__).parameters
        reserved = {"self", "model_path", "n_ctx", "n_ubatch", "n_threads_batch", "type_k",
                    "type_v", "n_gpu_layers", "flash_attn", "logits_all", "verbose"}
        return option in params and option not in reserved and \
            params[option].kind is not inspect.Parameter.VAR_KEYWORD

    def available(self) -> str | None:
        if importlib.util.find_spec("llama_cpp") is None:
            return "llama-cpp-python not installed (pip install 'localmoe[llamacpp]')"
        return None

    def supports(self, model_format: str, kv_spec: Any = None) -> str | None:
        if model_format != "gguf":
            return (f"llama.cpp runs GGUF files only, this model is {model_format}; use "
                    f"--backend torch, or convert it with llama.cpp's convert_hf_to_gguf.py")
        return _kv_reason(kv_spec)

    def check_device(self, device: str | None) -> str | None:
        """``cuda``/``cuda:N`` need a llama-cpp-python built with GPU offload; the index is
        checked against the CUDA devices torch sees when torch has CUDA (llama.cpp finds the
        same ones), else left to llama.cpp."""
        d = str(device or "cpu").strip().lower()
        if not d.startswith("cuda"):
            return None
        import llama_cpp

        if not llama_cpp.llama_supports_gpu_offload():
            return _no_offload_reason(device)
        import torch

        return cuda_device_problem(device) if torch.backends.cuda.is_built() else None

    def load(self, model: Any, *, n_ctx: int | None = None, kv_spec: Any = None,
             device: str | None = None, n_threads: int | None = None, n_batch: int = 512,
             max_seqs: int = 1, **options: Any) -> "LlamaCppRunner":
        """Load ``model`` (a GGUF ModelFile) into llama.cpp.

        Args:
            n_ctx: context size in tokens (default: the model's training context, max 4096).
            kv_spec: KVSpec (default f16); see the module docstring for the mapping.
            device: None/"cpu"; "cuda" offloads all layers when llama-cpp-python was built
                with GPU support (split over the GPUs as llama.cpp does), "cuda:N" onto GPU N
                alone (``main_gpu=N``, no split).
            n_threads: CPU threads (default ``$LOCALMOE_THREADS``, else half the logical CPUs).
            n_batch: prefill chunk in tokens.

        Raises:
            BackendUnavailableError: llama-cpp-python missing, or a GPU asked of a CPU build.
            KVCacheFormatError: a KV format or option llama.cpp does not have, e.g. int2 or
                explicit per-channel keys (before weights load).
            ModelLoadError: llama.cpp could not load the file.
        """
        why = self.available()
        if why:
            raise BackendUnavailableError(f"backend 'llamacpp' is not available: {why}")
        fmt = getattr(model, "format", "gguf")
        if fmt != "gguf":
            raise BackendUnavailableError(self.supports(fmt, None))
        from localmoe.kv.spec import KVSpec

        kv_spec = KVSpec.parse(kv_spec or "f16")
        why = _kv_reason(kv_spec)
        if why:
            raise KVCacheFormatError(why)
        import llama_cpp

        n_gpu_layers = 0
        dev = (device or "cpu").strip().lower()
        if dev == "gpu":
            dev = "cuda"
        if dev.startswith("cuda"):
            if not llama_cpp.llama_supports_gpu_offload():
                raise BackendUnavailableError(_no_offload_reason(device))
            n_gpu_layers = -1
            if dev[5:].isdigit():  # cuda:N: that GPU alone (plain cuda: llama.cpp's layer split)
                options.setdefault("main_gpu", int(dev[5:]))
                options.setdefault("split_mode", llama_cpp.LLAMA_SPLIT_MODE_NONE)
            elif dev != "cuda":
                raise BackendUnavailableError(f"llamacpp backend: unknown device {device!r}")
        elif dev != "cpu":
            raise BackendUnavailableError(f"llamacpp backend: unknown device {device!r}")
        spec = model.spec
        ctx = int(n_ctx or min(int(spec.n_ctx_train or 4096), 4096))
        tk, tv = KV_TYPE_MAP[kv_spec.k.name][0], KV_TYPE_MAP[kv_spec.v.name][0]
        flash = not (kv_spec.k.is_float and kv_spec.v.is_float)
        threads = check_threads(n_threads) if n_threads is not None else _default_threads()
        # llama.cpp opens a split set by its first shard only
        path = str((getattr(model, "shards", None) or [getattr(model, "path")])[0])
        nb = max(1, min(int(n_batch), ctx))
        why = _llama_limits(model)
        if why:
            raise UnsupportedModelError(f"llama.cpp cannot run {os.path.basename(path)}: {why}; "
                                        f"try --backend torch")
        if not (kv_spec.k.is_float and kv_spec.v.is_float):
            for side, dim in (("K", spec.head_dim), ("V", spec.v_head_dim)):
                if dim % 32:
                    raise KVCacheFormatError(
                        f"llama.cpp's quantized KV cache needs a head size that is a multiple of 32 "
                        f"({side} heads are {dim}); use --kv-cache f16 or --backend torch")
        _quiet_llama_logs(llama_cpp)
        llm = _load_llama(
            llama_cpp, path, n_ctx=ctx, n_batch=nb, n_ubatch=nb, n_threads=threads,
            n_threads_batch=threads, n_gpu_layers=n_gpu_layers, type_k=tk, type_v=tv,
            flash_attn=flash, logits_all=False, **options)
        return LlamaCppRunner(llm, spec, ctx, _as_run(kv_spec), dev,
                              threads=threads, n_batch=nb, flash_attn=flash,
                              max_seqs=max(1, int(max_seqs)))


class LlamaCppRunner:
    """Runner over one llama.cpp context (see docs/INTERFACES.md "Runner").

    Attributes:
        spec: ModelSpec; n_ctx: tokens; kv_spec: KVSpec; device: "cpu"|"cuda"|"cuda:N";
        backend_name: "llamacpp"; max_seqs: sequences the context can hold.
    """

    backend_name = "llamacpp"

    def __init__(self, llm: Any, spec: Any, n_ctx: int, kv_spec: Any, device: str, *,
                 threads: int, n_batch: int, flash_attn: bool, max_seqs: int = 1):
        import llama_cpp

        self._lc = llama_cpp
        self._llm = llm
        self.spec = spec
        self.n_ctx = int(n_ctx)
        self.kv_spec = kv_spec
        self.device = device
        self.max_seqs = int(max_seqs)
        self.threads = threads
        self.flash_attn = flash_attn
        self._n_batch = int(n_batch)
        self._ctx = llm.ctx
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        self.vocab_size = int(llama_cpp.llama_vocab_n_tokens(vocab))
        self._batch = llama_cpp.llama_batch_init(self._n_batch, 0, self.max_seqs)
        self._lens: dict[int, int] = {}
        self._closed = False

    # -- sequences ------------------------------------------------------------------------------
    def new_sequence(self) -> int:
        """Reserve a sequence id (0 .. max_seqs-1).

        Raises:
            LocalMoEError: all sequences are in use.
        """
        for sid in range(self.max_seqs):
            if sid not in self._lens:
                self._lens[sid] = 0
                self._lc.llama_memory_seq_rm(self._mem, sid, -1, -1)
                return sid
        raise LocalMoEError(f"llama.cpp context holds at most {self.max_seqs} sequence(s)")

    def free_sequence(self, seq_id: int) -> None:
        if seq_id in self._lens and not self._closed:
            self._lc.llama_memory_seq_rm(self._mem, seq_id, -1, -1)
        self._lens.pop(seq_id, None)

    def seq_len(self, seq_id: int) -> int:
        return self._lens[seq_id]

    def truncate(self, seq_id: int, n_tokens: int) -> None:
        """Keep the first ``n_tokens`` cached tokens of ``seq_id``.

        llama.cpp cannot cut some caches (e.g. sliding-window layers) in the middle; then the
        whole sequence is dropped and ``seq_len`` reports 0, so callers re-prefill.
        """
        n = max(0, min(int(n_tokens), self._lens[seq_id]))
        if n == self._lens[seq_id]:
            return
        ok = self._lc.llama_memory_seq_rm(self._mem, seq_id, n, -1)
        if not ok:
            self._lc.llama_memory_seq_rm(self._mem, seq_id, -1, -1)
            n = 0
        self._lens[seq_id] = n

    # -- compute --------------------------------------------------------------------------------
    def forward(self, batch: list[tuple[int, list[int]]], all_logits: bool = False) -> list:
        """Append each sequence's tokens and return float32 CPU logits per sequence:
        ``[vocab]`` for its last new token, or ``[T_i, vocab]`` when ``all_logits``.

        Raises:
            ContextOverflowError: a sequence would exceed ``n_ctx``.
            LocalMoEError: llama_decode failed.
        """
        import numpy as np
        import torch

        lc = self._lc
        for sid, toks in batch:
            if sid not in self._lens:
                raise LocalMoEError(f"unknown sequence id {sid}")
            if self._lens[sid] + len(toks) > self.n_ctx:
                raise ContextOverflowError(self._lens[sid] + len(toks), self.n_ctx)
            if not toks:
                raise LocalMoEError("forward() needs at least one token per sequence")
        # flatten to (seq, pos, token, want_logits), then run in chunks of n_batch
        items = []
        for k, (sid, toks) in enumerate(batch):
            start = self._lens[sid]
            last = len(toks) - 1
            for j, t in enumerate(toks):
                items.append((k, sid, start + j, int(t), all_logits or j == last))
        per_seq: list[list] = [[] for _ in batch]
        b = self._batch
        nv = self.vocab_size
        for c0 in range(0, len(items), self._n_batch):
            chunk = items[c0:c0 + self._n_batch]
            for i, (_, sid, pos, t, want) in enumerate(chunk):
                b.token[i] = t
                b.pos[i] = pos
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = sid
                b.logits[i] = 1 if want else 0
            b.n_tokens = len(chunk)
            rc = lc.llama_decode(self._ctx, b)
            if rc != 0:
                # the failed chunk may be partly in the cache: drop it
                for sid in {it[1] for it in chunk}:
                    lc.llama_memory_seq_rm(self._mem, sid, min(it[2] for it in chunk if it[1] == sid), -1)
                if rc == 1:
                    raise ContextOverflowError(chunk[-1][2] + 1, self.n_ctx,
                                               "llama.cpp found no free KV cache slot for the batch",
                                               hint="raise the context size (--ctx-size)")
                raise LocalMoEError(f"llama_decode failed with code {rc}")
            for i, (k, sid, pos, _t, want) in enumerate(chunk):
                self._lens[sid] = pos + 1
                if want:
                    ptr = lc.llama_get_logits_ith(self._ctx, i)
                    row = np.empty(nv, dtype=np.float32)
                    ctypes.memmove(row.ctypes.data, ptr, nv * 4)
                    per_seq[k].append(row)
        out = []
        for rows in per_seq:
            if all_logits:
                out.append(torch.from_numpy(np.stack(rows)))
            else:
                out.append(torch.from_numpy(rows[-1]))
        return out

    def stats(self) -> dict[str, Any]:
        """{"device", "kv_bytes" (allocated for n_ctx tokens), "kv_type_k", "kv_type_v",
        "n_threads", "flash_attn", "tokens_cached"}."""
        s = self.spec
        def side(name, dim):
            _, _, bpb, vpb = KV_TYPE_MAP[name]
            return dim * bpb / vpb
        per_tok = s.n_layers * s.n_kv_heads * (side(self.kv_spec.k.name, s.head_dim)
                                               + side(self.kv_spec.v.name, s.v_head_dim))
        return {"device": self.device, "kv_bytes": int(per_tok * self.n_ctx),
                "kv_type_k": KV_TYPE_MAP[self.kv_spec.k.name][1],
                "kv_type_v": KV_TYPE_MAP[self.kv_spec.v.name][1],
                "n_threads": self.threads, "flash_attn": self.flash_attn,
                "tokens_cached": sum(self._lens.values())}

    def close(self) -> None:
        """Free the batch, context and model (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._lc.llama_batch_free(self._batch)
        except Exception:
            pass
        try:
            self._llm.close()
        except Exception:
            pass
        self._lens.clear()

    def __del__(self):  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass
