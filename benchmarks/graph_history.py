"""The context-0 decode graph's time after a history of runner events, in one process.

Session 22 found that ``vs_llamacpp``'s context-0 rows (graph ~2.01-2.03 ms on the H200 with
the synthetic Qwen3-30B-A3B file) are slower than a fresh process's (~1.86 ms) because of what
the runner did before them, not because of the decode step: after a 512-token prompt decoded
past its end and a 4,096-token prompt prefilled three times, every later decode graph replays
~155 us slower. This script replays such a history step by step and measures the context-0
graph after each step::

    python benchmarks/graph_history.py MODEL.gguf fresh,warm512,pp512,ttft4096,fresh
    python benchmarks/graph_history.py summarize OUT.jsonl

Steps: ``fresh`` (nothing), ``warm512`` (a 512-token prompt, then 4 decode steps on it: what
``vs_llamacpp.run_localmoe`` does first), ``pp512`` / ``ttft4096`` (its timed prompts:
:func:`vs_llamacpp.time_prefill`), ``recapture`` (drop the decode graphs; the next step
captures again), ``empty`` (``torch.cuda.empty_cache()``), ``sleep`` (5 s), ``ondevice`` (16
decode steps returning their logits on the device), ``ondevring`` (the same 16 steps, each
copying the graph's logits into one of two device buffers allocated before the first step: the
device-logits path without an allocation per step), ``alloc`` / ``bigalloc`` (16 device
allocations of 600 KB / 256 MiB, filled and freed, no step), ``upload`` (``cuGraphUpload`` of
every captured graph again: if the slow state is the driver's copy of the graphs going stale
when new memory is mapped, this restores the fast one). After each, a new
sequence of one token decodes 8 steps; the graph is replayed 32 times back to back (three
times), then the generation loop runs 64 tokens and the graph is timed again. One JSON line
per step: graph ms, a hash of the logits of one fixed decode step (the same in every row
of a healthy runner), host ms per replay enqueue, generation-loop ms, graph ms after the loop,
the captured graphs, how many were captured again because the allocator grew
(``graphs.Refresh``, with ``LOCALMOE_GRAPH_REFRESH=1``), and
the GPU's clocks (``nvidia-smi``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import vs_llamacpp as V  # noqa: E402

STEPS = ("fresh", "warm512", "pp512", "ttft4096", "recapture", "empty", "sleep", "ondevice",
         "ondevring", "alloc", "bigalloc", "upload")


def clocks() -> str:
    """SM clock, memory clock, power, temperature and throttle reasons, or why not."""
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,"
             "clocks_throttle_reasons.active", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"unavailable ({e})"


def kernel_times(g, reps: int = 20) -> dict:
    """Device time per replay of the graph ``g`` by kernel (name cut at 48 characters), in
    us, from ``torch.profiler`` over ``reps`` replays: which kernels a slow state slows."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            k = ev.name[:48]
            out[k] = out.get(k, 0.0) + ev.device_time_total / reps
    return {k: round(v, 2) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def context0(runner, prompt: list[int], tag: str, host_only: bool = False,
             profile: bool = False) -> dict:
    import torch

    s = runner.new_sequence()
    runner.forward([(s, prompt[:1])])
    V.time_decode(runner, s, 8)
    # the same tokens at the same positions after every step: a decode step whose logits
    # change with the history reads memory it no longer owns (a slow state that is a bug)
    check = runner.forward([(s, [5])])[0].float().cpu()
    logits_sha = hashlib.sha256(check.numpy().tobytes()).hexdigest()[:16]
    graph = [round(V.graph_ms(runner, s), 4) for _ in range(3)]
    g = runner.graphs.graphs[(1, runner.graphs.bucket(runner.cache.seq_len(s) + 1))].graph
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(32):
        g.replay()
    host_ms = (time.perf_counter() - t) / 32 * 1e3
    kernels = kernel_times(g) if profile else None
    gen = V.time_decode(runner, s, 64) if host_only else V.time_generate(runner, s, 64)
    after = round(V.graph_ms(runner, s), 4)
    runner.free_sequence(s)
    pg = runner.prefill_graphs
    return {"step": tag, "graph_ms": graph, "logits_sha": logits_sha,
            "logits_argmax": int(check.argmax()), "enqueue_ms": round(host_ms, 4),
            ("decode_ms" if host_only else "gen_ms"): round(gen, 4), "graph_after_gen_ms": after,
            "decode_graphs": sorted(k for k, v in runner.graphs.graphs.items() if v.graph),
            "recaptured": runner.graphs.refreshes,
            "prefill_graphs": sorted(k for k, v in pg.graphs.items() if v.graph) if pg else None,
            "reserved_mib": round(torch.cuda.memory_reserved() / 2**20, 1),
            "segments": len(torch.cuda.memory_snapshot()),
            "clocks": clocks(), **({"kernels_us": kernels} if kernels is not None else {})}


def ring_steps(runner, first: int, ring: list, n: int = 16) -> None:
    """``n`` decode steps of a new sequence that copy the decode graph's logits into the
    preallocated ``ring`` buffers in turn instead of returning a fresh copy (what
    ``runner.forward(on_device=True)`` does): the device-logits path with no allocation."""
    import torch

    from localmoe.backends.reference import prepare_batch
    from localmoe.kernels.quant_gemv import use_act_precision

    s = runner.new_sequence()
    runner.forward([(s, [first])])
    with torch.cuda.device(torch.device(runner.device)), torch.inference_mode(), \
            use_act_precision(runner.act_precision):
        for i in range(n):
            batch = [(s, [11 + i])]
            prepare_batch(runner.model, runner.cache, runner.n_ctx, batch)
            logits = runner.graphs.run(batch)
            runner.cache.commit(s, 1)
            ring[i % len(ring)].copy_(logits[0])
    torch.cuda.synchronize()
    runner.free_sequence(s)


def upload_graphs(runner) -> list[int]:
    """``cuGraphUpload`` (CUDA driver API) of every captured decode and prefill graph of
    ``runner`` on the current stream; the driver's result code of each (0: success)."""
    import ctypes

    import torch

    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuGraphUpload.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    stream = torch.cuda.current_stream().cuda_stream
    pools = [runner.graphs.graphs] + ([runner.prefill_graphs.graphs] if runner.prefill_graphs
                                      else [])
    codes = []
    for graphs in pools:
        for v in graphs.values():
            g = getattr(v, "graph", None)
            if g is not None and hasattr(g, "raw_cuda_graph_exec"):
                codes.append(int(lib.cuGraphUpload(g.raw_cuda_graph_exec(), stream)))
    torch.cuda.synchronize()
    return codes


def summarize(path: str, top: int = 14) -> None:
    """Print the rows of a JSONL file this script wrote (graph ms, logits hash, reserved MiB)
    and, where rows carry ``kernels_us`` (``--profile``), the kernels whose time changed most
    between the first profiled row and the slowest one."""
    rows = [json.loads(line) for line in open(path) if line.strip().startswith("{")]
    for d in rows:
        print(d["step"], d.get("graph_ms", d.get("codes")), d.get("graph_after_gen_ms", ""),
              d.get("logits_sha", ""), d.get("reserved_mib", ""), d.get("segments", ""),
              d.get("recaptured", ""))
    shas = {d["logits_sha"] for d in rows if "logits_sha" in d}
    if shas:
        print("logits: the same in every row" if len(shas) == 1
              else f"logits: {len(shas)} different hashes (a step reads memory it does not own?)")
    prof = [d["kernels_us"] for d in rows if "kernels_us" in d]
    if len(prof) >= 2:
        a, b = prof[0], max(prof[1:], key=lambda k: sum(k.values()))
        keys = sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, 0) - a.get(k, 0)))
        for k in keys[:top]:
            print(f"{a.get(k, 0):9.2f} {b.get(k, 0):9.2f} {b.get(k, 0) - a.get(k, 0):+8.2f}  {k}")
        print(f"total us {sum(a.values()):.1f} -> {sum(b.values()):.1f}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["summarize"]:
        for path in argv[1:]:
            summarize(path)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("steps", help="comma-separated, from: " + ", ".join(STEPS))
    ap.add_argument("--n-ctx", type=int, default=4700)
    ap.add_argument("--kv", default="f16")
    ap.add_argument("--host-only", action="store_true",
                    help="no logits on the device (no generation loop) outside 'ondevice' steps")
    ap.add_argument("--profile", action="store_true",
                    help="also the graph's device time by kernel after each step (torch.profiler)")
    a = ap.parse_args(argv)
    steps = a.steps.split(",")
    bad = [s for s in steps if s not in STEPS]
    if bad:
        ap.error(f"unknown step(s) {', '.join(bad)}; choose from {', '.join(STEPS)}")
    import torch

    from localmoe.backends.triton.runner import TritonRunner
    from localmoe.io.loader import open_model

    r = TritonRunner(open_model(str(a.model)), n_ctx=a.n_ctx, kv_spec=a.kv, device="cuda")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, r.spec.vocab_size, (4096,), generator=g).tolist()
    ring = [torch.empty(r.spec.vocab_size, dtype=torch.float32, device="cuda") for _ in range(2)]
    for step in steps:
        if step == "warm512":
            s = r.new_sequence()
            r.forward([(s, prompt[:512])])
            V.time_decode(r, s, 4)
            r.free_sequence(s)
        elif step == "pp512":
            V.time_prefill(r, prompt[:512])
        elif step == "ttft4096":
            V.time_prefill(r, prompt[:4096], reps=2)
        elif step == "recapture":
            r.graphs.graphs.clear()
        elif step == "empty":
            torch.cuda.empty_cache()
        elif step == "sleep":
            time.sleep(5)
        elif step == "ondevice":
            s = r.new_sequence()
            r.forward([(s, prompt[:1])])
            for i in range(16):
                r.forward([(s, [11 + i])], on_device=True)
            r.free_sequence(s)
        elif step == "ondevring":
            ring_steps(r, prompt[0], ring)
        elif step == "upload":
            print(json.dumps({"step": "upload", "codes": upload_graphs(r)}), flush=True)
        elif step in ("alloc", "bigalloc"):   # device allocations with no step: 16 x 600 KB
            n = 151936 if step == "alloc" else 64 << 20   # or 16 x 256 MiB
            for i in range(16):
                x = torch.empty(n, dtype=torch.float32, device="cuda")
                x.fill_(float(i))
                del x
            torch.cuda.synchronize()
        print(json.dumps(context0(r, prompt, step, a.host_only, a.profile)), flush=True)
    r.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
