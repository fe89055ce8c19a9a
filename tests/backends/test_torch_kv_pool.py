"""The torch backend's KV block pool is sized to the use: one full-context sequence."""

from __future__ import annotations

import math

import pytest

from localmoe.kv.spec import KVSpec


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from localmoe.testing.synthetic import write_gguf

    return str(write_gguf(tmp_path_factory.mktemp("pool") / "t.gguf", "tiny-llama"))


@pytest.mark.parametrize("kv", ["f16", "int8", "int4", "int4:t", "int2"])
def test_pool_holds_one_sequence_as_info_reports(tiny, kv):
    from localmoe.cli import model_info
    from localmoe.api import LLM
    from localmoe.io.loader import open_model

    llm = LLM(tiny, backend="torch", kv_cache=kv)
    try:
        assert llm.runner.max_seqs == 1
        cache = llm.runner.cache
        assert cache.n_blocks == math.ceil(llm.n_ctx / cache.block_size)
        info = model_info(open_model(tiny))
        assert llm.n_ctx == info["n_ctx_default"]
        per_token = info["kv_bytes_per_token"][kv]
        assert per_token == KVSpec.parse(kv).bytes_per_token(llm.spec)
        # allocated = what info gives for the default context (n_ctx is a whole number of pages)
        assert llm.stats()["kv_bytes"] == pytest.approx(per_token * info["n_ctx_default"], rel=0.02)
        assert llm.generate("hello", max_tokens=3, temperature=0).completion_tokens >= 1
    finally:
        llm.close()


def test_more_sequences_on_request(tiny):
    from localmoe.errors import LocalMoEError
    from localmoe.io.loader import open_model
    from localmoe.backends.registry import get_backend

    one = get_backend("torch").load(open_model(tiny), n_ctx=64)
    s = one.new_sequence()
    with pytest.raises(LocalMoEError, match="at most 1"):
        one.new_sequence()
    one.free_sequence(s)
    two = get_backend("torch").load(open_model(tiny), n_ctx=64, max_seqs=2)
    assert two.stats()["kv_bytes"] == 2 * one.stats()["kv_bytes"]
    two.new_sequence(), two.new_sequence()
