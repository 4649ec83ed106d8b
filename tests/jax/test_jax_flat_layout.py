"""JAX shards every tensor (issue 15, item 5): weight-update sharding's ``layout=dims-or-flat``
splits a dimension the data axis divides, and stores every other tensor flat (padded to a
multiple of N, a 1-D array split over the axis, jax/layout.py). On 8 CPU devices, a model
whose dimensions do not divide 8 (vocab 509, width 66) keeps every optimizer-state leaf of
at least 4096 elements at 1/8 (+2%) per device and matches the single-device step; optax's
Adafactor has its factored moments linked to their parameters and split along the
parameter's split dimension where they keep it, with the plan saying why where not."""

from __future__ import annotations

import math

import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
optax = pytest.importorskip("optax")

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from diphoma_compile import Mesh, parallelize  # noqa: E402
from diphoma_compile.errors import BackendError  # noqa: E402
from diphoma_compile.ir import print_graph  # noqa: E402
from diphoma_compile.jax.trace import trace_jax  # noqa: E402
from diphoma_compile.passes import PassContext  # noqa: E402
from diphoma_compile.passes.defaults import default_passes  # noqa: E402
from diphoma_compile.passes.pipeline import Pipeline  # noqa: E402

pytestmark = pytest.mark.skipif(jax.device_count() < 8,
                                reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")

N, VOCAB, DIM, SEQ, STEPS = 8, 509, 66, 8, 3


def mesh8() -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(jax.devices()[:N]), ("dp",))


class OddLM(nn.Module):
    """Vocab 509 and width 66: the embedding (509, 66), the (66, 66) projection and every
    bias have no dimension 8 divides; only the (66, 264)/(264, 66) MLP kernels do."""

    @nn.compact
    def __call__(self, ids):
        emb = nn.Embed(VOCAB, DIM)
        x = emb(ids)
        x = x + nn.Dense(DIM)(nn.gelu(nn.Dense(4 * DIM)(nn.LayerNorm()(x))))
        x = x + nn.Dense(DIM)(nn.tanh(nn.Dense(DIM)(x)))
        return emb.attend(nn.LayerNorm()(x))


def _init(module, example, rng):
    abstract = jax.eval_shape(module.init, jax.random.key(0), example)["params"]
    return jax.tree.map(lambda a: jnp.asarray(
        rng.standard_normal(a.shape).astype(np.float32) * 0.3 / math.sqrt(a.shape[0])),
        abstract)


def odd_lm_case(tx):
    rng = np.random.default_rng(0)
    module = OddLM()
    ids = rng.integers(0, VOCAB, (16, SEQ + 1)).astype(np.int32)
    batch = {"ids": jnp.asarray(ids[:, :-1]), "labels": jnp.asarray(ids[:, 1:])}

    def step(params, opt_state, batch):
        def loss_of(p):
            logits = module.apply({"params": p}, batch["ids"])
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, batch["labels"]).mean()
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    params = _init(module, batch["ids"], rng)
    return step, params, jax.jit(tx.init)(params), batch


def run(fn, params, opt_state, batch):
    losses = []
    for _ in range(STEPS):
        params, opt_state, loss = fn(params, opt_state, batch)
        losses.append(float(loss))
    return params, opt_state, np.array(losses)


def max_dev(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def per_device_fraction(stored, user) -> float:
    """The bytes the fullest device holds of a stored leaf, over the user's whole leaf."""
    held = max(s.data.nbytes for s in stored.addressable_shards)
    return held / user.nbytes


def test_every_large_state_leaf_is_an_eighth_per_device_and_the_step_matches_one_device():
    step, params, opt_state, batch = odd_lm_case(optax.adamw(1e-2))
    mesh = mesh8()
    pstep = parallelize(step, mesh)
    ref_p, ref_s, ref_l = run(jax.jit(step), params, opt_state, batch)
    our_p, stored_s, our_l = run(pstep, params, opt_state, batch)
    our_s = pstep.user_shapes(stored_s)
    assert ref_l[-1] < ref_l[0]
    np.testing.assert_allclose(our_l, ref_l, rtol=1e-5)
    assert [x.shape for x in jax.tree.leaves(our_s)] == [x.shape for x in jax.tree.leaves(ref_s)]

    # Adam amplifies reduction-order noise: plain GSPMD data parallelism is the yardstick
    rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp"))
    gspmd = jax.jit(step, in_shardings=(rep, rep, split), out_shardings=rep)
    g_p, g_s, g_l = run(gspmd, params, opt_state, batch)
    ours, theirs = max_dev((ref_p, ref_s), (our_p, our_s)), max_dev((ref_p, ref_s), (g_p, g_s))
    print(f"max abs deviation from one device: diphoma {ours:.3g}, GSPMD {theirs:.3g}")
    assert ours <= 2 * theirs + 1e-6

    fractions = {}
    for (path, stored), user in zip(jax.tree_util.tree_leaves_with_path(stored_s),
                                    jax.tree.leaves(ref_s)):
        if user.size >= 4096:
            fractions[jax.tree_util.keystr(path)] = per_device_fraction(stored, user)
    print({k: round(v, 4) for k, v in fractions.items()})
    # the embedding, the (66, 66) kernel and the MLP kernels, in mu and nu
    assert len(fractions) == 10
    assert max(fractions.values()) <= 1 / N * 1.02
    wus = pstep.plan.notes["weight-update-sharding"]
    assert wus["layout"] == "dims-or-flat"
    assert not [name for name, _ in wus["replicated"] if name.startswith("opt_state")]
    report = pstep.memory_report()
    single = sum(x.nbytes for x in jax.tree.leaves(opt_state))
    assert report.measured and single / N <= report.opt_state_bytes <= single / N * 1.02 + 64


def test_layout_dims_keeps_the_same_model_whole_and_says_why():
    """The layout JAX had: none of the odd model's large leaves but the MLP's is split."""
    step, params, opt_state, batch = odd_lm_case(optax.adamw(1e-2))
    g = parallelize(step, mesh8(), passes=default_passes("dp", layout="dims")).trace(
        params, opt_state, batch)
    reasons = dict(g.plan.notes["weight-update-sharding"]["replicated"])
    assert "no dimension of [509, 66] divides 8" in reasons["opt_state/0/mu/Embed_0/embedding"]
    flat = parallelize(step, mesh8()).trace(params, opt_state, batch)
    assert flat.plan.memory.opt_state < g.plan.memory.opt_state / 4


def test_dividing_shapes_give_the_very_program_of_layout_dims(golden):
    """Where every dimension divides, dims-or-flat is dims: the same IR, so the same bits;
    with odd shapes the IR (golden) holds flat pieces and 1-D state inputs."""
    module = nn.Dense(16)
    rng = np.random.default_rng(1)
    x, y = (jnp.asarray(rng.standard_normal((2, 8)).astype(np.float32)),
            jnp.asarray(rng.standard_normal((2, 16)).astype(np.float32)))
    tx = optax.adamw(1e-2)

    def step(params, opt_state, batch):
        def loss_of(p):
            return jnp.mean((module.apply({"params": p}, batch[0]) - batch[1]) ** 2)
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def planned(params, batch, layout):
        g = trace_jax(step, params, tx.init(params), batch, locations=False)
        g = g.replace(mesh=Mesh({"dp": N}))
        return Pipeline.from_spec(default_passes("dp", layout=layout)).run(g, PassContext())
    even = _init(module, x, rng)
    a, b = planned(even, (x, y), "dims-or-flat"), planned(even, (x, y), "dims")
    assert (a.inputs, a.ops, a.outputs) == (b.inputs, b.ops, b.outputs)
    module = nn.Dense(5)
    odd = _init(module, x, rng)
    text = print_graph(planned(odd, (x, y[:, :5]), "dims-or-flat"))
    assert "{dp: F}" in text or "{dp: Fx}" in text
    golden("jax_odd_dense_adamw.dp8.ir", text)


def test_the_user_s_state_and_the_stored_state_are_both_taken():
    """The first call takes the user's arrays (padded and laid out on entry); later calls
    the stored form the step returned; user_shapes() gives the user's shapes back."""
    step, params, opt_state, batch = odd_lm_case(optax.sgd(0.1, momentum=0.9))
    pstep = parallelize(step, mesh8(), donate=False)    # p1 and s1 are read twice
    p1, s1, _ = pstep(params, opt_state, batch)
    user = pstep.user_shapes(s1)
    p2, s2, l2 = pstep(p1, s1, batch)               # the stored form
    p3, s3, l3 = pstep(p1, user, batch)             # the user's shapes
    assert float(l2) == float(l3)
    assert max_dev((p2, s2), (p3, s3)) == 0.0
    emb = s1[0].trace["Embed_0"]["embedding"]
    assert emb.shape == (-(-VOCAB * DIM // N) * N,) and emb.sharding.spec == P("dp")
    assert pstep.user_shapes(s1, 1)[0].trace["Embed_0"]["embedding"].shape == (VOCAB, DIM)
    with pytest.raises(BackendError, match="does not have the structure of step argument 0"):
        pstep.user_shapes(s1, 0)


def test_the_step_donates_by_default_and_a_consumed_array_is_refused_not_crashed():
    """On a mesh the step donates parameters and optimizer state: what it returned is
    consumed when passed back; the user's own first arrays (another layout) are copied onto
    the mesh and left alone; passing a consumed array again is a BackendError (jax's own
    dispatch crashed the process on it)."""
    step, params, opt_state, batch = odd_lm_case(optax.adamw(1e-2))
    ref_p, ref_s, _ = jax.jit(step)(params, opt_state, batch)
    pstep = parallelize(step, mesh8())
    p1, s1, _ = pstep(params, opt_state, batch)
    assert not any(x.is_deleted() for x in jax.tree.leaves((params, opt_state)))
    p2, s2, _ = pstep(p1, s1, batch)
    assert all(x.is_deleted() for x in jax.tree.leaves((p1, s1)) if x.size > 1)
    with pytest.raises(BackendError, match="an earlier call of the step consumed") as e:
        pstep(p1, s1, batch)
    assert "donate=False" in e.value.hint
    # the user's arrays are intact: the single-device step still runs on them
    again_p, again_s, _ = jax.jit(step)(params, opt_state, batch)
    assert max_dev((ref_p, ref_s), (again_p, again_s)) == 0.0
    mem = pstep.runner.jitted.lower(*pstep.runner.flatten((p2, s2, batch))[0]).compile() \
        .memory_analysis()
    state = sum(x.nbytes for x in jax.tree.leaves(s2)) // N
    assert mem.alias_size_in_bytes >= sum(x.nbytes for x in jax.tree.leaves(params)) + state


class GPT2Wide(nn.Module):
    """One block of GPT-2 small's widths: vocab 50257, d=768, 12 heads, 3072 hidden."""

    @nn.compact
    def __call__(self, idx):
        wte = nn.Embed(50257, 768)
        x = wte(idx) + self.param("wpe", nn.initializers.normal(0.02), (1024, 768))[:idx.shape[1]]
        mask = nn.make_causal_mask(jnp.ones(idx.shape))
        x = x + nn.MultiHeadDotProductAttention(num_heads=12)(nn.LayerNorm()(x), mask=mask)
        x = x + nn.Dense(768)(nn.gelu(nn.Dense(3072)(nn.LayerNorm()(x))))
        return wte.attend(nn.LayerNorm()(x))


@pytest.mark.parametrize("n", [20, 100])
def test_gpt2_widths_at_dp_20_and_100_split_all_their_state_in_the_plan(n):
    """The issue's case: none of GPT-2 small's dims divides 20 or 100, so layout=dims split
    no optimizer state; dims-or-flat splits it all (planned on meta shapes, nothing runs)."""
    model, tx = GPT2Wide(), optax.adamw(1e-3)

    def step(params, opt_state, batch):
        def loss_of(p):
            return optax.softmax_cross_entropy_with_integer_labels(
                model.apply({"params": p}, batch["idx"]), batch["t"]).mean()
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    batch = {k: jax.ShapeDtypeStruct((n, 16), jnp.int32) for k in ("idx", "t")}
    params = jax.eval_shape(model.init, jax.random.key(0), batch["idx"])["params"]
    state = jax.eval_shape(tx.init, params)
    memory = {}
    for layout in ("dims", "dims-or-flat"):
        ps = parallelize(step, Mesh({"dp": n}), passes=default_passes("dp", layout=layout))
        memory[layout] = ps.trace(params, state, batch).plan.memory
    single = memory["dims"].single_device_opt_state
    assert memory["dims"].opt_state == single
    assert single / n <= memory["dims-or-flat"].opt_state <= single / n * 1.001


# ------------------------------------------------------------------ Adafactor

class Factored(nn.Module):
    """24 -> 48 -> 20 -> 5: with min_dim_size_to_factor=16 the first two kernels' second
    moments are factored (a row and a column moment each); the last kernel's is not."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(48)(x))
        h = nn.relu(nn.Dense(20)(h))
        return nn.Dense(5)(h)


def _against_one_device(module, tx, x, y, rng, normalize=None):
    """(the parallel step at dp=8, its largest deviation from jax.jit over STEPS steps of
    a mean squared error, parameters and optimizer state, and the optimizer state it
    returned, as stored) for ``module`` and ``tx``; the
    losses are checked to 1e-5. ``normalize``: applied to each gradient first."""
    def step(params, opt_state, batch):
        def loss_of(p):
            return jnp.mean((module.apply({"params": p}, batch[0]) - batch[1]) ** 2)
        loss, grads = jax.value_and_grad(loss_of)(params)
        if normalize is not None:
            grads = jax.tree.map(normalize, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    params = _init(module, x, rng)
    opt_state = jax.jit(tx.init)(params)
    pstep = parallelize(step, mesh8())
    ref_p, ref_s, ref_l = run(jax.jit(step), params, opt_state, (x, y))
    our_p, stored_s, our_l = run(pstep, params, opt_state, (x, y))
    np.testing.assert_allclose(our_l, ref_l, rtol=1e-5)
    return pstep, max_dev((ref_p, ref_s), (our_p, pstep.user_shapes(stored_s))), stored_s


def test_adafactor_moments_follow_their_parameter_and_match_one_device():
    rng = np.random.default_rng(0)
    module = Factored()
    x = jnp.asarray(rng.standard_normal((32, 24)).astype(np.float32))
    y = jnp.asarray(rng.standard_normal((32, 5)).astype(np.float32))
    tx = optax.adafactor(1e-2, min_dim_size_to_factor=16)

    pstep, dev, stored_s = _against_one_device(module, tx, x, y, rng)
    print(f"adafactor: max abs deviation from one device {dev:.3g}")
    assert dev <= 1e-6

    roles = {i.name: i.role for i in pstep.graph.inputs}
    assert roles["opt_state/0/v_row/Dense_0/kernel"].of == "params/Dense_0/kernel"
    wus = pstep.plan.notes["weight-update-sharding"]
    # kernel (24, 48) is split on dim 0; its row moment (24,) keeps dim 0, its column
    # moment (48,) is a mean over it. Kernel (48, 20): the other way round.
    assert wus["sharded"]["opt_state/0/v_row/Dense_0/kernel"] == "S(0)"
    assert wus["sharded"]["opt_state/0/v_col/Dense_1/kernel"] == "S(0)"
    reasons = dict(wus["replicated"])
    for name in ("opt_state/0/v_col/Dense_0/kernel", "opt_state/0/v_row/Dense_1/kernel"):
        assert "lacks the parameter's split dimension 0" in reasons[name]
    state = jax.tree_util.tree_leaves_with_path(stored_s)
    specs = {jax.tree_util.keystr(p): leaf.sharding.spec for p, leaf in state}
    assert specs["[0].v_row['Dense_0']['kernel']"] == P("dp")
    assert specs["[0].v_col['Dense_0']['kernel']"] == P(None)


def test_adafactor_golden(golden):
    """One factored kernel (8, 16) and its bias at dp=8: the row moment split with the
    kernel's dim 0, the column moment whole (a mean over dim 0, all-reduced)."""
    module = nn.Dense(16)
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((2, 8)).astype(np.float32))
    y = jnp.asarray(rng.standard_normal((2, 16)).astype(np.float32))
    tx = optax.adafactor(1e-2, min_dim_size_to_factor=8)

    def step(params, opt_state, batch):
        def loss_of(p):
            return jnp.mean((module.apply({"params": p}, batch[0]) - batch[1]) ** 2)
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    params = _init(module, x, rng)
    g = trace_jax(step, params, tx.init(params), (x, y), locations=False)
    ctx = PassContext()
    g = Pipeline.from_spec(default_passes("dp", layout="dims-or-flat")).run(
        g.replace(mesh=Mesh({"dp": N})), ctx)
    types = {i.name: i.value.type for i in g.inputs}
    assert str(types["opt_state/0/v_row/kernel"]) == "f32[8] {dp: S(0)}"
    assert str(types["opt_state/0/v_col/kernel"]) == "f32[16]"
    golden("jax_dense_adafactor.dp8.ir", print_graph(g))


def test_layout_flat_with_buckets_runs_on_jax_too():
    """``layout=flat`` (every non-scalar tensor flat, as on torch) and comm-fusion's packed
    flat buckets: every state leaf stored 1-D, the step matching the single-device one."""
    rng = np.random.default_rng(3)
    module = Factored()
    x = jnp.asarray(rng.standard_normal((32, 24)).astype(np.float32))
    y = jnp.asarray(rng.standard_normal((32, 5)).astype(np.float32))
    tx = optax.sgd(0.05, momentum=0.9)

    def step(params, opt_state, batch):
        def loss_of(p):
            return jnp.mean((module.apply({"params": p}, batch[0]) - batch[1]) ** 2)
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    params = _init(module, x, rng)
    opt_state = jax.jit(tx.init)(params)
    spec = default_passes("dp", layout="flat") + ",comm-fusion{bucket-mb=25},schedule-comm"
    pstep = parallelize(step, mesh8(), passes=spec)
    ref_p, ref_s, ref_l = run(jax.jit(step), params, opt_state, (x, y))
    our_p, stored_s, our_l = run(pstep, params, opt_state, (x, y))
    np.testing.assert_allclose(our_l, ref_l, rtol=1e-5)
    assert max_dev((ref_p, ref_s), (our_p, pstep.user_shapes(stored_s))) <= 1e-6
    assert all(leaf.ndim == 1 and leaf.sharding.spec == P("dp")
               for leaf in jax.tree.leaves(stored_s))
    assert any(len(op.inputs) > 1 and op.attrs.get("dim") == "flat" for op in pstep.graph.ops)


class Narrow(nn.Module):
    """Kernels (7, 24), (24, 3), (3, 5): no dimension 8 divides in (24, 3)'s state, which
    is stored flat."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(24)(x))
        return nn.Dense(5)(nn.tanh(nn.Dense(3)(h)))


@pytest.mark.parametrize("opt", ["muon", "normalized sgd"])
def test_a_whole_reduction_kept_to_the_tensors_rank_divides_a_flat_piece(opt):
    """optax.contrib.muon divides each update by its norm kept to the tensor's rank
    (``sum(u * u, keepdims=True)``: a [1, 1] value); on a tensor stored flat (a 1-D piece
    per device) the backend's division met a rank-2 operand and JAX raised a TypeError
    from inside the program (a review's probe, 2026-12-07). The [1, 1] value is now taken
    as the one number it is, and the step matches jax.jit."""
    rng = np.random.default_rng(0)
    module = Narrow()
    x = jnp.asarray(rng.standard_normal((16, 7)).astype(np.float32))
    y = jnp.asarray(rng.standard_normal((16, 5)).astype(np.float32))
    tx = optax.contrib.muon(1e-2) if opt == "muon" else optax.sgd(0.1, momentum=0.9)

    normalize = None if opt == "muon" else (
        lambda g: g / (jnp.sqrt(jnp.sum(g * g, keepdims=True)) + 1e-7))
    pstep, dev, _ = _against_one_device(module, tx, x, y, rng, normalize)
    assert dev <= 1e-5
    flat = [n for n, how in pstep.plan.notes["weight-update-sharding"]["sharded"].items()
            if how == "F"]
    assert any(n.endswith("Dense_1/kernel") for n in flat), flat     # (24, 3)
