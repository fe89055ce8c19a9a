"""Model file loading: GGUF (single file or split shards) and HF safetensors directories.

``open_model(path) -> ModelFile`` is the one entry point. For GGUF the container is parsed here
(format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md; type ids, block sizes and key
names come from the ``gguf`` package of the llama.cpp project), the file is memory-mapped and
tensors stay in their quantized block format until :meth:`ModelFile.load_tensor` dequantizes one.

Why not ``gguf.GGUFReader``: it builds one numpy array per string of the tokenizer arrays (12 s
for SmolLM2, 40 s for Gemma-3 on a 2-core box) and fails with bare ``ValueError``/``IndexError``
that name no tensor. This parser reads the header with bounds checks (every length is checked
against the bytes left in the file before anything is allocated), then validates every tensor
(known type id, row size a multiple of the block size, data inside the file) and the split set
before a single weight is touched.

Tensor shapes are given in **torch order** (GGUF ``ne`` reversed): ``attn_q.weight`` is
``[n_heads*head_dim, d_model]``, ``ffn_gate_exps.weight`` is ``[n_experts, d_ff_expert, d_model]``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
import math
import mmap
import os
import re
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from localmoe.errors import ModelLoadError, UnsupportedModelError
from localmoe.model.spec import ModelSpec

__all__ = [
    "open_model",
    "ModelFile",
    "GGUFModelFile",
    "TensorInfo",
    "RawTensor",
    "spec_from_gguf_metadata",
    "SUPPORTED_ARCHS",
    "qtype_name",
]

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "olmoe", "gemma3")

# GGUF metadata value types (gguf.md): id -> (struct format, size)
_SCALAR = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
_NP_SCALAR = {
    0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
    6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64,
}
_T_STRING, _T_ARRAY = 8, 9

_SPLIT_RE = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def _quant_sizes() -> dict[int, tuple[int, int, str]]:
    """ggml type id -> (values per block, bytes per block, name), from the gguf package."""
    import gguf

    out = {}
    for t, (bs, ts) in gguf.GGML_QUANT_SIZES.items():
        out[int(t)] = (int(bs), int(ts), t.name)
    return out


_QSIZES: dict[int, tuple[int, int, str]] = _quant_sizes()


def qtype_name(qtype: int) -> str:
    """Name of ggml type id ``qtype`` (``"Q4_K"``), or ``"unknown"``."""
    s = _QSIZES.get(int(qtype))
    return s[2] if s else "unknown"


def _supported_qtypes() -> set[int]:
    try:
        from localmoe.io.dequant import SUPPORTED_QTYPES

        return set(int(q) for q in SUPPORTED_QTYPES)
    except Exception:  # pragma: no cover - dequant module not there yet
        return {0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30}


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


@dataclass
class _GGUFTensor:
    name: str
    qtype: int
    ne: tuple[int, ...]          # ggml order (ne0 fastest)
    offset: int                  # absolute byte offset in its shard
    nbytes: int
    shard: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))


class _Header:
    """Parsed GGUF header of one file (metadata, tensor infos, data offset)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.size = path.stat().st_size
        except FileNotFoundError:
            raise ModelLoadError(f"model file not found: {path}") from None
        except OSError as e:
            raise ModelLoadError(f"cannot read model file {path}: {e}") from None
        if self.size == 0:
            raise ModelLoadError(f"{path} is empty (0 bytes): the download or copy did not complete; fetch the file again")
        if self.size < 24:
            raise ModelLoadError(
                f"{path} is only {self.size} bytes, too small to be a GGUF file; fetch the file again"
            )
        try:
            fh = open(path, "rb")
        except OSError as e:
            raise ModelLoadError(f"cannot open model file {path}: {e}") from None
        try:
            self.mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        finally:
            fh.close()
        self.pos = 0
        self.metadata: dict[str, Any] = {}
        self.tensors: list[_GGUFTensor] = []
        try:
            self._parse()
        except ModelLoadError:
            self.close()
            raise

    def close(self) -> None:
        try:
            self.mm.close()
        except (BufferError, ValueError):
            pass  # numpy views still alive: the mapping goes away with them

    # --- bounded readers -------------------------------------------------------------------
    def _need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise ModelLoadError(
                f"{self.path.name}: file ends inside the header while reading {what} "
                f"(needs {n} bytes at offset {self.pos}, file is {self.size} bytes): the file is "
                f"truncated or corrupt; download it again"
            )

    def _scalar(self, vtype: int, what: str):
        fmt, n = _SCALAR[vtype]
        self._need(n, what)
        v = struct.unpack_from(fmt, self.mm, self.pos)[0]
        self.pos += n
        return v

    def _string(self, what: str, as_bytes: bool = False):
        n = self._scalar(10, what)
        self._need(n, what)
        b = self.mm[self.pos:self.pos + n]
        self.pos += n
        if as_bytes:
            return b
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return b.decode("utf-8", errors="surrogateescape")

    def _value(self, vtype: int, key: str):
        if vtype in _SCALAR:
            return self._scalar(vtype, f"value of key {key!r}")
        if vtype == _T_STRING:
            return self._string(f"string value of key {key!r}")
        if vtype == _T_ARRAY:
            etype = self._scalar(4, f"array type of key {key!r}")
            count = self._scalar(10, f"array length of key {key!r}")
            if etype in _NP_SCALAR:
                isz = _SCALAR[etype][1]
                if count * isz > self.size - self.pos:
                    self._need(count * isz, f"array of key {key!r} ({count} items)")
                arr = np.frombuffer(self.mm, dtype=np.dtype(_NP_SCALAR[etype]).newbyteorder("<"),
                                    count=count, offset=self.pos)
                self.pos += count * isz
                return arr.tolist()
            if etype == _T_STRING:
                # every string takes at least its 8-byte length: bound count before looping
                if count * 8 > self.size - self.pos:
                    self._need(count * 8, f"string array of key {key!r} ({count} items)")
                return self._string_array(count, key)
            if etype == _T_ARRAY:
                if count > self.size - self.pos:
                    self._need(count, f"nested array of key {key!r}")
                return [self._value(_T_ARRAY, key) for _ in range(count)]
            raise ModelLoadError(
                f"{self.path.name}: key {key!r} is an array of unknown value type {etype}; the file "
                f"is corrupt or from a newer GGUF version"
            )
        raise ModelLoadError(
            f"{self.path.name}: key {key!r} has unknown value type {vtype}; the file is corrupt or "
            f"from a newer GGUF version"
        )

    def _string_array(self, count: int, key: str) -> list[str]:
        mm, size, pos = self.mm, self.size, self.pos
        unpack = struct.Struct("<Q").unpack_from
        out = []
        append = out.append
        for _ in range(count):
            if pos + 8 > size:
                self.pos = pos
                self._need(8, f"string array of key {key!r}")
            n = unpack(mm, pos)[0]
            pos += 8
            if pos + n > size:
                self.pos = pos
                self._need(n, f"string array of key {key!r}")
            b = mm[pos:pos + n]
            pos += n
            try:
                append(b.decode("utf-8"))
            except UnicodeDecodeError:
                append(b.decode("utf-8", errors="surrogateescape"))
        self.pos = pos
        return out

    # --- header ---------------------------------------------------------------------------
    def _parse(self) -> None:
        name = self.path.name
        magic = bytes(self.mm[0:4])
        if magic != GGUF_MAGIC:
            head = bytes(self.mm[0:64])
            hint = ""
            low = head.lstrip().lower()
            if low.startswith((b"<!doctype", b"<html", b"<?xml", b"<")):
                hint = " It looks like an HTML/XML page (an error or login page saved instead of the model)."
            elif head.startswith(b"version https://git-lfs"):
                hint = " It is a git-lfs pointer, not the model; run `git lfs pull` or download the file itself."
            elif head.startswith(b"{"):
                hint = " It looks like JSON text."
            raise ModelLoadError(
                f"{name} is not a GGUF file: it starts with {head[:8]!r}, expected b'GGUF'.{hint} "
                f"Download the .gguf file again (or pass an HF model directory)."
            )
        self.pos = 4
        version = self._scalar(4, "version")
        if version not in SUPPORTED_VERSIONS:
            extra = " (byte-swapped: a big-endian GGUF file)" if version & 0xFFFF == 0 else ""
            raise UnsupportedModelError(
                f"{name}: GGUF version {version}{extra} is not supported (supported: 2, 3); "
                f"re-convert the model with a current llama.cpp"
            )
        self.version = version
        n_tensors = self._scalar(10, "tensor count")
        n_kv = self._scalar(10, "metadata count")
        # each kv needs >= 8+1+4+1 bytes, each tensor info >= 8+4+8+4+8: reject absurd counts early
        if n_kv * 13 > self.size or n_tensors * 32 > self.size:
            raise ModelLoadError(
                f"{name}: header claims {n_tensors} tensors and {n_kv} metadata keys, which cannot "
                f"fit in a {self.size}-byte file: the file is truncated or corrupt; download it again"
            )
        for _ in range(n_kv):
            key = self._string("metadata key")
            vtype = self._scalar(4, f"value type of key {key!r}")
            if key in self.metadata:
                raise ModelLoadError(f"{name}: metadata key {key!r} appears twice; the file is corrupt")
            self.metadata[key] = self._value(vtype, key)
        infos = []
        for i in range(n_tensors):
            tname = self._string(f"name of tensor #{i}")
            n_dims = self._scalar(4, f"n_dims of tensor {tname!r}")
            if n_dims < 1 or n_dims > 4:
                raise ModelLoadError(
                    f"{name}: tensor {tname!r} has {n_dims} dimensions (GGUF allows 1..4): the file is corrupt"
                )
            self._need(8 * n_dims, f"dims of tensor {tname!r}")
            ne = struct.unpack_from(f"<{n_dims}Q", self.mm, self.pos)
            self.pos += 8 * n_dims
            qtype = self._scalar(4, f"type of tensor {tname!r}")
            off = self._scalar(10, f"offset of tensor {tname!r}")
            infos.append((tname, tuple(int(x) for x in ne), qtype, off))
        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise ModelLoadError(
                f"{name}: general.alignment = {align!r} is not a power of two; the file is corrupt"
            )
        self.alignment = align
        self.data_offset = (self.pos + align - 1) // align * align
        seen = set()
        for tname, ne, qtype, off in infos:
            if tname in seen:
                raise ModelLoadError(f"{name}: tensor {tname!r} appears twice; the file is corrupt")
            seen.add(tname)
            q = _QSIZES.get(qtype)
            if q is None:
                raise ModelLoadError(
                    f"{name}: tensor {tname!r} has unknown ggml type id {qtype}; the file is corrupt "
                    f"or uses a format newer than this localmoe/gguf package knows (upgrade gguf)"
                )
            bs, ts, qn = q
            if any(d <= 0 for d in ne):
                raise ModelLoadError(f"{name}: tensor {tname!r} has dimension {list(ne)} with a zero/negative size")
            if ne[0] % bs:
                raise ModelLoadError(
                    f"{name}: tensor {tname!r} ({qn}) has row size {ne[0]}, not a multiple of the "
                    f"{qn} block size {bs}; the file is corrupt"
                )
            nel = math.prod(ne)
            nbytes = nel // bs * ts
            start = self.data_offset + off
            if off % align:
                raise ModelLoadError(
                    f"{name}: tensor {tname!r} data offset {off} is not aligned to {align}; the file is corrupt"
                )
            if start + nbytes > self.size:
                raise ModelLoadError(
                    f"{name}: tensor {tname!r} ({qn}, {nbytes} bytes at offset {start}) extends past the "
                    f"end of the file ({self.size} bytes): the file is truncated (incomplete download); "
                    f"download it again"
                )
            self.tensors.append(_GGUFTensor(tname, qtype, ne, start, nbytes, 0))


class ModelFile(ABC):
    """A model opened from disk (base class; see :func:`open_model`).

    Attributes:
        path: the file (GGUF: the path given, any shard) or directory (HF).
        format: ``"gguf"`` or ``"safetensors"``.
        spec: :class:`~localmoe.model.spec.ModelSpec` read from metadata / config.json.
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


class GGUFModelFile(ModelFile):
    """A GGUF model, single file or split set, memory-mapped (read-only).

    Tensors are read lazily; :meth:`load_tensor` dequantizes one tensor into a new torch tensor,
    :meth:`raw_tensor` returns its block bytes as a zero-copy view.

    Raises (from the constructor): ``ModelLoadError`` for missing/truncated/corrupt files, missing
    shards, inconsistent split metadata, missing required keys; ``UnsupportedModelError`` for an
    unsupported architecture, GGUF version or tensor type (the message names the tensor, the type
    name and id).
    """

    format = "gguf"

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._headers: list[_Header] = []
        try:
            self._open()
        except ModelLoadError:
            self.close()
            raise
        except (ValueError, TypeError, KeyError, IndexError, OverflowError, struct.error, UnicodeError) as e:
            # safety net: a corrupt header must never surface as a bare traceback
            self.close()
            raise ModelLoadError(
                f"{self.path.name}: the file is corrupt ({type(e).__name__}: {e}); download it again"
            ) from e
        except OSError as e:
            self.close()
            raise ModelLoadError(f"cannot read {self.path}: {e}") from e

    def _open(self) -> None:
        p = self.path
        m = _SPLIT_RE.match(p.name)
        if m:
            count = int(m.group("count"))
            prefix = m.group("prefix")
            if count < 1:
                raise ModelLoadError(f"{p.name}: split file name says -of-{count:05d}; rename or re-download it")
            paths = [p.with_name(f"{prefix}-{i + 1:05d}-of-{count:05d}.gguf") for i in range(count)]
            missing = [q.name for q in paths if not q.is_file()]
            if missing:
                raise ModelLoadError(
                    f"split model {prefix} has {count} shards but {len(missing)} missing from "
                    f"{p.parent}: {', '.join(missing)}; download every shard into the same folder"
                )
        else:
            paths = [p]
        if not p.exists():
            raise ModelLoadError(f"model file not found: {p}")
        if p.is_dir():
            raise ModelLoadError(f"{p} is a directory; open_model() takes HF directories only when they hold config.json")
        for q in paths:
            self._headers.append(_Header(q))
        h0 = self._headers[0]
        md = h0.metadata
        self.metadata = dict(md)
        n_split = md.get("split.count")
        if len(paths) > 1 or (n_split is not None and int(n_split) > 1):
            self._check_split(paths)
        tensors: dict[str, _GGUFTensor] = {}
        for si, h in enumerate(self._headers):
            for t in h.tensors:
                if t.name in tensors:
                    raise ModelLoadError(
                        f"tensor {t.name!r} appears in both shard {tensors[t.name].shard + 1} and shard "
                        f"{si + 1}; the split set is inconsistent (mixed downloads?)"
                    )
                t.shard = si
                tensors[t.name] = t
        self._tensors = tensors
        supported = _supported_qtypes()
        for t in tensors.values():
            if t.qtype not in supported:
                raise UnsupportedModelError(
                    f"tensor {t.name!r} uses quant type {qtype_name(t.qtype)} (ggml type id {t.qtype}), "
                    f"which localmoe does not run; supported types: "
                    f"{', '.join(sorted(qtype_name(q) for q in supported))}. Use a file quantized to one "
                    f"of these (e.g. Q4_K_M, Q8_0)"
                )
        self._legacy_experts = self._find_legacy_experts()
        self.spec = spec_from_gguf_metadata(self.metadata, self)
        self.name = str(md.get("general.name") or self.spec.name or p.stem)
        if not self.spec.name:
            self.spec.name = self.name

    def _check_split(self, paths: list[Path]) -> None:
        count = len(paths)
        total = 0
        for i, h in enumerate(self._headers):
            md = h.metadata
            sc = md.get("split.count")
            sn = md.get("split.no")
            if sc is None or sn is None:
                raise ModelLoadError(
                    f"{h.path.name}: part of a {count}-shard set by its name but has no split.count / "
                    f"split.no metadata; the shard is not a llama.cpp split file or is corrupt"
                )
            if int(sc) != count:
                raise ModelLoadError(
                    f"{h.path.name}: split.count = {sc} but the file name says {count} shards; the "
                    f"shards come from different splits; download a consistent set"
                )
            if int(sn) != i:
                raise ModelLoadError(
                    f"{h.path.name}: split.no = {sn} but it is shard {i + 1} of {count} by name "
                    f"(expected split.no = {i}); rename the shards or download them again"
                )
            total += len(h.tensors)
        declared = self._headers[0].metadata.get("split.tensors.count")
        if declared is not None and int(declared) != total:
            raise ModelLoadError(
                f"split set {paths[0].name}: split.tensors.count = {declared} but the {count} shards hold "
                f"{total} tensors; a shard is from a different split; download a consistent set"
            )

    def _find_legacy_experts(self) -> dict[str, list[str]]:
        """Old Mixtral files: blk.N.ffn_{gate,up,down}.E.weight -> virtual stacked *_exps tensor."""
        pat = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")
        groups: dict[str, dict[int, str]] = {}
        for n in self._tensors:
            m = pat.match(n)
            if m:
                groups.setdefault(f"blk.{m.group(1)}.ffn_{m.group(2)}_exps.weight", {})[int(m.group(3))] = n
        out = {}
        for vname, d in groups.items():
            n_e = len(d)
            if sorted(d) != list(range(n_e)):
                raise ModelLoadError(f"per-expert tensors of {vname} are not numbered 0..{n_e - 1}: {sorted(d)}")
            parts = [d[e] for e in range(n_e)]
            t0 = self._tensors[parts[0]]
            for pn in parts:
                t = self._tensors[pn]
                if t.qtype != t0.qtype or t.ne != t0.ne:
                    raise ModelLoadError(f"per-expert tensor {pn} differs in type/shape from {parts[0]}")
            out[vname] = parts
        return out

    # --- public API -----------------------------------------------------------------------
    def tensor_names(self) -> list[str]:
        """Canonical GGUF tensor names (legacy per-expert tensors listed as stacked ``*_exps``)."""
        legacy = {p for parts in self._legacy_experts.values() for p in parts}
        return [n for n in self._tensors if n not in legacy] + list(self._legacy_experts)

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors or name in self._legacy_experts

    def _get(self, name: str) -> _GGUFTensor:
        t = self._tensors.get(name)
        if t is None:
            raise ModelLoadError(
                f"{self.path.name}: tensor {name!r} not found in the file (arch {self.spec.arch if hasattr(self, 'spec') else '?'}); "
                f"the file is incomplete or for a different architecture"
            )
        return t

    def tensor_info(self, name: str) -> TensorInfo:
        """Type, torch-order shape and byte size of tensor ``name``. Raises ``ModelLoadError`` if absent."""
        if name in self._legacy_experts:
            parts = [self._tensors[p] for p in self._legacy_experts[name]]
            t0 = parts[0]
            return TensorInfo(name, qtype_name(t0.qtype), (len(parts),) + t0.shape, sum(t.nbytes for t in parts))
        t = self._get(name)
        return TensorInfo(name, qtype_name(t.qtype), t.shape, t.nbytes)

    def _bytes(self, t: _GGUFTensor) -> np.ndarray:
        h = self._headers[t.shard]
        return np.frombuffer(h.mm, dtype=np.uint8, count=t.nbytes, offset=t.offset)

    def raw_tensor(self, name: str) -> RawTensor:
        """Block bytes of tensor ``name`` (see :class:`RawTensor`); zero-copy except for legacy
        per-expert Mixtral tensors, which are stacked into a new array."""
        if name in self._legacy_experts:
            parts = [self._tensors[p] for p in self._legacy_experts[name]]
            data = np.stack([self._bytes(t) for t in parts])
            t0 = parts[0]
            shape = (len(parts),) + t0.shape
            bs, ts, _ = _QSIZES[t0.qtype]
            return RawTensor(t0.qtype, shape, data.reshape(*shape[:-1], shape[-1] // bs * ts))
        t = self._get(name)
        bs, ts, _ = _QSIZES[t.qtype]
        shape = t.shape
        return RawTensor(t.qtype, shape, self._bytes(t).reshape(*shape[:-1], shape[-1] // bs * ts))

    def load_tensor(self, name: str, dtype=None, device="cpu"):
        """Dequantize tensor ``name`` into a new torch tensor.

        Args:
            name: canonical GGUF name.
            dtype: torch dtype of the result (default ``torch.float32``).
            device: torch device of the result.
        Returns:
            ``torch.Tensor`` of torch-order shape (see :class:`TensorInfo`).
        Raises:
            ModelLoadError: no such tensor. UnsupportedModelError: its block type is not supported.
        """
        import torch

        from localmoe.io.dequant import dequantize

        dtype = dtype or torch.float32
        raw = self.raw_tensor(name)
        # zero-copy view of the read-only mapping: dequantize() only reads its input (torch warns
        # about non-writable arrays, which is the point here, so the warning is silenced)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(np.ascontiguousarray(raw.data))
        dev = torch.device(device)
        if dev.type != "cpu":
            data = data.to(dev)
        try:
            out = dequantize(data, raw.qtype, raw.shape)
        except UnsupportedModelError as e:
            raise UnsupportedModelError(f"tensor {name!r}: {e}") from None
        return out.to(dtype) if out.dtype != dtype else out

    def close(self) -> None:
        for h in self._headers:
            h.close()
        self._headers = []


# ---------------------------------------------------------------------------------------------
# ModelSpec from GGUF metadata
# ---------------------------------------------------------------------------------------------

# per-arch facts llama.cpp hard-codes (src/llama-model.cpp build_* functions)
_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(rope_style="norm", norm_topk_prob=True),           # Mixtral: softmax over top-k
    "qwen2": dict(rope_style="neox", attn_bias=True),
    "qwen3": dict(rope_style="neox", qk_norm=True),
    "qwen2moe": dict(rope_style="neox", attn_bias=True, norm_topk_prob=False),
    "qwen3moe": dict(rope_style="neox", qk_norm=True, norm_topk_prob=True),
    "olmoe": dict(rope_style="neox", qk_norm=True, qk_norm_full=True, norm_topk_prob=False),
    "gemma3": dict(rope_style="neox", qk_norm=True, act="gelu_tanh", post_norms=True,
                   sliding_window_pattern=6, rope_base_local=10000.0),
}


def _req(md: dict[str, Any], key: str) -> Any:
    if key not in md:
        raise ModelLoadError(
            f"required metadata key {key!r} is missing; the file is incomplete or was written by a "
            f"converter localmoe does not understand; re-convert it with a current llama.cpp"
        )
    return md[key]


_BLK_RE = re.compile(r"blk\.(\d+)\.")


def _pos_int(md: dict[str, Any], key: str, required: bool = True, default: int = 0) -> int:
    v = _req(md, key) if required else md.get(key, default)
    if isinstance(v, list):  # per-layer arrays (e.g. head_count_kv): must be uniform here
        vals = set(v)
        if len(vals) != 1:
            raise UnsupportedModelError(
                f"metadata {key!r} varies per layer ({sorted(vals)[:6]}...); per-layer values are not supported"
            )
        v = v[0]
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ModelLoadError(f"metadata {key!r} = {v!r} is not a non-negative integer; the file is corrupt")
    if required and v == 0:
        raise ModelLoadError(f"metadata {key!r} = 0; the file is corrupt")
    return v


def _num(md: dict[str, Any], key: str, default: float) -> float:
    v = md.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ModelLoadError(f"metadata {key!r} = {v!r} is not a finite number; the file is corrupt")
    return float(v)


def spec_from_gguf_metadata(md: dict[str, Any], model: GGUFModelFile | None = None) -> ModelSpec:
    """Build a :class:`ModelSpec` from GGUF metadata (+ tensor presence when ``model`` is given).

    Keys: ``{arch}.block_count, embedding_length, feed_forward_length, attention.head_count[_kv],
    attention.key_length/value_length, rope.*, expert_*`` (llama.cpp ``llama-arch.cpp``). The
    rope style, q/k-norm flavour and top-k renormalization are per-architecture facts from
    llama.cpp's ``llama-model.cpp``; ``expert_weights_norm`` / ``expert_gating_func`` in the file
    override the defaults.

    Raises:
        UnsupportedModelError: architecture not in :data:`SUPPORTED_ARCHS`.
        ModelLoadError: a required key is missing or inconsistent (e.g. ``expert_used_count >
            expert_count``).
    """
    arch = _req(md, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(
            f"architecture {arch!r} (general.architecture) is not supported; localmoe runs: "
            f"{', '.join(SUPPORTED_ARCHS)}"
        )
    a = arch + "."
    d = dict(_ARCH_DEFAULTS[arch])
    n_layers = _pos_int(md, a + "block_count")
    d_model = _pos_int(md, a + "embedding_length")
    n_heads = _pos_int(md, a + "attention.head_count")
    n_kv = _pos_int(md, a + "attention.head_count_kv", required=False, default=n_heads) or n_heads
    if n_heads % n_kv:
        raise ModelLoadError(
            f"{a}attention.head_count = {n_heads} is not a multiple of head_count_kv = {n_kv}; the file is corrupt"
        )
    head_dim = _pos_int(md, a + "attention.key_length", required=False, default=0) or d_model // n_heads
    head_dim_v = _pos_int(md, a + "attention.value_length", required=False, default=0) or head_dim
    tokens = md.get("tokenizer.ggml.tokens")
    vocab = md.get(a + "vocab_size")
    if vocab is None and model is not None and model.has_tensor("token_embd.weight"):
        vocab = model.tensor_info("token_embd.weight").shape[0]
    if vocab is None and isinstance(tokens, list):
        vocab = len(tokens)
    if vocab is None:
        raise ModelLoadError(f"cannot tell the vocabulary size: no {a}vocab_size, token_embd.weight or tokenizer.ggml.tokens")
    if model is not None:
        # a corrupt block_count must not drive per-layer loops (or allocations) past the file
        blocks = {int(m.group(1)) for m in map(_BLK_RE.match, model.tensor_names()) if m}
        n_blocks = max(blocks) + 1 if blocks else 0
        if n_layers > n_blocks:
            raise ModelLoadError(
                f"metadata {a}block_count = {n_layers} but the file has tensors for {n_blocks} "
                f"blocks; the file is corrupt or incomplete (re-download it)")
    spec = ModelSpec(
        arch=arch,
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        head_dim_v=head_dim_v if head_dim_v != head_dim else None,
        vocab_size=int(vocab),
        d_ff=_pos_int(md, a + "feed_forward_length", required=False, default=0),
        n_ctx_train=_pos_int(md, a + "context_length", required=False, default=2048) or 2048,
        norm_eps=_num(md, a + "attention.layer_norm_rms_epsilon", _num(md, a + "attention.layer_norm_epsilon", 1e-5)),
        norm_type="rms" if (a + "attention.layer_norm_epsilon") not in md or (a + "attention.layer_norm_rms_epsilon") in md else "layer",
        rope_base=_num(md, a + "rope.freq_base", 10000.0),
        name=str(md.get("general.name", "")),
    )
    for k, v in d.items():
        setattr(spec, k, v)
    rd = md.get(a + "rope.dimension_count")
    if rd is not None and int(rd) != head_dim:
        spec.rope_dim = int(rd)
    # rope scaling
    rs: dict[str, Any] = {}
    st = md.get(a + "rope.scaling.type")
    if st and st != "none":
        rs["type"] = st
        for k in ("factor", "original_context_length", "attn_factor", "yarn_log_multiplier",
                  "yarn_ext_factor", "yarn_attn_factor", "yarn_beta_fast", "yarn_beta_slow"):
            if a + "rope.scaling." + k in md:
                rs[k] = md[a + "rope.scaling." + k]
    spec.rope_scaling = rs
    if a + "rope.freq_base_swa" in md:
        spec.rope_base_local = _num(md, a + "rope.freq_base_swa", 10000.0)
    sw = md.get(a + "attention.sliding_window")
    if arch == "gemma3":
        # llama.cpp models/gemma3.cpp: SWA only when the key is present and > 0; pattern default 6
        spec.embed_scale = math.sqrt(d_model)
        spec.sliding_window = int(sw) if isinstance(sw, int) and sw > 0 else None
        pat = md.get(a + "attention.sliding_window_pattern")
        if spec.sliding_window is None:
            spec.sliding_window_pattern = None
        elif isinstance(pat, int) and pat > 0:
            spec.sliding_window_pattern = pat
        elif isinstance(pat, list) and pat:
            # per-layer flags (True = sliding): must be "N-1 sliding, then 1 global", repeated
            n = next((i + 1 for i, v in enumerate(pat) if not v), None)
            if n is None or any(bool(v) != ((i + 1) % n != 0) for i, v in enumerate(pat)):
                raise UnsupportedModelError(
                    f"{a}attention.sliding_window_pattern {pat[:12]}... is not periodic; not supported"
                )
            spec.sliding_window_pattern = n
    for key, field_ in (("attn_logit_softcapping", "attn_logit_softcap"), ("final_logit_softcapping", "final_logit_softcap")):
        if md.get(a + key):
            setattr(spec, field_, _num(md, a + key, 0.0))
    if md.get(a + "attention.scale"):
        spec.attn_scale = _num(md, a + "attention.scale", 0.0)
    # MoE
    n_exp = _pos_int(md, a + "expert_count", required=False, default=0)
    if n_exp:
        top_k = _pos_int(md, a + "expert_used_count", required=False, default=0)
        if top_k == 0:
            raise ModelLoadError(f"{a}expert_count = {n_exp} but {a}expert_used_count is missing or 0; the file is corrupt")
        if top_k > n_exp:
            raise ModelLoadError(
                f"{a}expert_used_count = {top_k} exceeds {a}expert_count = {n_exp}; the file's metadata "
                f"is corrupt; re-convert it"
            )
        spec.n_experts, spec.top_k = n_exp, top_k
        dfe = _pos_int(md, a + "expert_feed_forward_length", required=False, default=0)
        if not dfe and model is not None:  # llama (Mixtral) and olmoe: size from the expert tensors
            for i in range(n_layers):
                nm = f"blk.{i}.ffn_up_exps.weight"
                if model.has_tensor(nm):
                    dfe = model.tensor_info(nm).shape[1]
                    break
        spec.d_ff_expert = dfe or spec.d_ff
        spec.leading_dense_layers = _pos_int(md, a + "leading_dense_block_count", required=False, default=0)
        if arch == "llama":
            # Mixtral files have no dense FFN
            spec.d_ff = spec.d_ff if spec.leading_dense_layers else 0
        n_sh = _pos_int(md, a + "expert_shared_count", required=False, default=0)
        d_sh = _pos_int(md, a + "expert_shared_feed_forward_length", required=False, default=0)
        has_shexp = model is not None and any(
            model.has_tensor(f"blk.{i}.ffn_up_shexp.weight") for i in range(n_layers))
        if has_shexp and model is not None:
            for i in range(n_layers):
                nm = f"blk.{i}.ffn_up_shexp.weight"
                if model.has_tensor(nm):
                    d_sh = d_sh or model.tensor_info(nm).shape[0]
                    break
            n_sh = n_sh or 1
        spec.n_shared_experts = n_sh if (d_sh or has_shexp) else 0
        spec.d_ff_shared = d_sh if spec.n_shared_experts else 0
        if model is not None:
            spec.shared_expert_gate = any(model.has_tensor(f"blk.{i}.ffn_gate_inp_shexp.weight") for i in range(n_layers))
        else:
            spec.shared_expert_gate = arch == "qwen2moe" and spec.n_shared_experts > 0
        g = md.get(a + "expert_gating_func")
        if g is not None:
            if int(g) == 1:
                spec.gating = "softmax"
            elif int(g) == 2:
                spec.gating = "sigmoid"
            else:
                raise UnsupportedModelError(f"{a}expert_gating_func = {g} is not supported (1 softmax, 2 sigmoid)")
        if a + "expert_weights_norm" in md:
            spec.norm_topk_prob = bool(md[a + "expert_weights_norm"])
        if md.get(a + "expert_weights_scale"):
            spec.expert_weights_scale = _num(md, a + "expert_weights_scale", 1.0)
    else:
        spec.norm_topk_prob = False
        if model is not None and any(n.endswith("ffn_gate_exps.weight") for n in model.tensor_names()):
            raise ModelLoadError(f"the file has expert tensors but no {a}expert_count; re-convert it")
    if model is not None:
        spec.tie_embeddings = not model.has_tensor("output.weight")
        if not model.has_tensor("token_embd.weight"):
            raise ModelLoadError("tensor 'token_embd.weight' is missing; the file is incomplete")
        if arch in ("qwen2", "qwen2moe"):
            spec.attn_bias = model.has_tensor("blk.0.attn_q.bias")
        if arch in ("qwen3", "qwen3moe", "olmoe", "gemma3"):
            spec.qk_norm = model.has_tensor("blk.0.attn_q_norm.weight")
            if arch == "olmoe" and spec.qk_norm:
                # olmoe's q norm spans the whole projection (n_heads*head_dim)
                spec.qk_norm_full = model.tensor_info("blk.0.attn_q_norm.weight").shape[0] == n_heads * head_dim
        if arch == "llama" and model.has_tensor("blk.0.attn_q_norm.weight"):
            spec.qk_norm = True
    return spec


# ---------------------------------------------------------------------------------------------


def open_model(path: str | os.PathLike) -> ModelFile:
    """Open a model for reading without loading weights.

    Args:
        path: a ``.gguf`` file (any shard ``*-0000k-of-0000n.gguf`` of a split set opens the whole
            set) or an HF directory holding ``config.json`` and ``*.safetensors`` (+ index).
    Returns:
        :class:`ModelFile` (``GGUFModelFile`` or ``hf_loader.HFModelFile``).
    Raises:
        ModelLoadError: missing, empty, truncated or corrupt file; missing shard; inconsistent
            split metadata; a missing required metadata key. The message names the file, key or
            tensor, the value found and what to do.
        UnsupportedModelError: valid file that localmoe cannot run (architecture, quant type).
    """
    p = Path(path).expanduser()
    if p.is_dir():
        if (p / "config.json").is_file():
            from localmoe.io.hf import HFModelFile

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
