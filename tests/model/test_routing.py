"""MoE routing: hand-computed weights for router logits [2.0, 1.0, 0.5, -1.0], ties, sigmoid
gating, renormalization, expert_weights_scale, selection bias, shared-expert gate."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from localmoe.errors import UnsupportedModelError
from localmoe.model.routing import route, select_topk, shared_expert_gate

LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0]])


def _softmax_by_hand(xs):
    ex = [math.exp(x) for x in xs]
    s = sum(ex)
    return [e / s for e in ex]


def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def test_softmax_top2_without_renormalization():
    w, ids = route(LOGITS, 2, gating="softmax", norm_topk_prob=False)
    p = _softmax_by_hand([2.0, 1.0, 0.5, -1.0])
    assert ids.tolist() == [[0, 1]]
    assert w.dtype == torch.float32
    assert w[0].tolist() == pytest.approx([p[0], p[1]], abs=1e-6)
    # concrete values: e^2 / (e^2 + e + e^0.5 + e^-1)
    assert w[0, 0].item() == pytest.approx(0.6094, abs=1e-4)
    assert w[0, 1].item() == pytest.approx(0.2242, abs=1e-4)
    assert w.sum().item() < 0.84  # not renormalized


def test_softmax_top2_with_renormalization():
    w, ids = route(LOGITS, 2, gating="softmax", norm_topk_prob=True)
    assert ids.tolist() == [[0, 1]]
    # renormalized softmax over the selected pair = softmax([2, 1]) = (sigmoid(1), sigmoid(-1))
    assert w[0].tolist() == pytest.approx([_sigmoid(1.0), _sigmoid(-1.0)], abs=1e-6)
    assert w.sum().item() == pytest.approx(1.0, abs=1e-6)


def test_sigmoid_gating_top2():
    w, ids = route(LOGITS, 2, gating="sigmoid", norm_topk_prob=False)
    assert ids.tolist() == [[0, 1]]
    assert w[0].tolist() == pytest.approx([_sigmoid(2.0), _sigmoid(1.0)], abs=1e-6)
    w2, _ = route(LOGITS, 2, gating="sigmoid", norm_topk_prob=True)
    s = _sigmoid(2.0) + _sigmoid(1.0)
    assert w2[0].tolist() == pytest.approx([_sigmoid(2.0) / s, _sigmoid(1.0) / s], abs=1e-6)


def test_expert_weights_scale():
    w, _ = route(LOGITS, 2, norm_topk_prob=True, expert_weights_scale=2.5)
    assert w[0].tolist() == pytest.approx([2.5 * _sigmoid(1.0), 2.5 * _sigmoid(-1.0)], abs=1e-6)


def test_ties_go_to_lower_expert_index():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0],
                           [0.0, 0.0, 0.0, 0.0],
                           [5.0, -1.0, 5.0, 5.0]])
    _, ids = route(logits, 2)
    assert ids.tolist() == [[1, 2], [0, 1], [0, 2]]
    _, ids1 = route(logits, 1)
    assert ids1.flatten().tolist() == [1, 0, 0]
    # many experts, all equal: the first k
    _, ids = select_topk(torch.zeros(3, 64), 8)
    assert ids.tolist() == [list(range(8))] * 3


def test_selection_bias_changes_choice_not_weights():
    bias = torch.tensor([0.0, 0.0, 1.0, 0.0])
    w, ids = route(LOGITS, 2, gating="sigmoid", selection_bias=bias)
    # sigmoid probs 0.881, 0.731, 0.622(+1), 0.269 -> selected 2 then 0
    assert ids.tolist() == [[2, 0]]
    assert w[0].tolist() == pytest.approx([_sigmoid(0.5), _sigmoid(2.0)], abs=1e-6)


def test_shared_expert_gate():
    x = torch.tensor([[1.0, 2.0], [3.0, -1.0]])
    g = torch.tensor([0.5, -0.25])
    out = shared_expert_gate(x, g)
    assert out.shape == (2, 1)
    assert out[:, 0].tolist() == pytest.approx([_sigmoid(0.0), _sigmoid(1.75)], abs=1e-6)


def test_bad_arguments():
    with pytest.raises(UnsupportedModelError, match="gating"):
        route(LOGITS, 2, gating="relu")
    with pytest.raises(ValueError):
        route(LOGITS, 5)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 16), st.integers(1, 8), st.integers(0, 2**31 - 1),
       st.sampled_from(["softmax", "sigmoid"]), st.floats(0.1, 30.0))
def test_renormalized_weights_are_finite_and_sum_to_one(n_exp, k, seed, gating, spread):
    k = min(k, n_exp)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(5, n_exp, generator=g) * spread
    w, ids = route(logits, k, gating=gating, norm_topk_prob=True)
    assert torch.isfinite(w).all()
    assert torch.allclose(w.sum(-1), torch.ones(5), atol=1e-5)
    assert (ids >= 0).all() and (ids < n_exp).all()
    # each row's ids are distinct and hold the k largest probabilities
    for r in range(5):
        assert len(set(ids[r].tolist())) == k
        probs = torch.softmax(logits[r], -1) if gating == "softmax" else torch.sigmoid(logits[r])
        thr = probs.sort(descending=True).values[k - 1]
        assert (probs[ids[r]] >= thr).all()
