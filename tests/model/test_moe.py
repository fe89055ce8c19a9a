"""The reference MoE layer (localmoe.model.moe) and the resident expert provider."""

import pytest
import torch

from localmoe.model.experts import ExpertWeights, ResidentExpertProvider
from localmoe.model.moe import moe_ffn
from localmoe.model.ops import activation


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def test_moe_ffn_groups_tokens_like_a_per_token_loop():
    E, D, F, N, k = 6, 16, 24, 11, 2
    g = _g(3)
    w = ExpertWeights(torch.randn(E, F, D, generator=g), torch.randn(E, F, D, generator=g),
                      torch.randn(E, D, F, generator=g))
    prov = ResidentExpertProvider({0: w})
    x = torch.randn(N, D, generator=g)
    ids = torch.randint(0, E - 1, (N, k), generator=g)  # expert E-1 never used
    ids[:, 1] = (ids[:, 0] + 1) % (E - 1)
    wts = torch.rand(N, k, generator=g)
    act = activation("silu")
    seen = []
    prov.prepare = lambda layer, used: seen.append(sorted(used.tolist()))
    got = moe_ffn(x, wts, ids, prov, 0, act)
    ref = torch.zeros(N, D)
    for n in range(N):
        for j in range(k):
            e = int(ids[n, j])
            h = act(w.gate[e] @ x[n]) * (w.up[e] @ x[n])
            ref[n] += wts[n, j] * (w.down[e] @ h)
    assert torch.allclose(got, ref, atol=1e-3, rtol=1e-4)
    assert seen == [sorted(set(ids.flatten().tolist()))]


def test_provider_get_stacks_experts():
    E, D, F = 3, 4, 5
    w = ExpertWeights(torch.randn(E, F, D), torch.randn(E, F, D), torch.randn(E, D, F))
    prov = ResidentExpertProvider({2: w})
    assert prov.layers() == [2] and prov.n_experts == 3
    g, u, d = prov.expert(2, 1)
    assert torch.equal(g, w.gate[1]) and torch.equal(d, w.down[1])
    with pytest.raises(KeyError):
        prov.expert(0, 0)
    assert prov.nbytes() == 3 * E * F * D * 4

