"""The JAX frontend marks what passes must know of a primitive it keeps whole: random draws
from a key carry ``rng=key``, and the backend still binds the primitive without it."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from diphoma_compile.ir.ops import random_draw  # noqa: E402
from diphoma_compile.jax.compile import compile_jax  # noqa: E402
from diphoma_compile.jax.trace import trace_jax_with_tree  # noqa: E402


def test_key_draws_are_marked_and_still_run():
    def step(params, opt_state, batch, key):
        mask = jax.random.bernoulli(key, 0.5, batch.shape)
        loss = jnp.mean(jnp.where(mask, batch, 0.0) @ params["w"])
        return params, opt_state, loss
    args = ({"w": jnp.arange(4.0)}, (), jnp.ones((8, 4)), jax.random.key(1))
    graph, tree = trace_jax_with_tree(step, *args)
    draws = [op for op in graph.ops if random_draw(op)]
    assert draws and all(op.name == "opaque" and op.attrs["rng"] == "key" for op in draws)
    assert {str(op.attrs["target"]) for op in draws} & {"jax:random_bits", "jax:threefry2x32"}
    got = compile_jax(graph, out_tree=tree)(*args)[2]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(step)(*args)[2]))
