"""Routers, gating and output scales for a split FFN (one layer at a time).

Notation: ``x [N, d_model]`` FFN inputs (after the pre-FFN norm), ``h [N, d_ff]`` the GLU hidden
``act(gate x) * up x``, ``groups [E, d_ff/E]`` the experts' neurons, ``down [d_model, d_ff]``.
Expert ``e``'s output is ``E_e(x) = down[:, groups[e]] @ h[groups[e]]``; the dense FFN is
``sum_e E_e(x)``.

* Router targets: the ``top_k`` experts with the largest ``||E_e(x)||`` (MoEfication's
  "which experts matter for this token", with outputs instead of ReLU activation sums since
  GLU activations are signed).
* :func:`train_router`: a linear router ``logits = x @ R.T`` fitted with binary cross-entropy to
  those multi-hot targets (full batch, Adam, seeded, float32).
* :func:`centroid_router`: the untrained baseline, each expert's mean gate-weight row (MoEfication's
  "parameter center" router), needs no data.
* Gating is the one llama.cpp's Mixtral-style ``llama`` and ``gemma4`` MoE layers compute:
  softmax over all experts, top-k, renormalized over the selected ones (= softmax over the
  selected logits). Ties go to the lower expert index (:func:`localmoe.model.routing.route`).
* :func:`fit_output`: makes the sparse mixture reproduce a target on the calibration tokens (the
  dense FFN's output, or what the dense model's residual stream needs, see :mod:`.plan`):
  a router temperature (grid search) and per-expert output scales (least squares, an ``E x E``
  system), or with ``refit_down`` the whole down projection by ridge regression on the gated
  hidden units (``d_ff x d_ff`` system; the selected experts' down weights absorb part of what
  the unselected experts would have added). Both are folded into the down weights, so the
  written model needs no scale the file format lacks.
"""

from __future__ import annotations

import torch

__all__ = ["expert_norms", "expert_stats", "topk_targets", "train_router", "centroid_router", "route",
           "gate_matrix", "col_expert", "with_shared", "fit_output", "relative_error"]


def col_expert(groups: torch.Tensor, d_ff: int, shared: torch.Tensor | None = None
               ) -> torch.Tensor:
    """``[d_ff]`` int64: the expert of each neuron (``E`` for the neurons in ``shared``, the
    always-on shared expert: index them into a gating matrix with an extra column of ones,
    :func:`with_shared`)."""
    col = torch.empty(d_ff, dtype=torch.int64)
    for e in range(groups.shape[0]):
        col[groups[e]] = e
    if shared is not None and shared.numel():
        col[shared] = groups.shape[0]
    return col


def with_shared(gm: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
    """The gating matrix ``gm [N, E]`` with a column of ones appended when there is a shared
    expert (``shared`` non-empty), else ``gm`` itself."""
    if shared is None or not shared.numel():
        return gm
    return torch.cat([gm, torch.ones(gm.shape[0], 1, dtype=gm.dtype)], 1)


def expert_norms(h: torch.Tensor, down: torch.Tensor, groups: torch.Tensor, batch: int = 2048
                 ) -> torch.Tensor:
    """``||E_e(x)||`` for every token and expert: ``[N, E]`` float32."""
    return expert_stats(h, down, groups, batch)[0]


def expert_stats(h: torch.Tensor, down: torch.Tensor, groups: torch.Tensor,
                 y: torch.Tensor | None = None, batch: int = 2048
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token expert statistics in one pass over the expert outputs.

    Args:
        y: ``[N, d_model]`` target the layer should produce (default: the dense output
            ``sum_e E_e(x)``).

    Returns:
        ``(norms [N, E], gram [N, E, E], proj [N, E], yy [N])``: ``||E_e(x)||``,
        ``<E_i(x), E_j(x)>``, ``<E_e(x), y>`` and ``||y||^2`` (float32; the Gram matrices make
        every later least-squares fit of per-expert scales independent of ``d_model``).
    """
    norms, gram, proj, yy = [], [], [], []
    for s in range(0, h.shape[0], batch):
        hb = h[s:s + batch]
        outs = torch.stack([hb[:, g] @ down[:, g].t() for g in groups], 1)     # [n, E, D]
        yb = outs.sum(1) if y is None else y[s:s + batch]
        g = torch.einsum("nid,njd->nij", outs, outs)
        gram.append(g)
        norms.append(g.diagonal(dim1=1, dim2=2).clamp_min(0).sqrt())
        proj.append(torch.einsum("nid,nd->ni", outs, yb))
        yy.append((yb * yb).sum(-1))
    return torch.cat(norms), torch.cat(gram), torch.cat(proj), torch.cat(yy)


def topk_targets(norms: torch.Tensor, top_k: int) -> torch.Tensor:
    """Multi-hot ``[N, E]`` float32 of each token's ``top_k`` largest expert outputs."""
    idx = torch.sort(norms, dim=1, descending=True, stable=True).indices[:, :top_k]
    return torch.zeros_like(norms).scatter_(1, idx, 1.0)


def train_router(x: torch.Tensor, targets: torch.Tensor, seed: int, steps: int = 300,
                 lr: float = 1e-2, batch: int = 2048) -> torch.Tensor:
    """Linear router fitted to multi-hot ``targets [N, E]`` with BCE (Adam, minibatches of
    ``batch`` tokens drawn with ``seed``): ``[E, d_model]`` float32."""
    g = torch.Generator().manual_seed(seed)
    R = (torch.randn(targets.shape[1], x.shape[1], generator=g) * 1e-3).requires_grad_()
    opt = torch.optim.Adam([R], lr=lr)
    xf = x.float()
    with torch.enable_grad():
        for _ in range(steps):
            idx = torch.randint(0, xf.shape[0], (min(batch, xf.shape[0]),), generator=g)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(xf[idx] @ R.t(), targets[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return R.detach()


def centroid_router(gate: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Untrained router: row ``e`` = mean of expert ``e``'s gate rows, ``[E, d_model]``."""
    return torch.stack([gate[g].mean(0) for g in groups])


def route(x: torch.Tensor, R: torch.Tensor, top_k: int, norm: bool = True
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [N, k] int64, weights [N, k] float32)``: softmax over all experts, top-k (ties to
    the lower index), renormalized when ``norm`` (llama.cpp ``build_moe_ffn`` with ``norm_w``;
    qwen2moe runs without)."""
    from localmoe.model.routing import route as _route

    w, ids = _route(x.float() @ R.t(), top_k, gating="softmax", norm_topk_prob=norm)
    return ids, w


def gate_matrix(ids: torch.Tensor, w: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Dense ``[N, E]`` gating weights (0 for unselected experts)."""
    return torch.zeros(ids.shape[0], n_experts).scatter_(1, ids, w)


def _mixture(h, down, col, gm):
    return (h * gm[:, col]) @ down.t()


def relative_error(h: torch.Tensor, down_dense: torch.Tensor, down_moe: torch.Tensor,
                   groups: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> float:
    """``||moe - dense|| / ||dense||`` over the tokens (Frobenius), where ``moe`` uses the gating
    ``(ids, w)`` and ``down_moe [d_model, d_ff]`` (neuron order of ``h``)."""
    col = col_expert(groups, h.shape[1])
    gm = gate_matrix(ids, w, groups.shape[0])
    y = h @ down_dense.t()
    return float((_mixture(h, down_moe, col, gm) - y).norm() / y.norm().clamp_min(1e-30))


def _fit_scales(stats, gm):
    """Least-squares per-expert scales ``s [E]`` for ``sum_e s_e g_e E_e(x) ~ y`` and the
    relative error they leave, from :func:`expert_stats` and the gating ``gm [N, E]``."""
    _, gram, proj, yy = stats
    gmd = gm.double()
    M = torch.einsum("ni,nj,nij->ij", gmd, gmd, gram.double())
    b = torch.einsum("ni,ni->i", gmd, proj.double())
    M += 1e-6 * M.diagonal().mean().clamp_min(1e-30) * torch.eye(M.shape[0], dtype=torch.float64)
    s = torch.linalg.solve(M, b)
    tot = yy.double().sum()
    err2 = (tot - 2 * s @ b + s @ M @ s).clamp_min(0)
    return s.float(), float((err2 / tot.clamp_min(1e-30)).sqrt())


def _refit_down(h, col, gm, y, ridge, n_experts=None):
    """Ridge refit of the down weights for gated hidden units ``h * gm[:, col]``. The ridge is
    ``ridge`` times the mean diagonal of the normal equations, taken separately over the routed
    neurons and over the shared expert's (``col == n_experts``): their gates differ in scale
    (1 against routing weights of ~1/E), and one common ridge would shrink the routed experts'
    weights far more than the shared one's."""
    z = h * gm[:, col]
    zz = (z.t() @ z).double()
    zy = (z.t() @ y).double()
    dg = zz.diagonal()
    if n_experts is not None and bool((col == n_experts).any()):
        sh = col == n_experts
        lam = torch.where(sh, dg[sh].mean(), dg[~sh].mean())
    else:
        lam = dg.mean().expand_as(dg)
    zz += torch.diag(ridge * lam)
    return torch.linalg.solve(zz, zy).t().float()


def fit_output(x: torch.Tensor, h: torch.Tensor, down: torch.Tensor, groups: torch.Tensor,
               R: torch.Tensor, top_k: int, *, y: torch.Tensor | None = None, stats=None,
               refit_down: bool = False,
               shared: torch.Tensor | None = None,
               norm: bool = True,
               ridge: float = 0.1,
               temperatures: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0, 1e3)
               ) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Choose the router temperature and the down weights of the sparse layer.

    Args:
        x: ``[N, d_model]`` calibration FFN inputs; h: ``[N, d_ff]`` their GLU hidden units.
        down: ``[d_model, d_ff]`` dense down projection; groups, R: the split and the router.
        top_k: experts per token the weights are fitted for.
        y: ``[N, d_model]`` what the layer should output (default: the dense FFN's output).
        stats: :func:`expert_stats` of ``(h, down, groups, y)`` if already computed.
        refit_down: ridge-refit the whole down projection (else per-expert scales only).
        shared: ``[F_s]`` int64 neuron ids of an always-on shared expert (gate 1; its down
            columns are refitted with the routed ones, or kept when only scales are fitted).
            ``stats`` and ``y`` then describe the routed experts' part.
        norm: renormalize the top-k routing weights (see :func:`route`).
        ridge: ridge strength relative to the mean diagonal of the normal equations.
        temperatures: router logit divisors tried (1e3 ~ uniform weights over the top-k).

    Returns:
        ``(R_scaled [E, d_model], down_moe [d_model, d_ff], info)``: the router divided by the
        chosen temperature, the down weights (neuron order of ``h``) with scales folded in, and
        ``info`` (temperature, calibration relative error).
    """
    stats = stats if stats is not None else expert_stats(h, down, groups, y)
    col = col_expert(groups, h.shape[1], shared)
    has_sh = shared is not None and shared.numel() > 0
    best = None
    for t in temperatures:
        ids, w = route(x, R / t, top_k, norm)
        gm = gate_matrix(ids, w, groups.shape[0])
        s, err = _fit_scales(stats, gm)
        if best is None or err < best[0]:
            best = (err, t, s, gm)
    err, t, s, gm = best
    gm = with_shared(gm, shared)
    if has_sh:
        s = torch.cat([s, torch.ones(1)])
    d = down * s[col][None, :]
    if refit_down or has_sh:
        yf = h @ down.t()
        if y is not None:
            yf = y + h[:, shared] @ down[:, shared].t() if has_sh else y
        if refit_down:
            d = _refit_down(h, col, gm, yf, ridge, groups.shape[0])
        err = float((_mixture(h, d, col, gm) - yf).norm() / yf.norm())
    return R / t, d, {"temperature": t, "calib_rel_err": err}
