"""The strategy menus of the neutral ops, run in JAX: every strategy over 2 and 4 devices
gives the op's whole result (tests/strategy_props.py says how)."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

# without x64, JAX computes the i64 and f64 of some cases in 32 bits (both sides alike)
pytestmark = pytest.mark.filterwarnings("ignore:Explicitly requested dtype:UserWarning")

import jax.numpy as jnp  # noqa: E402

from diphoma_compile.ir import Graph  # noqa: E402
from diphoma_compile.jax.compile import graph_function  # noqa: E402
from tests.strategy_props import assert_all, check_case, neutral_cases  # noqa: E402


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


def run_jax(jobs) -> list[list[np.ndarray]]:
    """Every (graph, arrays) job through the JAX backend's lowering of its op, all in one
    jitted program (one compilation for the whole case)."""
    fns = [_function(g) for g, _ in jobs]
    counts = [len(xs) for _, xs in jobs]

    def program(*flat):
        out, at = [], 0
        for fn, c in zip(fns, counts):
            out.append(list(fn(*flat[at:at + c])))
            at += c
        return out
    results = jax.jit(program)(*(x for _, xs in jobs for x in xs))
    return [[np.asarray(o) for o in r] for r in results]


CASES = neutral_cases(seed=1)


@pytest.mark.parametrize("family", sorted({c.name for c in CASES}))
def test_every_strategy_gives_the_whole_result(family):
    assert_all([check_case(c, run_jax, seed=k) for k, c in enumerate(CASES)
                if c.name == family])


