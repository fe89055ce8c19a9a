"""Time per sampled token: the NumPy Sampler against the device sampler (kernels/sampling.py).

For each mode (greedy; the engine's defaults top_k 40 / top_p 0.95 / min_p 0.05; temperature
only; top_p over the whole vocabulary; each with and without a grammar bitmask and
penalties) it times, at batch 1 and the given vocabulary:

* ``numpy_us``: ``Sampler.sample`` on host logits (what every backend paid before);
* ``device_us``: ``Sampler.sample`` on CUDA logits (upload of the mask, kernels, the id read:
  what the engine pays per token after the forward pass);
* ``graph_us``: ``sample_device`` replayed from a CUDA graph (no host launch cost), with
  ``ms`` from CUDA events;
* ``launch_us``: host time to enqueue ``sample_device`` (hidden behind the forward pass when
  the runner returns before the GPU finishes).

Run: ``python benchmarks/bench_sampling.py --vocab 151936 --out
benchmarks/results/sampling_<machine>.json`` (without CUDA only ``numpy_us`` and the torch
twin's time are measured).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time


def _time(fn, n: int) -> float:
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    return round(statistics.median(ts), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--out", default=None)
    ap.add_argument("--topk-max", type=int, default=None,
                    help="override kernels.sampling.TOPK_MAX (0: torch.topk for every top_k)")
    ap.add_argument("--modes", default=None, help="comma-separated subset of the modes")
    a = ap.parse_args()
    import numpy as np
    import torch

    from localmoe.engine.sampling import Sampler, SamplingParams
    import localmoe.kernels.sampling as ks
    from localmoe.kernels.sampling import (DeviceSamplingParams, counts_from_history,
                                           pack_mask, sample_device, sample_ref)

    if a.topk_max is not None:
        ks.TOPK_MAX = a.topk_max

    V = a.vocab
    cuda = torch.cuda.is_available()
    rng = np.random.default_rng(0)
    host = torch.from_numpy((rng.standard_normal(V) * 3).astype(np.float32))
    mask = rng.random(V) < 0.2
    bits = pack_mask(mask)
    hist = list(rng.integers(0, V, 256))
    modes = {
        "greedy": dict(temperature=0.0, top_k=1, top_p=1.0, min_p=0.0),
        "defaults": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
        "temperature": dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
        "top_p_full": dict(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0),
    }
    if a.modes:
        modes = {k: v for k, v in modes.items() if k in a.modes.split(",")}
    res = {"machine": platform.node() or "vm", "gpu": torch.cuda.get_device_name() if cuda
           else None, "command": "python " + " ".join(sys.argv), "vocab": V, "topk_max": ks.TOPK_MAX,
           "runs": {}}
    for name, kw in modes.items():
        for extra in ("plain", "mask", "penalties+mask"):
            pen = dict(repeat_penalty=1.1, frequency_penalty=0.2, repeat_last_n=64) \
                if extra.startswith("penalties") else {}
            p = SamplingParams(seed=1, **kw, **pen).validate()
            allowed = mask if "mask" in extra else None
            row = {}
            s = Sampler(p, V, device_sampling=False)
            row["numpy_us"] = _time(lambda: s.sample(host, hist, allowed), a.n)
            if not cuda:
                dp = DeviceSamplingParams.build([p], V, "cpu")
                counts = counts_from_history([hist], V, 64) if dp.has_penalties else None
                bm = torch.from_numpy(bits[None]) if allowed is not None else None
                row["twin_us"] = _time(lambda: sample_ref(host[None], dp, counts=counts,
                                                          bitmask=bm), max(5, a.n // 10))
            else:
                dev = host.cuda()
                sd = Sampler(p, V, device_sampling=True)
                dbits = bits if allowed is not None else None
                for _ in range(10):
                    sd.sample(dev, hist, dbits)
                torch.cuda.synchronize()
                row["device_us"] = _time(lambda: sd.sample(dev, hist, dbits), a.n)
                dp = DeviceSamplingParams.build([p], V, "cuda")
                counts = counts_from_history([hist], V, 64, device="cuda") \
                    if dp.has_penalties else None
                bm = torch.from_numpy(bits[None]).cuda() if allowed is not None else None
                ws: dict = {}

                def call():
                    return sample_device(dev[None], dp, counts=counts, bitmask=bm,
                                         want_logprobs=True, workspace=ws)

                for _ in range(5):
                    call()
                torch.cuda.synchronize()

                def launch_only():
                    call()

                row["launch_us"] = _time(launch_only, a.n)
                torch.cuda.synchronize()
                st = torch.cuda.Stream()
                st.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(st):
                    call()
                torch.cuda.current_stream().wait_stream(st)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    call()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                for _ in range(10):
                    g.replay()
                torch.cuda.synchronize()
                e0.record()
                for _ in range(a.n):
                    g.replay()
                e1.record()
                torch.cuda.synchronize()
                row["graph_us"] = round(e0.elapsed_time(e1) * 1000 / a.n, 1)
            res["runs"][f"{name}/{extra}"] = row
            print(f"{name:12s} {extra:15s}", row, flush=True)
    res["load_avg"] = list(os.getloadavg())
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
