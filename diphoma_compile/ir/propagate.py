"""Sharding propagation over a whole step, one mesh axis at a time.

Given placements fixed for some values (a pass's or the user's choice: Megatron's column and
row splits of the weights, say), ``complete`` picks a strategy for every op and a placement
for every value so that the step stays correct and the communication plus compute, priced by
a device model, is small; ``apply_assignment`` writes the result into the graph with the
resharding collectives inserted. ``op_candidates`` lists each op's strategies with their
costs, for a solver.

The choice is an integer program (``strategy_solver.py``, as AutoParallel and Alpa's
intra-op pass do it): exact under the device model, forward and backward alike (a fixed
placement constrains producers and consumers). Inputs no one fixed stay replicated;
optimizer state follows its parameter; an output that replaces an input gets that input's
placement back."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..errors import IRError
from .core import Attrs, Graph, Input, Op, Output, Value
from .device_model import DeviceModel, device_model
from .opdef import Category, is_local, op_def
from .roles import InputKind, OutputKind
from .strategies import (Strategy, candidates, fits_axis, group_counts, linear_collective,
                         replicated, reshard)
from .strategy_solver import solve
from .types import REPLICATE, Partial, Placement, Shard, TensorType

# taking a local slice moves no data, but is not free of choice: a split nobody needed
# would only make gathers later, so it costs a little
_SLICE_S = 1e-9


@dataclass(frozen=True)
class Reshard:
    """A collective inserted before an op (or before the graph's outputs: op index -1)."""

    op_index: int
    value: str
    src: Placement
    dst: Placement
    collective: str
    seconds: float


@dataclass(frozen=True)
class Assignment:
    """A placement for every top-level value and a strategy for every op, on one axis."""

    axis: str
    size: int
    placements: Mapping[str, Placement]
    strategies: Mapping[int, Strategy]
    reshards: tuple[Reshard, ...]
    output_placements: Mapping[str, Placement]    # what each output must be given back as
    comm_s: float
    compute_s: float

    def collectives(self, phase=None, graph: Graph | None = None) -> list[Reshard]:
        """The inserted collectives that move data (taking a slice moves none), optionally
        only those before ops of one phase."""
        out = [r for r in self.reshards if not is_local(r.collective)]
        if phase is not None and graph is not None:
            out = [r for r in out if r.op_index >= 0 and graph.ops[r.op_index].phase == phase]
        return out


def reshard_seconds(src: Placement, dst: Placement, t: TensorType, n: int, axis: str,
                    model: DeviceModel) -> float:
    """Seconds to bring a value from ``src`` to ``dst`` (inf when no collective does)."""
    how = reshard(src, dst)
    if how is None:
        return math.inf
    if how.collective is None:
        return 0.0
    if how.free:
        return _SLICE_S
    frac = (n - 1) / n
    sent = {"all_reduce": 2 * frac * t.nbytes, "reduce_scatter": frac * t.nbytes,
            "all_gather": frac * t.nbytes, "all_to_all": frac * t.nbytes / n}[how.collective]
    return model.collective_s(how.collective, sent, n, axis)


def _menu(op: Op, ins: Sequence[TensorType], outs: Sequence[TensorType], axis: str,
          n: int, groups: Iterable[int] = ()) -> list[Strategy]:
    cat = op_def(op.name).category
    if cat in (Category.collective, Category.sync):
        if op.attrs.get("axis") == axis:
            raise IRError(f"{op.name} already communicates over {axis!r}",
                          hint="propagate placements on an axis before inserting its "
                               "collectives")
        # a collective on another axis hands each value's placement on this one through
        if len(ins) != len(outs) or any(a.shape != b.shape for a, b in zip(ins, outs)):
            return [replicated(ins, outs)]
        menu = [replicated(ins, outs)]
        rank = min((t.rank for t in ins), default=0)
        menu += [Strategy(tuple(Shard(d) for _ in ins), tuple(Shard(d) for _ in outs))
                 for d in range(rank)]
        if linear_collective(op):
            menu.append(Strategy(tuple(Partial("sum") for _ in ins),
                                 tuple(Partial("sum") for _ in outs)))
        return [s for s in menu if fits_axis(s, ins, outs, n)]
    menu = candidates(op, ins, outs, n, groups=groups)
    if not ins:     # a constant is built where it is needed; as a partial sum it only costs
        menu = [s for s in menu if not any(isinstance(p, Partial) for p in s.outputs)]
    return menu or [replicated(ins, outs)]


def _compute_s(op: Op, s: Strategy, ins, outs, n: int, model: DeviceModel) -> float:
    d = op_def(op.name)
    flops = d.flops(op, ins, outs) or 0
    nbytes = d.bytes_accessed(op, ins, outs)
    split = any(isinstance(p, Shard) for p in s.inputs + s.outputs)   # partial: whole work
    return model.compute_s(flops, nbytes) / (n if split else 1)


def _signatures(graph: Graph) -> list[tuple[list[TensorType], list[TensorType]]]:
    """Each top-level op's operand and result types."""
    types = graph.value_types()
    return [([types[x] for x in op.inputs], [v.type for v in op.results]) for op in graph.ops]


def _state_like_param(graph: Graph) -> list[tuple[str, str]]:
    """(optimizer state, its parameter) for state shaped like its parameter: the state that
    follows the parameter's placement."""
    shapes = {i.name: i.value.type.shape for i in graph.inputs}
    return [(i.name, i.role.of) for i in graph.inputs
            if i.role.kind is InputKind.opt_state and i.role.of in shapes
            and i.value.type.shape == shapes[i.role.of]]


def _fixed_inputs(graph: Graph, fixed: Mapping[str, Placement]) -> dict[str, Placement]:
    """The fixed placements, with optimizer state following its parameter (same shape)."""
    out = dict(fixed)
    for state, param in _state_like_param(graph):
        if state not in out and param in fixed:
            out[state] = fixed[param]
    return out


def complete(graph: Graph, axis: str, fixed: Mapping[str, Placement],
             model: DeviceModel | str = "h100-nccl", time_limit_s: float = 60.0,
             free: Iterable[str] = (),
             avoid: Callable[[str, str], bool] | None = None,
             groups: Iterable[int] = ()) -> Assignment:
    """Complete the placements ``fixed`` for some values into the cheapest assignment of the
    whole step on ``axis`` (an axis of the graph's mesh), solved exactly as an integer
    program (HiGHS through scipy) under the device model's costs. Inputs named in ``free``
    (parameters, say) are placed by the solver too, replicated or split on a dimension the
    axis divides; their updated values and their optimizer state are placed alike. Ops
    are offered splits in groups (``S(d,k)``) for each k of ``groups`` and of the fixed
    placements."""
    model = device_model(model) if isinstance(model, str) else model
    n = graph.mesh.axis_size(axis)
    fixed = _fixed_inputs(graph, fixed)
    types = graph.value_types()
    made = {v.name for op in graph.ops for v in op.results} | {i.name for i in graph.inputs}
    unknown = sorted(set(fixed) - made)
    if unknown:
        raise IRError(f"placements fixed for values the graph does not have: "
                      f"{', '.join(unknown[:5])}", hint="name top-level values or inputs")

    def rc(src, dst, name) -> float:
        how = reshard(src, dst)
        if how is not None and avoid is not None and how.collective is not None \
                and avoid(how.collective, name):
            return math.inf
        return reshard_seconds(src, dst, types[name], n, axis, model)

    sigs = _signatures(graph)
    groups = set(groups) | group_counts(fixed.values())
    menus = [_menu(op, ins, outs, axis, n, groups) for op, (ins, outs) in zip(graph.ops, sigs)]
    free_in, ties = _free_inputs(graph, set(free) - set(fixed), n, set(fixed), groups)
    demands = {o.name: _output_demand(graph, o, fixed) for o in graph.outputs}
    for o in graph.outputs:
        if o.role.kind is OutputKind.replaces and o.role.target in free_in:
            demands[o.name] = None
            ties.append((o.name, o.role.target))
    chosen, chose_in = solve(
        graph, menus, fixed, demands, rc,
        lambda k, s: _compute_s(graph.ops[k], s, *sigs[k], n, model),
        time_limit_s, free_in, ties)
    fixed = {**fixed, **chose_in}
    for o in graph.outputs:
        if o.role.kind is OutputKind.replaces and o.role.target in chose_in:
            demands[o.name] = chose_in[o.role.target]
    placements: dict[str, Placement] = {i.name: fixed.get(i.name, REPLICATE)
                                        for i in graph.inputs}
    for k, op in enumerate(graph.ops):
        placements.update((v.name, p) for v, p in zip(op.results, chosen[k].outputs))

    # the collectives this implies: one per value and placement it must take, placed
    # before its first user
    steps: dict[tuple[str, Placement], Reshard] = {}
    compute = 0.0
    for k, op in enumerate(graph.ops):
        s = chosen[k]
        compute += _compute_s(op, s, *sigs[k], n, model)
        for x, want in zip(op.inputs, s.inputs):
            if placements[x] != want and (x, want) not in steps:
                steps[x, want] = _step(k, x, placements[x], want, rc)
    for o in graph.outputs:
        want = demands[o.name]
        if want is None and isinstance(placements[o.name], Partial):
            want = demands[o.name] = REPLICATE     # a returned value is never a partial sum
        if want is not None and placements[o.name] != want and (o.name, want) not in steps:
            steps[o.name, want] = _step(-1, o.name, placements[o.name], want, rc)
    steps = list(steps.values())
    wanted = {o.name: d for o, d in ((o, demands[o.name]) for o in graph.outputs)
              if d is not None and placements[o.name] != d}
    return Assignment(axis, n, placements, chosen, tuple(steps), wanted,
                      sum(r.seconds for r in steps), compute)


def _free_inputs(graph: Graph, free: set[str], n: int, fixed: set[str],
                 groups: Iterable[int] = ()
                 ) -> tuple[dict[str, list[Placement]], list[tuple[str, str]]]:
    """Candidate placements of the free inputs (whole, split on a dim the axis divides, or
    split in groups of ``groups``), with optimizer state of the same shape as a free
    parameter free too and tied to it."""
    names = {i.name for i in graph.inputs}
    missing = sorted(free - names)
    if missing:
        raise IRError(f"free placements asked for values that are not graph inputs: "
                      f"{', '.join(missing[:5])}")
    ties: list[tuple[str, str]] = []
    for state, param in _state_like_param(graph):
        if param in free and state not in free and state not in fixed:
            free.add(state)
            ties.append((state, param))
    options = {}
    for name in (i.name for i in graph.inputs if i.name in free):   # graph order: the
        t = graph.input(name).value.type                           # program's is fixed
        options[name] = [REPLICATE] + [Shard(d, k) for k in (1, *sorted(set(groups) - {1}))
                                       for d in range(t.rank) if t.shape[d] % (n * k) == 0
                                       and t.shape[d] >= n * k]
    return options, ties


def _output_demand(graph: Graph, o: Output, fixed: Mapping[str, Placement]):
    if o.name in fixed:
        return fixed[o.name]
    if o.role.kind is OutputKind.replaces:
        return fixed.get(o.role.target, REPLICATE)
    return None


def _step(k: int, x: str, src: Placement, dst: Placement, rc) -> Reshard:
    how = reshard(src, dst)
    if how is None:
        raise IRError(f"%{x} is {src} but must become {dst}, which no collective does",
                      hint="fix a placement that its producers can give")
    return Reshard(k, x, src, dst, how.collective, rc(src, dst, x))


def op_candidates(graph: Graph, axis: str, model: DeviceModel | str = "h100-nccl"
                  ) -> list[list[tuple[Strategy, float]]]:
    """For each top-level op, its strategies that fit the axis with their compute seconds
    (communication depends on the neighbours' choices: ``reshard_seconds`` prices it)."""
    model = device_model(model) if isinstance(model, str) else model
    n = graph.mesh.axis_size(axis)
    return [[(s, _compute_s(op, s, ins, outs, n, model)) for s in _menu(op, ins, outs, axis, n)]
            for op, (ins, outs) in zip(graph.ops, _signatures(graph))]


def apply_assignment(graph: Graph, a: Assignment) -> Graph:
    """The graph with the assignment's placements in its types and its collectives
    inserted (each before the op that needs it)."""
    names = graph.fresh_names()
    placed = a.placements

    def typed(name: str, t: TensorType) -> TensorType:
        return t.with_placement(a.axis, placed[name])

    inputs = tuple(Input(Value(i.name, typed(i.name, i.value.type)), i.role)
                   for i in graph.inputs)
    types = {i.name: i.value.type for i in inputs}
    ops: list[Op] = []
    before: dict[int, list[Reshard]] = defaultdict(list)
    for r in a.reshards:
        before[r.op_index].append(r)
    moved: dict[tuple[str, Placement], str] = {}     # (value, placement) -> its new name
    for k, op in enumerate(graph.ops):
        for r in before.get(k, ()):
            new = _collective(r, types, names, a.axis, op)
            ops += new
            types.update((o.result.name, o.result.type) for o in new)
            moved[r.value, r.dst] = new[-1].result.name
        s = a.strategies[k]
        inputs_k = tuple(moved[x, want] if placed[x] != want else x
                         for x, want in zip(op.inputs, s.inputs))
        results = tuple(Value(v.name, typed(v.name, v.type)) for v in op.results)
        for v in results:
            types[v.name] = v.type
        ops.append(op.replace(inputs=inputs_k, results=results))
    for r in before.get(-1, ()):
        new = _collective(r, types, names, a.axis, None)
        ops += new
        moved[r.value, r.dst] = new[-1].result.name
    outputs = [Output(moved.get((o.name, a.output_placements.get(o.name)), o.name), o.role)
               for o in graph.outputs]
    return graph.replace(inputs=inputs, ops=tuple(ops), outputs=tuple(outputs))


def _collective(r: Reshard, types, names, axis: str, user: Op | None) -> list[Op]:
    """The ops that carry out a reshard: one collective, or for a grouped split (``S(d,k)``)
    the collective on the view with the k groups as a dimension of their own, between two
    reshapes (``[.., k*m, ..] -> [.., k, m, ..]`` splits its second dim plainly)."""
    how = reshard(r.src, r.dst)
    attrs = dict(how.attrs)
    where = {"phase": user.phase if user is not None else None,
             "loc": user.loc if user is not None else None}
    k = attrs.pop("groups", 1)
    if k == 1:
        out = Value(names(f"{r.value}.{how.collective}"), types[r.value].with_placement(
            axis, r.dst))
        return [Op(how.collective, (r.value,), (out,), Attrs({"axis": axis, **attrs}),
                   **where)]
    t, d = types[r.value], attrs["dim"]
    if any(a != axis and not isinstance(p, Partial) and p != REPLICATE
           for a, p in t.placements):
        raise IRError(f"%{r.value} is split on another axis too; a grouped split ({r.dst} or "
                      f"{r.src}) can only move on its own", hint="place the other axis after")
    view = t.shape[:d] + (k, t.shape[d] // k) + t.shape[d + 1:]

    def plain(p: Placement) -> Placement:
        return Shard(d + 1) if isinstance(p, Shard) else p
    # other axes' placements (partial sums only: splits were refused above) carry through
    v_in = Value(names(f"{r.value}.groups"), t.with_shape(view).with_placement(
        axis, plain(r.src)))
    v_col = Value(names(f"{r.value}.{how.collective}"), v_in.type.with_placement(
        axis, plain(r.dst)))
    out = Value(names(f"{r.value}.ungroups"), t.with_placement(axis, r.dst))
    return [Op("reshape", (r.value,), (v_in,), Attrs({}), **where),
            Op(how.collective, (v_in.name,), (v_col,),
               Attrs({"axis": axis, **attrs, "dim": d + 1}), **where),
            Op("reshape", (v_col.name,), (out,), Attrs({}), **where)]
