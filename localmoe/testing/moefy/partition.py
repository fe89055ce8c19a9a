"""Split one FFN's hidden neurons into ``n_experts`` equal groups (the experts).

* :func:`random_split`: a seeded random permutation cut into equal parts (the baseline).
* :func:`coactivation_split`: balanced spherical k-means over the neurons' *co-activation
  profiles* on calibration tokens (MoEfication, Zhang et al. 2022, groups neurons that fire
  together; LLaMA-MoE, Zhu et al. 2023, compares such splits with random ones). A neuron's profile
  is the indicator of "this neuron is among the top quarter of |activation| for this token" over
  the calibration tokens; measured on SmolLM2 it gives ~5-10% lower FFN reconstruction error under
  oracle top-k routing than |activation| profiles or weight clustering, and ~15-30% lower than a
  random split. Clusters are kept exactly equal by a greedy capacity-constrained assignment
  (pairs taken in decreasing similarity; a neuron goes to its best cluster that still has room).

Every function is deterministic given its seed. Groups are returned sorted, as an int64 tensor
``[n_experts, d_ff // n_experts]`` of neuron indices.
"""

from __future__ import annotations

import torch

__all__ = ["random_split", "coactivation_split", "balanced_kmeans", "coactivation_features"]


def random_split(d_ff: int, n_experts: int, seed: int) -> torch.Tensor:
    """Random equal split of ``range(d_ff)``: ``[n_experts, d_ff // n_experts]`` int64."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(d_ff, generator=g)
    return perm.reshape(n_experts, -1).sort(dim=1).values


def _balanced_assign(sim: torch.Tensor, cap: int) -> torch.Tensor:
    """Assign each row of ``sim [n, k]`` to a column, at most ``cap`` rows per column, taking
    (row, column) pairs in decreasing similarity (ties: lower flat index first)."""
    n, k = sim.shape
    order = torch.argsort(sim.flatten(), descending=True, stable=True).tolist()
    assign = [-1] * n
    count = [0] * k
    left = n
    for idx in order:
        j, c = divmod(idx, k)
        if assign[j] >= 0 or count[c] >= cap:
            continue
        assign[j] = c
        count[c] += 1
        left -= 1
        if left == 0:
            break
    return torch.tensor(assign, dtype=torch.int64)


def balanced_kmeans(feat: torch.Tensor, n_clusters: int, seed: int, iters: int = 12) -> torch.Tensor:
    """Equal-size spherical k-means.

    Args:
        feat: ``[n, f]`` float features (rows are normalized to unit length).
        n_clusters: must divide ``n``.
        seed: picks the initial centroids (distinct rows).
        iters: assignment/update rounds (stops early when the assignment is stable).

    Returns:
        ``[n]`` int64 cluster id per row, each cluster exactly ``n // n_clusters`` rows.
    """
    n = feat.shape[0]
    cap = n // n_clusters
    f = torch.nn.functional.normalize(feat.float(), dim=1)
    g = torch.Generator().manual_seed(seed)
    cent = f[torch.randperm(n, generator=g)[:n_clusters]].clone()
    assign = None
    for _ in range(iters):
        new = _balanced_assign(f @ cent.t(), cap)
        if assign is not None and torch.equal(new, assign):
            break
        assign = new
        cent = torch.zeros_like(cent).index_add_(0, assign, f)
        cent = torch.nn.functional.normalize(cent, dim=1)
    return assign


def coactivation_features(acts: torch.Tensor, quantile: float = 0.75) -> torch.Tensor:
    """Per-neuron co-activation profiles: ``acts [N, d_ff]`` -> ``[d_ff, N]`` float32, 1 where the
    neuron's |activation| is in the token's top ``1 - quantile`` fraction, else 0."""
    a = acts.abs()
    kth = min(a.shape[1], max(1, int(round(quantile * a.shape[1]))))
    thr = a.kthvalue(kth, dim=1, keepdim=True).values
    return (a > thr).float().t().contiguous()


def coactivation_split(acts: torch.Tensor, n_experts: int, seed: int, iters: int = 12) -> torch.Tensor:
    """Clustered equal split from calibration activations ``acts [N, d_ff]`` (the GLU hidden
    ``act(gate x) * up x``): ``[n_experts, d_ff // n_experts]`` int64, rows sorted."""
    assign = balanced_kmeans(coactivation_features(acts), n_experts, seed, iters)
    groups = [torch.nonzero(assign == c).flatten() for c in range(n_experts)]
    return torch.stack(groups).sort(dim=1).values
