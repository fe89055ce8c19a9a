"""``--record-routing FILE`` on generate and bench (localmoe/cli/routing.py): the trace pairs
each generated token with its routing; what cannot be recorded is refused before the weights
load, as one error line."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from localmoe.cli import cli
from localmoe.model.routing_trace import load_trace
from localmoe.testing import synthetic


def run(args):
    return CliRunner().invoke(cli, args, catch_exceptions=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli-rt")
    return {"moe": str(synthetic.write_gguf(d / "moe.gguf", "tiny-qwen3moe")),
            "dense": str(synthetic.write_gguf(d / "dense.gguf", "tiny-llama"))}


@pytest.fixture
def no_load(monkeypatch):
    """Any weight load fails the test (refusals must come first)."""
    from localmoe.backends import llamacpp_backend, torch_backend

    def boom(*a, **k):
        pytest.fail("weights loaded before the refusal")
    monkeypatch.setattr(torch_backend.TorchBackend, "load", boom)
    monkeypatch.setattr(llamacpp_backend.LlamaCppBackend, "load", boom)


def test_generate_records_every_token(files, tmp_path):
    out = tmp_path / "gen.routing"
    r = run(["generate", "-m", files["moe"], "--raw", "--greedy", "-n", "6", "-t", "1",
             "--json", "--record-routing", str(out), "the quick brown fox"])
    assert r.exit_code == 0, r.output
    meta, (tr,) = load_trace(out)                    # exactly the path given
    assert meta["command"] == "generate" and meta["backend"] in ("torch", "triton")  # not llamacpp
    assert meta["moe_layers"] == [0, 1] and meta["n_experts"] == 8
    import json

    res = json.loads(r.stdout.strip().splitlines()[-1])
    from localmoe.io.loader import open_model
    from localmoe.text.tokenizer import Tokenizer

    tok = Tokenizer.from_model(open_model(files["moe"]))
    prompt = tok.encode("the quick brown fox", add_special=True)
    assert tr.n_prompt == len(prompt) and tr.tokens[:len(prompt)].tolist() == prompt
    gen = tr.tokens[len(prompt):].tolist()
    assert len(gen) == res["completion_tokens"] - 1      # the last token is not fed back
    assert tr.ids.shape == (len(tr.tokens), 2, 2) and tr.ahead.shape == (len(tr.tokens), 2, 3, 8)


def test_bench_records_one_untimed_run(files, tmp_path):
    out = tmp_path / "bench.npz"
    r = run(["bench", "-m", files["moe"], "-p", "12", "-n", "4", "-r", "1", "-t", "1",
             "--record-routing", str(out)])
    assert r.exit_code == 0, r.output
    meta, (tr,) = load_trace(out)
    assert meta["command"] == "bench" and tr.n_prompt == 12
    assert tr.steps.tolist() == [12, 1, 1, 1]


@pytest.mark.parametrize("which,extra,words", [
    ("moe", ["--backend", "llamacpp"], "needs the torch or triton backend"),
    ("dense", [], "dense model"),
])
def test_refused_before_the_weights_load(files, tmp_path, no_load, which, extra, words):
    r = run(["generate", "-m", files[which], "--raw", "-n", "2", *extra,
             "--record-routing", str(tmp_path / "x.npz"), "hi"])
    assert r.exit_code == 1
    assert r.stderr.startswith("error: ") and words in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x.npz").exists()


def test_unwritable_file_refused(files, tmp_path, no_load):
    for bad in (tmp_path / "missing" / "x.npz", tmp_path):
        for cmd in (["generate", "--raw", "hi"], ["bench"]):
            r = run([cmd[0], "-m", files["moe"], *cmd[1:], "--record-routing", str(bad)])
            assert r.exit_code == 1 and r.stderr.startswith("error: --record-routing"), r.stderr
