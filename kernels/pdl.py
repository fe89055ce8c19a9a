"""Programmatic dependent launch (PDL) for the kernels of the decode step (Hopper and later).

In a CUDA graph of ~500 small kernels, each kernel boundary costs GPU idle time: the next
kernel's blocks are only scheduled once the previous kernel has drained, then pay their own
start-up (argument loads, address arithmetic, the first global loads). With PDL (CUDA
programming guide, "Programmatic Dependent Launch and Synchronization"; PTX
``griddepcontrol``) a kernel launched with the programmatic-serialization attribute may be
launched before its predecessor has completed: once every block of the predecessor has
signalled ``griddepcontrol.launch_dependents`` (or exited), the dependent's blocks are
scheduled, and each blocks in ``griddepcontrol.wait`` until the predecessor has completed and
its writes are visible.

The rule every kernel launched this way follows (:func:`pdl_begin` at its very top): wait
before any load of data another kernel writes and before any store. Only constant inputs
(weights) may be touched before the wait (:func:`prefetch_l2`). Because every block of every
such kernel waits for its predecessor to complete, completion is transitive: a kernel that
reads what an earlier kernel (not the immediately preceding one) wrote sees it.

Where a kernel signals (``LOCALMOE_PDL_ORDER``, :func:`pdl_order`) decides what PDL gains.
Measured on the H200 (``benchmarks/results/pdl_order_h200-2026-12-04-s19.json``: the
Qwen3-30B-A3B decode graph at context 0, f16 KV, replayed back to back; every mode captured
on the same runner, each capture in a new memory pool):

====================== ============================= ============== ===========================
mode                   signal                        first probe    8 captures, one runner
====================== ============================= ============== ===========================
off                    -                             2.217-2.375    2.072 first, then 2.234-2.239
``signal_first`` (s9)  at the top, before the wait   2.439-2.446    -
``wait_first``         right after the wait          2.226-2.234    2.266-2.276
``at_exit`` (default)  none: at the block's exit     2.164-2.168    **2.024-2.031**
====================== ============================= ============== ===========================

(ms; the first probe ran a kernel trial that was not kept and is ~0.14 ms slower throughout.)
Signalling at the top lets every later kernel of the graph be launched in turn while the
first still runs (each resident block signals at once), so waiting blocks of many kernels
hold the SMs' slots: sessions 9 and 14 measured that mode slower, and PDL stayed off. With
the signal at the block's exit only the next kernel's launch overlaps the end of the current
one. That also removed the ~7% slower replay of every capture after a runner's first (2.07
-> 2.24 ms without PDL, the open question of sessions 10-18): with it every capture replays
in 2.02-2.03 ms, after prompts, longer decodes and recaptures alike. End to end
(``vs_llamacpp``, same machine, off then on): graph 2.077 -> 2.027 ms and generation loop
2.131 -> 2.086 ms at context 0, 2.858 -> 2.791 and 2.907 -> 2.848 ms at 16k.

:func:`pdl_args` gives the launch arguments: ``{"PDL": mode, "launch_pdl": True}`` for a CUDA
device of compute capability 9.0 or later whose Triton can launch with it, unless
``LOCALMOE_PDL=0``; ``{"PDL": 0}`` otherwise (older GPUs, the CPU interpreter), with which the
kernels compile exactly as without this module. The L2 prefetch of a GEMV's weights before
the wait (:func:`pdl_prefetch`) is off unless ``LOCALMOE_PDL_PREFETCH=1`` (session 16 measured
prefetching slower: the traffic delays the running kernel's own loads).
"""

from __future__ import annotations

import functools
import logging
import os

import triton
import triton.language as tl

__all__ = ["pdl_args", "pdl_begin", "pdl_prefetch", "pdl_status", "pdl_supported", "prefetch_l2",
           "prefetch_rows_l2"]


def _triton_can_launch_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except Exception:  # pragma: no cover - a Triton without the NVIDIA backend
        return False
    fields = getattr(CUDAOptions, "__dataclass_fields__", {})
    return "launch_pdl" in fields and hasattr(tl.extra, "cuda") and hasattr(tl.extra.cuda, "gdc_wait")


@functools.lru_cache(maxsize=None)
def _device_supports(index: int) -> bool:
    import torch

    return torch.cuda.get_device_capability(index)[0] >= 9 and _triton_can_launch_pdl()


def pdl_supported(device) -> bool:
    """Whether kernels on ``device`` (a torch device) launch with PDL: a CUDA device of compute
    capability >= 9.0, a Triton that supports it, not under ``TRITON_INTERPRET=1``, and
    ``LOCALMOE_PDL`` not ``0`` in the environment."""
    return _why_not(device) is None


def pdl_status(device) -> str:
    """``"on (<order>)"`` (:func:`pdl_order_name`) or ``"off (<why>)"`` for kernels on
    ``device`` (a torch device or its name): what ``runner.stats()["pdl"]`` reports."""
    import torch

    why = _why_not(torch.device(device))
    if why is not None:
        return f"off ({why})"
    return f"on ({pdl_order_name()})"


def _why_not(device) -> str | None:
    if os.environ.get("LOCALMOE_PDL", "1") == "0":
        return "LOCALMOE_PDL=0"
    if getattr(device, "type", None) != "cuda":
        return "not a CUDA device"
    if os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True"):
        return "TRITON_INTERPRET=1"
    index = device.index if device.index is not None else _current_index()
    if not _device_supports(index):
        return "needs compute capability 9.0+ and a Triton that launches with PDL"
    return None


def _current_index() -> int:
    import torch

    return torch.cuda.current_device()


def pdl_prefetch(device) -> bool:
    """Whether the GEMV kernels prefetch their weight rows into L2 before PDL's wait (PDL on
    ``device`` and ``LOCALMOE_PDL_PREFETCH=1``)."""
    return pdl_supported(device) and os.environ.get("LOCALMOE_PDL_PREFETCH", "0") == "1"


#: ``LOCALMOE_PDL_ORDER`` -> the ``PDL`` constexpr of :func:`pdl_begin`
PDL_ORDERS = {"signal_first": 1, "wait_first": 2, "at_exit": 3}


def pdl_order_name() -> str:
    """Where a PDL kernel lets its dependent start (``LOCALMOE_PDL_ORDER``): ``signal_first``
    (at its top, before its own wait), ``wait_first`` (right after its wait) or ``at_exit``
    (the default: no explicit signal; the dependent is launched as the last block exits).
    Another value is logged once and read as ``at_exit``."""
    name = os.environ.get("LOCALMOE_PDL_ORDER", "at_exit")
    if name not in PDL_ORDERS:
        _warn_order(name)
        name = "at_exit"
    return name


def pdl_order() -> int:
    """:func:`pdl_order_name`'s mode, the ``PDL`` constexpr of :func:`pdl_begin` (1-3)."""
    return PDL_ORDERS[pdl_order_name()]


@functools.lru_cache(maxsize=None)
def _warn_order(name: str) -> None:
    logging.getLogger(__name__).warning(
        "LOCALMOE_PDL_ORDER=%r is not one of %s; using at_exit", name, ", ".join(PDL_ORDERS))


def pdl_args(device) -> dict:
    """Keyword arguments for a kernel launch on ``device`` whose kernel takes a ``PDL``
    constexpr and calls :func:`pdl_begin`: ``PDL`` (0, or :func:`pdl_order`'s mode) and, when
    supported, ``launch_pdl``."""
    if pdl_supported(device):
        return {"PDL": pdl_order(), "launch_pdl": True}
    return {"PDL": 0}


@triton.jit
def pdl_begin(PDL: tl.constexpr):
    """Wait until the previous kernel has completed and its stores are visible, and let the
    next kernel's blocks start (before the wait with ``PDL`` 1, after it with 2, at this
    block's exit with 3: :func:`pdl_order`). Call it at the top of the kernel, in every
    program, before any load of non-constant data and any store. Signalling before the wait
    lets every later kernel of the graph start in turn while the first still runs (each
    resident block signals at once), so waiting blocks of many kernels hold the SMs' slots."""
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    elif PDL == 2:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    elif PDL == 3:
        tl.extra.cuda.gdc_wait()


@triton.jit
def prefetch_l2(ptrs, mask, PDL: tl.constexpr):
    """Ask for the 128-byte lines at ``ptrs`` (where ``mask``) to be brought into L2
    (PTX ``prefetch.global.L2``), before :func:`pdl_begin`'s wait, for constant data only
    (weights). Nothing without ``PDL`` (the interpreter has no PTX)."""
    if PDL:
        a = tl.where(mask, ptrs.to(tl.int64), 0)     # masked lanes: address 0, not issued
        tl.inline_asm_elementwise(
            "{ .reg .pred %p; setp.ne.u64 %p, $1, 0; @%p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
            "=r,l", [a], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_rows_l2(ptr, rows, rmask, rs, e0, e1, LINE: tl.constexpr, PDL: tl.constexpr):
    """:func:`prefetch_l2` of elements ``e0 .. e1`` of the rows ``rows`` (where ``rmask``) of
    a row-major plane at ``ptr`` with row stride ``rs`` elements, ``LINE`` elements to a
    128-byte line, 16 lines per row per step."""
    LB: tl.constexpr = 16
    r64 = rows.to(tl.int64)[:, None] * rs
    for l0 in range(e0, e1, LB * LINE):
        offs = l0 + tl.arange(0, LB) * LINE
        prefetch_l2(ptr + r64 + offs[None, :], rmask[:, None] & (offs < e1)[None, :], PDL)
