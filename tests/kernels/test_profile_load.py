"""benchmarks/profile_load.py times the weight load's phases on the tensors it is asked for
(here on the CPU: the pageable copy, the repack, the scale check, the gate/up join)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("triton")

from localmoe.io.loader import open_model  # noqa: E402
from localmoe.testing.synthetic import write_gguf  # noqa: E402

TOOL = Path(__file__).resolve().parents[2] / "benchmarks" / "profile_load.py"


def _tool():
    spec = importlib.util.spec_from_file_location("profile_load_under_test", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_phases_of_the_selected_tensors(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, "tiny-qwen3moe", seed=0)
    res = _tool().profile(str(path), r"^blk\.1\.", device="cpu")
    names = [t["name"] for t in res["tensors"]]
    assert names and all(n.startswith("blk.1.") for n in names)
    mf = open_model(str(path))
    assert res["sampled_bytes"] == sum(mf.raw_tensor(n).data.nbytes for n in names)
    assert {"h2d_pageable", "repack", "from_gguf", "check_finite", "interleave"} <= set(res["phases"])
    assert "pinned_h2d" not in res["phases"]            # CUDA only
    joined = [t for t in res["tensors"] if "interleave" in t]
    assert [t["name"] for t in joined] == ["blk.1.ffn_up_exps.weight"]
    # the file's estimate scales the sample by bytes
    p = res["phases"]["from_gguf"]
    assert p["file_s"] == pytest.approx(p["s"] * res["file_bytes"] / res["sampled_bytes"], rel=0.05, abs=0.01)
    with pytest.raises(ValueError, match="no tensor"):
        _tool().profile(str(path), r"^nothing", device="cpu")
