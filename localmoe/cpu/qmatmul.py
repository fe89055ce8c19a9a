"""Exact matmuls on GGUF block-quantized weights kept packed in memory (CPU, float32 activations).

Why: the torch reference dequantizes every weight to float32 at load, so a CPU decode step reads
4 bytes per weight (0.54 GB per token for SmolLM2-135M) and is memory-bandwidth bound. Here the
weights stay in a compact form that represents the GGUF values *exactly*, and a small C kernel
(AVX2/FMA when the CPU has it, plain C otherwise) computes ``x @ W.T`` with float32 activations
and float32 accumulation -- the same function as the float path up to float32 summation order.
PyTorch's own int4 CPU kernels (``_weight_int4pack_mm_for_cpu``) were measured first: with float32
activations they run a scalar loop (~35x slower than an fp32 GEMV here) and their vectorized path
rounds activations, scales and outputs to bfloat16, which is not exact.

Packed layout of a weight ``W [N, K]`` (N output rows, K input values, groups along K):

=====  ============================================  =========================================
kind   values ``q``                                  per group (``G = K / group``)
=====  ============================================  =========================================
q4     ``uint8 [N, K/32, 16]``: byte 4w+j of a       ``s, m: float32 [N, G]``;
       group holds value 8j+w (low nibble) and       ``w = s * q + m``, q in 0..15, group 32
       8j+w+4 (high nibble), see ``_pack_q4``
q8     ``int8 [N, K]``                               ``s: float32 [N, G]``, ``m`` float32 or
                                                     None; ``w = s * q (+ m)``, group 32 or 16
=====  ============================================  =========================================

GGUF types map exactly (ggml ``dequantize_row_*`` formulas, ggml-quants.c):
Q4_0 -> q4 (s = d, m = -8d), Q4_1 -> q4 (s = d, m = m), Q4_K -> q4 per 32-value sub-block
(s = d*sc, m = -dmin*mn), Q5_0 -> q8 (q - 16, s = d), Q5_1 -> q8 (s = d, m = m), Q5_K -> q8
(s = d*sc, m = -dmin*mn), Q8_0 -> q8 (s = d), Q6_K -> q8 group 16 (q - 32, s = d*sc), Q2_K ->
q8 group 16 (s = d*(sc&15), m = -dmin*(sc>>4)), Q3_K -> q8 group 16 (q - 4 where the high bit is
0, s = d*(sc-32)), IQ4_NL / IQ4_XS -> q8 (q = the code-book value, s = d or d*(ls-32)). Every
product/sum here is exact in float32 or is the same float32 operation ggml performs, so
:meth:`PackedWeight.dequantize` reproduces :func:`localmoe.io.dequant.dequantize` bit for bit.

The kernel: for each output row and group, unpack the group's values to float32 lanes, dot them
with ``x``'s group (FMA), scale the partial dot by ``s`` into a vector accumulator, and add
``m * sum(x_group)``. Decode (one row of ``x``) runs two adjacent weight rows at once (``x``
loaded once, two independent chains) with software prefetch ~1 KB ahead; output rows are split
over ``torch.get_num_threads()`` OpenMP threads (torch's own libgomp). Batches up to
``SMALL_M`` rows use the kernel; larger ones (prefill) dequantize each weight into a scratch
float32 matrix and call BLAS. On the 2-core VM (SmolLM2-135M Q4_1, 1 thread) a decode step reads
~106 MB of weights instead of ~620 MB.

Also here, for the decode path of models loaded with packed weights (same functions as the torch
ops up to float32 summation order): :func:`rms_norm` and :func:`attention_decode` (one C call
each instead of ~7 and ~12 small torch ops, whose dispatch overhead dominates a 135M-parameter
model's decode step).

The C source, ``qmatmul.c`` beside this module (package data), is compiled on first use with
the system C compiler into a per-user cache directory (``$LOCALMOE_KERNEL_CACHE`` or
platformdirs' user cache dir; one build per source, flags, compiler and machine) and loaded with
ctypes; without a compiler (or with ``LOCALMOE_CPU_QMATMUL=0``) :func:`kernel_status` gives the
reason and callers keep the float32 path.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.resources
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

import localmoe.io.dequant as dq
from localmoe.io.env import env_flag

__all__ = ["PackedWeight", "PackedLinear", "kernel_status", "pack_gguf", "rms_norm",
           "PACKABLE_QTYPES"]

#: rows of ``x`` up to which the fused kernel runs; above, dequantize + BLAS (measured on the
#: 2-core VM for a 576x3072 Q4_1 weight: kernel 0.74 ms vs 5.9 ms at 8 rows, 7.1 vs 8.9 ms at 64,
#: 19.5 vs 18.2 ms at 128)
SMALL_M = 64

#: the kernels' C source, shipped beside this module as package data (``qmatmul.c``)
_C_FILE = "qmatmul.c"

_lib_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_reason: str | None = None
_lib_tried = False


def _cache_dir() -> Path:
    d = os.environ.get("LOCALMOE_KERNEL_CACHE")
    if d:
        return Path(d)
    try:
        import platformdirs

        return Path(platformdirs.user_cache_dir("localmoe", appauthor=False)) / "cpu_kernels"
    except ImportError:
        return Path(tempfile.gettempdir()) / f"localmoe-cpu-kernels-{os.getuid()}"


def _simd_flags() -> list[str]:
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except Exception:
        cap = ""
    if platform.machine().lower() in ("x86_64", "amd64") and cap in ("AVX2", "AVX512"):
        return ["-mavx2", "-mfma", "-mf16c"]
    return []


def _c_source() -> str:
    """Text of the kernels' C source (package data beside this module).

    Raises:
        OSError: the file is not in the install.
    """
    return importlib.resources.files(__package__).joinpath(_C_FILE).read_text(encoding="utf-8")


def _build() -> tuple[ctypes.CDLL | None, str | None]:
    """Compile (once per source, flags, compiler and machine) and load the C kernels:
    ``(library, None)``, or ``(None, reason)`` when they cannot be had."""
    if not env_flag("LOCALMOE_CPU_QMATMUL", True):
        return None, "disabled by LOCALMOE_CPU_QMATMUL"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None, "no C compiler (cc/gcc) found"
    try:
        source = _c_source()
    except OSError as e:
        return None, f"the CPU kernel source {_C_FILE} is missing from the localmoe install ({e})"
    flags = ["-O3", "-shared", "-fPIC", "-ffp-contract=off", "-fopenmp", *_simd_flags()]
    key = hashlib.sha256((source + " ".join(flags) + cc + platform.machine()).encode())
    d = _cache_dir()
    so = d / f"qmatmul_{key.hexdigest()[:16]}.so"
    if not so.exists():
        try:
            d.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=d) as tmp:
                src = Path(tmp) / "qmatmul.c"
                src.write_text(source)
                out = Path(tmp) / "qmatmul.so"
                p = subprocess.run([cc, *flags, str(src), "-o", str(out)], capture_output=True,
                                   text=True, timeout=120)
                if p.returncode:
                    return None, f"compiling the CPU kernel failed: {p.stderr.strip()[-300:]}"
                os.replace(out, so)  # atomic: concurrent builders race harmlessly
        except (OSError, subprocess.SubprocessError) as e:
            return None, f"cannot build the CPU kernel: {e}"
    try:
        lib = ctypes.CDLL(str(so))
    except OSError as e:
        return None, f"cannot load the CPU kernel: {e}"
    i64, vp, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.lm_qmatmul.argtypes = [i32, vp, i64, i64, vp, vp, vp, i64, i64, vp, i64, i32]
    lib.lm_qmatmul.restype = None
    lib.lm_dequant_rows.argtypes = [i32, vp, vp, vp, i64, i64, vp, i64, i64, vp, i32]
    lib.lm_dequant_rows.restype = i64
    lib.lm_rms_norm.argtypes = [vp, i64, i64, vp, ctypes.c_float, vp]
    lib.lm_rms_norm.restype = None
    lib.lm_attn_decode.argtypes = [vp, i64, i64, i64, i64, vp, i64, vp, i64, i32, i64,
                                   ctypes.c_float, vp, vp]
    lib.lm_attn_decode.restype = None
    return lib, None


def _get_lib() -> ctypes.CDLL | None:
    global _lib, _lib_reason, _lib_tried
    if not _lib_tried:
        with _lib_lock:
            if not _lib_tried:
                _lib, _lib_reason = _build()
                _lib_tried = True
    return _lib


def kernel_status() -> str | None:
    """None when the packed CPU kernel is usable, else the reason it is not (no compiler,
    disabled by ``LOCALMOE_CPU_QMATMUL=0``, build error). Builds it on first call (~1 s)."""
    _get_lib()
    return _lib_reason


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm of contiguous float32 CPU ``x [..., K]`` with float32 ``w [K]`` (or None) in one C
    call: ``x / sqrt(mean(x^2) + eps) * w`` (torch's formula; only the summation order of
    ``x^2`` differs). Saves the ~7 small torch ops whose overhead dominates at decode.

    Raises:
        RuntimeError: the kernel is unavailable (check :func:`kernel_status` first).
    """
    lib = _get_lib()
    if lib is None:
        raise RuntimeError(f"CPU kernel unavailable: {_lib_reason}")
    K = x.shape[-1]
    y = torch.empty_like(x)
    lib.lm_rms_norm(x.data_ptr(), x.numel() // K, K, None if w is None else w.data_ptr(),
                    float(eps), y.data_ptr())
    return y


def attention_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                     ) -> torch.Tensor:
    """Decode attention of one new query per head over all ``L`` given keys (no mask: the
    caller passes exactly the keys the query sees), in one C call.

    Args:
        q: float32 contiguous ``[1, H, D]`` (CPU).
        k: ``[L, Hkv, D]``, v: ``[L, Hkv, Dv]``; float32 or float16, each row contiguous
            (``stride(-1) == 1``, ``stride(-2) == D``), e.g. slices of a float KV store.
        scale: logit scale.

    Returns:
        float32 ``[1, H, Dv]``: ``softmax(scale * q k^T) v`` per head, GQA head ``h`` reading
        kv head ``h // (H / Hkv)``.

    Raises:
        RuntimeError: kernel unavailable. ValueError: unsupported dtypes or layout.
    """
    lib = _get_lib()
    if lib is None:
        raise RuntimeError(f"CPU kernel unavailable: {_lib_reason}")
    _, H, D = q.shape
    L, Hkv, Dk = k.shape
    Dv = v.shape[-1]
    f16 = k.dtype == torch.float16
    if (q.dtype != torch.float32 or k.dtype != v.dtype or k.dtype not in (torch.float16, torch.float32)
            or Dk != D or H % Hkv or not q.is_contiguous() or k.stride(-1) != 1 or v.stride(-1) != 1
            or k.stride(-2) != D or v.stride(-2) != Dv):
        raise ValueError("attention_decode: unsupported dtypes or layout")
    o = torch.empty(1, H, Dv, dtype=torch.float32)
    scratch = torch.empty(max(L, 1), dtype=torch.float32)
    lib.lm_attn_decode(q.data_ptr(), H, Hkv, D, Dv, k.data_ptr(), k.stride(0), v.data_ptr(),
                       v.stride(0), int(f16), L, float(scale), o.data_ptr(), scratch.data_ptr())
    return o


class PackedWeight:
    """One weight matrix ``W [N, K]`` in the packed form of the module docstring (CPU tensors).

    Attributes:
        kind: ``"q4"`` or ``"q8"``.
        q: ``uint8 [N, K/32, 16]`` (q4) or ``int8 [N, K]`` (q8).
        s: ``float32 [N, K/group]`` group scales; m: same shape or None (zero) -- group offsets.
        group: values per group along K (32, or 16 for Q6_K).
        shape: ``(N, K)``.
    """

    def __init__(self, kind: str, q: torch.Tensor, s: torch.Tensor, m: torch.Tensor | None,
                 group: int):
        if kind not in ("q4", "q8") or (kind == "q4" and group != 32) or group not in (16, 32):
            raise ValueError(f"bad packed kind/group {kind}/{group}")
        self.kind, self.group = kind, int(group)
        self.q = q.contiguous()
        self.s = s.to(torch.float32).contiguous()
        self.m = None if m is None else m.to(torch.float32).contiguous()
        N = self.q.shape[0]
        K = self.s.shape[1] * self.group
        self.shape = (N, K)
        self._k = 0 if kind == "q4" else 1
        self._call = None   # bound kernel call, built on first use (pointers stay valid)

    @property
    def nbytes(self) -> int:
        """Bytes held (values, scales and offsets)."""
        return sum(t.numel() * t.element_size() for t in (self.q, self.s, self.m) if t is not None)

    def _ptrs(self):
        return (self.q.data_ptr(), self.s.data_ptr(), self.m.data_ptr() if self.m is not None else None)

    def matmul_into(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y[:, :] = x @ W.T`` for float32 contiguous ``x [M, K]``; ``y`` a float32 ``[M, N]``
        view whose rows may be strided (a column slice of a larger output)."""
        if self._call is None:
            lib = _get_lib()
            q, s, m = self._ptrs()
            fn = lib.lm_qmatmul
            k, gs, K, N = self._k, self.group, self.shape[1], self.shape[0]
            self._call = lambda xp, M, yp, ldy, nt: fn(k, xp, M, K, q, s, m, gs, N, yp, ldy, nt)
        self._call(x.data_ptr(), x.shape[0], y.data_ptr(), y.stride(0), torch.get_num_threads())

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 ``[R, K]`` of the rows ``rows`` (int64 ``[R]``; None: all ``N`` rows),
        bit-identical to :func:`localmoe.io.dequant.dequantize` of the source tensor.

        Raises:
            IndexError: a row index outside ``[0, N)`` (checked in the kernel before any read).
        """
        lib = _get_lib()
        K = self.shape[1]
        if rows is not None:
            rows = rows.to(torch.int64).contiguous()
            R = rows.shape[0]
        else:
            R = self.shape[0]
        out = torch.empty(R, K, dtype=torch.float32)
        q, s, m = self._ptrs()
        bad = lib.lm_dequant_rows(self._k, q, s, m, self.group, K,
                                  rows.data_ptr() if rows is not None else None, R, self.shape[0],
                                  out.data_ptr(), torch.get_num_threads())
        if bad:
            i = int(rows[bad - 1]) if rows is not None else R - 1
            raise IndexError(f"row {i} is outside the {self.shape[0]}-row weight")
        return out

    @staticmethod
    def cat(parts: Sequence["PackedWeight"]) -> "PackedWeight":
        """Stack weights of the same kind and group along N (e.g. fused q/k/v). Offsets absent in
        some parts are materialized as zeros."""
        p0 = parts[0]
        if any(p.kind != p0.kind or p.group != p0.group or p.shape[1] != p0.shape[1] for p in parts):
            raise ValueError("packed parts differ in kind, group or K")
        m = None
        if any(p.m is not None for p in parts):
            m = torch.cat([p.m if p.m is not None else torch.zeros_like(p.s) for p in parts])
        return PackedWeight(p0.kind, torch.cat([p.q for p in parts]),
                            torch.cat([p.s for p in parts]), m, p0.group)


class PackedLinear:
    """A (possibly fused) linear layer ``y = x @ W.T`` whose row blocks are packed weights.

    Fused projections (q/k/v, gate/up) whose parts share kind and group become one
    :class:`PackedWeight`; parts that differ (e.g. Q5_0 q/k with a Q8_0 v are both q8 and fuse,
    a Q4_K part next to a Q6_K one does not) stay separate and write adjacent column ranges.

    Args:
        parts: weights with equal K, in output order.

    Attributes:
        in_features (K), out_features (sum of N).
    """

    def __init__(self, parts: Sequence[PackedWeight]):
        groups: list[list[PackedWeight]] = []
        for p in parts:
            if groups and groups[-1][0].kind == p.kind and groups[-1][0].group == p.group:
                groups[-1].append(p)
            else:
                groups.append([p])
        self.parts = [g[0] if len(g) == 1 else PackedWeight.cat(g) for g in groups]
        self.in_features = self.parts[0].shape[1]
        self.out_features = sum(p.shape[0] for p in self.parts)

    #: where and in which dtype the layer computes (the kernel is CPU float32 only)
    device = torch.device("cpu")
    dtype = torch.float32

    @property
    def nbytes(self) -> int:
        """Bytes held by all parts."""
        return sum(p.nbytes for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K]`` float32 -> ``[M, out_features]`` float32 (any leading shape flattened)."""
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        M = x2.shape[0]
        if M > SMALL_M:
            # prefill: dequantize each part once and let BLAS do the matmul
            outs = [x2 @ p.dequantize().t() for p in self.parts]
            y = outs[0] if len(outs) == 1 else torch.cat(outs, -1)
        else:
            y = torch.empty(M, self.out_features, dtype=torch.float32)
            if len(self.parts) == 1:
                self.parts[0].matmul_into(x2, y)
            else:
                c = 0
                for p in self.parts:
                    n = p.shape[0]
                    p.matmul_into(x2, y[:, c:c + n])
                    c += n
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        """float32 ``[out_features, in_features]`` (the float weight)."""
        ws = [p.dequantize() for p in self.parts]
        return ws[0] if len(ws) == 1 else torch.cat(ws, 0)

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        """float32 ``[R, in_features]``: rows ``idx`` (int64 ``[R]``) of the float weight (an
        embedding lookup on a tied embedding/output matrix). Needs a single part."""
        if len(self.parts) != 1:
            return self.dequantize().index_select(0, idx)
        return self.parts[0].dequantize(idx)


# ---- packing GGUF blocks -------------------------------------------------------------------

def _f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).to(torch.float32).squeeze(-1)


_Q4_LO = torch.tensor([8 * (b % 4) + b // 4 for b in range(16)])


def _pack_q4(v: torch.Tensor) -> torch.Tensor:
    """[..., 32] values 0..15 -> [..., 16] bytes in the kernel's order: byte ``4w + j`` holds
    value ``8j + w`` (low nibble) and ``8j + w + 4`` (high nibble), so that 32-bit word ``w``
    shifted right by ``4p`` yields value ``8(p // 2) + w + 4(p % 2)``: AVX2 lanes unpack with
    per-lane shifts, no shuffles."""
    return (v[..., _Q4_LO] | (v[..., _Q4_LO + 4] << 4)).to(torch.uint8)


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] uint8 (a little-endian u32) -> [n, 32] bit j of the u32."""
    sh = torch.arange(8, dtype=torch.uint8).view(1, 1, 8)
    return ((qh.unsqueeze(-1) >> sh) & 1).reshape(qh.shape[0], 32)


def _nib(qs: torch.Tensor) -> torch.Tensor:
    """[n, c, 32] bytes -> [n, c, 2, 32] (low nibbles, then high nibbles)."""
    sh = torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)
    return (qs.unsqueeze(-2) >> sh) & 0x0F


def _blocks_to_packed(b: torch.Tensor, qtype: int) -> tuple[str, torch.Tensor, torch.Tensor,
                                                             torch.Tensor | None, int]:
    """GGUF blocks ``uint8 [n, block_bytes]`` (one tensor row after another) -> (kind, values
    per group ``[n_groups, ...]``, s, m, group) with groups in the row's order."""
    n = b.shape[0]
    if qtype == dq.Q4_0:
        d = _f16(b[:, 0:2])
        v = _nib(b[:, 2:18].reshape(n, 1, 16)).reshape(n, 32)
        return "q4", _pack_q4(v), d, -8.0 * d, 32
    if qtype == dq.Q4_1:
        v = _nib(b[:, 4:20].reshape(n, 1, 16)).reshape(n, 32)
        return "q4", _pack_q4(v), _f16(b[:, 0:2]), _f16(b[:, 2:4]), 32
    if qtype == dq.Q4_K:
        d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
        sc, mn = dq._k_scale_min(b[:, 4:16])
        s = (d * sc.to(torch.float32)).reshape(n * 8)
        m = -(dmin * mn.to(torch.float32)).reshape(n * 8)
        v = _nib(b[:, 16:144].reshape(n, 4, 32)).reshape(n * 8, 32)
        return "q4", _pack_q4(v), s, m, 32
    if qtype == dq.Q8_0:
        return "q8", b[:, 2:34].contiguous().view(torch.int8), _f16(b[:, 0:2]), None, 32
    if qtype in (dq.Q5_0, dq.Q5_1):
        o = 2 if qtype == dq.Q5_0 else 4
        d = _f16(b[:, 0:2])
        qh = _bits(b[:, o:o + 4])
        ql = _nib(b[:, o + 4:o + 20].reshape(n, 1, 16)).reshape(n, 32)
        q = (ql | (qh << 4)).to(torch.int8)
        if qtype == dq.Q5_0:
            return "q8", q - 16, d, None, 32
        return "q8", q, d, _f16(b[:, 2:4]), 32
    if qtype == dq.Q5_K:
        d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
        sc, mn = dq._k_scale_min(b[:, 4:16])
        s = (d * sc.to(torch.float32)).reshape(n * 8)
        m = -(dmin * mn.to(torch.float32)).reshape(n * 8)
        sh = torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
        hi = (b[:, 16:48].unsqueeze(1) >> sh) & 1
        ql = _nib(b[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
        return "q8", (ql | (hi << 4)).to(torch.int8).reshape(n * 8, 32), s, m, 32
    if qtype == dq.Q6_K:
        ql = b[:, 0:128].reshape(n, 2, 1, 64)
        qh = b[:, 128:192].reshape(n, 2, 1, 32)
        sc = b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
        d = _f16(b[:, 208:210])[:, None]
        s = (d * sc).reshape(n * 16)
        lo = ((ql >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)) & 0x0F).reshape(n, 8, 32)
        hi = ((qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)) & 0x03
              ).reshape(n, 8, 32)
        q = ((lo | (hi << 4)).to(torch.int8) - 32).reshape(n * 16, 16)
        return "q8", q, s, None, 16
    if qtype == dq.Q2_K:
        q, s, m = dq.q2_k_parts(b)
        return "q8", q.to(torch.int8).reshape(n * 16, 16), s.reshape(n * 16), -m.reshape(n * 16), 16
    if qtype == dq.Q3_K:
        q, s = dq.q3_k_parts(b)
        return "q8", q.reshape(n * 16, 16), s.reshape(n * 16), None, 16
    if qtype == dq.IQ4_NL:
        return "q8", dq.iq4_codes(b[:, 2:18].reshape(n, 1, 16)).reshape(n, 32), \
            _f16(b[:, 0:2]), None, 32
    if qtype == dq.IQ4_XS:
        q = dq.iq4_codes(b[:, 8:136].reshape(n, 8, 16)).reshape(n * 8, 32)
        return "q8", q, dq.iq4_xs_scales(b).reshape(n * 8), None, 32
    raise ValueError(f"qtype {qtype} cannot be packed")


#: ggml type ids :func:`pack_gguf` accepts
PACKABLE_QTYPES = frozenset({dq.Q4_0, dq.Q4_1, dq.Q4_K, dq.Q5_0, dq.Q5_1, dq.Q5_K, dq.Q8_0,
                             dq.Q6_K, dq.Q2_K, dq.Q3_K, dq.IQ4_NL, dq.IQ4_XS})


def pack_gguf(data: np.ndarray | torch.Tensor, qtype: int, shape: Sequence[int]) -> PackedWeight:
    """Pack a 2-D GGUF tensor's block bytes into a :class:`PackedWeight`.

    Args:
        data: ``uint8`` block bytes of the tensor (e.g. ``RawTensor.data``), ``N`` rows.
        qtype: ggml type id, one of :data:`PACKABLE_QTYPES`.
        shape: torch-order ``(N, K)``.

    Raises:
        ValueError: not 2-D, or ``qtype`` not packable.
    """
    if len(shape) != 2 or int(qtype) not in PACKABLE_QTYPES:
        raise ValueError(f"cannot pack qtype {qtype} shape {tuple(shape)}")
    N, K = int(shape[0]), int(shape[1])
    bs, ts = dq.BLOCK_SIZES[int(qtype)]
    if isinstance(data, np.ndarray):
        # zero-copy view of the (read-only) file mapping: packing only reads it; torch warns
        # about non-writable arrays, which is the point here
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8))
    b = data.reshape(N, -1)
    # rows in chunks of ~64k blocks, written into preallocated outputs: temporaries stay small
    # (a 262144 x 640 Q8_0 embedding would otherwise need several copies of its 170 MB)
    step = max(1, (1 << 16) // max(1, b.shape[1] // ts))
    q = s_out = m_out = None
    for r0 in range(0, N, step):
        kind, qc, sc, mc, group = _blocks_to_packed(b[r0:r0 + step].reshape(-1, ts), int(qtype))
        rows = min(step, N - r0)
        G = K // group
        if q is None:
            q = torch.empty((N, G, 16) if kind == "q4" else (N, K), dtype=qc.dtype)
            s_out = torch.empty(N, G, dtype=torch.float32)
            m_out = None if mc is None else torch.empty(N, G, dtype=torch.float32)
        q[r0:r0 + rows] = qc.reshape(rows, *q.shape[1:])
        s_out[r0:r0 + rows] = sc.reshape(rows, G)
        if m_out is not None:
            m_out[r0:r0 + rows] = mc.reshape(rows, G)
    return PackedWeight(kind, q, s_out, m_out, group)
