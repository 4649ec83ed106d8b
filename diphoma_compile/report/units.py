"""Units for people: bytes, flops and seconds as the plan, the benchmarks and the command
line print them."""

from __future__ import annotations


def human(n: float) -> str:
    """Bytes as B / KB / MB / GB (powers of 1000, like the benchmarks)."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"


def flops_text(n: float) -> str:
    """Floating-point operations as FLOP / KFLOP / ... / PFLOP (powers of 1000)."""
    for unit in ("FLOP", "KFLOP", "MFLOP", "GFLOP", "TFLOP"):
        if abs(n) < 999.5:      # what would round to 1000 takes the next unit
            return f"{n:.0f} {unit}" if unit == "FLOP" else f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} PFLOP"


def seconds_text(s: float) -> str:
    """A duration as s / ms / us, three significant digits."""
    if abs(s) >= 1:
        return f"{s:.3g} s"
    if abs(s) >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"
