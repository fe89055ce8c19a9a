"""When the decode step's kernels launch with programmatic dependent launch (kernels/pdl.py):
by default on a CUDA device of compute capability 9.0+ with a Triton that can (LOCALMOE_PDL=0
turns it off), never under the interpreter; otherwise the launch arguments leave the kernels
as they were. Where a kernel signals its dependent follows LOCALMOE_PDL_ORDER (default: at
the block's exit). The bit-for-bit GPU comparison is in tests/backends/test_triton_quant.py."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from localmoe.kernels import pdl  # noqa: E402


@pytest.fixture
def gpu_that_can(monkeypatch):
    """Pretend device 0 is a Hopper GPU and Triton can launch with PDL."""
    monkeypatch.setattr(pdl, "_device_supports", lambda index: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_on_by_default_for_a_capable_gpu(gpu_that_can, monkeypatch):
    for k in ("LOCALMOE_PDL", "LOCALMOE_PDL_ORDER", "LOCALMOE_PDL_PREFETCH"):
        monkeypatch.delenv(k, raising=False)
    dev = torch.device("cuda", 0)
    assert pdl.pdl_args(dev) == {"PDL": pdl.PDL_ORDERS["at_exit"], "launch_pdl": True}
    assert not pdl.pdl_prefetch(dev)           # the L2 prefetch only when asked
    monkeypatch.setenv("LOCALMOE_PDL_PREFETCH", "1")
    assert pdl.pdl_prefetch(dev)
    monkeypatch.setenv("LOCALMOE_PDL", "0")
    assert pdl.pdl_args(dev) == {"PDL": 0}
    assert not pdl.pdl_prefetch(dev)


@pytest.mark.parametrize("order", ["signal_first", "wait_first", "at_exit"])
def test_the_order_picks_the_kernels_mode(order, gpu_that_can, monkeypatch):
    monkeypatch.delenv("LOCALMOE_PDL", raising=False)
    monkeypatch.setenv("LOCALMOE_PDL_ORDER", order)
    modes = {pdl.pdl_args(torch.device("cuda", 0))["PDL"] for _ in range(2)}
    assert modes == {pdl.PDL_ORDERS[order]} and 0 not in modes


def test_an_unknown_order_is_logged_and_read_as_the_default(gpu_that_can, monkeypatch, caplog):
    monkeypatch.delenv("LOCALMOE_PDL", raising=False)
    monkeypatch.setenv("LOCALMOE_PDL_ORDER", "sideways")
    pdl._warn_order.cache_clear()
    with caplog.at_level("WARNING"):
        assert pdl.pdl_args(torch.device("cuda", 0))["PDL"] == pdl.PDL_ORDERS["at_exit"]
    assert "sideways" in caplog.text


@pytest.mark.parametrize("why", ["cpu", "interpreter", "old gpu"])
def test_never_where_it_cannot_run(why, monkeypatch):
    monkeypatch.setenv("LOCALMOE_PDL", "1")
    dev = torch.device("cuda", 0)
    monkeypatch.setattr(pdl, "_device_supports", lambda index: why != "old gpu")
    if why == "cpu":
        dev = torch.device("cpu")
    if why == "interpreter":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert pdl.pdl_args(dev) == {"PDL": 0}


def test_the_capability_check_reads_the_device(monkeypatch):
    """Hopper (9.0) and later can; Ampere (8.x) cannot, whatever Triton supports."""
    pdl._device_supports.cache_clear()
    monkeypatch.setattr(pdl, "_triton_can_launch_pdl", lambda: True)
    for cap, want in (((8, 9), False), ((9, 0), True), ((10, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, c=cap: c)
        pdl._device_supports.cache_clear()
        assert pdl._device_supports(0) is want
    pdl._device_supports.cache_clear()


def test_status_names_the_mode_or_why_not(gpu_that_can, monkeypatch):
    for k in ("LOCALMOE_PDL", "LOCALMOE_PDL_ORDER"):
        monkeypatch.delenv(k, raising=False)
    assert pdl.pdl_status(torch.device("cuda", 0)) == "on (at_exit)"
    monkeypatch.setenv("LOCALMOE_PDL_ORDER", "wait_first")
    assert pdl.pdl_status("cuda:0") == "on (wait_first)"
    assert pdl.pdl_status("cpu") == "off (not a CUDA device)"
    monkeypatch.setenv("LOCALMOE_PDL", "0")
    assert pdl.pdl_status("cuda:0") == "off (LOCALMOE_PDL=0)"
    monkeypatch.delenv("LOCALMOE_PDL")
    monkeypatch.setattr(pdl, "_device_supports", lambda index: False)
    assert pdl.pdl_status("cuda:0").startswith("off (needs compute capability 9.0+")
    assert pdl.pdl_args(torch.device("cuda", 0)) == {"PDL": 0}
