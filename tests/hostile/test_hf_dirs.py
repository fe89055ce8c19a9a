"""Hostile HF model directories (config.json, index, tokenizer files): opened, or refused with
one clear line; never a traceback, a hang or an allocation driven by a corrupt count."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from localmoe.errors import LocalMoEError
from localmoe.io.loader import open_model


def _cfg(**kw):
    return lambda c: c.update(kw)


CASES = {
    "deep_config": ('{"a":' * 100000 + "1" + "}" * 100000, None),
    "config_list": ("[1, 2]", None),
    "layers_1e9": (None, _cfg(num_hidden_layers=10**9)),
    "layers_1": (None, _cfg(num_hidden_layers=1)),
    "experts_1e6": (None, _cfg(num_experts=10**6)),
    "vocab_small": (None, _cfg(vocab_size=100)),
    "kv_heads_str": (None, _cfg(num_key_value_heads="2")),
    "head_dim_7": (None, _cfg(head_dim=7)),
    "ctx_str": (None, _cfg(max_position_embeddings="x")),
    "eps_negative": (None, _cfg(rms_norm_eps=-1.0)),
    "rope_nan": (None, _cfg(rope_theta=float("nan"), rope_parameters={"rope_theta": float("nan")})),
    "hidden_float": (None, _cfg(hidden_size=256.5)),
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from localmoe.testing.synthetic import write_hf

    return write_hf(tmp_path_factory.mktemp("hf") / "base", "tiny-qwen3moe")


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_config_is_refused_in_one_line(base, tmp_path, name):
    raw, edit = CASES[name]
    d = tmp_path / name
    shutil.copytree(base, d)
    if edit is not None:
        c = json.loads((base / "config.json").read_text())
        edit(c)
        raw = json.dumps(c)
    (d / "config.json").write_text(raw)
    with pytest.raises(LocalMoEError) as ei:
        open_model(d).close()
    assert "\n" not in str(ei.value) and len(str(ei.value)) < 600


def test_deep_tokenizer_config_is_refused(base, tmp_path):
    d = tmp_path / "tc"
    shutil.copytree(base, d)
    (d / "tokenizer_config.json").write_text('{"a":' * 100000 + "1" + "}" * 100000)
    with pytest.raises(LocalMoEError):
        open_model(d).close()


def test_the_base_directory_opens(base):
    open_model(Path(base)).close()


def test_tokenizer_larger_than_the_embedding_is_refused_before_the_load(base, tmp_path):
    from localmoe.engine.engine import Engine
    from localmoe.errors import ModelLoadError

    d = tmp_path / "tok"
    shutil.copytree(base, d)
    tj = json.loads((d / "tokenizer.json").read_text())
    n = len(tj["model"]["vocab"]) + len(tj["added_tokens"])
    tj["added_tokens"].append({"id": n + 40, "content": "<|far|>", "single_word": False, "lstrip": False,
                               "rstrip": False, "normalized": False, "special": True})
    (d / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(ModelLoadError, match="rows"):
        Engine(str(d), backend="torch", n_ctx=64)
