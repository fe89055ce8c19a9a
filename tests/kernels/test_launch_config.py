"""Launch choices of decode attention read from ``kernels/configs/*.json``
(:mod:`localmoe.kernels.launch_config`) are the choices the launcher made when they were code.

RECORDED expectations: :data:`OLD` was generated once, from the ``default_tile``,
``default_swap`` and ``default_sz_pre`` functions of kernels/decode_attention.py as they were
before the choices moved into data (commit c812fbd), over the grid below, before those
functions were replaced; it is the one recorded (not derived) expectation of the test suite.
Off CUDA the launcher then used 16-token tiles, 4 warps, 2 waves (:data:`OLD_CPU_TILE`), on
every CUDA device the H200 rules (no device had a table of its own), and always joined value
planes, 2 pipeline stages and the separate reduction.

Grid: each key is "KEY_FORMAT VALUE_FORMAT" of the synthetic codecs :data:`K_CODECS` /
:data:`V_CODECS` (the attributes the choices read); each value is
``"tiles | swap | sz_pre"``: tiles in 4 groups, one per (batch, kv heads) of :data:`PAIRS`, of
3 letters, one per ``max_len`` of :data:`LENS`, each letter a (block_n, num_warps, waves) of
:data:`TILES`; swap ``T``/``F``; sz_pre one entry per pair of :data:`PAIRS` (``-`` for none).
"""

import itertools
from types import SimpleNamespace

import pytest

from localmoe.errors import LocalMoEError
from localmoe.kernels import launch_config as lc


def _quant(bits, **kw):
    d = dict(bits=bits, is_fp4=False, channel=False, n_out=0, n_sink=0, window=0, rotate=False)
    d.update(kw)
    return SimpleNamespace(**d)


K_CODECS = {
    "f16": SimpleNamespace(),  # float codecs have none of the quantized attributes
    "int8": _quant(8), "int4": _quant(4), "int3": _quant(3), "int2": _quant(2),
    "int8:c": _quant(8, channel=True, window=16), "int4:c": _quant(4, channel=True, window=16),
    "int3:c": _quant(3, channel=True, window=16), "int2:c": _quant(2, channel=True, window=16),
    "fp4": _quant(4, is_fp4=True),
    "int4+out": _quant(4, n_out=2), "int4:c+out": _quant(4, channel=True, window=16, n_out=2),
    "int4+sink": _quant(4, n_sink=4), "int4+win": _quant(4, window=64),
    "int2+rot": _quant(2, rotate=True),
}
V_CODECS = {
    "f16": SimpleNamespace(), "int8": _quant(8), "int4": _quant(4), "int3": _quant(3),
    "int2": _quant(2), "fp4": _quant(4, is_fp4=True), "int4+out": _quant(4, n_out=2),
    "int2+sink": _quant(2, n_sink=4), "int8+win": _quant(8, window=64),
}
PAIRS = [(1, 1), (15, 1), (2, 8), (8, 4)]
LENS = [None, 4096, 4097]
TILES = {"A": (128, 4, 2.0), "B": (64, 4, 2.0), "C": (32, 1, 8.0), "D": (64, 1, 8.0),
         "E": (32, 2, 8.0), "F": (64, 4, 4.0), "G": (256, 4, 2.0), "H": (64, 2, 4.0)}
OLD_CPU_TILE = (16, 4, 2.0)

OLD = {
    "f16 f16":            "AAA AAA AAA AAA | F | v v v v",
    "f16 int8":           "AAA AAA CCC CCC | F | v v v v",
    "f16 int4":           "AAA AAA CCC CCC | F | v v v v",
    "f16 int3":           "AAA AAA CCC CCC | T | v v v v",
    "f16 int2":           "AAA AAA CCC CCC | T | v v v v",
    "f16 fp4":            "AAA AAA CCC CCC | T | v v v v",
    "f16 int4+out":       "BBB BBB BBB BBB | F | v v v v",
    "f16 int2+sink":      "BBB BBB BBB BBB | T | v v v v",
    "f16 int8+win":       "BBB BBB BBB BBB | F | v v v v",
    "int8 f16":           "AAA AAA CCC CCC | F | v v v v",
    "int8 int8":          "AAA AAA DDD DDD | F | v v v v",
    "int8 int4":          "AAA AAA DDD DDD | F | v v v v",
    "int8 int3":          "AAA AAA CCC CCC | T | v v v v",
    "int8 int2":          "AAA AAA CCC CCC | T | v v v v",
    "int8 fp4":           "AAA AAA CCC CCC | T | v v v v",
    "int8 int4+out":      "BBB BBB BBB BBB | F | v v v v",
    "int8 int2+sink":     "BBB BBB BBB BBB | T | v v v v",
    "int8 int8+win":      "BBB BBB BBB BBB | F | v v v v",
    "int4 f16":           "AAA AAA CCC CCC | F | vk vk vk vk",
    "int4 int8":          "AAA AAA DDD DDD | F | vk vk vk vk",
    "int4 int4":          "CAC CAC DDD DDD | F | vk vk vk vk",
    "int4 int3":          "AAA AAA CCC CCC | T | vk vk vk vk",
    "int4 int2":          "AAA AAA CCC CCC | T | vk vk vk vk",
    "int4 fp4":           "AAA AAA CCC CCC | T | vk vk vk vk",
    "int4 int4+out":      "BBB BBB BBB BBB | F | vk vk vk vk",
    "int4 int2+sink":     "BBB BBB BBB BBB | T | vk vk vk vk",
    "int4 int8+win":      "BBB BBB BBB BBB | F | vk vk vk vk",
    "int3 f16":           "AAA AAA FFF FFF | F | v v - -",
    "int3 int8":          "AAA AAA FFF FFF | F | v v - -",
    "int3 int4":          "AAA AAA FFF FFF | F | v v - -",
    "int3 int3":          "GGG GGG FFF FFF | T | v v - -",
    "int3 int2":          "GGG GGG FFF FFF | T | v v - -",
    "int3 fp4":           "AAA AAA FFF FFF | T | v v - -",
    "int3 int4+out":      "BBB BBB BBB BBB | F | v v - -",
    "int3 int2+sink":     "BBB BBB BBB BBB | T | v v - -",
    "int3 int8+win":      "BBB BBB BBB BBB | F | v v - -",
    "int2 f16":           "AAA AAA CCC CCC | F | v v v v",
    "int2 int8":          "AAA AAA CCC CCC | F | v v v v",
    "int2 int4":          "AAA AAA CCC CCC | F | v v v v",
    "int2 int3":          "GGG GGG EEE EEE | T | v v v v",
    "int2 int2":          "GGG GGG EEE EEE | T | v v v v",
    "int2 fp4":           "AAA AAA CCC CCC | T | v v v v",
    "int2 int4+out":      "BBB BBB BBB BBB | F | v v v v",
    "int2 int2+sink":     "BBB BBB BBB BBB | T | v v v v",
    "int2 int8+win":      "BBB BBB BBB BBB | F | v v v v",
    "int8:c f16":         "AAA AAA CCC CCC | F | v v v v",
    "int8:c int8":        "AAA AAA CCC CCC | F | v v v v",
    "int8:c int4":        "AAA AAA CCC CCC | F | v v v v",
    "int8:c int3":        "AAA AAA CCC CCC | T | v v v v",
    "int8:c int2":        "AAA AAA CCC CCC | T | v v v v",
    "int8:c fp4":         "AAA AAA CCC CCC | T | v v v v",
    "int8:c int4+out":    "BBB BBB BBB BBB | F | v v v v",
    "int8:c int2+sink":   "BBB BBB BBB BBB | T | v v v v",
    "int8:c int8+win":    "BBB BBB BBB BBB | F | v v v v",
    "int4:c f16":         "AAA AAA CCC CCC | F | v v v v",
    "int4:c int8":        "AAA AAA CCC CCC | F | v v v v",
    "int4:c int4":        "CAC CAC CCC CCC | F | v v v v",
    "int4:c int3":        "AAA AAA CCC CCC | T | v v v v",
    "int4:c int2":        "AAA AAA CCC CCC | T | v v v v",
    "int4:c fp4":         "AAA AAA CCC CCC | T | v v v v",
    "int4:c int4+out":    "BBB BBB BBB BBB | F | v v v v",
    "int4:c int2+sink":   "BBB BBB BBB BBB | T | v v v v",
    "int4:c int8+win":    "BBB BBB BBB BBB | F | v v v v",
    "int3:c f16":         "AAA AAA CCC CCC | F | v v v v",
    "int3:c int8":        "AAA AAA CCC CCC | F | v v v v",
    "int3:c int4":        "AAA AAA CCC CCC | F | v v v v",
    "int3:c int3":        "AAA AAA CCC CCC | T | v v v v",
    "int3:c int2":        "AAA AAA CCC CCC | T | v v v v",
    "int3:c fp4":         "AAA AAA CCC CCC | T | v v v v",
    "int3:c int4+out":    "BBB BBB BBB BBB | F | v v v v",
    "int3:c int2+sink":   "BBB BBB BBB BBB | T | v v v v",
    "int3:c int8+win":    "BBB BBB BBB BBB | F | v v v v",
    "int2:c f16":         "AAA AAA CCC CCC | F | v v v v",
    "int2:c int8":        "AAA AAA CCC CCC | F | v v v v",
    "int2:c int4":        "AAA AAA CCC CCC | F | v v v v",
    "int2:c int3":        "AAA AAA CCC CCC | T | v v v v",
    "int2:c int2":        "AAA AAA CCC CCC | T | v v v v",
    "int2:c fp4":         "AAA AAA CCC CCC | T | v v v v",
    "int2:c int4+out":    "BBB BBB BBB BBB | F | v v v v",
    "int2:c int2+sink":   "BBB BBB BBB BBB | T | v v v v",
    "int2:c int8+win":    "BBB BBB BBB BBB | F | v v v v",
    "fp4 f16":            "AAA AAA CCC CCC | F | v v v v",
    "fp4 int8":           "AAA AAA CCC CCC | F | v v v v",
    "fp4 int4":           "AAA AAA CCC CCC | F | v v v v",
    "fp4 int3":           "AAA AAA CCC CCC | T | v v v v",
    "fp4 int2":           "AAA AAA CCC CCC | T | v v v v",
    "fp4 fp4":            "AAA AAA CCC CCC | T | v v v v",
    "fp4 int4+out":       "BBB BBB BBB BBB | F | v v v v",
    "fp4 int2+sink":      "BBB BBB BBB BBB | T | v v v v",
    "fp4 int8+win":       "BBB BBB BBB BBB | F | v v v v",
    "int4+out f16":       "BBB BBB BBB BBB | F | vk vk vk vk",
    "int4+out int8":      "BBB BBB BBB BBB | F | vk vk vk vk",
    "int4+out int4":      "BBB BBB BBB BBB | F | vk vk vk vk",
    "int4+out int3":      "BBB BBB BBB BBB | T | vk vk vk vk",
    "int4+out int2":      "BBB BBB BBB BBB | T | vk vk vk vk",
    "int4+out fp4":       "BBB BBB BBB BBB | T | vk vk vk vk",
    "int4+out int4+out":  "BBB BBB BBB BBB | F | vk vk vk vk",
    "int4+out int2+sink": "BBB BBB BBB BBB | T | vk vk vk vk",
    "int4+out int8+win":  "BBB BBB BBB BBB | F | vk vk vk vk",
    "int4:c+out f16":     "AAA AAA CCC CCC | F | v v v v",
    "int4:c+out int8":    "AAA AAA CCC CCC | F | v v v v",
    "int4:c+out int4":    "CAC CAC CCC CCC | F | v v v v",
    "int4:c+out int3":    "AAA AAA CCC CCC | T | v v v v",
    "int4:c+out int2":    "AAA AAA CCC CCC | T | v v v v",
    "int4:c+out fp4":     "AAA AAA CCC CCC | T | v v v v",
    "int4:c+out int4+out":"BBB BBB BBB BBB | F | v v v v",
    "int4:c+out int2+sink":"BBB BBB BBB BBB | T | v v v v",
    "int4:c+out int8+win":"BBB BBB BBB BBB | F | v v v v",
    "int4+sink f16":      "BBB BBB BBB BBB | F | vk vk vk vk",
    "int4+sink int8":     "BBB BBB BBB BBB | F | vk vk vk vk",
    "int4+sink int4":     "BBB BBB BBB BBB | F | vk vk vk vk",
    "int4+sink int3":     "BBB BBB BBB BBB | T | vk vk vk vk",
    "int4+sink int2":     "BBB BBB BBB BBB | T | vk vk vk vk",
    "int4+sink fp4":      "BBB BBB BBB BBB | T | vk vk vk vk",
    "int4+sink int4+out": "BBB BBB BBB BBB | F | vk vk vk vk",
    "int4+sink int2+sink":"BBB BBB BBB BBB | T | vk vk vk vk",
    "int4+sink int8+win": "BBB BBB BBB BBB | F | vk vk vk vk",
    "int4+win f16":       "BBB BBB BBB BBB | F | vk vk vk vk",
    "int4+win int8":      "BBB BBB BBB BBB | F | vk vk vk vk",
    "int4+win int4":      "BBB BBB BBB BBB | F | vk vk vk vk",
    "int4+win int3":      "BBB BBB BBB BBB | T | vk vk vk vk",
    "int4+win int2":      "BBB BBB BBB BBB | T | vk vk vk vk",
    "int4+win fp4":       "BBB BBB BBB BBB | T | vk vk vk vk",
    "int4+win int4+out":  "BBB BBB BBB BBB | F | vk vk vk vk",
    "int4+win int2+sink": "BBB BBB BBB BBB | T | vk vk vk vk",
    "int4+win int8+win":  "BBB BBB BBB BBB | F | vk vk vk vk",
    "int2+rot f16":       "BBB BBB BBB BBB | F | v v v v",
    "int2+rot int8":      "BBB BBB BBB BBB | F | v v v v",
    "int2+rot int4":      "BBB BBB BBB BBB | F | v v v v",
    "int2+rot int3":      "BBB BBB BBB BBB | T | v v v v",
    "int2+rot int2":      "BBB BBB BBB BBB | T | v v v v",
    "int2+rot fp4":       "BBB BBB BBB BBB | T | v v v v",
    "int2+rot int4+out":  "BBB BBB BBB BBB | F | v v v v",
    "int2+rot int2+sink": "BBB BBB BBB BBB | T | v v v v",
    "int2+rot int8+win":  "BBB BBB BBB BBB | F | v v v v",
}


CHANGED = {
    # session 11 (benchmarks/results/attention_h200-2026-12-02-s11.json): int2 values with
    # per-token int2/int4 keys at few pairs take 64-token tiles up to 4096 tokens
    "int2 int2": "GBG GBG EEE EEE | T | v v v v",
    "int4 int2": "ABA ABA CCC CCC | T | vk vk vk vk",
    # the default int4 and int2 caches (per-channel keys) at few pairs: int4 64-token tiles up
    # to 4096 tokens, int2 one warp over 32-token tiles beyond
    "int4:c int4": "CBC CBC CCC CCC | F | v v v v",
    "int4:c+out int4": "CBC CBC CCC CCC | F | v v v v",
    # session 29 (int2_tiles_64k_h100-2026-12-05-s29.json): the default int2 cache beyond 4096
    # tokens at few pairs: two warps over 64-token tiles, 4 waves (the decode graph's gaps)
    "int2:c int2": "HAH HAH CCC CCC | T | v v v v",
    # session 13 (attention_h200-2026-12-03-s13-int8.json): the default int8 cache at few
    # pairs takes one warp over 32-token tiles from 64k tokens (None: unknown, long)
    "int8 int8": "CAA CAA DDD DDD | F | v v v v",
}
"""Recorded changes to :data:`OLD`, each with the measurement that made it (the tables' own
``why`` notes)."""


JOINED = {}
"""Where the tables still join the 2/3-bit value planes into one dot ("J", on :data:`LENS`'s
grid per pair group; "-": one dot per plane). :data:`OLD` joined them everywhere; session 33
(int2_vjoin_64k_h100-2026-12-06-s33.json) stopped it for the default int2 cache past 4096
tokens at few pairs and session 34 (attention_vjoin_h100-2026-12-06-s34.json) everywhere."""


def _expected(key):
    tiles, swap, sz = (p.strip() for p in CHANGED.get(key, OLD[key]).split("|"))
    groups = tiles.split()
    joins = JOINED.get(key, "--- --- --- ---").split()
    for (i, (batch, hkv)), (j, max_len) in itertools.product(enumerate(PAIRS), enumerate(LENS)):
        yield ((batch, hkv, max_len), TILES[groups[i][j]], swap == "T",
               sz.split()[i].strip("-"), joins[i][j] == "J")


def test_the_recorded_grid_is_complete():
    assert set(OLD) == {f"{k} {v}" for k in K_CODECS for v in V_CODECS}


@pytest.mark.parametrize("table", ["nvidia_h200", "default", "nvidia_a100_sxm4_80gb", "cpu"])
def test_tables_give_the_old_choices(table):
    """The H200's file, the default (any other GPU: the H200's rules, as before) and the CPU
    file (the interpreter: its own tile, the rest as on the GPU) over the whole grid."""
    t = lc.load_table(table)
    for key in OLD:
        kn, vn = key.split()
        for (batch, hkv, max_len), tile, swap, sz, join in _expected(key):
            c = t.choose(K_CODECS[kn], V_CODECS[vn], batch, hkv, max_len)
            where = (table, key, batch, hkv, max_len)
            assert (c.block_n, c.num_warps, c.waves) == (
                OLD_CPU_TILE if table == "cpu" else tile), where
            assert (c.swap_ab, c.sz_pre) == (swap, sz), where
            assert (c.v_join, c.num_stages, c.fused_reduce) == (join, 2, False), where


def test_lookup_cache_keeps_bucket_boundaries():
    """Cached choices are per bucket of the bounds the rules use: both sides of each bound,
    and values far beyond them, give what a fresh table gives."""
    kc, vc = K_CODECS["int4"], V_CODECS["int4"]
    cached = lc.load_table("nvidia_h200")
    for batch, max_len in itertools.product([1, 15, 16, 17, 64], [None, 1, 4096, 4097, 10**6]):
        fresh = lc.LaunchTable("fresh", cached.knobs)
        assert cached.choose(kc, vc, batch, 1, max_len) == fresh.choose(kc, vc, batch, 1, max_len)


def test_knob_lookup_cache_keeps_bucket_boundaries():
    """:meth:`LaunchTable.lookup` (the quantized kernels' knobs) caches per bucket of the
    numeric bounds its rules use: both sides of each bound give what a fresh table gives."""
    cached = lc.load_table("nvidia_h200")
    for tokens, n, e in itertools.product([1, 2, 3, 8, 9], [1, 32767, 32768, 10**6], [127, 128, 129]):
        fresh = lc.LaunchTable("fresh", cached.knobs)
        for knob, feats in (("gemv", dict(tokens=tokens, n=n, k=2048, qtype="Q8_0")),
                            ("router", dict(tokens=tokens, n_experts=e, top_k=8))):
            assert cached.lookup(knob, **feats) == fresh.lookup(knob, **feats) == fresh.pick(knob, feats)
    first = cached.lookup("gemv", tokens=1, n=64, k=64, qtype="Q8_0")
    first["BN"] = 99                                       # callers get their own dict
    assert cached.lookup("gemv", tokens=1, n=64, k=64, qtype="Q8_0")["BN"] != 99


def test_device_files():
    import torch

    assert lc.device_key("NVIDIA H200") == "nvidia_h200"
    assert lc.device_key("NVIDIA A100-SXM4-80GB") == "nvidia_a100_sxm4_80gb"
    assert lc.load_table("nvidia_h200").name == "nvidia_h200"
    assert lc.load_table("some_new_gpu").name == "default"
    assert lc.table_for(torch.device("cpu")).name == "cpu"
    assert (lc.CONFIG_DIR / "default.json").is_file()


def test_wrappers_read_the_default_table():
    import os

    import torch

    pytest.importorskip("triton")
    if not torch.cuda.is_available():  # as the kernel tests: before the kernel module imports
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from localmoe.kernels.decode_attention import default_swap, default_sz_pre, default_tile

    kc, vc = K_CODECS["int2"], V_CODECS["int2"]
    assert default_tile(kc, vc, 8, 4, 65536) == TILES["E"]
    assert default_tile(kc, vc, 8, 4, 65536, device="cpu") == OLD_CPU_TILE
    assert default_swap(kc, vc) is True and default_sz_pre(kc, vc, 8, 4) == "v"


@pytest.mark.parametrize("data,why", [
    ({"tile": [{"block_n": 1, "num_warps": 1, "waves": 1.0, "when": {"pairs": 1}}]}, "last"),
    ({"tile": [{"when": {"batch": 1}, "block_n": 1, "num_warps": 1, "waves": 1.0},
               {"block_n": 1, "num_warps": 1, "waves": 1.0}]}, "batch"),
    ({"tile": [{"block_n": 1, "num_warps": 1}]}, "waves"),
    ({"tiles": []}, "tiles"),
    ({"router": [{"when": {"pairs": 1}, "num_warps": 1}, {"num_warps": 4}]}, "pairs"),
    ({"gemv": [{"when": {"n": "big"}, "BN": 1, "CH": 32, "num_warps": 1, "xb": False, "stages": 1},
               {"BN": 1, "CH": 32, "num_warps": 1, "xb": False, "stages": 1}]}, "condition on n"),
    ({"gemv": [{"BN": 1, "CH": 32, "num_warps": 1}]}, "xb"),
])
def test_malformed_files_are_refused(tmp_path, monkeypatch, data, why):
    import json

    (tmp_path / "broken.json").write_text(json.dumps(data))
    monkeypatch.setattr(lc, "CONFIG_DIR", tmp_path)
    with pytest.raises(LocalMoEError) as e:
        lc._read("broken")
    assert why in str(e.value)


def test_a_config_file_named_by_the_environment_replaces_the_devices(tmp_path, monkeypatch):
    """LOCALMOE_LAUNCH_CONFIG=FILE: every CUDA device reads FILE (its knobs over the file it
    extends), the CPU keeps cpu.json; a file with knobs missing or unreadable is refused by
    name."""
    import json

    import torch

    rule = {"BN": 64, "CH": 8, "num_warps": 2, "xb": False, "stages": 3, "split": 4, "maxnreg": 0,
            "lookahead": True}
    f = tmp_path / "nvidia_h200.json"          # the device's own name: no false 'extends' loop
    f.write_text(json.dumps({"extends": "nvidia_h200", "moe_gate_up": [rule]}))
    monkeypatch.setenv(lc.CONFIG_ENV, str(f))
    monkeypatch.setattr(lc, "_BY_DEVICE", {})
    t = lc.table_for(torch.device("cuda", 0))
    assert t.name == str(f)
    assert t.lookup("moe_gate_up", tokens=1, top_k=8, n_experts=128, d_model=2048, d_ff=768,
                    qtype="Q4_K") == rule
    h200 = lc.load_table("nvidia_h200")
    assert t.knobs["moe_down"] == h200.knobs["moe_down"] != [rule]
    assert lc.table_for(torch.device("cpu")).name == "cpu"

    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"moe_gate_up": [rule]}))
    with pytest.raises(LocalMoEError, match="bare.json: no rules for"):
        lc.load_file(bare)
    with pytest.raises(LocalMoEError, match="cannot read launch config"):
        lc.load_file(tmp_path / "missing.json")


def test_an_optional_field_may_be_left_out_and_nothing_else():
    """``lookahead`` of the quantized tiles' knobs is optional (absent from the lookup, so
    false for the launchers, when a rule leaves it out); any other field missing or unknown
    still makes the file malformed."""
    rule = {"BN": 32, "CH": 16, "num_warps": 4, "xb": False, "stages": 1, "split": 2, "maxnreg": 0}
    t = lc.LaunchTable("t", dict(lc.load_table("cpu").knobs, moe_gate_up=[rule]))
    got = t.lookup("moe_gate_up", tokens=1, top_k=8, n_experts=128, d_model=2048, d_ff=768,
                   qtype="Q4_K")
    assert got == rule
    t = lc.LaunchTable("t", dict(lc.load_table("cpu").knobs,
                                 moe_gate_up=[dict(rule, lookahead=True)]))
    assert t.lookup("moe_gate_up", tokens=1, top_k=8, n_experts=128, d_model=2048, d_ff=768,
                    qtype="Q4_K")["lookahead"] is True
    for bad in (dict(rule, look_ahead=True), {k: v for k, v in rule.items() if k != "split"}):
        with pytest.raises(LocalMoEError, match="malformed"):
            lc._check("t", {"moe_gate_up": [bad]})
