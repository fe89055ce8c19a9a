"""GGUF loader: metadata, ModelSpec per architecture, tensor shapes/bytes, splits, legacy experts."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import gguf

from localmoe.errors import ModelLoadError, UnsupportedModelError
from localmoe.io.loader import open_model
from localmoe.io.model_file import ModelFile, RawTensor, TensorInfo
from localmoe.testing.synthetic import PRESETS, write_gguf

TINY = [n for n in PRESETS if n.startswith("tiny-")]


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tiny")
    return {n: write_gguf(d / f"{n}.gguf", n, seed=1) for n in TINY}


# --- against gguf.GGUFReader (the package's own parser) ------------------------------------

def _reader_value(f):
    v = f.contents()
    return v


@pytest.mark.parametrize("preset", ["tiny-qwen2moe", "tiny-llama"])
def test_metadata_and_tensors_match_gguf_reader(tiny_files, preset):
    path = tiny_files[preset]
    m = open_model(path)
    r = gguf.GGUFReader(path)
    keys = [k for k in r.fields if not k.startswith("GGUF.")]
    assert sorted(keys) == sorted(m.metadata)
    for k in keys:
        want = _reader_value(r.fields[k])
        got = m.metadata[k]
        if isinstance(want, float):
            assert got == pytest.approx(want, rel=1e-7), k
        else:
            assert got == want, k
    assert sorted(t.name for t in r.tensors) == sorted(m.tensor_names())
    for t in r.tensors:
        info = m.tensor_info(t.name)
        assert info.qtype == t.tensor_type.name
        assert info.shape == tuple(reversed([int(x) for x in t.shape]))
        assert info.nbytes == t.n_bytes
        raw = m.raw_tensor(t.name)
        assert raw.qtype == int(t.tensor_type)
        assert np.array_equal(raw.data.reshape(-1).view(np.uint8), np.asarray(t.data).reshape(-1).view(np.uint8))
    m.close()


# --- real files ----------------------------------------------------------------------------

def test_smollm2_spec(smollm2_path):
    m = open_model(smollm2_path)
    s = m.spec
    assert isinstance(m, ModelFile) and m.format == "gguf"
    assert (s.arch, s.n_layers, s.d_model, s.n_heads, s.n_kv_heads, s.head_dim) == ("llama", 30, 576, 9, 3, 64)
    assert (s.vocab_size, s.d_ff, s.n_ctx_train) == (49152, 1536, 8192)
    assert s.rope_style == "norm" and s.rope_base == 100000.0
    assert s.tie_embeddings and not s.is_moe and s.norm_eps == pytest.approx(1e-5)
    assert m.chat_template and "im_start" in m.chat_template
    assert len(m.metadata["tokenizer.ggml.tokens"]) == 49152
    assert m.metadata["tokenizer.ggml.model"] == "gpt2"
    assert len(m.tensor_names()) == 272
    q = m.tensor_info("blk.0.attn_q.weight")
    assert q == TensorInfo("blk.0.attn_q.weight", "Q4_1", (576, 576), 576 * 576 // 32 * 20)
    k = m.load_tensor("blk.0.attn_k.weight")
    assert k.shape == (192, 576) and k.dtype == torch.float32
    e = m.load_tensor("token_embd.weight", dtype=torch.bfloat16)
    assert e.shape == (49152, 576) and e.dtype == torch.bfloat16
    raw = m.raw_tensor("blk.0.ffn_down.weight")
    assert isinstance(raw, RawTensor) and raw.shape == (576, 1536) and raw.data.shape == (576, 1536 // 32 * 20)
    assert raw.data.dtype == np.uint8 and not raw.data.flags.writeable  # zero-copy view of the mapping
    m.close()


def test_gemma3_spec(gemma3_path):
    with open_model(gemma3_path) as m:
        s = m.spec
        assert (s.arch, s.n_layers, s.d_model, s.n_heads, s.n_kv_heads, s.head_dim) == ("gemma3", 18, 640, 4, 1, 256)
        assert s.vocab_size == 262144 and s.d_ff == 2048
        assert s.sliding_window == 512 and s.sliding_window_pattern == 6
        assert s.rope_base == 1e6 and s.rope_base_local == 10000.0 and s.rope_style == "neox"
        assert s.qk_norm and s.post_norms and s.act == "gelu_tanh"
        assert s.embed_scale == pytest.approx(math.sqrt(640)) and s.tie_embeddings
        assert s.layer_window(5) is None and s.layer_window(0) == 512
        assert m.tensor_info("blk.0.attn_q.weight").shape == (1024, 640)
        assert m.tensor_info("blk.0.ffn_down.weight").qtype == "Q6_K"


# --- synthetic MoE files -------------------------------------------------------------------

EXPECT = {
    "tiny-qwen3moe": dict(arch="qwen3moe", rope_style="neox", qk_norm=True, qk_norm_full=False, norm_topk_prob=True,
                          n_shared_experts=0, shared_expert_gate=False, attn_bias=False),
    "tiny-qwen2moe": dict(arch="qwen2moe", rope_style="neox", qk_norm=False, norm_topk_prob=False,
                          n_shared_experts=1, d_ff_shared=512, shared_expert_gate=True, attn_bias=True),
    "tiny-olmoe": dict(arch="olmoe", rope_style="neox", qk_norm=True, qk_norm_full=True, norm_topk_prob=False,
                       n_shared_experts=0, attn_bias=False),
    "tiny-mixtral": dict(arch="llama", rope_style="norm", qk_norm=False, norm_topk_prob=True, n_experts=4, d_ff=0),
    "tiny-llama": dict(arch="llama", rope_style="norm", n_experts=0, d_ff=512, tie_embeddings=True),
    "tiny-qwen3": dict(arch="qwen3", rope_style="neox", qk_norm=True, attn_bias=False, n_experts=0, d_ff=512,
                       tie_embeddings=False, rope_base=1e6),
    "tiny-qwen2": dict(arch="qwen2", rope_style="neox", qk_norm=False, attn_bias=True, n_experts=0, d_ff=512,
                       tie_embeddings=True),
}


@pytest.mark.parametrize("preset", TINY)
def test_tiny_spec(tiny_files, preset):
    p = PRESETS[preset]
    with open_model(tiny_files[preset]) as m:
        s = m.spec
        assert (s.n_layers, s.d_model, s.n_heads, s.n_kv_heads, s.head_dim) == (
            p.n_layers, p.d_model, p.n_heads, p.n_kv_heads, p.head_dim)
        assert s.vocab_size == len(m.metadata["tokenizer.ggml.tokens"])
        assert s.gating == "softmax"
        for k, v in EXPECT[preset].items():
            assert getattr(s, k) == v, k
        if p.is_moe:
            assert (s.n_experts, s.top_k, s.d_ff_expert) == (p.n_experts, p.top_k, p.d_ff_expert)
        assert m.chat_template is not None


def test_moe_tensor_shapes_torch_order(tiny_files):
    p = PRESETS["tiny-qwen3moe"]
    E, F, D = p.n_experts, p.d_ff_expert, p.d_model
    with open_model(tiny_files["tiny-qwen3moe"]) as m:
        assert m.tensor_info("blk.1.ffn_gate_exps.weight").shape == (E, F, D)
        assert m.tensor_info("blk.1.ffn_up_exps.weight").shape == (E, F, D)
        assert m.tensor_info("blk.1.ffn_down_exps.weight").shape == (E, D, F)
        assert m.tensor_info("blk.1.ffn_gate_inp.weight").shape == (E, D)
        w = m.load_tensor("blk.1.ffn_down_exps.weight")
        assert w.shape == (E, D, F)
        raw = m.raw_tensor("blk.1.ffn_down_exps.weight")
        # expert e = contiguous slice e: dequantizing data[e] alone equals w[e]
        from localmoe.io.dequant import dequantize

        e3 = dequantize(torch.from_numpy(np.array(raw.data[3])), raw.qtype, (D, F))
        assert torch.equal(e3, w[3])
        assert m.tensor_info("blk.0.attn_q.weight").shape == (p.n_heads * p.head_dim, D)
        assert m.tensor_info("blk.0.attn_q_norm.weight").shape == (p.head_dim,)


def test_metadata_overrides_gating_and_norm(tmp_path):
    p = replace(PRESETS["tiny-qwen2moe"], extra_kv={"{arch}.expert_gating_func": 2, "{arch}.expert_weights_norm": True,
                                                    "{arch}.expert_weights_scale": 2.5})
    with open_model(write_gguf(tmp_path / "x.gguf", p)) as m:
        assert m.spec.gating == "sigmoid" and m.spec.norm_topk_prob is True
        assert m.spec.expert_weights_scale == 2.5


def test_f32_roundtrip_values(tmp_path):
    """Values written as F32 come back exactly (loader adds nothing, reorders nothing)."""
    path = write_gguf(tmp_path / "f.gguf", "tiny-olmoe", seed=7, quant="f32")
    r = gguf.GGUFReader(path)
    with open_model(path) as m:
        for t in r.tensors:
            got = m.load_tensor(t.name)
            want = torch.from_numpy(np.array(t.data, dtype=np.float32))
            assert got.shape == want.shape and torch.equal(got, want), t.name


# --- split files ---------------------------------------------------------------------------

def test_split_open_from_any_shard(tmp_path):
    single = write_gguf(tmp_path / "one" / "m.gguf", "tiny-qwen3moe", seed=3)
    first = write_gguf(tmp_path / "split" / "m.gguf", "tiny-qwen3moe", seed=3, split_max_tensors=10)
    shards = sorted(first.parent.glob("m-*-of-*.gguf"))
    assert len(shards) == 3 and first == shards[0]
    ref = open_model(single)
    for s in shards:
        with open_model(s) as m:
            assert sorted(m.tensor_names()) == sorted(ref.tensor_names())
            assert m.spec == replace(ref.spec)
            for n in ("token_embd.weight", "blk.1.ffn_up_exps.weight", "output.weight"):
                assert torch.equal(m.load_tensor(n), ref.load_tensor(n))
    ref.close()


# --- legacy per-expert Mixtral tensors -------------------------------------------------------

def test_legacy_mixtral_per_expert_tensors_are_stacked(tmp_path, tiny_files):
    src = open_model(tiny_files["tiny-mixtral"])
    out = tmp_path / "legacy.gguf"
    w = gguf.GGUFWriter(out, "llama")
    for k, v in src.metadata.items():
        if k == "general.architecture":
            continue
        if isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        elif isinstance(v, str):
            w.add_string(k, v)
        elif k == "tokenizer.ggml.token_type":
            w.add_key_value(k, v, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
        else:
            w.add_array(k, v)
    for n in src.tensor_names():
        raw = src.raw_tensor(n)
        if "_exps." in n:
            base = n.replace("_exps.weight", "")
            for e in range(raw.data.shape[0]):
                w.add_tensor(f"{base}.{e}.weight", np.array(raw.data[e]), raw_dtype=gguf.GGMLQuantizationType(raw.qtype))
        else:
            w.add_tensor(n, np.array(raw.data), raw_dtype=gguf.GGMLQuantizationType(raw.qtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open_model(out) as m:
        assert "blk.0.ffn_gate_exps.weight" in m.tensor_names()
        assert not any(".ffn_gate.0." in n for n in m.tensor_names())
        assert m.spec.d_ff_expert == PRESETS["tiny-mixtral"].d_ff_expert
        for n in ("blk.0.ffn_gate_exps.weight", "blk.1.ffn_down_exps.weight"):
            assert m.tensor_info(n).shape == src.tensor_info(n).shape
            assert torch.equal(m.load_tensor(n), src.load_tensor(n))
            assert np.array_equal(m.raw_tensor(n).data, src.raw_tensor(n).data)
    src.close()


# --- errors --------------------------------------------------------------------------------

def test_missing_tensor_named(tiny_files):
    with open_model(tiny_files["tiny-llama"]) as m:
        with pytest.raises(ModelLoadError, match="blk.9.attn_q.weight"):
            m.load_tensor("blk.9.attn_q.weight")


def test_unsupported_arch(tmp_path):
    out = tmp_path / "bert.gguf"
    w = gguf.GGUFWriter(out, "bert")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(UnsupportedModelError, match="'bert'"):
        open_model(out)


def test_missing_required_key(tmp_path):
    out = tmp_path / "nokey.gguf"
    w = gguf.GGUFWriter(out, "qwen3moe")
    w.add_uint32("qwen3moe.block_count", 1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ModelLoadError, match="qwen3moe.embedding_length"):
        open_model(out)


def test_expert_used_count_above_expert_count(tmp_path):
    p = replace(PRESETS["tiny-qwen3moe"], top_k=9)  # 9 > 8 experts
    with pytest.raises(ModelLoadError, match="expert_used_count = 9 exceeds .*expert_count = 8"):
        open_model(write_gguf(tmp_path / "k.gguf", p))


def test_unsupported_tensor_type_refused_at_open(tmp_path):
    out = tmp_path / "iq.gguf"
    w = gguf.GGUFWriter(out, "llama")
    qt = gguf.GGMLQuantizationType.Q8_K     # a type of llama.cpp's activations, no weights
    for k, v in [("llama.block_count", 1), ("llama.embedding_length", 256), ("llama.attention.head_count", 4)]:
        w.add_uint32(k, v)
    bs, ts = gguf.GGML_QUANT_SIZES[qt]
    w.add_tensor("token_embd.weight", np.zeros((8, ts), np.uint8), raw_dtype=qt)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(UnsupportedModelError) as e:
        open_model(out)
    msg = str(e.value)
    assert "token_embd.weight" in msg and "Q8_K" in msg and str(int(qt)) in msg


def test_directory_and_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        open_model(tmp_path / "nope.gguf")
    with pytest.raises(ModelLoadError, match="config.json"):
        open_model(tmp_path)
    (tmp_path / "dir.gguf").mkdir()  # a folder named like a model is not one
    with pytest.raises(ModelLoadError, match="without config.json or .gguf files"):
        open_model(tmp_path)


def test_directory_of_several_models_lists_them_and_a_split_set_is_one(tmp_path):
    """-m DIR: with several GGUF models the error names them (a split set once, by its first
    shard) and shows how to pass one; a folder holding one split set opens it."""
    d = tmp_path / "many"
    write_gguf(d / "a.gguf", "tiny-llama")
    write_gguf(d / "m.gguf", "tiny-qwen3moe", seed=3, split_max_tensors=10)  # m-0000k-of-00003
    with pytest.raises(ModelLoadError) as e:
        open_model(d)
    msg = str(e.value)
    assert f"{d} holds 2 GGUF models: a.gguf, m-00001-of-00003.gguf; give the path" in msg, msg
    big = max([d / "a.gguf", d / "m-00001-of-00003.gguf"], key=lambda q: q.stat().st_size)
    assert msg.endswith(f"e.g. {big}") and "-m " not in msg   # the largest, not a 0-byte file
    (d / "0.gguf").write_bytes(b"")            # sorts first; an empty file is no model to suggest
    with pytest.raises(ModelLoadError) as e:
        open_model(d)
    assert str(e.value).endswith(f"e.g. {big}")
    split_only = write_gguf(tmp_path / "split" / "m.gguf", "tiny-qwen3moe", seed=3,
                            split_max_tensors=10).parent
    with open_model(split_only) as m:
        assert m.spec.n_layers > 0


# --- ModelSpec from metadata alone ---------------------------------------------------------

from localmoe.io.gguf_spec import spec_from_gguf_metadata  # noqa: E402


def _md(arch="qwen3moe", **kv):
    base = {"general.architecture": arch, f"{arch}.block_count": 4, f"{arch}.embedding_length": 512,
            f"{arch}.attention.head_count": 8, f"{arch}.attention.head_count_kv": 2, f"{arch}.vocab_size": 1000}
    base.update({k.replace("A.", f"{arch}."): v for k, v in kv.items()})
    return base


def test_spec_rope_scaling_and_moe_keys():
    s = spec_from_gguf_metadata(_md(**{
        "A.rope.scaling.type": "yarn", "A.rope.scaling.factor": 4.0, "A.rope.scaling.original_context_length": 32768,
        "A.expert_count": 16, "A.expert_used_count": 4, "A.expert_feed_forward_length": 256,
        "A.leading_dense_block_count": 1, "A.attention.key_length": 128}))
    assert s.rope_scaling == {"type": "yarn", "factor": 4.0, "original_context_length": 32768}
    assert (s.n_experts, s.top_k, s.d_ff_expert, s.leading_dense_layers, s.head_dim) == (16, 4, 256, 1, 128)
    assert s.layer_is_moe(1) and not s.layer_is_moe(0) and s.norm_topk_prob


def test_spec_gemma3_pattern_flags():
    flags = [True] * 5 + [False] + [True] * 5 + [False]
    s = spec_from_gguf_metadata(_md("gemma3", **{"A.attention.sliding_window": 512,
                                                  "A.attention.sliding_window_pattern": flags}))
    assert s.sliding_window_pattern == 6 and s.layer_window(5) is None and s.layer_window(4) == 512
    with pytest.raises(UnsupportedModelError, match="not periodic"):
        spec_from_gguf_metadata(_md("gemma3", **{"A.attention.sliding_window": 512,
                                                 "A.attention.sliding_window_pattern": [True, False, False, True]}))
    s = spec_from_gguf_metadata(_md("gemma3"))
    assert s.sliding_window is None  # no SWA key: every layer global, as in llama.cpp


@pytest.mark.parametrize("kv,err,match", [
    ({"A.expert_count": 8, "A.expert_used_count": 2, "A.expert_gating_func": 3}, UnsupportedModelError, "gating_func = 3"),
    ({"A.attention.head_count_kv": [2, 2, 4, 2]}, UnsupportedModelError, "varies per layer"),
    ({"A.attention.head_count_kv": 3}, ModelLoadError, "not a multiple"),
    ({"A.rope.freq_base": "fast"}, ModelLoadError, "rope.freq_base"),
    ({"A.block_count": -1}, ModelLoadError, "block_count"),
    ({"A.expert_count": 8}, ModelLoadError, "expert_used_count is missing"),
])
def test_spec_bad_metadata(kv, err, match):
    with pytest.raises(err, match=match):
        spec_from_gguf_metadata(_md(**kv))


def test_open_does_not_import_torch(tiny_files):
    """Header validation stays cheap for the CLI: torch is imported on the first load_tensor()."""
    import subprocess
    import sys

    code = (
        "import sys; from localmoe.io.loader import open_model; "
        f"m = open_model({str(tiny_files['tiny-qwen3moe'])!r}); assert m.spec.n_experts == 8; "
        "print('torch' in sys.modules); m.load_tensor('blk.0.attn_q.weight'); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True"]
