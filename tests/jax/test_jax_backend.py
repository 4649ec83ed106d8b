"""The JAX backend: control flow, opaque primitives and PRNG keys re-bound exactly; output
pytrees; hand-written IR; errors for calls and graphs it cannot run."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")

nn = pytest.importorskip("flax.linen")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from tests.jax_steps import mlp_batch  # noqa: E402

from diphoma_compile.jax.compile import compile_jax, graph_function  # noqa: E402
from diphoma_compile.errors import BackendError  # noqa: E402
from diphoma_compile.jax.trace import trace_jax  # noqa: E402
from diphoma_compile.ir import parse, print_graph  # noqa: E402


def _key_data(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(x)
    return x


def assert_identical(ref, ours) -> None:
    assert jax.tree.structure(ours) == jax.tree.structure(ref)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(ours)):
        a, b = np.asarray(_key_data(a)), np.asarray(_key_data(b))
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes(), (a, b)


@jax.custom_vjp
def _sin(x):
    return jnp.sin(x)


_sin.defvjp(lambda x: (jnp.sin(x), x), lambda r, t: (t * jnp.cos(r),))


def _control_step(params, opt_state, batch, key):
    """A step that exercises nested jaxprs, opaque primitives and PRNG keys."""
    def loss_fn(p):
        w = p["w"]
        y = jax.jit(_sin)(w * batch)
        y = lax.cond(y.sum() > 0, lambda a: a * 2, lambda a: a - 1, y)
        y, ys = lax.scan(lambda c, x: (c + x * w, c * 2), y, jnp.ones((3,) + w.shape))
        y = jax.checkpoint(lambda a: jnp.sin(a) * 2)(y)
        return jnp.mean(y ** 2) + ys.sum() * 1e-3
    loss, g = jax.value_and_grad(loss_fn)(params)
    noise = jax.random.uniform(key, params["w"].shape)
    new = {"w": params["w"] - 0.1 * g["w"] * noise}
    w = new["w"]
    extras = (jnp.round(w * 3), jnp.take(w, jnp.array([0, 2])), jnp.cumsum(w), jnp.argmax(w),
              jnp.sort(w), jnp.pad(w, (1, 2)), jnp.clip(w, -0.5, 0.5), jnp.concatenate([w, w]),
              2.0 ** jnp.arange(3), lax.dynamic_slice(w, (1,), (2,)), jax.random.split(key),
              jnp.linalg.norm(w), w.astype(jnp.bfloat16), jnp.where(w > 0, w, 0.0),
              lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * batch), (0, w))[1],
              jnp.zeros(5).at[jnp.array([1, 1, 3])].add(1.0))
    return new, {"m": opt_state["m"] * 0.9 + g["w"]}, loss, extras


ARGS = ({"w": jnp.linspace(-1.0, 1.0, 4)}, {"m": jnp.zeros(4)}, jnp.full(4, 0.5),
        jax.random.key(0))


@pytest.fixture(scope="module")
def control_graph():
    return trace_jax(_control_step, *ARGS)


def test_control_flow_opaque_and_keys_run_bit_identical(control_graph):
    assert parse(print_graph(control_graph)) == control_graph
    assert_identical(jax.jit(_control_step)(*ARGS), compile_jax(control_graph)(*ARGS))


def test_opaque_ops_keep_the_primitive_and_its_parameters(control_graph):
    targets = {str(op.attrs["target"]) for op in control_graph.walk() if op.name == "opaque"}
    assert {"jax:gather", "jax:scatter-add", "jax:cumsum", "jax:sort", "jax:random_bits",
            "jax:random_split", "jax:argmax"} <= targets
    gather = next(op for op in control_graph.walk() if op.attrs.get("target") == "jax:gather")
    assert gather.attrs["mode"] == "!enum:jax._src.lax.slicing:GatherScatterMode:FILL_OR_DROP"


class _Bf16Dropout(nn.Module):
    @nn.compact
    def __call__(self, x, key):
        h = nn.relu(nn.Dense(16, dtype=jnp.bfloat16)(x))
        h = nn.Dropout(0.5, deterministic=False)(h, rng=key)
        return nn.Dense(4, dtype=jnp.bfloat16)(h).astype(jnp.float32)


class _Layer(nn.Module):
    @nn.compact
    def __call__(self, carry, _):
        return nn.tanh(nn.Dense(6)(carry)), None


class _ScannedRemat(nn.Module):
    @nn.compact
    def __call__(self, x, key):
        layers = nn.scan(nn.remat(_Layer), variable_axes={"params": 0},
                         split_rngs={"params": True}, length=3)
        return layers()(x, None)[0][:, :4]


@pytest.mark.parametrize("module, key", [
    (_Bf16Dropout, jax.random.key(5)), (_Bf16Dropout, jax.random.PRNGKey(5)),
    (_ScannedRemat, jax.random.key(5)),
], ids=["bf16-dropout-typed-key", "bf16-dropout-raw-key", "nn.scan-remat"])
def test_flax_features_run_bit_identical(module, key):
    m = module()
    x, y = mlp_batch()
    params = jax.eval_shape(m.init, jax.random.key(0), x, key)["params"]
    params = jax.tree.map(  # numpy values: no eager JAX compiles for the initializers
        lambda a: np.sin(np.arange(a.size, dtype=a.dtype)).reshape(a.shape) * 0.5, params)
    tx = optax.adamw(1e-2)

    def step(p, s, batch, key):
        def loss_fn(p):
            return jnp.mean((m.apply({"params": p}, batch[0], key) - batch[1]) ** 2)
        loss, g = jax.value_and_grad(loss_fn)(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    args = (params, tx.init(params), (x, y), key)
    assert_identical(jax.jit(step)(*args), compile_jax(trace_jax(step, *args))(*args))


def test_rewritten_graph_keeps_the_users_pytrees(control_graph):
    # A pass returns a new graph object with the same signature: the structure is found.
    rewritten = control_graph.replace(passes=("dce",))
    assert_identical(jax.jit(_control_step)(*ARGS), compile_jax(rewritten)(*ARGS))


def test_unknown_signature_returns_params_opt_state_then_metric_leaves(control_graph):
    # Without a recorded structure, the outputs are rebuilt from the roles: replacing
    # outputs take their inputs' places, the other outputs follow as flat leaves.
    fewer = control_graph.replace(outputs=control_graph.outputs[:-1])
    new, opt, loss, *extras = compile_jax(fewer)(*ARGS)
    ref = jax.jit(_control_step)(*ARGS)
    assert_identical((ref[0], ref[1], ref[2]), (new, opt, loss))
    assert len(extras) == len(jax.tree.leaves(ref[3])) - 1


def test_explicit_out_tree_wins(control_graph):
    flat = compile_jax(control_graph, out_tree=jax.tree.structure(
        tuple(range(len(control_graph.outputs)))))(*ARGS)
    assert isinstance(flat, tuple) and len(flat) == len(control_graph.outputs)


def test_call_with_other_shapes_fails(control_graph):
    step = compile_jax(control_graph)
    with pytest.raises(BackendError, match=r"params/w is float32\[5\]; the graph expects f32\[4\]"):
        step({"w": jnp.zeros(5)}, *ARGS[1:])
    with pytest.raises(BackendError, match="traced with 4 arguments and is called with 3"):
        step(*ARGS[:3])
    # a graph with no traced trees (rewritten by hand) still counts the leaves
    hand = compile_jax(control_graph.replace(name="by_hand"))
    with pytest.raises(BackendError, match="called with 3 array leaves; the graph takes 4"):
        hand(*ARGS[:3])


HAND_WRITTEN = """
graph @hand (
  %x: f32[2,3] batch,
  %w: f32[3] param,
) {
  %r: f32[2,3] = relu(%x)
  %s: f32[2,3] = add(%r, %w) {alpha=0.5}
  %g: f32[2,3] = gelu(%s) {approximate=tanh}
  %m: f32[2] = reduce_mean(%g) {dims=[1]}
  %k: f32[2,1] = reduce_max(%g) {dims=[1], keepdim=true}
  %l: f32[] = reduce_sum(%m) {dims=[0]}
  return (%l loss, %k metric)
}
"""


def test_neutral_ops_from_other_frontends_run():
    g = parse(HAND_WRITTEN)
    x = np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5
    w = np.array([0.5, -1.0, 2.0], np.float32)
    loss, k = compile_jax(g)(x, w)
    s = jax.nn.gelu(np.maximum(x, 0) + 0.5 * w, approximate=True)
    np.testing.assert_allclose(loss, s.mean(1).sum(), rtol=1e-6)
    np.testing.assert_allclose(k, s.max(1, keepdims=True), rtol=1e-6)


BROADCASTING = """
graph @bcast (
  %p: bool[2,1] batch,
  %a: f32[3] batch,
  %b: f32[] batch,
  %lo: f32[1,3] batch,
) {
  %s: f32[2,3] = select(%p, %a, %b)
  %c: f32[2,3] = clamp(%a, %lo, %b)
  return (%s metric, %c metric)
}
"""


def test_select_and_clamp_broadcast_their_operands():
    # the IR's select and clamp broadcast like every elementwise op (the PyTorch frontend's
    # where and clamp do); JAX's select_n and clamp take one shape (or a 0-d bound) only
    p = np.array([[True], [False]])
    a = np.array([-2.0, 0.5, 3.0], np.float32)
    b = np.array(1.0, np.float32)
    lo = np.array([[-1.0, 0.0, 1.0]], np.float32)
    s, c = jax.jit(graph_function(parse(BROADCASTING)))(p, a, b, lo)
    np.testing.assert_array_equal(s, np.where(p, a, b))
    np.testing.assert_array_equal(c, np.minimum(np.maximum(np.broadcast_to(a, (2, 3)), lo), b))


@pytest.mark.parametrize("text, words", [
    ("""graph @g mesh[dp=2] (%x: f32[4] {dp: P(sum)}) {
  %y: f32[4] = all_reduce(%x) {axis=dp, op=sum}
  return (%y)
}""", "no lowering for op 'all_reduce'"),
    ("""graph @g (%x: f32[4]) {
  %y: f32[4] = opaque(%x) {target="aten::sin"}
  return (%y)
}""", "'aten::sin' is not a JAX primitive"),
    ("""graph @g (%x: f32[4]) {
  %y: f32[4] = opaque(%x) {target="jax:no_such_primitive"}
  return (%y)
}""", "no primitive named 'no_such_primitive'"),
], ids=["collective", "torch-opaque", "unknown-primitive"])
def test_graphs_the_backend_cannot_run(text, words):
    step = compile_jax(parse(text))
    with pytest.raises(BackendError, match=words):
        step(np.ones(4, np.float32))
