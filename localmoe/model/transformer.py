"""One shared decoder-only transformer (dense and MoE) built from a :class:`ModelSpec`.

Every family runs through the same block (:meth:`Transformer.block`); ``models/<family>.py``
only declares what differs (a :class:`Family` subclass). The attention itself is a callback
(``attn(layer, q, k, v) -> out``) supplied by the caller, so a runner can route it through its
paged KV cache and a faster backend can override just that op.

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
* FFN: gated linear unit ``down(act(gate x) * up x)`` with SiLU (SwiGLU) or tanh-GELU (GeGLU),
  Shazeer 2020, "GLU Variants Improve Transformer".
* MoE: routed experts (localmoe.model.routing) computed by grouping tokens per expert
  (argsort + index_add), plus optional shared experts with a sigmoid gate (Qwen2-MoE).

Tensor names are the canonical GGUF names (INTERFACES.md); shapes are torch order.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np
import torch

from localmoe.cpu.qmatmul import PackedLinear, PackedWeight
from localmoe.errors import UnsupportedModelError
from localmoe.model.experts import ExpertProvider, ResidentExpertProvider
from localmoe.model.ggml_numerics import (GGML_VEC_DOT_TYPE, ggml_act_quant, ggml_activation,  # noqa: F401
                            ggml_q8_1_min_correction, ggml_rms_norm,
                            ggml_rope_angles, ggml_weight_numerics)
from localmoe.model.routing import route, shared_expert_gate
from localmoe.model.spec import ModelSpec

AttnFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# --------------------------------------------------------------------------------------------
# primitive ops
# --------------------------------------------------------------------------------------------


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


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, mscale: float = 1.0,
                 ggml_base: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[T, rope_dim // 2]`` float32 for integer ``positions [T]``.

    ``ggml_base``: instead of ``p * inv_freq``, build the angles the way llama.cpp's
    ``rope_cache_init`` does (unscaled RoPE): ``theta_0 = p``, ``theta_{i+1} = theta_i *
    powf(base, -2/R)`` in float32 -- whose rounding grows with the position (``numerics="ggml"``).
    """
    if ggml_base is not None:
        ang = ggml_rope_angles(positions, inv_freq.shape[0], ggml_base)
    else:
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


def _rms_norm_packed(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
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


def moe_ffn(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, provider: ExpertProvider,
            layer: int, act: Callable[[torch.Tensor], torch.Tensor],
            quant_h: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Routed expert mixture, tokens grouped by expert (no Python loop over tokens).

    The ``N * top_k`` (token, expert) assignments are sorted by expert id (stable argsort); each
    used expert then runs once on its gathered tokens and the weighted outputs are scattered
    back with ``index_add_``.

    Args:
        x: ``[N, d_model]`` FFN input (after the FFN norm).
        weights: ``[N, top_k]`` float mixing weights (localmoe.model.routing.route).
        ids: ``[N, top_k]`` int64 expert ids.
        provider: where expert weights come from (``prepare`` is called with the used ids).
        layer: block index.
        act: gate activation.
        quant_h: optional rounding of the hidden activations before ``down`` (ggml numerics).

    Returns:
        ``[N, d_model]`` dtype of ``x``.
    """
    N, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // k
    w_sorted = weights.reshape(-1)[order].to(x.dtype)
    counts = torch.bincount(flat, minlength=provider.n_experts)
    used = torch.nonzero(counts).flatten()
    provider.prepare(layer, used)
    ends = torch.cumsum(counts, 0)
    out = torch.zeros_like(x)
    used_l = used.tolist()
    ends_l = ends[used].tolist()
    cnt_l = counts[used].tolist()
    for e, end, c in zip(used_l, ends_l, cnt_l):
        start = end - c
        t = tok[start:end]
        xs = x.index_select(0, t)
        g, u, d = provider.expert(layer, e)
        h = act(xs @ g.t()) * (xs @ u.t())
        if quant_h is not None:
            h = quant_h(h)
        y = (h @ d.t()) * w_sorted[start:end, None]
        out.index_add_(0, t, y)
    return out


# --------------------------------------------------------------------------------------------
# families
# --------------------------------------------------------------------------------------------


class Family:
    """What an architecture family changes relative to the shared block.

    Subclasses (one small file per family in ``models/``) set class attributes and may override
    :meth:`configure`. Features visible from tensor names (q/k norm, q/k/v bias, post norms,
    shared experts and their gate, dense vs MoE layers) are detected from the file, not declared.

    Attributes:
        arch: GGUF ``general.architecture``.
        gguf_rope_style: rotation layout of this arch's GGUF files (``norm`` | ``neox``).
        gguf_norm_topk_prob: llama.cpp's fixed renormalization choice for this arch (its graph
            builder hard-codes it), or None to use the spec.
        qk_norm_full: q/k RMSNorm over the whole projection (OLMoE) instead of per head.
        act: FFN activation, or None to use ``spec.act``.
    """

    arch: str = ""
    gguf_rope_style: str = "neox"
    gguf_norm_topk_prob: bool | None = None
    qk_norm_full: bool = False
    act: str | None = None

    def configure(self, spec: ModelSpec, model_format: str, tensor_names: set[str]) -> ModelSpec:
        """Return the spec this family runs with (a copy; the loader's spec is not mutated)."""
        upd: dict = {}
        if model_format == "gguf":
            upd["rope_style"] = self.gguf_rope_style
            if self.gguf_norm_topk_prob is not None and spec.is_moe:
                upd["norm_topk_prob"] = self.gguf_norm_topk_prob
        if self.act:
            upd["act"] = self.act
        upd["qk_norm"] = "blk.0.attn_q_norm.weight" in tensor_names
        upd["qk_norm_full"] = self.qk_norm_full
        upd["post_norms"] = "blk.0.post_attention_norm.weight" in tensor_names or spec.post_norms
        upd["attn_bias"] = "blk.0.attn_q.bias" in tensor_names
        upd["tie_embeddings"] = "output.weight" not in tensor_names
        return dataclasses.replace(spec, **upd)


FAMILIES: dict[str, type[Family]] = {}


def register_family(arch: str) -> Callable[[type[Family]], type[Family]]:
    """Class decorator registering a :class:`Family` for GGUF architecture ``arch``."""

    def deco(cls: type[Family]) -> type[Family]:
        cls.arch = arch
        FAMILIES[arch] = cls
        return cls

    return deco


def get_family(arch: str) -> Family:
    """The registered family of ``arch``.

    Raises:
        UnsupportedModelError: no family registered for ``arch``.
    """
    from localmoe import models  # noqa: F401  (registers the built-in families)

    if arch not in FAMILIES:
        raise UnsupportedModelError(
            f"architecture {arch!r} is not supported; supported: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[arch]()


# --------------------------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------------------------

_NORM_SUFFIXES = ("_norm.weight",)
#: per-layer matmul weights, stored transposed ``[in, out]`` in :attr:`Transformer.layers`
_LINEAR_KEYS = ("wqkv", "wo", "gate_up", "down", "sh_gate_up", "sh_down", "router")
_MAX_TRANSPOSED_OUTPUT_BYTES = 256 << 20
#: GGUF tensors that may be kept packed (``packed`` in :meth:`Transformer.from_model_file`)
_PACKABLE_SUFFIXES = tuple(f"{n}.weight" for n in (
    "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
    "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "token_embd")) + ("output.weight",)


class Transformer:
    """A decoder-only transformer: embeddings, ``n_layers`` shared blocks, final norm, lm head.

    Args:
        spec: the configured spec (see :meth:`Family.configure`).
        weights: GGUF-named float tensors on one device (norm offsets already applied), or
            for matmul weights on the CPU a :class:`localmoe.cpu.qmatmul.PackedWeight` (kept
            packed, see ``packed`` in :meth:`from_model_file`); the constructor fuses q/k/v and
            gate/up into single matrices and *consumes* the dict (fused sources are popped from
            it so their memory is freed as it goes).
        experts: provider of routed expert weights (None for dense models).

    Raises:
        ModelLoadError: a required tensor is missing.
    """

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor],
                 experts: ExpertProvider | None = None,
                 act_types: dict[str, str | None] | None = None,
                 block_mins: dict[str, torch.Tensor] | None = None):
        from localmoe.errors import ModelLoadError

        self.spec = spec
        self.experts = experts
        #: "exact" (float matmuls) or "ggml" (activations rounded like llama.cpp's CPU backend)
        self.numerics = "ggml" if act_types is not None else "exact"
        at = act_types or {}
        self._aq: dict[tuple[int, str], list[tuple[int, str | None]] | None] = {}
        self._act = activation(spec.act) if act_types is None else ggml_activation(spec.act)
        self._norm = rms_norm if act_types is None else ggml_rms_norm
        w = weights

        def need(name: str) -> torch.Tensor:
            if name not in w:
                raise ModelLoadError(f"tensor {name!r} is missing from the model file; the file "
                                     f"does not match architecture {spec.arch!r}")
            return w[name]

        def lin(t):  # a packed matmul weight becomes a (one-part) PackedLinear
            return PackedLinear([t]) if isinstance(t, PackedWeight) else t

        def fuse(*ts):  # fused projection [sum N, K]: packed if every part is, else float
            if all(isinstance(t, PackedWeight) for t in ts):
                return PackedLinear(ts)
            ts = [t.dequantize() if isinstance(t, PackedWeight) else t for t in ts]
            return torch.cat(ts, 0).contiguous()

        te = need("token_embd.weight")
        out_w = w.get("output.weight", te)
        tied = out_w is te
        self.tok_embd = lin(te)
        self.output = self.tok_embd if tied else lin(out_w)
        #: True when the matmul weights are kept packed (CPU kernel of localmoe.cpu.qmatmul)
        self.packed = isinstance(self.tok_embd, PackedLinear) or isinstance(self.output, PackedLinear)
        if self.packed:
            self._norm = _rms_norm_packed
        if isinstance(self.output, PackedLinear):
            self.output_t = None
        else:
            # lm head transposed too, unless that duplicates a large tied embedding
            nb = self.output.numel() * self.output.element_size()
            self.output_t = (self.output.t().contiguous()
                             if not tied or nb <= _MAX_TRANSPOSED_OUTPUT_BYTES else None)
            if not tied and self.output_t is not None:
                self.output = None
        self.output_norm = need("output_norm.weight")
        self.layers: list[dict[str, torch.Tensor]] = []
        self._mins: dict[tuple[int, str], list[torch.Tensor | None]] = {}

        def parts(layer, key, *names):
            if act_types is not None:
                self._aq[(layer, key)] = [(w[n].shape[0], at.get(n)) for n in names]
                if block_mins and any(n in block_mins for n in names):
                    self._mins[(layer, key)] = [block_mins.get(n) for n in names]

        parts(-1, "output", "output.weight" if "output.weight" in w else "token_embd.weight")
        for i in range(spec.n_layers):
            p = f"blk.{i}."
            L: dict[str, torch.Tensor] = {}
            parts(i, "wqkv", p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight")
            parts(i, "wo", p + "attn_output.weight")
            if p + "ffn_gate.weight" in w:
                parts(i, "gate_up", p + "ffn_gate.weight", p + "ffn_up.weight")
                parts(i, "down", p + "ffn_down.weight")
            if p + "ffn_gate_shexp.weight" in w:
                parts(i, "sh_gate_up", p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight")
                parts(i, "sh_down", p + "ffn_down_shexp.weight")
            if act_types is not None and p + "ffn_gate_exps.weight" in at:
                self._aq[(i, "exps_in")] = [(0, at[p + "ffn_gate_exps.weight"])]
                self._aq[(i, "exps_down")] = [(0, at[p + "ffn_down_exps.weight"])]
            L["attn_norm"] = need(p + "attn_norm.weight")
            q, k, v = need(p + "attn_q.weight"), need(p + "attn_k.weight"), need(p + "attn_v.weight")
            L["wqkv"] = fuse(q, k, v)
            self._q_out, self._k_out = q.shape[0], k.shape[0]
            del q, k, v
            if spec.attn_bias:
                L["bqkv"] = torch.cat([need(p + "attn_q.bias"), need(p + "attn_k.bias"),
                                       need(p + "attn_v.bias")], 0)
            L["wo"] = lin(need(p + "attn_output.weight"))
            for opt in ("attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm"):
                if p + opt + ".weight" in w:
                    L[opt] = w[p + opt + ".weight"]
            L["ffn_norm"] = need(p + "ffn_norm.weight")
            if p + "ffn_gate_inp.weight" in w:
                L["router"] = w[p + "ffn_gate_inp.weight"]
                if p + "exp_probs_b.bias" in w:
                    L["exp_bias"] = w[p + "exp_probs_b.bias"]
                if p + "ffn_up_shexp.weight" in w:
                    L["sh_gate_up"] = fuse(need(p + "ffn_gate_shexp.weight"),
                                           need(p + "ffn_up_shexp.weight"))
                    L["sh_down"] = lin(need(p + "ffn_down_shexp.weight"))
                    if p + "ffn_gate_inp_shexp.weight" in w:
                        L["sh_gate"] = w[p + "ffn_gate_inp_shexp.weight"]
            else:
                L["gate_up"] = fuse(need(p + "ffn_gate.weight"), need(p + "ffn_up.weight"))
                L["down"] = lin(need(p + "ffn_down.weight"))
            for n in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up", "ffn_gate_shexp",
                      "ffn_up_shexp", "attn_output", "ffn_down", "ffn_down_shexp", "ffn_gate_inp"):
                w.pop(p + n + ".weight", None)
            # matmul weights are kept transposed, [in, out] contiguous: x @ W_t reads memory
            # ~1.5x faster than x @ W.t() on the CPU (GEMV is bandwidth bound)
            for key in _LINEAR_KEYS:
                if key in L and not isinstance(L[key], PackedLinear):
                    L[key] = L[key].t().contiguous()
            self.layers.append(L)
        if any("router" in L for L in self.layers) and experts is None:
            raise ModelLoadError("the model has MoE layers but no expert provider was given")
        self.device = self.tok_embd.device
        self.dtype = self.tok_embd.dtype
        self.scale = spec.attn_scale if spec.attn_scale else 1.0 / math.sqrt(spec.head_dim)
        self._rope: dict[tuple, tuple[torch.Tensor, float]] = {}

    # ---- construction from a file ----
    @classmethod
    def from_model_file(cls, model_file, *, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32,
                        experts: ExpertProvider | None = None,
                        spec: ModelSpec | None = None, numerics: str = "exact",
                        packed: bool | None = None) -> "Transformer":
        """Load a model from a :class:`localmoe.io.loader.ModelFile` (dequantizing every tensor,
        or keeping GGUF block-quantized matmul weights packed, see ``packed``).

        Args:
            model_file: an open ModelFile (``.spec``, ``.format``, ``.tensor_names()``,
                ``.load_tensor(name, dtype, device)``).
            device, dtype: where and in which float type weights live.
            experts: a custom provider (e.g. offloading); default resident.
            spec: an already configured spec (default: configure ``model_file.spec``).
            numerics: ``"exact"`` (float32 matmuls on the dequantized weights: the reference) or
                ``"ggml"`` (GGUF only: additionally round each quantized matmul's input
                activations to the weight type's ggml ``vec_dot_type`` as llama.cpp's CPU
                backend does -- for tight parity checks against llama.cpp).
            packed: keep the GGUF block-quantized matmul weights (q/k/v/o, FFN, shared experts,
                embedding/lm head; types Q4_0/1, Q5_0/1, Q8_0, Q4_K, Q5_K, Q6_K) packed in memory
                and multiply them with the exact CPU kernel of :mod:`localmoe.cpu.qmatmul` (same
                function as the float32 path up to float32 summation order; ~4-6x fewer bytes
                read per decoded token). ``None`` (default): on when the model is GGUF, the
                device is the CPU, ``dtype`` float32, ``numerics="exact"`` and the kernel builds;
                ``False``: always dequantize to float; ``True``: require it.

        Raises:
            UnsupportedModelError: unknown architecture; ModelLoadError: missing tensors.
            ValueError: unknown ``numerics``; ``packed=True`` where it cannot apply (not GGUF,
                not CPU float32, ``numerics="ggml"``) or the kernel cannot be built (reason
                given).
        """
        if numerics not in ("exact", "ggml"):
            raise ValueError(f"numerics must be 'exact' or 'ggml', got {numerics!r}")
        use_packed = False
        if packed is not False:
            why = None
            if model_file.format != "gguf" or not hasattr(model_file, "raw_tensor"):
                why = "the model is not a GGUF file"
            elif torch.device(device).type != "cpu" or dtype != torch.float32:
                why = "packed weights run on the CPU in float32 only"
            elif numerics != "exact":
                why = "numerics='ggml' computes on float weights"
            else:
                from localmoe.cpu.qmatmul import kernel_status

                why = kernel_status()
            use_packed = why is None
            if packed and why:
                raise ValueError(f"packed weights requested but unavailable: {why}")
        names = set(model_file.tensor_names())
        if spec is None:
            spec = get_family(model_file.spec.arch).configure(model_file.spec, model_file.format,
                                                              names)
        off = float(spec.norm_weight_offset or 0.0)

        def load(name: str) -> torch.Tensor:
            t = model_file.load_tensor(name, dtype=torch.float32, device="cpu")
            if off and name.endswith(_NORM_SUFFIXES):
                t = t + off
            return t.to(device=device, dtype=dtype)

        def load_linear(name: str):
            if use_packed and name.endswith(_PACKABLE_SUFFIXES):
                from localmoe.cpu.qmatmul import PACKABLE_QTYPES, pack_gguf

                raw = model_file.raw_tensor(name)
                if raw.qtype in PACKABLE_QTYPES and len(raw.shape) == 2:
                    return pack_gguf(raw.data, raw.qtype, raw.shape)
            return load(name)

        weights = {n: load_linear(n) for n in sorted(names) if "_exps." not in n}
        if experts is None and spec.is_moe:
            moe_layers = [i for i in range(spec.n_layers) if f"blk.{i}.ffn_gate_inp.weight" in names]
            experts = ResidentExpertProvider.from_loader(moe_layers, load)
        act_types, mins = None, None
        if numerics == "ggml" and model_file.format == "gguf":
            act_types, mins = ggml_weight_numerics(model_file, names, device)
        return cls(spec, weights, experts, act_types, mins)

    def _mm(self, x: torch.Tensor, wt: torch.Tensor, layer: int, key: str) -> torch.Tensor:
        """``x @ wt`` for a transposed weight ``wt [in, out]``; in ggml numerics each column
        block of a fused ``wt`` sees ``x`` rounded to its own weight type's ggml vec_dot type."""
        if type(wt) is PackedLinear:
            return wt(x)
        parts = self._aq.get((layer, key)) if self._aq else None
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

    # ---- pieces ----
    def rope_for_layer(self, layer: int) -> tuple[float, dict]:
        """(rope base, scaling dict) of ``layer``: sliding-window layers of families with a local
        base (Gemma 3) use ``rope_base_local`` without scaling."""
        s = self.spec
        if s.rope_base_local and s.layer_window(layer):
            return float(s.rope_base_local), {}
        return float(s.rope_base), dict(s.rope_scaling or {})

    def _inv_freq(self, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
        key = (base, tuple(sorted((k, str(v)) for k, v in scaling.items())))
        if key not in self._rope:
            rd = self.spec.rope_dim or self.spec.head_dim
            inv, ms = rope_inv_freq(rd, base, scaling, self.spec.n_ctx_train)
            self._rope[key] = (inv.to(self.device), ms)
        return self._rope[key]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[N]`` int64 token ids -> ``[N, d_model]`` (times ``embed_scale`` if set)."""
        if type(self.tok_embd) is PackedLinear:
            x = self.tok_embd.rows(tokens)
        else:
            x = self.tok_embd.index_select(0, tokens)
        if self.spec.embed_scale:
            x = x * self.spec.embed_scale
        return x

    def ffn(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Dense or MoE FFN of ``layer`` on ``[N, d_model]`` (input already normed)."""
        L = self.layers[layer]
        s = self.spec
        if "router" not in L:
            gu = self._mm(x, L["gate_up"], layer, "gate_up")
            g, u = gu.chunk(2, dim=-1)
            return self._mm(self._act(g) * u, L["down"], layer, "down")
        logits = x @ L["router"]
        w, ids = route(logits, s.top_k, gating=s.gating, norm_topk_prob=s.norm_topk_prob,
                       expert_weights_scale=s.expert_weights_scale,
                       selection_bias=L.get("exp_bias"))
        if (layer, "exps_in") in self._aq:
            k_in, k_down = self._aq[(layer, "exps_in")][0][1], self._aq[(layer, "exps_down")][0][1]
            out = moe_ffn(ggml_act_quant(x, k_in), w, ids, self.experts, layer, self._act,
                          quant_h=lambda h: ggml_act_quant(h, k_down))
        else:
            out = moe_ffn(x, w, ids, self.experts, layer, self._act)
        if "sh_gate_up" in L:
            gu = self._mm(x, L["sh_gate_up"], layer, "sh_gate_up")
            g, u = gu.chunk(2, dim=-1)
            sh = self._mm(self._act(g) * u, L["sh_down"], layer, "sh_down")
            if "sh_gate" in L:
                sh = sh * shared_expert_gate(x, L["sh_gate"])
            out = out + sh
        return out

    def block(self, layer: int, x: torch.Tensor, rope: tuple[torch.Tensor, ...],
              attn: AttnFn) -> torch.Tensor:
        """One transformer block on ``x [N, d_model]``; ``rope`` = full-width (cos, sin) tables
        ``[N, 1, R]`` (:func:`rope_tables`) for this layer's base, optionally followed by the
        signed sin table of :func:`rope_signed_sin` (enables the fewer-op CPU float32 path);
        ``attn(layer, q[N,H,D], k[N,Hkv,D], v[N,Hkv,Dv]) -> [N,H,Dv]``."""
        s = self.spec
        L = self.layers[layer]
        N = x.shape[0]
        eps = s.norm_eps
        h = self._norm(x, L["attn_norm"], eps)
        qkv = self._mm(h, L["wqkv"], layer, "wqkv")
        if "bqkv" in L:
            qkv = qkv + L["bqkv"]
        cos2, sin2 = rope[0], rope[1]
        if (len(rope) > 2 and not s.qk_norm and qkv.dtype == torch.float32
                and cos2.shape[-1] == s.head_dim):
            # q and k are adjacent columns of qkv: rotate them as one [N, H + Hkv, D] tensor
            qk = qkv[:, :self._q_out + self._k_out].unflatten(-1, (-1, s.head_dim))
            qk = apply_rope_swapped(qk, cos2, rope[2], s.rope_style)
            q, k = qk[:, :s.n_heads], qk[:, s.n_heads:]
            v = qkv[:, self._q_out + self._k_out:].unflatten(-1, (s.n_kv_heads, s.v_head_dim))
            o = attn(layer, q, k, v).reshape(N, -1)
            return self._block_tail(layer, x, o)
        q, k, v = qkv.split([self._q_out, self._k_out, qkv.shape[1] - self._q_out - self._k_out], -1)
        if s.qk_norm and s.qk_norm_full:
            q = self._norm(q, L["attn_q_norm"], eps)
            k = self._norm(k, L["attn_k_norm"], eps)
        q = q.reshape(N, s.n_heads, s.head_dim)
        k = k.reshape(N, s.n_kv_heads, s.head_dim)
        v = v.reshape(N, s.n_kv_heads, s.v_head_dim)
        if s.qk_norm and not s.qk_norm_full:
            q = self._norm(q, L["attn_q_norm"], eps)
            k = self._norm(k, L["attn_k_norm"], eps)
        if len(rope) > 2 and q.dtype == torch.float32 and cos2.shape[-1] == s.head_dim:
            q = apply_rope_swapped(q, cos2, rope[2], s.rope_style)
            k = apply_rope_swapped(k, cos2, rope[2], s.rope_style)
        else:
            q = apply_rope_tables(q, cos2, sin2, s.rope_style)
            k = apply_rope_tables(k, cos2, sin2, s.rope_style)
        o = attn(layer, q, k, v).reshape(N, -1)
        return self._block_tail(layer, x, o)

    def _block_tail(self, layer: int, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Rest of :meth:`block` after attention: output projection, residuals, FFN."""
        s = self.spec
        L = self.layers[layer]
        eps = s.norm_eps
        if o.dtype != x.dtype:
            o = o.to(x.dtype)
        o = self._mm(o, L["wo"], layer, "wo")
        if "post_attention_norm" in L:
            o = self._norm(o, L["post_attention_norm"], eps)
        x = x + o
        f = self.ffn(layer, self._norm(x, L["ffn_norm"], eps))
        if "post_ffw_norm" in L:
            f = self._norm(f, L["post_ffw_norm"], eps)
        return x + f

    def forward_hidden(self, tokens: torch.Tensor, positions: torch.Tensor, attn: AttnFn
                       ) -> torch.Tensor:
        """Run all blocks; returns the final-normed hidden states ``[N, d_model]``.

        Args:
            tokens: ``[N]`` int64 ids (all sequences of a batch concatenated).
            positions: ``[N]`` int64 absolute positions of those tokens.
            attn: attention callback (sees each layer's q/k/v after RoPE).
        """
        x = self.embed(tokens)
        tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        for i in range(self.spec.n_layers):
            base, scaling = self.rope_for_layer(i)
            inv, ms = self._inv_freq(base, scaling)
            key = (base, id(inv))
            if key not in tables:
                gb = base if self.numerics == "ggml" and not scaling else None
                tables[key] = rope_tables(*rope_cos_sin(positions, inv, ms, ggml_base=gb),
                                          self.spec.rope_style)
                if self.device.type == "cpu":   # CUDA keeps the original op sequence
                    tables[key] += (rope_signed_sin(tables[key][1], self.spec.rope_style),)
            x = self.block(i, x, tables[key], attn)
        return self._norm(x, self.output_norm, self.spec.norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, d_model]`` -> ``[N, vocab_size]`` float32 (final soft-cap applied if set)."""
        if type(self.output) is PackedLinear:
            out = self.output(hidden)
        elif self.output_t is not None:
            out = self._mm(hidden, self.output_t, -1, "output").float()
        else:
            out = self._mm(hidden, self.output.t(), -1, "output").float()
        cap = self.spec.final_logit_softcap
        if cap:
            out = cap * torch.tanh(out / cap)
        return out

    def layer_window(self, layer: int) -> int | None:
        """Sliding window (tokens) of ``layer`` or None."""
        return self.spec.layer_window(layer)

    def forward_full(self, tokens: torch.Tensor) -> torch.Tensor:
        """Cache-free forward of one sequence at positions ``0..N-1``: ``[N]`` -> logits
        ``[N, vocab]`` float32 (the test oracle for cached/batched paths)."""
        pos = torch.arange(tokens.shape[0], device=tokens.device)

        def attn(layer, q, k, v):
            return attention(q, k, v, q_start=0, scale=self.scale,
                             window=self.layer_window(layer), softcap=self.spec.attn_logit_softcap)

        return self.logits(self.forward_hidden(tokens, pos, attn))
