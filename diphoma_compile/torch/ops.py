"""The one table between aten and the IR: which aten overloads become which neutral op,
and how the backend (``build.py``) turns a neutral op back into the same aten call.

An aten op that is not in the table becomes ``opaque{target="aten.<name>.<overload>"}``
with its non-tensor arguments kept in attributes, and the backend calls it as it was.
Python arithmetic on scalars (the optimizer's learning-rate math) has a table here too:
the importer reads it into 0-d IR ops, the backend computes those with Python numbers."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import UnsupportedOpError
from ..ir import shape_rules
from ..ir.ops import OPS
from ..ir.types import DType

aten = torch.ops.aten

TORCH_TO_DTYPE = {
    torch.float64: DType.f64, torch.float32: DType.f32, torch.float16: DType.f16,
    torch.bfloat16: DType.bf16, torch.int64: DType.i64, torch.int32: DType.i32,
    torch.int16: DType.i16, torch.int8: DType.i8, torch.uint8: DType.u8,
    torch.bool: DType.bool, torch.complex64: DType.c64, torch.complex128: DType.c128,
}
DTYPE_TO_TORCH = {v: k for k, v in TORCH_TO_DTYPE.items()}

# The IR dtype of a Python number and of torch's symbolic stand-in for one: what eager code
# computes the optimizer's scalar math in (Python doubles and ints)
SCALAR_DTYPE: dict[type, DType] = {
    float: DType.f64, torch.SymFloat: DType.f64, int: DType.i64, torch.SymInt: DType.i64,
    bool: DType.bool, torch.SymBool: DType.bool,
}

# Python arithmetic on (symbolic) scalars <-> the 0-d IR op that records it
SCALAR_MATH: dict[Callable, str] = {
    operator.mul: "mul", operator.add: "add", operator.sub: "sub", operator.truediv: "div",
    operator.pow: "pow", operator.neg: "neg",
    torch.sym_min: "min", torch.sym_max: "max",   # min()/max() of host scalars (Adafactor)
}

# The IR's comparisons (a bool result of operands in their promoted dtype), by shape rule
COMPARISONS = frozenset(n for n, d in OPS.items() if d.shape_rule is shape_rules.compare)


def ir_dtype(dt: torch.dtype) -> DType:
    """The IR dtype of a torch dtype; UnsupportedOpError for one the IR lacks."""
    try:
        return TORCH_TO_DTYPE[dt]
    except KeyError:
        raise UnsupportedOpError(f"tensors of dtype {dt} are not supported",
                                 hint="use a float, integer or bool dtype") from None


@dataclass(frozen=True)
class Neutral:
    """One aten overload <-> one neutral op.

    ``tensors``: positions of the operands in the aten call, in the IR inputs' order (a
    Python number there becomes a `full` constant, and the backend passes the number back);
    ``attrs``: IR attribute name -> (aten keyword, default left out); ``make_attrs``:
    attributes computed from the call (dims, perm)."""

    aten: Any
    ir: str
    tensors: tuple[int, ...]
    attrs: dict[str, tuple[int | str, Any]] = field(default_factory=dict)
    make_attrs: Callable[[tuple, dict], dict] | None = None    # computed attributes
    accepts: Callable[[tuple, dict], bool] | None = None       # else the call stays opaque


def _dims_of(args, kwargs):
    x = args[0]
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    rank = x.meta["val"].dim()
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        dims = list(range(rank))   # aten reads an empty dim list as "every dimension"
    dims = sorted(d % rank for d in (dims if isinstance(dims, (list, tuple)) else [dims]))
    keep = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    return {"dims": tuple(dims), "keepdim": bool(keep)}


def _norm_attrs(args, kwargs):
    ordv = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    keep = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    attrs = _dims_of((args[0], dim, keep), {})
    return {**attrs, "ord": float(ordv)}


def _plain_norm(args, kwargs):
    ordv = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    return kwargs.get("dtype") is None and float(ordv) in (1.0, 2.0, float("inf")) and \
        args[0].meta["val"].dtype.is_floating_point


def _perm_t(args, kwargs):
    rank = args[0].meta["val"].dim()
    return {"perm": tuple(range(rank))[::-1]}


def _perm_transpose(args, kwargs):
    rank = args[0].meta["val"].dim()
    a, b = args[1] % rank, args[2] % rank
    perm = list(range(rank))
    perm[a], perm[b] = perm[b], perm[a]
    return {"perm": tuple(perm)}


def _perm_permute(args, kwargs):
    rank = args[0].meta["val"].dim()
    return {"perm": tuple(d % rank for d in args[1])}


def _dot_mm(args, kwargs):
    return {"lhs_contract": (1,), "rhs_contract": (0,)}


def _dot_bmm(args, kwargs):
    return {"lhs_batch": (0,), "rhs_batch": (0,), "lhs_contract": (2,), "rhs_contract": (1,)}


def _broadcast_dims(args, kwargs):
    src = args[0].meta["val"]
    out_rank = len(args[1])
    return {"dims": tuple(range(out_rank - src.dim(), out_rank))}


NEUTRAL: list[Neutral] = [
    Neutral(aten.add.Tensor, "add", (0, 1), {"alpha": ("alpha", 1)}),
    Neutral(aten.sub.Tensor, "sub", (0, 1), {"alpha": ("alpha", 1)}),
    Neutral(aten.mul.Tensor, "mul", (0, 1)),
    Neutral(aten.div.Tensor, "div", (0, 1)),
    Neutral(aten.maximum.default, "max", (0, 1)),
    Neutral(aten.minimum.default, "min", (0, 1)),
    Neutral(aten.eq.Tensor, "eq", (0, 1)), Neutral(aten.ne.Tensor, "ne", (0, 1)),
    Neutral(aten.lt.Tensor, "lt", (0, 1)), Neutral(aten.le.Tensor, "le", (0, 1)),
    Neutral(aten.gt.Tensor, "gt", (0, 1)), Neutral(aten.ge.Tensor, "ge", (0, 1)),
    Neutral(aten.eq.Scalar, "eq", (0, 1)), Neutral(aten.ne.Scalar, "ne", (0, 1)),
    Neutral(aten.lt.Scalar, "lt", (0, 1)), Neutral(aten.le.Scalar, "le", (0, 1)),
    Neutral(aten.gt.Scalar, "gt", (0, 1)), Neutral(aten.ge.Scalar, "ge", (0, 1)),
    Neutral(aten.neg.default, "neg", (0,)), Neutral(aten.abs.default, "abs", (0,)),
    Neutral(aten.exp.default, "exp", (0,)), Neutral(aten.log.default, "log", (0,)),
    Neutral(aten.sqrt.default, "sqrt", (0,)), Neutral(aten.rsqrt.default, "rsqrt", (0,)),
    Neutral(aten.tanh.default, "tanh", (0,)), Neutral(aten.sigmoid.default, "sigmoid", (0,)),
    Neutral(aten.relu.default, "relu", (0,)),
    Neutral(aten.reciprocal.default, "reciprocal", (0,)),
    Neutral(aten.sign.default, "sign", (0,)),
    Neutral(aten.where.self, "select", (0, 1, 2)),
    Neutral(aten.lerp.Scalar, "lerp", (0, 1, 2)),
    Neutral(aten.lerp.Tensor, "lerp", (0, 1, 2)),
    Neutral(aten.addcmul.default, "addcmul", (0, 1, 2), {"value": ("value", 1)}),
    Neutral(aten.addcdiv.default, "addcdiv", (0, 1, 2), {"value": ("value", 1)}),
    Neutral(aten.mm.default, "dot", (0, 1), make_attrs=_dot_mm),
    Neutral(aten.bmm.default, "dot", (0, 1), make_attrs=_dot_bmm),
    Neutral(aten.permute.default, "transpose", (0,), make_attrs=_perm_permute),
    Neutral(aten.t.default, "transpose", (0,), make_attrs=_perm_t),
    Neutral(aten.t_copy.default, "transpose", (0,), make_attrs=_perm_t),
    Neutral(aten.permute_copy.default, "transpose", (0,), make_attrs=_perm_permute),
    Neutral(aten.transpose.int, "transpose", (0,), make_attrs=_perm_transpose),
    Neutral(aten.transpose_copy.int, "transpose", (0,), make_attrs=_perm_transpose),
    Neutral(aten.reshape.default, "reshape", (0,)),
    Neutral(aten.view.default, "reshape", (0,)),
    Neutral(aten.view_copy.default, "reshape", (0,)),
    Neutral(aten._unsafe_view.default, "reshape", (0,)),
    Neutral(aten.expand.default, "broadcast_in_dim", (0,), make_attrs=_broadcast_dims),
    Neutral(aten.expand_copy.default, "broadcast_in_dim", (0,), make_attrs=_broadcast_dims),
    Neutral(aten.sum.dim_IntList, "reduce_sum", (0,), make_attrs=_dims_of),
    Neutral(aten.sum.default, "reduce_sum", (0,), make_attrs=_dims_of),
    Neutral(aten.mean.dim, "reduce_mean", (0,), make_attrs=_dims_of),
    Neutral(aten.mean.default, "reduce_mean", (0,), make_attrs=_dims_of),
    Neutral(aten.amax.default, "reduce_max", (0,), make_attrs=_dims_of),
    Neutral(aten.amin.default, "reduce_min", (0,), make_attrs=_dims_of),
    Neutral(aten.linalg_vector_norm.default, "norm", (0,), make_attrs=_norm_attrs,
            accepts=_plain_norm),
]

BY_ATEN: dict[Any, Neutral] = {n.aten: n for n in NEUTRAL}


def emit_target(ir_name: str, overload: str | None = None) -> Any:
    """The aten overload the backend calls for a neutral op: the op's first row in NEUTRAL
    (the rows are ordered so that it is the form eager code calls), or the row with the
    given overload name (``Scalar`` for a comparison with a Python number)."""
    for row in NEUTRAL:
        if row.ir == ir_name and (overload is None or row.aten._overloadname == overload):
            return row.aten
    raise UnsupportedOpError(f"the torch backend has no aten form of IR op {ir_name!r}"
                             + (f" ({overload})" if overload else ""))


def emit_target_for(ir_name: str, number: bool) -> Any:
    """The aten overload for a neutral op whose last operand is (``number``) or is not a
    Python number: its ``Scalar`` or ``Tensor`` row where the table has both (comparisons,
    lerp), else its first row."""
    forms = {row.aten._overloadname for row in NEUTRAL if row.ir == ir_name}
    if {"Scalar", "Tensor"} <= forms:
        return emit_target(ir_name, "Scalar" if number else "Tensor")
    return emit_target(ir_name)


# Tensor overloads to which eager code also passes a Python number as the last operand
# (aten wraps it), as the optimizer passes its learning rate to mul
_WRAPS_NUMBER = frozenset({aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor})


def takes_number(target: Any) -> bool:
    """True when an aten overload of the table takes a Python number as its last operand."""
    return target in _WRAPS_NUMBER or target._overloadname == "Scalar"


# ops whose result is their input's value: the importer passes the input on
IDENTITY = {aten.detach.default, aten.detach_copy.default, aten.alias.default,
            aten.alias_copy.default, aten.lift_fresh_copy.default, aten.clone.default}


def changes_layout(node: Any) -> bool:
    """True for a clone that asks for another memory layout (``x.contiguous()`` of a
    transposed tensor is ``clone(memory_format=contiguous_format)``): not an identity, since
    a kernel after it may need that layout; it stays a call of its own."""
    fmt = node.kwargs.get("memory_format")
    return node.target is aten.clone.default and fmt not in (None, torch.preserve_format)


def draws_random(target: Any) -> bool:
    """True for ops that draw from the framework's global generator (dropout, rand, ...):
    they are kept in order (effectful) and marked, so no pass drops, merges or moves them;
    with the same seed they draw what eager draws."""
    return torch.Tag.nondeterministic_seeded in getattr(target, "tags", ())


# aten ops whose results alias their first input (a view costs no memory of its own); the
# importer marks them view=true, which is what the plan's memory estimate reads
VIEW_OPS = frozenset("""view _unsafe_view reshape _reshape_alias t transpose permute expand
    split split_with_sizes unbind select slice squeeze unsqueeze alias detach as_strided
    diagonal narrow unfold chunk view_as_real view_as_complex movedim""".split())


def is_view_target(name: str) -> bool:
    """True for the name of an aten op (``aten.select.int``) whose result is a view."""
    return name.startswith("aten.") and name.split(".")[1] in VIEW_OPS


DROPPED_TARGETS = {"profiler._record_function_enter_new.default",
                   "profiler._record_function_exit._RecordFunction",
                   "profiler._record_function_enter.default"}


def target_name(target: Any) -> str:
    """``aten.addmm.default`` for an OpOverload."""
    ns = getattr(target, "namespace", None)
    if ns is None:
        return getattr(target, "__name__", str(target))
    return f"{ns}.{target._opname}.{target._overloadname}"


def resolve_target(name: str) -> Any:
    """The OpOverload named ``ns.op.overload``; UnsupportedOpError when there is none."""
    try:
        ns, op, overload = name.split(".")
        return getattr(getattr(getattr(torch.ops, ns), op), overload)
    except (ValueError, AttributeError):
        raise UnsupportedOpError(f"no torch op named {name!r}",
                                 hint="the IR was made by another torch version?") from None


# ------------------------------------------------------------------ opaque arguments

_TAGS = ("%", "dtype:", "device:", "layout:", "memory_format:")


def encode_arg(v: Any, tensor_index: Callable[[Any], int]) -> Any:
    """A non-tensor aten argument as an attribute value; tensors become ``"%k"``."""
    if isinstance(v, torch.fx.Node):
        return f"%{tensor_index(v)}"
    if v is None or isinstance(v, (bool, int, float)):
        return v
    if isinstance(v, str):
        if v.startswith(_TAGS):
            raise UnsupportedOpError(f"string argument {v!r} clashes with the IR's encoding")
        return v
    if isinstance(v, torch.dtype):
        return f"dtype:{str(v).removeprefix('torch.')}"
    if isinstance(v, torch.device):
        return f"device:{v}"
    if isinstance(v, torch.layout):
        return f"layout:{str(v).removeprefix('torch.')}"
    if isinstance(v, torch.memory_format):
        return f"memory_format:{str(v).removeprefix('torch.')}"
    if isinstance(v, (list, tuple)):
        return tuple(encode_arg(x, tensor_index) for x in v)
    raise UnsupportedOpError(f"argument {v!r} of type {type(v).__name__} cannot be kept in "
                             "the IR")


def decode_arg(v: Any, inputs: list) -> Any:
    """The inverse of ``encode_arg``, with ``inputs`` the op's tensor operands."""
    if isinstance(v, str):
        if v.startswith("%"):
            return inputs[int(v[1:])]
        for tag, conv in (("dtype:", lambda s: getattr(torch, s)),
                          ("device:", torch.device),
                          ("layout:", lambda s: getattr(torch, s)),
                          ("memory_format:", lambda s: getattr(torch, s))):
            if v.startswith(tag):
                return conv(v[len(tag):])
        return v
    if isinstance(v, tuple):
        return [decode_arg(x, inputs) for x in v]
    return v
