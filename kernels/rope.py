"""Rotary position embedding in one launch (Su et al. 2021, "RoFormer").

``y = x * cos + rot(x) * sin`` over the first ``R`` dims of every head, where ``rot`` maps each
rotated pair ``(a, b)`` to ``(-b, a)``; pairs are ``(i, i + R/2)`` ("neox", HF layout) or
``(2i, 2i+1)`` ("norm", llama.cpp's NORM layout of GGUF llama files). ``cos``/``sin`` are the
full-width per-token tables ``[T, 1, R]`` of :func:`localmoe.model.ops.rope_tables`; dims past
``R`` pass through. Computed in float32, stored in ``x``'s dtype: the function of the twin
(:func:`rope_ref`, the shared model's ``apply_rope_tables``), which takes ~7 launches per call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from localmoe.kernels.host import cdiv, next_pow2

__all__ = ["rope", "rope_ref"]


@triton.jit
def rope_partner(d, R, NEOX: tl.constexpr):
    """``(partner, sign)`` of dims ``d``: ``rot(x)[d] = sign * x[partner]`` over the first
    ``R`` dims (pairs ``(i, i + R/2)`` for "neox", ``(2i, 2i+1)`` for "norm")."""
    if NEOX:
        half = R // 2
        partner = tl.where(d < half, d + half, d - half)
        sign = tl.where(d < half, -1.0, 1.0)
    else:
        partner = d ^ 1
        sign = tl.where(d % 2 == 0, -1.0, 1.0)
    return partner, sign


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, H, D, R, x_ts, x_hs, c_ts, y_ts, y_hs,
                 NEOX: tl.constexpr, HB: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1) * HB + tl.arange(0, HB)
    d = tl.arange(0, BD)
    hm = h < H
    m = hm[:, None] & (d < D)[None, :]
    base = x_ptr + t.to(tl.int64) * x_ts + h[:, None] * x_hs
    x = tl.load(base + d[None, :], mask=m, other=0.0).to(tl.float32)
    rot_m = d < R
    partner, sign = rope_partner(d, R, NEOX)
    xp = tl.load(base + partner[None, :], mask=m & rot_m[None, :], other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t.to(tl.int64) * c_ts + d, mask=rot_m, other=1.0)
    s = tl.load(sin_ptr + t.to(tl.int64) * c_ts + d, mask=rot_m, other=0.0)
    y = tl.where(rot_m[None, :], x * c[None, :] + sign[None, :] * xp * s[None, :], x)
    yp = y_ptr + t.to(tl.int64) * y_ts + h[:, None] * y_hs + d[None, :]
    tl.store(yp, y.to(y_ptr.dtype.element_ty), mask=m)


def rope(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor, style: str) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` (any float dtype; the last dim contiguous) with the float32
    tables ``cos2``/``sin2`` ``[T, 1, R]`` (``R <= D``, even). Returns a new ``[T, H, D]`` tensor
    in ``x.dtype``.

    Raises:
        ValueError: an unknown ``style`` or tables that do not fit ``x``.
    """
    if style not in ("neox", "norm"):
        raise ValueError(f"rope: unknown style {style!r}; expected 'neox' or 'norm'")
    t, h, d = x.shape
    r = cos2.shape[-1]
    if cos2.shape[0] != t or r > d or r % 2 or sin2.shape != cos2.shape:
        raise ValueError(f"rope: tables {tuple(cos2.shape)} do not fit x {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    c = cos2.reshape(t, r).float().contiguous()
    s = sin2.reshape(t, r).float().contiguous()
    y = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if t:
        hb = min(next_pow2(h), 16)
        _rope_kernel[(t, cdiv(h, hb))](
            x, c, s, y, h, d, r, x.stride(0), x.stride(1), c.stride(0), y.stride(0), y.stride(1),
            NEOX=style == "neox", HB=hb, BD=next_pow2(d), num_warps=2)
    return y


def rope_ref(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor, style: str) -> torch.Tensor:
    """The torch twin, in plain torch ops (the shared model's ``apply_rope_tables`` computes the
    same function; the tests check both)."""
    rd = cos2.shape[-1]
    xf = x.float()
    xr = xf[..., :rd]
    if style == "neox":
        rot = torch.cat([-xr[..., rd // 2:], xr[..., :rd // 2]], -1)
    else:
        rot = torch.stack([-xr[..., 1::2], xr[..., 0::2]], -1).flatten(-2)
    out = torch.cat([xr * cos2 + rot * sin2, xf[..., rd:]], -1)
    return out.to(x.dtype)
