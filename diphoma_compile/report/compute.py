"""The plan's compute: flops of the whole step and of one device under the plan, the
framework ops whose cost is unknown, and an estimated step time on a device model
(compute plus the communication computation does not hide).

**Flops per device.** An op's flops (``ir.analysis.op_cost``) are computed from the types
it reads and makes. Types are global except varying ones, whose shape is already one
device's (the local batch), so per mesh axis of ``n > 1`` devices an op's work is:

- varying (``V``: an input or a result is ``V`` on the axis): each device runs the op on
  its own data, and the flops from its types are one device's. The whole step has ``n``
  such pieces: ``flops_per_step`` counts the op ``n`` times, ``flops_per_device`` once.
- split (otherwise, an input or a result is ``S(d)``, ``F`` or ``Fx`` on the axis): the
  devices share the op, each running ``1/n`` of the flops its global types give
  (``flops_per_device`` counts ``1/n``, ``flops_per_step`` once).
- whole (everything ``R`` or ``P``): every device runs all of it (a replicated optimizer
  update under plain data parallelism, a transpose of a weight); ``flops_per_device``
  counts it whole and ``flops_per_step`` once.

So ``flops_per_step`` is the step's work counted once, as one device running the whole
batch would do it, and ``flops_per_device`` what one device does under the plan; when
every op is varying or split, ``flops_per_device * N == flops_per_step`` exactly (the sum
is kept as a fraction), and what exceeds it is work the devices repeat. Collectives
(``all_reduce``, ``take_shard``, ...) and ``wait`` count as communication, not flops.

**Step time.** Each op takes ``DeviceModel.compute_s`` of its per-device flops and bytes
(a roofline; views move no bytes), one after another on a compute stream. Collectives run
one after another on a communication stream, each taking ``DeviceModel.collective_s`` of
the bytes one device sends: an ``async`` collective starts when it is issued and the
stream is free, and computation stalls only at its ``wait`` if it has not finished; a
plain (synchronous) one stalls computation for all of it. ``exposed_comm`` is the stall,
``total = compute + exposed_comm``. An estimate: no kernel overheads, no fusion, and
collectives inside control-flow regions are not timed."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from ..ir.analysis import op_cost
from ..ir.core import Graph, Op
from ..ir.device_model import DeviceModel, device_model
from ..ir.opdef import level_size
from ..ir.ops import Category, is_view, op_def
from ..ir.types import FlatShard, Shard, TensorType, Varying

DEFAULT_DEVICE_MODEL = "h100-nccl"


@dataclass(frozen=True)
class Compute:
    """Flops of the step and of one device, ops of unknown cost, and the step-time
    estimate on ``device_model`` (seconds)."""

    flops_per_step: int
    flops_per_device: Fraction
    unknown_cost_ops: tuple[str, ...]
    device_model: str
    compute_s: float
    exposed_comm_s: float
    # a pipeline's: the time the last rank to finish waits for other stages
    # (report/pipeline_time.py); 0 otherwise
    bubble_s: float = 0.0

    @property
    def total_s(self) -> float:
        """Estimated seconds per step: compute plus exposed communication (plus, under a
        pipeline, the bubble)."""
        return self.compute_s + self.exposed_comm_s + self.bubble_s

    def to_dict(self) -> dict[str, Any]:
        """The plan's ``compute`` section (docs/plan.md)."""
        per = self.flops_per_device
        return {"flops_per_step": self.flops_per_step,
                "flops_per_device": int(per) if per.denominator == 1 else float(per),
                "unknown_cost_ops": list(self.unknown_cost_ops),
                "device_model": self.device_model,
                "estimated_step_s": {"compute": self.compute_s,
                                     "exposed_comm": self.exposed_comm_s,
                                     "bubble": self.bubble_s,
                                     "total": self.total_s}}


def work_split(op: Op, types: dict[str, TensorType], sizes: dict[str, int]
               ) -> tuple[int, int]:
    """(devices that share the op's work, pieces of that work in the whole step): per mesh
    axis of n devices, a varying op multiplies the pieces by n, a split one the sharers;
    see the module docstring."""
    share = pieces = 1
    placed = [types[n] for n in op.inputs] + [v.type for v in op.results]
    for axis, n in sizes.items():
        if n <= 1:
            continue
        ps = [t.placement(axis) for t in placed]
        if any(isinstance(p, Varying) for p in ps):
            pieces *= n
        elif any(isinstance(p, (Shard, FlatShard)) for p in ps):
            share *= n
    return share, pieces


def _comm(op: Op) -> bool:
    return op_def(op.name).category in (Category.collective, Category.sync)


def estimate_compute(graph: Graph, model: DeviceModel | str = DEFAULT_DEVICE_MODEL
                     ) -> Compute:
    """The compute section of ``graph``'s plan on ``model`` (a DeviceModel or its name)."""
    model = device_model(model) if isinstance(model, str) else model
    types = graph.value_types()
    sizes = dict(graph.mesh.axes)
    per_step, per_device = 0, Fraction(0)
    unknown: set[str] = set()
    compute_s = exposed = 0.0
    now = comm_free = 0.0                 # the compute and the communication streams
    pending: dict[str, float] = {}        # async result -> when its collective ends

    def stall(until: float) -> None:      # computation waits for communication
        nonlocal now, exposed
        if until > now:
            exposed += until - now
            now = until

    for op in graph.ops:
        if op.name == "wait":
            stall(max([0.0, *(pending.pop(n, 0.0) for n in op.inputs)]))
            continue
        if _comm(op):
            axis = op.attrs.get("axis")
            n = level_size(op, sizes.get(str(axis), 1))     # a level's devices (two hops)
            sent = op_cost(op, types, sizes).comm_bytes
            comm_free = max(now, comm_free) + model.collective_s(op.name, sent, n, str(axis))
            if op.attrs.get("async"):
                pending.update((v.name, comm_free) for v in op.results)
            else:
                stall(comm_free)
            continue
        cost = op_cost(op, types, sizes)
        unknown.update(cost.unknown)
        share, pieces = work_split(op, types, sizes)
        per_step += cost.flops * pieces
        per_device += Fraction(cost.flops, share)
        nbytes = 0 if is_view(op) else cost.bytes
        t = model.compute_s(cost.flops / share, nbytes / share)
        compute_s += t
        now += t
    if pending:                           # a collective no wait awaits ends the step
        stall(max(pending.values()))
    return Compute(per_step, per_device, tuple(sorted(unknown)), model.name, compute_s,
                   exposed)
