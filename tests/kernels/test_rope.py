"""The one-launch RoPE kernel against its torch twin and the shared model's RoPE."""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from localmoe.kernels.rope import rope, rope_ref  # noqa: E402
from localmoe.model.ops import apply_rope_tables, rope_cos_sin, rope_inv_freq, rope_tables  # noqa: E402

from tests import tolerances as tol  # noqa: E402

DEV = "cuda" if CUDA else "cpu"


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("style", ["neox", "norm"])
@pytest.mark.parametrize("t,h,d,rd", [(1, 32, 128, 128), (5, 4, 64, 64), (3, 3, 64, 32),
                                      (2, 20, 256, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_matches_twin_and_model(style, t, h, d, rd, dtype):
    pos = torch.tensor([7, 0, 1000, 3, 9][:t], device=DEV)   # not 0 alone: no rotation there
    inv, ms = rope_inv_freq(rd, 10000.0)
    cos2, sin2 = rope_tables(*rope_cos_sin(pos, inv.to(DEV), ms), style)
    x = torch.randn(t, h, d, device=DEV).to(dtype)
    y = rope(x, cos2, sin2, style)
    bound = tol.FP32 if dtype == torch.float32 else tol.FP16
    assert y.dtype == dtype and rel(y, rope_ref(x, cos2, sin2, style)) < bound
    assert rel(y, apply_rope_tables(x, cos2, sin2, style)) < bound
    other = "norm" if style == "neox" else "neox"
    assert rel(rope(x, cos2, sin2, other), rope_ref(x, cos2, sin2, style)) > tol.MUST_DIFFER * bound


def test_rope_strided_input_and_errors():
    qkv = torch.randn(3, 6 * 64, device=DEV)
    q = qkv[:, :4 * 64].reshape(3, 4, 64)
    inv, ms = rope_inv_freq(64, 1e6)
    cos2, sin2 = rope_tables(*rope_cos_sin(torch.arange(3, device=DEV), inv.to(DEV), ms), "neox")
    assert rel(rope(q, cos2, sin2, "neox"), rope_ref(q, cos2, sin2, "neox")) < tol.FP32
    with pytest.raises(ValueError, match="style"):
        rope(q, cos2, sin2, "gptj")
    with pytest.raises(ValueError, match="fit"):
        rope(q[:2], cos2, sin2, "neox")
