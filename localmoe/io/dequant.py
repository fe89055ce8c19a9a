"""Vectorized PyTorch dequantization of GGML block formats.

Block layouts follow ggml (``ggml/src/ggml-common.h``: ``block_q4_0`` ... ``block_q6_K``) and
the formulas are those of ggml's ``dequantize_row_*`` (``ggml/src/ggml-quants.c``); the
``gguf`` package's ``gguf.quants.dequantize`` is the oracle the tests compare against (results
are bit-identical: same float32 operations in the same order).

===== ===== ======== ======= ===========================================================
type  id    values   bytes   layout of one block -> value
===== ===== ======== ======= ===========================================================
F32   0     1        4
F16   1     1        2
BF16  30    1        2
Q4_0  2     32       18      d:f16, qs[16] (value j<16: low nibble of qs[j], j>=16: high
                             nibble of qs[j-16]); w = d*(q-8)
Q4_1  3     32       20      d:f16, m:f16, qs[16]; w = d*q + m
Q5_0  6     32       22      d:f16, qh:u32 (bit j = 5th bit of value j), qs[16]; w = d*(q-16)
Q5_1  7     32       24      d:f16, m:f16, qh:u32, qs[16]; w = d*q + m
Q8_0  8     32       34      d:f16, qs:int8[32]; w = d*q
Q4_K  12    256      144     d:f16, dmin:f16, scales[12] (8 x 6-bit scale + 8 x 6-bit min),
                             qs[128] (per 64 values: 32 low nibbles then 32 high nibbles);
                             w = d*sc[j]*q - dmin*m[j] for sub-block j of 32
Q5_K  13    256      176     Q4_K plus qh[32] (bit j of qh[l] = 5th bit of value l of sub-block j)
Q6_K  14    256      210     ql[128], qh[64], scales:int8[16], d:f16; w = d*sc[j]*(q-32),
                             16 sub-blocks of 16
===== ===== ======== ======= ===========================================================

No Python loop runs over blocks: every format is a few tensor ops over all blocks at once
(large tensors are processed in chunks of blocks to bound temporary memory). Works on any
device holding the bytes (CPU or CUDA).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from localmoe.errors import ModelLoadError, UnsupportedModelError


class _LazyTorch:
    """Stands in for the torch module until first use, so that importing this module (for
    SUPPORTED_QTYPES, e.g. from the loader's header validation) does not import torch."""

    def __getattr__(self, name):
        import torch as _torch

        globals()["torch"] = _torch
        return getattr(_torch, name)


torch = _LazyTorch()

__all__ = ["dequantize", "SUPPORTED_QTYPES", "BLOCK_SIZES", "QTYPE_NAMES"]

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30

#: ggml type id -> (values per block, bytes per block)
BLOCK_SIZES: dict[int, tuple[int, int]] = {
    F32: (1, 4), F16: (1, 2), BF16: (1, 2),
    Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
    Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210),
}
QTYPE_NAMES: dict[int, str] = {
    F32: "F32", F16: "F16", BF16: "BF16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1",
    Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K",
}
#: ggml type ids :func:`dequantize` handles
SUPPORTED_QTYPES: frozenset[int] = frozenset(BLOCK_SIZES)

_CHUNK_BLOCKS = 1 << 16  # blocks per step for large tensors (bounds temporaries to ~100 MB)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] uint8 -> [n, 1] float32 (little-endian fp16)."""
    return b.contiguous().view(torch.float16).to(torch.float32)


def _shifts(vals: Sequence[int], device) -> torch.Tensor:
    return torch.tensor(vals, dtype=torch.uint8, device=device)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, G, 32] bytes -> [n, G, 2, 32]: low nibbles, then high nibbles (ggml order)."""
    sh = _shifts([0, 4], qs.device).view(1, 1, 2, 1)
    return (qs.unsqueeze(-2) >> sh) & 0x0F


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] uint8 (a little-endian u32) -> [n, 32] uint8 bits, bit j of the u32 at index j."""
    sh = _shifts(range(8), qh.device).view(1, 1, 8)
    return ((qh.unsqueeze(-1) >> sh) & 1).reshape(qh.shape[0], 32)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    q = _nibbles(b[:, 2:18].reshape(n, 1, 16)).reshape(n, 32)
    return d * (q.to(torch.int8) - 8).to(torch.float32)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 4:20].reshape(n, 1, 16)).reshape(n, 32).to(torch.float32)
    return d * q + m


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    qh = _bits32(b[:, 2:6])
    ql = _nibbles(b[:, 6:22].reshape(n, 1, 16)).reshape(n, 32)
    q = (ql | (qh << 4)).to(torch.int8) - 16
    return d * q.to(torch.float32)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    qh = _bits32(b[:, 4:8])
    ql = _nibbles(b[:, 8:24].reshape(n, 1, 16)).reshape(n, 32)
    q = (ql | (qh << 4)).to(torch.float32)
    return d * q + m


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, 0:2])
    q = b[:, 2:34].contiguous().view(torch.int8).to(torch.float32)
    return q * d


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte K-quant scales into 8 six-bit scales and 8 six-bit mins ([n, 8] each).

    ggml ``get_scale_min_k4``: j<4: sc = s[j]&63, m = s[j+4]&63; j>=4: sc = (s[j+4]&15) |
    ((s[j-4]>>6)<<4), m = (s[j+4]>>4) | ((s[j]>>6)<<4).
    """
    s = s.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (d * sc.to(torch.float32)).view(n, 8, 1)
    ml = (dmin * mn.to(torch.float32)).view(n, 8, 1)
    q = _nibbles(b[:, 16:144].reshape(n, 4, 32)).reshape(n, 8, 32).to(torch.float32)
    return (dl * q - ml).reshape(n, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (d * sc.to(torch.float32)).view(n, 8, 1)
    ml = (dmin * mn.to(torch.float32)).view(n, 8, 1)
    qh = b[:, 16:48]
    sh = _shifts(range(8), b.device).view(1, 8, 1)
    hi = (qh.unsqueeze(1) >> sh) & 1                       # [n, 8, 32]: sub-block j = bit j
    ql = _nibbles(b[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
    q = (ql | (hi << 4)).to(torch.float32)
    return (dl * q - ml).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 1, 64)
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    sc = b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = _f16(b[:, 208:210])
    dl = (d * sc).view(n, 16, 1)
    lo = ((ql >> _shifts([0, 4], b.device).view(1, 1, 2, 1)) & 0x0F).reshape(n, 8, 32)
    hi = ((qh >> _shifts([0, 2, 4, 6], b.device).view(1, 1, 4, 1)) & 0x03).reshape(n, 8, 32)
    q = ((lo | (hi << 4)).to(torch.int8) - 32).reshape(n, 16, 16).to(torch.float32)
    return (dl * q).reshape(n, 256)


_BLOCK_FNS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    Q4_0: _q4_0, Q4_1: _q4_1, Q5_0: _q5_0, Q5_1: _q5_1, Q8_0: _q8_0,
    Q4_K: _q4_k, Q5_K: _q5_k, Q6_K: _q6_k,
}


def _type_label(qtype: int) -> str:
    try:
        import gguf

        return gguf.GGMLQuantizationType(int(qtype)).name
    except Exception:
        return "unknown"


def dequantize(data: torch.Tensor, qtype: int, shape: Sequence[int]) -> torch.Tensor:
    """Decode GGML blocks into float32 values.

    Args:
        data: ``torch.uint8`` tensor (any shape, contiguous) holding exactly
            ``prod(shape) / values_per_block * bytes_per_block`` bytes, on CPU or CUDA.
        qtype: ggml type id (``gguf.GGMLQuantizationType``), one of :data:`SUPPORTED_QTYPES`.
        shape: torch-order element shape of the result (last dim = GGUF ``ne0``, the row; it must
            be a multiple of the block size).
    Returns:
        ``torch.float32`` tensor of ``shape`` on ``data``'s device.
    Raises:
        UnsupportedModelError: ``qtype`` not supported (message names type name and id).
        ModelLoadError: byte count does not match ``shape``.
    """
    qtype = int(qtype)
    shape = tuple(int(s) for s in shape)
    if qtype not in BLOCK_SIZES:
        raise UnsupportedModelError(
            f"quant type {_type_label(qtype)} (ggml type id {qtype}) is not supported by localmoe; "
            f"supported: {', '.join(QTYPE_NAMES[q] for q in sorted(SUPPORTED_QTYPES))}"
        )
    bs, ts = BLOCK_SIZES[qtype]
    nel = math.prod(shape) if shape else 1
    if shape and shape[-1] % bs:
        raise ModelLoadError(
            f"{QTYPE_NAMES[qtype]} rows must be a multiple of {bs} values, got shape {shape}"
        )
    if data.dtype != torch.uint8:
        raise TypeError(f"dequantize() wants uint8 bytes, got {data.dtype}")
    n_blocks = nel // bs
    if data.numel() != n_blocks * ts:
        raise ModelLoadError(
            f"{QTYPE_NAMES[qtype]} tensor of shape {shape} needs {n_blocks * ts} bytes, got {data.numel()}"
        )
    flat = data.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if qtype == F32:
        return flat.view(torch.float32).reshape(shape).clone()
    if qtype == F16:
        return flat.view(torch.float16).to(torch.float32).reshape(shape)
    if qtype == BF16:
        return flat.view(torch.bfloat16).to(torch.float32).reshape(shape)
    blocks = flat.view(n_blocks, ts)
    fn = _BLOCK_FNS[qtype]
    if n_blocks <= _CHUNK_BLOCKS:
        return fn(blocks).reshape(shape)
    out = torch.empty((n_blocks, bs), dtype=torch.float32, device=data.device)
    for a in range(0, n_blocks, _CHUNK_BLOCKS):
        out[a:a + _CHUNK_BLOCKS] = fn(blocks[a:a + _CHUNK_BLOCKS])
    return out.reshape(shape)
