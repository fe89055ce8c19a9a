"""The moefication of one dense model: split, router and down weights of every layer.

:func:`build_plan` runs the dense model over the calibration text once (teacher forcing: every
layer is fitted on the dense model's own FFN inputs), then per layer: the GLU hidden units of
the calibration tokens, the split (:mod:`.partition`), the router and the output fit
(:mod:`.router`). A :class:`MoePlan` is saved as one ``.npz`` so the GGUF writers and the
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

__all__ = ["LayerPlan", "MoePlan", "build_plan", "glu_hidden"]


@dataclass
class LayerPlan:
    """One layer's MoE.

    Attributes:
        groups: ``[E, d_ff/E]`` int64 neuron ids of each expert (sorted).
        router: ``[E, d_model]`` float32; logits = FFN input (after the pre-FFN norm) @ router.T.
        down: ``[d_model, d_ff]`` float32 down weights of the sparse layer (source neuron order;
            output scales folded in).
        info: fit diagnostics (temperature, calibration relative error, router recall).
    """

    groups: torch.Tensor
    router: torch.Tensor
    down: torch.Tensor
    info: dict = field(default_factory=dict)


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
        return cls(meta["source"], meta["source_arch"], MoefyConfig(**meta["cfg"]), layers,
                   meta["stats"])


def glu_hidden(model, ffn, x: torch.Tensor) -> torch.Tensor:
    """``act(gate x) * up x``: ``[N, d_ff]`` float32 (``ffn`` a :class:`.collect.DenseFFN`)."""
    return model.ops.act(x @ ffn.gate.t()) * (x @ ffn.up.t())


def _fit_layer(model, layer: int, x: torch.Tensor, cfg: MoefyConfig) -> LayerPlan:
    from localmoe.testing.moefy import partition, router as rt
    from localmoe.testing.moefy.collect import dense_ffn

    w = dense_ffn(model, layer)
    h = glu_hidden(model, w, x)
    seed = cfg.seed * 1000 + layer
    if cfg.split == "cluster":
        groups = partition.coactivation_split(h, cfg.n_experts, seed)
    else:
        groups = partition.random_split(h.shape[1], cfg.n_experts, seed)
    targets = rt.topk_targets(rt.expert_norms(h, w.down, groups), cfg.top_k)
    if cfg.router == "trained":
        R = rt.train_router(x, targets, seed)
    else:
        R = rt.centroid_router(w.gate, groups)
    R, down, info = rt.fit_output(x, h, w.down, groups, R, cfg.top_k, refit_down=cfg.refit_down)
    ids, _ = rt.route(x, R, cfg.top_k)
    hit = torch.zeros_like(targets).scatter_(1, ids, 1.0)
    info["router_recall"] = float((hit * targets).sum() / targets.sum())
    return LayerPlan(groups, R.contiguous(), down.contiguous(), info)


def build_plan(model_file, cfg: MoefyConfig, *, dense=None, inputs=None, progress=None) -> MoePlan:
    """Moefy every layer of the dense model in ``model_file``.

    Args:
        model_file: the opened dense source (:func:`localmoe.io.loader.open_model`).
        cfg: what to build (checked first, see :func:`.config.check_request`).
        dense: an already loaded ``(Transformer, Tokenizer)`` of the same file (optional).
        inputs: already collected ``{layer: [N, d_model]}`` calibration FFN inputs (optional;
            must come from ``cfg.calib_corpus``).
        progress: ``progress(message)`` called per stage/layer.

    Returns:
        the :class:`MoePlan` (``stats``: seconds per stage, calibration token count).

    Raises:
        UnsupportedModelError, ValueError: see :func:`.config.check_request`.
    """
    from localmoe.testing.moefy import collect, texts

    check_request(model_file.spec, cfg, model_file.tensor_names())
    say = progress or (lambda m: None)
    t0 = time.perf_counter()
    model, tok = dense if dense is not None else collect.load_dense(model_file)
    stats: dict = {}
    if inputs is None:
        add_bos = bool(model_file.metadata.get("tokenizer.ggml.add_bos_token", False))
        chunks = collect.token_chunks(tok, texts.corpus(cfg.calib_corpus), cfg.calib_tokens,
                                      cfg.seq_len, add_bos)
        vs: dict = {}
        inputs = collect.collect_ffn_inputs(model, chunks, v_stats=vs)
        stats["max_mean_v2"] = max(vs.values())
    stats["calib_tokens"] = int(next(iter(inputs.values())).shape[0])
    stats["collect_s"] = round(time.perf_counter() - t0, 2)
    say(f"calibration: {stats['calib_tokens']} tokens in {stats['collect_s']} s")
    layers = []
    t1 = time.perf_counter()
    for l in range(model.spec.n_layers):
        layers.append(_fit_layer(model, l, inputs[l], cfg))
        i = layers[-1].info
        say(f"layer {l}: recall {i['router_recall']:.3f} calib rel err {i['calib_rel_err']:.3f} "
            f"T {i['temperature']}")
    stats["fit_s"] = round(time.perf_counter() - t1, 2)
    return MoePlan(str(model_file.path), model.spec.arch, cfg, layers, stats)
