"""The output structure (PyTreeDef) of each traced JAX step, which the IR has no place for:
the frontend notes it here, the runners read it back; neither imports the other for it."""

from __future__ import annotations

from typing import Any

from ..ir.core import Graph

# The IR has no place for pytree structures, so the frontend remembers the output structure
# of each traced step here, keyed by the graph's signature (input names, shapes and dtypes;
# output names and roles). Passes keep that signature while they change placements and ops,
# so the backend finds the user's trees for a transformed graph too.
OUT_TREES: dict[tuple, Any] = {}
_AMBIGUOUS = object()   # two traced steps with one signature and different output trees


def _signature(graph: Graph) -> tuple:
    return (graph.name,
            tuple((i.name, i.value.type.shape, i.value.type.dtype) for i in graph.inputs),
            tuple((o.name, o.role) for o in graph.outputs))


def output_tree(graph: Graph) -> Any | None:
    """The output PyTreeDef of the traced step ``graph`` (or a rewrite of it); None when
    unknown or ambiguous (the backend then rebuilds the trees from the roles)."""
    tree = OUT_TREES.get(_signature(graph))
    return None if tree is _AMBIGUOUS else tree


def remember_tree(graph: Graph, tree: Any) -> None:
    """Note the output structure of a step the frontend just traced."""
    key = _signature(graph)
    old = OUT_TREES.get(key, tree)
    OUT_TREES[key] = tree if old == tree else _AMBIGUOUS
