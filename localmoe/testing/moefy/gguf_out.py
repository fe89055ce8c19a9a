"""Writing a moefied model: typed metadata copied from the source, raw block copies, re-blocking.

The file is written with ``gguf.GGUFWriter`` (the llama.cpp project's writer, as
:mod:`localmoe.testing.synthetic` does), tensor by tensor, so memory stays near one tensor.
Block helpers:

* :func:`take_rows`: rows of a stored matrix, copied block for block (an FFN neuron's gate/up
  row is one row of ``ffn_gate``/``ffn_up``, so splitting neurons into experts loses nothing).
* :func:`expert_qtype`: the type an expert tensor is stored in: the source's when the expert's
  row length is a multiple of its block, else llama.cpp's own fallback (``llama-quant.cpp``:
  Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K/Q3_K -> Q4_0 for rows of 32k values; F16 for
  rows that fill no block). Down projections are split along their rows, so they are
  re-quantized from the (dequantized, scaled) floats with :func:`localmoe.testing.quants.quantize_blocks`.
* :func:`scale_blocks_pow2`: multiply a stored tensor by ``2**e`` exactly by editing the fp16
  block scales (every dequantized value scales by ``2**e``; no re-quantization).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

__all__ = ["OutTensor", "source_kvs", "write_gguf", "take_rows", "expert_qtype", "quantize",
           "dequantize", "scale_blocks_pow2", "block_size"]

#: llama.cpp's fallback when a row does not fill a K-quant super-block (llama-quant.cpp)
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "Q2_K": "Q4_0", "Q3_K": "Q4_0",
             "IQ4_XS": "IQ4_NL"}
#: byte offsets of the fp16 scale fields inside one block, per type
_F16_FIELDS = {"Q4_0": (0,), "Q5_0": (0,), "Q8_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2),
               "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,)}


@dataclass
class OutTensor:
    """One tensor of the output file.

    Attributes:
        name: GGUF name; shape: torch-order element shape; qtype: ggml type name.
        make: returns the data: uint8 blocks ``[*shape[:-1], row_bytes]`` or, for F32/F16, a
            float32/float16 array of ``shape``.
    """

    name: str
    shape: tuple[int, ...]
    qtype: str
    make: Callable[[], np.ndarray]


def block_size(qtype: str) -> tuple[int, int]:
    """``(values, bytes)`` per block of ggml type ``qtype``."""
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]


def expert_qtype(src_qtype: str, row_len: int) -> str:
    """Storage type for a tensor of rows of ``row_len`` values that was ``src_qtype``."""
    if src_qtype in ("F32", "F16", "BF16"):
        return src_qtype
    if row_len % block_size(src_qtype)[0] == 0:
        return src_qtype
    fb = _FALLBACK.get(src_qtype)
    if fb and row_len % block_size(fb)[0] == 0:
        return fb
    return "F16"


def quantize(x: np.ndarray, qtype: str) -> np.ndarray:
    """float32 ``x`` -> the stored array of ``qtype`` (see :class:`OutTensor`)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if qtype == "F32":
        return x
    if qtype == "F16":
        return x.astype(np.float16)
    from localmoe.testing.quants import quantize_blocks

    return quantize_blocks(x, qtype)


def dequantize(data: np.ndarray, qtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Stored array -> float32 of ``shape`` (``gguf.quants.dequantize``, the reference)."""
    import gguf

    if qtype in ("F32", "F16"):
        return np.asarray(data).view(np.float32 if qtype == "F32" else np.float16
                                     ).reshape(shape).astype(np.float32)
    return gguf.quants.dequantize(np.ascontiguousarray(data), gguf.GGMLQuantizationType[qtype]
                                  ).reshape(shape).astype(np.float32)


def take_rows(data: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Rows ``rows`` of a stored 2-D tensor (``[n_rows, row_bytes]`` uint8), block for block."""
    return np.ascontiguousarray(data[np.asarray(rows)])


def scale_blocks_pow2(data: np.ndarray, qtype: str, exp: int) -> np.ndarray:
    """A copy of stored tensor ``data`` whose every value is multiplied by ``2**exp`` exactly.

    Raises:
        ValueError: a type without fp16 block scales, or a scale that would not be exact in fp16
            (overflow, or a subnormal result).
    """
    if qtype in ("F32", "F16"):
        v = np.asarray(data).view(np.float32 if qtype == "F32" else np.float16)
        return (v * np.float32(2.0 ** exp)).astype(v.dtype).view(np.uint8).reshape(data.shape)
    if qtype not in _F16_FIELDS:
        raise ValueError(f"cannot rescale {qtype} blocks exactly")
    nb = block_size(qtype)[1]
    out = np.array(data, dtype=np.uint8, copy=True)
    blocks = out.reshape(-1, nb)
    for off in _F16_FIELDS[qtype]:
        old = blocks[:, off:off + 2].copy().view(np.float16).astype(np.float32)
        with np.errstate(over="ignore"):
            new = (old * np.float32(2.0 ** exp)).astype(np.float16)
        if not np.array_equal(new.astype(np.float32), old * np.float32(2.0 ** exp)):
            raise ValueError(f"scaling {qtype} blocks by 2**{exp} is not exact in fp16 "
                             f"(overflow or subnormal scales)")
        blocks[:, off:off + 2] = new.view(np.uint8)
    return out


def source_kvs(path: str | Path, src_arch: str, dst_arch: str, drop: Iterable[str] = ()
               ) -> list[tuple[str, Any, Any, Any]]:
    """Typed metadata of the GGUF at ``path`` as ``(key, value, vtype, sub_type)``, with the
    ``{src_arch}.`` prefix renamed to ``{dst_arch}.``; ``GGUF.*`` header fields,
    ``general.architecture`` and the keys in ``drop`` (after renaming) are left out."""
    import gguf

    r = gguf.GGUFReader(str(path))
    drop = set(drop)
    out = []
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        k = dst_arch + key[len(src_arch):] if key.startswith(src_arch + ".") else key
        if k in drop:
            continue
        vtype = gguf.GGUFValueType(f.types[0])
        sub = gguf.GGUFValueType(f.types[1]) if vtype == gguf.GGUFValueType.ARRAY else None
        out.append((k, f.contents(), vtype, sub))
    return out


def write_gguf(path: str | Path, arch: str, kvs: list[tuple[str, Any, Any, Any]],
               tensors: list[OutTensor]) -> Path:
    """Write a GGUF file: ``general.architecture = arch``, then ``kvs`` in order, then
    ``tensors`` (data made one at a time). Written to ``path.tmp`` and renamed, so a crash never
    leaves a half file under the final name."""
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(tmp, arch)
    for key, val, vtype, sub in kvs:
        w.add_key_value(key, val, vtype, sub_type=sub)
    for t in tensors:
        vals, nbytes = block_size(t.qtype)
        n = math.prod(t.shape)
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), n // vals * nbytes,
                          raw_dtype=gguf.GGMLQuantizationType[t.qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in tensors:
        arr = np.ascontiguousarray(t.make())
        vals, nbytes = block_size(t.qtype)
        if arr.nbytes != math.prod(t.shape) // vals * nbytes:
            raise ValueError(f"tensor {t.name}: {arr.nbytes} bytes made, expected "
                             f"{math.prod(t.shape) // vals * nbytes} for {t.qtype} {t.shape}")
        w.write_tensor_data(arr)
    w.close()
    tmp.replace(path)
    return path
