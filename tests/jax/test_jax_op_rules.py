"""The rules of the JAX primitives the frontend keeps opaque (jax/op_rules.py): every opaque
op of flax training steps (a transformer LM in linen and nnx, a CNN) has one, their costs
count what the primitive touches, and every strategy they list gives the whole result
(tests/strategy_props.py), on the primitives as jax.numpy, optax and flax emit them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402

import diphoma_compile  # noqa: E402
from diphoma_compile.ir import Graph, Shard  # noqa: E402
from diphoma_compile.ir.analysis import graph_cost  # noqa: E402
from diphoma_compile.ir.opdef import op_def  # noqa: E402
from diphoma_compile.ir.strategies import strategies_of  # noqa: E402
from diphoma_compile.jax import op_rules  # noqa: E402, F401 - the rules under test
from diphoma_compile.jax.dtypes import numpy_dtype  # noqa: E402
from diphoma_compile.jax.params import decode  # noqa: E402
from diphoma_compile.jax.trace import trace_jax  # noqa: E402
from tests.jax_run import run_jax  # noqa: E402
from tests.jax_steps import make_case  # noqa: E402
from tests.strategy_props import Case, assert_all, check_cases, sample  # noqa: E402

# ---------------------------------------------------------------- steps: the census


class CNN(nn.Module):
    """Convolutions with batch norm and layer norm, average pooling, a dense head."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Conv(8, (3, 3))(x)))
        x = nn.Conv(8, (3, 3), strides=2, feature_group_count=2)(x)
        x = nn.avg_pool(nn.LayerNorm()(x), (2, 2), strides=(2, 2))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


def _cnn_case():
    model, tx = CNN(), optax.adamw(1e-3)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 8, 8, 3)).astype(np.float32))
    y = jnp.asarray(np.arange(4) % 10)
    v = jax.eval_shape(model.init, jax.random.key(0), x)
    v = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape).astype(a.dtype) * .3), v)

    def step(params, opt_state, batch_stats, x, y):
        def loss_fn(p):
            logits, new = model.apply({"params": p, "batch_stats": batch_stats}, x,
                                      mutable=["batch_stats"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return loss, new["batch_stats"]
        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, stats, loss
    return step, (v["params"], tx.init(v["params"]), v["batch_stats"], x, y)


STEPS = {"lm-linen": lambda: make_case("lm", "linen", "adamw"),
         "lm-nnx": lambda: make_case("lm", "nnx", "adamw"),
         "cnn-linen": _cnn_case}


@pytest.mark.parametrize("name", sorted(STEPS))
def test_every_opaque_op_of_the_step_has_a_rule(name):
    step, args = STEPS[name]()
    g = diphoma_compile.trace(step, *args)
    opaque = {str(op.attrs["target"]) for op in g.walk() if op.name == "opaque"}
    assert opaque, "the step keeps no primitive opaque: the census checks nothing"
    # an opaque op without a rule has unknown flops: the cost names its target
    assert sorted(set(graph_cost(g)[0].unknown)) == []


def test_the_jax_framework_registers_the_rules():
    # a fresh process: loading the JAX framework is what registers them
    code = ("from diphoma_compile.framework import get; "
            "from diphoma_compile.ir.framework_ops import FRAMEWORK_OPS as F; "
            "before = 'jax:gather' in F; get('jax'); print(before, 'jax:gather' in F)")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get(
        "PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=root, env=env).stdout
    assert out.split() == ["False", "True"]


# ---------------------------------------------------------------- costs


def _trace(fn, *args) -> Graph:
    """A function of arrays traced as a step whose params are those arrays."""
    return trace_jax(lambda p, o, b: (p, o, fn(*p)), tuple(args), (), ())


def _first(g: Graph, target: str):
    types = g.value_types()
    op = next(op for op in g.walk() if op.attrs.get("target") == target)
    return op, [types[i] for i in op.inputs], [v.type for v in op.results]


def test_lookup_costs_count_the_rows_not_the_table():
    table = jnp.zeros((1000, 64))
    ids = jnp.zeros((2, 8), jnp.int32)
    fwd = _trace(lambda t, i: jnp.take(t, i, axis=0), table, ids)
    op, ins, outs = _first(fwd, "jax:gather")
    d = op_def("opaque")
    assert d.flops(op, ins, outs) == 0
    assert d.bytes_accessed(op, ins, outs) == 2 * 8 * 4 + 2 * (2 * 8 * 64 * 4)
    bwd = _trace(lambda t, i, c: jax.grad(lambda t: (jnp.take(t, i, axis=0) * c).sum())(t),
                 table, ids, jnp.ones((2, 8, 64)))
    op, ins, outs = _first(bwd, "jax:scatter-add")
    assert d.flops(op, ins, outs) == 2 * 8 * 64
    assert d.bytes_accessed(op, ins, outs) == 2 * 8 * 4 + 3 * (2 * 8 * 64 * 4)
    assert d.bytes_accessed(op, ins, outs) < table.nbytes


def test_conv_flops_count_each_tap_of_each_input_feature():
    x, w = jnp.zeros((2, 8, 8, 6)), jnp.zeros((3, 3, 3, 4))   # two groups of 3 features
    g = _trace(lambda x, w: lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
        feature_group_count=2), x, w)
    op, ins, outs = _first(g, "jax:conv_general_dilated")
    assert op_def("opaque").flops(op, ins, outs) == 2 * (2 * 8 * 8 * 4) * 3 * 9


# ---------------------------------------------------------------- strategies: the cases

def _index_bounds(op, ins) -> list[int]:
    """For each component of the index vectors: how many start positions fit."""
    name = str(op.attrs["target"])
    dn = decode(op.attrs["dimension_numbers"])
    operand = ins[0]
    if name == "jax:gather":
        sizes = [int(s) for s in op.attrs["slice_sizes"]]
        return [operand.shape[d] - sizes[d] + 1 for d in dn.start_index_map]
    upd = ins[2]
    window = [d for d in range(operand.rank) if d not in dn.inserted_window_dims
              and d not in dn.operand_batching_dims]
    size = {d: upd.shape[dn.update_window_dims[w]] for w, d in enumerate(window)}
    return [operand.shape[d] - size.get(d, 1) + 1 for d in dn.scatter_dims_to_operand_dims]


def _data(op, ins, rng) -> list[np.ndarray]:
    """Random inputs of the op's types; indices in range."""
    name = str(op.attrs["target"])
    data = [sample(rng, t.shape, numpy_dtype(t.dtype)) for t in ins]
    if name == "jax:gather" or name.startswith("jax:scatter"):
        idx = ins[1]
        bounds = _index_bounds(op, ins)
        comps = [rng.integers(0, b, idx.shape[:-1]) for b in bounds]
        data[1] = np.stack(comps, -1).astype(numpy_dtype(idx.dtype))
    if name in ("jax:dynamic_slice", "jax:dynamic_update_slice"):
        first = 1 if name == "jax:dynamic_slice" else 2
        size = [int(s) for s in op.attrs["slice_sizes"]] if first == 1 else list(ins[1].shape)
        for d, t in enumerate(ins[first:]):
            data[first + d] = np.asarray(rng.integers(0, ins[0].shape[d] - size[d] + 1),
                                         numpy_dtype(t.dtype))
    return data


def cases_of(fn, *args, seed: int = 0) -> list[Case]:
    """A case for each opaque op of the traced function, on random data."""
    rng = np.random.default_rng(seed)
    g = _trace(fn, *args)
    types = g.value_types()
    out = []
    for op in g.walk():
        if op.name == "opaque":
            ins = [types[i] for i in op.inputs]
            out.append(Case("opaque", _data(op, ins, rng), [v.type for v in op.results],
                            dict(op.attrs)))
    return out


def _f32(*shape):
    return jnp.zeros(shape, jnp.float32)


def _i32(*shape):
    return jnp.zeros(shape, jnp.int32)


def _grad(f, argnum=0):
    """The gradient of sum(f(...) * cotangent) (a function of the args and cotangent)."""
    return lambda *a: jax.grad(lambda *x: (f(*x[:-1]) * x[-1]).sum(), argnums=argnum)(*a)


def _conv(x, w, groups=1):
    return lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                    feature_group_count=groups)


def _window_gather(x, i):
    """Windows of 2 rows starting at the indices, and of the first 2 of dim 1."""
    dn = lax.GatherDimensionNumbers(offset_dims=(1, 2, 3), collapsed_slice_dims=(),
                                    start_index_map=(0,))
    return lax.gather(x, i, dn, (2, 2, 4), mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)


def _index_cases() -> list[Case]:
    take = lambda t, i: jnp.take(t, i, axis=0)                         # noqa: E731
    along = lambda x, i: jnp.take_along_axis(x, i[..., None], axis=-1)  # noqa: E731
    xent = optax.softmax_cross_entropy_with_integer_labels
    return (cases_of(take, _f32(8, 4), _i32(4, 2)) +                  # embedding lookup
            cases_of(_grad(take), _f32(8, 4), _i32(4, 2), _f32(4, 2, 4)) +
            cases_of(along, _f32(4, 2, 8), _i32(4, 2)) +             # take_along_axis
            cases_of(_grad(along), _f32(4, 2, 8), _i32(4, 2), _f32(4, 2, 1)) +
            cases_of(lambda x, y: jax.grad(lambda x: xent(x, y).sum())(x),
                     _f32(4, 8), _i32(4)) +                            # cross-entropy
            cases_of(lambda x, i: jnp.take(x, i, axis=1, mode="clip"), _f32(4, 8), _i32(4)) +
            cases_of(lambda x, i: jnp.take(x, i, axis=1), _f32(4, 8, 4), _i32(2)) +
            cases_of(_window_gather, _f32(8, 4, 4), _i32(4, 1)) +
            cases_of(lambda x, i, v: x.at[i].set(v), _f32(8, 4), _i32(4), _f32(4, 4)) +
            cases_of(lambda x, i, v: x.at[:, i].add(v), _f32(4, 8), _i32(2), _f32(4, 2)) +
            cases_of(lambda x, i, v: x.at[i].max(v), _f32(8, 4), _i32(4), _f32(4, 4)))


def _window_cases() -> list[Case]:
    pool = lambda x: nn.avg_pool(x, (2, 2), strides=(2, 2))            # noqa: E731
    return (cases_of(_conv, _f32(4, 8, 8, 4), _f32(3, 3, 4, 8)) +
            cases_of(_grad(_conv, (0, 1)), _f32(4, 8, 8, 4), _f32(3, 3, 4, 8),
                     _f32(4, 8, 8, 8)) +                               # with rev
            cases_of(lambda x, w: _conv(x, w, 2), _f32(4, 4, 4, 4), _f32(3, 3, 2, 4)) +
            cases_of(_grad(lambda x, w: _conv(x, w, 2), (0, 1)), _f32(4, 4, 4, 4),
                     _f32(3, 3, 2, 4), _f32(4, 4, 4, 4)) +      # a reshape with dimensions
            cases_of(lambda x: lax.reshape(x, (2, 16, 3), dimensions=(0, 2, 1, 3)),
                     _f32(2, 4, 4, 3)) +
            cases_of(pool, _f32(4, 8, 8, 4)) +
            cases_of(_grad(pool), _f32(4, 8, 8, 4), _f32(4, 4, 4, 4)) +  # interior pad
            cases_of(lambda x: nn.max_pool(x, (2, 2), strides=(2, 2)), _f32(4, 8, 8, 4)) +
            cases_of(lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 2), (1, 1),
                                                 ((1, 1), (0, 1))), _f32(4, 6)) +
            cases_of(lambda x: lax.pad(x, 1.5, ((0, 0, 0), (1, 2, 1))), _f32(4, 6)) +
            cases_of(lambda x: lax.rev(x, (1,)), _f32(4, 6, 2)))


def _axis_cases() -> list[Case]:
    x = _f32(4, 6)
    return (cases_of(lambda x: jnp.cumsum(x, 1), x) +
            cases_of(lambda x: lax.cummax(x, 0), _f32(6, 4)) +
            cases_of(lambda x: lax.cummin(x, 1), x) +
            cases_of(lambda x: lax.cumprod(x, 1), x) +
            cases_of(lambda x: lax.cumlogsumexp(x, 1), x) +
            cases_of(lambda x: jnp.sort(x, 1), x) +
            cases_of(lambda x: jnp.argsort(x, 0), _f32(6, 4)) +
            cases_of(lambda x: lax.top_k(x, 3), _f32(4, 2, 6)) +
            cases_of(lambda x: jnp.argmax(x, 1), _f32(4, 6, 2)) +
            cases_of(lambda b: jnp.all(b, 0), jnp.zeros((4, 8), bool)) +
            cases_of(lambda x: jnp.split(x, 3, axis=1), x) +
            # a collective over a vmapped axis (equinox's BatchNorm): positional axes
            cases_of(lambda x: jax.vmap(lambda r: lax.psum(r, "b"), axis_name="b",
                                        out_axes=None)(x), x) +
            cases_of(lambda x: jax.vmap(lambda r: lax.pmax(r, "b"), axis_name="b",
                                        out_axes=None)(x), _f32(6, 4)))


def _other_cases() -> list[Case]:
    return (cases_of(lambda x, i: lax.dynamic_slice(x, (i, 0), (2, 4)), _f32(4, 4), _i32()) +
            cases_of(lambda x, u, i: lax.dynamic_update_slice(x, u, (0, i)),
                     _f32(4, 8), _f32(4, 2), _i32()) +
            cases_of(lambda a, b: lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,))),
                                                  precision=lax.Precision.HIGHEST),
                     _f32(4, 2, 6), _f32(4, 6, 8)) +
            cases_of(lambda x: jax.scipy.special.erfinv(jnp.tanh(x)), _f32(4, 2)) +
            cases_of(lambda x: jnp.round(x, 0) * 0, _f32(2, 4)) +
            cases_of(lambda x: lax.shift_right_logical(x, jnp.uint32(3)),
                     jnp.zeros((4, 2), jnp.uint32)))


GROUPS = {"index": _index_cases, "window": _window_cases, "axis": _axis_cases,
          "other": _other_cases}


def _adjust_slice_sizes(op, ins, outs, s, n):
    """A gather's or dynamic slice's slice size of a split dim sliced whole: the local
    size."""
    sizes = [int(v) for v in op.attrs["slice_sizes"]]
    p = s.inputs[0]
    if isinstance(p, Shard) and sizes[p.dim] == ins[0].shape[p.dim] * n:
        sizes[p.dim] = ins[0].shape[p.dim]
    return op.attrs.set(slice_sizes=tuple(sizes))


def _shift(idx, j, chunk, k, outside):
    """Component j of the index vectors moved to device k's chunk; where it fell in it."""
    comp = idx[..., j].astype(np.int64) - k * chunk
    inside = (comp >= 0) & (comp < chunk)
    idx = idx.copy()
    idx[..., j] = np.where(inside, comp, outside)
    return idx, inside


def _mask_gather(op, s, n, k, xs):
    """Vocab-parallel gather: device k picks the indices in its rows and zeros the rest."""
    operand, idx = xs
    dn = decode(op.attrs["dimension_numbers"])
    d = s.inputs[0].dim
    idx, inside = _shift(idx, list(dn.start_index_map).index(d), operand.shape[d], k, 0)

    def fix(outs):
        rank, batch = outs[0].ndim, iter(inside.shape)
        shape = [1 if i in dn.offset_dims else next(batch) for i in range(rank)]
        return [np.where(inside.reshape(shape), outs[0], np.zeros((), outs[0].dtype))]
    return [operand, idx], fix


def _mask_scatter(op, s, n, k, xs):
    """Vocab-parallel scatter: device k drops the updates outside its rows (an index out of
    bounds, which FILL_OR_DROP drops)."""
    operand, idx, upd = xs
    assert "FILL_OR_DROP" in str(op.attrs["mode"])
    dn = decode(op.attrs["dimension_numbers"])
    d = s.inputs[0].dim
    idx, _ = _shift(idx, list(dn.scatter_dims_to_operand_dims).index(d), operand.shape[d], k,
                    operand.shape[d])
    return [operand, idx, upd], None


def _adjust_new_sizes(op, ins, outs, s, n):
    """A reshape's result shape: the local one."""
    return op.attrs.set(new_sizes=tuple(outs[0].shape))


ADJUST = {"jax:gather": _adjust_slice_sizes, "jax:dynamic_slice": _adjust_slice_sizes,
          "jax:reshape": _adjust_new_sizes}
MASK = {"jax:gather": _mask_gather,
        **{f"jax:{n}": _mask_scatter for n in ("scatter", "scatter-add", "scatter-max")}}


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_every_strategy_of_a_rule_gives_the_whole_result(group):
    cases = GROUPS[group]()
    assert cases
    assert_all(check_cases(cases, run_jax, adjust=ADJUST, mask=MASK))


def _kinds(case: Case) -> set[tuple[str, bool]]:
    op = case.op
    return {(s.name, s.masked) for s in strategies_of(op, case.ins, [v.type for v in op.results])}


def test_the_lm_lookups_split_by_batch_and_by_vocabulary():
    # what a planner needs of a transformer LM: the embedding lookup, the cross-entropy's
    # take_along_axis and their gradients split along the batch, and the vocabulary split
    # (masked) of the table and of the logits
    for case in _index_cases()[:4]:
        assert {("batch", False), ("vocab", True)} <= _kinds(case), str(case)


def test_a_gather_filling_with_another_value_is_not_a_partial_sum():
    # each device's piece would add the fill value to the sum
    (case,) = cases_of(lambda x, i: jnp.take(x, i, axis=0, mode="fill", fill_value=-1.0),
                       _f32(8, 4), _i32(4))
    kinds = {name for name, _ in _kinds(case)}
    assert "batch" in kinds and not kinds & {"vocab", "partial"}
