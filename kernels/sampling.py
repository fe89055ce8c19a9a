"""Token sampling on the device: the CPU sampler's chain on ``[B, V]`` logits, graph-capturable.

The semantics are those of :class:`localmoe.engine.sampling.Sampler` (its module docstring is
the specification); per row:

1. NaN -> ``-inf``;
2. penalties from ``counts [B, V] int32`` (how often each id occurs in the row's
   ``repeat_last_n`` window; exempt ids are kept at count 0 by the caller, see
   :func:`counts_from_history` / :func:`update_counts`): where ``count > 0``,
   ``x = x / repeat_penalty if x > 0 else x * repeat_penalty`` then
   ``x -= count * frequency_penalty + presence_penalty`` (float32, IEEE division, no fused
   multiply-add: bit-identical to the NumPy sampler);
3. logit bias (a dense ``[B or 1, V]`` float32 row added, zeros where there is no bias);
4. grammar bitmask (packed int32 ``[B, ceil(V/32)]``, bit ``i % 32`` of word ``i // 32`` set =
   token ``i`` allowed -- llguidance's layout); the log-probability of the chosen token is
   taken here (log-softmax at temperature 1);
5. greedy short-cut (temperature <= 1e-5, top_k == 1 or top_p == 0): the argmax, lowest id on
   ties; a row whose logits are all ``-inf`` after steps 1-4 gets the first allowed id (with a
   bitmask) or the first id whose raw logit is not NaN (0 if none), and a row with ``+inf``
   logits samples among those only -- both as the CPU sampler;
6. otherwise top_k, top_p (mass of the softmax at temperature 1 over the top_k survivors),
   min_p (``x >= x_max + ln(min_p)``, float32), temperature, and one categorical draw by the
   Gumbel-max trick (``argmax((x - x_max) / T - ln(-ln u))``, exact for the categorical
   distribution), ``u`` from Philox (``tl.philox``) keyed by the row's 64-bit seed with the
   candidate's position and the row's step counter as the counter: the seed and the counter
   live in device tensors, and the drawing kernel advances the counter, so a replayed CUDA
   graph draws fresh numbers. Same seed + same logits + same step -> same ids on the same
   device; the stream differs from the CPU sampler's NumPy PCG64, so a seeded request gives
   other (equally distributed) tokens than on the CPU.

Launches per step: greedy batches 2 (a split pass over the vocabulary that also writes the
processed logits, then a per-row combine); stochastic batches without top_k / top_p 4 (plus
a split draw pass and its combine); with top_k / top_p the sorted candidates, then one
per-row kernel over them that stops at the top_p prefix. Candidates of a top_k up to
:data:`TOPK_MAX`: a bitonic top-k (``tl.topk``; Shanbhag et al., 2018, "Efficient Top-K Query
Processing on Massively Parallel Hardware") over int64 keys packing the logit's
order-preserving bits and the id, each block's best in the split pass, then merge passes of
at most :data:`MERGE_KEYS` keys per program (2 at 151,936 entries; ties: the lower id first;
one program merging all 75 blocks' 64 keys took 73 us on the H200, as long as the
``torch.topk`` it replaces); larger top_k ``torch.topk``, top_p over the whole
vocabulary ``torch.sort``. No host synchronization, no data-dependent shape, no ``.item()``:
the whole call can be captured in a CUDA graph (all shapes depend only on ``B``, ``V`` and the
static fields of :class:`DeviceSamplingParams`).

Numerics that differ from the CPU sampler (greedy ids do not: steps 1-5 are bit-identical):
the log-sum-exp and top_p's cumulative mass accumulate in float32 (NumPy: float64), so a
logprob differs by ~1e-6 and a top_p boundary token whose cumulative mass is within ~1e-6 of
``top_p`` may fall on the other side; ties at the top_k boundary break by the lower id (by
``torch.topk``'s order above :data:`TOPK_MAX`; the CPU: arbitrary too).

:func:`sample_ref` is the torch twin (plain torch ops, random numbers from a
``torch.Generator``); :func:`sample_device` runs the Triton kernels on CUDA tensors and under
``TRITON_INTERPRET=1``, else the twin.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import NamedTuple, Sequence

import numpy as np
import torch

from localmoe.kernels.host import cdiv, next_pow2

__all__ = ["DeviceSamplingParams", "DeviceSample", "sample_device", "sample_ref",
           "update_counts", "counts_from_history", "pack_mask", "GREEDY_TEMPERATURE"]

GREEDY_TEMPERATURE = 1e-5  # as localmoe.engine.sampling (not imported: kernels sit below engine)
BLOCK = 2048  # vocabulary entries per program of the split passes
CAND_BLOCK = 1024  # sorted candidates per loop step of the candidate kernel
TOPK_MAX = 64  # the largest candidate count the top-k kernels serve (then torch.topk)
MERGE_KEYS = 1024  # keys per program of a top-k merge pass
_BIG = 2 ** 31 - 1


# ------------------------------------------------------------------------------ parameters
@dataclasses.dataclass
class DeviceSamplingParams:
    """Per-row sampling parameters as device tensors (build with :meth:`build`).

    Attributes (``[B]`` tensors on the logits' device):
        temperature: float32. top_k: int32 (0 = off). top_p: float32 (1 = off).
        log_min_p: float32, ``ln(min_p)`` (``-inf`` = off). greedy: int32 (1 = argmax).
        repeat_penalty / frequency_penalty / presence_penalty: float32.
        seed: int64, the Philox key (any 64-bit pattern). step: int64, the draw counter; the
            drawing kernel adds 1 per draw (reset it to replay a stream).
        bias: float32 ``[B or 1, V]`` added to the logits, or None.
        vocab_size: ``V``: ids ``>= V`` are never sampled (padded logits rows).
        has_penalties: some row has penalties (else ``counts`` is not read).
        n_cand: 0 = no sorted candidates needed (no row uses top_k / top_p); ``V`` = full sort;
            else ``torch.topk`` of that many (the largest top_k).
        stochastic: some row is not greedy.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    log_min_p: torch.Tensor
    greedy: torch.Tensor
    repeat_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    presence_penalty: torch.Tensor
    seed: torch.Tensor
    step: torch.Tensor
    bias: torch.Tensor | None
    vocab_size: int
    has_penalties: bool
    n_cand: int
    stochastic: bool

    @property
    def batch(self) -> int:
        return int(self.temperature.numel())

    @classmethod
    def build(cls, rows: Sequence, vocab_size: int, device, seeds: Sequence[int] | None = None
              ) -> "DeviceSamplingParams":
        """Parameters for ``len(rows)`` rows.

        Args:
            rows: per row, an object with the fields of
                :class:`localmoe.engine.sampling.SamplingParams` (temperature, top_k, top_p,
                min_p, repeat_penalty, repeat_last_n, frequency_penalty, presence_penalty,
                logit_bias as ``{id: bias}``, seed), already validated.
            vocab_size: ``V``.
            device: where the tensors live.
            seeds: per-row seeds overriding ``row.seed`` (a None seed without an override
                is drawn from OS entropy).
        Raises:
            ValueError: a ``logit_bias`` id outside ``[0, V)``.
        """
        V = int(vocab_size)
        B = len(rows)
        f = dict(temperature=[], top_k=[], top_p=[], log_min_p=[], greedy=[], repeat_penalty=[],
                 frequency_penalty=[], presence_penalty=[])
        seed_vals, has_pen, stoch, n_cand, bias_rows = [], False, False, 0, []
        for i, p in enumerate(rows):
            g = p.temperature <= GREEDY_TEMPERATURE or p.top_k == 1 or p.top_p <= 0.0
            f["temperature"].append(float(p.temperature))
            f["top_k"].append(int(p.top_k))
            f["top_p"].append(float(p.top_p))
            f["log_min_p"].append(math.log(p.min_p) if p.min_p > 0.0 else -math.inf)
            f["greedy"].append(int(g))
            pen = (p.repeat_last_n != 0 and (p.repeat_penalty != 1.0 or p.frequency_penalty != 0.0
                                             or p.presence_penalty != 0.0))
            has_pen |= pen
            f["repeat_penalty"].append(float(p.repeat_penalty) if pen else 1.0)
            f["frequency_penalty"].append(float(p.frequency_penalty) if pen else 0.0)
            f["presence_penalty"].append(float(p.presence_penalty) if pen else 0.0)
            s = seeds[i] if seeds is not None else p.seed
            if s is None:
                s = int.from_bytes(os.urandom(8), "little")
            s = int(s) & ((1 << 64) - 1)
            seed_vals.append(s - (1 << 64) if s >= (1 << 63) else s)  # as int64 bits
            if not g:
                stoch = True
                k = int(p.top_k) if 0 < p.top_k < V else V
                if k < V or p.top_p < 1.0:
                    n_cand = max(n_cand, k)
            bias_rows.append(dict(p.logit_bias or {}))
        if stoch and n_cand:
            # a row without truncation in a batch that sorts: it needs every candidate
            for p, g in zip(rows, f["greedy"]):
                if not g and not (0 < p.top_k < V):
                    n_cand = V
        bias = None
        if any(bias_rows):
            same = all(b == bias_rows[0] for b in bias_rows)
            bias = torch.zeros((1 if same else B, V), dtype=torch.float32)
            for r, b in enumerate(bias_rows[:1] if same else bias_rows):
                for tid, v in b.items():
                    if not 0 <= int(tid) < V:
                        raise ValueError(f"logit_bias token id {tid} is outside the vocabulary "
                                         f"(size {V})")
                    bias[r, int(tid)] = float(v)
            bias = bias.to(device)
        ff = {k: torch.tensor(v, dtype=torch.int32 if k in ("top_k", "greedy") else torch.float32,
                              device=device) for k, v in f.items()}
        return cls(seed=torch.tensor(seed_vals, dtype=torch.int64, device=device),
                   step=torch.zeros(B, dtype=torch.int64, device=device), bias=bias,
                   vocab_size=V, has_penalties=has_pen, n_cand=n_cand, stochastic=stoch, **ff)


class DeviceSample(NamedTuple):
    """What :func:`sample_device` returns (all on the logits' device).

    Attributes:
        ids: int64 ``[B]``, the sampled ids.
        logprobs: float32 ``[B]``, each id's log-probability at temperature 1 after
            penalties, bias and mask (``-inf`` when excluded or nothing is finite), or None.
        processed: float32 ``[B, V]``, the logits after steps 1-4 (``-inf`` = excluded), or
            None when not asked for and not needed.
    """

    ids: torch.Tensor
    logprobs: torch.Tensor | None
    processed: torch.Tensor | None


# ------------------------------------------------------------------------------ helpers
def pack_mask(allowed: np.ndarray) -> np.ndarray:
    """A bool ``[..., V]`` mask packed as int32 ``[..., ceil(V/32)]`` (bit ``i % 32`` of word
    ``i // 32`` = token ``i``; the bits past ``V`` are 0)."""
    a = np.asarray(allowed, dtype=bool)
    n = a.shape[-1]
    w = (n + 31) // 32
    if n != 32 * w:
        a = np.concatenate([a, np.zeros(a.shape[:-1] + (32 * w - n,), dtype=bool)], axis=-1)
    return np.packbits(a, axis=-1, bitorder="little").view(np.int32)


def counts_from_history(histories: Sequence[Sequence[int]], vocab_size: int, window: int,
                        exempt=(), device="cpu") -> torch.Tensor:
    """Token counts over each row's penalty window, int32 ``[B, V]`` on ``device``.

    Args:
        histories: per row, the token ids so far (prompt + generated).
        window: ``repeat_last_n`` (-1 = all, 0 = nothing counted).
        exempt: ids that are never penalized (kept at 0); ids outside ``[0, V)`` are ignored.
    """
    V = int(vocab_size)
    out = np.zeros((len(histories), V), dtype=np.int32)
    ex = np.fromiter((int(i) for i in exempt if 0 <= int(i) < V), dtype=np.int64)
    for r, h in enumerate(histories):
        if window == 0 or not len(h):
            continue
        w = np.asarray(h if window < 0 else h[-window:], dtype=np.int64)
        w = w[(w >= 0) & (w < V)]
        out[r] = np.bincount(w, minlength=V)[:V]
        if ex.size:
            out[r, ex] = 0
    return torch.from_numpy(out).to(device)


def update_counts(counts: torch.Tensor, ids: torch.Tensor, leaving: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """Add each row's new token to ``counts`` and take away the token that left its window,
    in place on the device (capture-safe: no host sync).

    Args:
        counts: int32 ``[B, V]``.
        ids: int ``[B]`` (or ``[B, 1]``), the token entering the window; ``-1`` = none (an
            exempt token: the caller passes -1 for ids it never penalizes).
        leaving: int ``[B]``, the token leaving the window (``repeat_last_n`` tokens ago), -1 =
            none; None = no row has one.
    Returns:
        ``counts``.
    """
    if triton is not None and _use_triton(counts) and counts.is_contiguous():
        B, V = counts.shape
        ids = ids.reshape(-1).to(device=counts.device, dtype=torch.int64)
        lv = ids if leaving is None else leaving.reshape(-1).to(device=counts.device,
                                                                 dtype=torch.int64)
        _update_counts_kernel[(B,)](counts, ids, lv, V, HAS_LEAVING=leaving is not None,
                                    num_warps=1)
        return counts
    for t, sign in ((ids, 1), (leaving, -1)):
        if t is None:
            continue
        t = t.reshape(-1, 1).to(device=counts.device, dtype=torch.int64)
        ok = (t >= 0) & (t < counts.shape[1])
        counts.scatter_add_(1, t.clamp(0, counts.shape[1] - 1), (ok.to(counts.dtype) * sign))
    return counts


def _use_triton(x: torch.Tensor) -> bool:
    if x.is_cuda:
        return True
    return os.environ.get("TRITON_INTERPRET", "") == "1"


# ------------------------------------------------------------------------------ kernels
try:
    import triton
    import triton.language as tl

    from localmoe.kernels.keys import PAD_KEY, key_low, key_score, score_key
except Exception:  # noqa: BLE001 -- no triton: the twin only
    triton = None

if triton is not None:
    @triton.jit
    def _gumbel(seed, pos, step_lo, step_hi):
        """-ln(-ln u), u uniform in (0, 1) from Philox(seed; pos, 0, step)."""
        z = pos.to(tl.uint32) * 0
        r0, _r1, _r2, _r3 = tl.philox(seed, pos.to(tl.uint32), z, z + step_lo, z + step_hi)
        # 23 bits, centred: u in [2**-24, 1 - 2**-24], exact in float32, so the noise is
        # always finite (an allowed token never scores -inf)
        u = ((r0 >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07
        return -tl.log(-tl.log(u))

    @triton.jit
    def _update_counts_kernel(c_ptr, ids_ptr, lv_ptr, V, HAS_LEAVING: tl.constexpr):
        b = tl.program_id(0)
        row = c_ptr + b.to(tl.int64) * V
        t = tl.load(ids_ptr + b)
        if (t >= 0) & (t < V):
            tl.store(row + t, tl.load(row + t) + 1)
        if HAS_LEAVING:
            t2 = tl.load(lv_ptr + b)
            if (t2 >= 0) & (t2 < V):
                tl.store(row + t2, tl.load(row + t2) - 1)

    @triton.jit
    def _prep_kernel(l_ptr, l_rs, x_ptr, c_ptr, bias_ptr, bias_rs, bits_ptr, bits_rs,
                     rp_ptr, fp_ptr, pp_ptr, pmax_ptr, parg_ptr, psum_ptr, pfirst_ptr, pok_ptr,
                     pk_ptr, V, S,
                     HAS_PEN: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
                     WRITE_X: tl.constexpr, BLOCK: tl.constexpr, KC: tl.constexpr):
        b = tl.program_id(0)
        s = tl.program_id(1)
        offs = s * BLOCK + tl.arange(0, BLOCK)
        inb = offs < V
        b64 = b.to(tl.int64)
        raw = tl.load(l_ptr + b64 * l_rs + offs, mask=inb, other=0.0).to(tl.float32)
        isnan = raw != raw
        x = tl.where(isnan, float("-inf"), raw)
        if HAS_PEN:
            c = tl.load(c_ptr + b64 * V + offs, mask=inb, other=0)
            rp = tl.load(rp_ptr + b)
            fr = tl.load(fp_ptr + b)
            pr = tl.load(pp_ptr + b)
            y = tl.where(x > 0, tl.math.div_rn(x, rp), x * rp)
            sub = c.to(tl.float32) * fr
            sub = sub + pr
            x = tl.where(c > 0, y - sub, x)
        if HAS_BIAS:
            x = x + tl.load(bias_ptr + b64 * bias_rs + offs, mask=inb, other=0.0)
        big = 2147483647
        if HAS_MASK:
            w = tl.load(bits_ptr + b64 * bits_rs + offs // 32, mask=inb, other=0)
            ok = ((w >> (offs % 32)) & 1) != 0
            x = tl.where(ok, x, float("-inf"))
            tl.store(pfirst_ptr + b * S + s, tl.min(tl.where(ok & inb, offs, big), axis=0))
        x = tl.where(inb, x, float("-inf"))
        if WRITE_X:
            tl.store(x_ptr + b64 * V + offs, x, mask=inb)
        m = tl.max(x, axis=0)
        arg = tl.argmax(x, axis=0, tie_break_left=True)
        e = tl.where(x == m, 1.0, tl.exp(x - m))
        ssum = tl.sum(tl.where(x > float("-inf"), e, 0.0), axis=0)
        tl.store(pmax_ptr + b * S + s, m)
        tl.store(parg_ptr + b * S + s, s * BLOCK + arg)
        tl.store(psum_ptr + b * S + s, ssum)
        tl.store(pok_ptr + b * S + s, tl.min(tl.where(~isnan & inb, offs, big), axis=0))
        if KC > 0:
            # first pass of the top-k: this block's KC largest processed logits as packed keys
            top = tl.topk(_cand_key(x, offs, inb), KC)
            tl.store(pk_ptr + (b64 * S + s) * KC + tl.arange(0, KC), top)

    @triton.jit
    def _cand_key(x, offs, inb):
        """int64 keys ordered as (logit, -id): the order-preserving int32 of the float32 logit
        in the high word, ``2**31 - 1 - id`` in the low word (ties: the lower id first);
        entries outside the row get the padding key ``-(2**63 - 1)``. -0.0 counts as +0.0."""
        return tl.where(inb, score_key(x, 2147483647 - offs), PAD_KEY)

    @triton.jit
    def _topk_merge_kernel(src_ptr, dst_ptr, vals_ptr, idx_ptr, n_in, n_out,
                           KC: tl.constexpr, GS: tl.constexpr, FINAL: tl.constexpr):
        """One merge pass of the top-k: program (b, g) keeps the KC largest keys of the lists
        ``g*GS .. g*GS+GS-1`` of row b's ``n_in`` lists (``src [B, n_in, KC]``). ``FINAL`` (one
        group left): sorted descending and unpacked into logits (float32) and ids (int32)
        ``[B, KC]``; else the keys go to list g of ``dst [B, n_out, KC]``."""
        b = tl.program_id(0)
        g = tl.program_id(1)
        r = g * GS + tl.arange(0, GS)[:, None]
        c = tl.arange(0, KC)[None, :]
        keys = tl.load(src_ptr + (b.to(tl.int64) * n_in + r) * KC + c, mask=r < n_in,
                       other=PAD_KEY)
        top = tl.topk(tl.reshape(keys, [GS * KC]), KC)
        kk = tl.arange(0, KC)
        if FINAL:     # (tl.topk's last merge leaves its keys sorted descending)
            val = key_score(top)
            idx = 2147483647 - key_low(top)
            pad = top == PAD_KEY
            tl.store(vals_ptr + b * KC + kk, tl.where(pad, float("-inf"), val))
            tl.store(idx_ptr + b * KC + kk, tl.where(pad, 0, idx))
        else:
            tl.store(dst_ptr + (b.to(tl.int64) * n_out + g) * KC + kk, top)

    @triton.jit
    def _finish_kernel(pmax_ptr, parg_ptr, psum_ptr, pfirst_ptr, pok_ptr, greedy_ptr,
                       ids_ptr, lp_ptr, m_ptr, lse_ptr, S,
                       HAS_MASK: tl.constexpr, SB: tl.constexpr):
        b = tl.program_id(0)
        ss = tl.arange(0, SB)
        sm = ss < S
        big = 2147483647
        pm = tl.load(pmax_ptr + b * S + ss, mask=sm, other=float("-inf"))
        pa = tl.load(parg_ptr + b * S + ss, mask=sm, other=big)
        ps = tl.load(psum_ptr + b * S + ss, mask=sm, other=0.0)
        m = tl.max(pm, axis=0)
        top = tl.min(tl.where(pm == m, pa, big), axis=0)
        w = tl.where(pm == m, ps, ps * tl.exp(pm - m))
        tot = tl.sum(tl.where(pm > float("-inf"), w, 0.0), axis=0)
        m_t = tl.where(m == float("inf"), 0.0, m)  # +inf rows sample among their +inf ids
        lse_t = m_t + tl.log(tot)
        if HAS_MASK:
            first = tl.min(tl.load(pfirst_ptr + b * S + ss, mask=sm, other=big), axis=0)
        else:
            first = tl.min(tl.load(pok_ptr + b * S + ss, mask=sm, other=big), axis=0)
        fallback = tl.where(first < big, first, 0)
        finite = (m > float("-inf")) & (m < float("inf"))
        ids = tl.where(m == float("-inf"), fallback, top)
        tl.store(ids_ptr + b, ids.to(tl.int64))
        tl.store(lp_ptr + b, tl.where(finite, m - lse_t, float("-inf")))
        tl.store(m_ptr + b, m)
        tl.store(lse_ptr + b, lse_t)

    @triton.jit
    def _draw_part_kernel(x_ptr, m_ptr, greedy_ptr, t_ptr, lmp_ptr, seed_ptr, step_ptr,
                          pscore_ptr, pidx_ptr, V, S, BLOCK: tl.constexpr):
        """Gumbel-max over the whole row (no top_k / top_p): the best of one block."""
        b = tl.program_id(0)
        s = tl.program_id(1)
        offs = s * BLOCK + tl.arange(0, BLOCK)
        inb = offs < V
        m = tl.load(m_ptr + b)
        x = tl.load(x_ptr + b.to(tl.int64) * V + offs, mask=inb, other=float("-inf"))
        y = tl.where(m == float("inf"), tl.where(x == float("inf"), 0.0, float("-inf")), x)
        m_t = tl.where(m == float("inf"), 0.0, m)
        thr = m_t + tl.load(lmp_ptr + b)
        temp = tl.load(t_ptr + b)
        step = tl.load(step_ptr + b)
        g = _gumbel(tl.load(seed_ptr + b), offs, (step & 0xFFFFFFFF).to(tl.uint32),
                    (step >> 32).to(tl.uint32))
        keep = inb & (y >= thr) & (y > float("-inf"))
        score = tl.where(keep, (y - m_t) / temp + g, float("-inf"))
        best = tl.max(score, axis=0)
        arg = tl.argmax(score, axis=0, tie_break_left=True)
        tl.store(pscore_ptr + b * S + s, best)
        tl.store(pidx_ptr + b * S + s, tl.where(best > float("-inf"), s * BLOCK + arg, 2147483647))

    @triton.jit
    def _draw_finish_kernel(x_ptr, pscore_ptr, pidx_ptr, m_ptr, lse_ptr, greedy_ptr, step_ptr,
                            ids_ptr, lp_ptr, V, S, SB: tl.constexpr):
        b = tl.program_id(0)
        ss = tl.arange(0, SB)
        sm = ss < S
        m = tl.load(m_ptr + b)
        if (tl.load(greedy_ptr + b) == 0) & (m > float("-inf")):
            sc = tl.load(pscore_ptr + b * S + ss, mask=sm, other=float("-inf"))
            pi = tl.load(pidx_ptr + b * S + ss, mask=sm, other=2147483647)
            best = tl.max(sc, axis=0)
            idx = tl.min(tl.where(sc == best, pi, 2147483647), axis=0)
            idx = tl.where(idx < V, idx, 0)
            xv = tl.load(x_ptr + b.to(tl.int64) * V + idx)
            ok = (m < float("inf")) & (xv > float("-inf"))
            tl.store(ids_ptr + b, idx.to(tl.int64))
            tl.store(lp_ptr + b, tl.where(ok, xv - tl.load(lse_ptr + b), float("-inf")))
            tl.store(step_ptr + b, tl.load(step_ptr + b) + 1)

    @triton.jit
    def _cand_kernel(vals_ptr, idx_ptr, K, m_ptr, lse_ptr, greedy_ptr, t_ptr, tk_ptr, tp_ptr,
                     lmp_ptr, seed_ptr, step_ptr, ids_ptr, lp_ptr, V, BLOCK: tl.constexpr):
        """top_k / top_p / min_p / temperature / draw over one row's sorted candidates."""
        b = tl.program_id(0)
        m = tl.load(m_ptr + b)
        if (tl.load(greedy_ptr + b) == 0) & (m > float("-inf")):
            row = b.to(tl.int64) * K
            is_inf = m == float("inf")
            lane = tl.arange(0, BLOCK)
            tk = tl.load(tk_ptr + b)
            k_eff = tl.where((tk > 0) & (tk < V), tk, V)
            k_eff = tl.minimum(k_eff, K)
            v0 = tl.load(vals_ptr + row)
            v0 = tl.where(is_inf, 0.0, v0)
            # the distribution top_p measures: over the top_k survivors (or the whole row)
            lse = tl.load(lse_ptr + b)
            if k_eff < V:
                acc = tl.zeros((BLOCK,), tl.float32)
                for start in range(0, k_eff, BLOCK):
                    j = start + lane
                    v = tl.load(vals_ptr + row + j, mask=j < k_eff, other=float("-inf"))
                    v = tl.where(is_inf, tl.where(v == float("inf"), 0.0, float("-inf")), v)
                    acc += tl.where(v > float("-inf"), tl.exp(v - v0), 0.0)
                lse = v0 + tl.log(tl.sum(acc, axis=0))
            # min_p: a prefix of the sorted candidates (x >= x_max + ln(min_p), float32)
            n_keep = k_eff
            lmp = tl.load(lmp_ptr + b)
            if lmp > float("-inf"):
                thr = v0 + lmp
                n_m = 0
                start = 0
                more = 1
                while (start < k_eff) & (more != 0):
                    j = start + lane
                    v = tl.load(vals_ptr + row + j, mask=j < k_eff, other=float("-inf"))
                    v = tl.where(is_inf, tl.where(v == float("inf"), 0.0, float("-inf")), v)
                    hit = (j < k_eff) & (v >= thr)
                    n_m += tl.sum(hit.to(tl.int32), axis=0)
                    more = tl.where(tl.sum(hit.to(tl.int32), axis=0) == BLOCK, 1, 0)
                    start += BLOCK
                n_keep = tl.maximum(n_m, 1)
            # top_p: the shortest prefix whose mass reaches top_p
            top_p = tl.load(tp_ptr + b)
            if top_p < 1.0:
                cum = 0.0
                n_p = 0
                start = 0
                while (start < n_keep) & (cum < top_p):
                    j = start + lane
                    jm = j < n_keep
                    v = tl.load(vals_ptr + row + j, mask=jm, other=float("-inf"))
                    v = tl.where(is_inf, tl.where(v == float("inf"), 0.0, float("-inf")), v)
                    c = cum + tl.cumsum(tl.where(jm, tl.exp(v - lse), 0.0), axis=0)
                    n_p += tl.sum((jm & (c < top_p)).to(tl.int32), axis=0)
                    cum = tl.max(tl.where(jm, c, 0.0), axis=0)
                    start += BLOCK
                n_keep = tl.maximum(tl.minimum(n_keep, n_p + 1), 1)
            # temperature and one Gumbel-max draw over the survivors
            temp = tl.load(t_ptr + b)
            step = tl.load(step_ptr + b)
            seed = tl.load(seed_ptr + b)
            s_lo = (step & 0xFFFFFFFF).to(tl.uint32)
            s_hi = (step >> 32).to(tl.uint32)
            best = float("-inf")
            best_j = 0
            for start2 in range(0, n_keep, BLOCK):
                j = start2 + lane
                jm = j < n_keep
                v = tl.load(vals_ptr + row + j, mask=jm, other=float("-inf"))
                v = tl.where(is_inf, tl.where(v == float("inf"), 0.0, float("-inf")), v)
                g = _gumbel(seed, j, s_lo, s_hi)
                sc = tl.where(jm & (v > float("-inf")), (v - v0) / temp + g, float("-inf"))
                bs = tl.max(sc, axis=0)
                bj = start2 + tl.argmax(sc, axis=0, tie_break_left=True)
                best_j = tl.where(bs > best, bj, best_j)
                best = tl.maximum(best, bs)
            tid = tl.load(idx_ptr + row + best_j)
            xv = tl.load(vals_ptr + row + best_j)
            ok = (m < float("inf")) & (xv > float("-inf"))
            tl.store(ids_ptr + b, tid.to(tl.int64))
            tl.store(lp_ptr + b, tl.where(ok, xv - tl.load(lse_ptr + b), float("-inf")))
            tl.store(step_ptr + b, step + 1)


def _launch_opts(x: torch.Tensor) -> dict:
    # no fused multiply-add: the penalties must round as the NumPy sampler's two operations
    return {"enable_fp_fusion": False} if x.is_cuda else {}


def sample_device(logits: torch.Tensor, params: DeviceSamplingParams, *,
                  counts: torch.Tensor | None = None, bitmask: torch.Tensor | None = None,
                  want_logprobs: bool = False, want_processed: bool = False,
                  workspace: dict | None = None) -> DeviceSample:
    """Sample one token per row on the logits' device (the chain in the module docstring).

    Args:
        logits: ``[B, V']`` (``V' >= params.vocab_size``; a ``[V']`` row is taken as
            ``B = 1``) float32/float16/bfloat16, any row stride, CUDA (or CPU: the Triton
            interpreter under ``TRITON_INTERPRET=1``, else the twin :func:`sample_ref`).
        params: :class:`DeviceSamplingParams` of ``B`` rows on the same device (its ``step``
            counters advance for the rows that draw).
        counts: int32 ``[B, V]`` window counts (required when ``params.has_penalties``).
        bitmask: int32 ``[B, ceil(V/32)]`` grammar mask, or None.
        want_logprobs: also return each id's log-probability.
        want_processed: also return the processed logits (for ``top_logprobs`` on the host).
        workspace: a dict the call keeps its buffers in between calls (no allocations per
            step); the returned tensors are then overwritten by the next call with it.
    Returns:
        :class:`DeviceSample`; nothing is synchronized (read ``ids`` when needed).
    Raises:
        ValueError: shapes or devices that do not fit.
    """
    x = logits.reshape(1, -1) if logits.dim() == 1 else logits
    B, V = x.shape[0], params.vocab_size
    _check(x, params, counts, bitmask)
    if not _use_triton(x) or triton is None:
        return sample_ref(x, params, counts=counts, bitmask=bitmask, want_logprobs=want_logprobs,
                          want_processed=want_processed)
    if x.stride(-1) != 1:
        x = x.contiguous()
    dev = x.device
    S = cdiv(V, BLOCK)
    SB = next_pow2(S)
    write_x = params.stochastic or want_processed
    ws = workspace if workspace is not None else {}
    key = (B, V, dev)
    if ws.get("key") != key:
        ws.clear()
        ws["key"] = key
    f32, i32 = torch.float32, torch.int32

    def buf(name, shape, dtype):
        t = ws.get(name)
        if t is None:
            t = ws[name] = torch.empty(shape, dtype=dtype, device=dev)
        return t

    xp = buf("xp", (B, V), f32) if write_x else x
    # sorted candidates of few top_k: the prep pass keeps each block's KC largest, merge passes
    # the row's (torch.topk over the vocabulary: ~48 us of kernels at 151,936 entries)
    KC = fused_topk_width(params.n_cand) if params.stochastic else 0
    # (the top-k buffers' names carry KC: one workspace may serve calls of other top_k)
    pk = buf(f"pk{KC}", (B, S, KC), torch.int64) if KC else x
    pmax, psum = buf("pmax", (B, S), f32), buf("psum", (B, S), f32)
    parg, pfirst, pok = (buf(n, (B, S), i32) for n in ("parg", "pfirst", "pok"))
    ids = buf("ids", (B,), torch.int64)
    lp, m, lse = (buf(n, (B,), f32) for n in ("lp", "m", "lse"))
    has_mask = bitmask is not None
    bias = params.bias
    opts = _launch_opts(x)
    _prep_kernel[(B, S)](
        x, x.stride(0), xp, counts if params.has_penalties else x,
        bias if bias is not None else x, 0 if bias is None or bias.shape[0] == 1 else V,
        bitmask if has_mask else x, bitmask.stride(0) if has_mask else 0,
        params.repeat_penalty, params.frequency_penalty, params.presence_penalty,
        pmax, parg, psum, pfirst, pok, pk, V, S,
        HAS_PEN=params.has_penalties, HAS_BIAS=bias is not None, HAS_MASK=has_mask,
        WRITE_X=write_x, BLOCK=BLOCK, KC=KC, num_warps=8, **opts)
    _finish_kernel[(B,)](pmax, parg, psum, pfirst, pok, params.greedy, ids, lp, m, lse, S,
                         HAS_MASK=has_mask, SB=SB, num_warps=1, **opts)
    if params.stochastic:
        if params.n_cand == 0:
            pscore, pidx = buf("pscore", (B, S), f32), buf("pidx", (B, S), i32)
            _draw_part_kernel[(B, S)](xp, m, params.greedy, params.temperature, params.log_min_p,
                                      params.seed, params.step, pscore, pidx, V, S, BLOCK=BLOCK,
                                      num_warps=8, **opts)
            _draw_finish_kernel[(B,)](xp, pscore, pidx, m, lse, params.greedy, params.step, ids,
                                      lp, V, S, SB=SB, num_warps=1, **opts)
        else:
            if KC:
                vals, idx = buf(f"cvals{KC}", (B, KC), f32), buf(f"cidx{KC}", (B, KC), i32)
                # merge passes of at most MERGE_KEYS keys per program until one list is left
                # (151,936 entries, KC 64: 75 lists -> 5 -> 1)
                GS = max(2, MERGE_KEYS // KC)
                src, n, lvl = pk, S, 0
                while True:
                    G = cdiv(n, GS)
                    dst = buf(f"pk{KC}_{lvl}", (B, G, KC), torch.int64) if G > 1 else src
                    _topk_merge_kernel[(B, G)](src, dst, vals, idx, n, G, KC=KC,
                                               GS=next_pow2(min(GS, n)), FINAL=G == 1,
                                               num_warps=4)
                    if G == 1:
                        break
                    src, n, lvl = dst, G, lvl + 1
            else:
                vals, idx = _candidates(xp, params.n_cand)
            _cand_kernel[(B,)](vals, idx, vals.shape[1], m, lse, params.greedy,
                               params.temperature, params.top_k, params.top_p, params.log_min_p,
                               params.seed, params.step, ids, lp, V, BLOCK=CAND_BLOCK,
                               num_warps=4, **opts)
    return DeviceSample(ids, lp if want_logprobs else None, xp if want_processed else None)


def fused_topk_width(n_cand: int) -> int:
    """Candidates per row that the top-k kernels keep for ``n_cand`` (a power of two
    >= 2), or 0 where ``torch.topk`` / ``torch.sort`` serves (no candidates needed, more than
    :data:`TOPK_MAX`, or a Triton without ``tl.topk``)."""
    if n_cand <= 0 or n_cand > TOPK_MAX or triton is None or not hasattr(tl, "topk"):
        return 0
    return max(2, next_pow2(n_cand))


def _candidates(xp: torch.Tensor, k: int, stable: bool = False):
    """The ``k`` largest processed logits of each row, sorted descending, and their ids
    (``stable``: equal logits by increasing id, the order of the top-k kernels)."""
    if stable:
        vals, idx = torch.sort(xp, dim=1, descending=True, stable=True)
        return vals[:, :k].contiguous(), idx[:, :k].contiguous()
    if k >= xp.shape[1]:
        vals, idx = torch.sort(xp, dim=1, descending=True)
    else:
        vals, idx = torch.topk(xp, k, dim=1, largest=True, sorted=True)
    return vals.contiguous(), idx.contiguous()


def _check(x, params, counts, bitmask) -> None:
    B, V = x.shape[0], params.vocab_size
    if x.dim() != 2 or x.shape[1] < V:
        raise ValueError(f"sample_device: logits {tuple(x.shape)} for a vocabulary of {V}")
    if params.batch != B:
        raise ValueError(f"sample_device: {params.batch} rows of parameters for {B} logits rows")
    if params.temperature.device != x.device:
        raise ValueError(f"sample_device: parameters on {params.temperature.device}, logits on "
                         f"{x.device}")
    if params.has_penalties and (counts is None or tuple(counts.shape) != (B, V)
                                 or counts.dtype != torch.int32 or not counts.is_contiguous()):
        raise ValueError(f"sample_device: penalties need contiguous int32 counts [{B}, {V}]")
    if bitmask is not None and (bitmask.dtype != torch.int32 or bitmask.dim() != 2
                                or bitmask.shape[0] != B or bitmask.shape[1] < (V + 31) // 32
                                or bitmask.stride(-1) != 1):
        raise ValueError(f"sample_device: bitmask must be int32 [{B}, {(V + 31) // 32}]")


# ------------------------------------------------------------------------------ twin
def sample_ref(logits: torch.Tensor, params: DeviceSamplingParams, *,
               counts: torch.Tensor | None = None, bitmask: torch.Tensor | None = None,
               want_logprobs: bool = False, want_processed: bool = False) -> DeviceSample:
    """The torch twin of :func:`sample_device`: plain torch ops, the same steps, float32
    numerics and Philox stream (:func:`philox_ref`), so it draws the same ids as the kernels
    (up to the last-bit rounding of ``exp``/``log``, which can only flip a near-exact tie).
    The ``step`` counters advance for the rows that draw, as in the kernels."""
    x = logits.reshape(1, -1) if logits.dim() == 1 else logits
    B, V = x.shape[0], params.vocab_size
    dev = x.device
    raw = x[:, :V].float()
    nan = torch.isnan(raw)
    xp = raw.masked_fill(nan, -math.inf)
    if params.has_penalties:
        c = counts.to(dev)
        rp = params.repeat_penalty[:, None]
        y = torch.where(xp > 0, xp / rp, xp * rp)
        sub = c.float() * params.frequency_penalty[:, None]
        sub = sub + params.presence_penalty[:, None]
        xp = torch.where(c > 0, y - sub, xp)
    if params.bias is not None:
        xp = xp + params.bias
    ar = torch.arange(V, device=dev)
    allowed = None
    if bitmask is not None:
        words = bitmask[:, : (V + 31) // 32].to(torch.int64)
        allowed = ((words[:, ar // 32] >> (ar % 32)) & 1).bool()
        xp = xp.masked_fill(~allowed, -math.inf)
    m, top = _argmax_lowest(xp)
    inf = math.inf
    finite = torch.isfinite(m)
    is_pinf = m == inf
    m_t = torch.where(is_pinf, torch.zeros_like(m), m)
    y = torch.where(is_pinf[:, None], torch.where(xp == inf, 0.0, -inf), xp)
    e = torch.where(y == m_t[:, None], torch.ones_like(y), torch.exp(y - m_t[:, None]))
    tot = torch.where(y > -inf, e, torch.zeros_like(e)).sum(1)
    lse_t = m_t + torch.log(tot)
    big = torch.full_like(ar, V)
    if allowed is not None:
        first = torch.where(allowed, ar, big).amin(1)
    else:
        first = torch.where(~nan, ar, big).amin(1)
    fallback = torch.where(first < V, first, torch.zeros_like(first))
    ids = torch.where(m == -inf, fallback, top)
    lp = torch.where(finite, m - lse_t, torch.full_like(m, -inf))
    draw = (params.greedy == 0) & (m > -inf)
    if params.stochastic:
        temp = params.temperature[:, None]
        if params.n_cand == 0:  # whole row: min_p threshold, Philox position = token id
            keep = (y >= (m_t + params.log_min_p)[:, None]) & (y > -inf)
            g = _gumbel_ref(params.seed, params.step, ar[None, :].expand(B, V))
            sc = torch.where(keep, (y - m_t[:, None]) / temp + g, torch.full_like(y, -inf))
            _, tid = _argmax_lowest(sc)
        else:  # sorted candidates: Philox position = rank
            # ties in the order of the path sample_device takes
            vals, idx = _candidates(xp, params.n_cand,
                                    stable=fused_topk_width(params.n_cand) > 0)
            K = vals.shape[1]
            vals = torch.where(is_pinf[:, None], torch.where(vals == inf, 0.0, -inf), vals)
            tk = params.top_k.long()
            k_eff = torch.where((tk > 0) & (tk < V), tk, torch.full_like(tk, V)).clamp(max=K)
            j = torch.arange(K, device=dev)[None, :].expand(B, K)
            in_k = j < k_eff[:, None]
            v0 = vals[:, :1]
            e = torch.where(in_k & (vals > -inf), torch.exp(vals - v0), torch.zeros_like(vals))
            lse_c = torch.where(k_eff < V, v0[:, 0] + torch.log(e.sum(1)), lse_t)
            n_keep = torch.minimum(k_eff, (in_k & (vals >= v0 + params.log_min_p[:, None])).sum(1))
            n_keep = n_keep.clamp(min=1)
            cum = torch.cumsum(torch.where(j < n_keep[:, None], torch.exp(vals - lse_c[:, None]),
                                           torch.zeros_like(vals)), dim=1)
            n_p = ((j < n_keep[:, None]) & (cum < params.top_p[:, None])).sum(1) + 1
            n_keep = torch.where(params.top_p < 1.0, torch.minimum(n_keep, n_p), n_keep)
            g = _gumbel_ref(params.seed, params.step, j)
            sc = torch.where((j < n_keep[:, None]) & (vals > -inf), (vals - v0) / temp + g,
                             torch.full_like(vals, -inf))
            _, best = _argmax_lowest(sc)
            tid = idx.gather(1, best[:, None])[:, 0]
        xv = xp.gather(1, tid[:, None])[:, 0]
        lp_d = torch.where((m < inf) & (xv > -inf), xv - lse_t, torch.full_like(xv, -inf))
        ids = torch.where(draw, tid, ids)
        lp = torch.where(draw, lp_d, lp)
        params.step.add_(draw.to(params.step.dtype))
    return DeviceSample(ids.to(torch.int64), lp if want_logprobs else None,
                        xp if want_processed else None)


_M32 = 0xFFFFFFFF


def philox_ref(seed: torch.Tensor, c0: torch.Tensor, c1, c2, c3) -> torch.Tensor:
    """Philox4x32-10 (Salmon et al. 2011, the generator behind ``tl.philox``) in int64 torch
    ops: key = the 64-bit ``seed`` (``[B, 1]`` int64 bits), counter words ``c0..c3`` (int64
    holding uint32 values, broadcastable); returns the first output word (uint32 values)."""
    def mulhilo(a, b):
        p = a * b  # < 2**64: the int64 product wraps, its bits are the product's
        return (p >> 32) & _M32, p & _M32

    k0 = seed & _M32
    k1 = (seed >> 32) & _M32
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64, device=seed.device) & _M32
                      for c in (c0, c1, c2, c3))
    for _ in range(10):
        hi_b, lo_b = mulhilo(0xCD9E8D57, c2)
        hi_a, lo_a = mulhilo(0xD2511F53, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + 0x9E3779B9) & _M32
        k1 = (k1 + 0xBB67AE85) & _M32
    return c0


def _gumbel_ref(seed: torch.Tensor, step: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The kernels' Gumbel noise ``-ln(-ln u)`` for positions ``pos [B, N]`` at each row's
    step (``u = (top 23 bits of Philox(seed; pos, 0, step_lo, step_hi) + 0.5) / 2**23``)."""
    st = step[:, None]
    r = philox_ref(seed[:, None], pos, 0, st & _M32, (st >> 32) & _M32)
    u = ((r >> 9).to(torch.float32) + 0.5) * 2.0 ** -23
    return -torch.log(-torch.log(u))


def _argmax_lowest(x: torch.Tensor):
    """Row max and the lowest id reaching it (``torch.argmax`` does not promise the first)."""
    m = x.amax(1)
    V = x.shape[1]
    ar = torch.arange(V, device=x.device)
    top = torch.where(x == m[:, None], ar, torch.full_like(ar, V)).amin(1)
    return m, torch.where(top < V, top, torch.zeros_like(top))
