"""Neutral IR ops as jax.lax calls: the backend's table, the inverse of jax/ops.py.

Each emitter takes the op, its input arrays (tracers under jit) and its declared result
types, and returns the result arrays. For ops the JAX frontend produces, the emitter binds
the very primitive (and parameters) the frontend read, so that a traced step compiles to
the same XLA program as the user's own."""

from __future__ import annotations

from collections.abc import Callable, Sequence
import jax
import numpy as np
from jax import lax

from ..errors import BackendError
from .dtypes import numpy_dtype
from ..ir.core import Op
from ..ir.types import TensorType

Emitter = Callable[[Op, list, Sequence[TensorType]], list]


def _broadcast(args: list, out: TensorType) -> list:
    """Operands as JAX's elementwise primitives take them: those broadcast scalars and
    size-1 dims of equal rank themselves; lower ranks get leading 1-dims (NumPy rules)."""
    return [a if np.ndim(a) in (0, out.rank) else
            lax.expand_dims(a, tuple(range(out.rank - np.ndim(a)))) for a in args]


def _nary(fn: Callable) -> Emitter:
    return lambda op, ins, outs: [fn(*_broadcast(list(ins), outs[0]))]


def _unary(fn: Callable) -> Emitter:
    return lambda op, ins, outs: [fn(ins[0])]


def _select(op: Op, ins: list, outs) -> list:
    p, a, b = _broadcast(list(ins), outs[0])
    return [lax.select_n(p, b, a)]  # select picks a where p; select_n picks case 1 where p


def _clamp(op: Op, ins: list, outs) -> list:
    x, lo, hi = ins
    return [lax.clamp(lo, x, hi)]


def _convert(op: Op, ins: list, outs) -> list:
    return [lax.convert_element_type(ins[0], numpy_dtype(outs[0].dtype))]


def _bitcast(op: Op, ins: list, outs) -> list:
    return [lax.bitcast_convert_type(ins[0], numpy_dtype(outs[0].dtype))]


def _reduce(fn: Callable) -> Emitter:
    def emit(op: Op, ins: list, outs) -> list:
        dims = tuple(op.attrs["dims"])
        r = fn(ins[0], dims)
        return [lax.reshape(r, outs[0].shape) if op.attrs.get("keepdim", False) else r]
    return emit


def _reduce_mean(x, dims):
    n = int(np.prod([np.shape(x)[d] for d in dims]))
    return lax.div(lax.reduce_sum(x, dims), np.array(n, x.dtype))


def _norm(op: Op, ins: list, outs) -> list:
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


def _arg_reduce(fn: Callable) -> Emitter:
    def emit(op: Op, ins: list, outs) -> list:
        (d,) = op.attrs["dims"]
        r = fn(ins[0], d, numpy_dtype(outs[0].dtype))
        return [lax.reshape(r, outs[0].shape) if op.attrs.get("keepdim", False) else r]
    return emit


def _dot(op: Op, ins: list, outs) -> list:
    a = op.attrs
    dims = ((tuple(a["lhs_contract"]), tuple(a["rhs_contract"])),
            (tuple(a.get("lhs_batch", ())), tuple(a.get("rhs_batch", ()))))
    # jnp.dot and flax ask for the result dtype explicitly; binding the same parameter keeps
    # the equation identical to the user's.
    return [lax.dot_general(ins[0], ins[1], dims,
                            preferred_element_type=numpy_dtype(outs[0].dtype))]


def _slice(op: Op, ins: list, outs) -> list:
    strides = op.attrs.get("strides")
    return [lax.slice(ins[0], tuple(op.attrs["starts"]), tuple(op.attrs["limits"]),
                      None if strides is None else tuple(strides))]


def _pad(op: Op, ins: list, outs) -> list:
    value = np.array(op.attrs.get("value", 0), numpy_dtype(outs[0].dtype))
    return [lax.pad(ins[0], value, [(lo, hi, 0) for lo, hi in
                                    zip(op.attrs["low"], op.attrs["high"])])]


def _full(op: Op, ins: list, outs) -> list:
    t = outs[0]
    # A numpy constant, not a jax array: under jit it becomes a literal, like the jaxpr's.
    value = np.array(op.attrs["value"], numpy_dtype(t.dtype))
    return [value if t.shape == () else np.broadcast_to(value, t.shape)]


def _literal(op: Op, ins: list, outs) -> list:
    t = outs[0]
    data = op.attrs["data"]
    data = data if isinstance(data, tuple) else (data,)
    return [np.asarray(data, numpy_dtype(t.dtype)).reshape(t.shape)]


def _iota(op: Op, ins: list, outs) -> list:
    t = outs[0]
    return [lax.broadcasted_iota(numpy_dtype(t.dtype), t.shape, op.attrs["dim"])]


def _index_select(op: Op, ins: list, outs) -> list:
    return [jax.numpy.take(ins[0], ins[1], axis=op.attrs["axis"])]


def _index_add(op: Op, ins: list, outs) -> list:
    dst, idx, upd = ins
    axis = op.attrs["axis"]
    moved = jax.numpy.moveaxis(dst, axis, 0)
    upd = jax.numpy.moveaxis(upd.reshape(dst.shape[:axis] + (-1,) + dst.shape[axis + 1:]),
                             axis, 0)
    return [jax.numpy.moveaxis(moved.at[idx.reshape(-1)].add(upd), 0, axis)]


def _gelu(op: Op, ins: list, outs) -> list:
    return [jax.nn.gelu(ins[0], approximate=op.attrs.get("approximate", "none") == "tanh")]


def _scaled(fn: Callable) -> Emitter:
    # add/sub with alpha (a + alpha*b), as the PyTorch frontend writes them.
    def emit(op: Op, ins: list, outs) -> list:
        a, b = ins[:2]
        if len(ins) == 3:   # alpha computed at run time
            b = lax.mul(lax.convert_element_type(ins[2], b.dtype), b)
        elif op.attrs.get("alpha", 1) != 1:
            b = lax.mul(np.array(op.attrs["alpha"], b.dtype), b)
        return [fn(*_broadcast([a, b], outs[0]))]
    return emit


def _addc(fn: Callable) -> Emitter:
    def emit(op: Op, ins: list, outs) -> list:
        # s + (value*t1) (*|/) t2: the order of the framework kernels
        s, t1, t2 = _broadcast(list(ins[:3]), outs[0])
        v = (lax.convert_element_type(ins[3], s.dtype) if len(ins) == 4
             else np.array(op.attrs.get("value", 1), s.dtype))
        return [lax.add(s, fn(lax.mul(v, t1), t2))]
    return emit


def _lerp(op: Op, ins: list, outs) -> list:
    # a + w*(b - a) for |w| < 0.5, else b - (b - a)*(1 - w): PyTorch's lerp, exact at both ends
    a, b, w = _broadcast(list(ins), outs[0])
    diff = lax.sub(b, a)
    low = lax.add(a, lax.mul(w, diff))
    high = lax.sub(b, lax.mul(diff, lax.sub(np.array(1, w.dtype), w)))
    return [lax.select(lax.lt(lax.abs(w), np.array(0.5, w.dtype)), low, high)]


EMITTERS: dict[str, Emitter] = {
    # unary
    "neg": _unary(lax.neg), "abs": _unary(lax.abs), "exp": _unary(lax.exp),
    "log": _unary(lax.log), "log1p": _unary(lax.log1p), "expm1": _unary(lax.expm1),
    "sqrt": _unary(lax.sqrt), "rsqrt": _unary(lax.rsqrt), "tanh": _unary(lax.tanh),
    "sigmoid": _unary(lax.logistic), "sin": _unary(lax.sin), "cos": _unary(lax.cos),
    "erf": _unary(lax.erf), "sign": _unary(lax.sign), "floor": _unary(lax.floor),
    "ceil": _unary(lax.ceil), "square": _unary(lax.square),
    "reciprocal": _unary(lambda x: lax.integer_pow(x, -1)),
    "copy": _unary(lambda x: lax.copy_p.bind(x)),
    "relu": _unary(lambda x: lax.max(x, np.array(0, x.dtype))),
    "round": _unary(lambda x: lax.round(x, lax.RoundingMethod.TO_NEAREST_EVEN)),
    "gelu": _gelu, "logical_not": _unary(lax.bitwise_not), "isfinite": _unary(lax.is_finite),
    "isnan": _unary(lambda x: lax.ne(x, x)),
    "integer_pow": lambda op, ins, outs: [lax.integer_pow(ins[0], op.attrs["exponent"])],
    # binary
    "add": _scaled(lax.add), "sub": _scaled(lax.sub), "mul": _nary(lax.mul),
    "div": _nary(lax.div), "pow": _nary(lax.pow), "max": _nary(lax.max),
    "min": _nary(lax.min), "rem": _nary(lax.rem), "atan2": _nary(lax.atan2),
    "and": _nary(lax.bitwise_and), "or": _nary(lax.bitwise_or), "xor": _nary(lax.bitwise_xor),
    "eq": _nary(lax.eq), "ne": _nary(lax.ne), "lt": _nary(lax.lt), "le": _nary(lax.le),
    "gt": _nary(lax.gt), "ge": _nary(lax.ge),
    # ternary and casts
    "select": _select, "clamp": _clamp, "lerp": _lerp, "addcmul": _addc(lax.mul),
    "addcdiv": _addc(lax.div), "convert": _convert, "bitcast": _bitcast,
    # reductions and contraction
    "reduce_sum": _reduce(lax.reduce_sum), "reduce_max": _reduce(lax.reduce_max),
    "reduce_min": _reduce(lax.reduce_min), "reduce_prod": _reduce(lax.reduce_prod),
    "reduce_mean": _reduce(_reduce_mean), "norm": _norm, "argmax": _arg_reduce(lax.argmax),
    "argmin": _arg_reduce(lax.argmin), "dot": _dot,
    # layout
    "reshape": lambda op, ins, outs: [lax.reshape(ins[0], outs[0].shape)],
    "transpose": lambda op, ins, outs: [lax.transpose(ins[0], tuple(op.attrs["perm"]))],
    "broadcast_in_dim": lambda op, ins, outs: [
        lax.broadcast_in_dim(ins[0], outs[0].shape, tuple(op.attrs["dims"]))],
    "slice": _slice, "pad": _pad,
    "concat": lambda op, ins, outs: [lax.concatenate(list(ins), op.attrs["dim"])],
    # indexing and constants
    "index_select": _index_select, "index_add": _index_add,
    "full": _full, "literal": _literal, "iota": _iota,
}


def emitter(op: Op) -> Emitter:
    """The emitter for a neutral op; BackendError for ops this backend cannot run yet."""
    try:
        return EMITTERS[op.name]
    except KeyError:
        raise BackendError(f"the JAX backend has no lowering for op {op.name!r}",
                           hint="collectives run in per-device programs only "
                                "(jax/parallel.py); quantization, send/recv and the "
                                "neutral random ops have no JAX lowering yet") from None

