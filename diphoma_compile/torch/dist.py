"""The per-rank runtime of a distributed torch step: one process per device, gloo or NCCL,
one process group per mesh axis.

``TorchDistStep`` runs the program ``build.py`` makes of a graph placed over a mesh (after
``tensor-parallel``, ``data-parallel`` and ``weight-update-sharding``). Each rank passes its
own local batch (the DDP convention; the ranks of one data index pass the same one).
Parameters stay whole and identical over the data axis; a parameter placed ``S(d)`` on a
tensor-parallel axis is this rank's chunk, held as the module's parameter between steps
(FSDP2's convention; ``state_dict()`` gathers the whole model). Optimizer state placed
``F``/``Fx``/``S(d)`` is kept *sharded inside the optimizer's own state dict*:
``opt.state[p][key]`` holds this rank's 1-D flat chunk (or dim chunk, or the flat chunk of
its tensor-parallel chunk). A gradient that the graph leaves sharded further than its
parameter is not written to ``p.grad`` (a rank holds only a piece of it, as under
FSDP/ZeRO): ``p.grad`` is None after such a step."""

from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from ..errors import BackendError, DiphomaError, MeshError, no_keywords
from ..ir.analysis import runs_on_one_device
from ..ir.core import Graph, InputKind, OutputKind
from ..ir.ops import OPS, Category
from ..ir.opdef import is_local, random_draw
from ..ir.printer import program_digest
from ..ir.types import DType, FlatShard, Placement, Replicate, Shard, TensorType, Varying
from ..mesh import Mesh
from ..report.memory import MemoryReport
from . import collectives
from .agreement import Peers, disagreeing, fingerprint, rng_digest
from .codegen import program
from .groups import coordinates, new_axis_groups, new_level_groups
from .runtime import TorchStep
from .shard_marks import guard_forward, mark_module, mark_optimizer, take_pieces
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
    distributed program, holding this rank's tensor-parallel parameter shards in the module
    and its optimizer-state shards in the optimizer."""

    def __init__(self, graph: Graph, captured: Captured, mesh: Any = None, group: Any = None,
                 axis: str = "dp", sync_module_states: bool = True,
                 groups: dict[str, Any] | None = None, seed: int = 0) -> None:
        self.seed = seed    # the first rounding key of quantizing passes
        self.mesh = Mesh.of(mesh) if mesh is not None else graph.mesh
        self.axis = axis
        where = _check_world(graph, self.mesh, group, axis, groups)
        # one device and nothing to exchange: the step runs in this process, no group needed
        self.alone = runs_on_one_device(graph) and not (dist.is_available()
                                                        and dist.is_initialized())
        self.comms = {a: collectives.Comm(a, n, r, g) for a, (n, r, g) in where.items()}
        self.comm = self.comms[axis]
        # an axis split into nodes (two-hop quantize-grads): a Comm per level, by comm_key
        self.level_comms = self._level_comms(graph)
        # for collectives outside the step (resharding, gathering state): not counted in
        # the step's bytes
        self._sides = {a: collectives.Comm(a, n, r, g) for a, (n, r, g) in where.items()}
        self._side = self._sides[axis]
        self.calls = 0
        captured = self._bind_comm_state(graph, captured)
        self._check_binding(graph, captured)
        super().__init__(graph, captured, self._program(graph, captured))
        self._state_type: dict[tuple[int, str], TensorType] = {
            s.key: i.value.type for i, s in zip(graph.inputs, captured.inputs)
            if s.kind == "opt_state"}
        # each parameter's type as the step reads it: by param index, by (module, name)
        params = [(i.value.type, s) for i, s in zip(graph.inputs, captured.inputs)
                  if s.kind == "param"]
        self._param_type = {pi: t for pi, (t, _) in enumerate(params)}
        self._param_type_at = {(s.owner, s.key[0]): t for t, s in params}
        self._param_names = [s.name for s in captured.inputs if s.kind == "param"]
        self._check_outputs()
        # gradients the graph leaves sharded are not written back: p.grad stays None
        self._with_grad -= self._sharded_grads
        self._check_equal_shares(graph)
        self._check_same_program(graph)
        if sync_module_states:
            self._broadcast_module_states()
        self._shard_params()
        self._mark_shards()
        self._guard_forward()

    def _program(self, graph: Graph, captured: Captured) -> Any:
        """This rank's program: a callable from the graph's inputs to its outputs (fx, or
        Inductor's code when the step was traced for it)."""
        return program(graph, captured, {**self.comms, **self.level_comms})

    def _level_comms(self, graph: Graph) -> dict[str, Any]:
        need = sorted({(str(op.attrs["axis"]), int(op.attrs["local"])) for op in graph.ops
                       if op.attrs.get("local") and op.name == "all_to_all"})
        out: dict[str, Any] = {}
        for axis, local in need:
            if dist.get_world_size() != self.mesh.size:
                raise BackendError(f"the step splits mesh axis {axis!r} into nodes of {local} "
                                   "devices, which needs the mesh's ranks to be the world's",
                                   hint="run the mesh on the whole world")
            for level, (n, r, g) in new_level_groups(self.mesh, axis, local).items():
                key = f"{axis}__{level}{local}"
                out[key] = collectives.Comm(key, n, r, g)
        return out

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
        mine = torch.tensor(dims, dtype=torch.int64, device=self._device())
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

    def _peers(self) -> list[Peers]:
        """The ranks that must agree on what every rank holds alike: the world when the
        mesh is the world (one collective, and no rank left waiting where another
        refused), else each axis's group."""
        if dist.is_initialized() and dist.get_world_size() == self.mesh.size:
            return [Peers(None, "the world", self.mesh.size, lambda r: r)]
        return [Peers(c.group, f"mesh axis {c.axis!r}", c.size, c.global_rank)
                for c in self.comms.values()]

    def _check_same_program(self, graph: Graph) -> None:
        """Every rank planned the step by itself: their programs must be one program, or
        their collectives pair up wrongly and the step hangs or computes garbage (one
        64-bit hash per rank, once)."""
        mine = torch.tensor([program_digest(graph)], dtype=torch.int64, device=self._device())
        found = disagreeing(mine, self._peers())
        if found is not None:
            peers, other, _ = found
            raise MeshError(
                f"the ranks built different programs for the step: over {peers.where}, rank "
                f"{dist.get_rank()}'s differs from rank {other}'s; their collectives would "
                "not pair up", hint="run the same code, library versions and options on "
                "every rank, with the same Python values the step reads (a count passed as "
                "an int differs by rank: pass it as a tensor); a tensor-parallel plan the "
                "solver stopped at its time limit (warned of when traced) depends on each "
                "rank's speed; else compare str(step.graph) across ranks and report the "
                "difference as a bug")

    def _check_args(self, args: tuple) -> list[torch.Tensor]:
        tensors = super()._check_args(args)
        if self.calls == 1 and not self.alone:
            self._check_same_whole_args(tensors)
            self._check_same_draws()
        return tensors

    def _check_same_whole_args(self, tensors: list[torch.Tensor]) -> None:
        """A tensor argument the plan takes as whole (not split over any axis: a 0-d count
        passed beside the batch) must be the same on every rank: each rank's was read as
        the same number (a token count each rank took of its own batch, passed as
        num_items_in_batch, gave 4x the loss and gradients at dp=4 with no word; a
        review's probe, 2026-12-07). Compared on the first call."""
        whole = self._whole_args(tensors)
        if not whole:
            return
        mine = torch.stack([fingerprint(t, self._device()) for _, t in whole])
        found = disagreeing(mine, self._peers())
        if found is not None:
            peers, other, rows = found
            names = ", ".join(f"%{whole[k][0]}" for k in rows[:3])
            raise MeshError(
                f"the step takes {names} as the same on every rank (not split with the "
                f"batch), but rank {dist.get_rank()} passes another value than rank {other} "
                f"(over {peers.where}): the plan would compute with each rank's as if it "
                "were everyone's", hint="pass the value for the whole global batch (a "
                "count all-reduced over the data-parallel ranks: dist.all_reduce(n)), or "
                "compute it inside the step from the batch")

    def _whole_args(self, tensors: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """(graph input, tensor) for each argument the plan takes as the same everywhere:
        not split over any axis, or a batch argument of no rows, or of one beside others
        of more (which the batch analysis takes as whole: a count, a temperature)."""
        args = list(zip([i for i, s in zip(self.graph.inputs, self.captured.inputs)
                         if s.kind == "arg"], tensors))
        rows = any(i.role.kind is InputKind.batch and t.dim() and t.shape[0] > 1
                   for i, t in args)
        return [(i.name, t) for i, t in args if not split_axes(i.value.type) or (
            i.role.kind is InputKind.batch and (t.dim() == 0 or rows and t.shape[0] == 1))]

    def _check_same_draws(self) -> None:
        """The ranks of a tensor-parallel axis hold the values the step draws random
        numbers on whole (dropout runs whole), so their generators must draw alike, or
        their copies of the whole parameters drift apart (a seed per rank, as
        accelerate's set_seed(device_specific=True) makes, did so with no word; a
        review's probe, 2026-12-07). Compared on the first call, where the step draws."""
        if not any(random_draw(op) == "global" for op in self.graph.walk()):
            return
        split = {a for t in self._param_type.values() for a, p in t.placements
                 if isinstance(p, Shard)} - {self.axis}
        peers = [Peers(c.group, f"mesh axis {a!r}", c.size, c.global_rank)
                 for a, c in self.comms.items() if a in split]
        if not peers:
            return
        mine = torch.tensor([rng_digest(self._device())], dtype=torch.int64,
                            device=self._device())
        found = disagreeing(mine, peers)
        if found is not None:
            peers_, other, _ = found
            raise MeshError(
                f"the ranks along {peers_.where} draw different random numbers (rank "
                f"{dist.get_rank()}'s generator is in another state than rank {other}'s), "
                "and the step draws (dropout) on values each of them holds whole: their "
                "copies of the whole parameters would drift apart",
                hint="seed the ranks of each tensor-parallel group alike (torch.manual_seed("
                     "seed + data-parallel index), not seed + rank), or turn dropout off")

    def _device(self) -> torch.device:
        """The device the step computes on (NCCL needs this rank's GPU for a tensor it
        sends)."""
        params = self.captured.params
        return params[0].device if params else torch.device("cpu")

    def _bind_comm_state(self, graph: Graph, cap: Captured) -> Captured:
        """The capture with a slot for each communication-state input a pass added
        (quantize-weight-diff's exact pieces and rounding key) and for the outputs that
        replace them; this runtime holds their values in ``comm_state``."""
        self.comm_state: dict[str, torch.Tensor] = {}
        self._comm_types = {i.name: i for i in graph.inputs
                            if i.role.kind is InputKind.comm_state}
        if not self._comm_types:
            return cap
        known = {s.name for s in cap.inputs}
        extra_in = [Slot("comm_state", 0, (i.name,), i.name) for i in graph.inputs
                    if i.name in self._comm_types and i.name not in known]
        outs = list(cap.outputs)
        for o in graph.outputs[len(cap.outputs):]:
            if o.role.kind is not OutputKind.replaces or o.role.target not in self._comm_types:
                raise BackendError(f"the output {o.name} was added by a pass but replaces no "
                                   "communication state",
                                   hint="passes keep the step's signature")
            outs.append(Slot("comm_state", 0, (o.role.target,), o.role.target))
        return replace(cap, inputs=list(cap.inputs) + extra_in, outputs=outs)

    def _comm_input(self, slot: Slot) -> torch.Tensor:
        """A communication state's value, started on first use: an exact piece from the
        parameter's own piece (its weights are exact before the first step), a key from
        ``seed``."""
        name = slot.key[0]
        if name not in self.comm_state:
            i = self._comm_types[name]
            if i.value.type.dtype is DType.key:
                self.comm_state[name] = torch.tensor(self.seed, dtype=torch.int64)
            else:
                pi = self._param_names.index(i.role.of)
                p = self.captured.params[pi]
                self.comm_state[name] = self._shard_of(p.data, i.value.type).clone()
        return self.comm_state[name]

    def _input(self, slot: Slot, args_it) -> torch.Tensor:
        if slot.kind == "comm_state":
            return self._comm_input(slot)
        return super()._input(slot, args_it)

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
        """Parameters are written back in the placement they are read in (whole, or this
        rank's tensor-parallel shard); a gradient so too, or not at all when the graph
        leaves it sharded further (reduce-scattered over the data axis)."""
        self._sharded_grads: set[int] = set()
        types = self.graph.value_types()
        axes = list(self.comms)
        for out, slot in zip(self.graph.outputs, self.captured.outputs):
            t = types[out.name]
            if slot is None or slot.kind in ("opt_state", "comm_state"):
                continue   # the user's results (R or V); state keeps its input's placement
            if slot.kind == "grad":
                p_type = self._param_type[slot.key[0]]
                if all(t.placement(a) == p_type.placement(a) for a in axes):
                    continue
                if any(isinstance(t.placement(a), (Shard, FlatShard)) for a in axes) and all(
                        isinstance(t.placement(a), (Shard, FlatShard, Replicate))
                        for a in axes):
                    self._sharded_grads.add(slot.key[0])
                    continue
                if all(isinstance(t.placement(a), Replicate) and
                       isinstance(p_type.placement(a), (Shard, FlatShard))
                       for a in axes if t.placement(a) != p_type.placement(a)):
                    # whole (zeros zero_grad(set_to_none=False) left) for a parameter held
                    # as a piece (shard_params): not written back, as a sharded one is not
                    self._sharded_grads.add(slot.key[0])
                    continue
                p = next(t.placement(a) for a in axes
                         if t.placement(a) != p_type.placement(a))
                raise BackendError(f"the gradient output {out.name} is placed {p}; a "
                                   "gradient is written back as its parameter is held (R, "
                                   "or its tensor-parallel shard) or not at all (S/F)")
            if slot.kind == "param":
                p_type = self._param_type_at.get((slot.owner, slot.key[0]))
                if p_type is None or split_axes(t) != split_axes(p_type):
                    raise BackendError(f"the new parameter {slot.name} is placed {t}, but it "
                                       f"is read as {p_type}; parameters are written back as "
                                       "they are held",
                                       hint="the program must all_gather new parameters")
                continue
            for a in axes:
                p = t.placement(a)
                if not isinstance(p, (Replicate, Varying)):
                    raise BackendError(f"the new {slot.kind} {slot.name} is placed {p} on "
                                       f"{a!r}; it is written back whole",
                                       hint="the program must all_gather it")
        for o in self.graph.outputs:
            if o.role.kind is not OutputKind.loss:
                continue
            for a in axes:
                if not isinstance(types[o.name].placement(a), Replicate):
                    raise BackendError(f"the loss {o.name} is not replicated over {a!r}",
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
        """This rank's piece of the whole tensor ``t`` of type ``typ``: its chunk along each
        split dimension, then, of that, its flat chunk (no communication)."""
        t = t.detach()
        for a, p in typ.placements:
            if isinstance(p, Shard) and a in self._sides:
                t = collectives.take_shard(self._sides[a], t, p.dim, [], p.groups)
        flat = _flat_axis(typ, self._sides)
        if flat is not None:
            t = collectives.take_shard(self._sides[flat], t, "flat",
                                       list(typ.local_shape(dict(self.mesh.axes))))
        return t

    def _whole_of(self, t: torch.Tensor, typ: TensorType) -> torch.Tensor:
        """The whole tensor of type ``typ`` from every rank's piece ``t`` (collectives over
        the axes it is split on: every rank must call it)."""
        out, moved = t.detach(), False
        flat = _flat_axis(typ, self._sides)
        if flat is not None:
            split_only = typ.local_shape({a: n for a, n in self.mesh.axes
                                          if isinstance(typ.placement(a), Shard)})
            out, moved = collectives.all_gather(self._sides[flat], out, "flat",
                                                list(split_only)), True
        for a, p in reversed(typ.placements):
            if isinstance(p, Shard) and a in self._sides and p.groups > 1:
                out, moved = collectives.all_gather_groups(self._sides[a], out, p.dim,
                                                           p.groups), True
            elif isinstance(p, Shard) and a in self._sides:
                out, moved = collectives.all_gather(self._sides[a], out, p.dim, []), True
        return out if moved else out.clone()

    def _write(self, slot: Slot, new: torch.Tensor) -> None:
        if slot.kind == "comm_state":
            self.comm_state[slot.key[0]] = new.clone()
            return
        if slot.kind == "grad" and slot.key[0] in self._sharded_grads:
            return
        super()._write(slot, new)

    # ------------------------------------------------------------------ running
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        no_keywords(kwargs)
        if not self.alone and not dist.is_initialized():
            raise BackendError("torch.distributed is no longer initialized",
                               hint="call the step before destroy_process_group()")
        self.calls += 1
        return super().__call__(*args)

    @property
    def comm_calls(self) -> int:
        """Calls this rank made to move data so far: its collectives (not those that move
        none: a take_shard) and its sends to other pipeline ranks, over every mesh axis."""
        return sum(n for c in (*self.comms.values(), *self.level_comms.values())
                   for kind, n in c.calls.items() if not is_local(kind))

    @property
    def comm_bytes(self) -> int:
        """Bytes this rank sent in the step's collectives so far (ring model), over every
        mesh axis."""
        return sum(c.bytes_sent for c in (*self.comms.values(), *self.level_comms.values()))

    def _broadcast_module_states(self) -> None:
        # as DDP does at construction: every rank starts from the mesh's first rank's
        # parameters and buffers (broadcast over each axis in turn reaches every rank)
        seen: set[int] = set()
        tensors = []
        for m in self.captured.modules:
            for t in list(m.parameters()) + list(m.buffers()):
                if id(t) not in seen:
                    seen.add(id(t))
                    tensors.append(t)
        whole = {id(p): tuple(p.shape) == self._param_type[pi].shape
                 for pi, p in enumerate(self.captured.params) if pi in self._param_type}
        held = {id(p): split_axes(self._param_type[pi])
                for pi, p in enumerate(self.captured.params) if pi in self._param_type}
        with torch.no_grad():
            for a, comm in self.comms.items():
                if comm.size == 1:
                    continue
                for t in tensors:
                    # a parameter already held as its shard (a step built before) keeps it
                    # on the axes it is split over
                    if not whole.get(id(t), True) and a in held.get(id(t), {}):
                        continue
                    dist.broadcast(t.data, src=comm.global_rank(0), group=comm.group)

    def _shard_params(self) -> None:
        """Make each parameter placed ``S(d)`` on a tensor-parallel axis, or ``F`` on the data
        axis (``shard-params``), the rank's piece of itself, as FSDP2 does: between steps
        the module's parameters ARE this rank's shards (a flat one is 1-D: its chunk of the
        flattened, zero-padded parameter; the module's own forward outside the step is then
        not meaningful); ``state_dict()`` gathers them."""
        sizes = dict(self.mesh.axes)
        for pi, p in enumerate(self.captured.params):
            typ = self._param_type.get(pi)
            if typ is None or not split_axes(typ):
                continue
            bad = [f"{a}: {q}" for a, q in split_axes(typ).items()
                   if not isinstance(q, (Shard, FlatShard))]
            if bad:
                raise BackendError(f"the parameter {self._param_names[pi]} is read placed "
                                   f"{', '.join(bad)}; the torch runtime holds parameters "
                                   "whole, split along a dimension (S(d)) or flat (F)",
                                   hint="shard optimizer state over the data axis, not the "
                                        "parameters themselves")
            local = typ.local_shape(sizes)
            if tuple(p.shape) == local:
                continue            # already this rank's shard
            if tuple(p.shape) != typ.shape:
                raise BackendError(f"the parameter {self._param_names[pi]} has shape "
                                   f"{tuple(p.shape)}; the plan holds {typ.shape} split to "
                                   f"{local}", hint="trace the step again")
            with torch.no_grad():
                p.data = self._shard_of(p.data, typ).clone()
            p.grad = None

    def _retrace_hint(self) -> str:
        return ("a DataLoader's smaller last batch: pass drop_last=True, or trace a second "
                "step for that shape before the first call (parallelize(step, mesh).trace("
                "model, opt, *last_batch)) and call it for that batch; a step traced after "
                "the first call finds the optimizer state already held as this plan's "
                "shards")

    def _mark_shards(self) -> None:
        """Hook the state dicts of the optimizers whose state, and of the modules whose
        parameters, this rank holds as shards: one rank's, refused on another
        (``shard_marks.py``)."""
        if self.alone:
            return
        rank, world = dist.get_rank(), dist.get_world_size()
        owners = {s.owner for s in self.captured.inputs if s.kind == "opt_state"
                  and split_axes(self._state_type[s.key])}
        for k in sorted(owners):
            mark_optimizer(self.captured.optimizers[k], rank, world)
        held = {s.owner for pi, s in enumerate(s for s in self.captured.inputs
                                               if s.kind == "param")
                if split_axes(self._param_type[pi])}
        for k in sorted(held):
            mark_module(self.captured.modules[k], rank, world)

    def _guard_forward(self) -> None:
        """Refuse the module's own forward between steps where it holds parameters as
        pieces (``shard_marks.guard_forward``; checked when called, by shape), and let the
        whole state load into it (``shard_marks.take_pieces``)."""
        pis = self._held_in_pieces()
        if not pis:
            return
        whole = {id(self.captured.params[pi]): self._param_type[pi].shape for pi in pis}
        piece = {id(self.captured.params[pi]): (
            self._param_type[pi].shape, functools.partial(self._piece_of, pi)) for pi in pis}
        for module in self.captured.modules:
            guard_forward(module, whole)
            take_pieces(module, piece)

    def _piece_of(self, pi: int, t: torch.Tensor) -> torch.Tensor:
        """This rank's piece of parameter ``pi``'s whole value ``t``, as it holds it."""
        return self._shard_of(t, self._param_type[pi]).clone()

    def _held_in_pieces(self) -> list[int]:
        """The parameters (by index) this rank holds as pieces between steps."""
        return [pi for pi, typ in self._param_type.items() if split_axes(typ)]

    def state_dict(self, module: int = 0) -> dict[str, torch.Tensor]:
        """The whole state dict of the step's ``module``-th module (parameters gathered from
        every rank's tensor-parallel shard, buffers as held) on every rank: a collective,
        every rank must call it. For checkpoints and comparisons."""
        cap = self.captured
        whole: dict[int, torch.Tensor] = {}      # id of a held parameter -> gathered
        slots = [s for s in cap.inputs if s.kind == "param"]
        for pi, slot in enumerate(slots):
            typ = self._param_type[pi]
            if slot.owner == module and split_axes(typ):
                whole[id(cap.params[pi])] = self._whole_of(cap.params[pi], typ)
        # by tensor, not name: a tied parameter (an embedding shared with the LM head)
        # appears under every name it has
        gathered = {k: whole[id(p)] for k, p in
                    cap.modules[module].named_parameters(remove_duplicate=False)
                    if id(p) in whole}
        return {k: gathered[k] if k in gathered else v.detach().clone()
                for k, v in cap.modules[module].state_dict().items()}

    # ------------------------------------------------------------------ reports
    def profile(self, *args: Any, steps: int = 5) -> StepProfile:
        """Time ``steps`` real training steps twice (they update the model): once with every
        collective waited for at once, giving the time in communication and, the rest, in
        computation; once as scheduled (asynchronous collectives waited for late), giving the
        communication still exposed. Hidden = communication - exposed. Medians per step;
        every rank must call it."""
        def timed(force: bool) -> tuple[float, float]:
            walls, blocked = [], []
            for c in self.comms.values():
                c.force_sync = force
            try:
                for _ in range(steps):
                    if not self.alone:
                        dist.barrier(group=self._barrier_group())
                    b0, t0 = self._blocked(), time.perf_counter()
                    self(*args)
                    walls.append(time.perf_counter() - t0)
                    blocked.append(self._blocked() - b0)
            finally:
                for c in self.comms.values():
                    c.force_sync = False
            return _median(walls), _median(blocked)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise DiphomaError(f"profile(steps={steps!r}): the steps to time are a whole "
                               "number of at least 1", hint="profile(*args, steps=5)")
        if self.codegen == "inductor" and not self.alone:
            raise BackendError(
                "profile() splits a step into computation and communication by running it "
                "with every collective waited for at once; a program compiled by Inductor "
                "has its collectives and their waits compiled in, so it cannot be rerun so",
                hint="profile the same plan with parallelize(..., codegen='fx'), or time the "
                     "Inductor program with torch.profiler")
        sync_wall, comm_s = timed(True)
        step_s, exposed = timed(False)
        return StepProfile(step_s=step_s, compute_s=max(sync_wall - comm_s, 0.0),
                           comm_s=comm_s, exposed_comm_s=exposed,
                           hidden_comm_s=max(comm_s - exposed, 0.0), steps=steps)

    def _blocked(self) -> float:
        return sum(c.blocked_s for c in (*self.comms.values(), *self.level_comms.values()))

    def _barrier_group(self) -> Any:
        # one axis: its group; several: every rank of the mesh (WORLD, or the user's mesh)
        big = [c for c in self.comms.values() if c.size > 1]
        return big[0].group if len(big) == 1 else None

    def memory_report(self) -> MemoryReport:
        """Bytes of parameters, optimizer state and gradients this process holds now
        (tensor-parallel shards and optimizer-state shards as held)."""
        cap = self.captured
        params = [p for m in cap.modules for p in m.parameters()]
        state = [v for opt in cap.optimizers for st in opt.state.values()
                 for v in st.values() if isinstance(v, torch.Tensor)]
        grads = [p.grad for p in params if p.grad is not None]
        return MemoryReport(_storage_bytes(params), _storage_bytes(state), _storage_bytes(grads))

    def gather_comm_state(self) -> dict[str, torch.Tensor]:
        """The communication state of quantizing passes, whole, {input name: tensor} on every
        rank (a collective: every rank must call it); empty before the first step. The
        exact weights of a quantize-weight-diff step are ``<param>.master``."""
        out = {}
        for name, t in self.comm_state.items():
            typ = self._comm_types[name].value.type
            out[name] = t.clone() if typ.dtype is DType.key else self._whole_of(t, typ)
        return out

    def load_comm_state(self, whole: dict[str, torch.Tensor]) -> None:
        """Resume from ``gather_comm_state()``'s whole tensors: each rank keeps its piece (no
        communication)."""
        for name, t in whole.items():
            i = self._comm_types.get(name)
            if i is None:
                raise BackendError(f"{name} is not communication state of this step "
                                   f"(it has {sorted(self._comm_types)})",
                                   hint="load the state gathered from the same plan")
            typ = i.value.type
            if tuple(t.shape) != typ.shape:
                raise BackendError(f"{name} has shape {tuple(t.shape)}, the plan holds "
                                   f"{typ.shape}", hint="load the state gathered from the "
                                                        "same plan")
            self.comm_state[name] = t.clone() if typ.dtype is DType.key else \
                self._shard_of(t, typ).clone()

    def gather_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The whole optimizer state, {param name: {slot: tensor}}, on every rank (a
        collective: every rank must call it). For tests and checkpoints."""
        cap = self.captured
        out: dict[str, dict[str, torch.Tensor]] = {}
        for slot in cap.inputs:
            if slot.kind != "opt_state":
                continue
            pi, key = slot.key
            t = self._whole_of(self._state(slot), self._state_type[slot.key])
            out.setdefault(self._param_names[pi], {})[key] = t
        return out


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
    return sum(seen.values())


def split_axes(t: TensorType) -> dict[str, Placement]:
    """The axes a value is not replicated over, and how it is placed on each."""
    return {a: p for a, p in t.placements if not isinstance(p, Replicate)}


def _flat_axis(typ: TensorType, comms: dict[str, Any]) -> str | None:
    """The one axis a value is flat-sharded over (None: none); BackendError for two."""
    flat = [a for a, p in typ.placements if isinstance(p, FlatShard) and a in comms]
    if len(flat) > 1:
        raise BackendError(f"a value of type {typ} is flat-sharded over {len(flat)} axes; "
                           "the torch runtime keeps flat shards of one axis",
                           hint="shard the optimizer state over the data axis only")
    return flat[0] if flat else None


def _check_world(graph: Graph, mesh: Mesh, group: Any, axis: str,
                 groups: dict[str, Any] | None = None) -> dict[str, tuple[int, int, Any]]:
    """Each mesh axis's size, this rank's index on it and its process group, after checking
    that the mesh, the graph and the running process group agree (before any collective
    runs, except the ``new_group`` calls that make the groups of a mesh of several axes).

    ``groups`` (a torch DeviceMesh's, by axis) are used as they are; otherwise a mesh with
    one axis of more than one device runs on ``group`` (default WORLD), and one with
    several gets a group per axis (``groups.new_axis_groups``) among ``group``'s ranks."""
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
    for name, n in mesh.axes:
        if (name in graph.mesh and graph.mesh.axis_size(name) != n) or (
                name not in graph.mesh and n > 1):
            raise MeshError(f"the graph was transformed for {graph.mesh} but runs on {mesh}",
                            hint="run the passes for the mesh you run on")
    coll = {str(op.attrs.get("axis")) for op in graph.ops
            if op.name in OPS and OPS[op.name].category is Category.collective}
    if coll - set(mesh.names):
        raise BackendError(f"the graph has collectives over {sorted(coll - set(mesh.names))}, "
                           f"which the mesh {mesh} does not have")
    big = [(name, n) for name, n in mesh.axes if n > 1]
    one = {name: (1, 0, None) for name, n in mesh.axes if n == 1}
    if not (dist.is_available() and dist.is_initialized()):
        if not big and group is None and not coll:
            return one      # a mesh of one device: the single-device program, in-process
        if not big:
            raise BackendError(
                f"torch.distributed is not initialized, and the plan for the one-device mesh "
                f"still has collectives over it ({', '.join(sorted(coll))}; the passes were "
                "given)",
                hint="leave passes= unset on a one-device mesh (the single-device program "
                     "runs), or call torch.distributed.init_process_group first")
        what = ", ".join(f"mesh axis {n!r}" for n, _ in big)
        raise BackendError(
            f"torch.distributed is not initialized, and the step runs on {mesh.size} "
            f"processes ({what})",
            hint=f"run under torchrun --nproc_per_node={mesh.size} and call "
                 "torch.distributed.init_process_group('gloo' or 'nccl') before building "
                 "the step")
    if groups:
        out = dict(one)
        for name, n in big:
            g = groups.get(name)
            world = dist.get_world_size(g)
            if world != n:
                raise MeshError(f"mesh axis {name!r} has {n} devices but its process group "
                                f"has {world} processes",
                                hint="build the DeviceMesh with the mesh's axis sizes")
            out[name] = (n, dist.get_rank(g), g)
        return out
    world = dist.get_world_size(group)
    if len(big) <= 1:
        name, n = big[0] if big else (axis, size)
        if world != n:
            raise MeshError(f"mesh axis {name!r} has {n} devices but the process group has "
                            f"{world} processes",
                            hint=f"run under torchrun --nproc_per_node={n}, or transform the "
                                 f"step for Mesh({{{name!r}: {world}}})")
        return {**one, name: (n, dist.get_rank(group), group)}
    if world != mesh.size:
        raise MeshError(f"the mesh {mesh} has {mesh.size} devices but the process group has "
                        f"{world} processes",
                        hint=f"run under torchrun --nproc_per_node={mesh.size}, or plan for "
                             f"a mesh of {world} devices")
    me = coordinates(mesh, dist.get_rank(group))
    made = new_axis_groups(mesh, group)
    return {**one, **{name: (n, me[name], made[name]) for name, n in big}}
