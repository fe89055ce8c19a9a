"""The decode-path KV write reads nothing back from the device (no host-device sync per layer and
token on the GPU backends) and stores the same bytes as the position-tensor path.

``PagedKVCache.write`` passes the start position (a Python int) to the codecs as ``start=``; a
codec then decides sink/window/page membership with Python ints. Three ways to catch a
read-back: (1) tensor -> Python conversions (``item``, ``tolist``, ``bool``, ``int``, ...) are
patched to raise during one-token writes; (2) the same writes run on the ``meta`` device, where
any data read-back (``.cpu()``, ``torch.equal``, mask indexing) raises; (3) on CUDA,
``torch.cuda.set_sync_debug_mode("error")``.
"""

import pytest
import torch

from localmoe.kv.cache import PagedKVCache
from localmoe.kv.spec import KVSpec
from localmoe.io.spec import ModelSpec

# per-channel keys with and without side buffers and key outliers, per-token keys with
# outliers + sinks + window, int3 planes, fp4 values with an odd window that wraps, int2 keys
# with outliers
SPECS = [
    "k=int4:c,v=int4",
    "k=int4:c,v=int4,koutliers=0.03125,sinks=4",
    "k=int2:c,v=int2:g16,sinks=4,window=8",
    "int3:c,sinks=2,window=24",
    "int4:t,sinks=4,window=8,outliers=0.04",
    "k=int8:c,v=fp4,sinks=3,window=5",
    "k=int2:c,v=int2,koutliers=0.05,sinks=4,window=8",
]
_SYNCING = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy")


def _mspec(d=64, h=2):
    return ModelSpec(arch="llama", n_layers=1, d_model=128, n_heads=4, n_kv_heads=h, head_dim=d,
                     vocab_size=10)


def _x(t, seed, device="cpu", h=2, d=64):
    if device == "meta":
        return torch.empty(t, h, d, device="meta")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, d, generator=g) * 2.0
    x[:, :, 5] += 30.0                       # an outlier channel
    return x.to(device)


class _Synced(AssertionError):
    pass


@pytest.fixture
def no_readback(monkeypatch):
    """A context in which tensor -> Python conversions raise :class:`_Synced`."""
    import contextlib

    @contextlib.contextmanager
    def ctx():
        def boom(name):
            def f(self, *a, **k):
                raise _Synced(f"Tensor.{name} called on the decode write path")
            return f
        with monkeypatch.context() as m:
            for name in _SYNCING:
                m.setattr(torch.Tensor, name, boom(name))
            yield
    return ctx


def _prefill(cache, n, device="cpu"):
    sid = cache.new_seq()
    cache.reserve(sid, n)
    x = _x(n, 1, device)
    cache.write(0, sid, 0, x, x * 0.5 if device != "meta" else x)
    cache.commit(sid, n)
    return sid


@pytest.mark.parametrize("kv", SPECS)
@pytest.mark.parametrize("n0", [2, 13])   # decode inside the sinks / through a page end
def test_one_token_writes_do_not_read_back(kv, n0, no_readback):
    cache = PagedKVCache(_mspec(), KVSpec.parse(kv), n_ctx=64, block_size=16)
    sid = _prefill(cache, n0)
    cache.reserve(sid, 40)
    toks = [_x(1, 100 + i) for i in range(20)]
    with no_readback():
        for i, t in enumerate(toks):   # crosses position 15 (page end) and the sink boundary
            cache.write(0, sid, n0 + i, t, t * 0.5)
            cache.commit(sid, 1)


@pytest.mark.parametrize("kv", ["k=int4:c,v=int4,sinks=4", "int4:t,sinks=4,window=8"])
def test_the_readback_detector_can_fail(kv, no_readback):
    """The position-tensor path (no ``start``) converts tensors on the host; the patches must
    see it, or the test above proves nothing."""
    cache = PagedKVCache(_mspec(), KVSpec.parse(kv), n_ctx=64, block_size=16)
    sid = _prefill(cache, 15)
    cache.reserve(sid, 1)
    slots = cache.slots(sid, 15, 16)
    with no_readback(), pytest.raises(_Synced):
        cache.k_codec.write(cache.k_stores[0], slots, _x(1, 7), torch.arange(15, 16), seq_row=0)


@pytest.mark.parametrize("kv", SPECS)
def test_decode_writes_run_on_the_meta_device(kv):
    """Meta tensors hold no data: any read-back (``.cpu()``, ``torch.equal``, mask indexing,
    ``bool``) raises, so a write that completes here issued no device->host transfer."""
    cache = PagedKVCache(_mspec(), KVSpec.parse(kv), n_ctx=64, block_size=16, device="meta")
    sid = _prefill(cache, 13, device="meta")
    cache.reserve(sid, 40)
    for p in range(13, 50):
        t = _x(1, 0, "meta")
        cache.write(0, sid, p, t, t)
        cache.commit(sid, 1)
    k, v = cache.read(0, sid, 50)
    assert k.shape == (50, 2, 64) and v.shape == (50, 2, 64)
    # the old path does read back: it must fail on meta
    if cache.k_codec.channel or cache.k_codec.n_sink:
        with pytest.raises((NotImplementedError, RuntimeError)):
            cache.k_codec.write(cache.k_stores[0], cache.slots(sid, 49, 50), t,
                                torch.arange(49, 50, device="meta"), seq_row=0)


def _old_write(cache, sid, start, k, v):
    """The pre-``start`` path: codecs get only the position tensor."""
    slots = cache.slots(sid, start, start + k.shape[0])
    pos = torch.arange(start, start + k.shape[0])
    row = cache.seq_row(sid)
    cache.k_codec.write(cache.k_stores[0], slots, k, pos, seq_row=row)
    cache.v_codec.write(cache.v_stores[0], slots, v, pos, seq_row=row)


@pytest.mark.parametrize("kv", SPECS)
def test_start_path_stores_the_same_bytes(kv):
    """Prefill, decode across page ends, a ring that wraps, a truncation that cuts a page and a
    second sequence row: every store tensor and every read equal the position-tensor path."""
    spec = KVSpec.parse(kv)
    new = PagedKVCache(_mspec(), spec, n_ctx=96, max_seqs=2, block_size=16)
    old = PagedKVCache(_mspec(), spec, n_ctx=96, max_seqs=2, block_size=16)
    x = _x(96, 3)
    sids = []
    for c in (new, old):
        c.new_seq()                      # occupy row 0 so the tested sequence sits in row 1
        sids.append(c.new_seq())
    plan = [(20, None), (1, None), (1, None), (9, None), (1, None), (16, None), (3, None),
            (None, 26), (7, None), (1, None), (30, None)]   # (write n) or (truncate to n)
    for c, sid, via_start in ((new, sids[0], True), (old, sids[1], False)):
        for n, cut in plan:
            if cut is not None:
                c.truncate(sid, cut)
                continue
            p = c.seq_len(sid)
            c.reserve(sid, n)
            if via_start:
                c.write(0, sid, p, x[p:p + n], x[p:p + n] * 0.5)
            else:
                _old_write(c, sid, p, x[p:p + n], x[p:p + n] * 0.5)
            c.commit(sid, n)
    assert new.seq_len(sids[0]) == old.seq_len(sids[1]) == 64
    for a, b in ((new.k_stores[0], old.k_stores[0]), (new.v_stores[0], old.v_stores[0])):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key
    n = new.seq_len(sids[0])
    for s in (0, 5, 40):
        ka, va = new.read(0, sids[0], n, start=s)          # read passes start to the codecs
        slots = old.slots(sids[1], s, n)
        pos = torch.arange(s, n)
        kb = old.k_codec.read(old.k_stores[0], slots, positions=pos, seq_row=1)
        vb = old.v_codec.read(old.v_stores[0], slots, positions=pos, seq_row=1)
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_triton_write_kv_passes_start_to_codec_write(no_readback):
    """The triton backend's write_kv (per-channel keys and float values both go through
    ``codec.write``) issues no read-back either; run unbound on a CPU cache."""
    from localmoe.backends.torch_backend import SeqSlice
    from localmoe.backends.triton.runner import TritonRunner

    class Fake:
        _fused = True
        _step, _memo_step, _memo = 1, -1, {}
        _per_call = TritonRunner._per_call

    f = Fake()
    f.cache = PagedKVCache(_mspec(), KVSpec.parse("k=int4:c,v=f16,sinks=4"), n_ctx=64,
                           block_size=16)
    sid = _prefill(f.cache, 15)
    f.cache.reserve(sid, 2)
    with no_readback():
        for p in (15, 16):
            t = _x(1, p)
            TritonRunner.write_kv(f, 0, SeqSlice(sid, p, 0, 1), t, t)
            f.cache.commit(sid, 1)
    ref = PagedKVCache(_mspec(), f.cache.kv_spec, n_ctx=64, block_size=16)
    rs = _prefill(ref, 15)
    ref.reserve(rs, 2)
    for p in (15, 16):
        t = _x(1, p)
        ref.write(0, rs, p, t, t)
    for key in ref.k_stores[0]:
        assert torch.equal(ref.k_stores[0][key], f.cache.k_stores[0][key]), key


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv", SPECS)
def test_cuda_decode_write_is_sync_free(kv):
    cache = PagedKVCache(_mspec(), KVSpec.parse(kv), n_ctx=64, block_size=16, device="cuda")
    sid = _prefill(cache, 13, device="cuda")
    cache.reserve(sid, 20)
    toks = [_x(1, 100 + i, "cuda") for i in range(20)]
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i, t in enumerate(toks):
            cache.write(0, sid, 13 + i, t, t)
            cache.commit(sid, 1)
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    torch.cuda.synchronize()
