"""Hostile prompts and token ids (issue 18 items 2, 6, 9): a prompt that cannot fit is refused
before tokenizing, ids outside the table never reach a kernel, greedy decoding gives the same
tokens whatever the cache held."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from localmoe.errors import ContextOverflowError, InvalidRequestError
from localmoe.testing.synthetic import write_gguf
from tests.hostile.harness import run_capped


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("p") / "llama.gguf", "tiny-llama", seed=3, quant="q8_0")


@pytest.fixture(scope="module")
def llm(tiny_llama):
    from localmoe.api import LLM

    m = LLM(str(tiny_llama), backend="torch", n_ctx=256)
    yield m
    m.close()


def test_huge_prompt_refused_before_tokenizing(llm, monkeypatch):
    called = []
    orig = llm.tokenizer.encode
    monkeypatch.setattr(llm.tokenizer, "encode", lambda *a, **k: called.append(1) or orig(*a, **k))
    big = "word " * 2_000_000  # 10 M characters
    t0 = time.monotonic()
    with pytest.raises(ContextOverflowError) as ei:
        llm.generate(big, max_tokens=1)
    assert time.monotonic() - t0 < 1.0 and not called
    assert "10,000,000 characters" in str(ei.value) and ei.value.n_ctx == 256
    with pytest.raises(ContextOverflowError):
        list(llm.chat_stream([{"role": "user", "content": big}]))
    assert not called


def test_prompt_slightly_too_long_gets_the_exact_count(llm):
    with pytest.raises(ContextOverflowError) as ei:
        llm.generate("a b " * 400, max_tokens=1)
    assert ei.value.n_prompt > 256 and "tokens but the context holds 256" in str(ei.value)


def test_huge_stdin_prompt_one_error_line_under_a_memory_cap(tiny_llama):
    res = run_capped(["generate", "-m", str(tiny_llama), "--backend", "torch", "-c", "128", "-n", "1"],
                     stdin=b"x" * (64 << 20), env={"LOCALMOE_HOSTILE": "1"})
    assert not res.problems("reject"), (res.problems("reject"), res.err[-800:])
    assert "characters" in res.err and "context holds 128" in res.err


@pytest.mark.parametrize("ids", [[1, 2, 10**6], [-1, 5], [2**40]])
def test_prompt_token_ids_outside_the_vocabulary(llm, ids):
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate(ids, max_tokens=1)
    assert llm.generate([1, 2, 3], max_tokens=1, temperature=0).completion_tokens == 1


def test_packed_embedding_lookup_checks_ids():
    from localmoe.cpu.qmatmul import kernel_status, pack_gguf
    from localmoe.testing.quants import quantize_blocks

    if kernel_status() is not None:
        pytest.skip(kernel_status())
    w = np.random.default_rng(0).standard_normal((10, 64), dtype=np.float32)
    pw = pack_gguf(quantize_blocks(w, "Q8_0"), 8, (10, 64))
    assert pw.dequantize(torch.tensor([0, 9])).shape == (2, 64)
    for bad in ([0, 10], [-1], [2**40]):
        with pytest.raises(IndexError, match="outside the 10-row weight"):
            pw.dequantize(torch.tensor(bad))


def test_greedy_same_tokens_whatever_the_cache_held(tiny_llama, llm):
    from localmoe.api import LLM

    a = "The quick brown fox jumps over the lazy dog. " * 3
    b = a + "Then it ran far away into the"
    llm.generate(a, temperature=0, max_tokens=8)
    warm = llm.generate(b, temperature=0, max_tokens=12)
    assert warm.cached_tokens == 0  # greedy: no prefix reuse by default (docs/LIMITS.md)
    fresh_llm = LLM(str(tiny_llama), backend="torch", n_ctx=256)
    try:
        fresh = fresh_llm.generate(b, temperature=0, max_tokens=12)
    finally:
        fresh_llm.close()
    assert warm.token_ids == fresh.token_ids
    # sampling requests still reuse the cached prefix
    s1 = llm.generate(b, temperature=0.7, seed=1, max_tokens=2)
    assert s1.cached_tokens > 0


def test_closed_stdin_and_undecodable_stdin(tiny_llama):
    import subprocess
    import sys

    from tests.hostile.harness import ROOT

    args = [sys.executable, "-m", "localmoe", "generate", "-m", str(tiny_llama), "--backend", "torch",
            "-n", "1"]
    r = subprocess.run(args, stdin=subprocess.DEVNULL, capture_output=True, text=True, cwd=ROOT,
                       preexec_fn=lambda: __import__("os").close(0))
    assert r.returncode in (1, 2) and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: no prompt; give a PROMPT argument or pipe the prompt on stdin")
    res = run_capped(["generate", "-m", str(tiny_llama), "--backend", "torch", "-n", "1"],
                     stdin=b"hi \xff\xfe there")
    assert not res.problems("reject") and "character 3" in res.err


@pytest.fixture(scope="module", params=["smollm2", "gemma3-270m"])
def real_llm(request):
    from localmoe.api import LLM
    from tests.conftest import _real_model

    pytest.importorskip("llama_cpp")       # (the [llamacpp] extra; the suite runs without it)

    m = LLM(str(_real_model(request.param)), backend="llamacpp", n_ctx=8192)
    yield m
    m.close()


def test_hostile_prompts_tokenize_or_are_refused(real_llm):
    from localmoe.errors import LocalMoEError
    from tests.hostile.gen import hostile_prompts

    vocab = real_llm.runner.spec.vocab_size
    for name, text in hostile_prompts().items():
        for how in ("raw", "chat"):
            try:
                ids = (real_llm.prompt_ids(text) if how == "raw"
                       else real_llm.prompt_ids(messages=[{"role": "user", "content": text}]))
            except (InvalidRequestError, ContextOverflowError) as e:
                assert name in ("lone_surrogate", "surrogate_pair_halves", "empty", "whitespace_only") \
                    or isinstance(e, ContextOverflowError), (name, how, e)
                assert "\n" not in str(e)
                continue
            except LocalMoEError as e:  # pragma: no cover - reported with the case
                raise AssertionError(f"{name}/{how}: {e}")
            assert ids and all(0 <= i < vocab for i in ids), (name, how)
            if how == "chat":  # control-token text in user content stays plain text
                ctl = real_llm.tokenizer.control_ids
                user_ids = real_llm.prompt_ids(messages=[{"role": "user", "content": "x"}])
                assert sum(i in ctl for i in ids) == sum(i in ctl for i in user_ids), name
