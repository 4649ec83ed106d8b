"""Common-subexpression elimination: an op identical to an earlier one reuses its results."""

from __future__ import annotations

from dataclasses import dataclass

from ..ir.core import Graph, Op
from ..ir.ops import is_pure
from ..ir.rewrite import rename_outputs, rename_uses
from .base import Pass, PassContext, register_pass


def _key(op: Op) -> tuple:
    # Stage and micro-batch are part of the key: merging across them would move work
    # between pipeline stages. Phase and location are not: they only describe.
    return (op.name, op.inputs, op.attrs, tuple(v.type for v in op.results), op.stage,
            op.microbatch)


def _cse_ops(ops: tuple[Op, ...], table: dict, mapping: dict[str, str]) -> tuple[Op, ...]:
    out: list[Op] = []
    changed = False
    for op in ops:
        renamed = rename_uses((op,), mapping)[0]
        if renamed.regions:
            regions = []
            for r in renamed.regions:
                new_ops = _cse_ops(r.ops, dict(table), mapping)
                yields = tuple(mapping.get(n, n) for n in r.yields)
                regions.append(r if new_ops is r.ops and yields == r.yields
                               else r.replace(ops=new_ops, yields=yields))
            if any(a is not b for a, b in zip(regions, renamed.regions)):
                renamed = renamed.replace(regions=tuple(regions))
        changed |= renamed is not op
        if not renamed.regions and is_pure(renamed):
            key = _key(renamed)
            prior = table.get(key)
            if prior is not None:
                for v, w in zip(renamed.results, prior.results):
                    mapping[v.name] = w.name
                changed = True
                continue
            table[key] = renamed
        out.append(renamed)
    return tuple(out) if changed else ops


def cse_graph(graph: Graph) -> Graph:
    """``graph`` with repeated pure ops merged; the same object when none repeat.

    Ops with regions are not merged (their bodies are still simplified)."""
    mapping: dict[str, str] = {}
    ops = _cse_ops(graph.ops, {}, mapping)
    if ops is graph.ops:
        return graph
    return graph.replace(ops=ops, outputs=rename_outputs(graph, mapping))


@register_pass
@dataclass(frozen=True)
class CommonSubexpressionElimination(Pass):
    """Merge pure ops with the same name, inputs, attributes and result types."""

    name = "cse"

    def __call__(self, graph: Graph, ctx: PassContext) -> Graph:
        return cse_graph(graph)
