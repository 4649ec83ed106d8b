"""The per-rank runtime of a data-parallel torch step: one process per device, gloo or NCCL.

``TorchDistStep`` runs the program ``build.py`` makes of a graph placed over one mesh axis
(after ``data-parallel`` and ``weight-update-sharding``). Each rank passes its own local
batch (the DDP convention). Parameters stay whole and identical on every rank; optimizer
state placed ``F``/``Fx``/``S(d)`` is kept *sharded inside the optimizer's own state dict*:
``opt.state[p][key]`` holds this rank's 1-D flat chunk (or dim chunk), so the optimizer holds
1/N of it. A gradient that the graph leaves sharded is not written to ``p.grad`` (a rank
holds only a piece of it, as under FSDP/ZeRO): ``p.grad`` is None after such a step."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import BackendError, MeshError
from ..ir.analysis import runs_on_one_device
from ..ir.core import Graph, InputKind, OutputKind
from ..ir.ops import OPS, Category
from ..ir.types import FlatShard, Placement, Replicate, Shard, TensorType, Varying
from ..mesh import Mesh
from ..report.memory import MemoryReport
from . import collectives
from .build import build_module
from .runtime import TorchStep
from .state import Captured, Slot


@dataclass(frozen=True)
class StepProfile:
    """Seconds per step (medians): the step as scheduled, computation, communication, and
    the part of communication hidden behind computation."""

    step_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    hidden_comm_s: float
    steps: int

    def to_dict(self) -> dict[str, float]:
        """The profile as a plain dict (for JSON)."""
        return asdict(self)

    def __str__(self) -> str:
        share = self.hidden_comm_s / self.comm_s if self.comm_s else 0.0
        return (f"step {self.step_s * 1e3:.1f} ms: compute {self.compute_s * 1e3:.1f} ms, "
                f"communication {self.comm_s * 1e3:.1f} ms of which hidden "
                f"{self.hidden_comm_s * 1e3:.1f} ms ({share:.0%}), exposed "
                f"{self.exposed_comm_s * 1e3:.1f} ms (median of {self.steps})")


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


class TorchDistStep(TorchStep):
    """A callable with the user's step signature that runs this rank's part of a
    data-parallel program and keeps this rank's optimizer-state shards in the optimizer."""

    def __init__(self, graph: Graph, captured: Captured, mesh: Any = None, group: Any = None,
                 axis: str = "dp", sync_module_states: bool = True) -> None:
        self.mesh = Mesh.of(mesh) if mesh is not None else graph.mesh
        self.axis = axis
        size, rank = _check_world(graph, self.mesh, group, axis)
        # one device and nothing to exchange: the step runs in this process, no group needed
        self.alone = runs_on_one_device(graph) and not (dist.is_available()
                                                        and dist.is_initialized())
        self.comm = collectives.Comm(axis, size, rank, group)
        # for collectives outside the step (resharding, gathering state): not counted in
        # the step's bytes
        self._side = collectives.Comm(axis, size, rank, group)
        self.calls = 0
        self._check_binding(graph, captured)
        super().__init__(graph, captured, build_module(graph, {axis: self.comm}))
        self._state_type: dict[tuple[int, str], TensorType] = {
            s.key: i.value.type for i, s in zip(graph.inputs, captured.inputs)
            if s.kind == "opt_state"}
        self._param_names = [s.name for s in captured.inputs if s.kind == "param"]
        self._check_outputs()
        # gradients the graph leaves sharded are not written back: p.grad stays None
        self._with_grad -= self._sharded_grads
        self._check_equal_shares(graph)
        if sync_module_states:
            self._broadcast_module_states()

    # ------------------------------------------------------------------ checks
    def _check_equal_shares(self, graph: Graph) -> None:
        """Every rank traced the step at its own batch: the shapes must agree, or the mean
        of the ranks' gradients is not the global batch's gradient (one small collective,
        once, when the step is built)."""
        if self.comm.size == 1:
            return
        batch = [i for i in graph.inputs if i.role.kind is InputKind.batch]
        dims = [d for i in batch for d in i.value.type.shape]
        if not dims:
            return
        # a tensor on the device the step computes on (NCCL needs one on this rank's GPU)
        params = self.captured.params
        device = params[0].device if params else torch.device("cpu")
        mine = torch.tensor(dims, dtype=torch.int64, device=device)
        every = [torch.empty_like(mine) for _ in range(self.comm.size)]
        dist.all_gather(every, mine, group=self.comm.group)
        first = every[0].tolist()
        for rank, theirs in enumerate(t.tolist() for t in every):
            if theirs == first:
                continue
            at = 0
            for i in batch:
                k = i.value.type.rank
                if theirs[at:at + k] != first[at:at + k]:
                    raise MeshError(
                        f"the ranks pass batches of different shapes: %{i.name} is "
                        f"{tuple(first[at:at + k])} on rank 0 and {tuple(theirs[at:at + k])} "
                        f"on rank {rank}; averaging their gradients would weigh the examples "
                        "unequally", hint="give every rank an equal share of the global batch "
                                          "(drop or pad the last, uneven batch)")
                at += k

    @staticmethod
    def _check_binding(graph: Graph, cap: Captured) -> None:
        names = [i.name for i in graph.inputs]
        if names != [s.name for s in cap.inputs] or len(graph.outputs) != len(cap.outputs):
            raise BackendError("the graph's inputs or outputs are not those of the traced step "
                               "(a pass added, removed or reordered them)",
                               hint="passes keep the step's signature; trace the step again")

    def _placement(self, t: TensorType) -> Placement:
        return t.placement(self.axis)

    def _check_outputs(self) -> None:
        self._sharded_grads: set[int] = set()
        types = self.graph.value_types()
        for out, slot in zip(self.graph.outputs, self.captured.outputs):
            p = self._placement(types[out.name])
            if slot is None or slot.kind == "opt_state":
                continue   # the user's results (R or V); state keeps its input's placement
            if slot.kind == "grad":
                if isinstance(p, (Shard, FlatShard)):
                    self._sharded_grads.add(slot.key[0])
                elif not isinstance(p, Replicate):
                    raise BackendError(f"the gradient output {out.name} is placed {p} on "
                                       f"{self.axis!r}; a gradient is written back whole (R) "
                                       "or not at all (S/F)")
            elif not isinstance(p, (Replicate, Varying)) or (
                    slot.kind == "param" and not isinstance(p, Replicate)):
                raise BackendError(f"the new {slot.kind} {slot.name} is placed {p} on "
                                   f"{self.axis!r}; parameters are written back whole",
                                   hint="the program must all_gather new parameters")
        for o in self.graph.outputs:
            if o.role.kind is OutputKind.loss and not isinstance(
                    self._placement(types[o.name]), Replicate):
                raise BackendError(f"the loss {o.name} is not replicated over {self.axis!r}",
                                   hint="all_reduce{op=avg} the loss")

    # ------------------------------------------------------------------ state shards
    def _state_shape(self, pi: int, key: str, shape: torch.Size) -> tuple[int, ...]:
        t = self._state_type.get((pi, key))
        return tuple(shape) if t is None else t.local_shape(dict(self.mesh.axes))

    def _state(self, slot: Slot) -> torch.Tensor:
        t = super()._state(slot)
        typ = self._state_type[slot.key]
        local = typ.local_shape(dict(self.mesh.axes))
        if tuple(t.shape) == local:
            return t
        if tuple(t.shape) != typ.shape:
            raise BackendError(f"the optimizer state {slot.name} has shape {tuple(t.shape)}; "
                               f"this rank keeps {local} (whole: {typ.shape})",
                               hint="load a checkpoint of the whole state, or of this "
                                    "rank's shards, before the first step")
        # resuming from whole state: keep only this rank's shard, in storage of its own
        pi, key = slot.key
        p = self.captured.params[pi]
        shard = self._shard_of(t, typ).clone()
        self.captured.optimizers[slot.owner].state[p][key] = shard
        return shard

    def _shard_of(self, t: torch.Tensor, typ: TensorType) -> torch.Tensor:
        p = self._placement(typ)
        local = list(typ.local_shape(dict(self.mesh.axes)))
        dim = "flat" if isinstance(p, FlatShard) else p.dim
        return collectives.take_shard(self._side, t.detach(), dim, local)

    def _write(self, slot: Slot, new: torch.Tensor) -> None:
        if slot.kind == "grad" and slot.key[0] in self._sharded_grads:
            return
        super()._write(slot, new)

    # ------------------------------------------------------------------ running
    def __call__(self, *args: Any) -> Any:
        if not self.alone and not dist.is_initialized():
            raise BackendError("torch.distributed is no longer initialized",
                               hint="call the step before destroy_process_group()")
        self.calls += 1
        return super().__call__(*args)

    @property
    def comm_bytes(self) -> int:
        """Bytes this rank sent in the step's collectives so far (ring model)."""
        return self.comm.bytes_sent

    def _broadcast_module_states(self) -> None:
        # as DDP does at construction: every rank starts from rank 0's parameters/buffers
        if self.comm.size == 1:
            return
        seen: set[int] = set()
        with torch.no_grad():
            for m in self.captured.modules:
                for t in list(m.parameters()) + list(m.buffers()):
                    if id(t) not in seen:
                        seen.add(id(t))
                        dist.broadcast(t.data, src=self.comm.global_rank(0),
                                       group=self.comm.group)

    # ------------------------------------------------------------------ reports
    def profile(self, *args: Any, steps: int = 5) -> StepProfile:
        """Time ``steps`` real training steps twice (they update the model): once with every
        collective waited for at once, giving the time in communication and, the rest, in
        computation; once as scheduled (asynchronous collectives waited for late), giving the
        communication still exposed. Hidden = communication - exposed. Medians per step;
        every rank must call it."""
        def timed(force: bool) -> tuple[float, float]:
            walls, blocked = [], []
            self.comm.force_sync = force
            try:
                for _ in range(steps):
                    if not self.alone:
                        dist.barrier(group=self.comm.group)
                    b0, t0 = self.comm.blocked_s, time.perf_counter()
                    self(*args)
                    walls.append(time.perf_counter() - t0)
                    blocked.append(self.comm.blocked_s - b0)
            finally:
                self.comm.force_sync = False
            return _median(walls), _median(blocked)
        if steps < 1:
            raise ValueError("profile needs at least one step")
        sync_wall, comm_s = timed(True)
        step_s, exposed = timed(False)
        return StepProfile(step_s=step_s, compute_s=max(sync_wall - comm_s, 0.0),
                           comm_s=comm_s, exposed_comm_s=exposed,
                           hidden_comm_s=max(comm_s - exposed, 0.0), steps=steps)

    def memory_report(self) -> MemoryReport:
        """Bytes of parameters, optimizer state and gradients this process holds now."""
        cap = self.captured
        params = [p for m in cap.modules for p in m.parameters()]
        state = [v for opt in cap.optimizers for st in opt.state.values()
                 for v in st.values() if isinstance(v, torch.Tensor)]
        grads = [p.grad for p in params if p.grad is not None]
        return MemoryReport(_storage_bytes(params), _storage_bytes(state), _storage_bytes(grads))

    def gather_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The whole optimizer state, {param name: {slot: tensor}}, on every rank (a
        collective: every rank must call it). For tests and checkpoints."""
        cap = self.captured
        out: dict[str, dict[str, torch.Tensor]] = {}
        for slot in cap.inputs:
            if slot.kind != "opt_state":
                continue
            pi, key = slot.key
            t = self._state(slot).detach()
            typ = self._state_type[slot.key]
            p = self._placement(typ)
            if isinstance(p, FlatShard):
                t = collectives.all_gather(self._side, t, "flat", list(typ.shape))
            elif isinstance(p, Shard):
                t = collectives.all_gather(self._side, t, p.dim, list(typ.shape))
            else:
                t = t.clone()
            out.setdefault(self._param_names[pi], {})[key] = t
        return out


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
    return sum(seen.values())


def _check_world(graph: Graph, mesh: Mesh, group: Any, axis: str) -> tuple[int, int]:
    """The axis size and this rank's index on it, after checking that the mesh, the graph
    and the running process group agree (before any collective runs)."""
    if axis not in mesh:
        have = ", ".join(mesh.names) or "none"
        raise MeshError(f"the mesh {mesh} has no axis {axis!r} (axes: {have})",
                        hint=f"pass a mesh with a {axis!r} axis, e.g. Mesh({{{axis!r}: 4}}), "
                             "or name the axis the graph was transformed for")
    size = mesh.axis_size(axis)
    if axis not in graph.mesh:
        raise MeshError(f"the graph is not distributed over mesh axis {axis!r} (its mesh is "
                        f"{graph.mesh or 'empty'})",
                        hint=f"run the data-parallel{{axis={axis}}} pass on a graph whose mesh "
                             "has that axis")
    if graph.mesh.axis_size(axis) != size:
        raise MeshError(f"the graph was transformed for {graph.mesh} but runs on {mesh}",
                        hint="run the passes for the mesh you run on")
    others = [n for n, s in mesh.axes if n != axis and s > 1]
    if others:
        raise BackendError(f"the torch runtime runs one mesh axis ({axis!r}); the mesh also "
                           f"has {', '.join(others)}", hint="use a one-axis mesh for now")
    coll = {str(op.attrs.get("axis")) for op in graph.ops
            if op.name in OPS and OPS[op.name].category is Category.collective}
    if coll - {axis}:
        raise BackendError(f"the graph has collectives over {sorted(coll - {axis})}, not "
                           f"only {axis!r}")
    if not (dist.is_available() and dist.is_initialized()):
        if size == 1 and group is None and not coll:
            return 1, 0      # a mesh of one device: the single-device program, in-process
        if size == 1:
            raise BackendError(
                f"torch.distributed is not initialized, and the plan for the one-device mesh "
                f"axis {axis!r} still has collectives over it (the passes were given)",
                hint="leave passes= unset on a one-device mesh (the single-device program "
                     "runs), or call torch.distributed.init_process_group first")
        raise BackendError(
            f"torch.distributed is not initialized, and the step runs on {size} processes "
            f"(mesh axis {axis!r})",
            hint=f"run under torchrun --nproc_per_node={size} and call "
                 "torch.distributed.init_process_group('gloo' or 'nccl') before building "
                 "the step")
    world = dist.get_world_size(group)
    if world != size:
        raise MeshError(f"mesh axis {axis!r} has {size} devices but the process group has "
                        f"{world} processes",
                        hint=f"run under torchrun --nproc_per_node={size}, or transform the "
                             f"step for Mesh({{{axis!r}: {world}}})")
    return size, dist.get_rank(group)
