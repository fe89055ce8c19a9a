"""Quantize-and-append: pack new tokens' K or V into the paged quantized KV store.

Algorithm (one program per (token, kv head)): load the token's ``D`` channels in float32, pick
the ``N_OUT`` largest-|x| channels as outliers by repeated argmax (ties to the lower index),
compute per-group statistics over the remaining channels (int: min and max -> fp16 scale and
zero; fp4: absmax -> E4M3 scale), round every channel to its code, and pack codes into bytes
with the split-plane layout. Everything is written straight into the store at the token's slot.

Packed layout (see :mod:`localmoe.kv.quant_codec`, whose functions are the twin): head-major tensors
``q`` uint8 [H, S, D*P/8] (P = 2 for int3, else bits), ``q_hi`` uint8 [H, S, D/8] (int3 high
bit), ``scale`` fp16 [H, S, D/G] (E4M3 uint8 for fp4), ``zero`` fp16 [H, S, D/G], ``oidx``
uint8 [H, S, N_OUT], ``oval`` fp16 [H, S, N_OUT]. Channel ``d`` of a row of ``RB = D*P/8``
bytes sits in byte ``d % RB`` at bit ``(d // RB) * P`` (split planes).

Sources: KIVI (Liu et al., 2024) for asymmetric grouped integer KV quantization; KVQuant
(Hooper et al., 2024) for dense-and-sparse outliers; OCP Microscaling spec / NVFP4 for E2M1
values with E4M3 scales.

Sink and window copies (plain fp16 side buffers) and the optional key rotation are done by the
launcher with torch ops; the twin is :meth:`localmoe.kv.quant_codec.QuantCodec.write`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def quant_store_row(x, row, Q, QH, Scale, Zero, OIdx, OVal,
                    D: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
                    IS_FP4: tl.constexpr, N_OUT: tl.constexpr):
    """Quantize one head row ``x`` float32 [D] and store it at packed row ``row`` (= head *
    n_slots + slot) of the store tensors (see the module docstring for the layout). Shared
    by :func:`kv_quant_append` and :mod:`localmoe.kernels.qk_rope_append`."""
    d = tl.arange(0, D)
    x = tl.minimum(tl.maximum(x, -65504.0), 65504.0)

    # --- outliers: repeated argmax of |x| ---------------------------------------------------
    is_out = d < 0
    a = tl.abs(x)
    for j in tl.static_range(N_OUT):
        am = tl.where(is_out, -1.0, a)
        mx = tl.max(am, axis=0)
        i = tl.min(tl.where(am == mx, d, D), axis=0)
        is_out = is_out | (d == i)
        tl.store(OIdx + row * N_OUT + j, i.to(tl.uint8))
        v = tl.sum(tl.where(d == i, x, 0.0), axis=0)
        tl.store(OVal + row * N_OUT + j, v.to(tl.float16))

    NG: tl.constexpr = D // G
    if IS_FP4:
        ag = tl.reshape(tl.where(is_out, 0.0, a), [NG, G])
        s = tl.max(ag, axis=1) / 6.0
        s = tl.minimum(tl.maximum(s, 0.001953125), 448.0)
        e = (((s.to(tl.int32, bitcast=True) >> 23) & 255) - 127).to(tl.float32)
        m = tl.floor(s * tl.exp2(3.0 - e) + 0.5)
        code_s = (e + 7.0) * 8.0 + m - 8.0
        code_s = tl.where(e < -6.0, tl.floor(s * 512.0 + 0.5), code_s)
        code_s = tl.minimum(tl.maximum(code_s, 0.0), 126.0).to(tl.int32)
        tl.store(Scale + row * NG + tl.arange(0, NG), code_s.to(tl.uint8))
        # decode the stored scale
        se = (code_s >> 3) & 15
        sm = (code_s & 7).to(tl.float32)
        sdec = tl.where(se == 0, sm * 0.001953125, (8.0 + sm) * tl.exp2(se.to(tl.float32) - 10.0))
        inv = 1.0 / sdec
        vg = tl.reshape(x, [NG, G]) * inv[:, None]
        av = tl.abs(vg)
        mag = ((av > 0.25).to(tl.int32) + (av > 0.75).to(tl.int32) + (av > 1.25).to(tl.int32)
               + (av > 1.75).to(tl.int32) + (av > 2.5).to(tl.int32) + (av > 3.5).to(tl.int32)
               + (av > 5.0).to(tl.int32))
        codes = tl.reshape(mag | ((vg < 0).to(tl.int32) << 3), [D])
    else:
        xg = tl.reshape(x, [NG, G])
        og = tl.reshape(is_out, [NG, G])
        mn = tl.min(tl.where(og, float("inf"), xg), axis=1)
        mx = tl.max(tl.where(og, float("-inf"), xg), axis=1)
        QMAX: tl.constexpr = (1 << BITS) - 1
        zero16 = mn.to(tl.float16)
        zero = zero16.to(tl.float32)
        scale16 = tl.minimum((mx - zero) / QMAX, 65504.0).to(tl.float16)
        scale = scale16.to(tl.float32)
        tl.store(Scale + row * NG + tl.arange(0, NG), scale16)
        tl.store(Zero + row * NG + tl.arange(0, NG), zero16)
        inv = tl.where(scale > 0, 1.0 / scale, 0.0)
        c = tl.floor((xg - zero[:, None]) * inv[:, None] + 0.5)
        c = tl.minimum(tl.maximum(c, 0.0), QMAX)
        codes = tl.reshape(c.to(tl.int32), [D])

    # --- pack (split planes: channel d -> byte d % RB, bit (d // RB) * P) -----------------
    P: tl.constexpr = 2 if BITS == 3 else BITS
    PACK: tl.constexpr = 8 // P
    RB: tl.constexpr = D // PACK
    lo = codes & ((1 << P) - 1)
    sh = (tl.arange(0, PACK) * P)[:, None]
    byte = tl.sum(tl.reshape(lo, [PACK, RB]) << sh, axis=0)
    tl.store(Q + row * RB + tl.arange(0, RB), byte.to(tl.uint8))
    if BITS == 3:
        RB2: tl.constexpr = D // 8
        hi = (codes >> 2) & 1
        sh2 = tl.arange(0, 8)[:, None]
        byte2 = tl.sum(tl.reshape(hi, [8, RB2]) << sh2, axis=0)
        tl.store(QH + row * RB2 + tl.arange(0, RB2), byte2.to(tl.uint8))


@triton.jit
def _kv_quant_append_kernel(
    X, Slots, Q, QH, Scale, Zero, OIdx, OVal,
    n_slots, stride_xt, stride_xh,
    H: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
    IS_FP4: tl.constexpr, N_OUT: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    x = tl.load(X + t * stride_xt + h * stride_xh + d).to(tl.float32)
    slot = tl.load(Slots + t).to(tl.int64)
    row = h * n_slots + slot
    quant_store_row(x, row, Q, QH, Scale, Zero, OIdx, OVal, D, BITS, G, IS_FP4, N_OUT)


def kv_quant_append(codec, store: dict, slots: torch.Tensor, x: torch.Tensor,
                    positions: torch.Tensor, seq_row: int | None = None, *,
                    start: int | None = None) -> None:
    """Quantize ``x`` float [T, H, D] (fp16/bf16/fp32) into ``store`` at ``slots`` with the
    Triton kernel; the same bytes as ``codec.write`` (the twin, up to rare +-1 code differences
    where GPU division rounds differently at a half step).

    Args:
        codec: a :class:`localmoe.kv.quant_codec.QuantCodec` (format, group, outliers, rotation).
        store: the codec's storage dict (from ``codec.alloc``), on the same device as ``x``.
        slots: LongTensor[T] slot of each token.
        positions: LongTensor[T] token positions (sink/window side copies).
        seq_row: sequence row of the side buffers.
        start: the first position as a Python int when ``positions`` is ``start .. start+T-1``
            (the decode path): the side copies then read nothing back from the device.

    Raises:
        ValueError: shapes, devices or head_dim do not fit the codec.
    """
    T, H, D = x.shape
    if H != codec.n_kv_heads or D != codec.head_dim:
        raise ValueError(f"x has shape {tuple(x.shape)}, codec expects [T, {codec.n_kv_heads}, "
                         f"{codec.head_dim}]")
    if D & (D - 1):
        raise ValueError(f"the append kernel needs a power-of-two head_dim, got {D}")
    if slots.numel() != T:
        raise ValueError("one slot per token is required")
    if T == 0:
        return
    xr = codec.prepare(x) if codec.rotate else x
    xr = xr.contiguous()
    slots = slots.to(x.device)
    q = store["q"]
    dummy = q
    _kv_quant_append_kernel[(T, H)](
        xr, slots, q, store.get("q_hi", dummy), store["scale"], store.get("zero", dummy),
        store.get("oidx", dummy), store.get("oval", dummy),
        q.shape[1], xr.stride(0), xr.stride(1),
        H=H, D=D, BITS=codec.bits, G=codec.group, IS_FP4=codec.is_fp4, N_OUT=codec.n_out,
    )
    codec.write_side(store, x, positions, seq_row, start=start)


def kv_quant_append_ref(codec, store: dict, slots: torch.Tensor, x: torch.Tensor,
                        positions: torch.Tensor, seq_row: int | None = None) -> None:
    """PyTorch twin of :func:`kv_quant_append` (``codec.write``)."""
    codec.write(store, slots, x, positions, seq_row)
