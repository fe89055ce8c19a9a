"""Quantized KV codecs (localmoe/kv/quant_ops.py, quant_codec.py): packing, scalar formats, error bounds, outliers,
sinks/window, sizes, the paged cache and the torch backend with every format."""

import math

import pytest
import torch

from localmoe.errors import KVCacheFormatError
from localmoe.kv.cache import PagedKVCache
from localmoe.kv.formats import KVFormat
from localmoe.kv.quant_codec import QuantCodec
from localmoe.kv.quant_ops import (e2m1_decode, e2m1_encode, e4m3_decode, e4m3_encode, fp4_error_bound,
                                   int_error_bound, pack_codes, unpack_codes)
from localmoe.kv.spec import KVSpec
from localmoe.io.spec import ModelSpec

INT_FORMATS = ["int8", "int4", "int3", "int2"]
ALL_FORMATS = INT_FORMATS + ["fp4"]


def _data(t, h, d, seed=0, outlier_ch=(3,), scale=2.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, d, generator=g) * scale
    for c in outlier_ch:
        x[:, :, c] += 25.0
    return x


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("d", [16, 64, 128])
def test_pack_unpack_round_trip(bits, d):
    c = torch.randint(0, 1 << bits, (5, 3, d), dtype=torch.uint8)
    p = pack_codes(c, bits)
    assert p.shape == (5, 3, d * bits // 8) and p.dtype == torch.uint8
    assert torch.equal(unpack_codes(p, bits), c)


def test_pack_layout_is_split_planes():
    # int4: byte j = channel j (low nibble) | channel j + D/2 (high nibble)
    c = torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)
    assert pack_codes(c, 4).tolist() == [[0x31, 0x42]]
    # int2, D = 8: byte j holds channels j, j+2, j+4, j+6 from the low bits up
    c = torch.tensor([[1, 2, 3, 0, 2, 1, 0, 3]], dtype=torch.uint8)
    assert pack_codes(c, 2).tolist() == [[0b00101101, 0b11010010]]
    # int3's high-bit plane (P = 1), D = 16: byte j holds channels j, j+2, ..., j+14
    c = torch.zeros(1, 16, dtype=torch.uint8)
    c[0, 3] = 1
    c[0, 14] = 1
    assert pack_codes(c, 1).tolist() == [[0b10000000, 0b00000010]]


def test_e4m3_matches_torch_float8():
    codes = torch.arange(0, 127, dtype=torch.uint8)
    if hasattr(torch, "float8_e4m3fn"):
        assert torch.equal(e4m3_decode(codes), codes.view(torch.float8_e4m3fn).float())
        s = torch.rand(20000, generator=torch.Generator().manual_seed(1)) * 40 + 1e-3
        assert torch.equal(e4m3_encode(s), s.to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(e4m3_encode(e4m3_decode(codes[1:])), codes[1:])
    assert e4m3_decode(e4m3_encode(torch.tensor([1e9, 0.0]))).tolist() == [448.0, 2.0 ** -9]


def test_e2m1_grid():
    v = torch.tensor([0.0, 0.2, 0.3, 0.8, 1.3, 1.6, 2.4, 2.6, 3.6, 4.9, 5.1, 100.0, -0.6, -7.0])
    got = e2m1_decode(e2m1_encode(v)).tolist()
    assert got == [0.0, 0.0, 0.5, 1.0, 1.5, 1.5, 2.0, 3.0, 4.0, 4.0, 6.0, 6.0, -0.5, -6.0]


def _codec(name, d=64, h=2, **kv):
    spec = KVSpec.parse(name, kgroup="token", **kv)   # per-token key codecs here
    return QuantCodec(spec.k, h, d, spec, max_seqs=2)


@pytest.mark.parametrize("name", INT_FORMATS)
@pytest.mark.parametrize("group", [16, 32, 64, 128])
def test_int_error_within_analytic_bound(name, group):
    d = 128
    c = _codec(f"{name}:g{group}", d=d)
    x = _data(17, 2, d)
    st = c.alloc(32, "cpu")
    slots = torch.randperm(32)[:17]
    c.write(st, slots, x, torch.arange(17))
    err = (c.read(st, slots) - x).abs()
    bound = int_error_bound(x, c.bits, c.group)
    assert (err <= bound).all(), (err - bound).max()
    # the bound is tight-ish: the worst value uses a good part of it
    assert (err / bound).max() > 0.3


def test_fp4_error_within_analytic_bound():
    c = _codec("fp4", d=64)
    x = _data(33, 2, 64)
    st = c.alloc(40, "cpu")
    slots = torch.arange(33)
    c.write(st, slots, x, slots)
    err = (c.read(st, slots) - x).abs()
    assert (err <= fp4_error_bound(x)).all()


def test_error_shrinks_with_bits():
    x = _data(64, 2, 64, outlier_ch=())
    errs = []
    for name in ["int2", "int3", "int4", "int8"]:
        c = _codec(name)
        st = c.alloc(64, "cpu")
        s = torch.arange(64)
        c.write(st, s, x, s)
        errs.append((c.read(st, s) - x).pow(2).mean().item())
    assert errs == sorted(errs, reverse=True) and errs[-1] < errs[0] / 500


@pytest.mark.parametrize("name", ALL_FORMATS)
def test_outliers_restored_exactly_and_help(name):
    x = _data(20, 2, 64, outlier_ch=(5, 40))
    s = torch.arange(20)
    plain, out = _codec(name), _codec(name, outlier_frac=0.03)
    assert out.n_out == 2
    sp, so = plain.alloc(20, "cpu"), out.alloc(20, "cpu")
    plain.write(sp, s, x, s)
    out.write(so, s, x, s)
    r = out.read(so, s)
    for ch in (5, 40):
        assert torch.equal(r[:, :, ch], x[:, :, ch].half().float())
    err_plain = (plain.read(sp, s) - x).pow(2).mean()
    err_out = (r - x).pow(2).mean()
    assert err_out < err_plain * 0.7


def _mspec(d=64):
    return ModelSpec(arch="llama", n_layers=2, d_model=128, n_heads=4, n_kv_heads=2, head_dim=d,
                     vocab_size=10)


@pytest.mark.parametrize("name", ALL_FORMATS)
def test_sink_and_window_tokens_exact_through_cache(name):
    kv = KVSpec.parse(name, sink_tokens=3, window=8)
    cache = PagedKVCache(_mspec(), kv, n_ctx=64, max_seqs=2, block_size=16)
    a = cache.new_seq()
    x = _data(40, 2, 64)
    cache.reserve(a, 40)
    cache.write(0, a, 0, x[:25], x[:25] * 0.5)      # prefill
    for p in range(25, 40):                          # then decode one by one
        cache.write(0, a, p, x[p:p + 1], x[p:p + 1] * 0.5)
    cache.commit(a, 40)
    k, v = cache.read(0, a, 40)
    exact = list(range(3)) + list(range(32, 40))
    assert torch.equal(k[exact], x[exact].half().float())
    assert torch.equal(v[exact], (x[exact] * 0.5).half().float())
    mid = list(range(3, 32))
    assert not torch.equal(k[mid], x[mid].half().float())  # quantized in between
    # truncation keeps correctness: positions read back either exact or quantized-consistent
    cache.truncate(a, 30)
    cache.reserve(a, 1)
    y = _data(1, 2, 64, seed=9)
    cache.write(0, a, 30, y, y)
    cache.commit(a, 1)
    k2, _ = cache.read(0, a, 31)
    assert torch.equal(k2[30], y[0].half().float())
    assert torch.equal(k2[:3], x[:3].half().float())
    # a new sequence reusing the row starts with an empty window
    cache.free_seq(a)
    b = cache.new_seq()
    cache.reserve(b, 2)
    z = _data(2, 2, 64, seed=3)
    cache.write(0, b, 0, z, z)
    cache.commit(b, 2)
    kb, _ = cache.read(0, b, 2)
    assert torch.equal(kb, z.half().float())


@pytest.mark.parametrize("name", ALL_FORMATS)
def test_never_nan_or_inf(name):
    c = _codec(name, outlier_frac=0.02)
    x = torch.zeros(6, 2, 64)
    x[1] = 7.0                                   # constant groups (zero range)
    x[2] = 1e6                                   # beyond fp16
    x[3, :, ::2] = -1e6
    x[4] = torch.randn(2, 64) * 1e-8             # tiny (E4M3 subnormal range)
    x[5] = torch.randn(2, 64) * 3e4
    st = c.alloc(8, "cpu")
    s = torch.arange(6)
    c.write(st, s, x, s)
    r = c.read(st, s)
    assert torch.isfinite(r).all()
    assert torch.equal(r[0], torch.zeros(2, 64))
    if name != "fp4":
        assert torch.equal(r[1], x[1])


def test_rotation_round_trips_and_spreads_outliers():
    x = _data(32, 2, 64, outlier_ch=(7,), scale=1.0)
    s = torch.arange(32)
    errs = {}
    for rot in (False, True):
        spec = KVSpec.parse("int3:t")
        c = QuantCodec(spec.k, 2, 64, spec, role="k", rotate=rot)
        st = c.alloc(32, "cpu")
        c.write(st, s, x, s)
        errs[rot] = (c.read(st, s) - x).pow(2).mean().item()
    assert errs[True] < errs[False]
    with pytest.raises(KVCacheFormatError):
        QuantCodec(KVFormat.parse("int4"), 2, 64, KVSpec.parse("int4"), role="v", rotate=True)


@pytest.mark.parametrize("name,group,bits", [("int4", 32, 5.0), ("int4", 64, 4.5),
                                             ("int4", 128, 4.25), ("int2", 32, 3.0),
                                             ("int2", 64, 2.5), ("fp4", 16, 4.5),
                                             ("int8", 32, 9.0), ("int3", 32, 4.0)])
def test_bits_per_value_and_allocated_bytes_agree(name, group, bits):
    fmt = KVFormat.parse(f"{name}:g{group}") if name != "fp4" else KVFormat.parse("fp4")
    spec = KVSpec(fmt, fmt)
    assert spec.bits_per_value("k", 128) == pytest.approx(bits)
    c = QuantCodec(fmt, 4, 128, spec)
    st = c.alloc(100, "cpu")
    allocated = sum(t.numel() * t.element_size() for t in st.values())
    assert allocated == pytest.approx(c.bytes_per_token() * 100)
    assert c.bytes_per_token() == pytest.approx(bits * 128 * 4 / 8)


def test_footprint_counts_side_buffers():
    ms = _mspec()
    base = PagedKVCache(ms, KVSpec.parse("int4:t"), n_ctx=64, max_seqs=2)
    side = PagedKVCache(ms, KVSpec.parse("int4:t", sink_tokens=4, window=16), n_ctx=64, max_seqs=2)
    extra = side.footprint() - base.footprint()
    assert extra == 2 * 2 * 2 * ((4 + 16) * 2 * 64 * 2 + 16 * 4)  # layers * (k,v) * rows


def test_bad_group_is_a_clear_error():
    with pytest.raises(KVCacheFormatError, match="group size"):
        PagedKVCache(ModelSpec(arch="llama", n_layers=1, d_model=8, n_heads=1, n_kv_heads=1,
                               head_dim=8, vocab_size=4), KVSpec.parse("fp4"), n_ctx=16)


@pytest.mark.parametrize("kv", ["int8", "int4", "int3", "int2", "fp4", "k=int4,v=int2"])
def test_torch_backend_generates_with_every_format(smollm2_path, kv):
    from localmoe.backends.torch_backend import TorchRunner
    from localmoe.io.loader import open_model
    from localmoe.text.tokenizer import Tokenizer

    mf = open_model(smollm2_path)
    tok = Tokenizer.from_model(mf)
    spec = KVSpec.parse("f16", k="int4", v="int2") if "=" in kv else KVSpec.parse(kv, sink_tokens=2)
    r = TorchRunner(mf, n_ctx=128, kv_spec=spec, max_seqs=1)
    sid = r.new_sequence()
    ids = tok.encode("The capital of France is")
    out = []
    logits = r.forward([(sid, ids)])[0]
    for _ in range(6):
        assert torch.isfinite(logits).all()
        t = int(logits.argmax())
        out.append(t)
        logits = r.forward([(sid, [t])])[0]
    text = tok.decode(out)
    assert text.strip(), out
    assert r.stats()["kv_format"] == str(spec)


@pytest.mark.parametrize("text", ["int4", "k=int4,v=int2", "int2,outliers=0.04,sinks=4,window=64",
                                  "k=int4:g64,v=int2,outliers=0.03", "int4:g64,sinks=2"])
def test_spec_string_round_trips(text):
    s = KVSpec.parse(text)
    assert KVSpec.parse(str(s)) == s
    assert str(s) == text


def test_spec_string_options():
    s = KVSpec.parse("int2,outliers=2%,sinks=4")
    assert (s.k.name, s.outlier_frac, s.sink_tokens, s.window) == ("int2", 0.02, 4, 0)
    assert KVSpec.parse("int2,window=8", v="int4").v.name == "int4"
    for bad in ("int2,foo=1", "int2,sinks=x", "int2,outliers=0.7"):
        with pytest.raises(KVCacheFormatError):
            KVSpec.parse(bad)
