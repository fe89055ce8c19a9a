"""What to build: :class:`MoefyConfig`, the presets, and the checks made before any work."""

from __future__ import annotations

from dataclasses import dataclass, replace

from localmoe.errors import UnsupportedModelError

__all__ = ["MoefyConfig", "PRESETS", "SUPPORTED_SOURCES", "TARGET_ARCH", "check_request"]

#: dense source architecture -> the llama.cpp MoE architecture written (see docs/MOEFY.md)
TARGET_ARCH = {"llama": "llama", "gemma3": "gemma4"}
SUPPORTED_SOURCES = tuple(TARGET_ARCH)


@dataclass(frozen=True)
class MoefyConfig:
    """How to turn a dense model into a MoE.

    Attributes:
        n_experts: experts per layer; must divide the FFN width ``d_ff``.
        top_k: experts per token, ``1 <= top_k <= n_experts``.
        split: ``"cluster"`` (balanced co-activation clustering) or ``"random"``.
        router: ``"trained"`` (fitted on calibration hidden states) or ``"centroid"`` (mean gate
            row per expert; no training).
        refit_down: least-squares refit of the down projections for the sparse mixture (else
            per-expert output scales only).
        target: what each layer is fitted to reproduce on the moefied model's own inputs:
            ``"residual"`` (the dense model's residual stream after the layer: corrects errors
            of earlier layers) or ``"local"`` (the dense FFN's output).
        calib_tokens: calibration tokens (from ``calib_corpus``), in sequences of ``seq_len``.
        seed: seeds every random choice (split, k-means initialization, router init).
        shared_frac: fraction ``F`` of each FFN's neurons kept as one always-on shared expert
            (the neurons with the largest mean output contribution on the calibration text);
            the rest is split into ``n_experts`` routed experts of ``floor((1-F) d_ff / E)``
            neurons (leftovers join the shared expert). ``0`` (default): no shared expert, a
            Mixtral-style ``llama`` file as before; ``> 0``: a ``qwen2moe`` file (llama sources
            only). Must be in ``[0, 1)``.
    """

    n_experts: int
    top_k: int
    split: str = "cluster"
    router: str = "trained"
    refit_down: bool = True
    target: str = "local"
    calib_tokens: int = 8192
    seq_len: int = 512
    seed: int = 0
    calib_corpus: str = "python-reference"
    shared_frac: float = 0.0

    def with_(self, **kw) -> "MoefyConfig":
        return replace(self, **kw)

    def tag(self) -> str:
        """Short name, e.g. ``16x4-cluster-trained-refit-residual-s0``."""
        return (f"{self.n_experts}x{self.top_k}-{self.split}-{self.router}"
                f"{'-refit' if self.refit_down else ''}-{self.target}-s{self.seed}"
                f"{f'-sh{self.shared_frac:g}' if self.shared_frac else ''}")

    @property
    def norm_topk(self) -> bool:
        """Whether the top-k routing weights are renormalized: yes for the Mixtral-style llama
        and gemma4 files, no for qwen2moe (llama.cpp's qwen2moe graph never renormalizes)."""
        return not self.shared_frac

    def split_sizes(self, d_ff: int) -> tuple[int, int]:
        """``(d_ff_shared, d_ff_expert)`` for an FFN of ``d_ff`` neurons (shared may be 0)."""
        fe = int((1.0 - self.shared_frac) * d_ff) // self.n_experts
        return d_ff - self.n_experts * fe, fe


#: preset -> (source model short name in the store, config)
PRESETS: dict[str, tuple[str, MoefyConfig]] = {
    "smollm2-moe-16x4": ("smollm2", MoefyConfig(16, 4)),
    "smollm2-moe-32x8": ("smollm2", MoefyConfig(32, 8)),
    "gemma3-moe-16x4": ("gemma3-270m", MoefyConfig(16, 4)),
}


def check_request(spec, cfg: MoefyConfig, tensor_names=None) -> None:
    """Refuse a request before any work starts.

    Args:
        spec: the source's :class:`~localmoe.model.spec.ModelSpec`.
        cfg: the request.
        tensor_names: the source's tensor names (to detect a model that already has experts).

    Raises:
        UnsupportedModelError: the family is not one moefy handles, or the model is already a MoE.
        ValueError: ``n_experts`` < 2 or (without a shared expert) not a divisor of ``d_ff``,
            ``shared_frac`` outside ``[0, 1)``, leaving fewer routed neurons than experts, or
            asked of a non-llama source, ``top_k`` out of
            ``[1, n_experts]``, unknown ``split``/``router``, non-positive token counts.
    """
    if spec.arch not in SUPPORTED_SOURCES:
        raise UnsupportedModelError(
            f"moefy handles dense {', '.join(SUPPORTED_SOURCES)} models; this one is "
            f"{spec.arch!r}")
    if spec.is_moe or (tensor_names and any("_exps." in n for n in tensor_names)):
        raise UnsupportedModelError("the source model already has experts; moefy needs a dense model")
    if cfg.n_experts < 2:
        raise ValueError(f"n_experts must be at least 2, got {cfg.n_experts}")
    f = cfg.shared_frac
    if not (isinstance(f, (int, float)) and 0.0 <= f < 1.0):
        raise ValueError(f"shared_frac={f} must be in [0, 1)")
    if f and spec.arch != "llama":
        raise ValueError(f"a shared expert (shared_frac={f}) is written as qwen2moe, for llama "
                         f"sources only; this one is {spec.arch!r}")
    if f and cfg.split_sizes(spec.d_ff)[1] < 1:
        raise ValueError(f"shared_frac={f} leaves {int((1.0 - f) * spec.d_ff)} of {spec.d_ff} "
                         f"neurons for {cfg.n_experts} experts: fewer neurons than experts")
    if not f and spec.d_ff % cfg.n_experts:
        divs = [d for d in range(2, min(spec.d_ff, 256) + 1) if spec.d_ff % d == 0]
        raise ValueError(f"n_experts={cfg.n_experts} does not divide the FFN width d_ff={spec.d_ff}; "
                         f"choose one of {divs[:16]}")
    if not 1 <= cfg.top_k <= cfg.n_experts:
        raise ValueError(f"top_k={cfg.top_k} must be between 1 and n_experts={cfg.n_experts}")
    if cfg.split not in ("cluster", "random"):
        raise ValueError(f"split must be 'cluster' or 'random', got {cfg.split!r}")
    if cfg.router not in ("trained", "centroid"):
        raise ValueError(f"router must be 'trained' or 'centroid', got {cfg.router!r}")
    if cfg.target not in ("residual", "local"):
        raise ValueError(f"target must be 'residual' or 'local', got {cfg.target!r}")
    if cfg.calib_tokens <= 0 or cfg.seq_len < 2:
        raise ValueError("calib_tokens must be positive and seq_len at least 2")
