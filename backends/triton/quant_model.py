"""The triton backend's weights: GGUF tensors kept in their quantized blocks on the GPU.

:func:`load_quant_model` builds the shared :class:`~localmoe.model.transformer.Transformer`
with

* every 2-D matmul weight (attention q/k/v/o, dense FFN, shared expert, embedding, lm head) as
  a :class:`QuantLinear`: one or more :class:`~localmoe.kernels.qtensor.QuantTensor` parts
  (fused q/k/v and gate/up stay one part where their types agree), multiplied by
  :func:`~localmoe.kernels.quant_gemv.quant_gemv` for 1-8 tokens (decode) and
  :func:`~localmoe.kernels.quant_gemm.quant_gemm` above (prefill); the embedding is a row
  gather (:func:`~localmoe.kernels.quant_gemm.dequantize_rows`);
* the routed experts as :class:`QuantExperts`: per MoE layer gate and up interleaved
  ``[E, 2F, D]`` and down ``[E, D, F]``, plus the ``slot_of`` table (identity) the kernels read
  expert ids through -- the offload manager's seam;
* norms, biases and routers as float tensors (routers float32: the routing decision is taken on
  unrounded logits, as llama.cpp's F32 router weights give).

No float copy of a quantized weight is made on the GPU or the host: blocks go from the
memory-mapped file through a few reused pinned buffers (:class:`~localmoe.io.staging.PinnedStager`)
to the device and are repacked there (:meth:`QuantTensor.from_gguf`); the block scales of all
tensors are checked for NaN/Inf with one host read at the end.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Sequence

import torch

from localmoe.errors import ModelLoadError, UnsupportedModelError
from localmoe.io.staging import PinnedStager
from localmoe.model.experts import ExpertProvider

#: decode: up to this many tokens go through the GEMV kernel, more through the GEMM
GEMV_MAX_TOKENS = 8
#: GGUF tensors loaded as QuantLinear (2-D matmul weights)
_LINEAR_SUFFIXES = tuple(f"{n}.weight" for n in (
    "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
    "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "token_embd")) + ("output.weight",)
_EXPERT_PARTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


class QuantLinear:
    """A matmul weight ``[N, K]`` on the GPU made of QuantTensor parts stacked along N.

    The shared transformer treats it like :class:`localmoe.cpu.qmatmul.PackedLinear`: it is
    called (``y = lin(x)``), fused (:meth:`fuse_linear`) and gathered (:meth:`rows`), never
    transposed.

    Args:
        parts: 2-D QuantTensors with equal K, in output order (consecutive parts of one qtype
            are joined into one, so fused q/k/v or gate/up run as one kernel when they can).
        dtype: the activations' dtype (what :meth:`rows` and ``__call__`` return).

    Raises:
        ModelLoadError: parts of different K.
    """

    def __init__(self, parts: Sequence[Any], dtype: torch.dtype = torch.float16):
        from localmoe.kernels.qtensor import QuantTensor

        if len({p.K for p in parts}) != 1:
            raise ModelLoadError("cannot fuse weights of different input widths: "
                                 + ", ".join(f"{p.name} {p.shape}" for p in parts))
        groups: list[list[Any]] = []
        for p in parts:
            if groups and groups[-1][0].qtype == p.qtype:
                groups[-1].append(p)
            else:
                groups.append([p])
        self.parts = []
        for g in groups:
            if len(g) == 1:
                self.parts.append(g[0])
            else:
                planes = {k: torch.cat([p.planes[k] for p in g], 0) for k in g[0].planes}
                self.parts.append(QuantTensor(g[0].qtype, (sum(p.N for p in g), g[0].K),
                                              planes, "+".join(str(p.name) for p in g)))
        self.in_features = self.parts[0].K
        self.out_features = sum(p.N for p in self.parts)
        self.dtype = dtype
        self.device = self.parts[0].device

    @classmethod
    def fuse_linear(cls, parts: Sequence["QuantLinear"]) -> "QuantLinear":
        """One QuantLinear whose output rows are those of ``parts`` in order."""
        return cls([q for p in parts for q in p.parts], parts[0].dtype)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        """Bytes of every part's planes on the device."""
        return sum(p.nbytes for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K]`` -> ``[M, N]`` in ``self.dtype``: GEMV kernel for ``M <=``
        :data:`GEMV_MAX_TOKENS` (activations quantized to int8 blocks once for all parts),
        else the GEMM kernel; float parts through torch."""
        from localmoe.kernels.quant_gemm import quant_gemm
        from localmoe.kernels.quant_gemv import quant_gemv, quantize_act

        if x.dtype != self.dtype:
            x = x.to(self.dtype)
        if not x.is_contiguous():
            x = x.contiguous()
        m = x.shape[0]
        out = torch.empty((m, self.out_features), dtype=self.dtype, device=x.device)
        xa = None
        c = 0
        for p in self.parts:
            y = out[:, c:c + p.N] if len(self.parts) > 1 else out
            c += p.N
            if p.is_float:
                y.copy_(x @ p.planes["w"].to(self.dtype).T)
            elif m <= GEMV_MAX_TOKENS:
                if xa is None:
                    xa = quantize_act(x)
                quant_gemv(xa, p, out=y)
            else:
                quant_gemm(x, p, out=y)
        return out

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        """``[R, K]`` in ``self.dtype``: rows ``idx`` (int64 ``[R]``) of the weight (embedding
        lookup; one part, as a token table always is)."""
        from localmoe.kernels.quant_gemm import dequantize_rows

        if len(self.parts) != 1:
            raise ValueError("rows() needs a single-part weight")
        p = self.parts[0]
        if p.is_float:
            return p.planes["w"].index_select(0, idx).to(self.dtype)
        return dequantize_rows(p, idx, dtype=self.dtype)

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, K]`` (tests and references only: materializes the float weight)."""
        return torch.cat([p.dequantize().reshape(p.N, p.K) for p in self.parts], 0)


class QuantExperts(ExpertProvider):
    """Routed experts of every MoE layer, resident on the GPU in their quantized blocks.

    Attributes:
        gate_up: layer -> QuantTensor ``[E, 2F, D]`` (gate row ``2f``, up row ``2f+1``).
        down: layer -> QuantTensor ``[E, D, F]``.
        slot_of: layer -> int32 ``[E]`` device tensor, expert -> slot in the stacked tensors
            (identity: every expert resident). The kernels read expert ids through it.
        identity_slots: True while every ``slot_of`` table is the identity: the decode
            kernels then skip reading it (:meth:`slots`). Whatever fills the tables with
            anything else (the offload manager) sets it False before graphs are captured.
    """

    def __init__(self, gate_up: dict[int, Any], down: dict[int, Any]):
        self.gate_up, self.down = gate_up, down
        first = next(iter(gate_up.values()))
        self.n_experts = first.shape[0]
        self.slot_of = {i: torch.arange(self.n_experts, dtype=torch.int32, device=first.device)
                        for i in gate_up}
        # LOCALMOE_MOE_SLOT_TABLE=1: read the (identity) tables anyway, for comparisons
        self.identity_slots = os.environ.get("LOCALMOE_MOE_SLOT_TABLE", "0") != "1"

    def slots(self, layer: int) -> torch.Tensor | None:
        """The slot table the decode kernels of ``layer`` read, or None while the tables are
        the identity (:func:`localmoe.kernels.fused_moe.fused_moe` then reads expert ``e``'s
        rows from slot ``e``, one dependent load less per program)."""
        return None if self.identity_slots else self.slot_of[layer]

    def layers(self) -> list[int]:
        return sorted(self.gate_up)

    def expert(self, layer: int, e: int):
        """``(gate [F, D], up [F, D], down [D, F])`` float32 of expert ``e`` (dequantized: for
        the reference MoE hook and tests, not the fast path)."""
        gu = self.gate_up[layer]
        f2, d = gu.shape[1], gu.shape[2]
        w = gu.dequantize(slice(e * f2, (e + 1) * f2))
        dn = self.down[layer].dequantize(slice(e * d, (e + 1) * d))
        return w[0::2], w[1::2], dn

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.gate_up.values(), *self.down.values()))


def quant_unavailable(model_file, numerics: str = "exact") -> str | None:
    """Why ``model_file`` cannot keep its weights quantized on the GPU (the triton backend then
    dequantizes them to the compute dtype), or None."""
    from localmoe.io.dequant import QTYPE_NAMES
    from localmoe.kernels.qtensor import SUPPORTED_QTYPES

    if model_file.format != "gguf" or not hasattr(model_file, "raw_tensor"):
        return "the model is not a GGUF file"
    if numerics != "exact":
        return "numerics='ggml' computes on float weights"
    for n in model_file.tensor_names():
        if n.endswith(_LINEAR_SUFFIXES) or "_exps." in n:
            qt = model_file.raw_tensor(n).qtype
            if qt not in SUPPORTED_QTYPES:
                return (f"tensor {n!r} has quant type {QTYPE_NAMES.get(qt, qt)}, which the kernels "
                        "do not read")
    return None


def check_fits(need: int, device) -> None:
    """Refuse a load whose weights (``need`` bytes) cannot fit the free memory of a CUDA
    ``device`` (a 5% + 256 MiB margin for the KV cache's neighbours and the CUDA context).

    Raises:
        ModelLoadError: names the bytes needed and free, and the ways out.
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return
    free, _total = torch.cuda.mem_get_info(dev)
    if need * 1.05 + (256 << 20) > free:
        gib = 1 << 30
        raise ModelLoadError(
            f"the model's weights need {need / gib:.1f} GiB of GPU memory and {dev} has "
            f"{free / gib:.1f} GiB free; use a smaller quantization, a larger or less busy GPU, "
            "or run on the CPU (--backend llamacpp or torch); expert offload (--vram-budget) "
            "is not available yet")


def _expert_parts(model_file, layer: int, device, load_q) -> tuple[Any, Any]:
    p = f"blk.{layer}."
    g, u, d = (load_q(p + n + ".weight") for n in _EXPERT_PARTS)
    from localmoe.kernels.qtensor import QuantTensor

    if g.qtype != u.qtype or g.shape != u.shape:
        raise UnsupportedModelError(
            f"layer {layer}: ffn_gate_exps and ffn_up_exps differ in type or shape; the fused MoE "
            "kernel needs them alike (use --backend torch or llamacpp)")
    if g.is_float or d.is_float:
        raise UnsupportedModelError(
            f"layer {layer}: float expert weights are not read by the fused MoE kernels "
            "(use --backend torch or llamacpp)")
    return QuantTensor.interleave_rows(g, u, name=p + "ffn_gate_up_exps"), d


def load_quant_model(model_file, *, device: str | torch.device, dtype: torch.dtype,
                     progress: Callable[[int, int], None] | None = None):
    """Build the Transformer of a GGUF file with its weights quantized on ``device``.

    Args:
        model_file: an open GGUF ModelFile.
        device: a CUDA device (or the CPU under ``TRITON_INTERPRET=1``, for tests).
        dtype: the activations' dtype (float16 on the GPU).
        progress: ``progress(bytes_done, bytes_total)`` after each tensor.
    Returns:
        the Transformer (``model.experts`` a :class:`QuantExperts` for MoE files).
    Raises:
        UnsupportedModelError: a quant type the kernels do not read (names the tensor), or
            expert weights the fused kernel cannot take.
        ModelLoadError: missing tensors, a NaN/Inf block scale (names the tensor), weights
            larger than the GPU's free memory (checked before loading), or the GPU running out
            of memory during the load (what was allocated is freed).
    """
    from localmoe.kernels.qtensor import QuantTensor
    from localmoe.models.family import get_family

    names = sorted(model_file.tensor_names())
    spec = get_family(model_file.spec.arch).configure(model_file.spec, model_file.format, set(names))
    off = float(spec.norm_weight_offset or 0.0)
    total = sum(math.prod(model_file.raw_tensor(n).data.shape) for n in names) or 1
    check_fits(total, device)
    done = 0

    def tick(n: str) -> None:
        nonlocal done
        done += math.prod(model_file.raw_tensor(n).data.shape)
        if progress is not None:
            progress(done, total)

    stager = PinnedStager(device) if torch.device(device).type == "cuda" else None
    # (name, qtype, finite flag) per quantized tensor, read at the end; not the tensors, so that
    # gate and up are freed once joined
    checks: list[tuple[str, int, torch.Tensor]] = []

    def load_q(n: str):
        t = QuantTensor.from_gguf(model_file.raw_tensor(n), None, None, device=device, name=n,
                                  stager=stager, check=False)
        if not t.is_float:
            checks.append((n, t.qtype, t.finite_flag()))
        tick(n)
        return t

    def load_f(n: str, dt: torch.dtype) -> torch.Tensor:
        t = model_file.load_tensor(n, dtype=torch.float32, device="cpu")
        if off and n.endswith("_norm.weight"):
            t = t + off
        tick(n)
        t = t.to(dt)
        # through the stager too: a copy from pageable memory would drain the stream (and the
        # quantized tensors' pipeline) at each of the ~5 norms and router rows per layer
        return stager.to_device(t) if stager is not None else t.to(device)

    try:
        model = _build(model_file, spec, names, device, dtype, load_q, load_f)
        _check_flags(checks)
        return model
    except torch.cuda.OutOfMemoryError:
        pass
    finally:
        checks.clear()
        if stager is not None:
            stager.close()
    # raised outside the handler, so the failed load's frames and tensors are already gone
    torch.cuda.empty_cache()
    raise ModelLoadError(
            f"the GPU ran out of memory while loading {total / (1 << 30):.1f} GiB of weights onto "
            f"{device} (what was loaded is freed); free GPU memory or run on the CPU "
            "(--backend llamacpp or torch)")


def _check_flags(checks: list[tuple[str, int, torch.Tensor]]) -> None:
    """Raise the error of the first tensor whose block scales hold NaN/Inf: one host read for
    all the tensors' flags (a read per tensor would drain the load's copy pipeline each time)."""
    from localmoe.kernels.qtensor import nonfinite_error

    if not checks:
        return
    ok = torch.stack([f for *_, f in checks]).cpu()
    if not bool(ok.all()):
        name, qtype, _ = checks[int((~ok).nonzero()[0])]
        raise nonfinite_error(name, qtype)


def _build(model_file, spec, names, device, dtype, load_q, load_f):
    from localmoe.model.transformer import Transformer

    weights: dict[str, Any] = {}
    for n in names:
        if "_exps." in n:
            continue
        if n.endswith(_LINEAR_SUFFIXES) and len(model_file.raw_tensor(n).shape) == 2:
            weights[n] = QuantLinear([load_q(n)], dtype)
        else:
            weights[n] = load_f(n, torch.float32 if n.endswith("ffn_gate_inp.weight") else dtype)
    experts = None
    moe_layers = [i for i in range(spec.n_layers) if f"blk.{i}.ffn_gate_inp.weight" in names]
    if moe_layers:
        gu, dn = {}, {}
        for i in moe_layers:
            gu[i], dn[i] = _expert_parts(model_file, i, device, load_q)
        experts = QuantExperts(gu, dn)
    return Transformer(spec, weights, experts)
