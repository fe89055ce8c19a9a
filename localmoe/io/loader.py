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
from localmoe.io.gguf_file import _SPLIT_RE, GGUFModelFile
from localmoe.io.hf import HFModelFile
from localmoe.io.model_file import ModelFile

__all__ = ["open_model"]


def _gguf_models(files: list[Path]) -> list[Path]:
    """The models among ``files`` (sorted .gguf paths): each plain file, and the first shard of
    each split set (``NAME-0000k-of-0000n.gguf``)."""
    out, sets = [], set()
    for f in files:
        m = _SPLIT_RE.match(f.name)
        if m is None:
            out.append(f)
        elif m.group("prefix") not in sets:
            sets.add(m.group("prefix"))
            out.append(f)
    return out


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
        ggufs = sorted(q for q in p.glob("*.gguf") if q.is_file())  # not a dir named x.gguf
        models = _gguf_models(ggufs)  # a split set is one model (its first shard)
        if len(models) == 1:
            return GGUFModelFile(models[0])
        if not models:
            raise ModelLoadError(f"{p} is a directory without config.json or .gguf files; give "
                                 f"a .gguf file or an HF model folder")
        shown = ", ".join(m.name for m in models[:8])
        more = f" and {len(models) - 8} more" if len(models) > 8 else ""
        # the example is the largest file (a 0-byte leftover sorts first as often as not);
        # the path alone, since `info` takes it as an argument and the others after -m
        example = max(models, key=lambda m: m.stat().st_size)
        raise ModelLoadError(f"{p} holds {len(models)} GGUF models: {shown}{more}; give the "
                             f"path of one of them, e.g. {example}")
    if not p.exists():
        # maybe a split name given as prefix.gguf
        raise ModelLoadError(f"model file not found: {p}")
    return GGUFModelFile(p)
