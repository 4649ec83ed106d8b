"""How each op kind may be sharded: placement rules, one mesh axis at a time.

A rule maps the placements of an op's inputs on one axis to the placements of its results,
or returns None when the op cannot run on inputs placed that way (a pass must then insert a
collective first). The verifier checks declared placements against these rules, and passes
such as data-parallel and weight-update-sharding use them to propagate placements."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .core import Op
from .opdef import Category, op_def
from .strategies import strategies_of
from .shape_rules import dot_dims
from .types import (FLAT, FLAT_DIRTY, REPLICATE, VARYING, FlatShard, Partial, Placement,
                    Replicate, Shard, TensorType, Varying)

ShardingRule = Callable[[Op, Sequence[TensorType], Sequence[TensorType], str],
                        "tuple[Placement, ...] | None"]

def propagate(op: Op, ins: Sequence[TensorType], outs: Sequence[TensorType], axis: str,
              rule: ShardingRule) -> tuple[Placement, ...] | None:
    """The placements of an op's results on ``axis``: per-device (varying) inputs make any op
    a per-device computation; inputs split by dimension, whole or partial take the op's
    strategy (``strategies.py``) that accepts them; flat shards, constants and collectives
    follow the op's own rule here."""
    pls = _pls(ins, axis)
    if any(isinstance(p, Varying) for p in pls):
        if all(isinstance(p, (Varying, Replicate)) for p in pls):
            return tuple(VARYING for _ in outs)
        return None
    if rule in _OWN_RULES or any(isinstance(p, FlatShard) for p in pls):
        return rule(op, ins, outs, axis)
    return by_strategy(op, ins, outs, tuple(pls))


def by_strategy(op: Op, ins: Sequence[TensorType], outs: Sequence[TensorType],
                pls: tuple[Placement, ...]) -> tuple[Placement, ...] | None:
    """The result placements of the op's plain strategy taking inputs placed ``pls``."""
    for s in strategies_of(op, ins, outs):
        if s.inputs == pls and not s.masked:
            return s.outputs
    return None


def _pls(ins: Sequence[TensorType], axis: str) -> list[Placement]:
    return [t.placement(axis) for t in ins]


def _all_r(outs) -> tuple[Placement, ...]:
    return tuple(REPLICATE for _ in outs)


def replicate_only(op: Op, ins, outs, axis: str):
    """Ops that run only on whole tensors (opaque, control flow, rng, constants)."""
    if all(isinstance(p, Replicate) for p in _pls(ins, axis)):
        return _all_r(outs)
    return None


def elementwise(op: Op, ins, outs, axis: str):
    """Split operands share one placement and the result's shape; the rest are replicated
    and do not span the split dimension. Partial sums pass only through linear math."""
    pls = _pls(ins, axis)
    if all(isinstance(p, Replicate) for p in pls):
        return _all_r(outs)
    if any(isinstance(p, Partial) for p in pls):
        return _partial_elementwise(op, pls)
    out = outs[0]
    split = {p for p in pls if not isinstance(p, Replicate)}
    if split and all(isinstance(q, FlatShard) for q in split):
        return _flat_elementwise(op, ins, pls, outs)
    if len(split) != 1:
        return None
    p = split.pop()
    for t, q in zip(ins, pls):
        if q == p:
            if t.shape != out.shape:
                return None  # a split operand that is broadcast: its pieces do not line up
        elif isinstance(p, FlatShard):
            if t.numel != 1:
                return None
        else:
            aligned = p.dim - (out.rank - t.rank)
            if aligned >= 0 and t.shape[aligned] != 1:
                return None  # a whole operand spanning the split dim: slice it first
    return tuple(p for _ in outs)


def _flat_elementwise(op: Op, ins, pls: list[Placement], outs):
    """Flat shards line up only with same-size flat shards and replicated scalars; the result
    keeps zero padding when the op maps the zero operands to zero."""
    for t, q in zip(ins, pls):
        if isinstance(q, FlatShard):
            if t.shape != outs[0].shape:
                return None
        elif t.numel != 1:
            return None
    zero = [isinstance(q, FlatShard) and not q.dirty for q in pls]
    # mul by anything and div of zero by a replicated (nonzero) scale keep zeros; other ops
    # say in their table row which operands' zeros make a zero result
    zero_when = op_def(op.name).zero_when
    if op.name == "mul":
        clean = any(zero) and all(z or not isinstance(q, FlatShard) for z, q in zip(zero, pls))
    elif op.name == "div":
        clean = zero[0] and isinstance(pls[1], Replicate)
    elif zero_when:
        clean = all(zero[i] for i in zero_when if i < len(pls))
    else:
        clean = False
    return tuple(FLAT if clean else FLAT_DIRTY for _ in outs)


def _partial_elementwise(op: Op, pls: list[Placement]):
    part = [p for p in pls if isinstance(p, Partial)]
    if any(p.op != "sum" for p in part):
        return None
    whole = [p for p in pls if isinstance(p, Replicate)]
    d = op_def(op.name)
    if d.linear and d.category is Category.unary:
        return (Partial("sum"),)
    if d.linear:      # add, sub
        # linear in the two summands; a run-time alpha must be the same on every device
        two = all(isinstance(p, Partial) for p in pls[:2])
        return (Partial("sum"),) if two and all(isinstance(p, Replicate) for p in pls[2:]) \
            else None
    if op.name == "mul" and len(part) == 1 and len(whole) == len(pls) - 1:
        return (Partial("sum"),)
    if op.name == "div" and isinstance(pls[0], Partial) and isinstance(pls[1], Replicate):
        return (Partial("sum"),)
    return None


def reduce(op: Op, ins, outs, axis: str):
    """Reducing a split dimension leaves a partial result; other splits move with the dims."""
    (p,) = _pls(ins, axis)
    dims = tuple(op.attrs.get("dims", ()))
    keep = op.attrs.get("keepdim", False)
    if isinstance(p, Replicate):
        return _all_r(outs)
    if isinstance(p, Shard):
        if p.dim in dims:
            kind = op_def(op.name).partial
            return (Partial(kind),) if kind else None
        return (Shard(p.dim if keep else p.dim - sum(d < p.dim for d in dims)),)
    if isinstance(p, FlatShard):
        # Zero padding is harmless only to a sum over every dimension; padding of unknown
        # value (Fx) is harmless only when nothing is padded (the verifier checks the size).
        full = len(dims) == ins[0].rank
        return (Partial("sum"),) if op.name == "reduce_sum" and full else None
    if isinstance(p, Partial) and p.op == "sum" and op.name == "reduce_sum":
        return (p,)
    return None


def dot(op: Op, ins, outs, axis: str):
    """Batch and free dims carry their split to the result; a split contraction is partial."""
    lp, rp = _pls(ins, axis)
    lhs, rhs = ins
    lb, rb, lc, rc, lf, rf = dot_dims(op.attrs, lhs.rank, rhs.rank)
    if isinstance(lp, Replicate) and isinstance(rp, Replicate):
        return _all_r(outs)
    if isinstance(lp, Partial) or isinstance(rp, Partial):
        other = rp if isinstance(lp, Partial) else lp
        part = lp if isinstance(lp, Partial) else rp
        return (part,) if part.op == "sum" and isinstance(other, Replicate) else None
    if isinstance(lp, FlatShard) or isinstance(rp, FlatShard):
        return None
    if isinstance(lp, Shard) and isinstance(rp, Shard):
        if lp.dim in lc and rp.dim in rc and lc.index(lp.dim) == rc.index(rp.dim):
            return (Partial("sum"),)
        if lp.dim in lb and rp.dim in rb and lb.index(lp.dim) == rb.index(rp.dim):
            return (Shard(lb.index(lp.dim)),)
        return None
    if isinstance(lp, Shard):
        if lp.dim in lf:
            return (Shard(len(lb) + lf.index(lp.dim)),)
        return None
    if rp.dim in rf:
        return (Shard(len(lb) + len(lf) + rf.index(rp.dim)),)
    return None


def _linear_partial(p: Placement):
    return (p,) if isinstance(p, Partial) and p.op == "sum" else None


def transpose(op: Op, ins, outs, axis: str):
    """A split moves with its dimension."""
    (p,) = _pls(ins, axis)
    if isinstance(p, Shard):
        return (Shard(tuple(op.attrs["perm"]).index(p.dim)),)
    if isinstance(p, Replicate):
        return _all_r(outs)
    return _linear_partial(p)


def reshape(op: Op, ins, outs, axis: str):
    """A flat shard ignores shape; a dim split survives when it maps to a whole result dim."""
    (p,) = _pls(ins, axis)
    src, dst = ins[0].shape, outs[0].shape
    if isinstance(p, (Replicate, FlatShard)):
        return (p,)
    if isinstance(p, Shard):
        before = 1
        for d in range(p.dim):
            before *= src[d]
        acc = 1
        for j, s in enumerate(dst):
            if acc == before and s == src[p.dim]:
                return (Shard(j),)
            acc *= s
        return None
    return _linear_partial(p)


def broadcast_in_dim(op: Op, ins, outs, axis: str):
    """A split operand dim of full size carries its split to the result dim it maps to."""
    (p,) = _pls(ins, axis)
    if isinstance(p, Shard):
        d = tuple(op.attrs["dims"])[p.dim]
        return (Shard(d),) if ins[0].shape[p.dim] == outs[0].shape[d] else None
    if isinstance(p, Replicate):
        return _all_r(outs)
    return _linear_partial(p)


def slice_or_pad(op: Op, ins, outs, axis: str):
    """Slicing or padding an unsplit dim keeps the split; a partial sum stays partial."""
    (p,) = _pls(ins, axis)
    if isinstance(p, Replicate):
        return _all_r(outs)
    if isinstance(p, Shard):
        return (p,) if ins[0].shape[p.dim] == outs[0].shape[p.dim] else None
    if op.name == "pad" and op.attrs.get("value", 0) != 0:
        return None
    return _linear_partial(p)


def concat(op: Op, ins, outs, axis: str):
    """Concatenating along an unsplit dim keeps a common split."""
    pls = set(_pls(ins, axis))
    if len(pls) != 1:
        return None
    p = pls.pop()
    if isinstance(p, Replicate):
        return _all_r(outs)
    if isinstance(p, Shard):
        return (p,) if p.dim != op.attrs["dim"] else None
    return _linear_partial(p)


def index_select(op: Op, ins, outs, axis: str):
    """Replicated table, split indices: the result is split like the indices (embedding)."""
    sp, ip = _pls(ins, axis)
    ax = op.attrs["axis"]
    if isinstance(sp, Replicate) and isinstance(ip, Replicate):
        return _all_r(outs)
    if isinstance(sp, Replicate) and isinstance(ip, Shard):
        return (Shard(ax + ip.dim),)
    if isinstance(sp, Shard) and sp.dim != ax and isinstance(ip, Replicate):
        return (Shard(sp.dim if sp.dim < ax else sp.dim + ins[1].rank - 1),)
    return None


def index_add(op: Op, ins, outs, axis: str):
    """Split updates added at split indices into a partial-sum base give a partial sum
    (the embedding gradient under data parallelism; a zero base made by `full` may be
    declared P(sum))."""
    dp, ip, up = _pls(ins, axis)
    ax = op.attrs["axis"]
    if all(isinstance(p, Replicate) for p in (dp, ip, up)):
        return _all_r(outs)
    if isinstance(ip, Shard) and up == Shard(ax + ip.dim) and dp == Partial("sum"):
        return (Partial("sum"),)
    return None


def constant(op: Op, ins, outs, axis: str):
    """A constant can be built in any split locally; only zeros are a valid partial sum."""
    pls = [t.placement(axis) for t in outs]
    for p in pls:
        if isinstance(p, Partial) and not (op.name == "full" and op.attrs.get("value") == 0
                                           and p.op == "sum"):
            return None
    return tuple(pls)


def gather_scatter(op: Op, ins, outs, axis: str):
    """gather/scatter_add along ``dim``: a split of another dim passes through when every
    operand is split there and has the same size there (so the pieces line up)."""
    pls = _pls(ins, axis)
    if all(isinstance(p, Replicate) for p in pls):
        return _all_r(outs)
    if len(set(pls)) == 1 and isinstance(pls[0], Shard) and pls[0].dim != op.attrs["dim"]:
        d = pls[0].dim
        if len({t.shape[d] for t in ins}) == 1:
            return (pls[0],)
    return None


def collective(op: Op, ins, outs, axis: str):
    """Collectives change the placement on their own axis; other axes pass through."""
    if op.attrs.get("axis") == axis:
        return None  # checked by verify_collective against the collective's semantics
    if not ins:
        return tuple(REPLICATE for _ in outs)
    if len(ins) == len(outs):
        return tuple(t.placement(axis) for t in ins)
    return tuple(ins[0].placement(axis) for _ in outs)


def same_placements(op: Op, ins, outs, axis: str):
    """Each result is placed as its input (a wait hands values through)."""
    return tuple(t.placement(axis) for t in ins)


def quant(op: Op, ins, outs, axis: str):
    """Quantization works on flat groups: a flat or leading-dim split passes through."""
    p = _pls(ins[:1], axis)[0]
    if isinstance(p, Replicate) and all(isinstance(q, Replicate) for q in _pls(ins, axis)):
        return _all_r(outs)
    if isinstance(p, FlatShard):
        return tuple(p for _ in outs)
    return None


# rules that speak for themselves: constants take the placement declared for them, and
# collectives and waits are checked against their own semantics
_OWN_RULES = (constant, collective, same_placements)


def expected_collective(op: Op, src: Placement) -> tuple[Placement | None, str]:
    """For a collective on its own axis: the result placement it gives, or None and why."""
    name, red = op.name, op.attrs.get("op", "sum")
    if name == "all_reduce":
        if src != Partial(red) and not isinstance(src, Varying):
            return None, f"all_reduce{{op={red}}} takes a P({red}) or V input, found {src}"
        return REPLICATE, ""
    if name == "reduce_scatter":
        if src != Partial(red) and not isinstance(src, Varying):
            return None, f"reduce_scatter{{op={red}}} takes a P({red}) or V input, found {src}"
        dim = op.attrs["dim"]
        return (FLAT if dim == "flat" else Shard(dim)), ""
    if name == "all_gather":
        dim = op.attrs["dim"]
        ok = isinstance(src, FlatShard) if dim == "flat" else src == Shard(dim)
        if not ok:
            want = "F" if dim == "flat" else str(Shard(dim))
            return None, f"all_gather{{dim={dim}}} takes a {want} input, found {src}"
        return REPLICATE, ""
    if name == "all_to_all":
        want = Shard(op.attrs["from_dim"])
        if src != want:
            return None, f"all_to_all takes a {want} input, found {src}"
        return Shard(op.attrs["to_dim"]), ""
    if name == "broadcast":
        return REPLICATE, ""
    if name == "take_shard":
        if not isinstance(src, Replicate):
            return None, f"take_shard takes a replicated input, found {src}"
        dim = op.attrs["dim"]
        return (FLAT if dim == "flat" else Shard(dim)), ""
    if name in ("send", "recv"):
        return src, ""
    return None, f"{name} is not a collective"
