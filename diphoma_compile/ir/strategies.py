"""How each op may be split: the menu of sharding strategies, one mesh axis at a time.

A strategy says which placement each input must have and which placement each result then
has. Executing the op on every device's pieces (each device runs the op on its slices of the
inputs) and combining the pieces as the result placements say gives the op's whole result.
Communication is not part of a strategy: it is what it costs to bring the inputs to the
placements the strategy needs (``reshard``), priced by a device model.

The menu of a neutral op is the ``strategies`` function of its table row (``ops.py``); the
menu of a framework op kept whole (``opaque``) comes from the rule its framework package
registered for its target (``register_framework_op``), with the same interface. A strategy
marked ``masked`` is not a plain slicing: each device also shifts and masks indices (vocab-
parallel embedding and cross-entropy); it is listed for planners, and a backend must do the
masking to run it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from .core import Op
from .framework_ops import framework_rule
from .opdef import is_local, op_def
from .types import REPLICATE, FlatShard, Partial, Placement, Replicate, Shard, TensorType


@dataclass(frozen=True)
class Strategy:
    """One way to run an op split over an axis: input placements -> result placements."""

    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]
    name: str = ""          # what people call it: batch, column, row, contract, heads, vocab
    masked: bool = False    # devices shift and mask indices (not a plain slicing)

    def __str__(self) -> str:
        ins = ", ".join(map(str, self.inputs))
        outs = ", ".join(map(str, self.outputs))
        tag = f" [{self.name}{', masked' if self.masked else ''}]" if self.name else ""
        return f"({ins}) -> ({outs}){tag}"


StrategyFn = Callable[[Op, Sequence[TensorType], Sequence[TensorType]], list[Strategy]]

# the name of a strategy that cuts a split of k groups into its k pieces, or joins k pieces
# into one (a fused query/key/value projection's result split, its gradients concatenated):
# where a step has one, a planner tries grouped splits of k groups
GROUPS = "groups"


# ---------------------------------------------------------------- menus

def replicated(ins: Sequence[TensorType], outs: Sequence[TensorType]) -> Strategy:
    """Every device runs the whole op on whole inputs."""
    return Strategy(tuple(REPLICATE for _ in ins), tuple(REPLICATE for _ in outs), "replicate")


def replicate_only(op: Op, ins, outs) -> list[Strategy]:
    """Ops that run only on whole tensors (control flow, random draws, quantization)."""
    return [replicated(ins, outs)]


def no_strategies(op: Op, ins, outs) -> list[Strategy]:
    """Collectives and waits: they set placements themselves; nothing to choose."""
    return []


def strategies_of(op: Op, ins: Sequence[TensorType], outs: Sequence[TensorType],
                  groups: Iterable[int] = ()) -> list[Strategy]:
    """The menu of any op: its table row's, or its framework's rule for an opaque op (a
    framework op without a rule runs whole); with ``groups``, also each split of the menu
    made over dimensions of k groups, for every k given (``regrouped``)."""
    regroup = True
    if op.name == "opaque":
        rule = framework_rule(op)
        if rule is None or rule.strategies is None:
            return [replicated(ins, outs)]
        menu, regroup = rule.strategies(op, ins, outs), rule.regroup
        if menu is None:        # no opinion on this call's form: it runs whole
            return [replicated(ins, outs)]
    else:
        fn = op_def(op.name).strategies
        menu = [replicated(ins, outs)] if fn is None else fn(op, ins, outs)
    if regroup:
        for k in sorted(set(groups) - {1}):
            menu += [g for g in (regrouped(s, k) for s in list(menu)) if g is not None]
    return menu


def regrouped(s: Strategy, k: int) -> Strategy | None:
    """The strategy with every plain split ``S(d)`` made a split of k groups ``S(d,k)``, or
    None when it has no plain split (or is masked, or already grouped).

    Exact whenever the plain strategy is: a grouped split is a plain split of the dimension
    with its indices permuted, alike in every operand and result, and the strategies here
    (elementwise math, contractions, reductions, layout ops that keep the dimension's order
    in runs of size/k) commute with such a permutation. Framework ops that tie contiguous
    runs together opt out (``FrameworkOpRule.regroup``)."""
    pls = s.inputs + s.outputs
    if s.masked or not any(isinstance(p, Shard) for p in pls) \
            or any(isinstance(p, Shard) and p.groups != 1 for p in pls):
        return None

    def g(p: Placement) -> Placement:
        return Shard(p.dim, k) if isinstance(p, Shard) else p
    return Strategy(tuple(map(g, s.inputs)), tuple(map(g, s.outputs)), s.name)


def group_counts(pls: Iterable[Placement]) -> set[int]:
    """The numbers of groups (above 1) of the grouped splits among ``pls``."""
    return {p.groups for p in pls if isinstance(p, Shard) and p.groups > 1}


def fits_axis(s: Strategy, ins: Sequence[TensorType], outs: Sequence[TensorType],
              n: int) -> bool:
    """True when every split dimension the strategy names divides evenly by ``n`` (times
    its groups)."""
    for p, t in list(zip(s.inputs, ins)) + list(zip(s.outputs, outs)):
        if isinstance(p, Shard) and (p.dim >= t.rank or t.shape[p.dim] % (n * p.groups)):
            return False
        if isinstance(p, FlatShard):
            return False
    return True


def candidates(op: Op, ins: Sequence[TensorType], outs: Sequence[TensorType],
               n: int, masked: bool = False, groups: Iterable[int] = ()) -> list[Strategy]:
    """The strategies that can run over an axis of ``n`` devices (for a solver); masked
    ones only when asked (no backend runs them yet); grouped splits of ``groups``."""
    return [s for s in strategies_of(op, ins, outs, groups) if fits_axis(s, ins, outs, n)
            and (masked or not s.masked)]


def linear_collective(op: Op) -> bool:
    """True when a collective commutes with sums over another axis (partial sums there
    pass through it): all but the reductions by max and min."""
    return str(op.attrs.get("op", "sum")) not in ("max", "min")


# ---------------------------------------------------------------- resharding

@dataclass(frozen=True)
class Reshard:
    """The collective that turns one placement of a tensor into another on one axis."""

    collective: str | None      # None: nothing to do
    attrs: tuple[tuple[str, object], ...] = ()

    @property
    def free(self) -> bool:
        """True when no data moves (the same placement, or taking a local slice)."""
        return self.collective is None or is_local(self.collective)


def reshard(src: Placement, dst: Placement) -> Reshard | None:
    """How to bring a value from ``src`` to ``dst`` on one axis, or None when no collective
    does (a split value cannot become a partial sum, a whole one only a partial sum, and
    partial sums of one kind cannot become another)."""
    if src == dst:
        return Reshard(None)
    if isinstance(src, Partial):
        if isinstance(dst, Replicate):
            return Reshard("all_reduce", (("op", src.op),))
        if isinstance(dst, Shard) and src.op in ("sum", "avg", "max", "min"):
            return Reshard("reduce_scatter", (("op", src.op),) + _dim_attrs(dst))
        return None
    if isinstance(src, Replicate) and isinstance(dst, Shard):
        return Reshard("take_shard", _dim_attrs(dst))
    if isinstance(src, Replicate) and dst == Partial("sum"):
        return Reshard("as_partial")       # device 0 keeps it, the others hold zeros
    if isinstance(src, Shard) and isinstance(dst, Replicate):
        return Reshard("all_gather", _dim_attrs(src))
    if isinstance(src, Shard) and isinstance(dst, Shard) and src.groups == dst.groups == 1:
        return Reshard("all_to_all", (("from_dim", src.dim), ("to_dim", dst.dim)))
    return None


def _dim_attrs(p: Shard) -> tuple[tuple[str, object], ...]:
    # a grouped split moves as the plain split of the view with its groups as a dimension
    # of their own (propagate.py inserts the reshapes around the collective)
    return (("dim", p.dim),) + ((("groups", p.groups),) if p.groups > 1 else ())


# ---------------------------------------------------------------- neutral op families

def _with_partials(menu: list[Strategy], ins, outs, partial_sets) -> list[Strategy]:
    """Add strategies taking partial sums at the operand positions of each set (the rest
    replicated) and giving partial sums."""
    for positions in partial_sets:
        pls = tuple(Partial("sum") if i in positions else REPLICATE for i in range(len(ins)))
        menu.append(Strategy(pls, tuple(Partial("sum") for _ in outs), "partial"))
    return menu


def elementwise(op: Op, ins, outs) -> list[Strategy]:
    """Split any result dimension; operands that are broadcast along it stay whole. Partial
    sums pass through math that is linear in them (the op table's ``linear``/``linear_in``)."""
    out = outs[0]
    menu = [replicated(ins, outs)]
    for d in range(out.rank):
        pls = []
        for t in ins:
            aligned = d - (out.rank - t.rank)
            spans = aligned >= 0 and t.shape[aligned] == out.shape[d]
            pls.append(Shard(aligned) if spans else REPLICATE)   # else broadcast along d
        menu.append(Strategy(tuple(pls), tuple(Shard(d) for _ in outs), "split"))
    row = op_def(op.name)
    sets = []
    if row.linear:
        sets.append(set(range(min(len(ins), 2))))   # add/sub: both summands; neg: its operand
    sets.extend({i} for i in row.linear_in if i < len(ins))
    return _with_partials(menu, ins, outs, sets)


def reduce(op: Op, ins, outs) -> list[Strategy]:
    """Kept dims carry their split; a reduced split dim leaves partial results of the op's
    ``partial`` kind; a sum of partial sums is a partial sum."""
    (x,) = ins
    dims = tuple(op.attrs.get("dims", ()))
    keep = op.attrs.get("keepdim", False)
    kind = op_def(op.name).partial
    menu = [replicated(ins, outs)]
    for d in range(x.rank):
        if d in dims:
            if kind:
                menu.append(Strategy((Shard(d),), tuple(Partial(kind) for _ in outs), "reduce"))
        else:
            od = d if keep else d - sum(r < d for r in dims)
            menu.append(Strategy((Shard(d),), tuple(Shard(od) for _ in outs), "split"))
    if kind in ("sum", "avg"):
        menu.append(Strategy((Partial("sum"),), tuple(Partial("sum") for _ in outs), "partial"))
    return menu


def dot(op: Op, ins, outs) -> list[Strategy]:
    """Batch dims split both operands; a free dim of one operand splits it alone (Megatron's
    row split of the activations or column split of the weight); a split contraction gives
    partial sums (Megatron's row-parallel layer); partial sums pass through either side."""
    from .shape_rules import dot_dims
    lhs, rhs = ins
    lb, rb, lc, rc, lf, rf = dot_dims(op.attrs, lhs.rank, rhs.rank)
    menu = [replicated(ins, outs)]
    for i, (a, b) in enumerate(zip(lb, rb)):
        menu.append(Strategy((Shard(a), Shard(b)), (Shard(i),), "batch"))
    for i, a in enumerate(lf):
        menu.append(Strategy((Shard(a), REPLICATE), (Shard(len(lb) + i),), "lhs"))
    for i, b in enumerate(rf):
        menu.append(Strategy((REPLICATE, Shard(b)), (Shard(len(lb) + len(lf) + i),), "column"))
    for a, b in zip(lc, rc):
        menu.append(Strategy((Shard(a), Shard(b)), (Partial("sum"),), "contract"))
    return _with_partials(menu, ins, outs, [{0}, {1}])


def transpose(op: Op, ins, outs) -> list[Strategy]:
    """A split moves with its dimension."""
    perm = tuple(op.attrs["perm"])
    menu = [replicated(ins, outs)]
    menu += [Strategy((Shard(d),), (Shard(perm.index(d)),), "split")
             for d in range(ins[0].rank)]
    return _with_partials(menu, ins, outs, [{0}])


def reshape(op: Op, ins, outs) -> list[Strategy]:
    """A split of input dim d is a split of result dim j when the elements before them
    number the same: then the n pieces of either are the same n runs of the flat tensor (a
    merge of d with later dims, a split of d into heads, or d unchanged)."""
    src, dst = ins[0].shape, outs[0].shape
    menu = [replicated(ins, outs)]
    dst_at: list[tuple[int, int, int]] = []     # (elements before, size, dim) of the result
    acc = 1
    for j, s in enumerate(dst):
        dst_at.append((acc, s, j))
        acc *= s
    acc = 1
    for d, s in enumerate(src):
        same = [j for b, size, j in dst_at if b == acc and size == s]
        grown = [j for b, size, j in dst_at if b == acc and size > 1 and s > 1]
        if same or grown:
            menu.append(Strategy((Shard(d),), (Shard((same or grown)[0]),), "split"))
        acc *= s
    menu += _ungroup(src, dst) + [Strategy(s.outputs, s.inputs, "regroup")
                                  for s in _ungroup(dst, src)]
    return _with_partials(menu, ins, outs, [{0}])


def _ungroup(src: Sequence[int], dst: Sequence[int]) -> list[Strategy]:
    """A dimension of k groups viewed as two, [k, size/k]: its grouped split is the plain
    split of the second (each device's piece of every group)."""
    menu = []
    for d, s in enumerate(src):
        if len(dst) == len(src) + 1 and tuple(dst[:d]) == tuple(src[:d]) \
                and tuple(dst[d + 2:]) == tuple(src[d + 1:]) and dst[d] * dst[d + 1] == s \
                and dst[d] > 1 and dst[d + 1] > 1:
            menu.append(Strategy((Shard(d, dst[d]),), (Shard(d + 1),), "ungroup"))
    return menu


def broadcast_in_dim(op: Op, ins, outs) -> list[Strategy]:
    """A split operand dim of full size carries its split to the result dim it maps to."""
    dims = tuple(op.attrs["dims"])
    (x,), out = ins, outs[0]
    menu = [replicated(ins, outs)]
    for d in range(x.rank):
        if x.shape[d] == out.shape[dims[d]]:
            menu.append(Strategy((Shard(d),), (Shard(dims[d]),), "split"))
    return _with_partials(menu, ins, outs, [{0}])


def slice_or_pad(op: Op, ins, outs) -> list[Strategy]:
    """Slicing or padding leaves the dims it does not touch splittable; a partial sum stays
    partial (padding with zeros only)."""
    x, out = ins[0], outs[0]
    menu = [replicated(ins, outs)]
    menu += [Strategy((Shard(d),) + tuple(REPLICATE for _ in ins[1:]), (Shard(d),), "split")
             for d in range(x.rank) if x.shape[d] == out.shape[d]]
    if op.name == "pad" and op.attrs.get("value", 0) != 0:
        return menu
    return _with_partials(menu, ins, outs, [{0}])


def concat(op: Op, ins, outs) -> list[Strategy]:
    """Concatenating along one dim keeps a common split of any other."""
    dim = op.attrs["dim"]
    out = outs[0]
    menu = [replicated(ins, outs)]
    menu += [Strategy(tuple(Shard(d) for _ in ins), (Shard(d),), "split")
             for d in range(out.rank) if d != dim]
    menu.append(Strategy(tuple(Partial("sum") for _ in ins), (Partial("sum"),), "partial"))
    return menu


def index_select(op: Op, ins, outs) -> list[Strategy]:
    """table[idx] along ``axis``: split indices split the result (the batch of an
    embedding lookup); another split table dim carries over; a table split along ``axis``
    (vocab-parallel) gives partial sums when each device looks up only its own rows."""
    table, idx = ins
    ax = op.attrs["axis"]
    menu = [replicated(ins, outs)]
    for i in range(idx.rank):
        menu.append(Strategy((REPLICATE, Shard(i)), (Shard(ax + i),), "batch"))
    for d in range(table.rank):
        if d != ax:
            od = d if d < ax else d + idx.rank - 1
            menu.append(Strategy((Shard(d), REPLICATE), (Shard(od),), "split"))
    menu.append(Strategy((Shard(ax), REPLICATE), (Partial("sum"),), "vocab", masked=True))
    return menu


def index_add(op: Op, ins, outs) -> list[Strategy]:
    """base.index_add(axis, idx, upd): split indices with their updates add into partial
    sums (an embedding's gradient under a batch split); another dim splits all three."""
    base, idx, upd = ins
    ax = op.attrs["axis"]
    menu = [replicated(ins, outs)]
    for i in range(idx.rank):
        menu.append(Strategy((Partial("sum"), Shard(i), Shard(ax + i)), (Partial("sum"),),
                             "batch"))
    for d in range(base.rank):
        if d != ax:
            ud = d if d < ax else d + idx.rank - 1
            menu.append(Strategy((Shard(d), REPLICATE, Shard(ud)), (Shard(d),), "split"))
    menu.append(Strategy((Shard(ax), REPLICATE, REPLICATE), (Shard(ax),), "vocab",
                         masked=True))
    menu.append(Strategy((Partial("sum"), REPLICATE, Partial("sum")), (Partial("sum"),),
                         "partial"))
    return menu


def gather_scatter(op: Op, ins, outs) -> list[Strategy]:
    """gather/scatter_add along ``dim``: another dim of the same size in every operand
    splits them all."""
    dim = op.attrs["dim"]
    out = outs[0]
    menu = [replicated(ins, outs)]
    for d in range(out.rank):
        if d != dim and len({t.shape[d] for t in ins}) == 1:
            menu.append(Strategy(tuple(Shard(d) for _ in ins), (Shard(d),), "split"))
    return menu


def constant(op: Op, ins, outs) -> list[Strategy]:
    """A constant is built in any split where it is needed, except an iota along its own
    dim (every device would count from 0, not from its offset); zeros are also a partial
    sum."""
    out = outs[0]
    counted = op.attrs.get("dim") if op.name == "iota" else None
    menu = [replicated(ins, outs)]
    menu += [Strategy(tuple(REPLICATE for _ in ins), (Shard(d),), "split")
             for d in range(out.rank) if d != counted]
    if op.name == "full" and op.attrs.get("value") == 0:
        menu.append(Strategy((), (Partial("sum"),), "partial"))
    return menu


def same_split(op: Op, ins, outs) -> list[Strategy]:
    """Ops whose every operand and result have one shape, split alike on any dim (a
    framework's elementwise op kept whole, e.g. gelu's backward)."""
    out = outs[0]
    menu = [replicated(ins, outs)]
    menu += [Strategy(tuple(Shard(d) for _ in ins), tuple(Shard(d) for _ in outs), "split")
             for d in range(out.rank)]
    return menu
