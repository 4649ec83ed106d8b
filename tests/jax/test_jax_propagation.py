"""Sharding propagation over a traced flax training step: Megatron's column and row splits,
fixed on the weights of one transformer block, complete into exactly Megatron's
communication (one all-reduce after attention and one after the MLP in forward, the same two
in backward), and the completed graph verifies."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import diphoma_compile
from diphoma_compile.errors import IRError
from diphoma_compile.ir import Phase, verify
from diphoma_compile.ir.propagate import apply_assignment, complete, op_candidates
from diphoma_compile.ir.types import REPLICATE, Partial, Shard
from diphoma_compile.mesh import Mesh
from tests.jax_steps import DIM, LinenBlock, assert_runs_like_one_device, squares_step

ATTN = "params/MultiHeadDotProductAttention_0/"
MEGATRON = {ATTN + "query/kernel": Shard(1), ATTN + "key/kernel": Shard(1),
            ATTN + "value/kernel": Shard(1), ATTN + "out/kernel": Shard(0),
            "params/Dense_0/kernel": Shard(1), "params/Dense_0/bias": Shard(0),
            "params/Dense_1/kernel": Shard(0)}


def _block_step(optimizer):
    block = LinenBlock()
    x = jnp.linspace(-1.0, 1.0, 2 * 8 * DIM).reshape(2, 8, DIM)
    params = block.init(jax.random.key(0), x)["params"]
    graph = diphoma_compile.trace(squares_step(block, optimizer), params,
                                  optimizer.init(params), x)
    return graph.replace(mesh=Mesh({"tp": 2}))


@pytest.fixture(scope="module")
def sgd_block():
    return _block_step(optax.sgd(0.1))


def _moving(assignment, graph, phase):
    return [r.collective for r in assignment.collectives(phase, graph)]


def test_megatron_block_gets_two_all_reduces_forward_and_two_backward(sgd_block):
    a = complete(sgd_block, "tp", MEGATRON)
    assert _moving(a, sgd_block, Phase.forward) == ["all_reduce", "all_reduce"]
    assert _moving(a, sgd_block, Phase.backward) == ["all_reduce", "all_reduce"]
    assert len(a.collectives()) == 4          # nothing in the update, nothing at the outputs
    # the attention and MLP outputs are the partial sums reduced
    for r in a.collectives():
        assert r.src == Partial("sum") and r.dst == REPLICATE
    placed = apply_assignment(sgd_block, a)
    verify(placed)
    types = placed.value_types()
    for name, p in MEGATRON.items():
        assert types[name].placement("tp") == p
    # updated weights come back placed as they went in
    for o in placed.outputs:
        if o.role.target in MEGATRON:
            assert types[o.name].placement("tp") == MEGATRON[o.role.target], o.name
    # the heads are split through attention: the scores are split on the heads dim
    ops = [op for op in placed.ops if op.name == "dot" and op.phase is Phase.forward]
    assert any(types[op.result.name].placement("tp") == Shard(1)
               and types[op.result.name].rank == 4 for op in ops)


def test_optimizer_state_follows_its_parameter():
    graph = _block_step(optax.adamw(1e-3))
    a = complete(graph, "tp", MEGATRON)
    assert len(a.collectives()) == 4
    for i in graph.inputs:
        if i.role.of in MEGATRON and i.value.type.shape == graph.input(i.role.of).value.type.shape:
            assert a.placements[i.name] == MEGATRON[i.role.of], i.name


def test_nothing_fixed_stays_replicated_without_communication(sgd_block):
    a = complete(sgd_block, "tp", {})
    assert a.collectives() == []
    assert all(p == REPLICATE for p in a.placements.values())


def test_a_split_weight_read_whole_is_gathered_once(sgd_block):
    # only the MLP's second weight split by rows, its input whole: the cheapest completion
    # either splits the hidden activations or gathers the weight, never both
    a = complete(sgd_block, "tp", {"params/Dense_1/kernel": Shard(0)})
    verify(apply_assignment(sgd_block, a))
    assert a.comm_s > 0


def test_candidates_list_megatron_splits_with_halved_compute(sgd_block):
    cands = op_candidates(sgd_block, "tp")
    k = next(k for k, op in enumerate(sgd_block.ops)
             if op.name == "dot" and op.inputs[1] == "params/Dense_0/kernel")
    names = {s.name: c for s, c in cands[k]}
    assert {"replicate", "column", "contract"} <= set(names)
    assert names["column"] == pytest.approx(names["replicate"] / 2)


def test_bad_fixed_placements_are_clear_errors(sgd_block):
    with pytest.raises(IRError, match="does not have: nope"):
        complete(sgd_block, "tp", {"nope": Shard(0)})
    with pytest.raises(Exception, match="no axis 'pp'"):
        complete(sgd_block, "pp", {})


def test_a_placement_no_producer_can_give_is_a_clear_error(sgd_block):
    loss = sgd_block.outputs[-1].name
    with pytest.raises(IRError, match="no consistent assignment"):
        complete(sgd_block, "tp", {loss: Partial("max")})


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_the_completed_megatron_block_runs_on_two_devices_like_one(optimizer):
    """The assignment is a program: the shard_map backend runs the completed graph on a
    tensor-parallel mesh of two devices, three steps, and loss, parameters and optimizer
    state match the single-device step."""
    if jax.device_count() < 2:
        pytest.skip("needs two JAX devices")
    tx = optax.sgd(0.1, momentum=0.9) if optimizer == "sgd" else optax.adamw(1e-2)
    block = LinenBlock()
    # random inputs: with smooth ones the query/key gradients are ~1e-8, and Adam's first
    # steps turn their rounding noise into whole steps of lr
    x = jax.random.normal(jax.random.key(1), (2, 8, DIM))
    params = block.init(jax.random.key(0), x)["params"]
    step = squares_step(block, tx)
    graph = diphoma_compile.trace(step, params, tx.init(params), x).replace(
        mesh=Mesh({"tp": 2}))
    placed = apply_assignment(graph, complete(graph, "tp", MEGATRON))
    ours = assert_runs_like_one_device(step, params, x, placed, tx, {"tp": 2}, "tp")
    # the Megatron weights are held split: each device has half of them
    q = ours[0]["MultiHeadDotProductAttention_0"]["query"]["kernel"]
    assert {s.data.shape for s in q.addressable_shards} == {(DIM, 1, 8)}


def test_as_partial_then_all_reduce_gives_the_value_back_exactly():
    """A replicated value as a partial sum (device 0 keeps it, the others hold zeros), summed
    over the axis: the value itself, bit for bit, on two devices."""
    import numpy as np

    from diphoma_compile.ir import parse
    from diphoma_compile.jax.parallel import compile_jax_parallel
    if jax.device_count() < 2:
        pytest.skip("needs two JAX devices")
    graph = parse("""# diphoma-ir v1
graph @g mesh[tp=2] (%x: f32[3,4] batch) {
  %p: f32[3,4] {tp: P(sum)} = as_partial(%x) {axis=tp}
  %r: f32[3,4] = all_reduce(%p) {axis=tp, op=sum}
  %y: f32[3,4] = mul(%r, %x)
  return (
    %y other,
  )
}
""")
    verify(graph)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
    run = compile_jax_parallel(graph, mesh=mesh, axis="tp")
    x = jax.random.normal(jax.random.key(0), (3, 4))
    (y,) = run(x)
    assert np.array_equal(np.asarray(y), np.asarray(x * x))


def test_free_parameters_are_placed_by_the_solver(sgd_block):
    """Only the kernels fixed; the solver places the other parameters: the column layer's
    bias follows its split (else its gradient would be gathered), layer norms stay whole."""
    from diphoma_compile.ir.roles import InputKind
    kernels = {k: p for k, p in MEGATRON.items() if k != "params/Dense_0/bias"}
    free = [i.name for i in sgd_block.inputs
            if i.role.kind is InputKind.param and i.name not in kernels]
    a = complete(sgd_block, "tp", kernels, free=free)
    assert a.placements["params/Dense_0/bias"] == Shard(0)
    assert a.placements["params/LayerNorm_0/scale"] == REPLICATE
    assert len(a.collectives()) == 4
    placed = apply_assignment(sgd_block, a)
    verify(placed)
    types = placed.value_types()
    out = next(o for o in placed.outputs if o.role.target == "params/Dense_0/bias")
    assert types[out.name].placement("tp") == Shard(0)
    with pytest.raises(IRError, match="not graph inputs: dot"):
        complete(sgd_block, "tp", {}, free=["dot"])
