"""GGML blocks from numpy: :func:`quantize_blocks` (F16/BF16/Q4_0..Q8_0 through
``gguf.quants``, Q4_K/Q5_K/Q6_K through simple round-to-nearest K-quant quantizers, since
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


_K_QUANTIZERS = {"Q4_K": _quant_q4_k, "Q5_K": _quant_q5_k, "Q6_K": _quant_q6_k}


def quantize_blocks(x: np.ndarray, qtype: str) -> np.ndarray:
    """Quantize float32 ``x`` (last dim a multiple of the block size) to GGML blocks.

    Uses ``gguf.quants.quantize`` where it exists (F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and
    this module's simple K-quant quantizers for Q4_K / Q5_K / Q6_K (round-to-nearest per
    sub-block with 6-bit (Q4_K/Q5_K) or int8 (Q6_K) sub-block scales; valid blocks whose
    ``gguf.quants.dequantize`` is close to ``x``, not llama.cpp's optimized search).

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
    else:
        raise ValueError(f"no random-block generator for {qtype}")
    return b.reshape(*shape[:-1], shape[-1] // bs * ts)
