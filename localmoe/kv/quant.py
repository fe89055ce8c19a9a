"""Quantized KV-cache codecs: int8/int4/int3/int2 (asymmetric, grouped) and fp4 (E2M1, E4M3 scales).

These are the storage formats behind ``--kv-cache int8|int4|int3|int2|fp4`` and the PyTorch
*twins* of the Triton kernels in :mod:`localmoe.kernels.kv_quant_append` and
:mod:`localmoe.kernels.decode_attention`: the kernels must produce exactly these bytes and read
them back the same way.

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

**Per-channel keys** (KIVI, Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit
Quantization for KV Cache"; format option ``int4:c``, ``codec.channel``): for keys of the int
formats, one fp16 scale and zero per (page, head, channel) from the min/max of that channel over
the ``PAGE = block_size`` tokens of a cache page, codes as above. A page is quantized when its
last token is written; until then its tokens live only in the fp16 ring (ring size
``max(window, PAGE)``), which every read consults first. No rotation in this mode. Outliers
(``KVSpec.key_outliers()``, option ``koutliers=``; ``outliers=`` applies to values and
per-token keys) are chosen per page when it is quantized: for each token the ``n_out`` channels
whose exclusion shrinks their channel's page range most (:func:`select_channel_outliers`);
they are left out of the min/max, get code 0 (so their packed value is the channel's
``czero``) and are stored exactly in ``oidx``/``oval`` at the token's slot, the same entries as
per-token outliers (a read overwrites them; the decode kernel adds
``q[c] * (oval - czero[page, c])`` to the token's score instead). Error bound per value: half
a step of the channel's
range over the page, see :func:`channel_error_bound`.

Optional extras, all per :class:`~localmoe.kv.cache.KVSpec`:

* **Outliers** (dense-and-sparse, KVQuant, Hooper et al., 2024): per token and head the
  ``n_out = ceil(frac * head_dim)`` channels of largest ``|x|`` (per-token groups; per-channel
  keys: see above) are left out of the group's min/max and stored exactly as (uint8 index,
  fp16 value); a read overwrites them. ``frac`` is ``outlier_frac`` for values and
  ``KVSpec.key_outliers()`` for keys.
* **Sinks** (StreamingLLM, Xiao et al., 2023): positions ``< sink_tokens`` are also stored in
  fp16 in a per-sequence side buffer and read from there.
* **Recent window**: the last ``window`` written positions of a sequence are also kept in a
  per-sequence fp16 ring (slot ``pos % window``, tagged with ``pos``); a position whose tag
  matches is read from the ring. Tokens that age out are read from the quantized store, which
  is always written.
* **Key rotation** (optional, QuaRot-style): keys may be multiplied by a normalized Hadamard
  matrix ``H`` (orthogonal, symmetric) before quantization, which spreads outlier channels over
  all channels; ``read`` rotates back; the attention kernel rotates ``q`` instead (``qH . kH =
  q . k``). Off by default (see docs/KV-QUALITY.md for the measurement behind the choice).

Packed layout (all tensors head-major so one head's consecutive slots are contiguous for the
attention kernel; ``H = n_kv_heads``, ``D = head_dim``, ``S = n_slots``, ``NG = D / G``):

=============  =======================  =====================================================
key            shape, dtype             meaning
=============  =======================  =====================================================
``q``          [H, S, D*P/8] uint8      codes, P = plane bits (B, or 2 for int3)
``q_hi``       [H, S, D/8] uint8        int3 only: the third (high) bit of every code
``scale``      [H, S, NG] fp16 | uint8  int: fp16 scale; fp4: E4M3 scale byte (not per-channel)
``zero``       [H, S, NG] fp16          int only: group minimum (not per-channel)
``cscale``     [H, NB, D] fp16          per-channel keys: scale of (head, page, channel),
                                        NB = S // PAGE, page of a slot = ``slot // PAGE``
``czero``      [H, NB, D] fp16          per-channel keys: zero; ``x = code * cscale + czero``
``oidx``       [H, S, n_out] uint8      outlier channel indices (if outlier_frac > 0)
``oval``       [H, S, n_out] fp16       outlier values
``sink``       [R, H, n_sink, D] fp16   sink tokens of each sequence row (R = max_seqs)
``ring``       [R, H, W, D] fp16        recent-window ring per sequence row
``ring_pos``   [R, W] int32             position held by each ring entry (-1 = empty)
=============  =======================  =====================================================

Bit packing (split planes): with ``PACK = 8 / P`` codes per byte and ``RB = D / PACK`` bytes
per row, channel ``d`` lives in byte ``d % RB`` at bit offset ``(d // RB) * P`` (int4: byte j
holds channel j in the low nibble and channel j + D/2 in the high nibble; int2: channels j,
j + D/4, j + D/2, j + 3D/4 from the low bits up; the int3 ``q_hi`` plane is packed the same way
with P = 1). Plane ``i`` (``(byte >> i*P) & (2^P - 1)``) is channels ``i*RB .. (i+1)*RB - 1`` in
order, so a kernel unpacks with one shift and mask per plane, no register shuffles, and feeds
each plane to its own dot over that slice of head_dim.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import torch

from localmoe.errors import KVCacheFormatError
from localmoe.kv.cache import KVCodec, KVFormat, KVSpec, register_codec

QUANT_FORMATS = ("int8", "int4", "int3", "int2", "fp4")
FP4_GROUP = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E4M3_MAX = 448.0
E4M3_MIN_SUB = 2.0 ** -9
FP16_MAX = 65504.0

# Default key rotation in per-token mode: none (measured, see docs/KV-QUALITY.md). Set per
# codec with ``rotate=True``.
DEFAULT_KEY_ROTATE = False
# Smallest cache page (block size) for per-channel keys. The default key grouping that
# KVSpec.parse applies is kv_cache.DEFAULT_KEY_GROUPING (measured in docs/KV-QUALITY.md).
MIN_CHANNEL_PAGE = 4


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


def _outlier_frac(kv_spec: KVSpec, role: str) -> float:
    """Outlier fraction of the codec of ``role``: :meth:`KVSpec.key_outliers` for keys,
    ``outlier_frac`` for values (specs built without the keys' field count as per-token)."""
    if role == "k" and hasattr(kv_spec, "key_outliers"):
        return float(kv_spec.key_outliers())
    return float(kv_spec.outlier_frac)


def key_grouping(fmt: KVFormat, role: str) -> str:
    """Effective grouping (``"channel"`` or ``"token"``) of a codec of ``fmt`` in ``role``
    ("k"/"v"): ``"channel"`` when the format says so (``int4:c``; :meth:`KVSpec.parse` fills in
    ``kv_cache.DEFAULT_KEY_GROUPING`` for keys when the user names no grouping), else per token.

    Raises:
        KVCacheFormatError: per-channel grouping asked for values or for fp4.
    """
    g = getattr(fmt, "grouping", "") or ""
    if g == "channel":
        if fmt.name not in QUANT_FORMATS or fmt.name == "fp4":
            raise KVCacheFormatError(f"per-channel grouping needs an int format, not {fmt.name}")
        if role != "k":
            raise KVCacheFormatError("per-channel grouping applies to keys only (values are "
                                     "grouped per token)")
        return "channel"
    return "token"


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


# --------------------------------------------------------------------------------------------
# the codec
# --------------------------------------------------------------------------------------------
class QuantCodec(KVCodec):
    """Storage of K or V of one layer in a quantized format (see the module docstring).

    Args:
        fmt: KVFormat with name in :data:`QUANT_FORMATS`.
        n_kv_heads, head_dim: per-token shape ``[n_kv_heads, head_dim]``.
        kv_spec: the cache's KVSpec (outlier_frac, sink_tokens, window).
        role: ``"k"`` or ``"v"`` (only keys may be rotated or grouped per channel).
        max_seqs: sequence rows of the sink/window side buffers.
        rotate: Hadamard-rotate keys before quantization (default :data:`DEFAULT_KEY_ROTATE`
            for per-token keys with a power-of-two head_dim, never for values).
        block_size: tokens per cache page; per-channel keys keep one scale and zero per
            (page, head, channel).

    Attributes (besides the format's): ``channel`` (bool) keys are grouped per channel over
    each page (then ``block_size`` is the page, ``group == block_size`` tokens share a scale,
    ``n_out`` from ``KVSpec.key_outliers()``, ``rotate`` is False and ``window`` is the ring size
    ``max(kv_spec.window, block_size)``).

    Raises:
        KVCacheFormatError: group size does not divide head_dim, head_dim is not packable,
            per-channel grouping for values/fp4, with a Hadamard rotation, or with a block
            size below :data:`MIN_CHANNEL_PAGE`.
    """

    def __init__(self, fmt: KVFormat, n_kv_heads: int, head_dim: int, kv_spec: KVSpec, *,
                 role: str = "k", max_seqs: int = 1, rotate: bool | None = None,
                 block_size: int = 16):
        super().__init__(fmt, n_kv_heads, head_dim, kv_spec)
        if fmt.name not in QUANT_FORMATS:
            raise KVCacheFormatError(f"{fmt.name} is not a quantized KV format")
        self.bits = fmt.bits
        self.is_fp4 = fmt.name == "fp4"
        self.role = role
        self.block_size = int(block_size)
        self.channel = key_grouping(fmt, role) == "channel"
        self.group = FP4_GROUP if self.is_fp4 else min(fmt.group_size or 32, head_dim)
        if self.channel:
            if self.block_size < MIN_CHANNEL_PAGE:
                raise KVCacheFormatError(
                    f"per-channel keys ({fmt}) need a KV block size of at least "
                    f"{MIN_CHANNEL_PAGE} tokens, got {self.block_size}; use a larger block size "
                    f"or per-token keys ('{fmt.name}:t')")
            if rotate:
                raise KVCacheFormatError(
                    "per-channel keys are not Hadamard-rotated; use per-token keys "
                    f"('{fmt.name}:t') with rotate=True")
            rotate = False
            self.group = self.block_size
        if head_dim % 8 or (not self.channel and head_dim % self.group):
            raise KVCacheFormatError(
                f"KV format {fmt} needs head_dim ({head_dim}) to be a multiple of its group size "
                f"{self.group} and of 8; pick another group size (e.g. '{fmt.name}:g16')")
        self.max_seqs = max(1, int(max_seqs))
        pow2 = head_dim & (head_dim - 1) == 0
        if rotate is None:
            rotate = DEFAULT_KEY_ROTATE and role == "k" and pow2
        if rotate and (role != "k" or not pow2):
            raise KVCacheFormatError("Hadamard rotation applies to keys with a power-of-two head_dim")
        self.rotate = bool(rotate)
        self.n_out = outlier_count(_outlier_frac(kv_spec, role), head_dim)
        self.n_sink = int(kv_spec.sink_tokens)
        self.window = int(kv_spec.window)
        if self.channel:  # the ring must hold every token of a page that is not complete yet
            self.window = max(self.window, self.block_size)
        self.pbits = plane_bits(self.bits)
        self._had: dict[str, torch.Tensor] = {}

    # --- sizes ----------------------------------------------------------------------------
    @classmethod
    def bits_per_value(cls, fmt: KVFormat, head_dim: int, kv_spec: KVSpec, *, role: str = "k",
                       block_size: int = 16) -> float:
        """Stored bits per value with scales, zero points and outliers (sinks/window are per
        sequence and not counted here; see :meth:`side_bytes`). Per-token int: ``B + 32/G``;
        per-channel keys: ``B + 32/block_size`` (fp16 scale + zero per channel per page); plus
        ``24 * n_out / head_dim`` for outliers (uint8 index + fp16 value each)."""
        if fmt.name == "fp4":
            per = 4 + 8 / FP4_GROUP
        elif key_grouping(fmt, role) == "channel":
            per = fmt.bits + 32 / max(1, int(block_size))
        else:
            g = min(fmt.group_size or 32, head_dim)
            per = fmt.bits + 32 / g
        n_out = outlier_count(_outlier_frac(kv_spec, role), head_dim)
        return per + n_out * 24 / head_dim

    def side_bytes(self) -> int:
        """Bytes of the per-sequence fp16 sink and window buffers of this layer and kind."""
        per_row = (self.n_sink + self.window) * self.n_kv_heads * self.head_dim * 2 + self.window * 4
        return per_row * self.max_seqs

    # --- rotation -------------------------------------------------------------------------
    def hadamard(self, device: Any) -> torch.Tensor:
        """The rotation matrix float32 [D, D] on ``device`` (cached)."""
        key = str(device)
        if key not in self._had:
            self._had[key] = hadamard(self.head_dim, device)
        return self._had[key]

    # --- storage --------------------------------------------------------------------------
    def alloc(self, n_slots: int, device: Any) -> dict[str, torch.Tensor]:
        """Zeroed packed storage for ``n_slots`` slots (see the layout table).

        Raises:
            KVCacheFormatError: per-channel keys and ``n_slots`` not a multiple of the page.
        """
        h, d = self.n_kv_heads, self.head_dim
        ng = d // self.group
        dev = torch.device(device)
        st = {"q": torch.zeros(h, n_slots, d * self.pbits // 8, dtype=torch.uint8, device=dev)}
        if self.bits == 3:
            st["q_hi"] = torch.zeros(h, n_slots, d // 8, dtype=torch.uint8, device=dev)
        if self.channel:
            if n_slots % self.block_size:
                raise KVCacheFormatError(
                    f"per-channel key storage needs whole pages: {n_slots} slots is not a "
                    f"multiple of the block size {self.block_size}")
            nb = n_slots // self.block_size
            st["cscale"] = torch.zeros(h, nb, d, dtype=torch.float16, device=dev)
            st["czero"] = torch.zeros(h, nb, d, dtype=torch.float16, device=dev)
        elif self.is_fp4:
            st["scale"] = torch.zeros(h, n_slots, ng, dtype=torch.uint8, device=dev)
        else:
            st["scale"] = torch.zeros(h, n_slots, ng, dtype=torch.float16, device=dev)
            st["zero"] = torch.zeros(h, n_slots, ng, dtype=torch.float16, device=dev)
        if self.n_out:
            st["oidx"] = torch.zeros(h, n_slots, self.n_out, dtype=torch.uint8, device=dev)
            st["oval"] = torch.zeros(h, n_slots, self.n_out, dtype=torch.float16, device=dev)
        if self.n_sink:
            st["sink"] = torch.zeros(self.max_seqs, h, self.n_sink, d, dtype=torch.float16, device=dev)
        if self.window:
            st["ring"] = torch.zeros(self.max_seqs, h, self.window, d, dtype=torch.float16, device=dev)
            st["ring_pos"] = torch.full((self.max_seqs, self.window), -1, dtype=torch.int32, device=dev)
        return st

    def reset_row(self, store: dict[str, torch.Tensor], row: int) -> None:
        """Forget the window of sequence row ``row`` (called when a row is (re)assigned)."""
        if "ring_pos" in store:
            store["ring_pos"][row].fill_(-1)

    # --- quantize / dequantize rows (twins of the kernels) -----------------------------------
    def quantize_rows(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Quantize rows float [T, H, D] (already rotated if the codec rotates) into packed
        tensors shaped like the store entries but token-major ([T, H, ...])."""
        x = x.float()
        out: dict[str, torch.Tensor] = {}
        exclude = None
        if self.n_out:
            idx, exclude = select_outliers(x, self.n_out)
            out["oidx"] = idx.to(torch.uint8)
            out["oval"] = torch.gather(x, -1, idx).clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
        if self.is_fp4:
            codes, out["scale"] = quantize_fp4(x, exclude)
        else:
            codes, out["scale"], out["zero"] = quantize_int(x, self.bits, self.group, exclude)
        if self.bits == 3:
            out["q"] = pack_codes(codes & 3, 2)
            out["q_hi"] = pack_codes(codes >> 2, 1)
        else:
            out["q"] = pack_codes(codes, self.pbits)
        return out

    def _codes(self, q: torch.Tensor, q_hi: torch.Tensor | None) -> torch.Tensor:
        """uint8 codes [..., D] of packed bytes ``q`` [..., RB] (and ``q_hi``, int3 only)."""
        codes = unpack_codes(q, self.pbits)
        if self.bits == 3:
            codes = codes | (unpack_codes(q_hi, 1) << 2)
        return codes

    def dequantize_rows(self, p: dict[str, torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`quantize_rows` (before un-rotation): -> float32 [..., D]."""
        codes = self._codes(p["q"], p.get("q_hi"))
        if self.is_fp4:
            x = dequantize_fp4(codes, p["scale"])
        else:
            x = dequantize_int(codes, p["scale"], p["zero"], self.group)
        if self.n_out:
            x = x.scatter(-1, p["oidx"].long(), p["oval"].float())
        return x

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        """float32 copy of ``x`` [T, H, D], rotated when the codec rotates."""
        x = x.float()
        if self.rotate:
            x = x @ self.hadamard(x.device)
        return x

    _PACKED_KEYS = ("q", "q_hi", "scale", "zero", "oidx", "oval")

    def write(self, store: dict[str, torch.Tensor], slots: torch.Tensor, x: torch.Tensor,
              positions: torch.Tensor, seq_row: int | None = None, *,
              start: int | None = None) -> None:
        """Quantize and store ``x`` float [T, H, D] at ``slots`` LongTensor[T]; positions
        LongTensor[T] select sink/window tokens, whose fp16 copies go to row ``seq_row``
        (default 0) of the side buffers.

        ``start`` (Python int, optional): the caller guarantees ``positions == start ..
        start+T-1`` (:meth:`PagedKVCache.write` passes it). Then every position decision is
        made with Python ints and no value is read back from a device tensor (no host-device
        sync per layer and token on the GPU decode path); ``positions`` is not inspected. The
        bytes stored are the same as without it.

        Per-channel keys (``self.channel``): ``positions`` must be consecutive
        (``p0 .. p0+T-1``, one sequence) and ``slots`` their paged slots; see
        :meth:`write_channel`.
        """
        if self.channel:
            return self.write_channel(store, slots, x, positions, seq_row, start=start)
        packed = self.quantize_rows(self.prepare(x))
        for k, v in packed.items():
            store[k][:, slots] = v.transpose(0, 1)
        self.write_side(store, x, positions, seq_row, start=start)

    def write_side(self, store: dict[str, torch.Tensor], x: torch.Tensor, positions: torch.Tensor,
                   seq_row: int | None, *, start: int | None = None) -> None:
        """Copy sink and window tokens of ``x`` [T, H, D] (unrotated) to the fp16 side buffers.

        With ``start`` (positions are ``start .. start+T-1``) the sink range and the ring
        entries are plain slices computed from Python ints (no host-device sync); without it
        ``positions`` LongTensor[T] (any distinct positions) is inspected on the host as before.
        """
        if not (self.n_sink or self.window):
            return
        row = 0 if seq_row is None else int(seq_row)
        xh = x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
        if start is not None:
            s0, t = int(start), x.shape[0]
            if self.n_sink and s0 < self.n_sink:
                hi = min(s0 + t, self.n_sink)
                store["sink"][row][:, s0:hi] = xh[:hi - s0].transpose(0, 1)
            if self.window:
                w = self.window
                p = max(s0, s0 + t - w)          # the last w positions of the call
                while p < s0 + t:                # at most two runs (the ring wraps once)
                    r = p % w
                    n = min(w - r, s0 + t - p)
                    store["ring"][row][:, r:r + n] = xh[p - s0:p - s0 + n].transpose(0, 1)
                    store["ring_pos"][row][r:r + n] = torch.arange(
                        p, p + n, dtype=torch.int32, device=store["ring_pos"].device)
                    p += n
            return
        pos = positions.to(x.device).long()
        if self.n_sink:
            m = pos < self.n_sink
            if bool(m.any()):
                store["sink"][row][:, pos[m]] = xh[m].transpose(0, 1)
        if self.window:
            keep = pos >= pos.max() - self.window + 1 if pos.numel() else pos
            p = pos[keep]
            r = p % self.window
            store["ring"][row][:, r] = xh[keep].transpose(0, 1)
            store["ring_pos"][row][r] = p.to(torch.int32)

    def write_channel(self, store: dict[str, torch.Tensor], slots: torch.Tensor, x: torch.Tensor,
                      positions: torch.Tensor, seq_row: int | None = None, *,
                      start: int | None = None) -> None:
        """Per-channel key write (KIVI, Liu et al., 2024, grouped per cache page).

        Every new token goes to the fp16 ring (and sinks to the sink buffer). Each page that
        this call completes (a position ``p`` with ``(p + 1) % block_size == 0``) is quantized
        as a whole: for every (head, channel) an fp16 scale and zero from the min/max over the
        page's ``block_size`` tokens (:func:`quantize_channel`), codes packed into ``q``
        (``q_hi``) at the page's slots and ``cscale``/``czero`` at block ``slot // block_size``.
        Page tokens written by earlier calls are taken from the ring (or the sink buffer), or,
        when a truncation let the ring forget them, from the page's current codes (the page was
        complete before). Inputs are rounded to fp16 first, so one prefill and token-by-token
        decoding store the same bytes. Vectorized over pages (no loop over tokens).

        Args:
            store: this codec's storage (:meth:`alloc`).
            slots: LongTensor[T] slots of ``positions`` (page-aligned: position ``p`` at
                ``block * block_size + p % block_size``).
            x: float Tensor[T, H, D] new keys.
            positions: LongTensor[T], consecutive ``p0 .. p0+T-1``.
            seq_row: row of the sequence in the side buffers (default 0).
            start: optional Python int ``p0``, given by callers that know it
                (:meth:`PagedKVCache.write`, whose slots are page-aligned by construction):
                then neither ``positions`` nor ``slots`` is read back to the host (no
                consecutiveness or alignment check), so the decode path issues no host-device
                sync (same bytes as without it).

        Raises:
            ValueError: positions are not consecutive, or a slot does not sit at its position's
                offset in the page (both checked only without ``start``).
        """
        t = x.shape[0]
        if t == 0:
            return
        page = self.block_size
        dev = x.device
        if start is None:
            pos = positions.detach().to("cpu", torch.long)
            p0 = int(pos[0])
            if not torch.equal(pos, torch.arange(p0, p0 + t)):
                raise ValueError("per-channel keys need consecutive positions in one write")
        else:
            p0 = int(start)
        first_end = (p0 // page + 1) * page - 1            # first position completing a page
        n_pages = len(range(first_end, p0 + t, page))      # pages this call completes
        prior = None
        if n_pages and first_end - page + 1 < p0:
            # tokens of the first completed page written by earlier calls: read them before
            # this call's ring writes can overwrite their ring entries
            lo = first_end - page + 1
            pp = torch.arange(lo, p0, device=dev)
            blk0 = slots[first_end - p0].to(dev, torch.long) // page
            ps = blk0 * page + pp % page
            prior = self.read(store, ps, positions=pp, seq_row=seq_row,
                              start=None if start is None else lo)
        self.write_side(store, x, positions, seq_row, start=start)
        if not n_pages:
            return
        xh = x.float().clamp(-FP16_MAX, FP16_MAX).to(torch.float16).float()
        idx = torch.arange(first_end - p0, t, page, device=dev)  # in-call index of page ends
        end_slots = slots.to(dev).long()[idx]
        if start is None and bool(((end_slots % page) != page - 1).any()):
            raise ValueError("slots are not page-aligned with their positions")
        blocks = end_slots // page                               # [NP]
        off = torch.arange(page, device=dev)
        tok = idx[:, None] - (page - 1) + off                    # [NP, PAGE] in-call index
        vals = xh[tok.clamp(min=0)]                              # [NP, PAGE, H, D]
        if prior is not None:
            n_prior = prior.shape[0]
            vals[0, :n_prior] = prior.clamp(-FP16_MAX, FP16_MAX).to(torch.float16).float()
        exclude = None
        if self.n_out:
            oidx, exclude = select_channel_outliers(vals, self.n_out, exclude)
        codes, cscale, czero = quantize_channel(vals, self.bits, exclude)
        ss = (blocks[:, None] * page + off).reshape(-1)          # [NP * PAGE]
        if self.n_out:
            # outlier entries get code 0, so their packed value is the channel's zero: the
            # decode kernel adds ``q[c] * (oval - czero[c])`` per outlier instead of patching
            # the key tile (same result as the overwrite in dequantize_channel_slots)
            codes = codes.masked_fill(exclude, 0)
            oidx = oidx.reshape(-1, self.n_kv_heads, self.n_out)
            store["oidx"][:, ss] = oidx.transpose(0, 1).to(torch.uint8)
            oval = torch.gather(vals.reshape(-1, self.n_kv_heads, self.head_dim), -1, oidx)
            store["oval"][:, ss] = oval.transpose(0, 1).to(torch.float16)
        codes = codes.reshape(-1, self.n_kv_heads, self.head_dim).transpose(0, 1)  # [H, n, D]
        if self.bits == 3:
            store["q"][:, ss] = pack_codes(codes & 3, 2)
            store["q_hi"][:, ss] = pack_codes(codes >> 2, 1)
        else:
            store["q"][:, ss] = pack_codes(codes, self.pbits)
        store["cscale"][:, blocks] = cscale.transpose(0, 1)
        store["czero"][:, blocks] = czero.transpose(0, 1)

    def dequantize_channel_slots(self, store: dict[str, torch.Tensor], slots: torch.Tensor,
                                 aligned: bool = False) -> torch.Tensor:
        """Per-channel keys: ``code * cscale[h, slot // block_size, d] + czero[...]`` of the
        packed page codes at ``slots`` LongTensor[L] -> float32 [L, H, D] (side buffers not
        applied; slots of incomplete pages hold stale values).

        ``aligned``: the caller guarantees that ``slots`` are the tokens of consecutive
        positions from a page start, so each run of ``block_size`` slots is one whole page in
        order; those pages are then read as [block_size, RB] rows and scaled with one
        scale/zero row per page instead of one gathered per token (same values)."""
        P = self.block_size
        n = slots.shape[0]
        full = n // P * P if aligned else 0
        qh = store.get("q_hi")
        parts = []
        if full:
            blocks = slots[:full:P].long() // P                              # [NB]

            def pages(t):  # [H, S, X] -> the pages ``blocks`` as [H, NB, P, X]
                return t.view(t.shape[0], -1, P, t.shape[-1])[:, blocks]

            codes = self._codes(pages(store["q"]), pages(qh) if qh is not None else None)
            x = dequantize_channel(codes, store["cscale"][:, blocks, None],
                                   store["czero"][:, blocks, None])      # [H, NB, P, D]
            parts.append(x.reshape(x.shape[0], full, -1))
        if full < n or not parts:  # the rest (all of it when not aligned or empty)
            rest = slots[full:]
            b = rest.long() // P
            codes = self._codes(store["q"][:, rest], qh[:, rest] if qh is not None else None)
            parts.append(dequantize_channel(codes, store["cscale"][:, b], store["czero"][:, b]))
        x = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        if self.n_out:
            x = x.scatter(-1, store["oidx"][:, slots].long(), store["oval"][:, slots].float())
        return x.transpose(0, 1)

    def read(self, store: dict[str, torch.Tensor], slots: torch.Tensor,
             positions: torch.Tensor | None = None, seq_row: int | None = None, *,
             start: int | None = None) -> torch.Tensor:
        """Dequantized float32 [L, H, D] of ``slots`` LongTensor[L]. With ``positions`` (and
        ``seq_row``, default 0) sink and window tokens come from the fp16 side buffers: a
        sink position from ``sink``, a position whose ring tag matches from ``ring``,
        everything else from the packed store. Per-channel keys need ``positions``: the tokens
        of a page that is not complete yet exist only in the ring.

        ``start`` (Python int, optional, with ``positions``): the caller guarantees
        ``positions == start .. start+L-1``; the side buffers are then applied with slices and
        ``torch.where`` (no host-device sync), the same values as without it."""
        if self.channel:
            aligned = positions is not None and start is not None and \
                int(start) % self.block_size == 0
            x = self.dequantize_channel_slots(store, slots, aligned).contiguous()
        else:
            p = {k: store[k][:, slots].transpose(0, 1) for k in self._PACKED_KEYS if k in store}
            x = self.dequantize_rows(p)
        if self.rotate:
            x = x @ self.hadamard(x.device)  # H is symmetric and orthogonal: H^-1 = H
        if positions is not None and (self.n_sink or self.window) and start is not None:
            row = 0 if seq_row is None else int(seq_row)
            s0, n = int(start), x.shape[0]
            if self.n_sink and s0 < self.n_sink:
                hi = min(s0 + n, self.n_sink)
                x[:hi - s0] = store["sink"][row][:, s0:hi].transpose(0, 1).float()
            if self.window:
                pos = torch.arange(s0, s0 + n, device=x.device)
                r = pos % self.window
                m = store["ring_pos"][row][r].long() == pos
                if x.device.type == "cpu":  # copy only the ring's tokens (a sync costs nothing)
                    sel = m.nonzero().squeeze(1)
                    x[sel] = store["ring"][row][:, r[sel]].transpose(0, 1).float()
                else:
                    x = torch.where(m[:, None, None],
                                    store["ring"][row][:, r].transpose(0, 1).float(), x)
        elif positions is not None and (self.n_sink or self.window):
            row = 0 if seq_row is None else int(seq_row)
            pos = positions.to(x.device).long()
            if self.n_sink:
                m = pos < self.n_sink
                if bool(m.any()):
                    x[m] = store["sink"][row][:, pos[m]].transpose(0, 1).float()
            if self.window:
                r = pos % self.window
                m = store["ring_pos"][row][r].long() == pos
                if bool(m.any()):
                    x[m] = store["ring"][row][:, r[m]].transpose(0, 1).float()
        return x


for _name in QUANT_FORMATS:
    register_codec(_name, QuantCodec)
