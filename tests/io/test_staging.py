"""PinnedStager: copies through a ring of reused host buffers arrive whole and unaliased (pieces
larger than a buffer, every dtype, non-contiguous sources), fall back to plain copies without
page-locked memory, and QuantTensor.from_gguf through a stager builds the same planes."""

from __future__ import annotations

import pytest
import torch

from localmoe.io.staging import PinnedStager
from localmoe.kernels import qtensor as qtm
from localmoe.kernels.qtensor import QTYPE_NAMES, QUANT_QTYPES, QuantTensor, random_gguf_blocks

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_copies_arrive_whole_and_later_copies_do_not_overwrite_them(device):
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in (0, 5, 7, 8, 23, 50)]
    srcs.append(torch.randn(6, 9, generator=g).to(torch.float16))          # 108 bytes, 2-D
    srcs.append(torch.randn(9, 6, generator=g).t())                         # not contiguous
    nbytes = sum(s.numel() * s.element_size() for s in srcs)
    with PinnedStager(device, buffer_bytes=7, n_buffers=2, n_workers=2) as st:
        outs = [st.to_device(s) for s in srcs]                 # one at a time
        assert st.bytes_staged == nbytes
        outs2 = list(st.iter_to_device(srcs))                   # read ahead across tensors
        assert st.bytes_staged == 2 * nbytes
    for s, o, o2 in zip(srcs, outs, outs2):  # checked after every copy: no buffer aliasing
        for x in (o, o2):
            assert x.device.type == device and x.dtype == s.dtype and x.shape == s.shape
            assert torch.equal(x.cpu(), s)


def test_outputs_the_caller_drops_are_not_kept_alive():
    """A tensor's chunks are freed as the caller moves on (not held until the last one)."""
    import gc
    import weakref

    srcs = [torch.full((30,), i, dtype=torch.uint8) for i in range(4)]
    srcs.insert(2, torch.empty(0, dtype=torch.float16))
    with PinnedStager("cpu", buffer_bytes=8, n_buffers=2) as st:
        it = st.iter_to_device(srcs)
        refs = []
        for _ in range(3):
            o = next(it)
            refs.append(weakref.ref(o))
            del o
        gc.collect()
        assert all(r() is None for r in refs)
        assert [int(t[0]) for t in it] == [2, 3]


def test_a_consumer_that_stops_early_leaves_the_stager_usable():
    srcs = [torch.full((30,), i, dtype=torch.uint8) for i in range(6)]
    st = PinnedStager("cpu", buffer_bytes=8, n_buffers=3)
    it = st.iter_to_device(srcs)
    assert torch.equal(next(it), srcs[0])
    it.close()                                       # waits for the reads in flight
    assert [int(t[0]) for t in st.iter_to_device(srcs[::-1])] == [5, 4, 3, 2, 1, 0]
    st.close()


def test_bad_arguments_and_no_pinned_memory():
    for bad in ({"buffer_bytes": 0}, {"n_buffers": 0}, {"n_workers": 0}):
        with pytest.raises(ValueError, match="n_workers >= 1"):
            PinnedStager("cpu", **bad)
    st = PinnedStager("cpu", buffer_bytes=4)
    if not torch.cuda.is_available():
        st.cuda = True                       # asks for page-locked memory: refused without CUDA
        src = torch.arange(10, dtype=torch.uint8)
        assert torch.equal(st.to_device(src), src)
        assert st.fallback and "page-locked" in st.fallback and st.bytes_staged == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qt", QUANT_QTYPES, ids=[QTYPE_NAMES[q] for q in QUANT_QTYPES])
def test_from_gguf_through_a_stager_builds_the_same_planes(qt, device, monkeypatch):
    bs = qtm.BLOCK_SIZES[qt][0]
    shape = (2, 5, 3 * max(bs, 32) if bs != 256 else 512)
    b = random_gguf_blocks(qt, shape, seed=qt)
    ref = QuantTensor.from_gguf(b, qt, shape, device=device)
    monkeypatch.setattr(qtm, "_CHUNK_VALUES", 2 * shape[-1])      # 5 row chunks, the last short
    with PinnedStager(device, buffer_bytes=100, n_buffers=2) as st:
        got = QuantTensor.from_gguf(b, qt, shape, device=device, stager=st, check=False)
        assert st.bytes_staged == b.nbytes
    assert got.planes.keys() == ref.planes.keys()
    for k in ref.planes:
        assert torch.equal(got.planes[k].cpu(), ref.planes[k].cpu()), k
    assert bool(got.finite_flag())
