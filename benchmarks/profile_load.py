"""Where the triton backend's weight load spends its time, phase by phase.

``load_quant_model`` copies each GGUF tensor's block bytes from the memory-mapped file to the
device in chunks (``QuantTensor.from_gguf``: a host copy into one of a few reused pinned
buffers and an asynchronous copy from there, then the repack into planes on the device; the NaN/Inf
check of the block scales once for all tensors at the end), and joins each layer's gate and up
experts (``QuantTensor.interleave_rows``). This times those phases one at a time, each
followed by a device synchronization, over the tensors selected (default: the first two
layers, the embedding and the output head), and extrapolates to the whole file by bytes:

* ``h2d_pageable``: a copy from the mapped file, ``torch.from_numpy(mmap bytes).to(device)``;
* ``host_to_pinned`` and ``pinned_h2d`` (CUDA only): the same bytes copied into a pinned host
  buffer, then from it to the device (the stager's two steps, not overlapped);
* ``repack``: the planes built on the device from device bytes (``QuantTensor._repack_rows``
  over the loader's chunks);
* ``check_finite``: the scale check with a host read per tensor (the loader reads once);
* ``from_gguf``: the whole call without a stager, for comparison with the sum of its phases;
* ``from_gguf_staged`` (CUDA only): the loader's call, through a :class:`PinnedStager` (one
  tensor at a time here: the overlap across tensors shows only in a whole load);
* ``interleave``: the gate/up join of each layer's experts.

Usage (GPU machine, the file in the page cache)::

    python benchmarks/profile_load.py --model /tmp/models/mixtral-8x7b.gguf --out load.json

Results: ``{"model", "device", "file_bytes", "sampled_bytes", "phases": {phase: {"s",
"gb_s", "file_s"}}, "tensors": [...]}`` (``file_s``: the phase's time scaled to the file).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import re
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from localmoe.io.loader import open_model
from localmoe.io.staging import PinnedStager
from localmoe.kernels.qtensor import BLOCK_SIZES, FLOAT_QTYPES, QuantTensor, row_chunks

DEFAULT_TENSORS = r"^(blk\.[01]\.|token_embd\.|output\.)"


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(dev, fn):
    _sync(dev)
    t = time.perf_counter()
    out = fn()
    _sync(dev)
    return out, time.perf_counter() - t


def profile(path: str, pattern: str = DEFAULT_TENSORS, device: str = "cuda") -> dict:
    """Phase times of loading the tensors of ``path`` whose names match ``pattern`` onto
    ``device`` (see the module docstring). Raises ValueError when no tensor matches."""
    dev = torch.device(device)
    mf = open_model(path)
    names = [n for n in sorted(mf.tensor_names()) if re.search(pattern, n)]
    if not names:
        raise ValueError(f"no tensor of {path} matches {pattern!r}")
    phases: dict[str, float] = {}
    rows = []
    sampled = 0
    pinned = None
    joined: dict[str, QuantTensor] = {}
    stager = PinnedStager(dev) if dev.type == "cuda" else None
    for n in names:
        raw = mf.raw_tensor(n)
        if raw.qtype not in BLOCK_SIZES:
            continue
        with warnings.catch_warnings():     # a read-only mmap view, as in the loader
            warnings.simplefilter("ignore", UserWarning)
            src = torch.from_numpy(np.ascontiguousarray(raw.data).reshape(-1))
        nbytes = src.numel()
        sampled += nbytes
        row = {"name": n, "qtype": int(raw.qtype), "bytes": nbytes}
        dbytes, row["h2d_pageable"] = _timed(dev, lambda: src.to(dev))
        if dev.type == "cuda":
            if pinned is None or pinned.numel() < nbytes:
                pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            buf = pinned[:nbytes]
            _, row["host_to_pinned"] = _timed(dev, lambda: buf.copy_(src))
            _, row["pinned_h2d"] = _timed(dev, lambda: buf.to(dev, non_blocking=True))
        if raw.qtype not in FLOAT_QTYPES:
            bs, ts = BLOCK_SIZES[raw.qtype]
            k = raw.shape[-1]
            r = math.prod(raw.shape[:-1])
            nb = k // bs
            d2 = dbytes.view(r, nb * ts)

            def repack():
                for r0, r1 in row_chunks(r, k):
                    QuantTensor._repack_rows(d2[r0:r1].reshape((r1 - r0) * nb, ts), raw.qtype,
                                             r1 - r0, k)
            _, row["repack"] = _timed(dev, repack)
        qt, row["from_gguf"] = _timed(dev, lambda: QuantTensor.from_gguf(raw, None, None,
                                                                           device=dev, name=n))
        if stager is not None:
            _, row["from_gguf_staged"] = _timed(dev, lambda: QuantTensor.from_gguf(
                raw, None, None, device=dev, name=n, stager=stager))
        if not qt.is_float:
            _, row["check_finite"] = _timed(dev, qt.check_finite)
        m = re.match(r"(blk\.\d+\.)ffn_(gate|up)_exps\.weight$", n)
        if m:
            other = joined.pop(m.group(1), None)
            if other is None:
                joined[m.group(1)] = qt
            else:
                _, row["interleave"] = _timed(dev, lambda: QuantTensor.interleave_rows(other, qt))
        for k2, v in row.items():
            if isinstance(v, float):
                phases[k2] = phases.get(k2, 0.0) + v
        rows.append({k2: (round(v, 5) if isinstance(v, float) else v) for k2, v in row.items()})
        del dbytes, qt
    file_bytes = Path(path).stat().st_size
    scale = file_bytes / max(sampled, 1)
    return {
        "model": str(path), "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "machine": platform.node(), "file_bytes": file_bytes, "sampled_bytes": sampled,
        "pattern": pattern,
        "phases": {k2: {"s": round(v, 4), "gb_s": round(sampled / v / 1e9, 2) if v else None,
                        "file_s": round(v * scale, 2)} for k2, v in phases.items()},
        "tensors": rows,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tensors", default=DEFAULT_TENSORS, help="regex of tensor names to time")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    res = profile(a.model, a.tensors, a.device)
    for k, v in res["phases"].items():
        print(f"{k:16s} {v['s']:8.3f} s  {v['gb_s'] or 0:7.2f} GB/s  ~{v['file_s']:7.2f} s for the file")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
