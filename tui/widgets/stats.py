"""The live stats bar: backend and device, TTFT, tok/s, context used, KV bytes, expert cache.

Only numbers that were measured or reported by the engine are shown; a field without a value
is left out (expert-cache hit rate and host->device bandwidth appear only when
``runner.stats()`` reports them).
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.widgets import Static

from ..engine_api import format_bytes

__all__ = ["Stats", "StatsBar"]


@dataclass
class Stats:
    """What the bar shows; None fields are omitted."""

    status: str = ""
    backend: str | None = None
    device: str | None = None
    ttft_ms: float | None = None
    tok_s: float | None = None
    ctx_used: int | None = None
    n_ctx: int | None = None
    kv_bytes: int | None = None
    expert_hit_rate: float | None = None
    h2d_gbps: float | None = None

    def render_text(self) -> str:
        """The bar's text, fields separated by ``│``."""
        parts = []
        if self.status:
            parts.append(self.status)
        if self.backend:
            parts.append(self.backend + (f" · {self.device}" if self.device else ""))
        if self.ttft_ms is not None:
            parts.append(f"TTFT {self.ttft_ms:.0f} ms")
        if self.tok_s is not None:
            parts.append(f"{self.tok_s:.1f} tok/s")
        if self.n_ctx:
            parts.append(f"ctx {self.n_ctx}" if self.ctx_used is None
                         else f"ctx {self.ctx_used}/{self.n_ctx}")
        if self.kv_bytes is not None:
            parts.append(f"KV {format_bytes(self.kv_bytes)}")
        if self.expert_hit_rate is not None:
            parts.append(f"experts {self.expert_hit_rate * 100:.0f}% hit")
        if self.h2d_gbps is not None:
            parts.append(f"H2D {self.h2d_gbps:.1f} GB/s")
        return " │ ".join(parts)


class StatsBar(Static):
    """One line of live statistics at the bottom of the chat screen."""

    def __init__(self, **kwargs) -> None:
        super().__init__("", markup=False, **kwargs)
        self.stats = Stats()

    def show(self, **changes) -> None:
        """Update some fields (keyword names of :class:`Stats`) and redraw."""
        for k, v in changes.items():
            setattr(self.stats, k, v)
        self.update(self.stats.render_text())
