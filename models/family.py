"""Architecture families: what each one changes relative to the shared transformer block.

``models/<family>.py`` declares one :class:`Family` subclass per GGUF architecture and registers
it with :func:`register_family`; importing :mod:`localmoe.models` (which this module's import
implies) registers the built-in families, and :func:`get_family` returns the one for an
architecture.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from localmoe.errors import UnsupportedModelError
from localmoe.io.spec import ModelSpec


class Family:
    """What an architecture family changes relative to the shared block.

    Subclasses (one small file per family in ``models/``) set class attributes and may override
    :meth:`configure`. Features visible from tensor names (q/k norm, q/k/v bias, post norms,
    shared experts and their gate, dense vs MoE layers) are detected from the file, not declared.

    Attributes:
        arch: GGUF ``general.architecture``.
        gguf_rope_style: rotation layout of this arch's GGUF files (``norm`` | ``neox``).
        gguf_norm_topk_prob: llama.cpp's fixed renormalization choice for this arch (its graph
            builder hard-codes it), or None to use the spec.
        qk_norm_full: q/k RMSNorm over the whole projection (OLMoE) instead of per head.
        act: FFN activation, or None to use ``spec.act``.
        gpu_dtype: the activation dtype a GPU runner uses unless told otherwise: ``"float16"``,
            or ``"bfloat16"`` for families whose activations outgrow float16's range (65504).
    """

    arch: str = ""
    gguf_rope_style: str = "neox"
    gguf_norm_topk_prob: bool | None = None
    qk_norm_full: bool = False
    act: str | None = None
    gpu_dtype: str = "float16"

    def configure(self, spec: ModelSpec, model_format: str, tensor_names: set[str]) -> ModelSpec:
        """Return the spec this family runs with (a copy; the loader's spec is not mutated)."""
        upd: dict = {}
        if model_format == "gguf":
            upd["rope_style"] = self.gguf_rope_style
            if self.gguf_norm_topk_prob is not None and spec.is_moe:
                upd["norm_topk_prob"] = self.gguf_norm_topk_prob
        if self.act:
            upd["act"] = self.act
        upd["qk_norm"] = "blk.0.attn_q_norm.weight" in tensor_names
        upd["qk_norm_full"] = self.qk_norm_full
        upd["post_norms"] = "blk.0.post_attention_norm.weight" in tensor_names or spec.post_norms
        upd["attn_bias"] = "blk.0.attn_q.bias" in tensor_names
        upd["tie_embeddings"] = "output.weight" not in tensor_names
        return dataclasses.replace(spec, **upd)


FAMILIES: dict[str, type[Family]] = {}


def register_family(arch: str) -> Callable[[type[Family]], type[Family]]:
    """Class decorator registering a :class:`Family` for GGUF architecture ``arch``."""

    def deco(cls: type[Family]) -> type[Family]:
        cls.arch = arch
        FAMILIES[arch] = cls
        return cls

    return deco


def get_family(arch: str) -> Family:
    """The registered family of ``arch``.

    Raises:
        UnsupportedModelError: no family registered for ``arch``.
    """
    if arch not in FAMILIES:
        raise UnsupportedModelError(
            f"architecture {arch!r} is not supported; supported: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[arch]()
