"""CPU thread counts: the user's request (``--threads`` / ``$LOCALMOE_THREADS``), checked, and the
torch backend's default (the physical cores minus the cores other processes keep busy).

The counts come from psutil (physical cores of the affinity mask; busy time of the whole machine
over the load); where it cannot count physical cores the usable logical CPUs stand in. Torch is
imported only where a count is read or set.
"""

from __future__ import annotations

import os
import time
from typing import Any

from localmoe.errors import InvalidRequestError

THREADS_ENV = "LOCALMOE_THREADS"
# the most CPU threads a backend is given: ggml's own limit (GGML_MAX_N_THREADS); far more
# threads than that crash OpenMP / ggml (99999 segfaulted in libgomp) or crawl
MAX_THREADS = 512


def check_threads(n: Any, param: str = "n_threads") -> int:
    """``n`` as a thread count from 1 to :data:`MAX_THREADS`.

    Raises:
        InvalidRequestError: anything else (``param``).
    """
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_THREADS:
        raise InvalidRequestError(
            f"{param}={n!r} is not a thread count from 1 to {MAX_THREADS}", param=param)
    return n


def env_threads() -> int | None:
    """CPU threads the user set in ``$LOCALMOE_THREADS`` (``-t/--threads`` sets it) for the
    torch and llamacpp backends; None when it is unset or empty (the backend's default).
    Surrounding spaces are dropped; a blank value is an error, as a blank
    ``LOCALMOE_API_KEY`` is (a value was set, but to no count).

    Raises:
        InvalidRequestError: a value that is not a whole number from 1 to
            :data:`MAX_THREADS` (``param="LOCALMOE_THREADS"``).
    """
    raw = os.environ.get(THREADS_ENV)
    if raw is None or raw == "":
        return None
    v = raw.strip()
    if v.isascii() and v.isdigit() and 0 < int(v) <= MAX_THREADS:
        return int(v)
    raise InvalidRequestError(
        f"{THREADS_ENV}={raw!r} is not a thread count; set it to a whole number from 1 to "
        f"{MAX_THREADS} (or unset it for the default)", param=THREADS_ENV)


def usable_cpus() -> int:
    """Logical CPUs this process may run on: its affinity mask (psutil), or all CPUs where the
    platform has none."""
    import psutil  # imported here: `localmoe --help` reads MAX_THREADS only

    try:
        return max(1, len(psutil.Process().cpu_affinity()))
    except (AttributeError, NotImplementedError, psutil.Error, OSError):
        return _logical_cpus()


def physical_cores() -> int:
    """Physical CPU cores this process may run on (SMT siblings counted once), at least 1.

    psutil's physical and logical counts give the machine's threads per core; the usable
    logical CPUs (the affinity mask) divided by it are the cores of the mask. Where psutil
    cannot count physical cores, the usable logical CPUs."""
    import psutil

    usable = usable_cpus()
    phys = psutil.cpu_count(logical=False)
    logical = psutil.cpu_count(logical=True)
    if not phys or not logical:
        return usable
    return max(1, min(phys, round(usable * phys / logical)))


_LAST_SET = [0]  # the thread count a runner set last (so the next load may change it again)


class _CPUBusy:
    """Cores kept busy by *other* processes over an interval: the whole machine's busy time
    (``psutil.cpu_times``: everything but idle and iowait, steal included) minus this process's
    own CPU time. ``start()`` then ``cores()`` (which waits until at least ``min_s`` seconds
    have passed). None where the counters cannot be read."""

    def __init__(self, min_s: float = 0.2):
        self.min_s = min_s
        self._t0 = None

    @staticmethod
    def _snap() -> tuple[float, float, float, float] | None:
        """(machine CPU seconds, of them idle, this process's CPU seconds, monotonic time), or
        None where psutil cannot read them."""
        import psutil

        try:
            t = psutil.cpu_times()
            own = psutil.Process().cpu_times()
        except (psutil.Error, OSError, NotImplementedError):
            return None
        # guest time is counted inside user time already (as psutil's own percentages do)
        total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
        idle = t.idle + getattr(t, "iowait", 0.0)
        return total, idle, own.user + own.system, time.monotonic()

    def start(self) -> "_CPUBusy":
        self._t0 = self._snap()
        return self

    def cores(self) -> float | None:
        """Cores other processes kept busy since ``start()`` (a float >= 0), or None."""
        if self._t0 is None:
            return None
        left = self.min_s - (time.monotonic() - self._t0[3])
        if left > 0:
            time.sleep(left)
        now = self._snap()
        if now is None:
            return None
        (tot0, idle0, own0, w0), (tot1, idle1, own1, w1) = self._t0, now
        if tot1 <= tot0 or w1 <= w0:
            return None
        busy = (1.0 - (idle1 - idle0) / (tot1 - tot0)) * _logical_cpus()
        return max(0.0, busy - (own1 - own0) / (w1 - w0))


def _logical_cpus() -> int:
    import psutil

    return psutil.cpu_count() or os.cpu_count() or 1


def default_threads(busy_elsewhere: float | None = None) -> tuple[int, str]:
    """CPU threads for the torch backend when none were asked for, and why.

    ``$LOCALMOE_THREADS`` when set (``--threads`` sets it), else ``$OMP_NUM_THREADS`` when set
    (left to torch), else the physical cores minus the cores other processes keep busy
    (``busy_elsewhere``, measured while the model loads), at least 1. OpenMP threads spin at
    every barrier, and a thread that shares its core with another busy process holds up all the
    others at each matmul: on the 2-core VM beside one busy process 2 threads decoded SmolLM2 at
    12 tok/s, 1 thread at 28.5. An idle machine keeps every physical core.

    A count set with ``torch.set_num_threads`` before loading (one that is neither torch's
    own default nor the last one set here) is kept.

    Returns:
        (threads, reason) -- reason like ``"2 physical cores, 0.0 busy elsewhere"``.

    Raises:
        InvalidRequestError: ``$LOCALMOE_THREADS`` is not a whole number from 1 to 512.
    """
    import torch

    env = env_threads()
    if env is not None:
        return env, "LOCALMOE_THREADS/--threads"
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return torch.get_num_threads(), "OMP_NUM_THREADS"
    phys = physical_cores()
    now = torch.get_num_threads()
    if now not in (phys, usable_cpus(), _LAST_SET[0]):
        return now, "torch.set_num_threads"  # the caller chose; keep it
    if busy_elsewhere is None:
        return phys, f"{phys} physical cores"
    n = max(1, min(phys, phys - int(busy_elsewhere + 0.5)))
    return n, f"{phys} physical cores, {busy_elsewhere:.1f} busy elsewhere"


class RunnerThreads:
    """The CPU thread count of a runner being loaded: checked before its weights load, the
    load measured as the busy-cores sampling interval, applied after.

    Args:
        n_threads: the requested count or None (the default, :func:`default_threads`).
        on_cpu: the runner computes on the CPU (otherwise only ``n_threads`` is checked and
            nothing is set).

    Raises:
        InvalidRequestError: ``n_threads`` is no thread count, or (on the CPU, none requested)
            ``$LOCALMOE_THREADS`` is not one -- before any weights load.
    """

    def __init__(self, n_threads: int | None, on_cpu: bool):
        if n_threads is not None:
            check_threads(n_threads)
        elif on_cpu:
            env_threads()  # a bad $LOCALMOE_THREADS is refused before the weights load
        self._n = n_threads
        self._on_cpu = on_cpu
        self._busy = _CPUBusy().start() if on_cpu and n_threads is None else None

    def apply(self) -> tuple[int | None, str]:
        """Set the count process-wide (``torch.set_num_threads``) once the weights are loaded
        (the load itself was the sampling interval, at least 0.2 s). Returns ``(threads,
        reason)``, ``(None, "")`` off the CPU."""
        if not self._on_cpu:
            return None, ""
        import torch

        if self._n is not None:
            n, why = int(self._n), "requested"
        else:
            n, why = default_threads(self._busy.cores())
        torch.set_num_threads(n)
        _LAST_SET[0] = n
        return n, why
