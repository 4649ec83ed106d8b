"""Parameter sharding (ZeRO-3 / FSDP class) on top of weight-update sharding.

After ``weight-update-sharding`` each device updates its piece of every parameter and an
all-gather at the end of the step rebuilds the whole parameter, which every device then
holds between steps. This pass keeps the pieces instead: the parameter inputs become this
device's piece (the placement the update already uses, ``F`` or ``S(d)``), the new pieces
are returned as they are (no all-gather at the end), and the whole parameter is gathered
where the step reads it, once before its first use in the forward pass and again before its
first use in the backward pass, so that the forward's copy can be freed in between.
``schedule-comm`` then issues each such gather one ahead of its use (prefetch), not all at
the start.

Between steps a device holds 1/N of the parameters, as it already held 1/N of the optimizer
state; the step holds whole only the parameters in use, at the price of a second all-gather
of every parameter (forward and backward), as FSDP pays. ``backward=keep`` gathers once, in
forward, and keeps the whole copy through backward: the communication of the default plan
with the gather moved to the start of the next step's forward, where it overlaps it
(weight-update-sharding's ``gather=next-forward``); the step's peak is the default plan's."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..ir.core import Attrs, Graph, Input, InputKind, Op, OutputKind, Phase, Value, walk_ops
from ..ir.rewrite import rename_uses
from ..ir.opdef import Category, is_view, op_def
from ..ir.shape_rules import TypeRuleError, region_types
from ..ir.sharding_rules import propagate, sums_dirty_padding
from ..ir.types import FLAT, FLAT_DIRTY, REPLICATE, Placement, TensorType, dim_attr, fits
from .base import Pass, PassContext, PassFailure, register_pass
from .data_parallel import require_axis


@dataclass(frozen=True)
class ShardParamsRecord:
    """What shard-params decided: the parameters held as pieces (with their placement),
    those kept whole and why, and the gathers it placed by phase."""

    axis: str
    sharded: Mapping[str, str]
    whole: tuple[tuple[str, str], ...]
    gathers: Mapping[str, int]           # phase -> all-gathers placed before uses
    backward: str = "regather"

    def to_dict(self) -> dict[str, Any]:
        """The plan's ``notes["shard-params"]`` (docs/plan.md)."""
        return {"axis": self.axis, "sharded": dict(self.sharded),
                "whole": [list(w) for w in self.whole], "gathers": dict(self.gathers),
                "backward": self.backward}


_BACKWARD = ("regather", "keep")


@register_pass
@dataclass(frozen=True)
class ShardParams(Pass):
    """Hold parameters as their update pieces over ``axis``; gather them where used."""

    name = "shard-params"
    axis: str = "dp"
    backward: str = "regather"      # or "keep": backward reads the forward's gather

    def __call__(self, graph: Graph, ctx: PassContext) -> Graph:
        n = require_axis(graph, self.axis, self.name)
        if self.backward not in _BACKWARD:
            raise PassFailure(f"{self.name}: backward={self.backward!r} is not one of "
                              f"{', '.join(_BACKWARD)}",
                              hint="regather: gather again for backward (FSDP); keep: hold "
                                   "the forward's whole copy through backward")
        if n == 1:
            return graph
        params = {i.name for i in graph.inputs if i.role.kind is InputKind.param}
        # each parameter's piece: the take_shard the update reads (weight-update-sharding)
        pieces: dict[str, Op] = {}
        for op in graph.ops:
            if op.name == "take_shard" and op.attrs.get("axis") == self.axis \
                    and op.inputs[0] in params and op.inputs[0] not in pieces:
                pieces[op.inputs[0]] = op
        if not pieces and not any(op.name == "reduce_scatter" for op in graph.ops):
            raise PassFailure(f"{self.name}: the graph has no sharded update on axis "
                              f"{self.axis!r}",
                              hint=f"run weight-update-sharding{{axis={self.axis}}} first")
        made = {v.name: op for op in graph.ops for v in op.results}
        types = graph.value_types()
        new_of = {o.role.target: o.name for o in graph.outputs
                  if o.role.kind is OutputKind.replaces and o.role.target in params}
        sharded: dict[str, Placement] = {}
        whole: list[tuple[str, str]] = []
        returned: dict[str, str] = {}          # output name -> the piece returned instead
        for p in sorted(params):
            piece = pieces.get(p)
            if piece is None:
                whole.append((p, "weight-update-sharding kept its update whole (its notes "
                                 "say why)"))
                continue
            gather = made.get(new_of.get(p, ""))
            place = piece.result.type.placement(self.axis)
            if gather is None or gather.name != "all_gather" or \
                    gather.attrs.get("axis") != self.axis or \
                    not fits(types[gather.inputs[0]].placement(self.axis), place):
                whole.append((p, "its new value is not gathered from its update's piece"))
                continue
            # held as the new piece is made: with padding of unknown value (Fx) when the
            # update dirties it (AdamW's eps), which the gathers drop
            sharded[p] = types[gather.inputs[0]].placement(self.axis)
            returned[new_of[p]] = gather.inputs[0]
        if not sharded:
            raise PassFailure(f"{self.name}: no parameter's update is sharded over "
                              f"{self.axis!r}", hint="nothing to hold as pieces")
        return self._rewrite(graph, sharded, pieces, returned, whole, ctx)

    def _rewrite(self, graph: Graph, sharded: dict[str, Placement], pieces: dict[str, Op],
                 returned: dict[str, str], whole: list, ctx: PassContext) -> Graph:
        ax = self.axis
        inputs = tuple(Input(Value(i.name, i.value.type.with_placement(ax, sharded[i.name])),
                             i.role) if i.name in sharded else i for i in graph.inputs)
        # the update's take_shard of a held parameter is the parameter itself now
        alias = {pieces[p].result.name: p for p in sharded}
        dropped = {id(pieces[p]) for p in sharded}
        names = graph.fresh_names()
        ops: list[Op] = []
        gathered: dict[tuple[str, Phase | None], str] = {}
        counts: dict[str, int] = {}
        # forward views of a gathered parameter (its transpose, say): (parameter, the view
        # ops from it); backward reads them made again from its own gather, so that the
        # forward's whole copy dies when the forward is done with it
        views: dict[str, tuple[str, tuple[Op, ...]]] = {}
        remade: dict[str, str] = {}

        def gather_of(p: str, at: Op) -> str:
            key = (p, at.phase if self.backward == "regather" else None)
            if key not in gathered:
                t = graph.input(p).value.type
                v = Value(names(f"{p}.whole"), t.with_placement(ax, REPLICATE))
                ops.append(Op("all_gather", (p,), (v,), Attrs(
                    {"axis": ax, "dim": dim_attr(sharded[p])}), phase=at.phase, loc=at.loc))
                gathered[key] = v.name
                phase = at.phase.value if at.phase is not None else "none"
                counts[phase] = counts.get(phase, 0) + 1
            return gathered[key]

        def again(x: str, at: Op) -> str:
            # a forward view of a parameter, made again in at's phase from its gather there
            if x not in remade:
                p, chain = views[x]
                src, mapping = gather_of(p, at), {}
                for v_op in chain:
                    new = tuple(Value(names(f"{v.name}.again"), v.type) for v in v_op.results)
                    ops.append(v_op.replace(inputs=tuple(mapping.get(i, src if i == p else i)
                                                         for i in v_op.inputs),
                                            results=new, phase=at.phase))
                    mapping.update((v.name, n.name) for v, n in zip(v_op.results, new))
                remade[x] = mapping[x]
            return remade[x]

        for op in (o for o in graph.ops if id(o) not in dropped):
            # ops reading the whole parameter (the update reads the take_shard's piece)
            mapping = {x: gather_of(x, op) for x in dict.fromkeys(op.inputs) if x in sharded}
            if op.phase is Phase.backward and self.backward == "regather":
                mapping.update((x, again(x, op)) for x in op.inputs if x in views
                               and views[x][1][0].phase is Phase.forward)
            ops.append(op.replace(inputs=tuple(mapping.get(x, x) for x in op.inputs))
                       if mapping else op)
            if is_view(op) and len(op.results) == 1 and op.phase is Phase.forward:
                src = op.inputs[0] if op.inputs else None
                if src in sharded:
                    views[op.results[0].name] = (src, (op,))
                elif src in views:
                    p, chain = views[src]
                    views[op.results[0].name] = (p, chain + (op,))
        outputs = tuple(type(o)(returned.get(o.name, o.name), o.role) for o in graph.outputs)
        renamed = list(rename_uses(tuple(ops), alias))
        dirty: set[str] = set()
        for _ in range(4):
            # state whose padding the update now dirties (L2 weight decay reading a held
            # Fx parameter makes Adam's moments Fx) is declared Fx, as weight-update
            # sharding declares its own
            inputs = tuple(Input(Value(i.name, i.value.type.with_placement(ax, FLAT_DIRTY)), i.role)
                           if i.name in dirty else i for i in inputs)
            types = {i.name: i.value.type for i in inputs}
            ops = _retype(renamed, types, ax, graph.mesh.axis_size(ax), names)
            more = {o.role.target for o in outputs if o.role.kind is OutputKind.replaces
                    and o.role.target in types and types[o.role.target].placement(ax) == FLAT
                    and types[o.name].placement(ax) == FLAT_DIRTY}
            if not more:
                break
            dirty |= more
        ctx.decisions[self.name] = ShardParamsRecord(
            ax, {p: str(q) for p, q in sharded.items()}, tuple(whole), counts, self.backward)
        return graph.replace(inputs=inputs, ops=tuple(ops), outputs=outputs)


def _check_regions(op: Op, ins: list[TensorType], res: list[TensorType],
                   types: dict[str, TensorType]) -> None:
    """PassFailure unless ``op``'s regions still take what it now reads (its region rule:
    body arguments against operands, yields against results, placements included)."""
    inner = dict(types)              # the body's values besides the graph's
    for r in op.regions:
        inner.update((a.name, a.type) for a in r.args)
        inner.update((v.name, v.type) for o in walk_ops(r.ops) for v in o.results)
    rule = op_def(op.name).region_rule
    try:
        if rule is not None:
            rule(op, ins, res, region_types(op, inner))
    except TypeRuleError as e:
        raise PassFailure(f"shard-params: {op.name} reads values placed otherwise than its "
                          f"body was placed for ({e})", op=op,
                          hint="keep this step's parameters whole (shard_params=False)"
                          ) from None


def _retype(ops: list[Op], types: dict[str, TensorType], axis: str, n: int,
            names: Any) -> list[Op]:
    """The ops with their results' placements on ``axis`` derived again from their inputs'
    (a piece held with padding of unknown value, ``Fx``, makes the update math on it
    ``Fx`` too); PassFailure naming an op that cannot run on what it now reads. A sum
    over such a piece (LAMB's norm of a parameter) reads it gathered and cut again, with
    zero padding (``F``): one more all-gather of that value."""
    out = []
    for op in ops:
        ins = [types[x] for x in op.inputs]
        if sums_dirty_padding(op, ins, axis, n):
            x, t = op.inputs[0], ins[0]
            whole = Value(names(f"{x}.whole"), t.with_placement(axis, REPLICATE))
            piece = Value(names(f"{x}.clean"), t.with_placement(axis, FLAT))
            out += [Op("all_gather", (x,), (whole,), Attrs(axis=axis, dim="flat"),
                       phase=op.phase, loc=op.loc),
                    Op("take_shard", (whole.name,), (piece,), Attrs(axis=axis, dim="flat"),
                       phase=op.phase, loc=op.loc)]
            types.update({whole.name: whole.type, piece.name: piece.type})
            op = op.replace(inputs=(piece.name, *op.inputs[1:]))
            ins[0] = piece.type
        res = [v.type for v in op.results]
        if op.regions:
            # control flow keeps its body's placements: a scan over per-device values reads
            # the gathered (whole) parameters its body was placed for
            _check_regions(op, ins, res, types)
            types.update((v.name, v.type) for v in op.results)
            out.append(op)
            continue
        # a collective on this axis sets its result's placement itself
        own = op_def(op.name).category is Category.collective and op.attrs.get("axis") == axis
        got = None if own else propagate(op, ins, res, axis, op_def(op.name).sharding_rule)
        if not own and got is None:
            raise PassFailure(f"shard-params: {op.name} cannot run on its inputs placed "
                              f"{', '.join(str(t.placement(axis)) for t in ins)} over "
                              f"{axis!r}", op=op,
                              hint="keep this step's parameters whole (shard_params=False)")
        if got is not None and tuple(v.type.placement(axis) for v in op.results) != got:
            op = op.replace(results=tuple(Value(v.name, v.type.with_placement(axis, q))
                                          for v, q in zip(op.results, got)))
        types.update((v.name, v.type) for v in op.results)
        out.append(op)
    return out

