"""GGML blocks from numpy: :func:`quantize_blocks` (F16/BF16/Q4_0..Q8_0 through
``gguf.quants``, Q2_K..Q6_K, IQ4_NL and IQ4_XS through simple round-to-nearest quantizers, since
``gguf`` has none) and :func:`random_blocks` (random *valid* blocks of a given value spread, for
real geometries where quantizing billions of floats would take hours).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["quantize_blocks", "random_blocks"]


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales + 8 six-bit mins -> 12 bytes (inverse of ggml get_scale_min_k4)."""
    sc = sc.astype(np.uint8)
    mn = mn.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    return out


def _quant_k_asym(x: np.ndarray, nmax: int):
    """Shared Q4_K/Q5_K step: x [n, 8, 32] -> (d, dmin fp16 bytes, sc, mn, q in [0, nmax])."""
    n = x.shape[0]
    mn_v = np.minimum(x.min(-1), 0.0)
    mx_v = x.max(-1)
    scale = (mx_v - mn_v) / nmax
    minv = -mn_v
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (minv.max(-1) / 63).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.clip(np.rint(scale / d32), 0, 63), 0)
        mq = np.where(dmin32 > 0, np.clip(np.rint(minv / dmin32), 0, 63), 0)
        S = (d32 * sc)[..., None]
        M = (dmin32 * mq)[..., None]
        q = np.where(S > 0, np.clip(np.rint((x + M) / S), 0, nmax), 0).astype(np.uint8)
    head = np.concatenate([d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2),
                           _pack_k_scales(sc, mq)], axis=1)
    return head, q


def _quant_q4_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    head, q = _quant_k_asym(x.reshape(n, 8, 32), 15)
    q = q.reshape(n, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    return np.concatenate([head, qs], axis=1)


def _quant_q5_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    head, q = _quant_k_asym(x.reshape(n, 8, 32), 31)          # q [n, 8, 32]
    hi = (q >> 4) & 1
    qh = np.zeros((n, 32), dtype=np.uint8)
    for j in range(8):                                         # 8 bit planes (not a loop over blocks)
        qh |= hi[:, j] << j
    lo = (q & 0x0F).reshape(n, 4, 2, 32)
    qs = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(n, 128)
    return np.concatenate([head, qh, qs], axis=1)


def _quant_q6_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    xs = x.reshape(n, 16, 16)
    amax = np.abs(xs).max(-1)
    scale = amax / 31
    d = (scale.max(-1) / 127).astype(np.float16)
    d32 = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.clip(np.rint(scale / d32), -128, 127), 0).astype(np.int8)
        S = (d32 * sc.astype(np.float32))[..., None]
        q = np.where(S != 0, np.clip(np.rint(xs / S), -32, 31), 0).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(n, 2, 4, 32)               # [half, group, 32]
    lo = (q & 0x0F).reshape(n, 2, 2, 64)
    ql = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(n, 128)
    hi = (q >> 4) & 0x03                                       # [n, 2, 4, 32]
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(n, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(n, 2)], axis=1)


def _crumb_bytes(q: np.ndarray) -> np.ndarray:
    """2-bit codes [n, 256] -> Q2_K/Q3_K ``qs`` [n, 64] (value 128h+32s+l at bits 2s of
    qs[32h+l])."""
    n = q.shape[0]
    c = q.reshape(n, 2, 4, 32).astype(np.uint8)
    return (c[:, :, 0] | (c[:, :, 1] << 2) | (c[:, :, 2] << 4) | (c[:, :, 3] << 6)).reshape(n, 64)


def _quant_q2_k(x: np.ndarray) -> np.ndarray:
    """w = d*sc*q - dmin*m per 16 values, q in 0..3, 4-bit sc and m."""
    n = x.shape[0]
    xs = x.reshape(n, 16, 16)
    minv = -np.minimum(xs.min(-1), 0.0)
    scale = (xs.max(-1) + minv) / 3
    d = (scale.max(-1) / 15).astype(np.float16)
    dmin = (minv.max(-1) / 15).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.clip(np.rint(scale / d32), 0, 15), 0).astype(np.uint8)
        mq = np.where(dmin32 > 0, np.clip(np.rint(minv / dmin32), 0, 15), 0).astype(np.uint8)
        S = (d32 * sc)[..., None]
        M = (dmin32 * mq)[..., None]
        q = np.where(S > 0, np.clip(np.rint((xs + M) / S), 0, 3), 0).astype(np.uint8)
    return np.concatenate([sc | (mq << 4), _crumb_bytes(q.reshape(n, 256)),
                           d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2)], axis=1)


def _quant_q3_k(x: np.ndarray) -> np.ndarray:
    """w = d*(sc-32)*(q-4) per 16 values, q in 0..7 (its bit 2 in ``hmask``), 6-bit sc."""
    n = x.shape[0]
    xs = x.reshape(n, 16, 16)
    scale = np.abs(xs).max(-1) / 4
    d = (scale.max(-1) / 31).astype(np.float16)
    d32 = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.clip(np.rint(scale / d32), -32, 31), 0).astype(np.int16)
        S = (d32 * sc.astype(np.float32))[..., None]
        q = (np.where(S != 0, np.clip(np.rint(xs / S), -4, 3), 0) + 4).astype(np.uint8).reshape(n, 256)
    u = (sc + 32).astype(np.uint8)                               # 6-bit scales [n, 16]
    lo = u & 0x0F
    scales = np.concatenate([lo[:, 0:8] | (lo[:, 8:16] << 4),
                             ((u[:, 0:4] >> 4) | ((u[:, 4:8] >> 4) << 2) | ((u[:, 8:12] >> 4) << 4)
                              | ((u[:, 12:16] >> 4) << 6))], axis=1).astype(np.uint8)
    hbit = ((q >> 2) & 1).reshape(n, 8, 32)                      # value 32i+l -> bit i of hmask[l]
    hmask = np.zeros((n, 32), dtype=np.uint8)
    for i in range(8):                                           # 8 bit planes, not blocks
        hmask |= hbit[:, i] << i
    return np.concatenate([hmask, _crumb_bytes(q & 3), scales, d.view(np.uint8).reshape(n, 2)],
                          axis=1)


def _iq4_codes(xs: np.ndarray, dl: np.ndarray) -> np.ndarray:
    """Nearest entry of the IQ4_NL code book for ``xs / dl`` (``dl`` broadcast): [..] uint8."""
    from localmoe.io.dequant import IQ4_VALUES

    table = np.asarray(IQ4_VALUES, dtype=np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(dl != 0, xs / dl, 0.0)
    return np.abs(t[..., None] - table).argmin(-1).astype(np.uint8)


def _nibble_pairs(q: np.ndarray) -> np.ndarray:
    """Codes [..., 32] -> 16 bytes (value j in the low nibble of byte j, 16+j in the high)."""
    return (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)


def _quant_iq4_nl(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    xs = x.reshape(n, 32)
    # the code book spans -127..113: scale by the value of largest magnitude, mapped to -127
    amax_i = np.abs(xs).argmax(-1)
    d = (-xs[np.arange(n), amax_i] / 127).astype(np.float16)
    q = _iq4_codes(xs, d.astype(np.float32)[:, None])
    return np.concatenate([d.view(np.uint8).reshape(n, 2), _nibble_pairs(q)], axis=1)


def _quant_iq4_xs(x: np.ndarray) -> np.ndarray:
    """Per 32 values a 6-bit scale ls (w = d*(ls-32)*T[q]), one fp16 d per 256."""
    n = x.shape[0]
    xs = x.reshape(n, 8, 32)
    amax_i = np.abs(xs).argmax(-1)
    sub = -np.take_along_axis(xs, amax_i[..., None], -1)[..., 0] / 127      # [n, 8]
    d = (np.abs(sub).max(-1) / 31).astype(np.float16)
    d32 = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        ls = (np.where(d32 > 0, np.clip(np.rint(sub / d32), -32, 31), 0) + 32).astype(np.uint16)
    q = _iq4_codes(xs, (d32 * (ls.astype(np.float32) - 32))[..., None])
    lo = (ls & 0x0F).astype(np.uint8)
    scales_l = lo[:, 0::2] | (lo[:, 1::2] << 4)
    scales_h = np.zeros(n, dtype=np.uint16)
    for j in range(8):
        scales_h |= ((ls[:, j] >> 4) & 3) << (2 * j)
    return np.concatenate([d.view(np.uint8).reshape(n, 2), scales_h.view(np.uint8).reshape(n, 2),
                           scales_l, _nibble_pairs(q).reshape(n, 128)], axis=1)


_K_QUANTIZERS = {"Q2_K": _quant_q2_k, "Q3_K": _quant_q3_k, "Q4_K": _quant_q4_k,
                 "Q5_K": _quant_q5_k, "Q6_K": _quant_q6_k, "IQ4_NL": _quant_iq4_nl,
                 "IQ4_XS": _quant_iq4_xs}


def quantize_blocks(x: np.ndarray, qtype: str) -> np.ndarray:
    """Quantize float32 ``x`` (last dim a multiple of the block size) to GGML blocks.

    Uses ``gguf.quants.quantize`` where it exists (F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and
    this module's simple quantizers for Q2_K / Q3_K / Q4_K / Q5_K / Q6_K / IQ4_NL / IQ4_XS
    (round-to-nearest per sub-block, or to the nearest code-book entry for the IQ4 types; valid
    blocks whose ``gguf.quants.dequantize`` is close to ``x``, not llama.cpp's optimized
    search).

    Returns:
        ``np.ndarray`` (uint8 block bytes, shape ``(*x.shape[:-1], row_bytes)``) or, for F32/F16,
        the converted float array.
    """
    import gguf

    qt = gguf.GGMLQuantizationType[qtype]
    x = np.ascontiguousarray(x, dtype=np.float32)
    if qtype in _K_QUANTIZERS:
        bs, ts = gguf.GGML_QUANT_SIZES[qt]
        if x.shape[-1] % bs:
            raise ValueError(f"{qtype} needs rows that are a multiple of {bs}, got {x.shape}")
        blocks = _K_QUANTIZERS[qtype](x.reshape(-1, bs))
        return blocks.reshape(*x.shape[:-1], x.shape[-1] // bs * ts)
    return gguf.quants.quantize(x, qt)


def random_blocks(rng: np.random.Generator, qtype: str, shape: tuple[int, ...], std: float) -> np.ndarray:
    """Random *valid* blocks with value std ~ ``std`` (fast path for real geometries)."""
    import gguf

    qt = gguf.GGMLQuantizationType[qtype]
    bs, ts = gguf.GGML_QUANT_SIZES[qt]
    n = math.prod(shape) // bs
    b = np.frombuffer(rng.bytes(n * ts), dtype=np.uint8).reshape(n, ts).copy()

    def f16(v):
        return np.full((n, 1), v, dtype=np.float16).view(np.uint8)

    if qtype == "Q8_0":
        b[:, 0:2] = f16(std / 74.0)
    elif qtype == "Q4_0":
        b[:, 0:2] = f16(std / 4.6)
    elif qtype == "Q4_K":
        b[:, 0:2] = f16(std / (31.5 * 4.6 * 1.2))
        b[:, 2:4] = f16(std / (31.5 * 4.6 * 1.2) * 7.5)
    elif qtype == "Q5_K":
        b[:, 0:2] = f16(std / (31.5 * 9.2 * 1.2))
        b[:, 2:4] = f16(std / (31.5 * 9.2 * 1.2) * 15.5)
    elif qtype == "Q6_K":
        b[:, 208:210] = f16(std / (74.0 * 18.5))
    elif qtype == "Q2_K":
        b[:, 80:82] = f16(std / 14.0)
        b[:, 82:84] = f16(std / 14.0 * 1.5)
    elif qtype == "Q3_K":
        b[:, 108:110] = f16(std / (2.3 * 18.5))
    elif qtype in ("IQ4_NL", "IQ4_XS"):
        # code book rms ~66; IQ4_XS sub-block scales ls-32 have rms ~18.5
        b[:, 0:2] = f16(std / 66.0 if qtype == "IQ4_NL" else std / (66.0 * 18.5))
    else:
        raise ValueError(f"no random-block generator for {qtype}")
    return b.reshape(*shape[:-1], shape[-1] // bs * ts)
