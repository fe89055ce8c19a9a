"""Routing traces: what a MoE model routed, token by token, and what a predictor could have known.

:class:`RoutingRecorder` wraps a Transformer's MoE hook (``model.moe``). For every token of
every forward call and every MoE layer ``l`` it records

* ``ids [k]``: the experts chosen (top-k of the router's softmax; ties to the lower index),
* ``weights [k]``: their mixing weights (as the model uses them),
* ``ahead [A, E]``: the router logits of layers ``l+1 .. l+A`` applied to *this* layer's
  hidden state -- the residual stream entering layer ``l``'s FFN, normalized with the target
  layer's own pre-FFN norm (what a prefetcher has in hand one, two, three layers early;
  mixtral-offloading's speculative loading). The hook only sees layer ``l``'s normed FFN input
  ``x_l = rmsnorm(h_l) * w_l``; ``rmsnorm(h_l) = x_l / w_l`` is recovered exactly and
  ``x_l / w_l * w_{l+d}`` is what layer ``l+d``'s router would read. NaN where ``l+d`` is past
  the last layer.

File format (``.npz``, numpy; :func:`save_trace` / :func:`load_trace`):

===============  ===========================  ==============================================
array            shape, dtype                 meaning
===============  ===========================  ==============================================
``meta``         uint8 (UTF-8 JSON)           model, plan config, n_layers, n_experts, top_k,
                                              ahead, prompts (name, kind, n_prompt, n_total),
                                              format version
``tokens.P``     ``[T]`` int32                token ids of prompt ``P`` (prompt then output)
``ids.P``        ``[T, L, k]`` int16          experts per token and MoE layer
``weights.P``    ``[T, L, k]`` float16        their weights
``ahead.P``      ``[T, L, A, E]`` float16     router logits of layer ``l+d`` (d = 1..A) on
                                              layer ``l``'s hidden state
===============  ===========================  ==============================================

Tokens ``0 .. n_prompt-1`` were processed as one prefill, the rest one by one (decode).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

__all__ = ["RoutingRecorder", "Trace", "save_trace", "load_trace", "TRACE_VERSION"]

TRACE_VERSION = 1


@dataclass
class Trace:
    """One prompt's routing: arrays as in the module docstring (numpy)."""

    name: str
    kind: str
    n_prompt: int
    tokens: np.ndarray
    ids: np.ndarray
    weights: np.ndarray
    ahead: np.ndarray
    text: str = ""


class RoutingRecorder:
    """Records routing of ``model`` (a MoE :class:`~localmoe.model.transformer.Transformer`)
    while installed (``with RoutingRecorder(model, ahead=3) as rec: ...``).

    The MoE output is unchanged: the wrapped hook still computes it; the recorder recomputes
    the router logits (``x @ router``) and routes them with the same function.

    Attributes:
        steps: per forward call, ``{layer: (ids [N, k], weights [N, k], ahead [N, A, E])}``.
    """

    def __init__(self, model, ahead: int = 3):
        self.model = model
        self.ahead = int(ahead)
        self.steps: list[dict] = []
        self._inner = None
        n = model.spec.n_layers
        self.moe_layers = [l for l in range(n) if "router" in model.layers[l]]
        self._norm_w = {l: model.layers[l]["ffn_norm"].float() for l in self.moe_layers}

    def __enter__(self) -> "RoutingRecorder":
        self._inner = self.model.moe
        self.model.moe = self._hook
        return self

    def __exit__(self, *exc) -> None:
        self.model.moe = self._inner

    def _hook(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        from localmoe.model.routing import route

        s, L = self.model.spec, self.model.layers[layer]
        if layer == self.moe_layers[0]:
            self.steps.append({})
        xf = x.float()
        logits = xf @ L["router"].float()
        w, ids = route(logits, s.top_k, gating=s.gating, norm_topk_prob=s.norm_topk_prob,
                       expert_weights_scale=s.expert_weights_scale,
                       selection_bias=L.get("exp_bias"))
        ahead = torch.full((x.shape[0], self.ahead, s.n_experts), float("nan"))
        base = xf / self._norm_w[layer]
        for d in range(1, self.ahead + 1):
            t = layer + d
            if t in self._norm_w:
                Lt = self.model.layers[t]
                ahead[:, d - 1] = (base * self._norm_w[t]) @ Lt["router"].float()
        self.steps[-1][layer] = (ids.cpu(), w.cpu(), ahead)
        return self._inner(layer, x)

    def take(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Everything recorded so far as ``(ids [T, L, k], weights [T, L, k], ahead [T, L, A,
        E])`` (tokens of all forward calls in order) and clear the recorder."""
        ids, ws, ah = [], [], []
        for st in self.steps:
            ids.append(torch.stack([st[l][0] for l in self.moe_layers], 1))
            ws.append(torch.stack([st[l][1] for l in self.moe_layers], 1))
            ah.append(torch.stack([st[l][2] for l in self.moe_layers], 1))
        self.steps = []
        return (torch.cat(ids).numpy().astype(np.int16), torch.cat(ws).numpy().astype(np.float16),
                torch.cat(ah).numpy().astype(np.float16))


def save_trace(path: str | Path, traces: list[Trace], meta: dict) -> Path:
    """Write traces as one compressed ``.npz`` (see the module docstring)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    m = dict(meta, version=TRACE_VERSION,
             prompts=[{"name": t.name, "kind": t.kind, "n_prompt": int(t.n_prompt),
                       "n_total": int(len(t.tokens)), "text": t.text} for t in traces])
    arrays = {"meta": np.frombuffer(json.dumps(m).encode(), dtype=np.uint8)}
    for t in traces:
        arrays[f"tokens.{t.name}"] = t.tokens.astype(np.int32)
        arrays[f"ids.{t.name}"] = t.ids
        arrays[f"weights.{t.name}"] = t.weights
        arrays[f"ahead.{t.name}"] = t.ahead
    np.savez_compressed(path, **arrays)
    return path


def load_trace(path: str | Path) -> tuple[dict, list[Trace]]:
    """``(meta, traces)`` of a file written by :func:`save_trace`.

    Raises:
        ValueError: not a trace file, or a newer format version.
    """
    z = np.load(path)
    if "meta" not in z:
        raise ValueError(f"{path} is not a routing trace (no 'meta' array)")
    meta = json.loads(bytes(z["meta"]).decode())
    if meta.get("version", 0) > TRACE_VERSION:
        raise ValueError(f"{path}: trace format version {meta['version']} is newer than {TRACE_VERSION}")
    out = [Trace(p["name"], p["kind"], p["n_prompt"], z[f"tokens.{p['name']}"], z[f"ids.{p['name']}"],
                 z[f"weights.{p['name']}"], z[f"ahead.{p['name']}"], p.get("text", ""))
           for p in meta["prompts"]]
    return meta, out
