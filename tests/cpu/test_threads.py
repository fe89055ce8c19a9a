"""The torch backend's CPU thread count: --threads / LOCALMOE_THREADS, else the physical cores
minus the cores other processes keep busy."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from localmoe.cpu.threads import _CPUBusy, default_threads, physical_cores


@pytest.fixture(autouse=True)
def _restore_threads(monkeypatch):
    n = torch.get_num_threads()
    monkeypatch.delenv("LOCALMOE_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    yield
    torch.set_num_threads(n)


def test_default_leaves_room_for_busy_cores(monkeypatch):
    phys = physical_cores()
    assert 1 <= phys <= (__import__("os").cpu_count() or 1)
    assert default_threads(0.0)[0] == phys  # an idle machine keeps every physical core
    assert default_threads(0.3)[0] == phys  # background noise is not a busy core
    assert default_threads(1.0)[0] == max(1, phys - 1)
    assert default_threads(phys + 5.0)[0] == 1
    n, why = default_threads(1.0)
    assert "physical cores" in why and "busy elsewhere" in why
    torch.set_num_threads(phys + 3)  # a count the caller chose is kept
    assert default_threads(1.0) == (phys + 3, "torch.set_num_threads")
    torch.set_num_threads(phys)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert default_threads(0.0) == (torch.get_num_threads(), "OMP_NUM_THREADS")
    monkeypatch.setenv("LOCALMOE_THREADS", "3")
    assert default_threads(5.0) == (3, "LOCALMOE_THREADS/--threads")


def test_busy_cores_of_other_processes_are_measured():
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        import time

        time.sleep(0.3)
        busy = _CPUBusy(min_s=0.6).start().cores()
    finally:
        spin.kill()
        spin.wait()
    if busy is None:
        pytest.skip("no /proc/stat here")
    assert busy >= 0.5, busy  # the spinning child holds (most of) one core


def test_runner_applies_threads(tmp_path, monkeypatch):
    from localmoe.errors import InvalidRequestError
    from localmoe.io.loader import open_model
    from localmoe.backends.registry import get_backend
    from localmoe.testing.synthetic import write_gguf

    mf = open_model(write_gguf(tmp_path / "t.gguf", "tiny-llama"))
    r = get_backend("torch").load(mf, n_ctx=32, n_threads=1)
    assert torch.get_num_threads() == 1 and r.stats()["n_threads"] == 1
    monkeypatch.setenv("LOCALMOE_THREADS", "2")
    r = get_backend("torch").load(mf, n_ctx=32)
    assert torch.get_num_threads() == 2 and r.stats()["n_threads"] == 2
    monkeypatch.delenv("LOCALMOE_THREADS")
    r = get_backend("torch").load(mf, n_ctx=32)
    st = r.stats()
    assert 1 <= st["n_threads"] <= physical_cores() and "physical cores" in st["threads_reason"]
    with pytest.raises(InvalidRequestError, match="threads"):
        get_backend("torch").load(mf, n_ctx=32, n_threads=0)


def test_threads_flag(monkeypatch):
    import os

    from localmoe.cli import cli
    import localmoe.cli.options as cli_options

    seen = {}

    class Stop(Exception):
        pass

    def fake_load(*a, **k):
        seen["env"] = os.environ.get("LOCALMOE_THREADS")
        raise Stop

    monkeypatch.setattr(cli_options, "load_llm", fake_load)
    r = CliRunner().invoke(cli, ["generate", "-t", "3", "-m", "x.gguf", "hi"])
    assert isinstance(r.exception, Stop) and seen["env"] == "3"
    for cmd in ("generate", "chat", "serve", "bench"):
        assert "--threads" in CliRunner().invoke(cli, [cmd, "--help"]).output
    r = CliRunner().invoke(cli, ["generate", "-t", "0", "hi"])
    assert r.exit_code == 2


@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5", "²", " ", "\t"])
def test_bad_threads_env_is_an_error_wherever_it_is_read(tmp_path, monkeypatch, value):
    """A LOCALMOE_THREADS that is no thread count was silently ignored (the default ran); it
    is one error line naming the variable and its value, before any weights load."""
    import types

    import localmoe.backends.llamacpp_backend as lb
    import localmoe.backends.torch_backend as tb
    import localmoe.tui.app as tui_app
    import localmoe.serve.server as server
    from localmoe.cli import cli
    from localmoe.api import LLM
    from localmoe.errors import InvalidRequestError
    from localmoe.testing.synthetic import write_gguf

    m = str(write_gguf(tmp_path / "m.gguf", "tiny-llama"))
    monkeypatch.setenv("LOCALMOE_THREADS", value)
    msg = f"LOCALMOE_THREADS={value!r} is not a thread count"
    for read in (default_threads, lb._default_threads):
        with pytest.raises(InvalidRequestError, match=re.escape(msg)):
            read()
    opened = []

    def no_load(*a, **kw):
        opened.append("weights")
        raise AssertionError("weights must not load")

    monkeypatch.setattr(tb.TorchBackend, "load", no_load)
    monkeypatch.setattr(tui_app, "run_chat", lambda *a, **kw: opened.append("chat"))
    monkeypatch.setattr(server, "_check_port_free", lambda *a: opened.append("serve"))
    with pytest.raises(InvalidRequestError, match=re.escape(msg)):
        LLM(m, backend="torch", n_ctx=32)
    for cmd in (["generate", "hi"], ["chat"], ["serve"], ["bench"]):
        r = CliRunner().invoke(cli, [*cmd, "-m", m, "--backend", "torch"])
        lines = [l for l in r.stderr.splitlines() if l.strip()]
        assert r.exit_code == 1 and len(lines) == 1, (cmd, r.output)
        assert lines[0].startswith(f"error: {msg}; set it to a whole number from 1 to 512"), lines
    assert not opened
    # -t sets a good value for the command; an empty variable is the default (a blank one,
    # " ", is refused above, as a blank LOCALMOE_API_KEY is); spaces around a count are dropped
    r = CliRunner().invoke(cli, ["generate", "-m", m, "--backend", "torch", "-t", "2", "hi"])
    assert "LOCALMOE_THREADS" not in r.output and opened == ["weights"]
    monkeypatch.setenv("LOCALMOE_THREADS", "")
    assert default_threads(0.0)[1] != "LOCALMOE_THREADS/--threads"
    monkeypatch.setenv("LOCALMOE_THREADS", " 3 ")
    assert default_threads(0.0) == (3, "LOCALMOE_THREADS/--threads")


def test_huge_thread_counts_are_refused_before_any_load(tmp_path, monkeypatch):
    """99999 threads segfaulted in libgomp (torch and llama.cpp) and 5000 crawled: counts above
    ggml's own limit of 512 are refused as an option, an environment value and an API value."""
    import localmoe.backends.torch_backend as tb
    from localmoe.cli import cli
    from localmoe.api import LLM
    from localmoe.errors import InvalidRequestError
    from localmoe.backends.registry import MAX_THREADS, check_threads, env_threads
    from localmoe.testing.synthetic import write_gguf

    assert MAX_THREADS == 512 and check_threads(512) == 512
    for bad in (513, 99999, 0, True, 2.0):
        with pytest.raises(InvalidRequestError, match="is not a thread count from 1 to 512"):
            check_threads(bad)
    monkeypatch.setenv("LOCALMOE_THREADS", "99999")
    with pytest.raises(InvalidRequestError, match="from 1 to 512"):
        env_threads()
    monkeypatch.setenv("LOCALMOE_THREADS", "512")
    assert env_threads() == 512
    monkeypatch.delenv("LOCALMOE_THREADS")
    m = str(write_gguf(tmp_path / "m.gguf", "tiny-llama"))
    monkeypatch.setattr(tb.TorchBackend, "load", lambda *a, **kw: pytest.fail("weights loaded"))
    r = CliRunner().invoke(cli, ["generate", "-m", m, "--backend", "torch", "-t", "99999", "hi"])
    assert r.exit_code == 2 and "1<=x<=512" in r.output
    with pytest.raises(InvalidRequestError, match="n_threads=600"):
        tb.TorchRunner(write_gguf(tmp_path / "m2.gguf", "tiny-llama"), n_threads=600)


def test_physical_cores_come_from_psutil_and_the_affinity_mask(monkeypatch):
    """psutil's physical/logical counts give the threads per core; the affinity mask's share
    of them is what this process may use (SMT siblings counted once)."""
    import psutil

    from localmoe.cpu import threads

    class P:
        def __init__(self, cpus):
            self.cpus = cpus

        def cpu_affinity(self):
            return list(range(self.cpus))

    def machine(phys, logical, mask):
        monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: logical_n if logical else phys)
        monkeypatch.setattr(psutil, "Process", lambda *a: P(mask))
        logical_n = logical
        return threads.physical_cores()

    assert machine(8, 16, 16) == 8      # SMT 2, whole machine
    assert machine(8, 16, 4) == 2       # 4 logical CPUs of the mask = 2 cores
    assert machine(4, 4, 3) == 3        # no SMT, 3 CPUs allowed
    assert machine(8, 16, 1) == 1       # never 0
    assert machine(None, 16, 6) == 6    # psutil cannot tell: the usable logical CPUs


def test_busy_cores_read_psutil_counters(monkeypatch):
    """Busy cores are the machine's non-idle time over the interval minus our own CPU time."""
    import psutil
    from collections import namedtuple

    from localmoe.cpu import threads

    T = namedtuple("T", "user nice system idle iowait irq softirq steal guest guest_nice")
    O = namedtuple("O", "user system")
    snaps = iter([(T(10, 0, 0, 90, 0, 0, 0, 0, 5, 0), O(1, 0)),
                  # 4 CPUs over 1 s: 4 CPU-seconds, 1.5 of them idle -> 2.5 busy, 0.5 ours
                  (T(12, 0, 0.5, 91.5, 0, 0, 0, 0, 7, 0), O(1.5, 0))])
    cur = {}
    clock = iter([100.0, 101.0, 101.0])

    def cpu_times():
        cur["s"] = next(snaps)
        return cur["s"][0]

    class P:
        def cpu_times(self):
            return cur["s"][1]

    monkeypatch.setattr(psutil, "cpu_times", cpu_times)
    monkeypatch.setattr(psutil, "Process", lambda *a: P())
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 4)
    monkeypatch.setattr(threads.time, "monotonic", lambda: next(clock))
    busy = threads._CPUBusy(min_s=0.0).start().cores()
    assert busy == pytest.approx(2.0)
