"""The quantized KV codec: int8/int4/int3/int2 (asymmetric, grouped) and fp4 cache storage.

:class:`QuantCodec` stores the K or V rows of one layer with the arithmetic of
:mod:`localmoe.kv.quant_ops` (the PyTorch twins of the Triton kernels in
:mod:`localmoe.kernels.kv_quant_append` and :mod:`localmoe.kernels.decode_attention`) and reads
them back; the kernels write and read exactly these stores.

**Per-channel keys** (KIVI, Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit
Quantization for KV Cache"; format option ``int4:c``, ``codec.channel``): for keys of the int
formats, one fp16 scale and zero per (page, head, channel) from the min/max of that channel over
the ``PAGE = block_size`` tokens of a cache page, codes as for per-token groups. A page is
quantized when its last token is written; until then its tokens live only in the fp16 ring (ring
size ``max(window, PAGE)``), which every read consults first. No rotation in this mode. Outliers
(``KVSpec.key_outliers()``, option ``koutliers=``; ``outliers=`` applies to values and
per-token keys) are chosen per page when it is quantized: for each token the ``n_out`` channels
whose exclusion shrinks their channel's page range most
(:func:`~localmoe.kv.quant_ops.select_channel_outliers`); they are left out of the min/max, get
code 0 (so their packed value is the channel's ``czero``) and are stored exactly in
``oidx``/``oval`` at the token's slot, the same entries as per-token outliers (a read overwrites
them; the decode kernel adds ``q[c] * (oval - czero[page, c])`` to the token's score instead).
Error bound per value: half a step of the channel's range over the page, see
:func:`~localmoe.kv.quant_ops.channel_error_bound`.

Optional extras, all per :class:`~localmoe.kv.spec.KVSpec`:

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
attention kernel; ``H = n_kv_heads``, ``D = head_dim``, ``S = n_slots``, ``NG = D / G``; the
bit packing of ``q``/``q_hi`` is the split-plane layout of :mod:`localmoe.kv.quant_ops`):

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
"""

from __future__ import annotations

from typing import Any

import torch

from localmoe.errors import KVCacheFormatError
from localmoe.kv.codec import KVCodec
from localmoe.kv.formats import QUANT_FORMATS, KVFormat
from localmoe.kv.quant_ops import (FP4_GROUP, FP16_MAX, dequantize_channel, dequantize_fp4,
                                   dequantize_int, hadamard, outlier_count, pack_codes,
                                   plane_bits, quantize_channel, quantize_fp4, quantize_int,
                                   select_channel_outliers, select_outliers, unpack_codes)

__all__ = ["QuantCodec", "QUANT_FORMATS", "DEFAULT_KEY_ROTATE", "MIN_CHANNEL_PAGE",
           "key_grouping"]

# Default key rotation in per-token mode: none (measured, see docs/KV-QUALITY.md). Set per
# codec with ``rotate=True``.
DEFAULT_KEY_ROTATE = False
# Smallest cache page (block size) for per-channel keys. The default key grouping that
# KVSpec.parse applies is formats.DEFAULT_KEY_GROUPING (measured in docs/KV-QUALITY.md).
MIN_CHANNEL_PAGE = 4


def _outlier_frac(kv_spec: Any, role: str) -> float:
    """Outlier fraction of the codec of ``role``: :meth:`KVSpec.key_outliers` for keys,
    ``outlier_frac`` for values (specs built without the keys' field count as per-token)."""
    if role == "k" and hasattr(kv_spec, "key_outliers"):
        return float(kv_spec.key_outliers())
    return float(kv_spec.outlier_frac)


def key_grouping(fmt: KVFormat, role: str) -> str:
    """Effective grouping (``"channel"`` or ``"token"``) of a codec of ``fmt`` in ``role``
    ("k"/"v"): ``"channel"`` when the format says so (``int4:c``; :meth:`KVSpec.parse` fills in
    ``formats.DEFAULT_KEY_GROUPING`` for keys when the user names no grouping), else per token.

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


def _first_position(positions: torch.Tensor, t: int, start: int | None) -> int:
    """First position of a per-channel key write: ``start``, or ``positions[0]`` after checking
    (on the host) that ``positions`` LongTensor[t] is consecutive.

    Raises:
        ValueError: positions are not consecutive (checked only without ``start``).
    """
    if start is not None:
        return int(start)
    pos = positions.detach().to("cpu", torch.long)
    p0 = int(pos[0])
    if not torch.equal(pos, torch.arange(p0, p0 + t)):
        raise ValueError("per-channel keys need consecutive positions in one write")
    return p0


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

    def __init__(self, fmt: KVFormat, n_kv_heads: int, head_dim: int, kv_spec: Any, *,
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
    def bits_per_value(cls, fmt: KVFormat, head_dim: int, kv_spec: Any, *, role: str = "k",
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
        p0 = _first_position(positions, t, start)
        first_end = (p0 // page + 1) * page - 1            # first position completing a page
        n_pages = len(range(first_end, p0 + t, page))      # pages this call completes
        prior = None
        if n_pages and first_end - page + 1 < p0:
            # tokens of the first completed page written by earlier calls: read them before
            # this call's ring writes can overwrite their ring entries
            prior = self._page_prior(store, slots, x.device, p0, first_end, seq_row, start)
        self.write_side(store, x, positions, seq_row, start=start)
        if not n_pages:
            return
        vals, blocks = self._completed_pages(x, slots, p0, first_end, prior,
                                             check_aligned=start is None)
        self._store_pages(store, vals, blocks)

    def _page_prior(self, store: dict[str, torch.Tensor], slots: torch.Tensor, dev: Any, p0: int,
                    first_end: int, seq_row: int | None, start: int | None) -> torch.Tensor:
        """float32 [p0 - page start, H, D]: the tokens of the page ending at ``first_end`` that
        earlier calls wrote (from the ring, the sink buffer or the page's codes)."""
        page = self.block_size
        lo = first_end - page + 1
        pp = torch.arange(lo, p0, device=dev)
        blk0 = slots[first_end - p0].to(dev, torch.long) // page
        ps = blk0 * page + pp % page
        return self.read(store, ps, positions=pp, seq_row=seq_row,
                         start=None if start is None else lo)

    def _completed_pages(self, x: torch.Tensor, slots: torch.Tensor, p0: int, first_end: int,
                         prior: torch.Tensor | None, check_aligned: bool
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pages a write of ``x`` [T, H, D] at ``p0 ..`` completes, fp16-rounded, as float32
        [NP, PAGE, H, D] (the first page's earlier tokens from ``prior``), and their block ids
        LongTensor[NP].

        Raises:
            ValueError: with ``check_aligned``, a page's last slot is not at the page end.
        """
        page = self.block_size
        dev = x.device
        t = x.shape[0]
        xh = x.float().clamp(-FP16_MAX, FP16_MAX).to(torch.float16).float()
        idx = torch.arange(first_end - p0, t, page, device=dev)  # in-call index of page ends
        end_slots = slots.to(dev).long()[idx]
        if check_aligned and bool(((end_slots % page) != page - 1).any()):
            raise ValueError("slots are not page-aligned with their positions")
        blocks = end_slots // page                               # [NP]
        off = torch.arange(page, device=dev)
        tok = idx[:, None] - (page - 1) + off                    # [NP, PAGE] in-call index
        vals = xh[tok.clamp(min=0)]                              # [NP, PAGE, H, D]
        if prior is not None:
            n_prior = prior.shape[0]
            vals[0, :n_prior] = prior.clamp(-FP16_MAX, FP16_MAX).to(torch.float16).float()
        return vals, blocks

    def _store_pages(self, store: dict[str, torch.Tensor], vals: torch.Tensor,
                     blocks: torch.Tensor) -> None:
        """Quantize whole pages ``vals`` float32 [NP, PAGE, H, D] per channel (with their
        outliers) into the slots and ``cscale``/``czero`` rows of ``blocks`` LongTensor[NP]."""
        self._put_pages([store], self._page_parts(vals), blocks)

    def _page_parts(self, vals: torch.Tensor) -> dict[str, torch.Tensor]:
        """Store entries of whole pages ``vals`` float32 [NP, PAGE, H', D] quantized per
        channel, head-major like the store (``q``/``q_hi``/``oidx``/``oval`` [H', NP * PAGE,
        ...], ``cscale``/``czero`` [H', NP, D]). ``H'`` may be several layers' heads side by
        side: every (head, channel) of a page is quantized on its own."""
        h = vals.shape[2]
        exclude = None
        out: dict[str, torch.Tensor] = {}
        if self.n_out:
            oidx, exclude = select_channel_outliers(vals, self.n_out, exclude)
        codes, cscale, czero = quantize_channel(vals, self.bits, exclude)
        if self.n_out:
            # outlier entries get code 0, so their packed value is the channel's zero: the
            # decode kernel adds ``q[c] * (oval - czero[c])`` per outlier instead of patching
            # the key tile (same result as the overwrite in dequantize_channel_slots)
            codes = codes.masked_fill(exclude, 0)
            oidx = oidx.reshape(-1, h, self.n_out)
            out["oidx"] = oidx.transpose(0, 1).to(torch.uint8)
            oval = torch.gather(vals.reshape(-1, h, self.head_dim), -1, oidx)
            out["oval"] = oval.transpose(0, 1).to(torch.float16)
        codes = codes.reshape(-1, h, self.head_dim).transpose(0, 1)  # [H', n, D]
        if self.bits == 3:
            out["q"] = pack_codes(codes & 3, 2)
            out["q_hi"] = pack_codes(codes >> 2, 1)
        else:
            out["q"] = pack_codes(codes, self.pbits)
        out["cscale"] = cscale.transpose(0, 1)
        out["czero"] = czero.transpose(0, 1)
        return out

    def _put_pages(self, stores: list[dict[str, torch.Tensor]], parts: dict[str, torch.Tensor],
                   blocks: torch.Tensor) -> None:
        """Write :meth:`_page_parts` of ``len(stores)`` layers (heads ``i * H .. (i+1) * H``
        for ``stores[i]``) at the slots of ``blocks`` LongTensor[NP]."""
        page, h = self.block_size, self.n_kv_heads
        ss = (blocks[:, None] * page + torch.arange(page, device=blocks.device)).reshape(-1)
        for i, store in enumerate(stores):
            for k, v in parts.items():
                v = v[i * h:(i + 1) * h]
                if k in ("cscale", "czero"):
                    store[k][:, blocks] = v
                else:
                    store[k][:, ss] = v

    def write_channel_layers(self, stores: list[dict[str, torch.Tensor]], slots: torch.Tensor,
                             xs: torch.Tensor, seq_row: int | None, start: int) -> None:
        """:meth:`write_channel` of several layers' keys at the same slots, the pages of all
        of them quantized together (a prompt's keys: ~80 small device ops instead of ~80 per
        layer). Stores the same bytes as one :meth:`write_channel` per layer.

        Args:
            stores: the layers' storage (:meth:`alloc`), one per row of ``xs``.
            slots: LongTensor[T] page-aligned slots of positions ``start .. start+T-1``.
            xs: float Tensor[L, T, H, D] new keys of ``L`` layers.
            seq_row: row of the sequence in the side buffers (None: row 0).
            start: Python int, the first position (not read back from the device).
        """
        n_layers, t = xs.shape[0], xs.shape[1]
        page = self.block_size
        if t == 0 or n_layers == 0:
            return
        if start % page or n_layers == 1:
            # a first page begun by earlier calls (its earlier tokens come per layer from the
            # ring, the sinks or the page's codes), or a single layer: the per-layer write
            for store, x in zip(stores, xs):
                self.write_channel(store, slots, x, None, seq_row, start=start)
            return
        for store, x in zip(stores, xs):
            self.write_side(store, x, None, seq_row, start=start)
        if t < page:
            return
        x = xs.transpose(0, 1).reshape(t, n_layers * self.n_kv_heads, self.head_dim)
        vals, blocks = self._completed_pages(x, slots, start, start + page - 1, None,
                                             check_aligned=False)
        self._put_pages(stores, self._page_parts(vals), blocks)

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
