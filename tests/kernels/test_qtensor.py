"""QuantTensor: repacked planes round-trip bit for bit against gguf's reference dequantizer and
localmoe.io.dequant; views, joins, byte counts and bad input."""

from __future__ import annotations

from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

from localmoe.errors import ModelLoadError, UnsupportedModelError
from localmoe.io.dequant import SUPPORTED_QTYPES as TORCH_DEQUANT_QTYPES
from localmoe.io.dequant import dequantize as torch_dequantize
from localmoe.kernels.qtensor import (
    BLOCK_SIZES, FLOAT_QTYPES, QTYPE_NAMES, QUANT_QTYPES, QuantTensor, random_gguf_blocks,
)

ALL = list(QUANT_QTYPES) + list(FLOAT_QTYPES)


def _shape(qt, rows=(3, 5)):
    bs = BLOCK_SIZES[qt][0]
    k = 768 if bs == 256 else (224 if bs == 32 else 40)   # 3 super-blocks / 7 blocks
    return (*rows, k)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("qt", ALL, ids=[QTYPE_NAMES[q] for q in ALL])
def test_round_trip_matches_gguf_and_torch_dequant(qt):
    shape = _shape(qt)
    b = random_gguf_blocks(qt, shape, seed=qt)
    w = QuantTensor.from_gguf(b, qt, shape, device="cpu")
    deq = w.dequantize()
    assert deq.shape == shape and deq.dtype == torch.float32
    ref = gguf.quants.dequantize(b, gguf.GGMLQuantizationType(qt)).reshape(shape)
    assert np.array_equal(_bits(deq.numpy()), _bits(ref))
    if qt in TORCH_DEQUANT_QTYPES:
        assert torch.equal(torch_dequantize(torch.from_numpy(b.copy()), qt, shape), deq)
    # row selections and expert views decode the same rows
    flat = deq.reshape(-1, shape[-1])
    assert torch.equal(w.dequantize(slice(4, 9)), flat[4:9])
    idx = torch.tensor([7, 0, 14])
    assert torch.equal(w.dequantize(idx), flat[idx])
    assert torch.equal(w.expert(2).dequantize(), deq[2])


@pytest.mark.parametrize("qt", QUANT_QTYPES, ids=[QTYPE_NAMES[q] for q in QUANT_QTYPES])
def test_plane_bytes_and_accounting(qt):
    shape = _shape(qt, rows=(4,))
    w = QuantTensor.from_gguf(random_gguf_blocks(qt, shape, seed=1), qt, shape, device="cpu")
    bs, ts = BLOCK_SIZES[qt]
    assert w.ggml_nbytes == 4 * shape[-1] // bs * ts
    # 12 -> 16 scale bytes; IQ4_XS: 6 bytes of 6-bit scales -> 8
    extra = {"Q4_K": 4, "Q5_K": 4, "Q3_K": 4, "IQ4_XS": 2}.get(QTYPE_NAMES[qt], 0)
    assert w.nbytes == w.ggml_nbytes + 4 * (shape[-1] // 256) * extra
    for p in w.planes.values():
        assert p.shape[0] == 4 and p.is_contiguous()
    assert w.planes["q"].stride(0) * 4 % 16 == 0      # code rows start 16-byte aligned
    assert w.N == 4 and w.K == shape[-1] and w.rows == 4 and not w.is_float


def test_accepts_raw_tensor_objects_and_torch_bytes():
    shape = (2, 4, 256)
    b = random_gguf_blocks("Q4_K", shape, seed=3)
    raw = SimpleNamespace(qtype=12, shape=shape, data=b)
    a = QuantTensor.from_gguf(raw, None, None, device="cpu")
    c = QuantTensor.from_gguf(torch.from_numpy(b.copy()), "q4_k", shape, device="cpu")
    assert a.n_experts == 2 and torch.equal(a.dequantize(), c.dequantize())


def test_interleave_rows_puts_gate_and_up_side_by_side():
    shape = (3, 4, 64)
    g = QuantTensor.from_gguf(random_gguf_blocks("Q8_0", shape, seed=1), "Q8_0", shape, "cpu")
    u = QuantTensor.from_gguf(random_gguf_blocks("Q8_0", shape, seed=2), "Q8_0", shape, "cpu")
    gu = QuantTensor.interleave_rows(g, u)
    assert gu.shape == (3, 8, 64)
    d = gu.dequantize()
    assert torch.equal(d[:, 0::2], g.dequantize()) and torch.equal(d[:, 1::2], u.dequantize())
    with pytest.raises(ValueError, match="equal qtype"):
        q4 = QuantTensor.from_gguf(random_gguf_blocks("Q4_0", shape), "Q4_0", shape, "cpu")
        QuantTensor.interleave_rows(g, q4)


def test_bad_input_is_reported_with_the_tensor_name():
    # IQ2_XXS (16): 66 bytes per 256 values
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.ffn_up.*IQ2_XXS.*id 16.*torch.*llamacpp"):
        QuantTensor.from_gguf(np.zeros(66, np.uint8), 16, (1, 256), "cpu", name="blk.0.ffn_up")
    with pytest.raises(ModelLoadError, match="needs 144 bytes"):
        QuantTensor.from_gguf(np.zeros(100, np.uint8), "Q4_0", (4, 64), "cpu", name="w")
    with pytest.raises(ModelLoadError, match="multiple of 256"):
        QuantTensor.from_gguf(np.zeros(144, np.uint8), "Q4_K", (2, 128), "cpu")
    b = random_gguf_blocks("Q6_K", (2, 256), seed=0)
    b[1, 208:210] = np.array([np.inf], np.float16).view(np.uint8)
    with pytest.raises(ModelLoadError, match="output.weight.*NaN/Inf"):
        QuantTensor.from_gguf(b, "Q6_K", (2, 256), "cpu", name="output.weight")


@pytest.mark.gpu
@pytest.mark.parametrize("qt", QUANT_QTYPES, ids=[QTYPE_NAMES[q] for q in QUANT_QTYPES])
def test_round_trip_on_the_gpu(qt):
    shape = (8, 96, 2048)
    b = random_gguf_blocks(qt, shape, seed=qt)
    w = QuantTensor.from_gguf(b, qt, shape, device="cuda")
    assert w.device.type == "cuda"
    ref = gguf.quants.dequantize(b, gguf.GGMLQuantizationType(qt)).reshape(shape)
    assert np.array_equal(_bits(w.dequantize().cpu().numpy()), _bits(ref))


def test_the_iq4_code_book_is_ggmls():
    """The kernels' copy of the IQ4_NL / IQ4_XS code book (kernels may not import localmoe.io)
    is the dequantizer's and gguf's."""
    import gguf

    from localmoe.io.dequant import IQ4_VALUES as IO_VALUES
    from localmoe.kernels.qtensor import IQ4_VALUES

    assert IQ4_VALUES == IO_VALUES == tuple(gguf.quants.IQ4_NL.kvalues)
