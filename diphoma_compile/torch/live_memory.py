"""The peak of tensor memory a step reaches, measured: every storage an aten op makes during
the step is counted from its making until it is freed (its storage object is collected), on
top of the tensors held before the step. This is what the plan's liveness peak predicts,
measured on the running program; it sees tensor storage only (not the allocator's slack,
the interpreter, or a communication library's own buffers)."""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@dataclass(frozen=True)
class MeasuredPeak:
    """Tensor bytes one process held: ``held`` before the step (parameters, optimizer state,
    gradients, the step's arguments), ``peak`` the most at once while it ran, reached in
    ``peak_op`` (the aten op that made the last storage counted), and the live bytes at the
    peak by the op that made them (``held`` for what was there before)."""
    held: int
    peak: int
    peak_op: str
    by_op: dict[str, int] = field(default_factory=dict)

    @property
    def transient(self) -> int:
        """The step's own memory: the peak above what was held before it."""
        return self.peak - self.held

    def __str__(self) -> str:
        return (f"peak {self.peak / 1e6:.1f} MB ({self.held / 1e6:.1f} MB held before the "
                f"step + {self.transient / 1e6:.1f} MB transient, at {self.peak_op})")


class _LiveStorages(TorchDispatchMode):
    """Counts the bytes of the storages alive, made by ops under the mode or added."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[int, str]] = {}
        self.now = 0
        self.peak = 0
        self.peak_op = "-"
        self.at_peak: Counter = Counter()

    def add(self, t: Any, made_by: str) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        t = getattr(t, "_local_tensor", t)        # a DTensor: the shard this process holds
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):   # a subclass without storage of its own
            return
        key = storage.data_ptr()
        if key == 0 or key in self.live:
            return
        nbytes = storage.nbytes()
        self.live[key] = (nbytes, made_by)
        self.now += nbytes
        # torch keeps a storage's Python object as long as the storage lives, so it is
        # collected when the last tensor on the storage is
        weakref.finalize(storage, self._freed, key)
        if self.now > self.peak:
            self.peak, self.peak_op = self.now, made_by
            self.at_peak = Counter()
            for n, by in self.live.values():
                self.at_peak[by] += n

    def _freed(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.now -= entry[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket.__name__)
        for t in tree_leaves(out):
            self.add(t, name)
        return out


def measure_peak(run: Callable[[], Any], held: Iterable[Any]) -> MeasuredPeak:
    """Run ``run()`` once under the counter; ``held``: the tensors alive before it (nested
    containers are flattened; tensors sharing storage count once)."""
    mode = _LiveStorages()
    for t in tree_leaves(list(held)):
        mode.add(t, "held")
    before = mode.now
    mode.peak, mode.peak_op = before, "-"
    mode.at_peak = Counter({"held": before})
    with mode:
        run()
    return MeasuredPeak(held=before, peak=mode.peak, peak_op=mode.peak_op,
                        by_op=dict(mode.at_peak.most_common()))
