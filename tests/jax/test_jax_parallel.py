"""The JAX parallel backend: per-device graphs under jax.shard_map on 8 CPU devices.

Ten steps of ``parallelize(step, mesh)`` (data parallelism + weight-update sharding) against
the single-device step on the global batch, for an MLP and a small transformer LM, each with
a parameter none of whose dimensions divides the data axis (its state stored flat), on a 1-axis
(8,) mesh and on a (2, 4) mesh whose 'data' axis carries the batch; plus the collectives one
by one on hand-written IR, and the errors a bad mesh or batch gives."""

from __future__ import annotations

import math
import warnings

import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
optax = pytest.importorskip("optax")

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from diphoma_compile.jax.parallel import compile_jax_parallel  # noqa: E402
from diphoma_compile.errors import (BackendError, DiphomaError, DiphomaWarning,  # noqa: E402
                                    MeshError)
from diphoma_compile.ir import parse, verify  # noqa: E402
import diphoma_compile  # noqa: E402
from diphoma_compile import parallelize  # noqa: E402
from diphoma_compile.report.text import render  # noqa: E402
from tests.jax_steps import keyed_steps  # noqa: E402

pytestmark = pytest.mark.skipif(jax.device_count() < 8,
                                reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")

STEPS = 10


def jax_mesh(shape: tuple[int, ...], second: str = "model") -> jax.sharding.Mesh:
    names = ("data",) if len(shape) == 1 else ("data", second)
    return jax.sharding.Mesh(np.array(jax.devices()[:math.prod(shape)]).reshape(shape), names)


# ------------------------------------------------------------------ models and steps

class MLP(nn.Module):
    """32 -> 1024 -> 3 -> 5: the Dense(3)/Dense(5) kernels and biases have no dimension
    that 8 (or 2) divides, so their state is stored flat; they are under 1% of the state."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(1024)(x))
        return nn.Dense(5)(nn.tanh(nn.Dense(3)(h)))


VOCAB, DIM, SEQ = 64, 32, 8


class LM(nn.Module):
    """One pre-norm transformer block with tied embeddings, plus a width-3 adapter whose
    bias (3,) no axis size divides."""

    @nn.compact
    def __call__(self, ids):
        emb = nn.Embed(VOCAB, DIM)
        x = emb(ids)
        mask = nn.make_causal_mask(jnp.ones(ids.shape))
        x = x + nn.MultiHeadDotProductAttention(num_heads=2, use_bias=False)(
            nn.LayerNorm()(x), mask=mask)
        x = x + nn.Dense(DIM)(nn.gelu(nn.Dense(2 * DIM)(nn.LayerNorm()(x))))
        x = x + nn.Dense(DIM)(nn.tanh(nn.Dense(3)(x)))
        return emb.attend(nn.LayerNorm()(x))


OPTIMIZERS = {
    "momentum": lambda: optax.sgd(0.05, momentum=0.9),
    "clip_momentum": lambda: optax.chain(optax.clip_by_global_norm(0.5),
                                         optax.sgd(0.05, momentum=0.9)),
    "adamw": lambda: optax.adamw(1e-2),
    "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)),
    # unit-wise norms: reductions over some dims of each gradient, which must see the synced
    # gradient (computed per device and then averaged they were off by 1e-2)
    "agc_momentum": lambda: optax.chain(optax.adaptive_grad_clip(0.1),
                                        optax.sgd(0.05, momentum=0.9)),
}


def _normal(rng: np.random.Generator, shape, scale: float = 1.0, base: float = 0.0):
    return jnp.asarray((base + rng.standard_normal(shape) * scale).astype(np.float32))


def make(model: str, optimizer: str):
    """(step, params, opt_state, global batch); initial values from numpy (eager JAX
    initializers compile op by op, which is slow here)."""
    rng = np.random.default_rng(0)
    if model == "mlp":
        module, batch = MLP(), (_normal(rng, (32, 32)), _normal(rng, (32, 5)))

        def loss_of(p, b):
            return jnp.mean((module.apply({"params": p}, b[0]) - b[1]) ** 2)
    else:
        module = LM()
        ids = rng.integers(0, VOCAB, (16, SEQ + 1)).astype(np.int32)
        batch = {"ids": jnp.asarray(ids[:, :-1]), "labels": jnp.asarray(ids[:, 1:])}

        def loss_of(p, b):
            logits = module.apply({"params": p}, b["ids"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, b["labels"]).mean()
    example = batch[0] if model == "mlp" else batch["ids"]
    abstract = jax.eval_shape(module.init, jax.random.key(0), example)["params"]
    params = jax.tree.map(lambda a: _normal(rng, a.shape, 0.3 / math.sqrt(max(a.shape[0], 1)),
                                            1.0 if a.ndim == 1 and a.shape[0] == DIM else 0.0),
                          abstract)
    tx = OPTIMIZERS[optimizer]()

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_of)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step, params, jax.jit(tx.init)(params), batch


def gspmd(step, mesh):
    """Plain GSPMD data parallelism: the user's step under jax.jit, batch split on 'data'."""
    rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    return jax.jit(step, in_shardings=(rep, rep, split), out_shardings=rep)


def run(fn, params, opt_state, batch):
    losses = []
    for _ in range(STEPS):
        params, opt_state, loss = fn(params, opt_state, batch)
        losses.append(float(loss))
    return params, opt_state, np.array(losses)


def max_dev(a, b) -> float:
    """Largest absolute difference over every leaf of two pytrees (gathered)."""
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def user(pstep, out):
    """A step's (params, opt_state, *rest) with flat-stored leaves in the user's shapes."""
    p, s, *rest = out
    return (pstep.user_shapes(p, 0), pstep.user_shapes(s, 1), *rest)


def max_rel_dev(a, b) -> float:
    """Largest per-leaf max|a - b| / max|a|."""
    out = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        scale = max(float(np.max(np.abs(x))), 1e-30)
        out = max(out, float(np.max(np.abs(x - y))) / scale)
    return out


# Every model on both meshes, with and without clipping, in both optimizer families; the LM
# only twice, as each of its programs takes seconds to compile here. "fused" adds bucketed,
# early-issued collectives (comm-fusion, schedule-comm) to the default pipeline.
CASES = [("mlp", "momentum", (8,), ""), ("mlp", "clip_momentum", (2, 4), "fused"),
         ("mlp", "adamw", (2, 4), ""), ("mlp", "clip_adamw", (8,), "fused"),
         ("mlp", "agc_momentum", (8,), ""),
         ("lm", "momentum", (2, 4), ""), ("lm", "clip_adamw", (8,), "")]
FUSED = ("dce,data-parallel{axis=data},weight-update-sharding{axis=data, layout=dims-or-flat},"
         "comm-fusion{bucket-mb=25},schedule-comm,dce")


@pytest.mark.parametrize("case", CASES, ids=["-".join([m, o, "x".join(map(str, s))] +
                                                      ([f] if f else []))
                                             for m, o, s, f in CASES])
def test_ten_steps_match_the_single_device_step(case):
    model, optimizer, shape, fused = case
    step, params, opt_state, batch = make(model, optimizer)
    # the second axis idle (an axis named model would get tensor parallelism by default)
    mesh = jax_mesh(shape, second="replica")
    n = mesh.shape["data"]
    pstep = parallelize(step, mesh, axis="data", passes=FUSED if fused else None)
    ref_p, ref_s, ref_l = run(jax.jit(step), params, opt_state, batch)
    our_p, stored_s, our_l = run(pstep, params, opt_state, batch)
    our_s = pstep.user_shapes(stored_s)    # flat-stored leaves in the user's shapes
    assert ref_l[-1] < ref_l[0]      # the model learns: parity of a frozen step proves little
    assert jax.tree.structure((our_p, our_s)) == jax.tree.structure((ref_p, ref_s))
    assert [x.shape for x in jax.tree.leaves(our_s)] == [x.shape for x in jax.tree.leaves(ref_s)]
    np.testing.assert_allclose(our_l, ref_l, rtol=1e-5)

    if "adam" in optimizer:
        # Adam divides by sqrt(v): reduction-order noise in tiny gradients is amplified the
        # same way under any data-parallel reduction; GSPMD's own deviation is the yardstick
        g_p, g_s, g_l = run(gspmd(step, mesh), params, opt_state, batch)
        np.testing.assert_allclose(g_l, ref_l, rtol=1e-5)
        ours, theirs = max_dev((ref_p, ref_s), (our_p, our_s)), \
            max_dev((ref_p, ref_s), (g_p, g_s))
        print(f"{model}-{optimizer}: max abs deviation diphoma {ours:.3g}, GSPMD {theirs:.3g}")
        assert ours <= 2 * theirs + 1e-6, f"diphoma deviates {ours:.3g}, GSPMD {theirs:.3g}"
    else:
        rel = max_rel_dev((ref_p, ref_s), (our_p, our_s))
        print(f"{model}-{optimizer}: max relative deviation {rel:.3g}")
        assert rel <= 1e-5

    # state stays sharded: every leaf with a dimension n divides is split on 'data', every
    # other non-scalar one stored flat (1-D, padded to a multiple of n) and split on 'data'
    for leaf, user in zip(jax.tree.leaves(stored_s), jax.tree.leaves(ref_s)):
        spec = leaf.sharding.spec
        if any(d % n == 0 for d in user.shape):
            assert leaf.shape == user.shape and "data" in tuple(spec), (leaf.shape, spec)
        elif user.size > 1:
            assert leaf.shape == (-(-user.size // n) * n,) and tuple(spec) == ("data",), \
                (user.shape, leaf.shape, spec)
        else:
            assert all(s is None for s in spec), (leaf.shape, spec)
    assert all(all(s is None for s in p.sharding.spec) for p in jax.tree.leaves(our_p))

    report = pstep.memory_report()
    single_state = sum(x.nbytes for x in jax.tree.leaves(opt_state))
    single_params = sum(x.nbytes for x in jax.tree.leaves(params))
    assert report.measured
    assert report.param_bytes == single_params
    assert single_state / n <= report.opt_state_bytes < single_state / n * 1.01
    assert report.to_dict()["opt_state_bytes"] == report.opt_state_bytes


def test_shard_params_holds_parameters_sharded_and_matches_the_single_device_step():
    """parallelize(shard_params=True): the parameters come back as global arrays sharded on
    'data' (along a dimension 8 divides, else stored flat), gathered inside the step where read;
    ten steps match the single-device step."""
    step, params, opt_state, batch = make("mlp", "momentum")
    mesh = jax_mesh((8,), second="replica")
    pstep = parallelize(step, mesh, axis="data", shard_params=True)
    ref_p, ref_s, ref_l = run(jax.jit(step), params, opt_state, batch)
    stored_p, stored_s, our_l = run(pstep, params, opt_state, batch)
    our_p, our_s = pstep.user_shapes(stored_p, 0), pstep.user_shapes(stored_s, 1)
    np.testing.assert_allclose(our_l, ref_l, rtol=1e-5)
    assert max_rel_dev((ref_p, ref_s), (our_p, our_s)) <= 1e-5
    # every parameter is split on 'data': along a dimension 8 divides, else stored flat
    for leaf, user in zip(jax.tree.leaves(stored_p), jax.tree.leaves(ref_p)):
        assert "data" in tuple(leaf.sharding.spec), (leaf.shape, leaf.sharding)
        assert leaf.shape == (user.shape if any(d % 8 == 0 for d in user.shape)
                              else (-(-user.size // 8) * 8,))
    notes = pstep.plan.notes["shard-params"]
    assert notes["sharded"] and notes["gathers"]["forward"] == len(notes["sharded"])
    single = sum(x.nbytes for x in jax.tree.leaves(params))
    assert pstep.memory_report().param_bytes < single / 2


@pytest.mark.parametrize("opt", ["lamb", "adafactor"])
def test_shard_params_with_an_update_that_sums_over_a_flat_parameter(opt):
    """LAMB's trust ratio takes each parameter's norm, Adafactor its RMS: under
    shard_params a (5,) bias is held as a flat piece whose padding the update leaves of
    unknown value (Fx), and the sum over it was left in the graph, which then did not
    verify (a review's probe, 2026-12-07). The sum now reads that piece gathered and cut
    again (zero padding): the step matches jax.jit."""
    rng = np.random.default_rng(0)

    def r(*shape):
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32) * 0.4)
    params = {"w": r(7, 16), "b": r(16), "v": r(16, 5), "c": r(5)}
    batch = (r(16, 7), r(16, 5))
    tx = optax.lamb(1e-2) if opt == "lamb" else optax.adafactor(1e-2)

    def step(params, opt_state, batch):
        def loss_of(p):
            return jnp.mean((jnp.tanh(batch[0] @ p["w"] + p["b"]) @ p["v"] + p["c"]
                             - batch[1]) ** 2)
        loss, g = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    opt_state = jax.jit(tx.init)(params)
    pstep = parallelize(step, jax_mesh((8,)), axis="data", shard_params=True)
    ref_p, ref_s, ref_l = run(jax.jit(step), params, opt_state, batch)
    stored_p, stored_s, our_l = run(pstep, params, opt_state, batch)
    np.testing.assert_allclose(our_l, ref_l, rtol=1e-5)
    assert max_rel_dev((ref_p, ref_s), (pstep.user_shapes(stored_p, 0),
                                        pstep.user_shapes(stored_s, 1))) <= 1e-5
    assert pstep.plan.notes["shard-params"]["sharded"]["params/c"].startswith("F")


# ------------------------------------------------------------------ collectives, one by one

def collectives_ir(mesh: str, n: int) -> str:
    """Every collective the backend lowers, on local batches x: f32[r,8], y: f32[r,3]."""
    r = 16 // n
    s1, f = "{data: S(1)}", "{data: F}"
    rs_bucket, rs_flat = "async=true, axis=data, dim=1, op=sum", "axis=data, dim=flat, op=avg"
    return f"""graph @collectives {mesh} (
  %w: f32[8,16] param,
  %x: f32[{r},8] {{data: V}} batch,
  %y: f32[{r},3] {{data: V}} batch,
  %z: f32[{r},16] {{data: V}} batch,
) {{
  %sum: f32[{r},8] = all_reduce(%x) {{axis=data, op=sum}}
  %avg: f32[{r},8] = all_reduce(%x) {{axis=data, op=avg}}
  %max: f32[{r},8] = all_reduce(%x) {{axis=data, op=max}}
  %min: f32[{r},8] = all_reduce(%x) {{axis=data, op=min}}
  %rs: f32[{r},8] {{data: S(1)}} = reduce_scatter(%x) {{axis=data, dim=1, op=avg}}
  %rf: f32[{r},3] {{data: F}} = reduce_scatter(%y) {{axis=data, dim=flat, op=sum}}
  %rfg: f32[{r},3] = all_gather(%rf) {{axis=data, dim=flat}}
  %root: f32[{r},8] = broadcast(%x) {{axis=data, root=1}}
  %ws: f32[8,16] {{data: S(0)}} = take_shard(%w) {{axis=data, dim=0}}
  %wt: f32[8,16] {{data: S(1)}} = all_to_all(%ws) {{axis=data, from_dim=0, to_dim=1}}
  %wg: f32[8,16] = all_gather(%wt) {{axis=data, dim=1}}
  %sl: f32[8,4] {{data: S(0)}} = slice(%ws) {{limits=[8, 6], starts=[0, 2]}}
  %io: i32[8,16] {{data: S(0)}} = iota() {{dim=0}}
  %b1: f32[{r},8] {s1}, %b2: f32[{r},16] {s1} = reduce_scatter(%x, %z) {{{rs_bucket}}}
  %c1: f32[{r},8] {s1}, %c2: f32[{r},16] {s1} = wait(%b1, %b2)
  %g1: f32[{r},8], %g2: f32[{r},16] = all_gather(%c1, %c2) {{axis=data, dim=1}}
  %f1: f32[{r},3] {f}, %f2: f32[{r},8] {f} = reduce_scatter(%y, %x) {{{rs_flat}}}
  %h1: f32[{r},3], %h2: f32[{r},8] = all_gather(%f1, %f2) {{axis=data, dim=flat}}
  %a1: f32[{r},8], %a2: f32[{r},3] = all_reduce(%x, %y) {{axis=data, op=max}}
  return (%sum, %avg, %max, %min, %rs, %rfg, %root, %wt, %wg, %sl, %io, %c2, %g1, %g2, %h1, %h2,
          %a1, %a2)
}}
"""


@pytest.mark.parametrize("shape", [(8,), (2, 4)], ids=["8", "2x4"])
def test_collectives_lower_to_their_meaning(shape):
    mesh = jax_mesh(shape)
    n = mesh.shape["data"]
    text = collectives_ir("mesh[data=8]" if n == 8 else "mesh[data=2, model=4]", n)
    graph = verify(parse(text))
    rng = np.random.default_rng(1)
    w, x, y, z = (rng.standard_normal(s).astype(np.float32)
                  for s in ((8, 16), (16, 8), (16, 3), (16, 16)))
    tree = jax.tree.structure(tuple(range(18)))
    outs = compile_jax_parallel(graph, mesh=mesh, out_tree=tree)(w, x, y, z)
    bx, by, bz = x.reshape(n, -1, 8), y.reshape(n, -1, 3), z.reshape(n, -1, 16)
    want = [bx.sum(0), bx.mean(0), bx.max(0), bx.min(0), bx.mean(0), by.sum(0), bx[1],
            w, w, w[:, 2:6], np.broadcast_to(np.arange(8, dtype=np.int32)[:, None], (8, 16)),
            # buckets: one packed collective for several values
            bz.sum(0), bx.sum(0), bz.sum(0), by.mean(0), bx.mean(0), bx.max(0), by.max(0)]
    for k, (got, exp) in enumerate(zip(outs, want)):
        np.testing.assert_allclose(np.asarray(got), exp, rtol=1e-6, atol=1e-6,
                                   err_msg=f"output {k}")
    assert outs[4].sharding.spec == P(None, "data")      # S(1) comes back split on dim 1
    assert outs[7].sharding.spec == P(None, "data")


# ------------------------------------------------------------------ errors

SMALL = """graph @small {mesh} (
  %w: f32[8] param,
  %m: f32[8] {{data: S(0)}} opt_state(of=%w, slot=trace),
  %x: f32[2,8] {{data: V}} batch,
) {{
  %h: f32[2,8] {{data: V}} = mul(%x, %w)
  %s: f32[] {{data: V}} = reduce_sum(%h) {{dims=[0, 1]}}
  %loss: f32[] = all_reduce(%s) {{axis=data, op=avg}}
  return (%w replaces(%w), %m replaces(%m), %loss loss)
}}
"""


def small(mesh: str = "mesh[data=8]"):
    return verify(parse(SMALL.format(mesh=mesh)))


def test_mesh_of_another_size_than_the_devices_is_refused():
    with pytest.raises(MeshError, match=r"4 devices but there are 8 JAX devices"):
        compile_jax_parallel(small("mesh[data=4]"))


def test_missing_axis_is_refused():
    with pytest.raises(MeshError, match=r"mesh \(data=8\) has no axis 'dp'"):
        compile_jax_parallel(small(), mesh=jax_mesh((8,)), axis="dp")


def test_graph_partitioned_for_another_mesh_is_refused():
    with pytest.raises(MeshError, match=r"partitioned for mesh axis data=8.*data=2, model=4"):
        compile_jax_parallel(small(), mesh=jax_mesh((2, 4)))


def test_batch_that_does_not_split_evenly_is_refused():
    step = compile_jax_parallel(small())
    w, m = np.ones(8, np.float32), np.zeros(8, np.float32)
    with pytest.raises(MeshError, match=r"12 rows along dim 0.*8 devices of mesh axis data"):
        step(w, m, np.ones((12, 8), np.float32))
    with pytest.raises(BackendError, match=r"global batch of 16 \(2 per device x 8\)"):
        step(w, m, np.ones((24, 8), np.float32))
    w2, m2, loss = step(w, m, np.ones((16, 8), np.float32))
    assert float(loss) == 16.0


def test_memory_is_planned_before_the_first_call_and_measured_after():
    step = compile_jax_parallel(small())
    planned = step.memory_report()
    # one MemoryReport for both backends: JAX keeps no gradients between steps
    assert planned.to_dict() == {"param_bytes": 32, "opt_state_bytes": 4, "grad_bytes": 0,
                                 "devices": 8, "measured": False}
    step(np.ones(8, np.float32), np.zeros(8, np.float32), np.ones((16, 8), np.float32))
    measured = step.memory_report()
    assert measured.measured
    assert (measured.param_bytes, measured.opt_state_bytes) == (32, 4)


# ------------------------------------------------------------------ returned values

def _metric_step(tx):
    """An MLP step returning its loss, its gradients and metrics of the batch: a maximum and
    a minimum (combined across devices by max and min, not averaged) and the gradients'
    global norm (computed after the sync, in the update)."""
    module = MLP()

    def loss_of(p, b):
        err = module.apply({"params": p}, b[0]) - b[1]
        return jnp.mean(jnp.sum(err ** 2, axis=1)), err

    def step(params, opt_state, batch):
        (loss, err), grads = jax.value_and_grad(loss_of, has_aux=True)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params, value=loss)
        metrics = {"max": jnp.max(jnp.abs(err)), "min": -jnp.max(-err),
                   "gnorm": optax.global_norm(grads), "grads": grads}
        return optax.apply_updates(params, updates), opt_state, loss, metrics
    return step


@pytest.mark.parametrize("opt", ["momentum", "polyak"])
def test_returned_metrics_and_gradients_match_the_single_device_step(opt):
    """Polyak step sizes read the loss in the update: it is read synced, as returned."""
    tx = optax.sgd(0.05, momentum=0.9) if opt == "momentum" else \
        optax.polyak_sgd(max_learning_rate=0.05)
    step = _metric_step(tx)
    _, params, _, batch = make("mlp", "momentum")
    opt_state = jax.jit(tx.init)(params)
    pstep = parallelize(step, jax_mesh((8,)), axis="data")
    ref, ours = jax.jit(step), pstep
    rp, rs, op, os_ = params, opt_state, params, opt_state
    for _ in range(3):
        rp, rs, rl, rm = ref(rp, rs, batch)
        op, os_, ol, om = ours(op, os_, batch)
        np.testing.assert_allclose(float(ol), float(rl), rtol=1e-5)
        for k in ("max", "min", "gnorm"):
            np.testing.assert_allclose(float(om[k]), float(rm[k]), rtol=1e-5, err_msg=k)
        assert max_rel_dev(rm["grads"], om["grads"]) <= 1e-5
    assert max_rel_dev((rp, rs), (op, pstep.user_shapes(os_))) <= 1e-5
    combined = pstep.plan.notes["data-parallel"]["combined"]
    assert sorted(combined.values()) == ["max", "min"]


def test_a_returned_per_example_value_is_refused():
    module = MLP()
    tx = optax.sgd(0.05)

    def step(params, opt_state, batch):
        def loss_of(p):
            out = module.apply({"params": p}, batch[0])
            return jnp.mean((out - batch[1]) ** 2), out
        (loss, out), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, out
    _, params, _, batch = make("mlp", "momentum")
    pstep = parallelize(step, jax_mesh((8,)), axis="data")
    with pytest.raises(DiphomaError, match=r"returns %.*a \[4, 5\] value computed per device"):
        pstep.trace(params, jax.jit(tx.init)(params), batch)


class _Dropping(nn.Module):
    """flax's own dropout on activations and on attention weights."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dropout(0.3, deterministic=False)(nn.relu(nn.Dense(16)(x)))
        # (no biases: a key's bias has no gradient, rounding noise that momentum keeps)
        h = nn.SelfAttention(num_heads=2, dropout_rate=0.2, deterministic=False,
                             use_bias=False)(h)
        return nn.Dense(4)(h.mean(1))


@pytest.mark.parametrize("rows", [32, 8])
def test_dropout_from_one_key_draws_the_global_batchs_masks(rows):
    """A mask drawn from the step's key at the batch's shape (flax's Dropout, attention
    dropout; before, refused: every device would have drawn its share's mask from the same
    key, repeating one another's masks). Each device draws it at the global batch's shape
    and keeps its rows: the single-device step's masks, so its parameters and losses over
    steps with new keys. At one row per device (8 rows) the rows are found on the step
    traced at two (refused before 2026-12-06: nothing was judged at one row)."""
    module, tx = _Dropping(), optax.sgd(0.05, momentum=0.9)

    def step(params, opt_state, batch, key):
        def loss_of(p):
            out = module.apply({"params": p}, batch[0], rngs={"dropout": key})
            return jnp.mean((out - batch[1]) ** 2)
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    batch = (jax.random.normal(k[1], (rows, 3, 8)), jax.random.normal(k[2], (rows, 4)))
    params = module.init({"params": k[0], "dropout": k[0]}, batch[0])["params"]
    pstep = parallelize(step, jax_mesh((8,)), axis="data")
    a, b = keyed_steps(step, pstep, (params, tx.init(params)), batch, range(100, 103))
    assert max_rel_dev(a[0], b[0]) <= 1e-5
    assert pstep.plan.notes["data-parallel"]["random_per_row"]
    assert "keeps its own rows" in render(pstep.plan)


def test_a_key_mask_broadcast_over_features_is_refused():
    """A mask drawn at another shape than the activations it meets (one draw per example,
    broadcast over the features): not drawn per row yet, so refused with what to do."""
    tx = optax.sgd(0.1)

    def step(params, opt_state, batch, key):
        def loss_of(p):
            mask = jax.random.bernoulli(key, 0.5, (batch.shape[0], 1))
            return jnp.mean(jnp.where(mask, batch, 0.0) @ p["w"])
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    params = {"w": jnp.ones((4,), jnp.float32)}
    pstep = parallelize(step, jax_mesh((8,)), axis="data")
    with pytest.raises(DiphomaError, match="random numbers drawn from a JAX key meet per-device"):
        pstep.trace(params, tx.init(params), jnp.ones((16, 4)), jax.random.key(0))


def test_a_number_per_example_from_one_key_meeting_the_batch_is_drawn_per_row():
    """``x * uniform(key, (B, 1))`` on the batch input itself: a scale per example, which
    every device drew at its share's shape from the same key, repeating rows 0-3's
    numbers on all 8 devices with no word until 2026-12-07 (a review found it; the same
    draw on an activation was drawn per row). Now drawn at the global batch's shape, each
    device keeping its rows: the single-device step's numbers."""
    tx = optax.sgd(0.05)

    def step(params, opt_state, batch, key):
        def loss_of(p):
            x = batch[0] * jax.random.uniform(key, (batch[0].shape[0], 1))
            return jnp.mean((jnp.tanh(x @ p["w"]) - batch[1]) ** 2)
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    k = jax.random.split(jax.random.PRNGKey(1), 3)
    params = {"w": jax.random.normal(k[0], (6, 3))}
    batch = (jax.random.normal(k[1], (32, 6)), jax.random.normal(k[2], (32, 3)))
    pstep = parallelize(step, jax_mesh((8,)), axis="data")
    a, b = keyed_steps(step, pstep, (params, tx.init(params)), batch, range(100, 103))
    assert max_rel_dev(a[0], b[0]) <= 1e-5
    assert pstep.plan.notes["data-parallel"]["random_per_row"]


def test_noise_on_the_weights_from_one_key_is_the_same_on_every_device():
    tx = optax.sgd(0.1)
    params = {"w": jnp.ones((4,), jnp.float32)}

    def noisy_weights(params, opt_state, batch, key):
        """Noise drawn at the weight's shape is the same on every device, as on one; what
        it computes with the batch is per-device data, not a draw (tanh after the dot)."""
        def loss_of(p):
            w = p["w"] + 0.1 * jax.random.normal(key, p["w"].shape)
            return jnp.mean(jnp.tanh(batch @ w))
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    args = (params, tx.init(params), jnp.arange(64.0).reshape(16, 4) / 64, jax.random.key(0))
    pstep = parallelize(noisy_weights, jax_mesh((8,)), axis="data")
    ours = user(pstep, pstep(*args))
    ref = jax.jit(noisy_weights)(*args)
    assert max_rel_dev(ref, ours) <= 1e-5


class Narrow(nn.Module):
    """8 -> 16 -> 4: the (4,) bias is the one tensor 8 does not divide."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.relu(nn.Dense(16)(x)))


def test_multisteps_gradient_accumulation_matches_the_single_device_step():
    """optax.MultiSteps updates inside a lax.cond, which must run on whole values: it was
    handed a (4,) operand cut in 8 (an unverifiable graph)."""
    rng = np.random.default_rng(0)
    module = Narrow()
    batch = (_normal(rng, (16, 8)), _normal(rng, (16, 4)))
    abstract = jax.eval_shape(module.init, jax.random.key(0), batch[0])["params"]
    params = jax.tree.map(lambda a: _normal(rng, a.shape, 0.3), abstract)
    tx = optax.MultiSteps(optax.sgd(0.05, momentum=0.9), every_k_schedule=2)

    def ms_step(params, opt_state, batch):
        def loss_of(p):
            return jnp.mean((module.apply({"params": p}, batch[0]) - batch[1]) ** 2)
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    opt_state = jax.jit(tx.init)(params)
    pstep = parallelize(ms_step, jax_mesh((8,)), axis="data")
    rp, rs, op, os_ = params, opt_state, params, opt_state
    for _ in range(4):
        rp, rs, rl = jax.jit(ms_step)(rp, rs, batch)
        op, os_, ol = pstep(op, os_, batch)
        np.testing.assert_allclose(float(ol), float(rl), rtol=1e-5)
    assert max_rel_dev((rp, rs), (op, pstep.user_shapes(os_, 1))) <= 1e-5


def _masked_mean_step(tx, count="clamp"):
    def step(params, opt_state, batch):
        def loss_of(p):
            err = jnp.mean((jnp.tanh(batch[0] @ p["w"]) - batch[1]) ** 2, axis=-1)
            if count == "int + eps":        # an integer count, a constant added to it
                return jnp.sum(err * batch[2]) / (jnp.sum(batch[2] > 0) + 1e-6)
            if count == "plain":
                return jnp.sum(err * batch[2]) / jnp.sum(batch[2])
            if count == "nanmean":          # its count, of ~isnan(loss), reads the params
                return jnp.nanmean(jnp.where(batch[2] > 0, err, jnp.nan))
            if count == "reciprocal":       # times the clamped count's reciprocal
                return jnp.sum(err * batch[2]) * (1.0 / jnp.maximum(jnp.sum(batch[2]), 1.0))
            return jnp.sum(err * batch[2]) / jnp.maximum(jnp.sum(batch[2]), 1.0)
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step


@pytest.mark.parametrize("count", ["clamp", "int + eps", "reciprocal", "nanmean"])
def test_a_mean_over_a_count_of_the_batch_divides_by_the_devices_summed_count(count):
    """sum(err * mask) / max(sum(mask), 1) with a mask that counts differently on each of 8
    devices (some count none): each device divides by the count summed over the devices,
    so losses and parameters match jax.jit over 3 Adam steps; the plan says so, with no
    warning. With counts=local (each device's own count, as DDP) the same step lands far
    from it: the test's data can tell the two apart. An integer count plus a constant
    (``sum(mask > 0) + 1e-6``) adds the constant once, to the summed count (it was added
    on every device, 8x the loss, when a review probed it). A sum times the count's
    reciprocal (``* (1 / max(sum(mask), 1))``) is the same mean (warned of as combining
    examples, and left each device's own, before 2026-12-06). So is ``jnp.nanmean`` of the
    masked-out errors set to NaN: its count, of ``~isnan``, reads the parameters through a
    boolean, which no gradient flows through (it was left each device's own, and a device
    counting none returned NaN, until 2026-12-07)."""
    tx = optax.adam(0.05)
    step = _masked_mean_step(tx, count)
    k = jax.random.split(jax.random.key(0), 4)
    params = {"w": jax.random.normal(k[0], (8, 16))}
    mask = (jax.random.uniform(k[3], (16,)) < 0.4).astype(jnp.float32)
    batch = (jax.random.normal(k[1], (16, 8)), jax.random.normal(k[2], (16, 16)), mask)
    dev = {}
    for counts in ("global", "local") if count == "clamp" else ("global",):
        pstep = parallelize(step, jax_mesh((8,)), axis="data", passes=(
            None if counts == "global" else
            "dce,data-parallel{axis=data, counts=local},dce"))
        rp, rs, op, os_ = params, tx.init(params), params, tx.init(params)
        losses = []
        with warnings.catch_warnings():
            warnings.simplefilter("error", DiphomaWarning)
            for _ in range(3):
                rp, rs, rl = jax.jit(step)(rp, rs, batch)
                op, os_, ol = pstep(op, os_, batch)
                losses.append(abs(float(ol) - float(rl)))
        dev[counts] = (max(losses), max_rel_dev(rp, op), pstep.plan.to_text())
        notes = pstep.plan.notes["data-parallel"]
        listed = notes["counted_globally" if counts == "global" else "batch_counted"]
        assert len(listed) == 1 and "divides by a sum over the batch" in listed[0]
    assert dev["global"][0] <= 1e-6 and dev["global"][1] <= 1e-5, dev
    if count != "clamp":
        return
    assert dev["local"][1] > 1e-2, dev
    assert "divides its sum by the count summed over the devices" in dev["global"][2]
    assert "the forward divides by counts over the batch" in dev["local"][2]
    plain = parallelize(make("mlp", "momentum")[0], jax_mesh((8,)), axis="data")
    _, p2, s2, b2 = make("mlp", "momentum")
    plain.trace(p2, s2, b2)
    for field in ("batch_counted", "batch_coupled", "counted_globally"):
        assert plain.plan.notes["data-parallel"][field] == []


@pytest.mark.parametrize("count", ["plain", "int + eps"])
def test_one_row_per_device_divides_by_the_devices_summed_count(count):
    """A global batch of 8 on 8 devices: one row each, which cannot show which dims hold
    examples. The step is judged on a trace at more rows per device, and the masked mean
    divides by the count summed over the devices: losses and parameters match jax.jit
    over 3 Adam steps. Before, nothing was judged at one row: each device divided by its
    own count, and the devices whose row is masked out divided 0 by 0 (NaN)."""
    tx = optax.adam(0.05)
    step = _masked_mean_step(tx, count)
    k = jax.random.split(jax.random.key(0), 3)
    params = {"w": jax.random.normal(k[0], (8, 16))}
    mask = jnp.array([1, 0, 1, 1, 0, 0, 1, 0], jnp.float32)
    batch = (jax.random.normal(k[1], (8, 8)), jax.random.normal(k[2], (8, 16)), mask)
    pstep = parallelize(step, jax_mesh((8,)), axis="data")
    rp, rs, op, os_ = params, tx.init(params), params, tx.init(params)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DiphomaWarning)
        for _ in range(3):
            rp, rs, rl = jax.jit(step)(rp, rs, batch)
            op, os_, ol = pstep(op, os_, batch)
            assert abs(float(ol) - float(rl)) <= 1e-6, (float(ol), float(rl))
    assert max_rel_dev(rp, op) <= 1e-5
    assert len(pstep.plan.notes["data-parallel"]["counted_globally"]) == 1


def test_one_row_per_device_with_labels_picked_per_row_matches_jax_jit():
    """optax's integer-label cross-entropy picks each row's label with a gather whose
    index drops the rows' dim at one row: the two traces differ there in rank, and the
    masked mean after it went unmatched, each device's own with no word (a review,
    2026-12-06: 1.618 against jax.jit's 1.567). The ops at another rank are paired as
    reading the same values (ir/row_probe.py), so it is summed: jax.jit's loss, the count
    returned too."""
    model, tx = nn.Dense(4), optax.sgd(0.1)
    k = jax.random.split(jax.random.key(0), 3)

    def step(params, opt_state, x, y, keep):
        def lf(p):
            c = jnp.sum(keep)
            per = optax.softmax_cross_entropy_with_integer_labels(
                model.apply({"params": p}, x), y)
            return jnp.sum(per * keep) / c, c
        (loss, c), g = jax.value_and_grad(lf, has_aux=True)(params)
        up, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, up), opt_state, loss, c
    x, y = jax.random.normal(k[0], (8, 3, 8)), jax.random.randint(k[1], (8, 3), 0, 4)
    keep = (jax.random.uniform(k[2], (8, 3)) > 0.4).astype(jnp.float32)
    params = model.init(k[0], x[:1])["params"]
    want = jax.jit(step)(params, tx.init(params), x, y, keep)
    pstep = parallelize(step, jax_mesh((8,)), axis="data")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DiphomaWarning)
        got = pstep(params, tx.init(params), x, y, keep)
    assert abs(float(got[2]) - float(want[2])) <= 1e-6 and float(got[3]) == float(want[3])
    assert max_rel_dev(want[0], got[0]) <= 1e-5


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("loss", ["half sum", "half masked"])
def test_a_loss_halved_by_hand_is_not_a_mean(loss, rows):
    """``sum(...) / 2`` at one row per device, judged on a probe at two rows, was taken for
    a mean over them (a review, 2026-12-06: the gradients averaged, 1/8 of jax.jit's
    loss). The probe's rows are a prime no constant of the step is a multiple of. At two
    rows per device the step that runs divides by 2 as a mean over them would; it was
    taken for one (1/8 of the loss, documented) until the step traced at more rows was
    read for such divisions too (2026-12-06)."""
    tx = optax.sgd(0.01)

    def step(params, opt_state, batch):
        def loss_of(p):
            err = (jnp.tanh(batch[0] @ p["w"]) - batch[1]) ** 2
            if loss == "half sum":
                return jnp.sum(err) / 2
            return jnp.sum(jnp.mean(err, -1) * batch[2]) * 0.5 / jnp.sum(batch[2])
        value, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value
    k = jax.random.split(jax.random.key(0), 3)
    params = {"w": jax.random.normal(k[0], (8, 4))}
    batch = (jax.random.normal(k[1], (8 * rows, 8)), jax.random.normal(k[2], (8 * rows, 4)),
             jnp.array([1, 0, 1, 1, 0, 1, 1, 0] * rows, jnp.float32))
    want = jax.jit(step)(params, tx.init(params), batch)
    got = parallelize(step, jax_mesh((8,)), axis="data")(params, tx.init(params), batch)
    assert abs(float(got[2]) - float(want[2])) <= 1e-5 * abs(float(want[2]))
    assert max_rel_dev(want[0], got[0]) <= 1e-5


@pytest.mark.parametrize("loss, rows, probed", [
    ("jnp.mean", 2, False), ("optax cross-entropy's mean", 2, False),
    ("half sum", 2, True), ("mean of a sum over the rows", 4, True)])
def test_jnp_mean_is_a_mean_without_a_second_trace(loss, rows, probed):
    """jnp.mean divides the sum it takes by its number of elements: at 2 rows a device,
    the same constant as ``sum() / 2``. The JAX frontend marks jnp.mean's own division
    (``div{mean=true}``) and the plan takes it for a mean without tracing the step again
    at more rows (1-2 s a plan on a flax GPT); a sum halved by hand, and jnp.mean of a sum
    already taken over the rows (4 columns at 4 rows a device), are still told apart on
    that trace. Every plan matches jax.jit on 8 devices."""
    from diphoma_compile.api import trace_step
    tx = optax.sgd(0.05)

    def step(params, opt_state, batch):
        def loss_of(p):
            y = batch[0] @ p["w"]
            err = (jnp.tanh(y) - batch[1]) ** 2
            if loss == "jnp.mean":
                return jnp.mean(err)
            if loss == "half sum":
                return jnp.sum(err) / 2
            if loss == "mean of a sum over the rows":
                return jnp.mean(jnp.sum(err, 0))
            labels = jnp.argmax(batch[1], -1)
            return optax.softmax_cross_entropy_with_integer_labels(y, labels).mean()
        value, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value
    k = jax.random.split(jax.random.key(0), 3)
    params = {"w": jax.random.normal(k[0], (8, 4))}
    batch = (jax.random.normal(k[1], (8 * rows, 8)), jax.random.normal(k[2], (8 * rows, 4)))
    args = (params, tx.init(params), batch)
    _, _, _, probe = trace_step(step, args, diphoma_compile.Mesh({"data": 8}), "data")
    assert (probe is not None) == probed
    want = jax.jit(step)(*args)
    got = parallelize(step, jax_mesh((8,)), axis="data")(params, tx.init(params), batch)
    assert abs(float(got[2]) - float(want[2])) <= 1e-5 * abs(float(want[2]))
    assert max_rel_dev(want[0], got[0]) <= 1e-5


def test_a_flax_lm_averaging_optax_cross_entropy_plans_with_one_trace():
    """The flax linen language model of these tests, its loss optax's cross-entropy
    ``.mean()`` as people write it, at 2 rows a device: jnp.mean's division is marked and
    the step is planned without the second trace at more rows, its gradients averaged
    (its parity with jax.jit over ten steps: ``test_ten_steps_match_the_single_device_step``
    [lm-clip_adamw-8])."""
    from diphoma_compile.api import trace_step
    from diphoma_compile.ir.batch_coupling import scaled_by_rows, split_batch
    step, params, opt_state, batch = make("lm", "adamw")
    _, graph, _, probe = trace_step(step, (params, opt_state, batch),
                                    diphoma_compile.Mesh({"data": 8}), "data")
    assert any(op.name == "div" and op.attrs.get("mean") for op in graph.ops)
    assert probe is None and scaled_by_rows(graph) == []
    assert split_batch(graph).gradients == "avg"


def _matches_jit_with(step, tx, gradients: str) -> None:
    """``step`` (params, opt_state, (x [16, 8], y [16, 4])) -> (params, opt_state, loss)
    on 8 devices: planned with ``gradients`` combined so, and as jax.jit's."""
    k = jax.random.split(jax.random.key(0), 3)
    params = {"w": jax.random.normal(k[0], (8, 4))}
    batch = (jax.random.normal(k[1], (16, 8)), jax.random.normal(k[2], (16, 4)))
    want = jax.jit(step)(params, tx.init(params), batch)
    pstep = parallelize(step, jax_mesh((8,)), axis="data")
    got = pstep(params, tx.init(params), batch)
    assert pstep.plan.notes["data-parallel"]["gradients"] == gradients
    assert abs(float(got[2]) - float(want[2])) <= 1e-5 * abs(float(want[2]))
    assert max_rel_dev(want[0], got[0]) <= 1e-5


@pytest.mark.parametrize("loss", ["reciprocal on the left", "tokens over sequences"])
def test_a_mean_written_by_hand_is_averaged(loss):
    """Means over the batch's examples that were taken for sums (a review, 2026-12-06:
    the gradients added up, 8x jax.jit's loss on 8 devices): ``(1 / x.shape[0]) * sum``,
    whose constant is the product's first operand, and a sum over tokens flattened with
    the rows (``reshape(-1)``) divided by the number of sequences."""
    tx = optax.sgd(0.01)

    def step(params, opt_state, batch):
        def loss_of(p):
            err = (jnp.tanh(batch[0] @ p["w"]) - batch[1]) ** 2
            if loss == "reciprocal on the left":
                return (1.0 / batch[0].shape[0]) * jnp.sum(err)
            return jnp.sum(err.reshape(-1)) / batch[0].shape[0]
        value, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value
    _matches_jit_with(step, tx, "avg")


@pytest.mark.parametrize("form, gradients", [
    ("sum differentiated, mean returned", "sum"), ("mean differentiated, sum / 2 returned",
                                                   "avg"),
    ("grad of a sum, mean recomputed", "sum")])
def test_the_gradients_combine_as_the_value_differentiated(form, gradients):
    """The value ``value_and_grad`` differentiates is not the one returned (an aux, or a
    loss computed again): the gradients combine as the differentiated one does, found
    from the backward's seed (``ir/grad_seed.py``). Before (2026-12-06) they followed the
    returned value: on 8 devices the parameters moved 0.125x or 8x as far as jax.jit's
    (maxrel 0.875 and 7.0), the losses right."""
    tx = optax.sgd(0.01)

    def step(params, opt_state, batch):
        def terms(p):
            return (jnp.tanh(batch[0] @ p["w"]) - batch[1]) ** 2

        def both(p):
            err = terms(p)
            return (jnp.sum(err) if form.startswith("sum") else jnp.mean(err)), jnp.sum(err)
        if form.startswith("grad"):
            grads = jax.grad(lambda p: jnp.sum(terms(p)))(params)
            value = jnp.mean(terms(params))
        else:
            (_, total), grads = jax.value_and_grad(both, has_aux=True)(params)
            value = total / batch[0].shape[0] if form.startswith("sum") else total / 2
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value
    _matches_jit_with(step, tx, gradients)


@pytest.mark.parametrize("flavour", ["linen", "nnx"])
def test_the_value_differentiated_is_found_on_a_flax_lm(flavour):
    """On a flax language model (linen and nnx, optax cross-entropy's mean) the backward's
    seed is matched to the loss ``value_and_grad`` returns, so the gradients' kind is read
    from the value differentiated, not taken from the loss returned for want of it."""
    from diphoma_compile.api import trace_step
    from diphoma_compile.ir.batch_coupling import split_batch
    from diphoma_compile.ir.grad_seed import differentiated
    from tests.jax_steps import make_case
    step, args = make_case("lm", flavour, "adamw")
    _, graph, _, probe = trace_step(step, args, diphoma_compile.Mesh({"dp": 2}), "dp")
    loss = next(o.name for o in graph.outputs if o.role.kind.name == "loss")
    assert differentiated(graph) == [loss]
    assert split_batch(graph, probe).gradients == "avg"


def test_one_row_per_device_that_cannot_be_traced_at_two_is_said_unjudged():
    """A step that fixes the batch's size (``reshape(1, -1)``) traces at one row per
    device but not at two: the batch is not judged, and a warning and the plan say so."""
    tx = optax.sgd(0.1)

    def step(params, opt_state, batch):
        def loss_of(p):
            err = jnp.mean((batch[0].reshape(1, -1) @ p["w"] - batch[1]) ** 2, axis=-1)
            return jnp.sum(err * batch[2]) / jnp.sum(batch[2])
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    params = {"w": jnp.ones((8, 4))}
    batch = (jnp.ones((8, 8)), jnp.ones((8, 4)), jnp.ones((8,)))
    pstep = parallelize(step, jax_mesh((8,)), axis="data")
    with pytest.warns(DiphomaWarning, match="was not judged"):
        pstep.trace(params, tx.init(params), batch)
    assert pstep.plan.notes["data-parallel"]["batch_judged"] is False


def _picking_step(pick):
    """SGD on a classifier whose loss is ``-mean(pick(logp, labels, perm))``."""
    tx = optax.sgd(0.1)

    def step(params, opt_state, batch):
        x, y, perm = batch

        def loss_of(p):
            return -jnp.mean(pick(jax.nn.log_softmax(x @ p["w"]), y, perm))
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    params = {"w": jax.random.normal(jax.random.key(0), (8, 10)) * 0.1}
    batch = (jax.random.normal(jax.random.key(1), (16, 8)), jnp.arange(16) % 10,
             jnp.arange(16)[::-1])
    return step, params, tx.init(params), batch


_N = 16
_PICKS = {   # each row's own entry: not found
    "arange and labels": (lambda lp, y, _: lp[jnp.arange(lp.shape[0]), y], False),
    "arange rows": (lambda lp, y, _: lp[jnp.arange(lp.shape[0])][:, 0], False),
    "take_along_axis": (lambda lp, y, _: jnp.take_along_axis(lp, y[:, None], axis=-1), False),
    # other rows' entries: found
    "reversed": (lambda lp, y, _: lp[jnp.arange(_N)[::-1], y], True),
    "shifted": (lambda lp, y, _: lp[(jnp.arange(_N) + 1) % _N, y], True),
    "rows from the batch": (lambda lp, y, perm: lp[perm, y], True),
}


@pytest.mark.parametrize("case", list(_PICKS))
def test_a_gather_of_each_rows_own_entry_is_not_found(case):
    """``logp[jnp.arange(n), labels]`` picks each example's own entry: the positions a
    share builds are its own rows'. Positions that are not the row's own (reversed,
    shifted, read from the batch) pick other examples' entries and are found."""
    from diphoma_compile.ir.batch_coupling import batch_coupling
    from diphoma_compile import trace
    pick, found = _PICKS[case]
    step, params, state, batch = _picking_step(pick)
    coupled = [c for c in batch_coupling(trace(step, params, state, batch))]
    # found at the gather, or where the reversed positions meet the labels (concat)
    assert len(coupled) == found and all(c.certain for c in coupled)


def test_a_gather_of_each_rows_own_entry_runs_as_the_single_device_step():
    step, params, state, batch = _picking_step(_PICKS["arange and labels"][0])
    pstep = parallelize(step, jax_mesh((8,)), axis="data")
    rp, rs, op, os_ = params, state, params, state
    with warnings.catch_warnings():
        warnings.simplefilter("error", DiphomaWarning)
        for _ in range(3):
            rp, rs, rl = jax.jit(step)(rp, rs, batch)
            op, os_, ol = pstep(op, os_, batch)
            np.testing.assert_allclose(float(ol), float(rl), rtol=1e-5)
    assert max_rel_dev(rp, op) <= 1e-5


def _summing_step(params, opt_state, batch, state):
    """SGD momentum on a loss written as a sum over the batch divided by the global
    batch's size (16, a constant: on each device's share of 2 rows it is no mean); a
    count of correct answers; a moving average of a batch mean of activations and a
    running total of the mean cross-entropy carried as state after the batch (a running
    total of the summed loss would be found: the state would be counted once per
    device)."""
    tx = optax.sgd(0.05, momentum=0.9)

    def loss_of(p):
        h = jnp.tanh(batch[0] @ p["w"])
        logits = h @ p["v"]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch[1])
        return ce.sum() / 16, (h, logits, ce)
    (loss, (h, logits, ce)), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    new = {"ema": 0.9 * state["ema"] + 0.1 * jnp.mean(jax.lax.stop_gradient(h), axis=0),
           "ce_total": state["ce_total"] + jnp.mean(ce)}
    correct = jnp.sum(jnp.argmax(logits, -1) == batch[1]).astype(jnp.float32)
    return optax.apply_updates(params, updates), opt_state, new, loss, correct


def test_sums_over_the_batch_add_up_and_state_linear_in_it_is_exact():
    """Under data parallelism the devices' losses, counts and gradients of a loss that is
    a sum over the batch add up to the single-device step's (averaging gave 1/8 of each);
    state updated linearly from batch means and the loss (a moving average of
    activations, a running total) is averaged, the single-device value (it was device 0's
    own); no warning."""
    k = jax.random.split(jax.random.PRNGKey(3), 4)
    params = {"w": jax.random.normal(k[0], (8, 12)) * 0.3,
              "v": jax.random.normal(k[1], (12, 5)) * 0.3}
    batch = (jax.random.normal(k[2], (16, 8)), jax.random.randint(k[3], (16,), 0, 5))
    state = {"ema": jnp.zeros(12), "ce_total": jnp.float32(0)}
    opt_state = optax.sgd(0.05, momentum=0.9).init(params)
    pstep = parallelize(_summing_step, jax_mesh((8,)), axis="data", donate=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DiphomaWarning)
        pstep.trace(params, opt_state, batch, state)
    notes = pstep.plan.notes["data-parallel"]
    assert notes["gradients"] == "sum" and sorted(notes["combined"].values()) == ["sum"] * 2
    assert notes["broadcast"] == []
    a = b = (params, opt_state, batch, state)
    for _ in range(3):
        want, got = jax.jit(_summing_step)(*a), pstep(*b)
        for w_, g_ in zip(want[3:], got[3:]):
            np.testing.assert_allclose(float(g_), float(w_), rtol=1e-5)
        a, b = (*want[:2], batch, want[2]), (*got[:2], batch, got[2])
    assert max_rel_dev((a[0], a[3]), (b[0], b[3])) <= 1e-5
    assert max_rel_dev(a[1], pstep.user_shapes(b[1], 1)) <= 1e-5


class _BatchNormNet(nn.Module):
    """No bias before the norm (as in ResNets): its gradient is zero up to rounding, which
    AdamW would turn into steps of the learning rate's size."""

    @nn.compact
    def __call__(self, x):
        h = nn.BatchNorm(use_running_average=False)(nn.Dense(16, use_bias=False)(x))
        return nn.Dense(4)(nn.relu(h))


def _batch_norm_step(net, tx):
    """A flax variables dict in, the new one out: parameters under "params", the running
    statistics under "batch_stats"."""
    def loss_of(p, stats, x, y):
        out, new = net.apply({"params": p, "batch_stats": stats}, x, mutable=["batch_stats"])
        return jnp.mean((out - y) ** 2), new

    def step(variables, opt_state, batch):
        (loss, new), grads = jax.value_and_grad(loss_of, has_aux=True)(
            variables["params"], variables["batch_stats"], *batch)
        updates, opt_state = tx.update(grads, opt_state, variables["params"])
        return ({"params": optax.apply_updates(variables["params"], updates),
                 "batch_stats": new["batch_stats"]}, opt_state, loss)
    return step, loss_of


def test_flax_batch_norm_runs_as_ddp_does():
    """A flax variables dict's batch_stats collection is model state (buffers), not
    parameters (a dict of the user's own with a "params" key, whose every leaf the
    optimizer keeps state for, is parameters throughout): compile() runs the step bit for
    bit, and data parallelism over 8 devices runs it as DDP does (each device normalizes
    its share, the gradients are averaged), with a warning that the step so differs from
    the single-device one. The running mean, a moving average of a batch mean, is the
    shares' average (the single-device value); the running variance, not linear in the
    batch, is device 0's, as under DDP. The reference is that computed by hand: each
    share's gradients (vmap), their mean, one AdamW update, those statistics."""
    from diphoma_compile import compile as compile_step
    net, tx = _BatchNormNet(), optax.adamw(1e-2)
    x = jax.random.normal(jax.random.PRNGKey(1), (32, 8))
    y = jax.random.normal(jax.random.PRNGKey(2), (32, 4))
    variables = net.init(jax.random.PRNGKey(0), x)
    opt_state = tx.init(variables["params"])
    step, loss_of = _batch_norm_step(net, tx)

    compiled = compile_step(step, variables, opt_state, (x, y))
    roles = {i.name: i.role.kind.value for i in compiled.graph.inputs}
    assert roles["params/batch_stats/BatchNorm_0/mean"] == "buffer"
    assert roles["params/params/Dense_0/kernel"] == "param"
    mu = next(i for i in compiled.graph.inputs if i.name == "opt_state/0/mu/Dense_0/kernel")
    assert mu.role.of == "params/params/Dense_0/kernel"
    # a dict of the user's own with a "params" key, every leaf trained: all parameters
    tx_all = optax.adam(0.1)
    own = {"params": jnp.ones((8, 4)), "scale": jnp.ones((4,))}

    def own_step(p, s, b):
        loss, grads = jax.value_and_grad(
            lambda p: jnp.mean((b[0] @ p["params"] * p["scale"]) ** 2))(p)
        updates, s = tx_all.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss
    kinds = {i.name: i.role.kind.value for i in
             compile_step(own_step, own, tx_all.init(own), (x,)).graph.inputs}
    assert kinds["params/scale"] == "param"
    ref = jax.jit(step)
    a, b = (variables, opt_state), (variables, opt_state)
    for _ in range(2):
        *a, la = ref(*a, (x, y))
        *b, lb = compiled(*b, (x, y))
        assert float(la) == float(lb)
    assert jax.tree.all(jax.tree.map(lambda p, q: bool(jnp.array_equal(p, q)), a[0], b[0]))

    pstep = parallelize(step, jax_mesh((8,)), axis="data")
    with pytest.warns(DiphomaWarning, match="combines examples of its batch"):
        pstep.trace(variables, opt_state, (x, y))
    assert pstep.plan.notes["data-parallel"]["broadcast"] == [
        "new/params/batch_stats/BatchNorm_0/var"]
    assert "new/params/batch_stats/BatchNorm_0/mean" in \
        pstep.plan.notes["data-parallel"]["averaged"]

    def ddp(variables, opt_state):
        shares = (x.reshape(8, 4, 8), y.reshape(8, 4, 4))
        (losses, new), grads = jax.vmap(jax.value_and_grad(loss_of, has_aux=True),
                                        in_axes=(None, None, 0, 0))(
            variables["params"], variables["batch_stats"], *shares)
        grads = jax.tree.map(lambda g: g.mean(0), grads)
        updates, opt_state = tx.update(grads, opt_state, variables["params"])
        stats = jax.tree_util.tree_map_with_path(
            lambda path, s: s.mean(0) if path[-1].key == "mean" else s[0], new["batch_stats"])
        return ({"params": optax.apply_updates(variables["params"], updates),
                 "batch_stats": stats}, opt_state, losses.mean())
    a, b = (variables, opt_state), (variables, opt_state)
    for _ in range(3):
        *a, la = jax.jit(ddp)(*a)
        *b, lb = pstep(*b, (x, y))
        np.testing.assert_allclose(float(lb), float(la), rtol=1e-5)
    assert max_rel_dev(a[0], pstep.user_shapes(b[0], 0)) <= 1e-5


def test_a_per_example_result_shaped_like_batch_weights_is_not_their_new_value():
    """A step returning per-example losses, shaped like the per-example weights it takes
    after the batch: the weights stay batch (split with it), the result a metric; the
    loss is the single-device step's."""
    net, tx = nn.Dense(4), optax.sgd(0.1)
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    x, y = jax.random.normal(k[0], (8, 8)), jax.random.normal(k[1], (8, 4))
    w = jax.random.uniform(k[2], (8,))
    params = net.init(k[3], x)["params"]

    def step(params, opt_state, x, y, w):
        def loss_of(p):
            per = jnp.mean((net.apply({"params": p}, x) - y) ** 2, -1) * w
            return per.mean(), per
        (loss, per), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, per
    pstep = parallelize(step, jax_mesh((8,)), axis="data")
    got = pstep(params, tx.init(params), x, y, w)
    want = jax.jit(step)(params, tx.init(params), x, y, w)
    assert {i.name: i.role.kind.value for i in pstep.graph.inputs}["batch2"] == "batch"
    np.testing.assert_allclose(float(got[2]), float(want[2]), rtol=1e-6)


def test_a_batch_centering_and_a_contrastive_loss_are_warned_of():
    """Features centred over the batch (a batch norm's first half, written out) and a
    contrastive loss (every example's embedding against every other's): each device's
    share computes them alone."""
    tx = optax.sgd(0.1)

    def centred_step(params, opt_state, batch):
        def loss_of(p):
            h = batch[0] @ p["w"]
            h = h - jnp.mean(h, axis=0)
            return jnp.mean((h - batch[1]) ** 2)
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    params = {"w": jnp.ones((8, 4))}
    pstep = parallelize(centred_step, jax_mesh((8,)), axis="data")
    with pytest.warns(DiphomaWarning, match=r"\(sub\): reads a sum or mean over the batch"):
        pstep.trace(params, tx.init(params), (jnp.ones((16, 8)), jnp.ones((16, 4))))
    assert len(pstep.plan.notes["data-parallel"]["batch_coupled"]) == 1

    def contrastive_step(params, opt_state, batch):
        def loss_of(p):
            u, v = batch[0] @ p["a"], batch[1] @ p["b"]
            logits = u @ v.T
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, jnp.arange(logits.shape[0])).mean()
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    params = {"a": jnp.ones((8, 4)), "b": jnp.ones((6, 4))}
    pstep = parallelize(contrastive_step, jax_mesh((8,)), axis="data")
    with pytest.warns(DiphomaWarning, match=r"\(dot\)"):
        pstep.trace(params, tx.init(params), (jnp.ones((16, 8)), jnp.ones((16, 6))))


@pytest.mark.parametrize("penalty", ["eigvalsh", "cholesky"])
def test_linear_algebra_on_the_batch_covariance_is_warned_of(penalty):
    """A penalty on the batch's covariance (the largest eigenvalue of h.T h / B, a Cholesky
    factor's trace): XLA ops of no rule reading a sum over the batch. Silent before (a
    reviewer's probe, 2026-12-07: loss 1.916 on 4 devices against jax.jit's 1.854)."""
    tx = optax.sgd(0.1)
    pen = {"eigvalsh": lambda c: jnp.linalg.eigvalsh(c).max(),
           "cholesky": lambda c: jnp.trace(jnp.linalg.cholesky(c + jnp.eye(4)))}[penalty]

    def step(params, opt_state, batch):
        def loss_of(p):
            h = batch[0] @ p["w"]
            return jnp.mean((h - batch[1]) ** 2) + 0.1 * pen(h.T @ h / h.shape[0])
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    params = {"w": jnp.linspace(-1.0, 1.0, 32).reshape(8, 4)}
    batch = (jnp.linspace(0.0, 1.0, 128).reshape(16, 8), jnp.ones((16, 4)))
    pstep = parallelize(step, jax_mesh((8,)), axis="data")
    with pytest.warns(DiphomaWarning, match=r"\(jax:(eigh|cholesky)\): reads a sum or mean "
                                            r"over the batch in math that is not linear"):
        pstep.trace(params, tx.init(params), batch)


@pytest.mark.parametrize("take", ["half", "one piece", "both pieces"])
def test_rows_taken_by_position_are_warned_of(take):
    """A loss over the batch's first half (a slice, or one piece of ``jnp.split``): each
    device's share holds other examples there, so the parallel step trains on other rows
    than the single-device one (before, silently). Both pieces (each row once) are exact."""
    tx = optax.sgd(0.1)

    def step(params, opt_state, batch):
        x, y = batch

        def loss_of(p):
            if take == "half":
                return jnp.mean((x[: x.shape[0] // 2] @ p["w"] - y[: y.shape[0] // 2]) ** 2)
            pieces = list(zip(jnp.split(x, 2), jnp.split(y, 2)))
            if take == "one piece":
                pieces = pieces[:1]
            return sum(jnp.mean((a @ p["w"] - b) ** 2) for a, b in pieces) / len(pieces)
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"w": jax.random.normal(k[0], (8, 4))}
    batch = (jax.random.normal(k[1], (32, 8)), jax.random.normal(k[2], (32, 4)))
    pstep = parallelize(step, jax_mesh((8,)), axis="data")
    if take == "both pieces":
        with warnings.catch_warnings():
            warnings.simplefilter("error", DiphomaWarning)
            got = pstep(params, tx.init(params), batch)
        want = jax.jit(step)(params, tx.init(params), batch)
        assert max_rel_dev(want[0], got[0]) <= 1e-5
        return
    op = "slice" if take == "half" else "jax:split"
    with pytest.warns(DiphomaWarning, match=rf"\({op}\): takes rows \[0:2\] of 4 by their"):
        pstep.trace(params, tx.init(params), batch)


@pytest.mark.parametrize("take", ["roll", "diff", "halves", "shift pairs"])
def test_rows_paired_by_position_are_warned_of(take):
    """``jnp.roll`` along the batch (its last rows joined before its first) and
    ``jnp.diff`` (two overlapping windows of the rows) pair each example with its
    neighbour: a device's share pairs other examples (before: silently averaged). The
    same windows joined in order stay exact."""
    tx = optax.sgd(0.1)

    def step(params, opt_state, batch):
        x, y = batch

        def loss_of(p):
            h = x @ p["w"]
            if take == "roll":
                return jnp.mean((h - jnp.roll(y, 1, axis=0)) ** 2)
            if take == "diff":
                return jnp.mean(jnp.diff(h, axis=0) ** 2)
            n = y.shape[0]
            if take == "halves":            # row i with row i + n/2
                return jnp.mean((h[: n // 2] - h[n // 2:]) ** 2)
            return jnp.mean((h - jnp.concatenate([y[: n // 2], y[n // 2:]])) ** 2)
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"w": jax.random.normal(k[0], (8, 4))}
    batch = (jax.random.normal(k[1], (32, 8)), jax.random.normal(k[2], (32, 4)))
    pstep = parallelize(step, jax_mesh((8,)), axis="data")
    if take == "shift pairs":
        with warnings.catch_warnings():
            warnings.simplefilter("error", DiphomaWarning)
            got = pstep(params, tx.init(params), batch)
        want = jax.jit(step)(params, tx.init(params), batch)
        assert max_rel_dev(want[0], got[0]) <= 1e-5
        return
    match = {"roll": r"\(concat\): joins windows of the batch's rows in another order",
             "diff": r"\(slice\): takes rows \[0:3\] and \[1:4\] of 4, which overlap",
             "halves": r"\(sub\): pairs rows \[0:2\] and \[2:4\] of 4 by their position"}[take]
    with pytest.warns(DiphomaWarning, match=match):
        pstep.trace(params, tx.init(params), batch)


@pytest.mark.parametrize("count", ["shape", "ones", "ones_like"])
def test_counts_from_the_batchs_shape_are_warned_of(count):
    """The step is traced at a device's share: ``x.shape[0]`` and arrays of ones at it (JAX's
    ``ones_like`` reads only its operand's shape) count the share's rows, 1/8 of the
    batch here, and no value of the batch reaches them (silent before)."""
    tx = optax.sgd(0.1)

    def step(params, opt_state, batch):
        x, y = batch
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((x @ p["w"] - y) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        n = {"shape": lambda: jnp.asarray(x.shape[0], jnp.float32),
             "ones": lambda: jnp.ones(x.shape[0]).sum(),
             "ones_like": lambda: jnp.ones_like(x[:, 0]).sum()}[count]()
        return optax.apply_updates(params, updates), opt_state, loss, n
    params = {"w": jnp.ones((8, 4))}
    pstep = parallelize(step, jax_mesh((8,)), axis="data")
    where = r"the step's result %metric/1" if count == "shape" else r"test_jax_parallel.py:\d+"
    with pytest.warns(DiphomaWarning, match=rf"{where} \(\w+\): makes a value the step "
                                            r"returns from the number 4, the rows"):
        pstep.trace(params, tx.init(params), (jnp.ones((32, 8)), jnp.ones((32, 4))))


# ------------------------------------------------------------------ several batch arguments

class Small(nn.Module):
    """8 -> 16 -> 4: the hidden width is the batch size, for the coincidence below."""

    @nn.compact
    def __call__(self, x, scale=None):
        h = nn.relu(nn.Dense(16)(x))
        return nn.Dense(4)(h if scale is None else h * scale)


def _small_case():
    rng = np.random.default_rng(0)
    module, tx = Small(), optax.adamw(1e-2)
    x, y = _normal(rng, (16, 8)), _normal(rng, (16, 4))
    abstract = jax.eval_shape(module.init, jax.random.key(0), x)["params"]
    params = jax.tree.map(lambda a: _normal(rng, a.shape, 0.3), abstract)

    def step(params, opt_state, x, y):
        def loss_of(p):
            return jnp.mean((module.apply({"params": p}, x) - y) ** 2)
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return module, tx, step, params, jax.jit(tx.init)(params), x, y


def test_a_step_taking_x_and_y_splits_both_and_matches_the_single_device_step():
    """step(params, opt_state, x, y), as most people write it: y was taken as a value every
    device needs whole, and optax failed deep inside on (2, 4) - (16, 4)."""
    _, _, step, params, opt_state, x, y = _small_case()
    pstep = parallelize(step, jax_mesh((8,)), axis="data")
    rp, rs, op, os_ = params, opt_state, params, opt_state
    losses = []
    for _ in range(4):
        rp, rs, rl = jax.jit(step)(rp, rs, x, y)
        op, os_, ol = pstep(op, os_, x, y)
        np.testing.assert_allclose(float(ol), float(rl), rtol=1e-5)
        losses.append(float(rl))
    assert losses[-1] < losses[0]
    assert jax.tree.structure((op, os_)) == jax.tree.structure((rp, rs))
    assert max_dev((rp, rs), (op, pstep.user_shapes(os_, 1))) <= 1e-6   # reduction order only
    # naming the batch arguments gives the same program
    explicit = parallelize(step, jax_mesh((8,)), axis="data", batch_argnums=(2, 3))
    ep, es = params, opt_state
    for _ in range(4):
        ep, es, _ = explicit(ep, es, x, y)
    assert max_dev((ep, es), (op, os_)) == 0.0
    batch = {i.name: i.value.type.shape for i in pstep.graph.inputs
             if i.role.kind.value == "batch"}
    assert batch == {"batch0": (2, 8), "batch1": (2, 4)}     # both split over 8 devices


def test_keys_and_numbers_after_the_batch_are_not_batch():
    from diphoma_compile.jax.roles import infer_batch_argnums
    p, s = {"w": np.ones((16, 4))}, ()
    x, y = np.ones((16, 8)), np.ones((16, 4))
    lr, key, old_key = np.float32(0.1), jax.random.key(0), jax.random.PRNGKey(0)
    assert infer_batch_argnums((p, s, x)) == (2,)
    assert infer_batch_argnums((p, s, x, key)) == (2,)
    assert infer_batch_argnums((p, s, x, lr, old_key)) == (2,)
    assert infer_batch_argnums((p, s, (x, y), lr)) == (2,)
    assert infer_batch_argnums((p, s, x, y, key, {"m": np.ones(16)}, lr)) == (2, 3, 5)
    with pytest.raises(DiphomaError, match=r"step argument 3 .*argument 3/t \(float64\[5, 4\]\)"
                                           r" has a leading dimension other than the batch's "
                                           r"16 rows") as e:
        infer_batch_argnums((p, s, x, {"t": np.ones((5, 4))}))
    assert "batch_argnums=" in e.value.hint and "(2, 3)" in e.value.hint
    with pytest.raises(DiphomaError, match=r"argument 3/0 has the batch's 16 rows but "
                                           r"argument 3/1 is a single number"):
        infer_batch_argnums((p, s, x, (y, lr)))


def test_an_argument_with_the_batch_size_by_coincidence_is_refused():
    """A per-feature scale as wide as the batch is long: taken by its shape it would be cut
    in eight. The step runs with it whole while the batch is cut, so it is not per-example;
    batch_argnums says what it is."""
    module, tx, _, params, opt_state, x, y = _small_case()
    scale = jnp.linspace(0.5, 1.5, 16)

    def step(params, opt_state, batch, scale):
        def loss_of(p):
            return jnp.mean((module.apply({"params": p}, batch[0], scale) - batch[1]) ** 2)
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    with pytest.raises(DiphomaError, match=r"step argument 3 has the batch's 16 rows, but "
                                           r"the step also runs with it whole") as e:
        parallelize(step, jax_mesh((8,)), axis="data").trace(params, opt_state, (x, y), scale)
    assert "batch_argnums=" in e.value.hint and "(2,)" in e.value.hint
    pstep = parallelize(step, jax_mesh((8,)), axis="data", batch_argnums=2)
    ours, ref = user(pstep, pstep(params, opt_state, (x, y), scale)), \
        jax.jit(step)(params, opt_state, (x, y), scale)
    assert max_dev(ref, ours) <= 1e-6


def test_a_table_after_the_batch_is_refused_with_what_to_do():
    module, tx, _, params, opt_state, x, y = _small_case()

    def step(params, opt_state, x, table):
        def loss_of(p):
            return jnp.mean((module.apply({"params": p}, x) - table[0]) ** 2)
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    table = jnp.ones((3, 4))
    with pytest.raises(DiphomaError, match=r"cannot tell whether step argument 3 is part of "
                                           r"the batch.*float32\[3, 4\]"):
        parallelize(step, jax_mesh((8,)), axis="data")(params, opt_state, x, table)
    pstep = parallelize(step, jax_mesh((8,)), axis="data", batch_argnums=(2,))
    assert max_dev(jax.jit(step)(params, opt_state, x, table),
                   user(pstep, pstep(params, opt_state, x, table))) <= 1e-6
    with pytest.raises(DiphomaError, match=r"batch_argnums='x' is not one or more argument"):
        parallelize(step, jax_mesh((8,)), batch_argnums="x")
    with pytest.raises(DiphomaError, match=r"argument number\(s\) \[7\]"):
        parallelize(step, jax_mesh((8,)), axis="data", batch_argnums=(2, 7)).trace(
            params, opt_state, x, table)


def test_golden_ir_of_a_key_mask_drawn_per_row(golden):
    """The data-parallel IR of a dropout mask from the step's key on the batch (the golden
    of ``random_bits`` at the global batch's shape and its ``take_piece``)."""
    from diphoma_compile import Mesh
    from diphoma_compile.ir import print_graph
    from diphoma_compile.framework import get
    from diphoma_compile.jax.trace import trace_jax
    from diphoma_compile.passes import PassContext
    get("jax")          # its op rules registered, as parallelize does
    from diphoma_compile.passes.pipeline import Pipeline
    tx = optax.sgd(0.1)

    def step(params, opt_state, x, key):
        def loss_of(p):
            keep = jax.random.bernoulli(key, 0.5, x.shape)
            return jnp.mean(jnp.where(keep, x, 0.0) @ p["w"])
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    params = {"w": jnp.ones((4,), jnp.float32)}
    g = trace_jax(step, params, tx.init(params), jnp.ones((2, 4)), jax.random.key(0),
                  locations=False)
    g = Pipeline.from_spec("dce,data-parallel{axis=dp}").run(g.replace(mesh=Mesh({"dp": 8})),
                                                              PassContext())
    text = print_graph(g)
    assert "shape=[16, 4]" in text and "take_piece(" in text
    golden("jax_dropout_sgd.dp8.ir", text)


def _accumulating_step(how: str):
    """Gradient accumulation over 4 microbatches of the batch: in a lax.scan, or in a
    Python loop (each value_and_grad traced); Adam."""
    tx = optax.adam(1e-2)

    def loss_of(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w"]) @ p["v"] - y) ** 2)

    def step(params, opt_state, batch):
        x, y = batch
        if how == "scan":
            def body(acc, mb):
                loss, g = jax.value_and_grad(loss_of)(params, *mb)
                return jax.tree.map(jnp.add, acc, g), loss
            grads, losses = jax.lax.scan(
                body, jax.tree.map(jnp.zeros_like, params),
                (x.reshape(4, -1, x.shape[-1]), y.reshape(4, -1, y.shape[-1])))
            grads, loss = jax.tree.map(lambda g: g / 4, grads), losses.mean()
        else:
            grads, loss = jax.tree.map(jnp.zeros_like, params), 0.0
            for a, b in zip(jnp.split(x, 4), jnp.split(y, 4)):
                part, g = jax.value_and_grad(loss_of)(params, a, b)
                grads = jax.tree.map(lambda s, t: s + t / 4, grads, g)
                loss = loss + part / 4
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {"w": jax.random.normal(k[0], (8, 16)) * 0.3,
              "v": jax.random.normal(k[1], (16, 4)) * 0.3}
    batch = (jax.random.normal(k[2], (64, 8)), jax.random.normal(k[3], (64, 4)))
    return step, params, tx.init(params), batch


def test_gradient_accumulation_in_a_python_loop_matches_one_device():
    step, params, opt_state, batch = _accumulating_step("loop")
    pstep = parallelize(step, jax_mesh((8,)), axis="data")
    a = b = (params, opt_state)
    for _ in range(3):
        want, got = jax.jit(step)(*a, batch), pstep(*b, batch)
        np.testing.assert_allclose(float(got[2]), float(want[2]), rtol=1e-5)
        a, b = want[:2], got[:2]
    assert max_rel_dev(a[0], b[0]) <= 1e-5


def test_gradient_accumulation_in_a_scan_is_refused_saying_what_to_do():
    """Autodiff inside a lax.scan leaves no backward pass outside it: refused naming the
    scan and the forms that run (before: 'computed from the batch outside backward')."""
    step, params, opt_state, batch = _accumulating_step("scan")
    pstep = parallelize(step, jax_mesh((8,)), axis="data")
    with pytest.raises(DiphomaError, match=r"inside a lax.scan .*\n.*Python loop.*MultiSteps"):
        pstep.trace(params, opt_state, batch)


@pytest.mark.parametrize("shape,dim,bits", [((16, 4), 0, 32), ((8, 3, 5), 0, 32),
                                            ((4, 16), 1, 8), ((8, 2, 6), 2, 16)])
def test_a_devices_piece_of_a_key_draw_is_the_slice_of_the_whole(shape, dim, bits):
    """jax/key_pieces.py: each device computes only its piece of bits drawn at the global
    shape (partitionable threefry: element i hashes the counter i), bit for bit the slice
    of the whole draw, without drawing the rest."""
    from diphoma_compile.jax import key_pieces
    mesh = jax_mesh((8,)) if shape[dim] % 8 == 0 else None
    n = 8 if mesh is not None else 2
    mesh = mesh or jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    key = jax.random.key(7)
    d = key_pieces.Deferred(key, bits, shape)
    assert key_pieces._partitionable(d)
    spec = P(*[("data" if k == dim else None) for k in range(len(shape))])
    got = jax.jit(jax.shard_map(lambda: key_pieces.piece(d, "data", n, dim), mesh=mesh,
                                in_specs=(), out_specs=spec, check_vma=False))()
    want = jax.random.bits(key, shape, np.dtype(f"uint{bits}"))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("partitionable", [True, False])
def test_a_microbatchs_piece_of_a_devices_piece_of_a_key_draw_is_its_slice(partitionable,
                                                                            monkeypatch):
    """A pipeline's microbatch keeps rows [m b, (m + 1) b) of its data-parallel share's
    piece of a draw (passes/pipeline_draws.py): made from those rows' counters alone
    (jax/key_pieces.py windows), bit for bit the slice of the whole draw; where the
    generator is not partitionable (taken as not here), the whole draw sliced."""
    from diphoma_compile.jax import key_pieces
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    key = jax.random.key(3)
    shape, m = (16, 3), 4
    d = key_pieces.Deferred(key, 32, shape)
    assert key_pieces._partitionable(d)
    if not partitionable:
        monkeypatch.setattr(key_pieces, "_partitionable", lambda d: False)

    def mine(index):
        share = key_pieces.device_piece(d, "data", 2, 0)
        return key_pieces.pick(key_pieces.as_pieces(share, 0, m), index)
    run = jax.jit(jax.shard_map(mine, mesh=mesh, in_specs=P(), out_specs=P("data"),
                                check_vma=False))
    whole = np.asarray(jax.random.bits(key, shape, np.uint32))
    for index in range(m):
        got = np.asarray(run(jnp.int32(index)))       # both devices' pieces, stacked
        want = np.concatenate([whole[dev * 8 + index * 2: dev * 8 + index * 2 + 2]
                               for dev in range(2)])
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_python_numbers_are_step_arguments_as_under_jit(dtype):
    """A Python float (a loss scale) and int (a step count) passed to the step are scalar
    inputs, weakly typed as jax.jit traces them (bf16 times 0.5 stays bf16): compile and
    dp=8 match jax.jit as the numbers change between calls."""
    dt = jnp.dtype(dtype)
    tx = optax.sgd(0.1)

    def step(params, opt_state, x, y, scale, warm):
        def loss_fn(p):
            return jnp.mean((x @ p["w"] - y) ** 2)
        loss, g = jax.value_and_grad(loss_fn)(params)
        g = jax.tree.map(lambda t: t * scale / (1 + warm), g)
        upd, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, loss

    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(4, 2)), dt)}
    x, y = (jnp.asarray(rng.normal(size=s), dt) for s in ((16, 4), (16, 2)))
    calls = [(0.5, 0), (2.0, 0), (2.0, 1)]
    runs = {}
    for name in ("jit", "compile", "dp"):
        fn = {"jit": jax.jit(step), "dp": parallelize(step, {"dp": 8}, donate=False),
              "compile": diphoma_compile.compile(step, params, tx.init(params), x, y, 0.5, 0)
              }[name]
        p, o, losses = params, tx.init(params), []
        for scale, warm in calls:
            p, o, loss = fn(p, o, x, y, scale, warm)
            losses.append(float(loss))
        assert p["w"].dtype == dt
        runs[name] = (np.asarray(p["w"], np.float32), losses)
    tol = 1e-6 if dtype == "float32" else 1e-2
    for name in ("compile", "dp"):
        np.testing.assert_allclose(runs[name][0], runs["jit"][0], atol=tol, rtol=tol)
        np.testing.assert_allclose(runs[name][1], runs["jit"][1], atol=tol, rtol=tol)
    # the numbers change the step well beyond the tolerance (a program that kept the
    # traced ones as constants would fail above)
    p, o = params, tx.init(params)
    for _ in calls:
        p, o, _ = jax.jit(step)(p, o, x, y, *calls[0])
    assert np.abs(np.asarray(p["w"], np.float32) - runs["jit"][0]).max() > 5 * tol


def test_a_captured_typed_key_draws_as_under_jit():
    """A typed key the step captures (``KEY = jax.random.key(42)`` at module level, dropout
    drawn from it at the batch's shape) is a constant of its words wrapped as a key: compile
    is jax.jit's step bit for bit, and dp=8 (each device keeping its rows of the draw)
    within rounding, over three Adam steps."""
    key = jax.random.key(42)
    tx = optax.adam(0.01)

    def step(params, opt_state, x, y):
        def loss_fn(p):
            keep = jax.random.bernoulli(key, 0.8, (x.shape[0], 16))
            h = jnp.tanh(x @ p["w1"]) * keep / 0.8
            return jnp.mean((h @ p["w2"] - y) ** 2)
        loss, g = jax.value_and_grad(loss_fn)(params)
        upd, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, loss

    rng = np.random.default_rng(0)
    params = {"w1": jnp.asarray(rng.normal(size=(8, 16)), jnp.float32),
              "w2": jnp.asarray(rng.normal(size=(16, 2)), jnp.float32)}
    x, y = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((32, 8), (32, 2)))
    runs = {}
    for name, fn in (("jit", jax.jit(step)), ("dp", parallelize(step, {"dp": 8}, donate=False)),
                     ("compile", diphoma_compile.compile(step, params, tx.init(params), x, y))):
        p, o = params, tx.init(params)
        for _ in range(3):
            p, o, loss = fn(p, o, x, y)
        runs[name] = (p, float(loss))
    for name, tol in (("compile", 0.0), ("dp", 1e-6)):
        for k in params:
            np.testing.assert_allclose(runs[name][0][k], runs["jit"][0][k], atol=tol, rtol=0)
        assert abs(runs[name][1] - runs["jit"][1]) <= tol * abs(runs["jit"][1])


@pytest.mark.parametrize("mesh, microbatches, early", [
    ({"dp": 8}, 1, False), ({"dp": 4, "pp": 2}, 2, False), ({"dp": 4, "pp": 2}, 2, True),
    ({"dp": 4, "pp": 2}, 2, "outside")])
def test_a_mean_over_a_mask_drawn_from_the_key_matches_the_single_device_step(
        mesh, microbatches, early):
    """The examples picked at random from the step's key (a Bernoulli mask at the
    per-example losses' shape) and the loss averaged over those picked: the mask is the
    single-device step's (drawn at the global batch's shape, each device keeping its
    rows), and each device divides by the count summed over the devices, and with a
    pipeline over the microbatches too (the draw made again, from the same key and
    microbatch index, in the stage's count program). Before 2026-12-07 the draw was taken
    for a whole value and the loss for a sum over the batch: dp=8 added the devices' losses
    and gradients up, NaN where a device picked none; dp=4 x pp=2 was refused. ``early``:
    the mask drawn at the top of the step, before the model runs (a review's
    probe): the cut makes it on the first stage and sends it; the count program makes it
    again on the loss's stage (an internal error at first). ``outside``: drawn and counted
    at the top, outside the differentiated function: the cut makes the draw again on each
    stage that reads it, as it does the batch's values (same key, same microbatch index);
    refused until 2026-12-07 (the backward's product with the mask was placed with the
    mask on the first stage and read on the second)."""
    model = MLP()
    x = jax.random.normal(jax.random.key(1), (16, 8))
    y = jax.random.randint(jax.random.key(2), (16,), 0, 4)
    params = model.init(jax.random.key(0), x)["params"]
    tx = optax.sgd(0.1)

    def step(params, opt_state, x, y, key):
        drawn = jax.random.bernoulli(key, 0.5, y.shape).astype(jnp.float32)
        count = jnp.sum(drawn)

        def lf(p):
            per = optax.softmax_cross_entropy_with_integer_labels(
                model.apply({"params": p}, x), y)
            if early == "outside":
                return jnp.sum(per * drawn) / count
            if early:
                return jnp.sum(per * drawn) / jnp.sum(drawn)
            m = jax.random.bernoulli(key, 0.5, per.shape).astype(jnp.float32)
            return jnp.sum(per * m) / jnp.sum(m)
        loss, g = jax.value_and_grad(lf)(params)
        up, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, up), opt_state, loss
    pstep = parallelize(step, mesh, microbatches=microbatches)
    ref = ours = (params, tx.init(params))
    for k in range(2):
        key = jax.random.key(5 + k)
        *ref, want = jax.jit(step)(*ref, x, y, key)
        *ours, got = pstep(*ours, x, y, key)
        np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    assert max_rel_dev(ref[0], ours[0]) <= 1e-5
    summed = pstep.plan.notes["pipeline" if microbatches > 1 else "data-parallel"]
    assert len(summed["counted_globally"]) == 1


@pytest.mark.parametrize("update", ["ravel_pytree norm", "median threshold"])
def test_an_update_that_ravels_a_split_gradient_gathers_it_and_matches_jax_jit(update):
    """A (7, 24) gradient split along its second dimension over 8 devices, raveled
    (``jax.flatten_util.ravel_pytree`` of the gradients, or ``ravel()`` for a sort's
    median): its 168 elements are 7 groups of 24 each split (S(0,7)), which the gather
    weight-update sharding inserted could not take, and the pass left a graph that did not
    verify (a review's probe, 2026-12-07). Viewed as (7, 24) again it is gathered there."""
    from jax.flatten_util import ravel_pytree
    rng = np.random.default_rng(0)

    def r(*shape):
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32) * 0.4)
    params = {"w": r(7, 24), "b": r(24), "v": r(24, 5), "c": r(5)}
    batch = (r(16, 7), r(16, 5))
    tx = optax.sgd(0.1, momentum=0.9)

    def step(params, opt_state, batch):
        def loss_of(p):
            out = jnp.tanh(batch[0] @ p["w"] + p["b"]) @ p["v"] + p["c"]
            return jnp.mean((out - batch[1]) ** 2)
        loss, g = jax.value_and_grad(loss_of)(params)
        if update == "ravel_pytree norm":
            flat, unravel = ravel_pytree(g)
            g = unravel(flat / (jnp.linalg.norm(flat) + 1e-6))
        else:
            g = jax.tree.map(lambda u: jnp.where(
                jnp.abs(u) >= jnp.sort(jnp.abs(u).ravel())[u.size // 2], u, 0.0), g)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    pstep = parallelize(step, jax_mesh((8,)), axis="data")
    rp, rs, op, os_ = params, tx.init(params), params, tx.init(params)
    for _ in range(3):
        rp, rs, rl = jax.jit(step)(rp, rs, batch)
        op, os_, ol = pstep(op, os_, batch)
        assert abs(float(ol) - float(rl)) <= 1e-5 * abs(float(rl)), (float(ol), float(rl))
    assert max_rel_dev(rp, op) <= 1e-5
    sharded = pstep.plan.notes["weight-update-sharding"]["sharded"]
    assert [how for name, how in sharded.items() if name.endswith("/w")] == ["S(1)"], sharded


def test_a_metric_of_the_new_parameters_on_the_batch_runs_under_data_parallel():
    """A step returning the loss of its new parameters on the same batch: the model run
    again in the update phase, ``f(new, x) - y`` a difference of two per-device values,
    was taken for two contributions to one gradient and moved into backward, reading a
    value the update makes: the pass left a graph that did not verify (a review's probe,
    2026-12-07). Under data parallelism alone it matches jax.jit; weight-update sharding
    refuses it, as docs/data-parallel.md says."""
    rng = np.random.default_rng(0)

    def r(*shape):
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32) * 0.4)
    params = {"w": r(7, 24), "b": r(24), "v": r(24, 5), "c": r(5)}
    batch = (r(16, 7), r(16, 5))
    tx = optax.adam(1e-2)

    def loss_of(p, b):
        return jnp.mean((jnp.tanh(b[0] @ p["w"] + p["b"]) @ p["v"] + p["c"] - b[1]) ** 2)

    def step(params, opt_state, batch):
        loss, g = jax.value_and_grad(loss_of)(params, batch)
        updates, opt_state = tx.update(g, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss, loss_of(params, batch)
    pstep = parallelize(step, jax_mesh((8,)), axis="data",
                        passes="dce,data-parallel{axis=data},dce")
    rp, rs, op, os_ = params, tx.init(params), params, tx.init(params)
    for _ in range(3):
        rp, rs, rl, rafter = jax.jit(step)(rp, rs, batch)
        op, os_, ol, oafter = pstep(op, os_, batch)
        for a, b in ((ol, rl), (oafter, rafter)):
            assert abs(float(a) - float(b)) <= 1e-5 * abs(float(b)), (float(a), float(b))
    assert max_rel_dev(rp, op) <= 1e-5
    with pytest.raises(DiphomaError, match="runs the model on the batch again after the "
                                           "optimizer step"):
        parallelize(step, jax_mesh((8,)), axis="data").trace(params, tx.init(params), batch)


def test_lbfgs_runs_without_a_line_search_and_is_refused_clearly_with_one():
    """optax.lbfgs keeps a history of parameter and gradient differences, [10, 24] for a
    [24] bias: weight-update sharding wrote the bias's piece (S(0)) into it by cutting the
    history along its dim 0 as well (10 rows over 8 devices), and the graph did not
    verify; a piece's split is carried to the result's aligned dimension now (dim 1), and
    the step matches jax.jit. Its default zoom line search evaluates the loss on the
    batch inside a while loop in the update: refused, saying so (a verifier's list of
    fifty types before, 2026-12-07)."""
    rng = np.random.default_rng(0)

    def r(*shape):
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32) * 0.4)
    params = {"w": r(7, 24), "b": r(24), "v": r(24, 5), "c": r(5)}
    batch = (r(16, 7), r(16, 5))

    def make(tx):
        def step(params, opt_state, batch):
            def loss_of(p):
                return jnp.mean((jnp.tanh(batch[0] @ p["w"] + p["b"]) @ p["v"] + p["c"]
                                 - batch[1]) ** 2)
            loss, g = jax.value_and_grad(loss_of)(params)
            updates, opt_state = tx.update(g, opt_state, params, value=loss, grad=g,
                                           value_fn=loss_of)
            return optax.apply_updates(params, updates), opt_state, loss
        return step
    tx = optax.lbfgs(learning_rate=0.1, linesearch=None)
    step = make(tx)
    pstep = parallelize(step, jax_mesh((8,)), axis="data")
    ref = jax.jit(step)
    rp, rs, op, os_ = params, tx.init(params), params, tx.init(params)
    for _ in range(3):
        rp, rs, rl = ref(rp, rs, batch)
        op, os_, ol = pstep(op, os_, batch)
        assert abs(float(ol) - float(rl)) <= 1e-5 * abs(float(rl)), (float(ol), float(rl))
    assert max_rel_dev(rp, op) <= 1e-5
    searching = optax.lbfgs()
    with pytest.raises(DiphomaError, match="a line search, as optax.lbfgs's"):
        parallelize(make(searching), jax_mesh((8,)), axis="data").trace(
            params, searching.init(params), batch)
