"""Device sampling (kernels/sampling.py) against the NumPy Sampler, its oracle.

Without CUDA the kernels run through the Triton interpreter (TRITON_INTERPRET=1) at small
vocabularies; with CUDA the same tests run on the GPU, plus the full Qwen vocabulary, CUDA
graph capture and a no-host-sync check.

* greedy ids (and the chosen token's log-probability) equal the Sampler's on random logits,
  ties, NaN rows, all -inf but one, +inf, bias, penalties and grammar bitmasks;
* the kernels draw exactly the twin's ids (same Philox stream), and the twin's distribution
  matches the Sampler's (chi-square homogeneity, 20,000 draws each, fixed seeds) for
  temperature / top_k / top_p / min_p combinations, while a wrong temperature or top_p fails
  the same test;
* the Sampler's device path (penalty counts kept on the device across steps, packed masks,
  logprobs) gives the NumPy path's greedy tokens.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from localmoe.engine.sampling import Sampler, SamplingParams  # noqa: E402
from localmoe.kernels.sampling import (  # noqa: E402
    DeviceSamplingParams, counts_from_history, pack_mask, philox_ref, sample_device, sample_ref,
    update_counts)

DEV = "cuda" if CUDA else "cpu"
# chi-square critical values at p = 0.001 by degrees of freedom
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12,
            9: 27.88, 10: 29.59, 11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70}


def _greedy(**kw):
    return SamplingParams.greedy(**kw).validate()


def _cpu_ids(rows, params, histories=None, masks=None, exempt=()):
    """The NumPy Sampler's ids and logprobs, one fresh sampler per row."""
    ids, lps = [], []
    for r in range(rows.shape[0]):
        s = Sampler(params, rows.shape[1], exempt_ids=exempt, device_sampling=False)
        ids.append(s.sample(rows[r].cpu(), histories[r] if histories else (),
                            None if masks is None else masks[r]))
        lps.append(s.last_logprob.logprob if s.last_logprob else None)
    return ids, lps


def _device(rows, params, histories=None, masks=None, exempt=(), twin=False):
    V = rows.shape[1]
    B = rows.shape[0]
    dp = DeviceSamplingParams.build([params] * B, V, DEV)
    counts = (counts_from_history(histories or [()] * B, V, params.repeat_last_n, exempt, DEV)
              if dp.has_penalties else None)
    bits = (torch.from_numpy(pack_mask(np.stack(masks))).to(DEV) if masks is not None else None)
    fn = sample_ref if twin else sample_device
    out = fn(rows.to(DEV), dp, counts=counts, bitmask=bits, want_logprobs=True)
    return out.ids.cpu().tolist(), out.logprobs.cpu().tolist()


def _check_greedy(rows, params, histories=None, masks=None, exempt=()):
    params = dataclass_copy(params)
    want, want_lp = _cpu_ids(rows, params, histories, masks, exempt)
    for twin in (False, True):
        got, got_lp = _device(rows, params, histories, masks, exempt, twin)
        assert got == want, ("twin" if twin else "kernel", got, want)
        for a, b in zip(got_lp, want_lp):
            if b is None:  # no logprobs asked of the Sampler
                continue
            assert (a == b == -math.inf) or abs(a - b) < 1e-4, (a, b)
    return want


def dataclass_copy(p):
    import dataclasses

    return dataclasses.replace(p)


@pytest.mark.parametrize("V", [1000, 4099])
def test_greedy_matches_sampler_random_and_ties(V):
    g = torch.Generator().manual_seed(V)
    rows = torch.randn(4, V, generator=g) * 4
    rows[2] = torch.round(rows[2])            # many exact ties: the lowest id must win
    rows[3] = 0.0
    rows[3, [7, V - 1, 500]] = 2.5            # a three-way tie across blocks
    ids = _check_greedy(rows, _greedy(logprobs=0))
    assert ids[3] == 7
    # the comparison can fail: another row gives another id
    assert _device(rows.flip(1), _greedy())[0] != ids


def test_greedy_non_finite_rows():
    V = 1000
    rows = torch.randn(6, V, generator=torch.Generator().manual_seed(1))
    rows[0, ::3] = float("nan")                          # NaN among finite
    rows[1] = float("-inf"); rows[1, 613] = -5.0          # all -inf but one
    rows[2] = float("nan")                                # nothing finite at all
    rows[3] = float("nan"); rows[3, 40:] = float("-inf")  # first non-NaN id is 40
    rows[4, [10, 900]] = float("inf")                     # +inf wins, the first one
    rows[5] = float("-inf")
    ids = _check_greedy(rows, _greedy(logprobs=0))
    assert ids[1:] == [613, 0, 40, 10, 0]


@pytest.mark.parametrize("V", [1000, 4099])
def test_greedy_bias_penalties_and_exempt(V):
    g = torch.Generator().manual_seed(7)
    rows = torch.randn(4, V, generator=g) * 2
    top = rows.argmax(1)
    rng = np.random.default_rng(0)
    hist = [list(rng.integers(0, V, 40)) + [int(top[r])] * 3 for r in range(4)]
    hist[1] = hist[1] + [V + 5, -1]                       # out-of-range ids are ignored
    exempt = (int(top[2]),)                               # never penalized
    for p in (_greedy(repeat_penalty=1.7, repeat_last_n=16),
              _greedy(frequency_penalty=1.5, presence_penalty=0.7, repeat_last_n=-1),
              _greedy(repeat_penalty=0.6, frequency_penalty=-0.4, repeat_last_n=8,
                      logit_bias={3: 100.0, int(top[0]): -100.0, V - 1: 9.0})):
        ids = _check_greedy(rows, p, histories=hist, exempt=exempt)
        assert ids[2] == int(top[2]) or p.repeat_penalty < 1.0
    # the penalties move the answer (the test can fail when they are ignored)
    assert _device(rows, _greedy())[0] != _cpu_ids(
        rows, _greedy(repeat_penalty=1.7, repeat_last_n=16), hist)[0]


def test_greedy_bitmask():
    V = 4099
    rows = torch.randn(5, V, generator=torch.Generator().manual_seed(3))
    rng = np.random.default_rng(3)
    masks = [rng.random(V) < f for f in (0.5, 0.01, 0.0, 0.001, 1.0)]
    masks[3][:] = False
    masks[3][[4097, 2050]] = True                         # allowed ids in the last word
    rows[4] = float("-inf")
    masks[4][:] = False
    masks[4][[77, 3000]] = True                           # nothing finite: the first allowed id
    ids = _check_greedy(rows, _greedy(logprobs=0, logit_bias={5: 50.0}), masks=masks)
    assert ids[2] == 0 and ids[4] == 77
    assert masks[0][ids[0]] and masks[1][ids[1]]


def test_pack_mask_layout_is_llguidance_s():
    a = np.zeros(70, dtype=bool)
    a[[0, 31, 32, 69]] = True
    w = pack_mask(a)
    assert w.dtype == np.int32 and w.shape == (3,)
    assert w[0] == (1 | -(1 << 31)) and w[1] == 1 and w[2] == 1 << 5


def test_philox_twin_matches_triton():
    import triton
    import triton.language as tl

    @triton.jit
    def k(out_ptr, seed_ptr, step_ptr, N: tl.constexpr):
        j = tl.arange(0, N)
        z = j.to(tl.uint32) * 0
        seed = tl.load(seed_ptr)
        step = tl.load(step_ptr)
        r0, _a, _b, _c = tl.philox(seed, j.to(tl.uint32), z, z + (step & 0xFFFFFFFF).to(tl.uint32),
                                   z + (step >> 32).to(tl.uint32))
        tl.store(out_ptr + j, r0.to(tl.int64) & 0xFFFFFFFF)

    for seed, step in ((0, 0), (123456789012345, 7), (-5, (1 << 33) + 3)):
        out = torch.empty(64, dtype=torch.int64, device=DEV)
        k[(1,)](out, torch.tensor([seed], device=DEV), torch.tensor([step], device=DEV), N=64)
        ref = philox_ref(torch.tensor([[seed]], device=DEV), torch.arange(64, device=DEV), 0,
                         step & 0xFFFFFFFF, step >> 32)
        assert torch.equal(out, ref[0]), seed


COMBOS = [
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    dict(temperature=0.6, top_k=0, top_p=1.0, min_p=0.0),
    dict(temperature=1.5, top_k=5, top_p=1.0, min_p=0.0),
    dict(temperature=1.0, top_k=0, top_p=0.8, min_p=0.0),
    dict(temperature=0.8, top_k=0, top_p=1.0, min_p=0.08),
    dict(temperature=1.2, top_k=8, top_p=0.9, min_p=0.02),
]


@pytest.mark.parametrize("kw", COMBOS[::2] + [COMBOS[3]])
def test_kernel_draws_the_twin_ids(kw):
    V = 1000
    rows = torch.randn(6, V, generator=torch.Generator().manual_seed(5)) * 2.5
    ps = [SamplingParams(seed=1000 + i, **kw).validate() for i in range(6)]
    a = DeviceSamplingParams.build(ps, V, DEV)
    b = DeviceSamplingParams.build(ps, V, DEV)
    seen = set()
    for _ in range(2):  # the step counter advances: the second draw uses fresh numbers
        x = sample_device(rows.to(DEV), a, want_logprobs=True)
        y = sample_ref(rows.to(DEV), b, want_logprobs=True)
        assert x.ids.tolist() == y.ids.tolist()
        assert torch.allclose(x.logprobs, y.logprobs, atol=1e-4)
        seen.add(tuple(x.ids.tolist()))
    assert a.step.tolist() == [2] * 6 and len(seen) == 2


def _probs_logits(V=12):
    # a peaked head and a flat tail: temperature, top_p and min_p each change the distribution
    base = np.log(np.array([0.3, 0.2, 0.14, 0.1, 0.08, 0.06, 0.04, 0.03, 0.02, 0.015, 0.01,
                            0.005]))
    return torch.tensor(base[:V], dtype=torch.float32)


def _chi2_homogeneity(a, b):
    """Chi-square statistic of two count vectors and its degrees of freedom; bins with fewer
    than 20 draws in both together are pooled into one (the test needs expected counts >= 5)."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    tot = a + b
    big = tot >= 20
    small = (tot > 0) & ~big
    a = np.append(a[big], a[small].sum()) if small.any() else a[big]
    b = np.append(b[big], b[small].sum()) if small.any() else b[big]
    tot = a + b
    na, nb = a.sum(), b.sum()
    ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
    return float(((a - ea) ** 2 / ea).sum() + ((b - eb) ** 2 / eb).sum()), a.size - 1


def _cpu_counts(logits, p, n):
    s = Sampler(p, logits.numel(), device_sampling=False)
    c = np.zeros(logits.numel(), dtype=np.int64)
    for _ in range(n):
        c[s.sample(logits)] += 1
    return c


def _device_counts(logits, p, n, fn):
    V = logits.numel()
    dp = DeviceSamplingParams.build([p] * n, V, DEV, seeds=range(n))
    ids = fn(logits.to(DEV).expand(n, V).contiguous(), dp).ids
    return np.bincount(ids.cpu().numpy(), minlength=V)


N_DRAWS = 20000


@pytest.mark.parametrize("kw", COMBOS)
def test_twin_distribution_matches_sampler(kw):
    logits = _probs_logits()
    p = SamplingParams(seed=42, **kw).validate()
    cpu = _cpu_counts(logits, p, N_DRAWS)
    fns = [sample_ref] + ([sample_device] if CUDA else [])  # the interpreter is too slow here
    for fn in fns:
        dev = _device_counts(logits, p, N_DRAWS, fn)
        stat, df = _chi2_homogeneity(cpu, dev)
        assert stat < CHI2_999[df], (fn.__name__, stat, df, cpu, dev)


@pytest.mark.parametrize("kw,wrong", [
    (COMBOS[1], dict(temperature=0.75)), (COMBOS[3], dict(top_p=0.7)),
    (COMBOS[4], dict(min_p=0.12)), (COMBOS[2], dict(temperature=1.2))])
def test_the_distribution_test_can_fail(kw, wrong):
    logits = _probs_logits()
    cpu = _cpu_counts(logits, SamplingParams(seed=42, **kw).validate(), N_DRAWS)
    bad = SamplingParams(seed=42, **dict(kw, **wrong)).validate()
    dev = _device_counts(logits, bad, N_DRAWS, sample_ref)
    stat, df = _chi2_homogeneity(cpu, dev)
    assert stat > CHI2_999[df], (stat, df)


@pytest.mark.parametrize("kernel", [True, False])
def test_update_counts_slides_the_window(kernel, monkeypatch):
    if not kernel:  # the torch ops the kernel stands for
        import localmoe.kernels.sampling as ks

        monkeypatch.setattr(ks, "_use_triton", lambda x: False)
    V, win = 50, 4
    hist = [1, 2, 3, 2, 5]
    c = counts_from_history([hist], V, win, exempt=(3,), device=DEV)
    assert c[0, 2].item() == 2 and c[0, 3].item() == 0 and c[0, 1].item() == 0
    hist.append(7)
    update_counts(c, torch.tensor([7], device=DEV), torch.tensor([2], device=DEV))
    assert torch.equal(c, counts_from_history([hist], V, win, exempt=(3,), device=DEV))
    update_counts(c, torch.tensor([-1], device=DEV))  # an exempt token enters: nothing counted
    assert int(c.sum()) == 3


@pytest.mark.parametrize("allowed_kind", [None, "bool", "packed"])
def test_sampler_device_path_matches_numpy_over_steps(allowed_kind):
    """Greedy with penalties over a sliding window, step by step: the device path keeps its
    counts on the device (one token in, one out per step) and must agree with NumPy."""
    V = 700
    g = torch.Generator().manual_seed(11)
    p = SamplingParams.greedy(repeat_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2,
                              repeat_last_n=6, logprobs=2, logit_bias={9: 3.0})
    cpu = Sampler(p, V, exempt_ids=(0,), device_sampling=False)
    dev = Sampler(p, V, exempt_ids=(0,), device_sampling=True)
    hist_c, hist_d = [5, 6, 7], [5, 6, 7]
    rng = np.random.default_rng(1)
    base = torch.randn(V, generator=g)
    for step in range(12):
        x = base + 0.3 * torch.randn(V, generator=g)  # the penalties decide between close ids
        mask = rng.random(V) < 0.7 if allowed_kind else None
        m_dev = pack_mask(mask) if allowed_kind == "packed" else mask
        a = cpu.sample(x, hist_c, mask)
        b = dev.sample(x.to(DEV), hist_d, m_dev)
        assert a == b, step
        la, lb = cpu.last_logprob, dev.last_logprob
        assert abs(la.logprob - lb.logprob) < 1e-4
        assert [i for i, _ in la.top] == [i for i, _ in lb.top]
        hist_c.append(a)
        hist_d.append(b)
    assert len(set(hist_c[3:])) > 2  # the penalties did move the argmax around


def test_sampler_device_path_seed_reproducible_and_logprob_only():
    V = 300
    x = torch.randn(V, generator=torch.Generator().manual_seed(2)) * 2
    p = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=7, logprobs=0)
    a = Sampler(p, V, device_sampling=True)
    b = Sampler(p, V, device_sampling=True)
    n = 8 if CUDA else 4        # every draw after the first the same kernels (~1 s each here)
    ta = [a.sample(x.to(DEV), [1, 2]) for _ in range(n)]
    tb = [b.sample(x.to(DEV), [1, 2]) for _ in range(n)]
    assert ta == tb and len(set(ta)) > 1
    lp = a.last_logprob
    ref = torch.log_softmax(x.double(), 0)[lp.token_id].item()
    assert lp.top == [] and abs(lp.logprob - ref) < 1e-4


def test_launch_then_finish_gives_what_sample_gives():
    """Sampler.launch (device work only, the id left on the device) then Sampler.finish (the
    read) picks the tokens sample() picks, seeded draws and penalty counts included, and
    can_launch refuses what needs the host (log-probabilities, NumPy); a grammar mask holds."""
    V = 300
    g = torch.Generator().manual_seed(3)
    # 4 steps in the interpreter (~1.5 s a draw): as with 6, each step after the first is
    # penalized by the counts of the tokens drawn before it
    xs = [torch.randn(V, generator=g) * 2 for _ in range(6 if CUDA else 4)]
    p = SamplingParams(temperature=0.8, top_k=40, seed=11, repeat_penalty=1.3,
                       presence_penalty=0.4)
    a = Sampler(p, V, exempt_ids=(0,), device_sampling=True)
    b = Sampler(p, V, exempt_ids=(0,), device_sampling=True)
    ha, hb, ta, tb = [5, 6], [5, 6], [], []
    for x in xs:
        ta.append(a.sample(x.to(DEV), ha))
        ha.append(ta[-1])
        assert b.can_launch(x.to(DEV))
        pend = b.launch(x.to(DEV), hb)
        assert pend.ids.device == x.to(DEV).device
        tb.append(b.finish(pend, hb))
        hb.append(tb[-1])
    assert ta == tb and len(set(ta)) > 1
    allowed = np.zeros(V, bool)
    allowed[[3, 50, 77]] = True
    c = Sampler(p, V, exempt_ids=(0,), device_sampling=True)
    assert c.finish(c.launch(xs[0].to(DEV), [5, 6], allowed), [5, 6]) in (3, 50, 77)
    assert not Sampler(SamplingParams(logprobs=0), V, device_sampling=True).can_launch(xs[0])
    assert not Sampler(p, V, device_sampling=False).can_launch(xs[0])


# ------------------------------------------------------------------------------ GPU only
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")


@gpu
def test_full_vocab_greedy_and_distribution_on_gpu():
    V = 151936
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(4, V, generator=g) * 3
    rows[1] = torch.round(rows[1])
    masks = [np.random.default_rng(i).random(V) < 0.3 for i in range(4)]
    for p in (_greedy(logprobs=0), _greedy(repeat_penalty=1.5, repeat_last_n=64, logprobs=0)):
        hist = [list(np.random.default_rng(9).integers(0, V, 64))] * 4
        _check_greedy(rows, p, histories=hist, masks=masks)
    x = torch.full((V,), -30.0)
    x[:12] = _probs_logits()
    for kw in COMBOS:
        p = SamplingParams(seed=1, **kw).validate()
        cpu = _cpu_counts(x, p, 1000)
        dev = _device_counts(x, p, 1000, sample_device)
        stat, df = _chi2_homogeneity(cpu, dev)
        assert stat < CHI2_999.get(df, 40.0), (kw, stat, df)


@gpu
def test_capture_in_cuda_graph_without_host_sync():
    V = 151936
    x = (torch.randn(1, V, device="cuda") * 3).contiguous()
    p = SamplingParams(temperature=1.0, top_k=40, top_p=0.95, min_p=0.05, seed=3,
                       repeat_penalty=1.1, repeat_last_n=64).validate()
    dp = DeviceSamplingParams.build([p], V, "cuda")
    counts = counts_from_history([[1, 2, 3]], V, 64, device="cuda")
    bits = torch.full((1, (V + 31) // 32), -1, dtype=torch.int32, device="cuda")
    sample_device(x, dp, counts=counts, bitmask=bits, want_logprobs=True)  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sample_device(x, dp, counts=counts, bitmask=bits, want_logprobs=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        sample_device(x, dp, counts=counts, bitmask=bits, want_logprobs=True)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sample_device(x, dp, counts=counts, bitmask=bits, want_logprobs=True)
        update_counts(counts, out.ids)
    seen = set()
    for _ in range(20):
        graph.replay()
        seen.add(int(out.ids[0]))
    assert len(seen) > 1  # replays draw fresh numbers (the step counter lives on the device)
    assert int(dp.step[0]) >= 20


@pytest.mark.parametrize("top_k,merge_keys", [(3, 1024), (40, 1024), (64, 128), (5, 16)])
def test_fused_top_k_candidates_draw_the_twin_ids_with_ties(top_k, merge_keys, monkeypatch):
    """top_k <= TOPK_MAX goes through the top-k kernels (their packed keys order equal logits
    by increasing id, as the twin's stable sort): on logits with many ties, over several blocks
    of the split pass and one or several merge passes (``MERGE_KEYS`` small: 2 lists per
    program, 3 -> 2 -> 1), the kernels draw the twin's ids step after step."""
    if not CUDA and (top_k, merge_keys) in ((40, 1024), (64, 128)):
        pytest.skip("CI time: the interpreter runs the small and the many-merge cases (the GPU all)")
    import localmoe.kernels.sampling as ks

    if ks.fused_topk_width(top_k) == 0:
        pytest.skip("this Triton has no tl.topk: torch.topk serves")
    monkeypatch.setattr(ks, "MERGE_KEYS", merge_keys)
    if DEV == "cpu":    # the interpreter's bitonic top-k over 2,048-entry blocks took 2 min
        monkeypatch.setattr(ks, "BLOCK", 512)
    V = 2 * ks.BLOCK + 37
    g = torch.Generator().manual_seed(11)
    rows = torch.round(torch.randn(4, V, generator=g) * 4) / 2     # few distinct values
    rows[1, 5] = rows[1].max() + 1.0                                 # a clear winner
    rows[2, :] = 0.0                                                 # one big tie
    ps = [SamplingParams(seed=70 + i, temperature=1.3, top_k=top_k, top_p=0.97).validate()
          for i in range(4)]
    a = DeviceSamplingParams.build(ps, V, DEV)
    b = DeviceSamplingParams.build(ps, V, DEV)
    assert a.n_cand == top_k
    ws: dict = {}       # the draws' buffers: the first call fills it, the later ones reuse it
    for _ in range(3 if CUDA else 2):     # the interpreter: two steps of the Philox stream
        x = sample_device(rows.to(DEV), a, want_logprobs=True, workspace=ws)
        y = sample_ref(rows.to(DEV), b, want_logprobs=True)
        assert x.ids.tolist() == y.ids.tolist()
        assert torch.allclose(x.logprobs, y.logprobs, atol=1e-4)
    if top_k >= 40:     # the all-zero row draws among the lowest top_k ids only
        assert 0 <= x.ids[2].item() < top_k
    # one workspace across calls of two top_k (buffers of another candidate count): after the
    # draws' top_k, 7, then top_k again
    for k in (7, top_k):
        ps = [SamplingParams(seed=9, top_k=k, top_p=0.97).validate()] * 4
        c, d = (DeviceSamplingParams.build(ps, V, DEV) for _ in range(2))
        assert sample_device(rows.to(DEV), c, workspace=ws).ids.tolist() == \
            sample_ref(rows.to(DEV), d).ids.tolist()
