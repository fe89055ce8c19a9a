"""Recording the expert routing of a runner (``localmoe generate/bench --record-routing``).

:class:`RunnerRecorder` is a :class:`~localmoe.model.routing_trace.RoutingRecorder` on the
runner's shared transformer (torch and triton backends) that also wraps the runner's
``forward`` (INTERFACES.md "Runner"), so every recorded row is paired with its token id and its
forward call. The file functions are re-exported from :mod:`localmoe.model.routing_trace`
(format: docs/ROUTING_TRACES.md).
"""

from __future__ import annotations

import numpy as np

from localmoe.errors import UnsupportedModelError
from localmoe.model.routing_trace import (DEFAULT_AHEAD, TRACE_VERSION, RoutingRecorder, Trace,
                                          load_trace, save_trace)

__all__ = ["RunnerRecorder", "RoutingRecorder", "Trace", "save_trace", "load_trace",
           "TRACE_VERSION", "DEFAULT_AHEAD"]


class RunnerRecorder(RoutingRecorder):
    """A :class:`RoutingRecorder` on a runner's model that also records the token ids of each
    ``runner.forward`` call (one sequence per call, as the engine runs it).

    Args:
        runner: a runner whose ``model`` is the shared Transformer (torch, triton backends).
        ahead: as :class:`RoutingRecorder`.

    Raises:
        UnsupportedModelError: the runner has no Transformer whose MoE hook can be wrapped
            (llama.cpp), or the model has no MoE layers.
    """

    def __init__(self, runner, ahead: int = DEFAULT_AHEAD):
        model = getattr(runner, "model", None)
        if model is None or not hasattr(model, "moe") or not hasattr(model, "layers"):
            name = getattr(runner, "backend_name", type(runner).__name__)
            raise UnsupportedModelError(
                f"the {name} backend cannot record routing (it does not run the MoE layers "
                f"through localmoe's MoE hook); use the torch or triton backend")
        super().__init__(model, ahead)
        self.runner = runner
        self.tokens: list[list[int]] = []
        self._forward = None

    def __enter__(self) -> "RunnerRecorder":
        super().__enter__()
        self._forward = self.runner.forward

        def forward(batch, *args, **kw):
            out = self._forward(batch, *args, **kw)   # raises before anything is recorded
            self.tokens.append([int(t) for _, toks in batch for t in toks])
            return out

        self.runner.forward = forward
        return self

    def __exit__(self, *exc) -> None:
        if self._forward is not None:
            del self.runner.forward          # the class's method again
            self._forward = None
        super().__exit__(*exc)

    def take_trace(self, name: str, kind: str, text: str = "") -> Trace:
        """Everything recorded so far as one :class:`Trace` (``n_prompt`` = the first forward
        call's tokens), and clear the recorder."""
        sizes = self.step_sizes()
        toks = [t for call in self.tokens for t in call]
        ids, ws, ah = self.take()
        self.tokens = []
        n = min(len(toks), ids.shape[0])
        return Trace(name, kind, sizes[0] if sizes else 0, np.array(toks[:n], dtype=np.int32),
                     ids[:n], ws[:n], ah[:n], text, np.array(sizes, dtype=np.int32))
