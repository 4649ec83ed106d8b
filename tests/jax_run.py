"""Running one-op IR graphs in JAX for the strategy property tests
(tests/strategy_props.py): every graph of a case in one jitted program."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from diphoma_compile.ir import Graph
from diphoma_compile.jax.compile import graph_function


def _grid(idx, dim: int) -> tuple:
    """Index arrays addressing, at each position of ``idx``, the operand element whose
    coordinate along ``dim`` is the index there (torch's gather and scatter_add)."""
    grid = list(jnp.indices(idx.shape))
    grid[dim] = idx
    return tuple(grid)


# the neutral ops the JAX backend has no lowering for yet, by their meaning
_REFERENCE = {
    "gather": lambda o, x, i: x[_grid(i, o.attrs["dim"])],
    "scatter_add": lambda o, b, i, u: b.at[_grid(i, o.attrs["dim"])].add(u),
}


def _function(graph: Graph):
    """The one-op graph as a function of its input arrays."""
    (op,) = graph.ops
    if op.name in _REFERENCE:
        return lambda *xs: [_REFERENCE[op.name](op, *xs)]
    return graph_function(graph)


def run_jax(jobs: Sequence[tuple[Graph, list[np.ndarray]]]) -> list[list[np.ndarray]]:
    """Every (graph, arrays) job through the JAX backend's lowering of its op, all in one
    jitted program (one compilation for the whole batch of jobs). The jobs of one graph
    (every device's piece of a strategy) run as one op, vmapped over the devices."""
    groups: dict[str, list[int]] = {}
    for j, (g, _) in enumerate(jobs):
        groups.setdefault(str(g), []).append(j)
    order = list(groups.values())
    fns = [jax.vmap(_function(jobs[js[0]][0]), axis_size=len(js)) for js in order]
    stacked = [[np.stack([jobs[j][1][i] for j in js]) for i in range(len(jobs[js[0]][1]))]
               for js in order]

    def program(args):
        return [list(fn(*xs)) for fn, xs in zip(fns, args)]
    results = jax.jit(program)(stacked)
    out: list = [None] * len(jobs)
    for js, res in zip(order, results):
        res = [np.asarray(r) for r in res]    # indexing device arrays compiles a slice
        for k, j in enumerate(js):
            out[j] = [r[k] for r in res]
    return out
