"""Per-channel key quantization (KIVI-style, one scale/zero per channel per cache page):
storage contract, page completion, truncation, ring, ragged batches, GPU routing twin, engine."""

import pytest
import torch

from localmoe.errors import KVCacheFormatError
from localmoe.kv.cache import PagedKVCache
from localmoe.kv.formats import KVFormat
from localmoe.kv.quant_codec import QuantCodec
from localmoe.kv.quant_ops import (channel_error_bound, outlier_count, pack_codes, quantize_channel,
                                   unpack_codes)
from localmoe.kv.spec import KVSpec
from localmoe.io.spec import ModelSpec

CH_FORMATS = ["int8:c", "int4:c", "int3:c", "int2:c"]


def _mspec(d=64, h=2):
    return ModelSpec(arch="llama", n_layers=2, d_model=128, n_heads=4, n_kv_heads=h, head_dim=d,
                     vocab_size=10)


def _data(t, h=2, d=64, seed=0, outlier_ch=(3, 17), scale=2.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, d, generator=g) * scale
    for c in outlier_ch:
        x[:, :, c] += 25.0
    return x


def _cache(name, block=16, n_ctx=128, max_seqs=2, **kw):
    """The KIVI page contract without outlier entries (key_outlier_frac=0 unless given; key
    outliers are tested in test_kv_channel_outliers.py)."""
    kw.setdefault("key_outlier_frac", 0.0)
    return PagedKVCache(_mspec(), KVSpec.parse(name, **kw), n_ctx=n_ctx, max_seqs=max_seqs,
                        block_size=block)


def _fill(cache, x, chunks, layer=0, sid=None):
    """Write x [T, H, D] (as both K and V*0.5) in pieces of the given sizes; returns sid."""
    sid = cache.new_seq() if sid is None else sid
    p = cache.seq_len(sid)
    for n in chunks:
        cache.reserve(sid, n)
        cache.write(layer, sid, p, x[p:p + n], x[p:p + n] * 0.5)
        cache.commit(sid, n)
        p += n
    return sid


# ---- storage contract ----------------------------------------------------------------------
@pytest.mark.parametrize("name", CH_FORMATS)
def test_store_layout_contract(name):
    cache = _cache(name)
    kc, vc = cache.k_codec, cache.v_codec
    assert kc.channel is True and kc.block_size == 16 and kc.window == 16
    assert kc.n_out == 0 and kc.rotate is False
    dflt = _cache(name, key_outlier_frac=None)          # the format's default key outliers
    assert dflt.k_codec.n_out == outlier_count(dflt.kv_spec.key_outliers(), 64)
    assert ("oidx" in dflt.k_stores[0]) == (dflt.k_codec.n_out > 0)
    assert vc.channel is False and "scale" in cache.v_stores[0]
    st = cache.k_stores[0]
    n_slots = cache.n_blocks * 16
    bits = KVFormat.parse(name).bits
    p = 2 if bits == 3 else bits
    assert st["q"].shape == (2, n_slots, 64 * p // 8) and st["q"].dtype == torch.uint8
    assert ("q_hi" in st) == (bits == 3)
    assert st["cscale"].shape == (2, cache.n_blocks, 64) and st["cscale"].dtype == torch.float16
    assert st["czero"].shape == (2, cache.n_blocks, 64) and st["czero"].dtype == torch.float16
    assert "scale" not in st and "zero" not in st and "oidx" not in st
    assert st["ring"].shape == (2, 2, 16, 64) and st["ring_pos"].shape == (2, 16)


@pytest.mark.parametrize("name", CH_FORMATS)
def test_complete_pages_decode_from_codes_and_scales(name):
    """x = code * cscale[h, slot//PAGE, d] + czero[h, slot//PAGE, d] for every token of a
    complete page that is outside the ring; the codes are packed with pack_codes."""
    cache = _cache(name)
    x = _data(70)
    sid = _fill(cache, x, [70])
    st, c = cache.k_stores[0], cache.k_codec
    slots = cache.slots(sid, 0, 48)
    codes = unpack_codes(st["q"][:, slots], c.pbits)
    if c.bits == 3:
        codes = codes | (unpack_codes(st["q_hi"][:, slots], 1) << 2)
    b = slots // 16
    manual = (codes.float() * st["cscale"][:, b].float() + st["czero"][:, b].float()).transpose(0, 1)
    k, _ = cache.read(0, sid, 70)
    assert torch.equal(k[:48], manual)
    # and they are the per-channel quantization of the fp16-rounded page
    pages = x[:48].half().float().reshape(3, 16, 2, 64)
    q, cs, cz = quantize_channel(pages, c.bits)
    assert torch.equal(st["cscale"][:, b[::16]], cs.transpose(0, 1))
    assert torch.equal(st["czero"][:, b[::16]], cz.transpose(0, 1))
    packed = pack_codes(q.reshape(48, 2, 64) & ((1 << c.pbits) - 1), c.pbits).transpose(0, 1)
    assert torch.equal(st["q"][:, slots], packed)


@pytest.mark.parametrize("name", CH_FORMATS)
def test_round_trip_within_analytic_bound(name):
    cache = _cache(name, n_ctx=256, max_seqs=1)
    x = _data(200, seed=3)
    x[:, 1, 40] *= 30.0                       # a wide channel in one head
    sid = _fill(cache, x, [200])
    k, v = cache.read(0, sid, 200)
    n = 192                                   # 12 complete pages; the ring holds 184..199
    bnd = channel_error_bound(x[:n].half().float().reshape(12, 16, 2, 64),
                              KVFormat.parse(name).bits).reshape(n, 2, 64)
    err = (k[:n] - x[:n]).abs()
    assert (err <= bnd).all(), (err / bnd).max()
    assert (err[:176] > 0).any()              # really quantized
    assert torch.equal(k[184:], x[184:].half().float())


def test_per_channel_beats_per_token_on_outlier_channels():
    x = _data(128, seed=5, outlier_ch=(3, 17, 30))
    errs = {}
    for name in ("int4:c", "int4:t"):
        cache = _cache(name, n_ctx=128, max_seqs=1)
        sid = _fill(cache, x, [128])
        k, _ = cache.read(0, sid, 96)         # outside the 16-token ring
        errs[name] = (k - x[:96]).pow(2).mean().item()
    assert errs["int4:c"] < 0.5 * errs["int4:t"], errs


# ---- page completion across write calls ---------------------------------------------------
@pytest.mark.parametrize("name", ["int4:c", "int3:c", "int2:c"])
@pytest.mark.parametrize("chunks", [[1] * 53, [5, 11, 1, 16, 20], [15, 1, 17, 20], [3, 50]])
def test_token_by_token_equals_prefill(name, chunks):
    x = _data(53, seed=1)
    a = _cache(name, sink_tokens=2)
    b = _cache(name, sink_tokens=2)
    sa = _fill(a, x, [53])
    sb = _fill(b, x, chunks)
    for key in a.k_stores[0]:
        assert torch.equal(a.k_stores[0][key], b.k_stores[0][key]), key
    ka, _ = a.read(0, sa, 53)
    kb, _ = b.read(0, sb, 53)
    assert torch.equal(ka, kb)


@pytest.mark.parametrize("window", [0, 8, 40])
def test_ring_holds_the_incomplete_page(window):
    cache = _cache("int2:c", window=window)
    assert cache.k_codec.window == max(window, 16)
    x = _data(64, seed=2)
    sid = cache.new_seq()
    for n in range(1, 41):                    # after every token: page tokens read exactly
        _fill(cache, x, [1], sid=sid)
        k, _ = cache.read(0, sid, n)
        lo = (n // 16) * 16
        assert torch.equal(k[lo:n], x[lo:n].half().float()), n
        w = max(window, 16)
        assert torch.equal(k[max(0, n - w):n], x[max(0, n - w):n].half().float())
        if n >= 16 + w:                        # older complete pages are quantized
            assert not torch.equal(k[:16], x[:16].half().float())


def test_sinks_exact_and_pages_complete_around_them():
    cache = _cache("int2:c", sink_tokens=4)
    x = _data(60, seed=4)
    sid = _fill(cache, x, [7, 1, 30, 22])
    k, _ = cache.read(0, sid, 60)
    assert torch.equal(k[:4], x[:4].half().float())
    assert not torch.equal(k[4:16], x[4:16].half().float())


# ---- truncation ---------------------------------------------------------------------------
@pytest.mark.parametrize("cut", [20, 31, 32, 35, 5, 0])
@pytest.mark.parametrize("chunks_after", [[1] * 30, [30], [12, 18]])
def test_truncate_mid_page_then_rewrite(cut, chunks_after):
    """Write 60 tokens, truncate into a (complete) page, write new tokens: every position
    reads back its current data (within the bound for complete pages, exact in the ring), and
    the re-completed page matches a fresh cache fed the same history the same way."""
    name = "int4:c"
    x = _data(60, seed=6)
    y = _data(80, seed=7) * 1.5
    cache = _cache(name)
    sid = _fill(cache, x, [60])
    cache.truncate(sid, cut)
    k0, _ = cache.read(0, sid, cut)
    # before rewriting: the kept prefix reads as before truncation
    ref = _cache(name)
    rs = _fill(ref, x, [60])
    kr, _ = ref.read(0, rs, cut)
    assert torch.equal(k0, kr)
    new = torch.cat([x[:cut], y[cut:cut + sum(chunks_after)]])
    _fill(cache, new, chunks_after, sid=sid)
    n = cut + sum(chunks_after)
    k, _ = cache.read(0, sid, n)
    assert torch.isfinite(k).all()
    # the ring serves the last 16 positions exactly
    assert torch.equal(k[n - 16:n], new[n - 16:n].half().float())
    # everything else within the per-channel bound of its page (page tokens before the cut
    # may have been re-quantized from their codes: allow two bounds there)
    full = (n // 16) * 16
    pages = new[:full].half().float().reshape(-1, 16, 2, 64)
    bnd = channel_error_bound(pages, 4).reshape(full, 2, 64)
    err = (k[:full] - new[:full]).abs()
    first_cut_page = (cut // 16) * 16
    tight = torch.ones(full, dtype=torch.bool)
    tight[first_cut_page:min(full, first_cut_page + 16)] = False
    assert (err[tight] <= bnd[tight]).all()
    assert (err <= 3 * bnd + 1e-3).all()
    # new tokens (after the cut) never leak old data: a page fully after the cut equals a fresh
    # cache's page fed new in one go
    fresh = _cache(name)
    fs = _fill(fresh, new, [n])
    kf, _ = fresh.read(0, fs, n)
    first_clean = ((cut + 15) // 16) * 16    # pages that start at or after the cut
    assert torch.equal(k[first_clean:], kf[first_clean:])


def test_truncate_within_ring_keeps_exact_tokens():
    cache = _cache("int4:c")
    x = _data(40, seed=8)
    sid = _fill(cache, x, [40])               # ring: 24..39 (page 1 = 16..31 complete)
    cache.truncate(sid, 37)
    y = _data(10, seed=9)
    _fill(cache, torch.cat([x[:37], y]), [1, 1, 1, 1, 1, 1, 1, 1, 1, 1], sid=sid)
    k, _ = cache.read(0, sid, 47)
    assert torch.equal(k[32:37], x[32:37].half().float())   # page 2 completed from the ring
    assert torch.equal(k[37:47], y[:10].half().float())


# ---- ragged batches and sequence rows -----------------------------------------------------
def test_ragged_sequences_match_single_sequence_caches():
    name = "int3:c"
    xs = [_data(n, seed=10 + i) for i, n in enumerate((37, 5, 64))]
    shared = _cache(name, n_ctx=128, max_seqs=3, window=4)
    sids = [shared.new_seq() for _ in xs]
    # interleave: each step every sequence adds a different number of tokens
    steps = [[9, 3, 16], [1, 2, 16], [20, 0, 1], [7, 0, 31]]
    for step in steps:
        for sid, x, n in zip(sids, xs, step):
            if n:
                _fill(shared, x, [n], sid=sid)
    for sid, x in zip(sids, xs):
        assert shared.seq_len(sid) == len(x)
        solo = _cache(name, n_ctx=128, max_seqs=1, window=4)
        ss = _fill(solo, x, [len(x)])
        k1, v1 = shared.read(0, sid, len(x))
        k2, v2 = solo.read(0, ss, len(x))
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_row_reuse_never_reads_a_stale_ring():
    cache = _cache("int4:c", max_seqs=1)
    x = _data(30, seed=11)
    sid = _fill(cache, x, [30])
    cache.free_seq(sid)
    y = _data(5, seed=12)
    s2 = _fill(cache, y, [5])
    k, _ = cache.read(0, s2, 5)
    assert torch.equal(k, y.half().float())


# ---- extremes -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", CH_FORMATS)
def test_never_nan_or_inf(name):
    cache = _cache(name, n_ctx=64, max_seqs=1)
    x = torch.zeros(48, 2, 64)
    x[16:32] = 7.0                             # constant channels (zero range)
    x[32:40, :, ::2] = 1e6                     # beyond fp16
    x[40:48, :, 1::2] = -1e6
    x[33, :, 5] = 1e-8
    sid = _fill(cache, x, [48])
    k, _ = cache.read(0, sid, 48)
    assert torch.isfinite(k).all()
    assert torch.equal(k[:16], torch.zeros(16, 2, 64))
    assert torch.equal(k[16:32], x[16:32])


# ---- user surface -------------------------------------------------------------------------
def test_spec_parsing_and_round_trip():
    s = KVSpec.parse("int4:c")
    assert s.k.grouping == "channel" and s.v.grouping == ""
    import localmoe.kv.formats as kv_formats

    assert str(s) == ("int4" if kv_formats.DEFAULT_KEY_GROUPING == "channel" else "int4:c")
    assert KVSpec.parse(str(s)) == s
    for text in ("int4:c,sinks=4,window=64", "k=int4:c,v=int2:g16", "int4:t:g16", "k=int2:c,v=int4"):
        assert KVSpec.parse(str(KVSpec.parse(text))) == KVSpec.parse(text)
    assert KVSpec.parse("int4,kgroup=channel") == KVSpec.parse("int4:c")
    assert KVSpec.parse("int4", kgroup="token").k.grouping == "token"
    assert KVSpec.parse("f16", k="int4:channel", v="int4").k.grouping == "channel"
    assert KVFormat.parse("int4:g16:c") == KVFormat("int4", 4, 16, "channel")
    for bad, kw in (("fp4:c", {}), ("f16:c", {}), ("int4,kgroup=diagonal", {}),
                    ("f16", {"k": "int4", "v": "int4:c"}), ("fp4", {"kgroup": "channel"}), ("int4", {"kgroup": "diag"})):
        with pytest.raises(KVCacheFormatError):
            KVSpec.parse(bad, **kw)


def test_bad_combinations_are_clear_errors():
    with pytest.raises(KVCacheFormatError, match="block size"):
        _cache("int4:c", block=2)
    spec = KVSpec.parse("int4:c")
    with pytest.raises(KVCacheFormatError, match="rotat"):
        QuantCodec(spec.k, 2, 64, spec, role="k", rotate=True)
    with pytest.raises(KVCacheFormatError, match="keys only"):
        QuantCodec(spec.k, 2, 64, spec, role="v")
    c = QuantCodec(spec.k, 2, 64, spec, block_size=16)
    with pytest.raises(KVCacheFormatError, match="multiple"):
        c.alloc(40, "cpu")
    st = c.alloc(64, "cpu")
    with pytest.raises(ValueError, match="consecutive"):
        c.write(st, torch.tensor([0, 2]), _data(2), torch.tensor([0, 2]))


@pytest.mark.parametrize("name,block,bits", [("int4:c", 16, 6.0), ("int4:c", 32, 5.0),
                                             ("int4:c,koutliers=0.03125", 16, 6.75),
                                             ("int4:c,koutliers=0.03125", 32, 5.75),
                                             ("int2:c", 16, 4.0), ("int3:c", 64, 3.5),
                                             ("int8:c", 16, 10.0)])
def test_bits_per_value_and_allocated_bytes_agree(name, block, bits):
    # outliers= is the values'; per-channel keys take koutliers= (default: none)
    spec = KVSpec.parse(name, outlier_frac=0.04)
    assert spec.bits_per_value("k", 128, block) == pytest.approx(bits)
    c = QuantCodec(spec.k, 4, 128, spec, block_size=block)
    st = c.alloc(128, "cpu")
    packed = sum(t.numel() * t.element_size() for k, t in st.items()
                 if k not in ("sink", "ring", "ring_pos"))
    assert packed == pytest.approx(c.bytes_per_token() * 128)
    assert c.bytes_per_token() == pytest.approx(bits * 128 * 4 / 8)
    cache = PagedKVCache(_mspec(128, 4), spec, n_ctx=64, block_size=block)
    assert cache.kv_spec.bytes_per_token(cache.spec, block) == pytest.approx(
        2 * 4 * 128 * (bits + spec.bits_per_value("v", 128)) / 8)


def test_outliers_still_apply_to_values():
    cache = _cache("int4:c", outlier_frac=0.04, key_outlier_frac=None)
    assert cache.k_codec.n_out == 0 and cache.v_codec.n_out == 3   # outliers= is the values'
    assert "oidx" in cache.v_stores[0] and "oidx" not in cache.k_stores[0]
    both = _cache("int4:c,koutliers=0.03", outlier_frac=0.04, key_outlier_frac=None)
    assert both.k_codec.n_out == 2 and both.k_stores[0]["oidx"].shape[-1] == 2


def test_format_table_reports_both_sides():
    from localmoe.kv.spec import kv_format_table

    rows = {r["format"]: r for r in kv_format_table(_mspec(64), ("int4:c", "int4:t", "int2:c"))}
    assert rows["int4:c"]["bits_k"] == pytest.approx(6.0)
    assert rows["int4:c"]["bits_v"] == pytest.approx(5.0)
    assert rows["int4:t"]["bits_k"] == pytest.approx(5.0)


# ---- GPU routing twin ---------------------------------------------------------------------
def test_triton_routing_twin_matches_cache_write():
    """The triton backend's write_kv sends per-channel keys to codec.write and token-mode
    values to the append kernel; on CPU the kernel twin (kv_quant_append_ref) stands in: the
    stores must equal PagedKVCache.write's."""
    from localmoe.kernels.kv_quant_append import kv_quant_append_ref

    x = _data(45, seed=13)
    a = _cache("int4:c", sink_tokens=2)
    b = _cache("int4:c", sink_tokens=2)
    sa = _fill(a, x, [20, 1, 1, 23])
    sb = b.new_seq()
    p = 0
    for n in (20, 1, 1, 23):
        b.reserve(sb, n)
        slots = b.slots(sb, p, p + n)
        pos = torch.arange(p, p + n)
        row = b.seq_row(sb)
        for codec, store, t in ((b.k_codec, b.k_stores[0], x[p:p + n]),
                                (b.v_codec, b.v_stores[0], x[p:p + n] * 0.5)):
            if hasattr(codec, "quantize_rows") and not getattr(codec, "channel", False):
                kv_quant_append_ref(codec, store, slots, t, pos, row)
            else:
                codec.write(store, slots, t, pos, seq_row=row)
        b.commit(sb, n)
        p += n
    for sa_, sb_ in ((a.k_stores[0], b.k_stores[0]), (a.v_stores[0], b.v_stores[0])):
        for key in sa_:
            assert torch.equal(sa_[key], sb_[key]), key
    assert torch.equal(a.read(0, sa, 45)[0], b.read(0, sb, 45)[0])


def _layers_cache(name, n_layers=3, **kw):
    kw.setdefault("key_outlier_frac", 0.0)
    spec = ModelSpec(arch="llama", n_layers=n_layers, d_model=128, n_heads=4, n_kv_heads=2,
                     head_dim=64, vocab_size=10)
    return PagedKVCache(spec, KVSpec.parse(name, **kw), n_ctx=128, max_seqs=2, block_size=16)


@pytest.mark.parametrize("name,kw", [("int4:c", {}), ("int3:c", {"sink_tokens": 2}),
                                     ("int2:c", {"key_outlier_frac": 0.0625}),
                                     ("int4:c", {"key_outlier_frac": 0.0625, "window": 40})])
@pytest.mark.parametrize("before,n", [(0, 7), (0, 16), (0, 45), (16, 33), (5, 30)])
def test_several_layers_pages_quantized_together_store_the_same_bytes(name, kw, before, n):
    """``write_channel_layers`` (a prompt's keys of every layer, pages quantized together,
    layers side by side as heads) stores what one ``write_channel`` per layer stores: codes,
    scales, outliers, ring and sinks; after ``before`` tokens written earlier (a first page
    begun earlier goes per layer)."""
    a, b = _layers_cache(name, **kw), _layers_cache(name, **kw)
    xs = torch.stack([_data(before + n, seed=20 + i) * (i + 1) for i in range(3)])
    sa, sb = a.new_seq(), b.new_seq()
    for c, s in ((a, sa), (b, sb)):
        c.reserve(s, before + n)
        for layer in range(3):
            if before:
                c.k_codec.write(c.k_stores[layer], c.slots(s, 0, before), xs[layer, :before],
                                None, seq_row=c.seq_row(s), start=0)
    slots = a.slots(sa, before, before + n)
    for layer in range(3):
        a.k_codec.write(a.k_stores[layer], slots, xs[layer, before:], None,
                        seq_row=a.seq_row(sa), start=before)
    b.k_codec.write_channel_layers(b.k_stores, b.slots(sb, before, before + n),
                                   xs[:, before:], b.seq_row(sb), before)
    for layer in range(3):
        for key in a.k_stores[layer]:
            assert torch.equal(a.k_stores[layer][key], b.k_stores[layer][key]), (layer, key)


def test_a_prompts_keys_are_written_in_groups_of_layers(monkeypatch):
    """The triton runner's write of a prefill graph's K/V: per-channel keys of several layers
    per ``write_channel_layers`` call (groups bounded by PROMPT_KV_ROWS tokens x layers),
    values through the append kernel, the same stores as the cache's own write per layer."""
    import localmoe.backends.triton.runner as tr
    import localmoe.kernels.kv_quant_append as kqa
    from localmoe.kernels.kv_quant_append import kv_quant_append_ref

    monkeypatch.setattr(kqa, "kv_quant_append", lambda c, st, sl, x, pos, row, start=None:
                        kv_quant_append_ref(c, st, sl, x, pos, row))
    monkeypatch.setattr(tr, "PROMPT_KV_ROWS", 2 * 45)
    calls = []
    real = QuantCodec.write_channel_layers
    monkeypatch.setattr(QuantCodec, "write_channel_layers",
                        lambda self, stores, *a: calls.append(len(stores)) or real(self, stores, *a))
    n, padded = 45, 64
    a, b = _layers_cache("int4:c", sink_tokens=2), _layers_cache("int4:c", sink_tokens=2)
    ks = [_data(padded, seed=30 + i) for i in range(3)]
    vs = [_data(padded, seed=40 + i) * 0.5 for i in range(3)]
    sa = a.new_seq()
    a.reserve(sa, n)
    for layer in range(3):
        a.write(layer, sa, 0, ks[layer][:n], vs[layer][:n])
    sb = b.new_seq()
    b.reserve(sb, padded)
    tr.TritonRunner.write_prompt_kv(type("R", (), {"cache": b})(), sb, n,
                                    [(k, v) for k, v in zip(ks, vs)])
    assert calls == [2, 1]
    for sa_, sb_ in zip(a.k_stores + a.v_stores, b.k_stores + b.v_stores):
        for key in sa_:
            assert torch.equal(sa_[key], sb_[key]), key


def test_triton_backend_routes_channel_keys_to_codec_write(monkeypatch):
    """The triton runner's K/V writes (decode steps, eager prefill, a prefill graph's writes
    after the replay): per-channel keys go to the codec's own write (pages, ring), per-token
    values to the append kernel."""
    import localmoe.kernels.kv_quant_append as kqa
    from localmoe.backends.triton.runner import _write_codec

    cache = _cache("int4:c", n_ctx=64, max_seqs=1)
    calls = []
    monkeypatch.setattr(kqa, "kv_quant_append", lambda *a, **k: calls.append("kernel"))
    monkeypatch.setattr(type(cache.k_codec), "write", lambda *a, **k: calls.append("codec"))
    x, pos = _data(3), torch.arange(3)
    _write_codec(cache.k_codec, cache.k_stores[0], pos, x, pos, 0, 0)
    assert calls == ["codec"]
    assert getattr(cache.v_codec, "channel", False) is False
    _write_codec(cache.v_codec, cache.v_stores[0], pos, x, pos, 0, 0)
    assert calls == ["codec", "kernel"]


def test_decode_attention_ref_reads_channel_keys():
    from localmoe.kernels.decode_attention import decode_attention_ref
    from tests.tolerances import FP32

    cache = _cache("int4:c", n_ctx=64, max_seqs=1)
    x = _data(50, seed=14)
    sid = _fill(cache, x, [50])
    q = torch.randn(1, 4, 64)
    bt = cache.block_table(sid)[None]
    out = decode_attention_ref(q, cache.k_codec, cache.k_stores[0], cache.v_codec,
                               cache.v_stores[0], bt, torch.tensor([50]), page_size=16,
                               seq_rows=torch.tensor([cache.seq_row(sid)]))
    k, v = cache.read(0, sid, 50)
    s = torch.einsum("hqd,lhd->hql", q[0].view(2, 2, 64), k) / 8.0
    ref = torch.einsum("hql,lhd->hqd", torch.softmax(s, -1), v).reshape(4, 64)
    assert torch.allclose(out[0], ref, atol=FP32)


# ---- engine -------------------------------------------------------------------------------
@pytest.mark.parametrize("kv", ["int4:c", "k=int2:c,v=int4,sinks=4"])
def test_engine_generates_with_channel_keys(smollm2_path, kv):
    from localmoe.backends.torch_backend import TorchRunner
    from localmoe.io.loader import open_model
    from localmoe.text.tokenizer import Tokenizer

    torch.set_num_threads(1)
    mf = open_model(smollm2_path)
    tok = Tokenizer.from_model(mf)
    spec = KVSpec.parse(kv)
    r = TorchRunner(mf, n_ctx=128, kv_spec=spec, max_seqs=1)
    assert r.cache.k_codec.channel
    sid = r.new_sequence()
    ids = tok.encode("The capital of France is")
    out = []
    logits = r.forward([(sid, ids)])[0]
    for _ in range(24):                       # crosses page boundaries while decoding
        assert torch.isfinite(logits).all()
        t = int(logits.argmax())
        out.append(t)
        logits = r.forward([(sid, [t])])[0]
    assert tok.decode(out).strip(), out
    assert r.stats()["kv_format"] == str(spec)


@pytest.mark.parametrize("default", ["channel", "token"])
def test_default_key_grouping_is_filled_in_by_parse(monkeypatch, default):
    import localmoe.kv.formats as kv_formats

    monkeypatch.setattr(kv_formats, "DEFAULT_KEY_GROUPING", default)
    for text in ("int4", "int3", "int2", "k=int4,v=int2", "int4,sinks=4"):
        s = KVSpec.parse(text)
        assert s.k.grouping == default and s.v.grouping == ""
        assert str(s) == text and KVSpec.parse(str(s)) == s
    assert KVSpec.parse("int8").k.grouping == "token"          # int8 keys stay per token
    assert KVSpec.parse("fp4").k.grouping == ""
    other = "token" if default == "channel" else "channel"
    s = KVSpec.parse(f"int4:{other[0]}")
    assert s.k.grouping == other and str(s) == f"int4:{other[0]}"
    cache = PagedKVCache(_mspec(), KVSpec.parse("int4"), n_ctx=32)
    assert cache.k_codec.channel == (default == "channel") and not cache.v_codec.channel
    # a KVFormat built without parse is per token (the kernel tests build codecs that way)
    assert not QuantCodec(KVFormat.parse("int4"), 2, 64, KVSpec.parse("int4")).channel


@pytest.mark.parametrize("name", CH_FORMATS)
@pytest.mark.parametrize("kout", [0.0, 0.0625])
def test_page_rows_read_equals_per_token_gather(name, kout):
    """``dequantize_channel_slots(aligned=True)`` (whole pages read as rows, one scale/zero row
    per page) gives exactly the per-token gather's values: two interleaved sequences (pages
    not in order), key outliers, a read from a page start that ends mid-page."""
    cache = _cache(name, n_ctx=256, max_seqs=2, key_outlier_frac=kout)
    a, b = cache.new_seq(), cache.new_seq()
    xa, xb = _data(150, seed=1), _data(150, seed=2)
    for p0 in range(0, 150, 25):  # interleaved writes: each sequence's pages are scattered
        _fill(cache, xa, [25], sid=a)
        _fill(cache, xb, [25], sid=b)
    c, st = cache.k_codec, cache.k_stores[0]
    for sid in (a, b):
        for start, end in ((0, 150), (32, 119), (16, 17)):
            slots = cache.slots(sid, start, end)
            fast = c.dequantize_channel_slots(st, slots, aligned=True)
            slow = c.dequantize_channel_slots(st, slots, aligned=False)
            assert torch.equal(fast, slow)
