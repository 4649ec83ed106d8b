"""Flops, bytes and sharding strategies of the aten ops the torch frontend keeps whole
(``opaque{target="aten.<op>.<overload>"}``), registered with the IR by target on import
(``ir/framework_ops.py``). Each rule reads the op's arguments by their names in the aten
schema; its tensors are the op's inputs, in order of first use.

Flop conventions (logical, whole tensors; one multiply-add is 2 flops, as
``torch.utils.flop_counter`` counts):

- ``addmm(bias, x[M,K], w[K,N])``: 2MKN + MN (the bias add).
- ``convolution``: 2 * N * outSpatial * numel(weight) (= 2*N*Cout*outHW*(Cin/groups)*kH*kW;
  a transposed convolution counts the input's spatial size), + numel(out) with a bias. Its
  backward: the same matmul flops for each of the input's and the weight's gradients that
  ``output_mask`` asks for, + numel(grad_out) for the bias's.
- scaled dot-product attention (every kernel; H the query's heads): forward
  2*B*H*Sq*Sk*(D + Dv) (= 4BHSqSkD: the full score matrix even when causal, as the kernels
  compute masked blocks too) + 5 per score for the softmax. Backward: the kernels recompute
  the scores, then four gradient matmuls, 2*B*H*Sq*Sk*(3D + 2Dv) (2.5x the forward's
  matmuls, as ``torch.utils.flop_counter`` counts), + 4 per score for the softmax's backward.
- normalization (layer, batch, group norm), per element of the input: forward 6, + 1 each
  for weight and bias; backward 11 for the input's gradient, 2 for the weight's, 1 for the
  bias's (14 when all three are asked for).
- per element of the result: gelu 8 (backward 10), silu 4 (backward 8), tanh_backward 3,
  softmax 5 (backward 4), log_softmax 4 (backward 3), mse_loss 3 (backward 3),
  threshold_backward, masked_fill, tril/triu, pow, mul/div by a number, sin/cos 1, clamp 1
  per bound (clamp_min, clamp_max 1), a random draw (bernoulli, normal, rand) 1,
  native_dropout 3 (backward 2).
- nll_loss forward and backward: 1 per row (target element); argmax 1 per input element;
  max pooling 1 per window element of each result (backward: 1 per grad_out element);
  ``_foreach_norm`` 2 per element; embedding 0; embedding_dense_backward 1 per grad_out
  element (its adds).
- reductions over named dims and scans, per element of the input: var, std (and with their
  mean), logsumexp 3; norms 2; max, min, median, kthvalue, mode, any, all, prod, nansum,
  sort, topk, cumulative sums, products, maxima and logsumexp 1 (a sort counted as one
  pass). cdist and pdist 3 per result element per feature; xlogy 2, other elementwise
  ops kept opaque (add/sub of a number, isnan, rounding, sign) 1 per element.
- 0 flops: views (slice, select, squeeze, unsqueeze, split, unbind, unfold), copies (clone,
  copy, _to_copy), cat, stack, padding, roll, flip, gather, indexing, the scatters and
  slice/select backward, creation (arange, zeros, ones, empty, full, *_like, new_*,
  scalar_tensor).

Bytes: every operand and result read or written once, except views (0: the result aliases
its operand), creation ops (only what they write; ``empty*`` nothing), embedding (the indices,
the rows looked up and the result, not the whole table), gather, nll_loss and max-pool
backward (the operands they read only the shape of are not counted).

Strategies (``ir/strategies.py``) list every split over one mesh axis that is exact: running
the same call on each device's pieces and combining the pieces as the result placements say
gives the whole call's result. They name dims whatever their size (``fits_axis`` leaves out
those an axis cannot divide). A random op (dropout, bernoulli, attention with dropout) runs
whole only: split, it would draw other numbers. Where a call's arguments name a whole shape
(``input_sizes`` of slice/select backward, ``N``/``C``/``group`` of group norm, an embedding
gradient's ``num_weights``), a device passes its local value: ``local_arguments`` says which.
A ``masked`` strategy is the vocab-parallel embedding: the table is split by rows; device k
holds rows [o, o + V/n), subtracts o from the indices, looks up (or, backward, accumulates)
only the in-range ones and zeroes the rest (forward: result rows of out-of-range indices;
backward: their grad_out rows, with ``padding_idx`` shifted by o, or -1 when not its own)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any
from dataclasses import dataclass

from ..ir.core import Attrs, Op, Value
from ..ir.strategies import GROUPS
from ..ir.types import Partial, Placement, Shard, TensorType
from .rule_call import (_Call, _P, _R, _T, _along, _arguments, _dim, _nbytes, _numel,
                        _register)


# ------------------------------------------------------------------ costs, by kind

def _zero(c: _Call) -> int:
    return 0


def _per_out(k: float) -> Callable[[_Call], float]:
    return lambda c: k * _numel(c.outs[0]) if c.outs else 0


def _per_in(k: float) -> Callable[[_Call], float]:
    return lambda c: k * _numel(c.ins[0]) if c.ins else 0


def _written(c: _Call) -> int:
    return sum(t.nbytes for t in c.outs)


def _views(c: _Call) -> int:
    return 0


# ------------------------------------------------------------------ elementwise and layout

def _elementwise(linear: tuple[str, ...] = ()) -> Callable[[_Call], list]:
    def fn(c: _Call) -> list:
        """Split any result dim (operands broadcast along it stay whole); partial sums pass
        through the operands the op is linear in."""
        out = c.outs[0]
        names = [n for n, v in c.args.items() if isinstance(v, _T)]
        menu = [c.strategy({n: _along(c.t(n), out, d) for n in names}, Shard(d), "split")
                for d in range(out.rank)]
        menu += [c.strategy({n: _P}, _P, "partial") for n in linear if c.t(n) is not None]
        return menu
    return fn


def _keeps(c: _Call, untouched: Callable[[int], int | None], src: str = "self",
           linear: bool = True) -> list:
    """A layout op splits its operand's dims that it leaves alone: ``untouched(d)`` is the
    result dim of operand dim d, or None; partial sums pass through when ``linear``."""
    x = c.t(src)
    menu = []
    for d in range(x.rank):
        od = untouched(d)
        if od is not None:
            menu.append(c.strategy({src: Shard(d)}, Shard(od), "split"))
    if linear:
        menu.append(c.strategy({src: _P}, _P, "partial"))
    return menu


def _slice(c: _Call) -> list:
    """Dims other than the sliced one split."""
    dim = _dim(c["dim"], c.t("self").rank)
    return _keeps(c, lambda d: None if d == dim else d)


def _slice_rows(c: _Call) -> list[range] | None:
    """The rows of dim 0 a slice takes (None: it cuts another dim)."""
    x = c.t("self")
    if x.rank == 0 or _dim(c["dim"], x.rank) != 0:
        return None
    n = x.shape[0]
    start, end = c["start"], c["end"]
    start = 0 if start is None else (start + n if start < 0 else start)
    end = n if end is None else (end + n if end < 0 else end)
    return [range(max(0, min(start, n)), max(0, min(end, n)), c["step"] or 1)]


def _split_rows(c: _Call) -> list[range] | None:
    """The rows of dim 0 each kept piece of a split holds (None: it cuts another dim)."""
    x = c.t("self")
    if x.rank == 0 or _dim(c["dim"], x.rank) != 0:
        return None
    size, n = int(c["split_size"]), x.shape[0]
    return [range(p * size, min((p + 1) * size, n)) for p in c.positions]


def _select(c: _Call) -> list:
    """Dims other than the selected one split (those after it shift down)."""
    dim = _dim(c["dim"], c.t("self").rank)
    return _keeps(c, lambda d: None if d == dim else d - (d > dim))


def _squeeze(c: _Call) -> list:
    """Dims other than the squeezed one split."""
    x = c.t("self")
    dim = _dim(c["dim"], x.rank)
    gone = x.rank > 0 and x.shape[dim] == 1
    return _keeps(c, lambda d: d if not gone or d < dim else (None if d == dim else d - 1))


def _unsqueeze(c: _Call) -> list:
    """Every dim splits (those from the new one on shift up)."""
    dim = _dim(c["dim"], c.t("self").rank + 1)
    return _keeps(c, lambda d: d + (d >= dim))


def _listed(c: _Call, name: str, shift_from: int | None) -> list:
    """cat/stack: every operand split alike on a dim other than ``dim``."""
    tensors = [c.ins[t.index] for t in c[name] if isinstance(t, _T)]
    if not tensors:
        return []
    out = c.outs[0]
    dim = _dim(c["dim"], out.rank)
    menu = []
    # cat skips empty 1-d operands whatever the others' rank (an empty cache in a key/value
    # concatenation): they stay whole in every split
    rank = out.rank - (shift_from is not None)
    skipped = [shift_from is None and t.rank == 1 and t.numel == 0 and rank != 1
               for t in tensors]
    for d in range(out.rank):
        src = d if shift_from is None or d < shift_from else d - 1
        if d == dim:
            continue
        if any(not skip and (t.rank != rank or t.shape[src] != out.shape[d])
               for t, skip in zip(tensors, skipped)):
            continue
        menu.append(c.strategy({name: [_R if skip else Shard(src) for skip in skipped]},
                               Shard(d), "split"))
    menu.append(c.strategy({name: _P}, _P, "partial"))
    return menu


def _cat(c: _Call) -> list:
    """Dims other than the concatenated one split; k operands of one shape split along
    the concatenated dim make a split of k groups (a fused projection's gradient, its
    query, key and value parts concatenated)."""
    menu = _listed(c, "tensors", None)
    tensors = [c.ins[t.index] for t in c["tensors"] if isinstance(t, _T)]
    if len(tensors) > 1 and len(tensors) == len(c["tensors"]) \
            and len({t.shape for t in tensors}) == 1:
        dim = _dim(c["dim"], c.outs[0].rank)
        menu.append(c.strategy({"tensors": Shard(dim)}, Shard(dim, len(tensors)), GROUPS))
    return menu


def _stack(c: _Call) -> list:
    """Every operand dim splits (the result's dims from the new one on shift up)."""
    dim = _dim(c["dim"], c.outs[0].rank)
    return _listed(c, "tensors", dim)


def _pieces(c: _Call) -> list:
    """split/unbind: dims other than the one cut split every piece."""
    x = c.t("self")
    dim = _dim(c["dim"], x.rank)
    drop = "split_size" not in c.args       # unbind drops the dim
    menu = _keeps(c, lambda d: None if d == dim else d - (drop and d > dim))
    if not drop and len(c.outs) > 1 and len({t.shape for t in c.outs}) == 1 \
            and len(c.outs) * c.outs[0].shape[dim] == x.shape[dim]:
        # k equal pieces of a split of k groups: each piece split plainly (the local call
        # cuts pieces of size/n: ``local_arguments``)
        menu.append(c.strategy({"self": Shard(dim, len(c.outs))}, Shard(dim), GROUPS))
    return menu


def _pad(c: _Call) -> list:
    """Dims that get no padding split; partial sums stay partial with zero padding."""
    x = c.t("self")
    pad = tuple(c["pad"])
    padded = {x.rank - 1 - i // 2 for i, p in enumerate(pad) if p}
    return _keeps(c, lambda d: None if d in padded else d, linear=c["value"] in (0, None))


def _triangle(c: _Call) -> list:
    """tril/triu: leading (batch) dims split; the last two index the triangle."""
    x = c.t("self")
    return _keeps(c, lambda d: d if d < x.rank - 2 else None)


def _slice_backward(c: _Call) -> list:
    """Dims other than the sliced one split (with the local ``input_sizes``)."""
    g = c.t("grad_output")
    dim = _dim(c["dim"], g.rank)
    return _keeps(c, lambda d: None if d == dim else d, src="grad_output")


def _select_backward(c: _Call) -> list:
    """Dims of grad_output split the result's dims they stand for (the local
    ``input_sizes``)."""
    g = c.t("grad_output")
    dim = _dim(c["dim"], g.rank + 1)
    return _keeps(c, lambda d: d + (d >= dim), src="grad_output")


def _slice_scatter(c: _Call) -> list:
    """Dims other than the scattered one split self and src alike."""
    x = c.t("self")
    dim = _dim(c["dim"], x.rank)
    menu = [c.strategy({"self": Shard(d), "src": Shard(d)}, Shard(d), "split")
            for d in range(x.rank) if d != dim]
    return menu + [c.strategy({"self": _P, "src": _P}, _P, "partial")]


def _select_scatter(c: _Call) -> list:
    """Dims other than the selected one split self and the matching dim of src."""
    x = c.t("self")
    dim = _dim(c["dim"], x.rank)
    menu = [c.strategy({"self": Shard(d), "src": Shard(d - (d > dim))}, Shard(d), "split")
            for d in range(x.rank) if d != dim]
    return menu + [c.strategy({"self": _P, "src": _P}, _P, "partial")]


def _gather(c: _Call) -> list:
    """A dim other than ``dim`` where index and self have one size splits both; the index
    split along ``dim`` looks up its own entries of a whole ``self`` (a class weight per
    target: ``weight.gather(0, target)``)."""
    x, idx = c.t("self"), c.t("index")
    dim = _dim(c["dim"], x.rank)
    return [c.strategy({"self": Shard(d), "index": Shard(d)}, Shard(d), "split")
            for d in range(idx.rank) if d != dim and x.shape[d] == idx.shape[d]] + \
        [c.strategy({"index": Shard(dim)}, Shard(dim), "lookup")]


def _like(zero: bool) -> Callable[[_Call], list]:
    def fn(c: _Call) -> list:
        """A tensor shaped like the operand: split where the operand is; zeros are also a
        partial sum."""
        x = c.t("self")
        menu = [c.strategy({"self": Shard(d)}, Shard(d), "split")
                for d in range(x.rank)]
        if zero:
            menu.append(c.strategy({"self": _P}, _P, "partial"))
        return menu
    return fn


def _argmax(c: _Call) -> list:
    """Dims other than the reduced one split."""
    x = c.t("self")
    if c["dim"] is None:
        return []
    dim = _dim(c["dim"], x.rank)
    keep = c["keepdim"]
    return _keeps(c, lambda d: None if d == dim else d - (not keep and d > dim), linear=False)


def _masked_fill(c: _Call) -> list:
    """Split like an elementwise op; a partial sum stays partial when the fill is 0."""
    menu = _elementwise()(c)
    if c["value"] == 0:
        menu.append(c.strategy({"self": _P}, _P, "partial"))
    return menu


# ------------------------------------------------------------------ reductions and scans

def _dims_named(c: _Call, name: str = "dim") -> set[int]:
    """The operand dims an argument names (None or empty: every dim)."""
    rank = c.t("self").rank
    dims = c.args.get(name)       # prod.default names none
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        return set(range(rank))
    dims = dims if isinstance(dims, (list, tuple)) else (dims,)
    return {_dim(d, rank) for d in dims}


def _reduce(sums: bool = False) -> Callable[[_Call], list]:
    def fn(c: _Call) -> list:
        """Dims not reduced split, every result alike (values and indices, a variance and
        its mean); a sum (nansum) also makes a split of a reduced dim a partial sum (not
        linear in partial sums: NaN in one piece is not NaN in their sum)."""
        gone = _dims_named(c)
        keep = bool(c.args.get("keepdim"))
        menu = _keeps(c, lambda d: None if d in gone else
                      (d if keep else d - sum(g < d for g in gone)), linear=False)
        if sums:
            menu += [c.strategy({"self": Shard(d)}, _P, "contract") for d in sorted(gone)]
        return menu
    return fn


def _extreme(kind: str) -> Callable[[_Call], list]:
    def fn(c: _Call) -> list:
        """A maximum or minimum of every element: any split dim leaves partial maxima
        (minima) the devices' values combine by."""
        return [c.strategy({"self": Shard(d)}, Partial(kind), "reduce")
                for d in range(c.t("self").rank)]
    return fn


def _along_dims(name: str, linear: bool = False) -> Callable[[_Call], list]:
    def fn(c: _Call) -> list:
        """Dims other than those the op runs along (sorts, scans, rolls, flips) split;
        a roll with no dims runs along the flattened tensor: nothing splits."""
        if name == "dims" and not c[name]:
            return []
        along = _dims_named(c, name)
        return _keeps(c, lambda d: None if d in along else d, linear=linear)
    return fn


def _cdist(c: _Call) -> list:
    """Leading (batch) dims split both operands; x1's rows split the result's rows and
    x2's its columns (the other operand whole)."""
    x1, x2 = c.t("x1"), c.t("x2")
    r = c.outs[0].rank
    menu = [c.strategy({"x1": Shard(d), "x2": Shard(d)}, Shard(d), "split")
            for d in range(r - 2) if x1.rank == x2.rank == r]
    menu.append(c.strategy({"x1": Shard(x1.rank - 2)}, Shard(r - 2), "rows"))
    menu.append(c.strategy({"x2": Shard(x2.rank - 2)}, Shard(r - 1), "columns"))
    return menu


def _counts(c: _Call) -> int | None:
    """``arange(n)``, ``arange(0, n)`` or ``arange(-n, 0)``: each element its own position
    along dim 0 (negative positions index the same rows)."""
    n = c.outs[0].shape[0] if c.outs and c.outs[0].rank == 1 else None
    start, end = c.args.get("start", 0), c["end"]
    step = c.args.get("step", 1)
    if n is None or step not in (1, None) or not isinstance(start, int) or \
            not isinstance(end, int):
        return None
    return 0 if (start, end) in ((0, n), (-n, 0)) else None


def _index_tensors(c: _Call) -> tuple[list[tuple[int, _T]], int, tuple[int, ...]] | None:
    """The index tensors of ``x[...]`` with their operand dims, the result's first dim
    holding their (broadcast) dims, and that broadcast shape; None unless they are integer
    tensors on adjacent dims whose shapes broadcast together (HF's padding mask is read as
    ``mask[arange(B)[:, None], arange(S)[None, :]]``)."""
    given = [(k, v) for k, v in enumerate(c["indices"]) if v is not None]
    if not given or any(not isinstance(v, _T) or not c.ins[v.index].dtype.is_int
                        for _, v in given):
        return None
    ks = [k for k, _ in given]
    if ks != list(range(ks[0], ks[0] + len(ks))):
        return None
    shapes = [c.ins[v.index].shape for _, v in given]
    rank = max(len(sh) for sh in shapes)
    padded = [(1,) * (rank - len(sh)) + tuple(sh) for sh in shapes]
    shape = []
    for sizes in zip(*padded):
        big = {n for n in sizes if n != 1}
        if len(big) > 1:
            return None
        shape.append(big.pop() if big else 1)
    return given, ks[0], tuple(shape)


def _index_picks(c: _Call) -> tuple[dict[int, tuple[int, None]], int | None]:
    """Each indexed operand dim with the input position of the tensor indexing it (each
    element an index), and the result's dim holding the indices' first dim (where an
    index tensor has the broadcast rank)."""
    found = _index_tensors(c)
    if found is None:
        return {}, None
    given, first, shape = found
    return {k: (v.index, None) for k, v in given
            if c.ins[v.index].rank == len(shape)}, first


def _index(c: _Call) -> list | None:
    """``x[i]``, ``x[:, i]``, ``x[i, j]`` with integer index tensors broadcasting together
    on adjacent dims: the indices' broadcast dims split the result's dims they become,
    each index tensor split where it has that dim's size and whole where it broadcasts (x
    whole); x's dims that are not indexed split where they land (the indices whole). Rows
    of x split while an index picks among them is not a split: each device's rows sit at
    other positions (``batch_coupling`` accepts a pick of each row's own position). Other
    forms (a boolean mask, indices on dims apart): no opinion (None: not judged)."""
    x = c.t("self")
    found = _index_tensors(c)
    if found is None:
        return None
    given, first, shape = found
    n, ir = len(given), len(shape)
    indexed = {v.index: c.ins[v.index] for _, v in given}

    def along(j: int) -> list:
        out = []
        for v in c["indices"]:
            if not isinstance(v, _T):
                out.append(_R)
                continue
            t = indexed[v.index]
            a = j - (ir - t.rank)
            out.append(Shard(a) if a >= 0 and t.shape[a] == shape[j] else _R)
        return out
    menu = [c.strategy({"indices": along(j)}, Shard(first + j), "index")
            for j in range(ir) if shape[j] > 1]
    for d in range(x.rank):
        if d < first:
            menu.append(c.strategy({"self": Shard(d)}, Shard(d), "split"))
        elif d >= first + n:
            menu.append(c.strategy({"self": Shard(d)}, Shard(d - n + ir), "split"))
    return menu


# ------------------------------------------------------------------ softmax and losses

def _softmax(c: _Call) -> list:
    """Dims other than the softmax's split."""
    x = c.t("self")
    dim = _dim(c["dim"], x.rank)
    return _keeps(c, lambda d: None if d == dim else d, linear=False)


def _softmax_backward(c: _Call) -> list:
    """Dims other than the softmax's split both operands; linear in grad_output."""
    g = c.t("grad_output")
    dim = _dim(c["dim"], g.rank)
    menu = [c.strategy({"grad_output": Shard(d), "output": Shard(d)}, Shard(d), "split")
            for d in range(g.rank) if d != dim]
    return menu + [c.strategy({"grad_output": _P}, _P, "partial")]


_NONE, _MEAN, _SUM = 0, 1, 2     # aten's reduction codes


def _nll_forward(c: _Call) -> list:
    """Rows split: per row (reduction none), or into partial sums of the loss and of the
    total weight (sum). A mean over rows of split data is a ratio of two partial sums: not
    exact, so it runs whole."""
    x = c.t("self")
    if x.rank < 2:
        return []
    split = {"self": Shard(0), "target": Shard(0)}
    if c["reduction"] == _NONE:
        return [c.strategy(split, (Shard(0), _R), "batch")]
    if c["reduction"] == _SUM:
        return [c.strategy(split, (_P, _P), "batch")]
    return []


def _nll_summed(op: Op, ins: Sequence[TensorType], outs: Sequence[TensorType]
                ) -> tuple[Op, int, int] | None:
    """A mean reduction as the same call with reduction ``sum``, its loss at result 0 and
    its total weight (the count of targets not ignored, weighted) at result 1; None where
    the call drops either."""
    c = _Call(op, ins, outs)
    if c["reduction"] != _MEAN or 0 not in c.positions or 1 not in c.positions:
        return None
    args = list(op.attrs.get("args", ()))
    if len(args) > 3:
        args[3] = _SUM
        attrs = op.attrs.set(args=tuple(args))
    else:
        attrs = op.attrs.set(kw_reduction=_SUM)
    return op.replace(attrs=attrs), c.positions.index(0), c.positions.index(1)


def _nll_count(op: Op, ins: Sequence[TensorType], outs: Sequence[TensorType], names
               ) -> tuple[list[Op], str] | None:
    """A mean reduction's total weight from its targets alone, as IR ops: the targets not
    equal to ignore_index, counted. None where the call drops it, or weights its classes
    (``weight[target]`` would need an indexing op the torch backend does not lower: the
    pipeline then counts with a copy of the call on zeros in place of the logits)."""
    c = _Call(op, ins, outs)
    if c["reduction"] != _MEAN or 1 not in c.positions or c.t("weight") is not None:
        return None
    target = op.inputs[c.args["target"].index]
    tt, tw = c.t("target"), c.out(1)
    ops: list[Op] = []

    def make(name: str, inputs: tuple[str, ...], t: TensorType, attrs: dict, hint: str) -> str:
        out = names(hint)
        ops.append(Op(name, inputs, (Value(out, t),), Attrs(attrs), loc=op.loc))
        return out
    ignored = make("full", (), TensorType((), tt.dtype), {"value": int(c["ignore_index"])},
                   f"{target}.ignored")
    kept = make("ne", (target, ignored), TensorType(tt.shape, "bool", tt.placements), {},
                f"{target}.kept")
    each = make("convert", (kept,), TensorType(tt.shape, tw.dtype, tt.placements),
                {"dtype": str(tw.dtype)}, f"{target}.counts")
    count = make("reduce_sum", (each,), tw, {"dims": list(range(tt.rank))},
                 f"{target}.total_weight")
    return ops, count


def _nll_backward(c: _Call) -> list:
    """Rows split under any reduction (the total weight is an input, whole); linear in
    grad_output."""
    x = c.t("self")
    menu = [c.strategy({"grad_output": _P}, _P, "partial")]
    if x.rank >= 2:
        g = Shard(0) if c["reduction"] == _NONE else _R
        menu.append(c.strategy({"grad_output": g, "self": Shard(0), "target": Shard(0)},
                               Shard(0), "batch"))
    return menu


def _pointwise_loss(c: _Call) -> list:
    """A loss of each element then reduced (mse, smooth L1, Huber, soft margin, binary
    cross-entropy with or without logits): any dim splits, its other tensors (target,
    weight, pos_weight) broadcast along it: per element (none), into partial sums (sum),
    or into partial means (mean: a plain mean of the elements, weighted or not, and the
    pieces have one size)."""
    x = c.t("self")
    res = {_NONE: None, _SUM: _P, _MEAN: Partial("avg")}[c["reduction"]]
    others = [n for n, v in c.args.items() if isinstance(v, _T) and n != "self"]
    return [c.strategy({"self": _along(x, x, d), **{n: _along(c.t(n), x, d) for n in others}},
                       Shard(d) if res is None else res, "split")
            for d in range(x.rank)]


def _pointwise_loss_backward(c: _Call) -> list:
    """Any dim splits under none and sum (a mean's backward divides by the local count);
    linear in grad_output."""
    x = c.t("self")
    menu = [c.strategy({"grad_output": _P}, _P, "partial")]
    if c["reduction"] != _MEAN:
        others = [n for n, v in c.args.items() if isinstance(v, _T) and n != "self"]
        menu += [c.strategy({"self": Shard(d), **{n: _along(c.t(n), x, d) for n in others}},
                            Shard(d), "split")
                 for d in range(x.rank)]
    return menu


def _multi_margin(c: _Call) -> list:
    """Rows (dim 0 of a [N, C] input, with their targets) split: per row (none), into
    partial sums (sum) or partial means of equal pieces (mean)."""
    if c.t("self").rank != 2:
        return []
    res = {_NONE: Shard(0), _SUM: _P, _MEAN: Partial("avg")}[c["reduction"]]
    return [c.strategy({"self": Shard(0), "target": Shard(0)}, res, "batch")]


def _multi_margin_backward(c: _Call) -> list:
    """Rows split under none and sum (a mean's backward divides by the local rows);
    linear in grad_output."""
    menu = [c.strategy({"grad_output": _P}, _P, "partial")]
    if c.t("self").rank == 2 and c["reduction"] != _MEAN:
        g = Shard(0) if c["reduction"] == _NONE else _R
        menu.append(c.strategy({"grad_output": g, "self": Shard(0), "target": Shard(0)},
                               Shard(0), "batch"))
    return menu


# ------------------------------------------------------------------ matmul, conv, lookup

def _addmm(c: _Call) -> list:
    """Rows of x split the result's rows; columns of w split its columns; a split
    contraction gives partial sums, with the bias given as a partial sum too (added once);
    partial sums of x or w with a partial bias stay partial."""
    out = c.outs[0]
    b = c.t("self")
    return [
        c.strategy({"self": _along(b, out, 0), "mat1": Shard(0)}, Shard(0), "batch"),
        c.strategy({"self": _along(b, out, 1), "mat2": Shard(1)}, Shard(1), "column"),
        c.strategy({"self": _P, "mat1": Shard(1), "mat2": Shard(0)}, _P, "contract"),
        c.strategy({"self": _P, "mat1": _P}, _P, "partial"),
        c.strategy({"self": _P, "mat2": _P}, _P, "partial"),
    ]


def _addmm_flops(c: _Call) -> int:
    (m, k), n = c.t("mat1").shape, c.t("mat2").shape[1]
    return 2 * m * k * n + m * n


def _conv_matmul(x: TensorType, w: TensorType, out: TensorType, transposed: bool) -> int:
    """2 * N * (spatial size) * numel(weight): the output's spatial size, or the input's for
    a transposed convolution."""
    spatial = math.prod((x if transposed else out).shape[2:])
    return 2 * x.shape[0] * spatial * w.numel


def _conv_flops(c: _Call) -> int:
    out = c.outs[0]
    f = _conv_matmul(c.t("input"), c.t("weight"), out, bool(c["transposed"]))
    return f + (out.numel if c.t("bias") is not None else 0)


def _conv_backward_flops(c: _Call) -> int:
    g, x, w = c.t("grad_output"), c.t("input"), c.t("weight")
    mask = tuple(c["output_mask"])
    mm = _conv_matmul(x, w, g, bool(c["transposed"]))
    return mm * bool(mask[0]) + mm * bool(mask[1]) + g.numel * bool(mask[2])


def _conv_dims(c: _Call) -> tuple[int, int]:
    """The weight's dims of the output and of the input channels."""
    return (1, 0) if c["transposed"] else (0, 1)


def _convolution(c: _Call) -> list:
    """Batch split; with one group, output channels split the weight (and bias), input
    channels split input and weight into partial sums (the bias a partial sum too);
    linear in the input and in the weight with a partial bias."""
    wo, wi = _conv_dims(c)
    menu = [c.strategy({"input": Shard(0)}, Shard(0), "batch")]
    if c["groups"] == 1:
        menu += [c.strategy({"weight": Shard(wo), "bias": Shard(0)}, Shard(1), "out-channels"),
                 c.strategy({"input": Shard(1), "weight": Shard(wi), "bias": _P}, _P,
                            "in-channels")]
    return menu + [c.strategy({"input": _P, "bias": _P}, _P, "partial"),
                   c.strategy({"weight": _P, "bias": _P}, _P, "partial")]


def _convolution_backward(c: _Call) -> list:
    """Batch split: the weight's and bias's gradients become partial sums; with one group,
    output channels split grad_out and the weight (the input's gradient partial), input
    channels split input and weight (the bias's gradient whole); linear in grad_out."""
    wo, wi = _conv_dims(c)
    menu = [c.strategy({"grad_output": Shard(0), "input": Shard(0)}, (Shard(0), _P, _P), "batch")]
    if c["groups"] == 1:
        menu += [c.strategy({"grad_output": Shard(1), "weight": Shard(wo)},
                            (_P, Shard(wo), Shard(0)), "out-channels"),
                 c.strategy({"input": Shard(1), "weight": Shard(wi)},
                            (Shard(1), Shard(wi), _R), "in-channels")]
    return menu + [c.strategy({"grad_output": _P}, _P, "partial")]


def _embedding(c: _Call) -> list:
    """Split indices split the result; a split hidden dim carries over; the vocab split is
    masked (each device looks up its own rows; partial sums)."""
    idx = c.t("indices")
    menu = [c.strategy({"indices": Shard(i)}, Shard(i), "batch")
            for i in range(idx.rank)]
    menu.append(c.strategy({"weight": Shard(1)}, Shard(idx.rank), "column"))
    menu.append(c.strategy({"weight": Shard(0)}, _P, "vocab", masked=True))
    return menu


def _embedding_bytes(c: _Call) -> int:
    return _nbytes(c.t("indices")) + 2 * c.outs[0].nbytes


def _embedding_backward(c: _Call) -> list:
    """Split indices with their grad_out rows give partial sums, the hidden dim splits, the
    vocab split is masked; linear in grad_output. Counting index frequencies needs every
    index, so with ``scale_grad_by_freq`` the indices stay whole."""
    g, idx = c.t("grad_output"), c.t("indices")
    menu = [c.strategy({"grad_output": _P}, _P, "partial"),
            c.strategy({"grad_output": Shard(g.rank - 1)}, Shard(1), "column")]
    if not c["scale_grad_by_freq"]:
        menu += [c.strategy({"grad_output": Shard(i), "indices": Shard(i)}, _P, "batch")
                 for i in range(idx.rank)]
        menu.append(c.strategy({}, Shard(0), "vocab", masked=True))
    return menu


# ------------------------------------------------------------------ normalization

def _layer_norm(c: _Call) -> list:
    """Dims before the normalized ones split the input, the result, mean and rstd."""
    x = c.t("input")
    axis = x.rank - len(c["normalized_shape"])
    return [c.strategy({"input": Shard(d)}, Shard(d), "batch")
            for d in range(axis)]


def _layer_norm_backward(c: _Call) -> list:
    """Dims before the normalized ones split; the weight's and bias's gradients become
    partial sums; linear in grad_out."""
    x = c.t("input")
    axis = x.rank - len(c["normalized_shape"])
    menu = [c.strategy({"grad_out": Shard(d), "input": Shard(d), "mean": Shard(d),
                        "rstd": Shard(d)}, (Shard(d), _P, _P), "batch")
            for d in range(axis)]
    return menu + [c.strategy({"grad_out": _P}, _P, "partial")]


def _norm_flops(c: _Call) -> int:
    return (6 + (c.t("weight") is not None) + (c.t("bias") is not None)) * c.t("input").numel


def _norm_backward_flops(c: _Call) -> int:
    mask = tuple(c["output_mask"])
    return (11 * bool(mask[0]) + 2 * bool(mask[1]) + bool(mask[2])) * c.t("input").numel


def _per_channel(c: _Call, t: TensorType | None, channels: int) -> Placement:
    """Split a per-channel statistic with the channels; whole when it is not one (empty in
    eval mode)."""
    return Shard(0) if t is not None and t.rank == 1 and t.shape[0] == channels else _R


def _batch_norm(c: _Call) -> list:
    """Channels split everything per channel; in eval mode the batch splits too (the
    running statistics are used whole)."""
    x = c.t("input")
    if x.rank < 2:
        return []
    ch = x.shape[1]
    stats = [_per_channel(c, c.out(i), ch) for i in range(1, 5)]
    menu = [c.strategy({"input": Shard(1), "weight": Shard(0), "bias": Shard(0),
                        "running_mean": Shard(0), "running_var": Shard(0)},
                       (Shard(1), *stats), "channels")]
    if not c.args.get("training", False):
        menu.append(c.strategy({"input": Shard(0)}, (Shard(0), _R, _R, _R, _R), "batch"))
    return menu


def _batch_norm_channels(c: _Call) -> list:
    """A batch norm with no running statistics (``F.instance_norm`` runs one over the
    examples' channels laid side by side): channels split everything per channel."""
    return _batch_norm(c)[:1]


def _batch_norm_backward(c: _Call) -> list:
    """Channels split; in eval mode the batch splits too (weight and bias gradients become
    partial sums); linear in grad_out."""
    x = c.t("input")
    if x.rank < 2:
        return []
    ch = x.shape[1]
    per = {n: _per_channel(c, c.t(n), ch) for n in
           ("weight", "running_mean", "running_var", "save_mean", "save_invstd")}
    menu = [c.strategy({"grad_out": Shard(1), "input": Shard(1), **per},
                       (Shard(1), Shard(0), Shard(0)), "channels"),
            c.strategy({"grad_out": _P}, _P, "partial")]
    if not c["train"]:
        menu.append(c.strategy({"grad_out": Shard(0), "input": Shard(0)}, (Shard(0), _P, _P),
                               "batch"))
    return menu


def _group_norm(c: _Call) -> list:
    """The batch splits everything per sample; channels split whole groups (the local
    ``N``, ``C`` and ``group``)."""
    x = c.t("input")
    menu = [c.strategy({"input": Shard(0)}, Shard(0), "batch")]
    if x.rank >= 2:
        menu.append(c.strategy({"input": Shard(1), "weight": Shard(0), "bias": Shard(0)},
                               Shard(1), "channels"))
    return menu


def _group_norm_backward(c: _Call) -> list:
    """As the forward: the batch (weight and bias gradients partial) or whole groups of
    channels; linear in grad_out."""
    x = c.t("input")
    per_sample = {"grad_out": Shard(0), "input": Shard(0), "mean": Shard(0), "rstd": Shard(0)}
    channels = {"grad_out": Shard(1), "input": Shard(1), "mean": Shard(1), "rstd": Shard(1),
                "weight": Shard(0)}
    menu = [c.strategy({"grad_out": _P}, _P, "partial")]
    menu.append(c.strategy(per_sample, (Shard(0), _P, _P), "batch"))
    if x.rank >= 2:
        menu.append(c.strategy(channels, (Shard(1), Shard(0), Shard(0)), "channels"))
    return menu


def _max_pool(c: _Call) -> list:
    """Batch and channel dims split the values and their indices (indices count within
    each plane)."""
    x = c.t("self")
    return [c.strategy({"self": Shard(d)}, Shard(d), "split")
            for d in range(x.rank - 2)]


def _max_pool_backward(c: _Call) -> list:
    """Batch and channel dims split; linear in grad_output."""
    x = c.t("self")
    menu = [c.strategy({"grad_output": Shard(d), "self": Shard(d), "indices": Shard(d)},
                       Shard(d), "split") for d in range(x.rank - 2)]
    return menu + [c.strategy({"grad_output": _P}, _P, "partial")]


def _max_pool_flops(c: _Call) -> int:
    return c.outs[0].numel * math.prod(c["kernel_size"])


# ------------------------------------------------------------------ attention

@dataclass(frozen=True)
class _Attention:
    """Where one SDPA kernel's operands and results are: argument names, and result
    positions by kind (out, lse, grads, the bias's gradient; the rest are whole: seeds,
    offsets, sequence lengths, the debug mask when empty)."""

    bias: str | None              # the mask/bias argument
    out: int | None = None        # forward: result positions of out and logsumexp
    lse: int | None = None
    debug: int | None = None
    backward: bool = False        # results: dq, dk, dv (, dbias at 3)
    query_split: bool = False     # the query sequence may split (lse is [B, H, Sq])


def _attention(spec: _Attention) -> Callable[[_Call], list]:
    def fn(c: _Call) -> list:
        """Batch and heads split q, k, v alike (also under grouped-query attention); the
        query sequence splits when not causal (k, v whole; backward: their gradients
        partial); the backward is linear in grad_out. With dropout it runs whole."""
        q = c.t("query")
        if c["dropout_p"]:
            return []
        scores = TensorType(q.shape[:-1] + (c.t("key").shape[-2],), q.dtype)
        bias = c.t(spec.bias) if spec.bias else None
        dims = [0, 1] + ([2] if spec.query_split and not c["is_causal"] else [])
        menu = []
        for d in dims:
            kv = Shard(d) if d < 2 else _R
            places = {"query": Shard(d), "key": kv, "value": kv, "out": Shard(d),
                      "grad_out": Shard(d), "grad_out_": Shard(d), "logsumexp": Shard(d)}
            if spec.bias:
                places[spec.bias] = _along(bias, scores, d)
            if spec.backward:
                db = places[spec.bias] if spec.bias and places[spec.bias] != _R else _P
                res = [Shard(d), kv if d < 2 else _P, kv if d < 2 else _P, db]
            else:
                res = [_R] * 9
                res[spec.out] = res[spec.lse] = Shard(d)
                dbg = c.out(spec.debug) if spec.debug is not None else None
                if dbg is not None and dbg.rank == 4 and dbg.shape[d] == q.shape[d]:
                    res[spec.debug] = Shard(d)
            name = ("batch", "heads", "query")[d]
            menu.append(c.strategy(places, res, name))
        if spec.backward:
            menu.append(c.strategy({"grad_out": _P, "grad_out_": _P}, _P, "partial"))
        return menu
    return fn


def _attention_flops(backward: bool) -> Callable[[_Call], int]:
    def fn(c: _Call) -> int:
        q, k, v = c.t("query"), c.t("key"), c.t("value")
        scores = math.prod(q.shape[:-1]) * k.shape[-2]
        d, dv = q.shape[-1], v.shape[-1]
        if backward:    # scores recomputed; grads of the scores, v, q and k
            return 2 * scores * (3 * d + 2 * dv) + 4 * scores
        return 2 * scores * (d + dv) + 5 * scores
    return fn


_SDPA = {
    "_scaled_dot_product_flash_attention_for_cpu.default":
        _Attention("attn_mask", out=0, lse=1, query_split=True),
    "_scaled_dot_product_flash_attention_for_cpu_backward.default":
        _Attention("attn_mask", backward=True, query_split=True),
    "_scaled_dot_product_flash_attention.default": _Attention(None, out=0, lse=1, debug=8),
    "_scaled_dot_product_flash_attention_backward.default": _Attention(None, backward=True),
    "_scaled_dot_product_efficient_attention.default": _Attention("attn_bias", out=0, lse=1),
    "_scaled_dot_product_efficient_attention_backward.default":
        _Attention("attn_bias", backward=True),
    "_scaled_dot_product_cudnn_attention.default":
        _Attention("attn_bias", out=0, lse=1, debug=8),
    "_scaled_dot_product_cudnn_attention_backward.default":
        _Attention("attn_bias", backward=True),
}


# ------------------------------------------------------------------ local arguments

def _local_sizes(c: _Call) -> dict[str, Any]:
    return {"input_sizes": c.outs[0].shape}


def _local_group_norm(c: _Call) -> dict[str, Any]:
    x = c.t("input")
    per_group = c["C"] // c["group"]
    return {"N": x.shape[0], "C": x.shape[1], "group": x.shape[1] // per_group}


def _local_num_weights(c: _Call) -> dict[str, Any]:
    return {"num_weights": c.outs[0].shape[0]}


def _local_split(c: _Call) -> dict[str, Any]:
    return {"split_size": c.outs[0].shape[_dim(c["dim"], c.outs[0].rank)]}


_LOCAL: dict[str, Callable[[_Call], dict[str, Any]]] = {
    "aten.slice_backward.default": _local_sizes,
    "aten.select_backward.default": _local_sizes,
    "aten.native_group_norm.default": _local_group_norm,
    "aten.native_group_norm_backward.default": _local_group_norm,
    "aten.embedding_dense_backward.default": _local_num_weights,
    "aten.split.Tensor": _local_split,
}


def local_arguments(op: Op, ins: Sequence[TensorType],
                    outs: Sequence[TensorType]) -> dict[str, Any]:
    """The arguments (by schema name) a device passes instead of the op's own when it runs
    the op on its pieces, given the local types of the op's operands and results: those
    that name a whole shape. Empty for most ops."""
    fn = _LOCAL.get(str(op.attrs.get("target", "")))
    return {} if fn is None else fn(_Call(op, ins, outs))


def with_local_arguments(op: Op, args: Sequence[Any], kwargs: dict[str, Any],
                         ins: Sequence[TensorType], outs: Sequence[TensorType]
                         ) -> tuple[list[Any], dict[str, Any]]:
    """The call's positional and keyword arguments with ``local_arguments`` put in place
    (``ins``/``outs``: the local types)."""
    args, kwargs = list(args), dict(kwargs)
    replace = local_arguments(op, ins, outs)
    if replace:
        names = [name for name, _, _ in _arguments(str(op.attrs["target"]))]
        for name, value in replace.items():
            i = names.index(name)
            if i < len(args):
                args[i] = value
            else:
                kwargs[name] = value
    return args, kwargs


# ------------------------------------------------------------------ the rules

# creation: nothing read, the result written (empty: not even that); run whole
_register("arange.default arange.start arange.start_step", _zero, nbytes=_written,
          iota_dim=_counts)
_register("ones.default zeros.default full.default scalar_tensor.default new_zeros.default "
          "new_ones.default new_full.default", _zero, nbytes=_written)
_register("empty.memory_format empty_strided.default new_empty.default", _zero, nbytes=_views)
_register("full_like.default", _zero, _like(False), _written)
# in the backward, a single one like a scalar of the forward: autograd's seed of
# loss.backward(), that scalar being the value differentiated
_register("ones_like.default", _zero, _like(False), _written, seeds_gradient=True)
_register("zeros_like.default", _zero, _like(True), _written)
_register("empty_like.default", _zero, _like(False), _views)
# random draws: whole (split, they would draw other numbers)
_register("bernoulli.p bernoulli.default normal.float_float rand.default randn.default "
          "rand_like.default randn_like.default", _per_out(1))
_register("native_dropout.default", _per_in(3))

# views and copies
_register("slice.Tensor", _zero, _slice, _views, row_window=_slice_rows)
_register("select.int", _zero, _select, _views)
_register("squeeze.dim", _zero, _squeeze, _views)
_register("unsqueeze.default", _zero, _unsqueeze, _views)
_register("split.Tensor", _zero, _pieces, _views, row_window=_split_rows)
_register("unbind.int", _zero, _pieces, _views)
_register("clone.default", _zero, _elementwise(("self",)), copies=True)
_register("_to_copy.default", _zero, _elementwise())
_register("copy.default", _zero, _elementwise(),
          lambda c: _nbytes(c.t("src")) + _written(c))
_register("cat.default", _zero, _cat, joins_rows=True)
_register("stack.default", _zero, _stack)
_register("constant_pad_nd.default", _zero, _pad)
_register("slice_backward.default", _zero, _slice_backward)
_register("select_backward.default", _zero, _select_backward)
_register("slice_scatter.default", _zero, _slice_scatter)
_register("select_scatter.default", _zero, _select_scatter)
_register("fill.Tensor", _zero, _like(False),
          lambda c: _nbytes(c.t("value")) + _written(c))
_register("gather.default", _zero, _gather,
          lambda c: _nbytes(c.t("index")) + 2 * _written(c))
_register("index_put.default",
          lambda c: _numel(c.t("values")) if c["accumulate"] else 0)

# elementwise
_register("mul.Scalar div.Scalar", _per_out(1), _elementwise(("self",)))
_register("pow.Tensor_Scalar cos.default sin.default", _per_out(1), _elementwise())
_register("clamp.default", lambda c: _numel(c.outs[0]) * ((c["min"] is not None)
                                                         + (c["max"] is not None)),
          _elementwise())
_register("clamp_min.default clamp_max.default", _per_out(1), _elementwise())
_register("masked_fill.Scalar", _per_out(1), _masked_fill)
_register("tril.default triu.default", _per_out(1), _triangle)
_register("gelu.default", _per_out(8), _elementwise())
_register("gelu_backward.default", _per_out(10), _elementwise(("grad_output",)))
_register("silu.default", _per_out(4), _elementwise())
_register("silu_backward.default", _per_out(8), _elementwise(("grad_output",)))
_register("tanh_backward.default", _per_out(3), _elementwise(("grad_output",)))
_register("threshold_backward.default", _per_out(1), _elementwise(("grad_output",)))
_register("native_dropout_backward.default", _per_out(2), _elementwise(("grad_output",)))

# softmax, losses, reductions
_register("_softmax.default _safe_softmax.default", _per_out(5), _softmax)
_register("_log_softmax.default", _per_out(4), _softmax)
_register("_softmax_backward_data.default", _per_out(4), _softmax_backward)
_register("_log_softmax_backward_data.default", _per_out(3), _softmax_backward)
_register("nll_loss_forward.default nll_loss2d_forward.default",
          lambda c: max(_numel(c.t("target")), 1), _nll_forward,
          lambda c: (_nbytes(c.t("target")) + _numel(c.t("target")) * c.t("self").dtype.itemsize
                     + _nbytes(c.t("weight")) + _written(c)),
          row_mean="a mean over the targets it counts (those not equal to ignore_index, "
                   "weighted by the class weights when given)",
          row_weighted=lambda c: c.t("weight") is not None, row_sum=_nll_summed,
          row_count=_nll_count)
_register("nll_loss_backward.default nll_loss2d_backward.default",
          lambda c: max(_numel(c.t("target")), 1), _nll_backward,
          lambda c: (_nbytes(c.t("grad_output")) + _nbytes(c.t("target"))
                     + _nbytes(c.t("weight")) + _nbytes(c.t("total_weight")) + _written(c)))
_register("mse_loss.default", _per_in(3), _pointwise_loss)
_register("mse_loss_backward.default", lambda c: 3 * c.t("self").numel,
          _pointwise_loss_backward)
_register("smooth_l1_loss.default huber_loss.default soft_margin_loss.default",
          _per_in(4), _pointwise_loss)
_register("smooth_l1_loss_backward.default huber_loss_backward.default "
          "soft_margin_loss_backward.default", lambda c: 4 * c.t("self").numel,
          _pointwise_loss_backward)
_register("binary_cross_entropy.default binary_cross_entropy_with_logits.default",
          _per_in(6), _pointwise_loss)
_register("binary_cross_entropy_backward.default", lambda c: 5 * c.t("self").numel,
          _pointwise_loss_backward)
_register("multi_margin_loss.default", lambda c: 4 * c.t("self").numel, _multi_margin)
_register("multi_margin_loss_backward.default", lambda c: 4 * c.t("self").numel,
          _multi_margin_backward)
_register("argmax.default", _per_in(1), _argmax)
# reductions over named dims (every dim when none is named), sorts and scans along one
_register("var.correction std.correction var_mean.correction std_mean.correction",
          _per_in(3), _reduce())
_register("logsumexp.default", _per_in(3), _reduce())
_register("norm.ScalarOpt_dim linalg_vector_norm.default", _per_in(2), _reduce())
_register("max.dim min.dim median.dim nanmedian.dim kthvalue.default mode.default any.dim "
          "all.dim any.dims all.dims prod.dim_int prod.default", _per_in(1), _reduce())
# a count of the nonzero elements is a sum: a split of a counted dim leaves partial counts
_register("count_nonzero.default count_nonzero.dim_IntList", _per_in(1), _reduce(sums=True))
_register("nansum.default", _per_in(1), _reduce(sums=True))
_register("max.default", _per_in(1), _extreme("max"))
_register("min.default", _per_in(1), _extreme("min"))
# the median of every element: no split gives a piece of it
_register("median.default nanmedian.default", _per_in(1), lambda c: [])
_register("sort.default sort.stable topk.default cummax.default cummin.default "
          "cumprod.default logcumsumexp.default", _per_in(1), _along_dims("dim"))
_register("cumsum.default", _per_in(1), _along_dims("dim", linear=True))
_register("roll.default", _zero, _along_dims("dims", linear=True))
_register("flip.default", _zero, _along_dims("dims", linear=True))
_register("unfold.default", _zero, _along_dims("dimension"), _views)
_register("_cdist_forward.default",
          lambda c: 3 * c.outs[0].numel * c.t("x1").shape[-1], _cdist)
# every pair of rows: no split gives a slice of its result
_register("_pdist_forward.default",
          lambda c: 3 * c.outs[0].numel * c.t("self").shape[-1], lambda c: [])
_register("index.Tensor", _zero, _index, lambda c: sum(_nbytes(t) for t in c.ins[1:])
          + 2 * _written(c), row_picks=_index_picks)
# elementwise ops the importer keeps opaque
_register("add.Scalar sub.Scalar rsub.Scalar isnan.default logical_not.default "
          "ceil.default floor.default round.default trunc.default sign.default sgn.default "
          "fill.Scalar", _per_out(1), _elementwise())
_register("sigmoid_backward.default", _per_out(2), _elementwise(("grad_output",)))
_register("xlogy.Tensor", _per_out(2), _elementwise())
_register("_foreach_norm.Scalar", lambda c: 2 * sum(t.numel for t in c.ins))

# matmul, convolution, embedding
_register("addmm.default", _addmm_flops, _addmm)
# a grouped convolution and group norm tie contiguous runs of channels together
_register("convolution.default", _conv_flops, _convolution, regroup=False)
_register("convolution_backward.default", _conv_backward_flops, _convolution_backward,
          regroup=False)
_register("embedding.default", _zero, _embedding, _embedding_bytes)
_register("embedding_dense_backward.default", lambda c: c.t("grad_output").numel,
          _embedding_backward)

# normalization and pooling
_register("native_layer_norm.default", _norm_flops, _layer_norm)
_register("native_layer_norm_backward.default", _norm_backward_flops, _layer_norm_backward)
# in training mode a batch norm normalizes with the batch's own statistics
_register("_native_batch_norm_legit_functional.default", _norm_flops, _batch_norm,
          batch_stats=True)
_register("_native_batch_norm_legit_no_training.default", _norm_flops, _batch_norm)
_register("_native_batch_norm_legit.no_stats", _norm_flops, _batch_norm_channels,
          batch_stats=True)
_register("native_batch_norm_backward.default", _norm_backward_flops, _batch_norm_backward)
_register("native_group_norm.default", _norm_flops, _group_norm, regroup=False)
_register("native_group_norm_backward.default", _norm_backward_flops, _group_norm_backward,
          regroup=False)
_register("max_pool2d_with_indices.default", _max_pool_flops, _max_pool)
_register("max_pool2d_with_indices_backward.default", lambda c: c.t("grad_output").numel,
          _max_pool_backward,
          lambda c: (_nbytes(c.t("grad_output")) + _nbytes(c.t("indices")) + _written(c)))

# attention
for _target, _spec in _SDPA.items():
    _register(_target, _attention_flops(_spec.backward), _attention(_spec))
