"""Quantized GEMV kernel vs its torch twin, every GGUF quant type.

Without CUDA the kernel runs through the Triton interpreter (TRITON_INTERPRET=1, set before
triton is imported) at small awkward shapes: a partial row block, K tiles with a partial tail,
several K iterations, split-K. With CUDA the same tests run on the GPU, plus full-size shapes
(marked gpu).
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from localmoe.kernels.qtensor import (  # noqa: E402
    BLOCK_SIZES, FLOAT_QTYPES, QTYPE_NAMES, QUANT_QTYPES, QuantTensor, random_gguf_blocks,
)
from localmoe.kernels.quant_gemv import (  # noqa: E402
    QuantAct, act_precision, dequantize_act, gemv_config, gemv_partials_split, quant_gemv,
    quant_gemv_partials, quant_gemv_ref, quantize_act, quantize_act_ref, sum_partials,
    use_act_precision, wide_default,
)

from localmoe.errors import InvalidRequestError  # noqa: E402
from tests import tolerances as tol  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
IDS = [QTYPE_NAMES[q] for q in QUANT_QTYPES]
# one table of tolerances (relative, norm-wise): vs the twin with the kernel's int8 activation
# rounding (exact integer dots; float32 scale/accumulation order only), and vs the plain float
# product (the activation rounding itself, ~0.3-1% on random data)
# (a float16/bfloat16 output adds its own rounding: "twin_half")
TOL = {"twin": tol.FP32 if not CUDA else tol.FP32_DEVICE, "twin_half": tol.FP16,
       "float": tol.ACT_QUANT_GEMV}  # tests/tolerances.py


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def make(qt, n, k, seed=0, lead=()):
    shape = (*lead, n, k)
    return QuantTensor.from_gguf(random_gguf_blocks(qt, shape, seed=seed), qt, shape, device=DEV)


def small_k(qt: int) -> int:
    # K-quants: 3 super-blocks (not a power of two); legacy: 7 blocks of 32 (not a multiple of 64)
    return 768 if BLOCK_SIZES[qt][0] == 256 else 224


def check(x, w, y):
    assert torch.isfinite(y).all(), "unwritten or non-finite output"
    assert rel(y, quant_gemv_ref(x, w)) < TOL["twin" if y.dtype == torch.float32 else "twin_half"]
    assert rel(y, quant_gemv_ref(x, w, act_quant=False)) < TOL["float"]


@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("qt", QUANT_QTYPES, ids=IDS)
def test_gemv_matches_twin_every_qtype(qt, tokens):
    torch.manual_seed(qt * 10 + tokens)
    w = make(qt, 13, small_k(qt), seed=qt)            # 13 rows: a partial row block of 8
    x = torch.randn(tokens, w.K, device=DEV)
    out = torch.full((tokens, 13), float("nan"), device=DEV)
    y = quant_gemv(x, w, out=out, config={"BN": 8, "CH": 4, "num_warps": 4, "split": 1})
    assert y is out
    check(x, w, y)


@pytest.mark.parametrize("qt", [8, 14, 11], ids=["Q8_0", "Q6_K", "Q3_K"])
def test_gemv_pipelined_k_loop_computes_what_the_plain_one_does(qt):
    """``stages`` 3 (the K loop's loads pipelined through shared memory on the GPU): the same
    result as the plain loop, K in several tiles with a tail, a partial row block, 3 tokens."""
    torch.manual_seed(qt)
    w = make(qt, 13, small_k(qt), seed=qt)
    x = torch.randn(3, w.K, device=DEV)
    cfg = {"BN": 8, "CH": 2, "num_warps": 4, "split": 1}
    a = quant_gemv(x, w, config=cfg)
    b = quant_gemv(x, w, config=dict(cfg, stages=3))
    assert torch.equal(a, b) if not CUDA else rel(b, a) < TOL["twin"]
    check(x, w, b)


@pytest.mark.parametrize("qt", QUANT_QTYPES, ids=IDS)
def test_gemv_lookahead_k_loop_computes_what_the_plain_one_does(qt):
    """``lookahead`` (the next K tile's loads issued before this tile's dots): the same bits
    as the plain loop for every GGUF type, K in several tiles with a tail, a partial row
    block, 3 tokens; and with K in one tile (the loop body never runs)."""
    torch.manual_seed(qt + 1)
    w = make(qt, 13, small_k(qt), seed=qt + 1)
    x = torch.randn(3, w.K, device=DEV)
    for ch in (2, 64):
        cfg = {"BN": 8, "CH": ch, "num_warps": 4, "split": 1}
        a = quant_gemv(x, w, config=cfg)
        b = quant_gemv(x, w, config=dict(cfg, lookahead=True))
        assert torch.equal(a, b) if not CUDA else rel(b, a) < TOL["twin"], ch
    check(x, w, b)


@pytest.mark.parametrize("qt", [12, 10, 5 + 1], ids=["Q4_K", "Q2_K", "Q5_0"])
def test_gemv_unmasked_tiles(qt):
    # N % BN == 0, whole K tiles, T a power of two: the kernel drops every bounds mask
    torch.manual_seed(2)
    w = make(qt, 16, 512, seed=qt)
    x = torch.randn(2, 512, device=DEV)
    check(x, w, quant_gemv(x, w, config={"BN": 8, "CH": 4, "num_warps": 4, "split": 2}))


@pytest.mark.parametrize("qt", [8, 11, 14], ids=["Q8_0", "Q3_K", "Q6_K"])
def test_gemv_split_k_and_half_inputs(qt):
    torch.manual_seed(1)
    w = make(qt, 6, small_k(qt), seed=2)
    x = torch.randn(2, w.K, device=DEV).to(torch.float16)
    y = quant_gemv(x, w, config={"BN": 4, "CH": 2, "num_warps": 4, "split": 3})
    assert y.dtype == torch.float16 and y.shape == (2, 6)
    check(x, w, y)


def test_quantize_act_matches_twin_and_is_reusable():
    torch.manual_seed(5)
    x = torch.randn(3, 160, device=DEV) * torch.rand(3, 160, device=DEV).pow(4) * 10
    x[1, 32:64] = 0.0
    xa = quantize_act(x, blocks_per_program=2)
    assert xa.shape == (3, 160) and xa.q.dtype == torch.int32 and xa.d.shape == (3, 5)
    assert torch.equal(dequantize_act(xa), quantize_act_ref(x))
    codes = xa.q.view(torch.int8).reshape(3, 5, 2, 16).sum(-1)          # the packed slice sums
    assert torch.equal((xa.s << 16) >> 16, codes[..., 0]) and torch.equal(xa.s >> 16, codes[..., 1])
    for qt in (8, 3, 10):                                 # one QuantAct, three weights
        w = make(qt, 9, 256 if qt == 10 else 160, seed=qt)
        if qt == 10:
            x256 = torch.randn(3, 256, device=DEV)
            xa, x = quantize_act(x256), x256
        y = quant_gemv(xa, w, config={"BN": 4, "CH": 2, "num_warps": 4, "split": 1})
        assert y.dtype == torch.float32 and rel(y, quant_gemv_ref(x, w)) < TOL["twin"]
        assert rel(y, quant_gemv_ref(xa, w)) < TOL["twin"]


@pytest.mark.parametrize("qt", QUANT_QTYPES, ids=IDS)
def test_gemv_int16_activations_every_qtype(qt):
    # "int16" activations (int8 codes plus int8 codes of their rounding error at a 254x finer
    # scale): the kernel equals its twin, and lands far closer to the float product than int8
    torch.manual_seed(qt + 40)
    w = make(qt, 13, small_k(qt), seed=qt)
    x = torch.randn(3, w.K, device=DEV) * torch.rand(3, w.K, device=DEV).pow(3) * 4
    x[0, 32:64] = 0.0
    cfg = {"BN": 8, "CH": 4, "num_warps": 4, "split": 2}
    y8 = quant_gemv(x, w, config=cfg)
    with use_act_precision("int16"):
        assert act_precision() == "int16"
        y16 = quant_gemv(x, w, config=cfg)
        twin = quant_gemv_ref(x, w)
    assert act_precision() == "int8"
    exact = quant_gemv_ref(x, w, act_quant=False)
    assert rel(y16, twin) < TOL["twin"]
    e16, e8 = rel(y16, exact), rel(y8, exact)
    assert e16 < tol.ACT16_QUANT_GEMV and e16 < e8 / 10, (e16, e8)


def test_quantize_act_int16_layout_and_errors():
    torch.manual_seed(6)
    x = torch.randn(3, 96, device=DEV) * 3
    x[2] = 0.0
    xa = quantize_act(x, blocks_per_program=2, wide=True)
    assert xa.wide and xa.shape == (3, 96) and xa.is_packed(3, 96, DEV)
    assert not xa.is_packed(3, 96 * 2, DEV) and not quantize_act(x).is_packed(3, 96 // 2, DEV)
    assert torch.equal(dequantize_act(xa), quantize_act_ref(x, wide=True))
    codes = xa.q.view(torch.int8).reshape(3, 3, 2, 32)     # [row, block, hi|residual, value]
    assert torch.equal(codes[:, :, 0], quantize_act(x).q.view(torch.int8).reshape(3, 3, 32))
    assert codes[:, :, 1].abs().max() <= 127 and codes[2].abs().sum() == 0
    sums = xa.pairs()[..., 2]                             # the residual codes' slice sums
    res = codes[:, :, 1].reshape(3, 3, 2, 16).sum(-1).to(torch.int32)
    assert torch.equal((sums << 16) >> 16, res[..., 0]) and torch.equal(sums >> 16, res[..., 1])
    assert torch.equal(xa.rows(1, 3).q, xa.q[1:3]) and xa.rows(1, 3).wide
    with pytest.raises(InvalidRequestError, match="int8, int16"):
        with use_act_precision("int4"):
            pass
    # "mixed": int16 blocks except the routed experts' input
    with use_act_precision("mixed"):
        assert quantize_act(x).wide and not QuantAct.empty(2, 64, DEV, wide_default(None, True)).wide
        assert wide_default(False) is False and wide_default(True, experts=True) is True
    assert not quantize_act(x).wide


def test_gemv_all_zero_activation_blocks_and_float_weights():
    w = make(12, 5, 512, seed=3)
    x = torch.randn(1, 512, device=DEV)
    x[:, 64:128] = 0.0                                    # whole int8 blocks of zeros
    check(x, w, quant_gemv(x, w, config={"BN": 8, "CH": 8, "num_warps": 4, "split": 1}))
    for qt in FLOAT_QTYPES:
        wf = make(qt, 5, 64, seed=4)
        xf = torch.randn(3, 64, device=DEV)
        assert rel(quant_gemv(xf, wf), quant_gemv_ref(xf, wf)) < tol.FP16


def test_gemv_rejects_bad_inputs():
    w = make(2, 8, 64)
    with pytest.raises(ValueError, match=r"\[T, 64\]"):
        quant_gemv(torch.randn(2, 32, device=DEV), w)
    with pytest.raises(TypeError, match="float32/float16/bfloat16"):
        quant_gemv(torch.ones(2, 64, dtype=torch.int32, device=DEV), w)
    with pytest.raises(ValueError, match="2-D"):
        quant_gemv(torch.randn(2, 64, device=DEV), make(2, 8, 64, lead=(2,)))


def test_config_splits_k_only_for_small_n():
    assert gemv_config(151936, 2048, 1, 14)["split"] == 1
    small = gemv_config(64, 8192, 1, 8)
    assert small["split"] > 1 and small["CH"] <= 8192 // 32


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8])
@pytest.mark.parametrize("qt,n,k", [(8, 5120, 2048), (8, 2048, 4096), (12, 768, 2048),
                                    (14, 2048, 768), (14, 4096, 14336), (10, 1000, 4096),
                                    (11, 1000, 4096), (13, 1000, 4096), (2, 1000, 4096),
                                    (3, 1000, 4096), (6, 1000, 4096), (7, 1000, 4096)])
def test_gemv_full_size_on_gpu(qt, n, k, tokens):
    torch.manual_seed(0)
    w = make(qt, n, k, seed=5)
    x = torch.randn(tokens, k, device=DEV, dtype=torch.bfloat16)
    check(x, w, quant_gemv(x, w))


# ---- split-K partials (quant_gemv_partials): one launch, plain stores, no zeroing ------------

def check_partials(qt, tokens, splits):
    torch.manual_seed(qt * 10 + tokens + 1)
    w = make(qt, 13, small_k(qt), seed=qt)            # a partial row block, K tiles with a tail
    x = torch.randn(tokens, w.K, device=DEV)
    xa = quantize_act(x)
    for split in splits:
        cfg = {"BN": 16, "CH": 4 if BLOCK_SIZES[qt][0] == 256 else 2, "num_warps": 4,
               "split": split}
        s = gemv_partials_split(w, tokens, cfg)
        assert 1 <= s <= split and (s > 1) == (split > 1)
        out = torch.full((s, tokens, 13), float("nan"), device=DEV)
        p = quant_gemv_partials(xa, w, config=cfg, out=out)
        assert p is out and torch.isfinite(p).all(), "a slice left unwritten"
        assert rel(sum_partials(p), quant_gemv_ref(x, w)) < TOL["twin"]
        if s > 1:                                         # every slice holds a real part
            y = quant_gemv(xa, w, config=cfg)             # atomics into a zeroed output
            assert rel(sum_partials(p), y) < TOL["twin"]  # float32 addition order only
            for i in range(s):
                assert rel(p[i], y) > tol.MUST_DIFFER * TOL["twin"]


# (the interpreter runs a program at a time: 1 and 3 tokens for every type, 8 tokens for one
# type of each kernel branch; all of them on the GPU)
@pytest.mark.parametrize("tokens,splits", [(1, (1, 4)), (3, (2,))])
@pytest.mark.parametrize("qt", QUANT_QTYPES, ids=IDS)
def test_gemv_partials_sum_to_gemv_every_qtype(qt, tokens, splits):
    check_partials(qt, tokens, splits)


@pytest.mark.parametrize("qt", QUANT_QTYPES if CUDA else [8, 12],
                         ids=IDS if CUDA else ["Q8_0", "Q4_K"])
def test_gemv_partials_eight_tokens(qt):
    check_partials(qt, 8, (1, 2, 4) if CUDA else (4,))


def test_gemv_partials_more_tokens_half_input_float_weights_and_bad_out():
    torch.manual_seed(7)
    w = make(8, 9, 256, seed=1)
    x = torch.randn(10, 256, device=DEV).to(torch.float16)       # two groups of <= 8 tokens
    cfg = {"BN": 16, "CH": 2, "num_warps": 4, "split": 3}
    p = quant_gemv_partials(x, w, config=cfg)
    assert p.dtype == torch.float32 and p.shape == (gemv_partials_split(w, 10, cfg), 10, 9)
    assert p.shape[0] > 1
    assert rel(sum_partials(p), quant_gemv_ref(x, w)) < TOL["twin"]
    for qt in FLOAT_QTYPES:                                      # float weights: one slice
        wf = make(qt, 5, 64, seed=4)
        xf = torch.randn(3, 64, device=DEV)
        pf = quant_gemv_partials(xf, wf)
        assert pf.shape == (1, 3, 5) and gemv_partials_split(wf, 3) == 1
        assert rel(pf[0], quant_gemv_ref(xf, wf)) < tol.FP16
    with pytest.raises(ValueError, match=r"out must be float32 \["):
        quant_gemv_partials(x, w, config=cfg, out=torch.empty(1, 10, 9, device=DEV))
    with pytest.raises(ValueError, match=r"\[T, 256\]"):
        quant_gemv_partials(torch.randn(2, 32, device=DEV), w)
