"""Per-channel keys with fp16 outlier entries (KIVI pages + KVQuant dense-and-sparse): the
``koutliers=`` option, the per-page selection, the round trip, sizes, and the decode kernel
reading the same ``oidx``/``oval`` entries as for per-token keys."""

import math
import os

import pytest
import torch

import localmoe.kv.spec as kv_spec_mod
from localmoe.errors import KVCacheFormatError
from localmoe.kv.cache import PagedKVCache
from localmoe.kv.quant_codec import QuantCodec
from localmoe.kv.quant_ops import (int_error_bound, outlier_count, quantize_channel,
                                   select_channel_outliers)
from localmoe.kv.spec import KVSpec
from localmoe.io.spec import ModelSpec

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _mspec(d=64, h=2):
    return ModelSpec(arch="llama", n_layers=1, d_model=128, n_heads=4, n_kv_heads=h, head_dim=d,
                     vocab_size=10)


def _keys(t, h=2, d=64, seed=0):
    """Keys with a constant-offset channel (harmless per channel) and token spikes (harmful)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, d, generator=g) * 2.0
    x[:, :, 5] += 30.0
    for tok, ch, amp in ((3, 9, 40.0), (20, 30, -35.0), (21, 30, 20.0), (40, 2, 50.0)):
        if tok < t:
            x[tok, :, ch] += amp
    return x


# ---- the option -----------------------------------------------------------------------------
def test_parse_str_and_precedence(monkeypatch):
    s = KVSpec.parse("int4,koutliers=0.03")
    assert s.key_outlier_frac == pytest.approx(0.03) and s.outlier_frac == 0.0
    assert KVSpec.parse(str(s)) == s and "koutliers=0.03" in str(s)
    assert KVSpec.parse("k=int2:c,v=int4,koutliers=2%").key_outlier_frac == pytest.approx(0.02)
    assert KVSpec.parse("int4", key_outlier_frac=0.05).key_outliers() == pytest.approx(0.05)
    # per-token keys: outliers= applies to them unless koutliers= says otherwise
    assert KVSpec.parse("int4:t,outliers=0.04").key_outliers() == pytest.approx(0.04)
    assert KVSpec.parse("int4:t,outliers=0.04,koutliers=0").key_outliers() == 0.0
    # per-channel keys: outliers= is the values'; the keys' default comes from the table
    monkeypatch.setitem(kv_spec_mod.DEFAULT_CHANNEL_KEY_OUTLIERS, "int2", 0.125)
    assert KVSpec.parse("int2,outliers=0.04").key_outliers() == pytest.approx(0.125)
    c = PagedKVCache(_mspec(), KVSpec.parse("int2,outliers=0.04"), n_ctx=32)
    assert c.k_codec.n_out == 8 and c.v_codec.n_out == 3      # the codec follows the table
    assert KVSpec.parse("int2").bits_per_value("k", 64) == pytest.approx(2 + 2 + 3.0)
    assert KVSpec.parse("int2,koutliers=0").key_outliers() == 0.0
    assert str(KVSpec.parse("int2")) == "int2"                  # the default stays implicit
    monkeypatch.delitem(kv_spec_mod.DEFAULT_CHANNEL_KEY_OUTLIERS, "int2")
    assert KVSpec.parse("int2").key_outliers() == 0.0
    for bad in ("int4,koutliers=0.6", "int4,koutliers=-0.1", "k=f16,v=int4,koutliers=0.1",
                "int4,koutliers=x"):
        with pytest.raises(KVCacheFormatError):
            KVSpec.parse(bad)


@pytest.mark.parametrize("d,frac,n_out,bits", [(64, 2 / 64, 2, 6.75), (128, 2 / 64, 4, 6.75),
                                               (256, 1 / 256, 1, 6.09375), (64, 0.0, 0, 6.0)])
def test_bits_and_allocated_bytes_agree(d, frac, n_out, bits):
    spec = KVSpec.parse("int4", key_outlier_frac=frac)
    assert outlier_count(spec.key_outliers(), d) == n_out
    assert spec.bits_per_value("k", d) == pytest.approx(bits)
    c = QuantCodec(spec.k, 2, d, spec, block_size=16)
    assert c.channel and c.n_out == n_out
    st = c.alloc(64, "cpu")
    packed = sum(t.numel() * t.element_size() for k, t in st.items()
                 if k not in ("sink", "ring", "ring_pos"))
    assert packed * 8 == pytest.approx(bits * 64 * 2 * d)
    assert spec.bits_per_value("v", d) == pytest.approx(5.0)   # values are untouched


# ---- the selection --------------------------------------------------------------------------
def test_selection_takes_the_range_setting_spikes():
    x = _keys(16)[None]                                       # one page [1, 16, H, D]
    idx, ex = select_channel_outliers(x, 1)
    assert idx.shape == (1, 16, 2, 1) and ex.shape == x.shape
    assert (idx[0, 3, :, 0] == 9).all()                       # token 3's spike in channel 9
    assert ex.sum() == 16 * 2                                 # one entry per token and head
    assert torch.equal(ex.long().sum(-1), torch.ones(1, 16, 2, dtype=torch.long))
    # two rounds: a token whose spike is the runner-up after the first exclusion is taken next
    idx2, _ = select_channel_outliers(_keys(32)[None, 16:], 2)
    assert (idx2[0, 4] == 30).any(dim=-1).all() and (idx2[0, 5] == 30).any(dim=-1).all()


def test_selection_shrinks_every_channel_range():
    x = _keys(64, seed=3).view(4, 16, 2, 64)
    xt = x.permute(0, 2, 3, 1)
    for n_out in (1, 2, 4):
        _, ex = select_channel_outliers(x, n_out)
        et = ex.permute(0, 2, 3, 1)
        rng = xt.amax(-1) - xt.amin(-1)
        inf = float("inf")
        kept = (torch.where(et, -inf, xt).amax(-1) - torch.where(et, inf, xt).amin(-1))
        assert (kept <= rng).all()
        assert kept.sum() < rng.sum()


def test_sink_entries_already_excluded_stay_excluded():
    x = _keys(16)[None]
    pre = torch.zeros_like(x, dtype=torch.bool)
    pre[0, :2] = True                                         # two tokens left out already
    _, ex = select_channel_outliers(x, 1, pre)
    assert ex[0, :2].all() and (ex & ~pre).sum() == 14 * 2   # one new entry per other token


def test_fully_excluded_channel_falls_back_to_its_whole_range():
    x = _keys(16)[None]
    ex = torch.zeros_like(x, dtype=torch.bool)
    ex[..., 7] = True                                         # every token of channel 7
    codes, s, z = quantize_channel(x, 4, ex)
    assert torch.isfinite(s.float()).all() and torch.isfinite(z.float()).all()
    ref_codes, rs, rz = quantize_channel(x, 4)
    assert torch.equal(s[..., 7], rs[..., 7]) and torch.equal(codes[..., 7], ref_codes[..., 7])


# ---- the cache round trip -------------------------------------------------------------------
@pytest.mark.parametrize("fmt,bits", [("int4", 4), ("int3", 3), ("int2", 2)])
def test_round_trip_exact_outliers_and_bounded_rest(fmt, bits):
    x = _keys(48, seed=5)
    spec = KVSpec.parse(fmt, key_outlier_frac=2 / 64)
    cache = PagedKVCache(_mspec(), spec, n_ctx=64, block_size=16)
    sid = cache.new_seq()
    for p, n in ((0, 5), (5, 1), (6, 20), (26, 1), (27, 21)):   # pages complete over calls
        cache.reserve(sid, n)
        cache.write(0, sid, p, x[p:p + n], x[p:p + n])
        cache.commit(sid, n)
    k, _ = cache.read(0, sid, 48)
    xh = x.half().float()
    pages = xh.view(3, 16, 2, 64)
    idx, ex = select_channel_outliers(pages, 2)
    ex = ex.reshape(48, 2, 64)
    assert torch.equal(k[ex], xh[ex])                         # outliers read back exactly
    st = cache.k_stores[0]
    slots = cache.slots(sid, 0, 48)
    assert torch.equal(st["oidx"][:, slots].long(), idx.reshape(48, 2, 2).transpose(0, 1))
    bound = int_error_bound(pages.permute(0, 2, 3, 1), bits, 16, ex.view(3, 16, 2, 64)
                            .permute(0, 2, 3, 1)).permute(0, 3, 1, 2).reshape(48, 2, 64)
    err = (k - xh).abs()
    assert (err[~ex] <= bound[~ex]).all()
    # against the same cache without outliers: the spikes' pages are far better
    plain = PagedKVCache(_mspec(), KVSpec.parse(fmt, key_outlier_frac=0.0), n_ctx=64)
    s2 = plain.new_seq()
    plain.reserve(s2, 48)
    plain.write(0, s2, 0, x, x)
    k2, _ = plain.read(0, s2, 48)
    assert err.max() < (k2 - xh).abs().max() and err.mean() < (k2 - xh).abs().mean()


def test_truncated_page_keeps_its_outliers_when_completed_again():
    """A truncation inside a complete page, then new tokens: the page's earlier tokens come
    back from its codes (outliers included) and are re-quantized."""
    x = _keys(40, seed=6)
    spec = KVSpec.parse("int4", key_outlier_frac=2 / 64)
    cache = PagedKVCache(_mspec(), spec, n_ctx=64, block_size=16)
    sid = cache.new_seq()
    cache.reserve(sid, 32)
    cache.write(0, sid, 0, x[:32], x[:32])
    cache.commit(sid, 32)
    before, _ = cache.read(0, sid, 32)
    cache.truncate(sid, 22)
    cache.reserve(sid, 10)
    cache.write(0, sid, 22, x[22:32], x[22:32])              # the same tokens again
    cache.commit(sid, 10)
    after, _ = cache.read(0, sid, 32)
    assert torch.equal(after[:16], before[:16])
    assert (after[16:22] - x[16:22].half().float()).abs().max() <= \
        (before[16:22] - x[16:22].half().float()).abs().max() * 2 + 1e-3


# ---- the decode kernel reads them ----------------------------------------------------------
@pytest.mark.parametrize("kname,sink", [("int4", 0), ("int2", 4)])
def test_decode_kernel_reads_channel_key_outliers(kname, sink):
    pytest.importorskip("triton")
    from localmoe.kernels.decode_attention import decode_attention, decode_attention_ref
    from tests.tolerances import FP16, FP32_DEVICE

    dev = "cuda" if CUDA else "cpu"
    spec = KVSpec.parse(f"k={kname},v=int4,koutliers=0.04,sinks={sink}")
    cache = PagedKVCache(_mspec(64, 2), spec, n_ctx=128, block_size=16, device=dev)
    assert cache.k_codec.channel and cache.k_codec.n_out == 3
    sid = cache.new_seq()
    x = _keys(70, seed=7)
    cache.reserve(sid, 70)
    cache.write(0, sid, 0, x[:60].to(dev), x[:60].to(dev))
    for p in range(60, 70):                                   # decode across a page end
        cache.write(0, sid, p, x[p:p + 1].to(dev), x[p:p + 1].to(dev))
    cache.commit(sid, 70)
    assert cache.k_stores[0]["oval"].abs().sum() > 0
    q = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(8)).to(dev)
    bt = cache.block_table(sid)[None]
    lens = torch.tensor([70], dtype=torch.int32, device=dev)
    rows = torch.tensor([cache.seq_row(sid)], device=dev)
    args = (q, cache.k_codec, cache.k_stores[0], cache.v_codec, cache.v_stores[0], bt, lens)
    o = decode_attention(*args, page_size=16, seq_rows=rows)
    r = decode_attention_ref(*args, page_size=16, seq_rows=rows)
    assert ((o.float() - r).norm() / r.norm()).item() < FP16
    # and the reference itself is the cache's own dequantized attention
    k, v = cache.read(0, sid, 70)
    s = torch.einsum("hqd,lhd->hql", q[0].view(2, 2, 64).float(), k) / math.sqrt(64)
    ref = torch.einsum("hql,lhd->hqd", torch.softmax(s, -1), v).reshape(4, 64)
    assert torch.allclose(r[0].float(), ref, atol=FP32_DEVICE)
