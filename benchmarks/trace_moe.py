"""Where the fused MoE's two launches spend their time, program by program (GPU only).

Runs the decode MoE (``fused_moe`` from router logits, as the decode step launches it; Q4_K
experts of a preset's shapes, routings rotating over disjoint experts so the weights come from
DRAM) as one CUDA graph of calls, with every program of both launches writing time stamps
(:mod:`localmoe.kernels.trace`): entry, after PDL's wait, after routing (gate/up) or the
expert ids (down), after the K loop, at exit, and for split-K gate/up the last part's combine.
The same calls are timed without the stamps (the stamps' own cost is the difference).
Prints and writes (``--out``) one summary per variant: medians over the calls of each launch's
span (first entry to last exit), the gap to the next launch, the programs' start skew and the
median / slowest program's phases, on ``%globaltimer`` (ns) and ``%clock64`` (cycles).

Usage (on the GPU machine)::

    python benchmarks/trace_moe.py --tokens 1 --out trace.json \\
        [--variant NAME='{"gate_up": {"split": 1}}'] [--variant @alloc={}] [--no-route]
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys

import torch

#: the stamps of a gate/up record / a down record (localmoe.kernels.trace)
GATE_UP_PHASES = ("entry", "waited", "routed", "loop", "exit", "combined")
DOWN_PHASES = ("entry", "waited", "ids", "loop", "exit")


def _median(v):
    return statistics.median(v) if v else None


def launch_summary(rec: torch.Tensor, phases: tuple[str, ...], origin: int) -> dict:
    """Summary of one traced launch: ``rec`` int64 ``[programs, 16]`` records
    (``localmoe.kernels.trace``: stamp ``i`` at ``2i`` (globaltimer ns) and ``2i+1``
    (clock64), the SM at 12), ``phases`` the stamps' names, ``origin`` the
    time (ns) the offsets are taken from. A stamp a program did not write (0) is left out.
    Returns first/last entry and last exit (ns from ``origin``), the median and the slowest
    program's duration of each phase (ns, and cycles from clock64), and the SMs used."""
    g = rec[:, 0::2][:, :len(phases)].tolist()
    c = rec[:, 1::2][:, :len(phases)].tolist()
    entries = [r[0] for r in g if r[0]]
    ends = [max(v for v in r if v) for r in g if any(r)]
    if not entries:
        raise ValueError("launch_summary: no program wrote its entry stamp")
    out = {"programs": len(g), "first_entry_ns": min(entries) - origin,
           "last_entry_ns": max(entries) - origin, "last_exit_ns": max(ends) - origin,
           "sms": len(set(rec[:, 12].tolist()))}
    slow = max(range(len(g)), key=lambda i: max(g[i]))
    out["slowest_program_ns"] = {"entry": g[slow][0] - origin}
    for i in range(1, len(phases)):
        dn = [r[i] - r[i - 1] for r in g if r[i] and r[i - 1]]
        dc = [r[i] - r[i - 1] for r in c if r[i] and r[i - 1]]
        name = f"{phases[i - 1]}->{phases[i]}"
        out[f"median_ns {name}"] = _median(dn)
        out[f"median_cycles {name}"] = _median(dc)
        if g[slow][i] and g[slow][i - 1]:
            out["slowest_program_ns"][name] = g[slow][i] - g[slow][i - 1]
    return out


def call_summaries(records: list[tuple[torch.Tensor, torch.Tensor]]) -> list[dict]:
    """Per call of one replay (``records``: the (gate/up, down) record buffers of the calls in
    launch order): both launches' :func:`launch_summary` with offsets from the call's first
    gate/up entry, the gap between the launches (down's first entry minus gate/up's last exit;
    negative: overlapped through PDL) and to the next call's gate/up."""
    out = []
    for i, (gu, dn) in enumerate(records):
        origin = int(gu[gu[:, 0] > 0, 0].min())
        s_gu = launch_summary(gu, GATE_UP_PHASES, origin)
        s_dn = launch_summary(dn, DOWN_PHASES, origin)
        s = {"gate_up": s_gu, "down": s_dn, "span_ns": s_dn["last_exit_ns"],
             "gap_gate_up_down_ns": s_dn["first_entry_ns"] - s_gu["last_exit_ns"]}
        if i + 1 < len(records):
            nxt = records[i + 1][0]
            s["gap_down_next_ns"] = int(nxt[nxt[:, 0] > 0, 0].min()) - origin - s_dn["last_exit_ns"]
        out.append(s)
    return out


def aggregate(calls: list[dict]) -> dict:
    """Medians over calls of every number in :func:`call_summaries`' dicts (nested keys
    joined with '/')."""
    flat: dict[str, list] = {}

    def walk(d, pre):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{pre}{k}/")
            elif isinstance(v, (int, float)):
                flat.setdefault(pre + k, []).append(v)
    for c in calls:
        walk(c, "")
    return {k: _median(v) for k, v in flat.items()}


def timer_step(records) -> int | None:
    """The smallest positive difference between globaltimer stamps seen (ns): the timer's
    resolution as this GPU updates it."""
    vals = sorted({int(v) for gu, dn in records for r in (gu, dn) for v in r[:, 0::2][:, :6].flatten().tolist() if v})
    diffs = [b - a for a, b in zip(vals, vals[1:]) if b > a]
    return min(diffs) if diffs else None


_WEIGHTS: dict = {}


def run_variant(m, tokens, cfg, route, reps=20):
    """(untraced us per call, traced us per call, per-call summaries, timer step)."""
    import bench_quant_kernels as B
    from localmoe.kernels.fused_moe import fused_moe, moe_programs
    from localmoe.kernels.quant_gemv import quantize_act
    from localmoe.kernels.trace import trace_buffer

    dev = "cuda"
    key = tuple(sorted(m.items()))
    if key not in _WEIGHTS:         # built once per model: every variant reads the same experts
        _WEIGHTS.clear()
        _WEIGHTS[key] = B.moe_weights(m, dev)[:2]
    gu, wd = _WEIGHTS[key]
    gen = torch.Generator().manual_seed(0)
    rts = B.moe_routings(m, tokens, gu, wd, dev, gen)
    x = quantize_act(torch.randn(tokens, m["d"], generator=gen).to(dev, torch.bfloat16))
    cfg = cfg or {}
    pg = moe_programs("gate_up", gu, tokens, m["k"], cfg.get("gate_up"))
    pd = moe_programs("down", wd, tokens, m["k"], cfg.get("down"))
    bufs = [(trace_buffer(pg, dev), trace_buffer(pd, dev)) for _ in rts]
    if route:
        rls = [B._routing_of(i, m["e"]) for i, _ in rts]
        plain = [lambda r=r: fused_moe(x, gu, wd, None, None, config=cfg, route=r) for r in rls]
        traced = [lambda r=r, b=b: fused_moe(x, gu, wd, None, None, config=cfg, route=r, trace=b)
                  for r, b in zip(rls, bufs)]
    else:
        plain = [lambda i=i, w=w: fused_moe(x, gu, wd, i, w, config=cfg) for i, w in rts]
        traced = [lambda i=i, w=w, b=b: fused_moe(x, gu, wd, i, w, config=cfg, trace=b)
                  for (i, w), b in zip(rts, bufs)]
    us_plain = B.time_calls(plain, reps)
    us_traced = B.time_calls(traced, reps)     # the buffers hold the last replay's stamps
    torch.cuda.synchronize()
    records = [(a.cpu(), b.cpu()) for a, b in bufs]
    return us_plain, us_traced, call_summaries(records), timer_step(records)


#: steps a ``--variant`` name may ask for between variants instead of a launch choice (the
#: JSON is ignored): ``@alloc`` keeps 16 more 600 KB device buffers alive, ``@empty_cache``
#: frees the allocator's cached blocks (session 30: every variant after a process's first
#: showed 0.35 us longer launch gaps; do allocations or new kernels cause it?), ``@sleep`` idles
#: the GPU for 5 s (a compile's idle time before a process's first variant), ``@gc`` drops
#: the collected graphs' memory
ACTIONS = {
    "@sleep": lambda kept: __import__("time").sleep(5.0),
    "@gc": lambda kept: (__import__("gc").collect(), torch.cuda.synchronize(), torch.cuda.empty_cache()),
    "@alloc": lambda kept: kept.extend(torch.empty(600 * 1024, dtype=torch.uint8, device="cuda")
                                       for _ in range(16)),
    "@empty_cache": lambda kept: torch.cuda.empty_cache(),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", nargs="*", type=int, default=[1])
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                    help="launch choices, as fused_moe's config ({'gate_up': {...}, 'down': {...}})")
    ap.add_argument("--no-route", action="store_true", help="ids given (no routing in gate/up)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("trace_moe: needs a CUDA GPU (the stamps are PTX)", file=sys.stderr)
        return 2
    import bench_quant_kernels as B
    from graph_history import clocks     # nvidia-smi's clocks, power, throttle reasons

    m = B.MODELS[a.model]
    variants = [("table", None)] + [(v.split("=", 1)[0], json.loads(v.split("=", 1)[1])) for v in a.variant]
    res = {"machine": platform.node(), "gpu": torch.cuda.get_device_name(0),
           "date": datetime.date.today().isoformat(), "model": a.model,
           "command": "python benchmarks/trace_moe.py " + " ".join(argv or sys.argv[1:]),
           "rows": []}
    kept = []
    for t in a.tokens:
        for name, cfg in variants:
            act = name.rstrip("0123456789")      # "@sleep2": a second step of that kind
            if act in ACTIONS:       # a step between variants (the launch gaps' state)
                ACTIONS[act](kept)
                print(f"== {name}")
                res["rows"].append({"action": name, "tokens": t})
                continue
            us_p, us_t, calls, step = run_variant(m, t, cfg, not a.no_route)
            agg = aggregate(calls)
            row = {"clocks": clocks(), "variant": name, "config": cfg, "tokens": t, "route": not a.no_route,
                   "us_per_call": round(us_p, 2), "us_per_call_traced": round(us_t, 2),
                   "globaltimer_step_ns": step, "median": agg, "calls": calls}
            res["rows"].append(row)
            print(f"== {name} T={t}: {us_p:.2f} us per call ({us_t:.2f} traced), timer step {step} ns"
                  f" [{row['clocks']}]")
            for k, v in agg.items():
                if "slowest" not in k or "exit" in k:
                    print(f"   {k:52s} {v}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
    raise SystemExit(main())
