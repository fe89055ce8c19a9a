"""Sampler: validation, greedy edge cases, statistics of each filter, penalties, bias, seeds."""

from __future__ import annotations

import math

import pytest
import torch

from localmoe.errors import InvalidRequestError
from localmoe.engine.sampling import Sampler, SamplingParams

P4 = [0.5, 0.3, 0.15, 0.05]
# chi-square critical values at p = 0.001 by degrees of freedom
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}


def _logits(probs, pad=0):
    x = torch.tensor([math.log(p) for p in probs], dtype=torch.float32)
    if pad:
        x = torch.cat([x, torch.full((pad,), -1e9)])
    return x


def _counts(sampler, logits, n, history=()):
    c = torch.zeros(logits.numel(), dtype=torch.long)
    for _ in range(n):
        c[sampler.sample(logits, list(history))] += 1
    return c


def _chi2(counts, expected_probs):
    n = int(counts.sum())
    stat = 0.0
    for k, p in enumerate(expected_probs):
        if p > 0:
            e = n * p
            stat += (int(counts[k]) - e) ** 2 / e
        else:
            assert int(counts[k]) == 0, f"token {k} has probability 0 but was drawn"
    return stat


def _plain(**kw):
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234)
    base.update(kw)
    return SamplingParams(**base)


# ---------------------------------------------------------------------------- validation
@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", 1000.0),
    ("temperature", "hot"), ("top_k", -1), ("top_k", 2.5), ("top_p", 1.5), ("top_p", -0.01),
    ("min_p", 2.0), ("repeat_penalty", 0.0), ("repeat_penalty", -1.0), ("repeat_last_n", -2),
    ("frequency_penalty", 2.5), ("presence_penalty", -3.0), ("logit_bias", {"x": 1}),
    ("logit_bias", {5: 101}), ("logit_bias", {-1: 1}), ("logit_bias", [1, 2]), ("seed", "abc"),
    ("seed", 1.5), ("max_tokens", 0), ("max_tokens", -5), ("stop", ["ok", ""]), ("stop", [3]),
    ("top_p", float("inf")), ("temperature", True),
])
def test_out_of_range_values_name_the_parameter(field, value):
    p = SamplingParams(**{field: value})
    with pytest.raises(InvalidRequestError) as ei:
        p.validate()
    assert ei.value.param == field
    assert field in str(ei.value) or field == "logit_bias" or field == "stop"


def test_validate_normalizes():
    p = SamplingParams(stop="END", logit_bias={"7": -5, 3: 2.0}, top_k=5.0, max_tokens=3).validate()
    assert p.stop == ("END",) and p.logit_bias == {7: -5.0, 3: 2.0} and p.top_k == 5
    assert SamplingParams(stop=None).validate().stop == ()
    g = SamplingParams.greedy(max_tokens=4).validate()
    assert g.is_greedy and g.max_tokens == 4 and g.temperature == 0.0


def test_logit_bias_outside_vocab_is_rejected():
    with pytest.raises(InvalidRequestError) as ei:
        Sampler(SamplingParams(logit_bias={10: 1.0}), vocab_size=10)
    assert ei.value.param == "logit_bias"


# ---------------------------------------------------------------------------- greedy / edges
@pytest.mark.parametrize("params", [
    SamplingParams.greedy(),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1e-7),
    SamplingParams(top_p=0.0, temperature=5.0),
    SamplingParams(top_k=1, temperature=5.0),
])
def test_greedy_edge_values(params):
    torch.manual_seed(0)
    for _ in range(20):
        x = torch.randn(50)
        s = Sampler(params, 50)
        assert s.sample(x) == int(torch.argmax(x))


def test_greedy_tie_takes_lowest_id():
    x = torch.tensor([0.0, 3.0, 3.0, 1.0])
    assert Sampler(SamplingParams.greedy(), 4).sample(x) == 1


def test_never_nan_or_out_of_range():
    s = Sampler(_plain(top_k=3, top_p=0.9, min_p=0.1), 6)
    all_nan = torch.full((6,), float("nan"))
    assert 0 <= s.sample(all_nan) < 6
    x = torch.tensor([float("nan"), 1.0, float("nan"), 0.5, float("-inf"), 0.0])
    for _ in range(200):
        assert s.sample(x) in (1, 3, 5)
    assert s.sample(torch.full((6,), float("-inf"))) in range(6)
    y = torch.tensor([0.0, float("inf"), 1.0, 0.0, 0.0, 0.0])
    assert all(s.sample(y) == 1 for _ in range(20))
    big = torch.tensor([1e30, -1e30, 3e38, -3e38, 0.0, 1.0])
    assert Sampler(_plain(temperature=1e-3), 6).sample(big) in range(6)
    assert Sampler(_plain(temperature=100.0), 6).sample(big) in range(6)


def test_padded_logits_never_sample_past_vocab():
    s = Sampler(_plain(), vocab_size=4)
    x = torch.cat([torch.zeros(4), torch.full((60,), 50.0)])  # padding rows with huge logits
    assert all(s.sample(x) < 4 for _ in range(200))


def test_accepts_other_dtypes_and_shapes():
    x = torch.tensor([[0.0, 5.0, 1.0]], dtype=torch.bfloat16)
    assert Sampler(SamplingParams.greedy(), 3).sample(x) == 1


# ---------------------------------------------------------------------------- statistics
N = 6000


def test_plain_sampling_follows_softmax():
    c = _counts(Sampler(_plain(), 4), _logits(P4), N)
    assert _chi2(c, P4) < CHI2_999[3]


def test_temperature_reshapes_distribution():
    for t in (0.5, 2.0):
        q = [p ** (1 / t) for p in P4]
        q = [v / sum(q) for v in q]
        c = _counts(Sampler(_plain(temperature=t), 4), _logits(P4), N)
        assert _chi2(c, q) < CHI2_999[3], t


def test_top_k():
    c = _counts(Sampler(_plain(top_k=2), 4), _logits(P4), N)
    assert _chi2(c, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]) < CHI2_999[1]


def test_top_p():
    # cumulative 0.5, 0.8, 0.95: top_p=0.7 keeps {0, 1}; top_p=0.45 keeps {0}
    c = _counts(Sampler(_plain(top_p=0.7), 4), _logits(P4), N)
    assert _chi2(c, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]) < CHI2_999[1]
    c = _counts(Sampler(_plain(top_p=0.45), 4), _logits(P4), 500)
    assert int(c[0]) == 500
    c = _counts(Sampler(_plain(top_p=0.9), 4), _logits(P4), N)
    assert _chi2(c, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]) < CHI2_999[2]


def test_min_p():
    # min_p 0.2 of top 0.5 -> keep p >= 0.1: {0, 1, 2}
    c = _counts(Sampler(_plain(min_p=0.2), 4), _logits(P4), N)
    assert _chi2(c, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]) < CHI2_999[2]


def test_filters_apply_before_temperature():
    # top_p is computed at temperature 1: with top_p=0.7 only {0, 1} survive even at T=5
    t = 5.0
    q = [0.5 ** (1 / t), 0.3 ** (1 / t)]
    q = [v / sum(q) for v in q] + [0.0, 0.0]
    c = _counts(Sampler(_plain(top_p=0.7, temperature=t), 4), _logits(P4), N)
    assert _chi2(c, q) < CHI2_999[1]


# ---------------------------------------------------------------------------- penalties and bias
def test_repeat_penalty_divides_positive_and_multiplies_negative():
    s = Sampler(SamplingParams.greedy(repeat_penalty=1.5), 4)
    x = torch.tensor([2.0, 1.6, -1.0, -1.2])
    assert s.sample(x, history=[]) == 0
    assert s.sample(x, history=[0]) == 1  # 2.0 / 1.5 = 1.33 < 1.6
    y = torch.tensor([-5.0, -5.0, -1.0, -1.2])
    assert s.sample(y, history=[2]) == 3  # -1.0 * 1.5 = -1.5 < -1.2


def test_repeat_last_n_window():
    x = torch.tensor([2.0, 1.6, 0.0])
    s = Sampler(SamplingParams.greedy(repeat_penalty=1.5, repeat_last_n=2), 3)
    assert s.sample(x, history=[0, 2, 2]) == 0  # token 0 is outside the last 2
    assert s.sample(x, history=[2, 0]) == 1
    s_all = Sampler(SamplingParams.greedy(repeat_penalty=1.5, repeat_last_n=-1), 3)
    assert s_all.sample(x, history=[0] + [2] * 500) == 1
    s_off = Sampler(SamplingParams.greedy(repeat_penalty=1.5, repeat_last_n=0), 3)
    assert s_off.sample(x, history=[0]) == 0


def test_frequency_and_presence_penalties():
    x = torch.tensor([3.0, 2.0, 0.0])
    f = Sampler(SamplingParams.greedy(frequency_penalty=0.4), 3)
    assert f.sample(x, history=[0, 0]) == 0  # 3 - 0.8 = 2.2 > 2
    assert f.sample(x, history=[0, 0, 0]) == 1  # 3 - 1.2 = 1.8 < 2
    p = Sampler(SamplingParams.greedy(presence_penalty=1.5), 3)
    assert p.sample(x, history=[0]) == 1
    assert p.apply_penalties(x.clone(), [0, 0, 0])[0].item() == pytest.approx(1.5)
    neg = Sampler(SamplingParams.greedy(presence_penalty=-2.0), 3)
    assert neg.sample(x, history=[2]) == 0 and neg.sample(torch.tensor([1.0, 0.0, 0.0]), [2]) == 2


def test_exempt_tokens_are_not_penalized():
    x = torch.tensor([2.0, 1.6, 0.0])
    s = Sampler(SamplingParams.greedy(repeat_penalty=2.0, presence_penalty=1.0), 3, exempt_ids={0})
    assert s.sample(x, history=[0, 0, 0]) == 0
    s2 = Sampler(SamplingParams.greedy(repeat_penalty=2.0, presence_penalty=1.0), 3)
    assert s2.sample(x, history=[0, 0, 0]) == 1


def test_logit_bias():
    x = torch.tensor([5.0, 0.0, 0.0, 0.0])
    assert Sampler(SamplingParams.greedy(logit_bias={2: 100}), 4).sample(x) == 2
    s = Sampler(_plain(logit_bias={"0": -100}), 4)
    assert all(s.sample(x) != 0 for _ in range(300))


# ---------------------------------------------------------------------------- seeds
def _seq(params, n=64, vocab=1000):
    torch.manual_seed(7)  # the logits are fixed; only the sampler's randomness varies
    x = torch.randn(vocab)
    s = Sampler(params, vocab)
    return [s.sample(x) for _ in range(n)]


def test_same_seed_same_output():
    p = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    assert _seq(p) == _seq(SamplingParams(**{**p.__dict__}))
    assert _seq(p) != _seq(SamplingParams(**{**p.__dict__, "seed": 43}))


def test_no_seed_differs_across_runs():
    p = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=None)
    runs = {tuple(_seq(p)) for _ in range(3)}
    assert len(runs) == 3
    assert Sampler(p, 10).seed != Sampler(p, 10).seed


def test_seeded_sampler_is_independent_of_global_rng():
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=5)
    x = torch.zeros(100)
    a = Sampler(p, 100)
    first = [a.sample(x) for _ in range(10)]
    torch.manual_seed(999)
    torch.rand(1000)
    b = Sampler(p, 100)
    assert [b.sample(x) for _ in range(10)] == first


def test_model_defaults_from_gguf_metadata():
    md = {"general.sampling.temp": 0.6, "general.sampling.top_k": 20, "general.sampling.top_p": 0.95,
          "general.sampling.min_p": 7.0, "general.sampling.penalty_repeat": 1.1, "other": 1}
    d = SamplingParams.model_defaults(md)
    assert d == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "repeat_penalty": 1.1}
    assert SamplingParams(**d).validate().top_k == 20
    assert SamplingParams.model_defaults(None) == {}


def test_top_k_on_wide_logit_ranges():
    x = torch.arange(1000, dtype=torch.float32) * 0.01  # flat-ish: needs the gap to widen
    s = Sampler(_plain(top_k=5), 1000)
    assert {s.sample(x) for _ in range(300)} == {995, 996, 997, 998, 999}
    y = torch.full((1000,), float("-inf"))
    y[[3, 500]] = torch.tensor([0.0, 1.0])  # fewer finite tokens than top_k
    s = Sampler(_plain(top_k=40), 1000)
    assert {s.sample(y) for _ in range(200)} == {3, 500}
    z = -torch.arange(5000, dtype=torch.float32) * 100.0  # huge gaps
    assert Sampler(_plain(top_k=3, temperature=100.0), 5000).sample(z) in (0, 1, 2)


# ------------------------------------------------------------------ grammar mask, logprobs

def test_mask_restricts_every_mode_to_allowed_ids():
    import numpy as np

    allowed = np.array([False, True, False, True])
    greedy = Sampler(SamplingParams.greedy(), 4)
    assert greedy.sample(_logits(P4), allowed=allowed) == 1  # the argmax 0 is forbidden
    for kw in (dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
               dict(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0),
               dict(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0),
               dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2)):
        s = Sampler(SamplingParams(seed=3, **kw), 4)
        picks = {s.sample(_logits(P4), allowed=allowed) for _ in range(300)}
        assert picks <= {1, 3} and 1 in picks, (kw, picks)
    # nothing allowed is finite (a -100 bias is still finite; -inf logits are not)
    x = torch.tensor([0.0, -math.inf, 1.0, -math.inf])
    assert greedy.sample(x, allowed=allowed) == 1  # the first allowed id, never a banned one
    # a mask shorter than padded logits: the padding is never picked
    assert Sampler(SamplingParams.greedy(), 4).sample(torch.tensor([0., 0., 0., 0., 9.]),
                                                      allowed=allowed) in (1, 3)


def test_logprobs_are_log_softmax_after_penalties_bias_and_mask():
    import numpy as np

    p = SamplingParams.greedy(logprobs=3, presence_penalty=1.0, logit_bias={2: 0.5})
    s = Sampler(p, 4)
    x = _logits(P4)
    allowed = np.array([True, True, True, False])
    t = s.sample(x, history=[0], allowed=allowed)
    ref = x.clone().double()
    ref[0] -= 1.0          # presence penalty on the history token
    ref[2] += 0.5          # bias
    ref[3] = -math.inf     # mask
    lsm = torch.log_softmax(ref, 0)
    lp = s.last_logprob
    assert t == int(torch.argmax(ref)) == lp.token_id
    assert lp.logprob == pytest.approx(float(lsm[t]), abs=1e-5)
    assert [i for i, _ in lp.top] == [int(i) for i in torch.argsort(-lsm)[:3]]
    assert [v for _, v in lp.top] == pytest.approx([float(lsm[i]) for i, _ in lp.top], abs=1e-5)
    assert 3 not in [i for i, _ in lp.top]  # a masked token is no alternative
    # sampled (not greedy) picks report their own logprob; temperature does not change it
    s2 = Sampler(SamplingParams(seed=1, temperature=2.0, top_k=0, top_p=1.0, min_p=0.0,
                                logprobs=0), 4)
    for _ in range(20):
        t = s2.sample(_logits(P4))
        assert s2.last_logprob.logprob == pytest.approx(math.log(P4[t]), abs=1e-5)
        assert s2.last_logprob.top == []


@pytest.mark.parametrize("kw,param", [
    (dict(logprobs=21), "top_logprobs"), (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=1.5), "logprobs"), (dict(prompt_logprobs=1), "prompt_logprobs"),
    (dict(max_tokens=0), "max_tokens"), (dict(grammar="json"), "grammar"),
    (dict(json_schema=3), "json_schema"), (dict(json_object="yes"), "json_object"),
    (dict(json_object=True, json_schema={}), "json_schema")])
def test_structured_and_logprob_params_are_validated(kw, param):
    with pytest.raises(InvalidRequestError) as ei:
        SamplingParams(**kw).validate()
    assert ei.value.param == param
    SamplingParams(max_tokens=0, prompt_logprobs=True).validate()  # scoring only
