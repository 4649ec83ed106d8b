"""The op vocabulary: one table row per op kind with its category, attributes, shape rule,
cost estimates and sharding rule. Passes look behaviour up here instead of branching on names."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..errors import UnknownOpError
from . import shape_rules as R
from . import sharding_rules as S
from .core import Attrs, Op, Value
from .types import REDUCE_OPS, DType, TensorType


class Category(enum.Enum):
    """What kind of computation an op is; passes reason by category."""

    unary = "unary"
    binary = "binary"
    ternary = "ternary"
    cast = "cast"
    reduce = "reduce"
    dot = "dot"
    layout = "layout"
    index = "index"
    constant = "constant"
    rng = "rng"
    collective = "collective"
    sync = "sync"
    quant = "quant"
    control = "control"
    opaque = "opaque"


ELEMENTWISE = frozenset({Category.unary, Category.binary, Category.ternary, Category.cast})

# Attribute kinds: how the verifier checks an attribute's value.
AttrKind = str  # int, ints, number, bool, str, dtype, axis, reduce, dim_or_flat, any, or a|b|c


@dataclass(frozen=True)
class OpDef:
    """One row of the op table."""

    name: str
    category: Category
    shape_rule: Callable | None
    sharding_rule: S.ShardingRule
    attrs: dict[str, tuple[AttrKind, bool]] = field(default_factory=dict)  # (kind, required)
    flops_per_elem: float = 0.0     # per result element (elementwise) or per input (reduce)
    effectful: bool = False         # never removed or merged (send/recv)
    deterministic: bool = True      # False: two identical ops may differ (unkeyed rng)
    open_attrs: bool = False        # accepts attributes not listed (opaque)
    region_rule: Callable | None = None
    expand: Callable | None = None  # (op, input types, names) -> equivalent simpler ops
    doc: str = ""

    def flops(self, op: Op, ins: Sequence[TensorType], outs: Sequence[TensorType]) -> int:
        """Floating-point operations of one execution (logical, whole tensors)."""
        if self.category is Category.dot:
            lhs, rhs = ins
            lb, _, lc, _, lf, rf = R.dot_dims(op.attrs, lhs.rank, rhs.rank)
            k = math.prod(lhs.shape[i] for i in lc)
            return 2 * outs[0].numel * k
        if self.category is Category.reduce:
            return int(self.flops_per_elem * ins[0].numel)
        if self.category is Category.control:
            return 0  # counted on the region ops
        return int(self.flops_per_elem * sum(t.numel for t in outs))

    def bytes_accessed(self, op: Op, ins: Sequence[TensorType],
                       outs: Sequence[TensorType]) -> int:
        """Bytes read and written by one execution (logical, whole tensors)."""
        if self.category is Category.control:
            return 0
        return sum(t.nbytes for t in ins) + sum(t.nbytes for t in outs)

    def comm_bytes(self, op: Op, ins: Sequence[TensorType], outs: Sequence[TensorType],
                   axis_size: int) -> int:
        """Bytes one device sends for a collective (ring algorithms); 0 for other ops."""
        if self.category is not Category.collective or axis_size <= 1:
            return 0
        n = axis_size
        frac = (n - 1) / n
        axis = {str(op.attrs.get("axis")): n}
        if self.name == "all_reduce":
            return int(2 * frac * sum(t.nbytes for t in ins))
        if self.name == "reduce_scatter":
            # the padded whole: n pieces of the results' local size
            return int(frac * n * sum(t.local_nbytes(axis) for t in outs))
        if self.name == "all_to_all":
            return int(frac * ins[0].nbytes)
        if self.name == "all_gather":
            return int(frac * n * sum(t.local_nbytes(axis) for t in ins))
        if self.name == "broadcast":   # a pipelined ring: all but the last rank forward
            return int(frac * ins[0].nbytes)
        if self.name == "send":
            return ins[0].nbytes
        return 0


OPS: dict[str, OpDef] = {}


def register_op(opdef: OpDef) -> OpDef:
    """Add an op kind to the vocabulary (also for extensions); names are unique."""
    if opdef.name in OPS:
        raise ValueError(f"op {opdef.name!r} is already registered")
    OPS[opdef.name] = opdef
    return opdef


def op_def(name: str) -> OpDef:
    """The table row of an op kind; UnknownOpError naming close matches otherwise."""
    try:
        return OPS[name]
    except KeyError:
        import difflib
        close = difflib.get_close_matches(name, OPS, n=3)
        hint = f"did you mean {', '.join(close)}?" if close else \
            "use `opaque {target=...}` for an op outside the vocabulary"
        raise UnknownOpError(f"unknown op {name!r}", hint=hint) from None


def is_elementwise(name: str) -> bool:
    """True for unary, binary, ternary and cast ops."""
    return op_def(name).category in ELEMENTWISE


def _add(names: str, category: Category, shape_rule, sharding_rule, attrs=None,
         flops: float = 0.0, **kw) -> None:
    for n in names.split():
        register_op(OpDef(n, category, shape_rule, sharding_rule, dict(attrs or {}),
                          flops, **kw))


C, E = Category, S.elementwise
_REDUCE = {"dims": ("ints", True), "keepdim": ("bool", False)}
_COLL = {"axis": ("axis", True)}

# elementwise ------------------------------------------------------------------
_add("neg abs exp log log1p expm1 sqrt rsqrt tanh sigmoid relu sin cos erf sign floor ceil "
     "round reciprocal square copy", C.unary, R.unary, E, flops=1)
_add("gelu", C.unary, R.unary, E, {"approximate": ("none|tanh", False)}, flops=8)
_add("integer_pow", C.unary, R.unary, E, {"exponent": ("int", True)}, flops=2,
     doc="x ** exponent by repeated multiplication (JAX integer_pow); exponent < 0 divides")
_add("logical_not", C.unary, R.unary_to_bool, E, flops=1)
_add("isfinite isnan", C.unary, R.unary_to_bool, E, flops=1)
_add("add sub", C.binary, R.scaled_binary, E, {"alpha": ("number", False)}, flops=1,
     doc="a + alpha*b (a - alpha*b): the scaled form frameworks compute in one step; "
         "alpha is an attribute, or a third 0-d operand when computed at run time")
_add("mul div pow max min rem atan2 and or xor", C.binary, R.binary, E, flops=1)
_add("eq ne lt le gt ge", C.binary, R.compare, E, flops=1)
_add("select", C.ternary, R.select, E, flops=1)
_add("clamp", C.ternary, R.ternary, E, flops=2)
_add("lerp", C.ternary, R.ternary, E, flops=3,
     doc="a + w*(b - a) where |w| < 0.5, else b - (b - a)*(1 - w)")
_add("addcmul", C.ternary, R.scaled_ternary, E, {"value": ("number", False)}, flops=3,
     doc="s + (value*t1)*t2 (value: attribute or a fourth 0-d operand)")
_add("addcdiv", C.ternary, R.scaled_ternary, E, {"value": ("number", False)}, flops=3,
     doc="s + (value*t1)/t2 (value: attribute or a fourth 0-d operand)")
_add("convert", C.cast, R.convert, E, {"dtype": ("dtype", True)}, flops=1)
_add("bitcast", C.cast, R.bitcast, E, {"dtype": ("dtype", True)})

# reductions and contraction ---------------------------------------------------------
_add("reduce_sum reduce_max reduce_min reduce_mean reduce_prod", C.reduce, R.reduce, S.reduce,
     _REDUCE, flops=1)
_add("norm", C.reduce, R.reduce, S.replicate_only, {**_REDUCE, "ord": ("number", True)},
     flops=2, expand=lambda op, ins, names: _expand_norm(op, ins, names),
     doc="the vector norm over dims (ord 2, 1 or inf); a pass that must shard its input "
         "expands it into sums that shard")
_add("argmax argmin", C.reduce, R.arg_reduce, S.replicate_only, _REDUCE, flops=1)
_add("dot", C.dot, R.dot, S.dot, {"lhs_contract": ("ints", True), "rhs_contract": ("ints", True),
                                   "lhs_batch": ("ints", False), "rhs_batch": ("ints", False)})

# layout -------------------------------------------------------------------------------
_add("reshape", C.layout, R.reshape, S.reshape)
_add("transpose", C.layout, R.transpose, S.transpose, {"perm": ("ints", True)})
_add("broadcast_in_dim", C.layout, R.broadcast_in_dim, S.broadcast_in_dim,
     {"dims": ("ints", True)})
_add("slice", C.layout, R.slice_, S.slice_or_pad,
     {"starts": ("ints", True), "limits": ("ints", True), "strides": ("ints", False)})
_add("concat", C.layout, R.concat, S.concat, {"dim": ("int", True)})
_add("pad", C.layout, R.pad, S.slice_or_pad,
     {"low": ("ints", True), "high": ("ints", True), "value": ("number", False)})

# indexing ---------------------------------------------------------------------------------
_add("index_select", C.index, R.index_select, S.index_select, {"axis": ("int", True)})
_add("index_add", C.index, R.index_add, S.index_add, {"axis": ("int", True)}, flops=1)
_add("gather", C.index, R.gather, S.gather_scatter, {"dim": ("int", True)})
_add("scatter_add", C.index, R.scatter_add, S.gather_scatter, {"dim": ("int", True)}, flops=1)

# constants and random numbers -------------------------------------------------------------
_add("full", C.constant, R.full, S.constant, {"value": ("number", True)})
_add("literal", C.constant, R.literal, S.constant, {"data": ("any", True)})
_add("iota", C.constant, R.iota, S.constant, {"dim": ("int", True)})
_RNG = {"seed": ("int", False)}
_add("rng_uniform", C.rng, R.rng, S.replicate_only,
     {**_RNG, "low": ("number", False), "high": ("number", False)}, flops=1)
_add("rng_normal", C.rng, R.rng, S.replicate_only,
     {**_RNG, "mean": ("number", False), "std": ("number", False)}, flops=1)
_add("rng_bernoulli", C.rng, R.rng, S.replicate_only, {**_RNG, "p": ("number", True)}, flops=1)

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
_add("all_to_all", C.collective, R.same_as_input, S.collective,
     {**_COLL, "from_dim": ("int", True), "to_dim": ("int", True)})
_add("broadcast", C.collective, R.same_as_input, S.collective, {**_COLL, "root": ("int", True)})
_add("take_shard", C.collective, R.same_as_input, S.collective,
     {**_COLL, "dim": ("dim_or_flat", True)},
     doc="the local piece of a replicated tensor: a slice, no communication")
_add("send", C.collective, R.send, S.collective, {**_COLL, "peer": ("int", True)},
     effectful=True)
_add("recv", C.collective, R.recv, S.collective, {**_COLL, "peer": ("int", True)},
     effectful=True)

# quantization ---------------------------------------------------------------------------------
_Q = {"bits": ("int", True), "group_size": ("int", True)}
_add("quantize", C.quant, R.quantize, S.quant,
     {**_Q, "rounding": ("nearest|stochastic", False),
      "scheme": ("symmetric|asymmetric", False)}, flops=4)
_add("dequantize", C.quant, R.dequantize, S.quant, {**_Q, "dtype": ("dtype", True)}, flops=2)
_add("pack", C.quant, R.pack, S.quant, {"bits": ("int", True)}, flops=1)
_add("unpack", C.quant, R.unpack, S.quant, {"bits": ("int", True), "dtype": ("dtype", True)},
     flops=1)

# control flow (nested regions) ------------------------------------------------------------------
_add("call", C.control, None, S.replicate_only, {"callee": ("str", False)},
     region_rule=R.check_call)
_add("cond", C.control, None, S.replicate_only, region_rule=R.check_cond)
_add("while", C.control, None, S.replicate_only, region_rule=R.check_while)
_add("scan", C.control, None, S.replicate_only,
     {"length": ("int", True), "num_carry": ("int", True), "num_consts": ("int", False),
      "reverse": ("bool", False), "unroll": ("int", False)}, region_rule=R.check_scan)

# everything else ---------------------------------------------------------------------------------
_add("opaque", C.opaque, None, S.replicate_only,
     {"target": ("str", True), "effectful": ("bool", False)}, open_attrs=True)


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


def is_effectful(op: Op) -> bool:
    """True when an op must not be removed or merged even if its results are unused."""
    d = op_def(op.name)
    return d.effectful or bool(op.attrs.get("effectful", False)) or any(
        is_effectful(o) for r in op.regions for o in r.ops)


def is_pure(op: Op) -> bool:
    """True when two identical ops give identical results (safe to merge)."""
    d = op_def(op.name)
    if is_effectful(op) or not d.deterministic:
        return False
    if d.category is Category.rng:
        return bool(op.inputs) or "seed" in op.attrs  # an unkeyed, unseeded draw is fresh
    return True


def check_attr(kind: AttrKind, value, axes: Sequence[str]) -> str | None:
    """None when ``value`` fits ``kind``, else what was expected."""
    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)
    if kind == "int":
        return None if is_int(value) else "an int"
    if kind == "ints":
        ok = isinstance(value, tuple) and all(is_int(v) and v >= 0 for v in value)
        return None if ok else "a list of ints >= 0, e.g. [0, 1]"
    if kind == "number":
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) \
            else "a number"
    if kind == "bool":
        return None if isinstance(value, bool) else "true or false"
    if kind == "str":
        return None if isinstance(value, str) else "a string"
    if kind == "dtype":
        ok = isinstance(value, str) and value in DType._value2member_map_
        return None if ok else "a dtype (" + ", ".join(d.value for d in DType) + ")"
    if kind == "axis":
        return None if value in axes else \
            f"a mesh axis ({', '.join(axes) if axes else 'the graph has no mesh'})"
    if kind == "reduce":
        return None if value in REDUCE_OPS else "one of " + ", ".join(REDUCE_OPS)
    if kind == "dim_or_flat":
        return None if (is_int(value) and value >= 0) or value == "flat" else \
            "a dimension (int) or flat"
    if kind == "any":
        return None
    choices = kind.split("|")
    return None if value in choices else "one of " + ", ".join(choices)
