"""Prefill GEMM, embedding row gather and grouped MoE GEMM on quantized blocks vs torch twins.

Without CUDA the kernels run through the Triton interpreter (TRITON_INTERPRET=1) at small
shapes covering every GGUF quant type and awkward token counts; with CUDA the same tests run on
the GPU (fp16 operands) plus real-geometry shapes (marked gpu).
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from localmoe.kernels.fused_moe import fused_moe_ref  # noqa: E402
from localmoe.kernels.qtensor import (BLOCK_SIZES, QTYPE_NAMES, QUANT_QTYPES, QuantTensor,  # noqa: E402
                                      random_gguf_blocks)
from localmoe.kernels.quant_gemm import (dequantize_rows, moe_align, moe_prefill,  # noqa: E402
                                         quant_gemm, quant_gemm_ref)

from tests import tolerances as tol  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
# the dot runs in the activations' dtype: fp32 in the interpreter, fp16 on the GPU
DT = torch.float16 if CUDA else torch.float32
TOL = tol.FP16 if CUDA else tol.FP32


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def make(qt, shape, seed=0, scale=0.02):
    return QuantTensor.from_gguf(random_gguf_blocks(qt, shape, seed=seed, scale=scale), qt, shape,
                                 device=DEV)


#: block scale giving weights of ~0.02: 0.02 over the typical |scale * code| of each type
WEIGHT_SCALE = {2: 0.005, 3: 0.0025, 6: 0.002, 7: 0.001, 8: 3e-4, 10: 0.002, 11: 2e-4,
                12: 1e-4, 13: 5e-5, 14: 4e-5, 20: 3e-4, 23: 2e-5}


def kdim(qt, small=96):
    return 256 if BLOCK_SIZES[qt][0] == 256 else small


@pytest.mark.parametrize("qt", QUANT_QTYPES, ids=[QTYPE_NAMES[q] for q in QUANT_QTYPES])
def test_gemm_matches_twin_every_qtype(qt):
    """N not a multiple of the tile, M not a multiple of the tile; every output written."""
    w = make(qt, (40, kdim(qt)), seed=qt)
    x = torch.randn(33, w.K, device=DEV).to(DT)
    out = torch.full((33, 40), float("nan"), device=DEV, dtype=DT)
    quant_gemm(x, w, out=out)
    assert torch.isfinite(out).all()
    assert rel(out, quant_gemm_ref(x, w)) < TOL


@pytest.mark.parametrize("m", [1, 3, 8, 257])
def test_gemm_token_counts(m):
    w = make(12, (24, 512), seed=m)
    x = torch.randn(m, 512, device=DEV).to(DT)
    assert rel(quant_gemm(x, w), quant_gemm_ref(x, w)) < TOL


def test_gemm_wrong_weight_fails_the_check():
    """The comparison can fail: another weight's product is far off."""
    w, w2 = make(8, (24, 64), seed=1), make(8, (24, 64), seed=2)
    x = torch.randn(5, 64, device=DEV).to(DT)
    assert rel(quant_gemm(x, w2), quant_gemm_ref(x, w)) > tol.MUST_DIFFER * TOL


def test_gemm_rejects_bad_inputs():
    w = make(8, (8, 64))
    with pytest.raises(ValueError):
        quant_gemm(torch.randn(2, 32, device=DEV), w)
    with pytest.raises(TypeError):
        quant_gemm(torch.ones(2, 64, dtype=torch.int32, device=DEV), w)
    with pytest.raises(ValueError):
        quant_gemm(torch.randn(2, 64, device=DEV), make(8, (2, 8, 64)))
    f16 = QuantTensor.from_gguf(random_gguf_blocks(1, (8, 64)), 1, (8, 64), device=DEV)
    with pytest.raises(ValueError, match="F16"):
        quant_gemm(torch.randn(2, 64, device=DEV), f16)


@pytest.mark.parametrize("qt", QUANT_QTYPES, ids=[QTYPE_NAMES[q] for q in QUANT_QTYPES])
def test_dequantize_rows_is_exact(qt):
    """The embedding gather gives the file's values bit for bit (float32 out), repeated and
    out-of-order ids included."""
    w = make(qt, (37, kdim(qt, 64)), seed=qt + 1)
    ids = torch.tensor([36, 0, 5, 5, 17], device=DEV)
    got = dequantize_rows(w, ids, dtype=torch.float32)
    assert torch.equal(got, w.dequantize(ids))


def test_moe_align_groups_every_assignment_once():
    g = torch.Generator().manual_seed(3)
    t, k, e, bm = 29, 3, 7, 4
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    ids[:6] = torch.tensor([0, 1, 2])       # skewed: expert 0 gets many
    sorted_ids, block_expert, n_pad = moe_align(ids.to(DEV), e, bm)
    sorted_ids, block_expert, n_pad = sorted_ids.cpu(), block_expert.cpu(), int(n_pad)
    n = t * k
    real = sorted_ids[sorted_ids < n]
    assert sorted(real.tolist()) == list(range(n))
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=e)
    assert n_pad == int(((counts + bm - 1) // bm * bm).sum())
    for b in range(n_pad // bm):
        rows = sorted_ids[b * bm:(b + 1) * bm]
        rows = rows[rows < n]
        assert len(rows) and (flat[rows.long()] == block_expert[b]).all()
    assert (sorted_ids[n_pad:] == n).all()


@pytest.mark.parametrize("qt_gu,qt_d,act", [(12, 8, "silu"), (14, 14, "gelu"), (8, 2, "silu"),
                                            (10, 11, "silu"), (23, 20, "silu")],
                         ids=["Q4_K-Q8_0", "Q6_K-Q6_K-gelu", "Q8_0-Q4_0", "Q2_K-Q3_K",
                              "IQ4_XS-IQ4_NL"])
def test_moe_prefill_matches_twin(qt_gu, qt_d, act):
    """Grouped GEMMs against the per-token loop twin (float activations), a permuted slot table
    and a skewed routing (one expert takes many tokens, some take none)."""
    e, d = 6, 256
    f = 256 if qt_d in (10, 11, 12, 13, 14, 23) else 64
    # random blocks with the default scale give weights far larger than a trained model's
    # (Q6_K up to ~80): block scales over the types' typical code size keep |w| ~ 0.02, and h
    # and the output inside fp16's range on the GPU
    g = make(qt_gu, (e, f, d), seed=1, scale=WEIGHT_SCALE[qt_gu])
    u = make(qt_gu, (e, f, d), seed=2, scale=WEIGHT_SCALE[qt_gu])
    gu = QuantTensor.interleave_rows(g, u)
    dn = make(qt_d, (e, d, f), seed=3, scale=WEIGHT_SCALE[qt_d])
    gen = torch.Generator().manual_seed(0)
    t, k = 21, 2
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    ids[:8, 0] = 4
    wts = torch.rand(t, k, generator=gen)
    x = torch.randn(t, d, generator=gen).to(DT)
    slot = torch.randperm(e, generator=gen).to(torch.int32)
    out = moe_prefill(x.to(DEV), gu, dn, ids.to(DEV), wts.to(DEV), slot_of=slot.to(DEV),
                      activation=act)
    ref = fused_moe_ref(x.to(DEV), gu, dn, ids.to(DEV), wts.to(DEV), slot_of=slot.to(DEV),
                        activation=act, act_quant=False)
    assert out.shape == (t, d) and out.dtype == x.dtype
    assert rel(out, ref) < TOL
    # and the identity slot table gives another function (the slots are really read)
    other = moe_prefill(x.to(DEV), gu, dn, ids.to(DEV), wts.to(DEV), activation=act)
    assert rel(other, ref) > tol.MUST_DIFFER * TOL


def test_moe_prefill_in_chunks():
    """A prompt in passes of a few tokens (the bound on the prefill's intermediates) gives
    the one-pass result; a pass of no tokens is refused."""
    e, d, f, t, k = 6, 256, 64, 21, 2
    gu = QuantTensor.interleave_rows(make(8, (e, f, d), seed=1, scale=WEIGHT_SCALE[8]),
                                     make(8, (e, f, d), seed=2, scale=WEIGHT_SCALE[8]))
    dn = make(2, (e, d, f), seed=3, scale=WEIGHT_SCALE[2])
    gen = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(DEV)
    wts = torch.rand(t, k, generator=gen).to(DEV)
    x = torch.randn(t, d, generator=gen).to(DT).to(DEV)
    whole = moe_prefill(x, gu, dn, ids, wts, chunk=t)
    ref = fused_moe_ref(x, gu, dn, ids, wts, act_quant=False)
    assert rel(whole, ref) < TOL
    for c in (1, 8):
        parts = moe_prefill(x, gu, dn, ids, wts, chunk=c)
        assert parts.dtype == x.dtype and rel(parts, whole) < 1e-3, c
    with pytest.raises(ValueError, match="chunk"):
        moe_prefill(x, gu, dn, ids, wts, chunk=0)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="full-size shapes on the GPU only")
@pytest.mark.parametrize("qt,n,k", [(8, 5120, 2048), (14, 151936, 2048), (12, 6144, 4096),
                                    (10, 1000, 4096), (11, 1000, 4096), (13, 1000, 4096),
                                    (2, 1000, 4096), (3, 1000, 4096), (6, 1000, 4096),
                                    (7, 1000, 4096)])
def test_gemm_full_size_on_gpu(qt, n, k):
    w = make(qt, (n, k), seed=7)
    x = torch.randn(512, k, device=DEV, dtype=torch.float16)
    assert rel(quant_gemm(x, w), quant_gemm_ref(x, w)) < tol.FP16


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="full-size shapes on the GPU only")
def test_moe_prefill_qwen3_geometry_on_gpu():
    e, f, d, t, k = 128, 768, 2048, 512, 8
    gu = QuantTensor.interleave_rows(make(12, (e, f, d), 1, WEIGHT_SCALE[12]),
                                     make(12, (e, f, d), 2, WEIGHT_SCALE[12]))
    dn = make(14, (e, d, f), 3, WEIGHT_SCALE[14])
    logits = torch.randn(t, e, device=DEV)
    w, ids = torch.topk(torch.softmax(logits, -1), k)
    x = torch.randn(t, d, device=DEV, dtype=torch.float16)
    out = moe_prefill(x, gu, dn, ids, w)
    sel = torch.arange(0, t, 37, device=DEV)
    ref = fused_moe_ref(x[sel], gu, dn, ids[sel], w[sel], act_quant=False)
    assert rel(out[sel], ref) < tol.FP16
