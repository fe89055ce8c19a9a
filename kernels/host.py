"""Host-side integer helpers for launch arithmetic (grid sizes, split counts, tile widths).

Plain Python: in recent Triton releases ``triton.cdiv`` and ``triton.next_power_of_2`` are
constexpr functions whose host calls unwrap every argument, a few microseconds each, and an
eager decode step makes hundreds of them (``benchmarks/bench_host_step.py``).
"""

from __future__ import annotations

__all__ = ["cdiv", "next_pow2"]


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers (``b > 0``), as ``triton.cdiv``."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` for ``n >= 1`` (0 for 0), as
    ``triton.next_power_of_2``."""
    n = int(n)
    return 0 if n <= 0 else 1 << (n - 1).bit_length()
