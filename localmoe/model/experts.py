"""Expert weights for MoE layers: the ExpertProvider seam and the resident implementation.

A MoE layer never owns its expert tensors; it asks an :class:`ExpertProvider`. The resident
provider keeps every expert of every MoE layer in memory (on the compute device); an offloading
provider (localmoe/offload) keeps them in host RAM and streams the ones a step needs into a
device cache. The MoE layer tells the provider which experts a batch routes to *before* asking
for their weights (:meth:`ExpertProvider.prepare`), so an offloading provider can fetch only
those.

Layout (torch order, GGUF ``ne`` reversed; INTERFACES.md):
``gate[E, d_ff_expert, d_model]``, ``up[E, d_ff_expert, d_model]``, ``down[E, d_model,
d_ff_expert]`` -- GGUF ``blk.N.ffn_{gate,up,down}_exps.weight``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Iterable, NamedTuple

import torch


class ExpertWeights(NamedTuple):
    """Stacked weights of one MoE layer (float tensors on the compute device).

    gate, up: ``[n_experts, d_ff_expert, d_model]``; down: ``[n_experts, d_model, d_ff_expert]``.
    """

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


class ExpertProvider(ABC):
    """Interface: where a MoE layer gets expert weights from.

    Subclasses implement :meth:`expert` (and may override :meth:`get` / :meth:`prepare`).
    Layer indices are the model's 0-based block indices; only MoE layers are valid.
    """

    n_experts: int = 0

    @abstractmethod
    def layers(self) -> list[int]:
        """Indices of the MoE layers this provider serves."""

    def prepare(self, layer: int, expert_ids: torch.Tensor) -> None:
        """Announce the (unique, int64) expert ids a batch routes to in ``layer``.

        Called once per layer and forward step before :meth:`expert`; the resident provider
        ignores it, an offloading one fetches the missing experts here.
        """

    @abstractmethod
    def expert(self, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Weights of expert ``e`` of ``layer``: ``(gate[F, D], up[F, D], down[D, F])``.

        Raises:
            KeyError: ``layer`` is not a MoE layer of this provider.
        """

    def get(self, layer: int) -> ExpertWeights:
        """All experts of ``layer`` stacked (see :class:`ExpertWeights`); may be expensive for an
        offloading provider (it materializes every expert)."""
        parts = [self.expert(layer, e) for e in range(self.n_experts)]
        return ExpertWeights(*(torch.stack([p[i] for p in parts]) for i in range(3)))

    def stats(self) -> dict:
        """Counters for ``runner.stats()`` (empty for the resident provider)."""
        return {}


class ResidentExpertProvider(ExpertProvider):
    """Every expert of every MoE layer kept in memory as stacked float tensors.

    Args:
        weights: ``{layer: ExpertWeights}`` already on the compute device.
    """

    def __init__(self, weights: dict[int, ExpertWeights]):
        self._w = dict(weights)
        first = next(iter(self._w.values()), None)
        self.n_experts = int(first.gate.shape[0]) if first is not None else 0

    @classmethod
    def from_loader(cls, layers: Iterable[int], load: Callable[[str], torch.Tensor]
                    ) -> "ResidentExpertProvider":
        """Build from a tensor getter ``load(gguf_name) -> Tensor`` (already dequantized, on the
        target device and dtype), reading ``blk.{l}.ffn_{gate,up,down}_exps.weight``."""
        w = {}
        for l in layers:
            w[l] = ExpertWeights(load(f"blk.{l}.ffn_gate_exps.weight"),
                                 load(f"blk.{l}.ffn_up_exps.weight"),
                                 load(f"blk.{l}.ffn_down_exps.weight"))
        return cls(w)

    def layers(self) -> list[int]:
        return sorted(self._w)

    def get(self, layer: int) -> ExpertWeights:
        return self._w[layer]

    def expert(self, layer: int, e: int):
        w = self._w[layer]
        return w.gate[e], w.up[e], w.down[e]

    def nbytes(self) -> int:
        """Bytes held by all expert tensors."""
        return sum(t.numel() * t.element_size() for w in self._w.values() for t in w)
