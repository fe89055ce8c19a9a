"""A launch tape: the eager decode step recorded once and replayed launch by launch, without
the Python that chose the launches.

When CUDA graphs are off (``--no-cuda-graph``, ``LOCALMOE_CUDA_GRAPHS=0``, a capture that
failed), the fused decode step runs eagerly on the static buffers of
:mod:`localmoe.backends.triton.graphs`. Launched from Python it is host-bound: ~480 Triton
launches per token of Qwen3-30B-A3B, each paying our wrapper (launch choices, buffers,
arguments) and Triton's ``JITFunction.run`` (argument binding, specialization keys, cache
look-up); measured on the H200, 55 ms of host time per token for ~2.4 ms of GPU work
(``benchmarks/results/eager_h200-2026-12-02-s11.json``).

The step on static buffers launches the same kernels with the same arguments every time (that
is what lets a CUDA graph record it), so the launches themselves can be recorded the same way
and replayed in order from a flat list:

* a Triton launch is recorded at its compiled launcher (the call that follows argument
  binding: grid, stream, function handle, packed arguments); replay calls that launcher again;
  under ``TRITON_INTERPRET=1`` the interpreted kernel call is recorded instead;
* a PyTorch operator (the embedding gather, small casts, the router's fp32 matmul) is recorded
  through a ``TorchDispatchMode`` with its argument and result tensors; replay writes into the
  recorded result (the operator's ``out=`` overload where it has one, else a copy), re-runs
  in-place operators, and skips views and uninitialised allocations (``empty``).

Every tensor the step touched stays alive with the tape (as a CUDA graph's memory pool keeps
its tensors), and the step's result is the recorded result tensor, overwritten by each replay.
A step the tape cannot represent (a host read such as ``.item()``, a random operator, another
stream) is not recorded: :func:`record` says why and the caller keeps launching from Python.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LaunchTape", "record"]

_aten = torch.ops.aten
#: allocations whose contents are undefined: nothing to replay
_ALLOC = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
          _aten.new_empty.default, _aten.new_empty_strided.default}
#: operators a replay cannot repeat faithfully
_REFUSE = {_aten._local_scalar_dense.default: "a host read of a device value (.item())"}


class LaunchTape:
    """The recorded launches of one step; :meth:`replay` launches them again in order.

    Attributes:
        entries: ``(fn, args, kwargs)`` in launch order.
        out: the step's result (a recorded tensor, overwritten by each replay).
        n_triton, n_torch: recorded Triton launches and replayed PyTorch operators.
    """

    def __init__(self):
        self.entries: list[tuple[Callable, tuple, dict]] = []
        self.out: Any = None
        self.n_triton = 0
        self.n_torch = 0
        self.stream: int | None = None

    def usable(self) -> bool:
        """False when the current CUDA stream is not the one the launches were recorded on."""
        return self.stream is None or torch.cuda.current_stream().cuda_stream == self.stream

    def replay(self) -> Any:
        """Launch the recorded step again; returns :attr:`out`."""
        for fn, args, kwargs in self.entries:
            fn(*args, **kwargs)
        return self.out


def _views(func, args, out) -> bool:
    """True when ``out`` is a view of an argument: the schema says the result may alias an
    input (``Tensor(a)``) and it does share that input's storage (``to``, ``reshape`` and
    ``contiguous`` return a new tensor when they must convert or copy)."""
    rets = func._schema.returns
    if not rets or not all(r.alias_info is not None and not r.alias_info.is_write for r in rets):
        return False
    outs = out if isinstance(out, (tuple, list)) else (out,)
    bases = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    return all(isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() in bases
               for o in outs)


def _mutates(func) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


def _copy_into(dst: torch.Tensor, func, args, kwargs):
    dst.copy_(func(*args, **kwargs))


class _Recorder(TorchDispatchMode):
    """Records the PyTorch operators of the step (not those inside a Triton launch)."""

    def __init__(self, tape: LaunchTape):
        super().__init__()
        self.tape = tape
        self.paused = 0
        self.why: str | None = None
        self.jit_runs = 0         # compiled-kernel launches seen at JITFunction.run
        self.launched = 0         # ... and at the compiled launcher (recorded)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused or self.why is not None:
            return out
        if func in _REFUSE:
            self.why = _REFUSE[func]
        elif torch.Tag.nondeterministic_seeded in func.tags:
            self.why = f"a random operator ({func})"
        elif func in _ALLOC or _views(func, args, out):
            pass
        elif _mutates(func):
            self.tape.entries.append((func, args, kwargs))
            self.tape.n_torch += 1
        elif isinstance(out, torch.Tensor):
            self.tape.entries.append(self._functional(func, args, kwargs, out))
            self.tape.n_torch += 1
        else:
            self.why = f"{func} returns {type(out).__name__}, not one tensor"
        return out

    @staticmethod
    def _functional(func, args, kwargs, out: torch.Tensor):
        """Replay of a functional operator into its recorded result ``out``: the ``out=``
        overload when it exists and accepts ``out`` as it is (tried once here: the inputs are
        unchanged, so it rewrites the same values), else compute and copy."""
        variant = getattr(func.overloadpacket, "out", None)
        if variant is not None and any(a.name == "out" for a in variant._schema.arguments):
            kw = dict(kwargs, out=out)
            try:
                variant(*args, **kw)
                return variant, args, kw
            except Exception:  # noqa: BLE001 -- no usable out= overload: copy instead
                pass
        return _copy_into, (out, func, args, kwargs), {}


@contextlib.contextmanager
def _patched(obj, name: str, wrapper_factory):
    orig = getattr(obj, name)
    setattr(obj, name, wrapper_factory(orig))
    try:
        yield
    finally:
        setattr(obj, name, orig)


def _launch_patches(tape: LaunchTape, rec: _Recorder, owner: int) -> list:
    """Context managers that record Triton launches made on thread ``owner``."""
    import triton.runtime.interpreter as interp

    def interp_factory(orig):
        def run(self, *args, grid, warmup, **kwargs):
            if warmup or threading.get_ident() != owner:
                return orig(self, *args, grid=grid, warmup=warmup, **kwargs)
            tape.entries.append((orig, (self, *args), dict(kwargs, grid=grid, warmup=False)))
            tape.n_triton += 1
            rec.paused += 1
            try:
                return orig(self, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                rec.paused -= 1
        return run

    def jit_factory(orig):
        def run(self, *args, grid, warmup, **kwargs):
            if not warmup and threading.get_ident() == owner:
                rec.jit_runs += 1
            return orig(self, *args, grid=grid, warmup=warmup, **kwargs)
        return run

    from triton.runtime.jit import JITFunction

    patches = [_patched(interp.InterpretedFunction, "run", interp_factory),
               _patched(JITFunction, "run", jit_factory)]
    if torch.cuda.is_available():
        try:
            from triton.runtime import driver
            launcher_cls = driver.active.launcher_cls
        except Exception:  # noqa: BLE001 -- no GPU driver: the interpreter patch only
            launcher_cls = None
        if launcher_cls is not None and "__call__" in vars(launcher_cls):
            def launch_factory(orig):
                def call(self, *args):
                    if threading.get_ident() == owner:
                        tape.entries.append((orig, (self, *args), {}))
                        tape.n_triton += 1
                        rec.launched += 1
                    return orig(self, *args)
                return call
            patches.append(_patched(launcher_cls, "__call__", launch_factory))
    return patches


_LOCK = threading.Lock()


def record(step: Callable[[], Any]) -> tuple[Any, LaunchTape | None, str | None]:
    """Run ``step()`` once, recording its launches.

    Returns:
        ``(result, tape, None)``, or ``(result, None, why)`` when the step did something a
        replay cannot repeat (the result is valid either way: the step ran normally).
    """
    tape = LaunchTape()
    rec = _Recorder(tape)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tape.stream = torch.cuda.current_stream().cuda_stream
    with _LOCK, contextlib.ExitStack() as stack:
        for p in _launch_patches(tape, rec, threading.get_ident()):
            stack.enter_context(p)
        with rec:
            out = step()
    if rec.why is None and rec.launched < rec.jit_runs:
        rec.why = (f"{rec.jit_runs - rec.launched} of {rec.jit_runs} Triton launches did not "
                   "pass the launcher this Triton version was expected to use")
    if rec.why is None and not isinstance(out, torch.Tensor):
        rec.why = f"the step returned {type(out).__name__}, not a tensor"
    if rec.why is not None:
        return out, None, rec.why
    tape.out = out
    return out, tape, None
