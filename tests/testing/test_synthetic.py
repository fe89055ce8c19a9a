"""Synthetic model writer: llama.cpp layout, determinism, quantizers, tokenizer, llama.cpp loads it."""

from __future__ import annotations

import math
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import gguf

from localmoe.io.loader import open_model
from localmoe.testing import synthetic as syn
from localmoe.testing.bpe import CHATML_TEMPLATE, build_tokenizer
from localmoe.testing.quants import quantize_blocks, random_blocks
from localmoe.testing.synthetic import PRESETS, write_gguf
from localmoe.text.bytelevel import bytes_to_unicode
from tests.conftest import raw_llama

TINY = [n for n in PRESETS if n.startswith("tiny-")]

# llama.cpp tensor names of one block per architecture (src/llama-arch.cpp LLM_TENSOR_NAMES)
ATTN = {"attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_norm.weight"}
MOE = {"ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"}
BLOCK = {
    "tiny-qwen3moe": ATTN | MOE | {"attn_q_norm.weight", "attn_k_norm.weight"},
    "tiny-qwen2moe": ATTN | MOE | {"attn_q.bias", "attn_k.bias", "attn_v.bias", "ffn_gate_inp_shexp.weight",
                                   "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"},
    "tiny-olmoe": ATTN | MOE | {"attn_q_norm.weight", "attn_k_norm.weight"},
    "tiny-mixtral": ATTN | MOE,
    "tiny-llama": ATTN | {"ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"},
    "tiny-qwen3": ATTN | {"ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "attn_q_norm.weight",
                          "attn_k_norm.weight"},
    "tiny-qwen2": ATTN | {"ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "attn_q.bias", "attn_k.bias",
                          "attn_v.bias"},
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("syn")
    return {n: write_gguf(d / f"{n}.gguf", n, seed=0) for n in TINY}


@pytest.mark.parametrize("preset", TINY)
def test_layout(files, preset):
    p = PRESETS[preset]
    with open_model(files[preset]) as m:
        names = set(m.tensor_names())
        top = {"token_embd.weight", "output_norm.weight"} | (set() if p.tie_embeddings else {"output.weight"})
        want = top | {f"blk.{i}.{s}" for i in range(p.n_layers) for s in BLOCK[preset]}
        assert names == want
        # storage mix of real downloads: F32 norms/router, Q8_0 attention, Q4_K experts, Q6_K output
        assert m.tensor_info("blk.0.attn_norm.weight").qtype == "F32"
        assert m.tensor_info("blk.0.attn_q.weight").qtype == "Q8_0"
        if p.is_moe:
            assert m.tensor_info("blk.0.ffn_gate_inp.weight").qtype == "F32"
            assert m.tensor_info("blk.0.ffn_down_exps.weight").qtype == "Q4_K"
        if not p.tie_embeddings:
            assert m.tensor_info("output.weight").qtype == "Q6_K"
        md = m.metadata
        assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.chat_template"] == CHATML_TEMPLATE
        assert md[f"{p.arch}.block_count"] == p.n_layers


def test_deterministic(tmp_path):
    a = write_gguf(tmp_path / "a.gguf", "tiny-olmoe", seed=3)
    b = write_gguf(tmp_path / "b.gguf", "tiny-olmoe", seed=3)
    c = write_gguf(tmp_path / "c.gguf", "tiny-olmoe", seed=4)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


def test_weights_are_not_degenerate(files):
    with open_model(files["tiny-qwen3moe"]) as m:
        w = m.load_tensor("blk.0.ffn_gate_exps.weight")
        assert torch.isfinite(w).all()
        std = w.std().item()
        assert 0.5 / math.sqrt(256) < std < 2.0 / math.sqrt(256)
        # experts differ from each other
        assert not torch.equal(w[0], w[1])
        n = m.load_tensor("blk.0.attn_norm.weight")
        assert abs(n.mean().item() - 1.0) < 0.05


@pytest.mark.parametrize("qtype,bound", [("Q4_0", 0.12), ("Q4_1", 0.10), ("Q5_0", 0.06), ("Q5_1", 0.05),
                                         ("Q8_0", 0.008), ("Q4_K", 0.10), ("Q5_K", 0.05), ("Q6_K", 0.025)])
def test_quantizer_error(qtype, bound):
    """RMS error of dequant(quant(x)) for unit-normal x, by the gguf reference dequantizer."""
    x = np.random.default_rng(0).standard_normal((32, 512)).astype(np.float32)
    b = quantize_blocks(x, qtype)
    y = gguf.quants.dequantize(b, gguf.GGMLQuantizationType[qtype])
    rms = float(np.sqrt(((y - x) ** 2).mean()))
    assert rms < bound, rms
    assert rms > bound / 20  # it is really quantized


def test_k_quantizer_handles_constant_and_zero_blocks():
    x = np.zeros((2, 256), np.float32)
    x[1] = 3.0
    for q in ("Q4_K", "Q5_K", "Q6_K"):
        y = gguf.quants.dequantize(quantize_blocks(x, q), gguf.GGMLQuantizationType[q])
        assert np.isfinite(y).all()
        np.testing.assert_allclose(y, x, atol=0.05)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_0"])
def test_random_blocks_valid(qtype):
    rng = np.random.default_rng(1)
    b = random_blocks(rng, qtype, (64, 512), std=0.02)
    y = gguf.quants.dequantize(b, gguf.GGMLQuantizationType[qtype])
    assert y.shape == (64, 512) and np.isfinite(y).all()
    assert 0.005 < y.std() < 0.08


def test_tokenizer_is_consistent():
    t = build_tokenizer()
    vocab = set(t.tokens)
    assert len(vocab) == len(t.tokens)  # unique
    b2u = bytes_to_unicode()
    assert all(b2u[b] in vocab for b in range(256))
    for m in t.merges:
        a, b = m.split(" ")
        assert a in vocab and b in vocab and a + b in vocab
    assert t.token_types[t.eos_id] == 3 and t.tokens[t.im_start_id] == "<|im_start|>"
    padded = build_tokenizer(vocab_size=1000)
    assert len(padded.tokens) == 1000 and padded.tokens[:len(t.tokens) - 3] == t.tokens[:-3]


def test_real_geometry_plan():
    """Real-geometry presets describe the real models (parameter counts, shapes) without writing them."""
    p = PRESETS["qwen3-30b-a3b"]
    plan = syn._plan(p, p.vocab_size)
    total = sum(math.prod(t.shape) for t in plan)
    assert 30.0e9 < total < 31.0e9  # Qwen3-30B-A3B: 30.5 B parameters
    shapes = {t.name: t.shape for t in plan}
    assert shapes["blk.47.ffn_gate_exps.weight"] == (128, 768, 2048)
    assert shapes["blk.0.attn_q.weight"] == (32 * 128, 2048)
    assert syn._storage(p, next(t for t in plan if t.name == "blk.0.ffn_up_exps.weight")) == "Q4_K"
    assert syn._storage(p, next(t for t in plan if t.name == "output.weight")) == "Q6_K"
    assert syn._storage(p, next(t for t in plan if t.name == "blk.0.attn_k.weight")) == "Q8_0"
    mx = PRESETS["mixtral-8x7b"]
    total = sum(math.prod(t.shape) for t in syn._plan(mx, mx.vocab_size))
    assert 46.0e9 < total < 47.5e9  # Mixtral-8x7B: 46.7 B
    ol = PRESETS["olmoe-1b-7b"]
    total = sum(math.prod(t.shape) for t in syn._plan(ol, ol.vocab_size))
    assert 6.5e9 < total < 7.2e9  # OLMoE-1B-7B: 6.9 B


def test_truncated_real_geometry_writes(tmp_path):
    """The random-block path writes a valid file (1 layer of OLMoE geometry, small vocab)."""
    from dataclasses import replace

    p = replace(PRESETS["olmoe-1b-7b"], vocab_size=1024, n_layers=1, n_experts=4, top_k=2)
    path = write_gguf(tmp_path / "o.gguf", p)
    with open_model(path) as m:
        assert m.spec.n_experts == 4 and m.spec.d_model == 2048
        w = m.load_tensor("blk.0.ffn_down_exps.weight")
        assert w.shape == (4, 2048, 1024) and torch.isfinite(w).all()


def test_cli(tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    assert syn.main(["--preset", "tiny-llama", "--out", str(out), "--quant", "f16", "--seed", "2"]) == 0
    assert str(out) in capsys.readouterr().out
    with open_model(out) as m:
        assert m.tensor_info("blk.0.attn_q.weight").qtype == "F16"


def test_cli_bad_output_paths_are_one_line_errors(tmp_path, capsys, monkeypatch):
    """--out a directory, an unwritable place, or --hf without transformers: exit 1 with one
    ``error:`` line, no traceback."""
    import builtins

    (tmp_path / "afile").write_text("x")
    cases = [(["--out", str(tmp_path)], "is a directory"),
             (["--out", str(tmp_path / "afile" / "m.gguf")], "cannot write")]   # under a file
    for args, why in cases:
        with pytest.raises(SystemExit) as e:
            syn.main(["--preset", "tiny-llama", *args])
        assert e.value.code == 1
        err = capsys.readouterr().err
        assert err.startswith("error:") and why in err and "Traceback" not in err
    real_import = builtins.__import__

    def no_transformers(name, *a, **k):
        if name == "transformers":
            raise ImportError(name)
        return real_import(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_transformers)
    with pytest.raises(SystemExit) as e:
        syn.main(["--preset", "tiny-llama", "--hf", "--out", str(tmp_path / "hf")])
    assert e.value.code == 1 and "needs the transformers package" in capsys.readouterr().err


REPO_ROOT = Path(__file__).resolve().parents[2]


def test_cli_hf_runs_from_the_repository_root(tmp_path):
    """`python -m localmoe.testing.synthetic --hf` from the repository root failed: sys.path[0]
    is the root, whose kernels/ folder (localmoe.kernels' sources) shadowed Hugging Face's
    `kernels` package that transformers imports (`cannot import name 'CUDAProperties' from
    'kernels'`). The command as a user runs it, in a fresh process."""
    pytest.importorskip("transformers")
    assert (REPO_ROOT / "kernels" / "__init__.py").is_file()
    out = tmp_path / "hf"
    r = subprocess.run([sys.executable, "-m", "localmoe.testing.synthetic", "--preset",
                        "tiny-llama", "--hf", "--out", str(out)], cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()


def test_installed_kernels_first_skips_the_checkouts_kernels_folder(tmp_path, monkeypatch):
    """The helper behind it (tests/conftest.py uses it too): with the repository root (or "",
    the current folder, there) before the installed `kernels`, `import kernels` gets the
    installed one afterwards; sys.path is unchanged; a folder holding some other `kernels`
    does not count as shadowing; a `kernels` already imported from the checkout is replaced,
    another one is kept."""
    from localmoe.testing.hf_kernels import installed_kernels_first, shadowing_entries

    site = tmp_path / "site"   # a stand-in for site-packages holding HF's kernels
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("WHICH = 'installed'\n")
    monkeypatch.chdir(REPO_ROOT)
    path = [str(REPO_ROOT), "", str(site)]
    assert shadowing_entries(path) == [str(REPO_ROOT), ""]
    monkeypatch.setattr(sys, "path", path + [p for p in sys.path if p not in path])
    saved = {n: m for n, m in sys.modules.items() if n == "kernels" or n.startswith("kernels.")}
    try:
        for n in saved:
            del sys.modules[n]
        import kernels

        assert not hasattr(kernels, "WHICH")   # the shadowing this is about: the checkout's
        before = list(sys.path)
        installed_kernels_first()   # ... already imported from the checkout: replaced
        assert sys.modules["kernels"].WHICH == "installed" and sys.path == before
        del sys.modules["kernels"]
        installed_kernels_first()   # nothing imported yet
        assert sys.modules["kernels"].WHICH == "installed" and sys.path == before
        other = types.ModuleType("kernels")   # imported from elsewhere: left alone
        sys.modules["kernels"] = other
        installed_kernels_first()
        assert sys.modules["kernels"] is other
    finally:
        for n in [n for n in sys.modules if n == "kernels" or n.startswith("kernels.")]:
            del sys.modules[n]
        sys.modules.update(saved)


@pytest.mark.parametrize("args,why", [
    (["--quant", "bogus"], "--quant 'bogus' is not one this writer makes"),
    (["--quant", "iq2_xxs"], "is not one this writer makes"),
    (["--n-layers", "0"], "--n-layers must be at least 1"),
    (["--n-layers", "-1"], "--n-layers must be at least 1"),
    (["--seed", "-1"], "--seed must be at least 0"),
    (["--split-max-tensors", "-3"], "--split-max-tensors must be at least 0")])
def test_cli_bad_arguments_are_refused_before_writing(tmp_path, capsys, args, why):
    """Arguments the writer cannot honour are usage errors (exit 2, one ``error:`` line) and
    write nothing: before, a KeyError, a struct.error, a numpy ValueError, or a file with 0
    layers that the loader then called corrupt (fresh-user trial, session 21)."""
    out = tmp_path / "m.gguf"
    with pytest.raises(SystemExit) as e:
        syn.main(["--preset", "tiny-llama", "--out", str(out), *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and why in err and "Traceback" not in err, err
    assert not out.exists()


# --- llama.cpp accepts every file ----------------------------------------------------------

@pytest.mark.llamacpp
@pytest.mark.parametrize("preset", TINY)
def test_llamacpp_loads_and_runs(files, preset):
    llm = raw_llama(model_path=str(files[preset]), n_ctx=128, n_threads=2, verbose=False,
                    logits_all=True)
    try:
        ids = llm.tokenize(b"The quick brown fox jumps over the lazy dog.", add_bos=False, special=False)
        assert 3 < len(ids) < 44
        llm.eval(ids)
        logits = np.array(llm.scores[: len(ids)])
        assert logits.shape == (len(ids), len(build_tokenizer().tokens))
        assert np.isfinite(logits).all() and logits.std() > 0.1
        # llama.cpp tokenizes with our merges exactly like the HF tokenizers library does
        from tokenizers import Tokenizer as HFTok
        from localmoe.testing.synthetic import _hf_tokenizer_files

        tdir = files[preset].parent / f"tok-{preset}"
        tdir.mkdir(exist_ok=True)
        _hf_tokenizer_files(tdir, build_tokenizer())
        hf = HFTok.from_file(str(tdir / "tokenizer.json"))
        assert ids == hf.encode("The quick brown fox jumps over the lazy dog.").ids
    finally:
        llm.close()


def test_cli_does_not_overwrite_a_file_without_force(tmp_path, capsys):
    """--out naming an existing file (a user's, or a model) is refused unless --force; a
    parent that is a file is named as such."""
    keep = tmp_path / "notes.txt"
    keep.write_text("mine")
    with pytest.raises(SystemExit) as e:
        syn.main(["--preset", "tiny-llama", "--out", str(keep)])
    assert e.value.code == 1 and "--force" in capsys.readouterr().err
    assert keep.read_text() == "mine"
    assert syn.main(["--preset", "tiny-llama", "--out", str(keep), "--force"]) == 0
    assert keep.read_bytes()[:4] == b"GGUF"
    with pytest.raises(SystemExit) as e:
        syn.main(["--preset", "tiny-llama", "--out", str(keep / "x.gguf")])
    assert e.value.code == 1 and "is not a folder" in capsys.readouterr().err
