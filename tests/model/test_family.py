"""Architecture families (localmoe.models.family, models/*.py): each one's delta from the
shared block."""

import pytest

from localmoe.errors import UnsupportedModelError
from localmoe.models.family import get_family
from localmoe.io.spec import ModelSpec


def _spec(arch, **kw):
    base = dict(arch=arch, n_layers=12, d_model=64, n_heads=4, n_kv_heads=1, head_dim=16,
                vocab_size=100)
    base.update(kw)
    return ModelSpec(**base)


def test_family_deltas():
    names = {"token_embd.weight", "blk.0.attn_q_norm.weight", "blk.0.post_attention_norm.weight"}
    g = get_family("gemma3").configure(_spec("gemma3", sliding_window=512), "gguf", names)
    assert g.act == "gelu_tanh" and g.post_norms and g.qk_norm and g.tie_embeddings
    assert g.embed_scale == pytest.approx(8.0) and g.rope_style == "neox"
    assert g.sliding_window_pattern == 6 and g.rope_base_local == 10000.0
    assert [g.layer_window(i) for i in range(12)].count(None) == 2  # layers 5 and 11 global

    ll = get_family("llama").configure(_spec("llama", rope_style="neox", n_experts=4, top_k=2),
                                       "gguf", {"output.weight"})
    assert ll.rope_style == "norm" and ll.norm_topk_prob and not ll.qk_norm
    hf = get_family("llama").configure(_spec("llama", rope_style="neox"), "safetensors", set())
    assert hf.rope_style == "neox"
    q2 = get_family("qwen2moe").configure(_spec("qwen2moe", n_experts=4, top_k=2,
                                                norm_topk_prob=True), "gguf", {"blk.0.attn_q.bias"})
    assert not q2.norm_topk_prob and q2.attn_bias
    ol = get_family("olmoe").configure(_spec("olmoe", n_experts=4, top_k=2), "gguf",
                                       {"blk.0.attn_q_norm.weight"})
    assert ol.qk_norm and ol.qk_norm_full and not ol.norm_topk_prob
    q3 = get_family("qwen3moe").configure(_spec("qwen3moe", n_experts=4, top_k=2), "gguf", set())
    assert q3.norm_topk_prob
    with pytest.raises(UnsupportedModelError, match="not supported"):
        get_family("mamba")
