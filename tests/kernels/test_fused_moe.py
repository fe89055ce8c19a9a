"""Fused MoE decode kernels (gate/up + act, down + weighted sum) vs their torch twin.

Without CUDA the kernels run through the Triton interpreter (TRITON_INTERPRET=1) at small
shapes whose expert pairs cover every GGUF quant type; with CUDA the same tests run on the GPU,
plus Qwen3-30B-A3B-sized experts and a no-host-sync check (marked gpu).
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from localmoe.kernels.fused_moe import fused_moe, fused_moe_ref  # noqa: E402
from localmoe.kernels.quant_gemv import quantize_act, use_act_precision  # noqa: E402
from localmoe.kernels.qtensor import BLOCK_SIZES, QTYPE_NAMES, QuantTensor, random_gguf_blocks  # noqa: E402

from tests import tolerances as tol  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
# as in test_quant_gemv; "float" doubles there: x and h are both rounded to int8 on the way
TOL = {"twin": tol.FP32 if not CUDA else tol.FP32_DEVICE, "float": tol.ACT_QUANT_MOE}
# (gate/up qtype, down qtype): together every quant type, K-quants with legacy ones
PAIRS = [(12, 14), (8, 2), (10, 11), (13, 3), (6, 7), (14, 12), (23, 20)]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def experts(qt_gu, qt_d, e, f, d, seed=0):
    g = QuantTensor.from_gguf(random_gguf_blocks(qt_gu, (e, f, d), seed=seed), qt_gu, (e, f, d), DEV)
    u = QuantTensor.from_gguf(random_gguf_blocks(qt_gu, (e, f, d), seed=seed + 1), qt_gu, (e, f, d), DEV)
    wd = QuantTensor.from_gguf(random_gguf_blocks(qt_d, (e, d, f), seed=seed + 2), qt_d, (e, d, f), DEV)
    return QuantTensor.interleave_rows(g, u), wd


def route(t, e, top_k, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g)
    w, ids = torch.topk(torch.softmax(logits, -1), top_k)
    return ids.to(torch.int32).to(DEV), (w / w.sum(-1, keepdim=True)).to(DEV)


# each program serves one (token, expert) pair, so more tokens add indexing, not new code paths:
# every pair at 1 token, two cheap legacy pairs at 3 and 8 (the interpreter is slow)
CASES = [(p, 1) for p in PAIRS] + [(PAIRS[1], 3), (PAIRS[4], 8)]


@pytest.mark.parametrize("pair,tokens", CASES,
                         ids=[f"{QTYPE_NAMES[a]}-{QTYPE_NAMES[b]}-t{t}" for (a, b), t in CASES])
def test_fused_moe_matches_twin(pair, tokens):
    qt_gu, qt_d = pair
    e, top_k = 5, 2
    # K of gate/up (d) and of down (f): 256 for K-quants, 3 blocks of 32 for legacy types;
    # BN 64 leaves a partial row block at 96 rows; CH 4 walks 256-value down rows in 2 tiles
    d = 256 if BLOCK_SIZES[qt_gu][0] == 256 else 96
    f = 256 if BLOCK_SIZES[qt_d][0] == 256 else 96
    gu, wd = experts(qt_gu, qt_d, e, f, d, seed=tokens)
    torch.manual_seed(tokens)
    x = torch.randn(tokens, d, device=DEV)
    ids, w = route(tokens, e, top_k, seed=tokens)
    slot_of = torch.tensor([3, 0, 4, 1, 2], dtype=torch.int32, device=DEV)   # not the identity
    act = "gelu" if tokens == 3 or qt_gu == 14 else "silu"
    out = torch.full((tokens, d), float("nan"), device=DEV)
    cfg = {"gate_up": {"BN": 64, "CH": 8}, "down": {"BN": 64 if d == 96 else 128, "CH": 4}}
    y = fused_moe(x, gu, wd, ids, w, slot_of=slot_of, activation=act, out=out, config=cfg)
    assert y is out and torch.isfinite(y).all()
    ref = fused_moe_ref(x, gu, wd, ids, w, slot_of=slot_of, activation=act)
    assert rel(y, ref) < TOL["twin"]
    flt = fused_moe_ref(x, gu, wd, ids, w, slot_of=slot_of, activation=act, act_quant=False)
    assert rel(y, flt) < TOL["float"]


def test_quantized_x_and_unmasked_tiles():
    # x given as a QuantAct skips the quantize launch; F % BN == 0 and whole K tiles drop masks
    gu, wd = experts(3, 8, 4, 64, 96, seed=9)
    x = torch.randn(2, 96, device=DEV)
    ids, w = route(2, 4, 2, seed=3)
    xa = quantize_act(x)
    cfg = {"gate_up": {"BN": 32, "CH": 1}, "down": {"BN": 32, "CH": 2}}
    y = fused_moe(xa, gu, wd, ids, w, config=cfg)
    assert y.dtype == torch.float32 and rel(y, fused_moe_ref(xa, gu, wd, ids, w)) < TOL["twin"]
    with pytest.raises(ValueError, match="multiples of 32"):
        fused_moe(x, gu, wd, ids, w, config={"gate_up": {"BN": 16}})


@pytest.mark.parametrize("tiled,split", [(False, 1), (True, 2)], ids=["unrolled", "tile-split"])
def test_int16_activations_match_twin_and_beat_int8(tiled, split):
    # act_precision "int16": x quantized with its residual codes, h written the same way by the
    # gate/up epilogue and read by the down launch (both of its launch shapes)
    e, f, d = 5, 256, 256
    gu, wd = experts(12, 14, e, f, d, seed=21)
    torch.manual_seed(21)
    x = torch.randn(3, d, device=DEV)
    ids, w = route(3, e, 3, seed=21)
    cfg = {"gate_up": {"BN": 64, "CH": 4, "split": split},
           "down": {"BN": 128, "CH": 4, "experts_tile": tiled}}
    y8 = fused_moe(x, gu, wd, ids, w, config=cfg)
    with use_act_precision("int16"):
        xa = quantize_act(x)
        y16 = fused_moe(xa, gu, wd, ids, w, config=cfg)
        ref = fused_moe_ref(x, gu, wd, ids, w)
    assert xa.wide and rel(y16, ref) < TOL["twin"]
    assert rel(fused_moe_ref(xa, gu, wd, ids, w), ref) < TOL["twin"]     # h follows x's precision
    flt = fused_moe_ref(x, gu, wd, ids, w, act_quant=False)
    e16, e8 = rel(y16, flt), rel(y8, flt)
    assert e16 < tol.ACT16_QUANT_GEMV and e16 < e8 / 10, (e16, e8)


@pytest.mark.parametrize("split,qt,f,bn,ch", [(2, 8, 96, 64, 2), (4, 12, 64, 32, 1),
                                               (3, 2, 64, 32, 1)])
def test_split_k_gate_up_matches_the_twin_and_resets_its_counters(split, qt, f, bn, ch):
    """gate/up with K split over several programs (the last to finish adds the parts in order
    and finishes the block): the twin's result, the unsplit kernel's up to float32 order, the
    counters back at zero (a second call, and a CUDA graph replay, start clean) and the same
    bits again; a d_ff that is not a multiple of BN (96 of 64: masked), a split that does not
    divide K's chunks (3 parts of 8: 3, 3, 2), 2 tokens x top-2."""
    from localmoe.kernels import fused_moe as fm

    d = 256
    gu, wd = experts(qt, 8, 4, f, d, seed=5)
    x = torch.randn(2, d, device=DEV)
    ids, w = route(2, 4, 2, seed=4)
    one = fused_moe(x, gu, wd, ids, w, config={"gate_up": {"BN": bn, "CH": ch}})
    cfg = {"gate_up": {"BN": bn, "CH": ch, "split": split}}
    a = fused_moe(x, gu, wd, ids, w, config=cfg)
    assert rel(a, fused_moe_ref(x, gu, wd, ids, w)) < TOL["twin"]
    assert rel(a, one) < TOL["twin"]
    p, cnt = fm._SCRATCH[str(a.device)]
    assert p.shape[0] >= split and not cnt.any()
    b = fused_moe(x, gu, wd, ids, w, config=cfg)
    assert torch.equal(a, b)


@pytest.mark.parametrize("qt,top_k,bn,ch", [(12, 3, 32, 4), (14, 2, 64, 8), (8, 4, 32, 2),
                                             (11, 3, 64, 2), (23, 2, 32, 4)],
                         ids=["Q4_K-top3", "Q6_K-top2", "Q8_0-top4", "Q3_K-top3", "IQ4_XS-top2"])
def test_down_with_the_experts_in_one_tile(qt, top_k, bn, ch):
    """moe_down's ``experts_tile`` launch (a token's top-k experts as the tile's first
    dimension, padded to a power of two: top-3 runs 4 lanes, one masked): the twin's result
    and the unrolled launch's up to float32 order, the slot table honoured; a partial row
    block (d = 96 rows in blocks of 64) and a K range that is not whole tiles (Q8_0: 3 chunks
    in tiles of 2) are masked."""
    e, f = 5, 96 if qt == 8 else 256
    d = 96 if bn == 64 else 256
    gu, wd = experts(8 if d == 96 else 12, qt, e, f, d, seed=qt)
    x = torch.randn(3, d, device=DEV)
    ids, w = route(3, e, top_k, seed=qt)
    slot_of = torch.tensor([2, 4, 0, 3, 1], dtype=torch.int32, device=DEV)
    ref = fused_moe_ref(x, gu, wd, ids, w, slot_of=slot_of)
    unrolled = fused_moe(x, gu, wd, ids, w, slot_of=slot_of,
                         config={"gate_up": {"BN": 32, "CH": 4}, "down": {"BN": bn, "CH": ch}})
    tiled = fused_moe(x, gu, wd, ids, w, slot_of=slot_of,
                      config={"gate_up": {"BN": 32, "CH": 4},
                              "down": {"BN": bn, "CH": ch, "experts_tile": True}})
    assert torch.isfinite(tiled).all()
    # both launches read the same h (one gate/up kernel): equal up to float32 order
    assert rel(tiled, unrolled) < TOL["twin"]
    # the twin rounds its own h to int8: on the GPU a value at a rounding boundary (the
    # kernel's exp) can land on the other code (seen once: 6.6e-4 on Q8_0-top4)
    assert rel(tiled, ref) < (TOL["float"] if CUDA else TOL["twin"])


@pytest.mark.parametrize("qts", [(12, 14), (10, 11)], ids=["Q4_K-Q6_K", "Q2_K-Q3_K"])
@pytest.mark.parametrize("stages", [2, 3])
def test_pipelined_k_loops_compute_what_the_plain_ones_do(qts, stages):
    """``stages`` > 1 (the K loops' loads pipelined through shared memory on the GPU,
    Triton's ``tl.range(num_stages=)``) changes when weights arrive, not the arithmetic: the
    same bits as ``stages`` 1 for gate/up (split and not) and both down launches, over K
    ranges of several tiles with a tail."""
    if not CUDA and (stages, qts) != (2, (12, 14)):
        pytest.skip("CI time: the interpreter runs one variant (the GPU all)")
    e, f, d = 5, 256, 512
    gu, wd = experts(*qts, e, f, d, seed=7)
    x = torch.randn(2, d, device=DEV)
    ids, w = route(2, e, 2, seed=7)
    ch = 2 if qts[0] in (10, 11) else 4       # 64-value chunks: 8 of them, 4 tiles
    for split, et in ((1, False), (2, True)):
        base = {"gate_up": {"BN": 32, "CH": ch, "split": split},
                "down": {"BN": 64, "CH": 2, "experts_tile": et}}
        piped = {k: dict(v, stages=stages) for k, v in base.items()}
        a = fused_moe(x, gu, wd, ids, w, config=base)
        b = fused_moe(x, gu, wd, ids, w, config=piped)
        assert torch.isfinite(b).all()
        assert torch.equal(a, b) if not CUDA else rel(b, a) < TOL["twin"], (split, et)
    assert rel(b, fused_moe_ref(x, gu, wd, ids, w)) < (TOL["float"] if CUDA else TOL["twin"])


@pytest.mark.parametrize("pair", PAIRS, ids=[f"{QTYPE_NAMES[a]}-{QTYPE_NAMES[b]}" for a, b in PAIRS])
def test_lookahead_k_loops_compute_what_the_plain_ones_do(pair):
    """``lookahead`` (the next K tile's loads issued into registers before this tile's dots)
    changes when the weights arrive, not the arithmetic: the same bits as the plain loop for
    gate/up (split and not) and both down launches, every GGUF type, over K ranges of one tile,
    several tiles and a tail."""
    e, f, d = 4, 256, 768       # K of 24 (or 12 64-value) chunks for gate/up, 8 (4) for down
    gu, wd = experts(*pair, e, f, d, seed=11)
    x = torch.randn(1, d, device=DEV)
    ids, w = route(1, e, 2, seed=11)
    for split, et, ch in ((1, False, 8), (2, True, 2), (1, True, 32)):
        base = {"gate_up": {"BN": 128, "CH": ch, "split": split},
                "down": {"BN": 128, "CH": ch, "experts_tile": et}}
        ahead = {k: dict(v, lookahead=True) for k, v in base.items()}
        a = fused_moe(x, gu, wd, ids, w, config=base)
        b = fused_moe(x, gu, wd, ids, w, config=ahead)
        assert torch.isfinite(b).all()
        assert torch.equal(a, b) if not CUDA else rel(b, a) < TOL["twin"], (split, et, ch)
    assert rel(b, fused_moe_ref(x, gu, wd, ids, w)) < (TOL["float"] if CUDA else TOL["twin"])


def test_slot_table_is_read_on_the_device():
    gu, wd = experts(8, 8, 4, 32, 64, seed=7)
    x = torch.randn(1, 64, device=DEV)
    ids, w = route(1, 4, 2, seed=1)
    cfg = {"gate_up": {"BN": 32, "CH": 2}, "down": {"BN": 64, "CH": 1}}
    base = fused_moe(x, gu, wd, ids, w, config=cfg)
    assert rel(base, fused_moe_ref(x, gu, wd, ids, w)) < TOL["twin"]
    # pointing every expert at slot 0 must change the result to expert 0's
    zero = torch.zeros(4, dtype=torch.int32, device=DEV)
    moved = fused_moe(x, gu, wd, ids, w, slot_of=zero, config=cfg)
    assert rel(moved, fused_moe_ref(x, gu, wd, ids, w, slot_of=zero)) < TOL["twin"]
    assert rel(moved, base) > tol.FP16


@pytest.mark.parametrize("tile", [False, True])
def test_no_slot_table_reads_slot_e_as_the_identity_table_does(tile):
    """slot_of=None (no table read: every expert in its own slot) gives the identity table's
    result bit for bit, in both launches and both down paths (experts unrolled or one tile),
    at 2 tokens; a permuted table gives another."""
    gu, wd = experts(8, 8, 4, 32, 64, seed=3)
    x = torch.randn(2, 64, device=DEV)
    ids, w = route(2, 4, 2, seed=2)
    cfg = {"gate_up": {"BN": 32, "CH": 2}, "down": {"BN": 64, "CH": 1, "experts_tile": tile}}
    none = fused_moe(x, gu, wd, ids, w, slot_of=None, config=cfg)
    ident = fused_moe(x, gu, wd, ids, w, config=cfg,
                      slot_of=torch.arange(4, dtype=torch.int32, device=DEV))
    assert torch.equal(none, ident)
    perm = torch.tensor([1, 0, 3, 2], dtype=torch.int32, device=DEV)
    assert rel(fused_moe(x, gu, wd, ids, w, slot_of=perm, config=cfg), none) > tol.FP16


def test_fused_moe_rejects_bad_inputs():
    gu, wd = experts(8, 8, 4, 32, 64)
    x = torch.randn(2, 64, device=DEV)
    ids, w = route(2, 4, 2, seed=0)
    with pytest.raises(ValueError, match=r"\[T, 64\]"):
        fused_moe(torch.randn(2, 32, device=DEV), gu, wd, ids, w)
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe(x, gu, gu, ids, w)
    with pytest.raises(ValueError, match="top_k"):
        fused_moe(x, gu, wd, ids[:1], w[:1])
    with pytest.raises(ValueError, match="slot_of"):
        fused_moe(x, gu, wd, ids, w, slot_of=torch.arange(4, device=DEV))
    with pytest.raises(ValueError, match="activation"):
        fused_moe(x, gu, wd, ids, w, activation="relu")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [{"gate_up": {"split": 1}}, {"gate_up": {"split": 4}},
                                     {"gate_up": {"split": 2, "maxnreg": 128}},
                                     {"down": {"BN": 1, "CH": 32, "num_warps": 1, "experts_tile": True}},
                                     {"down": {"BN": 4, "CH": 32, "num_warps": 4, "experts_tile": True}},
                                     {"gate_up": {"stages": 3}, "down": {"stages": 3}},
                                     {"gate_up": {"lookahead": True}, "down": {"lookahead": True}},
                                     {"gate_up": {"CH": 8, "lookahead": True},
                                      "down": {"BN": 4, "CH": 8, "num_warps": 4, "experts_tile": True,
                                               "lookahead": True}}],
                         ids=["split1", "split4", "split2-maxnreg128", "down-experts-tile-bn1",
                              "down-experts-tile-bn4", "stages3", "lookahead", "lookahead-ch8"])
@pytest.mark.parametrize("tokens", [1, 8])
@pytest.mark.parametrize("shape,qts", [((128, 768, 2048, 8), (12, 12)), ((64, 1024, 2048, 8), (12, 14)),
                                       ((8, 14336, 4096, 2), (12, 14))],
                         ids=["qwen3-30b-a3b", "olmoe-1b-7b", "mixtral-8x7b"])
def test_fused_moe_full_size_on_gpu(shape, qts, tokens, variant):
    e, f, d, top_k = shape
    gu, wd = experts(*qts, e, f, d, seed=1)
    x = torch.randn(tokens, d, device=DEV, dtype=torch.bfloat16)
    ids, w = route(tokens, e, top_k, seed=2)
    cfg = variant
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")      # no host sync inside the two launches
    try:
        y = fused_moe(x, gu, wd, ids, w, slot_of=torch.arange(e, dtype=torch.int32, device=DEV),
                      config=cfg)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = fused_moe_ref(x, gu, wd, ids, w)
    assert rel(y, ref) < tol.BF16


@pytest.mark.parametrize("gating,norm,bias,split,e,top_k", [
    ("softmax", True, False, 1, 8, 2),       # Mixtral-like
    ("softmax", False, False, 2, 12, 4),     # split K, E padded to 16
    ("sigmoid", True, True, 1, 6, 3)],       # DeepSeek-V3-like: selection bias, E not 2**n
    ids=["softmax-norm", "softmax-split", "sigmoid-bias"])
def test_routing_in_the_gate_up_launch(gating, norm, bias, split, e, top_k):
    """fused_moe(route=Routing(logits)): launch 1 routes every token itself (softmax without
    a selection bias: one bitonic top-k; else router.route_pick) and writes the ids and
    weights launch 2 reads: the router twin's ids and weights, and the output of fused_moe
    fed with those ids, bit for bit; ties go to the lower expert."""
    from localmoe.kernels.router import Routing, router_ref

    t, f, d = 3, 64, 96
    gu, wd = experts(8, 2, e, f, d, seed=31)
    g = torch.Generator().manual_seed(31)
    x = torch.randn(t, d, generator=g).to(DEV)
    logits = torch.randn(t, e, generator=g)
    logits[1, :] = 0.5                          # all tied: the lowest experts win
    sb = (torch.randn(e, generator=g) * 0.1).to(DEV) if bias else None
    kw = dict(gating=gating, norm_topk_prob=norm, expert_weights_scale=1.5, selection_bias=sb)
    w_ref, ids_ref = router_ref(logits.to(DEV), top_k, **kw)
    slot_of = torch.randperm(e, generator=g).to(torch.int32).to(DEV)
    ids_buf = torch.full((t, top_k), -1, dtype=torch.int32, device=DEV)
    w_buf = torch.full((t, top_k), float("nan"), device=DEV)
    rt = Routing(logits.to(DEV), top_k, gating, norm, 1.5, sb, ids_buf, w_buf)
    cfg = {"gate_up": {"BN": 32, "CH": 2, "split": split}, "down": {"BN": 32, "CH": 2}}
    y = fused_moe(x, gu, wd, None, None, slot_of=slot_of, config=cfg, route=rt)
    assert torch.equal(ids_buf.cpu(), ids_ref.cpu())
    if not bias:                             # (a selection bias breaks the tie)
        assert ids_buf[1].tolist() == list(range(top_k))
    assert torch.allclose(w_buf, w_ref, rtol=1e-6, atol=1e-7)
    y2 = fused_moe(x, gu, wd, ids_buf, w_buf, slot_of=slot_of, config=cfg)
    assert torch.equal(y, y2)
    assert rel(y, fused_moe_ref(x, gu, wd, ids_ref, w_ref, slot_of=slot_of)) < TOL["twin"]
    with pytest.raises(ValueError, match="router logits"):
        fused_moe(x, gu, wd, None, None, route=rt._replace(logits=logits[:, :-1].to(DEV)))
    with pytest.raises(ValueError, match="ids / weights buffers"):
        fused_moe(x, gu, wd, None, None, route=rt._replace(ids=ids_buf.long()))
