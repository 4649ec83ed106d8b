"""Analyses over a graph: producers and users, dependency order, liveness and peak memory,
flops and bytes. Each is a pure function of the graph; passes call what they need."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import networkx as nx

from .core import Graph, Op, Phase, walk_ops
from .ops import Category, is_view, op_def
from .types import TensorType


def producers(graph: Graph) -> dict[str, Op]:
    """Value name -> the op that defines it (nested regions included)."""
    return {v.name: op for op in graph.walk() for v in op.results}


def users(graph: Graph) -> dict[str, list[Op]]:
    """Value name -> ops that read it, in program order (graph outputs are not ops).

    An op whose region reads an outer value counts as a user of that value too."""
    out: dict[str, list[Op]] = defaultdict(list)

    def visit(ops, enclosing: list[Op]) -> None:
        for op in ops:
            for n in op.inputs:
                out[n].append(op)
                for e in enclosing:
                    out[n].append(e)
            for r in op.regions:
                visit(r.ops, enclosing + [op])
                for y in r.yields:
                    out[y].append(op)
                    for e in enclosing:
                        out[y].append(e)
    visit(graph.ops, [])
    return {k: _dedupe(v) for k, v in out.items()}


def _dedupe(ops: list[Op]) -> list[Op]:
    seen, res = set(), []
    for op in ops:
        if id(op) not in seen:
            seen.add(id(op))
            res.append(op)
    return res


def differentiates(graph: Graph) -> bool:
    """The step computes gradients: it has a backward op, nested ones included."""
    return any(op.phase is Phase.backward for op in graph.walk())


def free_inputs(op: Op) -> list[str]:
    """Values an op reads, including those its regions capture from outside."""
    defined: set[str] = set()
    reads: list[str] = list(op.inputs)
    for r in op.regions:
        defined.update(a.name for a in r.args)
        for inner in walk_ops(r.ops):
            defined.update(v.name for v in inner.results)
            for rr in inner.regions:
                defined.update(a.name for a in rr.args)
        for inner in walk_ops(r.ops):
            reads.extend(inner.inputs)
            for rr in inner.regions:
                reads.extend(rr.yields)
        reads.extend(r.yields)
    return list(dict.fromkeys(n for n in reads if n not in defined))


def dependency_graph(graph: Graph) -> nx.DiGraph:
    """Top-level ops as nodes (their index), an edge from producer to consumer."""
    dg = nx.DiGraph()
    # Producers are found wherever they stand, so that a graph whose ops are out of
    # dependency order (as a pass may build it) gets the edges topo_order needs.
    made = {v.name: k for k, op in enumerate(graph.ops) for v in op.results}
    for k, op in enumerate(graph.ops):
        dg.add_node(k, op=op)
    for k, op in enumerate(graph.ops):
        for n in free_inputs(op):
            if n in made and made[n] != k:
                dg.add_edge(made[n], k, value=n)
    return dg


def topo_order(graph: Graph) -> list[Op]:
    """Top-level ops in a dependency order; among ready ops, program order wins.

    Effectful ops keep their relative order."""
    dg = dependency_graph(graph)
    from .ops import is_effectful
    last = None
    for k, op in enumerate(graph.ops):
        if is_effectful(op):
            if last is not None:
                dg.add_edge(last, k)
            last = k
    return [graph.ops[k] for k in nx.lexicographical_topological_sort(dg)]


@dataclass(frozen=True)
class Liveness:
    """When each top-level value is born and last used (op indices; -1 = graph input)."""

    born: dict[str, int]
    last_use: dict[str, int]
    bytes_at: tuple[int, ...]   # bytes live while each op runs (per device)
    peak_bytes: int
    peak_index: int


def liveness(graph: Graph, per_device: bool = True) -> Liveness:
    """Live ranges of top-level values and the peak of live bytes.

    Inputs are live from the start; outputs to the end. A value made and never used lives
    for the op that made it. With ``per_device`` bytes are what one device holds under the
    values' placements, otherwise the logical size."""
    sizes = dict(graph.mesh.axes)
    types: dict[str, TensorType] = {i.name: i.value.type for i in graph.inputs}
    born = {i.name: -1 for i in graph.inputs}
    last: dict[str, int] = {i.name: -1 for i in graph.inputs}
    for k, op in enumerate(graph.ops):
        for n in free_inputs(op):
            last[n] = k
        for v in op.results:
            types[v.name] = v.type
            born[v.name] = k
            last.setdefault(v.name, k)
    end = len(graph.ops)
    for o in graph.outputs:
        last[o.name] = end

    def nbytes(t: TensorType) -> int:
        return t.local_nbytes(sizes) if per_device else t.nbytes

    n = len(graph.ops)
    delta = [0] * (n + 2)
    for name, b in born.items():
        size = nbytes(types[name])
        start = max(b, 0)
        stop = min(max(last.get(name, b), start), n)
        delta[start] += size
        delta[stop + 1] -= size
    running, bytes_at = 0, []
    for k in range(max(n, 1)):
        running += delta[k]
        bytes_at.append(running)
    peak = max(bytes_at)
    return Liveness(born, last, tuple(bytes_at), peak, bytes_at.index(peak))


@dataclass(frozen=True)
class OpCost:
    """Logical flops, bytes touched, and bytes each device sends; ``unknown`` names the
    framework ops (targets) whose flops no rule gives: counted as zero, and said so."""

    flops: int = 0
    bytes: int = 0
    comm_bytes: int = 0
    unknown: tuple[str, ...] = ()

    def __add__(self, other: OpCost) -> OpCost:
        return OpCost(self.flops + other.flops, self.bytes + other.bytes,
                      self.comm_bytes + other.comm_bytes, self.unknown + other.unknown)


def op_cost(op: Op, types: dict[str, TensorType], axis_sizes: dict[str, int]) -> OpCost:
    """Cost of one op (its regions' ops included, each counted once)."""
    d = op_def(op.name)
    ins = [types[n] for n in op.inputs]
    outs = [v.type for v in op.results]
    axis = op.attrs.get("axis")
    flops = d.flops(op, ins, outs)
    unknown = () if flops is not None else (str(op.attrs.get("target", op.name)),)
    cost = OpCost(flops or 0, d.bytes_accessed(op, ins, outs),
                  d.comm_bytes(op, ins, outs, axis_sizes.get(axis, 1) if axis else 1,
                               axis_sizes), unknown)
    for r in op.regions:
        for inner in r.ops:
            cost = cost + op_cost(inner, types, axis_sizes)
    return cost


def graph_cost(graph: Graph) -> tuple[OpCost, list[OpCost]]:
    """Total cost and the cost of each top-level op."""
    types = graph.value_types()
    sizes = dict(graph.mesh.axes)
    per = [op_cost(op, types, sizes) for op in graph.ops]
    total = OpCost()
    for c in per:
        total = total + c
    return total, per


def runs_on_one_device(graph: Graph) -> bool:
    """True when a planned graph is the single-device program: its mesh has one device and
    it has no collective (a runner then needs no process group, no shard_map)."""
    return graph.mesh.size == 1 and not any(
        op_def(op.name).category is Category.collective for op in graph.walk())


@dataclass(frozen=True)
class Peak:
    """The most bytes one device holds while a step runs: the graph's inputs (held by the
    caller throughout) plus the values live at the busiest op, views counted at their base."""

    bytes: int
    index: int          # the top-level op at the peak (-1: the inputs alone)
    inputs_bytes: int   # what the inputs hold (the memory at rest, before the step)


def _finished_at(graph: Graph) -> dict[int, int]:
    """Top-level op index of each async collective -> the index of the wait finishing it."""
    made: dict[str, int] = {}
    out: dict[int, int] = {}
    for k, op in enumerate(graph.ops):
        if op.name == "wait":
            for i in op.inputs:
                if i in made:
                    out.setdefault(made[i], k)
        elif op.attrs.get("async", False):
            for v in op.results:
                made[v.name] = k
    return out


def view_bases(graph: Graph) -> dict[str, str]:
    """Each top-level value that is a view (``is_view``) -> the value owning its storage. A
    ``wait``'s results are its inputs, handed on (result i is input i)."""
    base: dict[str, str] = {}
    for op in graph.ops:
        if op.name == "wait":
            for i, v in zip(op.inputs, op.results):
                base[v.name] = base.get(i, i)
        elif is_view(op) and op.inputs:
            for v in op.results:
                base[v.name] = base.get(op.inputs[0], op.inputs[0])
    return base


def peak_memory(graph: Graph, in_place: Collection[str] = (),
                scratch: Mapping[int, int] | None = None,
                written: Collection[str] = ()) -> Peak:
    """Liveness over the program as it runs, per device: each value that owns storage lives
    from the op that makes it to its last use (through any view of it), or to the end when
    the step returns it; inputs live throughout; views own nothing. Values in ``in_place``
    are copied into the input they replace where they are made (the backend's in-place
    updates): they are not held to the end; those also in ``written`` are made in the
    input's storage by their own kernel and own nothing. ``scratch``: top-level op index ->
    bytes the backend holds besides the op's results while it runs (a collective's packed
    send buffer), from the op to the ``wait`` that finishes it (the op alone when it is
    synchronous)."""
    sizes = dict(graph.mesh.axes)
    inputs = sum(i.value.type.local_nbytes(sizes) for i in graph.inputs)
    input_names = {i.name for i in graph.inputs}
    base = view_bases(graph)
    born: dict[str, int] = {}
    size: dict[str, int] = {}
    last: dict[str, int] = {}
    for k, op in enumerate(graph.ops):
        for n in free_inputs(op):
            last[base.get(n, n)] = k
        for v in op.results:
            if v.name not in base and v.name not in written:
                born[v.name] = k
                size[v.name] = v.type.local_nbytes(sizes)
                last.setdefault(v.name, k)
    end = len(graph.ops)
    for o in graph.outputs:
        if o.name not in in_place:
            last[base.get(o.name, o.name)] = end
    delta = [0] * (end + 2)
    for name, k in born.items():
        if name in input_names:
            continue
        delta[k] += size[name]
        delta[min(max(last.get(name, k), k), end - 1) + 1] -= size[name]
    if scratch:
        finished = _finished_at(graph)
        for k, nbytes in scratch.items():
            delta[k] += nbytes
            delta[min(finished.get(k, k), end - 1) + 1] -= nbytes
    running, best, at = 0, 0, -1
    for k in range(end):
        running += delta[k]
        if running > best:
            best, at = running, k
    return Peak(inputs + best, at, inputs)
