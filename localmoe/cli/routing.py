"""``--record-routing FILE`` of ``localmoe generate`` and ``localmoe bench``: the routing of
every token through every MoE layer, written as a routing trace (docs/ROUTING_TRACES.md).

Recording wraps the shared transformer's MoE hook (:mod:`localmoe.backends.recording`), so it
needs a backend that runs the model through it: torch or triton. ``--backend auto`` then picks
triton where it runs, else torch (not llama.cpp, which keeps its routing inside ggml); an
explicit other backend, a dense model or an unwritable FILE is refused before the weights load.
"""

from __future__ import annotations

import os
import sys

import click

from localmoe.errors import LocalMoEError

#: backends whose runners run the MoE layers through the shared transformer's MoE hook
RECORDING_BACKENDS = ("torch", "triton")

HELP = ("Write which experts every token was routed to in every MoE layer (ids, weights and the "
        "next layers' router logits on its hidden state) to FILE (.npz; docs/ROUTING_TRACES.md). "
        "Needs the torch or triton backend (auto picks one of them).")


def record_routing_option(f):
    return click.option("--record-routing", "record_routing", default=None, metavar="FILE",
                        help=HELP)(f)


def check_request(path: str, backend: str | None) -> str:
    """Refuse a FILE that cannot be written or a backend that cannot record, before any work;
    return the backend to load (``auto`` becomes ``triton`` where it runs, else ``torch``).

    Raises:
        LocalMoEError: FILE's folder missing or not writable, FILE a folder, or a backend other
            than torch/triton.
    """
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise LocalMoEError(f"--record-routing {path}: is a folder; give a file name")
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise LocalMoEError(f"--record-routing {path}: {parent} is not a writable folder")
    name = (backend or "auto").strip().lower()
    if name == "auto":
        from localmoe.backends.registry import get_backend

        try:
            triton_ok = get_backend("triton").available() is None
        except LocalMoEError:
            triton_ok = False
        return "triton" if triton_ok else "torch"
    if name not in RECORDING_BACKENDS:
        raise LocalMoEError(
            f"--record-routing needs the torch or triton backend: the {name} backend does not "
            f"expose the experts it routes to (drop --backend or pass --backend torch)")
    return name


def check_model(llm) -> None:
    """``before_load`` check: the model has MoE layers and the backend can record.

    Raises:
        LocalMoEError: a dense model or a backend that cannot record.
    """
    if getattr(llm, "backend_name", None) not in RECORDING_BACKENDS:
        raise LocalMoEError(f"--record-routing needs the torch or triton backend, not "
                            f"{llm.backend_name}")
    spec = llm.model_file.spec
    if not spec.n_experts:
        raise LocalMoEError(f"--record-routing: {llm.model_file.name} is a dense model (no MoE "
                            f"layers): there is no expert routing to record")


def recorder(llm):
    """A :class:`~localmoe.backends.recording.RunnerRecorder` on the engine's runner (not yet
    installed)."""
    from localmoe.backends.recording import RunnerRecorder

    return RunnerRecorder(llm.runner)


def write(path: str, llm, rec, traces: list, command: str) -> None:
    """Write ``traces`` (from ``rec``, a :func:`recorder`) with the model's and the run's
    metadata; one line on stderr.

    Raises:
        LocalMoEError: the file cannot be written.
    """
    from localmoe.backends.recording import save_trace

    meta = dict(rec.meta(), model=llm.model_name, backend=llm.backend_name, command=command,
                argv=" ".join(["localmoe"] + sys.argv[1:]))
    try:
        save_trace(path, traces, meta)
    except OSError as e:
        raise LocalMoEError(f"cannot write {path}: {e.strerror or e}") from None
    n = sum(len(t.tokens) for t in traces)
    click.echo(f"routing of {n} tokens through {len(rec.moe_layers)} MoE layers written to "
               f"{path}", err=True)
