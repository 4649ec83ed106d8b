"""Which placements an op's results get from its inputs', one mesh axis at a time.

``propagate`` maps the placements of an op's inputs on one axis to the placements of its
results, or None when the op cannot run on inputs placed that way (a pass must then insert
a collective first). The verifier checks declared placements with it, and passes such as
data-parallel and weight-update-sharding use it to propagate placements. Dimension splits,
whole and partial values follow the op's strategies (``strategies.py``); the rules here
cover what strategies do not: per-device (varying) values, the flat padded shards of
weight-update sharding, constants built in a declared placement, and collectives."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .core import Op
from .opdef import Category, op_def
from .strategies import group_counts, linear_collective, strategies_of
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
    for s in strategies_of(op, ins, outs, group_counts(pls)):
        if s.inputs == pls and not s.masked:
            return s.outputs
    return None


def _pls(ins: Sequence[TensorType], axis: str) -> list[Placement]:
    return [t.placement(axis) for t in ins]


def _all_r(outs) -> tuple[Placement, ...]:
    return tuple(REPLICATE for _ in outs)


def none(op: Op, ins, outs, axis: str):
    """Ops that cannot take flat shards (dot, layout, indexing, opaque, control flow)."""
    return None


def elementwise(op: Op, ins, outs, axis: str):
    """Flat shards line up only with same-size flat shards and replicated scalars; the result
    keeps zero padding when the op maps the zero operands to zero."""
    pls = _pls(ins, axis)
    for t, q in zip(ins, pls):
        if isinstance(q, FlatShard):
            if t.shape != outs[0].shape:
                return None
        elif not isinstance(q, Replicate) or t.numel != 1:
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


def reduce(op: Op, ins, outs, axis: str):
    """Zero padding is harmless only to a sum over every dimension; padding of unknown value
    (Fx) is harmless only when nothing is padded (the verifier checks the size)."""
    full = len(tuple(op.attrs.get("dims", ()))) == ins[0].rank
    return (Partial("sum"),) if op_def(op.name).partial == "sum" and full else None


def sums_dirty_padding(op: Op, ins: Sequence[TensorType], axis: str, n: int) -> bool:
    """Whether ``op`` reduces a flat piece on ``axis`` (of ``n`` devices) whose padding may
    hold anything (``Fx``: math before it may have made the zeros nonzero, exp(0) = 1)
    where there is padding: what ``reduce`` leaves to the size, which the verifier refuses
    and the passes avoid by gathering first."""
    return op_def(op.name).category is Category.reduce and bool(ins) and \
        ins[0].placement(axis) == FLAT_DIRTY and ins[0].numel % n != 0


def reshape(op: Op, ins, outs, axis: str):
    """A flat shard ignores shape."""
    return (_pls(ins, axis)[0],)


def constant(op: Op, ins, outs, axis: str):
    """A constant can be built in any split locally; only zeros are a valid partial sum."""
    pls = [t.placement(axis) for t in outs]
    for p in pls:
        if isinstance(p, Partial) and not (op.name == "full" and op.attrs.get("value") == 0
                                           and p.op == "sum"):
            return None
    return tuple(pls)


def collective(op: Op, ins, outs, axis: str):
    """Collectives change the placement on their own axis; other axes pass through."""
    if op.attrs.get("axis") == axis:
        return None  # checked by verify_collective against the collective's semantics
    if op.name == "recv":       # what the peer sent, placed there as declared here
        return tuple(t.placement(axis) for t in outs)
    if not ins:
        return tuple(REPLICATE for _ in outs)
    if any(isinstance(t.placement(axis), Partial) for t in ins) and not linear_collective(op):
        return None     # a max of partial sums is not a partial sum of the max
    if op.name == "take_shard" and ins and _splits_dim(ins[0].placement(axis),
                                                       op.attrs.get("dim")):
        # a piece of a piece of the same dim: which axis is the major one would be a
        # layout for the backends to guess (they guessed differently: a gradient-norm
        # clip under dp x tp came back with its pieces out of order); whole here first
        return None
    if op.attrs.get("dim", "flat") != "flat" and \
            any(isinstance(t.placement(axis), FlatShard) for t in ins):
        # a collective along a dimension of a value held flat on this axis: each device
        # holds a 1-D chunk, which has no such dimension (a tp gather of a gradient that
        # weight-update sharding reduce-scattered flat over dp): whole here first
        return None
    if len(ins) == len(outs):
        return tuple(t.placement(axis) for t in ins)
    return tuple(ins[0].placement(axis) for _ in outs)


def _splits_dim(p: Placement, dim: object) -> bool:
    """Whether ``p`` splits dimension ``dim`` (a flat piece splits every one)."""
    return isinstance(p, FlatShard) or (isinstance(p, Shard) and p.dim == dim)


def same_placements(op: Op, ins, outs, axis: str):
    """Each result is placed as its input (a wait hands values through)."""
    return tuple(t.placement(axis) for t in ins)


def quant(op: Op, ins, outs, axis: str):
    """Quantization works on flat groups. Replicated stays replicated; a flat shard passes
    through (each device quantizes its own groups); with ``pieces`` (one per device of the
    axis) a flat or dim-0 shard quantizes to dim-0 shards of q and scales, and pack, unpack and
    dequantize of dim-0 shards stay dim-0 shards (each device's piece of the payload)."""
    pls = _pls(ins, axis)
    if all(isinstance(q, Replicate) for q in pls):
        return _all_r(outs)
    p = pls[0]
    rest = pls[1:]
    if op.name == "quantize" and "pieces" in op.attrs:
        # a dim-0 shard (even by definition) is chunk j of the flattened tensor, as a flat
        # piece is: either quantizes alone to device j's piece of the payload
        if (isinstance(p, FlatShard) or p == Shard(0)) and \
                all(isinstance(q, Replicate) for q in rest):
            return tuple(Shard(0) for _ in outs)
        return None
    if op.name == "dequantize" and "pieces" in op.attrs:
        return None     # the pieces' padding is dropped: runs on whole payloads only
    if isinstance(p, FlatShard) and all(isinstance(q, (FlatShard, Replicate)) for q in rest):
        return tuple(p for _ in outs)
    if isinstance(p, Shard) and p.dim == 0 and all(q == p for q in rest):
        return tuple(Shard(0) for _ in outs)
    return None


def blockwise(op: Op, ins, outs, axis: str):
    """A transform of contiguous blocks (hadamard): whole stays whole, a dim-0 shard stays
    one, and a flat shard stays one with padding of unknown value (a block that holds
    padding mixes it with real values); the backend checks that a piece holds whole
    blocks."""
    p = _pls(ins, axis)[0]
    if isinstance(p, FlatShard):
        return tuple(FLAT_DIRTY for _ in outs)
    if isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0):
        return tuple(p for _ in outs)
    return None


# rules that speak for themselves: constants take the placement declared for them, and
# collectives and waits are checked against their own semantics
_OWN_RULES = (constant, collective, same_placements, quant, blockwise)


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
        if isinstance(src, Varying):     # per-device payloads: chunk j goes to device j
            return VARYING, ""
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
    if name == "as_shard":
        if not isinstance(src, Varying):
            return None, f"as_shard takes a varying input, found {src}"
        dim = op.attrs["dim"]
        return (FLAT if dim == "flat" else Shard(dim)), ""
    if name == "take_piece":
        if not isinstance(src, Replicate):
            return None, f"take_piece takes a replicated input, found {src}"
        return VARYING, ""
    if name == "as_varying":
        if not isinstance(src, Replicate):
            return None, f"as_varying takes a replicated input, found {src}"
        return VARYING, ""
    if name == "as_partial":
        if not isinstance(src, Replicate):
            return None, f"as_partial takes a replicated input, found {src}"
        return Partial("sum"), ""
    if name in ("send", "recv"):
        return src, ""
    return None, f"{name} is not a collective"
