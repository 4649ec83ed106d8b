"""What an op kind is: the row type of the op table (``OpDef``), the registry, and the
questions passes ask of any op (is it pure, effectful, a random draw, a view). The table's rows
themselves are in ``ops.py``."""

from __future__ import annotations

import difflib
import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ..errors import UnknownOpError
from . import shape_rules as R
from .core import Op
from .framework_ops import framework_rule
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
    sharding_rule: Callable        # sharding_rules.ShardingRule
    attrs: dict[str, tuple[AttrKind, bool]] = field(default_factory=dict)  # (kind, required)
    flops_per_elem: float = 0.0     # per result element (elementwise) or per input (reduce)
    effectful: bool = False         # never removed or merged (send/recv)
    deterministic: bool = True      # False: two identical ops may differ (unkeyed rng)
    open_attrs: bool = False        # accepts attributes not listed (opaque)
    region_rule: Callable | None = None
    expand: Callable | None = None  # (op, input types, names) -> equivalent simpler ops
    doc: str = ""
    # Facts the sharding rules and passes read (instead of lists of op names):
    # the result is zero wherever all these operands are zero (the others finite), so a
    # flat shard's zero padding stays zero through the op
    zero_when: tuple[int, ...] = ()
    linear: bool = False            # partial sums pass through: f(a + b) = f(a) + f(b)
    linear_in: tuple[int, ...] = () # linear in each of these operands alone (mul: 0 and 1)
    partial: str | None = None      # reducing a split dim leaves partial results of this kind
    view: bool = False              # the result may alias its first operand (no storage)
    local: bool = False             # a collective each device computes alone: moves no data
    strategies: Callable | None = None  # strategies.StrategyFn; None: runs whole only

    def flops(self, op: Op, ins: Sequence[TensorType],
              outs: Sequence[TensorType]) -> int | None:
        """Floating-point operations of one execution (logical, whole tensors); None for a
        framework op whose framework registered no rule (its cost is unknown)."""
        if self.category is Category.opaque:
            rule = framework_rule(op)
            return None if rule is None else int(rule.flops(op, ins, outs))
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
        if self.category is Category.control or self.view:
            return 0        # a view moves nothing (backends emit it as one)
        if self.category is Category.opaque:
            rule = framework_rule(op)
            if rule is not None and rule.bytes is not None:
                return int(rule.bytes(op, ins, outs))
        return sum(t.nbytes for t in ins) + sum(t.nbytes for t in outs)

    def comm_bytes(self, op: Op, ins: Sequence[TensorType], outs: Sequence[TensorType],
                   axis_size: int, sizes: Mapping[str, int] | None = None) -> int:
        """Bytes one device sends for a collective (ring algorithms); 0 for other ops.
        ``sizes`` (every mesh axis's size) counts a value split over other axes too at the
        size of its piece (a tensor-parallel shard's gradient reduced over the data axis)."""
        if self.category is not Category.collective or axis_size <= 1:
            return 0
        n = axis_size
        frac = (n - 1) / n
        name = str(op.attrs.get("axis"))
        others = {a: k for a, k in (sizes or {}).items() if a != name}
        axis = {**others, name: n}

        def piece(t: TensorType) -> int:     # what one device holds of t, on other axes
            return t.local_nbytes(others)
        if self.name == "all_reduce":
            return int(2 * frac * sum(piece(t) for t in ins))
        if self.name == "reduce_scatter":
            # the padded whole: n pieces of the results' local size
            return int(frac * n * sum(t.local_nbytes(axis) for t in outs))
        if self.name == "all_to_all":
            m = level_size(op, n)
            return int((m - 1) / m * sum(piece(t) for t in ins))
        if self.name == "all_gather":
            return int(frac * n * sum(t.local_nbytes(axis) for t in ins))
        if self.name == "broadcast":   # a pipelined ring: all but the last rank forward
            return int(frac * piece(ins[0]))
        if self.name == "send":
            return piece(ins[0])
        return 0


def level_size(op: Op, n: int) -> int:
    """The devices a collective over an axis of ``n`` exchanges among: all n, or with
    ``local=L, level=local|node`` the L of one node or the n/L nodes."""
    local = op.attrs.get("local")
    if not local:
        return n
    return int(local) if op.attrs.get("level", "local") == "local" else n // int(local)


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
        close = difflib.get_close_matches(name, OPS, n=3)
        hint = f"did you mean {', '.join(close)}?" if close else \
            "use `opaque {target=...}` for an op outside the vocabulary"
        raise UnknownOpError(f"unknown op {name!r}", hint=hint) from None


def is_elementwise(name: str) -> bool:
    """True for unary, binary, ternary and cast ops."""
    return op_def(name).category in ELEMENTWISE


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


def random_draw(op: Op) -> str | None:
    """How an op draws random numbers, as its frontend marked it (``rng`` attribute of an
    opaque op) or its category says: ``"global"`` from the process's own generator (each
    device draws its own numbers), ``"key"`` from a key or seed the step holds (every device
    draws the same numbers), None when it draws none."""
    if op.name == "opaque":
        how = op.attrs.get("rng")
        return None if how is None else str(how)
    if op_def(op.name).category is Category.rng:
        return "key" if op.inputs or "seed" in op.attrs else "global"
    return None


def draws_from_a_key(op: Op) -> bool:
    """Whether ``op`` draws from a key or seed the step holds (``random_draw`` "key"),
    itself or anywhere in its regions (a lax.scan over layers with dropout inside)."""
    return random_draw(op) == "key" or any(draws_from_a_key(o) for r in op.regions
                                           for o in r.ops)


def is_local(name: str) -> bool:
    """True for the collectives that move no data (each device computes its piece alone:
    take_shard, as_partial), which costs, plans and reports count as free."""
    d = OPS.get(name)
    return d is not None and d.local


def is_view(op: Op) -> bool:
    """True when the op's result aliases its first operand instead of owning memory: the
    neutral layout ops that backends emit as views, and framework ops their frontend marked
    ``view``."""
    if op.name == "opaque":
        return bool(op.attrs.get("view", False))
    return op_def(op.name).view


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
