"""The verifier: SSA scoping, op attributes, shape rules, placements, roles, stage order.

Errors show the offending op between its neighbours, so a pass author sees where it broke."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from ..errors import DiphomaError, IRVerifyError
from .core import Graph, InputKind, Op, OutputKind, Phase
from .ops import Category, check_attr, op_def
from .printer import format_name, format_op_head
from .shape_rules import TypeRuleError, region_types
from .sharding_rules import expected_collective, propagate, sums_dirty_padding
from .types import Replicate, Shard, TensorType, Varying, fits

_PHASE_RANK = {Phase.forward: 0, Phase.backward: 1, Phase.update: 2}


@dataclass
class _Def:
    type: TensorType
    op: Op | None = None  # producer; None for graph inputs and region arguments


def _context(ops: tuple[Op, ...], index: int, path: str, graph: Graph) -> str:
    lines = [f"  in graph {format_name(graph.name, '@')}, {path}:"]
    lo, hi = max(0, index - 2), min(len(ops), index + 3)
    for k in range(lo, hi):
        mark = ">>" if k == index else "  "
        lines.append(f"  {mark} {format_op_head(ops[k])}")
    return "\n".join(lines)


class _Verifier:
    def __init__(self, graph: Graph) -> None:
        self.g = graph
        self.sizes = dict(graph.mesh.axes)
        self._all_names_below: set[str] = set()  # names made inside regions seen so far

    def fail(self, msg: str, ops=(), index: int = -1, path: str = "", hint: str | None = None):
        ctx = _context(ops, index, path, self.g) if index >= 0 else ""
        raise IRVerifyError(msg, op_path=path or None, context=ctx, hint=hint)

    # ------------------------------------------------------------------ types
    def check_type(self, t: TensorType, what: str, **where) -> None:
        split_by: dict[int, list[str]] = {}  # dim -> the axes splitting it (nested splits)
        for axis, p in t.placements:
            if axis not in self.sizes:
                have = ", ".join(self.sizes) or "no axes"
                self.fail(f"{what} is placed on axis {axis!r}, which the mesh lacks ({have})",
                          **where)
            if isinstance(p, Shard):
                if not 0 <= p.dim < t.rank:
                    self.fail(f"{what} is split on dim {p.dim} but has rank {t.rank}", **where)
                axes = split_by.setdefault(p.dim, [])
                axes.append(axis)
                n = math.prod(self.sizes[a] for a in axes)
                if t.shape[p.dim] % (n * p.groups):
                    named = (f"axis {axis!r}" if len(axes) == 1 else
                             "axes " + ", ".join(repr(a) for a in axes))
                    of = f" in each of {p.groups} groups" if p.groups > 1 else ""
                    self.fail(f"{what}: dim {p.dim} of size {t.shape[p.dim]} does not divide "
                              f"among {n} devices of {named}{of}", **where,
                              hint="use the flat, padded placement F, or another dimension")

    # ------------------------------------------------------------------ graph
    def run(self) -> None:
        g = self.g
        scope: dict[str, _Def] = {}
        inputs = {}
        for i in g.inputs:
            if i.name in scope:
                self.fail(f"input {format_name(i.name)} is declared twice")
            self.check_type(i.value.type, f"input {format_name(i.name)}")
            scope[i.name] = _Def(i.value.type)
            inputs[i.name] = i
        for i in g.inputs:
            r = i.role
            if r.kind in (InputKind.opt_state, InputKind.comm_state) and r.of is not None:
                target = inputs.get(r.of)
                if target is None or target.role.kind is not InputKind.param:
                    self.fail(f"optimizer state {format_name(i.name)} names "
                              f"{format_name(r.of)}, which is not a parameter input",
                              hint="link optimizer state to an input with the param role")
        self.block(g.ops, scope, "op")
        self.check_outputs(scope, inputs)

    def check_outputs(self, scope: dict[str, _Def], inputs: dict) -> None:
        replaced: Counter[str] = Counter()
        losses = 0
        for o in self.g.outputs:
            d = scope.get(o.name)
            if d is None:
                self.fail(f"output {format_name(o.name)} is not defined at graph level")
            if o.role.kind is OutputKind.loss:
                losses += 1
                if d.type.numel != 1:
                    self.fail(f"loss output {format_name(o.name)} is {d.type}, not a scalar",
                              hint="reduce the loss to one number (mean or sum) in the step")
            if o.role.kind is OutputKind.replaces:
                target = inputs.get(o.role.target)
                if target is None:
                    self.fail(f"output {format_name(o.name)} replaces "
                              f"{format_name(o.role.target)}, which is not a graph input")
                replaced[o.role.target] += 1
                if not _type_fits(target.value.type, d.type):
                    self.fail(f"output {format_name(o.name)} ({d.type}) replaces input "
                              f"{format_name(target.name)} of another type "
                              f"({target.value.type})",
                              hint="a replacing output keeps its input's shape, dtype and "
                                   "placement, so the backend can update it in place")
        if losses > 1:
            self.fail(f"the graph has {losses} loss outputs; at most one is allowed",
                      hint="mark the others as metric")
        twice = [n for n, c in replaced.items() if c > 1]
        if twice:
            self.fail(f"input {format_name(twice[0])} is replaced by more than one output")

    # ------------------------------------------------------------------ ops
    def block(self, ops: tuple[Op, ...], scope: dict[str, _Def], path: str) -> None:
        for k, op in enumerate(ops):
            where = dict(ops=ops, index=k, path=f"{path} #{k}")
            self.op(op, scope, where)
            for v in op.results:
                scope[v.name] = _Def(v.type, op)

    def op(self, op: Op, scope: dict[str, _Def], where: dict) -> None:
        try:
            d = op_def(op.name)
        except DiphomaError as e:
            self.fail(e.message, **where, hint=e.hint)
        ins = []
        for n in op.inputs:
            if n not in scope:
                self.fail(f"{op.name} uses {format_name(n)} before it is defined", **where)
            ins.append(scope[n].type)
        for v in op.results:
            if v.name in scope or v.name in self._all_names_below:
                self.fail(f"{format_name(v.name)} is defined twice", **where)
            self.check_type(v.type, f"result {format_name(v.name)}", **where)
        outs = [v.type for v in op.results]
        self.attrs(op, d, where)
        for r in op.regions:
            inner = dict(scope)
            for a in r.args:
                if a.name in inner or a.name in self._all_names_below:
                    self.fail(f"region argument {format_name(a.name)} is defined twice",
                              **where)
                self.check_type(a.type, f"region argument {format_name(a.name)}", **where)
                inner[a.name] = _Def(a.type)
            self.block(r.ops, inner, f"{where['path']} {format_name(r.name, '^')}")
            for y in r.yields:
                if y not in inner:
                    self.fail(f"region {format_name(r.name, '^')} yields "
                              f"{format_name(y)}, which it cannot see", **where)
            # names made inside a region stay reserved: names are unique graph-wide
            self._all_names_below.update(set(inner) - set(scope))
        if op.regions and d.region_rule is None:
            self.fail(f"{op.name} takes no regions", **where)
        try:
            if d.shape_rule is not None:
                d.shape_rule(op, ins, outs)
            if d.region_rule is not None:
                types = {**{n: s.type for n, s in scope.items()}, **op_region_types(op)}
                d.region_rule(op, ins, outs, region_types(op, types))
        except TypeRuleError as e:
            self.fail(f"{op.name}: {e}", **where)
        except (KeyError, TypeError, IndexError) as e:
            self.fail(f"{op.name}: malformed op ({type(e).__name__}: {e})", **where)
        self.placements(op, d, ins, outs, where)
        self.order(op, scope, where)

    def attrs(self, op: Op, d, where: dict) -> None:
        axes = tuple(self.sizes)
        for key, (kind, required) in d.attrs.items():
            if key not in op.attrs:
                if required:
                    self.fail(f"{op.name} needs attribute {key!r}", **where)
                continue
            bad = check_attr(kind, op.attrs[key], axes)
            if bad:
                self.fail(f"{op.name}: attribute {key}={op.attrs[key]!r} should be {bad}",
                          **where)
        if not d.open_attrs:
            extra = sorted(set(op.attrs) - set(d.attrs))
            if extra:
                known = ", ".join(d.attrs) or "none"
                self.fail(f"{op.name} has unknown attribute(s) {', '.join(extra)} "
                          f"(known: {known})", **where)

    def placements(self, op: Op, d, ins, outs, where: dict) -> None:
        if not self.sizes:
            return
        if all(not t.placements for t in ins) and all(not t.placements for t in outs) \
                and d.category is not Category.collective:
            return
        if op.name == "scan" and all(isinstance(t.placement(a), (Replicate, Varying))
                                     for t in (*ins, *outs) for a in self.sizes):
            # a fixed number of iterations over whole or per-device values: its region rule
            # matches the body's arguments to its operands and its results to the body's
            # yields, placements included, and the body's ops are checked one by one, so a
            # result is per device exactly where the body makes it so (a stacked output of
            # the weights alone is not). Split or partial values keep the rule below (a
            # slice of a value split along the scanned dimension is no longer split so).
            return
        for axis in self.sizes:
            if d.category is Category.collective and op.attrs.get("axis") == axis:
                pairs = list(zip(ins, outs)) if len(ins) == len(outs) else \
                    [(ins[0] if ins else outs[0], outs[0] if outs else None)]
                for k, (t_in, t_out) in enumerate(pairs):
                    want, why = expected_collective(op, t_in.placement(axis))
                    if want is None:
                        which = f" (input {k})" if len(pairs) > 1 else ""
                        self.fail(f"{op.name} on axis {axis!r}{which}: {why}", **where)
                    got = t_out.placement(axis) if t_out is not None else want
                    if not fits(got, want):
                        which = f" {k}" if len(pairs) > 1 else ""
                        self.fail(f"{op.name} on axis {axis!r} gives {want}, but its result"
                                  f"{which} is declared {got}", **where)
                continue
            if sums_dirty_padding(op, ins, axis, self.sizes[axis]):
                # math before the reduction may have made the padding nonzero (exp(0) = 1)
                self.fail(f"{op.name} reduces a flat shard whose padding may be nonzero (Fx) "
                          f"on axis {axis!r} ({ins[0].numel} elements over "
                          f"{self.sizes[axis]} devices)",
                          **where, hint="reduce a value whose padding is zero (F), or gather "
                                        "it first")
            want_all = propagate(op, ins, outs, axis, d.sharding_rule)
            if want_all is None:
                placed = ", ".join(str(t.placement(axis)) for t in ins) or "no inputs"
                self.fail(f"{op.name} cannot take inputs placed ({placed}) on axis {axis!r}",
                          **where, hint="insert a collective (all_gather, all_reduce) or "
                                        "take_shard before it")
            for k, (t, want) in enumerate(zip(outs, want_all)):
                got = t.placement(axis)
                if not fits(got, want):
                    self.fail(f"{op.name}: result {k} is declared {got} on axis {axis!r}, "
                              f"but its inputs give {want}", **where)

    def order(self, op: Op, scope: dict[str, _Def], where: dict) -> None:
        for n in op.inputs:
            prod = scope[n].op
            if prod is None:
                continue
            if op.stage is not None and prod.stage is not None and prod.stage > op.stage:
                self.fail(f"{op.name} in stage {op.stage} uses {format_name(n)} from a later "
                          f"stage {prod.stage}", **where,
                          hint="values flow from earlier pipeline stages to later ones")
            if op.phase is not None and prod.phase is not None and \
                    _PHASE_RANK[prod.phase] > _PHASE_RANK[op.phase]:
                self.fail(f"{op.name} ({op.phase.value}) uses {format_name(n)} made in the "
                          f"later {prod.phase.value} phase", **where)


def _type_fits(declared: TensorType, given: TensorType) -> bool:
    if (declared.shape, declared.dtype) != (given.shape, given.dtype):
        return False
    axes = {a for a, _ in declared.placements} | {a for a, _ in given.placements}
    return all(fits(declared.placement(a), given.placement(a)) for a in axes)


def op_region_types(op: Op) -> dict[str, TensorType]:
    """Types of the values defined inside an op's regions."""
    out: dict[str, TensorType] = {}
    for r in op.regions:
        out.update((a.name, a.type) for a in r.args)
        for inner in r.ops:
            out.update((v.name, v.type) for v in inner.results)
            out.update(op_region_types(inner))
    return out


def verify(graph: Graph) -> Graph:
    """Check every IR invariant of ``graph``; return it, or raise IRVerifyError."""
    _Verifier(graph).run()
    return graph


