"""Launch choices of the quantized GEMV, the fused MoE and the router, read from
``kernels/configs/*.json`` (:mod:`localmoe.kernels.launch_config`), are the choices the kernels
made when they were code; the tuning script's rules and file writing (with a fake timer).

RECORDED expectations: :data:`OLD_GEMV`, :data:`OLD_MOE` and :data:`OLD_ROUTER` were generated
once, before the choices moved into data (after commit bfdb399), from ``gemv_config`` of
kernels/quant_gemv.py (its ``GEMV_CONFIG`` dict: per token bucket 1/2/4/8, a large-N override
at N >= 32768, split over K up to 8 ways until 264 programs), ``MOE_CONFIG`` of
kernels/fused_moe.py and the router's ``num_warps=1 if e <= 128 else 4``, over the grid below;
the same choices held on the H200, on any other GPU and on the CPU (the interpreter), since
the code knew no device. They are recorded, not derived: do not regenerate them from the new
lookup.

GEMV grid: each key is "QTYPE K"; each value holds one group per N of :data:`NS` of 8 letters,
one per token count 1..8, each letter a (BN, CH, num_warps, xb, split) of :data:`GEMV_CHOICES`.
"""

import importlib.util
import itertools
import json
import os
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from localmoe.errors import LocalMoEError  # noqa: E402
from localmoe.kernels import launch_config as lc  # noqa: E402
from localmoe.kernels.fused_moe import moe_config  # noqa: E402
from localmoe.kernels.qtensor import QTYPE_NAMES, QUANT_QTYPES  # noqa: E402
from localmoe.kernels.quant_gemv import gemv_config  # noqa: E402
from localmoe.kernels.router import router_config  # noqa: E402

NS = [32, 64, 768, 2048, 5120, 32767, 32768, 151936]
GEMV_CHOICES = {
    "A": (2, 8, 2, False, 1), "B": (1, 8, 1, False, 1), "D": (2, 16, 2, False, 1),
    "E": (1, 16, 1, False, 1), "G": (2, 64, 2, False, 1), "H": (1, 32, 1, False, 2),
    "I": (1, 32, 1, False, 1), "K": (2, 64, 2, False, 2), "L": (1, 32, 1, False, 4),
    "M": (2, 64, 2, False, 4), "N": (1, 32, 1, False, 8), "O": (2, 4, 2, False, 1),
    "P": (1, 4, 1, False, 1), "R": (2, 32, 2, False, 1),
    # output heads (N >= 32768), since session 20: four rows of 4 warps at one token, x per
    # thread; one row per warp above (before: four rows, x once per row, at every count)
    "T": (4, 8, 4, False, 1), "U": (4, 16, 4, False, 1), "V": (4, 64, 4, False, 1),
    "W": (1, 64, 1, False, 1), "X": (4, 4, 4, False, 1), "Y": (4, 32, 4, False, 1),
}
_LEGACY = {  # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q4_K, Q5_K, Q6_K (32-value chunks)
    256: "AABBBBBB AABBBBBB AABBBBBB AABBBBBB AABBBBBB AABBBBBB TBBBBBBB TBBBBBBB",
    512: "DDEEEEEE DDEEEEEE DDEEEEEE DDEEEEEE DDEEEEEE DDEEEEEE UEEEEEEE UEEEEEEE",
    2048: "GGHHHHHH GGHHHHHH GGIIIIII GGIIIIII GGIIIIII GGIIIIII VWWWWWWW VWWWWWWW",
    4096: "KKLLLLLL KKLLLLLL GGIIIIII GGIIIIII GGIIIIII GGIIIIII VWWWWWWW VWWWWWWW",
    14336: "MMNNNNNN MMNNNNNN GGIIIIII GGIIIIII GGIIIIII GGIIIIII VWWWWWWW VWWWWWWW",
}
_K64 = {  # Q2_K, Q3_K (64-value chunks)
    256: "OOPPPPPP OOPPPPPP OOPPPPPP OOPPPPPP OOPPPPPP OOPPPPPP XPPPPPPP XPPPPPPP",
    512: "AABBBBBB AABBBBBB AABBBBBB AABBBBBB AABBBBBB AABBBBBB TBBBBBBB TBBBBBBB",
    2048: "RRIIIIII RRIIIIII RRIIIIII RRIIIIII RRIIIIII RRIIIIII YIIIIIII YIIIIIII",
    4096: "GGHHHHHH GGHHHHHH GGIIIIII GGIIIIII GGIIIIII GGIIIIII VWWWWWWW VWWWWWWW",
    14336: "KKLLLLLL KKLLLLLL GGIIIIII GGIIIIII GGIIIIII GGIIIIII VWWWWWWW VWWWWWWW",
}
# (IQ4_NL / IQ4_XS came after the old table; their 32-value chunks take the legacy choices)
OLD_GEMV = {f"{q} {k}": (_K64 if q in ("Q2_K", "Q3_K") else _LEGACY)[k]
            for q in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                      "IQ4_NL", "IQ4_XS")
            for k in _LEGACY}
OLD_MOE = {"gate_up": {"BN": 32, "CH": 16, "num_warps": 8, "xb": True, "split": 1},
           "down": {"BN": 1, "CH": 32, "num_warps": 1, "xb": False, "stages": 1}}   # xb: absent meant False
OLD_ROUTER = {2: 1, 8: 1, 60: 1, 64: 1, 128: 1, 129: 4, 160: 4, 256: 4, 512: 4}

# the GPU tables; cpu.json (the interpreter's) keeps the router but takes 64-row GEMV / MoE tiles
TABLES = ["nvidia_h200", "default", "nvidia_a100_sxm4_80gb"]
DEVICES = [None] + (["cuda"] if CUDA else [])
INTERPRETER_TILE = {"BN": 64, "CH": 8, "num_warps": 4, "xb": False, "stages": 1}


def test_the_recorded_gemv_grid_covers_every_qtype():
    assert {k.split()[0] for k in OLD_GEMV} == {QTYPE_NAMES[q] for q in QUANT_QTYPES}


@pytest.mark.parametrize("table", TABLES)
def test_gemv_tables_give_the_old_choices(table, monkeypatch):
    """Every table (the H200's, the default for other GPUs, the CPU's) over the whole grid
    gives the recorded choices:
    qtypes x K x N (small, around and past 32768) x tokens 1..8."""
    t = lc.load_table(table)
    monkeypatch.setattr("localmoe.kernels.quant_gemv.device_table", lambda device: t)
    for key, groups in OLD_GEMV.items():
        qname, k = key.split()
        qt = next(q for q in QUANT_QTYPES if QTYPE_NAMES[q] == qname)
        for (n, group), tokens in itertools.product(zip(NS, groups.split()), range(1, 9)):
            c = gemv_config(n, int(k), tokens, qt)
            got = (c["BN"], c["CH"], c["num_warps"], c["xb"], c["split"])
            assert got == GEMV_CHOICES[group[tokens - 1]], (table, key, n, tokens)


@pytest.mark.parametrize("device", DEVICES)
def test_gemv_config_by_device(device):
    """The lookup through the device's file (None: default.json) on a few shapes."""
    assert gemv_config(151936, 2048, 1, 14, device=device)["split"] == 1
    assert gemv_config(5120, 2048, 1, 8, device=device) == dict(
        BN=2, CH=64, num_warps=2, xb=False, stages=1, split=1)
    assert gemv_config(64, 8192, 8, 8, device=device)["split"] == 8


@pytest.mark.parametrize("table", TABLES)
def test_moe_and_router_tables_give_the_old_choices(table):
    t = lc.load_table(table)
    for tokens, top_k, e, (d, f), qt in itertools.product(
            range(1, 9), [1, 2, 8], [8, 64, 128, 256], [(2048, 768), (4096, 14336), (256, 32)],
            ["Q4_K", "Q8_0", "Q2_K", "Q6_K"]):
        # gate/up was re-tuned since (the test below); down at one token of narrow experts
        # too (test_down_takes_the_experts_tile_for_one_token_of_narrow_experts)
        if tokens == 1 and f <= 1024:
            continue
        got = t.lookup("moe_down", tokens=tokens, top_k=top_k, n_experts=e,
                       d_model=d, d_ff=f, qtype=qt)
        assert got == dict(OLD_MOE["down"], experts_tile=False, maxnreg=0), (
            table, tokens, top_k, e, d, f, qt)
    for (e, warps), tokens, top_k in itertools.product(OLD_ROUTER.items(), range(1, 9), [1, 8]):
        assert t.lookup("router", tokens=tokens, n_experts=e, top_k=top_k) == {"num_warps": warps}


def test_cpu_table_takes_interpreter_tiles_and_keeps_the_router():
    """Tensors on the CPU (the interpreter): 64-row programs for the quantized GEMV and fused
    MoE at every shape, the router as on the GPU, and at one token the MoE's look-ahead K
    loops (the GPU's one-token path)."""
    t = lc.load_table("cpu")
    for tokens, n, qt in itertools.product([1, 3, 8], [13, 5120, 151936], ["Q8_0", "Q6_K"]):
        assert t.lookup("gemv", tokens=tokens, n=n, k=2048, qtype=qt) == INTERPRETER_TILE
    assert moe_config("gate_up", 1, 8, 128, 2048, 768, 12, "cpu") == dict(
        INTERPRETER_TILE, split=1, maxnreg=0, lookahead=True)
    assert moe_config("gate_up", 2, 8, 128, 2048, 768, 12, "cpu") == dict(
        INTERPRETER_TILE, split=1, maxnreg=0)
    assert moe_config("down", 1, 8, 128, 2048, 768, 12, "cpu") == dict(
        INTERPRETER_TILE, experts_tile=True, maxnreg=0, lookahead=True)
    assert moe_config("down", 2, 8, 128, 2048, 768, 12, "cpu") == dict(
        INTERPRETER_TILE, experts_tile=False, maxnreg=0)
    assert gemv_config(5120, 2048, 1, 8, device="cpu")["BN"] == 64
    for (e, warps), tokens in itertools.product(OLD_ROUTER.items(), range(1, 9)):
        assert t.lookup("router", tokens=tokens, n_experts=e, top_k=8) == {"num_warps": warps}


@pytest.mark.parametrize("table", TABLES)
def test_gate_up_splits_k_for_one_token_only(table):
    """The H200's re-tuned gate/up rule (quant_tune_h200-2026-12-02-s10.json; the other GPU
    tables extend it): K split 2 ways for one token, unsplit from 2 tokens on."""
    t = lc.load_table(table)
    got = {n: t.lookup("moe_gate_up", tokens=n, top_k=8, n_experts=128, d_model=2048, d_ff=768,
                       qtype="Q4_K") for n in range(1, 9)}
    assert got[1]["split"] == 2 and got[1]["num_warps"] == 4
    assert all(got[n]["split"] == 1 for n in range(2, 9))


@pytest.mark.parametrize("table", TABLES)
def test_down_takes_the_experts_tile_for_one_token_of_narrow_experts(table):
    """moe_down's rules (quant_tune_h200-2026-12-03-s13.json; the CPU's mirrors the GPU's
    path): the token's experts in one tile at one token when d_ff <= 1024 (Qwen3, OLMoE), the
    experts one after another at more tokens and for wide experts (Mixtral)."""
    t = lc.load_table(table)

    def down(tokens, f):
        return t.lookup("moe_down", tokens=tokens, top_k=8, n_experts=128, d_model=2048,
                        d_ff=f, qtype="Q4_K")
    assert down(1, 768)["experts_tile"] and down(1, 1024)["experts_tile"]
    # OLMoE's 32 chunks: the whole K in one 8-row tile (session 21); Qwen3's 24 keep 4 x 8
    assert (down(1, 1024)["BN"], down(1, 1024)["CH"]) == (8, 32)
    assert (down(1, 768)["BN"], down(1, 768)["CH"]) == (4, 8)
    assert not any(down(n, 768)["experts_tile"] for n in range(2, 9))
    assert not down(1, 14336)["experts_tile"]


@pytest.mark.parametrize("device", DEVICES)
def test_moe_and_router_config_by_device(device):
    assert moe_config("gate_up", 1, 8, 128, 2048, 768, 12, device)["split"] == 2
    assert moe_config("down", 8, 8, 128, 2048, 768, 12, device) == dict(
        OLD_MOE["down"], experts_tile=False, maxnreg=0)
    assert router_config(1, 128, 8, device) == {"num_warps": 1}
    assert router_config(4, 256, 8, device) == {"num_warps": 4}


# ---- the tuning script: rules from timings, the file it writes ---------------------------------
def _bench():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_quant_kernels.py"
    spec = importlib.util.spec_from_file_location("bench_quant_kernels_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fake_timer(calls):
    """Deterministic 'timings' of the sweep's candidates, no kernel run: BN=2 wins the small
    GEMVs at 1-2 tokens, BN=1 from 4 tokens, xb the output head, num_warps 2 the router up
    to 64 experts, and the moe candidates in their list order; one candidate always fails."""
    def timer(knob, case, cands):
        calls.append((knob, case["tokens"], len(cands)))
        out = []
        for i, c in enumerate(cands):
            if knob == "gemv":
                big = case["n"] >= 32768
                score = (0 if c["xb"] else 5) if big else abs(
                    c["BN"] - (2 if case["tokens"] <= 2 else 1)) + (c["CH"] != 64) + c["xb"]
                us = 10.0 + score + 0.01 * i
            elif knob == "router":
                us = 2.0 + abs(c["num_warps"] - (2 if case["n_experts"] <= 64 else 4))
            else:
                us = 20.0 + i
            out.append(None if c.get("num_warps") == 16 else us)
        return out
    return timer


def test_tuning_writes_a_device_file_from_timings(tmp_path, monkeypatch):
    """``--sweep --write-config`` on CPU with an injected timer: the rules pick the fastest
    candidate per token bucket, merge equal neighbours, name the measurement, and the file
    written loads (a new device's file extends default.json) and gives those choices."""
    bench = _bench()
    calls = []
    rules = bench.tune(fake_timer(calls), tokens=[1, 2, 4, 8], knobs=bench.TUNED_KNOBS,
                       device="Fake GPU 9000", n_sm=100)
    assert {k for k, _, _ in calls} == {"gemv", "moe_gate_up", "moe_down", "router",
                                        "router_fused"}
    assert [r.get("when") for r in rules["gemv"]] == [
        {"n": {"min": 32768}}, {"tokens": {"max": 2}}, None]
    assert "Fake GPU 9000" in rules["gemv"][1]["why"] and "tokens=2" in rules["gemv"][1]["why"]
    assert rules["gemv_split"] == [dict(rules["gemv_split"][0], min_programs=200, max_split=8)]
    assert [r.get("when") for r in rules["router"]] == [{"n_experts": {"max": 64}}, None]

    for name, src in (("cpu", "cpu.json"), ("default", "default.json"),
                      ("nvidia_h200", "nvidia_h200.json")):
        (tmp_path / src).write_text((lc.CONFIG_DIR / src).read_text())
    monkeypatch.setattr(lc, "CONFIG_DIR", tmp_path)
    lc.load_table.cache_clear()
    try:
        key = lc.device_key("Fake GPU 9000")
        data = lc.write_config(tmp_path / f"{key}.json", rules, about="tuned", extends="default")
        assert data["extends"] == "default" and json.loads((tmp_path / f"{key}.json").read_text()) == data
        t = lc.load_table(key)
        assert t.name == "fake_gpu_9000"
        assert t.lookup("gemv", tokens=2, n=5120, k=2048, qtype="Q8_0") == dict(
            BN=2, CH=64, num_warps=2, xb=False, stages=1)
        assert t.lookup("gemv", tokens=3, n=5120, k=2048, qtype="Q8_0")["BN"] == 1
        assert t.lookup("gemv", tokens=8, n=151936, k=2048, qtype="Q6_K")["xb"] is True
        assert t.lookup("moe_down", tokens=1, top_k=8, n_experts=128, d_model=2048, d_ff=768,
                        qtype="Q4_K") == bench.DOWN_CANDIDATES[0]
        assert t.lookup("router", tokens=1, n_experts=60, top_k=8) == {"num_warps": 2}
        assert t.knobs["tile"] == lc.load_table("nvidia_h200").knobs["tile"]   # from default

        # re-tuning an existing file replaces those knobs and keeps the others
        old = json.loads((tmp_path / "nvidia_h200.json").read_text())
        lc.write_config(tmp_path / "nvidia_h200.json", {"router": rules["router"]})
        new = json.loads((tmp_path / "nvidia_h200.json").read_text())
        assert new == dict(old, router=rules["router"]) and list(new) == list(old)
    finally:
        lc.load_table.cache_clear()


def test_tuned_rules_ties_and_bounds():
    """Within 2% the earlier candidate wins (the H200 sweep's router at 8 experts: 4 warps
    1.69 us, 1 warp 1.71 us); neighbours with one winner share a rule bounded by the last."""
    one, four = {"num_warps": 1}, {"num_warps": 4}
    pts = [(8, [(one, 1.71), (four, 1.69)]), (64, [(one, 2.31), (four, 3.79)]),
           (256, [(one, 9.0), (four, 4.35)])]
    rules = lc.tuned_rules("router", "n_experts", pts, "router", context="GPU: ")
    assert rules == [
        {"when": {"n_experts": {"max": 64}}, "num_warps": 1, "why": (
            "GPU: router: n_experts=8: num_warps=1 1.71 us (fastest num_warps=4 1.69 us); "
            "n_experts=64: num_warps=1 2.31 us (next num_warps=4 3.79 us)")},
        {"num_warps": 4, "why": "GPU: router: n_experts=256: num_warps=4 4.35 us (next num_warps=1 9.00 us)"}]
    strict = lc.tuned_rules("router", "n_experts", pts[:1], tie=0.0)
    assert strict[0]["num_warps"] == 4


def test_tuned_rules_refuses_what_cannot_be_a_rule():
    fields = {"num_warps": 1}
    with pytest.raises(LocalMoEError, match="no candidate ran"):
        lc.tuned_rules("router", "n_experts", [(8, [(fields, None)])])
    with pytest.raises(LocalMoEError, match="exactly"):
        lc.tuned_rules("router", "n_experts", [(8, [({"BN": 1}, 1.0)])])
    with pytest.raises(LocalMoEError, match="malformed"):
        lc.write_config("/nonexistent-dir/x.json", {"router": [{"num_warps": 1, "when": {"n": 1}}]})
