"""In-kernel time stamps: where a launch's programs spend their time (a measuring tool).

A kernel compiled with its ``TRACE`` constexpr on writes, per program, one record of
:data:`RECORD` int64 values into a trace buffer: up to :data:`STAMPS` time stamps, each a pair
(PTX ``%globaltimer``, nanoseconds on a clock shared by every SM; ``%clock64``, the SM's cycle
counter, for short intervals within a program), then the SM the program ran on
(``%smid``). A stamp is taken after the value it is given (``dep``) has been computed, so a stamp
placed after a loop's reduction is read once the loop's loads have returned. Records let a
benchmark line up the programs of consecutive launches on one time axis: when each started,
waited for its predecessor (programmatic dependent launch), routed, finished its K loop and
exited (``benchmarks/trace_moe.py``). Off (``TRACE`` false) the kernels compile as without
this module. The stamps are PTX, so the CPU interpreter cannot run a traced kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["RECORD", "RECORD_C", "STAMPS", "SM", "stamp", "stamp_end", "trace_buffer"]

#: int64 values per program record: STAMPS (globaltimer, clock64) pairs, then the SM
RECORD = 16
STAMPS = 6
SM = 2 * STAMPS          # index of %smid in a record
#: the same, for jit code (Triton reads globals only as constexpr objects)
RECORD_C = tl.constexpr(RECORD)
_SM = tl.constexpr(SM)


@triton.jit
def stamp(rec_ptr, SLOT: tl.constexpr, dep):
    """Store ``%globaltimer`` and ``%clock64`` as stamp ``SLOT`` of the record at ``rec_ptr``
    (int64), read once the int32 scalar ``dep`` is known."""
    d = tl.zeros([1], dtype=tl.int32) + dep
    g, c = tl.inline_asm_elementwise(
        "{ .reg .u32 t; mov.u32 t, $2; mov.u64 $0, %globaltimer; mov.u64 $1, %clock64; }",
        "=l,=l,r", [d], dtype=(tl.int64, tl.int64), is_pure=False, pack=1)
    o = tl.arange(0, 1)
    tl.store(rec_ptr + 2 * SLOT + o, g)
    tl.store(rec_ptr + 2 * SLOT + 1 + o, c)


@triton.jit
def stamp_end(rec_ptr, SLOT: tl.constexpr, dep):
    """:func:`stamp` ``SLOT``, and the record's SM (``%smid``)."""
    stamp(rec_ptr, SLOT, dep)
    d = tl.zeros([1], dtype=tl.int32) + dep
    sm = tl.inline_asm_elementwise("{ .reg .u32 t; mov.u32 t, $1; mov.u32 $0, %smid; }",
                                   "=r,r", [d], dtype=tl.int32, is_pure=False, pack=1)
    o = tl.arange(0, 1)
    tl.store(rec_ptr + _SM + o, sm.to(tl.int64))


def trace_buffer(programs: int, device) -> torch.Tensor:
    """A zeroed int64 ``[programs, RECORD]`` buffer for one traced launch (a stamp never
    written stays 0)."""
    return torch.zeros((programs, RECORD), dtype=torch.int64, device=device)
