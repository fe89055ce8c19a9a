"""Fused decode attention over a paged, packed (quantized) KV cache, split-K over the sequence.

Algorithm: flash-decoding (Dao et al., 2023; "Flash-Decoding for long-context inference").
Stage 1 runs one program per (sequence, kv head, split): the split's token range is walked in
tiles of ``BLOCK_N`` tokens; for each tile the slot of every token is looked up in the block
table (``slot = block_table[b, pos // PAGE] * PAGE + pos % PAGE``), the packed K and V rows are
loaded and dequantized *in registers* (no fp16 copy of the cache is ever materialized), scores
for all ``QPK = n_heads / n_kv_heads`` query heads of the kv head are computed with one
``tl.dot`` (GQA: K/V are read once per kv head), and an online softmax accumulates
``sum p * V``. Each split writes its normalized partial output and its log2-sum-exp; stage 2
(the reduction kernel) merges the splits of every (sequence, query head).

Storage read (see :mod:`localmoe.kv_quant` for the exact layout; one kernel, constexpr format):

* ``FMT=0`` float codec: ``data`` [S, H, D] f16/bf16/f32 (slot-major, any strides).
* ``FMT=1`` int codec, ``BITS`` in 8, 4, 3, 2, group ``G``: ``q`` uint8 [H, S, D*P/8] (P = 2 for
  int3), ``q_hi`` uint8 [H, S, D/8] (int3), ``scale``/``zero`` fp16 [H, S, D/G];
  ``x = code * scale + zero``.
* ``FMT=2`` fp4: ``q`` uint8 [H, S, D/2] E2M1 codes, ``scale`` uint8 [H, S, D/16] E4M3.
* Optional ``oidx`` uint8/``oval`` fp16 [H, S, N_OUT] outliers (overwrite their channels),
  ``sink`` fp16 [R, H, N_SINK, D], ``ring`` fp16 [R, H, N_RING, D] + ``ring_pos`` int32
  [R, N_RING] full-precision side buffers selected per token, and Hadamard-rotated keys
  (``ROT``: scores of quantized keys use the rotated query ``qH``).

Units: ``sm_scale`` multiplies ``q . k``; ``sliding_window`` W > 0 restricts a sequence of
length L to positions ``>= L - W``. The twin is :func:`decode_attention_ref`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _unpack(b, BN: tl.constexpr, RB: tl.constexpr, P: tl.constexpr):
    """uint8-in-int32 bytes [BN, RB] -> int32 codes [BN, RB * 8/P] (interleaved layout:
    channel d in byte d // (8/P) at bit (d % (8/P)) * P), rebuilt with register joins."""
    M: tl.constexpr = (1 << P) - 1
    if P == 8:
        c = b
    elif P == 4:
        c = tl.reshape(tl.join(b & M, (b >> 4) & M), [BN, RB * 2])
    elif P == 2:
        c = tl.reshape(tl.join(tl.join(b & M, (b >> 4) & M), tl.join((b >> 2) & M, (b >> 6) & M)),
                       [BN, RB * 4])
    else:
        c = tl.reshape(tl.join(tl.join(tl.join(b & 1, (b >> 4) & 1), tl.join((b >> 2) & 1, (b >> 6) & 1)),
                               tl.join(tl.join((b >> 1) & 1, (b >> 5) & 1), tl.join((b >> 3) & 1, (b >> 7) & 1))),
                       [BN, RB * 8])
    return c


@triton.jit
def _load_kv_tile(Qp, QHp, Sp, Zp, OIp, OVp, h, slots, mask_n, n_slots, sqh, sqs,
                  BN: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr, BITS: tl.constexpr,
                  G: tl.constexpr, N_OUT: tl.constexpr):
    """Dequantized fp16 [BN, D] tile of kv head ``h`` at ``slots`` (int64 [BN])."""
    d = tl.arange(0, D)
    m2 = mask_n[:, None]
    if FMT == 0:
        x = tl.load(Qp + h * sqh + slots[:, None] * sqs + d[None, :], mask=m2, other=0.0)
        x = x.to(tl.float16)
    else:
        row = h * n_slots + slots
        P: tl.constexpr = 2 if BITS == 3 else BITS
        RB: tl.constexpr = D * P // 8
        b = tl.load(Qp + row[:, None] * RB + tl.arange(0, RB)[None, :], mask=m2, other=0)
        c = _unpack(b.to(tl.int32), BN, RB, P)
        if BITS == 3:
            RB2: tl.constexpr = D // 8
            b2 = tl.load(QHp + row[:, None] * RB2 + tl.arange(0, RB2)[None, :], mask=m2, other=0)
            c = c | (_unpack(b2.to(tl.int32), BN, RB2, 1) << 2)
        NG: tl.constexpr = D // G
        g = tl.arange(0, NG)
        if FMT == 2:
            # E4M3 scale (small [BN, NG] tensor), broadcast over its group
            sc = tl.load(Sp + row[:, None] * NG + g[None, :], mask=m2, other=0).to(tl.int32)
            se = (sc >> 3) & 15
            sm = (sc & 7).to(tl.float32)
            s = tl.where(se == 0, sm * 0.001953125, (8.0 + sm) * tl.exp2(se.to(tl.float32) - 10.0))
            s = tl.reshape(tl.broadcast_to(s.to(tl.float16)[:, :, None], [BN, NG, G]), [BN, D])
            # E2M1 -> fp16 bits without conversions: (e1 e0 m) with e > 0 is exponent e + 14,
            # mantissa m, i.e. bits (mag + 28) << 9; mag 1 is 0.5 (0x3800); sign to bit 15
            mag = c & 7
            hb = tl.where(mag >= 2, (mag + 28) << 9, tl.where(mag == 1, 0x3800, 0))
            hb = hb | ((c & 8) << 12)
            val = hb.to(tl.int16).to(tl.float16, bitcast=True)
            x = val * s
        else:
            s = tl.load(Sp + row[:, None] * NG + g[None, :], mask=m2, other=0.0)
            z = tl.load(Zp + row[:, None] * NG + g[None, :], mask=m2, other=0.0)
            s = tl.reshape(tl.broadcast_to(s[:, :, None], [BN, NG, G]), [BN, D])
            z = tl.reshape(tl.broadcast_to(z[:, :, None], [BN, NG, G]), [BN, D])
            # int -> fp16 without I2F: 0x6400 | c is the fp16 number 1024 + c (c < 1024)
            cf = (c | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
            x = cf * s + z
        for j in tl.static_range(N_OUT):
            oi = tl.load(OIp + row * N_OUT + j, mask=mask_n, other=0).to(tl.int32)
            ov = tl.load(OVp + row * N_OUT + j, mask=mask_n, other=0.0).to(tl.float16)
            x = tl.where(d[None, :] == oi[:, None], ov[:, None], x)
    return x


@triton.jit
def _load_side(Sink, Ring, RingPos, srow, h, pos, mask_n,
               H: tl.constexpr, D: tl.constexpr, N_SINK: tl.constexpr, N_RING: tl.constexpr):
    """Full-precision tile (fp16 [BLOCK_N, D]) and bool mask [BLOCK_N] of the tokens held
    in the sink/ring side buffers of sequence row ``srow``."""
    d = tl.arange(0, D)
    is_fp = pos < 0
    xf = tl.zeros([pos.shape[0], D], dtype=tl.float16)
    if N_SINK > 0:
        is_s = mask_n & (pos < N_SINK)
        ps = tl.where(is_s, pos, 0)
        xs = tl.load(Sink + ((srow * H + h) * N_SINK + ps)[:, None] * D + d[None, :],
                     mask=is_s[:, None], other=0.0)
        xf = tl.where(is_s[:, None], xs.to(tl.float16), xf)
        is_fp = is_fp | is_s
    if N_RING > 0:
        r = pos % N_RING
        tag = tl.load(RingPos + srow * N_RING + r, mask=mask_n, other=-1)
        is_r = mask_n & (tag == pos) & (~is_fp)
        xr = tl.load(Ring + ((srow * H + h) * N_RING + r)[:, None] * D + d[None, :],
                     mask=is_r[:, None], other=0.0)
        xf = tl.where(is_r[:, None], xr.to(tl.float16), xf)
        is_fp = is_fp | is_r
    return xf, is_fp


@triton.jit
def _decode_split_kernel(
    Qry, QryR,
    Kq, Kqh, Ks, Kz, Koi, Kov, Ksink, Kring, Kpos,
    Vq, Vqh, Vs, Vz, Voi, Vov, Vsink, Vring, Vpos,
    BlockTable, SeqLens, SeqRows, MidO, MidL,
    n_slots, k_sqh, k_sqs, v_sqh, v_sqs, stride_qb, stride_qh, stride_bt,
    qk_scale, sliding_window, chunk, n_splits,
    HKV: tl.constexpr, QPK: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr,
    DV: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    K_FMT: tl.constexpr, K_BITS: tl.constexpr, K_G: tl.constexpr, K_NOUT: tl.constexpr,
    K_SIDE: tl.constexpr,
    V_FMT: tl.constexpr, V_BITS: tl.constexpr, V_G: tl.constexpr, V_NOUT: tl.constexpr,
    V_SIDE: tl.constexpr,
    N_SINK: tl.constexpr, N_RING: tl.constexpr, ROT: tl.constexpr, IDX64: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // HKV
    hk = pid % HKV
    L = tl.load(SeqLens + b)
    srow = tl.load(SeqRows + b).to(tl.int64)
    start = split * chunk
    end = tl.minimum(start + chunk, L)
    if sliding_window > 0:
        start = tl.maximum(start, L - sliding_window)

    hi = tl.arange(0, BLOCK_H)
    hmask = hi < QPK
    qh = hk * QPK + hi
    d = tl.arange(0, D)
    dv = tl.arange(0, DV)
    q = tl.load(Qry + b * stride_qb + qh[:, None] * stride_qh + d[None, :], mask=hmask[:, None],
                other=0.0).to(tl.float32)
    q = (q * qk_scale).to(tl.float16)
    if ROT:
        qr = tl.load(QryR + b * stride_qb + qh[:, None] * stride_qh + d[None, :],
                     mask=hmask[:, None], other=0.0).to(tl.float32)
        qr = (qr * qk_scale).to(tl.float16)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, DV], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        mask_n = pos < end
        blk = tl.load(BlockTable + b * stride_bt + pos // PAGE, mask=mask_n, other=0)
        slots = blk * PAGE + pos % PAGE
        if IDX64:
            slots = slots.to(tl.int64)
        k = _load_kv_tile(Kq, Kqh, Ks, Kz, Koi, Kov, hk, slots, mask_n, n_slots, k_sqh, k_sqs,
                          BLOCK_N, D, K_FMT, K_BITS, K_G, K_NOUT)
        if K_SIDE:
            kf, is_fp = _load_side(Ksink, Kring, Kpos, srow, hk, pos, mask_n, HKV, D, N_SINK, N_RING)
            if ROT:
                s_fp = tl.dot(q, tl.trans(kf))
                s_q = tl.dot(qr, tl.trans(k))
                s = tl.where(is_fp[None, :], s_fp, s_q)
            else:
                k = tl.where(is_fp[:, None], kf, k)
                s = tl.dot(q, tl.trans(k))
        else:
            if ROT:
                s = tl.dot(qr, tl.trans(k))
            else:
                s = tl.dot(q, tl.trans(k))
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _load_kv_tile(Vq, Vqh, Vs, Vz, Voi, Vov, hk, slots, mask_n, n_slots, v_sqh, v_sqs,
                          BLOCK_N, DV, V_FMT, V_BITS, V_G, V_NOUT)
        if V_SIDE:
            vf, vis_fp = _load_side(Vsink, Vring, Vpos, srow, hk, pos, mask_n, HKV, DV, N_SINK, N_RING)
            v = tl.where(vis_fp[:, None], vf, v)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)
        m_i = m_new

    ok = l_i > 0
    out = acc / tl.where(ok, l_i, 1.0)[:, None]
    lse = tl.where(ok, m_i + tl.log2(tl.where(ok, l_i, 1.0)), float("-inf"))
    hq_total = HKV * QPK
    base = (b * hq_total + qh) * n_splits + split
    tl.store(MidO + base[:, None] * DV + dv[None, :], out, mask=hmask[:, None])
    tl.store(MidL + base, lse, mask=hmask)


@triton.jit
def _decode_reduce_kernel(MidO, MidL, Out, n_splits, stride_ob, stride_oh,
                          HQ: tl.constexpr, DV: tl.constexpr, SPLITS_P: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // HQ
    h = pid % HQ
    s = tl.arange(0, SPLITS_P)
    dv = tl.arange(0, DV)
    sm = s < n_splits
    lse = tl.load(MidL + pid * n_splits + s, mask=sm, other=float("-inf"))
    mx = tl.max(lse, axis=0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp2(lse - mx)
    o = tl.load(MidO + (pid * n_splits + s)[:, None] * DV + dv[None, :], mask=sm[:, None], other=0.0)
    tot = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(tot > 0, tot, 1.0)
    tl.store(Out + b * stride_ob + h * stride_oh + dv, out)


def _codec_args(codec, store):
    """(FMT, BITS, G, N_OUT, SIDE, tensors(9), stride_h, stride_s) of one codec's store."""
    if "data" in store:  # float codec: [S, H, D]
        t = store["data"]
        return 0, 16, 1, 0, False, (t,) * 9, t.stride(1), t.stride(0)
    q = store["q"]
    fmt = 2 if codec.is_fp4 else 1
    side = bool(codec.n_sink or codec.window)
    ts = tuple(store.get(k, q) for k in ("q", "q_hi", "scale", "zero", "oidx", "oval", "sink",
                                         "ring", "ring_pos"))
    return fmt, codec.bits, codec.group, codec.n_out, side, ts, 0, 0


def choose_splits(batch: int, n_kv_heads: int, max_len: int, block_n: int, device) -> int:
    """Splits per (sequence, kv head): at least two programs per SM, rounded so the program
    count is a whole number of waves (one resident program per SM at these register counts),
    with at least one ``block_n`` tile per split."""
    pairs = max(1, batch * n_kv_heads)
    cap = max(1, triton.cdiv(max_len, block_n))
    if device.type != "cuda":
        return max(1, min(4, cap))
    n_sm = torch.cuda.get_device_properties(device).multi_processor_count
    s = triton.cdiv(2 * n_sm, pairs)
    for cand in range(s, 2 * s + 1):  # prefer an exact multiple of the SM count
        if (cand * pairs) % n_sm == 0:
            s = cand
            break
    return max(1, min(s, cap, 256))


def default_tile(k_codec, v_codec) -> tuple[int, int]:
    """(block_n, num_warps) measured best on the H200 (benchmarks/results/attention_h200.json)."""
    bits = [getattr(c, "bits", 16) if not getattr(c, "is_fp4", False) else 0
            for c in (k_codec, v_codec)]
    extras = any(getattr(c, "n_out", 0) or getattr(c, "n_sink", 0) or getattr(c, "window", 0)
                 or getattr(c, "rotate", False) for c in (k_codec, v_codec))
    if extras:
        return 64, 4
    if all(b >= 16 for b in bits):
        return 128, 8
    if any(b in (4, 8) for b in bits):
        return 128, 8
    return 256, 8


def decode_attention(q: torch.Tensor, k_codec, k_store: dict, v_codec, v_store: dict,
                     block_table: torch.Tensor, seq_lens: torch.Tensor, *, page_size: int,
                     sm_scale: float | None = None, seq_rows: torch.Tensor | None = None,
                     sliding_window: int = 0, max_len: int | None = None,
                     num_splits: int | None = None, block_n: int | None = None,
                     num_warps: int | None = None, num_stages: int = 2) -> torch.Tensor:
    """Attention of one new query token per sequence over its cached tokens.

    Args:
        q: [B, n_heads, D] float (fp16/bf16/fp32) queries (RoPE applied, not scaled).
        k_codec, k_store, v_codec, v_store: codecs and stores of one layer (any registered
            format: float ``data`` or the packed quantized layout).
        block_table: int32 [B, max_blocks] physical block of each logical block.
        seq_lens: int32 [B] cached tokens per sequence (the new token's K/V included).
        page_size: tokens per block (a power of two).
        sm_scale: score scale (default 1/sqrt(D)).
        seq_rows: int32 [B] sequence rows of the sink/window side buffers (default 0..B-1).
        sliding_window: attend only the last ``sliding_window`` positions (0 = all).
        max_len: max of ``seq_lens`` if known (avoids a device sync); used to size splits.
        num_splits: splits per sequence (default: :func:`choose_splits`).
        block_n, num_warps, num_stages: tile size in tokens and launch options (default
            :func:`default_tile`).

    Returns:
        float32 [B, n_heads, Dv].

    Raises:
        ValueError: head counts, head sizes or devices do not fit.
    """
    B, HQ, D = q.shape
    HKV = k_codec.n_kv_heads
    DV = v_codec.head_dim
    if HQ % HKV:
        raise ValueError(f"n_heads {HQ} is not a multiple of n_kv_heads {HKV}")
    if D != k_codec.head_dim or D & (D - 1) or DV & (DV - 1) or D < 16 or DV < 16:
        raise ValueError(f"decode_attention needs power-of-two head sizes >= 16 (got {D}, {DV})")
    if page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two, got {page_size}")
    QPK = HQ // HKV
    dev = q.device
    bn0, nw0 = default_tile(k_codec, v_codec) if dev.type == "cuda" else (16, 4)
    block_n = block_n or bn0
    num_warps = num_warps or nw0
    q = q.contiguous()
    qr = q
    rot = bool(getattr(k_codec, "rotate", False))
    if rot:
        qr = (q.float() @ k_codec.hadamard(dev)).contiguous()
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    block_table = block_table.to(device=dev, dtype=torch.int32).contiguous()
    seq_lens = seq_lens.to(device=dev, dtype=torch.int32).contiguous()
    if seq_rows is None:
        seq_rows = torch.arange(B, device=dev, dtype=torch.int32)
    seq_rows = seq_rows.to(device=dev, dtype=torch.int32).contiguous()
    if max_len is None:
        max_len = int(seq_lens.max().item()) if B else 0
    if num_splits is None:
        num_splits = choose_splits(B, HKV, max_len, block_n, dev)
    chunk = triton.cdiv(triton.cdiv(max(max_len, 1), num_splits), block_n) * block_n
    kf, kb, kg, kno, kside, kt, ksh, kss = _codec_args(k_codec, k_store)
    vf, vb, vg, vno, vside, vt, vsh, vss = _codec_args(v_codec, v_store)
    n_sink = getattr(k_codec if kside else v_codec, "n_sink", 0) if (kside or vside) else 0
    n_ring = getattr(k_codec if kside else v_codec, "window", 0) if (kside or vside) else 0
    n_slots = (kt[0].shape[1] if kf else kt[0].shape[0])
    if vf and vt[0].shape[1] != n_slots or (not vf and vt[0].shape[0] != n_slots):
        raise ValueError("K and V stores hold different slot counts")
    idx64 = max(t.numel() for t in kt + vt) >= 2 ** 31
    mid_o = torch.empty(B, HQ, num_splits, DV, device=dev, dtype=torch.float32)
    mid_l = torch.empty(B, HQ, num_splits, device=dev, dtype=torch.float32)
    out = torch.empty(B, HQ, DV, device=dev, dtype=torch.float32)
    if B == 0:
        return out
    block_h = max(16, triton.next_power_of_2(QPK))
    while True:
        try:
            _decode_split_kernel[(B * HKV, num_splits)](
                q, qr, *kt, *vt, block_table, seq_lens, seq_rows, mid_o, mid_l,
                n_slots, ksh, kss, vsh, vss, q.stride(0), q.stride(1), block_table.stride(0),
                sm_scale * LOG2E, int(sliding_window or 0), chunk, num_splits,
                HKV=HKV, QPK=QPK, BLOCK_H=block_h, D=D, DV=DV, PAGE=page_size, BLOCK_N=block_n,
                K_FMT=kf, K_BITS=kb, K_G=kg, K_NOUT=kno, K_SIDE=kside,
                V_FMT=vf, V_BITS=vb, V_G=vg, V_NOUT=vno, V_SIDE=vside,
                N_SINK=n_sink, N_RING=n_ring, ROT=rot, IDX64=idx64, num_warps=num_warps,
                num_stages=num_stages,
            )
            break
        except triton.runtime.errors.OutOfResources:
            if block_n <= 16:
                raise
            block_n //= 2  # same chunk (a multiple of the smaller tile), smaller tiles
    _decode_reduce_kernel[(B * HQ,)](
        mid_o, mid_l, out, num_splits, out.stride(0), out.stride(1),
        HQ=HQ, DV=DV, SPLITS_P=max(2, triton.next_power_of_2(num_splits)),
    )
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
