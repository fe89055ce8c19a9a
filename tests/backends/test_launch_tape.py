"""The launch tape (backends/triton/tape.py): the eager decode step recorded once, replayed
launch by launch. Without CUDA the Triton kernels run through the interpreter (the recorded
launch is the interpreted call); on the GPU the compiled launcher."""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
pytest.importorskip("gguf")

import triton.language as tl  # noqa: E402

from localmoe.backends.triton.runner import TritonRunner  # noqa: E402
from localmoe.backends.triton.tape import record  # noqa: E402
from localmoe.io.loader import open_model  # noqa: E402
from localmoe.testing.synthetic import write_gguf  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
DT = torch.float16 if CUDA else torch.float32


@triton.jit
def _add_one_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=m) + 1.0, mask=m)


def test_replay_repeats_launches_and_operators_in_order():
    """A step mixing PyTorch operators (functional, in place, a dtype conversion, views, an
    allocation) and a Triton launch: the replay recomputes everything from the inputs' current
    values, in the recorded order, into the recorded result."""
    src = torch.arange(6, dtype=torch.float32, device=DEV)
    acc = torch.zeros(6, device=DEV)

    def step():
        h = (src * 2).to(torch.float64)          # functional + a converting ``to``
        v = h.view(2, 3)[1]                      # views: nothing to replay
        scratch = torch.empty(6, device=DEV)     # allocation: nothing to replay
        scratch.copy_(src)                       # in place
        _add_one_kernel[(1,)](scratch, 6, BLOCK=8)
        acc.add_(scratch)                        # in place, accumulates across replays
        return v.sum() + h[0] + scratch.sum().to(torch.float64)

    out, tape, why = record(step)
    assert why is None and tape is not None
    assert tape.n_triton == 1 and tape.n_torch >= 5
    first = out.item()
    assert first == pytest.approx(2 * (3 + 4 + 5) + 0 + 21)
    src += 10                                    # new inputs, as a decode step's buffers
    again = tape.replay()
    assert again is out                          # the recorded result, overwritten
    assert again.item() == pytest.approx(2 * (13 + 14 + 15) + 20 + 81)
    assert torch.equal(acc, (torch.arange(6, device=DEV) + 1) + (torch.arange(6, device=DEV) + 11))


@pytest.mark.parametrize("step,why", [
    (lambda: torch.ones(3, device=DEV) * torch.ones(3, device=DEV).sum().item(), "host read"),
    (lambda: torch.rand(3, device=DEV), "random operator"),
    (lambda: torch.ones(3, device=DEV).max(0), "not one tensor"),
])
def test_steps_a_replay_cannot_repeat_are_not_recorded(step, why):
    out, tape, reason = record(step)
    assert tape is None and why in reason
    assert out is not None                       # the step itself ran normally


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("tape") / "m.gguf", "tiny-qwen3moe", seed=1)


def _decode(r, steps: int):
    """Two sequences decoding together, then the second alone (two static-buffer buckets);
    returns the logits stacked. Both prompts prefill in one call: 9 rows go through the GEMM
    (in the interpreter a prompt of up to 8 rows takes the GEMV, whose time grows with its
    rows: twice the time of the two prompts' one GEMM)."""
    a, b = r.new_sequence(), r.new_sequence()
    r.forward([(a, [3, 9, 27, 81, 7, 21, 63]), (b, [5, 25])])
    outs = []
    for i in range(steps):
        outs += [t.clone() for t in r.forward([(a, [11 + i]), (b, [40 + i])])]
        outs += [t.clone() for t in r.forward([(b, [90 + i])])]
    return torch.stack(outs)


def test_eager_decode_replays_its_tape_with_the_same_logits(model_file, monkeypatch):
    """With CUDA graphs off, the second eager step of each (batch, bucket) records its launches
    and later steps replay them: the logits equal those of steps launched from Python (bit for
    bit in the interpreter; within split-K float reordering on the GPU)."""
    mf = open_model(str(model_file))
    monkeypatch.setenv("LOCALMOE_PREFILL_GRAPHS", "0")
    runs = {}
    for tape in ("0", "1"):
        monkeypatch.setenv("LOCALMOE_LAUNCH_TAPE", tape)
        r = TritonRunner(mf, n_ctx=64, device=DEV, dtype=DT, max_seqs=2, cuda_graphs=False)
        runs[tape] = _decode(r, 3)
        st = r.stats()["launch_tape"]
        if tape == "1":
            assert st == {"recorded": 2, "replays": 2}, st
        else:
            assert st == "off (LOCALMOE_LAUNCH_TAPE=0)"
    if CUDA:
        scale = runs["0"].abs().max()
        assert (runs["1"] - runs["0"]).abs().max() < 1e-2 * scale
    else:
        assert torch.equal(runs["1"], runs["0"])
