"""Reference ops of the shared transformer (localmoe.model.ops) against naive
re-implementations and reference formulas."""

import math

import pytest
import torch

from localmoe.errors import UnsupportedModelError
from localmoe.model.ops import apply_rope, attention, rms_norm, rope_cos_sin, rope_inv_freq


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def test_rms_norm_formula():
    x = torch.randn(3, 8, generator=_g())
    w = torch.randn(8, generator=_g(1))
    eps = 1e-6
    ref = torch.stack([r / math.sqrt(float((r * r).mean()) + eps) for r in x]) * w
    assert torch.allclose(rms_norm(x, w, eps), ref, atol=1e-6)
    # half precision input comes back in half precision
    assert rms_norm(x.half(), w, eps).dtype == torch.float16


def _rope_naive(x, pos, base, style):
    """Rotate each pair explicitly (RoFormer eq. 34) — per token, per head, per pair."""
    T, H, D = x.shape
    out = x.clone()
    for t in range(T):
        for i in range(D // 2):
            th = pos[t] * base ** (-2 * i / D)
            c, s = math.cos(th), math.sin(th)
            a, b = (2 * i, 2 * i + 1) if style == "norm" else (i, i + D // 2)
            xa, xb = x[t, :, a].clone(), x[t, :, b].clone()
            out[t, :, a] = xa * c - xb * s
            out[t, :, b] = xb * c + xa * s
    return out


@pytest.mark.parametrize("style", ["norm", "neox"])
def test_rope_matches_pairwise_rotation(style):
    x = torch.randn(5, 2, 8, generator=_g())
    pos = torch.tensor([0, 1, 7, 100, 3000])
    inv, ms = rope_inv_freq(8, 10000.0)
    assert ms == 1.0
    cos, sin = rope_cos_sin(pos, inv)
    got = apply_rope(x, cos, sin, style)
    assert torch.allclose(got, _rope_naive(x, pos.tolist(), 10000.0, style), atol=1e-4)
    assert torch.allclose(got[0], x[0])  # position 0 is the identity


def test_rope_norm_on_permuted_weights_equals_neox():
    """GGUF llama stores Q/K rows permuted (HF half-split -> interleaved pairs); NORM rope on the
    permuted layout must equal NEOX rope on the HF layout, permuted the same way."""
    D = 16
    x_hf = torch.randn(4, 3, D, generator=_g())
    perm = torch.stack([torch.arange(D // 2), torch.arange(D // 2) + D // 2], 1).flatten()
    x_gguf = x_hf[..., perm]
    cos, sin = rope_cos_sin(torch.arange(4) * 13, rope_inv_freq(D, 1e4)[0])
    assert torch.allclose(apply_rope(x_gguf, cos, sin, "norm"),
                          apply_rope(x_hf, cos, sin, "neox")[..., perm], atol=1e-5)


def test_rope_relative_position_property_and_partial_dims():
    D, R = 16, 8
    q = torch.randn(1, 1, D, generator=_g())
    k = torch.randn(1, 1, D, generator=_g(1))
    inv, _ = rope_inv_freq(R, 1e4)

    def rot(x, p):
        c, s = rope_cos_sin(torch.tensor([p]), inv)
        return apply_rope(x, c, s, "neox")

    d1 = (rot(q, 10) * rot(k, 3)).sum()
    d2 = (rot(q, 107) * rot(k, 100)).sum()
    assert torch.allclose(d1, d2, atol=1e-4)
    assert torch.equal(rot(q, 5)[..., R:], q[..., R:])  # only the first R dims rotate


def test_rope_scaling_linear_and_yarn():
    inv, _ = rope_inv_freq(64, 1e4)
    lin, ms = rope_inv_freq(64, 1e4, {"type": "linear", "factor": 4.0})
    assert ms == 1.0 and torch.allclose(lin, inv / 4)
    yarn, ms = rope_inv_freq(64, 1e4, {"type": "yarn", "factor": 4.0,
                                        "original_context_length": 4096})
    assert ms == pytest.approx(0.1 * math.log(4.0) + 1.0)
    assert torch.allclose(yarn[:4], inv[:4])            # high frequencies extrapolate
    assert torch.allclose(yarn[-4:], inv[-4:] / 4)      # low frequencies interpolate
    with pytest.raises(UnsupportedModelError):
        rope_inv_freq(64, 1e4, {"type": "su", "factor": 2.0})


def test_yarn_matches_transformers():
    tf = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = tf.LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64,
                         max_position_embeddings=32768,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                          "original_max_position_embeddings": 8192})
    ref_inv, ref_af = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    inv, ms = rope_inv_freq(64, 1e6, {"type": "yarn", "factor": 4.0,
                                      "original_context_length": 8192})
    assert torch.allclose(inv, ref_inv.float(), rtol=1e-5)
    assert ms == pytest.approx(ref_af)


def _attention_naive(q, k, v, q_start, scale, window=None, softcap=None):
    T, H, D = q.shape
    L, Hkv, Dv = v.shape
    out = torch.zeros(T, H, Dv, dtype=torch.float64)
    for t in range(T):
        p = q_start + t
        for h in range(H):
            kh = h // (H // Hkv)
            keys = [j for j in range(L) if j <= p and (window is None or p - j < window)]
            s = torch.tensor([float(q[t, h].double() @ k[j, kh].double()) * scale for j in keys])
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            w = torch.softmax(s, 0)
            out[t, h] = sum(w[i] * v[j, kh].double() for i, j in enumerate(keys))
    return out


@pytest.mark.parametrize("q_start,T,window,softcap", [(0, 7, None, None), (5, 3, None, None),
                                                     (0, 9, 4, None), (6, 1, 3, 20.0)])
def test_attention_matches_naive(q_start, T, window, softcap):
    H, Hkv, D, Dv = 4, 2, 8, 6
    L = q_start + T
    q = torch.randn(T, H, D, generator=_g())
    k = torch.randn(L, Hkv, D, generator=_g(1))
    v = torch.randn(L, Hkv, Dv, generator=_g(2))
    got = attention(q, k, v, q_start=q_start, scale=0.3, window=window, softcap=softcap)
    ref = _attention_naive(q, k, v, q_start, 0.3, window, softcap)
    assert got.shape == (T, H, Dv)
    assert torch.allclose(got.double(), ref, atol=1e-5)

