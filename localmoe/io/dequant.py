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
Q2_K  10    256      84      scales[16] (low nibble: scale, high: min, per 16 values), qs[64]
                             (value 128h+32s+l at bits 2s of qs[32h+l]), d:f16, dmin:f16;
                             w = d*(sc&15)*q - dmin*(sc>>4)
Q3_K  11    256      110     hmask[32] (bit i//32 of hmask[i%32] = 3rd bit), qs[64] as Q2_K,
                             scales[12] (16 x 6 bits), d:f16; w = d*(sc-32)*(q3-4)
Q4_K  12    256      144     d:f16, dmin:f16, scales[12] (8 x 6-bit scale + 8 x 6-bit min),
                             qs[128] (per 64 values: 32 low nibbles then 32 high nibbles);
                             w = d*sc[j]*q - dmin*m[j] for sub-block j of 32
Q5_K  13    256      176     Q4_K plus qh[32] (bit j of qh[l] = 5th bit of value l of sub-block j)
Q6_K  14    256      210     ql[128], qh[64], scales:int8[16], d:f16; w = d*sc[j]*(q-32),
                             16 sub-blocks of 16
IQ4_NL 20   32       18      d:f16, qs[16] (nibbles as Q4_0); w = d*T[q], T the 16-entry
                             non-linear table :data:`IQ4_VALUES`
IQ4_XS 23   256      136     d:f16, scales_h:u16, scales_l[4], qs[128] (per 32 values: nibbles as
                             Q4_0); sub-block j scale ls = (scales_l[j/2] >> 4(j%2) & 15) |
                             (scales_h >> 2j & 3) << 4; w = d*(ls-32)*T[q]
===== ===== ======== ======= ===========================================================

No Python loop runs over blocks: every format is a few tensor ops over all blocks at once
(large tensors are processed in chunks of blocks to bound temporary memory). Works on any
device holding the bytes (CPU or CUDA).

The other weight types of GGUF files (the grid i-quants IQ1_S..IQ3_S, TQ1_0/TQ2_0, MXFP4:
:data:`REFERENCE_QTYPES`) go through ``gguf.quants.dequantize`` itself, on the CPU: correct by
construction, ~10-30 M values/s on one core, so a model in these types loads slowly on the
torch backend (and on the triton backend, which dequantizes them to fp16); the llamacpp
backend reads them natively.
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

__all__ = ["dequantize", "SUPPORTED_QTYPES", "BLOCK_SIZES", "QTYPE_NAMES", "IQ4_VALUES"]

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30
Q2_K, Q3_K, IQ4_NL, IQ4_XS = 10, 11, 20, 23

#: ggml type id -> (values per block, bytes per block)
BLOCK_SIZES: dict[int, tuple[int, int]] = {
    F32: (1, 4), F16: (1, 2), BF16: (1, 2),
    Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
    Q2_K: (256, 84), Q3_K: (256, 110), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210),
    IQ4_NL: (32, 18), IQ4_XS: (256, 136),
}
QTYPE_NAMES: dict[int, str] = {
    F32: "F32", F16: "F16", BF16: "BF16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1",
    Q8_0: "Q8_0", Q2_K: "Q2_K", Q3_K: "Q3_K", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K",
    IQ4_NL: "IQ4_NL", IQ4_XS: "IQ4_XS",
}
#: the non-linear 4-bit code book of IQ4_NL and IQ4_XS (ggml ``kvalues_iq4nl``)
IQ4_VALUES: tuple[int, ...] = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69,
                               89, 113)
#: the i-quants, ternary and FP4 types: decoded by ``gguf.quants.dequantize`` (NumPy, on the
#: CPU; the weights of a model in these types are dequantized once, at load)
REFERENCE_QTYPES: dict[int, str] = {
    16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 21: "IQ3_S", 22: "IQ2_S",
    29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}


def _reference_sizes() -> dict[int, tuple[int, int]]:
    import gguf

    out = {}
    for t, name in REFERENCE_QTYPES.items():
        try:
            q = gguf.GGMLQuantizationType(t)
        except ValueError:    # a gguf package without it
            continue
        if q.name == name and q in gguf.GGML_QUANT_SIZES:
            out[t] = tuple(int(v) for v in gguf.GGML_QUANT_SIZES[q])
    return out


BLOCK_SIZES.update(_reference_sizes())
QTYPE_NAMES.update({t: REFERENCE_QTYPES[t] for t in BLOCK_SIZES if t in REFERENCE_QTYPES})
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


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K/Q3_K qs [n, 64] -> [n, 256] 2-bit codes (value 128h+32s+l at bits 2s of qs[32h+l])."""
    n = qs.shape[0]
    sh = _shifts([0, 2, 4, 6], qs.device).view(1, 1, 4, 1)
    return ((qs.reshape(n, 2, 1, 32) >> sh) & 3).reshape(n, 256)


def q2_k_parts(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q2_K blocks [n, 84] -> (codes uint8 [n, 256] in 0..3, scales and mins float32 [n, 16]
    = ``d * (sc & 15)`` and ``dmin * (sc >> 4)``, one per 16 values); ``w = scale * code -
    min``."""
    sc = b[:, 0:16]
    dl = _f16(b[:, 80:82]) * (sc & 0x0F).to(torch.float32)
    ml = _f16(b[:, 82:84]) * (sc >> 4).to(torch.float32)
    return _crumbs(b[:, 16:80]), dl, ml


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    q, dl, ml = q2_k_parts(b)
    q = q.reshape(n, 16, 16).to(torch.float32)
    return (dl.view(n, 16, 1) * q - ml.view(n, 16, 1)).reshape(n, 256)


def q3_k_parts(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q3_K blocks [n, 110] -> (codes int8 [n, 256] in -4..3, scales float32 [n, 16] = d * (the
    6-bit scale - 32), one per 16 values); ``w = scale * code``."""
    n = b.shape[0]
    s = b[:, 96:108]
    lo = (s[:, :8].reshape(n, 1, 8) >> _shifts([0, 4], b.device).view(1, 2, 1)).reshape(n, 16) & 0x0F
    hi = (s[:, 8:12].reshape(n, 1, 4) >> _shifts([0, 2, 4, 6], b.device).view(1, 4, 1)).reshape(n, 16) & 3
    sc = ((lo | (hi << 4)).to(torch.int8) - 32).to(torch.float32)
    hm = b[:, 0:32]
    hbit = ((hm.reshape(n, 1, 32) >> _shifts(range(8), b.device).view(1, 8, 1)) & 1).reshape(n, 256)
    # ggml: the offset 4 applies where the high bit is 0
    q = _crumbs(b[:, 32:96]).to(torch.int8) - ((hbit ^ 1) << 2).to(torch.int8)
    return q, _f16(b[:, 108:110]) * sc


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    q, dl = q3_k_parts(b)
    return (dl.view(n, 16, 1) * q.to(torch.float32).reshape(n, 16, 16)).reshape(n, 256)


def iq4_codes(qs: torch.Tensor) -> torch.Tensor:
    """IQ4_NL/IQ4_XS nibble bytes [n, m, 16] -> int8 [n, m, 32] code-book values
    (:data:`IQ4_VALUES`; value j of 32 in the low nibble of byte j, 16+j in the high one)."""
    table = torch.tensor(IQ4_VALUES, dtype=torch.int8, device=qs.device)
    return table[_nibbles(qs).reshape(*qs.shape[:-1], 32).long()]


def iq4_xs_scales(b: torch.Tensor) -> torch.Tensor:
    """IQ4_XS blocks [n, 136] -> float32 [n, 8]: ``d * (ls - 32)`` of each 32 values."""
    n = b.shape[0]
    sh = b[:, 2:4].contiguous().view(torch.int16).to(torch.int32)          # [n, 1]
    j = torch.arange(8, device=b.device, dtype=torch.int32).view(1, 8)
    lo = (b[:, 4:8].to(torch.int32).repeat_interleave(2, dim=1) >> ((j % 2) * 4)) & 0x0F
    ls = lo | (((sh >> (2 * j)) & 3) << 4)
    return _f16(b[:, 0:2]) * (ls - 32).to(torch.float32)


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    return _f16(b[:, 0:2]) * iq4_codes(b[:, 2:18].reshape(n, 1, 16)).reshape(n, 32).to(torch.float32)


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    dl = iq4_xs_scales(b).view(n, 8, 1)
    return (dl * iq4_codes(b[:, 8:136].reshape(n, 8, 16)).to(torch.float32)).reshape(n, 256)


_BLOCK_FNS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    Q4_0: _q4_0, Q4_1: _q4_1, Q5_0: _q5_0, Q5_1: _q5_1, Q8_0: _q8_0,
    Q2_K: _q2_k, Q3_K: _q3_k, Q4_K: _q4_k, Q5_K: _q5_k, Q6_K: _q6_k,
    IQ4_NL: _iq4_nl, IQ4_XS: _iq4_xs,
}


def _reference_fn(qtype: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Blocks -> float32 values through ``gguf.quants.dequantize`` (a CPU copy of the blocks
    on another device; the result goes back to the blocks' device)."""
    import gguf
    import numpy as np

    qt = gguf.GGMLQuantizationType(qtype)

    def fn(b: torch.Tensor) -> torch.Tensor:
        with np.errstate(all="ignore"):   # a NaN/Inf scale: the load's finite checks say so
            v = gguf.quants.dequantize(np.ascontiguousarray(b.cpu().numpy()), qt)
        return torch.from_numpy(np.asarray(v, dtype=np.float32)).to(b.device)

    return fn


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
    fn = _BLOCK_FNS.get(qtype) or _reference_fn(qtype)
    if n_blocks <= _CHUNK_BLOCKS:
        return fn(blocks).reshape(shape)
    out = torch.empty((n_blocks, bs), dtype=torch.float32, device=data.device)
    for a in range(0, n_blocks, _CHUNK_BLOCKS):
        out[a:a + _CHUNK_BLOCKS] = fn(blocks[a:a + _CHUNK_BLOCKS])
    return out.reshape(shape)
