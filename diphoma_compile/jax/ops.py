"""The one table from JAX primitives to neutral IR ops.

Each row is a converter: it looks at one jaxpr equation and either emits neutral ops and
returns their result names, or returns None when this use of the primitive has no exact
neutral form (a non-default precision, accuracy or sharding, a dtype the op does not take).
The frontend then keeps the equation as ``opaque{target="jax:<name>", ...params}``.

A neutral form is *exact* when the JAX backend, emitting the op back through ``jax.lax``,
produces the same primitive with the same parameters (or one that lowers to the same XLA):
that is what makes trace + backend bit-identical to the user's jitted step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..ir.types import DType, TensorType
from .params import is_trivial_sharding
from .dtypes import ir_dtype


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


Converter = Callable[[EqnView], "list[str] | None"]

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


def same(op: str) -> Converter:
    """A primitive that is the neutral op ``op`` when its parameters are defaults."""
    def conv(e: EqnView) -> list[str] | None:
        if not _defaults_only(e.params):
            return None
        if op not in _BOOL_RESULT and e.in_types and \
                any(t.dtype is not e.in_types[0].dtype for t in e.out_types):
            return None   # abs of a complex number is real: not the neutral op; stays opaque
        return e.emit(op, e.inputs, {}, e.out_types)
    return conv


def _integer_pow(e: EqnView) -> list[str] | None:
    if not _defaults_only(e.params, ("y",)):
        return None
    # Not `square` for y=2: square lowers to chlo.square, integer_pow to a multiply.
    return e.emit("integer_pow", e.inputs, {"exponent": int(e.params["y"])}, e.out_types)


def _logical_not(e: EqnView) -> list[str] | None:
    # On integers `not` is bitwise; the neutral op is the boolean one.
    if e.in_types[0].dtype is not DType.bool:
        return None
    return same("logical_not")(e)


def _pow(e: EqnView) -> list[str] | None:
    if not _defaults_only(e.params):
        return None
    x, y = e.in_types
    if x.dtype is y.dtype:
        return e.emit("pow", e.inputs, {}, e.out_types)
    # pow(float, int) lowers to convert + power: the same two ops, made explicit.
    (yf,) = e.emit("convert", [e.inputs[1]], {"dtype": x.dtype.value},
                   [TensorType(y.shape, x.dtype)])
    return e.emit("pow", [e.inputs[0], yf], {}, e.out_types)


def _select_n(e: EqnView) -> list[str] | None:
    # select_n(which, case0, case1) picks case1 where `which` is true; neutral
    # select(pred, a, b) picks a where pred is true: swap the cases.
    if len(e.inputs) != 3 or e.in_types[0].dtype is not DType.bool or e.params:
        return None
    p, c0, c1 = e.inputs
    return e.emit("select", [p, c1, c0], {}, e.out_types)


def _clamp(e: EqnView) -> list[str] | None:
    if e.params:
        return None
    lo, x, hi = e.inputs  # JAX order: clamp(min, x, max)
    return e.emit("clamp", [x, lo, hi], {}, e.out_types)


def _convert(e: EqnView) -> list[str] | None:
    if not _defaults_only(e.params, ("new_dtype", "weak_type")):
        return None
    dt = ir_dtype(e.params["new_dtype"])
    if dt is DType.key or e.in_types[0].dtype is DType.key:
        return None
    return e.emit("convert", e.inputs, {"dtype": dt.value}, e.out_types)


def _bitcast(e: EqnView) -> list[str] | None:
    if not _defaults_only(e.params, ("new_dtype",)):
        return None
    src, dst = e.in_types[0], e.out_types[0]
    if src.shape != dst.shape or src.dtype.itemsize != dst.dtype.itemsize:
        return None  # a bitcast that changes the shape is outside the neutral op
    return e.emit("bitcast", e.inputs, {"dtype": dst.dtype.value}, e.out_types)


def _reduce(op: str) -> Converter:
    def conv(e: EqnView) -> list[str] | None:
        if not _defaults_only(e.params, ("axes",)):
            return None
        return e.emit(op, e.inputs, {"dims": sorted(int(a) for a in e.params["axes"])},
                      e.out_types)
    return conv


def _arg_reduce(op: str) -> Converter:
    def conv(e: EqnView) -> list[str] | None:
        # The neutral argmax gives i64; with JAX's default 32-bit indices it stays opaque.
        if not _defaults_only(e.params, ("axes", "index_dtype")) or \
                np.dtype(e.params["index_dtype"]) != np.int64:
            return None
        return e.emit(op, e.inputs, {"dims": _ints(e.params["axes"])}, e.out_types)
    return conv


def _dot_general(e: EqnView) -> list[str] | None:
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
    return e.emit("dot", e.inputs, attrs, e.out_types)


def _reshape(e: EqnView) -> list[str] | None:
    if not _defaults_only(e.params, ("new_sizes", "dimensions")) or \
            e.params["dimensions"] is not None:
        return None
    return e.emit("reshape", e.inputs, {}, e.out_types)


def _squeeze(e: EqnView) -> list[str] | None:
    # squeeze lowers to an XLA reshape, exactly what the neutral reshape emits.
    if not _defaults_only(e.params, ("dimensions",)):
        return None
    return e.emit("reshape", e.inputs, {}, e.out_types)


def _transpose(e: EqnView) -> list[str] | None:
    if not _defaults_only(e.params, ("permutation",)):
        return None
    return e.emit("transpose", e.inputs, {"perm": _ints(e.params["permutation"])}, e.out_types)


def _broadcast_in_dim(e: EqnView) -> list[str] | None:
    if not _defaults_only(e.params, ("shape", "broadcast_dimensions")) or len(e.inputs) != 1:
        return None  # extra operands are dynamic shapes
    return e.emit("broadcast_in_dim", e.inputs,
                  {"dims": _ints(e.params["broadcast_dimensions"])}, e.out_types)


def _slice(e: EqnView) -> list[str] | None:
    if not _defaults_only(e.params, ("start_indices", "limit_indices", "strides")):
        return None
    attrs: dict[str, Any] = {"starts": _ints(e.params["start_indices"]),
                             "limits": _ints(e.params["limit_indices"])}
    if e.params["strides"] is not None:
        attrs["strides"] = _ints(e.params["strides"])
    return e.emit("slice", e.inputs, attrs, e.out_types)


def _concatenate(e: EqnView) -> list[str] | None:
    if not _defaults_only(e.params, ("dimension",)):
        return None
    return e.emit("concat", e.inputs, {"dim": int(e.params["dimension"])}, e.out_types)


def _pad(e: EqnView) -> list[str] | None:
    value = e.literals[1]
    config = e.params.get("padding_config", ())
    if not _defaults_only(e.params, ("padding_config",)) or value is None or \
            any(i != 0 or lo < 0 or hi < 0 for lo, hi, i in config) or \
            not isinstance(value, (int, float)) or isinstance(value, bool):
        return None  # interior or negative padding, or a padding value computed at run time
    return e.emit("pad", e.inputs[:1], {"low": _ints(c[0] for c in config),
                                        "high": _ints(c[1] for c in config), "value": value},
                  e.out_types)


def _iota(e: EqnView) -> list[str] | None:
    if not _defaults_only(e.params, ("dtype", "shape", "dimension")):
        return None
    return e.emit("iota", [], {"dim": int(e.params["dimension"])}, e.out_types)


# primitive name -> converter. Primitives not listed are kept opaque.
PRIMITIVES: dict[str, Converter] = {
    # unary
    "neg": same("neg"), "abs": same("abs"), "sign": same("sign"), "floor": same("floor"),
    "ceil": same("ceil"), "exp": same("exp"), "log": same("log"), "log1p": same("log1p"),
    "expm1": same("expm1"), "sqrt": same("sqrt"), "rsqrt": same("rsqrt"),
    "tanh": same("tanh"), "logistic": same("sigmoid"), "sin": same("sin"), "cos": same("cos"),
    "erf": same("erf"), "is_finite": same("isfinite"), "square": same("square"),
    "copy": same("copy"),
    "stop_gradient": same("copy"),  # an identity once the step is differentiated
    "integer_pow": _integer_pow, "not": _logical_not,
    # binary
    "add": same("add"), "add_any": same("add"), "sub": same("sub"), "mul": same("mul"),
    "div": same("div"), "pow": _pow, "max": same("max"), "min": same("min"),
    "rem": same("rem"), "atan2": same("atan2"), "and": same("and"), "or": same("or"),
    "xor": same("xor"), "eq": same("eq"), "ne": same("ne"), "lt": same("lt"),
    "le": same("le"), "gt": same("gt"), "ge": same("ge"),
    # ternary and casts
    "select_n": _select_n, "clamp": _clamp, "convert_element_type": _convert,
    "bitcast_convert_type": _bitcast,
    # reductions and contraction
    "reduce_sum": _reduce("reduce_sum"), "reduce_max": _reduce("reduce_max"),
    "reduce_min": _reduce("reduce_min"), "reduce_prod": _reduce("reduce_prod"),
    "argmax": _arg_reduce("argmax"), "argmin": _arg_reduce("argmin"),
    "dot_general": _dot_general,
    # layout and constants
    "reshape": _reshape, "squeeze": _squeeze, "transpose": _transpose,
    "broadcast_in_dim": _broadcast_in_dim, "slice": _slice, "concatenate": _concatenate,
    "pad": _pad, "iota": _iota,
}

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

# Parameters the backend rebuilds itself rather than reading from the attributes:
# scatter's update computation is derived from the primitive (scatter-add adds).
DERIVED_PARAMS: dict[str, tuple[str, ...]] = {
    name: ("update_jaxpr", "update_consts")
    for name in ("scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min",
                 "scatter-max")
}
