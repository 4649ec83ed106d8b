"""The public entry points dispatch to the right frontend and backend."""

from __future__ import annotations

import pytest

import diphoma_compile
from diphoma_compile.errors import DiphomaError


def test_jax_step_through_public_api():
    jax = pytest.importorskip("jax")
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    import numpy as np
    from tests.jax_steps import make_case

    from diphoma_compile.jax.trace import trace_jax
    step, (params, opt_state, batch) = make_case("mlp", "linen", "adamw")
    g = diphoma_compile.trace(step, params, opt_state, batch)
    assert g == trace_jax(step, params, opt_state, batch)
    compiled = diphoma_compile.compile(step, params, opt_state, batch, passes="dce,cse")
    ours = compiled(params, opt_state, batch)
    ref = jax.jit(step)(params, opt_state, batch)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(ours)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_torch_step_through_public_api():
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model, opt, x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    g = diphoma_compile.trace(step, model, opt, torch.ones(3, 4))
    assert {i.name for i in g.inputs} == {"weight", "bias", "lr", "x"}


def test_no_framework_values_is_an_error():
    with pytest.raises(DiphomaError):
        diphoma_compile.trace(lambda a, b: a, 1, 2)


def test_compile_without_example_arguments_says_to_pass_them():
    """``compile(step)`` alone, as ``torch.compile`` is called: the error says the example
    arguments go with the step."""
    with pytest.raises(DiphomaError, match="no example arguments") as got:
        diphoma_compile.compile(lambda model, opt, x: None)
    assert "compile(step, model, opt, batch)" in got.value.hint
