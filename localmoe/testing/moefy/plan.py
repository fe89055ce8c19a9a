"""The moefication of one dense model: split, router and down weights of every layer.

:func:`build_plan` walks the calibration text through the dense model and through the model
being built, one layer at a time (:class:`.collect.LayerStreams`); per layer: the GLU hidden
units of the moefied model's FFN inputs, the split (:mod:`.partition`), the router and the
output fit (:mod:`.router`) towards the dense model's residual stream. A :class:`MoePlan` is saved as one ``.npz`` so the GGUF writers and the
evaluation reuse it without recomputing.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from localmoe.testing.moefy.config import MoefyConfig, check_request

__all__ = ["LayerPlan", "MoePlan", "build_plan", "glu_hidden", "sparse_ffn", "shared_split",
           "open_gate"]


@dataclass
class LayerPlan:
    """One layer's MoE.

    Attributes:
        groups: ``[E, d_ff_expert]`` int64 neuron ids of each expert (sorted).
        router: ``[E, d_model]`` float32; logits = FFN input (after the pre-FFN norm) @ router.T.
        down: ``[d_model, d_ff]`` float32 down weights of the sparse layer (source neuron order;
            output scales folded in).
        info: fit diagnostics (temperature, calibration relative error, router recall).
        shared: ``[F_s]`` int64 neuron ids of the always-on shared expert (sorted; empty when
            there is none).
        sh_gate: ``[d_model]`` float32 weight of the shared expert's sigmoid gate (qwen2moe's
            ``ffn_gate_inp_shexp``): tiny, so the gate is ``0.5`` within ~1e-4 on the
            calibration inputs and the stored shared down weights are doubled; empty when
            there is no shared expert.
    """

    groups: torch.Tensor
    router: torch.Tensor
    down: torch.Tensor
    info: dict = field(default_factory=dict)
    shared: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    sh_gate: torch.Tensor = field(default_factory=lambda: torch.zeros(0))


@dataclass
class MoePlan:
    """All layers' :class:`LayerPlan` plus what made them."""

    source: str
    source_arch: str
    cfg: MoefyConfig
    layers: list[LayerPlan]
    stats: dict = field(default_factory=dict)

    def save(self, path: str | Path) -> Path:
        """Write ``path`` (``.npz``: per-layer arrays + a JSON header)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays = {}
        for i, L in enumerate(self.layers):
            arrays[f"groups.{i}"] = L.groups.numpy()
            arrays[f"router.{i}"] = L.router.numpy()
            arrays[f"down.{i}"] = L.down.numpy()
            if L.shared.numel():
                arrays[f"shared.{i}"] = L.shared.numpy()
                arrays[f"sh_gate.{i}"] = L.sh_gate.numpy()
        meta = {"source": self.source, "source_arch": self.source_arch, "cfg": asdict(self.cfg),
                "stats": self.stats, "info": [L.info for L in self.layers]}
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, **arrays)
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "MoePlan":
        z = np.load(path)
        meta = json.loads(bytes(z["meta"]).decode())
        n = len(meta["info"])
        layers = [LayerPlan(torch.from_numpy(z[f"groups.{i}"]), torch.from_numpy(z[f"router.{i}"]),
                            torch.from_numpy(z[f"down.{i}"]), meta["info"][i]) for i in range(n)]
        for i, L in enumerate(layers):
            if f"shared.{i}" in z:
                L.shared = torch.from_numpy(z[f"shared.{i}"])
                L.sh_gate = torch.from_numpy(z[f"sh_gate.{i}"])
        return cls(meta["source"], meta["source_arch"], MoefyConfig(**meta["cfg"]), layers,
                   meta["stats"])


def glu_hidden(model, ffn, x: torch.Tensor) -> torch.Tensor:
    """``act(gate x) * up x``: ``[N, d_ff]`` float32 (``ffn`` a :class:`.collect.DenseFFN`)."""
    return model.ops.act(x @ ffn.gate.t()) * (x @ ffn.up.t())


def _fit_layer(model, layer: int, x: torch.Tensor, y: torch.Tensor | None, cfg: MoefyConfig
               ) -> LayerPlan:
    """Split, router and output fit of one layer on inputs ``x`` with target output ``y``."""
    from localmoe.testing.moefy import partition, router as rt
    from localmoe.testing.moefy.collect import dense_ffn

    w = dense_ffn(model, layer)
    h = glu_hidden(model, w, x)
    seed = cfg.seed * 1000 + layer
    shared, routed = shared_split(h, w.down, cfg)
    hr = h[:, routed] if shared.numel() else h
    if cfg.split == "cluster":
        groups = partition.coactivation_split(hr, cfg.n_experts, seed)
    else:
        groups = partition.random_split(hr.shape[1], cfg.n_experts, seed)
    yr = y
    if shared.numel():
        groups = routed[groups]                  # back to source neuron ids
        if y is not None:
            yr = y - h[:, shared] @ w.down[:, shared].t()
    stats = rt.expert_stats(h, w.down, groups, yr)
    targets = rt.topk_targets(stats[0], cfg.top_k)
    if cfg.router == "trained":
        R = rt.train_router(x, targets, seed)
    else:
        R = rt.centroid_router(w.gate, groups)
    R, down, info = rt.fit_output(x, h, w.down, groups, R, cfg.top_k, y=yr, stats=stats,
                                  refit_down=cfg.refit_down, shared=shared, norm=cfg.norm_topk)
    ids, _ = rt.route(x, R, cfg.top_k, cfg.norm_topk)
    hit = torch.zeros_like(targets).scatter_(1, ids, 1.0)
    info["router_recall"] = float((hit * targets).sum() / targets.sum())
    lp = LayerPlan(groups, R.contiguous(), down.contiguous(), info)
    if shared.numel():
        lp.shared = shared
        lp.sh_gate = open_gate(x)
        info["shared_share"] = float((h[:, shared] @ w.down[:, shared].t()).norm()
                                     / (h @ w.down.t()).norm().clamp_min(1e-30))
    return lp


def shared_split(h: torch.Tensor, down: torch.Tensor, cfg: MoefyConfig
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(shared, routed)`` sorted int64 neuron ids: the ``d_ff_shared`` neurons
    (:meth:`.config.MoefyConfig.split_sizes`) with the largest mean output contribution
    ``mean_t |h_t,i| * ||down[:, i]||`` on the calibration tokens, and the others.

    Args:
        h: ``[N, d_ff]`` GLU hidden units; down: ``[d_model, d_ff]``.
    """
    d_ff = h.shape[1]
    n_sh, _ = cfg.split_sizes(d_ff)
    if not n_sh:
        return torch.zeros(0, dtype=torch.int64), torch.arange(d_ff)
    score = h.abs().mean(0) * down.norm(dim=0)
    order = torch.sort(score, descending=True, stable=True).indices
    return torch.sort(order[:n_sh]).values, torch.sort(order[n_sh:]).values


def open_gate(x: torch.Tensor, level: float = 1e-4) -> torch.Tensor:
    """A ``[d_model]`` float32 shared-expert gate weight ``w`` with ``x . w`` about ``level``
    (never 0, so llama.cpp's ``silu(z) / z`` sigmoid stays finite) on the calibration inputs
    ``x [N, d_model]``: ``sigmoid(x . w) = 0.5`` to ~``level / 4``, an always-open gate at half
    height (the writer doubles the shared down weights)."""
    m = x.float().mean(0)
    return (level * m / m.pow(2).sum().clamp_min(1e-30)).contiguous()


def _post_norm(model, layer: int):
    """The block's post-FFN norm weight (Gemma), or None."""
    return model.layers[layer].get("post_ffw_norm")


def _target(model, layer: int, x: torch.Tensor, a: torch.Tensor, dense_next: torch.Tensor,
            how: str) -> torch.Tensor | None:
    """What layer ``layer``'s FFN should output on the moefied stream's inputs ``x``:
    ``local`` -> None (the dense FFN's own output on ``x``); ``residual`` -> the output that
    brings the moefied stream back to the dense one, ``dense_next - a`` (through the post-FFN
    norm when the block has one: its direction ``z / w``, at the dense FFN's per-token RMS)."""
    if how == "local":
        return None
    z = dense_next - a
    w = _post_norm(model, layer)
    if w is None:
        return z
    from localmoe.testing.moefy.collect import dense_ffn

    f = dense_ffn(model, layer)
    ref = glu_hidden(model, f, x) @ f.down.t()
    u = z / w
    rms = lambda t: t.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-30)  # noqa: E731
    return u * (rms(ref) / rms(u))


def sparse_ffn(model, layer: int, lp: LayerPlan, top_k: int, post_normed: bool):
    """The fitted sparse FFN of ``layer`` as a function ``x [n, d_model] -> [n, d_model]`` (float
    down weights; with ``post_normed`` its output is RMS-normalized as gemma4's MoE branch)."""
    from localmoe.testing.moefy import router as rt
    from localmoe.testing.moefy.collect import dense_ffn

    w = dense_ffn(model, layer)
    col = rt.col_expert(lp.groups, w.gate.shape[0], lp.shared)
    norm = not lp.shared.numel()

    def f(x):
        h = glu_hidden(model, w, x)
        ids, wts = rt.route(x, lp.router, top_k, norm)
        gm = rt.with_shared(rt.gate_matrix(ids, wts, lp.groups.shape[0]), lp.shared)
        out = (h * gm[:, col]) @ lp.down.t()
        return model.ops.norm(out, None, model.spec.norm_eps) if post_normed else out
    return f


def build_plan(model_file, cfg: MoefyConfig, *, dense=None, progress=None) -> MoePlan:
    """Moefy every layer of the dense model in ``model_file``, one layer at a time.

    The calibration sequences run through the dense model and through the model being built
    (:class:`.collect.LayerStreams`): layer ``l`` is fitted on the FFN inputs the moefied model
    produces after its first ``l`` layers were replaced, towards ``cfg.target`` (``residual``:
    what brings its residual stream back to the dense one; ``local``: the dense FFN's output).

    Args:
        model_file: the opened dense source (:func:`localmoe.io.loader.open_model`).
        cfg: what to build (checked first, see :func:`.config.check_request`).
        dense: an already loaded ``(Transformer, Tokenizer)`` of the same file (optional; not
            modified).
        progress: ``progress(message)`` called per stage/layer.

    Returns:
        the :class:`MoePlan` (``stats``: seconds, calibration tokens, largest mean V^2).

    Raises:
        UnsupportedModelError, ValueError: see :func:`.config.check_request`.
    """
    from localmoe.testing.moefy import collect, texts
    from localmoe.testing.moefy.config import TARGET_ARCH

    check_request(model_file.spec, cfg, model_file.tensor_names())
    say = progress or (lambda m: None)
    t0 = time.perf_counter()
    model, tok = dense if dense is not None else collect.load_dense(model_file)
    add_bos = bool(model_file.metadata.get("tokenizer.ggml.add_bos_token", False))
    chunks = collect.token_chunks(tok, texts.corpus(cfg.calib_corpus), cfg.calib_tokens,
                                  cfg.seq_len, add_bos)
    vs: dict = {}
    streams = collect.LayerStreams(model, chunks, v_stats=vs)
    post_normed = TARGET_ARCH[model.spec.arch] == "gemma4"
    layers = []
    for l in range(model.spec.n_layers):
        streams.dense_step(l)
        x, a = streams.moe_inputs(l)
        y = _target(model, l, x, a, streams.dense_residual(), cfg.target)
        layers.append(_fit_layer(model, l, x, y, cfg))
        streams.moe_step(l, sparse_ffn(model, l, layers[-1], cfg.top_k, post_normed))
        i = layers[-1].info
        say(f"layer {l}: router recall {i['router_recall']:.3f}, calibration rel. error "
            f"{i['calib_rel_err']:.3f}, T {i['temperature']} ({time.perf_counter() - t0:.0f} s)")
    stats = {"calib_tokens": int(sum(len(c) for c in chunks)), "max_mean_v2": max(vs.values()),
             "plan_s": round(time.perf_counter() - t0, 2)}
    return MoePlan(str(model_file.path), model.spec.arch, cfg, layers, stats)
