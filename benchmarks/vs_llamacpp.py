"""localmoe's triton backend against llama.cpp (CUDA) on the same GGUF file and GPU, in one run.

Writes (or reuses) a synthetic real-geometry preset (``localmoe.testing.synthetic``), builds
llama.cpp's ``llama-bench`` with CUDA from a llama.cpp source tree or tarball (the vendored
tree of the llama-cpp-python source distribution; the build is cached in ``--build-dir``), and
measures both engines at batch 1:

* ``load_s``: localmoe runner construction (file in the page cache; the file is read once
  before timing); llama.cpp: the wall time of ``llama-bench -p 1 -n 1 -r 1`` (process start,
  CUDA init, load and two one-token runs: an upper bound of its load);
* ``peak_vram_gib``: the GPU's ``memory.used`` (nvidia-smi, polled every 0.1 s) above the level
  before the engine started, for both engines alike (CUDA context included);
* ``prefill_tok_s``: a 512-token prompt at context 0 (llama.cpp: ``pp512``);
* ``tpot_ms``: time per decoded token at each ``--depths`` context (``tg`` at ``-d ...``), 64
  tokens, median of steps (localmoe: ``runner.forward`` of one token, CUDA synchronized: what
  ``LLM.generate`` spends per token minus sampling; CUDA graphs as the runner uses them, and
  ``tpot_eager_ms`` with the same step launched op by op). localmoe's context is filled with
  random K/V through the cache's codecs (:func:`fill_context`: decode reads the same bytes as
  after a prefill); llama-bench prefills it. Each ``--kv`` format of localmoe and each
  ``--llama-kv`` type of llama.cpp (``-ctk``/``-ctv``) gives its own rows;
* ``ttft_<n>_ms`` (``--ttft-prompt n``): time to prefill an ``n``-token prompt at context 0
  (llama.cpp: ``pp<n>``);
* ``replay_ms`` (localmoe only): the decode step with 32 steps queued back to back (logits left
  on the device): its GPU time without the per-step host work that ``tpot_ms`` includes;
  ``graph_ms`` the captured graph alone replayed back to back (no input staging between);
* ``tpot_generate_ms`` (localmoe only): the engine's decode loop on the runner
  (:func:`time_generate`: device sampling, each step launched with the sampled token still on
  the device and read after the launch), ``tpot_generate_unpipelined_ms`` the same loop reading
  each token before launching the next step, and at context 0 ``tpot_engine_ms``: the TPOT of
  ``LLM.generate`` itself (:func:`time_engine`). llama-bench's ``tg`` has no sampling: it is
  ``tpot_ms``'s counterpart;
* ``kernels_per_token`` (and ``kernels_per_layer``), ``host_syncs_per_token``, ``gpu_busy``,
  ``kernel_us_per_token`` and ``kernel_table`` (the 12 costliest kernels: launches and us per
  token) (localmoe only): a
  ``torch.profiler`` trace of 8 decode steps: CUDA kernels launched, synchronizing CUDA runtime
  calls (stream/device/event synchronize, blocking copies to the host), and the kernels' summed
  time over the wall time.

Output: ``benchmarks/results/vs_llamacpp-<date>.json`` ``{"machine", "gpu", "preset",
"file_bytes", "command", "rows": [{"engine", "kv", "ctx", "load_s", "peak_vram_gib",
"prefill_tok_s", "tpot_ms", "kernels_per_token", "host_syncs_per_token", "gpu_busy"}]}``.

Usage (GPU machine)::

    python benchmarks/vs_llamacpp.py --preset qwen3-30b-a3b --model-dir /tmp/models \\
        --llama-src llama.cpp-src.tar.xz --build-dir /tmp/llama-build --out results.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cudaMemcpy", "cudaMemcpy2D")


# ---------------------------------------------------------------------------------------------
# shared helpers
# ---------------------------------------------------------------------------------------------

def gpu_mem_used_mib() -> float | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                              "-i", os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]],
                             capture_output=True, text=True, timeout=10).stdout
        return float(out.strip().splitlines()[0])
    except Exception:
        return None


class VramPoll:
    """Peak ``memory.used`` (MiB) above the level at start, polled in a thread."""

    def __init__(self, every: float = 0.1):
        self.base = gpu_mem_used_mib()
        self.peak = self.base
        self.every = every
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            v = gpu_mem_used_mib()
            if v is not None and (self.peak is None or v > self.peak):
                self.peak = v
            time.sleep(self.every)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()

    @property
    def gib(self) -> float | None:
        if self.base is None or self.peak is None:
            return None
        return round((self.peak - self.base) / 1024, 2)


def ensure_file(preset: str, model_dir: Path, n_layers: int | None, quant: str | None = None
                ) -> Path:
    """The synthetic ``preset`` file in ``model_dir`` (written once): its Q4_K_M-like mix, or
    every weight matrix in ``quant`` (e.g. ``iq4_xs``, ``q3_k``)."""
    from localmoe.testing.synthetic import write_gguf

    name = (preset + (f"-{n_layers}l" if n_layers else "") + (f"-{quant.lower()}" if quant else "")
            + ".gguf")
    path = model_dir / name
    if not path.exists():
        model_dir.mkdir(parents=True, exist_ok=True)
        t = time.time()
        write_gguf(path, preset, seed=0, n_layers=n_layers, quant=quant)
        print(f"wrote {path} ({path.stat().st_size / 1e9:.1f} GB) in {time.time() - t:.0f} s", flush=True)
    return path


def page_in(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(1 << 26):
            pass


# ---------------------------------------------------------------------------------------------
# llama.cpp
# ---------------------------------------------------------------------------------------------

def build_llama_bench(src: Path, build_dir: Path, jobs: int) -> Path:
    """``llama-bench`` built with CUDA (sm_90) in ``build_dir`` (reused when present)."""
    exe = build_dir / "bin" / "llama-bench"
    if exe.exists():
        return exe
    root = src
    if src.is_file():
        dest = build_dir.parent / "llama-src"
        if not (dest / "llama.cpp").exists():
            dest.mkdir(parents=True, exist_ok=True)
            with tarfile.open(src) as t:
                t.extractall(dest)
        root = dest / "llama.cpp"
    build_dir.mkdir(parents=True, exist_ok=True)
    cfg = ["cmake", "-S", str(root), "-B", str(build_dir), "-DGGML_CUDA=ON",
           "-DCMAKE_CUDA_ARCHITECTURES=90", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
           "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
           "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_APP=OFF", "-DGGML_NATIVE=ON"]
    subprocess.run(cfg, check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama-bench", "-j", str(jobs)],
                   check=True, stdout=subprocess.DEVNULL)
    return exe


def _llama_json(cmd: list[str], timeout: float) -> tuple[list[dict], str | None]:
    """``(records, error)`` of one ``llama-bench -o json`` run: its records, or none and why
    (a non-zero exit with the end of its stderr, or the time limit)."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        return [], f"timed out after {timeout:.0f} s"
    if res.returncode:
        return [], f"exit {res.returncode}: {res.stderr[-500:].strip()}"
    try:
        return json.loads(res.stdout), None
    except json.JSONDecodeError as e:
        return [], f"unreadable output ({e})"


def run_llama_bench(exe: Path, path: Path, depths: list[int], n_gen: int, n_prompt: int,
                    kv_types: list[str] = ("f16",), ttft_prompt: int = 0,
                    reps: int = 3, timeout: float = 3000.0) -> list[dict]:
    """llama-bench rows: ``pp<n_prompt>`` (and ``pp<ttft_prompt>``) at depth 0, ``tg<n_gen>``
    at each depth, for each KV cache type (``-ctk``/``-ctv``: f16, q8_0, q4_0).

    Each KV type's prompts and each (KV type, depth)'s generation is its own llama-bench run
    of at most ``timeout`` seconds, so one that fails or is too slow (quantized KV at 64k
    prefills its depth slowly) costs its own row's figures (``None``, with ``llama_error``
    saying why), not the others'.
    """
    prompts = [n_prompt] + ([ttft_prompt] if ttft_prompt else [])
    t = time.time()
    subprocess.run([str(exe), "-m", str(path), "-ngl", "99", "-fa", "1", "-p", "1", "-n", "1",
                    "-r", "1", "-o", "json"], capture_output=True, text=True, timeout=600, check=True)
    load_s = round(time.time() - t, 2)
    rows = []
    build = None
    with VramPoll() as vp:
        for kv in kv_types:
            base = [str(exe), "-m", str(path), "-ngl", "99", "-fa", "1", "-r", str(reps),
                    "-o", "json", "-ctk", kv, "-ctv", kv]
            t = time.time()
            pp_data, pp_err = _llama_json(base + ["-p", ",".join(map(str, prompts)), "-n", "0"],
                                          timeout)
            pp = {r["n_prompt"]: r for r in pp_data if r.get("n_gen") == 0}
            for depth in depths:
                tg_data, tg_err = _llama_json(
                    base + ["-p", "0", "-n", str(n_gen), "-d", str(depth)], timeout)
                tg = [r for r in tg_data if r.get("n_gen") == n_gen and r.get("n_prompt") == 0]
                build = build or next((r.get("build_commit") for r in pp_data + tg_data), None)
                row = {"engine": "llama.cpp", "kv": kv, "ctx": depth, "load_s": load_s,
                       "peak_vram_gib": None,
                       "prefill_tok_s": (round(pp[n_prompt]["avg_ts"], 1)
                                         if n_prompt in pp and depth == 0 else None),
                       "tpot_ms": round(1e3 / tg[0]["avg_ts"], 3) if tg else None,
                       "kernels_per_token": None, "host_syncs_per_token": None,
                       "gpu_busy": None, "bench_wall_s": round(time.time() - t, 1),
                       "build": build}
                if ttft_prompt and ttft_prompt in pp and depth == 0:
                    row[f"ttft_{ttft_prompt}_ms"] = round(
                        1e3 * ttft_prompt / pp[ttft_prompt]["avg_ts"], 1)
                errors = [e for e in (pp_err if depth == 0 else None, tg_err) if e]
                if errors:
                    row["llama_error"] = "; ".join(errors)
                rows.append(row)
    for r in rows:
        r["peak_vram_gib"] = vp.gib
    return rows


# ---------------------------------------------------------------------------------------------
# localmoe
# ---------------------------------------------------------------------------------------------

def _sync():
    import torch

    torch.cuda.synchronize()


def profile_decode(runner, seq: int, steps: int = 8) -> dict:
    """Kernels, synchronizing runtime calls and GPU-busy share per decode step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        runner.forward([(seq, [7])])
    _sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            runner.forward([(seq, [7])])
        _sync()
        wall = time.perf_counter() - t
    kernels = syncs = 0
    busy_us = 0.0
    table: dict[str, list] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels += 1
            us = ev.device_time if hasattr(ev, "device_time") else ev.cuda_time
            busy_us += us
            row = table.setdefault(ev.name[:72], [0, 0.0])
            row[0] += 1
            row[1] += us
        elif ev.name in SYNC_CALLS:
            syncs += 1
    top = sorted(table.items(), key=lambda kv: -kv[1][1])[:12]
    return {"kernels_per_token": round(kernels / steps, 1),
            "host_syncs_per_token": round(syncs / steps, 1),
            "gpu_busy": round(busy_us / 1e6 / wall, 3),
            "kernel_us_per_token": round(busy_us / steps, 1),
            "kernel_table": [{"kernel": k, "per_token": round(n / steps, 1),
                              "us_per_token": round(us / steps, 1)} for k, (n, us) in top]}


def _queued_ms(step, steps: int = 32, warmup: int = 3) -> float:
    """Milliseconds per call of ``step`` with ``steps`` calls queued back to back, CUDA events
    around them (after ``warmup`` calls and a sync)."""
    import torch

    for _ in range(warmup):
        step()
    _sync()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(steps):
        step()
    e1.record()
    _sync()
    return e0.elapsed_time(e1) / steps


def replay_ms(runner, seq: int, steps: int = 32) -> float | None:
    """Milliseconds per decode step with ``steps`` steps queued back to back (logits left on
    the device, CUDA events around them): the step's GPU time without the per-step host work
    and logits copy that :func:`time_decode` includes. None where the runner cannot return
    device logits."""
    if not getattr(runner, "supports_device_logits", False):
        return None
    return _queued_ms(lambda: runner.forward([(seq, [9])], on_device=True), steps)


def graph_ms(runner, seq: int, steps: int = 32) -> float | None:
    """Milliseconds per replay of the captured decode graph that ``seq``'s next step uses (its
    length bucket), replayed back to back with nothing else queued (no input staging, no
    copies): the step's time on the device, to set against :func:`replay_ms`. None without a
    captured graph."""
    graphs = getattr(runner, "graphs", None)
    if graphs is None:
        return None
    g = graphs.graphs.get((1, graphs.bucket(runner.cache.seq_len(seq) + 1)))
    if g is None or g.graph is None:
        return None
    return _queued_ms(g.graph.replay, steps)


def time_decode(runner, seq: int, n: int) -> float:
    times = []
    for i in range(n):
        _sync()
        t = time.perf_counter()
        runner.forward([(seq, [11 + i % 100])])
        _sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times[3:] if len(times) > 6 else times) * 1e3


def time_generate(runner, seq: int, n: int, pipeline: bool = True) -> float | None:
    """Milliseconds per token of the engine's decode loop on the runner (its detokenizing and
    stop checks aside, which overlap the GPU): each step's logits sampled on the device
    (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05, a fixed seed) and the sampled token fed
    to the next step. ``pipeline``: the step is launched with the token still on the device and
    the id read after the launch (:meth:`Sampler.launch`); otherwise the id is read first (the
    loop before pipelining). None where the runner cannot keep logits on the device."""
    from localmoe.engine.sampling import Sampler, SamplingParams

    if not getattr(runner, "supports_device_logits", False):
        return None
    sampler = Sampler(SamplingParams(seed=0), runner.spec.vocab_size)
    hist = [11]
    logits = runner.forward([(seq, hist[-1:])], on_device=True)[0]
    times = []
    for _ in range(n):
        t = time.perf_counter()
        if pipeline:
            pend = sampler.launch(logits, hist)
            logits = runner.forward([(seq, [0])], on_device=True, tokens_on_device=pend.ids)[0]
            tok = sampler.finish(pend, hist)
        else:
            tok = sampler.sample(logits, hist)
            logits = runner.forward([(seq, [tok])], on_device=True)[0]
        hist.append(tok)
        times.append(time.perf_counter() - t)
    _sync()
    return statistics.median(times[3:] if len(times) > 6 else times) * 1e3


def time_engine(runner, mf, n: int) -> float:
    """TPOT (ms) of ``LLM.generate`` over ``runner`` as a user calls it (default sampling, the
    end tokens banned so that ``n`` tokens come), from the result's timings."""
    from localmoe.engine.engine import Engine
    from localmoe.text.tokenizer import Tokenizer

    tok = Tokenizer.from_model(mf)
    eng = Engine.from_parts(runner, tok, model_file=mf)
    ban = {int(i): -100.0 for i in getattr(tok, "eog_ids", ()) or ()}
    try:
        eng.generate("hello", max_tokens=8, logit_bias=ban)     # warm-up
        return eng.generate("The quick brown fox", max_tokens=n, logit_bias=ban).timings.tpot_ms
    finally:
        runner.free_sequence(eng._seq)       # the runner stays open for the next rows


def fill_context(runner, seq: int, depth: int, chunk: int = 4096) -> None:
    """Give sequence ``seq`` ``depth`` cached tokens without running the model: random K/V
    (unit normal, what the attention reads costs the same whatever the values) written through
    each layer's codecs. Decode at that depth then reads exactly what it would after a real
    prefill, without the reference prefill attention's score matrices (tens of GiB at 64k)."""
    import torch

    c, s = runner.cache, runner.spec
    g = torch.Generator(device=c.device).manual_seed(1)
    for start in range(0, depth, chunk):
        n = min(chunk, depth - start)
        c.reserve(seq, n)
        for layer in range(s.n_layers):
            k = torch.randn((n, s.n_kv_heads, s.head_dim), generator=g, device=c.device,
                            dtype=runner.dtype)
            v = torch.randn((n, s.n_kv_heads, s.v_head_dim), generator=g, device=c.device,
                            dtype=runner.dtype)
            c.write(layer, seq, start, k, v)
        c.commit(seq, n)


def time_prefill(runner, prompt: list[int], reps: int = 3, chunk: int = 4096) -> float:
    """Median seconds to prefill ``prompt`` on a fresh sequence (chunks of ``chunk`` tokens),
    after one untimed run (it compiles kernels and captures the prompt's prefill graph)."""
    ts = []
    for rep in range(reps + 1):
        s = runner.new_sequence()
        _sync()
        t = time.perf_counter()
        for i in range(0, len(prompt), chunk):
            runner.forward([(s, prompt[i:i + chunk])])
        _sync()
        if rep:
            ts.append(time.perf_counter() - t)
        runner.free_sequence(s)
    return statistics.median(ts)


def run_localmoe(path: Path, depths: list[int], n_gen: int, n_prompt: int, kv: str,
                 profile: bool, ttft_prompt: int = 0, eager: bool = True,
                 decode_first: bool = False) -> list[dict]:
    """localmoe's rows (one per depth). ``decode_first``: the decode rows are timed before the
    prefill and TTFT timings instead of after them (session 21: the context-0 graph read ~170
    us slower here than in a fresh process; this tells whether the prompts before it are why)."""
    import torch

    from localmoe.backends.triton.runner import TritonRunner
    from localmoe.io.loader import open_model

    n_ctx = max(depths + [ttft_prompt]) + n_prompt + n_gen + 64
    with VramPoll() as vp:
        t = time.perf_counter()
        mf = open_model(str(path))
        runner = TritonRunner(mf, n_ctx=n_ctx, kv_spec=kv, device="cuda")
        _sync()
        load_s = time.perf_counter() - t
        g = torch.Generator().manual_seed(0)
        vocab = runner.spec.vocab_size
        n_layers = runner.spec.n_layers
        rows = []
        prompt = torch.randint(0, vocab, (max(n_prompt, ttft_prompt),), generator=g).tolist()
        # warm-up: compile every kernel variant once (prefill and decode)
        s = runner.new_sequence()
        runner.forward([(s, prompt[:n_prompt])])
        time_decode(runner, s, 4)
        runner.free_sequence(s)

        def prompts():
            p = n_prompt / time_prefill(runner, prompt[:n_prompt])
            return p, (time_prefill(runner, prompt[:ttft_prompt], reps=2) * 1e3
                       if ttft_prompt else None)

        if not decode_first:
            prefill, ttft = prompts()
        for depth in depths:
            s = runner.new_sequence()
            if depth:
                fill_context(runner, s, depth)
            else:
                runner.forward([(s, prompt[:1])])
            tpot = time_decode(runner, s, n_gen)
            replay = replay_ms(runner, s)
            graph = graph_ms(runner, s)
            gen = time_generate(runner, s, n_gen)
            gen_plain = time_generate(runner, s, n_gen, pipeline=False)
            prof = profile_decode(runner, s) if profile else {}
            graphs = runner.graphs
            eager_ms, eager_prof = None, {}
            if eager and graphs is not None and graphs.capture:
                graphs.capture = False       # the same step launched op by op, for comparison
                eager_ms = time_decode(runner, s, 16)
                eager_prof = profile_decode(runner, s, 4) if profile else {}
                graphs.capture = True
            runner.free_sequence(s)
            engine_ms = time_engine(runner, mf, n_gen) if depth == 0 else None
            kpt = prof.get("kernels_per_token")
            row = {"engine": "localmoe", "kv": kv, "ctx": depth, "load_s": round(load_s, 2),
                   "peak_vram_gib": None,
                   "prefill_tok_s": None,        # set below, on the context-0 row
                   "tpot_ms": round(tpot, 3),
                   "replay_ms": round(replay, 3) if replay else None,
                   "graph_ms": round(graph, 3) if graph else None,
                   "tpot_generate_ms": round(gen, 3) if gen else None,
                   "tpot_generate_unpipelined_ms": round(gen_plain, 3) if gen_plain else None,
                   "tpot_engine_ms": round(engine_ms, 3) if engine_ms else None,
                   "kernels_per_token": kpt,
                   "kernel_us_per_token": prof.get("kernel_us_per_token"),
                   "kernel_table": prof.get("kernel_table"),
                   "kernels_per_layer": round(kpt / n_layers, 2) if kpt else None,
                   "host_syncs_per_token": prof.get("host_syncs_per_token"),
                   "gpu_busy": prof.get("gpu_busy"), "weights": runner.stats()["weights"],
                   "fused_step": runner.stats().get("fused_step"),
                   "tpot_eager_ms": round(eager_ms, 3) if eager_ms else None,
                   "eager_profile": eager_prof or None,
                   "cuda_graphs": runner.stats()["cuda_graphs"],
                   "pdl": runner.stats().get("pdl"),
                   "torch_peak_alloc_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        if decode_first:
            prefill, ttft = prompts()
        for row in rows:
            if row["ctx"] == 0:
                row["prefill_tok_s"] = round(prefill, 1)
                if ttft is not None:
                    row[f"ttft_{ttft_prompt}_ms"] = round(ttft, 1)
    for r in rows:
        r["peak_vram_gib"] = vp.gib
    runner.close()
    del runner
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--n-layers", type=int, default=None, help="truncated copy (quick runs)")
    ap.add_argument("--quant", default=None,
                    help="every weight matrix of the synthetic file in this GGUF type (iq4_xs, "
                         "q3_k, ...; default: the preset's Q4_K_M-like mix)")
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/models"))
    ap.add_argument("--llama-src", type=Path, default=None,
                    help="llama.cpp source tree or .tar.xz (skip llama.cpp when absent)")
    ap.add_argument("--build-dir", type=Path, default=Path("/tmp/llama-build"))
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    ap.add_argument("--depths", default="0,16384")
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--kv", default="f16", help="localmoe KV formats, comma-separated")
    ap.add_argument("--llama-kv", default="f16", help="llama.cpp -ctk/-ctv types, comma-separated")
    ap.add_argument("--ttft-prompt", type=int, default=0, help="also time a prompt this long")
    ap.add_argument("--reps", type=int, default=3, help="llama-bench repetitions")
    ap.add_argument("--llama-timeout", type=float, default=3000.0,
                    help="seconds for each llama-bench run (one KV type's prompts, or one KV "
                         "type at one depth); a slower one leaves its row's figures empty")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--moe-prefill-chunk", type=int, default=None,
                    help="tokens per MoE prefill pass (kernels.quant_gemm.MOE_PREFILL_CHUNK)")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager (no graph) timing")
    ap.add_argument("--skip-localmoe", action="store_true")
    ap.add_argument("--llama-rows", type=Path, default=None,
                    help="llama.cpp rows from an earlier --skip-localmoe run's JSON on this "
                         "machine and file (a run too long for one device call), merged in")
    ap.add_argument("--decode-first", action="store_true",
                    help="time localmoe's decode rows before its prefill and TTFT timings")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    depths = [int(x) for x in a.depths.split(",")]
    path = ensure_file(a.preset, a.model_dir, a.n_layers, a.quant)
    page_in(path)
    import torch

    out = {"machine": platform.node(), "gpu": torch.cuda.get_device_name(0), "preset": a.preset, "quant": a.quant or "mixed",
           "n_layers": a.n_layers, "file_bytes": path.stat().st_size,
           "date": datetime.date.today().isoformat(),
           "command": "python benchmarks/vs_llamacpp.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "torch": torch.__version__, "rows": []}
    if a.moe_prefill_chunk is not None:
        from localmoe.kernels import quant_gemm

        quant_gemm.MOE_PREFILL_CHUNK = a.moe_prefill_chunk
    if not a.skip_localmoe:
        for i, kv in enumerate(a.kv.split(",")):
            out["rows"] += run_localmoe(path, depths, a.n_gen, a.n_prompt, kv, not a.no_profile,
                                        ttft_prompt=a.ttft_prompt,
                                        eager=not a.no_eager and i == 0,
                                        decode_first=a.decode_first)
    if a.llama_src is not None:
        exe = build_llama_bench(a.llama_src, a.build_dir, a.jobs)
        out["rows"] += run_llama_bench(exe, path, depths, a.n_gen, a.n_prompt,
                                       a.llama_kv.split(","), a.ttft_prompt, a.reps,
                                       a.llama_timeout)
    if a.llama_rows is not None:
        old = json.loads(a.llama_rows.read_text())
        if (old.get("machine"), old.get("file_bytes")) != (out["machine"], out["file_bytes"]):
            print(f"warning: {a.llama_rows} was measured on {old.get('machine')} with a "
                  f"{old.get('file_bytes')}-byte file", file=sys.stderr)
        out["llama_rows_from"] = {"file": str(a.llama_rows), "command": old.get("command")}
        out["rows"] += [r for r in old["rows"] if r["engine"] == "llama.cpp"]
    base = {r["ctx"]: r for r in out["rows"] if r["engine"] == "llama.cpp" and r["kv"] == "f16"}
    for o in out["rows"]:
        r = base.get(o["ctx"])
        if o["engine"] == "localmoe" and r is not None:
            o["ratio_to_llamacpp_f16"] = {k: round(o[k] / r[k], 3) for k in o
                                          if k in ("peak_vram_gib", "prefill_tok_s", "tpot_ms")
                                          or k.startswith("ttft_")
                                          if isinstance(o.get(k), (int, float)) and r.get(k)}
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
