"""Programmatic dependent launch (PDL) for the kernels of the decode step (Hopper and later).

In a CUDA graph of ~500 small kernels, each kernel boundary costs GPU idle time: the next
kernel's blocks are only scheduled once the previous kernel has drained, then pay their own
start-up (argument loads, address arithmetic, the first global loads). With PDL (CUDA
programming guide, "Programmatic Dependent Launch and Synchronization"; PTX
``griddepcontrol``) a kernel launched with the programmatic-serialization attribute may start
while its predecessor still runs: every block of the predecessor signals
``griddepcontrol.launch_dependents`` when it starts, and the dependent's blocks, resident
early, run their prologue and then block in ``griddepcontrol.wait`` until the predecessor has
completed and its writes are visible.

The rule every kernel launched this way follows (:func:`pdl_begin` at its very top): signal,
then wait, before any load of data another kernel writes and before any store. Only constant
inputs (weights) may be touched before the wait (:func:`prefetch_l2`). Because every block of
every such kernel waits for its predecessor to complete, completion is transitive: a kernel
that reads what an earlier kernel (not the immediately preceding one) wrote sees it.

:func:`pdl_args` gives the launch arguments: ``{"PDL": True, "launch_pdl": True}`` when PDL is
switched on (``LOCALMOE_PDL=1``) for a CUDA device of compute capability 9.0 or later and the
installed Triton can launch with it, ``{"PDL": False}`` otherwise (the default, the CPU
interpreter, older GPUs). With ``PDL`` False the kernels compile exactly as without this module.

**Off by default**: measured on the H200 (benchmarks/results/pdl_h200-2026-12-02.json, the
fused Qwen3-30B-A3B decode graph, f16 KV) it gave TPOT 2.879 -> 2.689 ms at an empty context
but 3.907 -> 4.006 ms at 16k, and the graph alone replayed back to back 2.530 -> 2.511 ms (ctx
0) and 3.146 -> 3.213 ms (16k): the kernels already run back to back in the graph (their
summed time equals the replay's), so there was little idle time for PDL to hide. One GPU test
(the fused step against the shared block, OLMoE-shaped, int4 KV) picked a different greedy
token at one step of six with PDL on (logits within the test's tolerance); whether that is a
race (a load placed before the wait) or a near tie moved by a legitimate difference is open:
``tests/backends/test_triton_quant.py``'s PDL on/off test compares the two bit for bit on the
GPU. The L2 prefetch of the weights before
the wait (``LOCALMOE_PDL_PREFETCH``) was not measured. An A/B/A of the session-14 tree on one
H200 (``decode_step_h200-2026-12-03-s14.json``, two runs each) settles the default: the step on
the device 2.162/2.159 ms without PDL against 2.374/2.376 with it at an empty context, and
2.774/2.768 against 3.149/3.158 ms at 16k.
"""

from __future__ import annotations

import functools
import os

import triton
import triton.language as tl

__all__ = ["pdl_args", "pdl_begin", "pdl_prefetch", "pdl_supported", "prefetch_l2",
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
    """Whether kernels on ``device`` (a torch device) launch with PDL: ``LOCALMOE_PDL=1`` in the
    environment, a CUDA device of compute capability >= 9.0, a Triton that supports it, and not
    under ``TRITON_INTERPRET=1``."""
    if os.environ.get("LOCALMOE_PDL", "0") != "1":
        return False
    if getattr(device, "type", None) != "cuda":
        return False
    if os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True"):
        return False
    index = device.index if device.index is not None else _current_index()
    return _device_supports(index)


def _current_index() -> int:
    import torch

    return torch.cuda.current_device()


def pdl_prefetch(device) -> bool:
    """Whether the GEMV kernels prefetch their weight rows into L2 before PDL's wait (PDL on
    ``device`` and ``LOCALMOE_PDL_PREFETCH`` not ``0``)."""
    return pdl_supported(device) and os.environ.get("LOCALMOE_PDL_PREFETCH", "1") != "0"


def pdl_args(device) -> dict:
    """Keyword arguments for a kernel launch on ``device`` whose kernel takes a ``PDL``
    constexpr and calls :func:`pdl_begin`: ``PDL`` and, when supported, ``launch_pdl``."""
    if pdl_supported(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def pdl_begin(PDL: tl.constexpr):
    """Let the next kernel's blocks start, then wait until the previous kernel has completed
    and its stores are visible. Call it at the top of the kernel, in every program, before any
    load of non-constant data and any store."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
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
