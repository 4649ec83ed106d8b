"""The argument and output structures (PyTreeDefs) of each traced JAX step, which the IR has
no place for: the frontend notes them here, the runners read them back (to rebuild the
result, and to refuse a call whose trees differ from the traced ones); neither imports the
other for it."""

from __future__ import annotations

from typing import Any

import jax

from ..errors import BackendError
from ..ir.core import Graph, InputKind

# The IR has no place for pytree structures, so the frontend remembers the output structure
# of each traced step here, keyed by the graph's signature (input names, shapes and dtypes;
# output names and roles). Passes keep that signature while they change placements and ops,
# so the backend finds the user's trees for a transformed graph too.
OUT_TREES: dict[tuple, Any] = {}
# the tuple of each argument's PyTreeDef, keyed by the graph's name and input names alone:
# passes change output names (new/params/w.full) and may lay inputs out anew
IN_TREES: dict[tuple, Any] = {}
_AMBIGUOUS = object()   # two traced steps with one signature and different output trees


def _signature(graph: Graph) -> tuple:
    return (graph.name,
            tuple((i.name, i.value.type.shape, i.value.type.dtype) for i in graph.inputs),
            tuple((o.name, o.role) for o in graph.outputs))


def _input_names(graph: Graph) -> tuple:
    """The graph's name and the names of the inputs the user passes (not a pipeline's
    microbatch index, nor state a runner holds between calls)."""
    return graph.name, tuple(i.name for i in graph.inputs
                             if i.role.kind not in (InputKind.microbatch, InputKind.comm_state))


def output_tree(graph: Graph) -> Any | None:
    """The output PyTreeDef of the traced step ``graph`` (or a rewrite of it); None when
    unknown or ambiguous (the backend then rebuilds the trees from the roles)."""
    tree = OUT_TREES.get(_signature(graph))
    return None if tree is _AMBIGUOUS else tree


def remember_tree(graph: Graph, tree: Any, in_trees: tuple = ()) -> None:
    """Note the output structure of a step the frontend just traced, and its arguments'."""
    for table, key, t in ((OUT_TREES, _signature(graph), tree),
                          (IN_TREES, _input_names(graph), tuple(in_trees))):
        old = table.get(key, t)
        table[key] = t if old == t else _AMBIGUOUS


def input_trees(graph: Graph) -> tuple | None:
    """The argument PyTreeDefs ``graph`` (or the step it was rewritten from) was traced
    with; None when unknown or ambiguous. A runner looks them up once, not per call."""
    traced = IN_TREES.get(_input_names(graph))
    return None if traced is _AMBIGUOUS else traced


def check_argument_trees(traced: tuple | None, treedefs: list[Any]) -> None:
    """BackendError if the arguments' structures differ from the ``traced`` ones
    (``input_trees``), beyond the container's kind (a list where a tuple was: their leaves
    are found by the same indices). Leaves are matched to the program's inputs by
    position, so a dict whose keys changed would feed the wrong arrays (keys sort: a batch
    traced as {"inp", "tgt"} and called as {"x", "tgt"} swaps its two leaves)."""
    if traced is None or tuple(treedefs) == traced:
        return
    if len(treedefs) != len(traced):
        raise BackendError(f"the step was traced with {len(traced)} arguments and is called "
                           f"with {len(treedefs)}",
                           hint="pass the same arguments the step was traced with")
    for k, (was, now) in enumerate(zip(traced, treedefs)):
        if was == now:
            continue
        old, new = _paths(was), _paths(now)
        if old == new:
            continue
        raise BackendError(
            f"argument {k} of the step has another structure than when it was traced: its "
            f"leaves were {_few(old)} and are {_few(new)}; the program takes leaves by "
            "position, so it would read them as other arrays",
            hint="call the step with the trees it was traced with (the same dict keys, "
                 "dataclass fields and nesting), or compile it again for the new ones")


def _few(paths: list[str], n: int = 4) -> str:
    shown = ", ".join(p or "(the argument)" for p in paths[:n])
    return shown + (f", ... ({len(paths)} leaves)" if len(paths) > n else "")


def _paths(treedef: Any) -> list[str]:
    """Each leaf's key path in ``treedef`` (``['inp']``, ``[0].w``): two structures that
    differ only in their containers' kinds (tuple, list) have the same paths."""
    tree = jax.tree_util.tree_unflatten(treedef, range(treedef.num_leaves))
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
