"""GGUF files (single file or split shards): :class:`GGUFModelFile`.

The container is parsed here (format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md;
type ids, block sizes and key names come from the ``gguf`` package of the llama.cpp project), the
file is memory-mapped and tensors stay in their quantized block format until
:meth:`GGUFModelFile.load_tensor` dequantizes one.

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
from localmoe.io.gguf_spec import spec_from_gguf_metadata
from localmoe.io.model_file import ModelFile, RawTensor, TensorInfo, check_regular_file
from localmoe.io.validate import (MAX_ARRAY_ITEMS, MAX_METADATA_DEPTH, check_gguf_metadata,
                                  check_tensor_shapes)

__all__ = ["GGUFModelFile", "check_gguf_size", "qtype_name"]

GGUF_MAGIC = b"GGUF"
#: bytes of a GGUF header's fixed part (magic, version, tensor and metadata counts)
GGUF_MIN_SIZE = 24


def check_gguf_size(path: str | os.PathLike, size: int) -> None:
    """Refuse a file too short to be a GGUF file before its magic is read, in the words
    every command uses (loading, ``info``, ``pull PATH``): empty (a download or copy that did
    not complete), or shorter than a GGUF header.

    Args:
        path: the file (named in the message).
        size: its size in bytes (``os.stat``).

    Raises:
        ModelLoadError: ``"<path> is empty (0 bytes): the download or copy did not complete;
            fetch the file again"`` or ``"<path> is only N bytes, too small to be a GGUF file;
            ..."``.
    """
    if size == 0:
        raise ModelLoadError(f"{path} is empty (0 bytes): the download or copy did not complete; fetch the file again")
    if size < GGUF_MIN_SIZE:
        raise ModelLoadError(
            f"{path} is only {size} bytes, too small to be a GGUF file; fetch the file again"
        )
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
#: tensors, and metadata keys, one file may declare (real models: a few thousand tensors)
MAX_HEADER_ITEMS = 1 << 16

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
            st = path.stat()
        except FileNotFoundError:
            raise ModelLoadError(f"model file not found: {path}") from None
        except OSError as e:
            raise ModelLoadError(f"cannot read model file {path}: {e}") from None
        check_regular_file(path, st)  # /dev/zero is no "empty download"; a FIFO would block
        self.size = st.st_size
        check_gguf_size(path, self.size)
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
        #: key -> index of the first string-array entry that is not valid UTF-8
        self.bad_utf8: dict[str, int] = {}
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
        # a single string (a name, a chat template): invalid bytes become U+FFFD, so the text
        # can always be printed, rendered and tokenized
        return b.decode("utf-8", errors="replace")

    def _value(self, vtype: int, key: str, depth: int = 0):
        if vtype in _SCALAR:
            return self._scalar(vtype, f"value of key {key!r}")
        if vtype == _T_STRING:
            return self._string(f"string value of key {key!r}")
        if vtype == _T_ARRAY:
            etype = self._scalar(4, f"array type of key {key!r}")
            count = self._scalar(10, f"array length of key {key!r}")
            if count > MAX_ARRAY_ITEMS:  # as Python objects: 10-60x the bytes in the file
                raise ModelLoadError(
                    f"{self.path.name}: key {key!r} is an array of {count:,} items, over the "
                    f"{MAX_ARRAY_ITEMS:,} limit (vocabularies hold under 1 M); the file is corrupt or hostile")
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
                if depth + 1 >= MAX_METADATA_DEPTH:
                    raise ModelLoadError(
                        f"{self.path.name}: key {key!r} nests arrays more than {MAX_METADATA_DEPTH} "
                        f"levels deep; the file is corrupt or hostile")
                if count > self.size - self.pos:
                    self._need(count, f"nested array of key {key!r}")
                return [self._value(_T_ARRAY, key, depth + 1) for _ in range(count)]
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
                self.bad_utf8.setdefault(key, len(out))
                append(b.decode("utf-8", errors="surrogateescape"))
        self.pos = pos
        return out

    # --- header ---------------------------------------------------------------------------
    def _parse(self) -> None:
        self._check_magic()
        self.pos = 4
        version = self._scalar(4, "version")
        if version not in SUPPORTED_VERSIONS:
            extra = " (byte-swapped: a big-endian GGUF file)" if version & 0xFFFF == 0 else ""
            if not extra and version > 255:   # no GGUF version has been near this: noise
                raise ModelLoadError(
                    f"{self.path.name}: the GGUF version field reads {version}: the file is "
                    "corrupt or not a GGUF model; download it again")
            raise UnsupportedModelError(
                f"{self.path.name}: GGUF version {version}{extra} is not supported (supported: 2, 3); "
                f"re-convert the model with a current llama.cpp"
            )
        self.version = version
        n_tensors = self._scalar(10, "tensor count")
        n_kv = self._scalar(10, "metadata count")
        # each kv needs >= 8+1+4+1 bytes, each tensor info >= 8+4+8+4+8: reject absurd counts early
        if n_kv * 13 > self.size or n_tensors * 32 > self.size:
            raise ModelLoadError(
                f"{self.path.name}: header claims {n_tensors} tensors and {n_kv} metadata keys, which cannot "
                f"fit in a {self.size}-byte file: the file is truncated or corrupt; download it again"
            )
        if n_kv > MAX_HEADER_ITEMS or n_tensors > MAX_HEADER_ITEMS:
            raise ModelLoadError(
                f"{self.path.name}: header claims {n_tensors:,} tensors and {n_kv:,} metadata keys, over "
                f"the {MAX_HEADER_ITEMS:,} limit (models hold a few thousand); the file is corrupt or hostile")
        self._read_metadata(n_kv)
        infos = self._read_tensor_infos(n_tensors)
        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise ModelLoadError(
                f"{self.path.name}: general.alignment = {align!r} is not a power of two; the file is corrupt"
            )
        self.alignment = align
        self.data_offset = (self.pos + align - 1) // align * align
        seen = set()
        for tname, ne, qtype, off in infos:
            if tname in seen:
                raise ModelLoadError(f"{self.path.name}: tensor {tname!r} appears twice; the file is corrupt")
            seen.add(tname)
            self.tensors.append(self._checked_tensor(tname, ne, qtype, off))

    def _check_magic(self) -> None:
        """The file starts with ``GGUF``; else say what it looks like instead."""
        magic = bytes(self.mm[0:4])
        if magic == GGUF_MAGIC:
            return
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
            f"{self.path} is not a GGUF file: it starts with {head[:8]!r}, expected b'GGUF'.{hint} "
            f"Download the .gguf file again (or pass an HF model directory)."
        )

    def _read_metadata(self, n_kv: int) -> None:
        for _ in range(n_kv):
            key = self._string("metadata key")
            vtype = self._scalar(4, f"value type of key {key!r}")
            if key in self.metadata:
                raise ModelLoadError(f"{self.path.name}: metadata key {key!r} appears twice; the file is corrupt")
            self.metadata[key] = self._value(vtype, key)

    def _read_tensor_infos(self, n_tensors: int) -> list[tuple[str, tuple[int, ...], int, int]]:
        """``(name, ne, ggml type id, offset in the data section)`` of every tensor, unchecked."""
        infos = []
        for i in range(n_tensors):
            tname = self._string(f"name of tensor #{i}")
            n_dims = self._scalar(4, f"n_dims of tensor {tname!r}")
            if n_dims < 1 or n_dims > 4:
                raise ModelLoadError(
                    f"{self.path.name}: tensor {tname!r} has {n_dims} dimensions (GGUF allows 1..4): the file is corrupt"
                )
            self._need(8 * n_dims, f"dims of tensor {tname!r}")
            ne = struct.unpack_from(f"<{n_dims}Q", self.mm, self.pos)
            self.pos += 8 * n_dims
            qtype = self._scalar(4, f"type of tensor {tname!r}")
            off = self._scalar(10, f"offset of tensor {tname!r}")
            infos.append((tname, tuple(int(x) for x in ne), qtype, off))
        return infos

    def _checked_tensor(self, tname: str, ne: tuple[int, ...], qtype: int, off: int) -> _GGUFTensor:
        """One tensor, after checking its type id, sizes, alignment and that its data is in the file."""
        name, align = self.path.name, self.alignment
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
        return _GGUFTensor(tname, qtype, ne, start, nbytes, 0)


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
        except (ValueError, TypeError, KeyError, IndexError, OverflowError, struct.error, UnicodeError,
                RecursionError, MemoryError) as e:
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
        #: every file of the model, first shard first (``[path]`` for a single file)
        self.shards: list[Path] = list(paths)
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
                    f"{self._headers[t.shard].path.name}: tensor {t.name!r} uses quant type "
                    f"{qtype_name(t.qtype)} (ggml type id {t.qtype}), "
                    f"which localmoe does not run; supported types: "
                    f"{', '.join(sorted(qtype_name(q) for q in supported))}. Use a file quantized to one "
                    f"of these (e.g. Q4_K_M, Q8_0)"
                )
        self._legacy_experts = self._find_legacy_experts()
        check_gguf_metadata(self.metadata, p.name, h0.bad_utf8)
        self.spec = spec_from_gguf_metadata(self.metadata, self)
        check_tensor_shapes(self.spec, self)
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

