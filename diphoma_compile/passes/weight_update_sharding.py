"""Cross-replica weight-update sharding (Xu et al. 2020, arXiv 2004.13336).

Under data parallelism every device repeats the whole optimizer update after an all-reduce
of the gradients. This pass finds the update by static analysis (the ``update``-phase ops
between the averaged gradients, the optimizer state, the parameters and the new values) and
shards it: each gradient's all-reduce becomes a reduce-scatter, each device updates its
1/N piece of every tensor (the optimizer state is stored only as that piece), and an
all-gather returns the new parameters. The communication volume is that of the all-reduce.

Placements flow through the update by the op table's sharding rules. An op the rules cannot
run on pieces is first expanded into simpler ops when the table knows how (a norm becomes a
sum of squares, whose partial sums take one scalar all-reduce); otherwise its inputs are
gathered and it runs replicated, and the plan says which op and why.

``gather=next-forward`` keeps the new pieces as the parameters between steps and gathers
each where the next step first reads it (``shard_params.ShardParams`` with
``backward=keep``), so the gather overlaps the next forward instead of ending this step.

``layout=flat`` shards every tensor as its flattened, zero-padded form (the torch backend);
``layout=dims`` splits the first dimension that divides the axis and leaves tensors with
none replicated; ``layout=dims-or-flat`` splits such a dimension where there is one and
shards the rest flat (the JAX backend: its shardings need even splits, and it stores flat
pieces as a padded 1-D array).

Optimizer state of another shape than its parameter (Adafactor's factored row and column
moments: the parameter's shape less one dimension) follows the parameter's split dimension
when the state keeps it, and stays whole otherwise; the plan says why."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..ir.core import Attrs, Graph, Input, InputKind, Op, OutputKind, Phase, Value
from ..ir.ops import op_def
from ..ir.sharding_rules import propagate, sums_dirty_padding
from ..ir.types import (FLAT, FLAT_DIRTY, REPLICATE, Partial, Placement, Replicate,
                        Shard, TensorType, Varying, dim_attr, fits)
from .base import Pass, PassContext, PassFailure, register_pass
from .data_parallel import require_axis

_LAYOUTS = ("flat", "dims", "dims-or-flat")
_GATHERS = ("end", "next-forward")


def shard_placement(t: TensorType, n: int, layout: str) -> tuple[Placement, str]:
    """Where a tensor's update runs: its placement and, when replicated, why. A dimension
    another axis splits already (tensor parallelism) is not split again: which axis would
    be the major one is a layout the backends need not guess."""
    if t.numel <= 1:
        return REPLICATE, "a scalar: cheaper to repeat than to split"
    if layout == "flat":
        return FLAT, ""
    split = {p.dim for _, p in t.placements if isinstance(p, Shard)}
    for d, size in enumerate(t.shape):
        if d not in split and size % n == 0:
            return Shard(d), ""
    if layout == "dims-or-flat" and not t.placements:
        return FLAT, ""
    what = f"no dimension of {list(t.shape)} divides {n}"
    if split:       # the dims that do are another axis's already (tensor parallelism)
        axes = ", ".join(a for a, p in t.placements if isinstance(p, Shard))
        what = (f"no dimension of {list(t.shape)} that {axes} leaves whole divides {n} "
                f"(dimension {', '.join(str(d) for d in sorted(split))} is split over {axes})")
    if layout == "dims-or-flat":
        return REPLICATE, (f"{what}, and a flat piece of a tensor split over another axis is "
                           "not laid out")
    return REPLICATE, f"{what} and layout=dims needs even splits"


def _in_result(p: Placement, t: TensorType, res: TensorType) -> Placement | None:
    """Placement ``p`` of an operand of type ``t`` carried to the op's result ``res``,
    their dims aligned from the last; None where it does not line up (a flat piece of
    another shape, a split dim the result lacks or has of another size)."""
    if t.shape == res.shape:
        return p
    if not isinstance(p, Shard):
        return None
    d = p.dim + res.rank - t.rank
    return Shard(d, p.groups) if 0 <= d < res.rank and res.shape[d] == t.shape[p.dim] \
        else None


def linked_placement(t: TensorType, param: TensorType, n: int,
                     layout: str) -> tuple[Placement, str]:
    """Where optimizer state of another shape than its parameter is stored: a factored
    moment (the parameter's shape less one dimension, as optax's Adafactor row and column
    statistics, or with that dimension of size 1, as torch's) split along the parameter's
    split dimension when it keeps it; else whole, and why."""
    if t.numel <= 1:
        return REPLICATE, "a scalar: cheaper to repeat than to split"
    pp, why = shard_placement(param, n, layout)
    lost = [a for a in range(param.rank)
            if param.shape[:a] + param.shape[a + 1:] == t.shape]
    # torch.optim.Adafactor keeps the reduced dimension, as size 1 ([rows, 1], [1, cols])
    kept = [a for a in range(param.rank) if t.rank == param.rank and param.shape[a] > 1
            and t.shape == param.shape[:a] + (1,) + param.shape[a + 1:]]
    if not lost and not kept:
        return REPLICATE, (f"its shape {list(t.shape)} is not its parameter's "
                           f"{list(param.shape)} less one dimension (or with it of size "
                           "1), so no piece of it follows the parameter's")
    if isinstance(pp, Replicate):
        return REPLICATE, f"its parameter stays whole ({why})"
    if not isinstance(pp, Shard):
        return REPLICATE, (f"its parameter is split flat (no dimension of "
                           f"{list(param.shape)} divides {n}), and a factored moment has "
                           "no flat piece that follows it")
    # the state's dimension that is the parameter's split one, for each dimension it may lack
    follows = {None if a == pp.dim else pp.dim - (a < pp.dim) for a in lost}
    follows |= {None if a == pp.dim else pp.dim for a in kept}
    if len(follows) > 1:
        return REPLICATE, (f"which dimension of {list(param.shape)} it lacks cannot be told "
                           "from the shapes, so whether it keeps the parameter's split "
                           f"dimension {pp.dim} is unknown")
    d = follows.pop()
    if d is None:
        return REPLICATE, (f"it lacks the parameter's split dimension {pp.dim} (a mean "
                           "over it, as one of Adafactor's factored moments), which an "
                           "all-reduce makes whole")
    return Shard(d), ""



@dataclass(frozen=True)
class WeightUpdateShardingRecord:
    """What weight-update-sharding decided: what it sharded, what stayed whole and why."""

    axis: str
    layout: str                              # "flat" or "dims"
    sharded: Mapping[str, str]               # state input -> its placement
    replicated: tuple[tuple[str, str], ...]  # (value, why it stayed whole)
    expanded: tuple[str, ...]                # "op -> the ops it became", per expansion
    scalar_reductions: tuple[str, ...]       # partial sums all-reduced as scalars
    gathered: tuple[str, ...]                # parameters whose new value is all-gathered
    grads_left_sharded: tuple[str, ...]      # gradient outputs left as shards

    def to_dict(self) -> dict[str, Any]:
        """The plan's ``notes["weight-update-sharding"]`` (docs/plan.md)."""
        return {"axis": self.axis, "layout": self.layout, "sharded": dict(self.sharded),
                "replicated": list(self.replicated), "expanded": list(self.expanded),
                "scalar_reductions": list(self.scalar_reductions),
                "gathered": list(self.gathered),
                "grads_left_sharded": list(self.grads_left_sharded)}


@dataclass
class _Plan:
    """What the rewrite decided, collected as it goes (frozen into the record at the end)."""

    sharded: dict[str, str]
    replicated: list[tuple[str, str]]
    expanded: list[str]
    scalar_reductions: list[str]
    gathered: list[str]
    grads_left_sharded: list[str]

    def record(self, axis: str, layout: str) -> WeightUpdateShardingRecord:
        """These decisions, frozen, for the plan."""
        return WeightUpdateShardingRecord(
            axis, layout, dict(self.sharded), tuple(self.replicated), tuple(self.expanded),
            tuple(self.scalar_reductions), tuple(self.gathered),
            tuple(self.grads_left_sharded))


def _refuse_late_metrics(graph: Graph, axis: str, name: str) -> None:
    """An update op reading per-device values (the model run again on the batch after the
    optimizer step, for a metric): under this pass each device holds only its piece of
    the new parameters there."""
    for op in graph.ops:
        if op.phase is Phase.update and op.name not in ("all_reduce", "broadcast") and any(
                isinstance(v.type.placement(axis), Varying) for v in op.results):
            raise PassFailure(
                f"{name}: the step runs the model on the batch again after the optimizer "
                "step (a metric of the updated parameters); with the update sharded each "
                "device holds only its piece of the new parameters there", op=op,
                hint="compute that metric at the start of the next step (or outside it), "
                     "or parallelize with passes='data-parallel' (no update sharding)")


@register_pass
@dataclass(frozen=True)
class WeightUpdateSharding(Pass):
    """Shard the optimizer update and its state over mesh axis ``axis``."""

    name = "weight-update-sharding"
    axis: str = "dp"
    layout: str = "flat"
    gather: str = "end"      # or "next-forward": parameters stay pieces between steps

    def __call__(self, graph: Graph, ctx: PassContext) -> Graph:
        n = require_axis(graph, self.axis, self.name)
        if self.layout not in _LAYOUTS:
            raise PassFailure(f"{self.name}: layout={self.layout!r} is not one of "
                              f"{', '.join(_LAYOUTS)}")
        if self.gather not in _GATHERS:
            raise PassFailure(f"{self.name}: gather={self.gather!r} is not one of "
                              f"{', '.join(_GATHERS)}",
                              hint="end: all-gather new parameters after the update; "
                                   "next-forward: at their first use in the next step")
        if any(op.name == "take_shard" and op.attrs.get("axis") == self.axis
               for op in graph.ops):
            raise PassFailure(f"{self.name}: the update already runs on pieces over axis "
                              f"{self.axis!r} (weight-update sharding ran before)",
                              hint="run weight-update-sharding once per axis")
        if not any(_is_grad_sync(op, self.axis) for op in graph.ops):
            raise PassFailure(f"{self.name}: the graph has no gradient all-reduce on axis "
                              f"{self.axis!r} to turn into a reduce-scatter",
                              hint=f"run data-parallel{{axis={self.axis}}} first")
        if n == 1:
            return graph
        _refuse_late_metrics(graph, self.axis, self.name)
        dirty: set[str] = set()
        for _ in range(4):   # state whose padding the update dirties is declared Fx
            out, plan, more = _Rewrite(graph, self.axis, n, self.layout, dirty).run()
            if not more:
                break
            dirty |= more
        else:  # pragma: no cover - each round only adds names
            raise PassFailure(f"{self.name}: state placements did not settle")
        ctx.decisions[self.name] = plan.record(self.axis, self.layout)
        if self.gather == "next-forward":
            # the new pieces are what the step returns; the next forward gathers them
            from .shard_params import ShardParams
            out = ShardParams(self.axis, backward="keep")(out, ctx)
        return out


def _is_grad_sync(op: Op, axis: str) -> bool:
    return op.name == "all_reduce" and op.attrs.get("axis") == axis


class _Rewrite:
    def __init__(self, graph: Graph, axis: str, n: int, layout: str, dirty: set[str]) -> None:
        self.g, self.ax, self.n, self.layout, self.dirty = graph, axis, n, layout, dirty
        self.types: dict[str, TensorType] = {}
        self.names = graph.fresh_names()
        self.out: list[Op] = []
        self.plan = _Plan({}, [], [], [], [], [])
        self.param_shard: dict[str, str] = {}     # param -> its take_shard value
        self.alias: dict[str, str] = {}           # a transpose undone by the next -> source
        self.transposed: dict[str, tuple[str, tuple[int, ...]]] = {}
        self.lazy: dict[str, Op] = {}             # transposes of pieces not yet needed
        self.params = {i.name for i in graph.inputs if i.role.kind is InputKind.param}
        users: dict[str, list[Op]] = {}
        for op in graph.ops:
            for i in op.inputs:
                users.setdefault(i, []).append(op)
        self.users = users
        self.output_names = {o.name for o in graph.outputs}
        # what the step returns to the user: whole on every device, never a piece
        self.returned = {o.name for o in graph.outputs
                         if o.role.kind in (OutputKind.loss, OutputKind.metric)}

    # -------------------------------------------------------------- helpers
    def place(self, t: TensorType) -> tuple[Placement, str]:
        return shard_placement(t, self.n, self.layout)

    def emit(self, name: str, ins: tuple[str, ...], t: TensorType, attrs: dict,
             at: Op | None, hint: str) -> str:
        v = self.names(hint)
        self.out.append(Op(name, ins, (Value(v, t),), Attrs(attrs),
                           phase=at.phase if at is not None else Phase.update,
                           loc=at.loc if at is not None else None))
        self.types[v] = t
        return v

    def gather(self, name: str, at: Op | None) -> str:
        t = self.types[name]
        p = t.placement(self.ax)
        if isinstance(p, Shard) and p.groups > 1 and \
                not any(isinstance(q, Shard) for a, q in t.placements if a != self.ax):
            # k groups laid end to end, each split (a tensor split along dim 1, raveled:
            # S(0,k)): viewed as [k, size/k] it is split along the second, gathered there
            d, k = p.dim, p.groups
            shape = (*t.shape[:d], k, t.shape[d] // k, *t.shape[d + 1:])
            view = self.emit("reshape", (name,), TensorType(shape, t.dtype, t.placements)
                             .with_placement(self.ax, Shard(d + 1)), {}, at,
                             f"{name}.groups")
            whole = self.emit("all_gather", (view,), self.types[view].with_placement(
                self.ax, REPLICATE), {"axis": self.ax, "dim": d + 1}, at, f"{view}.full")
            return self.emit("reshape", (whole,), t.with_placement(self.ax, REPLICATE), {},
                             at, f"{name}.full")
        return self.emit("all_gather", (name,), t.with_placement(self.ax, REPLICATE),
                         {"axis": self.ax, "dim": dim_attr(p)}, at, f"{name}.full")

    def shard(self, name: str, p: Placement, at: Op | None) -> str:
        t = self.types[name]
        return self.emit("take_shard", (name,), t.with_placement(self.ax, p),
                         {"axis": self.ax, "dim": dim_attr(p)}, at, f"{name}.shard")

    # -------------------------------------------------------------- the rewrite
    def run(self) -> tuple[Graph, _Plan, set[str]]:
        g, ax = self.g, self.ax
        inputs = []
        for i in g.inputs:
            t = i.value.type
            if i.role.kind is InputKind.opt_state and i.role.of is not None:
                pt = g.input(i.role.of).value.type
                p, why = self.place(t) if pt.shape == t.shape else \
                    linked_placement(t, pt, self.n, self.layout)
                if p == FLAT and i.name in self.dirty:
                    p = FLAT_DIRTY
                if isinstance(p, Replicate):
                    if t.numel > 1 or pt.shape == t.shape:
                        self.plan.replicated.append((i.name, why))
                else:
                    t = t.with_placement(ax, p)
                    self.plan.sharded[i.name] = str(p)
                    i = Input(Value(i.name, t), i.role)
            self.types[i.name] = t
            inputs.append(i)

        work = deque(g.ops)
        while work:
            op = work.popleft()
            if _is_grad_sync(op, ax) and isinstance(self.types[op.inputs[0]].placement(ax),
                                                    Varying):
                self.grad_sync(op)
            elif op.phase is Phase.update:
                expanded = self.update_op(op)
                if expanded is not None:
                    work.extendleft(reversed(expanded))
            else:
                self.keep(op)
        return self.finish(inputs)

    def keep(self, op: Op) -> None:
        self.out.append(op)
        self.types.update((v.name, v.type) for v in op.results)

    def grad_sync(self, op: Op) -> None:
        v = op.result
        p, why = self.place(v.type)
        users = self.users.get(v.name, [])
        # a gradient is read by the update and only by it; a synced value nothing reads (a
        # returned metric) or that the step returns stays an all-reduce
        if isinstance(p, Replicate) or not users or v.name in self.returned or \
                not all(u.phase is Phase.update for u in users):
            if why and v.type.numel > 1:
                self.plan.replicated.append((v.name, why))
            self.keep(op)
            return
        t = v.type.with_placement(self.ax, p)
        self.out.append(op.replace(name="reduce_scatter", results=(Value(v.name, t),),
                                   attrs=op.attrs.set(dim=dim_attr(p))))
        self.types[v.name] = t

    def update_op(self, op: Op) -> list[Op] | None:
        """Place one update op; returns its expansion when it must be expanded instead."""
        ins = [self.alias.get(i, i) for i in op.inputs]
        if op.name == "transpose":
            if self.undoes_transpose(op, ins[0]):
                return None
            if not isinstance(self.types[ins[0]].placement(self.ax), Replicate):
                # wait: the next transpose may undo it; run it only if something reads it
                self.lazy[op.result.name] = op.replace(inputs=tuple(ins))
                return None
        for i in ins:
            if i in self.lazy:
                self.place_op(self.lazy.pop(i))
        for k, name in enumerate(ins):
            if name in self.params:
                ins[k] = self.param_piece(name, op)
        return self.place_op(op.replace(inputs=tuple(ins)))

    def place_op(self, op: Op) -> list[Op] | None:
        ins = list(op.inputs)
        tried_gather = tried_slice = False
        d = op_def(op.name)
        while True:
            types = [self.types[i] for i in ins]
            outs = [v.type for v in op.results]
            got = None if op.regions and any(t.placements for t in types) else \
                propagate(op, types, outs, self.ax, d.sharding_rule)
            dirty_sum = got is not None and sums_dirty_padding(op, types, self.ax, self.n)
            if got is not None and not dirty_sum:
                break
            split = any(not isinstance(t.placement(self.ax), Replicate) for t in types)
            if split and d.expand is not None:
                new = d.expand(op.replace(inputs=tuple(ins)), types, self.names)
                if new is not None:
                    self.plan.expanded.append(f"{op.name} -> "
                                              + ", ".join(o.name for o in new))
                    return new
            partial = [k for k, t in enumerate(types) if isinstance(t.placement(self.ax),
                                                                     Partial)]
            if partial:
                for k in partial:
                    red = types[k].placement(self.ax).op
                    ins[k] = self.emit("all_reduce", (ins[k],),
                                       types[k].with_placement(self.ax, REPLICATE),
                                       {"axis": self.ax, "op": red}, op, f"{ins[k]}.sum")
                    self.plan.scalar_reductions.append(ins[k])
                continue
            if not tried_slice and not op.regions:
                # a whole operand beside pieces: take its piece locally (a slice, no
                # communication), e.g. a scalar broadcast to the tensor's shape. Not for
                # an op with regions (cond, while): its operands are unrelated tensors, and
                # it runs on whole values anyway
                tried_slice = True
                # each piece's placement in the result's dims, aligned from the last as
                # broadcasting aligns them (a [24] bias split S(0) written into a [10, 24]
                # history is S(1) there); None where it does not line up
                res = op.results[0].type
                pieces = {_in_result(t.placement(self.ax), t, res) for t in types
                          if not isinstance(t.placement(self.ax), Replicate)}
                if len(pieces) == 1 and None not in pieces:
                    piece = pieces.pop()
                    whole = [k for k, t in enumerate(types) if t.numel > 1 and
                             isinstance(t.placement(self.ax), Replicate) and
                             t.shape == op.results[0].type.shape]
                    if whole:
                        for k in whole:
                            ins[k] = self.shard(ins[k], FLAT if piece == FLAT_DIRTY
                                                else piece, op)
                        continue
            if tried_gather or not split:
                raise PassFailure(f"weight-update-sharding: {op.name} cannot run on its "
                                  "inputs even replicated", op=op)
            for k, t in enumerate(types):
                if not isinstance(t.placement(self.ax), Replicate):
                    ins[k] = self.gather(ins[k], op)
            self.plan.replicated.append((f"{op.name} -> %{op.results[0].name}",
                                         "a flat piece's padding may hold anything (Fx) "
                                         "and the reduction would count it" if dirty_sum
                                         else f"the {op.name} rule cannot run on pieces"))
            tried_gather = True
        results = tuple(Value(v.name, v.type.with_placement(self.ax, p))
                        for v, p in zip(op.results, got))
        self.keep(op.replace(inputs=tuple(ins), results=results))
        return None

    def undoes_transpose(self, op: Op, src: str) -> bool:
        """A transpose of a transpose that restores the order is its source (the views
        eager code takes, t().t(), traced as two transposes): alias instead of running it,
        since a flat piece cannot be transposed locally."""
        perm = tuple(op.attrs["perm"])
        if src in self.transposed:
            base, first = self.transposed[src]
            if tuple(first[p] for p in perm) == tuple(range(len(perm))):
                self.alias[op.result.name] = base
                self.types[op.result.name] = self.types[base]
                return True
        self.transposed[op.result.name] = (src, perm)
        return False

    def param_piece(self, name: str, at: Op) -> str:
        """This device's piece of a full parameter, made once (a slice, no communication)."""
        if name not in self.param_shard:
            p, _ = self.place(self.types[name])
            self.param_shard[name] = name if isinstance(p, Replicate) else \
                self.shard(name, p, at)
        return self.param_shard[name]

    def finish(self, inputs: list[Input]) -> tuple[Graph, _Plan, set[str]]:
        g, ax = self.g, self.ax
        in_types = {i.name: i.value.type for i in inputs}
        fix: dict[str, str] = {}
        after: dict[str, list[Op]] = {}
        more: set[str] = set()
        outs = [type(o)(self.alias.get(o.name, o.name), o.role) for o in g.outputs]
        for o in outs:
            if o.name in self.lazy:
                self.place_op(self.lazy.pop(o.name))
        producer = {v.name: op for op in self.out for v in op.results}
        for o in outs:
            t = self.types[o.name]
            p = t.placement(ax)
            at = producer.get(o.name)
            mark = len(self.out)
            if o.role.kind is OutputKind.replaces:
                want = in_types[o.role.target].placement(ax)
                if fits(want, p):
                    continue
                if want == FLAT and p == FLAT_DIRTY:
                    more.add(o.role.target)
                    continue
                name = o.name
                if isinstance(p, Partial):
                    name = self.emit("all_reduce", (name,), t.with_placement(ax, REPLICATE),
                                     {"axis": ax, "op": p.op}, at, f"{name}.sum")
                elif not isinstance(p, Replicate):
                    name = self.gather(name, at)
                    if o.role.target in self.params:
                        self.plan.gathered.append(o.role.target)
                if not isinstance(want, Replicate):
                    name = self.shard(name, want, at)
                fix[o.name] = name
            elif isinstance(p, Partial):
                fix[o.name] = self.emit("all_reduce", (o.name,), t.with_placement(ax, REPLICATE),
                                        {"axis": ax, "op": p.op}, at, f"{o.name}.sum")
            elif not isinstance(p, Replicate) and not isinstance(p, Varying):
                self.plan.grads_left_sharded.append(o.name)
            made, self.out[mark:] = self.out[mark:], []
            if made:
                after.setdefault(o.name, []).extend(made)
        ops: list[Op] = []
        for op in self.out:
            ops.append(op)
            for v in op.results:
                ops.extend(after.pop(v.name, ()))
        for rest in after.values():   # outputs that are inputs
            ops[:0] = rest
        outputs = tuple(type(o)(fix.get(o.name, o.name), o.role) for o in outs)
        graph = g.replace(inputs=tuple(inputs), ops=tuple(ops), outputs=outputs)
        return graph, self.plan, more - self.dirty
