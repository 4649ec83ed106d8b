"""The JAX op table: one row per neutral op, each primitive in one row, both directions."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")

import numpy as np  # noqa: E402

from diphoma_compile.ir.ops import op_def  # noqa: E402
from diphoma_compile.jax.compile import compile_jax  # noqa: E402
from diphoma_compile.jax.ops import BY_OP, BY_PRIMITIVE, TABLE  # noqa: E402
from diphoma_compile.jax.trace import trace_jax  # noqa: E402


def test_one_row_per_op_and_per_primitive():
    assert len(BY_OP) == len(TABLE)
    primitives = [p for row in TABLE for p in row.primitives]
    assert len(set(primitives)) == len(primitives)
    assert all(BY_PRIMITIVE[p].op == row.op for row in TABLE for p in row.primitives)


def test_every_row_is_a_neutral_op():
    for row in TABLE:
        op_def(row.op)   # raises for a name the IR does not define


def test_a_converted_primitive_is_emitted_back():
    def step(params, opt_state, batch):
        loss = jax.numpy.sum(jax.nn.sigmoid(batch @ params["w"]))
        return params, opt_state, loss

    params, x = {"w": np.ones((3, 2), np.float32)}, np.ones((4, 3), np.float32)
    graph = trace_jax(step, params, (), x)
    assert {"dot", "sigmoid", "reduce_sum"} <= {op.name for op in graph.ops}
    _, _, loss = compile_jax(graph)(params, (), x)
    np.testing.assert_allclose(loss, jax.jit(step)(params, (), x)[2])
