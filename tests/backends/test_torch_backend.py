"""Torch reference runner: cached decoding == one prefill == cache-free forward; a ragged batch
== each sequence alone; sliding windows through the paged cache; errors and bookkeeping."""

import math
from types import SimpleNamespace

import pytest
import torch

from localmoe.errors import ContextOverflowError, InvalidRequestError, LocalMoEError
from localmoe.io.spec import ModelSpec

PRESETS = ["tiny-qwen3moe", "tiny-qwen2moe", "tiny-olmoe", "tiny-mixtral", "tiny-llama"]
ATOL = 2e-3   # fp32 compute; only summation order differs between the paths compared


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    from localmoe.testing.synthetic import write_gguf

    d = tmp_path_factory.mktemp("tiny")
    return {p: write_gguf(d / f"{p}.gguf", p) for p in PRESETS}


def _runner(path, **kw):
    from localmoe.io.loader import open_model
    from localmoe.backends.registry import get_backend

    return get_backend("torch").load(open_model(path), **kw)


def _tokens(n, seed, vocab):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@pytest.mark.parametrize("preset", PRESETS)
def test_token_by_token_decode_equals_prefill(tiny_files, preset):
    r = _runner(tiny_files[preset], n_ctx=64, kv_spec="f32", max_seqs=3)
    toks = _tokens(24, 1, r.spec.vocab_size)
    a = r.new_sequence()
    full = r.forward([(a, toks)], all_logits=True)[0]
    assert full.shape == (24, r.spec.vocab_size) and full.dtype == torch.float32
    assert r.seq_len(a) == 24
    # cache-free oracle
    ref = r.model.forward_full(torch.tensor(toks))
    assert torch.allclose(full, ref, atol=ATOL), (full - ref).abs().max()
    b = r.new_sequence()
    steps = [r.forward([(b, [t])])[0] for t in toks]
    step = torch.stack(steps)
    assert torch.allclose(step, full, atol=ATOL), (step - full).abs().max()
    # last-token logits equal the last row of all_logits
    c = r.new_sequence()
    assert torch.allclose(r.forward([(c, toks)])[0], full[-1], atol=ATOL)
    assert full.std() > 0.1  # not a degenerate model


@pytest.mark.parametrize("preset", ["tiny-qwen2moe", "tiny-mixtral"])
def test_ragged_batch_equals_each_alone(tiny_files, preset):
    r = _runner(tiny_files[preset], n_ctx=64, max_seqs=6)
    V = r.spec.vocab_size
    prompts = [_tokens(n, 10 + n, V) for n in (5, 17, 1)]
    nexts = [_tokens(n, 20 + n, V) for n in (2, 1, 3)]
    batch_ids = [r.new_sequence() for _ in prompts]
    out1 = r.forward(list(zip(batch_ids, prompts)), all_logits=True)
    out2 = r.forward(list(zip(batch_ids, nexts)), all_logits=True)
    for i, (p, n) in enumerate(zip(prompts, nexts)):
        s = r.new_sequence()
        a1 = r.forward([(s, p)], all_logits=True)[0]
        a2 = r.forward([(s, n)], all_logits=True)[0]
        assert out1[i].shape == (len(p), V) and out2[i].shape == (len(n), V)
        assert torch.allclose(out1[i], a1, atol=ATOL)
        assert torch.allclose(out2[i], a2, atol=ATOL)
        r.free_sequence(s)
    assert [r.seq_len(s) for s in batch_ids] == [7, 18, 4]


def test_truncate_reuses_prefix_and_errors(tiny_files):
    r = _runner(tiny_files["tiny-qwen3moe"], n_ctx=32, max_seqs=2)
    V = r.spec.vocab_size
    toks = _tokens(20, 3, V)
    s = r.new_sequence()
    full = r.forward([(s, toks)], all_logits=True)[0]
    r.truncate(s, 12)
    assert r.seq_len(s) == 12
    again = r.forward([(s, toks[12:])], all_logits=True)[0]
    assert torch.allclose(again, full[12:], atol=ATOL)
    with pytest.raises(ContextOverflowError) as ei:
        r.forward([(s, _tokens(13, 4, V))])
    assert ei.value.n_ctx == 32 and ei.value.n_prompt == 33
    assert r.seq_len(s) == 20  # nothing appended
    with pytest.raises(InvalidRequestError):
        r.forward([(s, [V + 5])])
    with pytest.raises(InvalidRequestError):
        r.forward([])
    with pytest.raises(LocalMoEError):
        r.forward([(12345, [1])])
    st = r.stats()
    assert st["device"] == "cpu" and st["kv_bytes"] > 0 and st["kv_format"] == "f16"
    assert st["expert_bytes"] > 0
    r.free_sequence(s)
    r.close()


# ---- sliding window / gemma3-style model built in memory ----------------------------------

def _fake_gemma_file(window=4, n_layers=4, seed=0):
    spec = ModelSpec(arch="gemma3", n_layers=n_layers, d_model=32, n_heads=2, n_kv_heads=1,
                     head_dim=16, vocab_size=50, d_ff=48, rope_base=1e6, sliding_window=window,
                     sliding_window_pattern=2, norm_eps=1e-6)
    g = torch.Generator().manual_seed(seed)
    D, H, Hk, Dh, F = 32, 2, 1, 16, 48
    t = {"token_embd.weight": torch.randn(50, D, generator=g) * 0.5,
         "output_norm.weight": 1 + 0.1 * torch.randn(D, generator=g)}
    for i in range(n_layers):
        p = f"blk.{i}."
        for n, shp in [("attn_q", (H * Dh, D)), ("attn_k", (Hk * Dh, D)), ("attn_v", (Hk * Dh, D)),
                       ("attn_output", (D, H * Dh)), ("ffn_gate", (F, D)), ("ffn_up", (F, D)),
                       ("ffn_down", (D, F))]:
            t[p + n + ".weight"] = torch.randn(*shp, generator=g) / math.sqrt(shp[1])
        for n, d in [("attn_norm", D), ("ffn_norm", D), ("post_attention_norm", D),
                     ("post_ffw_norm", D), ("attn_q_norm", Dh), ("attn_k_norm", Dh)]:
            t[p + n + ".weight"] = 1 + 0.1 * torch.randn(d, generator=g)
    return SimpleNamespace(spec=spec, format="gguf", tensor_names=lambda: list(t),
                           load_tensor=lambda name, dtype=torch.float32, device="cpu":
                           t[name].to(dtype=dtype, device=device))


def test_sliding_window_cached_equals_prefill_and_window_matters():
    from localmoe.backends.torch_backend import TorchRunner

    r = TorchRunner(_fake_gemma_file(window=4), n_ctx=64, kv_spec="f32")
    assert r.spec.embed_scale == pytest.approx(math.sqrt(32)) and r.spec.act == "gelu_tanh"
    assert [r.model.layer_window(i) for i in range(4)] == [4, None, 4, None]
    toks = _tokens(19, 5, 50)
    s = r.new_sequence()
    full = r.forward([(s, toks[:7])], all_logits=True)[0]
    rest = [r.forward([(s, [t])])[0] for t in toks[7:15]]
    tail = r.forward([(s, toks[15:])], all_logits=True)[0]
    got = torch.cat([full, torch.stack(rest), tail])
    ref = r.model.forward_full(torch.tensor(toks))
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()
    # the window changes the result once the sequence is longer than it
    wide = TorchRunner(_fake_gemma_file(window=1000), n_ctx=64, kv_spec="f32")
    ref_wide = wide.model.forward_full(torch.tensor(toks))
    assert torch.allclose(ref_wide[:4], ref[:4], atol=1e-5)
    assert not torch.allclose(ref_wide[6:], ref[6:], atol=1e-3)


@pytest.mark.gpu
def test_cuda_matches_cpu(tiny_files):
    cpu = _runner(tiny_files["tiny-qwen3moe"], n_ctx=64)
    gpu = _runner(tiny_files["tiny-qwen3moe"], n_ctx=64, device="cuda")
    toks = _tokens(30, 7, cpu.spec.vocab_size)
    a = cpu.forward([(cpu.new_sequence(), toks)], all_logits=True)[0]
    b = gpu.forward([(gpu.new_sequence(), toks)], all_logits=True)[0]
    assert b.device.type == "cpu" and torch.allclose(a, b, atol=1e-2)
