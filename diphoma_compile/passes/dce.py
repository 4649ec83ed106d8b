"""Dead-code elimination: drop ops none of whose results reach an output or an effect."""

from __future__ import annotations

from dataclasses import dataclass

from ..ir.analysis import free_inputs
from ..ir.core import Graph, Op
from ..ir.ops import is_effectful
from .base import Pass, PassContext, register_pass


def _dce_ops(ops: tuple[Op, ...], live: set[str]) -> tuple[Op, ...]:
    """Keep the ops that feed ``live`` (updated in place with what they read)."""
    kept: list[Op] = []
    for op in reversed(ops):
        if not is_effectful(op) and not any(v.name in live for v in op.results):
            continue
        if op.regions:
            regions = []
            for r in op.regions:
                inner_live = set(r.yields)
                new_ops = _dce_ops(r.ops, inner_live)
                regions.append(r if len(new_ops) == len(r.ops) else r.replace(ops=new_ops))
            if any(a is not b for a, b in zip(regions, op.regions)):
                op = op.replace(regions=tuple(regions))
        live.update(free_inputs(op))
        kept.append(op)
    if len(kept) == len(ops):
        return ops
    return tuple(reversed(kept))


def dce_graph(graph: Graph) -> Graph:
    """``graph`` without dead ops; the same object when nothing was dead."""
    ops = _dce_ops(graph.ops, {o.name for o in graph.outputs})
    if ops is graph.ops:
        return graph
    return graph.replace(ops=ops)


@register_pass
@dataclass(frozen=True)
class DeadCodeElimination(Pass):
    """Remove side-effect-free ops whose results are never used, inside regions too.

    Graph inputs stay, even unused: they are the step's signature."""

    name = "dce"

    def __call__(self, graph: Graph, ctx: PassContext) -> Graph:
        return dce_graph(graph)
