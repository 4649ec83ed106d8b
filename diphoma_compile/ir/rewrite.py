"""Small helpers for passes that rebuild graphs: renaming uses, replacing op lists."""

from __future__ import annotations

from collections.abc import Mapping

from .core import Graph, Op, Output, Region


def rename_uses(ops: tuple[Op, ...], mapping: Mapping[str, str]) -> tuple[Op, ...]:
    """Ops with every use of a mapped name replaced; untouched ops keep their identity."""
    if not mapping:
        return ops
    out = []
    for op in ops:
        inputs = tuple(mapping.get(n, n) for n in op.inputs)
        regions = tuple(rename_region(r, mapping) for r in op.regions)
        if inputs != op.inputs or any(a is not b for a, b in zip(regions, op.regions)):
            op = op.replace(inputs=inputs, regions=regions)
        out.append(op)
    return tuple(out)


def rename_region(r: Region, mapping: Mapping[str, str]) -> Region:
    """A region with uses (inner ops and yields) renamed."""
    ops = rename_uses(r.ops, mapping)
    yields = tuple(mapping.get(n, n) for n in r.yields)
    if yields == r.yields and all(a is b for a, b in zip(ops, r.ops)):
        return r
    return r.replace(ops=ops, yields=yields)


def rename_outputs(graph: Graph, mapping: Mapping[str, str]) -> tuple[Output, ...]:
    """Graph outputs with mapped names replaced."""
    return tuple(Output(mapping.get(o.name, o.name), o.role) for o in graph.outputs)
