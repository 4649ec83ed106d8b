"""Pipeline parallelism is not built for JAX yet: a mesh with a pp axis is refused with a
message that says so, before anything is traced."""

from __future__ import annotations

import jax
import optax
import pytest

import diphoma_compile
from diphoma_compile.errors import FrontendError
from tests.jax_steps import DIM, LinenBlock, squares_step


@pytest.mark.parametrize("mesh, kw", [({"dp": 1, "pp": 2}, {}),
                                      ({"dp": 1, "pp": 2}, {"microbatches": 1})])
def test_a_pp_axis_is_refused_for_jax_steps(mesh, kw):
    model = LinenBlock()
    x = jax.random.normal(jax.random.key(1), (4, 8, DIM))
    params = model.init(jax.random.key(0), x)["params"]
    tx = optax.sgd(0.1)
    step = diphoma_compile.parallelize(squares_step(model, tx), mesh, **kw)
    with pytest.raises(FrontendError) as e:
        step.trace(params, tx.init(params), x)
    assert "pipeline parallelism" in str(e.value) and "not supported for JAX" in str(e.value)
