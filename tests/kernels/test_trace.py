"""The MoE launches' time stamps (localmoe.kernels.trace, benchmarks/trace_moe.py): the
summary arithmetic on hand-made records (CPU), and on the GPU that a traced launch computes
the same result as an untraced one with ordered stamps in every program."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from localmoe.kernels.trace import RECORD, SM, trace_buffer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import trace_moe as T  # noqa: E402

CUDA = torch.cuda.is_available()


def _rec(stamps_ns, sm=0, cycles_per_ns=2):
    r = torch.zeros(RECORD, dtype=torch.int64)
    for i, v in enumerate(stamps_ns):
        if v is not None:
            r[2 * i], r[2 * i + 1] = v, v * cycles_per_ns
    r[SM] = sm
    return r


def test_launch_summary_reads_phases_gaps_and_the_slowest_program():
    gu = torch.stack([_rec([1000, 1100, 1400, 2400, 2500, None], sm=0),
                      _rec([1050, 1150, 1350, 2950, 3000, 3600], sm=1),
                      _rec([1020, 1120, 1320, 2020, 2100, None], sm=1)])
    dn = torch.stack([_rec([3500, 3700, 3800, 4800, 4900]), _rec([3550, 3750, 3850, 5050, 5100], sm=3)])
    nxt = torch.stack([_rec([5300, 5400, 5500, 6000, 6100, None])])
    calls = T.call_summaries([(gu, dn), (nxt, dn + 2000)])
    c = calls[0]
    g = c["gate_up"]
    assert (g["first_entry_ns"], g["last_entry_ns"], g["last_exit_ns"]) == (0, 50, 2600)
    assert g["sms"] == 2 and g["programs"] == 3
    assert g["median_ns waited->routed"] == 200
    assert g["median_ns routed->loop"] == 1000
    assert g["median_cycles routed->loop"] == 2000
    assert g["median_ns exit->combined"] == 600           # only the program that combined
    assert g["slowest_program_ns"]["loop->exit"] == 50 and g["slowest_program_ns"]["entry"] == 50
    assert c["gap_gate_up_down_ns"] == 3500 - 1000 - 2600
    assert c["down"]["last_exit_ns"] == 4100 and c["span_ns"] == 4100
    assert c["gap_down_next_ns"] == 5300 - 1000 - 4100
    assert "gap_down_next_ns" not in calls[1]
    agg = T.aggregate(calls)
    assert agg["gate_up/median_ns waited->routed"] == 150   # median of 200 and 100
    assert T.timer_step([(gu, dn)]) == 20


def test_a_launch_without_stamps_is_an_error():
    with pytest.raises(ValueError, match="no program"):
        T.launch_summary(torch.zeros(2, RECORD, dtype=torch.int64), T.DOWN_PHASES, 0)


def test_a_trace_off_the_gpu_is_a_clear_error():
    from localmoe.kernels.fused_moe import _trace_args

    with pytest.raises(ValueError, match="CUDA GPU"):
        _trace_args(trace_buffer(4, "cpu"), 4, torch.zeros(1))


@pytest.mark.skipif(not CUDA, reason="the stamps are PTX: needs a CUDA GPU")
@pytest.mark.parametrize("split", [1, 2])
def test_traced_moe_matches_and_every_program_stamps_in_order(split):
    from localmoe.kernels.fused_moe import fused_moe, moe_programs
    from localmoe.kernels.qtensor import QuantTensor, random_gguf_blocks

    e, f, d, k = 16, 256, 1024, 4      # K = 32 chunks: two 16-chunk tiles, so split 2 splits
    g = torch.Generator().manual_seed(0)

    def make(shape, seed):
        return QuantTensor.from_gguf(random_gguf_blocks("Q4_K", shape, seed=seed), "Q4_K", shape,
                                     device="cuda")
    gu = QuantTensor.interleave_rows(make((e, f, d), 1), make((e, f, d), 2))
    wd = make((e, d, f), 3)
    x = torch.randn(1, d, generator=g).cuda()
    ids = torch.randperm(e, generator=g)[:k][None].to(torch.int32).cuda()
    w = torch.softmax(torch.randn(1, k, generator=g), -1).cuda()
    cfg = {"gate_up": {"split": split, "BN": 32, "CH": 16}}
    assert moe_programs("gate_up", gu, 1, k, cfg["gate_up"]) == split * (f // 32) * k
    bufs = (trace_buffer(moe_programs("gate_up", gu, 1, k, cfg["gate_up"]), "cuda"),
            trace_buffer(moe_programs("down", wd, 1, k), "cuda"))
    ref = fused_moe(x, gu, wd, ids, w, config=cfg)
    out = fused_moe(x, gu, wd, ids, w, config=cfg, trace=bufs)
    assert torch.equal(ref, out)
    for rec, n in ((bufs[0].cpu(), 5), (bufs[1].cpu(), 5)):
        ts = rec[:, 0:2 * n:2]
        assert (ts > 0).all()
        assert (ts[:, 1:] >= ts[:, :-1]).all()
    combined = bufs[0][:, 10].cpu()            # stamp 5: the split-K part that combined
    if split > 1:    # one per (row block, expert), after its own exit stamp
        assert int((combined > 0).sum()) == bufs[0].shape[0] // split
        done = combined > 0
        assert (combined[done] >= bufs[0][done, 8].cpu()).all()
    else:
        assert not combined.any()
