"""Static SASS statistics of the decode-attention kernel for the H200 (sm_90), no GPU needed.

Compiles ``_decode_split_kernel`` for a format with Triton's own ptxas and reports registers,
spills (stack frame), shared memory and instruction counts of the hottest loop (the largest
backward-branch body), divided by the K+V elements one tile covers. The decode kernel is bound
by per-element instruction issue, so instructions per element predict its speed ranking
before any device time is spent.

Usage: ``python benchmarks/sass_stats.py int4 int2 fp4 int4/int2 --block-n 128 --warps 8``
(formats as ``int2c/int2`` for per-channel int2 keys; ``--swap`` and ``--stages 2`` as the
H200 table launches 2/3-bit values).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import types

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from localmoe.kernels import decode_attention as da

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_variant(kfmt, vfmt, block_n=128, warps=8, stages=2, d=128, qpk=8, extra=None,
                    swap=False, fuse=False):
    fn = da._decode_split_kernel
    names = fn.arg_names
    const = dict(HKV=4, QPK=qpk, QPK_P=qpk, BLOCK_H=max(8 if swap else 16, qpk), D=d, DV=d,
                 PAGE=16, BLOCK_N=block_n, SWAP=swap,
                 N_SINK=0, N_RING=0, ROT=False, IDX64=False, HAS_ROWS=False, FUSE=fuse,
                 SPLITS_P=64, MERGE_C=8, PDL=False, SINGLE=False, QUANT=False,
                 V_JOIN=False, ASM=True,
                 K_NARROW=(kfmt[0] == 1 and kfmt[1] in (2, 3) and d < 64))
    for side, f in (("K", kfmt), ("V", vfmt)):
        fmt, bits, g, ch = f
        const.update({f"{side}_FMT": fmt, f"{side}_BITS": bits, f"{side}_G": g,
                      f"{side}_NOUT": 0, f"{side}_SIDE": False})
        const[f"{side}_CHAN"] = ch
        const[f"{side}_NSINK"] = 0
        const[f"{side}_NRING"] = 16 if ch else 0
        const[f"{side}_SIDE"] = bool(ch)
    const["K_NOP"] = 1
    def codec(f):  # what da.default_sz_pre reads of a codec
        return types.SimpleNamespace(bits=f[1], channel=f[3], is_fp4=f[0] == 2)

    sides = da.default_sz_pre(codec(kfmt), codec(vfmt), batch=8, n_kv_heads=4)
    const["K_PRE"], const["V_PRE"] = "k" in sides, "v" in sides
    const.update(extra or {})
    sig = {}
    for n in names:
        if n in const:
            sig[n] = "constexpr"
        elif n[0].isupper():
            fp4 = (kfmt if n[0] == "K" else vfmt)[0] == 2
            if n in ("MidO", "MidL", "Out"):
                sig[n] = "*fp32"
            elif n == "Qq":
                sig[n] = "*i8"
            elif n in ("BlockTable", "SeqLens", "SeqRows", "Kpos", "Vpos"):
                sig[n] = "*i32"
            elif n in ("Kq", "Kqh", "Vq", "Vqh", "Koi", "Voi") or (n in ("Ks", "Vs") and fp4):
                sig[n] = "*u8"
            elif n == "Locks":
                sig[n] = "*i32"
            else:
                sig[n] = "*fp16"
        elif n == "qk_scale":
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    # what the JIT's specialization sees at run time: 16-byte aligned pointers, sizes and
    # strides that are multiples of 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n] != "constexpr" and n not in ("qk_scale", "n_splits", "sliding_window")}
    src = ASTSource(fn, signature=sig, constexprs={k: v for k, v in const.items() if k in names},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})


def sass_of(c):
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(c.asm["cubin"])
        path = f.name
    sass = subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", path], capture_output=True,
                          text=True).stdout
    res = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", path],
                         capture_output=True, text=True).stdout
    os.unlink(path)
    return sass, res


def loop_body(sass):
    """``(op, args)`` of the largest loop of ``sass`` (label .. backward BRA to it; loops
    with atomics, a split kernel's epilogue, left out), and the kernel's instruction count."""
    lines = [l for l in sass.splitlines()]
    labels, instrs = {}, []
    for l in lines:
        m = re.match(r"^(\.L_\w+):", l.strip())
        if m:
            labels[m.group(1)] = len(instrs)
            continue
        m = re.search(r"/\*[0-9a-f]{4}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);", l)
        if m:
            instrs.append((m.group(2), m.group(3)))
    best = (0, 0)
    for i, (op, args) in enumerate(instrs):
        if op.startswith("BRA"):
            mt = re.search(r"\.L_\w+", args)
            t = mt.group(0) if mt else None
            if t in labels and labels[t] < i and i - labels[t] > best[1] - best[0] \
                    and not any(o.startswith("ATOM") or o.startswith("RED") for o, _ in instrs[labels[t]:i]):
                best = (labels[t], i)
    return instrs[best[0]:best[1] + 1], len(instrs)


def loop_stats(sass):
    """Opcode histogram of the largest loop (:func:`loop_body`)."""
    body, total = loop_body(sass)
    hist = collections.Counter(op.split(".")[0] for op, _ in body)
    return len(body), hist, total


def parse_fmt(s):
    # name -> (FMT, BITS, G, CHAN)
    ch = s.endswith("c")
    s = s.rstrip("c")
    if s == "f16":
        return (0, 16, 1, False)
    if s == "fp4":
        return (2, 4, 16, False)
    b, _, g = s.partition(":g")
    return (1, int(b[3:]), int(g or 32), ch)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("formats", nargs="+")
    ap.add_argument("--block-n", type=int, nargs="*", default=[128])
    ap.add_argument("--warps", type=int, nargs="*", default=[8])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--hist", action="store_true")
    ap.add_argument("--swap", action="store_true",
                    help="products transposed (decode_attention(swap_ab=True))")
    ap.add_argument("--fuse", action="store_true",
                    help="the split-K merge in the same launch (fused_reduce=True; off in the "
                         "H200 table, whose separate reduction kernel keeps the split "
                         "kernel's registers down: int2:c/int2 at 32-token one-warp tiles 176 "
                         "registers without, 255 and a spill stack with)")
    ap.add_argument("--join", action="store_true",
                    help="2/3-bit value planes joined into one full-width dot (v_join=True; the "
                         "tables' choice before session 34; without it one dot per plane, as they now "
                         "choose)")
    ap.add_argument("--kout", type=int, default=0,
                    help="outliers per token of per-channel keys (K_NOUT)")
    a = ap.parse_args(argv)
    for f in a.formats:
        kf, vf = (f.split("/") + [None])[:2]
        vf = vf or kf.rstrip("c")
        for bn in a.block_n:
            for w in a.warps:
                extra = {}
                if a.kout:
                    extra.update(K_NOUT=a.kout, K_NOP=triton.next_power_of_2(a.kout))
                if a.join:
                    pv = parse_fmt(vf)
                    extra["V_JOIN"] = pv[0] == 1 and pv[1] in (2, 3)
                c = compile_variant(parse_fmt(kf), parse_fmt(vf), bn, w, a.stages, extra=extra,
                                    swap=a.swap, fuse=a.fuse)
                sass, res = sass_of(c)
                n, hist, tot = loop_stats(sass)
                m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", res)
                per_el = n * w * 32 / (bn * 128 * 2)
                print(f"{f:14s} bn={bn:3d} w={w} regs={m.group(1)} stack={m.group(2)} "
                      f"smem={c.metadata.shared} loop={n} instr ({per_el:.2f} thread-instr/elem) total={tot}")
                if a.hist:
                    print("   ", " ".join(f"{k}:{v}" for k, v in hist.most_common(30)))


if __name__ == "__main__":
    sys.exit(main())
