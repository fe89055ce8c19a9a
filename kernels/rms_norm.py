"""RMSNorm in one launch (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization").

``y = x * rsqrt(mean(x^2) + eps) * w`` over the last dimension, computed in float32 and stored
in ``x``'s dtype -- the formula and numerics of the torch twin
:func:`localmoe.model.ops.rms_norm`, which takes ~8 kernel launches for a half-precision input
(cast, square, mean, add, rsqrt, two products, cast back). A decode step of a 48-layer model
norms 4 times per layer (attention and FFN inputs, query and key heads): ~1,300 launches become
~190.

Each program normalizes ``ROWS`` rows of ``N`` values (``N`` padded to a power of two and
masked), reading ``x`` through its row stride (a row of the query heads is a slice of the fused
q/k/v output).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from localmoe.kernels.host import cdiv, next_pow2

__all__ = ["rms_norm", "rms_norm_ref"]


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, R, N, x_rs, y_rs, eps,
                     HAS_W: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BLOCK)
    rm = r < R
    cm = c < N
    m = rm[:, None] & cm[None, :]
    x = tl.load(x_ptr + r.to(tl.int64)[:, None] * x_rs + c[None, :], mask=m, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
    y = x * inv[:, None]
    if HAS_W:
        w = tl.load(w_ptr + c, mask=cm, other=0.0).to(tl.float32)
        y = y * w[None, :]
    tl.store(y_ptr + r.to(tl.int64)[:, None] * y_rs + c[None, :], y.to(y_ptr.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm of ``x [..., n]`` (float16/bfloat16/float32) with weight ``w [n]`` or None.

    Returns:
        a new tensor shaped and typed like ``x``.
    Raises:
        ValueError: ``w`` of the wrong length or on another device.
    """
    n = x.shape[-1]
    if w is not None and (w.numel() != n or w.device != x.device):
        raise ValueError(f"rms_norm: weight of {w.numel()} values on {w.device} for rows of {n} "
                         f"on {x.device}")
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    r = x2.shape[0]
    y = torch.empty((r, n), dtype=x.dtype, device=x.device)
    if r:
        block = next_pow2(n)
        rows = max(1, min(16, 4096 // block))
        _rms_norm_kernel[(cdiv(r, rows),)](
            x2, w if w is not None else x2, y, r, n, x2.stride(0), y.stride(0), float(eps),
            HAS_W=w is not None, ROWS=rows, BLOCK=block, num_warps=4 if block >= 1024 else 1)
    return y.reshape(x.shape)


def rms_norm_ref(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The torch twin, in plain torch ops (the shared model's ``rms_norm`` computes the same
    function; the tests check both)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if w is not None:
        y = y * w.float()
    return y.to(x.dtype)
