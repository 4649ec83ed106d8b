"""Models people write with other JAX libraries, unmodified: an equinox Module (partitioned
into arrays and the rest with ``eqx.partition``) and a haiku transform, each an embedding,
multi-head attention, a layer norm and an MLP trained with optax. Their steps compile bit for
bit as the user's own ``jax.jit``, and data parallelism with weight-update sharding over 8
devices matches the single-device step on the global batch."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import diphoma_compile  # noqa: E402
from tests.jax_steps import keyed_steps  # noqa: E402

VOCAB, D, SEQ, BATCH = 32, 16, 8, 8


def _optimizer(name: str):
    return optax.adamw(1e-2) if name == "adamw" else optax.sgd(0.1, momentum=0.9)


def _loss(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tgt"]).mean()


def equinox_case(opt):
    eqx = pytest.importorskip("equinox")

    class Net(eqx.Module):
        emb: eqx.nn.Embedding
        attn: eqx.nn.MultiheadAttention
        norm: eqx.nn.LayerNorm
        mlp: eqx.nn.MLP

        def __init__(self, key):
            k = jax.random.split(key, 3)
            self.emb = eqx.nn.Embedding(VOCAB, D, key=k[0])
            self.attn = eqx.nn.MultiheadAttention(2, D, key=k[1])
            self.norm = eqx.nn.LayerNorm(D)
            self.mlp = eqx.nn.MLP(D, VOCAB, 32, 1, key=k[2])

        def __call__(self, ids):
            x = jax.vmap(self.emb)(ids)
            x = x + self.attn(x, x, x)
            return jax.vmap(self.mlp)(jax.vmap(self.norm)(x))

    params, static = eqx.partition(Net(jax.random.PRNGKey(0)), eqx.is_array)

    def step(params, opt_state, batch):
        def loss_fn(p):
            return _loss(jax.vmap(eqx.combine(p, static))(batch["ids"]), batch)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step, params


def haiku_case(opt):
    hk = pytest.importorskip("haiku")

    def forward(ids):
        x = hk.Embed(VOCAB, D)(ids)
        x = x + hk.MultiHeadAttention(2, D // 2, w_init=hk.initializers.VarianceScaling())(
            x, x, x)
        return hk.nets.MLP([32, VOCAB])(hk.LayerNorm(-1, True, True)(x))

    net = hk.without_apply_rng(hk.transform(forward))
    params = net.init(jax.random.PRNGKey(0), jnp.zeros((1, SEQ), jnp.int32))

    def step(params, opt_state, batch):
        def loss_fn(p):
            return _loss(net.apply(p, batch["ids"]), batch)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step, params


CASES = {"equinox": equinox_case, "haiku": haiku_case}


def _batch():
    ids = jax.random.randint(jax.random.PRNGKey(1), (BATCH, SEQ), 0, VOCAB)
    return {"ids": ids, "tgt": jnp.roll(ids, -1, axis=1)}


def _run(step, params, opt_state, batch, n: int = 5):
    losses = []
    for _ in range(n):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    return params, opt_state, losses


@pytest.mark.parametrize("library", list(CASES))
def test_compiled_step_is_bit_identical_to_jit(library):
    opt = _optimizer("adamw")
    step, params = CASES[library](opt)
    batch = _batch()
    ours = diphoma_compile.compile(step, params, opt.init(params), batch)
    ref = jax.jit(step)
    a = b = (params, opt.init(params))
    losses = []
    for k in range(5):
        got, want = ours(*b, batch), ref(*a, batch)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert np.asarray(x).tobytes() == np.asarray(y).tobytes(), (library, k)
        a, b = want[:2], got[:2]
        losses.append(float(want[2]))
    assert losses[-1] < losses[0]        # the model learns: parity of a frozen step proves little


@pytest.mark.skipif(jax.device_count() < 8,
                    reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
@pytest.mark.parametrize("library", list(CASES))
def test_data_parallel_over_8_devices_matches_one(library):
    opt = _optimizer("sgd")
    step, params = CASES[library](opt)
    batch = _batch()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    pstep = diphoma_compile.parallelize(step, mesh, axis="data")
    ref_p, ref_s, ref_l = _run(jax.jit(step), params, opt.init(params), batch)
    our_p, our_s, our_l = _run(pstep, params, opt.init(params), batch)
    assert ref_l[-1] < ref_l[0]          # the model learns
    np.testing.assert_allclose(our_l, ref_l, rtol=1e-5)
    stored = our_s
    our_s = pstep.user_shapes(stored)
    assert jax.tree.structure((our_p, our_s)) == jax.tree.structure((ref_p, ref_s))
    for x, y in zip(jax.tree.leaves((our_p, our_s)), jax.tree.leaves((ref_p, ref_s))):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
    # weight-update sharding: each device holds an eighth of the momentum (the whole of it
    # in 8 pieces: no leaf is kept whole on every device but scalars)
    for leaf in jax.tree.leaves(stored):
        if leaf.size > 1:
            assert "data" in tuple(leaf.sharding.spec), (leaf.shape, leaf.sharding.spec)
    report = pstep.memory_report()
    whole = sum(x.nbytes for x in jax.tree.leaves(ref_s))
    assert report.opt_state_bytes < whole / 8 * 1.1, (report.opt_state_bytes, whole)


def _haiku_batch_norm_case(layers: int, width: int, rows: int):
    """haiku's transform_with_state over ``layers`` x (Linear, BatchNorm, relu) and a head,
    SGD momentum: (net, tx, step, loss_of(params, state, x, y), (params, state, x, y)),
    the step ``step(params, opt_state, batch, state) -> (params, opt_state, state, loss)``."""
    hk = pytest.importorskip("haiku")

    def fwd(x):
        for _ in range(layers):
            x = jax.nn.relu(hk.BatchNorm(True, True, 0.9)(
                hk.Linear(width, with_bias=False)(x), is_training=True))
        return hk.Linear(4)(x)
    net = hk.without_apply_rng(hk.transform_with_state(fwd))
    x = jax.random.normal(jax.random.PRNGKey(1), (rows, 8))
    y = jax.random.normal(jax.random.PRNGKey(2), (rows, 4))
    params, state = net.init(jax.random.PRNGKey(0), x)
    tx = optax.sgd(0.1, momentum=0.9)

    def loss_of(p, st, x, y):
        out, st = net.apply(p, st, x)
        return jnp.mean((out - y) ** 2), st

    def step(params, opt_state, batch, state):
        (loss, state), grads = jax.value_and_grad(loss_of, has_aux=True)(params, state, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, state, loss
    return net, tx, step, loss_of, (params, state, x, y)


@pytest.mark.skipif(jax.device_count() < 8,
                    reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
def test_haiku_batch_norm_state_is_model_state():
    """haiku's transform_with_state: the BatchNorm's moving averages are an argument after
    the batch that the step returns updated (jax/roles.py ``returned_state``): buffers.
    compile() runs the step bit for bit; data parallelism runs it as DDP does (each device
    normalizes its share; the new variance averages are device 0's, the mean averages,
    linear in the batch's mean, the shares' average), with the coupling warning, and
    matches that written by hand: each share's gradients (vmap), their mean, one update,
    share 0's state. (JAX makes ``1 - 0.9`` once for the momentum and the moving averages:
    jax/phases.py runs that constant in the forward pass.)"""
    from diphoma_compile.errors import DiphomaWarning
    net, tx, step, loss_of, (params, state, x, y) = _haiku_batch_norm_case(1, 16, 32)

    def ddp(params, opt_state, batch, state):
        shares = (batch[0].reshape(8, 4, 8), batch[1].reshape(8, 4, 4))
        (losses, new), grads = jax.vmap(jax.value_and_grad(loss_of, has_aux=True),
                                        in_axes=(None, None, 0, 0))(params, state, *shares)
        updates, opt_state = tx.update(jax.tree.map(lambda g: g.mean(0), grads), opt_state,
                                       params)
        def combined(path, s):       # the mean's averages averaged, the rest share 0's
            mean = "mean_ema" in jax.tree_util.keystr(path) and s.dtype.kind == "f"
            return s.mean(0) if mean else s[0]
        return (optax.apply_updates(params, updates), opt_state,
                jax.tree_util.tree_map_with_path(combined, new), losses.mean())

    args = (params, tx.init(params), (x, y), state)
    compiled = diphoma_compile.compile(step, *args)
    assert {i.role.kind.value for i in compiled.graph.inputs
            if i.name.startswith("arg3/")} == {"buffer"}
    a = b = args
    for _ in range(2):
        want, got = jax.jit(step)(*a), compiled(*b)
        for p, q in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert np.asarray(p).tobytes() == np.asarray(q).tobytes()
        a, b = (*want[:2], (x, y), want[2]), (*got[:2], (x, y), got[2])

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    pstep = diphoma_compile.parallelize(step, mesh, axis="data")    # state found: not batch
    with pytest.warns(DiphomaWarning, match="combines examples of its batch"):
        pstep.trace(*args)
    notes = pstep.plan.notes["data-parallel"]
    assert sorted(n.split("/")[-2:][0] for n in notes["broadcast"]) == ["var_ema"] * 2
    assert {"new/arg3/batch_norm/~/mean_ema/hidden",
            "new/arg3/batch_norm/~/mean_ema/average"} <= set(notes["averaged"])
    a = b = args
    for _ in range(3):
        want, got = jax.jit(ddp)(*a), pstep(*b)
        np.testing.assert_allclose(float(got[3]), float(want[3]), rtol=1e-5)
        a, b = (*want[:2], (x, y), want[2]), (*got[:2], (x, y), got[2])
    ours = (b[0], pstep.user_shapes(b[1], 1), b[3])
    for p, q in zip(jax.tree.leaves(ours), jax.tree.leaves((a[0], a[1], a[3]))):
        np.testing.assert_allclose(np.asarray(p), np.asarray(q), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(jax.device_count() < 8,
                    reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
def test_haiku_batch_norm_state_through_a_two_stage_pipeline():
    """One microbatch over pp=2: the moving averages' integer counters come back as
    integers (the pipeline's mean over microbatches keeps a buffer's dtype), and the
    step runs as jax.jit runs it, twice in a row."""
    _, tx, step, _, (params, state, x, y) = _haiku_batch_norm_case(2, 8, 8)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("pp",))
    pstep = diphoma_compile.parallelize(step, mesh, microbatches=1)
    a = b = (params, tx.init(params), (x, y), state)
    for _ in range(2):
        want, got = jax.jit(step)(*a), pstep(*b)
        assert [leaf.dtype for leaf in jax.tree.leaves(got[2])] == \
            [leaf.dtype for leaf in jax.tree.leaves(want[2])]
        np.testing.assert_allclose(float(got[3]), float(want[3]), rtol=1e-6)
        a, b = (*want[:2], (x, y), want[2]), (*got[:2], (x, y), got[2])


def _equinox_batch_norm_case():
    """equinox's ``eqx.nn.BatchNorm`` with ``eqx.nn.State`` under ``jax.vmap(...,
    axis_name="batch")``: its batch statistics are ``psum`` over the mapped axis (a
    reduction over the batch's rows in the traced step) and its first-call flag a state
    leaf the step returns as False. (step, tx, args): ``step(params, opt_state, batch,
    state) -> (params, opt_state, state, loss)``."""
    eqx = pytest.importorskip("equinox")

    class Net(eqx.Module):
        l1: eqx.nn.Linear
        bn: eqx.nn.BatchNorm
        l2: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.l1 = eqx.nn.Linear(8, 12, key=k1)
            self.bn = eqx.nn.BatchNorm(12, axis_name="batch", mode="ema")
            self.l2 = eqx.nn.Linear(12, 4, key=k2)

        def __call__(self, x, state):
            h, state = self.bn(self.l1(x), state)
            return self.l2(jax.nn.relu(h)), state

    model, state = eqx.nn.make_with_state(Net)(jax.random.PRNGKey(0))
    params, static = eqx.partition(model, eqx.is_array)
    tx = optax.sgd(0.1, momentum=0.9)

    def step(params, opt_state, batch, state):
        x, y = batch

        def loss_of(p):
            out, new = jax.vmap(eqx.combine(p, static), axis_name="batch",
                                in_axes=(0, None), out_axes=(0, None))(x, state)
            return jnp.mean((out - y) ** 2), new
        (loss, state), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, state, loss
    batch = (jax.random.normal(jax.random.PRNGKey(1), (16, 8)),
             jax.random.normal(jax.random.PRNGKey(2), (16, 4)))
    return step, (params, tx.init(params), batch, state)


@pytest.mark.skipif(jax.device_count() < 8,
                    reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
@pytest.mark.parametrize("state_first", [False, True], ids=["after", "before"])
def test_equinox_batch_norm_is_warned_of_and_runs_through_a_two_stage_pipeline(state_first):
    """Data parallelism warns at equinox's batch statistics (a psum over the vmapped batch
    axis has the rule of a sum over those rows); a two-stage pipeline at one microbatch
    makes the flag's new value on the stage reading the flag, and runs the step as
    jax.jit does, three times in a row. The state passed before the batch
    (``step(params, opt_state, state, batch)``, as equinox's examples order it) is found
    as state too: its first leaf, the flag, has no rows, so it cannot be the batch."""
    from diphoma_compile.errors import DiphomaWarning
    after, args = _equinox_batch_norm_case()
    step = after
    if state_first:
        def step(params, opt_state, state, batch):
            return after(params, opt_state, batch, state)
        args = (*args[:2], args[3], args[2])
    k_batch, k_state = (3, 2) if state_first else (2, 3)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    pstep = diphoma_compile.parallelize(step, mesh, axis="data")
    with pytest.warns(DiphomaWarning, match=r"combines examples of its batch: _batch_norm"):
        pstep.trace(*args)
    assert len(pstep.plan.notes["data-parallel"]["batch"]) == 2     # x and y, not the state
    pipe = diphoma_compile.parallelize(
        step, jax.sharding.Mesh(np.array(jax.devices()[:2]), ("pp",)), microbatches=1)

    def again(out):
        new = [*out[:2], None, None]
        new[k_batch], new[k_state] = args[k_batch], out[2]
        return tuple(new)
    a = b = args
    for _ in range(3):
        want, got = jax.jit(step)(*a), pipe(*b)
        np.testing.assert_allclose(float(got[3]), float(want[3]), rtol=1e-6)
        a, b = again(want), again(got)
    for p, q in zip(jax.tree.leaves((b[0], b[k_state])), jax.tree.leaves((a[0], a[k_state]))):
        np.testing.assert_allclose(np.asarray(p), np.asarray(q), rtol=1e-5, atol=1e-6)


def _dropout_case(library: str):
    """An MLP with dropout as each library writes it: equinox's ``eqx.nn.Dropout`` under
    ``jax.vmap`` with one key per example (``jax.random.split(key, n)``), haiku's
    ``hk.dropout`` with the transform's rng. SGD momentum; step(params, opt_state, batch,
    key)."""
    tx = optax.sgd(0.05, momentum=0.9)
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    x, y = jax.random.normal(k[1], (32, 8)), jax.random.normal(k[2], (32, 4))
    if library == "equinox":
        eqx = pytest.importorskip("equinox")

        class Net(eqx.Module):
            l1: eqx.nn.Linear
            l2: eqx.nn.Linear
            drop: eqx.nn.Dropout

            def __init__(self, key):
                a, b = jax.random.split(key)
                self.l1, self.l2 = eqx.nn.Linear(8, 16, key=a), eqx.nn.Linear(16, 4, key=b)
                self.drop = eqx.nn.Dropout(0.3)

            def __call__(self, x, key):
                return self.l2(self.drop(jax.nn.relu(self.l1(x)), key=key))
        params, static = eqx.partition(Net(k[0]), eqx.is_array)

        def forward(p, x, key):
            keys = jax.random.split(key, x.shape[0])
            return jax.vmap(eqx.combine(p, static))(x, keys)
    else:
        hk = pytest.importorskip("haiku")

        def fwd(x):
            h = hk.dropout(hk.next_rng_key(), 0.3, jax.nn.relu(hk.Linear(16)(x)))
            return hk.Linear(4)(h)
        net = hk.transform(fwd)
        params = net.init(k[0], x)

        def forward(p, x, key):
            return net.apply(p, key, x)

    def step(params, opt_state, batch, key):
        loss, grads = jax.value_and_grad(
            lambda p: jnp.mean((forward(p, batch[0], key) - batch[1]) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step, params, tx, (x, y)


@pytest.mark.skipif(jax.device_count() < 8,
                    reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
@pytest.mark.parametrize("library", ["equinox", "haiku"])
def test_dropout_under_data_parallelism_matches_one_device(library):
    """Each device draws the global batch's masks (equinox: the global batch's keys, one
    per example) and keeps its rows: losses and parameters as on one device over three
    steps with new keys (before, refused)."""
    step, params, tx, batch = _dropout_case(library)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    pstep = diphoma_compile.parallelize(step, mesh, axis="data")
    a, b = keyed_steps(step, pstep, (params, tx.init(params)), batch, range(5, 8))
    for x, y in zip(jax.tree.leaves(a[0]), jax.tree.leaves(b[0])):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-6)
    assert pstep.plan.notes["data-parallel"]["random_per_row"]


@pytest.mark.skipif(jax.device_count() < 8,
                    reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
@pytest.mark.parametrize("library", ["equinox", "haiku"])
def test_dropout_through_a_pipeline_matches_one_device(library):
    """The same steps over dp=4 x pp=2 with 2 microbatches: each microbatch keeps its rows
    of its share's draw for the whole batch (equinox: of the whole batch's keys, one per
    example), as on one device over three steps with new keys (before, refused)."""
    step, params, tx, batch = _dropout_case(library)
    pstep = diphoma_compile.parallelize(step, {"dp": 4, "pp": 2}, microbatches=2,
                                        batch_argnums=2)
    a, b = keyed_steps(step, pstep, (params, tx.init(params)), batch, range(5, 8))
    for x, y in zip(jax.tree.leaves(a[0]), jax.tree.leaves(b[0])):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-6)
