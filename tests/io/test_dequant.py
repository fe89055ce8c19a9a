"""localmoe.io.dequant against gguf's reference dequantizer (bit-for-bit)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gguf

import localmoe.io.dequant as dq
from localmoe.io.dequant import SUPPORTED_QTYPES, dequantize
from localmoe.errors import ModelLoadError, UnsupportedModelError
from localmoe.testing.quants import quantize_blocks

QT = gguf.GGMLQuantizationType
QUANT_TYPES = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K,
               QT.Q6_K, QT.IQ4_NL, QT.IQ4_XS]
# byte offsets of the fp16 scale fields in each block (random bytes there could be NaN/Inf)
F16_FIELDS = {
    QT.Q4_0: [0], QT.Q4_1: [0, 2], QT.Q5_0: [0], QT.Q5_1: [0, 2], QT.Q8_0: [0],
    QT.Q2_K: [80, 82], QT.Q3_K: [108], QT.Q4_K: [0, 2], QT.Q5_K: [0, 2], QT.Q6_K: [208],
    QT.IQ4_NL: [0], QT.IQ4_XS: [0],
}
# rms error of the test quantizers (localmoe.testing.quants) on normal(0, 1) rows: 2 and 3 bits
# per weight are coarse
QUANT_RMS = {QT.Q2_K: 0.4, QT.Q3_K: 0.25}


def random_blocks(qtype, n_blocks: int, seed: int) -> np.ndarray:
    """Random block bytes with finite random fp16 scales (every bit pattern of the rest)."""
    rng = np.random.default_rng(seed)
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(n_blocks, ts), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        v = (rng.standard_normal(n_blocks) * 0.05).astype(np.float16)
        b[:, off:off + 2] = v.view(np.uint8).reshape(n_blocks, 2)
    return b


def ours(b: np.ndarray, qtype, shape) -> torch.Tensor:
    return dequantize(torch.from_numpy(np.ascontiguousarray(b)), int(qtype), shape)


def ref(b: np.ndarray, qtype, shape) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf.quants.dequantize(b, qtype), dtype=np.float32, copy=True)).reshape(shape)


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows,blocks_per_row", [(1, 1), (3, 2), (7, 5)])
def test_random_blocks_bit_exact(qtype, rows, blocks_per_row):
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    b = random_blocks(qtype, rows * blocks_per_row, seed=rows * 31 + blocks_per_row).reshape(rows, -1)
    shape = (rows, blocks_per_row * bs)
    got, want = ours(b, qtype, shape), ref(b, qtype, shape)
    assert got.dtype == torch.float32 and got.shape == shape
    assert torch.equal(got, want), f"max diff {(got - want).abs().max()}"


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
def test_quantized_floats_bit_exact_3d(qtype):
    bs, _ = gguf.GGML_QUANT_SIZES[qtype]
    x = np.random.default_rng(1).standard_normal((3, 5, 2 * bs)).astype(np.float32)
    b = quantize_blocks(x, qtype.name)
    got, want = ours(b, qtype, x.shape), ref(b, qtype, x.shape)
    assert torch.equal(got, want)
    # and it is a decent approximation of x (sanity: the layout is not scrambled)
    rel = (got - torch.from_numpy(x)).pow(2).mean().sqrt().item()
    assert rel < QUANT_RMS.get(qtype, 0.12)


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16], ids=lambda q: q.name)
def test_float_types(qtype):
    x = np.random.default_rng(2).standard_normal((4, 6)).astype(np.float32)
    if qtype == QT.F32:
        raw, want = x.view(np.uint8), x
    elif qtype == QT.F16:
        raw, want = x.astype(np.float16).view(np.uint8), x.astype(np.float16).astype(np.float32)
    else:
        raw = gguf.quants.quantize(x, QT.BF16).view(np.uint8)
        want = gguf.quants.dequantize(gguf.quants.quantize(x, QT.BF16), QT.BF16)
    got = dequantize(torch.from_numpy(raw.copy()), int(qtype), x.shape)
    assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(want)).reshape(x.shape))


def test_chunked_path_matches(monkeypatch):
    """Large tensors are processed in chunks of blocks: same result as one pass."""
    b = random_blocks(QT.Q4_K, 10, seed=3)
    whole = ours(b, QT.Q4_K, (10, 256))
    monkeypatch.setattr(dq, "_CHUNK_BLOCKS", 3)
    chunked = ours(b, QT.Q4_K, (10, 256))
    assert torch.equal(whole, chunked)


@pytest.mark.parametrize("qtype", [QT.IQ2_XXS, QT.IQ2_XS, QT.IQ3_XXS, QT.IQ1_S, QT.IQ3_S, QT.IQ2_S,
                                   QT.IQ1_M, QT.TQ1_0, QT.TQ2_0, QT.MXFP4], ids=lambda q: q.name)
def test_other_types_go_through_ggufs_reference_dequantizer(qtype):
    """The i-quants' grids, ternary and FP4 types: gguf's own dequantizer, in chunks of blocks
    (every bit pattern; random bytes can make NaN/Inf scales, compared as such)."""
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    b = np.random.default_rng(int(qtype)).integers(0, 256, size=(6, 2 * ts), dtype=np.uint8)
    with np.errstate(all="ignore"):
        want = ref(b, qtype, (6, 2 * bs))
        got = ours(b, qtype, (6, 2 * bs))
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert int(qtype) in SUPPORTED_QTYPES and dq.QTYPE_NAMES[int(qtype)] == qtype.name


def test_reference_types_chunked(monkeypatch):
    b = np.random.default_rng(5).integers(0, 256, size=(10, 66), dtype=np.uint8)
    b[:, 0:2] = np.full((10, 1), 0.01, np.float16).view(np.uint8)
    whole = ours(b, QT.IQ2_XXS, (10, 256))
    monkeypatch.setattr(dq, "_CHUNK_BLOCKS", 3)
    assert torch.equal(ours(b, QT.IQ2_XXS, (10, 256)), whole)


@pytest.mark.parametrize("qtype", [QT.Q8_1, QT.Q8_K, QT.I8, QT.F64], ids=lambda q: q.name)
def test_unsupported_type_refused_with_name_and_id(qtype):
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    with pytest.raises(UnsupportedModelError) as e:
        dequantize(torch.zeros(ts, dtype=torch.uint8), int(qtype), (bs,))
    assert qtype.name in str(e.value) and str(int(qtype)) in str(e.value)
    assert int(qtype) not in SUPPORTED_QTYPES


def test_unknown_type_id_refused():
    with pytest.raises(UnsupportedModelError, match="99"):
        dequantize(torch.zeros(32, dtype=torch.uint8), 99, (32,))


def test_wrong_byte_count():
    with pytest.raises(ModelLoadError, match="needs 34 bytes"):
        dequantize(torch.zeros(33, dtype=torch.uint8), int(QT.Q8_0), (32,))
    with pytest.raises(ModelLoadError, match="multiple of 256"):
        dequantize(torch.zeros(144, dtype=torch.uint8), int(QT.Q4_K), (2, 128))


def _smallest_per_type(path):
    from localmoe.io.loader import open_model

    m = open_model(path)
    best: dict[int, str] = {}
    for n in m.tensor_names():
        r = m.raw_tensor(n)
        if r.qtype not in best or r.data.nbytes < m.raw_tensor(best[r.qtype]).data.nbytes:
            best[r.qtype] = n
    return m, best


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_real_file_tensors_bit_exact(which, request):
    path = request.getfixturevalue(f"{which}_path")
    m, best = _smallest_per_type(path)
    assert len(best) >= 3
    for qtype, name in best.items():
        r = m.raw_tensor(name)
        got = m.load_tensor(name)
        want = ref(np.asarray(r.data), QT(qtype), r.shape)
        assert torch.equal(got, want), (name, QT(qtype).name)
    m.close()


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
def test_cuda_matches_cpu(qtype):
    bs, _ = gguf.GGML_QUANT_SIZES[qtype]
    b = random_blocks(qtype, 64, seed=5)
    cpu = ours(b, qtype, (8, 8 * bs))
    gpu = dequantize(torch.from_numpy(b).cuda(), int(qtype), (8, 8 * bs))
    assert gpu.device.type == "cuda"
    assert torch.equal(gpu.cpu(), cpu)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_every_real_tensor_bit_exact(which, request):
    """All tensors of the real files but the embedding tables (their Q8_0 blocks are covered above;
    gguf's numpy reference needs minutes for 167 M values on a small CPU)."""
    from localmoe.io.loader import open_model

    path = request.getfixturevalue(f"{which}_path")
    with open_model(path) as m:
        for name in m.tensor_names():
            if name == "token_embd.weight":
                continue
            r = m.raw_tensor(name)
            got = m.load_tensor(name)
            want = ref(np.asarray(r.data), QT(r.qtype), r.shape)
            assert torch.equal(got, want), name
