"""Fused decode attention over a paged, packed (quantized) KV cache, split-K over the sequence.

Algorithm: flash-decoding (Dao et al., 2023; "Flash-Decoding for long-context inference").
Stage 1 runs one program per (sequence, kv head, split): the split's token range is walked in
tiles of ``BLOCK_N`` tokens; for each tile the slot of every token is looked up in the block
table (``slot = block_table[b, pos // PAGE] * PAGE + pos % PAGE``), the packed K and V rows are
loaded and dequantized *in registers* (no fp16 copy of the cache is ever materialized), scores
for all ``QPK = n_heads / n_kv_heads`` query heads of the kv head are computed with ``tl.dot``
(GQA: K/V are read once per kv head; ``swap_ab``: as ``k @ q.T`` so the heads are the mma's
N side, :func:`default_swap`), and an online softmax accumulates ``sum p * V``. Each
split writes its normalized partial output and its log2-sum-exp; stage 2 (the reduction
kernel, or with ``fused_reduce=True`` the last split of each (sequence, kv head) in the same
launch, ordered by an acq_rel atomic counter) merges the splits of every (sequence, query head).
With one split (and value planes of whole 32-channel blocks, not joined) the split program
writes the normalized output, and the O projection's int8 blocks, itself: no reduction
launch. Capping short contexts at one split to get there measured slower on the H200 (a
256-token bucket's programs walk two tiles in turn: 198 + 71 us of split and reduction per
token became 350 us, the step 2.085 -> 2.167 ms; ``decode_step_h200-2026-12-03-s15.json``), so
the split count is unchanged and this serves launches whose context fits one tile.

Sub-byte rows use the *split-plane* packing of :func:`localmoe.kv.quant_ops.pack_codes`: plane i of
a row (bits ``i*P .. i*P+P-1`` of every byte) holds channels ``i*RB .. i*RB+RB-1`` in order, so
each plane is unpacked with one shift and mask (no register shuffles), converted to fp16 with
bit tricks (``0x6400 | code`` is the fp16 number ``1024 + code``), scaled, and fed to its own
dot against the same channel slice of the query: ``q . k = sum_i q_i . k_i``. Value planes get
one accumulator each; the 4 planes of int2/int3 can instead be joined into one full-width tile
whose accumulator columns are permuted and un-permuted at the store (``v_join``; the launch
tables keep the planes apart since session 34, which measured that never slower).

Storage read (see :mod:`localmoe.kv.quant_codec` for the exact layout; one kernel, constexpr format):

* ``FMT=0`` float codec: ``data`` [S, H, D] f16/bf16/f32 (slot-major, any strides).
* ``FMT=1`` int codec, ``BITS`` in 8, 4, 3, 2, group ``G``: ``q`` uint8 [H, S, D*P/8] (P = 2 for
  int3), ``q_hi`` uint8 [H, S, D/8] (int3), ``scale``/``zero`` fp16 [H, S, D/G];
  ``x = code * scale + zero``.
* Per-channel keys (``CHAN``; KIVI, Liu et al., 2024): codes as above, ``cscale``/``czero``
  fp16 [H, S/PAGE, D] per (head, page, channel), ``x = code * cscale[h, slot // PAGE, d] +
  czero[...]``; tiles are page aligned and load one scale row per page; tokens of incomplete
  pages are in the ``ring`` (always present for such codecs).
* ``FMT=2`` fp4: ``q`` uint8 [H, S, D/2] E2M1 codes, ``scale`` uint8 [H, S, D/16] E4M3.
* Optional ``oidx`` uint8/``oval`` fp16 [H, S, N_OUT] outliers (overwrite their channels;
  per-channel keys: their codes are 0 and each adds ``q[c] * (oval - czero[c])`` to its
  token's score, :func:`_channel_outlier_scores`),
  ``sink`` fp16 [R, H, N_SINK, D], ``ring`` fp16 [R, H, N_RING, D] + ``ring_pos`` int32
  [R, N_RING] full-precision side buffers selected per token (only on tiles that can hold
  them: the first N_SINK and the last N_RING positions), and Hadamard-rotated keys (``ROT``:
  scores of quantized keys use the rotated query ``qH``).

Measured on the H200 (docs/KV-CACHE-FORMATS.md, benchmarks/results/attention_h200*.json): the
launch choices (tile, warps, programs per SM, transposed products, per-tile scale rows; data in
``kernels/configs/<device>.json`` read by :mod:`localmoe.kernels.launch_config`) and the choices
left off (L2 bulk prefetch, folding per-channel key scales into the query) come from
benchmarks/bench_attention.py sweeps.

On the GPU, int8/int4/int2 code bytes are unpacked by inline PTX (:func:`_ptx_codes`): four
codes per 32-bit register with ``prmt`` and ``sub.f16x2`` instead of one integer lane per code.

Units: ``sm_scale`` multiplies ``q . k``; ``sliding_window`` W > 0 restricts a sequence of
length L to positions ``>= L - W``. The twin is :func:`decode_attention_ref`.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from localmoe.kernels.launch_config import CHOICE_FIELDS, device_table
from localmoe.kernels.pdl import pdl_args, pdl_begin
from localmoe.kernels.quant_gemv import pack_store_blocks
from localmoe.kernels.host import cdiv, next_pow2
from localmoe.kernels.scratch import grown

LOG2E = 1.4426950408889634

@triton.jit
def _plane_codes(b, bh, cols, i: tl.constexpr, P: tl.constexpr, BITS: tl.constexpr,
                 RB1: tl.constexpr):
    """int32 codes [BN, RB] of plane ``i`` (channels ``cols``) from the row bytes ``b``
    (split-plane layout: plane i = bits i*P .. i*P+P-1 of every byte); int3 adds its third bit
    from ``bh`` (the q_hi bytes at ``cols % RB1``, bit ``cols // RB1``)."""
    if P == 8:
        c = b
    else:
        c = (b >> (i * P)) & ((1 << P) - 1)
    if BITS == 3:
        c = c | (((bh >> (cols // RB1)[None, :]) & 1) << 2)
    return c


def _ptx_codes(shift: int, mask: int | None) -> str:
    """PTX turning 4 code bytes (one 32-bit register ``$2``) into 4 fp16 code values (two
    f16x2 registers ``$0``, ``$1``): ``(byte >> shift) & mask`` placed under the fp16 exponent
    of 1024 with ``prmt`` (``0x64 : code`` is the fp16 number 1024 + code) and 1024 subtracted
    with one ``sub.f16x2`` per pair (exact)."""
    lines = ["{", ".reg .b32 t, k;"]
    src = "$2"
    if shift:
        lines.append(f"shr.u32 t, $2, {shift};")
        src = "t"
    if mask is not None:
        lines.append(f"and.b32 t, {src}, {mask:#x};")
        src = "t"
    lines += ["mov.b32 k, 0x64646464;", f"prmt.b32 $0, {src}, k, 0x4140;",
              f"prmt.b32 $1, {src}, k, 0x4342;", "mov.b32 k, 0x64006400;",
              "sub.f16x2 $0, $0, k;", "sub.f16x2 $1, $1, k;", "}"]
    return " ".join(lines)


def _ptx_e2m1(shift_left: int) -> str:
    """PTX turning 4 bytes (``$2``) whose high nibbles (after ``shl`` by ``shift_left``) are E2M1
    codes (OCP MX: sign, 2 exponent bits, 1 mantissa bit) into their 4 exact fp16 values (two
    f16x2 registers ``$0``, ``$1``). Every E2M1 magnitude is an fp16 number whose low byte is
    zero, so ``prmt`` looks the high byte up in an 8-entry byte table (magnitude = byte index)
    and the sign bit is moved to bit 15 with a second ``prmt``."""
    lines = ["{", ".reg .b32 x, m, s, t, la, lb, z;", "mov.b32 la, 0x3E3C3800;",
             "mov.b32 lb, 0x46444240;", "mov.b32 z, 0;"]
    if shift_left:
        lines.append(f"shl.b32 x, $2, {shift_left};")
    else:
        lines.append("mov.b32 x, $2;")
    lines += ["and.b32 m, x, 0x70707070;", "and.b32 s, x, 0x80808080;",
              "prmt.b32 $0, la, lb, m;", "prmt.b32 t, s, z, 0x1404;", "or.b32 $0, $0, t;",
              "shr.u32 m, m, 16;", "prmt.b32 $1, la, lb, m;", "prmt.b32 t, s, z, 0x3424;",
              "or.b32 $1, $1, t;", "}"]
    return " ".join(lines)


# one string per (bits, plane) of the split-plane layout, constexpr for the JIT
_ASM_B8 = tl.constexpr(_ptx_codes(0, None))
_ASM_B4_0 = tl.constexpr(_ptx_codes(0, 0x0F0F0F0F))
_ASM_B4_1 = tl.constexpr(_ptx_codes(4, 0x0F0F0F0F))
_ASM_B2_0 = tl.constexpr(_ptx_codes(0, 0x03030303))
_ASM_B2_1 = tl.constexpr(_ptx_codes(2, 0x03030303))
_ASM_B2_2 = tl.constexpr(_ptx_codes(4, 0x03030303))
_ASM_B2_3 = tl.constexpr(_ptx_codes(6, 0x03030303))
_ASM_FP4_0 = tl.constexpr(_ptx_e2m1(4))
_ASM_FP4_1 = tl.constexpr(_ptx_e2m1(0))


@triton.jit
def _asm_plane(b, i: tl.constexpr, P: tl.constexpr, FP4: tl.constexpr):
    """fp16 values of plane ``i`` of the uint8 row bytes ``b``, four bytes per PTX block: int
    codes of ``P`` bits (:func:`_ptx_codes`) or, with ``FP4``, E2M1 values of the low (0) or
    high (1) nibbles (:func:`_ptx_e2m1`). A pure unary op, so Triton moves its layout
    conversion to the (2-4x smaller) bytes in front of it."""
    if FP4:
        asm: tl.constexpr = _ASM_FP4_0 if i == 0 else _ASM_FP4_1
    elif P == 8:
        asm: tl.constexpr = _ASM_B8
    elif P == 4:
        asm: tl.constexpr = _ASM_B4_0 if i == 0 else _ASM_B4_1
    elif i == 0:
        asm: tl.constexpr = _ASM_B2_0
    elif i == 1:
        asm: tl.constexpr = _ASM_B2_1
    elif i == 2:
        asm: tl.constexpr = _ASM_B2_2
    else:
        asm: tl.constexpr = _ASM_B2_3
    return tl.inline_asm_elementwise(asm, "=r,=r,r", [b], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _codes_f16(b, bh, cols, i: tl.constexpr, P: tl.constexpr, BITS: tl.constexpr,
               RB1: tl.constexpr, ASM: tl.constexpr):
    """fp16 codes [BN, RB] of plane ``i`` of an int format from the uint8 row bytes ``b``:
    inline PTX on the GPU (``ASM``; not int3), else :func:`_plane_codes` and the fp16 magic
    (``0x6400 | c`` is the fp16 number 1024 + c)."""
    if ASM and BITS != 3:
        cf = _asm_plane(b, i, P, False)
    else:
        c = _plane_codes(b.to(tl.int32), bh, cols, i, P, BITS, RB1)
        cf = (c | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
    return cf


@triton.jit
def _pick2(y, b: tl.constexpr):
    """Half ``b`` (0 or 1) of the last dimension (size 2) of ``y``."""
    y0, y1 = tl.split(y)
    if b == 0:
        r = y0
    else:
        r = y1
    return r


@triton.jit
def _col_block(x, BN: tl.constexpr, NG: tl.constexpr, W: tl.constexpr, i: tl.constexpr):
    """Columns ``i*W .. i*W+W-1`` of ``x`` [BN, NG] as [BN, W], with reshapes and splits that
    stay in registers when each thread holds whole rows (NG / W in 1, 2, 4: a plane's groups,
    or one group of a plane at most as wide as a group, out of at most 4 planes)."""
    N: tl.constexpr = NG // W
    if N == 1:
        y = x
    else:
        y = tl.permute(tl.reshape(x, [BN, N, W]), (0, 2, 1))          # [BN, W, N]
        if N == 2:
            y = _pick2(y, i)
        else:
            y = _pick2(_pick2(tl.reshape(y, [BN, W, 2, 2]), i % 2), i // 2)
    return y


@triton.jit
def _dequant_plane(c, row, blk, h, n_blocks, cols, mask_n, Sp, Zp, OIp, OVp, sa, za,
                   i: tl.constexpr, BN: tl.constexpr, RB: tl.constexpr, D: tl.constexpr,
                   FMT: tl.constexpr, G: tl.constexpr, CHAN: tl.constexpr, N_OUT: tl.constexpr,
                   PAGE: tl.constexpr, ASM: tl.constexpr, PRE: tl.constexpr):
    """fp16 [BN, RB] values of plane ``i`` from its codes ``c`` (:func:`_tile_codes`)."""
    m2 = mask_n[:, None]
    if FMT == 2:
        # E2M1 -> fp16 bits without conversions: (e1 e0 m) with e > 0 is exponent e + 14,
        # mantissa m, i.e. bits (mag + 28) << 9; mag 1 is 0.5 (0x3800); sign to bit 15
        if ASM:
            val = c
        else:
            mag = c & 7
            hb = tl.where(mag >= 2, (mag + 28) << 9, tl.where(mag == 1, 0x3800, 0)) | ((c & 8) << 12)
            val = hb.to(tl.int16).to(tl.float16, bitcast=True)
        NG: tl.constexpr = D // G
        NGP: tl.constexpr = RB // G
        sc = tl.load(Sp + row[:, None] * NG + (i * NGP + tl.arange(0, NGP))[None, :], mask=m2,
                     other=0).to(tl.int16)
        # E4M3 scale (positive) -> fp16 exactly: the bits 0eeeemmm shifted left by 7 are the
        # fp16 number value * 2^-8 (normals and subnormals alike; both biases differ by 8)
        s = ((sc & 0x7F) << 7).to(tl.float16, bitcast=True) * 256.0
        if NGP == 1:
            x = val * s
        else:
            x = val * tl.reshape(tl.broadcast_to(s[:, :, None], [BN, NGP, G]), [BN, RB])
    else:
        cf = c  # fp16 codes (:func:`_codes_f16`)
        if CHAN:
            # per-channel keys: scale and zero of (head, page, channel), one row per page of
            # the tile (``blk`` = the tile's NPG page blocks, tiles are page aligned),
            # broadcast over the page's tokens
            NPG: tl.constexpr = BN // PAGE if BN >= PAGE else 1
            TPP: tl.constexpr = BN // NPG
            pr = (h * n_blocks + blk)[:, None] * D + cols[None, :]
            s = tl.load(Sp + pr)
            z = tl.load(Zp + pr)
            s = tl.reshape(tl.broadcast_to(s[:, None, :], [NPG, TPP, RB]), [BN, RB])
            z = tl.reshape(tl.broadcast_to(z[:, None, :], [NPG, TPP, RB]), [BN, RB])
            x = cf * s + z
        else:
            NG: tl.constexpr = D // G
            if G >= RB:
                gi: tl.constexpr = (i * RB) // G
                if PRE:
                    s = tl.reshape(_col_block(sa, BN, NG, 1, gi), [BN])
                    z = tl.reshape(_col_block(za, BN, NG, 1, gi), [BN])
                else:
                    s = tl.load(Sp + row * NG + gi, mask=mask_n, other=0.0)
                    z = tl.load(Zp + row * NG + gi, mask=mask_n, other=0.0)
                x = cf * s[:, None] + z[:, None]
            else:
                NGP: tl.constexpr = RB // G
                if PRE:
                    s = _col_block(sa, BN, NG, NGP, i)
                    z = _col_block(za, BN, NG, NGP, i)
                else:
                    gg = (i * NGP + tl.arange(0, NGP))[None, :]
                    s = tl.load(Sp + row[:, None] * NG + gg, mask=m2, other=0.0)
                    z = tl.load(Zp + row[:, None] * NG + gg, mask=m2, other=0.0)
                s = tl.reshape(tl.broadcast_to(s[:, :, None], [BN, NGP, G]), [BN, RB])
                z = tl.reshape(tl.broadcast_to(z[:, :, None], [BN, NGP, G]), [BN, RB])
                x = cf * s + z
    for j in tl.static_range(0 if CHAN else N_OUT):
        oi = tl.load(OIp + row * N_OUT + j, mask=mask_n, other=0).to(tl.int32)
        ov = tl.load(OVp + row * N_OUT + j, mask=mask_n, other=0.0).to(tl.float16)
        x = tl.where(cols[None, :] == oi[:, None], ov[:, None], x)
    return x


@triton.jit
def _tile_codes(b, bh, cols, i: tl.constexpr, P: tl.constexpr, BITS: tl.constexpr,
                RB1: tl.constexpr, FMT: tl.constexpr, ASM: tl.constexpr):
    """Codes of plane ``i`` in the form :func:`_dequant_plane` takes (fp16 code values for int
    formats; fp4: the fp16 E2M1 values with ``ASM``, else the int32 codes)."""
    if FMT == 2:
        if ASM:
            c = _asm_plane(b, i, 4, True)
        else:
            c = _plane_codes(b.to(tl.int32), bh, cols, i, P, BITS, RB1)
    else:
        c = _codes_f16(b, bh, cols, i, P, BITS, RB1, ASM)
    return c


@triton.jit
def _load_kv_tile(Qp, QHp, Sp, Zp, OIp, OVp, h, slots, blk, mask_n, n_slots, n_blocks, sqh, sqs,
                  BN: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr, BITS: tl.constexpr,
                  G: tl.constexpr, CHAN: tl.constexpr, N_OUT: tl.constexpr, PAGE: tl.constexpr,
                  ASM: tl.constexpr, PRE: tl.constexpr):
    """Dequantized fp16 planes (up to 4 tensors [BN, D/NPL]; NPL = number of planes: 1 for
    float and int8, 2 for int4/fp4, 4 for int3/int2; unused outputs repeat plane 0) of kv head
    ``h`` at ``slots`` (int [BN]); ``blk``: per-channel keys only, int [NPG] blocks of the
    tile's pages."""
    m2 = mask_n[:, None]
    if FMT == 0:
        d = tl.arange(0, D)
        x0 = tl.load(Qp + h * sqh + slots[:, None] * sqs + d[None, :], mask=m2, other=0.0)
        x0 = x0.to(tl.float16)
        x1 = x0
        x2 = x0
        x3 = x0
    else:
        row = h * n_slots + slots
        P: tl.constexpr = 2 if BITS == 3 else BITS
        NPL: tl.constexpr = 8 // P
        RB: tl.constexpr = D // NPL
        RB1: tl.constexpr = D // 8
        cb = tl.arange(0, RB)
        b = tl.load(Qp + row[:, None] * RB + cb[None, :], mask=m2, other=0)
        if BITS == 3:
            bh = tl.load(QHp + row[:, None] * RB1 + (cb % RB1)[None, :], mask=m2,
                         other=0).to(tl.int32)
        else:
            bh = b
        # per-token int scales and zeros: one [BN, D/G] load each for all planes (``PRE``)
        # instead of one narrow strided load per plane
        PRE1: tl.constexpr = PRE and FMT == 1 and not CHAN and (D // G) <= 8
        if PRE1:
            ga = tl.arange(0, D // G)
            sa = tl.load(Sp + row[:, None] * (D // G) + ga[None, :], mask=m2, other=0.0)
            za = tl.load(Zp + row[:, None] * (D // G) + ga[None, :], mask=m2, other=0.0)
        else:
            sa = row
            za = row
        c0 = _tile_codes(b, bh, cb, 0, P, BITS, RB1, FMT, ASM)
        x0 = _dequant_plane(c0, row, blk, h, n_blocks, cb, mask_n, Sp, Zp, OIp, OVp, sa, za, 0, BN,
                            RB, D, FMT, G, CHAN, N_OUT, PAGE, ASM, PRE1)
        x1 = x0
        x2 = x0
        x3 = x0
        if NPL >= 2:
            c1 = _tile_codes(b, bh, cb + RB, 1, P, BITS, RB1, FMT, ASM)
            x1 = _dequant_plane(c1, row, blk, h, n_blocks, cb + RB, mask_n, Sp, Zp, OIp, OVp, sa,
                                za, 1, BN, RB, D, FMT, G, CHAN, N_OUT, PAGE, ASM, PRE1)
        if NPL >= 4:
            c2 = _tile_codes(b, bh, cb + 2 * RB, 2, P, BITS, RB1, FMT, ASM)
            x2 = _dequant_plane(c2, row, blk, h, n_blocks, cb + 2 * RB, mask_n, Sp, Zp, OIp, OVp,
                                sa, za, 2, BN, RB, D, FMT, G, CHAN, N_OUT, PAGE, ASM, PRE1)
            c3 = _tile_codes(b, bh, cb + 3 * RB, 3, P, BITS, RB1, FMT, ASM)
            x3 = _dequant_plane(c3, row, blk, h, n_blocks, cb + 3 * RB, mask_n, Sp, Zp, OIp, OVp,
                                sa, za, 3, BN, RB, D, FMT, G, CHAN, N_OUT, PAGE, ASM, PRE1)
    return x0, x1, x2, x3


@triton.jit
def _side_mask(Ring, RingPos, srow, pos, mask_n, N_SINK: tl.constexpr, N_RING: tl.constexpr):
    """Which tokens of a tile come from the fp16 side buffers: (is_sink, is_ring, ring index)."""
    is_s = mask_n & (pos < N_SINK)
    if N_RING > 0:
        r = pos % N_RING
        tag = tl.load(RingPos + srow * N_RING + r, mask=mask_n, other=-1)
        is_r = mask_n & (tag == pos) & (~is_s)
    else:
        r = pos
        is_r = pos < 0
    return is_s, is_r, r


@triton.jit
def _side_plane(x, Sink, Ring, srow, h, pos, is_s, is_r, r, cols,
                H: tl.constexpr, D: tl.constexpr, N_SINK: tl.constexpr, N_RING: tl.constexpr):
    """Plane ``x`` [BN, len(cols)] with sink/ring tokens replaced by their fp16 copies."""
    if N_SINK > 0:
        ps = tl.where(is_s, pos, 0)
        xs = tl.load(Sink + ((srow * H + h) * N_SINK + ps)[:, None] * D + cols[None, :],
                     mask=is_s[:, None], other=0.0)
        x = tl.where(is_s[:, None], xs.to(tl.float16), x)
    if N_RING > 0:
        xr = tl.load(Ring + ((srow * H + h) * N_RING + r)[:, None] * D + cols[None, :],
                     mask=is_r[:, None], other=0.0)
        x = tl.where(is_r[:, None], xr.to(tl.float16), x)
    return x


@triton.jit
def _side_planes(x0, x1, x2, x3, Sink, Ring, srow, h, pos, is_s, is_r, r, cols,
                 RB: tl.constexpr, NPL: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                 N_SINK: tl.constexpr, N_RING: tl.constexpr):
    """The ``NPL`` planes ``x*`` [BN, RB] (channels ``cols + i * RB``) with their sink/ring
    tokens replaced by the fp16 copies (:func:`_side_plane`)."""
    x0 = _side_plane(x0, Sink, Ring, srow, h, pos, is_s, is_r, r, cols, H, D, N_SINK, N_RING)
    if NPL >= 2:
        x1 = _side_plane(x1, Sink, Ring, srow, h, pos, is_s, is_r, r, cols + RB, H, D, N_SINK,
                         N_RING)
    if NPL >= 4:
        x2 = _side_plane(x2, Sink, Ring, srow, h, pos, is_s, is_r, r, cols + 2 * RB, H, D,
                         N_SINK, N_RING)
        x3 = _side_plane(x3, Sink, Ring, srow, h, pos, is_s, is_r, r, cols + 3 * RB, H, D,
                         N_SINK, N_RING)
    return x0, x1, x2, x3


@triton.jit
def _join4(x0, x1, x2, x3, BN: tl.constexpr, D: tl.constexpr):
    """The 4 planes [BN, D/4] joined into one [BN, D] tile; column c holds channel
    ``(2 * (c % 2) + (c // 2) % 2) * D/4 + c // 4`` (:func:`_join_perm`)."""
    return tl.reshape(tl.join(tl.join(x0, x1), tl.join(x2, x3)), [BN, D])


@triton.jit
def _join_perm(D: tl.constexpr):
    """int32 [D]: the channel each column of a :func:`_join4` tile holds."""
    c = tl.arange(0, D)
    return (2 * (c % 2) + (c // 2) % 2) * (D // 4) + c // 4


@triton.jit
def _dot_t(q, k, NARROW: tl.constexpr, SWAP: tl.constexpr):
    """``q @ k.T`` in fp32 for q [BLOCK_H, n] and k [BN, n] fp16: ``tl.dot``, or for ``NARROW``
    planes (n < 16, below ``tl.dot``'s minimum on the GPU) a broadcast multiply and sum;
    ``SWAP`` (not with ``NARROW``): ``k @ q.T`` instead, the transpose ([BN, BLOCK_H])."""
    if NARROW:
        s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
    elif SWAP:
        s = tl.dot(k, tl.trans(q))
    else:
        s = tl.dot(q, tl.trans(k))
    return s


@triton.jit
def _plane_scores(q0, q1, q2, q3, k0, k1, k2, k3, NPL: tl.constexpr, NARROW: tl.constexpr,
                  SWAP: tl.constexpr):
    """Scores [BLOCK_H, BN] of the query planes ``q*`` against the ``NPL`` key planes ``k*``
    (one product per plane, :func:`_dot_t`). ``SWAP``: each product is computed as
    ``k @ q.T`` (the key tile is the mma's M side and the query heads its N side, so 8 heads
    need no padding to 16 rows) and the sum is transposed once."""
    T: tl.constexpr = SWAP and not NARROW
    s = _dot_t(q0, k0, NARROW, T)
    if NPL >= 2:
        s += _dot_t(q1, k1, NARROW, T)
    if NPL >= 4:
        s += _dot_t(q2, k2, NARROW, T)
        s += _dot_t(q3, k3, NARROW, T)
    if T:
        s = tl.trans(s)
    return s


@triton.jit
def _pv(acc, alpha, pf, v, SWAP: tl.constexpr):
    """Online-softmax update ``acc * alpha + pf @ v`` for pf fp16 [BLOCK_H, BN] and v fp16
    [BN, n]; ``SWAP``: ``acc`` is held transposed, [n, BLOCK_H], and gets ``v.T @ pf.T``."""
    if SWAP:
        r = acc * alpha[None, :] + tl.dot(tl.trans(v), tl.trans(pf))
    else:
        r = acc * alpha[:, None] + tl.dot(pf, v)
    return r


@triton.jit
def _store_acc(MidO, base, cols, acc, inv, hmask, DV: tl.constexpr, SWAP: tl.constexpr):
    """Store ``acc * inv`` (an accumulator of :func:`_pv`: [BLOCK_H, n], or [n, BLOCK_H] with
    ``SWAP``) at the columns ``cols`` (int [n]) of the partial-output rows ``base``
    (int [BLOCK_H])."""
    if SWAP:
        tl.store(MidO + base[None, :] * DV + cols[:, None], acc * inv[None, :],
                 mask=hmask[None, :])
    else:
        tl.store(MidO + base[:, None] * DV + cols[None, :], acc * inv[:, None],
                 mask=hmask[:, None])


@triton.jit
def _load_q(Qry, b, qh, hmask, stride_qb, stride_qh, qk_scale, c):
    """Query channels ``c`` (int32 [n]), scaled, fp16 [BLOCK_H, n]."""
    q = tl.load(Qry + b * stride_qb + qh[:, None] * stride_qh + c[None, :], mask=hmask[:, None],
                other=0.0).to(tl.float32)
    return (q * qk_scale).to(tl.float16)


@triton.jit
def _channel_outlier_scores(Qry, OI, OV, Zp, b, h, qh, hmask, blk, slots, mask_n, n_slots,
                            n_blocks, stride_qb, stride_qh, qk_scale, D: tl.constexpr,
                            N_OUT: tl.constexpr, BLOCK_H: tl.constexpr,
                            BLOCK_N: tl.constexpr, NOP: tl.constexpr, QPK: tl.constexpr,
                            QPK_P: tl.constexpr):
    """Score corrections [BLOCK_H, BLOCK_N] of the outlier entries of per-channel keys: their
    codes are 0, so the key tile holds the channel's zero ``czero[h, page, c]`` there; add
    ``q[c] * (oval - czero[h, page, c])`` per outlier, with the query columns gathered per
    token and outlier from global memory (L1-resident) for the ``QPK`` real query heads only,
    instead of patching elements of the key tile (H200, 8 x 64k, int4 keys with 4 outliers per
    token: 1076 us with the patch, 441 us with one gather per outlier over all 16 tile rows,
    406 us with one gather for all outliers, 320-330 us with the real heads only; 196 us
    without outliers; docs/KV-QUALITY.md)."""
    row = h * n_slots + slots
    zrow = (h * n_blocks + blk) * D
    jj = tl.arange(0, NOP)
    m2 = mask_n[:, None] & (jj < N_OUT)[None, :]
    oi = tl.load(OI + row[:, None] * N_OUT + jj[None, :], mask=m2, other=0).to(tl.int32)
    ov = tl.load(OV + row[:, None] * N_OUT + jj[None, :], mask=m2, other=0.0).to(tl.float32)
    z = tl.load(Zp + zrow[:, None] + oi, mask=m2, other=0.0).to(tl.float32)
    dlt = (ov - z) * qk_scale
    if QPK_P * 2 == BLOCK_H or QPK_P * 4 == BLOCK_H:
        # gather only the QPK real query heads, then pad the rows up to BLOCK_H with zeros
        hr = tl.arange(0, QPK_P)
        qg = tl.load(Qry + b * stride_qb + (h * QPK + hr)[:, None, None] * stride_qh
                     + oi[None, :, :], mask=(hr < QPK)[:, None, None] & m2[None, :, :],
                     other=0.0).to(tl.float32)
        c = tl.sum(qg * dlt[None, :, :], axis=2)                      # [QPK_P, BLOCK_N]
        if QPK_P * 4 == BLOCK_H:
            c = tl.reshape(tl.permute(tl.join(c, tl.zeros_like(c)), (2, 0, 1)),
                           [2 * QPK_P, BLOCK_N])
        corr = tl.reshape(tl.permute(tl.join(c, tl.zeros_like(c)), (2, 0, 1)),
                          [BLOCK_H, BLOCK_N])
    else:
        qg = tl.load(Qry + b * stride_qb + qh[:, None, None] * stride_qh + oi[None, :, :],
                     mask=hmask[:, None, None] & m2[None, :, :], other=0.0).to(tl.float32)
        corr = tl.sum(qg * dlt[None, :, :], axis=2)
    return corr


@triton.jit
def _decode_split_kernel(
    Qry, QryR,
    Kq, Kqh, Ks, Kz, Koi, Kov, Ksink, Kring, Kpos,
    Vq, Vqh, Vs, Vz, Voi, Vov, Vsink, Vring, Vpos,
    BlockTable, SeqLens, SeqRows, MidO, MidL, Out, Locks, Qq, Qs,
    n_slots, n_blocks, k_sqh, k_sqs, v_sqh, v_sqs, stride_qb, stride_qh, stride_bt,
    stride_ob, stride_oh, q_rs, s_rs,
    qk_scale, sliding_window, chunk, n_splits,
    HKV: tl.constexpr, QPK: tl.constexpr, QPK_P: tl.constexpr, BLOCK_H: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    K_FMT: tl.constexpr, K_BITS: tl.constexpr, K_G: tl.constexpr, K_NOUT: tl.constexpr,
    K_SIDE: tl.constexpr, K_CHAN: tl.constexpr, K_NSINK: tl.constexpr, K_NRING: tl.constexpr,
    K_NOP: tl.constexpr,
    V_FMT: tl.constexpr, V_BITS: tl.constexpr, V_G: tl.constexpr, V_NOUT: tl.constexpr,
    V_SIDE: tl.constexpr, V_NSINK: tl.constexpr, V_NRING: tl.constexpr,
    ROT: tl.constexpr, IDX64: tl.constexpr, HAS_ROWS: tl.constexpr, FUSE: tl.constexpr,
    SPLITS_P: tl.constexpr, MERGE_C: tl.constexpr, V_JOIN: tl.constexpr, K_NARROW: tl.constexpr, ASM: tl.constexpr,
    K_PRE: tl.constexpr, V_PRE: tl.constexpr, SWAP: tl.constexpr, PDL: tl.constexpr,
    SINGLE: tl.constexpr = False, QUANT: tl.constexpr = False, WIDE: tl.constexpr = False,
):
    pdl_begin(PDL)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // HKV
    hk = pid % HKV
    L = tl.load(SeqLens + b)
    if HAS_ROWS:
        srow = tl.load(SeqRows + b).to(tl.int64)
    else:
        srow = b.to(tl.int64)
    start = split * chunk
    end = tl.minimum(start + chunk, L)
    lo = start
    if sliding_window > 0:
        lo = tl.maximum(start, L - sliding_window)
        # tiles stay aligned to pages (per-channel keys read one scale row per page)
        AL: tl.constexpr = BLOCK_N if BLOCK_N < PAGE else PAGE
        start = tl.maximum(start, lo - lo % AL)

    # planes: keys/values of sub-byte formats are split along head_dim into NPL planes of
    # RB channels (split-plane packing); float and int8 are one plane
    K_NPL: tl.constexpr = 1 if (K_FMT == 0 or K_BITS == 8) else (2 if K_BITS == 4 else 4)
    V_NPL: tl.constexpr = 1 if (V_FMT == 0 or V_BITS == 8) else (2 if V_BITS == 4 else 4)
    KRB: tl.constexpr = D // K_NPL
    VRB: tl.constexpr = DV // V_NPL
    hi = tl.arange(0, BLOCK_H)
    hmask = hi < QPK
    qh = hk * QPK + hi
    kc = tl.arange(0, KRB)
    vc = tl.arange(0, VRB)
    q0 = _load_q(Qry, b, qh, hmask, stride_qb, stride_qh, qk_scale, kc)
    q1 = q0
    q2 = q0
    q3 = q0
    if K_NPL >= 2:
        q1 = _load_q(Qry, b, qh, hmask, stride_qb, stride_qh, qk_scale, kc + KRB)
    if K_NPL >= 4:
        q2 = _load_q(Qry, b, qh, hmask, stride_qb, stride_qh, qk_scale, kc + 2 * KRB)
        q3 = _load_q(Qry, b, qh, hmask, stride_qb, stride_qh, qk_scale, kc + 3 * KRB)
    r0 = q0
    r1 = q1
    r2 = q2
    r3 = q3
    if ROT:
        r0 = _load_q(QryR, b, qh, hmask, stride_qb, stride_qh, qk_scale, kc)
        if K_NPL >= 2:
            r1 = _load_q(QryR, b, qh, hmask, stride_qb, stride_qh, qk_scale, kc + KRB)
        if K_NPL >= 4:
            r2 = _load_q(QryR, b, qh, hmask, stride_qb, stride_qh, qk_scale, kc + 2 * KRB)
            r3 = _load_q(QryR, b, qh, hmask, stride_qb, stride_qh, qk_scale, kc + 3 * KRB)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    # V_JOIN: the 4 value planes are joined into one [BLOCK_N, DV] tile (column c holds
    # channel vperm[c]) for a single full-width dot; else one accumulator per plane
    VA: tl.constexpr = DV if V_JOIN else VRB
    vperm = _join_perm(DV)
    # SWAP: accumulators are held transposed ([channels, BLOCK_H], :func:`_pv`)
    if SWAP:
        acc0 = tl.zeros([VA, BLOCK_H], dtype=tl.float32)
        acc1 = tl.zeros([VRB, BLOCK_H], dtype=tl.float32)
        acc2 = tl.zeros([VRB, BLOCK_H], dtype=tl.float32)
        acc3 = tl.zeros([VRB, BLOCK_H], dtype=tl.float32)
    else:
        acc0 = tl.zeros([BLOCK_H, VA], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_H, VRB], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_H, VRB], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_H, VRB], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        mask_n = (pos < end) & (pos >= lo)
        blk = tl.load(BlockTable + b * stride_bt + pos // PAGE, mask=mask_n, other=0)
        slots = blk * PAGE + pos % PAGE
        if K_CHAN:
            NPG: tl.constexpr = BLOCK_N // PAGE if BLOCK_N >= PAGE else 1
            pg = n0 // PAGE + tl.arange(0, NPG)
            pblk = tl.load(BlockTable + b * stride_bt + pg, mask=pg * PAGE < end, other=0)
        else:
            pblk = blk
        if IDX64:
            slots = slots.to(tl.int64)
            pblk = pblk.to(tl.int64)
        k0, k1, k2, k3 = _load_kv_tile(Kq, Kqh, Ks, Kz, Koi, Kov, hk, slots, pblk, mask_n,
                                       n_slots, n_blocks, k_sqh, k_sqs, BLOCK_N, D, K_FMT,
                                       K_BITS, K_G, K_CHAN, K_NOUT, PAGE, ASM, K_PRE)
        if ROT:
            # rotated quantized keys score against the rotated query
            s = _plane_scores(r0, r1, r2, r3, k0, k1, k2, k3, K_NPL, K_NARROW, SWAP)
        else:
            s = _plane_scores(q0, q1, q2, q3, k0, k1, k2, k3, K_NPL, K_NARROW, SWAP)
        if K_CHAN and K_NOUT > 0:
            s += _channel_outlier_scores(Qry, Koi, Kov, Kz, b, hk, qh, hmask, blk, slots,
                                         mask_n, n_slots, n_blocks, stride_qb, stride_qh,
                                         qk_scale, D, K_NOUT, BLOCK_H, BLOCK_N, K_NOP, QPK,
                                         QPK_P)
        if K_SIDE:
            if (n0 < K_NSINK) | (n0 + BLOCK_N > L - K_NRING):
                # sink/ring tokens: scores of their fp16 copies (unrotated) against the query,
                # computed apart so the quantized key tile keeps the dot-operand layout
                is_s, is_r, rr = _side_mask(Kring, Kpos, srow, pos, mask_n, K_NSINK, K_NRING)
                fz = tl.zeros([BLOCK_N, KRB], dtype=tl.float16)
                f0, f1, f2, f3 = _side_planes(fz, fz, fz, fz, Ksink, Kring, srow, hk, pos, is_s,
                                              is_r, rr, kc, KRB, K_NPL, HKV, D, K_NSINK, K_NRING)
                s_fp = _plane_scores(q0, q1, q2, q3, f0, f1, f2, f3, K_NPL, K_NARROW, SWAP)
                s = tl.where((is_s | is_r)[None, :], s_fp, s)
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pf = p.to(tl.float16)
        v0, v1, v2, v3 = _load_kv_tile(Vq, Vqh, Vs, Vz, Voi, Vov, hk, slots, blk, mask_n, n_slots,
                                       n_blocks, v_sqh, v_sqs, BLOCK_N, DV, V_FMT, V_BITS, V_G,
                                       False, V_NOUT, PAGE, ASM, V_PRE)
        if V_SIDE:
            if (n0 < V_NSINK) | (n0 + BLOCK_N > L - V_NRING):
                is_s, is_r, rr = _side_mask(Vring, Vpos, srow, pos, mask_n, V_NSINK, V_NRING)
                v0, v1, v2, v3 = _side_planes(v0, v1, v2, v3, Vsink, Vring, srow, hk, pos, is_s,
                                              is_r, rr, vc, VRB, V_NPL, HKV, DV, V_NSINK,
                                              V_NRING)
        if V_JOIN:
            vj = _join4(v0, v1, v2, v3, BLOCK_N, DV)
            acc0 = _pv(acc0, alpha, pf, vj, SWAP)
        else:
            acc0 = _pv(acc0, alpha, pf, v0, SWAP)
        if V_NPL >= 2 and not V_JOIN:
            acc1 = _pv(acc1, alpha, pf, v1, SWAP)
        if V_NPL >= 4 and not V_JOIN:
            acc2 = _pv(acc2, alpha, pf, v2, SWAP)
            acc3 = _pv(acc3, alpha, pf, v3, SWAP)
        m_i = m_new

    ok = l_i > 0
    inv = 1.0 / tl.where(ok, l_i, 1.0)
    lse = tl.where(ok, m_i + tl.log2(tl.where(ok, l_i, 1.0)), float("-inf"))
    if SINGLE:
        # one split: this program holds the whole softmax, so it writes the normalized output
        # (and its int8 blocks) itself and no reduction runs
        _single_out(Out, Qq, Qs, b, hk, vc, acc0, inv, 0, stride_ob, stride_oh, q_rs, s_rs,
                    QPK, BLOCK_H, VRB, DV, SWAP, QUANT, WIDE)
        if V_NPL >= 2:
            _single_out(Out, Qq, Qs, b, hk, vc, acc1, inv, 1, stride_ob, stride_oh, q_rs, s_rs,
                        QPK, BLOCK_H, VRB, DV, SWAP, QUANT, WIDE)
        if V_NPL >= 4:
            _single_out(Out, Qq, Qs, b, hk, vc, acc2, inv, 2, stride_ob, stride_oh, q_rs, s_rs,
                        QPK, BLOCK_H, VRB, DV, SWAP, QUANT, WIDE)
            _single_out(Out, Qq, Qs, b, hk, vc, acc3, inv, 3, stride_ob, stride_oh, q_rs, s_rs,
                        QPK, BLOCK_H, VRB, DV, SWAP, QUANT, WIDE)
    else:
        hq_total = HKV * QPK
        base = (b * hq_total + qh) * n_splits + split
        if V_JOIN:
            _store_acc(MidO, base, vperm, acc0, inv, hmask, DV, SWAP)
        else:
            _store_acc(MidO, base, vc, acc0, inv, hmask, DV, SWAP)
        if V_NPL >= 2 and not V_JOIN:
            _store_acc(MidO, base, VRB + vc, acc1, inv, hmask, DV, SWAP)
        if V_NPL >= 4 and not V_JOIN:
            _store_acc(MidO, base, 2 * VRB + vc, acc2, inv, hmask, DV, SWAP)
            _store_acc(MidO, base, 3 * VRB + vc, acc3, inv, hmask, DV, SWAP)
        tl.store(MidL + base, lse, mask=hmask)
        if FUSE:
            # split-K merge in the same launch: the last split of (sequence, kv head) to finish
            # (an acq_rel counter orders the other splits' partial stores before it) merges all
            # partials of the kv head's QPK query heads and resets the counter for the next call
            cnt = tl.atomic_add(Locks + pid, 1, sem="acq_rel")
            if cnt == n_splits - 1:
                hrow = (b * hq_total + qh) * n_splits
                sp = tl.arange(0, SPLITS_P)
                lse_all = tl.load(MidL + hrow[:, None] + sp[None, :],
                                  mask=hmask[:, None] & (sp < n_splits)[None, :],
                                  other=float("-inf"), cache_modifier=".cg")
                mx = tl.max(lse_all, axis=1)
                mx = tl.where(mx == float("-inf"), 0.0, mx)
                tot = tl.sum(tl.exp2(lse_all - mx[:, None]), axis=1)
                dv = tl.arange(0, DV)
                mc = tl.arange(0, MERGE_C)
                o = tl.zeros([BLOCK_H, DV], dtype=tl.float32)
                for s0 in range(0, n_splits, MERGE_C):
                    sm = (s0 + mc) < n_splits
                    m3 = hmask[:, None, None] & sm[None, :, None]
                    lw = tl.load(MidL + hrow[:, None] + s0 + mc[None, :],
                                 mask=hmask[:, None] & sm[None, :], other=float("-inf"),
                                 cache_modifier=".cg")
                    w = tl.exp2(lw - mx[:, None])
                    po = tl.load(MidO + ((hrow[:, None] + s0 + mc[None, :]) * DV)[:, :, None]
                                 + dv[None, None, :], mask=m3, other=0.0, cache_modifier=".cg")
                    o += tl.sum(w[:, :, None] * po, axis=1)
                o = o / tl.where(tot > 0, tot, 1.0)[:, None]
                tl.store(Out + b * stride_ob + qh[:, None] * stride_oh + dv[None, :], o,
                         mask=hmask[:, None])
                tl.atomic_xchg(Locks + pid, 0)


@triton.jit
def _single_out(Out, Qq, Qs, b, hk, vc, acc, inv, i: tl.constexpr, stride_ob, stride_oh, q_rs,
                s_rs, QPK: tl.constexpr, BLOCK_H: tl.constexpr, VRB: tl.constexpr,
                DV: tl.constexpr, SWAP: tl.constexpr, QUANT: tl.constexpr,
                WIDE: tl.constexpr = False):
    """Value plane ``i`` (channels ``i*VRB ..``) of a single-split program's output: ``acc``
    (an accumulator of :func:`_pv`) times ``inv``, stored as float32 rows of the kv head's
    query heads and, with ``QUANT``, as their int8 blocks in the O projection's QuantAct
    (VRB a multiple of 32: a plane holds whole blocks)."""
    if SWAP:
        o = tl.trans(acc) * inv[:, None]                    # [BLOCK_H, VRB]
    else:
        o = acc * inv[:, None]
    hi = tl.arange(0, BLOCK_H)
    qh = hk * QPK + hi
    tl.store(Out + b * stride_ob + qh[:, None] * stride_oh + (i * VRB + vc)[None, :], o,
             mask=(hi < QPK)[:, None])
    if QUANT:
        NBP: tl.constexpr = VRB // 32
        r = tl.arange(0, BLOCK_H * NBP)
        blk = (hk * QPK + r // NBP) * (DV // 32) + i * NBP + r % NBP
        b4 = blk[:, None, None, None]
        bl = b.to(tl.int64)
        pack_store_blocks(tl.reshape(o, [BLOCK_H * NBP, 2, 4, 4]), b4,
                          ((r // NBP) < QPK)[:, None, None, None], Qq + bl * q_rs, Qs + bl * s_rs,
                          WIDE)


@triton.jit
def _decode_reduce_kernel(MidO, MidL, Out, n_splits, stride_ob, stride_oh,
                          Qq, Qs, q_rs, s_rs,
                          HQ: tl.constexpr, DV: tl.constexpr, DVB: tl.constexpr,
                          SPLITS_P: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr,
                          WIDE: tl.constexpr = False):
    """Merge the splits' partial outputs of one (sequence, query head) and ``DVB`` of its
    ``DV`` channels (program (b * HQ + h, channel block)): the log-sum-exp weights of every
    split, then one load of the whole ``[splits, DVB]`` tile, so all of a program's bytes are in
    flight at once and ``DV / DVB`` programs share a head."""
    pdl_begin(PDL)
    pid = tl.program_id(0)
    cb = tl.program_id(1)
    b = pid // HQ
    h = pid % HQ
    s = tl.arange(0, SPLITS_P)
    dv = cb * DVB + tl.arange(0, DVB)
    sm = s < n_splits
    lse = tl.load(MidL + pid * n_splits + s, mask=sm, other=float("-inf"))
    mx = tl.max(lse, axis=0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp2(lse - mx)
    o = tl.load(MidO + (pid * n_splits + s)[:, None] * DV + dv[None, :], mask=sm[:, None], other=0.0)
    tot = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(tot > 0, tot, 1.0)
    tl.store(Out + b * stride_ob + h * stride_oh + dv, out)
    if QUANT:   # also the int8 blocks of the row [H * DV] the O projection's GEMV reads
        NB: tl.constexpr = DVB // 32
        b4 = ((h * DV + cb * DVB) // 32 + tl.arange(0, NB))[:, None, None, None]
        bl = b.to(tl.int64)
        pack_store_blocks(tl.reshape(out, [NB, 2, 4, 4]), b4, b4 >= 0, Qq + bl * q_rs,
                          Qs + bl * s_rs, WIDE)


def _reduce_block(dv: int) -> int:
    """Channels per program of the split merge: 32 (one int8 block of the O projection's
    input), or the whole ``dv`` where it is smaller or not a multiple of 32."""
    return 32 if dv % 32 == 0 else dv


def _v_planes(vspec) -> int:
    """Planes a value row is split into (split-plane packing, as the kernel's ``V_NPL``): 1 for
    float and int8, 2 for int4 and fp4, 4 for int3/int2."""
    vf, vb = vspec[0], vspec[1]
    return 1 if (vf == 0 or vb == 8) else (2 if vb == 4 else 4)


def _codec_args(codec, store):
    """(FMT, BITS, G, N_OUT, CHAN, n_sink, n_ring, tensors(9), stride_h, stride_s, n_blocks) of
    one codec's store. Per-channel keys pass ``cscale``/``czero`` [H, NB, D] as scale/zero."""
    if "data" in store:  # float codec: [S, H, D]
        t = store["data"]
        return 0, 16, 1, 0, False, 0, 0, (t,) * 9, t.stride(1), t.stride(0), 1
    q = store["q"]
    fmt = 2 if codec.is_fp4 else 1
    chan = bool(getattr(codec, "channel", False))
    names = ("q", "q_hi", "cscale" if chan else "scale", "czero" if chan else "zero", "oidx",
             "oval", "sink", "ring", "ring_pos")
    ts = tuple(store.get(k, q) for k in names)
    n_blocks = store["cscale"].shape[1] if chan else 1
    return (fmt, codec.bits, codec.group, codec.n_out, chan, int(codec.n_sink),
            int(codec.window), ts, 0, 0, n_blocks)


def _interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (kernels run on the CPU through numpy)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_LOCKS: dict = {}


def _locks(n: int, device) -> torch.Tensor:
    """Zeroed int32 split counters (at least ``n``), one buffer per device, reused across calls
    (every fused launch leaves them at zero again). Calls must not overlap on two streams. An
    outgrown buffer stays alive (:func:`localmoe.kernels.scratch.grown`): a CUDA graph captured
    before it grew still uses it."""
    key = str(device)
    t = _LOCKS[key] = grown(_LOCKS.get(key), (max(n, 256),), torch.int32, device, zero=True)
    return t


def choose_splits(batch: int, n_kv_heads: int, max_len: int, block_n: int, device,
                  waves: float = 2.0) -> int:
    """Splits per (sequence, kv head): about ``waves`` programs per SM, rounded so the program
    count is a whole number of waves where possible, with at least one ``block_n`` tile per
    split."""
    pairs = max(1, batch * n_kv_heads)
    cap = max(1, cdiv(max_len, block_n))
    if device.type != "cuda":
        return max(1, min(4, cap))
    n_sm = torch.cuda.get_device_properties(device).multi_processor_count
    s = max(1, cdiv(int(waves * n_sm), pairs))
    for cand in range(s, 2 * s + 1):  # prefer an exact multiple of the SM count
        if (cand * pairs) % n_sm == 0:
            s = cand
            break
    return max(1, min(s, cap, 256))


def default_tile(k_codec, v_codec, batch: int = 1, n_kv_heads: int = 1,
                 max_len: int | None = None, device=None) -> tuple[int, int, float]:
    """(block_n, num_warps, waves) of ``device``'s launch table (:mod:`.launch_config`;
    default: the table of a CUDA device without a file of its own, which holds the H200's
    measurements, ``configs/nvidia_h200.json``). ``max_len`` None counts as long."""
    c = device_table(device).choose(k_codec, v_codec, batch, n_kv_heads, max_len)
    return c.block_n, c.num_warps, c.waves


def default_swap(k_codec, v_codec, device=None) -> bool:
    """Whether :func:`decode_attention` computes its products transposed (``swap_ab``) by
    ``device``'s launch table (default as :func:`default_tile`): with 2/3-bit or fp4 values."""
    return device_table(device).choose(k_codec, v_codec).swap_ab


def default_sz_pre(k_codec, v_codec, batch: int = 1, n_kv_heads: int = 1, device=None) -> str:
    """Sides (``"k"``, ``"v"``) whose per-token scales and zeros are loaded once per tile as
    [BLOCK_N, D/G] rows instead of one narrow strided load per plane, by ``device``'s launch
    table (default as :func:`default_tile`)."""
    return device_table(device).choose(k_codec, v_codec, batch, n_kv_heads).sz_pre


def _check_inputs(q, k_codec, v_codec, page_size: int) -> None:
    """Raise ValueError for head counts, head sizes or a page size the kernel cannot take."""
    HQ, D = q.shape[1], q.shape[2]
    HKV, DV = k_codec.n_kv_heads, v_codec.head_dim
    if HQ % HKV:
        raise ValueError(f"n_heads {HQ} is not a multiple of n_kv_heads {HKV}")
    if D != k_codec.head_dim or D & (D - 1) or DV & (DV - 1) or D < 16 or DV < 16:
        raise ValueError(f"decode_attention needs power-of-two head sizes >= 16 (got {D}, {DV})")
    if page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two, got {page_size}")
    if getattr(k_codec, "channel", False) and k_codec.block_size != page_size:
        raise ValueError(f"per-channel keys are grouped per {k_codec.block_size}-token page, "
                         f"but page_size is {page_size}")


def _choices(k_codec, v_codec, B: int, max_len: int, dev, given: dict) -> dict:
    """Launch options: each one the caller gave (not None), else the device's launch table's
    (:mod:`.launch_config`). ``given`` maps :data:`~.launch_config.CHOICE_FIELDS` to values."""
    c = device_table(dev).choose(k_codec, v_codec, B, k_codec.n_kv_heads, max_len)
    out = {f: (getattr(c, f) if given.get(f) is None else given[f]) for f in CHOICE_FIELDS}
    for f in ("block_n", "num_warps", "waves"):  # 0 meant "default" before the table
        out[f] = given.get(f) or getattr(c, f)
    return out


def _constexprs(q, k_codec, kspec, v_codec, vspec, ch: dict, page_size: int, has_rows: bool,
                num_splits: int, asm) -> dict:
    """The kernel's constexpr arguments (and ``num_warps``/``num_stages``) of one launch."""
    kf, kb, kg, kno, kchan, kns, knr = kspec
    vf, vb, vg, vno, _, vns, vnr = vspec
    HQ, D, HKV, DV = q.shape[1], q.shape[2], k_codec.n_kv_heads, v_codec.head_dim
    QPK = HQ // HKV
    swap = bool(ch["swap_ab"])
    # joined value planes only when each plane is >= 16 channels (head_dim >= 64) and the tile
    # >= 32 tokens: at head_dim 32 (H200) and at 16-token tiles of head_dim 64 and 128 (H100,
    # session 33: relative error ~1.0 for every head group, with and without the PTX unpack)
    # the join gave wrong results on the GPU (triton 3.6), though not in the interpreter
    vjoin = bool(vf == 1 and vb in (2, 3) and DV >= 64 and ch["block_n"] >= 32
                 and ch["v_join"])
    splits_p = max(2, next_pow2(num_splits))
    if asm is None:
        asm = q.device.type == "cuda" and not _interpreting() and \
            os.environ.get("LOCALMOE_KV_ASM", "1") != "0"
    return dict(
        HKV=HKV, QPK=QPK, QPK_P=next_pow2(QPK),
        BLOCK_H=max(8 if swap else 16, next_pow2(QPK)), D=D, DV=DV,
        PAGE=page_size, K_FMT=kf, K_BITS=kb, K_G=kg, K_NOUT=kno, K_SIDE=bool(kns or knr),
        K_CHAN=kchan, K_NSINK=kns, K_NRING=knr, K_NOP=next_pow2(max(kno, 1)),
        V_FMT=vf, V_BITS=vb, V_G=vg, V_NOUT=vno, V_SIDE=bool(vns or vnr), V_NSINK=vns,
        V_NRING=vnr, ROT=bool(getattr(k_codec, "rotate", False)), HAS_ROWS=has_rows,
        FUSE=bool(ch["fused_reduce"]), SPLITS_P=splits_p, MERGE_C=min(8, splits_p),
        V_JOIN=vjoin,
        # 2/3-bit keys of head_dim < 64: planes narrower than tl.dot's minimum of 16
        K_NARROW=bool(kf == 1 and kb in (2, 3) and D < 64), ASM=bool(asm),
        K_PRE="k" in ch["sz_pre"], V_PRE="v" in ch["sz_pre"], SWAP=swap,
        num_warps=ch["num_warps"], num_stages=ch["num_stages"])


def _prepare(q, k_codec, block_table, seq_lens, seq_rows, max_len):
    """Contiguous int32 tables on the query's device, the rotated query (``ROT``), the
    (rows, given) pair of ``seq_rows`` (``seq_lens`` stands in when not given) and ``max_len``
    (read from the device when None)."""
    dev = q.device
    q = q.contiguous()
    qr = q
    if getattr(k_codec, "rotate", False):
        qr = (q.float() @ k_codec.hadamard(dev)).contiguous()
    block_table = block_table.to(device=dev, dtype=torch.int32).contiguous()
    seq_lens = seq_lens.to(device=dev, dtype=torch.int32).contiguous()
    has_rows = seq_rows is not None
    rows = seq_rows.to(device=dev, dtype=torch.int32).contiguous() if has_rows else seq_lens
    if max_len is None:
        max_len = int(seq_lens.max().item()) if q.shape[0] else 0
    return q, qr, block_table, seq_lens, (rows, has_rows), max_len


def _launch_split(grid, args: tuple, meta: dict, block_n: int, extra: dict) -> None:
    """Stage 1; on OutOfResources retried with half the tile (the split's token range stays
    a multiple of it) down to 16 tokens."""
    while True:
        try:
            _decode_split_kernel[grid](*args, BLOCK_N=block_n, **meta, **extra,
                                       **pdl_args(args[0].device))
            return
        except triton.runtime.errors.OutOfResources:
            if block_n <= 16:
                raise
            block_n //= 2


def decode_attention(q: torch.Tensor, k_codec, k_store: dict, v_codec, v_store: dict,
                     block_table: torch.Tensor, seq_lens: torch.Tensor, *, page_size: int,
                     sm_scale: float | None = None, seq_rows: torch.Tensor | None = None,
                     sliding_window: int = 0, max_len: int | None = None,
                     num_splits: int | None = None, block_n: int | None = None,
                     num_warps: int | None = None, num_stages: int | None = None,
                     fused_reduce: bool | None = None, waves: float | None = None,
                     v_join: bool | None = None, asm: bool | None = None,
                     sz_pre: str | None = None, maxnreg: int | None = None,
                     swap_ab: bool | None = None, quant_out=None) -> torch.Tensor:
    """Attention of one new query token per sequence over its cached tokens.

    Launch options left None come from the device's launch table (:mod:`.launch_config`,
    ``kernels/configs/<device>.json``: measured on the H200; CPU tensors, run through the
    interpreter, ``cpu.json``).

    Args:
        q: [B, n_heads, D] float (fp16/bf16/fp32) queries (RoPE applied, not scaled).
        k_codec, k_store, v_codec, v_store: codecs and stores of one layer (any registered
            format: float ``data``, the packed quantized layout, per-channel keys).
        block_table: int32 [B, max_blocks] physical block of each logical block.
        seq_lens: int32 [B] cached tokens per sequence (the new token's K/V included).
        page_size: tokens per block (a power of two; per-channel keys: the codec's block size).
        sm_scale: score scale (default 1/sqrt(D)).
        seq_rows: int32 [B] sequence rows of the sink/window side buffers (default 0..B-1).
        sliding_window: attend only the last ``sliding_window`` positions (0 = all).
        max_len: max of ``seq_lens`` if known (avoids a device sync); used to size splits.
        num_splits: splits per sequence (default: :func:`choose_splits` with ``waves``).
        block_n, num_warps, num_stages: tile size in tokens and launch options.
        fused_reduce: merge the splits inside the same launch (the last split of each
            sequence and kv head does it, ordered by an atomic counter) instead of the
            separate reduction kernel (which measured as fast or faster on the H200).
        waves: programs per SM the default split count aims for.
        v_join: join the 4 value planes of int3/int2 values into one full-width tile (one
            dot) instead of one dot per plane.
        sz_pre: sides (``"k"``, ``"v"``, both or ``""``) whose per-token int scales and zeros
            are loaded once per tile for all planes.
        maxnreg: register cap per thread passed to the compiler (default: none).
        swap_ab: compute the products transposed (``k @ q.T`` and ``v.T @ p.T``: the query
            heads of a kv head are the mma's N side, 8 wide, instead of M rows padded to 16),
            with query-head tiles of max(8, QPK) rows.
        quant_out: a :class:`localmoe.kernels.quant_gemv.QuantAct` ``[B, n_heads * Dv]``
            that also receives the output quantized to int8 blocks (the input of the O
            projection's GEMV; written by the reduction, or by the split itself when there is
            one, so no quantize launch follows; ``Dv`` a multiple of 32).
        asm: unpack int8/int4/int2 codes with inline PTX (:func:`_ptx_codes`, four codes per
            32-bit register) instead of per-element integer ops (default: on a CUDA device
            unless ``TRITON_INTERPRET`` is set, since the interpreter cannot run PTX, or
            ``LOCALMOE_KV_ASM=0``).

    Returns:
        float32 [B, n_heads, Dv].

    Raises:
        ValueError: head counts, head sizes, page size or devices do not fit.
    """
    B, HQ, D = q.shape
    _check_inputs(q, k_codec, v_codec, page_size)
    HKV, dev = k_codec.n_kv_heads, q.device
    q, qr, block_table, seq_lens, seq_rows, max_len = _prepare(
        q, k_codec, block_table, seq_lens, seq_rows, max_len)
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    ch = _choices(k_codec, v_codec, B, max_len, dev, dict(
        block_n=block_n, num_warps=num_warps, waves=waves, swap_ab=swap_ab, sz_pre=sz_pre,
        v_join=v_join, num_stages=num_stages, fused_reduce=fused_reduce))
    if num_splits is None:
        num_splits = choose_splits(B, HKV, max_len, ch["block_n"], dev, ch["waves"])
    if quant_out is not None and v_codec.head_dim % 32:
        raise ValueError("quant_out needs a value head size that is a multiple of 32, got "
                         f"{v_codec.head_dim}")
    if quant_out is not None and not quant_out.is_packed(B, q.shape[1] * v_codec.head_dim, dev):
        raise ValueError(f"quant_out must be a QuantAct [{B}, {q.shape[1] * v_codec.head_dim}] "
                         "as QuantAct.empty makes it")
    return _launch(q, qr, k_codec, k_store, v_codec, v_store, block_table, seq_lens, seq_rows,
                   ch, page_size=page_size, sm_scale=sm_scale, sliding_window=sliding_window,
                   max_len=max_len, num_splits=num_splits, asm=asm, maxnreg=maxnreg,
                   quant_out=quant_out)


def _launch(q, qr, k_codec, k_store, v_codec, v_store, block_table, seq_lens, seq_rows, ch, *,
            page_size, sm_scale, sliding_window, max_len, num_splits, asm, maxnreg,
            quant_out=None):
    """Allocate the split buffers and the output, run stage 1 and (unless fused) stage 2 of
    :func:`decode_attention` with the resolved choices ``ch`` and ``num_splits``."""
    B, HQ, _ = q.shape
    HKV, DV, dev = k_codec.n_kv_heads, v_codec.head_dim, q.device
    chunk = cdiv(cdiv(max(max_len, 1), num_splits), ch["block_n"]) * ch["block_n"]
    *kspec, kt, ksh, kss, knb = _codec_args(k_codec, k_store)
    *vspec, vt, vsh, vss, _ = _codec_args(v_codec, v_store)
    n_slots = (kt[0].shape[1] if kspec[0] else kt[0].shape[0])
    if vt[0].shape[1 if vspec[0] else 0] != n_slots:
        raise ValueError("K and V stores hold different slot counts")
    mid_o = torch.empty(B, HQ, num_splits, DV, device=dev, dtype=torch.float32)
    mid_l = torch.empty(B, HQ, num_splits, device=dev, dtype=torch.float32)
    out = torch.empty(B, HQ, DV, device=dev, dtype=torch.float32)
    if B == 0:
        return out
    meta = _constexprs(q, k_codec, kspec, v_codec, vspec, ch, page_size, seq_rows[1], num_splits,
                       asm)
    meta["IDX64"] = max(t.numel() for t in kt + vt) >= 2 ** 31
    qa = quant_out
    # one split (and value planes of whole 32-channel blocks, not joined): the split writes the
    # output and its int8 blocks itself, no reduction launch
    single = num_splits == 1 and not meta["V_JOIN"] and (DV // _v_planes(vspec)) % 32 == 0
    if single:
        meta.update(SINGLE=True, QUANT=qa is not None, FUSE=False,
                    WIDE=qa is not None and qa.wide)
    locks = _locks(B * HKV, dev) if meta["FUSE"] else mid_l
    qt = (qa.q, qa.s, qa.q.stride(0), qa.s.stride(0)) if qa is not None else (out, out, 0, 0)
    _launch_split((B * HKV, num_splits), (
        q, qr, *kt, *vt, block_table, seq_lens, seq_rows[0], mid_o, mid_l, out, locks,
        qt[0], qt[1], n_slots, knb, ksh, kss, vsh, vss, q.stride(0), q.stride(1),
        block_table.stride(0), out.stride(0), out.stride(1), qt[2], qt[3], sm_scale * LOG2E,
        int(sliding_window or 0), chunk, num_splits), meta, ch["block_n"],
        {} if maxnreg is None else {"maxnreg": int(maxnreg)})
    if single:
        return out
    if not meta["FUSE"]:
        dvb = _reduce_block(DV)
        _decode_reduce_kernel[(B * HQ, DV // dvb)](
            mid_o, mid_l, out, num_splits, out.stride(0), out.stride(1), *qt,
            HQ=HQ, DV=DV, DVB=dvb, SPLITS_P=meta["SPLITS_P"], QUANT=qa is not None,
            WIDE=qa is not None and qa.wide, **pdl_args(out.device))
    elif qa is not None:
        from localmoe.kernels.quant_gemv import quantize_act

        q2 = quantize_act(out.reshape(B, HQ * DV), wide=qa.wide)
        qa.q.copy_(q2.q)
        qa.pairs().copy_(q2.pairs())
    return out


def _codec_read(codec, store, slots, positions, row):
    try:
        return codec.read(store, slots, positions=positions, seq_row=row)
    except TypeError:
        return codec.read(store, slots)


def decode_attention_ref(q: torch.Tensor, k_codec, k_store: dict, v_codec, v_store: dict,
                         block_table: torch.Tensor, seq_lens: torch.Tensor, *, page_size: int,
                         sm_scale: float | None = None, seq_rows: torch.Tensor | None = None,
                         sliding_window: int = 0, **_: object) -> torch.Tensor:
    """PyTorch twin of :func:`decode_attention` (same arguments): dequantize each sequence's
    K/V with the codecs' ``read`` and run softmax attention in float32 -> [B, n_heads, Dv]."""
    B, HQ, D = q.shape
    HKV = k_codec.n_kv_heads
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    outs = []
    for b in range(B):
        L = int(seq_lens[b])
        lo = max(0, L - sliding_window) if sliding_window else 0
        pos = torch.arange(lo, L, device=block_table.device)
        slots = (block_table[b].long()[pos // page_size] * page_size + pos % page_size)
        row = int(seq_rows[b]) if seq_rows is not None else b
        k = _codec_read(k_codec, k_store, slots.to(q.device), pos.to(q.device), row)
        v = _codec_read(v_codec, v_store, slots.to(q.device), pos.to(q.device), row)
        qb = q[b].float().view(HKV, HQ // HKV, D)
        s = torch.einsum("hqd,lhd->hql", qb, k) * sm_scale
        p = torch.softmax(s, dim=-1)
        outs.append(torch.einsum("hql,lhd->hqd", p, v).reshape(HQ, -1))
    return torch.stack(outs) if outs else q.new_zeros(0, HQ, v_codec.head_dim, dtype=torch.float32)
