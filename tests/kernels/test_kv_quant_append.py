"""Quantize-and-append Triton kernel vs its PyTorch twin (``QuantCodec.write``).

Without CUDA the kernel runs through the Triton interpreter (TRITON_INTERPRET=1, set before the
kernel module is imported) at small shapes; with CUDA the same tests run on the GPU, where a
code may differ by one step at an exact half-way point (GPU division rounding).
"""

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from localmoe.kernels.kv_quant_append import kv_quant_append, kv_quant_append_ref  # noqa: E402
from tests import tolerances as tol  # noqa: E402
from localmoe.kv.quant_codec import QuantCodec  # noqa: E402
from localmoe.kv.spec import KVSpec  # noqa: E402

DEV = "cuda" if CUDA else "cpu"


def _compare(st, ref):
    for key in ref:
        a, r = st[key], ref[key]
        if key in ("q", "q_hi") and CUDA:
            assert (a != r).float().mean().item() < tol.APPEND_CODES_GPU, key
        else:
            assert torch.equal(a, r), key


@pytest.mark.parametrize("name", ["int8", "int4", "int3", "int2", "fp4"])
@pytest.mark.parametrize("group", [16, 32, 64])
@pytest.mark.parametrize("t", [1, 7, 33])
def test_append_matches_twin(name, group, t):
    if name == "fp4" and group != 16:
        pytest.skip("fp4 has a fixed group of 16")
    fmt = f"{name}:g{group}" if name != "fp4" else "fp4"
    spec = KVSpec.parse(fmt, kgroup="token")
    c = QuantCodec(spec.k, 2, 64, spec)
    g = torch.Generator().manual_seed(t * 7 + group)
    x = (torch.randn(t, 2, 64, generator=g) * 3).to(DEV)
    x[:, :, 2] += 20
    slots = torch.randperm(48, generator=g)[:t].to(DEV)
    pos = torch.arange(t, device=DEV)
    st, ref = c.alloc(48, DEV), c.alloc(48, DEV)
    kv_quant_append(c, st, slots, x, pos)
    kv_quant_append_ref(c, ref, slots, x, pos)
    _compare(st, ref)


@pytest.mark.parametrize("name", ["int4", "int2", "fp4", "int3"])
def test_append_outliers_sinks_window_rotation(name):
    spec = KVSpec.parse(name, outlier_frac=0.05, sink_tokens=2, window=4, kgroup="token")
    for rotate in (False, True):
        c = QuantCodec(spec.k, 2, 64, spec, role="k", max_seqs=2, rotate=rotate)
        g = torch.Generator().manual_seed(1)
        x = (torch.randn(9, 2, 64, generator=g) * 2).to(DEV)
        x[:, :, 11] -= 30
        slots = torch.arange(9, device=DEV) + 16
        pos = torch.arange(9, device=DEV)
        st, ref = c.alloc(32, DEV), c.alloc(32, DEV)
        kv_quant_append(c, st, slots, x, pos, seq_row=1)
        kv_quant_append_ref(c, ref, slots, x, pos, seq_row=1)
        _compare(st, ref)
        assert torch.isfinite(c.read(st, slots, positions=pos, seq_row=1)).all()


def test_append_extreme_values_stay_finite():
    spec = KVSpec.parse("int4:t", outlier_frac=0.02)
    c = QuantCodec(spec.k, 1, 32, spec)
    x = torch.zeros(4, 1, 32, device=DEV)
    x[1] = 1e6
    x[2, :, ::2] = -1e7
    x[3] = 5.0
    st = c.alloc(4, DEV)
    s = torch.arange(4, device=DEV)
    kv_quant_append(c, st, s, x, s)
    r = c.read(st, s)
    assert torch.isfinite(r).all()
    assert torch.equal(r[3], x[3])


def test_append_rejects_bad_shapes():
    spec = KVSpec.parse("int4:t")
    c = QuantCodec(spec.k, 2, 64, spec)
    st = c.alloc(8, DEV)
    with pytest.raises(ValueError):
        kv_quant_append(c, st, torch.arange(2, device=DEV), torch.zeros(2, 3, 64, device=DEV),
                        torch.arange(2, device=DEV))
