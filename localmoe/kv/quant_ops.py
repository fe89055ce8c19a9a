"""Quantization arithmetic of the KV codecs: int (asymmetric, grouped), fp4 and bit packing.

These functions are the PyTorch *twins* of the Triton kernels in
:mod:`localmoe.kernels.kv_quant_append` and :mod:`localmoe.kernels.decode_attention`: the
kernels must produce exactly these bytes and read them back the same way. How the codes are laid
out in a cache store is :class:`~localmoe.kv.quant_codec.QuantCodec`'s business.

Quantization (per token, per kv head, groups of ``G`` consecutive channels of ``head_dim``):

* ``intB`` (B in 8, 4, 3, 2), asymmetric min/max as in KIVI (Liu et al., 2024):
  ``scale = (max - min) / (2^B - 1)`` and ``zero = min`` are stored as fp16; a code is
  ``c = clamp(floor((x - zero) / scale + 0.5), 0, 2^B - 1)`` computed with the *fp16-rounded*
  scale and zero, and ``x_hat = c * scale + zero``. Error bound per value:
  ``|x - x_hat| <= scale / 2`` plus fp16 rounding of ``zero`` (see :func:`int_error_bound`).
* ``fp4``: E2M1 codes (values 0, .5, 1, 1.5, 2, 3, 4, 6 and their negatives; OCP MX spec) with
  one E4M3 scale per 16 values (NVFP4 layout without the per-tensor scale):
  ``s = e4m3(absmax / 6)``, ``x_hat = s * e2m1(round_nearest(x / s))``. Error bound: half the
  E2M1 spacing at the value's magnitude times ``s`` (<= ``s``), see :func:`fp4_error_bound`.
* Per channel (KIVI keys, :func:`quantize_channel`): the same int rule with one group per
  (page, head, channel) over the page's tokens; :func:`select_channel_outliers` picks the
  dense-and-sparse outliers of a page (KVQuant, Hooper et al., 2024). Error bound: half a step
  of the channel's range over the page, see :func:`channel_error_bound`.
* Outliers per token (:func:`select_outliers`): the ``n_out`` channels of largest ``|x|``,
  left out of their group's min/max.
* Rotation: :func:`hadamard`, a normalized Sylvester Hadamard matrix (orthogonal, symmetric).

Bit packing (split planes): with ``P`` bits per code, ``PACK = 8 / P`` codes per byte and
``RB = D / PACK`` bytes per row, channel ``d`` lives in byte ``d % RB`` at bit offset
``(d // RB) * P`` (int4: byte j holds channel j in the low nibble and channel j + D/2 in the
high nibble; int2: channels j, j + D/4, j + D/2, j + 3D/4 from the low bits up; int3 is a 2-bit
plane plus a 1-bit plane of the high bits, packed the same way with P = 1). Plane ``i``
(``(byte >> i*P) & (2^P - 1)``) is channels ``i*RB .. (i+1)*RB - 1`` in order, so a kernel
unpacks with one shift and mask per plane, no register shuffles, and feeds each plane to its own
dot over that slice of head_dim.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import torch

__all__ = ["FP4_GROUP", "E2M1_VALUES", "E4M3_MAX", "E4M3_MIN_SUB", "FP16_MAX", "plane_bits",
           "pack_codes", "unpack_codes", "e4m3_encode", "e4m3_decode", "e2m1_encode",
           "e2m1_decode", "hadamard", "outlier_count", "select_outliers", "quantize_int",
           "dequantize_int", "quantize_fp4", "dequantize_fp4", "int_error_bound",
           "quantize_channel", "select_channel_outliers", "dequantize_channel",
           "channel_error_bound", "fp4_error_bound"]

FP4_GROUP = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E4M3_MAX = 448.0
E4M3_MIN_SUB = 2.0 ** -9
FP16_MAX = 65504.0


# --------------------------------------------------------------------------------------------
# bit packing
# --------------------------------------------------------------------------------------------
def plane_bits(bits: int) -> int:
    """Bits of the main code plane: ``bits`` itself, or 2 for int3 (whose third bit is a plane
    of its own)."""
    return 2 if bits == 3 else bits


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``bits``-bit codes (uint8 Tensor[..., D], values < 2**bits, bits in 1, 2, 4, 8)
    into uint8 Tensor[..., D*bits/8] using the split-plane layout of the module docstring:
    with ``RB = D*bits/8`` bytes per row, channel ``d`` lives in byte ``d % RB`` at bit
    ``(d // RB) * bits`` (int4: byte j holds channel j in the low nibble and channel j + D/2 in
    the high nibble).

    Raises:
        ValueError: D is not a multiple of 8/bits.
    """
    if bits == 8:
        return codes.to(torch.uint8)
    pack = 8 // bits
    d = codes.shape[-1]
    if d % pack:
        raise ValueError(f"head_dim {d} is not a multiple of {pack} for {bits}-bit packing")
    rb = d // pack
    c = codes.to(torch.int32).reshape(*codes.shape[:-1], pack, rb)
    shifts = (torch.arange(pack, device=codes.device, dtype=torch.int32) * bits).unsqueeze(-1)
    return (c << shifts).sum(dim=-2).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: uint8 Tensor[..., RB] -> uint8 Tensor[..., RB*8/bits]."""
    if bits == 8:
        return packed.to(torch.uint8)
    pack = 8 // bits
    p = packed.to(torch.uint8).unsqueeze(-2)  # [..., 1, RB]; byte shifts, no int32 copy
    c = torch.cat([(p >> (i * bits)) & ((1 << bits) - 1) for i in range(pack)], dim=-2)
    return c.reshape(*packed.shape[:-1], pack * packed.shape[-1])  # plane i = channels i*RB..


# --------------------------------------------------------------------------------------------
# scalar formats
# --------------------------------------------------------------------------------------------
def e4m3_encode(s: torch.Tensor) -> torch.Tensor:
    """Encode positive float32 scales as E4M3 (fn variant) bytes, round half up, saturating at
    448 and flushing below 2**-9 up to the smallest subnormal. Tensor[...] -> uint8 Tensor[...].

    Done with integer-exact float arithmetic so the Triton kernel reproduces it bit for bit.
    """
    s = s.float().clamp(E4M3_MIN_SUB, E4M3_MAX)
    e = (((s.view(torch.int32) >> 23) & 255) - 127).float()   # exact floor(log2(s))
    # normal: code = (e + 7) * 8 + round(s / 2^(e-3)) - 8, a mantissa that rounds up to 16
    # carries into the exponent by itself; subnormal (e < -6): code = round(s * 2^9)
    m = torch.floor(s * torch.exp2(3.0 - e) + 0.5)
    code = (e + 7.0) * 8.0 + m - 8.0
    code = torch.where(e < -6, torch.floor(s * 512.0 + 0.5), code)
    return code.clamp(0, 126).to(torch.uint8)


def e4m3_decode(c: torch.Tensor) -> torch.Tensor:
    """Decode E4M3 (fn) bytes to float32 (no NaN codes are ever produced by the encoder)."""
    c = c.to(torch.int32)
    e = (c >> 3) & 15
    m = (c & 7).float()
    normal = (8.0 + m) * torch.exp2(e.float() - 10.0)
    sub = m * E4M3_MIN_SUB
    return torch.where(e == 0, sub, normal)


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """Round float32 values (already divided by the scale) to the nearest E2M1 code (4 bits:
    sign, 2 exponent, 1 mantissa); magnitudes above 6 saturate. -> uint8 Tensor."""
    a = v.abs()
    mag = torch.zeros_like(a, dtype=torch.int32)
    for t in _E2M1_MIDPOINTS:
        mag += (a > t).to(torch.int32)
    sign = (v < 0).to(torch.int32) << 3
    return (mag | sign).to(torch.uint8)


def e2m1_decode(c: torch.Tensor) -> torch.Tensor:
    """Decode 4-bit E2M1 codes (uint8 Tensor) to float32."""
    c = c.to(torch.int32)
    mag = c & 7
    e = (mag >> 1).float()
    m = (mag & 1).float()
    val = torch.where(e == 0, m * 0.5, (1.0 + 0.5 * m) * torch.exp2(e - 1.0))
    return torch.where((c & 8) != 0, -val, val)


@lru_cache(maxsize=16)
def _hadamard_cpu(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def hadamard(n: int, device: Any = "cpu") -> torch.Tensor:
    """Normalized Sylvester Hadamard matrix float32 [n, n] (orthogonal and symmetric).

    Raises:
        ValueError: n is not a power of two.
    """
    if n <= 0 or n & (n - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two head_dim, got {n}")
    return _hadamard_cpu(n).to(device)


# --------------------------------------------------------------------------------------------
# row quantizers (the twins of the append kernel)
# --------------------------------------------------------------------------------------------
def outlier_count(outlier_frac: float, head_dim: int) -> int:
    """Outlier channels kept per token and head: ``ceil(outlier_frac * head_dim)`` (0 if off)."""
    if outlier_frac <= 0:
        return 0
    return min(head_dim // 4, max(1, math.ceil(outlier_frac * head_dim)))


def select_outliers(x: torch.Tensor, n_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``n_out`` channels by |x| of each row. x float32 [..., D] -> (idx int64 [..., n_out]
    in descending |x| order, ties to the lower index; mask bool [..., D])."""
    a = x.abs()
    idx = []
    mask = torch.zeros_like(x, dtype=torch.bool)
    for _ in range(n_out):
        i = torch.where(mask, torch.full_like(a, -1.0), a).argmax(dim=-1, keepdim=True)
        idx.append(i)
        mask.scatter_(-1, i, True)
    return torch.cat(idx, dim=-1), mask


def quantize_int(x: torch.Tensor, bits: int, group: int, exclude: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric grouped integer quantization of float32 rows.

    Args:
        x: float32 Tensor[..., D] (finite).
        bits: 2..8.
        group: channels per group (divides D).
        exclude: optional bool Tensor[..., D]; True channels (outliers) are left out of the
            group min/max (their codes are clamped and never read back).

    Returns:
        codes uint8 [..., D], scale fp16 [..., D/group], zero fp16 [..., D/group].
    """
    d = x.shape[-1]
    xg = x.float().clamp(-FP16_MAX, FP16_MAX).reshape(*x.shape[:-1], d // group, group)
    if exclude is not None:
        ex = exclude.reshape(xg.shape)
        mn = torch.where(ex, torch.full_like(xg, float("inf")), xg).amin(-1)
        mx = torch.where(ex, torch.full_like(xg, float("-inf")), xg).amax(-1)
    else:
        mn, mx = xg.amin(-1), xg.amax(-1)
    qmax = (1 << bits) - 1
    zero = mn.to(torch.float16)
    scale = ((mx - zero.float()) / qmax).clamp(max=FP16_MAX).to(torch.float16)
    s32 = scale.float()
    inv = torch.where(s32 > 0, 1.0 / s32, torch.zeros_like(s32))
    c = torch.floor((xg - zero.float().unsqueeze(-1)) * inv.unsqueeze(-1) + 0.5).clamp(0, qmax)
    return c.reshape(x.shape).to(torch.uint8), scale, zero


def dequantize_int(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int
                   ) -> torch.Tensor:
    """``codes * scale + zero`` per group: uint8 [..., D], fp16 [..., NG] x2 -> float32 [..., D]."""
    d = codes.shape[-1]
    c = codes.float().reshape(*codes.shape[:-1], d // group, group)
    return (c * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)).reshape(codes.shape)


def quantize_fp4(x: torch.Tensor, exclude: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """E2M1 quantization with an E4M3 scale per 16 channels.

    Args:
        x: float32 Tensor[..., D], D a multiple of 16.
        exclude: optional bool Tensor[..., D] of outlier channels left out of the absmax.

    Returns:
        codes uint8 [..., D] (4-bit values), scale uint8 [..., D/16] (E4M3 bytes).
    """
    d = x.shape[-1]
    xg = x.float().clamp(-FP16_MAX, FP16_MAX).reshape(*x.shape[:-1], d // FP4_GROUP, FP4_GROUP)
    a = xg.abs()
    if exclude is not None:
        a = torch.where(exclude.reshape(xg.shape), torch.zeros_like(a), a)
    sb = e4m3_encode(a.amax(-1) / 6.0)
    s = e4m3_decode(sb)
    codes = e2m1_encode(xg * (1.0 / s).unsqueeze(-1))
    return codes.reshape(x.shape), sb


def dequantize_fp4(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., D] and E4M3 scale bytes [..., D/16] -> float32 [..., D]."""
    d = codes.shape[-1]
    v = e2m1_decode(codes).reshape(*codes.shape[:-1], d // FP4_GROUP, FP4_GROUP)
    return (v * e4m3_decode(scale).unsqueeze(-1)).reshape(codes.shape)


def int_error_bound(x: torch.Tensor, bits: int, group: int,
                    exclude: torch.Tensor | None = None) -> torch.Tensor:
    """Analytic per-value bound of ``|x - dequant(quant(x))|`` for ``intB`` (float32 [..., D]):
    half a step ``(max - min) / (2^B - 1) / 2`` plus fp16 rounding of scale (times the top
    code) and of zero (relative 2^-11 each), plus a float32 slack."""
    d = x.shape[-1]
    xg = x.float().reshape(*x.shape[:-1], d // group, group)
    if exclude is not None:
        ex = exclude.reshape(xg.shape)
        mn = torch.where(ex, torch.full_like(xg, float("inf")), xg).amin(-1)
        mx = torch.where(ex, torch.full_like(xg, float("-inf")), xg).amax(-1)
    else:
        mn, mx = xg.amin(-1), xg.amax(-1)
    step = (mx - mn) / ((1 << bits) - 1)
    b = step * 0.5 * (1 + 2.0 ** -9) + (mn.abs() + mx.abs()) * 2.0 ** -10 + 1e-6
    return b.unsqueeze(-1).expand_as(xg).reshape(x.shape)


def quantize_channel(x: torch.Tensor, bits: int, exclude: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel asymmetric quantization of whole pages (KIVI keys, Liu et al., 2024): every
    (page, head, channel) gets its own fp16 scale and zero from the min/max over the page's
    tokens, with the same rounding rule as :func:`quantize_int`.

    Args:
        x: float Tensor[NP, PAGE, H, D] (NP pages of PAGE tokens; finite, already fp16-rounded
            by the caller if bit-exact agreement with fp16 inputs matters).
        bits: 2..8.
        exclude: optional bool Tensor[NP, PAGE, H, D] (or broadcastable): entries left out of
            their channel's min/max (outliers, sink tokens: read from elsewhere; their codes
            are clamped). A channel whose page entries are all excluded uses them all.

    Returns:
        codes uint8 [NP, PAGE, H, D], cscale fp16 [NP, H, D], czero fp16 [NP, H, D].
    """
    page = x.shape[1]
    xt = x.float().permute(0, 2, 3, 1)                       # [NP, H, D, PAGE]
    ex = None
    if exclude is not None:
        ex = exclude.expand(x.shape).permute(0, 2, 3, 1)
        ex = ex & ~ex.all(-1, keepdim=True)
    codes, scale, zero = quantize_int(xt, bits, page, ex)    # one group = the page's tokens
    return codes.permute(0, 3, 1, 2), scale[..., 0], zero[..., 0]


def select_channel_outliers(x: torch.Tensor, n_out: int, exclude: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense-and-sparse split for per-channel keys (KVQuant, Hooper et al., 2024): per token,
    the ``n_out`` channels whose exclusion shrinks their channel's min/max range over the page
    the most (greedy, ``n_out`` rounds; in each round a token that is the unique maximum or
    minimum of a channel scores the gap to the runner-up, every other entry scores 0).

    Args:
        x: float Tensor[NP, PAGE, H, D] pages of keys.
        n_out: outliers per token and head (< D).
        exclude: optional bool [NP, PAGE, H, D] entries already left out (sink tokens).

    Returns:
        (idx int64 [NP, PAGE, H, n_out] chosen channels, exclude bool [NP, PAGE, H, D] with
        them added).
    """
    xt = x.float().permute(0, 2, 3, 1)                       # [NP, H, D, PAGE]
    ex = (torch.zeros_like(xt, dtype=torch.bool) if exclude is None
          else exclude.expand(x.shape).permute(0, 2, 3, 1).clone())
    chosen = torch.zeros_like(ex)
    idx = []
    inf = float("inf")
    for _ in range(n_out):
        hi = torch.where(ex, -inf, xt).topk(2, dim=-1)
        lo = torch.where(ex, inf, xt).topk(2, dim=-1, largest=False)
        g_hi = torch.where(torch.isfinite(hi.values[..., 1]), hi.values[..., 0] - hi.values[..., 1], 0.0)
        g_lo = torch.where(torch.isfinite(lo.values[..., 1]), lo.values[..., 1] - lo.values[..., 0], 0.0)
        gain = torch.zeros_like(xt)
        gain.scatter_add_(-1, hi.indices[..., :1], g_hi[..., None])
        gain.scatter_add_(-1, lo.indices[..., :1], g_lo[..., None])
        gain = torch.where(chosen, -1.0, gain)               # a channel once per token
        d = gain.argmax(dim=2, keepdim=True)                 # [NP, H, 1, PAGE]
        chosen.scatter_(2, d, True)
        ex.scatter_(2, d, True)
        idx.append(d)
    out = torch.cat(idx, dim=2).permute(0, 3, 1, 2)          # [NP, PAGE, H, n_out]
    return out, ex.permute(0, 3, 1, 2)


def dequantize_channel(codes: torch.Tensor, cscale: torch.Tensor, czero: torch.Tensor
                       ) -> torch.Tensor:
    """``codes * cscale + czero`` element-wise: uint8 [..., D] with the scale and zero of each
    value's page and channel fp16 [..., D] (gathered by the caller) -> float32 [..., D]."""
    return codes.float() * cscale.float() + czero.float()


def channel_error_bound(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Analytic per-value bound of the per-channel round trip for float32 pages
    ``x`` [NP, PAGE, H, D]: :func:`int_error_bound` with the page's tokens of one channel as the
    group -> float32 [NP, PAGE, H, D]."""
    xt = x.float().permute(0, 2, 3, 1)
    return int_error_bound(xt, bits, x.shape[1]).permute(0, 3, 1, 2)


def fp4_error_bound(x: torch.Tensor, exclude: torch.Tensor | None = None) -> torch.Tensor:
    """Analytic per-value bound of ``|x - dequant(quant(x))|`` for ``fp4``: with the decoded
    E4M3 scale ``s`` (which may be up to 1/16 below absmax/6, so values may clip by that much),
    the E2M1 grid spacing around ``|x|/s`` is at most 2 (between 4 and 6), half-spacing 1 ->
    bound ``s * max(half_spacing(|x|/s), |x|/s - 6)`` plus the subnormal flush ``2^-9 * 0.25``."""
    d = x.shape[-1]
    xg = x.float().reshape(*x.shape[:-1], d // FP4_GROUP, FP4_GROUP)
    a = xg.abs()
    if exclude is not None:
        a = torch.where(exclude.reshape(xg.shape), torch.zeros_like(a), a)
    s = e4m3_decode(e4m3_encode(a.amax(-1) / 6.0)).unsqueeze(-1)
    r = xg.abs() / s
    half = torch.where(r <= 2.0, torch.full_like(r, 0.25),
                       torch.where(r <= 4.0, torch.full_like(r, 0.5), torch.ones_like(r)))
    b = s * torch.maximum(half, r - 6.0) * (1 + 1e-5) + 1e-7
    return b.reshape(x.shape)
