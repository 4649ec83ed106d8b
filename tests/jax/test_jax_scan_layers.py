"""Layers scanned over the activations (flax's ``nn.scan``, a ``lax.scan`` over stacked
weights: how MaxText-style and equinox models keep compile time flat) under data and
pipeline parallelism: the scan runs on each device's own activations, its body's values per
device where they are made from them (the data-parallel pass, with the verifier matching
the body to the scan's operands and results), and a pipeline places the scan whole on one
stage, its captures received there."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
nn = pytest.importorskip("flax.linen")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import diphoma_compile  # noqa: E402
from diphoma_compile import Mesh  # noqa: E402
from diphoma_compile.ir import print_graph  # noqa: E402
from diphoma_compile.jax.trace import trace_jax  # noqa: E402
from diphoma_compile.passes import PassContext  # noqa: E402
from diphoma_compile.passes.pipeline import Pipeline  # noqa: E402


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.Dense(32)(nn.LayerNorm()(x))
        return x + nn.Dense(16)(nn.gelu(h)), None


class Scanned(nn.Module):
    """A dense layer in, four residual blocks under nn.scan (weights stacked [4, ...]), a
    norm and a dense layer out."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16)(x)
        stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                        length=4)
        x, _ = stack()(x, None)
        return nn.Dense(4)(nn.LayerNorm()(x))


def _case():
    model, tx = Scanned(), optax.sgd(0.1, momentum=0.9)
    rng = np.random.default_rng(0)
    batch = {"x": jnp.asarray(rng.standard_normal((16, 8)), jnp.float32),
             "y": jnp.asarray(rng.standard_normal((16, 4)), jnp.float32)}
    params = model.init(jax.random.PRNGKey(0), batch["x"])["params"]

    def step(params, opt_state, batch):
        def loss_fn(p):
            return jnp.mean((model.apply({"params": p}, batch["x"]) - batch["y"]) ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step, params, tx, batch


def _train(step, params, tx, batch, steps=3):
    state, losses = (params, tx.init(params)), []
    for _ in range(steps):
        *state, loss = step(*state, batch)
        losses.append(float(loss))
    return state, losses


@pytest.mark.parametrize("mesh", [{"dp": 8}, {"dp": 4, "pp": 2}])
def test_flax_scanned_blocks_match_the_single_device_step(mesh):
    """nn.scan over four blocks (their weights stacked), SGD momentum: the losses and the
    parameters of 3 steps under dp=8 and dp=4 x pp=2 (the scan whole on one stage) match
    the single-device step. Before, the data-parallel pass refused any scan over the batch
    ("per-device control flow is not supported yet")."""
    step, params, tx, batch = _case()
    (ref, _), ref_losses = _train(jax.jit(step), params, tx, batch)
    ps = diphoma_compile.parallelize(step, mesh)
    (got, _), losses = _train(ps, params, tx, batch)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    if "pp" not in mesh:
        got = ps.user_shapes(got, 0)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    assert not np.allclose(np.asarray(ref["ScanBlock_0"]["Dense_0"]["kernel"]),
                           np.asarray(params["ScanBlock_0"]["Dense_0"]["kernel"]))


def test_golden_data_parallel_scan(golden):
    """The data-parallel pass on a lax.scan over two stacked weights and one every
    iteration reads: the carried activations and the stacked residuals per device (V) in
    forward (the body's constant 1.0 stays replicated); in backward the shared weight's
    gradient, summed over the iterations in a carry from replicated zeros, enters the scan
    through as_varying; both gradients averaged before the update."""
    tx = optax.sgd(0.1)

    def step(params, opt_state, x):
        def loss_fn(p):
            h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w @ p["shared"]), None), x,
                                p["stack"])
            return jnp.mean(h ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = {"stack": jnp.full((2, 4, 4), 0.1), "shared": jnp.eye(4)}
    g = trace_jax(step, params, tx.init(params), jnp.ones((2, 4)), locations=False)
    g = Pipeline.from_spec("dce,data-parallel{axis=dp}").run(g.replace(mesh=Mesh({"dp": 8})),
                                                              PassContext())
    text = print_graph(g)
    assert "scan(" in text and text.count("all_reduce") == 3      # the loss, 2 gradients
    assert "%c: f32[] = full()" in text and text.count("= as_varying(") == 1
    golden("jax_scan_sgd.dp8.ir", text)


def test_control_flow_other_than_a_scan_or_a_keyed_draw_in_one_is_refused():
    """A while loop over the batch (its trip count may differ per device) and dropout from
    a key inside a scanned layer (every device would repeat the same masks) stay refused,
    each saying why."""
    tx = optax.sgd(0.1)

    def stepper(loss_fn):
        def step(params, opt_state, x, key):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, key)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss
        return step

    def looped(p, x, key):       # a scale found by a loop over the batch's values
        scale = jax.lax.while_loop(lambda s: jnp.sum(x * s) < 100.0, lambda s: s * 2, 1.0)
        return jnp.mean((x @ p) ** 2) * jax.lax.stop_gradient(scale)

    def dropped(p, x, key):
        def body(h, k):
            return jnp.where(jax.random.bernoulli(k, 0.5, h.shape), jnp.tanh(h @ p), 0.), None
        h, _ = jax.lax.scan(body, x, jax.random.split(key, 2))
        return jnp.mean(h ** 2)

    params = jnp.full((4, 4), 0.1)
    for fn, words in ((looped, "other than a flat lax.scan"),
                      (dropped, "drawn from a JAX key inside scan")):
        with pytest.raises(diphoma_compile.DiphomaError) as e:
            diphoma_compile.parallelize(stepper(fn), {"dp": 8}, batch_argnums=2).trace(
                params, tx.init(params), jnp.ones((16, 4)), jax.random.PRNGKey(1))
        assert words in str(e.value), str(e.value)


def test_more_stages_than_places_around_a_scan_is_refused_saying_so():
    """Dense in, the scan, norm and dense out: three places for stages, so pp=4 is refused,
    and the reason names the scan (it runs whole on one stage)."""
    step, params, tx, batch = _case()
    with pytest.raises(diphoma_compile.DiphomaError) as e:
        diphoma_compile.parallelize(step, {"dp": 2, "pp": 4}).trace(params, tx.init(params),
                                                                     batch)
    assert "a lax.scan over layers is one layer here" in str(e.value)


def test_an_rnn_scanned_over_time_matches_the_single_device_step():
    """A recurrent cell scanned over 5 time steps, its weights read by every step (their
    gradients summed over the steps in carries that start as replicated zeros and enter
    the backward scan through as_varying), AdamW over dp=8: losses and parameters of 3
    steps match the single-device step."""
    tx = optax.adamw(1e-2)

    def loss_fn(p, x):
        def cell(h, xt):
            h = jnp.tanh(h @ p["wh"] + xt @ p["wx"] + p["b"])
            return h, h
        h, hs = jax.lax.scan(cell, jnp.zeros((x.shape[0], 16)), jnp.swapaxes(x, 0, 1))
        return jnp.mean((h @ p["out"]) ** 2) + 0.1 * jnp.mean(hs ** 2)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch["x"])
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(1)
    params = {"wh": jnp.asarray(rng.standard_normal((16, 16)) * 0.3, jnp.float32),
              "wx": jnp.asarray(rng.standard_normal((8, 16)) * 0.3, jnp.float32),
              "b": jnp.zeros(16), "out": jnp.asarray(rng.standard_normal((16, 4)) * 0.3,
                                                     jnp.float32)}
    batch = {"x": jnp.asarray(rng.standard_normal((16, 5, 8)), jnp.float32)}
    (ref, _), ref_losses = _train(jax.jit(step), params, tx, batch)
    ps = diphoma_compile.parallelize(step, {"dp": 8})
    (got, _), losses = _train(ps, params, tx, batch)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(ps.user_shapes(got, 0)), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    assert any(op.name == "as_varying" for op in ps.graph.ops)


def test_scan_edge_cases_plan_or_refuse_rightly():
    """Found in review: a carry that enters per device while the body yields a whole value
    for it (reset each step) is fed through as_varying inside the body and matches one
    device; a stacked output of the weights alone stays whole and shard_params=True plans
    and matches; dropout masks drawn from a key outside the scan and passed in as its
    scanned input are refused (every device would repeat them), as inside."""
    tx = optax.sgd(0.1, momentum=0.9)

    def stepper(loss_fn):
        def step(params, opt_state, batch):
            loss, grads = jax.value_and_grad(loss_fn)(params, batch["x"])
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss
        return step

    def reset(p, x):
        c, ys = jax.lax.scan(lambda c, xt: (jnp.zeros_like(c), jnp.tanh(c @ p["w"] + xt)), x,
                             jnp.stack([x * 0.5, x, x * 2]))
        return jnp.mean(ys ** 2) + jnp.mean(c)

    def norms(p, x):
        h, n = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), jnp.sum(w * w)), x, p["stack"])
        return jnp.mean(h ** 2) + 0.01 * jnp.sum(n)

    def masked(p, x):
        masks = jax.random.bernoulli(jax.random.PRNGKey(3), 0.5, (3,) + x.shape)
        h, _ = jax.lax.scan(lambda h, m: (jnp.where(m, jnp.tanh(h @ p["w"]), 0.0), None), x,
                            masks)
        return jnp.mean(h ** 2)

    rng = np.random.default_rng(2)
    params = {"w": jnp.asarray(rng.standard_normal((8, 8)) * 0.3, jnp.float32),
              "stack": jnp.asarray(rng.standard_normal((3, 8, 8)) * 0.3, jnp.float32)}
    batch = {"x": jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)}
    for fn, kw in ((reset, {}), (norms, {"shard_params": True})):
        _, ref_losses = _train(jax.jit(stepper(fn)), params, tx, batch, steps=2)
        _, losses = _train(diphoma_compile.parallelize(stepper(fn), {"dp": 8}, **kw), params,
                           tx, batch, steps=2)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    with pytest.raises(diphoma_compile.DiphomaError) as e:
        diphoma_compile.parallelize(stepper(masked), {"dp": 8}).trace(params, tx.init(params),
                                                                      batch)
    assert "drawn from a JAX key (dropout masks made outside the scan" in str(e.value)


@pytest.mark.parametrize("library", ["haiku", "equinox"])
def test_other_libraries_scanned_layers_match_the_single_device_step(library):
    """The same with the other libraries' ways of scanning layers, unmodified: haiku's
    hk.experimental.layer_stack and equinox's stacked layers (filter_vmap) under lax.scan,
    SGD momentum over dp=8: the losses of 2 steps match the single-device step."""
    tx = optax.sgd(0.1, momentum=0.9)
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((16, 4)), jnp.float32)
    if library == "haiku":
        hk = pytest.importorskip("haiku")

        def fwd(x):
            @hk.experimental.layer_stack(3)
            def stack(h):
                return h + jnp.tanh(hk.Linear(16)(hk.LayerNorm(-1, True, True)(h)))
            return hk.Linear(4)(stack(hk.Linear(16)(x)))
        f = hk.without_apply_rng(hk.transform(fwd))
        params, apply = f.init(jax.random.PRNGKey(0), x), f.apply
    else:
        eqx = pytest.importorskip("equinox")
        keys = jax.random.split(jax.random.PRNGKey(0), 3)
        model = (eqx.nn.Linear(8, 16, key=keys[0]),
                 eqx.filter_vmap(lambda k: eqx.nn.Linear(16, 16, key=k))(
                     jax.random.split(keys[1], 3)),
                 eqx.nn.Linear(16, 4, key=keys[2]))
        params, static = eqx.partition(model, eqx.is_array)

        def apply(p, x):
            first, stacked, last = eqx.combine(p, static)
            layers, rest = eqx.partition(stacked, eqx.is_array)

            def body(h, layer):
                return h + jnp.tanh(jax.vmap(eqx.combine(layer, rest))(h)), None
            h, _ = jax.lax.scan(body, jax.vmap(first)(x), layers)
            return jax.vmap(last)(h)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(
            lambda p: jnp.mean((apply(p, batch["x"]) - batch["y"]) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    batch = {"x": x, "y": y}
    _, ref_losses = _train(jax.jit(step), params, tx, batch, steps=2)
    ps = diphoma_compile.parallelize(step, {"dp": 8})
    _, losses = _train(ps, params, tx, batch, steps=2)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert any(op.name == "scan" for op in ps.graph.ops)
