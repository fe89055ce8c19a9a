"""Static SASS statistics of the quantized decode kernels for the H200 (sm_90), no GPU needed.

Compiles the fused-MoE gate/up or down launch, or the quantized GEMV, for one GGUF type and
one launch choice (the fields of the ``moe_gate_up`` / ``moe_down`` / ``gemv`` knobs of
``kernels/configs``) with the installed Triton and its ptxas, and prints registers, spill
stack, shared memory, and the memory instructions of the K loop (the largest backward-branch
body, :func:`sass_stats.loop_stats`): global loads (``LDG``), asynchronous copies
(``LDGSTS``, a pipelined loop), shared-memory traffic and barriers (``BAR``: layout
conversions through shared memory), and the loop's global loads issued after its first
barrier (``late_loads``: each waits for the data exchanged there, one more round trip per
tile; session 21 moved every load of a tile ahead of the arithmetic to make it 0). A screen
before device time, not a timing: session 19
found neither fewer barriers nor fewer loads per byte faster at one token
(``benchmarks/results/quant_layout_trial_h200-2026-12-04-s19.json``,
``gate_up_candidates_h200-2026-12-04-s19.json``). Use the GPU machine's Triton version (its
layout choices differ from other versions').

Usage::

    python benchmarks/sass_quant.py gate_up --qtype Q4_K \\
        --config '{"BN": 32, "CH": 16, "num_warps": 4, "split": 2, "stages": 3}'
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from localmoe.kernels import fused_moe as fm
from localmoe.kernels import quant_gemv as qg
from localmoe.kernels.qtensor import chunk_values, qtype_id

import sass_stats as ss

# plane pointer types per ggml type (qtensor's planes): d, sc, qh; everything else int32 or f16
_D = {12: "*i32", 13: "*i32"}
_SC = {12: "*i16", 13: "*i16", 10: "*u8"}
_QH = {11: "*i16"}


def _signature(fn, const: dict, qtype: int) -> dict:
    sig = {}
    for n in fn.arg_names:
        if n in const:
            sig[n] = "constexpr"
        elif n.endswith("_ptr"):
            sig[n] = {"xs_ptr": "*fp32", "hs_ptr": "*fp32", "p_ptr": "*fp32", "wts_ptr": "*fp32",
                      "out_ptr": "*fp16", "y_ptr": "*fp16", "dm_ptr": "*fp16",
                      "mn_ptr": "*fp16", "tr_ptr": "*i64", "lg_ptr": "*fp32",
                      "rb_ptr": "*fp32", "rw_ptr": "*fp32", "d_ptr": _D.get(qtype, "*fp16"),
                      "sc_ptr": _SC.get(qtype, "*i8"),
                      "qh_ptr": _QH.get(qtype, "*i32")}.get(n, "*i32")
        else:
            sig[n] = "fp32" if n == "rscale" else "i32"
    return sig


def compile_quant(kind: str, qtype: int, cfg: dict, top_k: int = 8, extra: dict | None = None):
    """The compiled kernel of ``kind`` (``gate_up``, ``down`` or ``gemv``) for ggml type
    ``qtype`` and launch choice ``cfg`` (BN, CH, num_warps, xb, stages, and split /
    experts_tile, lookahead), at one token, every tile in bounds; ``extra``: more constexprs (e.g.
    ``{"TRACE": True}``)."""
    cv = chunk_values(qtype)
    common = dict(QTYPE=qtype, CV=cv, BN=cfg["BN"], CH=cfg["CH"], EVEN=True,
                  XB=bool(cfg.get("xb", False)), USE_ASM=True, PDL=0, WIDE=False,
                  STAGES=int(cfg.get("stages", 1)), LOOKAHEAD=bool(cfg.get("lookahead", False)))
    if kind == "gate_up":
        fn = fm._moe_gate_up_kernel
        const = dict(common, TOP_K=top_k, ACT=0, SPLIT=int(cfg.get("split", 1)))
    elif kind == "down":
        fn = fm._moe_down_kernel
        et = bool(cfg.get("experts_tile", False))
        const = dict(common, TOP_K=top_k, ET=et, TKP=triton.next_power_of_2(top_k) if et else 1)
    elif kind == "gemv":
        fn = qg._quant_gemv_kernel
        const = dict(common, TP=1, ATOMIC=False, PREFETCH=False, LINE=32)
    else:
        raise ValueError(f"kind must be gate_up, down or gemv, not {kind!r}")
    const.update(extra or {})
    for prm in fn.params:   # constexprs left at their defaults (e.g. gate/up's routing: off)
        if prm.is_constexpr and prm.name not in const and prm.has_default:
            const[prm.name] = prm.default
    sig = _signature(fn, const, qtype)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n] != "constexpr" and n not in ("F", "D", "N", "T")}
    src = ASTSource(fn, signature=sig, constexprs={k: v for k, v in const.items()
                                                   if k in fn.arg_names}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": int(cfg.get("num_warps", 4)), "num_stages": 3,
                                   **({"maxnreg": int(cfg["maxnreg"])} if cfg.get("maxnreg") else {})})


def memory_ops(sass: str) -> collections.Counter:
    """Loads, copies, shared-memory traffic and barriers in the K loop of ``sass``."""
    n, hist, _ = ss.loop_stats(sass)
    keep = ("LDG", "LDGSTS", "LDS", "STS", "LDSM", "STSM", "BAR", "LDGDEPBAR")
    return collections.Counter({k: v for k, v in hist.items() if k in keep})


def late_loads(sass: str) -> int:
    """Global loads of the K loop of ``sass`` that come after the loop's first barrier."""
    body = [op.split(".")[0] for op, _ in ss.loop_body(sass)[0]]
    first_bar = body.index("BAR") if "BAR" in body else len(body)
    return body[first_bar:].count("LDG")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kind", choices=["gate_up", "down", "gemv"])
    ap.add_argument("--qtype", default="Q4_K")
    ap.add_argument("--config", action="append", required=True,
                    help="a launch choice as JSON (repeat to compare)")
    ap.add_argument("--json", action="store_true", help="one JSON object per launch choice")
    a = ap.parse_args(argv)
    qt = qtype_id(a.qtype)
    for text in a.config:
        cfg = json.loads(text)
        c = compile_quant(a.kind, qt, cfg)
        sass, res = ss.sass_of(c)
        n, _, total = ss.loop_stats(sass)
        m = re.search(r"REG:(\d+) STACK:(\d+)", res)
        mem = memory_ops(sass)
        if a.json:
            print(json.dumps({"config": cfg, "regs": int(m.group(1)), "stack": int(m.group(2)),
                              "smem": c.metadata.shared, "loop": n, "ops": dict(mem),
                              "late_loads": late_loads(sass)}))
            continue
        ops = " ".join(f"{k}:{v}" for k, v in sorted(mem.items()))
        print(f"{a.kind} {a.qtype} {json.dumps(cfg)}: regs={m.group(1)} stack={m.group(2)} "
              f"smem={c.metadata.shared} loop={n} instr (total {total}) {ops} "
              f"late_loads={late_loads(sass)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
