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

import jax_steps as J


def test_data_axis_choice():
    assert data_axis(Mesh({"dp": 4}), None) == "dp"
    assert data_axis(Mesh({"x": 4}), None) == "x"
    assert data_axis(Mesh({"data": 2, "model": 4}), None) == "data"
    assert data_axis(Mesh({"a": 2, "b": 4}), "b") == "b"
    with pytest.raises(MeshError, match="cannot tell which of the mesh axes a, b"):
        data_axis(Mesh({"a": 2, "b": 4}), None)
    with pytest.raises(MeshError, match="the mesh has no axis 'dp' \\(it has a, b\\)"):
        data_axis(Mesh({"a": 2, "b": 4}), "dp")


def test_default_passes_per_framework():
    from diphoma_compile import framework
    assert "layout=flat" in default_passes("dp", layout=framework.get("torch").update_layout)
    assert "layout=dims" in default_passes("data", layout=framework.get("jax").update_layout)


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
        if n == 8:   # leaves with no dimension divisible by 8 stay whole (layout=dims)
            assert m.opt_state < m.single_device_opt_state / n * 1.6 + 64
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
