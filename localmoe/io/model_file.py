"""The model-file interface every reader implements: :class:`ModelFile`, :class:`TensorInfo`,
:class:`RawTensor`.

Readers: :class:`localmoe.io.gguf_file.GGUFModelFile` (GGUF, single file or split set) and
:class:`localmoe.io.hf.HFModelFile` (HF safetensors directories); :func:`localmoe.io.loader.open_model`
picks one for a path.

Tensor shapes are given in **torch order** (GGUF ``ne`` reversed): ``attn_q.weight`` is
``[n_heads*head_dim, d_model]``, ``ffn_gate_exps.weight`` is ``[n_experts, d_ff_expert, d_model]``.
"""

from __future__ import annotations

import os
import stat
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localmoe.errors import ModelLoadError, UnsupportedModelError

if TYPE_CHECKING:
    import numpy as np

    from localmoe.io.spec import ModelSpec

__all__ = ["ModelFile", "TensorInfo", "RawTensor", "check_regular_file"]

_NOT_REGULAR = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"),
                (stat.S_ISDIR, "a directory"))


def check_regular_file(path: str | os.PathLike, st: os.stat_result | None = None) -> None:
    """Refuse a model path that is not a regular file (``/dev/zero``, a named pipe, ...)
    before it is read: a device reports 0 bytes (it is not an "empty download") and a pipe
    would block the reader.

    Args:
        path: the path (named in the message).
        st: its ``os.stat`` result, when the caller has it.

    Raises:
        ModelLoadError: ``"<path> is not a regular file (a character device); ..."``.
        OSError: ``path`` cannot be stat'ed (the caller reports that its own way).
    """
    mode = (st if st is not None else os.stat(path)).st_mode
    if stat.S_ISREG(mode):
        return
    kind = next((k for test, k in _NOT_REGULAR if test(mode)), "not a file")
    raise ModelLoadError(f"{path} is not a regular file ({kind}); give the path of a .gguf "
                         f"file or of an HF model folder")


@dataclass(frozen=True)
class TensorInfo:
    """Description of one tensor.

    Attributes:
        name: canonical (GGUF) name, e.g. ``blk.0.attn_q.weight``.
        qtype: storage type name: ``"F32"``, ``"F16"``, ``"BF16"``, ``"Q4_K"``, ...
        shape: torch-order shape (GGUF ``ne`` reversed), element counts.
        nbytes: bytes the tensor occupies in the file (its block data).
    """

    name: str
    qtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class RawTensor:
    """A tensor's bytes as stored in the GGUF file (zero-copy, read-only memmap view).

    Attributes:
        qtype: ggml type id (int; see ``gguf.GGMLQuantizationType``).
        shape: torch-order element shape, e.g. ``(n_experts, d_ff_expert, d_model)``.
        data: ``np.ndarray[uint8]`` of shape ``(*shape[:-1], row_bytes)`` where
            ``row_bytes = shape[-1] // block_values * block_bytes``; row-major, so expert ``e``
            of a stacked expert tensor is ``data[e]`` (contiguous).
    """

    qtype: int
    shape: tuple[int, ...]
    data: np.ndarray



class ModelFile(ABC):
    """A model opened from disk (base class; see :func:`open_model`).

    Attributes:
        path: the file (GGUF: the path given, any shard) or directory (HF).
        format: ``"gguf"`` or ``"safetensors"``.
        spec: :class:`~localmoe.io.spec.ModelSpec` read from metadata / config.json.
        name: display name (``general.name`` or file/dir stem).
        metadata: GGUF-style key -> python value dict (strings decoded, arrays as lists).
        chat_template: Jinja source of the default chat template, or None.
    """

    path: Path
    format: str
    spec: ModelSpec
    name: str
    metadata: dict[str, Any]

    @property
    def chat_template(self) -> str | None:
        t = self.metadata.get("tokenizer.chat_template")
        return t if isinstance(t, str) and t.strip() else None

    @abstractmethod
    def tensor_names(self) -> list[str]:
        """Canonical (GGUF) names of every tensor, in file order."""

    @abstractmethod
    def tensor_info(self, name: str) -> TensorInfo:
        """Type, torch-order shape and byte size of tensor ``name`` (KeyError if absent)."""

    def has_tensor(self, name: str) -> bool:
        """True when the model has a tensor with this canonical name."""
        return name in set(self.tensor_names())

    @abstractmethod
    def load_tensor(self, name: str, dtype=None, device="cpu"):
        """Tensor ``name`` dequantized to ``dtype`` (default float32) on ``device``."""

    def raw_tensor(self, name: str) -> RawTensor:
        raise UnsupportedModelError(
            f"raw quantized blocks are only available for GGUF files ({self.path} is {self.format}); "
            f"use load_tensor()"
        )

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.format} {self.spec.arch} {self.path}>"
