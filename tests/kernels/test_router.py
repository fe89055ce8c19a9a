"""Router kernel (softmax/sigmoid -> top-k -> weights) vs its torch twin router_ref (which matches
localmoe.model.routing.route).

Without CUDA the kernel runs through the Triton interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from localmoe.errors import UnsupportedModelError  # noqa: E402
from localmoe.kernels.keys import score_key  # noqa: E402
from localmoe.kernels.router import router, router_ref  # noqa: E402

from tests import tolerances as tol  # noqa: E402

DEV = "cuda" if CUDA else "cpu"

# family variants: qwen3moe / Mixtral (softmax, renormalized), qwen2moe / olmoe (softmax, not
# renormalized), DeepSeek-V3 style (sigmoid, selection bias, scale)
FAMILIES = {
    "qwen3moe": dict(gating="softmax", norm_topk_prob=True),
    "olmoe": dict(gating="softmax", norm_topk_prob=False),
    "sigmoid-bias": dict(gating="sigmoid", norm_topk_prob=True, expert_weights_scale=2.5, bias=True),
}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("t,e,k", [(1, 128, 8), (3, 60, 4), (8, 8, 2)])
def test_router_matches_route(family, t, e, k):
    kw = dict(FAMILIES[family])
    g = torch.Generator().manual_seed(t * 100 + e)
    logits = (torch.randn(t, e, generator=g) * 3).to(DEV)
    if kw.pop("bias", False):
        kw["selection_bias"] = (torch.randn(e, generator=g) * 0.1).to(DEV)
    w, ids = router(logits, k, **kw)
    rw, rids = router_ref(logits, k, **kw)
    assert ids.dtype == torch.int32 and torch.equal(ids.cpu(), rids.cpu())
    assert torch.allclose(w, rw, rtol=tol.FP32, atol=1e-7)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_twin_equals_the_model_reference_route(family):
    """router_ref is written apart from the model layer; it must agree with model.routing.route."""
    from localmoe.model.routing import route

    kw = dict(FAMILIES[family])
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 16, generator=g) * 3
    logits[0, 3] = logits[0, 9] = logits[0].max() + 1  # a tie inside the top-k
    if kw.pop("bias", False):
        kw["selection_bias"] = torch.randn(16, generator=g) * 0.1
    rw, rids = router_ref(logits, 4, **kw)
    w, ids = route(logits, 4, **kw)
    assert torch.equal(rids.long(), ids) and torch.equal(rw, w)


def test_ties_go_to_the_lower_expert_index():
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0, 2.0, 0.0]], device=DEV)
    w, ids = router(logits, 3, norm_topk_prob=True)
    assert ids.tolist() == [[1, 2, 4]]
    assert torch.allclose(w, torch.full_like(w, 1 / 3))
    _, rids = router_ref(logits, 3, norm_topk_prob=True)
    assert torch.equal(ids.cpu(), rids.cpu())


@pytest.mark.parametrize("pk", [False, True])
def test_fused_router_ties_and_signs(pk):
    """Tied logits (identical expert rows) go to the lower expert in both top-k forms; with
    sigmoid gating and a selection bias the selection scores are of both signs, which the
    packed form's integer keys must order as floats."""
    from localmoe.kernels.router import router_fused

    g = torch.Generator().manual_seed(11)
    d, e = 32, 16
    wr = torch.randn(e, d, generator=g)
    wr[9] = wr[3]
    wr[12] = wr[3]                                   # experts 3, 9, 12 always tie
    h = torch.randn(4, d, generator=g)
    h[0] = wr[3] * 4                                 # token 0: the tied trio on top
    wr, h = wr.to(DEV).t(), h.to(DEV)
    logits = (h.double() @ wr.double()).float()
    for kw in (dict(gating="softmax", norm_topk_prob=True),
               dict(gating="sigmoid", norm_topk_prob=True,
                    selection_bias=torch.linspace(-1.0, 1.0, e).to(DEV))):
        w, ids = router_fused(h, wr, 4, config={"packed_topk": pk, "num_warps": 1,
                                                "experts_per_program": 4}, **kw)
        rw, rids = router_ref(logits, 4, **kw)
        assert torch.equal(ids.cpu(), rids.cpu()), (kw, ids, rids)
        assert torch.allclose(w, rw, rtol=1e-5, atol=1e-6)
        if kw["gating"] == "softmax":
            assert ids[0].tolist()[:3] == [3, 9, 12]     # the tie, in expert order
    assert (logits < 0).any() and (logits > 0).any()


def test_router_rejects_bad_arguments():
    logits = torch.randn(2, 8, device=DEV)
    with pytest.raises(UnsupportedModelError, match="gating"):
        router(logits, 2, gating="relu")
    with pytest.raises(ValueError, match="top_k"):
        router(logits, 9)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("t,d,e,k,eb,nw,pk", [(1, 96, 128, 8, 8, 4, False), (1, 96, 128, 8, 2, 1, True),
                                              (3, 64, 60, 4, 16, 1, True), (8, 48, 8, 2, 4, 2, False)])
def test_fused_router_matches_matmul_then_route(family, t, d, e, k, eb, nw, pk):
    """router_fused (logits and routing in one launch; the last program of a token routes it)
    gives the ids of route(h @ W) and its weights; its counters are left at zero, so a second
    launch (a CUDA graph replay) routes again."""
    from localmoe.kernels.router import _counters, router_fused

    kw = dict(FAMILIES[family])
    g = torch.Generator().manual_seed(t * 10 + e)
    h = torch.randn(t, d, generator=g).to(DEV)
    # expert-major storage (as the triton backend keeps it), seen as [D, E]; and plain [D, E]
    wr = (torch.randn(e, d, generator=g) * 0.5).to(DEV).t()
    if t == 3:
        wr = wr.contiguous()
    if kw.pop("bias", False):
        kw["selection_bias"] = (torch.randn(e, generator=g) * 0.1).to(DEV)
    rw, rids = router_ref((h.double() @ wr.double()).float(), k, **kw)
    for _ in range(2):
        w, ids = router_fused(h, wr, k, config={"experts_per_program": eb, "num_warps": nw,
                                                "packed_topk": pk}, **kw)
        assert torch.equal(ids.cpu(), rids.cpu())
        assert torch.allclose(w, rw, rtol=1e-5, atol=1e-6)
        assert int(_counters(t, h.device)[:t].abs().sum()) == 0
    with pytest.raises(ValueError, match="w_router"):
        router_fused(h, torch.zeros(d + 1, e, device=DEV), k)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("t,d,e,k,eb,nw,pk,delta", [
    (1, 96, 128, 8, 8, 4, False, "partials"), (1, 64, 128, 8, 1, 1, True, "plain"),
    (3, 64, 60, 4, 16, 1, True, "partials"), (8, 32, 8, 2, 4, 2, False, None)])
def test_norm_router_matches_norm_then_route(family, t, d, e, k, eb, nw, pk, delta):
    """norm_router_fused (residual add + RMSNorm + int8 blocks + router logits + routing in
    one launch) against its two-launch equivalent add_rms_norm_quant -> router_fused: the same
    residual, int8 blocks and float rows bit for bit, ids equal and weights to float32
    rounding (the logits' sums run in another order); counters left at zero (a graph replay
    routes again); x itself is refused as the residual output. D = 96 pads the row to 128
    lanes (masked), the partials have 3 slices, E = 60 pads the experts. At 3 tokens the
    activations are "int16" (int8 codes plus their rounding error's: act_precision)."""
    from localmoe.kernels.fused_norm import add_rms_norm_quant
    from localmoe.kernels.quant_gemv import use_act_precision
    from localmoe.kernels.router import _counters, norm_router_fused, router_fused

    def prec():
        return use_act_precision("int16" if t == 3 else "int8")

    kw = dict(FAMILIES[family])
    g = torch.Generator().manual_seed(t * 10 + e)
    x = torch.randn(t, d, generator=g).to(torch.bfloat16).to(DEV)
    dl = {"partials": torch.randn(3, t, d, generator=g), "plain": torch.randn(t, d, generator=g),
          None: None}[delta]
    dl = dl.to(DEV) if dl is not None else None
    nw_ = (1.0 + 0.1 * torch.randn(d, generator=g)).to(torch.bfloat16).to(DEV)
    wr = (torch.randn(e, d, generator=g) * 0.5).to(DEV).t()
    if kw.pop("bias", False):
        kw["selection_bias"] = (torch.randn(e, generator=g) * 0.1).to(DEV)
    cfg = {"experts_per_program": eb, "num_warps": nw, "packed_topk": pk}
    with prec():
        r0, hq0, hf0 = add_rms_norm_quant(x, [dl] if dl is not None else [], nw_, 1e-6,
                                          residual_out=torch.empty_like(x),
                                          want_float=torch.float32)
    w0, ids0 = router_fused(hf0, wr, k, config=cfg, **kw)
    for _ in range(2):
        with prec():
            r, hq, hf, w, ids = norm_router_fused(x, dl, nw_, 1e-6, wr, k, config=cfg,
                                                  residual_out=torch.empty_like(x),
                                                  want_float=torch.float32, **kw)
        assert hq.wide == hq0.wide == (t == 3)
        assert torch.equal(r, r0)
        if CUDA:   # the norm's sum may run in another order: h to one bf16 ulp
            from localmoe.kernels.quant_gemv import dequantize_act

            assert torch.allclose(hf, hf0, rtol=2 ** -7, atol=1e-6)
            assert torch.allclose(dequantize_act(hq), dequantize_act(hq0), rtol=0.02, atol=0.02)
        else:
            assert torch.equal(hf, hf0)
            assert torch.equal(hq.q, hq0.q) and torch.equal(hq.pairs(), hq0.pairs())
        assert torch.equal(ids.cpu(), ids0.cpu())
        assert torch.allclose(w, w0, rtol=1e-5, atol=1e-6)
        assert int(_counters(t, x.device)[:t].abs().sum()) == 0
    # without the routing (left to the fused MoE's first launch): the same residual and
    # blocks, and logits that the router twin routes to the same ids
    from localmoe.kernels.router import norm_router_logits, router_ref

    with prec():
        r2, hq2, hf2, rt = norm_router_logits(x, dl, nw_, 1e-6, wr, k, config=cfg,
                                              residual_out=torch.empty_like(x),
                                              want_float=torch.float32, **kw)
    assert torch.equal(r2, r) and torch.equal(hq2.q, hq.q) and torch.equal(hf2, hf)
    assert rt.logits.shape == (t, e) and rt.ids.shape == rt.weights.shape == (t, k)
    w2, ids2 = router_ref(rt.logits, k, **kw)
    assert torch.equal(ids2.cpu(), ids0.cpu())
    assert torch.allclose(w2, w0, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="must not be x"):
        norm_router_fused(x, dl, nw_, 1e-6, wr, k, residual_out=x, **kw)


@triton.jit
def _top_kernel(x_ptr, o_ptr, N: tl.constexpr, K: tl.constexpr):
    i = tl.arange(0, N)
    key = score_key(tl.load(x_ptr + i), N - 1 - i)
    tl.store(o_ptr + tl.arange(0, K), tl.topk(key, K))


@pytest.mark.parametrize("n,k", [(128, 8), (16, 4), (1024, 64), (64, 64)])
def test_tl_topk_returns_its_keys_sorted_descending(n, k):
    """The MoE routing head (fused_moe._route_top) and the sampler's last top-k merge take
    ``tl.topk``'s keys as sorted, largest first, without sorting them again (session 31): if
    a Triton release stops sorting them, this fails. Packed keys (localmoe.kernels.keys) with
    ties in the scores, as the kernels build them, against torch.sort."""
    g = torch.Generator().manual_seed(n + k)
    for trial in range(4):
        x = torch.randn(n, generator=g)
        if trial % 2:                        # many ties: the low word (lower index) decides
            x = torch.randint(-2, 3, (n,), generator=g).float()
        out = torch.empty(k, dtype=torch.int64)
        xd, od = x.to(DEV), out.to(DEV)
        _top_kernel[(1,)](xd, od, N=n, K=k)
        bits = x.view(torch.int32).long()
        mono = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        keys = (mono << 32) | (n - 1 - torch.arange(n))
        assert torch.equal(od.cpu(), torch.sort(keys, descending=True).values[:k])
