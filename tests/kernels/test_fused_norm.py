"""The fused residual add + RMSNorm + int8 quantization kernel against its torch twin and
against the unfused chain it replaces (``x + d -> rms_norm -> quantize_act``).

Without CUDA the kernel runs through the Triton interpreter at small awkward shapes (D not a
power of two, a partial last program, 1-4 partial slices); with CUDA the same tests run on the
GPU, plus full widths (marked gpu). Bit-exact comparisons hold where both sides round the same
way: the residual always; the normed rows against the unfused kernels in the interpreter (on
the GPU their float32 reductions may be ordered differently, so there they are bounded by the
fp16/fp32 tolerances); the QuantAct against ``quantize_act`` of the kernel's own normed rows.
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from localmoe.kernels.fused_norm import (  # noqa: E402
    add_rms_norm_quant, add_rms_norm_quant_ref, pack_act_ref,
)
from localmoe.kernels.quant_gemv import (  # noqa: E402
    dequantize_act, quantize_act, sum_partials, use_act_precision,
)
from localmoe.kernels.rms_norm import rms_norm  # noqa: E402

from tests import tolerances as tol  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
EPS = 1e-6


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def bound(dtype):
    return tol.FP32 if dtype == torch.float32 else tol.FP16


def same_act(a, b) -> bool:
    return a.wide == b.wide and torch.equal(a.q, b.q) and torch.equal(a.pairs(), b.pairs())


def make_deltas(kind: str, t: int, d: int, dtype):
    if kind == "none":
        return []
    if kind == "plain":
        return [torch.randn(t, d, device=DEV).to(dtype)]
    if kind.startswith("partials"):
        return [torch.randn(int(kind[-1]), t, d, device=DEV)]
    # three mixed: partials of an O projection, an MoE output in float32, a shared expert's
    # output in the activation dtype
    return [torch.randn(3, t, d, device=DEV), torch.randn(t, d, device=DEV),
            torch.randn(t, d, device=DEV).to(dtype)]


@pytest.mark.parametrize("d", [32, 96, 2048])
@pytest.mark.parametrize("t", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_matches_unfused_chain(t, d, dtype):
    torch.manual_seed(t * 100 + d)
    x = (torch.randn(t, d, device=DEV) * 2).to(dtype)
    delta = torch.randn(t, d, device=DEV).to(dtype)
    w = (torch.rand(d, device=DEV) + 0.5).to(dtype)
    res = torch.full_like(x, float("nan"))
    r, hq, hf = add_rms_norm_quant(x, [delta], w, EPS, residual_out=res, want_float=dtype)
    assert r is res
    r_ref = x + delta                                   # the unfused chain, kernel by kernel
    h_ref = rms_norm(r_ref, w, EPS)
    assert torch.equal(r, r_ref)
    assert hf.dtype == dtype and torch.isfinite(hf).all()
    assert same_act(hq, quantize_act(hf))               # the quantization of the h it returns
    if CUDA:
        assert rel(hf, h_ref) < bound(dtype)
        assert rel(dequantize_act(hq), dequantize_act(quantize_act(h_ref))) < tol.FP16
    else:
        assert torch.equal(hf, h_ref)
        assert same_act(hq, quantize_act(h_ref))
    # no delta: the norm of x itself
    _, hq0, hf0 = add_rms_norm_quant(x, [], w, EPS, residual_out=res, want_float=dtype)
    assert torch.equal(res, x)
    if not CUDA:
        assert torch.equal(hf0, rms_norm(x, w, EPS)) and same_act(hq0, quantize_act(hf0))


@pytest.mark.parametrize("kind", ["none", "plain", "partials2", "partials4", "mixed3"])
@pytest.mark.parametrize("t,d", [(1, 32), (3, 96), (8, 2048)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_matches_twin(kind, t, d, dtype):
    torch.manual_seed(len(kind) * 7 + t + d)
    x = (torch.randn(t, d, device=DEV) * 3).to(dtype)
    deltas = make_deltas(kind, t, d, dtype)
    w = torch.randn(d, device=DEV).to(dtype)
    res = torch.empty_like(x)
    r, hq, hf = add_rms_norm_quant(x, deltas, w, EPS, residual_out=res, want_float=torch.float32)
    r_ref, hq_ref, hf_ref = add_rms_norm_quant_ref(x, deltas, w, EPS, want_float=torch.float32)
    assert torch.equal(r, r_ref)                        # float32 sums in one order, one rounding
    assert hf.dtype == torch.float32 and torch.equal(hf, hf.to(dtype).float())   # rounded h
    assert rel(hf, hf_ref) < bound(dtype)               # only the norm's reduction order differs
    assert same_act(hq, quantize_act(hf))
    if not CUDA:
        assert same_act(hq, pack_act_ref(hf))           # the packing twin, bit for bit
    assert rel(dequantize_act(hq), dequantize_act(hq_ref)) < tol.FP16
    if deltas:                  # the comparison can fail: without the last delta, or a slice
        assert not torch.equal(r, add_rms_norm_quant_ref(x, deltas[:-1], w, EPS)[0])
        if deltas[0].dim() == 3:
            short = [deltas[0][1:], *deltas[1:]]
            assert not torch.equal(r, add_rms_norm_quant_ref(x, short, w, EPS)[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_int16_activations_match_twin(dtype):
    # act_precision "int16": the residual codes come out of the same launch, as quantize_act's
    torch.manual_seed(11)
    x = (torch.randn(3, 96, device=DEV) * 3).to(dtype)
    deltas = make_deltas("mixed3", 3, 96, dtype)
    w = torch.randn(96, device=DEV).to(dtype)
    with use_act_precision("int16"):
        r, hq, hf = add_rms_norm_quant(x, deltas, w, EPS, residual_out=torch.empty_like(x),
                                       want_float=torch.float32)
        assert hq.wide and same_act(hq, quantize_act(hf))
        if not CUDA:
            assert same_act(hq, pack_act_ref(hf))
        _, hq_ref, _ = add_rms_norm_quant_ref(x, deltas, w, EPS)
    assert hq_ref.wide and rel(dequantize_act(hq), dequantize_act(hq_ref)) < tol.FP16
    assert rel(dequantize_act(hq), hf) < rel(dequantize_act(quantize_act(hf)), hf) / 10
    _, hq8, _ = add_rms_norm_quant(x, deltas, w, EPS, residual_out=torch.empty_like(x))
    assert not hq8.wide and torch.equal(hq8.q, hq.q.view(3, 3, 2, 8)[:, :, 0].reshape(3, 24))


def test_twin_pieces_match_unfused_ops():
    torch.manual_seed(3)
    p = torch.randn(4, 3, 64, device=DEV)
    manual = ((p[0] + p[1]) + p[2]) + p[3]
    assert torch.equal(sum_partials(p), manual)
    h = (torch.randn(3, 64, device=DEV) * 2).half()
    h[1, :32] = 0.0                                     # an all-zero block
    if not CUDA:                # on the GPU the kernel may contract v * inv + c into an FMA
        assert same_act(pack_act_ref(h), quantize_act(h))
    with pytest.raises(ValueError, match=r"\[S, T, N\]"):
        sum_partials(p[0])


# (bfloat16 runs on the GPU only: the interpreter truncates float32 -> bfloat16 instead of
# rounding to nearest, so its residual cannot equal torch's)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32]
                         + ([torch.bfloat16] if CUDA else []))
def test_in_place_no_residual_no_weight_no_quant(dtype):
    torch.manual_seed(4)
    x = torch.randn(5, 160, device=DEV).to(dtype)
    delta = torch.randn(2, 5, 160, device=DEV)
    r_ref, hq_ref, hf_ref = add_rms_norm_quant_ref(x, [delta], None, EPS, want_float=dtype)
    xc = x.clone()
    r, hq, hf = add_rms_norm_quant(xc, [delta], None, EPS, residual_out=xc, want_float=dtype)
    assert r is xc and torch.equal(xc, r_ref)           # the residual updated in place
    assert rel(hf, hf_ref) < tol.FP16 and same_act(hq, quantize_act(hf))
    r2, hq2, hf2 = add_rms_norm_quant(x, [delta], None, EPS, residual_out=None)
    assert r2 is None and hf2 is None and same_act(hq2, hq)
    res = torch.empty_like(x)
    r3, hq3, hf3 = add_rms_norm_quant(x, [delta], None, EPS, residual_out=res,
                                      want_float=torch.float32, quant=False)
    assert hq3 is None and torch.equal(r3, r_ref) and torch.equal(hf3, hf.float())
    # preallocated outputs (a CUDA graph's static buffers) are the ones written
    qa = quantize_act(torch.zeros(5, 160, device=DEV))
    hbuf = torch.empty(5, 160, device=DEV)
    _, hq4, hf4 = add_rms_norm_quant(x, [delta], None, EPS, residual_out=res, quant_out=qa,
                                     float_out=hbuf)
    assert hq4 is qa and hf4 is hbuf and same_act(qa, hq) and torch.equal(hbuf, hf.float())
    # no rows: nothing launched
    e = torch.empty(0, 64, device=DEV, dtype=dtype)
    _, hq5, _ = add_rms_norm_quant(e, [], None, EPS, residual_out=e.clone())
    assert hq5.q.shape == (0, 16)


def test_rejects_bad_inputs():
    x = torch.randn(3, 64, device=DEV)
    w = torch.ones(64, device=DEV)
    out = torch.empty_like(x)
    with pytest.raises(ValueError, match=r"delta 0 must be \[T, D\]"):
        add_rms_norm_quant(x, [torch.randn(3, 96, device=DEV)], w, EPS, residual_out=out)
    with pytest.raises(ValueError, match=r"delta 1 must be"):
        add_rms_norm_quant(x, [x, torch.randn(2, 2, 64, device=DEV)], w, EPS, residual_out=out)
    with pytest.raises(ValueError, match="on meta"):
        add_rms_norm_quant(x, [torch.empty(3, 64, device="meta")], w, EPS, residual_out=out)
    with pytest.raises(ValueError, match="multiple of 32"):
        add_rms_norm_quant(torch.randn(3, 48, device=DEV), [], None, EPS, residual_out=None)
    with pytest.raises(ValueError, match="at most 3"):
        add_rms_norm_quant(x, [x, x, x, x], w, EPS, residual_out=out)
    with pytest.raises(TypeError, match="float32"):
        add_rms_norm_quant(x, [torch.randn(2, 3, 64, device=DEV).half()], w, EPS, residual_out=out)
    with pytest.raises(ValueError, match="residual_out"):
        add_rms_norm_quant(x, [], w, EPS, residual_out=torch.empty(3, 32, device=DEV))
    with pytest.raises(TypeError, match="residual_out"):
        add_rms_norm_quant(x, [], w, EPS, residual_out=out.half())
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm_quant(x, [], torch.ones(63, device=DEV), EPS, residual_out=out)
    with pytest.raises(ValueError, match="quant_out"):
        add_rms_norm_quant(x, [], w, EPS, residual_out=out,
                           quant_out=quantize_act(torch.zeros(3, 32, device=DEV)))
    with pytest.raises(ValueError, match=r"\[T, D\]"):
        add_rms_norm_quant(x[0], [], w, EPS, residual_out=None)
    # 48 values are fine without the quantization
    y = torch.randn(2, 48, device=DEV)
    _, _, hf = add_rms_norm_quant(y, [], None, EPS, residual_out=None, want_float=torch.float32,
                                  quant=False)
    assert rel(hf, rms_norm(y, None, EPS)) < tol.FP32


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8])
@pytest.mark.parametrize("d", [2048, 4096, 5120, 8192])
def test_full_width_on_gpu(t, d):
    torch.manual_seed(d + t)
    x = torch.randn(t, d, device=DEV, dtype=torch.bfloat16)
    deltas = [torch.randn(4, t, d, device=DEV), torch.randn(t, d, device=DEV, dtype=torch.bfloat16)]
    w = torch.rand(d, device=DEV, dtype=torch.bfloat16)
    r, hq, hf = add_rms_norm_quant(x, deltas, w, EPS, residual_out=torch.empty_like(x),
                                   want_float=torch.float32)
    r_ref, hq_ref, hf_ref = add_rms_norm_quant_ref(x, deltas, w, EPS, want_float=torch.float32)
    assert torch.equal(r, r_ref) and rel(hf, hf_ref) < tol.BF16
    assert same_act(hq, quantize_act(hf))
    assert rel(dequantize_act(hq), dequantize_act(hq_ref)) < tol.BF16
