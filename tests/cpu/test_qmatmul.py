"""Packed GGUF weights on the CPU (localmoe.cpu.qmatmul) against the plain float32 path.

* packing: every packable block type, random bit patterns and real quantizer output, dequantizes
  bit-for-bit like localmoe.io.dequant (and gguf's reference dequantizer);
* the matmul kernel equals ``x @ dequant(W).T`` to float32 summation noise (relative Frobenius
  error <= 1e-5) for awkward sizes, 1..33 rows of x (kernel and dequantize+BLAS paths), fused
  parts of different kinds;
* the C RMSNorm and decode attention equal the torch versions to float32 noise;
* whole models: a runner with packed weights gives the same logits as ``packed_weights=False``
  (max |d logit| <= 1e-3 + REL * max |logit| with REL = REL_DLOGIT_TINY on the tiny synthetic
  files and REL_DLOGIT_REAL on SmolLM2 and Gemma-3; same greedy argmax), prefill and
  token-by-token decode.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import localmoe.cpu.qmatmul as cq
import localmoe.io.dequant as dq

from tests import tolerances as tol

pytestmark = pytest.mark.skipif(cq.kernel_status() is not None,
                                reason=f"packed CPU kernel unavailable: {cq.kernel_status()}")

QTYPES = {"Q4_0": dq.Q4_0, "Q4_1": dq.Q4_1, "Q5_0": dq.Q5_0, "Q5_1": dq.Q5_1, "Q8_0": dq.Q8_0,
          "Q4_K": dq.Q4_K, "Q5_K": dq.Q5_K, "Q6_K": dq.Q6_K, "Q2_K": dq.Q2_K, "Q3_K": dq.Q3_K,
          "IQ4_NL": dq.IQ4_NL, "IQ4_XS": dq.IQ4_XS}
# fp16 scale fields of each block layout (byte offsets)
_SCALE_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
                 "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "Q2_K": [80, 82], "Q3_K": [108],
                 "IQ4_NL": [0], "IQ4_XS": [0]}
MAX_REL = tol.FP32      # kernel vs x @ W.T, relative Frobenius norm (float32 summation order)
# packed vs float runner, max |d logit| relative to the largest |logit| (float32 summation order
# differences, amplified through the layers; measured: tiny 3-4e-4 absolute, SmolLM2 ~1.6e-4
# relative; Gemma-3-270M 1.2e-3 (0.077 of 64.7) on a Sapphire Rapids VM, where torch's float
# runner sums in another order), on top of an absolute 1e-3
ABS_DLOGIT = 1e-3
REL_DLOGIT_TINY = 3e-5
REL_DLOGIT_REAL = 3e-3


def _random_blocks(qtype: str, n_rows: int, k: int, seed: int) -> np.ndarray:
    """Random bytes (every bit pattern of values and sub-block scales) with finite, moderate
    fp16 scales, ``[n_rows, row_bytes]``."""
    bs, ts = dq.BLOCK_SIZES[QTYPES[qtype]]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(n_rows * k // bs, ts), dtype=np.uint8)
    for off in _SCALE_FIELDS[qtype]:
        d = (rng.standard_normal(b.shape[0]) * 0.02).astype(np.float16)
        b[:, off:off + 2] = d.view(np.uint8).reshape(-1, 2)
    return b.reshape(n_rows, -1)


def _quantized_blocks(qtype: str, n_rows: int, k: int, seed: int) -> np.ndarray:
    from localmoe.testing.quants import quantize_blocks

    x = np.random.default_rng(seed).standard_normal((n_rows, k)).astype(np.float32)
    return quantize_blocks(x, qtype)


def _ref(blocks: np.ndarray, qtype: str, shape) -> torch.Tensor:
    return dq.dequantize(torch.from_numpy(blocks.copy()).reshape(-1), QTYPES[qtype], shape)


@pytest.mark.parametrize("qtype", list(QTYPES))
@pytest.mark.parametrize("source", ["random", "quantized"])
def test_pack_dequantizes_bit_exactly(qtype, source):
    import gguf

    n, k = 33, 512
    make = _random_blocks if source == "random" else _quantized_blocks
    blocks = make(qtype, n, k, seed=1)
    pw = cq.pack_gguf(blocks, QTYPES[qtype], (n, k))
    ref = _ref(blocks, qtype, (n, k))
    assert torch.equal(pw.dequantize(), ref)
    gg = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype])
    assert np.array_equal(pw.dequantize().numpy(), gg.astype(np.float32))
    rows = torch.tensor([5, 0, 32, 5])
    assert torch.equal(pw.dequantize(rows), ref[rows])
    # packed bytes: 4-bit types hold half a byte per value, the rest one byte
    assert pw.q.numel() * pw.q.element_size() == n * k // (2 if pw.kind == "q4" else 1)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0", "Q6_K"])
def test_pack_large_tensor_in_chunks(qtype):
    n, k = 2500, 2048          # > 64k blocks: packed in several row chunks
    blocks = _random_blocks(qtype, n, k, seed=3)
    pw = cq.pack_gguf(blocks, QTYPES[qtype], (n, k))
    assert torch.equal(pw.dequantize(), _ref(blocks, qtype, (n, k)))


@pytest.mark.parametrize("qtype", list(QTYPES))
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 33, 64, 65])
def test_matmul_matches_float(qtype, m):
    n, k = 257, 768
    blocks = _random_blocks(qtype, n, k, seed=2)
    lin = cq.PackedLinear([cq.pack_gguf(blocks, QTYPES[qtype], (n, k))])
    w = _ref(blocks, qtype, (n, k))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    y, r = lin(x), x @ w.t()
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert ((y - r).norm() / r.norm()).item() <= MAX_REL


def test_fused_parts_of_different_kinds_keep_column_order():
    k = 512
    specs = [("Q4_K", 64), ("Q4_1", 32), ("Q6_K", 48), ("Q8_0", 16), ("Q5_0", 8)]
    parts, ws = [], []
    for i, (qt, n) in enumerate(specs):
        b = _random_blocks(qt, n, k, seed=10 + i)
        parts.append(cq.pack_gguf(b, QTYPES[qt], (n, k)))
        ws.append(_ref(b, qt, (n, k)))
    lin = cq.PackedLinear(parts)
    # q4 + q4 fuse, q8/16 alone, q8/32 + q8/32 fuse
    assert [(p.kind, p.group, p.shape[0]) for p in lin.parts] == [
        ("q4", 32, 96), ("q8", 16, 48), ("q8", 32, 24)]
    w = torch.cat(ws)
    assert torch.equal(lin.dequantize(), w)
    for m in (1, 3, 12):
        x = torch.randn(m, k)
        r = x @ w.t()
        assert ((lin(x) - r).norm() / r.norm()).item() <= MAX_REL
    assert lin.nbytes < w.numel() * 4 / 2.5


def test_rms_norm_matches_torch():
    from localmoe.model.ops import rms_norm

    for shape in [(1, 576), (7, 640), (3, 4, 256), (2, 13)]:
        x = torch.randn(shape) * 3
        w = torch.randn(shape[-1])
        for ww in (w, None):
            r = rms_norm(x, ww, 1e-6)
            got = cq.rms_norm(x, ww, 1e-6)
            assert (got - r).abs().max().item() <= tol.FP32 * max(1.0, r.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("h,hkv,d,length", [(9, 3, 64, 1), (9, 3, 64, 77), (4, 1, 256, 300),
                                            (8, 8, 24, 5)])
def test_decode_attention_matches_torch(dtype, h, hkv, d, length):
    from localmoe.model.ops import attention

    g = torch.Generator().manual_seed(length)
    q = torch.randn(1, h, d, generator=g)
    k = torch.randn(length, hkv, d, generator=g).to(dtype)
    v = torch.randn(length, hkv, d, generator=g).to(dtype)
    got = cq.attention_decode(q, k, v, 0.3)
    ref = attention(q, k.float(), v.float(), q_start=length - 1, scale=0.3)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= tol.FP32


@pytest.mark.parametrize("value", ["0", "off", " No "])
def test_kernel_can_be_disabled(monkeypatch, value):
    monkeypatch.setattr(cq, "_lib_tried", False)
    monkeypatch.setattr(cq, "_lib", None)
    monkeypatch.setattr(cq, "_lib_reason", None)
    monkeypatch.setenv("LOCALMOE_CPU_QMATMUL", value)
    assert "LOCALMOE_CPU_QMATMUL" in cq.kernel_status()


def test_kernel_says_why_it_cannot_build(monkeypatch):
    """The C source ships as package data; no compiler, or no source in the install, gives a
    reason (and the float path) instead of an error."""
    assert "lm_qmatmul" in cq._c_source() and "lm_attn_decode" in cq._c_source()
    for env, patch, want in ((("CC", ""), ("_C_FILE", cq._C_FILE), "no C compiler"),
                             (("CC", "cc"), ("_C_FILE", "absent.c"), "absent.c is missing")):
        monkeypatch.setattr(cq, "_lib_tried", False)
        monkeypatch.setattr(cq, "_lib", None)
        monkeypatch.setattr(cq, "_lib_reason", None)
        monkeypatch.setenv(*env)
        monkeypatch.setattr(cq, *patch)
        monkeypatch.setattr(cq.shutil, "which", lambda name: None)
        assert want in cq.kernel_status()


# ---- whole models ------------------------------------------------------------------------

def _runner(path, packed, **kw):
    from localmoe.io.loader import open_model
    from localmoe.backends.registry import get_backend

    return get_backend("torch").load(open_model(path), n_ctx=96, max_seqs=2,
                                     packed_weights=packed, **kw)


def _logits(runner, toks, n_prefill):
    """Logits of a prefill of ``n_prefill`` tokens, then token-by-token decode of the rest."""
    sid = runner.new_sequence()
    out = [runner.forward([(sid, toks[:n_prefill])], all_logits=True)[0]]
    for t in toks[n_prefill:]:
        out.append(runner.forward([(sid, [t])])[0][None])
    return torch.cat(out)


def _compare(path, n_tok, bound, vocab=None):
    torch.manual_seed(0)
    fl = _runner(path, False)
    toks = torch.randint(0, vocab or fl.spec.vocab_size, (n_tok,)).tolist()
    a = _logits(fl, toks, n_tok // 2)
    fl.close()
    pk = _runner(path, None)
    assert pk.model.packed
    b = _logits(pk, toks, n_tok // 2)
    st = pk.stats()
    pk.close()
    d, scale = (a - b).abs().max().item(), a.abs().max().item()
    print(f"\n{path.name}: max|dlogit| packed vs float = {d:.2e} (logit scale {scale:.1f}, "
          f"relative {d / scale:.1e}), weights {st['weights_bytes'] / 1e6:.1f} MB")
    assert d <= ABS_DLOGIT + bound * scale
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    return st


@pytest.mark.parametrize("preset,quant", [("tiny-llama", None), ("tiny-qwen3moe", None),
                                          ("tiny-qwen2moe", None), ("tiny-llama", "q4_0"),
                                          ("tiny-llama", "q4_1"), ("tiny-qwen3", "q5_1"),
                                          ("tiny-qwen2", "q5_k")])
def test_packed_runner_matches_float_runner_tiny(tmp_path, preset, quant):
    from localmoe.testing.synthetic import write_gguf

    path = write_gguf(tmp_path / f"{preset}.gguf", preset, quant=quant)
    _compare(path, 24, REL_DLOGIT_TINY)


@pytest.mark.slow
def test_packed_runner_matches_float_runner_smollm2(smollm2_path):
    st = _compare(smollm2_path, 40, REL_DLOGIT_REAL)
    assert st["weights_bytes"] < 0.25 * 651e6   # float32: ~651 MB


@pytest.mark.slow
def test_packed_runner_matches_float_runner_gemma3(gemma3_path):
    _compare(gemma3_path, 24, REL_DLOGIT_REAL)


def test_packed_option_is_off_where_it_cannot_apply(tmp_path):
    from localmoe.testing.synthetic import write_gguf

    path = write_gguf(tmp_path / "tiny-llama.gguf", "tiny-llama")
    assert not _runner(path, False).model.packed
    assert not _runner(path, None, numerics="ggml").model.packed
    with pytest.raises(ValueError, match="ggml"):
        _runner(path, True, numerics="ggml")
    assert _runner(path, True).model.packed


@pytest.mark.parametrize("kv", ["bf16", "k=bf16,v=f16", "k=f16,v=bf16"])
def test_packed_runner_decodes_with_caches_the_c_kernel_does_not_take(tmp_path, kv):
    """bf16 (or mixed) float caches decode through the torch attention, same logits."""
    from localmoe.kv.spec import KVSpec
    from localmoe.testing.synthetic import write_gguf

    path = write_gguf(tmp_path / "t.gguf", "tiny-llama")
    kw = dict(p.split("=") for p in kv.split(",")) if "=" in kv else {"kv": kv}
    spec = KVSpec.parse(**kw)
    torch.manual_seed(0)
    toks = torch.randint(0, 200, (12,)).tolist()
    fl = _runner(path, False, kv_spec=spec)
    a = _logits(fl, toks, 6)
    pk = _runner(path, None, kv_spec=spec)
    assert pk.model.packed
    b = _logits(pk, toks, 6)
    assert torch.isfinite(b).all()
    assert (a - b).abs().max().item() <= ABS_DLOGIT + REL_DLOGIT_TINY * a.abs().max().item()
