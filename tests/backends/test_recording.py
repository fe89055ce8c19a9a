"""Recording a runner's routing (localmoe.backends.recording): each recorded row paired with the
token the runner was fed, forward calls as steps, generation unchanged; runners without the
shared transformer (llama.cpp) refused."""

from __future__ import annotations

import numpy as np
import pytest

from localmoe.backends.recording import RunnerRecorder, load_trace, save_trace
from localmoe.errors import UnsupportedModelError
from localmoe.io.loader import open_model
from localmoe.testing import synthetic


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory):
    return open_model(synthetic.write_gguf(tmp_path_factory.mktemp("rec") / "q.gguf", "tiny-qwen3moe"))


def test_llamacpp_like_runner_is_refused():
    class NoModel:
        backend_name = "llamacpp"

    with pytest.raises(UnsupportedModelError, match="llamacpp backend cannot record"):
        RunnerRecorder(NoModel())


def test_runner_recording_pairs_tokens_and_steps(moe_file, tmp_path):
    from localmoe.engine.engine import Engine

    eng = Engine(moe_file, backend="torch", n_ctx=128, n_threads=1)
    try:
        prompt = [1, 5, 9, 33, 7, 2]
        want = eng.generate(prompt, temperature=0.0, max_tokens=5).token_ids
        eng.reset()
        rec = RunnerRecorder(eng.runner)
        with rec:
            got = eng.generate(prompt, temperature=0.0, max_tokens=5).token_ids
        assert "forward" not in vars(eng.runner)                 # the class's method again
        tr = rec.take_trace("p", "generate")
    finally:
        eng.close()
    assert got == want
    n_fwd = len(got) - 1 if len(got) == 5 else len(got)        # the last token is not fed back
    assert tr.tokens.tolist() == prompt + got[:n_fwd]
    assert tr.n_prompt == len(prompt) and tr.steps.tolist() == [len(prompt)] + [1] * n_fwd
    assert tr.ids.shape[0] == len(tr.tokens)
    path = save_trace(tmp_path / "trace.routing", [tr], rec.meta())
    assert path == tmp_path / "trace.routing" and path.is_file()    # no ".npz" appended
    meta, back = load_trace(path)
    assert meta["moe_layers"] == [0, 1] and meta["version"] == 2
    np.testing.assert_array_equal(back[0].ids, tr.ids)
    np.testing.assert_array_equal(back[0].steps, tr.steps)
