"""The op vocabulary: one table row per op kind with its category, attributes, shape rule,
cost estimates, sharding rule and sharding facts. Passes look behaviour up here instead of
branching on names; the row type and the questions asked of any op are in ``opdef.py``."""

from __future__ import annotations

import math
from collections.abc import Sequence

from . import shape_rules as R
from . import sharding_rules as S
from . import strategies as T
from .core import Attrs, Op, Value
from .opdef import (ELEMENTWISE, OPS, AttrKind, Category, OpDef, check_attr,
                    draws_from_a_key, is_effectful, is_elementwise, is_local, is_pure,
                    is_view, op_def, random_draw, register_op)
from .types import TensorType

__all__ = ["ELEMENTWISE", "OPS", "AttrKind", "Category", "OpDef", "check_attr",
           "draws_from_a_key", "is_effectful",
           "is_elementwise", "is_local", "is_pure", "is_view", "op_def", "random_draw",
           "register_op"]


def _add(names: str, category: Category, shape_rule, sharding_rule, attrs=None,
         flops: float = 0.0, **kw) -> None:
    for n in names.split():
        register_op(OpDef(n, category, shape_rule, sharding_rule, dict(attrs or {}),
                          flops, **kw))


C, E = Category, S.elementwise
_REDUCE = {"dims": ("ints", True), "keepdim": ("bool", False)}
_COLL = {"axis": ("axis", True)}

# elementwise ------------------------------------------------------------------
_ZERO = {"zero_when": (0,)}     # maps zero to zero
_add("neg copy", C.unary, R.unary, E, flops=1, linear=True, **_ZERO, strategies=T.elementwise)
_add("abs sqrt square relu tanh sin sign floor ceil round expm1 log1p erf", C.unary, R.unary,
     E, flops=1, **_ZERO, strategies=T.elementwise)
_add("exp log rsqrt sigmoid cos reciprocal", C.unary, R.unary, E, flops=1,
     strategies=T.elementwise)
_add("gelu", C.unary, R.unary, E, {"approximate": ("none|tanh", False)}, flops=8,
     strategies=T.elementwise)
_add("integer_pow", C.unary, R.unary, E, {"exponent": ("int", True)}, flops=2, **_ZERO,
     strategies=T.elementwise,
     doc="x ** exponent by repeated multiplication (JAX integer_pow); exponent < 0 divides")
_add("logical_not", C.unary, R.unary_to_bool, E, flops=1, strategies=T.elementwise)
_add("isfinite isnan", C.unary, R.unary_to_bool, E, flops=1, strategies=T.elementwise)
_add("add sub", C.binary, R.scaled_binary, E, {"alpha": ("number", False)}, flops=1,
     zero_when=(0, 1), linear=True, strategies=T.elementwise,
     doc="a + alpha*b (a - alpha*b): the scaled form frameworks compute in one step; "
         "alpha is an attribute, or a third 0-d operand when computed at run time")
_add("max min", C.binary, R.binary, E, flops=1, zero_when=(0, 1), strategies=T.elementwise)
_add("mul", C.binary, R.binary, E, flops=1, linear_in=(0, 1), strategies=T.elementwise)
# mean=true: the frontend made this division as a mean's (jnp.mean's, and its transpose in
# the backward): where its first operand is the sum the mean takes, the second is the
# number of elements that sum adds up, at any batch size
_add("div", C.binary, R.binary, E, {"mean": ("bool", False)}, flops=1, linear_in=(0,),
     strategies=T.elementwise)
_add("pow rem atan2 and or xor", C.binary, R.binary, E, flops=1, strategies=T.elementwise)
_add("eq ne lt le gt ge", C.binary, R.compare, E, flops=1, strategies=T.elementwise)
_add("select", C.ternary, R.select, E, flops=1, zero_when=(1, 2), strategies=T.elementwise)
_add("clamp", C.ternary, R.ternary, E, flops=2, strategies=T.elementwise)
_add("lerp", C.ternary, R.ternary, E, flops=3, zero_when=(0, 1), strategies=T.elementwise,
     doc="a + w*(b - a) where |w| < 0.5, else b - (b - a)*(1 - w)")
_add("addcmul", C.ternary, R.scaled_ternary, E, {"value": ("number", False)}, flops=3,
     zero_when=(0, 1, 2), strategies=T.elementwise,
     doc="s + (value*t1)*t2 (value: attribute or a fourth 0-d operand)")
_add("addcdiv", C.ternary, R.scaled_ternary, E, {"value": ("number", False)}, flops=3,
     strategies=T.elementwise,
     doc="s + (value*t1)/t2 (value: attribute or a fourth 0-d operand)")
_add("convert", C.cast, R.convert, E, {"dtype": ("dtype", True)}, flops=1, **_ZERO,
     strategies=T.elementwise)
_add("bitcast", C.cast, R.bitcast, E, {"dtype": ("dtype", True)}, **_ZERO,
     strategies=T.elementwise)

# reductions and contraction ---------------------------------------------------------
for _name, _kind in (("reduce_sum", "sum"), ("reduce_max", "max"), ("reduce_min", "min"),
                     ("reduce_mean", "avg"), ("reduce_prod", None)):
    _add(_name, C.reduce, R.reduce, S.reduce, _REDUCE, flops=1, partial=_kind,
         strategies=T.reduce)
_add("norm", C.reduce, R.reduce, S.none, {**_REDUCE, "ord": ("number", True)},
     flops=2, strategies=T.reduce, expand=lambda op, ins, names: _expand_norm(op, ins, names),
     doc="the vector norm over dims (ord 2, 1 or inf); a pass that must shard its input "
         "expands it into sums that shard")
_add("argmax argmin", C.reduce, R.arg_reduce, S.none, _REDUCE, flops=1,
     strategies=T.reduce)
_add("dot", C.dot, R.dot, S.none, {"lhs_contract": ("ints", True), "rhs_contract": ("ints", True),
                                   "lhs_batch": ("ints", False), "rhs_batch": ("ints", False)},
     strategies=T.dot)

# layout -------------------------------------------------------------------------------
_add("reshape", C.layout, R.reshape, S.reshape, view=True, strategies=T.reshape)
_add("transpose", C.layout, R.transpose, S.none, {"perm": ("ints", True)}, view=True,
     strategies=T.transpose)
_add("broadcast_in_dim", C.layout, R.broadcast_in_dim, S.none,
     {"dims": ("ints", True)}, view=True, strategies=T.broadcast_in_dim)
_add("slice", C.layout, R.slice_, S.none,
     {"starts": ("ints", True), "limits": ("ints", True), "strides": ("ints", False)},
     view=True, strategies=T.slice_or_pad)
_add("concat", C.layout, R.concat, S.none, {"dim": ("int", True)}, strategies=T.concat)
_add("pad", C.layout, R.pad, S.none,
     {"low": ("ints", True), "high": ("ints", True), "value": ("number", False)},
     strategies=T.slice_or_pad)

# indexing ---------------------------------------------------------------------------------
_add("index_select", C.index, R.index_select, S.none, {"axis": ("int", True)},
     strategies=T.index_select)
_add("index_add", C.index, R.index_add, S.none, {"axis": ("int", True)}, flops=1,
     strategies=T.index_add)
_add("gather", C.index, R.gather, S.none, {"dim": ("int", True)},
     strategies=T.gather_scatter)
_add("scatter_add", C.index, R.scatter_add, S.none, {"dim": ("int", True)}, flops=1,
     strategies=T.gather_scatter)

# constants and random numbers -------------------------------------------------------------
_add("full", C.constant, R.full, S.constant, {"value": ("number", True)}, strategies=T.constant)
_add("literal", C.constant, R.literal, S.constant, {"data": ("any", True)})
_add("iota", C.constant, R.iota, S.constant, {"dim": ("int", True)}, strategies=T.constant)
_RNG = {"seed": ("int", False)}
_add("rng_uniform", C.rng, R.rng, S.none,
     {**_RNG, "low": ("number", False), "high": ("number", False)}, flops=1)
_add("rng_normal", C.rng, R.rng, S.none,
     {**_RNG, "mean": ("number", False), "std": ("number", False)}, flops=1)
_add("rng_bernoulli", C.rng, R.rng, S.none, {**_RNG, "p": ("number", True)}, flops=1)

# collectives --------------------------------------------------------------------------------
# all_reduce, reduce_scatter and all_gather may carry a bucket: k inputs and k results, moved
# as one packed buffer (a device's piece of the bucket is its pieces of the members, packed)
_ASYNC = {"async": ("bool", False)}
_add("all_reduce", C.collective, R.same_as_inputs, S.collective,
     {**_COLL, **_ASYNC, "op": ("reduce", True)}, flops=1)
_add("reduce_scatter", C.collective, R.same_as_inputs, S.collective,
     {**_COLL, **_ASYNC, "op": ("reduce", True), "dim": ("dim_or_flat", True)}, flops=1)
_add("all_gather", C.collective, R.same_as_inputs, S.collective,
     {**_COLL, **_ASYNC, "dim": ("dim_or_flat", True)})
_add("wait", C.sync, R.same_as_inputs, S.same_placements,
     doc="the results of an async collective, usable from here on (issue early, wait late)")
_add("all_to_all", C.collective, R.same_as_inputs, S.collective,
     {**_COLL, **_ASYNC, "from_dim": ("int", True), "to_dim": ("int", True),
      "local": ("int", False),
      "level": ("local|node", False)},
     doc="local=L, level=local|node: the axis's N devices as N/L nodes of L consecutive "
         "devices; the exchange runs among one node's devices (local) or among the devices "
         "with the same place in their node (node)")
_add("broadcast", C.collective, R.same_as_input, S.collective, {**_COLL, "root": ("int", True)})
_add("take_shard", C.collective, R.same_as_input, S.collective,
     {**_COLL, "dim": ("dim_or_flat", True)}, local=True,
     doc="the local piece of a replicated tensor: a slice, no communication")
_add("as_partial", C.collective, R.same_as_input, S.collective, _COLL, local=True,
     doc="a replicated value as a partial sum: device 0 of the axis keeps it, the others "
         "hold zeros (no communication; a row-parallel layer's bias, added once)")
_add("as_varying", C.collective, R.same_as_input, S.collective, _COLL, local=True,
     doc="a replicated value as a per-device one (no communication: every device starts "
         "from the same value; a scan's carry that its body makes per device)")
_add("take_piece", C.collective, R.take_piece, S.collective, {**_COLL, "dim": ("int", True)},
     local=True,
     doc="this device's piece along dim of a whole value, as its own per-device value of the "
         "piece's shape (no communication): a random draw made at the global batch's shape, "
         "of which each device keeps its rows")
_add("as_shard", C.collective, R.as_shard, S.collective, {**_COLL, "dim": ("dim_or_flat", True)},
     local=True,
     doc="each device's varying value as its piece of a sharded value (the piece is its "
         "first elements, a flat piece's padding set to zero; no communication): what a "
         "pass that reduces by hand returns")
# a pipeline's point-to-point pairs: peer is the other end's index on the axis; tag pairs
# a send with its recv (several values may cross between two stages)
_P2P = {**_COLL, "peer": ("int", True), "tag": ("int", False)}
_add("send", C.collective, R.send, S.collective, _P2P, effectful=True)
_add("recv", C.collective, R.recv, S.collective, _P2P, effectful=True)
# a pipelined step's total over its microbatches, which the pipeline runtime makes: a
# count's sums over the batch's rows, run on every microbatch before the schedule starts
_add("microbatch_sum", C.sync, R.same_as_input, S.same_placements, {"op": ("reduce", True)},
     doc="the input's value added up (op=sum) or averaged (op=avg) over the step's "
         "microbatches, before any of them runs forward (passes/global_counts.py: the "
         "batch's count, which each microbatch's mean divides by); a pipeline runtime "
         "makes it, running what the input is made of on each microbatch first")

# quantization ---------------------------------------------------------------------------------
_Q = {"bits": ("int", True), "group_size": ("int", True), "pieces": ("int", False)}
_add("quantize", C.quant, R.quantize, S.quant,
     {**_Q, "rounding": ("nearest|stochastic", False),
      "scheme": ("symmetric|asymmetric", False), "hadamard": ("int", False)}, flops=4,
     doc="x -> (q, scales[, zeros]) per group of group_size values of the flattened x; "
         "symmetric: scale = absmax / (2^(bits-1) - 1); stochastic rounding draws from its "
         "key input (the same key gives the same rounding); pieces=N: the flat layout of "
         "N equal chunks, each padded to whole groups; hadamard=B: the orthonormal Hadamard "
         "transform of each B-block of that layout first (TLq-HS)")
_add("dequantize", C.quant, R.dequantize, S.quant, {**_Q, "dtype": ("dtype", True)}, flops=2,
     doc="q * scale per group (with pieces: the padding dropped, the declared shape)")
_add("pack", C.quant, R.pack, S.quant, {"bits": ("int", True)}, flops=1,
     doc="bits-bit integers into bytes (two 4-bit values per byte, low nibble first)")
_add("unpack", C.quant, R.unpack, S.quant, {"bits": ("int", True), "dtype": ("dtype", True)},
     flops=1, doc="the inverse of pack")
_add("hadamard", C.quant, R.hadamard, S.blockwise, {"block": ("int", False)}, flops=64,
     doc="the orthonormal Sylvester Hadamard transform (H/sqrt(block)) of each contiguous "
         "block of the flattened tensor (block 32 by default); its own inverse")
_add("rng_next", C.rng, R.rng_next, S.none, {},
     doc="the next key of a key (one key per step, carried as step state)")

# control flow (nested regions) ------------------------------------------------------------------
_add("call", C.control, None, S.none, {"callee": ("str", False)},
     region_rule=R.check_call)
_add("cond", C.control, None, S.none, region_rule=R.check_cond)
_add("while", C.control, None, S.none, region_rule=R.check_while)
_add("scan", C.control, None, S.none,
     {"length": ("int", True), "num_carry": ("int", True), "num_consts": ("int", False),
      "reverse": ("bool", False), "unroll": ("int", False)}, region_rule=R.check_scan)

# everything else ---------------------------------------------------------------------------------
_add("opaque", C.opaque, None, S.none,
     {"target": ("str", True), "effectful": ("bool", False), "rng": ("global|key", False),
      "view": ("bool", False)}, open_attrs=True,
     doc="a framework op kept whole; its frontend marks random draws (rng) and views")


def _expand_norm(op: Op, ins: Sequence[TensorType], names) -> list[Op] | None:
    """norm as elementwise math and a sum or max, whose sharding rules split it into partial
    results (not bit-exact with a framework's fused kernel: the summation order differs)."""
    x, out = ins[0], op.result
    red = {k: op.attrs[k] for k in ("dims", "keepdim") if k in op.attrs}
    ordv = op.attrs["ord"]
    common = {"phase": op.phase, "stage": op.stage, "microbatch": op.microbatch, "loc": op.loc}
    one = TensorType(x.shape, x.dtype)
    red_t = TensorType(out.type.shape, out.type.dtype)
    if ordv == 2:
        sq, s = names(f"{out.name}.sq"), names(f"{out.name}.sumsq")
        return [Op("square", (op.inputs[0],), (Value(sq, one),), **common),
                Op("reduce_sum", (sq,), (Value(s, red_t),), Attrs(red), **common),
                Op("sqrt", (s,), (Value(out.name, red_t),), **common)]
    if ordv in (1, math.inf):
        a = names(f"{out.name}.abs")
        kind = "reduce_sum" if ordv == 1 else "reduce_max"
        return [Op("abs", (op.inputs[0],), (Value(a, one),), **common),
                Op(kind, (a,), (Value(out.name, red_t),), Attrs(red), **common)]
    return None
