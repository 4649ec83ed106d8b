"""Steps over a flax TrainState, as flax's own training loops write them:
``step(state, batch, *rest) -> (state.apply_gradients(grads=...), loss)``
(jax/train_state.py). compile() against jax.jit of the same step bit for bit, parallelize()
on 8 devices within rounding, over several steps; a TrainState subclass holding BatchNorm
statistics; the errors."""

from __future__ import annotations

from typing import Any

import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
optax = pytest.importorskip("optax")

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax.training import train_state  # noqa: E402

import diphoma_compile  # noqa: E402
from diphoma_compile.errors import DiphomaWarning, FrontendError  # noqa: E402

STEPS = 3


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        h = nn.Dropout(0.2, deterministic=not train)(nn.relu(nn.Dense(16)(x)))
        return nn.Dense(4)(h)


class BNNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        h = nn.BatchNorm(use_running_average=not train)(nn.Dense(16)(x))
        return nn.Dense(4)(nn.relu(h))


class BNState(train_state.TrainState):
    batch_stats: Any


def _data():
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    return k[0], (jax.random.normal(k[1], (32, 8)), jax.random.normal(k[2], (32, 4)))


def step(state, batch, key):
    def loss_of(p):
        out = state.apply_fn({"params": p}, batch[0], rngs={"dropout": key})
        return jnp.mean((out - batch[1]) ** 2)
    loss, grads = jax.value_and_grad(loss_of)(state.params)
    return state.apply_gradients(grads=grads), loss


def bn_step(state, batch):
    def loss_of(p):
        out, new = state.apply_fn({"params": p, "batch_stats": state.batch_stats}, batch[0],
                                  mutable=["batch_stats"])
        return jnp.mean((out - batch[1]) ** 2), new["batch_stats"]
    (loss, stats), grads = jax.value_and_grad(loss_of, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads).replace(batch_stats=stats), loss


def _state():
    k, batch = _data()
    net = Net()
    params = net.init(k, batch[0], train=False)["params"]
    return train_state.TrainState.create(apply_fn=net.apply, params=params,
                                         tx=optax.adamw(1e-2)), batch


def _leaves_equal(a, b, tol=0.0) -> bool:
    return all(float(jnp.max(jnp.abs(jnp.asarray(x, jnp.float32) - jnp.asarray(y, jnp.float32))))
               <= tol for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_compile_of_a_train_state_step_is_bit_exact():
    state, batch = _state()
    compiled = diphoma_compile.compile(step, state, batch, jax.random.PRNGKey(1))
    ours = ref = state
    for i in range(STEPS):
        key = jax.random.PRNGKey(10 + i)
        ours, loss = compiled(ours, batch, key)
        ref, want = jax.jit(step)(ref, batch, key)
        assert float(loss) == float(want)
    assert isinstance(ours, train_state.TrainState) and int(ours.step) == STEPS
    assert ours.apply_fn is state.apply_fn and ours.tx is state.tx
    assert _leaves_equal((ours.params, ours.opt_state), (ref.params, ref.opt_state))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_parallelize_of_a_train_state_step_matches_the_single_device_step():
    """On 8 devices with dropout from the step's key (each device keeps its rows of the
    global batch's masks): losses and parameters within 1e-5 over three steps."""
    state, batch = _state()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    pstep = diphoma_compile.parallelize(step, mesh, axis="data")
    ours = ref = state
    for i in range(STEPS):
        key = jax.random.PRNGKey(10 + i)
        ours, loss = pstep(ours, batch, key)
        ref, want = jax.jit(step)(ref, batch, key)
        np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    assert int(ours.step) == STEPS
    assert _leaves_equal(ours.params, ref.params, 1e-5)
    assert pstep.plan.notes["data-parallel"]["random_per_row"]


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_a_returned_train_state_comes_back_in_the_users_shapes():
    """The state parallelize returns holds leaves no dim of which divides 8 as padded flat
    pieces (a [4] bias's Adam moments as [8]); user_shapes(state) had no way to give them
    back (a review, 2026-12-07): it returns the TrainState whole, its parameters and
    optimizer state in the user's shapes, which one device then continues from."""
    state, batch = _state()
    pstep = diphoma_compile.parallelize(step, {"dp": 8})
    ours, _ = pstep(state, batch, jax.random.PRNGKey(10))
    ref, _ = jax.jit(step)(state, batch, jax.random.PRNGKey(10))
    assert jax.tree.map(jnp.shape, ours.opt_state) != jax.tree.map(jnp.shape, ref.opt_state)
    mine = pstep.user_shapes(ours)
    assert isinstance(mine, train_state.TrainState) and int(mine.step) == 1
    assert jax.tree.map(jnp.shape, mine.opt_state) == jax.tree.map(jnp.shape, ref.opt_state)
    assert _leaves_equal((mine.params, mine.opt_state), (ref.params, ref.opt_state), 1e-5)
    jax.jit(step)(mine, batch, jax.random.PRNGKey(11))      # continues on one device
    with pytest.raises(diphoma_compile.DiphomaError, match=r"user_shapes\(state\)"):
        pstep.user_shapes(ours.opt_state)


def test_a_train_state_holding_batch_norm_statistics():
    """A TrainState subclass with ``batch_stats`` (flax's documented BatchNorm recipe):
    the statistics are model state the step returns; bit for bit with jax.jit."""
    k, batch = _data()
    net = BNNet()
    v = net.init(k, batch[0], train=False)
    state = BNState.create(apply_fn=net.apply, params=v["params"], tx=optax.sgd(0.1, 0.9),
                           batch_stats=v["batch_stats"])
    compiled = diphoma_compile.compile(bn_step, state, batch)
    graph = diphoma_compile.trace(bn_step, state, batch)
    assert any(i.role.kind.value == "buffer" for i in graph.inputs)
    ours = ref = state
    for _ in range(STEPS):
        ours, loss = compiled(ours, batch)
        ref, want = jax.jit(bn_step)(ref, batch)
        assert float(loss) == float(want)
    assert _leaves_equal((ours.params, ours.batch_stats), (ref.params, ref.batch_stats))


def test_batch_norm_statistics_as_wide_as_the_batch_are_not_taken_for_batch():
    """A BatchNorm over 16 features with a global batch of 16 rows: the TrainState's
    ``batch_stats`` have the batch's rows by coincidence. They are model state, never batch
    (before: refused, naming "step argument 3", an argument the user never wrote); the
    step runs over 8 devices with the batch norm warned of (each device normalizes its
    share, as under DDP)."""
    k, batch = _data()
    batch = (batch[0][:16], batch[1][:16])
    net = BNNet()
    v = net.init(k, batch[0], train=False)
    state = BNState.create(apply_fn=net.apply, params=v["params"], tx=optax.sgd(0.1, 0.9),
                           batch_stats=v["batch_stats"])
    assert jax.tree.leaves(state.batch_stats)[0].shape == (16,)
    pstep = diphoma_compile.parallelize(bn_step, jax.make_mesh((8,), ("data",)), axis="data")
    with pytest.warns(DiphomaWarning, match="combines examples of its batch"):
        new, loss = pstep(state, batch)
    assert new.step == 1 and jnp.isfinite(loss)
    assert jax.tree.leaves(new.batch_stats)[0].shape == (16,)


def test_a_train_state_step_returning_something_else_is_refused():
    state, batch = _state()

    def bad(state, batch, key):
        loss, grads = jax.value_and_grad(
            lambda p: jnp.mean(state.apply_fn({"params": p}, batch[0], train=False)))(
                state.params)
        return loss, state.apply_gradients(grads=grads)
    with pytest.raises(FrontendError, match=r"expected \(new_state, \*metrics\)"):
        diphoma_compile.compile(bad, state, batch, jax.random.PRNGKey(1))


class Deep(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(8):
            x = jnp.tanh(nn.Dense(16)(x))
        return nn.Dense(4)(x)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_a_train_state_step_through_a_pipeline():
    """The same adapter under a dp=2 x pp=4 pipeline of 2 microbatches: losses and
    parameters within 1e-5 of the single-device step, the step counter advanced."""
    k, batch = _data()
    net = Deep()
    state = train_state.TrainState.create(apply_fn=net.apply,
                                          params=net.init(k, batch[0])["params"],
                                          tx=optax.adamw(1e-2))

    def plain(state, batch):
        loss, grads = jax.value_and_grad(
            lambda p: jnp.mean((state.apply_fn({"params": p}, batch[0]) - batch[1]) ** 2))(
                state.params)
        return state.apply_gradients(grads=grads), loss
    pstep = diphoma_compile.parallelize(plain, {"dp": 2, "pp": 4}, microbatches=2)
    ours = ref = state
    for _ in range(STEPS):
        ours, loss = pstep(ours, batch)
        ref, want = jax.jit(plain)(ref, batch)
        np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    assert int(ours.step) == STEPS and _leaves_equal(ours.params, ref.params, 1e-5)
