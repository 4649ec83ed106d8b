"""parallelize(): mesh and data-axis handling, planning without running, and bad use."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import diphoma_compile
from diphoma_compile import DiphomaError, Mesh, parallelize
from diphoma_compile.errors import MeshError
from diphoma_compile.mesh import data_axis
from diphoma_compile.passes.defaults import default_passes

import tests.jax_steps as J


def test_data_axis_choice():
    assert data_axis(Mesh({"dp": 4}), None) == "dp"
    assert data_axis(Mesh({"x": 4}), None) == "x"
    assert data_axis(Mesh({"data": 2, "model": 4}), None) == "data"
    assert data_axis(Mesh({"a": 2, "b": 4}), "b") == "b"
    with pytest.raises(MeshError, match="cannot tell which of the mesh axes a, b"):
        data_axis(Mesh({"a": 2, "b": 4}), None)
    with pytest.raises(MeshError, match="the mesh has no axis 'dp' \\(it has a, b\\)"):
        data_axis(Mesh({"a": 2, "b": 4}), "dp")
    # pipeline and tensor axes alone: the hint says to add a data axis of one device (it
    # said only axis=..., and neither pp nor tp is one; a review, 2026-12-07)
    with pytest.raises(MeshError, match=r"add a data axis of size 1, e.g. \{'dp': 1, "
                                        r"'pp': 2, 'tp': 4\}"):
        data_axis(Mesh({"pp": 2, "tp": 4}), None)


def test_default_passes_per_framework():
    from diphoma_compile import framework
    assert "layout=flat" in default_passes("dp", layout=framework.get("torch").update_layout)
    assert "layout=dims-or-flat" in default_passes("data",
                                                   layout=framework.get("jax").update_layout)


def test_graph_and_plan_need_a_trace_first():
    step = parallelize(lambda p, s, b: (p, s, 0.0), {"dp": 2})
    with pytest.raises(DiphomaError, match="has not been traced yet"):
        _ = step.graph
    with pytest.raises(DiphomaError, match="has not run yet"):
        step.memory_report()


def test_jax_trace_plans_without_running_for_any_mesh_size():
    step, (params, state, batch) = J.make_case("mlp", "linen", "adamw")
    big = jax.tree_util.tree_map(lambda x: jnp.concatenate([x] * 64), batch)
    for n in (1, 8, 64):
        ps = parallelize(step, Mesh({"dp": n})).trace(params, state, big)
        x = next(i for i in ps.graph.inputs if i.role.kind.value == "batch")
        assert x.value.type.shape[0] == big[0].shape[0] // n      # traced per device
        m = ps.plan.memory
        assert m.single_device_opt_state / n <= m.opt_state
        if n == 8:   # leaves with no dimension divisible by 8 are stored flat
            assert m.opt_state < m.single_device_opt_state / n * 1.02 + 64
    assert diphoma_compile.ParallelStep is type(ps)


def test_jax_batch_that_does_not_divide_is_refused_before_running():
    step, (params, state, batch) = J.make_case("mlp", "linen", "sgd")
    odd = jax.tree_util.tree_map(lambda x: x[:3], batch)
    ps = parallelize(step, jax.sharding.Mesh(np.array(jax.devices()[:2]), ("dp",)))
    with pytest.raises(MeshError, match="has 3 examples, which do not divide among the 2 "
                                        "devices of axis 'dp'"):
        ps(params, state, odd)


def test_jax_fused_and_scheduled_step_is_bit_identical_to_unfused():
    """Buckets pack each device's pieces side by side and XLA reduces them element by
    element in the same order: the fused step gives the very same bits."""
    from diphoma_compile.passes.defaults import default_passes
    step, (params, state, batch) = J.make_case("mlp", "linen", "clip_adamw")
    batch = jax.tree_util.tree_map(lambda x: jnp.concatenate([x] * 4), batch)
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(8), ("dp",))
    base = default_passes("dp", layout="dims")
    plain = parallelize(step, mesh, passes=base)
    fused = parallelize(step, mesh, passes=base + ",comm-fusion{bucket-mb=0.0001},"
                                                  "schedule-comm")
    pa, sa, pb, sb = params, state, params, state
    for _ in range(3):
        pa, sa, la = plain(pa, sa, batch)
        pb, sb, lb = fused(pb, sb, batch)
        assert float(la) == float(lb)
    assert sum(len(op.inputs) > 1 for op in fused.graph.ops) >= 2
    assert any(op.name == "wait" for op in fused.graph.ops)
    for x, y in zip(jax.tree_util.tree_leaves((pa, sa)), jax.tree_util.tree_leaves((pb, sb))):
        assert np.array_equal(np.asarray(x), np.asarray(y))


# ------------------------------------------------------------------ a mesh of one device

def test_jax_on_one_device_runs_the_single_device_program_bit_for_bit():
    """Data parallelism over one device has nothing to split: the default pipeline is empty
    and the runner is the single-device jax.jit program. The planned one (a bucket of
    gradients averaged over one device) made XLA fuse the step otherwise, and AdamW
    amplified the last bits within four steps."""
    step, (params, state, batch) = J.make_case("mlp", "linen", "adamw")
    ref = jax.jit(step)
    for mesh in (jax.sharding.Mesh(np.array(jax.devices()[3:4]), ("dp",)), {"dp": 1}):
        ps = parallelize(step, mesh)
        rp, rs, op, os_ = params, state, params, state
        for _ in range(4):
            rp, rs, rl = ref(rp, rs, batch)
            op, os_, ol = ps(op, os_, batch)
            assert np.asarray(ol).tobytes() == np.asarray(rl).tobytes()
        for a, b in zip(jax.tree_util.tree_leaves((rp, rs)), jax.tree_util.tree_leaves((op, os_))):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
        assert ps.plan.passes == () and ps.plan.collectives == ()
        assert "single-device program" in ps.plan.notes["backend"]
        report = ps.memory_report()
        assert report.measured and report.devices == 1
        assert report.opt_state_bytes == sum(x.nbytes for x in jax.tree_util.tree_leaves(state))
        if not isinstance(mesh, dict):      # on the mesh's own device
            assert {d for x in jax.tree_util.tree_leaves(op) for d in x.devices()} == \
                {jax.devices()[3]}


def _torch_mlp_case():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

    def step(model, opt, x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return torch, model, step


def test_torch_on_one_device_runs_in_this_process_bit_for_bit():
    """No torchrun, no process group: a mesh of one device runs the single-device program
    here (it was refused: torch.distributed is not initialized), as eager does, bit for bit."""
    import copy
    torch, model, step = _torch_mlp_case()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ps = parallelize(step, {"dp": 1})
    for _ in range(4):
        x, y = torch.randn(16, 8), torch.randn(16, 4)
        assert torch.equal(ps(model, opt, x, y), step(ref, ref_opt, x, y))
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
        for k, v in ref_opt.state[q].items():
            assert torch.equal(opt.state[p][k], v), k
    assert ps.plan.passes == () and ps.plan.collectives == ()
    assert ps.memory_report().opt_state_bytes == sum(
        v.nbytes for st in ref_opt.state.values() for v in st.values())
    assert ps.profile(model, opt, x, y, steps=1).comm_s == 0.0      # no barrier to wait at
    # passes asked for by name keep their collectives: those need a process group
    with pytest.raises(DiphomaError, match="still has collectives over it"):
        parallelize(step, {"dp": 1}, passes="data-parallel")(model, opt, x, y)


def test_torch_refuses_batch_argnums():
    torch, model, step = _torch_mlp_case()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(DiphomaError, match=r"batch_argnums=\(2, 3\) is for JAX steps"):
        parallelize(step, {"dp": 1}, batch_argnums=(2, 3)).trace(
            model, opt, torch.ones(4, 8), torch.ones(4, 4))


def test_compression_preset_plans_quantized_collectives():
    """compression="sdp4bit" adds both quantizing passes; the plan gives bytes before and
    after and the bound per tensor; JAX plans it too; a node axis gives two hops; unknown
    values, pipelines and a misplaced node axis are refused with a hint."""
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(model, opt, x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    args = (model, opt, torch.randn(4, 64), torch.randn(4, 64))
    plain = parallelize(step, {"dp": 4}).trace(*args).plan
    ps = parallelize(step, {"dp": 4}, compression="sdp4bit").trace(*args)
    assert "quantize-grads" in " ".join(ps.plan.passes)
    notes = ps.plan.notes
    assert notes["quantize-weight-diff"]["quantized"] == ["0.weight", "2.weight"]
    assert notes["quantize-weight-diff"]["error_bound"] == "absmax/7"
    assert sorted(notes["quantize-grads"]["params"].values())[:2] == ["0.bias", "0.weight"]
    text = ps.plan.to_text()
    assert "quantize-grads (4-bit, group 128, Hadamard 32" in text
    assert "0.weight: 98.30 KB -> 13.06 KB (0.13x)" in text and "absmax/7" in text
    assert ps.plan.comm_bytes_per_step < 0.2 * plain.comm_bytes_per_step
    with pytest.raises(DiphomaError, match="unknown compression 'sdp3bit'") as e:
        parallelize(step, {"dp": 4}, compression="sdp3bit")
    assert "sdp4bit" in e.value.hint
    with pytest.raises(DiphomaError, match="both given"):
        parallelize(step, {"dp": 4}, compression="sdp4bit", passes="dce")
    with pytest.raises(DiphomaError, match="shard_params=True were both given"):
        parallelize(step, {"dp": 4}, compression="sdp4bit", shard_params=True)
    jstep, (params, state, batch) = J.make_case("mlp", "linen", "adamw")
    big = jax.tree_util.tree_map(lambda x: jnp.concatenate([x] * 4), batch)
    jplan = parallelize(jstep, Mesh({"dp": 4}), compression="sdp4bit").trace(
        params, state, big).plan
    assert "quantize-weight-diff" in jplan.notes and "quantize-grads" in jplan.notes
    with pytest.raises(DiphomaError, match="not lowered for pipelines"):
        parallelize(step, {"dp": 2, "pp": 2}, compression="sdp4bit").trace(*args)
    # a node axis splits the data axis into nodes: the gradients take two hops
    two = parallelize(step, {"node": 2, "dp": 2}, compression="sdp4bit").trace(*args)
    assert two.mesh == Mesh({"dp": 4})
    qg = two.plan.notes["quantize-grads"]
    assert qg["hops"] == 2 and qg["local"] == 2 and qg["intra_bits"] == 8
    with pytest.raises(DiphomaError, match="must come just before the data axis"):
        parallelize(step, {"dp": 2, "node": 2}, compression="sdp4bit")


def test_torch_refuses_a_mesh_axis_no_pass_uses():
    """{"dp": 2, "foo": 2} on 4 ranks ran with foo idle: the ranks along it, each passing
    its own data, drifted apart without a word (a reviewer's probe, 2026-12-05). Planning
    refuses it now, naming the axis and the names each pass takes; JAX, whose one
    controller passes the global batch, only repeats the work (inspect lists it)."""
    import torch
    from diphoma_compile.errors import MeshError
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model, opt, x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    args = (model, opt, torch.randn(4, 8), torch.randn(4, 4))
    with pytest.raises(MeshError, match="mesh axis foo=2 is used by no pass") as e:
        parallelize(step, {"dp": 2, "foo": 2}).trace(*args)
    assert "dp, data or batch" in e.value.hint
    assert parallelize(step, {"dp": 2, "foo": 1}).trace(*args).plan.idle_axes == {}


@pytest.mark.parametrize("bad", [0, -2, 2.5, True])
def test_microbatches_that_are_not_a_count_are_refused(bad):
    """microbatches=0 crashed with a ZeroDivisionError deep in the JAX batch check."""
    with pytest.raises(DiphomaError, match="whole number of at least 1"):
        parallelize(lambda *a: a, {"dp": 2, "pp": 2}, microbatches=bad)


def _class_prior_case():
    """A flax classifier whose batch dict holds a per-class log prior beside the examples."""
    import flax.linen as nn
    import optax
    model, tx = nn.Dense(8), optax.sgd(0.1)

    def step(params, opt_state, batch, *prior):
        def loss_fn(p):
            logits = model.apply(p, batch["x"]) + (prior[0] if prior else batch["log_prior"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (16, 8))
    batch = {"x": x, "y": jax.random.randint(key, (16,), 0, 8),
             "log_prior": jnp.log(jnp.arange(1.0, 9.0) / 36)}
    params = model.init(key, x[:1])
    return step, params, tx.init(params), batch


def test_a_batch_leaf_that_is_not_a_row_per_example_is_refused():
    """A per-class log prior f32[4] inside the batch dict beside x f32[16, 8] was split over
    dp=4 like the examples: each device added its one class's prior to every class (it
    broadcasts), and the loss came out 1.468 where jax.jit's is 1.604, without a word (a
    reviewer's probe on 4 devices, 2026-12-07; here 8 classes over dp=8). Refused now,
    naming the leaf; passed as an argument of its own, outside the batch (as the hint
    says), it runs and matches jax.jit."""
    step, params, state, batch = _class_prior_case()
    with pytest.raises(MeshError, match=r"batch leaf batch/log_prior has 8 rows, where the "
                                        r"batch has 16 \(batch/log_prior: 8; batch/x, "
                                        r"batch/y: 16\)") as e:
        parallelize(step, {"dp": 8})(params, state, batch)
    assert "batch_argnums=(2,)" in e.value.hint
    with pytest.raises(MeshError, match=r"batch leaf batch/log_prior has 8 rows"):
        parallelize(step, {"dp": 2, "pp": 2}, microbatches=2).trace(params, state, batch)
    prior = batch.pop("log_prior")
    want = jax.jit(step)(params, state, batch, prior)[2]
    got = parallelize(step, {"dp": 8}, batch_argnums=(2,))(params, state, batch, prior)[2]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_torch_pipeline_refuses_tensor_arguments_that_are_not_rows_of_the_batch():
    """Under a pipeline every tensor argument is cut into microbatches: a per-class weight
    f32[4] beside a batch of 16 was cut to one row per microbatch at M = 4 (it broadcasts)
    or failed in aten at M = 2 with no word of the cut; a 0-d tensor got a hint about
    the local batch's rows."""
    import torch
    import torch.nn.functional as F
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model, opt, x, y, w):
        loss = F.cross_entropy(model(x), y, weight=w)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    with pytest.raises(MeshError, match=r"step argument 4 has 4 rows, where the batch has "
                                        r"16") as e:
        parallelize(step, {"pp": 2}, microbatches=4).trace(model, opt, x, y, torch.ones(4))
    assert "register_buffer" in e.value.hint
    with pytest.raises(MeshError, match="step argument 4 is a 0-d tensor"):
        parallelize(step, {"pp": 2}, microbatches=4).trace(model, opt, x, y, torch.tensor(1.))
    with pytest.raises(MeshError, match=r"shape \(0,\) cannot be cut into 4 equal"):
        parallelize(step, {"pp": 2}, microbatches=4).trace(model, opt, x, y, torch.ones(0))


def test_jax_refuses_a_data_axis_no_pass_uses():
    """passes="" over {"dp": 8}: the batch was still cut into 8 shares for the trace, so the
    step wanted a global batch of 2 rows (the error said "call it with the global arrays
    of the shapes it was parallelized for"), and given them each device trained on the
    same 2 rows, no gradient averaged. Refused now, as torch refuses an idle axis."""
    step, params, state, batch = _class_prior_case()
    batch.pop("log_prior")

    def plain(params, opt_state, batch):
        return step(params, opt_state, batch, jnp.zeros(8))
    for passes in ("", "dce"):
        with pytest.raises(MeshError, match="mesh axis dp=8, over which the batch is split, "
                                            "is used by no pass"):
            parallelize(plain, {"dp": 8}, passes=passes).trace(params, state, batch)


def test_jax_step_that_returns_no_loss_is_refused_saying_so():
    """A step returning (params, opt_state), or per-example logits as its one metric, was
    refused with "the new value of %params/... is computed from the batch outside backward
    (the optimizer reads a forward value ...)", which it does not: with no loss among its
    results its ops had no phases. compile() runs it."""
    step, params, state, batch = _class_prior_case()
    prior = batch.pop("log_prior")

    def no_loss(params, opt_state, batch):
        return step(params, opt_state, batch, prior)[:2]

    def logits(params, opt_state, batch):
        new = step(params, opt_state, batch, prior)[:2]
        return (*new, batch["x"] @ params["params"]["kernel"])
    for fn in (no_loss, logits):
        with pytest.raises(DiphomaError, match="the step returns no loss") as e:
            parallelize(fn, {"dp": 8}).trace(params, state, batch)
        assert "(params, opt_state, loss, *metrics)" in str(e.value)
    new, _ = diphoma_compile.compile(no_loss, params, state, batch)(params, state, batch)
    want, _ = jax.jit(no_loss)(params, state, batch)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), new, want))


def test_options_of_the_wrong_kind_or_for_no_pipeline_are_refused():
    """shard_params="no" and donate="False" were taken as True (bool() of a string);
    schedule= with no pipeline axis, or beside passes= that hold another, was ignored;
    passes= of a list or a number raised Python's own AttributeError or TypeError."""
    from diphoma_compile.errors import PassSpecError

    def step(*a):
        return a
    for key, value in (("shard_params", "no"), ("donate", "False"), ("shard_params", 1)):
        with pytest.raises(DiphomaError, match=f"{key}={value!r}: the option is True or "
                                               "False"):
            parallelize(step, {"dp": 2}, **{key: value})
    assert parallelize(step, {"dp": 2}, shard_params=np.bool_(True)).shard_params is True
    with pytest.raises(DiphomaError, match="schedule='gpipe' is for pipeline parallelism"):
        parallelize(step, {"dp": 2}, schedule="gpipe")
    with pytest.raises(DiphomaError, match="unknown schedule 'gpip'") as e:
        parallelize(step, {"dp": 2, "pp": 2}, schedule="gpip")
    assert "interleaved-zb" in e.value.hint
    with pytest.raises(DiphomaError, match="whose pipeline pass runs schedule=1f1b"):
        parallelize(step, {"pp": 2}, passes="pipeline{axis=pp}", schedule="gpipe")
    # the default named where no pipeline runs (a config that always passes it, pp=1)
    assert parallelize(step, {"dp": 4, "pp": 1}, schedule="1f1b").pipeline is None
    with pytest.raises(DiphomaError, match="shard_params='False': the option is True or"):
        parallelize(step, {"dp": 2}, passes="dce", shard_params="False")
    assert parallelize(step, {"pp": 2}, passes="pipeline{axis=pp, schedule=gpipe}",
                       schedule="gpipe").pipeline.schedule == "gpipe"
    assert parallelize(step, {"dp": 2, "pp": 2}).pipeline.schedule == "1f1b"
    for passes in (3, ["dce"]):
        with pytest.raises(PassSpecError, match="a pass spec is a string of passes"):
            parallelize(step, {"dp": 2}, passes=passes)


def test_data_parallel_twice_over_one_axis_is_refused_by_name():
    """The second data-parallel{axis=dp} failed in the IR verifier ("all_reduce on axis
    'dp' gives R, but its result is declared V") with an IR dump."""
    step, (params, state, batch) = J.make_case("mlp", "linen", "sgd")
    twice = "dce,data-parallel{axis=dp},data-parallel{axis=dp}"
    with pytest.raises(DiphomaError, match="the graph is data parallel over 'dp' already"):
        parallelize(step, {"dp": 8}, passes=twice).trace(params, state, batch)


def test_batch_leaves_of_k_rows_per_example_split_with_it_and_ties_are_named():
    """A leaf of k rows per example in example order (two views of each example here,
    (32, 8) beside x (16, 8) and its targets) splits with the batch as before, and matches
    jax.jit; with as many leaves of each of two row counts the batch's rows are not known,
    and the error names them rather than guessing which one to move out."""
    import optax
    tx = optax.sgd(0.1)

    def step(params, opt_state, batch):
        def loss_of(p):
            views = batch["views"].reshape(batch["x"].shape[0], 2, 8).mean(1)
            return jnp.mean((batch["x"] @ p["w"] - views @ p["w"] - batch["y"]) ** 2)
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    params = {"w": jnp.linspace(-1.0, 1.0, 32).reshape(8, 4)}
    batch = {"x": jnp.linspace(0.0, 1.0, 128).reshape(16, 8),
             "views": jnp.linspace(1.0, 0.0, 256).reshape(32, 8),
             "y": jnp.linspace(0.0, 2.0, 64).reshape(16, 4)}
    want = jax.jit(step)(params, tx.init(params), batch)
    got = parallelize(step, {"dp": 8})(params, tx.init(params), batch)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-6)
    tie = {"a_table": jnp.ones(8), "x": batch["x"]}
    with pytest.raises(MeshError, match=r"\(batch/a_table: 8; batch/x: 16\), as many of each, "
                                        "so the batch.s rows are not known"):
        parallelize(step, {"dp": 8}).trace(params, tx.init(params), tie)


def test_compression_beside_tensor_parallelism_is_refused_up_front():
    """compression="sdp4bit" over {"dp": 2, "tp": 4}: the quantize-grads pass left a graph
    the verifier refused ("transpose: result 0 is declared R on axis 'tp', but its inputs
    give S(1)"), an IR dump (a reviewer's probe, 2026-12-07)."""
    step, (params, state, batch) = J.make_case("mlp", "linen", "adamw")
    with pytest.raises(DiphomaError, match="not lowered beside tensor parallelism"):
        parallelize(step, {"dp": 2, "tp": 4}, compression="sdp4bit").trace(
            params, state, batch)


def test_a_node_axis_that_is_the_data_axis_is_named():
    """{"node": 8} with compression said "the mesh axis 'node' must come just before the
    data axis 'node'"."""
    for mesh, axis in (({"node": 8}, None), ({"node": 2, "dp": 4}, "node")):
        with pytest.raises(MeshError, match="the data axis is the node axis 'node' itself"):
            parallelize(lambda *a: a, mesh, compression="sdp4bit", axis=axis)


def test_jax_mesh_axis_no_pass_uses_is_warned_of():
    """{"node": 2, "dp": 4} without compression: the devices along node repeated the same
    step on the same data, said only by a line of the plan's text."""
    from diphoma_compile.errors import DiphomaWarning
    step, (params, state, batch) = J.make_case("mlp", "linen", "sgd")
    with pytest.warns(DiphomaWarning, match="mesh axis node=2 is used by no pass"):
        ps = parallelize(step, {"node": 2, "dp": 4}).trace(params, state, batch)
    assert ps.plan.idle_axes == {"node": 2}


def test_the_tensor_parallel_pass_is_costed_on_the_plans_device_model():
    """The default tensor-parallel pass ran on h100-nccl whatever device_model= said (the
    pipeline pass and the step-time estimate took it)."""
    step, (params, state, batch) = J.make_case("mlp", "linen", "adamw")
    ps = parallelize(step, {"dp": 2, "tp": 4}, device_model="cpu-gloo").trace(
        params, state, batch)
    tp = [p for p in ps.plan.passes if p.startswith("tensor-parallel")]
    assert tp and "device-model=cpu-gloo" in tp[0], ps.plan.passes
