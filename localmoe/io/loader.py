"""Model file loading: ``open_model(path) -> ModelFile`` is the one entry point.

A ``.gguf`` file (any shard of a split set) opens as
:class:`~localmoe.io.gguf_file.GGUFModelFile`, an HF directory (``config.json`` +
``*.safetensors``) as :class:`~localmoe.io.hf.HFModelFile`; both implement
:class:`~localmoe.io.model_file.ModelFile` (tensor shapes in torch order, GGUF tensor names).
"""

from __future__ import annotations

import os
from pathlib import Path

from localmoe.errors import ModelLoadError
from localmoe.io.gguf_file import GGUFModelFile
from localmoe.io.hf import HFModelFile
from localmoe.io.model_file import ModelFile

__all__ = ["open_model"]


def open_model(path: str | os.PathLike) -> ModelFile:
    """Open a model for reading without loading weights.

    Args:
        path: a ``.gguf`` file (any shard ``*-0000k-of-0000n.gguf`` of a split set opens the whole
            set) or an HF directory holding ``config.json`` and ``*.safetensors`` (+ index).
    Returns:
        :class:`ModelFile` (``GGUFModelFile`` or ``HFModelFile``).
    Raises:
        ModelLoadError: missing, empty, truncated or corrupt file; missing shard; inconsistent
            split metadata; a missing required metadata key. The message names the file, key or
            tensor, the value found and what to do.
        UnsupportedModelError: valid file that localmoe cannot run (architecture, quant type).
    """
    p = Path(path).expanduser()
    if p.is_dir():
        if (p / "config.json").is_file():
            return HFModelFile(p)
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return GGUFModelFile(ggufs[0])
        raise ModelLoadError(
            f"{p} is a directory without config.json"
            + (f" and with {len(ggufs)} .gguf files; pass one of them" if ggufs else " or .gguf files")
        )
    if not p.exists():
        # maybe a split name given as prefix.gguf
        raise ModelLoadError(f"model file not found: {p}")
    return GGUFModelFile(p)
