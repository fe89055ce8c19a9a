"""Routing traces: which experts a MoE model routed each token to, and what a prefetcher could
have known one, two, three layers earlier.

:class:`RoutingRecorder` wraps a :class:`~localmoe.model.transformer.Transformer`'s MoE hook
(``model.moe``, :data:`~localmoe.model.moe.MoEFn`) while it is installed; the hook it wraps
still computes the layer's output, so generation is unchanged. For every token of every forward
call and every MoE layer (in layer order, ``L`` of them) it records

* ``ids [k]``: the experts chosen (the router logits ``x @ router`` in float32, routed with the
  model's own gating by :func:`localmoe.model.routing.route`; ties go to the lower index),
* ``weights [k]``: their mixing weights (after ``norm_topk_prob`` and the weights scale),
* ``ahead [A, E]``: the router logits of the next ``A`` MoE layers applied to *this* layer's
  hidden state: the residual stream ``h`` entering this layer's FFN, normalized with the
  target layer's own pre-FFN norm weight (what layer ``l+d``'s router would read if the
  residual stream did not change in between; the speculative expert loading of
  mixtral-offloading, Eliseev & Mazur 2023). The hook sees ``x = rmsnorm(h) * w_l``; the
  recorder recovers ``rmsnorm(h) = x / w_l`` (channels with ``|w_l| < 1e-6`` count as 0) and
  computes ``(x / w_l * w_{l+d}) @ router_{l+d}``. NaN past the last MoE layer.

:class:`localmoe.backends.recording.RunnerRecorder` also wraps a runner's ``forward`` so each
recorded row is paired with its token id and forward call. :func:`save_trace` and
:func:`load_trace` write and read the file format of docs/ROUTING_TRACES.md (``.npz``):

===============  ===========================  ==============================================
array            shape, dtype                 meaning
===============  ===========================  ==============================================
``meta``         uint8 (UTF-8 JSON)           format version, model, n_layers, moe_layers,
                                              n_experts, top_k, gating, ahead, prompts
                                              (name, kind, n_prompt, n_total, text), ...
``tokens.P``     ``[T]`` int32                token ids of prompt ``P`` in the order routed
``ids.P``        ``[T, L, k]`` int16          experts per token and MoE layer
``weights.P``    ``[T, L, k]`` float16        their mixing weights
``ahead.P``      ``[T, L, A, E]`` float16     router logits of MoE layer ``l+d`` (d = 1..A)
                                              on MoE layer ``l``'s hidden state
``steps.P``      ``[S]`` int32                tokens per forward call (the first is the
                                              prefill; 1 per decode step)
===============  ===========================  ==============================================
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from localmoe.errors import UnsupportedModelError

__all__ = ["RoutingRecorder", "Trace", "save_trace", "load_trace",
           "TRACE_VERSION", "DEFAULT_AHEAD"]

TRACE_VERSION = 2
#: MoE layers ahead whose router logits are recorded by default
DEFAULT_AHEAD = 3


@dataclass
class Trace:
    """One prompt's routing (numpy arrays as in the module docstring).

    Attributes:
        name: unique within a file (a key of the ``.npz``; letters, digits, ``-_``).
        kind: free label (``chat``, ``code``, ``prose``, ``gen``, ``generate``, ``bench``).
        n_prompt: tokens ``0 .. n_prompt-1`` were the prompt (prefill); later ones decode steps.
        tokens: ``[T]`` token ids; ids, weights: ``[T, L, k]``; ahead: ``[T, L, A, E]``.
        text: optional generated text.
        steps: ``[S]`` tokens per forward call (sums to ``T``), or None when unknown.
    """

    name: str
    kind: str
    n_prompt: int
    tokens: np.ndarray
    ids: np.ndarray
    weights: np.ndarray
    ahead: np.ndarray
    text: str = ""
    steps: np.ndarray | None = None


class RoutingRecorder:
    """Records the routing of ``model`` while installed (``with RoutingRecorder(model) as rec``).

    Args:
        model: a MoE :class:`~localmoe.model.transformer.Transformer` (layers with a
            ``"router"`` weight ``[d_model, n_experts]``).
        ahead: how many following MoE layers' router logits to record (``A``, >= 0).

    Attributes:
        moe_layers: the model's MoE layer indices, in order (the ``L`` axis of the arrays).
        steps: per forward call, ``{layer: (ids [N, k], weights [N, k], ahead [N, A, E])}``.

    Raises:
        UnsupportedModelError: the model has no MoE layers.
        ValueError: negative ``ahead``.
    """

    def __init__(self, model, ahead: int = DEFAULT_AHEAD):
        if int(ahead) < 0:
            raise ValueError(f"ahead must be >= 0, got {ahead}")
        self.model = model
        self.ahead = int(ahead)
        self.steps: list[dict] = []
        self._inner = None
        self.moe_layers = [l for l in range(model.spec.n_layers) if "router" in model.layers[l]]
        if not self.moe_layers:
            raise UnsupportedModelError(
                f"{getattr(model.spec, 'arch', 'this model')} model has no MoE layers: there is "
                f"no expert routing to record")
        self._norm_w = {l: model.layers[l]["ffn_norm"].float() for l in self.moe_layers}
        self._inv_w = {l: torch.where(w.abs() < 1e-6, torch.zeros_like(w), 1.0 / w)
                       for l, w in self._norm_w.items()}

    def __enter__(self) -> "RoutingRecorder":
        self._inner = self.model.moe
        self.model.moe = self._hook
        return self

    def __exit__(self, *exc) -> None:
        self.model.moe = self._inner

    @torch.no_grad()
    def _hook(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        from localmoe.model.routing import route

        s, L = self.model.spec, self.model.layers[layer]
        if layer == self.moe_layers[0] or not self.steps:
            self.steps.append({})
        xf = x.float()
        bias = L.get("exp_bias")
        w, ids = route(xf @ L["router"].float(), s.top_k, gating=s.gating,
                       norm_topk_prob=s.norm_topk_prob,
                       expert_weights_scale=s.expert_weights_scale,
                       selection_bias=None if bias is None else bias.float())
        ahead = torch.full((x.shape[0], self.ahead, s.n_experts), float("nan"))
        i = self.moe_layers.index(layer)
        if self.ahead:
            base = xf * self._inv_w[layer]
            for d, t in enumerate(self.moe_layers[i + 1:i + 1 + self.ahead]):
                Lt = self.model.layers[t]
                ahead[:, d] = ((base * self._norm_w[t]) @ Lt["router"].float()).cpu()
        self.steps[-1][layer] = (ids.cpu(), w.float().cpu(), ahead)
        return self._inner(layer, x)

    def step_sizes(self) -> list[int]:
        """Tokens of each recorded forward call."""
        return [int(next(iter(st.values()))[0].shape[0]) for st in self.steps if st]

    def take(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Everything recorded so far as ``(ids [T, L, k] int16, weights [T, L, k] float16,
        ahead [T, L, A, E] float16)`` (the tokens of all forward calls in order), and clear the
        recorder. Empty arrays when nothing was recorded."""
        steps = [st for st in self.steps if len(st) == len(self.moe_layers)]
        self.steps = []
        s = self.model.spec
        if not steps:
            L = len(self.moe_layers)
            return (np.zeros((0, L, s.top_k), np.int16), np.zeros((0, L, s.top_k), np.float16),
                    np.zeros((0, L, self.ahead, s.n_experts), np.float16))
        cat = lambda j: torch.cat([torch.stack([st[l][j] for l in self.moe_layers], 1)  # noqa: E731
                                   for st in steps])
        return (cat(0).numpy().astype(np.int16), cat(1).numpy().astype(np.float16),
                cat(2).numpy().astype(np.float16))

    def meta(self) -> dict:
        """The model fields a trace file's ``meta`` holds (see :func:`save_trace`)."""
        s = self.model.spec
        return {"arch": s.arch, "n_layers": int(s.n_layers), "moe_layers": self.moe_layers,
                "n_experts": int(s.n_experts), "top_k": int(s.top_k), "gating": s.gating,
                "norm_topk_prob": bool(s.norm_topk_prob), "ahead": self.ahead}


def save_trace(path: str | os.PathLike, traces: list[Trace], meta: dict) -> Path:
    """Write ``traces`` to ``path`` as one compressed ``.npz`` (exactly that path: no suffix is
    added); ``meta`` (JSON-serializable) is stored with the format version and the prompts.

    Raises:
        ValueError: two traces with the same name; OSError: the file cannot be written.
    """
    names = [t.name for t in traces]
    if len(set(names)) != len(names):
        raise ValueError(f"trace names must be unique, got {names}")
    path = Path(path)
    m = dict(meta, version=TRACE_VERSION,
             prompts=[{"name": t.name, "kind": t.kind, "n_prompt": int(t.n_prompt),
                       "n_total": int(len(t.tokens)), "text": t.text} for t in traces])
    arrays = {"meta": np.frombuffer(json.dumps(m).encode(), dtype=np.uint8)}
    for t in traces:
        arrays[f"tokens.{t.name}"] = np.asarray(t.tokens).astype(np.int32)
        arrays[f"ids.{t.name}"] = t.ids
        arrays[f"weights.{t.name}"] = t.weights
        arrays[f"ahead.{t.name}"] = t.ahead
        steps = t.steps if t.steps is not None else np.array(
            [t.n_prompt] + [1] * (len(t.tokens) - t.n_prompt), dtype=np.int32)
        arrays[f"steps.{t.name}"] = np.asarray(steps).astype(np.int32)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:   # a file object: numpy adds no ".npz" to the name
        np.savez_compressed(f, **arrays)
    return path


def load_trace(path: str | os.PathLike) -> tuple[dict, list[Trace]]:
    """``(meta, traces)`` of a file written by :func:`save_trace`.

    Raises:
        ValueError: not a routing trace, or a newer format version.
        OSError: unreadable.
    """
    try:
        z = np.load(path)
    except (ValueError, EOFError) as e:
        raise ValueError(f"{path} is not a routing trace (.npz): {e}") from None
    if not hasattr(z, "files") or "meta" not in z.files:
        raise ValueError(f"{path} is not a routing trace (no 'meta' array)")
    meta = json.loads(bytes(z["meta"]).decode())
    if meta.get("version", 0) > TRACE_VERSION:
        raise ValueError(f"{path}: trace format version {meta['version']} is newer than "
                         f"{TRACE_VERSION}; update localmoe")
    out = []
    for p in meta["prompts"]:
        n = p["name"]
        out.append(Trace(n, p["kind"], p["n_prompt"], z[f"tokens.{n}"], z[f"ids.{n}"],
                         z[f"weights.{n}"], z[f"ahead.{n}"], p.get("text", ""),
                         z[f"steps.{n}"] if f"steps.{n}" in z.files else None))
    return meta, out
