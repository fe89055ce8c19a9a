"""Decode-attention benchmark: fused packed-KV Triton kernel vs PyTorch SDPA on an fp16 cache.

Shape: Qwen3-30B-A3B attention (32 query heads, 4 kv heads, head_dim 128), one new token per
sequence, batch 1 and 8, contexts 4k/16k/64k, paged cache with 16-token blocks in a shuffled
block table. For each format it reports time per call (median over CUDA-graph replays that
cycle through enough cache copies to defeat the 60 MB L2), the K+V bytes the call must read
(packed codes, scales, outliers) and the achieved GB/s against the copy ceiling (~4.27 TB/s on
the H200, read+write counted). SDPA runs in the same process on contiguous fp16 K/V
([B, 4, L, 128], ``enable_gqa=True``).

Key formats with ``:c`` (``int4:c/int4``) are per-channel keys (KIVI, one scale and zero per
channel per 16-token page). Before timing, ``--check`` compares the kernels with their PyTorch twins on the GPU (every
format, outliers, sinks/window, rotation, GQA 8:1 and 4:1) and fails loudly on a mismatch.

The variant ``{}`` launches with the device's launch table (``kernels/configs/<device>.json``,
:mod:`localmoe.kernels.launch_config`; its name is saved with the results as ``launch_table``);
other variants override its choices (``{"block_n": 32, "num_warps": 1}``). A measured winner
goes into the device's table as a rule.

Usage: ``python benchmarks/bench_attention.py [--check] [--out results.json] [--contexts ...]``
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch

from localmoe.kv.codec import FloatCodec
from localmoe.kv.formats import KVFormat
from localmoe.kv.quant_codec import QuantCodec
from localmoe.kv.spec import KVSpec
from localmoe.kernels.decode_attention import decode_attention, decode_attention_ref
from localmoe.kernels.kv_quant_append import kv_quant_append

CEILING_TBS = 4.27
HQ, HKV, D, PAGE = 32, 4, 128, 16
DEV = "cuda"


def make_codec(name, spec, role, max_seqs, rotate=False):
    """Codec of one side; ``int4:c`` keys are per-channel (KIVI, one scale/zero per page)."""
    fmt = KVFormat.parse(name)
    if fmt.is_float:
        return FloatCodec(fmt, HKV, D, spec)
    return QuantCodec(fmt, HKV, D, spec, role=role, max_seqs=max_seqs, rotate=rotate,
                      block_size=PAGE)


def spec_of(fmt):
    """KVSpec of a format argument: ``k/v`` names (``int4:c/int4``, ``int4`` for both) or a
    full spec string with options (``k=int4:c,v=int4,koutliers=0.03125``)."""
    if "=" in fmt:
        return KVSpec.parse(fmt)
    kn, vn = fmt.split("/") if "/" in fmt else (fmt, fmt)
    return KVSpec.parse(k=kn, v=vn)


def write(codec, store, slots, x, pos, row):
    """Quantize-and-append kernel for per-token codecs; the codec's page writer (torch ops) for
    per-channel keys, which quantize whole pages."""
    if isinstance(codec, QuantCodec) and not codec.channel:
        kv_quant_append(codec, store, slots, x, pos, row)
    else:
        codec.write(store, slots, x, pos, row)


def fill(codec, store, slots, chunk=1 << 16, seed=0):
    """Write random K-like data (unit normal plus a few large channels) into every slot."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    n = slots.numel()
    for i in range(0, n, chunk):
        s = slots[i:i + chunk]
        x = torch.randn(s.numel(), HKV, D, device=DEV, generator=g)
        x[:, :, :4] *= 8.0
        pos = torch.arange(i, i + s.numel(), device=DEV)
        write(codec, store, s, x.half(), pos, 0)


def store_bytes(codec, n_tok):
    return codec.bytes_per_token() * n_tok


def time_graph(fns, reps=5, iters=20):
    """Median seconds per call of the list ``fns`` (each a call on a different cache copy),
    captured in one CUDA graph and replayed ``iters`` times, ``reps`` repeats."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(iters):
            g.replay()
        e1.record()
        torch.cuda.synchronize()
        out.append(e0.elapsed_time(e1) / 1e3 / iters / len(fns))
    return statistics.median(out)


def check(verbose=True, lens=(1, 1000, 4133), only=None, qpks=(8, 4), extra=({},)) -> int:
    """GPU correctness: kernels vs twins (``only``: keep cases whose key format contains one of
    these strings; ``extra``: kwargs of decode_attention, each checked). Returns the number of
    failures."""
    fails = 0
    torch.manual_seed(0)
    cases = [("f16", "f16", 0, 0, 0, False), ("int8", "int8", 0, 0, 0, False),
             ("int4", "int4", 0, 0, 0, False), ("int3", "int3", 0.02, 4, 64, False),
             ("int2", "int2", 0.02, 4, 128, False), ("fp4", "fp4", 0, 0, 0, False),
             ("int4", "int2", 0, 4, 0, True), ("int4:g64", "int4:g128", 0.05, 0, 32, True),
             ("int4:c", "int4", 0, 0, 0, False), ("int2:c", "int2", 0.02, 4, 32, False),
             ("int3:c", "int3", 0, 0, 0, False), ("int8:c", "int4", 0, 0, 0, False),
             ("int4:c", "int2", 0, 0, 0, False),
             ("int4:c", "int4", 0, 0, 0, False, 0.03125), ("int2:c", "int2", 0, 4, 0, False, 0.05)]
    if isinstance(only, str):
        only = [only]
    cases = [c for c in cases if not only or any(o in c[0] for o in only)]
    for qpk in qpks:
        for kn, vn, of, sink, win, rot, *kout in cases:
            spec = KVSpec.parse(k=kn, v=vn, outlier_frac=of, sink_tokens=sink, window=win,
                                key_outlier_frac=kout[0] if kout else None)
            B = 3
            kc = make_codec(kn, spec, "k", B, rot)
            vc = make_codec(vn, spec, "v", B)
            lens = torch.tensor(list(lens), dtype=torch.int32)
            nblk = sum(math.ceil(int(x) / PAGE) for x in lens) + 4
            perm = torch.randperm(nblk, device=DEV).int()
            maxb = math.ceil(int(lens.max()) / PAGE)
            bt = torch.zeros(B, maxb, dtype=torch.int32, device=DEV)
            ks, vs = kc.alloc(nblk * PAGE, DEV), vc.alloc(nblk * PAGE, DEV)
            ks2, vs2 = kc.alloc(nblk * PAGE, DEV), vc.alloc(nblk * PAGE, DEV)
            off = 0
            for b in range(B):
                L = int(lens[b]); nb = math.ceil(L / PAGE)
                bt[b, :nb] = perm[off:off + nb]; off += nb
                pos = torch.arange(L, device=DEV)
                slots = bt[b].long()[pos // PAGE] * PAGE + pos % PAGE
                k = torch.randn(L, HKV, D, device=DEV) * 2
                k[:, :, 3] += 15
                v = torch.randn(L, HKV, D, device=DEV)
                for c, st, st2, x in ((kc, ks, ks2, k), (vc, vs, vs2, v)):
                    write(c, st, slots, x, pos, b)
                    c.write(st2, slots, x, pos, b)
            # append kernel vs twin: codes may differ by one step where GPU division rounds
            for name, st, st2, c in (("K", ks, ks2, kc), ("V", vs, vs2, vc)):
                if not isinstance(c, QuantCodec):
                    continue
                for key in st:
                    a, r = st[key], st2[key]
                    if key in ("q", "q_hi"):
                        frac = (a != r).float().mean().item()
                        if frac > 1e-3:
                            fails += 1
                            print(f"FAIL append {kn}/{vn} {name}.{key}: {frac:.2e} bytes differ")
                    elif key in ("scale", "zero", "oval", "oidx", "sink", "ring", "ring_pos"):
                        if not torch.equal(a, r):
                            fails += 1
                            print(f"FAIL append {kn}/{vn} {name}.{key} differs")
            q = torch.randn(B, HKV * qpk, D, device=DEV, dtype=torch.float16)
            for sw, fused, kw in [(sw, f, kw) for kw in extra
                                  for sw, f in ((0, True), (512, True), (0, False))]:
                o = decode_attention(q, kc, ks, vc, vs, bt, lens, page_size=PAGE,
                                     sliding_window=sw, seq_rows=torch.arange(B),
                                     fused_reduce=fused, **kw)
                r = decode_attention_ref(q, kc, ks, vc, vs, bt, lens, page_size=PAGE,
                                         sliding_window=sw, seq_rows=torch.arange(B))
                err = ((o - r).norm() / r.norm()).item()
                ok = err < 1e-2 and torch.isfinite(o).all().item()
                fails += not ok
                if verbose or not ok:
                    print(f"{'ok  ' if ok else 'FAIL'} decode qpk={qpk} {spec} "
                          f"sink={sink} win={win} rot={rot} sw={sw} fused={fused} {kw}: "
                          f"rel err {err:.2e}")
    return fails


def bench(contexts, batches, formats, variants, out, rows=None):
    rows = [] if rows is None else rows
    torch.manual_seed(0)
    for B in batches:
        for ctx in contexts:
            ntok = B * ctx
            # SDPA on contiguous fp16
            kv_bytes_f16 = ntok * HKV * D * 2 * 2
            ncopy = max(1, min(16, math.ceil(512e6 / kv_bytes_f16)))
            sd = []
            for i in range(ncopy):
                kk = torch.randn(B, HKV, ctx, D, device=DEV, dtype=torch.float16)
                vv = torch.randn(B, HKV, ctx, D, device=DEV, dtype=torch.float16)
                qq = torch.randn(B, HQ, 1, D, device=DEV, dtype=torch.float16)
                sd.append((qq, kk, vv))
            fns = [lambda t=t: torch.nn.functional.scaled_dot_product_attention(
                t[0], t[1], t[2], enable_gqa=True) for t in sd]
            t_sdpa = time_graph(fns)
            del sd, fns
            rows.append(dict(batch=B, ctx=ctx, fmt="sdpa-f16", bytes=kv_bytes_f16,
                             us=t_sdpa * 1e6, gbs=kv_bytes_f16 / t_sdpa / 1e9))
            print(f"B={B} ctx={ctx:6d} {'sdpa-f16':22s} {t_sdpa*1e6:8.1f} us "
                  f"{kv_bytes_f16/t_sdpa/1e12:6.2f} TB/s", flush=True)
            for fmt in formats:
                spec = spec_of(fmt)
                # plain names keep their meaning here: "int4" = per-token keys (KVFormat.parse)
                kn, vn = ((str(spec.k), str(spec.v)) if "=" in fmt else
                          (fmt.split("/") if "/" in fmt else (fmt, fmt)))
                kc, vc = make_codec(kn, spec, "k", B), make_codec(vn, spec, "v", B)
                nbytes = (kc.bytes_per_token() + vc.bytes_per_token()) * ntok
                ncopy = max(1, min(16, math.ceil(512e6 / nbytes)))
                nblk = math.ceil(ctx / PAGE) * B
                caches = []
                for i in range(ncopy):
                    ks, vs = kc.alloc(nblk * PAGE, DEV), vc.alloc(nblk * PAGE, DEV)
                    allslots = torch.arange(nblk * PAGE, device=DEV)
                    fill(kc, ks, allslots, seed=i)
                    fill(vc, vs, allslots, seed=100 + i)
                    bt = torch.randperm(nblk, device=DEV, dtype=torch.int32).view(B, -1)
                    lens = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
                    q = torch.randn(B, HQ, D, device=DEV, dtype=torch.float16)
                    caches.append((q, ks, vs, bt, lens))
                for var in variants:
                    fns = [lambda c=c: decode_attention(c[0], kc, c[1], vc, c[2], c[3], c[4],
                                                        page_size=PAGE, max_len=ctx, **var)
                           for c in caches]
                    try:
                        t = time_graph(fns)
                    except Exception as e:  # report and continue
                        print(f"  {fmt} {var}: failed: {e}", file=sys.stderr)
                        continue
                    rows.append(dict(batch=B, ctx=ctx, fmt=fmt, variant=var, bytes=nbytes,
                                     us=t * 1e6, gbs=nbytes / t / 1e9, vs_sdpa=t_sdpa / t))
                    print(f"B={B} ctx={ctx:6d} {fmt:10s} {str(var):28s} {t*1e6:8.1f} us "
                          f"{nbytes/t/1e12:6.2f} TB/s ({nbytes/t/1e12/CEILING_TBS*100:5.1f}% of "
                          f"ceiling) {t_sdpa/t:5.2f}x sdpa", flush=True)
                del caches
                torch.cuda.empty_cache()
    best = {}
    for r in rows:
        k = (r["batch"], r["ctx"], r["fmt"])
        if k not in best or r["us"] < best[k]["us"]:
            best[k] = r
    print("best per config:")
    for (b, c, f), r in best.items():
        print(f"  B={b} ctx={c:6d} {f:12s} {r['us']:8.1f} us {r['gbs']/1e3:5.2f} TB/s "
              f"({r['gbs']/1e3/CEILING_TBS*100:5.1f}%) {r.get('vs_sdpa', 1.0):5.2f}x sdpa "
              f"{r.get('variant', '')}")
    if out:
        save(out, rows)
    return rows


def save(out, rows):
    """Write ``rows`` with the run metadata (device, versions, command, commit) to ``out``."""
    if out:
        import subprocess
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                    text=True).stdout.strip()
        except OSError:
            commit = ""
        from localmoe.kernels.launch_config import table_for

        with open(out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           launch_table=table_for(torch.device(DEV)).name,
                           triton=__import__("triton").__version__, argv=sys.argv, commit=commit,
                           shape=dict(n_heads=HQ, n_kv_heads=HKV, head_dim=D, page=PAGE),
                           ceiling_tbs=CEILING_TBS, rows=rows), f, indent=1)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--check-qpk", type=int, nargs="*", default=[8, 4])
    ap.add_argument("--contexts", type=int, nargs="*", default=[4096, 16384, 65536])
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--formats", nargs="*",
                    default=["f16", "int8", "int4", "int3", "int2", "fp4", "int4/int2",
                             "int4:c/int4", "int2:c/int2", "int4:c/int2"])
    ap.add_argument("--variants", default='[{}]', help="JSON list of kwargs for decode_attention")
    ap.add_argument("--out", default=None)
    ap.add_argument("--check-formats", nargs="*", default=None,
                    help="check only cases whose key format contains one of these")
    ap.add_argument("--check-variants", default='[{}]',
                    help="JSON list of decode_attention kwargs the check runs each case with")
    ap.add_argument("--jobs", default=None,
                    help="JSON list of {batches, contexts, formats, variants} run in turn in "
                         "this process instead of the single grid; --out is rewritten after "
                         "each job")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    if a.check:
        t = time.time()
        n = check(verbose=False, qpks=tuple(a.check_qpk), only=a.check_formats,
                  extra=tuple(json.loads(a.check_variants)))
        print(f"check: {n} failures ({time.time()-t:.0f} s)", flush=True)
        if n:
            return 1
    if a.jobs is not None:
        rows = []
        for job in json.loads(a.jobs):
            bench(job.get("contexts", a.contexts), job.get("batches", a.batches),
                  job.get("formats", a.formats), job.get("variants", [{}]), None, rows)
            save(a.out, rows)
        return 0
    bench(a.contexts, a.batches, a.formats, json.loads(a.variants), a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
