"""llama.cpp CPU-backend numerics, for the opt-in ``numerics="ggml"`` parity mode.

The reference engine (``numerics="exact"``) computes the exact float function of the dequantized
weights. llama.cpp's CPU backend deviates from that function in a few deterministic ways; this
module reproduces them so that parity tests against llama.cpp on a *quantized* file can be tight:

* quantized matmuls: the activations are first quantized to the weight type's ``vec_dot_type``
  (ggml-cpu ``type_traits_cpu``): Q8_0 (blocks of 32, fp16 scale) for Q4_0/Q5_0/Q8_0, Q8_1 (same
  values plus an fp16 ``d * sum(q)``) for Q4_1/Q5_1, Q8_K (blocks of 256, fp32 scale) for the
  K-quants, a cast for F16/BF16 weights;
* RoPE angles built by the float32 recurrence ``theta_{i+1} = theta_i * base^(-2/R)``;
* attention with an F16 K/V cache: q and the softmax probabilities rounded to fp16
  (``ggml_f16`` of :func:`localmoe.model.ops.attention`, set by the runner).

:class:`GgmlOps` bundles them as one op set of the shared block (beside the reference
:class:`localmoe.model.ops.TorchOps`). Nothing here is used by the default ``numerics="exact"``
path.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from localmoe.cpu.qmatmul import PackedLinear
from localmoe.model.ops import TorchOps, activation

# ggml-cpu type_traits_cpu[type].vec_dot_type, by weight type name
GGML_VEC_DOT_TYPE = {
    "Q4_0": "q8_0", "Q5_0": "q8_0", "Q8_0": "q8_0", "Q4_1": "q8_1", "Q5_1": "q8_1",
    "Q2_K": "q8_K", "Q3_K": "q8_K", "Q4_K": "q8_K", "Q5_K": "q8_K", "Q6_K": "q8_K",
    "IQ4_XS": "q8_K", "IQ4_NL": "q8_0", "F16": "f16", "BF16": "bf16",
}


def _ggml_q8(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dequantized x, fp32 block scale d [..., nb, 1], block sum of q [..., nb, 1])."""
    B = 256 if kind == "q8_K" else 32
    K = x.shape[-1]
    xb = x.float().reshape(*x.shape[:-1], K // B, B)
    amax = xb.abs().amax(-1, keepdim=True)
    # ggml: id = 127.f / amax (a correctly rounded fp32 division). Not ``127.0 / amax``: torch
    # evaluates scalar / tensor as reciprocal(amax) * 127, off by one ulp in ~25% of blocks,
    # which flips the rounding of values that land on (or within an ulp of) a .5 tie -- common
    # when the activations come straight from a Q8_0 embedding row.
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv)           # _mm256_round_ps / nearest_int: round half to even
    if kind == "q8_K":
        # quantize_row_q8_K_ref: iscale = -127/max (max = signed value of largest |x|),
        # q = nearest_int(iscale * x), fp32 d = 1/iscale; the sign cancels in q * d
        d = torch.where(amax > 0, 1.0 / inv, torch.zeros_like(amax))
        ds = d
    else:
        d = amax / 127.0                # fp32, stored as fp16
        ds = d.half().float()
    return (q * ds).reshape(x.shape).to(x.dtype), d, q.sum(-1, keepdim=True)


def ggml_act_quant(x: torch.Tensor, kind: str | None) -> torch.Tensor:
    """Round activations the way llama.cpp's CPU backend does before a quantized dot product.

    ``q8_0``/``q8_1``: per 32 values ``d = amax/127`` (stored fp16), ``q = round(x * 127/amax)``;
    ``q8_K``: per 256 values, fp32 scale (ggml-quants.c / ggml-cpu ``quantize_row_q8_*``);
    ``f16``/``bf16``: a cast. Returns ``q * d`` (shape and dtype of ``x [..., K]``); ``None``
    returns ``x``.
    """
    if kind is None:
        return x
    if kind == "f16":
        return x.half().to(x.dtype)
    if kind == "bf16":
        return x.bfloat16().to(x.dtype)
    if x.shape[-1] % (256 if kind == "q8_K" else 32):
        return x
    return _ggml_q8(x, kind)[0]


def ggml_q8_1_min_correction(x: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """Correction for Q4_1/Q5_1 weights (``w = d q + m`` per block of 32): ggml adds
    ``m * s`` with ``s = fp16(d_x * sum(q_x))`` (block_q8_1.s) where ``x_deq @ W`` has
    ``m * fp16(d_x) * sum(q_x)``. ``x [N, K]``, ``mins [out, K/32]`` -> ``[N, out]``."""
    _, d, qs = _ggml_q8(x, "q8_1")
    c = ((d * qs).half().float() - d.half().float() * qs).squeeze(-1)   # [N, K/32]
    return c @ mins.t()


def ggml_weight_numerics(model_file, names, device) -> tuple[dict, dict]:
    """Per-tensor ggml data for a GGUF ``model_file``: ``(act_types, block_mins)`` where
    ``act_types[name]`` is the vec_dot type of the tensor's weight type (None for F32) and
    ``block_mins[name]`` the ``[out, K/32]`` fp32 block minimums of Q4_1/Q5_1 tensors (non-expert)."""
    act_types, mins = {}, {}
    for n in names:
        qt = model_file.tensor_info(n).qtype
        act_types[n] = GGML_VEC_DOT_TYPE.get(qt)
        if qt in ("Q4_1", "Q5_1") and "_exps." not in n:
            raw = model_file.raw_tensor(n)
            bb = 20 if qt == "Q4_1" else 24
            blocks = np.ascontiguousarray(raw.data).reshape(*raw.data.shape[:-1], -1, bb)
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
            mins[n] = torch.from_numpy(m.astype(np.float32)).to(device)
    return act_types, mins


def ggml_rope_angles(positions: torch.Tensor, half: int, base: float) -> torch.Tensor:
    """RoPE angles ``[T, half]`` the way llama.cpp's ``rope_cache_init`` builds them (unscaled
    RoPE): ``theta_0 = p``, ``theta_{i+1} = theta_i * powf(base, -2/R)`` in float32, whose
    rounding grows with the position."""
    step = torch.tensor(float(base), dtype=torch.float64).pow(-1.0 / half).float()
    step = step.to(positions.device)
    th = positions.to(torch.float32)
    cols = []
    for _ in range(half):
        cols.append(th)
        th = th * step
    return torch.stack(cols, -1)


def ggml_rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm as ggml-cpu computes it (``ggml_compute_forward_rms_norm_f32`` then ``MUL``):
    fp32 squares summed in double, ``mean = (float)(sum / n)``, ``scale = 1.0f / sqrtf(mean +
    eps)`` in fp32, ``y = (x * scale) * w``. Bit-identical to llama.cpp on the same fp32 input;
    the exact path's ``rsqrt(mean(x^2) + eps)`` differs by an ulp, enough to flip the 8-bit
    rounding of activations that sit on a .5 tie (layer 0 of a Q8_0-embedding model)."""
    xf = x.float()
    ss = (xf * xf).double().sum(-1, keepdim=True)
    mean = (ss / x.shape[-1]).float()
    # sqrtf via float64 (exact after rounding back); torch's fp32 CPU sqrt is not correctly
    # rounded (~15% of inputs off by an ulp on AVX2)
    var = mean + torch.tensor(eps, dtype=torch.float32, device=x.device)
    scale = 1.0 / torch.sqrt(var.double()).float()
    y = xf * scale
    if w is not None:
        y = y * w.float()
    return y.to(x.dtype)


def _gelu_tanh_f32(x: torch.Tensor) -> torch.Tensor:
    """ggml_gelu_f32 in fp32 steps: ``0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2)))``
    (tanh evaluated in float64 and rounded, i.e. a correctly rounded tanhf)."""
    c = torch.tensor(0.79788456080286535587989211986876, dtype=torch.float32)
    a = torch.tensor(0.044715, dtype=torch.float32)
    inner = c * x * (1.0 + a * x * x)
    return 0.5 * x * (1.0 + torch.tanh(inner.double()).float())


def ggml_gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """tanh-GELU as ggml-cpu's GEGLU evaluates it (``GGML_GELU_FP16``, the default): for
    ``-10 < x < 10`` the input is rounded to fp16 and the result read from a 65536-entry table
    of fp16 GELU values (0 below -10, ``x`` above 10). That is a relative error of up to ~5e-4
    against the exact function on every FFN activation of a GeGLU model (Gemma)."""
    xf = x.float()
    table = _gelu_tanh_f32(xf.half().float()).half().float()
    y = torch.where(xf <= -10.0, torch.zeros_like(xf), torch.where(xf >= 10.0, xf, table))
    return y.to(x.dtype)


def ggml_activation(name: str):
    """The FFN gate activation of the ggml numerics mode: fp16-table GELU for ``gelu_tanh``
    (see :func:`ggml_gelu_tanh`); otherwise the exact activation (SiLU in ggml is a fp32 SIMD
    polynomial within ~1 ulp of the exact one)."""
    if name in ("gelu_tanh", "gelu_pytorch_tanh"):
        return ggml_gelu_tanh
    return activation(name)


class GgmlOps(TorchOps):
    """The op set of the ``numerics="ggml"`` parity mode: llama.cpp's CPU-backend roundings.

    * ``norm``: :func:`ggml_rms_norm`; ``act``: :func:`ggml_activation`;
    * ``linear``: the input rounded to each weight part's ``vec_dot_type`` (:func:`ggml_act_quant`;
      a fused weight such as q/k/v sees one rounding per part) plus the Q4_1/Q5_1 block-minimum
      correction (:func:`ggml_q8_1_min_correction`);
    * RoPE angles of unscaled layers by llama.cpp's float32 recurrence (:func:`ggml_rope_angles`);
    * MoE: the routed experts' input and hidden activations rounded to the expert weights'
      vec_dot types.

    Args:
        act: ``ModelSpec.act`` name.
        act_types: ``{gguf tensor name: vec_dot type or None}`` (:func:`ggml_weight_numerics`).
        block_mins: ``{gguf tensor name: [out, K/32] float32}`` of Q4_1/Q5_1 tensors.

    Raises:
        UnsupportedModelError: unknown activation.
    """

    name = "ggml"

    def __init__(self, act: str, act_types: dict[str, str | None],
                 block_mins: dict[str, torch.Tensor] | None = None):
        super().__init__(act)
        self.act = ggml_activation(act)
        self.norm = ggml_rms_norm
        self._types = dict(act_types)
        self._block_mins = block_mins or {}
        self._parts: dict[tuple[int, str], list[tuple[int, str | None]]] = {}
        self._mins: dict[tuple[int, str], list[torch.Tensor | None]] = {}

    @classmethod
    def from_model_file(cls, model_file, names, device, act: str) -> "GgmlOps":
        """The op set of a GGUF ``model_file`` whose tensors ``names`` go to ``device``."""
        act_types, mins = ggml_weight_numerics(model_file, names, device)
        return cls(act, act_types, mins)

    def bind(self, layer: int, key: str, names: tuple[str, ...], weights: dict) -> None:
        """Record the rows and vec_dot type of each part of the weight ``key`` (and the block
        minimums of Q4_1/Q5_1 parts) before the model fuses them."""
        self._parts[(layer, key)] = [(weights[n].shape[0], self._types.get(n)) for n in names]
        if any(n in self._block_mins for n in names):
            self._mins[(layer, key)] = [self._block_mins.get(n) for n in names]

    def linear(self, x: torch.Tensor, wt, layer: int, key: str) -> torch.Tensor:
        """``x @ wt`` where each column block of a fused ``wt [in, out]`` sees ``x`` rounded to
        its own weight type's vec_dot type (plus the Q4_1/Q5_1 correction)."""
        if type(wt) is PackedLinear:
            return wt(x)
        parts = self._parts.get((layer, key))
        if not parts:
            return x @ wt
        mins = self._mins.get((layer, key))
        kinds = {k for _, k in parts}
        if len(kinds) == 1 and not mins:
            return ggml_act_quant(x, parts[0][1]) @ wt
        outs, r = [], 0
        for j, (n, k) in enumerate(parts):
            o = ggml_act_quant(x, k) @ wt[:, r:r + n]
            if mins and mins[j] is not None:
                o = o + ggml_q8_1_min_correction(x, mins[j])
            outs.append(o)
            r += n
        return torch.cat(outs, -1)

    def rope_cos_sin(self, positions: torch.Tensor, inv_freq: torch.Tensor, mscale: float,
                     base: float, scaling: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Unscaled RoPE: angles as llama.cpp's ``rope_cache_init`` builds them
        (:func:`ggml_rope_angles`); scaled RoPE: the reference tables."""
        if scaling:
            return super().rope_cos_sin(positions, inv_freq, mscale, base, scaling)
        ang = ggml_rope_angles(positions, inv_freq.shape[0], base)
        return torch.cos(ang) * mscale, torch.sin(ang) * mscale

    def moe_input(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """``x`` rounded to the vec_dot type of ``layer``'s ``ffn_gate_exps`` weights."""
        return ggml_act_quant(x, self._types.get(f"blk.{layer}.ffn_gate_exps.weight"))

    def moe_hidden(self, layer: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """Rounding to the vec_dot type of ``layer``'s ``ffn_down_exps`` weights (None: F32)."""
        kind = self._types.get(f"blk.{layer}.ffn_down_exps.weight")
        if kind is None:
            return None
        return lambda h: ggml_act_quant(h, kind)
