"""Routing traces (localmoe.model.routing_trace) on a synthetic MoE: the recorder leaves the
output unchanged and records what the router chose; the look-ahead logits are the next layer's
router on this layer's hidden state; the file format's round trip and errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from localmoe.errors import UnsupportedModelError
from localmoe.io.loader import open_model
from localmoe.model.routing import route
from localmoe.model.routing_trace import RoutingRecorder, Trace, load_trace, save_trace
from localmoe.model.transformer import Transformer
from localmoe.testing import synthetic

TOKENS = torch.tensor([1, 5, 9, 33, 7, 2, 64, 12, 3], dtype=torch.int64)


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory):
    return open_model(synthetic.write_gguf(tmp_path_factory.mktemp("rt") / "q.gguf", "tiny-qwen3moe"))


def _model(mf):
    return Transformer.from_model_file(mf, packed=False)


def test_recorder_leaves_output_unchanged_and_records_the_routing(moe_file):
    model = _model(moe_file)
    want = model.forward_full(TOKENS)
    seen = {}
    inner = model.moe

    def spy(layer, x):  # what the MoE hook receives, to route independently
        seen[layer] = x.clone()
        return inner(layer, x)

    model.moe = spy
    with torch.no_grad(), RoutingRecorder(model, ahead=2) as rec:
        got = model.forward_full(TOKENS)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert model.moe is spy                       # uninstalled
    ids, ws, ah = rec.take()
    s = model.spec
    assert ids.shape == (len(TOKENS), 2, s.top_k) and ah.shape == (len(TOKENS), 2, 2, s.n_experts)
    for i, l in enumerate(rec.moe_layers):
        w, e = route(seen[l] @ model.layers[l]["router"], s.top_k, gating=s.gating,
                     norm_topk_prob=s.norm_topk_prob)
        np.testing.assert_array_equal(ids[:, i], e.numpy())
        np.testing.assert_allclose(ws[:, i].astype(np.float32), w.numpy(), atol=1e-3)
    assert np.isnan(ah[:, 1].astype(np.float32)).all()          # nothing after the last layer
    assert np.isnan(ah[:, 0, 1].astype(np.float32)).all()       # only 2 MoE layers
    assert rec.take()[0].shape[0] == 0                           # take() cleared it


def test_lookahead_is_the_next_router_on_this_hidden_state(moe_file):
    """With layer 0's FFN output and layer 1's attention output zeroed, layer 1's FFN sees the
    same residual stream as layer 0's: the look-ahead logits must then pick exactly layer 1's
    experts."""
    model = _model(moe_file)
    model.layers[1]["wo"] = torch.zeros_like(model.layers[1]["wo"])
    inner = model.moe
    model.moe = lambda layer, x: torch.zeros_like(x) if layer == 0 else inner(layer, x)
    with torch.no_grad(), RoutingRecorder(model, ahead=1) as rec:
        model.forward_full(TOKENS)
    ids, _, ah = rec.take()
    k = model.spec.top_k
    pred = np.argsort(-ah[:, 0, 0].astype(np.float32), axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(np.sort(pred, 1), np.sort(ids[:, 1], 1))
    # with the blocks left as they are, the residual stream moves between the layers: the
    # same look-ahead logits then miss some of layer 1's experts (the check above is not vacuous)
    model2 = _model(moe_file)
    with torch.no_grad(), RoutingRecorder(model2, ahead=1) as rec2:
        model2.forward_full(TOKENS)
    ids2, _, ah2 = rec2.take()
    np.testing.assert_array_equal(ah2[:, 0, 0], ah[:, 0, 0])     # layer 0's input is the same
    assert not np.array_equal(np.sort(pred, 1), np.sort(ids2[:, 1], 1))


def test_dense_model_is_refused(tmp_path):
    dense = open_model(synthetic.write_gguf(tmp_path / "d.gguf", "tiny-llama"))
    with pytest.raises(UnsupportedModelError, match="no MoE layers"):
        RoutingRecorder(_model(dense))


def test_file_errors(tmp_path):
    t = Trace("a", "x", 1, np.zeros(2, np.int32), np.zeros((2, 1, 1), np.int16),
              np.zeros((2, 1, 1), np.float16), np.zeros((2, 1, 0, 4), np.float16))
    with pytest.raises(ValueError, match="unique"):
        save_trace(tmp_path / "t.npz", [t, t], {})
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(ValueError, match="not a routing trace"):
        load_trace(tmp_path / "other.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a routing trace"):
        load_trace(tmp_path / "junk.npz")
    _, back = load_trace(save_trace(tmp_path / "ok.npz", [t], {}))
    assert back[0].steps.tolist() == [1, 1]          # steps derived when not given
