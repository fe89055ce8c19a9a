"""Fused decode attention (Triton) vs its PyTorch twin over packed paged KV caches.

Without CUDA the kernel runs through the Triton interpreter (TRITON_INTERPRET=1, set before the
kernel module is imported) at small shapes; with CUDA the same tests run on the GPU. The twin
dequantizes with the codecs' ``read`` (so quantization error is excluded: kernel and twin see
the same packed bytes) and computes in float32; the kernel's dots take fp16 operands, hence the
fp16 tolerance (norm-wise relative 1e-2, TESTING.md; tests/tolerances.py).
"""

import math
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from localmoe.kernels.decode_attention import decode_attention, decode_attention_ref  # noqa: E402
from tests import tolerances as tol  # noqa: E402
from localmoe.kv.codec import FloatCodec  # noqa: E402
from localmoe.kv.formats import KVFormat  # noqa: E402
from localmoe.kv.quant_codec import QuantCodec  # noqa: E402
from localmoe.kv.spec import KVSpec  # noqa: E402

DEV = "cuda" if CUDA else "cpu"


def _build(kname, vname, lens, hkv, d, page, *, outlier_frac=0.0, sink=0, window=0, rotate=False,
           seed=0, chunks=None, koutliers=None):
    spec = KVSpec.parse(k=kname, v=vname, outlier_frac=outlier_frac, sink_tokens=sink,
                        window=window, key_outlier_frac=koutliers)
    B = len(lens)

    def mk(name, role):
        f = KVFormat.parse(name)
        if f.is_float:
            return FloatCodec(f, hkv, d, spec)
        return QuantCodec(f, hkv, d, spec, role=role, max_seqs=B, rotate=rotate and role == "k",
                          block_size=page)

    kc, vc = mk(kname, "k"), mk(vname, "v")
    nblk = sum(math.ceil(L / page) for L in lens) + 3
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(nblk, generator=g)
    width = max(1, max(math.ceil(L / page) for L in lens))
    bt = torch.zeros(B, width, dtype=torch.int32)
    ks, vs = kc.alloc(nblk * page, DEV), vc.alloc(nblk * page, DEV)
    off = 0
    for b, L in enumerate(lens):
        nb = math.ceil(L / page)
        bt[b, :nb] = perm[off:off + nb].int()
        off += nb
        pos = torch.arange(L)
        slots = (bt[b].long()[pos // page] * page + pos % page).to(DEV)
        k = torch.randn(L, hkv, d, generator=g) * 2
        k[:, :, 1] += 12.0                     # an outlier channel, like real keys
        v = torch.randn(L, hkv, d, generator=g)
        step = chunks or L
        for p0 in range(0, L, step):  # in pieces: per-channel keys complete pages over calls
            sl = slice(p0, min(L, p0 + step))
            for c, st, x in ((kc, ks, k), (vc, vs, v)):
                c.write(st, slots[sl], x[sl].to(DEV), pos[sl].to(DEV), seq_row=b)
    return kc, ks, vc, vs, bt.to(DEV), torch.tensor(lens, dtype=torch.int32, device=DEV)


def _run(kc, ks, vc, vs, bt, lens, qpk, page, **kw):
    B = lens.numel()
    q = torch.randn(B, kc.n_kv_heads * qpk, kc.head_dim, device=DEV)
    rows = torch.arange(B, device=DEV)
    o = decode_attention(q, kc, ks, vc, vs, bt, lens, page_size=page, seq_rows=rows, **kw)
    kw.pop("num_splits", None)
    kw.pop("block_n", None)
    r = decode_attention_ref(q, kc, ks, vc, vs, bt, lens, page_size=page, seq_rows=rows, **kw)
    assert o.shape == r.shape and o.dtype == torch.float32
    assert torch.isfinite(o).all()
    err = ((o - r).norm() / r.norm()).item()
    assert err < tol.FP16, err
    return o, r


PAIRS = [("f16", "f16"), ("int8", "int8"), ("int4", "int4"), ("int3", "int3"), ("int2", "int2"),
         ("fp4", "fp4"), ("int4", "int2"), ("int8", "int4")]


@pytest.mark.parametrize("kname,vname", PAIRS)
@pytest.mark.parametrize("qpk", [1, 4, 8])
def test_decode_matches_twin(kname, vname, qpk):
    hkv = 2 if qpk < 8 else 1
    kc, ks, vc, vs, bt, lens = _build(kname, vname, [1, 7, 33, 257], hkv, 32, 16)
    _run(kc, ks, vc, vs, bt, lens, qpk, 16, num_splits=3, block_n=16)


@pytest.mark.parametrize("group", [16, 32])
def test_decode_group_sizes(group):
    kc, ks, vc, vs, bt, lens = _build(f"int4:g{group}", f"int2:g{group}", [5, 40], 2, 32, 16)
    _run(kc, ks, vc, vs, bt, lens, 4, 16, num_splits=2, block_n=16)


@pytest.mark.parametrize("page", [4, 16, 32])
def test_page_boundaries(page):
    lens = [page - 1, page, page + 1, 2 * page + 1]
    kc, ks, vc, vs, bt, lens = _build("int4", "int4", lens, 2, 32, page, seed=page)
    _run(kc, ks, vc, vs, bt, lens, 4, page, num_splits=2, block_n=16)


def test_long_sequence_with_everything():
    """1000+ tokens, outliers, sinks, a recent window, rotated keys, a sliding window."""
    kc, ks, vc, vs, bt, lens = _build("int4", "int2", [1100, 3], 1, 32, 16, outlier_frac=0.05,
                                      sink=4, window=32, rotate=True)
    _run(kc, ks, vc, vs, bt, lens, 4, 16, num_splits=4, block_n=32)
    _run(kc, ks, vc, vs, bt, lens, 4, 16, num_splits=2, block_n=32, sliding_window=300)


@pytest.mark.parametrize("kname", ["int3", "fp4"])
def test_sinks_window_outliers(kname):
    kc, ks, vc, vs, bt, lens = _build(kname, kname, [70, 20], 2, 32, 16, outlier_frac=0.05,
                                      sink=3, window=16)
    _run(kc, ks, vc, vs, bt, lens, 2, 16, num_splits=2, block_n=16)


@pytest.mark.parametrize("name", ["int2", "int3"])
def test_long_tiles(name):
    """256-token tiles (the batch-1 launch default for 2/3-bit caches on the GPU)."""
    kc, ks, vc, vs, bt, lens = _build(name, name, [1, 300, 700], 1, 32, 16, seed=7)
    _run(kc, ks, vc, vs, bt, lens, 8, 16, num_splits=2, block_n=256)


@pytest.mark.skipif(not CUDA, reason="the device table's long-context tile at full size (GPU)")
def test_long_context_tile_of_the_table_matches_twin():
    """The default int2 cache past 4096 tokens at few pairs with the launch table's own choice
    (Qwen3-30B-A3B's heads: 4 KV heads, 8 queries each, head size 128)."""
    kc, ks, vc, vs, bt, lens = _build("int2:c", "int2", [4500, 9000], 4, 128, 16, seed=3,
                                      chunks=1000)
    _run(kc, ks, vc, vs, bt, lens, 8, 16, max_len=9000)


def test_splits_do_not_change_the_result():
    kc, ks, vc, vs, bt, lens = _build("int4", "int4", [150], 1, 32, 16)
    q = torch.randn(1, 4, 32, device=DEV)
    outs = [decode_attention(q, kc, ks, vc, vs, bt, lens, page_size=16, num_splits=n, block_n=16)
            for n in (1, 3, 10)]
    for o in outs[1:]:
        assert torch.allclose(o, outs[0], atol=tol.SPLITS, rtol=tol.SPLITS)


def test_quantized_attention_is_close_to_float():
    """End to end including quantization (random data, so relative errors of the averaged
    output are large): int8 nearly exact, int4 close, int2 worst."""
    g = torch.Generator().manual_seed(5)
    L, hkv, d = 64, 1, 32
    k = torch.randn(L, hkv, d, generator=g)
    v = torch.randn(L, hkv, d, generator=g)
    q = torch.randn(1, 4, d, generator=g).to(DEV)
    pos = torch.arange(L, device=DEV)
    bt = torch.arange(4, dtype=torch.int32, device=DEV)[None]
    lens = torch.tensor([L], dtype=torch.int32, device=DEV)
    errs = {}
    for name in ("f16", "int8", "int4", "int2"):
        spec = KVSpec.parse(name)
        f = KVFormat.parse(name)
        mk = (lambda: FloatCodec(f, hkv, d, spec)) if f.is_float else (lambda: QuantCodec(f, hkv, d, spec))
        kc, vc = mk(), mk()
        ks, vs = kc.alloc(L, DEV), vc.alloc(L, DEV)
        kc.write(ks, pos, k.to(DEV), pos)
        vc.write(vs, pos, v.to(DEV), pos)
        errs[name] = decode_attention(q, kc, ks, vc, vs, bt, lens, page_size=16, block_n=16)
    ref = errs.pop("f16")
    rel = {n: ((o - ref).norm() / ref.norm()).item() for n, o in errs.items()}
    assert rel["int8"] < tol.QUANT_INT8_VS_FLOAT < rel["int2"]
    assert rel["int8"] < rel["int4"] < rel["int2"]
    assert rel["int4"] < tol.QUANT_INT4_VS_FLOAT, rel


CHANNEL_PAIRS = [("int4:c", "int4"), ("int2:c", "int2"), ("int3:c", "int3"), ("int8:c", "int8"),
                 ("int4:c", "int2")]


@pytest.mark.parametrize("kname,vname", CHANNEL_PAIRS)
@pytest.mark.parametrize("qpk", [4, 8])
def test_channel_keys_match_twin(kname, vname, qpk):
    """Per-channel keys (KIVI; cscale/czero per page, incomplete pages in the ring)."""
    kc, ks, vc, vs, bt, lens = _build(kname, vname, [1, 7, 33, 257], 2 if qpk < 8 else 1, 32, 16,
                                      seed=qpk)
    assert kc.channel and not vc.channel
    _run(kc, ks, vc, vs, bt, lens, qpk, 16, num_splits=3, block_n=16)


@pytest.mark.parametrize("page", [4, 32])
def test_channel_keys_pages_written_in_pieces(page):
    """Pages completed over several writes (prefill chunks of 5 tokens), tiles spanning pages."""
    lens = [page - 1, 2 * page + 3, 3 * page]
    kc, ks, vc, vs, bt, lens = _build("int4:c", "int4", lens, 2, 32, page, seed=page, chunks=5)
    _run(kc, ks, vc, vs, bt, lens, 4, page, num_splits=2, block_n=32)


def test_channel_keys_with_sinks_window_and_value_outliers():
    kc, ks, vc, vs, bt, lens = _build("int2:c", "int2", [1100, 40], 1, 32, 16, outlier_frac=0.05,
                                      sink=4, window=24)
    assert kc.window == 24 and kc.n_out == 0 and vc.n_out > 0
    _run(kc, ks, vc, vs, bt, lens, 4, 16, num_splits=4, block_n=32)
    _run(kc, ks, vc, vs, bt, lens, 4, 16, num_splits=2, block_n=32, sliding_window=300)


@pytest.mark.parametrize("fused", [True, False])
def test_fused_and_separate_reduction_agree(fused):
    kc, ks, vc, vs, bt, lens = _build("int4", "int2", [150, 9, 64], 2, 32, 16)
    q = torch.randn(3, 8, 32, device=DEV)
    ref = decode_attention_ref(q, kc, ks, vc, vs, bt, lens, page_size=16)
    for n in (1, 5):
        o = decode_attention(q, kc, ks, vc, vs, bt, lens, page_size=16, num_splits=n, block_n=16,
                             fused_reduce=fused)
        assert ((o - ref).norm() / ref.norm()).item() < tol.FP16
    # the split counters are back at zero, so a second call (e.g. a graph replay) merges again
    o2 = decode_attention(q, kc, ks, vc, vs, bt, lens, page_size=16, num_splits=5, block_n=16,
                          fused_reduce=fused)
    assert torch.allclose(o, o2)


def test_rejects_bad_shapes():
    kc, ks, vc, vs, bt, lens = _build("int4", "int4", [5], 2, 32, 16)
    with pytest.raises(ValueError):
        decode_attention(torch.randn(1, 3, 32, device=DEV), kc, ks, vc, vs, bt, lens, page_size=16)
    with pytest.raises(ValueError):
        decode_attention(torch.randn(1, 4, 32, device=DEV), kc, ks, vc, vs, bt, lens, page_size=12)


@pytest.mark.slow
def test_triton_runner_decode_matches_torch_runner(smollm2_path):
    """The triton backend's runner (fused append + decode kernels; interpreter on CPU) gives
    the torch reference's logits on a real model with an int4 cache."""
    from localmoe.backends.torch_backend import TorchRunner
    from localmoe.backends.triton.runner import TritonRunner
    from localmoe.io.loader import open_model
    from localmoe.text.tokenizer import Tokenizer

    mf = open_model(smollm2_path)
    ids = Tokenizer.from_model(mf).encode("The capital of France is Paris, and the capital of")
    spec = KVSpec.parse("int4", sink_tokens=2)
    a = TorchRunner(mf, n_ctx=64, kv_spec=spec, max_seqs=1, device=DEV)
    # the attention kernels are under test: weights dequantized as the torch runner's (the
    # quantized weights' own end-to-end test is tests/backends/test_triton_quant.py)
    b = TritonRunner(mf, n_ctx=64, kv_spec=spec, max_seqs=1, device=DEV, dtype=torch.float32,
                     packed_weights=False)
    sa, sb = a.new_sequence(), b.new_sequence()
    la, lb = a.forward([(sa, ids)])[0], b.forward([(sb, ids)])[0]
    t = int(la.argmax())
    assert int(lb.argmax()) == t
    la, lb = a.forward([(sa, [t])])[0], b.forward([(sb, [t])])[0]
    assert torch.isfinite(lb).all()
    assert int(lb.argmax()) == int(la.argmax())
    # fp16 dot operands in 30 layers: a few % of the logit range, far below the int4 error
    assert (la - lb).abs().max() < tol.LOGITS_FP16_DOTS * la.abs().max()
    assert b.stats()["fused_decode_calls"] == a.spec.n_layers


@pytest.mark.parametrize("kname,vname,page,bn", [
    ("int4:c", "int4", 16, 64), ("int3:c", "int3", 16, 32), ("int2:c", "int2", 16, 16),
    ("int8:c", "int4", 4, 16), ("int4:c", "int2", 32, 16)])
def test_channel_keys_page_tiles_match_twin(kname, vname, page, bn):
    """Per-channel keys with tiles of several pages, one page, or part of a page (page 32,
    16-token tiles)."""
    kc, ks, vc, vs, bt, lens = _build(kname, vname, [1, 7, 33, 4 * page + 5], 2, 32, page,
                                      seed=1, chunks=5)
    _run(kc, ks, vc, vs, bt, lens, 4, page, num_splits=2, block_n=bn)



@pytest.mark.parametrize("kname,page,bn,n_out,qpk", [
    ("int4:c", 16, 64, 2, 4), ("int4:c", 16, 16, 3, 8), ("int2:c", 16, 32, 1, 16),
    ("int3:c", 4, 32, 4, 2), ("int4:c", 32, 16, 2, 4), ("int8:c", 8, 128, 3, 8)])
def test_channel_key_outliers_match_twin(kname, page, bn, n_out, qpk):
    """Outlier entries of per-channel keys (code 0, exact fp16 value; the kernel adds
    ``q[c] * (oval - czero[c])`` to the token's score) with tiles of several pages, one page
    and part of a page, a sliding window, and 2 to 16 query heads per kv head (the query gather
    covers only the real heads when they are fewer than the tile's 16 rows)."""
    kc, ks, vc, vs, bt, lens = _build(kname, "int4", [1, 7, 33, 4 * page + 5], 2, 32, page,
                                      seed=n_out, chunks=5, koutliers=n_out / 32)
    assert kc.channel and kc.n_out == n_out and "oidx" in ks
    _run(kc, ks, vc, vs, bt, lens, qpk, page, num_splits=2, block_n=bn)
    _run(kc, ks, vc, vs, bt, lens, qpk, page, num_splits=2, block_n=bn,
         sliding_window=2 * page + 3)
    # the corrections are needed: with the outlier values replaced the result moves
    ks2 = dict(ks, oval=torch.zeros_like(ks["oval"]))
    q = torch.randn(lens.numel(), 2 * qpk, 32, device=DEV)
    a = decode_attention(q, kc, ks, vc, vs, bt, lens, page_size=page, block_n=bn)
    b = decode_attention(q, kc, ks2, vc, vs, bt, lens, page_size=page, block_n=bn)
    assert ((a - b).norm() / a.norm()).item() > tol.MUST_DIFFER * tol.FP16


@pytest.mark.parametrize("kname,vname,d", [("int2", "int2", 64), ("int4:g16", "int3", 64),
                                           ("int8", "int4", 64), ("int2:g16", "int2", 128)])
@pytest.mark.parametrize("sz_pre", ["", "kv"])
def test_scale_zero_loads_per_tile_or_per_plane_agree(kname, vname, d, sz_pre):
    """Per-token scales and zeros loaded once per tile as [BLOCK_N, D/G] rows (split per plane in
    registers: 1, 2 or 4 column blocks) or one strided load per plane: both match the twin."""
    kc, ks, vc, vs, bt, lens = _build(kname, vname, [7, 70], 2, d, 16, seed=3)
    _run(kc, ks, vc, vs, bt, lens, 4, 16, num_splits=2, block_n=32, sz_pre=sz_pre)


@pytest.mark.parametrize("kname,vname,d,extra", [
    ("f16", "f16", 32, {}), ("int4", "int4", 64, {}), ("int2", "int2", 64, {}),
    ("int4:c", "int2", 64, {}), ("fp4", "fp4", 32, {}), ("int3", "int3", 64, {"v_join": False}),
    ("int4:c", "int4", 64, {"koutliers": 0.0625}),
    ("int2", "int2", 64, {"sink": 4, "window": 16, "outlier_frac": 0.05})])
@pytest.mark.parametrize("qpk", [1, 4, 8])
@pytest.mark.parametrize("swap", [True, False])
def test_swapped_products_match_twin(kname, vname, d, extra, qpk, swap):
    """``swap_ab`` on: scores as ``k @ q.T`` and values as ``v.T @ p.T`` with query-head tiles
    of max(8, QPK) rows, and the transposed accumulators stored as such; off: ``q @ k.T`` with
    16-row tiles. Both match the twin for every value layout (joined 2/3-bit planes, per-plane
    accumulators, int4/fp4 planes), key outliers, sinks and the recent window, and head groups
    of 1, 4 and 8, whatever :func:`default_swap` picks."""
    hkv = 2 if qpk < 8 else 1
    kw = {k: extra[k] for k in ("sink", "window", "outlier_frac", "koutliers") if k in extra}
    kc, ks, vc, vs, bt, lens = _build(kname, vname, [3, 40, 129], hkv, d, 16, seed=5, **kw)
    _run(kc, ks, vc, vs, bt, lens, qpk, 16, num_splits=2, block_n=16, swap_ab=swap,
         **{k: v for k, v in extra.items() if k == "v_join"})


@pytest.mark.parametrize("vname,d", [("int2", 64), ("int3", 128)])
@pytest.mark.parametrize("bn", [16, 32])
@pytest.mark.parametrize("swap", [True, False])
def test_joined_value_planes_only_from_32_token_tiles(vname, d, bn, swap):
    """2/3-bit values are joined into one full-width tile only over tiles of >= 32 tokens
    (16-token joined tiles computed wrong results on an H100 with triton 3.6); both tiles
    match the twin."""
    from localmoe.kernels.decode_attention import _codec_args, _constexprs

    kc, ks, vc, vs, bt, lens = _build("int2", vname, [3, 40, 129], 2, d, 16, seed=5)
    q = torch.randn(lens.numel(), 8, d, device=DEV)
    ch = dict(block_n=bn, v_join=True, swap_ab=swap, fused_reduce=False, sz_pre="",
              num_warps=2, num_stages=1)
    meta = _constexprs(q, kc, _codec_args(kc, ks)[:7], vc, _codec_args(vc, vs)[:7], ch, 16,
                       True, 2, False)
    assert meta["V_JOIN"] == (bn >= 32)
    _run(kc, ks, vc, vs, bt, lens, 4, 16, num_splits=2, block_n=bn, swap_ab=swap, v_join=True)


def test_triton_runner_forward_runs_on_its_own_gpu(monkeypatch):
    """A runner on ``cuda:1`` makes GPU 1 the current device for the whole forward call
    (Triton launches on the current device); ``cuda`` and ``cpu`` runners leave it alone.
    Checked with a recording stand-in for ``torch.cuda.device``, so no GPU is needed."""
    from localmoe.backends.triton import runner as triton_runner

    current = [None]
    seen = []

    class FakeDevice:
        def __init__(self, dev):
            self.idx = torch.device(dev).index

        def __enter__(self):
            self.prev, current[0] = current[0], self.idx

        def __exit__(self, *exc):
            current[0] = self.prev

    monkeypatch.setattr(triton_runner.torch.cuda, "device", FakeDevice)
    monkeypatch.setattr(triton_runner.TritonRunner, "_forward",
                        lambda self, batch, all_logits=False, on_device=False, tokens=None:
                        seen.append(current[0]) or "out")
    for dev, want in (("cuda:1", 1), ("cuda", None), ("cpu", None)):
        r = triton_runner.TritonRunner.__new__(triton_runner.TritonRunner)
        r.device, r._step = dev, 0
        assert triton_runner.TritonRunner.forward(r, []) == "out"
        assert seen[-1] == want and current[0] is None


def _same_act(a, b) -> bool:
    return a.wide == b.wide and torch.equal(a.q, b.q) and torch.equal(a.pairs(), b.pairs())


@pytest.mark.parametrize("fused_reduce,wide,d", [(False, False, 32), (True, False, 32),
                                                 (False, True, 32), (True, True, 32),
                                                 (False, False, 128), (False, True, 128)])
def test_quantized_output_for_the_o_projection(fused_reduce, wide, d):
    """``quant_out`` receives the output in the int8 blocks of quantize_act (written by the
    reduction, one 32-channel block per program; by a quantize launch after a fused reduce),
    bit for bit, with the residual codes of ``wide`` ("int16") activations too, and the float
    output is unchanged."""
    from localmoe.kernels.quant_gemv import QuantAct, quantize_act

    kc, ks, vc, vs, bt, lens = _build("f16", "int4", [5, 40], 2, d, 16)
    q = torch.randn(2, 4, d, device=DEV)
    kw = dict(page_size=16, num_splits=3, block_n=16, fused_reduce=fused_reduce)
    plain = decode_attention(q, kc, ks, vc, vs, bt, lens, **kw)
    qa = QuantAct.empty(2, 4 * d, DEV, wide=wide)
    out = decode_attention(q, kc, ks, vc, vs, bt, lens, quant_out=qa, **kw)
    assert torch.equal(out, plain)
    assert _same_act(qa, quantize_act(out.reshape(2, -1), wide=wide))
    c16 = FloatCodec(KVFormat.parse("f16"), 2, 16, KVSpec.parse("f16"))
    with pytest.raises(ValueError, match="multiple of 32"):
        decode_attention(torch.randn(1, 4, 16, device=DEV), c16, c16.alloc(64, DEV), c16,
                         c16.alloc(64, DEV), bt[:1], lens[:1], page_size=16, quant_out=qa)


@pytest.mark.parametrize("kname,vname,d,swap", [("f16", "f16", 32, False), ("int8", "int8", 32, True),
                                                 ("int4", "int4", 64, False), ("int4:c", "int4", 64, True),
                                                 ("f16", "fp4", 64, False), ("int2", "int2", 64, True)])
def test_one_split_writes_the_output_itself(kname, vname, d, swap):
    """With one split the split program writes the normalized output and the O projection's
    int8 blocks itself (no reduction launch; int2/int3 values, whose planes are joined, keep the
    reduction): the same output as several splits and the twin, and ``quant_out`` bit for bit
    ``quantize_act`` of it (wide, "int16", in the swapped cases), also for a sequence with no
    tokens and query heads that do not fill the tile (qpk 3)."""
    from localmoe.kernels.quant_gemv import QuantAct, quantize_act

    kc, ks, vc, vs, bt, lens = _build(kname, vname, [37, 5, 90], 2, d, 16, seed=3)
    lens[1] = 0
    q = torch.randn(3, 6, d, device=DEV)
    kw = dict(page_size=16, block_n=32, swap_ab=swap)
    qa = QuantAct.empty(3, 6 * d, DEV, wide=swap)
    one = decode_attention(q, kc, ks, vc, vs, bt, lens, num_splits=1, quant_out=qa, **kw)
    many = decode_attention(q, kc, ks, vc, vs, bt, lens, num_splits=3, **kw)
    assert torch.allclose(one, many, atol=tol.SPLITS, rtol=tol.SPLITS)
    assert torch.equal(one[1], torch.zeros_like(one[1]))
    assert _same_act(qa, quantize_act(one.reshape(3, -1), wide=swap))
    kw.pop("block_n")
    kw.pop("swap_ab")
    r = decode_attention_ref(q, kc, ks, vc, vs, bt, lens, **kw)
    err = ((one - r).norm() / r.norm()).item()
    assert err < tol.FP16, err

