"""llamacpp backend: KV format mapping, refusals before load, Runner contract on SmolLM2, and
parity of our engine on it with raw llama-cpp-python."""

from __future__ import annotations

import importlib.util

import pytest

from localmoe.errors import (BackendUnavailableError, ContextOverflowError, KVCacheFormatError)
from localmoe.kv.spec import KVSpec
from localmoe.backends.registry import get_backend, select_backend

from tests.conftest import has_llamacpp, raw_llama


def backend():
    return get_backend("llamacpp")


def test_registered_with_description():
    b = backend()
    assert b.name == "llamacpp" and "llama" in b.description


def test_available_reason_when_missing(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == "llama_cpp" else real(n, *a))
    assert backend().available() == "llama-cpp-python not installed (pip install 'localmoe[llamacpp]')"
    with pytest.raises(BackendUnavailableError, match="llama-cpp-python not installed"):
        select_backend("llamacpp", "gguf")


def test_auto_on_safetensors_says_gguf_only_even_when_not_installed(monkeypatch):
    """`localmoe backends` / auto on a safetensors model: the reason llamacpp is skipped is
    that llama.cpp runs GGUF files only (installing it would not help), not that it is
    missing; on a GGUF model a missing llama-cpp-python is still the reason."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == "llama_cpp" else real(n, *a))
    _, why = select_backend("auto", "safetensors")
    assert "llamacpp: llama.cpp runs GGUF files only" in why and "not installed" not in why
    try:
        _, why = select_backend("auto", "gguf")
    except BackendUnavailableError:  # pragma: no cover - nothing else runs here
        return
    assert "llamacpp: llama-cpp-python not installed" in why or why.startswith("triton")


@pytest.mark.parametrize("kv,ok", [
    ("f16", True), ("bf16", True), ("f32", True), ("int8", True), ("int4", True),
    ("q8_0", True), ("int3", False), ("int2", False), ("fp4", False), ("int4:g64", False),
])
def test_kv_format_mapping(kv, ok):
    why = backend().supports("gguf", KVSpec.parse(kv))
    assert (why is None) == ok, why
    if not ok:
        assert "llama.cpp" in why and "--backend" in why


def test_refusals():
    b = backend()
    assert "GGUF files only" in b.supports("safetensors", KVSpec.parse("f16"))
    assert b.supports("gguf", KVSpec.parse("f16", k="int8", v="int4")) is None
    assert "int2" in b.supports("gguf", KVSpec.parse("f16", v="int2"))
    assert "outlier" in b.supports("gguf", KVSpec.parse("int4", outlier_frac=0.01))
    assert "sink" in b.supports("gguf", KVSpec.parse("int8", sink_tokens=4))


@pytest.mark.parametrize("kv,k,ok", [
    ("int4", None, True), ("int4:t", None, True), ("int4,kgroup=token", None, True),
    ("int8", None, True), ("k=int8,v=int4", None, True),
    ("int4:c", None, False), ("int4,kgroup=channel", None, False), ("int8:c", None, False),
    ("f16", "int4:c", False), ("k=int4:c,v=int4", None, False), ("int4,window=16", None, False),
    ("int4,outliers=0.02", None, False), ("int2,sinks=4", None, False), ("fp4", None, False),
    ("int4:t,koutliers=0.05", None, False), ("int4,koutliers=0", None, True),
])
def test_explicit_per_channel_keys_and_other_options_are_refused(kv, k, ok):
    """llama.cpp's q4_0/q8_0 group keys per token: the default int4 maps onto that, an explicit
    per-channel request (and every option llama.cpp lacks) is refused, and auto skips it."""
    from localmoe.engine.options import parse_kv_request

    spec = parse_kv_request(kv, k)
    why = backend().supports("gguf", spec)
    assert (why is None) == ok, why
    if not ok:
        assert "llama.cpp" in why and "--backend torch/triton" in why
        if has_llamacpp():
            b, _ = select_backend("auto", "gguf", spec)
            assert b.name != "llamacpp"
            with pytest.raises(BackendUnavailableError, match="llamacpp"):
                select_backend("llamacpp", "gguf", spec)


@pytest.mark.llamacpp
def test_per_channel_request_refused_before_weights_load(monkeypatch, smollm2_path):
    import llama_cpp

    from localmoe.api import LLM
    from localmoe.engine.options import parse_kv_request
    from localmoe.io.loader import open_model

    real = llama_cpp.Llama

    def no_load(*a, **k):
        raise AssertionError("weights must not load")

    monkeypatch.setattr(llama_cpp, "Llama", no_load)
    with pytest.raises(KVCacheFormatError, match="per-channel"):
        backend().load(open_model(smollm2_path), n_ctx=64, kv_spec=parse_kv_request("int4:c"))
    with pytest.raises(BackendUnavailableError, match="per-channel"):
        LLM(str(smollm2_path), backend="llamacpp", kv_cache="int4", kv_cache_k="int4:c")
    monkeypatch.setattr(llama_cpp, "Llama", real)
    # the default int4 runs, as what it is: per-token keys
    r = backend().load(open_model(smollm2_path), n_ctx=64, kv_spec=parse_kv_request("int4"))
    try:
        assert str(r.kv_spec) == "int4:t" and r.stats()["kv_type_k"] == "q4_0"
    finally:
        r.close()


@pytest.mark.llamacpp
def test_unsupported_kv_refused_before_weights_load(monkeypatch, smollm2_path):
    import llama_cpp

    from localmoe.io.loader import open_model

    def no_load(*a, **k):
        raise AssertionError("weights must not load")

    monkeypatch.setattr(llama_cpp, "Llama", no_load)
    mf = open_model(smollm2_path)
    with pytest.raises(KVCacheFormatError, match="int2"):
        backend().load(mf, n_ctx=128, kv_spec=KVSpec.parse("int2"))
    from localmoe.api import LLM

    with pytest.raises(BackendUnavailableError, match="int3"):
        LLM(str(smollm2_path), backend="llamacpp", kv_cache="int3")


@pytest.fixture(scope="module")
def runner(smollm2_path):
    if not has_llamacpp():
        pytest.skip("llama-cpp-python not installed")
    from localmoe.io.loader import open_model

    r = backend().load(open_model(smollm2_path), n_ctx=96, kv_spec=KVSpec.parse("f16"),
                       n_threads=1)
    yield r
    r.close()


PROMPT = [1, 504, 3458, 282, 4649, 314, 3458, 28, 357, 314, 253, 1345, 30]


@pytest.mark.slow
@pytest.mark.llamacpp
def test_runner_contract(runner):
    import torch

    assert runner.backend_name == "llamacpp" and runner.n_ctx == 96 and runner.max_seqs == 1
    assert runner.spec.arch == "llama"
    s = runner.new_sequence()
    full = runner.forward([(s, PROMPT)], all_logits=True)[0]
    assert full.shape == (len(PROMPT), runner.vocab_size) and full.dtype == torch.float32
    assert torch.isfinite(full).all()
    assert runner.seq_len(s) == len(PROMPT)
    # cached decoding == one prefill: re-run token by token after truncating
    runner.truncate(s, 5)
    assert runner.seq_len(s) == 5
    steps = [runner.forward([(s, [t])])[0] for t in PROMPT[5:]]
    inc = torch.stack(steps)
    # llama.cpp itself is not bit-identical between batched and one-token steps (different
    # matmul paths); measured: max |delta| 0.48 on a logit scale of 32. Bound at 3%, and the
    # argmax must agree wherever the top-2 gap exceeds that bound.
    tol = 0.03 * full.abs().max()
    assert (inc - full[5:]).abs().max() < tol
    top = full[5:].topk(2, -1).values
    clear = (top[:, 0] - top[:, 1]) > 2 * tol
    assert clear.any()
    assert (inc.argmax(-1) == full[5:].argmax(-1))[clear].all()
    # last-token logits equal the all_logits row
    runner.truncate(s, 0)
    last = runner.forward([(s, PROMPT)])[0]
    assert last.shape == (runner.vocab_size,)
    assert torch.allclose(last, full[-1], atol=1e-3, rtol=1e-3)
    # the context limit is enforced before compute
    with pytest.raises(ContextOverflowError) as ei:
        runner.forward([(s, list(range(100, 190)))])
    assert ei.value.n_ctx == 96
    assert runner.seq_len(s) == len(PROMPT)
    st = runner.stats()
    assert st["device"] == "cpu" and st["kv_type_k"] == "f16"
    assert st["kv_bytes"] == 30 * 3 * 64 * 2 * 2 * 96
    runner.free_sequence(s)


@pytest.mark.slow
@pytest.mark.llamacpp
@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_quantized_kv_runs(smollm2_path, kv):
    import torch

    from localmoe.io.loader import open_model

    r = backend().load(open_model(smollm2_path), n_ctx=64, kv_spec=KVSpec.parse(kv), n_threads=1)
    try:
        s = r.new_sequence()
        lg = r.forward([(s, PROMPT)], all_logits=True)[0]
        assert torch.isfinite(lg).all()
        st = r.stats()
        assert st["flash_attn"] is True
        assert st["kv_type_k"] == {"int8": "q8_0", "int4": "q4_0"}[kv]
        assert st["kv_bytes"] < 30 * 3 * 64 * 2 * 2 * 64 * 0.6
    finally:
        r.close()


@pytest.mark.slow
@pytest.mark.llamacpp
def test_engine_greedy_matches_raw_llama_cpp(smollm2_path):
    """Our tokenizer + engine + this runner produce llama.cpp's own greedy continuation."""
    import llama_cpp

    from localmoe.api import LLM

    prompt = "The capital of France is"
    raw = raw_llama(str(smollm2_path), n_ctx=128, n_threads=1, verbose=False)
    try:
        ref_ids = raw.tokenize(prompt.encode(), add_bos=True)
        ref = raw.create_completion(prompt, max_tokens=12, temperature=0.0, top_k=1)
        ref_text = ref["choices"][0]["text"]
    finally:
        raw.close()
    llm = LLM(str(smollm2_path), backend="llamacpp", n_ctx=128, n_threads=1)
    try:
        assert llm.backend_name == "llamacpp"
        assert llm.tokenizer.encode(prompt) == ref_ids
        r = llm.generate(prompt, temperature=0.0, max_tokens=12)
        n = min(len(r.text), len(ref_text))
        assert n > 10 and r.text[:n] == ref_text[:n]
    finally:
        llm.close()


@pytest.mark.llamacpp
def test_moe_model_generates_like_llama_cpp(tmp_path):
    """A synthetic Qwen3-MoE GGUF through our engine on llama.cpp: same greedy ids as
    llama.cpp's own loop over the same file."""
    import llama_cpp

    from localmoe.api import LLM
    from localmoe.testing.synthetic import write_gguf

    p = str(write_gguf(tmp_path / "tiny-qwen3moe.gguf", "tiny-qwen3moe", quant="mixed"))
    llm = LLM(p, backend="llamacpp", n_ctx=64, n_threads=1)
    try:
        assert llm.spec.n_experts == 8
        prompt = llm.tokenizer.encode("hello world", add_special=True)
        r = llm.generate(prompt, temperature=0.0, max_tokens=8,
                         logit_bias={i: -100.0 for i in llm.tokenizer.eog_ids})
        ours = r.token_ids
        LLM_EOG = set(llm.tokenizer.eog_ids)
    finally:
        llm.close()
    eog = sorted(LLM_EOG)
    raw = raw_llama(p, n_ctx=64, n_threads=1, verbose=False, logits_all=True)
    try:
        ref = []
        raw.eval(prompt)
        for _ in range(8):
            logits = raw.scores[raw.n_tokens - 1].copy()
            logits[eog] -= 100.0
            tok = int(logits.argmax())
            ref.append(tok)
            raw.eval([tok])
    finally:
        raw.close()
    assert len(ours) == 8
    assert ours == ref


@pytest.mark.parametrize("device,gpu_opts", [("cuda:1", {"main_gpu": 1, "split_mode": 0}),
                                             ("cuda", {}), ("cpu", None)])
def test_device_index_is_used_and_reported(tmp_path, monkeypatch, device, gpu_opts):
    """cuda:N puts the model on GPU N alone and the runner reports cuda:N (it said 'cuda');
    plain cuda keeps llama.cpp's split over every GPU."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import types

    import localmoe.backends.llamacpp_backend as lb
    from localmoe.io.loader import open_model
    from localmoe.testing.synthetic import write_gguf

    calls = []
    monkeypatch.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: True)
    monkeypatch.setattr(llama_cpp, "Llama", lambda **kw: calls.append(kw) or object())
    monkeypatch.setattr(lb, "LlamaCppRunner",
                        lambda llm, spec, ctx, kv, dev, **kw: types.SimpleNamespace(device=dev))
    mf = open_model(write_gguf(tmp_path / "t.gguf", "tiny-llama"))
    r = backend().load(mf, n_ctx=32, device=device)
    assert r.device == device
    (kw,) = calls
    assert kw["n_gpu_layers"] == (0 if gpu_opts is None else -1)
    for key in ("main_gpu", "split_mode"):
        assert kw.get(key) == (gpu_opts or {}).get(key), (key, kw)


def test_missing_gpu_is_refused_before_weights_load(monkeypatch):
    llama_cpp = pytest.importorskip("llama_cpp")
    import torch

    monkeypatch.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: False)
    assert "no GPU support" in backend().check_device("cuda:0")
    assert backend().check_device("cpu") is None
    monkeypatch.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: True)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert "'cuda:7' does not exist" in backend().check_device("cuda:7")
    assert backend().check_device("cuda:1") is None


def test_no_offload_advice_names_what_works_here(monkeypatch):
    """Without GPU offload in llama-cpp-python, the advice for --device cuda depends on what
    torch sees: no CUDA device -> say so and point to cpu (triton/torch could not run either);
    a CUDA device -> the triton/torch backends."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import torch

    monkeypatch.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    why = backend().check_device("cuda")
    assert "no CUDA device is visible here" in why and "--backend triton/torch" not in why
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    why = backend().check_device("cuda:0")
    assert "no GPU support" in why and "--backend triton/torch" in why


def test_an_unavailable_backend_names_the_ones_that_run_here(monkeypatch):
    """`--backend llamacpp` without llama-cpp-python says why and which backends do run
    (the torch reference always does)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == "llama_cpp" else real(n, *a))
    with pytest.raises(BackendUnavailableError) as e:
        select_backend("llamacpp", "gguf")
    msg = str(e.value)
    assert "available here: " in msg and "torch" in msg.split("available here: ")[1]
    assert "llamacpp" not in msg.split("available here: ")[1]


@pytest.mark.parametrize("info,env,off", [(b"AVX2 = 1 | AMX_INT8 = 1 | REPACK = 1", "", True),
                                          (b"AVX2 = 1 | AMX_INT8 = 1", "1", False),
                                          (b"AVX2 = 1 | AMX_INT8 = 1", "yes", False),
                                          (b"AVX2 = 1 | AMX_INT8 = 1", "0", True),
                                          (b"AVX2 = 1 | REPACK = 1", "", False)])
def test_amx_builds_load_without_the_extra_cpu_buffers(monkeypatch, info, env, off):
    """On a llama.cpp built with AMX, models load with ``use_extra_bufts = False`` (the AMX
    matrix multiply segfaulted on the first decode on a Sapphire Rapids VM,
    llama.cpp#20824), only for the duration of the load and unless LOCALMOE_LLAMACPP_AMX=1;
    other builds keep llama.cpp's defaults. A fake binding stands in for llama-cpp-python."""
    import types

    from localmoe.backends.llamacpp_backend import safe_model_params

    class Params:
        _fields_ = [("n_gpu_layers", int), ("use_extra_bufts", bool)]

        def __init__(self):
            self.use_extra_bufts = True

    low = types.SimpleNamespace(llama_model_default_params=Params)
    fake = types.SimpleNamespace(llama_cpp=low, llama_print_system_info=lambda: info)
    monkeypatch.setenv("LOCALMOE_LLAMACPP_AMX", env)
    with safe_model_params(fake) as was_off:
        inside = low.llama_model_default_params().use_extra_bufts
    assert was_off is off and inside is (not off)
    assert low.llama_model_default_params is Params       # restored


@pytest.mark.llamacpp
def test_uncompilable_chat_template_loads_and_runs_raw(tmp_path):
    """A GGUF whose chat template does not compile: llama-cpp-python does not compile the
    file's templates (it raised jinja2's TemplateSyntaxError out of ``Llama()``); the model
    loads without its template (our own warning) and raw completions run."""
    from localmoe.api import LLM
    from tests.hostile.gen import build, set_kv

    p = str(build(tmp_path / "badtpl.gguf", "tiny-qwen3moe",
                  kv=set_kv("tokenizer.chat_template", "{% if %}bad", "str")))
    llm = LLM(p, backend="llamacpp", n_ctx=64, n_threads=1)
    try:
        assert llm.backend_name == "llamacpp"
        prompt = llm.tokenizer.encode("hello world", add_special=True)
        r = llm.generate(prompt, temperature=0.0, max_tokens=4,
                         logit_bias={i: -100.0 for i in llm.tokenizer.eog_ids})
        assert len(r.token_ids) == 4
    finally:
        llm.close()
    raw = raw_llama(p, n_ctx=64, n_threads=1, verbose=False)  # the references load it too
    raw.close()


def test_a_path_that_is_not_utf8_is_one_clear_error(tmp_path):
    """llama-cpp-python encodes the path as UTF-8: a file name with a byte that is not UTF-8
    (a surrogate-escaped str on Linux) failed with "'utf-8' codec can't encode character
    '\\udcff' ... surrogates not allowed"; the error now says what is wrong and what works."""
    pytest.importorskip("llama_cpp")
    import os

    from localmoe.errors import ModelLoadError
    from localmoe.io.loader import open_model
    from localmoe.testing.synthetic import write_gguf

    good = write_gguf(tmp_path / "t.gguf", "tiny-llama")
    bad = tmp_path / os.fsdecode(b"bad\xffname.gguf")
    os.rename(good, bad)
    mf = open_model(bad)
    with pytest.raises(ModelLoadError) as ei:
        backend().load(mf, n_ctx=32)
    msg = str(ei.value)
    assert "not valid UTF-8" in msg and "--backend torch" in msg, msg
    assert "surrogates not allowed" not in msg and "\n" not in msg
