"""The plan: what the passes decided, read off the final IR, for a person (text) or a tool
(JSON, versioned schema). Per tensor its placement and bytes per device; each collective
with what it moves and the bytes a device sends per step (ring algorithms); per-device
memory for parameters, gradients, optimizer state and saved activations next to the
single-device figures. The JSON schema is documented in docs/plan.md."""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TypeVar

from ..ir.analysis import differentiates, free_inputs, peak_memory, producers, view_bases
from ..ir.core import Graph, InputKind, Op, OutputKind, Phase
from ..ir.device_model import DeviceModel, device_model
from ..ir.ops import Category, op_def
from ..ir.opdef import is_local
from ..ir.types import TensorType, Varying
from ..passes.base import Decision, find_decision
from ..passes.pipeline_orders import rank_orders
from ..passes.pipeline_parallel import PipelineRecord, pipeline_of
from ..passes.pipeline_programs import (StagePrograms, is_staged, rank_stage_programs, rank_stages,
                                        runs_per_step)
from .compute import DEFAULT_DEVICE_MODEL, Compute, estimate_compute
from .pipeline_peak import pipeline_peak
from .pipeline_time import pipeline_compute
from .text import render as render_text
from .text import summary as summary_text

SCHEMA_VERSION = 3
_ROLES = (InputKind.param, InputKind.opt_state, InputKind.batch, InputKind.buffer)
_D = TypeVar("_D")


@dataclass(frozen=True)
class TensorPlan:
    """A graph input's placement and size."""

    name: str
    role: str
    shape: tuple[int, ...]
    dtype: str
    placement: str           # "R", or "dp: F", "dp: V, tp: S(1)", ...
    bytes_per_device: int
    bytes_total: int         # the whole tensor (for a varying batch: all devices together)


@dataclass(frozen=True)
class CollectivePlan:
    """One collective of the step."""

    kind: str
    axis: str
    value: str               # the IR value it reads
    serves: str              # what it is for: "gradient of fc1.weight", "loss", ...
    reduction: str | None
    bytes_per_device: int    # bytes one device sends per step
    phase: str | None
    # per value it reads, the tensor that value belongs to: the parameter whose gradient or
    # new value it is, the buffer, "loss", "metric"; None where no one tensor is known
    belongs_to: tuple[str | None, ...] = ()
    # under a pipeline: the rank on the pipeline axis that runs it, and how many times a
    # step (M in a program run per microbatch; bytes_per_device counts every run)
    pp_rank: int | None = None
    runs: int = 1

    @property
    def tensor(self) -> str:
        """The tensor it moves, for a person: ``fc1.weight``, ``fc1.weight (+27)`` for a
        bucket, or the IR value where no tensor is known."""
        first = self.belongs_to[0] if self.belongs_to else None
        if first is None:
            return self.value
        more = len(self.belongs_to) - 1
        return first + (f" (+{more})" if more else "")


@dataclass(frozen=True)
class Memory:
    """Bytes per device, and on one device running the unsharded step."""

    params: int
    grads: int
    opt_state: int
    single_device_params: int
    single_device_grads: int
    single_device_opt_state: int
    # an estimate: forward values that backward reads (views counted once, at their base)
    activations: int = 0
    single_device_activations: int = 0
    # the most one device holds while the step runs: its inputs (held throughout) plus the
    # values live at the busiest op, by liveness over the program (analysis.peak_memory)
    peak: int = 0
    peak_at: str = ""          # the op at the peak: "#k name (phase)"
    # under a pipeline: each pp rank's peak (report/pipeline_peak.py); ``peak`` is the most
    peak_per_rank: tuple[int, ...] = ()


@dataclass(frozen=True)
class Plan:
    """A readable account of a transformed step; ``to_text()`` and ``to_json()``."""

    graph: str
    mesh: dict[str, int]
    passes: tuple[str, ...]
    tensors: tuple[TensorPlan, ...]
    collectives: tuple[CollectivePlan, ...]
    memory: Memory
    comm_bytes_per_step: int
    # pass name -> what the pass decided (DataParallelRecord, ...), in pipeline order
    decisions: dict[str, Decision] = field(default_factory=dict)
    param_count: int = 0     # elements of all parameters (tied ones once): the model size
    # what was planned, when a tool knows more than the graph: source, framework, inputs,
    # loss, optimizer (diphoma inspect fills it; plain strings)
    context: dict[str, str] = field(default_factory=dict)
    backend: str | None = None     # one line: how the framework's backend runs the plan
    # mesh axes of more than one device that no pass partitions over (see idle_axes())
    idle_axes: dict[str, int] = field(default_factory=dict)
    # flops per step and per device, ops of unknown cost, step time on a device model
    compute: Compute | None = None
    # under a pipeline, the bytes a device of each pp rank sends per step (the step's
    # comm_bytes_per_step is the largest); empty otherwise
    comm_bytes_per_rank: tuple[int, ...] = ()

    def decision(self, kind: type[_D]) -> _D | None:
        """What the pass whose record type is ``kind`` decided, or None when it did not run."""
        return find_decision(self.decisions, kind)

    @property
    def comm_calls_per_rank(self) -> tuple[int, ...]:
        """Under a pipeline, the calls a device of each pp rank makes a step: its
        collectives that move data and its sends to other ranks, each as often as its
        program runs (receives not counted; a send to another stage of the same rank is a
        hand-over in memory); empty otherwise."""
        return tuple(sum(c.runs for c in self.collectives if c.pp_rank == r
                         and c.kind != "recv" and not is_local(c.kind)
                         and not (c.kind == "send" and c.bytes_per_device == 0))
                     for r in range(len(self.comm_bytes_per_rank)))

    @property
    def notes(self) -> dict[str, Any]:
        """The decisions as plain data, keyed by pass name, then ``backend`` and ``idle_axes``."""
        notes: dict[str, Any] = {name: d.to_dict() if hasattr(d, "to_dict") else d
                                 for name, d in self.decisions.items()}
        if self.backend is not None:
            notes["backend"] = self.backend
        if self.idle_axes:
            notes["idle_axes"] = dict(self.idle_axes)
        return notes

    def to_dict(self) -> dict[str, Any]:
        """Plain data with ``schema`` = SCHEMA_VERSION (see docs/plan.md)."""
        return {"graph": self.graph, "mesh": dict(self.mesh), "passes": list(self.passes),
                "tensors": tuple(asdict(t) for t in self.tensors),
                "collectives": tuple(asdict(c) for c in self.collectives),
                "memory": asdict(self.memory), "comm_bytes_per_step": self.comm_bytes_per_step,
                "comm_bytes_per_rank": list(self.comm_bytes_per_rank),
                "notes": self.notes, "param_count": self.param_count,
                "context": dict(self.context),
                "compute": self.compute.to_dict() if self.compute else None,
                "schema": SCHEMA_VERSION}

    def to_json(self, indent: int | None = 2) -> str:
        """The plan as JSON."""
        return json.dumps(self.to_dict(), indent=indent, default=str)

    def summary(self) -> str:
        """The report's head: model size, mesh, passes, memory per device, communication,
        compute."""
        return summary_text(self)

    def to_text(self, max_rows: int = 60) -> str:
        """The plan as a report: summary, tensors, collectives, decisions."""
        return render_text(self, max_rows)


def _placement(t: TensorType) -> str:
    return ", ".join(f"{a}: {p}" for a, p in t.placements) or "R"


def gradient_sources(graph: Graph, prod: dict[str, Op] | None = None,
                     types: dict[str, TensorType] | None = None) -> dict[str, str]:
    """Collective result -> the parameter whose gradient it carries: walking back from each
    new parameter through values of the parameter's size to a collective (``prod`` and
    ``types``: the graph's producers and value types, when the caller has them)."""
    prod = producers(graph) if prod is None else prod
    types = graph.value_types() if types is None else types
    inputs = {i.name: i for i in graph.inputs}
    found: dict[str, str] = {}
    for o in graph.outputs:
        if o.role.kind is not OutputKind.replaces:
            continue
        target = inputs.get(o.role.target)
        if target is None or target.role.kind is not InputKind.param:
            continue
        numel = target.value.type.numel
        stack, seen = [o.name], set()
        while stack:
            n = stack.pop()
            op = prod.get(n)
            if op is None or n in seen:
                continue
            seen.add(n)
            if op_def(op.name).category is Category.collective and op.inputs and \
                    op.name in ("all_reduce", "reduce_scatter"):
                found.setdefault(n, target.name)     # in a bucket: this member's result
                continue
            if op.name == "wait" or (op_def(op.name).category is Category.collective
                                     and len(op.inputs) == len(op.results) > 1):
                # a bucket or a wait: result k is made from input k alone
                k = [v.name for v in op.results].index(n)
                stack.append(op.inputs[k])
                continue
            stack.extend(i for i in op.inputs if types[i].numel == numel)
    return found


def build_plan(graph: Graph, decisions: Mapping[str, Decision] | None = None, *,
               backend: str | None = None,
               device_model: DeviceModel | str = DEFAULT_DEVICE_MODEL,
               in_place: Collection[str] = (),
               scratch: Mapping[int, int] | None = None,
               cuts: list[StagePrograms] | None = None,
               written: Collection[str] = ()) -> Plan:
    """The plan of a (transformed) graph; ``decisions`` are the passes' records
    (``PassContext.decisions``), ``backend`` how the framework runs it, ``device_model``
    what the step time is estimated on (a DeviceModel or its name), ``in_place`` the new
    values the backend writes into their inputs' storage (``written``: those its kernels
    make there, owning no storage) and ``scratch`` the bytes its
    collectives hold while in flight (for the peak: ``analysis.peak_memory``); ``cuts``:
    ``rank_stage_programs(graph)`` of a staged graph, when already made."""
    sizes = dict(graph.mesh.axes)
    types = graph.value_types()
    tensors = []
    for i in graph.inputs:
        if i.role.kind not in _ROLES:
            continue
        t = i.value.type
        total = t.nbytes
        for a, p in t.placements:
            if isinstance(p, Varying):
                total *= sizes.get(a, 1)
        tensors.append(TensorPlan(i.name, i.role.kind.value, t.shape, t.dtype.value,
                                  _placement(t), t.local_nbytes(sizes), total))
    prod = producers(graph)
    sources = gradient_sources(graph, prod, types)
    grads = dict(sources)
    loss = {o.name for o in graph.outputs if o.role.kind is OutputKind.loss}
    waited = {v.name: i for op in graph.walk() if op.name == "wait"
              for v, i in zip(op.results, op.inputs)}
    grads.update((waited.get(o.name, o.name), o.role.target) for o in graph.outputs
                 if o.role.kind is OutputKind.replaces)
    loss |= {waited[n] for n in loss if n in waited}
    metrics = {o.name for o in graph.outputs if o.role.kind is OutputKind.metric}
    metrics |= {waited[n] for n in metrics if n in waited}
    owner = _Owners(graph, grads, loss, metrics, waited, prod, types)
    param_inputs = {i.name for i in graph.inputs if i.role.kind is InputKind.param}
    # the payloads quantizing passes moved: (tensor, what for), by collective result
    payloads: dict[str, tuple[str, str]] = {}
    for d in (decisions or {}).values():
        payloads.update(getattr(d, "payloads", None) or {})
    payloads.update((w, payloads[n]) for w, n in waited.items() if n in payloads)
    if cuts is None and is_staged(graph):
        cuts = rank_stage_programs(graph)   # each pp rank's programs
    runs = _runs_per_step(graph, cuts) if cuts else {}
    collectives = []
    for op in graph.walk():
        d = op_def(op.name)
        if d.category is not Category.collective:
            continue
        axis = str(op.attrs.get("axis"))
        ins = [types[n] for n in op.inputs]
        outs = [v.type for v in op.results]
        value = op.inputs[0] if op.inputs else ""
        if len(op.inputs) > 1:
            value += f" (+{len(op.inputs) - 1})"
        paid = [payloads.get(v.name) for v in op.results]
        serves = _serves(op, grads, loss, metrics, param_inputs)
        if any(paid):
            kinds = sorted({p[1].replace(f" of {p[0]}", "") for p in paid if p})
            serves = paid[0][1] if len(paid) == 1 and paid[0] else \
                f"bucket of {len(paid)}: " + ", ".join(kinds)
        belongs = owner.of_op(op)
        if any(paid):
            belongs = tuple(p[0] if p else b for p, b in zip(paid, belongs))
        rank, times = runs.get(id(op), (None, 1))
        if times == 0:      # run by no program
            continue
        nbytes = times * d.comm_bytes(op, ins, outs, sizes.get(axis, 1), sizes)
        if op.name == "send" and rank is not None and op.attrs.get("peer") == rank:
            nbytes = 0      # to a stage of the same rank (a V's tied weight): no traffic
        collectives.append(CollectivePlan(
            op.name, axis, value, serves, op.attrs.get("op"), nbytes,
            op.phase.value if op.phase else None, belongs, rank, times))
    per_rank = tuple(sum(c.bytes_per_device for c in collectives if c.pp_rank == r)
                     for r in range(len(cuts or ())))
    by_stage = _saved_by_stage(graph, sizes, types)
    memory = _memory(graph, sizes, sources, types, in_place, scratch, by_stage, cuts,
                     written)
    params = sum(i.value.type.numel for i in graph.inputs if i.role.kind is InputKind.param)
    decisions = _with_stage_activations(dict(decisions or {}), by_stage)
    return Plan(graph.name, sizes, graph.passes, tuple(tensors), tuple(collectives), memory,
                max(per_rank) if per_rank else sum(c.bytes_per_device for c in collectives),
                decisions, params, backend=backend, idle_axes=idle_axes(graph),
                compute=_compute(graph, device_model, cuts), comm_bytes_per_rank=per_rank)


def _runs_per_step(graph: Graph, cuts: list[StagePrograms]) -> dict[int, tuple[int, int]]:
    """Each op of a staged graph (by id) -> (the pp rank that runs it, times a step): M in
    the programs run per microbatch (forward, backward, count programs C), once in the
    update and T programs, added up over the programs holding it; a send or a receive
    (in no program) as its phase says: once a step in the update, else per microbatch;
    any other op in no program never runs (a backward's gather of a parameter program T
    gathers once for the step)."""
    m = pipeline_of(graph).microbatches
    rank = {st: r for r, stages in enumerate(rank_stages(graph)) for st in stages}
    out = {id(op): (rank[op.stage], (1 if op.phase is Phase.update else m)
                    if op.name in ("send", "recv") else 0)
           for op in graph.walk() if op.stage is not None}
    found: dict[int, tuple[int, int]] = {}
    for r, cut in enumerate(cuts):
        progs = [(k, p) for (_, k), p in cut.programs.items()]
        progs += [("C", p) for p in cut.counts.values()]
        progs += [("T", p) for p in cut.once.values()]
        for kind, prog in progs:
            times = runs_per_step(kind, m)
            for op in prog.graph.walk():    # in two programs (a constant copied): both
                found[id(op)] = (r, found.get(id(op), (r, 0))[1] + times)
    return {**out, **found}


def _compute(graph: Graph, model: DeviceModel | str, cuts: list | None) -> Compute:
    """The compute section: over each rank's stages and microbatches for a pipeline
    (``pipeline_time``; ``cuts`` its ranks' programs), over the program otherwise
    (``compute.estimate_compute``)."""
    model = device_model(model) if isinstance(model, str) else model
    if cuts is not None:
        got = pipeline_compute(graph, pipeline_of(graph), model, cuts)
        if got is not None:
            return got
    return estimate_compute(graph, model)


def idle_axes(graph: Graph) -> dict[str, int]:
    """Mesh axes of more than one device that no value is placed on and no collective runs
    over: every device along such an axis repeats the same work on the same tensors."""
    used = {a for v in graph.value_types().values() for a, _ in v.placements}
    used |= {str(op.attrs.get("axis")) for op in graph.walk()
             if op_def(op.name).category is Category.collective}
    return {a: n for a, n in graph.mesh.axes if n > 1 and a not in used}


class _Owners:
    """Which tensor a collective's values belong to. A result that carries a parameter's
    gradient or new value, a buffer's value, the loss or a metric is known by what it
    serves; otherwise the value is followed back while it is made from one value only
    (reshapes, squares, sums: a gradient's partial sum of squares) to a graph input or a
    known result."""

    def __init__(self, graph: Graph, grads: dict[str, str], loss: set[str],
                 metrics: set[str], waited: dict[str, str], prod: dict[str, Op],
                 types: dict[str, TensorType]) -> None:
        self.known = dict(grads)
        self.known.update((n, "loss") for n in loss)
        self.known.update((n, "metric") for n in metrics)
        self.inputs = {i.name for i in graph.inputs if i.role.kind in _ROLES}
        self.prod = prod
        self.types = types
        self.waited = waited

    def of_op(self, op: Op) -> tuple[str | None, ...]:
        """For each value ``op`` reads: the tensor it belongs to, or None."""
        results = [v.name for v in op.results]
        out = []
        for k, n in enumerate(op.inputs):
            r = results[k] if len(results) == len(op.inputs) else None
            out.append(self.known.get(r) if r in self.known else self.of_value(n))
        return tuple(out)

    def of_value(self, name: str) -> str | None:
        """The tensor ``name`` is made from alone, or None."""
        for _ in range(64):       # chains are short; the bound keeps a cycle-free walk cheap
            if name in self.known:
                return self.known[name]
            if name in self.inputs:
                return name
            if name in self.waited:
                name = self.waited[name]
                continue
            op = self.prod.get(name)
            if op is None:
                return None
            # scalars next to a tensor (a learning rate, a constant) do not change whose it is
            ins = set(op.inputs)
            big = {n for n in ins if self.types[n].numel > 1}
            ins = big or ins
            if len(ins) != 1:
                return None
            name = ins.pop()
        return None


def _serves(op: Op, grads: dict[str, str], loss: set[str], metrics: set[str],
            params: Collection[str] = ()) -> str:
    if len(op.results) > 1:
        parts = [_serves(op.replace(inputs=(i,), results=(v,)), grads, loss, metrics, params)
                 for i, v in zip(op.inputs, op.results)]
        kinds = sorted({p.split(" of ")[0] for p in parts if p})
        return f"bucket of {len(parts)}: " + ", ".join(kinds)
    out = op.results[0].name if op.results else ""
    if out in grads:
        if op.name == "broadcast":
            return f"device 0's value of {grads[out]}"
        return (f"new value of {grads[out]}" if op.name == "all_gather"
                else f"gradient of {grads[out]}")
    if out in loss:
        return "loss"
    if out in metrics:
        return "metric"
    if op.name == "all_reduce" and op.attrs.get("op") == "sum" and op.results[0].type.numel == 1:
        return "scalar sum (a gradient norm, a count of the batch)"
    if op.name == "take_shard":
        return "local piece, no communication"
    if op.name == "all_gather" and op.inputs and op.inputs[0] in params:
        return f"whole value of {op.inputs[0]} (held as pieces)"
    # what else moves: activations and their gradients (tensor parallelism)
    return {Phase.forward: "activation", Phase.backward: "activation gradient"}.get(
        op.phase, "")


def _memory(graph: Graph, sizes: dict[str, int], grads: dict[str, str],
            types: dict[str, TensorType], in_place: Collection[str] = (),
            scratch: Mapping[int, int] | None = None,
            by_stage: Mapping[int, int] | None = None, cuts: list | None = None,
            written: Collection[str] = ()) -> Memory:
    per = {k: 0 for k in ("param", "opt_state")}
    whole = dict(per)
    for i in graph.inputs:
        k = i.role.kind.value
        if k in per:
            per[k] += i.value.type.local_nbytes(sizes)
            whole[k] += i.value.type.nbytes
    g_local = sum(types[n].local_nbytes(sizes) for n in grads)
    g_whole = sum(types[n].nbytes for n in grads)
    if not grads and differentiates(graph):
        # an untransformed step: a gradient per trainable parameter
        g_local = g_whole = per["param"]
    act_local, act_whole = saved_activations(graph, sizes, types)
    opts = pipeline_of(graph)
    if opts is not None:     # a staged graph is traced at the microbatch: M of them
        act_whole *= opts.microbatches
    if cuts is not None:
        # a pipeline: a device holds only its stages' share, and its schedule's
        # microbatches in flight
        per["param"], per["opt_state"], g_local = _held_per_rank(graph, opts, sizes, grads,
                                                                 types)
        in_flight = _activations_in_flight(opts, sizes[opts.axis], by_stage or {})
        if in_flight is not None:
            act_local = in_flight
    peak = peak_memory(graph, in_place, scratch, written)
    peak_bytes, at, rank_peaks = peak.bytes, "", ()
    if peak.index >= 0:
        op = graph.ops[peak.index]
        name = op.attrs.get("target", op.name) if op.name == "opaque" else op.name
        at = f"#{peak.index} {name}" + (f" ({op.phase.value})" if op.phase else "")
    if cuts is not None:
        by_rank = pipeline_peak(graph, opts, in_place, cuts, written)
        if by_rank is not None:
            top = max(by_rank, key=lambda p: p.bytes)
            peak_bytes, at = top.bytes, top.at
            rank_peaks = tuple(p.bytes for p in by_rank)
    return Memory(per["param"], g_local, per["opt_state"], whole["param"], g_whole,
                  whole["opt_state"], act_local, act_whole, peak_bytes, at, rank_peaks)


def _held_per_rank(graph: Graph, opts: Any, sizes: dict[str, int], grads: dict[str, str],
                   types: dict[str, TensorType]) -> tuple[int, int, int]:
    """For a graph cut into pipeline stages (``opts`` its pipeline pass): the parameter,
    optimizer-state and gradient bytes of the device that holds the most of them, each
    rank holding what its stages' ops read (parameters, state: a tied parameter on both its
    stages) or make (gradients)."""
    rank_of = {s: r for r, stages in enumerate(rank_stages(graph)) for s in stages}
    ranks = sizes[opts.axis]
    kinds = {i.name: i.role.kind for i in graph.inputs}
    read: list[set[str]] = [set() for _ in range(ranks)]
    made: list[set[str]] = [set() for _ in range(ranks)]
    for op in graph.ops:
        if op.stage is None:
            continue
        r = rank_of[op.stage]
        read[r].update(n for n in free_inputs(op) if n in kinds)
        made[r].update(v.name for v in op.results if v.name in grads)
    best = (0, 0, 0)
    for r in range(ranks):
        param = sum(types[n].local_nbytes(sizes) for n in read[r]
                    if kinds[n] is InputKind.param)
        state = sum(types[n].local_nbytes(sizes) for n in read[r]
                    if kinds[n] is InputKind.opt_state)
        grad = sum(types[n].local_nbytes(sizes) for n in made[r])
        best = max(best, (param, state, grad), key=sum)
    return best


def _with_stage_activations(decisions: dict[str, Decision], by_stage: Mapping[int, int]
                            ) -> dict[str, Decision]:
    """The pipeline pass's record with each stage's activation bytes per microbatch (what
    its backward reads of its forward), which the plan measures on the final graph."""
    for name, d in decisions.items():
        if isinstance(d, PipelineRecord) and by_stage:
            stages = tuple(replace(st, activation_bytes=by_stage.get(st.index, 0))
                           for st in d.stages)
            decisions[name] = replace(d, stages=stages)
    return decisions


def _activations_in_flight(opts: Any, ranks: int, by_stage: Mapping[int, int]) -> int | None:
    """The most activation bytes one rank keeps at once under the pipeline pass ``opts``
    over ``ranks`` ranks, walking its schedule's written-out order
    (``passes/pipeline_orders.py``; a forward of microbatch m on stage s keeps s's saved
    activations of one microbatch, ``by_stage[s]``, until that backward frees them; under
    a split backward, until its weight-gradient run W: an upper bound, since what only the
    input-gradient run reads could go after it). None when the order cannot be written
    out (microbatches the schedule refuses)."""
    if not by_stage:
        return None
    try:
        orders = rank_orders(opts.schedule, ranks, opts.microbatches, 1 + max(by_stage))
    except ValueError:
        return None
    change = {"F": 1, "B": -1, "I": 0, "W": -1}
    most = 0
    for order in orders:
        live = 0
        for kind, _, stage in order:
            live += by_stage.get(stage, 0) * change[kind]
            most = max(most, live)
    return most


def _saved_values(graph: Graph) -> dict[str, Op]:
    """Forward-phase values that backward-phase ops read (the activations kept between the
    two), each view at its base, by the forward op that makes them; parameters and other
    graph inputs are not activations."""
    base = view_bases(graph)
    made = producers(graph)
    saved: dict[str, Op] = {}
    for op in graph.ops:
        if op.phase is not Phase.backward:
            continue
        for n in free_inputs(op):
            b = base.get(n, n)
            src = made.get(b)
            if src is not None and src.phase is Phase.forward:
                saved[b] = src
    return saved


def _saved_by_stage(graph: Graph, sizes: dict[str, int],
                    types: dict[str, TensorType]) -> dict[int, int]:
    """Stage -> bytes per device of its forward values its backward reads (one
    microbatch's: a staged graph is traced at the microbatch); empty without stages."""
    out: dict[int, int] = {}
    for b, src in _saved_values(graph).items():
        if src.stage is not None:
            out[src.stage] = out.get(src.stage, 0) + types[b].local_nbytes(sizes)
    return out


def saved_activations(graph: Graph, sizes: dict[str, int],
                      types: dict[str, TensorType]) -> tuple[int, int]:
    """Bytes of forward-phase values that backward-phase ops read (the activations kept
    between the two), per device and on one device running the whole batch. A view counts
    at its base, once; parameters and other graph inputs are not activations. An estimate:
    it follows program order and knows nothing of recomputation or a backend's fusion."""
    local = whole = 0
    for b in _saved_values(graph):
        t = types[b]
        local += t.local_nbytes(sizes)
        n = t.nbytes
        for a, p in t.placements:
            if isinstance(p, Varying):
                n *= sizes.get(a, 1)
        whole += n
    return local, whole
