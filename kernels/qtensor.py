"""GGUF-quantized weights on the device: :class:`QuantTensor` and its kernel-friendly planes.

A ``QuantTensor`` holds one GGUF tensor (logical shape ``[..., N, K]``; stacked experts are
``[n_experts, N, K]``, expert ``e`` = rows ``e*N .. e*N+N-1``) without ever materializing a
float copy: at construction the file's blocks are *repacked* once, on the device, into
separate planes (quants, high bits, block scales, sub-block scales), each a 2-D tensor with
one row per weight row (``R = prod(shape[:-1])`` rows). Planes keep the file's numbers bit for
bit; :meth:`QuantTensor.dequantize` (the torch twin of the kernels) reproduces
``gguf.quants.dequantize`` exactly (same float32 operations in the same order).

Source of the block formats: ggml ``ggml/src/ggml-common.h`` (``block_q4_0`` ... ``block_q6_K``)
and ``dequantize_row_*`` in ``ggml/src/ggml-quants.c``; the ``gguf`` package's
``gguf.quants.dequantize`` is the oracle in the tests. Per block (``w`` = weight, ``q`` = code):

====== ===== ====== ==================================================================
type   vals  bytes  ggml block -> value
====== ===== ====== ==================================================================
Q4_0   32    18     d f16, qs[16] (lo nibble = value l, hi = value 16+l); w = d*(q-8)
Q4_1   32    20     d, m f16, qs[16]; w = d*q + m
Q5_0   32    22     d, qh u32 (bit j = 5th bit of value j), qs[16]; w = d*(q-16)
Q5_1   32    24     d, m, qh, qs; w = d*q + m
Q8_0   32    34     d, qs int8[32]; w = d*q
Q2_K   256   84     scales[16] (lo nibble scale, hi nibble min, per 16 values), qs[64]
                    (value 128h+32s+l at bits 2s of qs[32h+l]), d, dmin f16;
                    w = d*(sc&15)*q - dmin*(sc>>4)
Q3_K   256   110    hmask[32] (bit i//32 of hmask[i%32] = 3rd bit), qs[64] as Q2_K,
                    scales[12] (16 x 6 bits), d; w = d*(sc-32)*(q3-4), q3 = low2 | hbit<<2
Q4_K   256   144    d, dmin, scales[12] (8 x 6-bit scale + 8 x 6-bit min), qs[128] (per 64
                    values: 32 low nibbles, then 32 high nibbles); w = d*sc*q - dmin*m
Q5_K   256   176    Q4_K + qh[32] (bit j of qh[l] = 5th bit of value 32j+l)
Q6_K   256   210    ql[128], qh[64], scales int8[16] (per 16 values), d; w = d*sc*(q-32)
IQ4_NL 32    18     d f16, qs[16] (nibbles as Q4_0); w = d*T[q], T the 16-entry code book
                    :data:`IQ4_VALUES` (-127..113)
IQ4_XS 256   136    d f16, scales_h u16, scales_l[4] (8 x 6-bit ls), qs[128] (per 32 values:
                    nibbles as Q4_0); w = d*(ls-32)*T[q]
====== ===== ====== ==================================================================

Repacked planes (``R`` rows, ``K`` values per row; all row-major, row ``r`` of every plane
belongs to weight row ``r``). Codes are grouped in *chunks* of ``CV`` values (64 for Q2_K /
Q3_K, 32 otherwise); a chunk is ``CV/16`` *slices* of 16 values, slice ``s`` = values
``16s .. 16s+15`` of the chunk, and inside a slice value ``4w+b`` is byte ``b`` of 32-bit word
``w`` (so one word holds 4 codes, the operand of one ``dp4a``):

* ``q`` int32 ``[R, K*B/32]`` the low ``B`` bits of every code: ``B=8`` (Q8_0: the int8 codes in
  order), ``B=4`` (chunk = 4 words; byte ``l`` = ``code[l] | code[16+l] << 4``: slice 0 in the
  low nibbles, slice 1 in the high ones; this is ggml's own Q4_0 order), ``B=2`` (Q2_K/Q3_K:
  chunk = 4 words; byte ``l`` bits ``2s..2s+1`` = ``code[16s+l]``);
* ``qh`` int32, the remaining high bits, laid out so that one shift and one mask put them
  under their bytes: Q5_0/Q5_1/Q5_K ``[R, K/32]`` one word per chunk, bit ``8b+4s+w`` = 5th bit
  of value ``16s+4w+b``; Q6_K ``[R, K/16]`` two words per chunk, word ``s`` bits
  ``8b+2w .. +1`` = bits 4-5 of value ``16s+4w+b``; Q3_K int16 ``[R, K/16]``, four per chunk,
  one per code word ``w`` (loaded as a tile beside the codes): bit ``4s+b`` = 3rd bit of value
  ``16s+4w+b``;
* ``d`` float16 ``[R, K/32]`` (legacy: per block) or ``[R, K/256]`` (K-quants: per super-block);
  Q4_K/Q5_K: int32 ``[R, K/256]``, the float16 bits of ``d`` in the low half and of ``dmin``
  in the high half (one load per super-block for both);
* ``dmin`` float16: Q4_1/Q5_1 ``m`` ``[R, K/32]``; Q2_K ``dmin`` ``[R, K/256]``;
* ``sc`` sub-block scales, pre-unpacked: Q4_K/Q5_K int16 ``[R, K/32]``, the 6-bit scale in the
  low byte and the 6-bit min in the high byte (one load per chunk for both); Q6_K int8
  ``[R, K/16]``; Q3_K int8 ``[R, K/16]`` (6-bit value minus 32); Q2_K uint8 ``[R, K/16]``
  (ggml's byte: scale in the low nibble, min in the high one); IQ4_XS int8 ``[R, K/32]``
  (ls - 32, one per chunk).

IQ4_NL / IQ4_XS codes are packed as Q4_0's (``B=4``) and stay 4-bit indices on the device:
the kernels map them to their int8 code-book values in registers
(:func:`localmoe.kernels.quant_gemv.iq4_lookup`, ``prmt`` byte permutes on the GPU).

Packing a chunk's scale with its min, and a super-block's ``d`` with its ``dmin``, cuts the
loads a kernel issues per Q4_K chunk from five to three (the profile of the fused MoE gate/up
launch on the H200 showed 59% of its stall cycles waiting on L1TEX loads).

Bytes on the device per 256 values: the file's for every type except Q4_K 148 (144 in the
file), Q5_K 180 (176) and Q3_K 114 (110): their 12-byte packed 6-bit scales become 16 bytes;
IQ4_XS 138 (136): its 6 bytes of 6-bit scales become 8.
F32/F16/BF16 tensors pass through as one plane ``w`` ``[R, K]`` of their own dtype.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from localmoe.errors import ModelLoadError, UnsupportedModelError

__all__ = [
    "QuantTensor", "BLOCK_SIZES", "QTYPE_NAMES", "QUANT_QTYPES", "FLOAT_QTYPES",
    "SUPPORTED_QTYPES", "chunk_values", "random_gguf_blocks", "qtype_id",
]

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16 = 10, 11, 12, 13, 14, 30
IQ4_NL, IQ4_XS = 20, 23
#: the IQ4_NL / IQ4_XS code book (ggml ``kvalues_iq4nl``; the same as
#: :data:`localmoe.io.dequant.IQ4_VALUES`, which this layer may not import, tested)
IQ4_VALUES: tuple[int, ...] = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69,
                               89, 113)

#: ggml type id -> (values per block, bytes per block)
BLOCK_SIZES: dict[int, tuple[int, int]] = {
    F32: (1, 4), F16: (1, 2), BF16: (1, 2),
    Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
    Q2_K: (256, 84), Q3_K: (256, 110), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210),
    IQ4_NL: (32, 18), IQ4_XS: (256, 136),
}
QTYPE_NAMES: dict[int, str] = {
    F32: "F32", F16: "F16", BF16: "BF16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0",
    Q5_1: "Q5_1", Q8_0: "Q8_0", Q2_K: "Q2_K", Q3_K: "Q3_K", Q4_K: "Q4_K", Q5_K: "Q5_K",
    Q6_K: "Q6_K", IQ4_NL: "IQ4_NL", IQ4_XS: "IQ4_XS",
}
QUANT_QTYPES: tuple[int, ...] = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
                                 IQ4_NL, IQ4_XS)
FLOAT_QTYPES: tuple[int, ...] = (F32, F16, BF16)
SUPPORTED_QTYPES: frozenset[int] = frozenset(BLOCK_SIZES)
_FLOAT_DTYPES = {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}
# byte offsets of the fp16 fields inside one block (d, m / dmin)
_F16_FIELDS = {
    Q4_0: (0,), Q4_1: (0, 2), Q5_0: (0,), Q5_1: (0, 2), Q8_0: (0,),
    Q2_K: (80, 82), Q3_K: (108,), Q4_K: (0, 2), Q5_K: (0, 2), Q6_K: (208,),
    IQ4_NL: (0,), IQ4_XS: (0,),
}
_CHUNK_VALUES = 1 << 24
"""Weight values repacked per step: bounds the repack's temporaries (uint8 codes, and the int64
high-bit words of Q3_K/Q5_*/Q6_K: 8 bytes a value, 128 MiB) while keeping the few dozen torch
operations per step long enough that their launches do not decide the load's speed (with 32 Ki
blocks a step, 1-8 Mi values, the repack ran at 7.8 GB/s on the H200 in session 20)."""


def row_chunks(rows: int, k: int) -> list[tuple[int, int]]:
    """The ``(first, end)`` row ranges :meth:`QuantTensor.from_gguf` copies and repacks at a
    time: whole rows of ``k`` values, about ``_CHUNK_VALUES`` values each (at least one row)."""
    per = max(1, _CHUNK_VALUES // max(1, k))
    return [(r0, min(rows, r0 + per)) for r0 in range(0, rows, per)]


def nonfinite_error(name: str | None, qtype: int, is_float: bool = False) -> ModelLoadError:
    """The error for a tensor whose :meth:`QuantTensor.finite_flag` is False (names it)."""
    what = "values" if is_float else "scales"
    return ModelLoadError(f"tensor {name!r}: {QTYPE_NAMES[qtype]} block {what} "
                          "contain NaN/Inf (corrupt file?)")


def qtype_id(qtype: int | str) -> int:
    """ggml type id of ``qtype`` (an id, a ``gguf.GGMLQuantizationType`` or a name like "Q4_K")."""
    if isinstance(qtype, str):
        for k, v in QTYPE_NAMES.items():
            if v == qtype.upper():
                return k
        raise UnsupportedModelError(f"quant type {qtype!r} is not supported by the triton kernels")
    return int(qtype)


def chunk_values(qtype: int) -> int:
    """Values per kernel chunk of ``qtype`` (64 for Q2_K/Q3_K, 32 for the other quants)."""
    return 64 if qtype in (Q2_K, Q3_K) else 32


def _type_label(qtype: int) -> str:
    if qtype in QTYPE_NAMES:
        return QTYPE_NAMES[qtype]
    try:
        import gguf

        return gguf.GGMLQuantizationType(qtype).name
    except Exception:
        return "unknown"


def _unsupported(qtype: int, name: str | None) -> UnsupportedModelError:
    who = f"tensor {name!r}: " if name else ""
    return UnsupportedModelError(
        f"{who}quant type {_type_label(qtype)} (ggml type id {qtype}) is not "
        f"supported by the triton kernels (supported: "
        f"{', '.join(QTYPE_NAMES[q] for q in sorted(SUPPORTED_QTYPES))}); "
        f"run this model with --backend torch or --backend llamacpp")


# ----------------------------------------------------------------------------------------------
# code extraction: ggml blocks [n, ts] uint8 -> natural-order codes [n, bs] uint8
# ----------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _const(vals: tuple[int, ...], dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    # made once per device: a tensor built from a list is a copy from pageable memory, which
    # waits for the device's stream and would stall the load's pipeline at every chunk
    return torch.tensor(vals, dtype=dtype, device=dev)


def _sh(vals, dev):
    return _const(tuple(vals), torch.uint8, torch.device(dev))


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] uint8 -> [n] float16 (little-endian)."""
    return b.contiguous().view(torch.float16).reshape(-1)


def _nib32(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] bytes -> [n, 32] codes (low nibbles = values 0..15, high = 16..31)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _bits_u32(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes of a little-endian u32 -> [n, 32] bits (bit j at index j)."""
    sh = _sh(range(8), qh.device).view(1, 1, 8)
    return ((qh.unsqueeze(-1) >> sh) & 1).reshape(qh.shape[0], 32)


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 packed bytes -> 8 six-bit scales and 8 six-bit mins (ggml ``get_scale_min_k4``)."""
    s = s.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q3k_scales(s: torch.Tensor) -> torch.Tensor:
    """Q3_K: 12 packed bytes -> 16 int8 scales (6-bit value - 32)."""
    n = s.shape[0]
    lo = (s[:, :8].reshape(n, 1, 8) >> _sh([0, 4], s.device).view(1, 2, 1)).reshape(n, 16) & 0x0F
    hi = (s[:, 8:12].reshape(n, 1, 4) >> _sh([0, 2, 4, 6], s.device).view(1, 4, 1)).reshape(n, 16) & 3
    return ((lo | (hi << 4)).to(torch.int16) - 32).to(torch.int8)


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K/Q3_K qs [n, 64] -> [n, 256] 2-bit codes (value 128h+32s+l at bits 2s of qs[32h+l])."""
    n = qs.shape[0]
    sh = _sh([0, 2, 4, 6], qs.device).view(1, 1, 4, 1)
    return ((qs.reshape(n, 2, 1, 32) >> sh) & 3).reshape(n, 256)


def _codes_and_scales(b: torch.Tensor, qt: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ggml blocks ``[n, ts]`` -> (codes ``[n, bs]`` uint8 in value order, per-block scale fields).

    Codes are the unsigned stored codes (Q8_0: the int8 bytes as uint8). Scale fields are
    ``[n, x]`` tensors keyed like the planes (``d``, ``dmin``, ``sc``, ``mn``)."""
    n = b.shape[0]
    if qt == Q8_0:
        return b[:, 2:34].contiguous(), {"d": _f16(b[:, 0:2])}
    if qt in (Q4_0, Q4_1, Q5_0, Q5_1):
        off = 2 if qt in (Q4_0, Q5_0) else 4
        f = {"d": _f16(b[:, 0:2])}
        if off == 4:
            f["dmin"] = _f16(b[:, 2:4])
        if qt in (Q5_0, Q5_1):
            hb = _bits_u32(b[:, off:off + 4])
            codes = _nib32(b[:, off + 4:off + 20]) | (hb << 4)
        else:
            codes = _nib32(b[:, off:off + 16])
        return codes, f
    if qt == Q2_K:
        codes = _crumbs(b[:, 16:80])
        return codes, {"d": _f16(b[:, 80:82]), "dmin": _f16(b[:, 82:84]), "sc": b[:, 0:16]}
    if qt == Q3_K:
        hm = b[:, 0:32]
        hbit = ((hm.reshape(n, 1, 32) >> _sh(range(8), b.device).view(1, 8, 1)) & 1).reshape(n, 256)
        codes = _crumbs(b[:, 32:96]) | (hbit << 2)
        return codes, {"d": _f16(b[:, 108:110]), "sc": _q3k_scales(b[:, 96:108])}
    if qt in (Q4_K, Q5_K):
        sc, mn = _k_scale_min(b[:, 4:16])
        qs = b[:, 16:144] if qt == Q4_K else b[:, 48:176]
        qs = qs.reshape(n, 4, 1, 32) >> _sh([0, 4], b.device).view(1, 1, 2, 1)
        codes = (qs & 0x0F).reshape(n, 256)
        if qt == Q5_K:
            qh = b[:, 16:48]
            hb = ((qh.reshape(n, 1, 32) >> _sh(range(8), b.device).view(1, 8, 1)) & 1).reshape(n, 256)
            codes = codes | (hb << 4)
        return codes, {"d": _f16(b[:, 0:2]), "dmin": _f16(b[:, 2:4]), "sc": sc, "mn": mn}
    if qt == IQ4_NL:
        return _nib32(b[:, 2:18]), {"d": _f16(b[:, 0:2])}
    if qt == IQ4_XS:
        sh = b[:, 2:4].contiguous().view(torch.int16).to(torch.int32)
        j = _const(tuple(range(8)), torch.int32, b.device).view(1, 8)
        lo = (b[:, 4:8].to(torch.int32).repeat_interleave(2, dim=1) >> ((j % 2) * 4)) & 0x0F
        ls = lo | (((sh >> (2 * j)) & 3) << 4)
        codes = _nib32(b[:, 8:136].reshape(n * 8, 16)).reshape(n, 256)
        return codes, {"d": _f16(b[:, 0:2]), "sc": (ls - 32).to(torch.int8)}
    if qt == Q6_K:
        ql = b[:, 0:128].reshape(n, 2, 1, 64) >> _sh([0, 4], b.device).view(1, 1, 2, 1)
        ql = (ql & 0x0F).reshape(n, 2, 4, 32)
        qh = b[:, 128:192].reshape(n, 2, 1, 32) >> _sh([0, 2, 4, 6], b.device).view(1, 1, 4, 1)
        qh = (qh & 3).reshape(n, 2, 4, 32)
        codes = (ql | (qh << 4)).reshape(n, 256)
        return codes, {"d": _f16(b[:, 208:210]), "sc": b[:, 192:208].contiguous().view(torch.int8)}
    raise AssertionError(qt)


def _pack_k_scales(f: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Q4_K/Q5_K fields -> packed planes: ``d`` int32 [n, 1] (float16 bits of d | dmin << 16,
    little-endian) and ``sc`` int16 [n, 8] (scale | min << 8)."""
    n = f["sc"].shape[0]
    d = torch.stack([f["d"].reshape(n), f["dmin"].reshape(n)], dim=-1).view(torch.int32)
    sc = torch.stack([f["sc"], f["mn"]], dim=-1).contiguous().view(torch.int16)
    return {"d": d.reshape(n, 1), "sc": sc.reshape(n, -1)}


def _unpack_k_scales(p: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`_pack_k_scales` for planes of ``r`` rows: ``d``/``dmin`` float16
    ``[r, K/256]``, ``sc``/``mn`` uint8 ``[r, K/32]``."""
    d = p["d"].contiguous().view(torch.float16)
    sc = p["sc"].contiguous().view(torch.uint8)
    return {"d": d[:, 0::2], "dmin": d[:, 1::2], "sc": sc[:, 0::2], "mn": sc[:, 1::2]}


# ----------------------------------------------------------------------------------------------
# canonical packing of natural-order codes [n, V] (V multiple of the chunk) and its inverse
# ----------------------------------------------------------------------------------------------

def _words(bytes_: torch.Tensor) -> torch.Tensor:
    """[..., 4m] uint8 -> [..., m] int32 (little-endian)."""
    return bytes_.contiguous().view(torch.int32)


def _pack_bits(bits: torch.Tensor, shifts: Sequence[int]) -> torch.Tensor:
    """Sum ``bits[..., i] << shifts[i]`` over the last axis into int32 words (bit patterns)."""
    sh = _const(tuple(shifts), torch.int64, bits.device)
    w = (bits.to(torch.int64) << sh).sum(-1)
    w = torch.where(w >= 2 ** 31, w - 2 ** 32, w)
    return w.to(torch.int32)


def _unpack_bits(words: torch.Tensor, shifts: Sequence[int], mask: int) -> torch.Tensor:
    """Inverse of :func:`_pack_bits` for fields of ``mask`` width: [..., ] -> [..., len(shifts)]."""
    sh = _const(tuple(shifts), torch.int64, words.device)
    return ((words.to(torch.int64).unsqueeze(-1) & 0xFFFFFFFF) >> sh & mask).to(torch.uint8)


# shift tables (index order = natural value order inside the packed group)
# 1 high bit per value, one word per 32-value chunk: value 16s+4w+b -> bit 8b+4s+w
_SH_H1_32 = [8 * b + 4 * s + w for s in range(2) for w in range(4) for b in range(4)]
# Q3_K: 1 bit per value, four int16 per 64-value chunk: value 16s+4w+b -> int16 w, bit 4s+b
# (shift i for bit i: the packed axis is ordered (s, b))
_SH_H1_Q3K = list(range(16))
# Q6_K: 2 bits per value, one word per 16-value slice: value 4w+b -> bits 8b+2w
_SH_H2_16 = [8 * b + 2 * w for w in range(4) for b in range(4)]


def _pack_codes(codes: torch.Tensor, qt: int) -> dict[str, torch.Tensor]:
    """Natural codes ``[n, V]`` uint8 -> planes ``q`` (and ``qh``) for ``n`` rows of ``V`` values."""
    n, v = codes.shape
    if qt == Q8_0:
        return {"q": _words(codes)}
    if qt in (Q2_K, Q3_K):
        c = codes.reshape(n, v // 64, 4, 16)
        low = (c[:, :, 0] & 3) | ((c[:, :, 1] & 3) << 2) | ((c[:, :, 2] & 3) << 4) | ((c[:, :, 3] & 3) << 6)
        out = {"q": _words(low.reshape(n, v // 4))}
        if qt == Q3_K:
            hb = ((codes >> 2) & 1).reshape(n, v // 64, 4, 4, 4)          # [.., s, w, b]
            hb = hb.permute(0, 1, 3, 2, 4).reshape(n, v // 64, 4, 16)      # [.., w, (s, b)]
            h = _pack_bits(hb, _SH_H1_Q3K).to(torch.int64)
            out["qh"] = torch.where(h >= 2 ** 15, h - 2 ** 16, h).to(torch.int16).reshape(n, v // 16)
        return out
    c = codes.reshape(n, v // 32, 2, 16)
    low = (c[:, :, 0] & 0x0F) | ((c[:, :, 1] & 0x0F) << 4)
    out = {"q": _words(low.reshape(n, v // 2))}
    if qt in (Q5_0, Q5_1, Q5_K):
        hb = ((codes >> 4) & 1).reshape(n, v // 32, 32)
        out["qh"] = _pack_bits(hb, _SH_H1_32)
    elif qt == Q6_K:
        hb = ((codes >> 4) & 3).reshape(n, v // 16, 16)
        out["qh"] = _pack_bits(hb, _SH_H2_16)
    return out


def _unpack_codes(planes: dict[str, torch.Tensor], qt: int, rows: slice | torch.Tensor) -> torch.Tensor:
    """Planes of the selected rows -> natural codes ``[r, K]`` uint8 (inverse of _pack_codes)."""
    q = planes["q"][rows].contiguous().view(torch.uint8)
    r = q.shape[0]
    if qt == Q8_0:
        return q
    if qt in (Q2_K, Q3_K):
        b = q.reshape(r, -1, 1, 16)
        codes = ((b >> _sh([0, 2, 4, 6], q.device).view(1, 1, 4, 1)) & 3).reshape(r, -1)
        if qt == Q3_K:
            hw = planes["qh"][rows].reshape(r, -1, 4)                      # [r, chunk, w]
            hb = _unpack_bits(hw, _SH_H1_Q3K, 1).reshape(r, -1, 4, 4, 4)   # [.., w, s, b]
            codes = codes | (hb.permute(0, 1, 3, 2, 4).reshape(r, -1) << 2)
        return codes
    b = q.reshape(r, -1, 1, 16)
    codes = ((b >> _sh([0, 4], q.device).view(1, 1, 2, 1)) & 0x0F).reshape(r, -1)
    if qt in (Q5_0, Q5_1, Q5_K):
        hb = _unpack_bits(planes["qh"][rows], _SH_H1_32, 1).reshape(r, -1)
        codes = codes | (hb << 4)
    elif qt == Q6_K:
        hb = _unpack_bits(planes["qh"][rows], _SH_H2_16, 3).reshape(r, -1)
        codes = codes | (hb << 4)
    return codes


def _dequant_codes(codes: torch.Tensor, p: dict[str, torch.Tensor], qt: int) -> torch.Tensor:
    """Natural codes ``[r, K]`` + scale planes of those rows -> float32 ``[r, K]`` (ggml formulas,
    float32 operations in ``gguf.quants`` order)."""
    r, k = codes.shape
    f32 = torch.float32
    if qt == Q8_0:
        d = p["d"].to(f32).reshape(r, -1, 1)
        return (codes.view(torch.int8).to(f32).reshape(r, -1, 32) * d).reshape(r, k)
    if qt in (Q4_0, Q5_0, Q4_1, Q5_1):
        d = p["d"].to(f32).reshape(r, -1, 1)
        c = codes.reshape(r, -1, 32)
        if qt in (Q4_0, Q5_0):
            q = (c.to(torch.int8) - (8 if qt == Q4_0 else 16)).to(f32)
            return (d * q).reshape(r, k)
        m = p["dmin"].to(f32).reshape(r, -1, 1)
        return (d * c.to(f32) + m).reshape(r, k)
    d = p["d"].to(f32).reshape(r, -1, 1)
    if qt in (Q4_K, Q5_K):
        dm = p["dmin"].to(f32).reshape(r, -1, 1)
        dl = (d * p["sc"].to(f32).reshape(r, -1, 8)).reshape(r, -1, 1)
        ml = (dm * p["mn"].to(f32).reshape(r, -1, 8)).reshape(r, -1, 1)
        return (dl * codes.reshape(r, -1, 32).to(f32) - ml).reshape(r, k)
    if qt == Q2_K:
        dm = p["dmin"].to(f32).reshape(r, -1, 1)
        s = p["sc"].reshape(r, -1, 16)
        dl = (d * (s & 0x0F).to(f32)).reshape(r, -1, 1)
        ml = (dm * (s >> 4).to(f32)).reshape(r, -1, 1)
        return (dl * codes.reshape(r, -1, 16).to(f32) - ml).reshape(r, k)
    if qt == Q3_K:
        dl = (d * p["sc"].to(f32).reshape(r, -1, 16)).reshape(r, -1, 1)
        q = (codes.to(torch.int8) - 4).to(f32)
        return (dl * q.reshape(r, -1, 16)).reshape(r, k)
    if qt == Q6_K:
        dl = (d * p["sc"].to(f32).reshape(r, -1, 16)).reshape(r, -1, 1)
        q = (codes.to(torch.int8) - 32).to(f32)
        return (dl * q.reshape(r, -1, 16)).reshape(r, k)
    if qt in (IQ4_NL, IQ4_XS):
        t = _const(IQ4_VALUES, torch.float32, codes.device)[codes.long()].reshape(r, -1, 32)
        if qt == IQ4_XS:
            d = (d * p["sc"].to(f32).reshape(r, -1, 8)).reshape(r, -1, 1)
        return (d * t).reshape(r, k)
    raise AssertionError(qt)


# ----------------------------------------------------------------------------------------------
# the tensor
# ----------------------------------------------------------------------------------------------

@dataclass
class QuantTensor:
    """A GGUF tensor on the device in repacked planes (see the module docstring).

    Attributes:
        qtype: ggml type id.
        shape: logical torch-order shape ``(..., N, K)`` (``(n_experts, N, K)`` for experts).
        planes: plane name -> 2-D device tensor with ``R = prod(shape[:-1])`` rows.
        name: tensor name for messages (optional).
    """

    qtype: int
    shape: tuple[int, ...]
    planes: dict[str, torch.Tensor] = field(repr=False)
    name: str | None = None

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, data, qtype: int | str, shape: Sequence[int], device="cuda",
                  name: str | None = None, stager=None, check: bool = True) -> "QuantTensor":
        """Repack a GGUF tensor's raw block bytes onto ``device``.

        Args:
            data: the block bytes: ``np.ndarray`` or ``torch.Tensor`` of uint8 (any shape, e.g.
                ``RawTensor.data`` ``[..., row_bytes]``), or an object with ``.qtype``,
                ``.shape`` and ``.data`` (a ``RawTensor``; then ``qtype``/``shape`` may be None).
            qtype: ggml type id or name.
            shape: torch-order element shape ``(..., N, K)``; ``K`` a multiple of the block size.
            device: where the planes live. Bytes are copied there in chunks of blocks and repacked
                there; no float copy of the weights is made.
            name: tensor name used in error messages.
            stager: a :class:`localmoe.io.staging.PinnedStager` the chunks' bytes go through
                (asynchronous copies from reused pinned buffers); None: ``Tensor.to``.
            check: check the block scales (not float tensors' values) for NaN/Inf here (one
                host read); False leaves it to the caller (:meth:`finite_flag`, one read for
                many tensors).
        Raises:
            UnsupportedModelError: qtype not supported (names the tensor and type, points to the
                torch / llamacpp backends).
            ModelLoadError: byte count does not match the shape, or a scale is NaN/Inf.
        """
        if qtype is None and hasattr(data, "qtype"):
            qtype, shape, data = data.qtype, data.shape, data.data
        qt = qtype_id(qtype)
        shape = tuple(int(s) for s in shape)
        if qt not in BLOCK_SIZES:
            raise _unsupported(qt, name)
        if len(shape) < 1:
            raise ModelLoadError(f"tensor {name!r}: needs at least one dimension, got {shape}")
        bs, ts = BLOCK_SIZES[qt]
        k = shape[-1]
        r = math.prod(shape[:-1])
        if k % bs:
            raise ModelLoadError(f"tensor {name!r}: {QTYPE_NAMES[qt]} rows must be a multiple of "
                                 f"{bs} values, got shape {shape}")
        src = torch.from_numpy(np.ascontiguousarray(data).reshape(-1)) if isinstance(data, np.ndarray) \
            else data.reshape(-1)
        if src.dtype != torch.uint8:
            raise ModelLoadError(f"tensor {name!r}: wants uint8 block bytes, got {src.dtype}")
        need = r * (k // bs) * ts
        if src.numel() != need:
            raise ModelLoadError(f"tensor {name!r}: {QTYPE_NAMES[qt]} of shape {shape} needs {need} "
                                 f"bytes, got {src.numel()}")
        dev = torch.device(device)

        def uploads(parts: list[torch.Tensor]):
            if stager is not None and src.device.type == "cpu":
                return stager.iter_to_device(parts)
            return (t.to(dev) for t in parts)

        if qt in FLOAT_QTYPES:
            w = next(uploads([src])).view(_FLOAT_DTYPES[qt]).reshape(r, k)
            qtensor = cls(qt, shape, {"w": w}, name)
        else:
            nb = k // bs
            planes: dict[str, torch.Tensor] | None = None
            src2 = src.view(r, nb * ts)
            chunks = row_chunks(r, k)
            for (r0, r1), blk in zip(chunks, uploads([src2[r0:r1] for r0, r1 in chunks])):
                blk = blk.reshape((r1 - r0) * nb, ts)
                part = cls._repack_rows(blk, qt, r1 - r0, k)
                if planes is None:
                    planes = {key: torch.empty((r, v.shape[1]), dtype=v.dtype, device=dev)
                              for key, v in part.items()}
                for key, v in part.items():
                    planes[key][r0:r1] = v
            qtensor = cls(qt, shape, planes, name)
        if check and not qtensor.is_float:
            qtensor.check_finite()
        return qtensor

    @staticmethod
    def _repack_rows(blk: torch.Tensor, qt: int, rows: int, k: int) -> dict[str, torch.Tensor]:
        codes, f = _codes_and_scales(blk, qt)
        out = _pack_codes(codes.reshape(rows, k), qt)
        if qt in (Q4_K, Q5_K):
            f = _pack_k_scales(f)
        for key, v in f.items():
            out[key] = v.reshape(rows, -1)
        return out

    # -- properties ----------------------------------------------------------------------------
    @property
    def N(self) -> int:  # noqa: N802 - the vocabulary's name for the output dim
        return self.shape[-2] if len(self.shape) >= 2 else 1

    @property
    def K(self) -> int:  # noqa: N802
        return self.shape[-1]

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1])

    @property
    def n_experts(self) -> int:
        """Leading dim of a stacked expert tensor ``[E, N, K]`` (1 for a 2-D weight)."""
        return self.shape[0] if len(self.shape) == 3 else 1

    @property
    def device(self) -> torch.device:
        return next(iter(self.planes.values())).device

    @property
    def is_float(self) -> bool:
        return self.qtype in FLOAT_QTYPES

    @property
    def nbytes(self) -> int:
        """Bytes of all planes on the device."""
        return sum(p.numel() * p.element_size() for p in self.planes.values())

    @property
    def ggml_nbytes(self) -> int:
        """Bytes of the same tensor in the GGUF file."""
        bs, ts = BLOCK_SIZES[self.qtype]
        return self.rows * (self.K // bs) * ts

    def row_nbytes(self) -> int:
        """Plane bytes of one weight row (what a kernel reads per row)."""
        return self.nbytes // self.rows

    def scale_planes(self, rows: slice | torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The scale planes of the selected rows (all by default) as the file's fields: ``d``,
        ``dmin`` float16, ``sc``, ``mn`` (Q4_K/Q5_K's packed planes unpacked; views where the
        layout allows); codes (``q``, ``qh``) and float weights are left out."""
        sel = slice(None) if rows is None else rows
        p = {k: v[sel] for k, v in self.planes.items() if k not in ("q", "qh", "w")}
        return _unpack_k_scales(p) if self.qtype in (Q4_K, Q5_K) else p

    def finite_flag(self) -> torch.Tensor:
        """A 0-d bool tensor on the device: every block scale (a float tensor's every value) is
        finite. Computed without a host read, so a loader can check many tensors at once."""
        planes = dict(self.planes)
        if not self.is_float:
            planes.update(self.scale_planes())
        flags = [torch.isfinite(p).all() for key in ("d", "dmin", "w")
                 if (p := planes.get(key)) is not None and p.is_floating_point()]
        return torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool, device=self.device)

    def check_finite(self) -> None:
        """Raise :class:`ModelLoadError` naming the tensor if a block scale is NaN or Inf."""
        if not bool(self.finite_flag()):
            raise nonfinite_error(self.name, self.qtype, self.is_float)

    # -- views ---------------------------------------------------------------------------------
    def expert(self, e: int) -> "QuantTensor":
        """Expert ``e`` of a stacked ``[E, N, K]`` tensor as a 2-D ``[N, K]`` QuantTensor (views)."""
        if len(self.shape) != 3:
            raise ValueError(f"expert() needs a 3-D stacked tensor, shape is {self.shape}")
        n = self.shape[1]
        planes = {k: v[e * n:(e + 1) * n] for k, v in self.planes.items()}
        return QuantTensor(self.qtype, self.shape[1:], planes, self.name)

    @classmethod
    def interleave_rows(cls, a: "QuantTensor", b: "QuantTensor", name: str | None = None) -> "QuantTensor":
        """Join two weights of one qtype and shape ``[..., N, K]`` into ``[..., 2N, K]`` with rows
        interleaved (row ``2n`` = ``a[n]``, row ``2n+1`` = ``b[n]``): the fused gate/up layout of
        :func:`localmoe.kernels.fused_moe.fused_moe`. Allocates the joined planes (the inputs can
        be dropped afterwards)."""
        if a.qtype != b.qtype or a.shape != b.shape:
            raise ValueError(f"interleave_rows needs equal qtype and shape, got "
                             f"{QTYPE_NAMES.get(a.qtype)}{a.shape} and {QTYPE_NAMES.get(b.qtype)}{b.shape}")
        planes = {k: torch.stack([a.planes[k], b.planes[k]], dim=1).reshape(2 * a.rows, -1)
                  for k in a.planes}
        shape = (*a.shape[:-2], 2 * a.shape[-2], a.shape[-1])
        return cls(a.qtype, shape, planes, name or a.name)

    # -- the torch twin ------------------------------------------------------------------------
    def dequantize(self, rows: slice | torch.Tensor | None = None) -> torch.Tensor:
        """Float32 values of the selected rows (all: ``[*shape]``; else ``[r, K]``).

        Bit-identical to ``gguf.quants.dequantize`` of the file's bytes. Meant for references
        and tests: it materializes float32 for the rows asked for.
        """
        sel = slice(None) if rows is None else rows
        if self.is_float:
            out = self.planes["w"][sel].to(torch.float32)
        else:
            codes = _unpack_codes(self.planes, self.qtype, sel)
            out = _dequant_codes(codes, self.scale_planes(sel), self.qtype)
        return out.reshape(self.shape) if rows is None else out


# ----------------------------------------------------------------------------------------------
# test / benchmark inputs
# ----------------------------------------------------------------------------------------------

def random_gguf_blocks(qtype: int | str, shape: Sequence[int], seed: int = 0, scale: float = 0.02,
                       rng: np.random.Generator | None = None) -> np.ndarray:
    """Random *valid* GGUF block bytes for a tensor of ``shape`` (uint8 ``[..., row_bytes]``).

    Every code and sub-block scale bit is random; the fp16 block scales (``d``, ``dmin`` / ``m``)
    are finite normal(0, ``scale``) values (|d| for K-quant ``d``/``dmin`` and legacy ``d``), so
    the weights are of order ``scale * code``. Float types get normal(0, 1) values.
    """
    qt = qtype_id(qtype)
    rng = rng or np.random.default_rng(seed)
    shape = tuple(int(s) for s in shape)
    if qt in FLOAT_QTYPES:
        v = rng.standard_normal(shape).astype(np.float32)
        if qt == F32:
            return v.view(np.uint8).reshape(*shape[:-1], -1)
        if qt == F16:
            return v.astype(np.float16).view(np.uint8).reshape(*shape[:-1], -1)
        return (v.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(*shape[:-1], -1)
    bs, ts = BLOCK_SIZES[qt]
    n = math.prod(shape) // bs
    b = rng.integers(0, 256, size=(n, ts), dtype=np.uint8)
    for off in _F16_FIELDS[qt]:
        v = rng.standard_normal(n) * scale
        if qt >= Q2_K or off == 0:   # d, K-quant dmin: positive; legacy m (offset): any sign
            v = np.abs(v)
        b[:, off:off + 2] = v.astype(np.float16).view(np.uint8).reshape(n, 2)
    return b.reshape(*shape[:-1], shape[-1] // bs * ts)
