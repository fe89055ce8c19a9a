"""The one-launch RMSNorm kernel against its torch twin and the shared model's norm."""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from localmoe.kernels.rms_norm import rms_norm, rms_norm_ref  # noqa: E402
from localmoe.model.ops import rms_norm as model_norm  # noqa: E402

from tests import tolerances as tol  # noqa: E402

DEV = "cuda" if CUDA else "cpu"


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("shape", [(1, 2048), (3, 576), (5, 32, 128), (17, 640), (2, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_matches_twin(shape, dtype):
    x = (torch.randn(shape, device=DEV) * 3 + 0.5).to(dtype)
    w = torch.randn(shape[-1], device=DEV).to(dtype)
    y = rms_norm(x, w, 1e-6)
    assert y.shape == x.shape and y.dtype == dtype
    bound = tol.FP32 if dtype == torch.float32 else tol.FP16
    assert rel(y, rms_norm_ref(x, w, 1e-6)) < bound
    assert rel(y, model_norm(x, w, 1e-6)) < bound
    assert rel(rms_norm(x, None, 1e-6), rms_norm_ref(x, None, 1e-6)) < bound
    # the comparison can fail: another weight gives another result
    assert rel(rms_norm(x, w.flip(0), 1e-6), rms_norm_ref(x, w, 1e-6)) > tol.MUST_DIFFER * bound


def test_rms_norm_strided_rows_and_bad_weight():
    qkv = torch.randn(4, 3 * 64, device=DEV)
    q = qkv[:, :128].reshape(4, 2, 64)          # rows strided inside the fused output
    w = torch.rand(64, device=DEV)
    assert rel(rms_norm(q, w, 1e-5), rms_norm_ref(q, w, 1e-5)) < tol.FP32
    with pytest.raises(ValueError, match="weight"):
        rms_norm(q, torch.ones(63, device=DEV), 1e-5)
