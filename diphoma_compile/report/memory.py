"""What a running step holds: bytes of parameters, optimizer state and gradients on one
device, as each backend's runner reports them after (or, planned, before) its first call."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class MemoryReport:
    """Bytes one device holds between steps (the largest over devices, each storage counted
    once), measured from live tensors or, before the first call, planned from types."""

    param_bytes: int
    opt_state_bytes: int
    grad_bytes: int = 0         # gradients left between steps (torch's .grad; JAX keeps none)
    devices: int = 1            # devices this report covers (a JAX mesh: all of them)
    measured: bool = True       # False: planned from the graph's types, nothing ran yet

    def to_dict(self) -> dict[str, Any]:
        """The report as a plain dict (for JSON)."""
        return asdict(self)
