"""What the IR knows of the JAX primitives the frontend keeps ``opaque``: their flops, their
bytes where reading every operand whole is wrong (a gather reads the rows it picks, not the
table), and how they may be split (``ir/strategies.py``), registered by target
(``jax:gather``). Importing this module registers them; ``framework.py`` does.

The strategies are the ones the property tests prove (tests/jax/test_jax_op_rules.py), on
the primitives' own parameters. Where a parameter carries a shape (a gather's
``slice_sizes``, a dynamic slice's), the local op takes the local size of each split dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from ..ir.core import Attrs, Op
from ..ir.framework_ops import FrameworkOpRule, register_framework_op
from ..ir.strategies import (Strategy, StrategyFn, dot, elementwise, reduce, replicated,
                             reshape)
from ..ir.types import REPLICATE, Partial, Shard, TensorType
from .params import decode

Types = Sequence[TensorType]
CostFn = Callable[[Op, Types, Types], int]

# threefry2x32, JAX's default generator: 20 rounds of add, rotate and xor on a pair of
# 32-bit words, about 40 integer operations per 32-bit word drawn
_THREEFRY_PER_WORD = 40


def _param(op: Op, name: str, default: Any = None) -> Any:
    return decode(op.attrs[name]) if name in op.attrs else default


def _register(names: str, flops: CostFn, strategies: StrategyFn | None = None,
              nbytes: CostFn | None = None, regroup: bool = True, **more: Any) -> None:
    for name in names.split():
        register_framework_op(FrameworkOpRule(f"jax:{name}", flops, strategies, nbytes,
                                              regroup, **more))


# ---------------------------------------------------------------- costs

def _per_result_element(k: float) -> CostFn:
    return lambda op, ins, outs: int(k * sum(t.numel for t in outs))


def _per_operand_element(k: float) -> CostFn:
    return lambda op, ins, outs: int(k * ins[0].numel)


def _none(op: Op, ins: Types, outs: Types) -> int:
    return 0


def _log2(n: int) -> int:
    return max(1, math.ceil(math.log2(max(n, 2))))


def _sort_flops(op: Op, ins: Types, outs: Types) -> int:
    # a comparison sort of each row: n log n comparisons, each moving every operand
    dim = int(op.attrs["dimension"])
    return ins[0].numel * _log2(ins[0].shape[dim]) * len(ins)


def _top_k_flops(op: Op, ins: Types, outs: Types) -> int:
    return ins[0].numel * _log2(int(op.attrs["k"]))


def _conv_flops(op: Op, ins: Types, outs: Types) -> int:
    # each result element: a multiply and an add per kernel tap and per input feature
    _, rspec, _ = _param(op, "dimension_numbers")
    rhs = ins[1]
    taps = math.prod(rhs.shape[d] for d in rspec[2:])
    return 2 * outs[0].numel * rhs.shape[rspec[1]] * taps


def _window_flops(op: Op, ins: Types, outs: Types) -> int:
    return outs[0].numel * math.prod(int(w) for w in op.attrs["window_dimensions"])


def _dot_flops(op: Op, ins: Types, outs: Types) -> int:
    (lc, _), _ = _param(op, "dimension_numbers")
    return 2 * outs[0].numel * math.prod(ins[0].shape[int(d)] for d in lc)


def _scatter_flops(op: Op, ins: Types, outs: Types) -> int:
    return ins[2].numel   # one combine per update element


def _gather_bytes(op: Op, ins: Types, outs: Types) -> int:
    # the indices, the rows picked (read) and the result (written): not the whole table
    return ins[1].nbytes + 2 * outs[0].nbytes


def _scatter_bytes(op: Op, ins: Types, outs: Types) -> int:
    # the indices and updates, and the rows they touch read and written in place
    return ins[1].nbytes + ins[2].nbytes + 2 * ins[2].numel * outs[0].dtype.itemsize


def _dynamic_slice_bytes(op: Op, ins: Types, outs: Types) -> int:
    return sum(t.nbytes for t in ins[1:]) + 2 * outs[0].nbytes


def _dynamic_update_bytes(op: Op, ins: Types, outs: Types) -> int:
    # the update written in place over the rows it covers
    return sum(t.nbytes for t in ins[2:]) + 2 * ins[1].nbytes


# ---------------------------------------------------------------- strategies

def _partial(ins: Types, outs: Types, kind: str = "sum",
             positions: Sequence[int] | None = None) -> Strategy:
    """Partial values at ``positions`` (default: every operand) give partial results."""
    at = range(len(ins)) if positions is None else positions
    return Strategy(tuple(Partial(kind) if i in at else REPLICATE for i in range(len(ins))),
                    tuple(Partial(kind) for _ in outs), "partial")


def _split_all(ins: Types, outs: Types, d: int) -> Strategy:
    return Strategy(tuple(Shard(d) for _ in ins), tuple(Shard(d) for _ in outs), "split")


def _along_axis(axis_of: Callable[[Op, Types], int], partial: str | None = None) -> StrategyFn:
    """Ops along one axis (cumulative ops, sort, top_k, split): every other dim splits all
    operands and results alike; a cumulative sum, max or min passes partial values on."""
    def strategies(op: Op, ins: Types, outs: Types) -> list[Strategy]:
        ax = axis_of(op, ins)
        menu = [replicated(ins, outs)]
        menu += [_split_all(ins, outs, d) for d in range(ins[0].rank)
                 if d != ax and ins[0].shape[d] > 1]
        if partial:
            menu.append(_partial(ins, outs, partial))
        return menu
    return strategies


def _axis(name: str) -> Callable[[Op, Types], int]:
    return lambda op, ins: int(op.attrs[name]) % ins[0].rank


def _last_or_axis(op: Op, ins: Types) -> int:
    return int(op.attrs.get("axis", ins[0].rank - 1)) % ins[0].rank


def _kept_dims(op: Op, ins: Types, outs: Types) -> list[Strategy]:
    """Reductions over ``axes`` (argmax, reduce_and, ...): a kept dim carries its split."""
    axes = {int(a) for a in op.attrs["axes"]}
    x = ins[0]
    menu = [replicated(ins, outs)]
    for d in range(x.rank):
        if d not in axes and x.shape[d] > 1:
            od = d - sum(a < d for a in axes)
            menu.append(Strategy((Shard(d),), tuple(Shard(od) for _ in outs), "split"))
    return menu


def _positional(kind: str) -> StrategyFn:
    """psum, pmax, pmin over positional axes (``jax.vmap(f, axis_name=...)`` of a
    collective over the mapped axis: equinox's BatchNorm) reduce those dims of their one
    operand, as the neutral reduction does; over named axes (inside shard_map) they run
    whole."""
    def strategies(op: Op, ins: Types, outs: Types) -> list[Strategy]:
        axes = _param(op, "axes", ())
        if len(ins) != 1 or not all(isinstance(a, int) for a in axes):
            return [replicated(ins, outs)]
        return reduce(op.replace(name=kind, attrs=Attrs({"dims": tuple(axes)})), ins, outs)
    return strategies


def _untouched(dims: Sequence[int], ins: Types, outs: Types, partial: str | None,
               rest: int = 0) -> list[Strategy]:
    """Split ``dims`` of the first operand and the result alike (the other ``rest``
    operands whole); partial values of the kind ``partial`` pass through every operand."""
    menu = [replicated(ins, outs)]
    menu += [Strategy((Shard(d),) + (REPLICATE,) * rest, (Shard(d),), "split")
             for d in dims if ins[0].shape[d] > 1]
    if partial:
        menu.append(_partial(ins, outs, partial))
    return menu


def _rev(op: Op, ins: Types, outs: Types) -> list[Strategy]:
    """A reversed dim's pieces change places; the others split."""
    flipped = {int(d) for d in op.attrs["dimensions"]}
    return _untouched([d for d in range(ins[0].rank) if d not in flipped], ins, outs, "sum")


def _pad(op: Op, ins: Types, outs: Types) -> list[Strategy]:
    """Dims padded by nothing split (the padding value whole); padding is linear in the
    operand and the padding value together."""
    config = _param(op, "padding_config")
    dims = [d for d, c in enumerate(config) if tuple(int(v) for v in c) == (0, 0, 0)]
    return _untouched(dims, ins, outs, "sum", rest=1)


def _window(kind: str) -> StrategyFn:
    """reduce_window_*: dims the window leaves alone (size 1, stride 1, no padding or
    dilation) split; partial values of the reduction's own kind pass through."""
    def strategies(op: Op, ins: Types, outs: Types) -> list[Strategy]:
        a = op.attrs
        pads = _param(op, "padding")
        dims = [d for d in range(ins[0].rank)
                if int(a["window_dimensions"][d]) == 1 and int(a["window_strides"][d]) == 1
                and tuple(pads[d]) == (0, 0) and int(a["base_dilation"][d]) == 1
                and int(a["window_dilation"][d]) == 1]
        return _untouched(dims, ins, outs, kind)
    return strategies


def _dynamic_slice(op: Op, ins: Types, outs: Types) -> list[Strategy]:
    """Dims sliced whole split (their start index clamps to 0 on every device)."""
    sizes = [int(s) for s in op.attrs["slice_sizes"]]
    dims = [d for d in range(ins[0].rank) if sizes[d] == ins[0].shape[d]]
    menu = _untouched(dims, ins, outs, None, rest=len(ins) - 1)
    menu.append(_partial(ins, outs, "sum", [0]))
    return menu


def _dynamic_update_slice(op: Op, ins: Types, outs: Types) -> list[Strategy]:
    """Dims the update covers whole split the operand and the update alike."""
    operand, update = ins[:2]
    rest = (REPLICATE,) * (len(ins) - 2)
    menu = [replicated(ins, outs)]
    menu += [Strategy((Shard(d), Shard(d)) + rest, (Shard(d),), "split")
             for d in range(operand.rank)
             if operand.shape[d] > 1 and update.shape[d] == operand.shape[d]]
    menu.append(_partial(ins, outs, "sum", [0, 1]))
    return menu


def _reshape(op: Op, ins: Types, outs: Types) -> list[Strategy]:
    """A reshape with ``dimensions`` transposes first: a split moves with its dim through
    the transpose, then splits the result as the neutral reshape says (the local op takes
    the local ``new_sizes``)."""
    x = ins[0]
    perm = [int(d) for d in op.attrs.get("dimensions") or range(x.rank)]
    moved = TensorType(tuple(x.shape[d] for d in perm), x.dtype)
    return [Strategy(tuple(Shard(perm[p.dim]) if isinstance(p, Shard) else p
                           for p in s.inputs), s.outputs, s.name)
            for s in reshape(op, [moved], outs)]


def _conv(op: Op, ins: Types, outs: Types) -> list[Strategy]:
    """The batch splits the input and the result; without feature groups the output
    features split the kernel and the result (a column split) and the input features split
    both operands into partial sums; partial sums pass through either operand."""
    lspec, rspec, ospec = _param(op, "dimension_numbers")
    lhs, rhs = ins
    groups = int(op.attrs.get("feature_group_count", 1))
    batch_groups = int(op.attrs.get("batch_group_count", 1))
    menu = [replicated(ins, outs)]
    if batch_groups == 1 and lhs.shape[lspec[0]] > 1:
        menu.append(Strategy((Shard(lspec[0]), REPLICATE), (Shard(ospec[0]),), "batch"))
    if groups == 1 and batch_groups == 1:
        if rhs.shape[rspec[0]] > 1:
            menu.append(Strategy((REPLICATE, Shard(rspec[0])), (Shard(ospec[1]),), "column"))
        if lhs.shape[lspec[1]] > 1:
            menu.append(Strategy((Shard(lspec[1]), Shard(rspec[1])), (Partial("sum"),),
                                 "contract"))
    menu += [_partial(ins, outs, "sum", [0]), _partial(ins, outs, "sum", [1])]
    return menu


def _dot_general(op: Op, ins: Types, outs: Types) -> list[Strategy]:
    """A dot_general kept whole (mixed precision, a set precision) splits as the neutral
    dot of the same dimension numbers does."""
    (lc, rc), (lb, rb) = _param(op, "dimension_numbers")
    attrs = {"lhs_contract": tuple(map(int, lc)), "rhs_contract": tuple(map(int, rc)),
             "lhs_batch": tuple(map(int, lb)), "rhs_batch": tuple(map(int, rb))}
    return dot(op.replace(name="dot", attrs=Attrs(attrs)), ins, outs)


def _fills_zero(op: Op, operand: TensorType) -> bool:
    """True when a gather's out-of-bounds results add up as the whole one does: no fill
    (clip, promise_in_bounds), or a fill of 0 or NaN (NaN for floats by default)."""
    mode = str(_param(op, "mode", ""))
    if "FILL" not in mode.upper():
        return True
    fill = _param(op, "fill_value")
    return operand.dtype.is_float and (fill is None or float(fill) == 0 or fill != fill)


def _gather(op: Op, ins: Types, outs: Types) -> list[Strategy]:
    """lax.gather (the last dim of the indices holds each index vector):

    - batch: a dim of the indices splits the result's matching batch dim (an embedding
      lookup of a split batch); an indices batching dim splits its operand dim too
      (take_along_axis);
    - split: an operand dim sliced whole and not indexed splits the result's matching
      offset dim (the local slice size is the local size);
    - vocab (masked): an indexed dim picked one at a time splits the operand; each device
      looks up the indices in its range and zeros the rest: partial sums;
    - partial: gathering is linear in the operand."""
    operand, idx = ins
    dn = _param(op, "dimension_numbers")
    offset, collapsed = tuple(dn.offset_dims), set(dn.collapsed_slice_dims)
    start_map = tuple(dn.start_index_map)
    obatch, ibatch = tuple(dn.operand_batching_dims), tuple(dn.start_indices_batching_dims)
    sizes = [int(s) for s in op.attrs["slice_sizes"]]
    out_batch = [d for d in range(outs[0].rank) if d not in offset]
    menu = [replicated(ins, outs)]
    for i in range(idx.rank - 1):
        if idx.shape[i] <= 1:
            continue
        src = Shard(obatch[ibatch.index(i)]) if i in ibatch else REPLICATE
        menu.append(Strategy((src, Shard(i)), (Shard(out_batch[i]),), "batch"))
    window = [d for d in range(operand.rank) if d not in collapsed and d not in obatch]
    for w, d in enumerate(window):
        if d not in start_map and operand.shape[d] > 1 and sizes[d] == operand.shape[d]:
            menu.append(Strategy((Shard(d), REPLICATE), (Shard(offset[w]),), "split"))
    if _fills_zero(op, operand):
        menu += [Strategy((Shard(d), REPLICATE), (Partial("sum"),), "vocab", masked=True)
                 for d in start_map
                 if d in collapsed and d not in obatch and operand.shape[d] > 1]
        menu.append(_partial(ins, outs, "sum", [0]))
    return menu


def _split_rows(op: Op, ins: Types, outs: Types) -> list[range] | None:
    """The rows of dim 0 each piece of a split holds (None: it cuts another axis)."""
    if not ins[0].rank or int(op.attrs["axis"]) % ins[0].rank != 0:
        return None
    ends = [0]
    for size in decode(op.attrs["sizes"]):
        ends.append(ends[-1] + int(size))
    return [range(a, b) for a, b in zip(ends, ends[1:])]


def _gather_picks(op: Op, ins: Types, outs: Types
                  ) -> tuple[dict[int, tuple[int, int | None]], int | None]:
    """The operand dims a gather picks one index at a time (collapsed, indexed, not batching
    dims), each with its index operand (the indices, input 1) and the entry of the index
    vector picking it; and the result's dim that holds the indices' first dim."""
    dn = _param(op, "dimension_numbers")
    start_map, collapsed = tuple(dn.start_index_map), set(dn.collapsed_slice_dims)
    picks = {d: (1, k) for k, d in enumerate(start_map)
             if d in collapsed and d not in tuple(dn.operand_batching_dims)}
    return picks, next((d for d in range(outs[0].rank) if d not in tuple(dn.offset_dims)),
                       None)


def _scatter(linear: bool) -> StrategyFn:
    """lax.scatter and its combining forms (the last dim of the indices holds each index
    vector):

    - batch: an indices batching dim splits its operand dim, the indices and the updates;
      another dim of the indices splits them and the updates, which a scatter-add adds
      into partial sums (an embedding's gradient under a split batch);
    - split: an operand dim the updates cover whole and do not index splits the operand
      and the updates;
    - vocab (masked): an indexed dim updated one row at a time splits the operand; each
      device drops the updates of rows outside its range;
    - partial (scatter-add): linear in the operand and the updates together."""
    def strategies(op: Op, ins: Types, outs: Types) -> list[Strategy]:
        operand, idx, upd = ins
        dn = _param(op, "dimension_numbers")
        uwd, inserted = tuple(dn.update_window_dims), set(dn.inserted_window_dims)
        to_operand = tuple(dn.scatter_dims_to_operand_dims)
        obatch, ibatch = tuple(dn.operand_batching_dims), tuple(dn.scatter_indices_batching_dims)
        upd_scatter = [d for d in range(upd.rank) if d not in uwd]
        menu = [replicated(ins, outs)]
        for i in range(idx.rank - 1):
            if idx.shape[i] <= 1:
                continue
            u = upd_scatter[i]
            if i in ibatch:
                ob = obatch[ibatch.index(i)]
                menu.append(Strategy((Shard(ob), Shard(i), Shard(u)), (Shard(ob),), "batch"))
            elif linear:
                menu.append(Strategy((Partial("sum"), Shard(i), Shard(u)), (Partial("sum"),),
                                     "batch"))
        window = [d for d in range(operand.rank) if d not in inserted and d not in obatch]
        for w, d in enumerate(window):
            if d not in to_operand and operand.shape[d] > 1 and \
                    upd.shape[uwd[w]] == operand.shape[d]:
                menu.append(Strategy((Shard(d), REPLICATE, Shard(uwd[w])), (Shard(d),),
                                     "split"))
        menu += [Strategy((Shard(d), REPLICATE, REPLICATE), (Shard(d),), "vocab", masked=True)
                 for d in to_operand
                 if d in inserted and d not in obatch and operand.shape[d] > 1]
        if linear:
            menu.append(_partial(ins, outs, "sum", [0, 2]))
        return menu
    return strategies


# ---------------------------------------------------------------- the rules

# elementwise primitives without a neutral op (or in a form the neutral op does not take:
# round's method, not on integers, abs of a complex number, select_n of n cases)
_register("erf_inv erfc lgamma digamma tan asin acos atan sinh cosh asinh acosh atanh cbrt "
          "exp2 nextafter round not shift_left shift_right_logical shift_right_arithmetic "
          "population_count clz reduce_precision imag real conj abs select_n",
          _per_result_element(1), elementwise)
_register("psum", _per_operand_element(1), _positional("reduce_sum"))
_register("pmax", _per_operand_element(1), _positional("reduce_max"))
_register("pmin", _per_operand_element(1), _positional("reduce_min"))
_register("argmax argmin reduce_and reduce_or reduce_xor", _per_operand_element(1), _kept_dims)
_register("cumsum", _per_result_element(1), _along_axis(_axis("axis"), "sum"))
_register("cummax", _per_result_element(1), _along_axis(_axis("axis"), "max"))
_register("cummin", _per_result_element(1), _along_axis(_axis("axis"), "min"))
_register("cumprod", _per_result_element(1), _along_axis(_axis("axis")))
_register("cumlogsumexp", _per_result_element(3), _along_axis(_axis("axis")))
_register("sort", _sort_flops, _along_axis(_axis("dimension")))
_register("top_k", _top_k_flops, _along_axis(_last_or_axis))
_register("split", _none, _along_axis(_axis("axis")), row_window=_split_rows)
# a reshape with dimensions (a grouped conv's gradient) and a grouped convolution tie
# contiguous runs of channels together: no grouped splits
_register("reshape", _none, _reshape, regroup=False)
_register("rev", _none, _rev)
_register("pad", _none, _pad)
_register("dynamic_slice", _none, _dynamic_slice, _dynamic_slice_bytes, joins_rows=True)
_register("dynamic_update_slice", _none, _dynamic_update_slice, _dynamic_update_bytes)
_register("reduce_window_sum", _window_flops, _window("sum"))
_register("reduce_window_max", _window_flops, _window("max"))
_register("reduce_window_min", _window_flops, _window("min"))
_register("conv_general_dilated", _conv_flops, _conv, regroup=False)
_register("dot_general", _dot_flops, _dot_general)
_register("gather", _none, _gather, _gather_bytes, row_picks=_gather_picks)
_register("scatter-add scatter-sub", _scatter_flops, _scatter(linear=True), _scatter_bytes)
_register("scatter scatter-mul scatter-min scatter-max", _scatter_flops, _scatter(linear=False),
          _scatter_bytes)
# random numbers: drawn whole on every device (the planner must not split a draw)
_register("random_bits", _per_result_element(_THREEFRY_PER_WORD), shape_attr="shape")
_register("threefry2x32", _per_result_element(_THREEFRY_PER_WORD))
_register("random_fold_in", _per_result_element(2 * _THREEFRY_PER_WORD))
_register("random_split", _per_result_element(2 * _THREEFRY_PER_WORD), shape_attr="shape")
_register("random_seed random_wrap random_unwrap", _none)
