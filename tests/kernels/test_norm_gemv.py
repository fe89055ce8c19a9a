"""The residual add + RMSNorm + int8 quantization fused into the quantized GEMV
(:func:`localmoe.kernels.norm_gemv.norm_gemv_partials`) against the two launches it replaces
(``add_rms_norm_quant`` then ``quant_gemv_partials``) and against its torch twin.

Without CUDA the kernel runs through the Triton interpreter at small awkward shapes (``D`` not a
power of two, a partial row block, K parts with a tail); there the fused partials equal the
unfused chain's bit for bit. On the GPU the norm's float32 reduction may be ordered
differently, so the partials are bounded by the twin's tolerance; full sizes are marked gpu.
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from localmoe.kernels.fused_norm import add_rms_norm_quant  # noqa: E402
from localmoe.kernels.norm_gemv import (  # noqa: E402
    MAX_TOKENS, norm_gemv_partials, norm_gemv_partials_ref,
)
from localmoe.kernels.qtensor import QTYPE_NAMES, QUANT_QTYPES  # noqa: E402
from localmoe.kernels.quant_gemv import (  # noqa: E402
    QuantAct, gemv_partials_split, quant_gemv_partials, sum_partials,
)

from tests import tolerances as tol  # noqa: E402
from tests.kernels.test_quant_gemv import make, small_k  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
EPS = 1e-6
IDS = [QTYPE_NAMES[q] for q in QUANT_QTYPES]
TWIN = tol.FP32 if not CUDA else tol.FP32_DEVICE


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def deltas_of(kind: str, t: int, d: int, dtype):
    if kind == "none":
        return []
    if kind == "moe":                           # the previous layer's MoE output
        return [torch.randn(t, d, device=DEV)]
    # the O projection's split-K partials, an MoE output, a shared expert's output
    return [torch.randn(3, t, d, device=DEV), torch.randn(t, d, device=DEV),
            torch.randn(t, d, device=DEV).to(dtype)]


def unfused(x, deltas, nw, w, cfg, wide=None):
    r, hq, _ = add_rms_norm_quant(x, deltas, nw, EPS, residual_out=torch.empty_like(x),
                                  quant_out=QuantAct.empty(x.shape[0], x.shape[1], DEV, wide))
    return r, quant_gemv_partials(hq, w, config=cfg)


def check(qt, t, kind, dtype=torch.float16, cfg=None, wide=None, norm_weight=True, seed=0):
    torch.manual_seed(seed * 100 + qt * 10 + t)
    w = make(qt, 13, small_k(qt), seed=qt)               # 13 rows: a partial row block
    k = w.shape[1]
    x = (torch.randn(t, k, device=DEV) * 3).to(dtype)
    deltas = deltas_of(kind, t, k, dtype)
    nw = (torch.rand(k, device=DEV) + 0.5).to(dtype) if norm_weight else None
    cfg = cfg or {"BN": 8, "CH": 2, "num_warps": 4, "split": 2}
    s = gemv_partials_split(w, t, cfg)
    out = torch.full((s, t, 13), float("nan"), device=DEV)
    r = torch.full_like(x, float("nan"))
    r1, p = norm_gemv_partials(x, deltas, nw, EPS, w, residual_out=r, config=cfg, wide=wide,
                               out=out)
    assert r1 is r and p is out and torch.isfinite(p).all(), "a slice left unwritten"
    r2, p2 = unfused(x, deltas, nw, w, cfg, wide)
    assert torch.equal(r1, r2)                           # the residual: one rounding, always
    if CUDA:
        assert rel(sum_partials(p), sum_partials(p2)) < tol.FP16
    else:
        assert torch.equal(p, p2)
    rr, y = norm_gemv_partials_ref(x, deltas, nw, EPS, w, wide=wide)
    assert rel(rr, r1) < tol.FP16       # (the interpreter rounds bfloat16 its own way)
    exact = not CUDA and dtype != torch.bfloat16
    assert rel(sum_partials(p), y) < (TWIN if exact else tol.FP16)
    return x, p


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("qt", QUANT_QTYPES, ids=IDS)
def test_matches_the_unfused_launches_every_qtype(qt, tokens):
    check(qt, tokens, "moe")


@pytest.mark.parametrize("kind", ["none", "mixed"])
def test_deltas_of_every_kind(kind):
    check(12, 2, kind)


def test_bfloat16_stream_no_norm_weight_one_part():
    check(14, 1, "moe", dtype=torch.bfloat16, norm_weight=False,
          cfg={"BN": 16, "CH": 4, "num_warps": 2, "split": 1})


def test_float32_stream_lookahead_unmasked_tiles():
    # N, K and tokens that drop every bounds mask (16 rows, 2 whole tiles per part, 2 tokens)
    torch.manual_seed(3)
    w = make(8, 16, 512, seed=3)
    x = torch.randn(2, 512, device=DEV)
    d = [torch.randn(2, 512, device=DEV)]
    cfg = {"BN": 8, "CH": 4, "num_warps": 4, "split": 2, "lookahead": True}
    r, p = norm_gemv_partials(x, d, None, EPS, w, residual_out=torch.empty_like(x), config=cfg)
    r2, p2 = unfused(x, d, None, w, cfg)
    assert torch.equal(r, r2)
    assert torch.equal(p, p2) if not CUDA else rel(p, p2) < tol.FP16


def test_int16_activations():
    check(12, 1, "moe", wide=True)


def test_eight_tokens_one_launch_and_nine_in_two_paths():
    # 8 tokens: one launch; 9: the unfused launches (the GEMV is built for 1-8 tokens)
    for t in (MAX_TOKENS, MAX_TOKENS + 1):
        x, p = check(8, t, "moe", cfg={"BN": 16, "CH": 4, "num_warps": 4, "split": 1})
        assert p.shape[1] == t


def test_residual_not_stored_and_zero_tokens():
    torch.manual_seed(4)
    w = make(2, 8, 64, seed=4)
    x = torch.randn(1, 64, device=DEV, dtype=torch.float16)
    keep = x.clone()
    r, p = norm_gemv_partials(x, [], None, EPS, w, residual_out=None)
    assert r is None and torch.equal(x, keep)
    assert rel(sum_partials(p), norm_gemv_partials_ref(x, [], None, EPS, w)[1]) < TWIN
    r0, p0 = norm_gemv_partials(x[:0], [], None, EPS, w, residual_out=torch.empty(0, 64,
                                device=DEV, dtype=torch.float16))
    assert r0.shape == (0, 64) and p0.shape[1:] == (0, 8)


def test_rejects_bad_inputs():
    w = make(2, 8, 64, seed=5)
    x = torch.randn(1, 64, device=DEV, dtype=torch.float16)
    with pytest.raises(ValueError, match="must not be x"):
        norm_gemv_partials(x, [], None, EPS, w, residual_out=x)
    with pytest.raises(ValueError, match=r"QuantTensor \[N, 64\]"):
        norm_gemv_partials(x, [], None, EPS, make(2, 8, 96), residual_out=None)
    with pytest.raises(ValueError, match="quantized GGUF type"):             # F16 weights
        norm_gemv_partials(x, [], None, EPS, make(1, 8, 64), residual_out=None)
    with pytest.raises(ValueError, match="out must be float32"):
        norm_gemv_partials(x, [], None, EPS, w, residual_out=None,
                           out=torch.empty(1, 1, 9, device=DEV))
    with pytest.raises(ValueError, match="at most 3"):
        norm_gemv_partials(x, [x, x, x, x], None, EPS, w, residual_out=None)
    with pytest.raises(ValueError, match="multiple of 32"):
        norm_gemv_partials(torch.randn(1, 40, device=DEV), [], None, EPS, w, residual_out=None)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4, 8])
@pytest.mark.parametrize("qt,n,k", [(12, 5120, 2048), (8, 5120, 2048), (14, 6144, 4096)])
def test_full_size_on_gpu(qt, n, k, tokens):
    # Qwen3-30B-A3B's q/k/v (Q4_K or Q8_0), Mixtral's (Q6_K), the device table's launch choice
    torch.manual_seed(tokens)
    w = make(qt, n, k, seed=7)
    x = torch.randn(tokens, k, device=DEV, dtype=torch.bfloat16)
    d = [torch.randn(tokens, k, device=DEV)]
    nw = torch.rand(k, device=DEV, dtype=torch.bfloat16) + 0.5
    r, p = norm_gemv_partials(x, d, nw, EPS, w, residual_out=torch.empty_like(x))
    r2, p2 = unfused(x, d, nw, w, None)
    assert torch.equal(r, r2)
    assert rel(sum_partials(p), sum_partials(p2)) < tol.FP16
