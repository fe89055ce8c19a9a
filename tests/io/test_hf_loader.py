"""HF safetensors directories behind the ModelFile interface, checked against transformers."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from localmoe.errors import ModelLoadError, UnsupportedModelError
from localmoe.io.loader import open_model
from localmoe.testing.synthetic import PRESETS, write_gguf, write_hf

HF_PRESETS = ["tiny-qwen3moe", "tiny-qwen2moe", "tiny-olmoe", "tiny-mixtral", "tiny-llama", "tiny-qwen3", "tiny-qwen2"]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {n: write_hf(d / n, n, seed=5) for n in HF_PRESETS}


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("gg")
    return {n: write_gguf(d / f"{n}.gguf", n, seed=5, quant="f32") for n in HF_PRESETS}


def _hf_model(path):
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _expert_weights(layer_mlp, part: str) -> torch.Tensor:
    """[E, out, in] expert weights from a transformers MoE block, whatever its layout."""
    ex = layer_mlp.experts
    if hasattr(ex, "gate_up_proj"):  # transformers >= 5 fused layout: [E, 2F, D] (gate first) and [E, D, F]
        if part == "down":
            return ex.down_proj.detach()
        gu = ex.gate_up_proj.detach()
        f = gu.shape[1] // 2
        return gu[:, :f] if part == "gate" else gu[:, f:]
    names = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}[part]
    out = []
    for e in ex:
        for n in names:
            if hasattr(e, n):
                out.append(getattr(e, n).weight.detach())
    return torch.stack(out)


@pytest.mark.parametrize("preset", HF_PRESETS)
def test_names_and_shapes_match_gguf_layout(hf_dirs, gguf_files, preset):
    """The HF loader exposes exactly the tensor names and torch-order shapes of llama.cpp's layout."""
    hf, gg = open_model(hf_dirs[preset]), open_model(gguf_files[preset])
    assert hf.format == "safetensors" and gg.format == "gguf"
    assert sorted(hf.tensor_names()) == sorted(gg.tensor_names())
    for n in gg.tensor_names():
        assert hf.tensor_info(n).shape == gg.tensor_info(n).shape, n
    hs, gs = hf.spec, gg.spec
    for f in ("arch", "n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "n_experts",
              "top_k", "d_ff_expert", "n_shared_experts", "d_ff_shared", "shared_expert_gate", "qk_norm",
              "qk_norm_full", "attn_bias", "tie_embeddings", "norm_topk_prob", "gating"):
        assert getattr(hs, f) == getattr(gs, f), f
    assert hs.rope_style == "neox"  # HF weights are unpermuted, whatever the arch
    assert hs.rope_base == gs.rope_base and hs.norm_eps == pytest.approx(gs.norm_eps)


@pytest.mark.parametrize("preset", HF_PRESETS)
def test_values_match_transformers(hf_dirs, preset):
    m = open_model(hf_dirs[preset])
    ref = _hf_model(hf_dirs[preset])
    L = ref.model.layers
    a = L[1].self_attn
    checks = {
        "token_embd.weight": ref.model.embed_tokens.weight,
        "output_norm.weight": ref.model.norm.weight,
        "blk.1.attn_q.weight": a.q_proj.weight,
        "blk.1.attn_k.weight": a.k_proj.weight,
        "blk.1.attn_v.weight": a.v_proj.weight,
        "blk.1.attn_output.weight": a.o_proj.weight,
        "blk.1.attn_norm.weight": L[1].input_layernorm.weight,
        "blk.1.ffn_norm.weight": L[1].post_attention_layernorm.weight,
    }
    if not PRESETS[preset].tie_embeddings:
        checks["output.weight"] = ref.lm_head.weight
    if hasattr(a, "q_norm"):
        checks["blk.1.attn_q_norm.weight"] = a.q_norm.weight
        checks["blk.1.attn_k_norm.weight"] = a.k_norm.weight
    if getattr(a.q_proj, "bias", None) is not None:
        checks["blk.1.attn_q.bias"] = a.q_proj.bias
    if PRESETS[preset].is_moe:
        mlp = L[1].mlp if hasattr(L[1], "mlp") else L[1].block_sparse_moe
        checks["blk.1.ffn_gate_inp.weight"] = mlp.gate.weight
        for part in ("gate", "up", "down"):
            checks[f"blk.1.ffn_{part}_exps.weight"] = _expert_weights(mlp, part)
        if hasattr(mlp, "shared_expert"):
            checks["blk.1.ffn_gate_shexp.weight"] = mlp.shared_expert.gate_proj.weight
            checks["blk.1.ffn_down_shexp.weight"] = mlp.shared_expert.down_proj.weight
            checks["blk.1.ffn_gate_inp_shexp.weight"] = mlp.shared_expert_gate.weight.reshape(-1)
    else:
        checks["blk.1.ffn_gate.weight"] = L[1].mlp.gate_proj.weight
        checks["blk.1.ffn_down.weight"] = L[1].mlp.down_proj.weight
    for name, want in checks.items():
        got = m.load_tensor(name)
        assert got.shape == want.shape, name
        assert torch.equal(got, want.detach().float()), name
    assert m.load_tensor("blk.0.attn_q.weight", dtype=torch.bfloat16).dtype == torch.bfloat16


def test_metadata_and_template(hf_dirs):
    m = open_model(hf_dirs["tiny-qwen3moe"])
    md = m.metadata
    assert md["general.architecture"] == "qwen3moe"
    assert md["qwen3moe.block_count"] == 2 and md["qwen3moe.expert_count"] == 8
    assert m.chat_template and "<|im_start|>" in m.chat_template
    assert "tokenizer.huggingface.json" in md and md["tokenizer.ggml.eos_token_id"] == 458
    with pytest.raises(UnsupportedModelError, match="GGUF"):
        m.raw_tensor("token_embd.weight")


def test_sharded_checkpoint_with_index(tmp_path, hf_dirs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = write_hf(tmp_path / "sh", "tiny-olmoe", seed=5, max_shard_size="1MB")
    files = sorted(d.glob("*.safetensors"))
    assert len(files) > 1 and (d / "model.safetensors.index.json").is_file()
    m, one = open_model(d), open_model(hf_dirs["tiny-olmoe"])
    assert sorted(m.tensor_names()) == sorted(one.tensor_names())
    for n in ("blk.0.ffn_up_exps.weight", "blk.1.attn_q_norm.weight", "output.weight"):
        assert torch.equal(m.load_tensor(n), one.load_tensor(n))
    files[-1].unlink()
    with pytest.raises(ModelLoadError, match=files[-1].name):
        open_model(d)


def test_fused_expert_layout(tmp_path, hf_dirs):
    """transformers-5 style fused experts (gate_up_proj [E, 2F, D], down_proj [E, D, F])."""
    from safetensors.torch import load_file, save_file

    src = hf_dirs["tiny-qwen3moe"]
    d = tmp_path / "fused"
    shutil.copytree(src, d)
    sd = load_file(str(d / "model.safetensors"))
    E = PRESETS["tiny-qwen3moe"].n_experts
    for i in range(2):
        p = f"model.layers.{i}.mlp.experts."
        g = torch.stack([sd.pop(f"{p}{e}.gate_proj.weight") for e in range(E)])
        u = torch.stack([sd.pop(f"{p}{e}.up_proj.weight") for e in range(E)])
        dn = torch.stack([sd.pop(f"{p}{e}.down_proj.weight") for e in range(E)])
        sd[p + "gate_up_proj"] = torch.cat([g, u], dim=1).contiguous()
        sd[p + "down_proj"] = dn
    save_file(sd, str(d / "model.safetensors"))
    m, ref = open_model(d), open_model(src)
    for n in ("blk.1.ffn_gate_exps.weight", "blk.1.ffn_up_exps.weight", "blk.1.ffn_down_exps.weight"):
        assert m.tensor_info(n).shape == ref.tensor_info(n).shape
        assert torch.equal(m.load_tensor(n), ref.load_tensor(n)), n


def test_unsupported_model_type_is_named_before_unknown_tensors(tmp_path):
    """An HF folder of an architecture localmoe does not run (model_type "bert", BERT's
    tensor names) was refused for its "tensors ... localmoe does not know"; the cause is the
    model_type, said first with the supported ones (also for FP8 tensors or a pickle-only
    folder)."""
    from safetensors.torch import save_file

    d = tmp_path / "bert"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    save_file({"bert.embeddings.word_embeddings.weight": torch.zeros(4, 8),
               "bert.encoder.layer.0.attention.self.query.weight": torch.zeros(8, 8)},
              str(d / "model.safetensors"))
    with pytest.raises(UnsupportedModelError) as ei:
        open_model(d)
    msg = str(ei.value)
    assert msg.startswith(f"{d / 'config.json'}: model_type 'bert' is not supported; "
                          "localmoe runs: "), msg
    assert "llama" in msg and "qwen3_moe" in msg and "tensors" not in msg
    save_file({"w": torch.zeros(2, 2).to(torch.float8_e4m3fn)}, str(d / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="model_type 'bert' is not supported"):
        open_model(d)
    # a supported model_type still gets the unknown-tensor message
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"bert.embeddings.word_embeddings.weight": torch.zeros(4, 8)},
              str(d / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="tensors have names localmoe does not know"):
        open_model(d)


def test_hf_errors(tmp_path, hf_dirs):
    d = tmp_path / "bad"
    d.mkdir()
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        open_model(d)
    (d / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (d / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError):
        open_model(d)
    # unsupported model_type with valid weights
    d2 = tmp_path / "bert"
    shutil.copytree(hf_dirs["tiny-llama"], d2)
    cfg = json.loads((d2 / "config.json").read_text())
    (d2 / "config.json").write_text(json.dumps(dict(cfg, model_type="bert")))
    with pytest.raises(UnsupportedModelError, match="'bert'"):
        open_model(d2)
    # config that does not match the weights
    (d2 / "config.json").write_text(json.dumps(dict(cfg, hidden_size=128)))
    with pytest.raises(ModelLoadError, match="config"):
        open_model(d2)
    # truncated safetensors
    d3 = tmp_path / "trunc"
    shutil.copytree(hf_dirs["tiny-llama"], d3)
    f = d3 / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        open_model(d3)
    # pickle-only checkpoint
    d4 = tmp_path / "bin"
    d4.mkdir()
    (d4 / "config.json").write_text(json.dumps(cfg))
    (d4 / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(UnsupportedModelError, match="safetensors"):
        open_model(d4)


def test_gemma3_text_checkpoint(tmp_path, gemma3_path):
    """HF Gemma-3 names map onto the real Gemma-3 GGUF's names; Gemma specifics land in the spec."""
    import transformers as tf

    cfg = tf.Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(cfg)
        model.save_pretrained(tmp_path / "g3")
    m = open_model(tmp_path / "g3")
    real = open_model(gemma3_path)

    def suffixes(mf):
        return {n.split(".", 2)[2] for n in mf.tensor_names() if n.startswith("blk.0.")}

    assert suffixes(m) == suffixes(real)
    assert {n for n in m.tensor_names() if not n.startswith("blk.")} == {
        n for n in real.tensor_names() if not n.startswith("blk.")}
    s = m.spec
    assert s.arch == "gemma3" and s.rope_style == "neox" and s.tie_embeddings
    assert s.norm_weight_offset == 1.0 and real.spec.norm_weight_offset == 0.0  # HF stores w, GGUF stores 1+w
    assert s.sliding_window == 16 and s.sliding_window_pattern == 6
    assert s.rope_base == 1e6 and s.rope_base_local == 1e4
    assert s.attn_scale == pytest.approx(256 ** -0.5) and s.embed_scale == pytest.approx(8.0)
    assert s.act == real.spec.act and s.post_norms and s.qk_norm
    sd = model.state_dict()
    L = model.model.layers[0]
    assert torch.equal(m.load_tensor("blk.0.post_attention_norm.weight"), L.post_attention_layernorm.weight.detach())
    assert torch.equal(m.load_tensor("blk.0.ffn_norm.weight"), L.pre_feedforward_layernorm.weight.detach())
    assert torch.equal(m.load_tensor("blk.0.post_ffw_norm.weight"), sd["model.layers.0.post_feedforward_layernorm.weight"])
    real.close()
