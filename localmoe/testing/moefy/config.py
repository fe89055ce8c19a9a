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

    def with_(self, **kw) -> "MoefyConfig":
        return replace(self, **kw)

    def tag(self) -> str:
        """Short name, e.g. ``16x4-cluster-trained-refit-residual-s0``."""
        return (f"{self.n_experts}x{self.top_k}-{self.split}-{self.router}"
                f"{'-refit' if self.refit_down else ''}-{self.target}-s{self.seed}")


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
        ValueError: ``n_experts`` < 2 or not a divisor of ``d_ff``, ``top_k`` out of
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
    if spec.d_ff % cfg.n_experts:
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
