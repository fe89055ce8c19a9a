"""moefy pieces without a model: bad requests, splits, block helpers, trace statistics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from localmoe.errors import UnsupportedModelError
from localmoe.io.spec import ModelSpec
from localmoe.testing.moefy import gguf_out, partition, trace_stats
from localmoe.testing.moefy.config import MoefyConfig, check_request


def _spec(arch="llama", d_ff=512, **kw):
    return ModelSpec(arch=arch, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16,
                     vocab_size=100, d_ff=d_ff, **kw)


@pytest.mark.parametrize("spec, cfg, exc, words", [
    (_spec("qwen3"), MoefyConfig(4, 2), UnsupportedModelError, "qwen3"),
    (_spec(n_experts=8, top_k=2), MoefyConfig(4, 2), UnsupportedModelError, "already has experts"),
    (_spec(d_ff=512), MoefyConfig(6, 2), ValueError, "does not divide"),
    (_spec(), MoefyConfig(4, 5), ValueError, "top_k=5"),
    (_spec(), MoefyConfig(4, 0), ValueError, "top_k=0"),
    (_spec(), MoefyConfig(1, 1), ValueError, "at least 2"),
    (_spec(), MoefyConfig(4, 2, split="kmeans"), ValueError, "split"),
    (_spec(), MoefyConfig(4, 2, shared_frac=1.0), ValueError, r"shared_frac=1.0 must be in \[0, 1\)"),
    (_spec(), MoefyConfig(4, 2, shared_frac=-0.1), ValueError, "must be in"),
    (_spec(), MoefyConfig(4, 2, shared_frac=0.995), ValueError, "fewer neurons than experts"),
    (_spec("gemma3"), MoefyConfig(4, 2, shared_frac=0.25), ValueError, "llama sources only"),
])
def test_bad_requests_are_refused(spec, cfg, exc, words):
    with pytest.raises(exc, match=words):
        check_request(spec, cfg)


def test_good_request_passes():
    check_request(_spec("gemma3", d_ff=2048), MoefyConfig(16, 4))
    # with a shared expert the routed remainder need not divide d_ff: 1536 * 0.875 / 16 = 84
    cfg = MoefyConfig(16, 4, shared_frac=0.125)
    check_request(_spec(d_ff=1536), cfg)
    assert cfg.split_sizes(1536) == (192, 84) and MoefyConfig(6, 2, shared_frac=0.1).split_sizes(
        512) == (512 - 6 * 76, 76)


def test_bad_request_fails_before_any_work(tmp_path, monkeypatch):
    """moefy() checks the request before calibrating: a bad top-k on a real file returns at once
    and never reaches the plan builder."""
    from localmoe.testing import synthetic
    from localmoe.testing.moefy import build, plan

    src = synthetic.write_gguf(tmp_path / "d.gguf", "tiny-llama", seed=0)
    called = []
    monkeypatch.setattr(plan, "build_plan", lambda *a, **k: called.append(1))
    with pytest.raises(ValueError, match="top_k=9"):
        build.moefy(src, tmp_path / "o.gguf", MoefyConfig(4, 9))
    with pytest.raises(UnsupportedModelError):
        build.moefy(synthetic.write_gguf(tmp_path / "q.gguf", "tiny-qwen3", seed=0),
                    tmp_path / "o.gguf", MoefyConfig(4, 2))
    assert not called and not (tmp_path / "o.gguf").exists()


@pytest.mark.parametrize("preset, args, words", [
    ("tiny-qwen3", ["--experts", "4", "--top-k", "2"], "moefy handles dense llama, gemma3"),
    ("tiny-llama", ["--experts", "6", "--top-k", "2"], "does not divide the FFN width"),
    ("tiny-llama", ["--experts", "4", "--top-k", "5"], "top_k=5 must be between 1 and"),
    # 0 was taken for a missing option: "give --preset, or --source, --out, --experts ..."
    ("tiny-llama", ["--experts", "4", "--top-k", "0"], "top_k=0 must be between 1 and"),
    ("tiny-llama", ["--experts", "0", "--top-k", "2"], "n_experts must be at least 2, got 0"),
    ("tiny-llama", ["--experts", "4", "--top-k", "2", "--shared-frac", "1"], "must be in [0, 1)"),
    ("tiny-llama", ["--experts", "4", "--top-k", "2", "--shared-frac", "0.995"],
     "fewer neurons than experts"),
])
def test_cli_bad_request_is_one_line_before_work(tmp_path, monkeypatch, capsys, preset, args, words):
    """``python -m localmoe.testing.moefy``: unsupported family, an expert count that does not
    divide d_ff, top-k > n_experts: one ``error:`` line, status 2, nothing built or written."""
    from localmoe.testing import synthetic
    from localmoe.testing.moefy import __main__ as cli, plan

    src = synthetic.write_gguf(tmp_path / "d.gguf", preset, seed=0)
    monkeypatch.setattr(plan, "build_plan", lambda *a, **k: pytest.fail("work started"))
    rc = cli.main(["--source", str(src), "--out", str(tmp_path / "o.gguf"), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and words in err[0], err
    assert not (tmp_path / "o.gguf").exists()


def test_cli_out_that_is_a_folder_is_one_line_before_work(tmp_path, monkeypatch, capsys):
    """--out naming a folder built the whole model, then failed renaming its temporary onto
    the folder with a traceback (IsADirectoryError), leaving ``OUT.tmp`` behind."""
    from localmoe.testing import synthetic
    from localmoe.testing.moefy import __main__ as cli, plan

    src = synthetic.write_gguf(tmp_path / "d.gguf", "tiny-llama", seed=0)
    (tmp_path / "out").mkdir()
    monkeypatch.setattr(plan, "build_plan", lambda *a, **k: pytest.fail("work started"))
    rc = cli.main(["--source", str(src), "--out", str(tmp_path / "out"), "--experts", "4",
                   "--top-k", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "is a folder" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.gguf", "out"]
    # a file where a folder of the path must be: FileExistsError from mkdir, after the work
    rc = cli.main(["--source", str(src), "--out", str(tmp_path / "d.gguf" / "o.gguf"),
                   "--experts", "4", "--top-k", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "d.gguf is a file, not a folder" in err[0], err


def test_splits_are_equal_and_deterministic():
    torch.manual_seed(0)
    acts = torch.randn(300, 64) * torch.linspace(0.1, 3, 64)
    a = partition.coactivation_split(acts, 8, seed=3)
    b = partition.coactivation_split(acts, 8, seed=3)
    assert torch.equal(a, b) and a.shape == (8, 8)
    assert sorted(a.flatten().tolist()) == list(range(64))
    r = partition.random_split(64, 8, seed=1)
    assert sorted(r.flatten().tolist()) == list(range(64)) and torch.equal(r, partition.random_split(64, 8, 1))
    assert not torch.equal(r, partition.random_split(64, 8, 2))


def test_clustering_recovers_planted_groups():
    """Neurons that fire on the same tokens end up in the same expert."""
    g = torch.Generator().manual_seed(0)
    n_tok, groups = 400, 4
    topic = torch.randint(0, groups, (n_tok,), generator=g)
    acts = torch.randn(n_tok, 32, generator=g) * 0.05
    for c in range(groups):
        acts[topic == c, c * 8:(c + 1) * 8] += 3.0
    perm = torch.randperm(32, generator=g)
    split = partition.coactivation_split(acts[:, perm], groups, seed=0)
    for row in split:
        assert len({int(perm[i]) // 8 for i in row}) == 1


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K"])
def test_scale_blocks_pow2_is_exact(qtype):
    x = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32) * 0.02
    blocks = gguf_out.quantize(x, qtype)
    ref = gguf_out.dequantize(blocks, qtype, x.shape)
    for e in (5, 12):
        got = gguf_out.dequantize(gguf_out.scale_blocks_pow2(blocks, qtype, e), qtype, x.shape)
        np.testing.assert_array_equal(got, ref * np.float32(2.0 ** e))
    with pytest.raises(ValueError, match="not exact"):
        gguf_out.scale_blocks_pow2(blocks, qtype, 40)


def test_expert_qtype_follows_llamacpp_fallback():
    assert gguf_out.expert_qtype("Q4_1", 96) == "Q4_1"
    assert gguf_out.expert_qtype("Q4_1", 48) == "F16"
    assert gguf_out.expert_qtype("Q4_K", 128) == "Q5_0"
    assert gguf_out.expert_qtype("Q6_K", 128) == "Q8_0"
    assert gguf_out.expert_qtype("Q6_K", 512) == "Q6_K"


def test_trace_stats_by_hand():
    # one layer, top-2 of 4 experts; prompt = first 2 tokens
    ids = np.array([[[0, 1]], [[2, 3]], [[0, 1]], [[0, 2]], [[0, 2]], [[1, 3]]], dtype=np.int16)
    # decode tokens 2..5; reuse vs previous: {0,1}&{2,3}=0, {0,2}&{0,1}=.5, {0,2}&{0,2}=1, {1,3}&{0,2}=0
    assert trace_stats.reuse(ids, 2)[0] == pytest.approx(1.5 / 4)
    # 2-slot LRU warmed with {0,1} then {2,3}: cache {2,3}; t2 {0,1}: 0 hits (cache {0,1});
    # t3 {0,2}: 1 hit (1 evicted); t4 {0,2}: 2 hits; t5 {1,3}: 0 hits -> 3 / 8
    assert trace_stats.cache_hits(ids, 2, 2, "lru")[0] == pytest.approx(3 / 8)
    assert trace_stats.cache_hits(ids, 2, 4, "lfu")[0] == pytest.approx(1.0)
    ahead = np.full((6, 2, 1, 4), np.nan, dtype=np.float16)
    ids2 = np.concatenate([ids, ids[::-1]], axis=1)                 # layer 1 = reversed order
    for t in range(6):                                               # predict layer 1 exactly
        lg = np.zeros(4)
        lg[ids2[t, 1]] = [2.0, 1.0]
        ahead[t, 0, 0] = lg
    p = trace_stats.prediction(ids2, ahead)
    assert p["top1"][0, 0] == 1.0 and p["recall"][0, 0] == 1.0 and np.isnan(p["top1"][1, 0])
