"""Routing traces of moefied models: the recorder and the file format live in
:mod:`localmoe.model.routing_trace` (what ``localmoe generate --record-routing`` writes; format
in docs/ROUTING_TRACES.md); this module re-exports them for the moefy benchmarks and tests."""

from __future__ import annotations

from localmoe.backends.recording import (TRACE_VERSION, RoutingRecorder, RunnerRecorder, Trace,
                                         load_trace, save_trace)

__all__ = ["RoutingRecorder", "RunnerRecorder", "Trace", "save_trace", "load_trace", "TRACE_VERSION"]
