"""Reference numerics of the shared transformer block, and the op set a backend swaps.

The block (:class:`localmoe.model.transformer.Transformer`) calls its numerics through an op set:
:class:`TorchOps` (this module, the reference: the exact float function of the weights) or
:class:`localmoe.model.ggml_numerics.GgmlOps` (llama.cpp's CPU roundings, for parity tests).
An op set supplies ``norm``, ``act``, ``linear`` (matmul of a named weight), the RoPE angles
and the MoE rounding hooks; attention and the MoE layer are separate hooks (``AttnFn`` here,
``MoEFn`` in :mod:`localmoe.model.moe`).

Formulas and their sources:

* RMSNorm: ``x / sqrt(mean(x^2) + eps) * w`` (Zhang & Sennrich 2019).
* RoPE: Su et al. 2021, "RoFormer". Two layouts (llama.cpp ``LLAMA_ROPE_TYPE_NORM`` /
  ``NEOX``): "norm" rotates interleaved pairs ``(x[2i], x[2i+1])`` (GGUF llama files, whose Q/K
  rows are permuted for this), "neox" rotates ``(x[i], x[i + d/2])`` (HF layout).
  ``theta_i = base^(-2i/d)``. Scaling: "linear" (positions / factor, Chen et al. 2023) and
  "yarn" (Peng et al. 2023, "YaRN": per-frequency blend of interpolation and extrapolation with a
  linear ramp between ``beta_fast`` and ``beta_slow`` rotations, cos/sin scaled by
  ``0.1 ln(factor) + 1``), as in HF ``modeling_rope_utils``.
* Attention: softmax(q k^T * scale) v with causal mask, grouped-query attention (Ainslie et al.
  2023), optional sliding window (a query at position p sees keys at p - window < j <= p, the
  llama.cpp/HF convention) and optional logit soft-capping (Gemma 2).
* FFN activations of the gated linear unit ``down(act(gate x) * up x)``: SiLU (SwiGLU) or
  tanh-GELU (GeGLU), Shazeer 2020, "GLU Variants Improve Transformer".
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from localmoe.errors import UnsupportedModelError

#: attention hook: ``attn(layer, q [N,H,D], k [N,Hkv,D], v [N,Hkv,Dv]) -> [N,H,Dv]`` (q/k after
#: RoPE); a runner routes it through its KV cache
AttnFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: ``x * rsqrt(mean(x^2) + eps) * w`` (Zhang & Sennrich 2019).

    Args:
        x: ``[..., n]`` float tensor.
        w: ``[n]`` weight (any offset such as Gemma's ``1 + w`` already applied) or None.
        eps: epsilon inside the square root.

    Returns:
        tensor shaped and typed like ``x`` (computed in float32 when ``x`` is half precision).
    """
    if x.dtype == torch.float32 and x.device.type == "cpu" and (w is None or w.dtype == x.dtype):
        # one fused op instead of seven (CPU decode is bound by per-op overhead); same formula
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if w is not None:
        y = y * w.float()
    return y.to(x.dtype)



def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The FFN gate activation named by ``ModelSpec.act`` (``silu`` | ``gelu_tanh`` | ``gelu``).

    Raises:
        UnsupportedModelError: unknown name.
    """
    if name == "silu":
        return torch.nn.functional.silu
    if name in ("gelu_tanh", "gelu_pytorch_tanh"):
        return lambda x: torch.nn.functional.gelu(x, approximate="tanh")
    if name == "gelu":
        return torch.nn.functional.gelu
    raise UnsupportedModelError(f"unknown FFN activation {name!r}; supported: silu, gelu_tanh, gelu")



def rope_inv_freq(rope_dim: int, base: float, scaling: dict | None = None,
                  n_ctx_train: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of RoPE, with optional scaling.

    Args:
        rope_dim: number of rotated dims per head (even).
        base: RoPE base (``rope.freq_base``).
        scaling: ``{"type": "linear"|"yarn"|"none", "factor": f, "original_context_length": n,
            "beta_fast": 32, "beta_slow": 1, "attn_factor": a}``; empty/None for plain RoPE.
        n_ctx_train: fallback for yarn's original context length.

    Returns:
        ``(inv_freq [rope_dim // 2] float32, mscale)`` where ``mscale`` multiplies cos and sin
        (1.0 except for YaRN).

    Raises:
        UnsupportedModelError: an unknown scaling type.
    """
    idx = torch.arange(0, rope_dim, 2, dtype=torch.float64)
    inv = 1.0 / (base ** (idx / rope_dim))
    scaling = scaling or {}
    kind = (scaling.get("type") or scaling.get("rope_type") or "none").lower()
    factor = float(scaling.get("factor") or 1.0)
    mscale = 1.0
    if kind in ("none", "default", "") or factor == 1.0 and kind != "yarn":
        pass
    elif kind == "linear":
        inv = inv / factor
    elif kind == "yarn":
        orig = float(scaling.get("original_context_length")
                     or scaling.get("original_max_position_embeddings") or n_ctx_train or 4096)
        beta_fast = float(scaling.get("beta_fast") or 32.0)
        beta_slow = float(scaling.get("beta_slow") or 1.0)

        def corr_dim(n_rot: float) -> float:
            return (rope_dim * math.log(orig / (n_rot * 2 * math.pi))) / (2 * math.log(base))

        low = max(math.floor(corr_dim(beta_fast)), 0)
        high = min(math.ceil(corr_dim(beta_slow)), rope_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extrap_w = 1.0 - ramp
        inv = (inv / factor) * (1 - extrap_w) + inv * extrap_w
        af = scaling.get("attn_factor") or scaling.get("attention_factor")
        mscale = float(af) if af else (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    else:
        raise UnsupportedModelError(
            f"unsupported rope scaling type {kind!r}; supported: none, linear, yarn")
    return inv.float(), mscale



def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, mscale: float = 1.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[T, rope_dim // 2]`` float32 for integer ``positions [T]``: angles
    ``p * inv_freq`` (llama.cpp's float32 recurrence is
    :meth:`localmoe.model.ggml_numerics.GgmlOps.rope_cos_sin`), both tables times ``mscale``."""
    ang = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
    return torch.cos(ang) * mscale, torch.sin(ang) * mscale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str = "neox"
               ) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` dims of each head (RoFormer, Su et al. 2021).

    Args:
        x: ``[T, H, D]`` queries or keys.
        cos, sin: ``[T, R/2]`` from :func:`rope_cos_sin` (R = rotated dims <= D).
        style: ``"norm"`` (interleaved pairs 2i, 2i+1; llama.cpp NORM) or ``"neox"``
            (pairs i, i + R/2).

    Returns:
        ``[T, H, D]`` in the dtype of ``x`` (rotation computed in float32).

    Raises:
        UnsupportedModelError: unknown style.
    """
    return apply_rope_tables(x, *rope_tables(cos, sin, style), style)



def rope_tables(cos: torch.Tensor, sin: torch.Tensor, style: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Expand ``[T, R/2]`` cos/sin into full-width ``[T, 1, R]`` tables for
    :func:`apply_rope_tables` (computed once per forward step, shared by q and k of every layer
    with the same RoPE base).

    Raises:
        UnsupportedModelError: unknown style.
    """
    if style == "neox":
        c, s = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    elif style == "norm":
        c, s = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
    else:
        raise UnsupportedModelError(f"unknown rope style {style!r}; expected 'norm' or 'neox'")
    return c[:, None, :], s[:, None, :]



def apply_rope_tables(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor, style: str
                      ) -> torch.Tensor:
    """``x * cos + rot(x) * sin`` over the first ``R = cos2.shape[-1]`` dims, where ``rot`` maps
    each pair ``(a, b)`` to ``(-b, a)``; tables from :func:`rope_tables`. ``x``: ``[T, H, D]``."""
    rd = cos2.shape[-1]
    xf = x.float()
    xr = xf[..., :rd] if rd < xf.shape[-1] else xf
    if style == "neox":
        half = rd // 2
        rot = torch.cat([-xr[..., half:], xr[..., :half]], -1)
    else:
        rot = torch.stack([-xr[..., 1::2], xr[..., 0::2]], -1).flatten(-2)
    out = xr * cos2 + rot * sin2
    if rd < xf.shape[-1]:
        out = torch.cat([out, xf[..., rd:]], -1)
    return out.to(x.dtype)



def rms_norm_packed(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """:func:`rms_norm` through the C kernel of :mod:`localmoe.cpu.qmatmul` for contiguous CPU
    float32 tensors (models loaded with packed weights); anything else goes to :func:`rms_norm`."""
    if (x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous()
            and (w is None or (w.dtype == torch.float32 and w.is_contiguous()))):
        from localmoe.cpu.qmatmul import rms_norm as _c_rms_norm

        return _c_rms_norm(x, w, eps)
    return rms_norm(x, w, eps)



def rope_signed_sin(sin2: torch.Tensor, style: str) -> torch.Tensor:
    """``sin2 [T, 1, R]`` of :func:`rope_tables` with the sign of ``rot`` folded in (``-sin`` on
    the first of each rotated pair), for :func:`apply_rope_swapped`."""
    R = sin2.shape[-1]
    if style == "neox":
        sign = torch.cat([-torch.ones(R // 2), torch.ones(R // 2)])
    else:
        sign = torch.tensor([-1.0, 1.0]).repeat(R // 2)
    return sin2 * sign.to(device=sin2.device, dtype=sin2.dtype)



def apply_rope_swapped(x: torch.Tensor, cos2: torch.Tensor, sin2s: torch.Tensor, style: str
                       ) -> torch.Tensor:
    """:func:`apply_rope_tables` in fewer ops, bit-identical: ``x * cos + swap(x) * sin2s`` where
    ``swap`` exchanges the two members of each rotated pair and ``sin2s`` comes from
    :func:`rope_signed_sin` (``(-b) * s == b * (-s)`` exactly). ``x [T, H, D]`` float32 with
    ``D == R`` (cos2, sin2s ``[T, 1, R]``); returns ``[T, H, D]`` float32.

    Raises:
        ValueError: other dtypes or partial rotary dims (use :func:`apply_rope_tables`)."""
    R = cos2.shape[-1]
    if x.dtype != torch.float32 or x.shape[-1] != R:
        raise ValueError("apply_rope_swapped needs float32 x with D == R")
    if style == "neox":
        sw = x.unflatten(-1, (2, R // 2)).flip(-2).flatten(-2)
    else:
        sw = x.unflatten(-1, (R // 2, 2)).flip(-1).flatten(-2)
    return x * cos2 + sw * sin2s



def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_start: int, scale: float,
              window: int | None = None, softcap: float | None = None,
              ggml_f16: bool = False) -> torch.Tensor:
    """Causal (optionally sliding-window) grouped-query attention of new queries over keys.

    The ``T`` queries sit at positions ``q_start .. q_start+T-1``; keys/values at ``0 .. L-1``
    with ``L >= q_start + T``. Query at position p sees key j iff ``j <= p`` and (no window or
    ``p - j < window``).

    Args:
        q: ``[T, H, D]``; k: ``[L, Hkv, D]``; v: ``[L, Hkv, Dv]`` with ``H % Hkv == 0``.
        q_start: position of the first query (tokens).
        scale: logit scale (usually ``1/sqrt(D)``).
        window: sliding window in tokens or None.
        softcap: ``cap * tanh(logits / cap)`` before the mask (Gemma 2) or None.
        ggml_f16: round q and the softmax probabilities to fp16 before their matmuls with an
            f16 K/V cache, as llama.cpp's (non flash-attention) CPU graph does; only for the
            ``numerics="ggml"`` parity mode.

    Returns:
        ``[T, H, Dv]`` float32 (dtype of ``q`` if that is float32/64).
    """
    T, H, D = q.shape
    L, Hkv, _ = k.shape
    need_mask = T > 1 or L > q_start + T or (window is not None and q_start + 1 > window)
    mask = None
    if need_mask:
        qpos = torch.arange(q_start, q_start + T, device=q.device)[:, None]
        kpos = torch.arange(L, device=q.device)[None, :]
        mask = kpos <= qpos
        if window:
            mask = mask & (qpos - kpos < window)
    if not softcap and not ggml_f16:
        o = torch.nn.functional.scaled_dot_product_attention(
            q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None],
            v.float().transpose(0, 1)[None], attn_mask=mask, scale=scale, enable_gqa=H != Hkv)
        return o[0].transpose(0, 1)
    g = H // Hkv
    qf = q.float()
    if ggml_f16:  # llama.cpp's CPU graph with an F16 cache rounds q (and p below) to fp16
        qf = qf.half().float()
    qf = qf.reshape(T, Hkv, g, D).permute(1, 2, 0, 3)                # [Hkv, g, T, D]
    kf = k.float().permute(1, 2, 0)                                   # [Hkv, D, L]
    vf = v.float().permute(1, 0, 2)                                   # [Hkv, L, Dv]
    s = torch.matmul(qf, kf.unsqueeze(1)) * scale                     # [Hkv, g, T, L]
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    if ggml_f16:
        p = p.half().float()
    o = torch.matmul(p, vf.unsqueeze(1))                              # [Hkv, g, T, Dv]
    return o.permute(2, 0, 1, 3).reshape(T, H, vf.shape[-1])


class TorchOps:
    """The reference op set of the shared block: the exact float function of the weights.

    A backend or a numerics mode supplies another op set (a subclass, e.g.
    :class:`localmoe.model.ggml_numerics.GgmlOps`) to change how the block computes without
    touching the block itself.

    Attributes:
        name: ``"exact"`` (reported as ``Transformer.numerics``).
        norm: ``norm(x [..., n], w [n] | None, eps) -> like x``: :func:`rms_norm`, or with
            ``packed`` the C kernel of :mod:`localmoe.cpu.qmatmul` (:func:`rms_norm_packed`).
        act: the FFN gate activation (:func:`activation` of ``act``), elementwise.
        rope: ``rope(x [T, H, D], cos2, sin2, style) -> like x``: :func:`apply_rope_tables`
            (a backend may swap in a one-launch kernel).

    Args:
        act: ``ModelSpec.act`` name (``silu`` | ``gelu_tanh`` | ``gelu``).
        packed: the model keeps packed CPU matmul weights (its norms go through the C kernel).

    Raises:
        UnsupportedModelError: unknown activation.
    """

    name = "exact"

    def __init__(self, act: str, *, packed: bool = False):
        self.act = activation(act)
        self.norm = rms_norm_packed if packed else rms_norm
        self.rope = apply_rope_tables

    def bind(self, layer: int, key: str, names: tuple[str, ...], weights: dict) -> None:
        """Announce the matmul weight ``key`` of ``layer`` (-1: the lm head) before the model
        fuses it from the file tensors ``names`` (stacked along the output dim in that order;
        ``weights[name]`` holds each part). The reference keeps nothing."""

    def linear(self, x: torch.Tensor, wt, layer: int, key: str) -> torch.Tensor:
        """``x [N, in] @ wt [in, out]`` for the weight ``key`` of ``layer`` (stored transposed);
        a :class:`localmoe.cpu.qmatmul.PackedLinear` (or any backend linear object, not a
        tensor) multiplies through its own kernel. Returns ``[N, out]``."""
        if not isinstance(wt, torch.Tensor):
            return wt(x)
        return x @ wt

    def rope_cos_sin(self, positions: torch.Tensor, inv_freq: torch.Tensor, mscale: float,
                     base: float, scaling: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables ``[T, R/2]`` float32 of a layer whose RoPE has ``base`` and
        ``scaling`` (:func:`rope_cos_sin`)."""
        return rope_cos_sin(positions, inv_freq, mscale)

    def moe_input(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' input ``x [N, d_model]`` of ``layer`` (the reference: as is)."""
        return x

    def moe_hidden(self, layer: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """A rounding of the experts' hidden activations before ``down`` in ``layer``, or None
        (the reference)."""
        return None
