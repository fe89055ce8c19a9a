"""The shared-memory carveout of the decode step's compiled Triton kernels (a trial switch).

On Hopper the L1 cache and shared memory share each SM's 256 KB; the driver picks the split
(the carveout) per launch from what the kernel needs. A launch that needs another carveout
than the kernel before it on an SM waits until that SM has drained its running blocks, so a
decode step whose attention kernel wants many shared-memory-hungry programs per SM (int2 KV:
8 one-warp programs of 16 KB) between kernels that want almost none may lose its overlap at
every such boundary. ``LOCALMOE_SMEM_CARVEOUT=<percent>`` sets the same preferred carveout
(CUDA ``CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT``) on every compiled kernel of
``localmoe.kernels`` before a CUDA graph is captured, so no boundary changes it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger(__name__)

_CARVEOUT_ATTR = 9          # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT


def requested() -> int | None:
    """``LOCALMOE_SMEM_CARVEOUT`` as a percent 0-100, or None (unset or not a percent)."""
    v = os.environ.get("LOCALMOE_SMEM_CARVEOUT", "")
    return int(v) if v.isdigit() and int(v) <= 100 else None


def apply(percent: int) -> int:
    """Set the preferred carveout of every compiled kernel of the ``localmoe.kernels``
    modules' Triton functions to ``percent``; returns how many kernels were set (0 where the
    driver library or Triton's caches cannot be reached)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    import triton

    n = 0
    for name, mod in list(sys.modules.items()):
        if not name.startswith("localmoe.kernels") or mod is None:
            continue
        for obj in vars(mod).values():
            if not isinstance(obj, triton.runtime.jit.JITFunction):
                continue
            for caches in getattr(obj, "device_caches", {}).values():
                for k in caches[0].values():
                    fn = getattr(k, "function", None)
                    if fn and cuda.cuFuncSetAttribute(ctypes.c_void_p(fn), _CARVEOUT_ATTR,
                                                      int(percent)) == 0:
                        n += 1
    log.info("shared-memory carveout %d%% set on %d kernels", percent, n)
    return n
