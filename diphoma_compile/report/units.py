"""Units for people: byte counts as the plan, the benchmarks and the command line print them."""

from __future__ import annotations


def human(n: float) -> str:
    """Bytes as B / KB / MB / GB (powers of 1000, like the benchmarks)."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"
