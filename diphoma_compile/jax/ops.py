"""The one table between JAX and the IR, both ways: which jaxpr primitives become which
neutral op, and how the backend emits each neutral op back as ``jax.lax`` calls.

Each row of ``TABLE`` is one neutral op. Its ``to_ir`` converter looks at one jaxpr
equation of the row's primitives and either emits neutral ops and returns their result
names, or returns None when this use of the primitive has no exact neutral form (a
non-default precision, accuracy or sharding, a dtype the op does not take); the frontend
then keeps the equation as ``opaque{target="jax:<name>", ...params}``. Its ``to_lax``
emitter takes the op, its input arrays (tracers under jit) and its declared result types,
and returns the result arrays. Rows with no primitives are ops other frontends produce
(the PyTorch frontend's relu, lerp, addcmul, ...), which the JAX backend runs as well.

A neutral form is *exact* when the emitter binds the very primitive (and parameters) the
converter read, or one that lowers to the same XLA: that is what makes trace + backend
bit-identical to the user's jitted step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax import lax

from ..errors import BackendError
from ..ir.core import Op
from ..ir.types import DType, TensorType
from .dtypes import ir_dtype, numpy_dtype
from .params import is_trivial_sharding


@dataclass
class EqnView:
    """What a converter sees of one equation: parameters, operand names and types."""

    primitive: str
    params: Mapping[str, Any]
    inputs: list[str]                      # IR value names (literals already materialized)
    in_types: list[TensorType]
    out_types: list[TensorType]
    literals: list[Any]                    # the Python value of each literal operand, or None
    emit: Callable[[str, list[str], dict[str, Any], list[TensorType]], list[str]]


# (the equation, the row's neutral op) -> result names, or None to keep it opaque
Converter = Callable[[EqnView, str], "list[str] | None"]
# (the op, its input arrays, its result types) -> result arrays
Emitter = Callable[[Op, list, Sequence[TensorType]], list]

# Parameters JAX adds for features the neutral ops do not express; a converter accepts the
# equation only when each has its default value.
_DEFAULTS: dict[str, Any] = {"accuracy": None, "sharding": None, "out_sharding": None,
                             "out_dtype": None}
_SHARDINGS = ("sharding", "out_sharding")


def _ints(xs: Any) -> list[int]:
    # jaxpr parameters sometimes hold numpy integers; attributes hold Python ints.
    return [int(x) for x in xs]


def _defaults_only(params: Mapping[str, Any], consumed: tuple[str, ...] = ()) -> bool:
    for k, v in params.items():
        if k in consumed:
            continue
        if k in _SHARDINGS and is_trivial_sharding(v):
            continue  # JAX writes "not sharded" as None or as a sharding over no mesh
        if k not in _DEFAULTS or v is not _DEFAULTS[k]:
            return False
    return True


_BOOL_RESULT = {"eq", "ne", "lt", "le", "gt", "ge", "isfinite", "isnan", "logical_not"}


def same(e: EqnView, op: str) -> list[str] | None:
    """Converter of a primitive that is the neutral op ``op`` when its parameters are defaults."""
    if not _defaults_only(e.params):
        return None
    if op not in _BOOL_RESULT and e.in_types and \
            any(t.dtype is not e.in_types[0].dtype for t in e.out_types):
        return None   # abs of a complex number is real: not the neutral op; stays opaque
    return e.emit(op, e.inputs, {}, e.out_types)


@dataclass(frozen=True)
class Row:
    """One neutral op both ways: the primitives that become it and the lax calls it becomes."""

    op: str                      # the neutral IR op
    primitives: tuple[str, ...]  # jaxpr primitives converted to it (none: other frontends')
    to_lax: Emitter              # backend: the op as jax.lax calls
    to_ir: Converter = same      # frontend: one equation of those primitives as the op

    def convert(self, e: EqnView) -> list[str] | None:
        """The equation as this op (its result names), or None when it has no exact form."""
        return self.to_ir(e, self.op)


# ---------------------------------------------------------------- elementwise

def _broadcast(args: list, out: TensorType) -> list:
    """Operands as JAX's elementwise primitives take them: those broadcast scalars and
    size-1 dims of equal rank themselves; lower ranks get leading 1-dims (NumPy rules)."""
    return [a if np.ndim(a) in (0, out.rank) else
            lax.expand_dims(a, tuple(range(out.rank - np.ndim(a)))) for a in args]


def _to_shape(a: Any, out: TensorType, scalar_ok: bool = False) -> Any:
    """An operand broadcast to the result's shape, for primitives that take one shape only
    (select_n's cases, clamp's operand); a 0-d operand stays 0-d where ``scalar_ok``. An
    operand that has the shape already is passed as it is: the frontend's own equations
    bind the very primitive they were read from."""
    shape = tuple(np.shape(a))
    if shape == out.shape or (scalar_ok and shape == ()):
        return a
    return lax.broadcast_in_dim(a, out.shape, tuple(range(out.rank - len(shape), out.rank)))


def _nary(fn: Callable) -> Emitter:
    return lambda op, ins, outs: [fn(*_broadcast(list(ins), outs[0]))]


def _unary(fn: Callable) -> Emitter:
    return lambda op, ins, outs: [fn(ins[0])]


def _to_ir_integer_pow(e: EqnView, op: str) -> list[str] | None:
    if not _defaults_only(e.params, ("y",)):
        return None
    # Not `square` for y=2: square lowers to chlo.square, integer_pow to a multiply.
    return e.emit(op, e.inputs, {"exponent": int(e.params["y"])}, e.out_types)


def _to_lax_integer_pow(op: Op, ins: list, outs: Sequence[TensorType]) -> list:
    return [lax.integer_pow(ins[0], op.attrs["exponent"])]


def _to_ir_logical_not(e: EqnView, op: str) -> list[str] | None:
    # On integers `not` is bitwise; the neutral op is the boolean one.
    if e.in_types[0].dtype is not DType.bool:
        return None
    return same(e, op)


def _to_ir_pow(e: EqnView, op: str) -> list[str] | None:
    if not _defaults_only(e.params):
        return None
    x, y = e.in_types
    if x.dtype is y.dtype:
        return e.emit(op, e.inputs, {}, e.out_types)
    # pow(float, int) lowers to convert + power: the same two ops, made explicit.
    (yf,) = e.emit("convert", [e.inputs[1]], {"dtype": x.dtype.value},
                   [TensorType(y.shape, x.dtype)])
    return e.emit(op, [e.inputs[0], yf], {}, e.out_types)


def _to_ir_select(e: EqnView, op: str) -> list[str] | None:
    # select_n(which, case0, case1) picks case1 where `which` is true; neutral
    # select(pred, a, b) picks a where pred is true: swap the cases.
    if len(e.inputs) != 3 or e.in_types[0].dtype is not DType.bool or e.params:
        return None
    p, c0, c1 = e.inputs
    return e.emit(op, [p, c1, c0], {}, e.out_types)


def _to_lax_select(op: Op, ins: list, outs: Sequence[TensorType]) -> list:
    p, a, b = ins
    p = _to_shape(p, outs[0], scalar_ok=True)
    a, b = _to_shape(a, outs[0]), _to_shape(b, outs[0])
    return [lax.select_n(p, b, a)]  # select picks a where p; select_n picks case 1 where p


def _to_ir_clamp(e: EqnView, op: str) -> list[str] | None:
    if e.params:
        return None
    lo, x, hi = e.inputs  # JAX order: clamp(min, x, max)
    return e.emit(op, [x, lo, hi], {}, e.out_types)


def _to_lax_clamp(op: Op, ins: list, outs: Sequence[TensorType]) -> list:
    x, lo, hi = ins
    return [lax.clamp(_to_shape(lo, outs[0], scalar_ok=True), _to_shape(x, outs[0]),
                      _to_shape(hi, outs[0], scalar_ok=True))]


# ---------------------------------------------------------------- casts

def _to_ir_convert(e: EqnView, op: str) -> list[str] | None:
    if not _defaults_only(e.params, ("new_dtype", "weak_type")):
        return None
    dt = ir_dtype(e.params["new_dtype"])
    if dt is DType.key or e.in_types[0].dtype is DType.key:
        return None
    return e.emit(op, e.inputs, {"dtype": dt.value}, e.out_types)


def _to_lax_convert(op: Op, ins: list, outs: Sequence[TensorType]) -> list:
    return [lax.convert_element_type(ins[0], numpy_dtype(outs[0].dtype))]


def _to_ir_bitcast(e: EqnView, op: str) -> list[str] | None:
    if not _defaults_only(e.params, ("new_dtype",)):
        return None
    src, dst = e.in_types[0], e.out_types[0]
    if src.shape != dst.shape or src.dtype.itemsize != dst.dtype.itemsize:
        return None  # a bitcast that changes the shape is outside the neutral op
    return e.emit(op, e.inputs, {"dtype": dst.dtype.value}, e.out_types)


def _to_lax_bitcast(op: Op, ins: list, outs: Sequence[TensorType]) -> list:
    return [lax.bitcast_convert_type(ins[0], numpy_dtype(outs[0].dtype))]


# ---------------------------------------------------------------- reductions and contraction

def _to_ir_reduce(e: EqnView, op: str) -> list[str] | None:
    if not _defaults_only(e.params, ("axes",)):
        return None
    return e.emit(op, e.inputs, {"dims": sorted(int(a) for a in e.params["axes"])},
                  e.out_types)


def _reduction(fn: Callable) -> Emitter:
    def emit(op: Op, ins: list, outs: Sequence[TensorType]) -> list:
        dims = tuple(op.attrs["dims"])
        r = fn(ins[0], dims)
        return [lax.reshape(r, outs[0].shape) if op.attrs.get("keepdim", False) else r]
    return emit


def _reduce_mean(x: Any, dims: tuple[int, ...]) -> Any:
    n = int(np.prod([np.shape(x)[d] for d in dims]))
    return lax.div(lax.reduce_sum(x, dims), np.array(n, x.dtype))


def _to_lax_norm(op: Op, ins: list, outs: Sequence[TensorType]) -> list:
    dims, x, o = tuple(op.attrs["dims"]), ins[0], op.attrs["ord"]
    if o == 2:
        r = lax.sqrt(lax.reduce_sum(lax.mul(x, x), dims))
    elif o == 1:
        r = lax.reduce_sum(lax.abs(x), dims)
    elif o == float("inf"):
        r = lax.reduce_max(lax.abs(x), dims)
    else:
        raise BackendError(f"the JAX backend has no lowering for norm of ord {o}")
    return [lax.reshape(r, outs[0].shape) if op.attrs.get("keepdim", False) else r]


def _to_ir_arg_reduce(e: EqnView, op: str) -> list[str] | None:
    # The neutral argmax gives i64; with JAX's default 32-bit indices it stays opaque.
    if not _defaults_only(e.params, ("axes", "index_dtype")) or \
            np.dtype(e.params["index_dtype"]) != np.int64:
        return None
    return e.emit(op, e.inputs, {"dims": _ints(e.params["axes"])}, e.out_types)


def _arg_reduction(fn: Callable) -> Emitter:
    def emit(op: Op, ins: list, outs: Sequence[TensorType]) -> list:
        (d,) = op.attrs["dims"]
        r = fn(ins[0], d, numpy_dtype(outs[0].dtype))
        return [lax.reshape(r, outs[0].shape) if op.attrs.get("keepdim", False) else r]
    return emit


def _to_ir_dot(e: EqnView, op: str) -> list[str] | None:
    if not _defaults_only(e.params, ("dimension_numbers", "precision",
                                     "preferred_element_type")):
        return None
    if e.params["precision"] is not None:
        return None
    lhs, rhs = e.in_types
    out = e.out_types[0]
    pref = e.params["preferred_element_type"]
    if lhs.dtype is not rhs.dtype or out.dtype is not lhs.dtype or \
            (pref is not None and ir_dtype(pref) is not out.dtype):
        return None  # mixed precision accumulation is not the neutral dot
    (lc, rc), (lb, rb) = e.params["dimension_numbers"]
    attrs = {"lhs_contract": _ints(lc), "rhs_contract": _ints(rc)}
    if lb:
        attrs.update(lhs_batch=_ints(lb), rhs_batch=_ints(rb))
    return e.emit(op, e.inputs, attrs, e.out_types)


def _to_lax_dot(op: Op, ins: list, outs: Sequence[TensorType]) -> list:
    a = op.attrs
    dims = ((tuple(a["lhs_contract"]), tuple(a["rhs_contract"])),
            (tuple(a.get("lhs_batch", ())), tuple(a.get("rhs_batch", ()))))
    # jnp.dot and flax ask for the result dtype explicitly; binding the same parameter keeps
    # the equation identical to the user's.
    return [lax.dot_general(ins[0], ins[1], dims,
                            preferred_element_type=numpy_dtype(outs[0].dtype))]


# ---------------------------------------------------------------- layout

def _to_ir_reshape(e: EqnView, op: str) -> list[str] | None:
    if e.primitive == "squeeze":
        # squeeze lowers to an XLA reshape, exactly what the neutral reshape emits.
        if not _defaults_only(e.params, ("dimensions",)):
            return None
    elif not _defaults_only(e.params, ("new_sizes", "dimensions")) or \
            e.params["dimensions"] is not None:
        return None
    return e.emit(op, e.inputs, {}, e.out_types)


def _to_lax_reshape(op: Op, ins: list, outs: Sequence[TensorType]) -> list:
    return [lax.reshape(ins[0], outs[0].shape)]


def _to_ir_transpose(e: EqnView, op: str) -> list[str] | None:
    if not _defaults_only(e.params, ("permutation",)):
        return None
    return e.emit(op, e.inputs, {"perm": _ints(e.params["permutation"])}, e.out_types)


def _to_lax_transpose(op: Op, ins: list, outs: Sequence[TensorType]) -> list:
    return [lax.transpose(ins[0], tuple(op.attrs["perm"]))]


def _to_ir_broadcast_in_dim(e: EqnView, op: str) -> list[str] | None:
    if not _defaults_only(e.params, ("shape", "broadcast_dimensions")) or len(e.inputs) != 1:
        return None  # extra operands are dynamic shapes
    return e.emit(op, e.inputs, {"dims": _ints(e.params["broadcast_dimensions"])},
                  e.out_types)


def _to_lax_broadcast_in_dim(op: Op, ins: list, outs: Sequence[TensorType]) -> list:
    return [lax.broadcast_in_dim(ins[0], outs[0].shape, tuple(op.attrs["dims"]))]


def _to_ir_slice(e: EqnView, op: str) -> list[str] | None:
    if not _defaults_only(e.params, ("start_indices", "limit_indices", "strides")):
        return None
    attrs: dict[str, Any] = {"starts": _ints(e.params["start_indices"]),
                             "limits": _ints(e.params["limit_indices"])}
    if e.params["strides"] is not None:
        attrs["strides"] = _ints(e.params["strides"])
    return e.emit(op, e.inputs, attrs, e.out_types)


def _to_lax_slice(op: Op, ins: list, outs: Sequence[TensorType]) -> list:
    strides = op.attrs.get("strides")
    return [lax.slice(ins[0], tuple(op.attrs["starts"]), tuple(op.attrs["limits"]),
                      None if strides is None else tuple(strides))]


def _to_ir_concat(e: EqnView, op: str) -> list[str] | None:
    if not _defaults_only(e.params, ("dimension",)):
        return None
    return e.emit(op, e.inputs, {"dim": int(e.params["dimension"])}, e.out_types)


def _to_lax_concat(op: Op, ins: list, outs: Sequence[TensorType]) -> list:
    return [lax.concatenate(list(ins), op.attrs["dim"])]


def _to_ir_pad(e: EqnView, op: str) -> list[str] | None:
    value = e.literals[1]
    config = e.params.get("padding_config", ())
    if not _defaults_only(e.params, ("padding_config",)) or value is None or \
            any(i != 0 or lo < 0 or hi < 0 for lo, hi, i in config) or \
            not isinstance(value, (int, float)) or isinstance(value, bool):
        return None  # interior or negative padding, or a padding value computed at run time
    return e.emit(op, e.inputs[:1], {"low": _ints(c[0] for c in config),
                                     "high": _ints(c[1] for c in config), "value": value},
                  e.out_types)


def _to_lax_pad(op: Op, ins: list, outs: Sequence[TensorType]) -> list:
    value = np.array(op.attrs.get("value", 0), numpy_dtype(outs[0].dtype))
    return [lax.pad(ins[0], value, [(lo, hi, 0) for lo, hi in
                                    zip(op.attrs["low"], op.attrs["high"])])]


# ---------------------------------------------------------------- constants and indexing

def _to_ir_iota(e: EqnView, op: str) -> list[str] | None:
    if not _defaults_only(e.params, ("dtype", "shape", "dimension")):
        return None
    return e.emit(op, [], {"dim": int(e.params["dimension"])}, e.out_types)


def _to_lax_iota(op: Op, ins: list, outs: Sequence[TensorType]) -> list:
    t = outs[0]
    return [lax.broadcasted_iota(numpy_dtype(t.dtype), t.shape, op.attrs["dim"])]


def _to_lax_full(op: Op, ins: list, outs: Sequence[TensorType]) -> list:
    t = outs[0]
    # A numpy constant, not a jax array: under jit it becomes a literal, like the jaxpr's.
    value = np.array(op.attrs["value"], numpy_dtype(t.dtype))
    return [value if t.shape == () else np.broadcast_to(value, t.shape)]


def _to_lax_literal(op: Op, ins: list, outs: Sequence[TensorType]) -> list:
    t = outs[0]
    data = op.attrs["data"]
    data = data if isinstance(data, tuple) else (data,)
    return [np.asarray(data, numpy_dtype(t.dtype)).reshape(t.shape)]


def _to_lax_index_select(op: Op, ins: list, outs: Sequence[TensorType]) -> list:
    return [jax.numpy.take(ins[0], ins[1], axis=op.attrs["axis"])]


def _to_lax_index_add(op: Op, ins: list, outs: Sequence[TensorType]) -> list:
    dst, idx, upd = ins
    axis = op.attrs["axis"]
    moved = jax.numpy.moveaxis(dst, axis, 0)
    upd = jax.numpy.moveaxis(upd.reshape(dst.shape[:axis] + (-1,) + dst.shape[axis + 1:]),
                             axis, 0)
    return [jax.numpy.moveaxis(moved.at[idx.reshape(-1)].add(upd), 0, axis)]


# ---------------------------------------------------------------- ops of other frontends

def _to_lax_gelu(op: Op, ins: list, outs: Sequence[TensorType]) -> list:
    return [jax.nn.gelu(ins[0], approximate=op.attrs.get("approximate", "none") == "tanh")]


def _scaled(fn: Callable) -> Emitter:
    # add/sub with alpha (a + alpha*b), as the PyTorch frontend writes them.
    def emit(op: Op, ins: list, outs: Sequence[TensorType]) -> list:
        a, b = ins[:2]
        if len(ins) == 3:   # alpha computed at run time
            b = lax.mul(lax.convert_element_type(ins[2], b.dtype), b)
        elif op.attrs.get("alpha", 1) != 1:
            b = lax.mul(np.array(op.attrs["alpha"], b.dtype), b)
        return [fn(*_broadcast([a, b], outs[0]))]
    return emit


def _addc(fn: Callable) -> Emitter:
    def emit(op: Op, ins: list, outs: Sequence[TensorType]) -> list:
        # s + (value*t1) (*|/) t2: the order of the framework kernels
        s, t1, t2 = _broadcast(list(ins[:3]), outs[0])
        v = (lax.convert_element_type(ins[3], s.dtype) if len(ins) == 4
             else np.array(op.attrs.get("value", 1), s.dtype))
        return [lax.add(s, fn(lax.mul(v, t1), t2))]
    return emit


def _to_lax_lerp(op: Op, ins: list, outs: Sequence[TensorType]) -> list:
    # a + w*(b - a) for |w| < 0.5, else b - (b - a)*(1 - w): PyTorch's lerp, exact at both ends
    a, b, w = _broadcast(list(ins), outs[0])
    diff = lax.sub(b, a)
    low = lax.add(a, lax.mul(w, diff))
    high = lax.sub(b, lax.mul(diff, lax.sub(np.array(1, w.dtype), w)))
    return [lax.select(lax.lt(lax.abs(w), np.array(0.5, w.dtype)), low, high)]


# ---------------------------------------------------------------- the table

TABLE: tuple[Row, ...] = (
    # unary
    Row("neg", ("neg",), _unary(lax.neg)),
    Row("abs", ("abs",), _unary(lax.abs)),
    Row("sign", ("sign",), _unary(lax.sign)),
    Row("floor", ("floor",), _unary(lax.floor)),
    Row("ceil", ("ceil",), _unary(lax.ceil)),
    Row("exp", ("exp",), _unary(lax.exp)),
    Row("log", ("log",), _unary(lax.log)),
    Row("log1p", ("log1p",), _unary(lax.log1p)),
    Row("expm1", ("expm1",), _unary(lax.expm1)),
    Row("sqrt", ("sqrt",), _unary(lax.sqrt)),
    Row("rsqrt", ("rsqrt",), _unary(lax.rsqrt)),
    Row("tanh", ("tanh",), _unary(lax.tanh)),
    Row("sigmoid", ("logistic",), _unary(lax.logistic)),
    Row("sin", ("sin",), _unary(lax.sin)),
    Row("cos", ("cos",), _unary(lax.cos)),
    Row("erf", ("erf",), _unary(lax.erf)),
    Row("isfinite", ("is_finite",), _unary(lax.is_finite)),
    Row("square", ("square",), _unary(lax.square)),
    # stop_gradient is an identity once the step is differentiated
    Row("copy", ("copy", "stop_gradient"), _unary(lambda x: lax.copy_p.bind(x))),
    Row("integer_pow", ("integer_pow",), _to_lax_integer_pow, _to_ir_integer_pow),
    Row("logical_not", ("not",), _unary(lax.bitwise_not), _to_ir_logical_not),
    Row("reciprocal", (), _unary(lambda x: lax.integer_pow(x, -1))),
    Row("relu", (), _unary(lambda x: lax.max(x, np.array(0, x.dtype)))),
    Row("round", (), _unary(lambda x: lax.round(x, lax.RoundingMethod.TO_NEAREST_EVEN))),
    Row("gelu", (), _to_lax_gelu),
    Row("isnan", (), _unary(lambda x: lax.ne(x, x))),
    # binary
    Row("add", ("add", "add_any"), _scaled(lax.add)),
    Row("sub", ("sub",), _scaled(lax.sub)),
    Row("mul", ("mul",), _nary(lax.mul)),
    Row("div", ("div",), _nary(lax.div)),
    Row("pow", ("pow",), _nary(lax.pow), _to_ir_pow),
    Row("max", ("max",), _nary(lax.max)),
    Row("min", ("min",), _nary(lax.min)),
    Row("rem", ("rem",), _nary(lax.rem)),
    Row("atan2", ("atan2",), _nary(lax.atan2)),
    Row("and", ("and",), _nary(lax.bitwise_and)),
    Row("or", ("or",), _nary(lax.bitwise_or)),
    Row("xor", ("xor",), _nary(lax.bitwise_xor)),
    Row("eq", ("eq",), _nary(lax.eq)),
    Row("ne", ("ne",), _nary(lax.ne)),
    Row("lt", ("lt",), _nary(lax.lt)),
    Row("le", ("le",), _nary(lax.le)),
    Row("gt", ("gt",), _nary(lax.gt)),
    Row("ge", ("ge",), _nary(lax.ge)),
    # ternary and casts
    Row("select", ("select_n",), _to_lax_select, _to_ir_select),
    Row("clamp", ("clamp",), _to_lax_clamp, _to_ir_clamp),
    Row("lerp", (), _to_lax_lerp),
    Row("addcmul", (), _addc(lax.mul)),
    Row("addcdiv", (), _addc(lax.div)),
    Row("convert", ("convert_element_type",), _to_lax_convert, _to_ir_convert),
    Row("bitcast", ("bitcast_convert_type",), _to_lax_bitcast, _to_ir_bitcast),
    # reductions and contraction
    Row("reduce_sum", ("reduce_sum",), _reduction(lax.reduce_sum), _to_ir_reduce),
    Row("reduce_max", ("reduce_max",), _reduction(lax.reduce_max), _to_ir_reduce),
    Row("reduce_min", ("reduce_min",), _reduction(lax.reduce_min), _to_ir_reduce),
    Row("reduce_prod", ("reduce_prod",), _reduction(lax.reduce_prod), _to_ir_reduce),
    Row("reduce_mean", (), _reduction(_reduce_mean)),
    Row("norm", (), _to_lax_norm),
    Row("argmax", ("argmax",), _arg_reduction(lax.argmax), _to_ir_arg_reduce),
    Row("argmin", ("argmin",), _arg_reduction(lax.argmin), _to_ir_arg_reduce),
    Row("dot", ("dot_general",), _to_lax_dot, _to_ir_dot),
    # layout
    Row("reshape", ("reshape", "squeeze"), _to_lax_reshape, _to_ir_reshape),
    Row("transpose", ("transpose",), _to_lax_transpose, _to_ir_transpose),
    Row("broadcast_in_dim", ("broadcast_in_dim",), _to_lax_broadcast_in_dim,
        _to_ir_broadcast_in_dim),
    Row("slice", ("slice",), _to_lax_slice, _to_ir_slice),
    Row("pad", ("pad",), _to_lax_pad, _to_ir_pad),
    Row("concat", ("concatenate",), _to_lax_concat, _to_ir_concat),
    # indexing and constants (full and literal are made by the converter itself, from
    # literals and captured arrays)
    Row("index_select", (), _to_lax_index_select),
    Row("index_add", (), _to_lax_index_add),
    Row("full", (), _to_lax_full),
    Row("literal", (), _to_lax_literal),
    Row("iota", ("iota",), _to_lax_iota, _to_ir_iota),
)

# neutral op -> its row
BY_OP: dict[str, Row] = {row.op: row for row in TABLE}
# primitive -> the row of the op it becomes. Primitives not listed are kept opaque.
BY_PRIMITIVE: dict[str, Row] = {p: row for row in TABLE for p in row.primitives}


def emitter(op: Op) -> Emitter:
    """The emitter for a neutral op; BackendError for ops this backend cannot run yet."""
    try:
        return BY_OP[op.name].to_lax
    except KeyError:
        raise BackendError(f"the JAX backend has no lowering for op {op.name!r}",
                           hint="collectives run in per-device programs only "
                                "(jax/parallel.py); quantization, send/recv and the "
                                "neutral random ops have no JAX lowering yet") from None


# ---------------------------------------------------------------- primitives kept apart

# Primitives whose nested jaxpr is inlined into the enclosing block, and the parameter that
# holds it. Inlining is exact for the traced step: a nested jit is a function call (XLA
# inlines it too), custom_jvp/custom_vjp calls only attach differentiation rules to their
# primal body, which is all a step that has already been differentiated runs, and remat
# only asks for recomputation in a gradient that has already been built.
# (pjit, core_call, custom_vjp_call_jaxpr and checkpoint are the names older JAX releases
# give these primitives.)
INLINE: dict[str, str] = {
    "jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr", "remat2": "jaxpr", "checkpoint": "jaxpr",
}

# Primitives that draw random numbers from a key the step holds (every device that holds the
# same key draws the same numbers): the frontend marks them rng=key, which passes read.
KEYED_RANDOM = frozenset({"random_bits", "threefry2x32", "rng_bit_generator", "rng_uniform"})


# Scatter primitives stay opaque, but carry their combining computation as a jaxpr that
# attributes cannot hold: the frontend leaves those parameters out (DERIVED_PARAMS) and the
# backend rebuilds them from the primitive's kind with the lax function the user's call went
# through (SCATTERS: scatter-add adds).
DERIVED_PARAMS: dict[str, tuple[str, ...]] = {
    name: ("update_jaxpr", "update_consts")
    for name in ("scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min",
                 "scatter-max")
}
SCATTERS: dict[str, Callable] = {
    "scatter": lax.scatter, "scatter-add": lax.scatter_add, "scatter-mul": lax.scatter_mul,
    "scatter-min": lax.scatter_min, "scatter-max": lax.scatter_max,
}
if hasattr(lax, "scatter_sub"):
    SCATTERS["scatter-sub"] = lax.scatter_sub
