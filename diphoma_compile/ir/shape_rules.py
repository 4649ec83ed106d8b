"""Shape and dtype rules of the op vocabulary: each checks declared result types."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from .core import Attrs, Op
from .types import DType, TensorType

ShapeRule = Callable[[Op, Sequence[TensorType], Sequence[TensorType]], None]


class TypeRuleError(Exception):
    """Raised by a rule; the verifier turns it into an IRVerifyError with context."""


def _fmt(t: TensorType) -> str:
    return f"{t.dtype.value}[{','.join(map(str, t.shape))}]"


def _expect(outs: Sequence[TensorType], want: Sequence[tuple[tuple[int, ...], DType]]) -> None:
    if len(outs) != len(want):
        raise TypeRuleError(f"expected {len(want)} result(s), found {len(outs)}")
    for i, (t, (shape, dtype)) in enumerate(zip(outs, want)):
        if t.shape != tuple(shape) or t.dtype is not dtype:
            w = f"{dtype.value}[{','.join(map(str, shape))}]"
            raise TypeRuleError(f"result {i} is declared {_fmt(t)} but the op gives {w}")


def _same_dtype(ins: Sequence[TensorType], what: str = "inputs") -> DType:
    dts = {t.dtype for t in ins}
    if len(dts) != 1:
        raise TypeRuleError(f"{what} must share one dtype, found "
                            + ", ".join(_fmt(t) for t in ins)
                            + " (insert an explicit convert)")
    return next(iter(dts))


def broadcast_shapes(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    """NumPy broadcasting of shapes; TypeRuleError when they do not broadcast."""
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(rank):
        dims = {s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0} - {1}
        if len(dims) > 1:
            raise TypeRuleError(f"shapes {', '.join(map(str, shapes))} do not broadcast")
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def _ints(attrs: Attrs, key: str, default: tuple[int, ...] = ()) -> tuple[int, ...]:
    v = attrs.get(key, default)
    return tuple(v) if isinstance(v, tuple) else (v,)


def _check_dims(dims: Sequence[int], rank: int, what: str) -> None:
    if any(d < 0 or d >= rank for d in dims):
        raise TypeRuleError(f"{what} {tuple(dims)} out of range for rank {rank}")
    if len(set(dims)) != len(dims):
        raise TypeRuleError(f"{what} {tuple(dims)} repeats a dimension")


def _arity(ins: Sequence[TensorType], lo: int, hi: int | None = None) -> None:
    hi = lo if hi is None else hi
    if not lo <= len(ins) <= hi:
        want = str(lo) if lo == hi else f"{lo} to {hi}"
        raise TypeRuleError(f"takes {want} input(s), found {len(ins)}")


# ---------------------------------------------------------------- elementwise

def unary(op: Op, ins, outs) -> None:
    _arity(ins, 1)
    _expect(outs, [(ins[0].shape, ins[0].dtype)])


def unary_to_bool(op: Op, ins, outs) -> None:
    _arity(ins, 1)
    _expect(outs, [(ins[0].shape, DType.bool)])


def binary(op: Op, ins, outs) -> None:
    _arity(ins, 2)
    _expect(outs, [(broadcast_shapes(*(t.shape for t in ins)), _same_dtype(ins))])


def _scale_operand(t: TensorType, what: str) -> None:
    if t.shape != () or not t.dtype.is_float:
        raise TypeRuleError(f"the {what} operand must be a 0-d float, found {_fmt(t)}")


def _scaled(n: int, scale: str) -> Callable:
    """A rule for ops of ``n`` operands plus a scale given as the attribute ``scale`` or as
    an extra 0-d operand (add/sub: alpha; addcmul/addcdiv: value)."""
    def rule(op: Op, ins, outs) -> None:
        _arity(ins, n, n + 1)
        if len(ins) == n + 1:
            _scale_operand(ins[n], scale)
            if scale in op.attrs:
                raise TypeRuleError(f"{scale} is given both as an attribute and as an operand")
        _expect(outs, [(broadcast_shapes(*(t.shape for t in ins[:n])), _same_dtype(ins[:n]))])
    return rule


scaled_binary = _scaled(2, "alpha")      # add, sub
scaled_ternary = _scaled(3, "value")     # addcmul, addcdiv


def compare(op: Op, ins, outs) -> None:
    _arity(ins, 2)
    _same_dtype(ins)
    _expect(outs, [(broadcast_shapes(*(t.shape for t in ins)), DType.bool)])


def select(op: Op, ins, outs) -> None:
    _arity(ins, 3)
    if ins[0].dtype is not DType.bool:
        raise TypeRuleError(f"the predicate must be bool, found {_fmt(ins[0])}")
    dt = _same_dtype(ins[1:], "the two branches")
    _expect(outs, [(broadcast_shapes(*(t.shape for t in ins)), dt)])


def ternary(op: Op, ins, outs) -> None:
    _arity(ins, 3)
    _expect(outs, [(broadcast_shapes(*(t.shape for t in ins)), _same_dtype(ins))])


def convert(op: Op, ins, outs) -> None:
    _arity(ins, 1)
    _expect(outs, [(ins[0].shape, DType.parse(str(op.attrs["dtype"])))])


def bitcast(op: Op, ins, outs) -> None:
    _arity(ins, 1)
    dt = DType.parse(str(op.attrs["dtype"]))
    if dt.itemsize != ins[0].dtype.itemsize:
        raise TypeRuleError(f"bitcast from {ins[0].dtype} to {dt} changes the item size")
    _expect(outs, [(ins[0].shape, dt)])


# ---------------------------------------------------------------- reductions and dot

def _reduced_shape(op: Op, t: TensorType) -> tuple[int, ...]:
    dims = _ints(op.attrs, "dims")
    _check_dims(dims, t.rank, "dims")
    if list(dims) != sorted(dims):
        raise TypeRuleError(f"dims {dims} must be sorted")
    if op.attrs.get("keepdim", False):
        return tuple(1 if i in dims else s for i, s in enumerate(t.shape))
    return tuple(s for i, s in enumerate(t.shape) if i not in dims)


def reduce(op: Op, ins, outs) -> None:
    _arity(ins, 1)
    _expect(outs, [(_reduced_shape(op, ins[0]), ins[0].dtype)])


def arg_reduce(op: Op, ins, outs) -> None:
    _arity(ins, 1)
    if len(_ints(op.attrs, "dims")) != 1:
        raise TypeRuleError("argmax/argmin reduce exactly one dimension")
    _expect(outs, [(_reduced_shape(op, ins[0]), DType.i64)])


def dot_dims(attrs: Attrs, lrank: int, rrank: int):
    """(lhs_batch, rhs_batch, lhs_contract, rhs_contract, lhs_free, rhs_free) of a dot."""
    lb, rb = _ints(attrs, "lhs_batch"), _ints(attrs, "rhs_batch")
    lc, rc = _ints(attrs, "lhs_contract"), _ints(attrs, "rhs_contract")
    _check_dims(lb + lc, lrank, "lhs batch+contract dims")
    _check_dims(rb + rc, rrank, "rhs batch+contract dims")
    if len(lb) != len(rb) or len(lc) != len(rc):
        raise TypeRuleError("lhs and rhs name different numbers of batch or contracting dims")
    lf = tuple(i for i in range(lrank) if i not in lb + lc)
    rf = tuple(i for i in range(rrank) if i not in rb + rc)
    return lb, rb, lc, rc, lf, rf


def dot(op: Op, ins, outs) -> None:
    _arity(ins, 2)
    lhs, rhs = ins
    lb, rb, lc, rc, lf, rf = dot_dims(op.attrs, lhs.rank, rhs.rank)
    for a, b in zip(lb + lc, rb + rc):
        if lhs.shape[a] != rhs.shape[b]:
            raise TypeRuleError(f"lhs dim {a} ({lhs.shape[a]}) does not match rhs dim {b} "
                                f"({rhs.shape[b]})")
    shape = tuple(lhs.shape[i] for i in lb) + tuple(lhs.shape[i] for i in lf) + \
        tuple(rhs.shape[i] for i in rf)
    _expect(outs, [(shape, _same_dtype(ins))])


# ---------------------------------------------------------------- layout

def reshape(op: Op, ins, outs) -> None:
    _arity(ins, 1)
    if len(outs) != 1:
        raise TypeRuleError(f"expected 1 result, found {len(outs)}")
    if outs[0].numel != ins[0].numel:
        raise TypeRuleError(f"reshape from {_fmt(ins[0])} to {_fmt(outs[0])} changes the "
                            "number of elements")
    _expect(outs, [(outs[0].shape, ins[0].dtype)])


def transpose(op: Op, ins, outs) -> None:
    _arity(ins, 1)
    perm = _ints(op.attrs, "perm")
    if sorted(perm) != list(range(ins[0].rank)):
        raise TypeRuleError(f"perm {perm} is not a permutation of 0..{ins[0].rank - 1}")
    _expect(outs, [(tuple(ins[0].shape[p] for p in perm), ins[0].dtype)])


def broadcast_in_dim(op: Op, ins, outs) -> None:
    _arity(ins, 1)
    if len(outs) != 1:
        raise TypeRuleError(f"expected 1 result, found {len(outs)}")
    dims, src, dst = _ints(op.attrs, "dims"), ins[0], outs[0]
    if len(dims) != src.rank:
        raise TypeRuleError(f"dims {dims} must name one result dim per operand dim "
                            f"({src.rank})")
    _check_dims(dims, dst.rank, "dims")
    for i, d in enumerate(dims):
        if src.shape[i] not in (1, dst.shape[d]):
            raise TypeRuleError(f"operand dim {i} ({src.shape[i]}) cannot broadcast to result "
                                f"dim {d} ({dst.shape[d]})")
    _expect(outs, [(dst.shape, src.dtype)])


def slice_(op: Op, ins, outs) -> None:
    _arity(ins, 1)
    t = ins[0]
    starts, limits = _ints(op.attrs, "starts"), _ints(op.attrs, "limits")
    strides = _ints(op.attrs, "strides", (1,) * t.rank)
    if not len(starts) == len(limits) == len(strides) == t.rank:
        raise TypeRuleError(f"starts, limits and strides need {t.rank} entries each")
    shape = []
    for d, (s, e, k) in enumerate(zip(starts, limits, strides)):
        if not (0 <= s <= e <= t.shape[d]) or k < 1:
            raise TypeRuleError(f"slice [{s}:{e}:{k}] is out of range for dim {d} "
                                f"({t.shape[d]})")
        shape.append(-(-(e - s) // k))
    _expect(outs, [(tuple(shape), t.dtype)])


def concat(op: Op, ins, outs) -> None:
    if not ins:
        raise TypeRuleError("takes at least one input")
    dim = op.attrs["dim"]
    first = ins[0]
    _check_dims([dim], first.rank, "dim")
    for t in ins[1:]:
        if t.rank != first.rank or any(a != b for i, (a, b) in
                                       enumerate(zip(t.shape, first.shape)) if i != dim):
            raise TypeRuleError(f"cannot concatenate {_fmt(first)} and {_fmt(t)} on dim {dim}")
    shape = list(first.shape)
    shape[dim] = sum(t.shape[dim] for t in ins)
    _expect(outs, [(tuple(shape), _same_dtype(ins))])


def pad(op: Op, ins, outs) -> None:
    _arity(ins, 1)
    t = ins[0]
    low, high = _ints(op.attrs, "low"), _ints(op.attrs, "high")
    if not len(low) == len(high) == t.rank or min(low + high, default=0) < 0:
        raise TypeRuleError(f"low and high need {t.rank} non-negative entries each")
    _expect(outs, [(tuple(s + a + b for s, a, b in zip(t.shape, low, high)), t.dtype)])


# ---------------------------------------------------------------- indexing

def _index_input(t: TensorType) -> None:
    if not t.dtype.is_int:
        raise TypeRuleError(f"indices must be integers, found {_fmt(t)}")


def index_select(op: Op, ins, outs) -> None:
    _arity(ins, 2)
    src, idx = ins
    axis = op.attrs["axis"]
    _check_dims([axis], src.rank, "axis")
    _index_input(idx)
    _expect(outs, [(src.shape[:axis] + idx.shape + src.shape[axis + 1:], src.dtype)])


def index_add(op: Op, ins, outs) -> None:
    _arity(ins, 3)
    dst, idx, upd = ins
    axis = op.attrs["axis"]
    _check_dims([axis], dst.rank, "axis")
    _index_input(idx)
    want = dst.shape[:axis] + idx.shape + dst.shape[axis + 1:]
    if upd.shape != want or upd.dtype is not dst.dtype:
        raise TypeRuleError(f"updates must be {dst.dtype.value}{list(want)}, found {_fmt(upd)}")
    _expect(outs, [(dst.shape, dst.dtype)])


def gather(op: Op, ins, outs) -> None:
    _arity(ins, 2)
    src, idx = ins
    _check_dims([op.attrs["dim"]], src.rank, "dim")
    _index_input(idx)
    if idx.rank != src.rank:
        raise TypeRuleError("gather indices must have the operand's rank")
    _expect(outs, [(idx.shape, src.dtype)])


def scatter_add(op: Op, ins, outs) -> None:
    _arity(ins, 3)
    dst, idx, upd = ins
    _check_dims([op.attrs["dim"]], dst.rank, "dim")
    _index_input(idx)
    if upd.shape != idx.shape or upd.dtype is not dst.dtype or idx.rank != dst.rank:
        raise TypeRuleError(f"updates {_fmt(upd)} must match the indices' shape {idx.shape} "
                            f"and the operand's dtype {dst.dtype}")
    _expect(outs, [(dst.shape, dst.dtype)])


# ---------------------------------------------------------------- constants and rng

def _one_result(outs) -> TensorType:
    if len(outs) != 1:
        raise TypeRuleError(f"expected 1 result, found {len(outs)}")
    return outs[0]


def full(op: Op, ins, outs) -> None:
    _arity(ins, 0)
    _one_result(outs)


def literal(op: Op, ins, outs) -> None:
    _arity(ins, 0)
    t = _one_result(outs)
    data = op.attrs["data"]
    n = len(data) if isinstance(data, tuple) else 1
    if n != t.numel:
        raise TypeRuleError(f"literal holds {n} values for {t.numel} elements of {_fmt(t)}")


def iota(op: Op, ins, outs) -> None:
    _arity(ins, 0)
    t = _one_result(outs)
    _check_dims([op.attrs["dim"]], t.rank, "dim")


def rng(op: Op, ins, outs) -> None:
    _arity(ins, 0, 1)
    if ins and (ins[0].dtype is not DType.key or ins[0].shape != ()):
        raise TypeRuleError(f"the rng state input must be key[], found {_fmt(ins[0])}")
    if len(outs) not in (1, 2) or (len(outs) == 2 and (outs[1].dtype is not DType.key
                                                        or outs[1].shape != ())):
        raise TypeRuleError("results are the random tensor and optionally the new key[]")
    if len(outs) == 2 and not ins:
        raise TypeRuleError("a new rng state needs an rng state input")


# ---------------------------------------------------------------- collectives

def same_as_input(op: Op, ins, outs) -> None:
    _arity(ins, 1)
    _expect(outs, [(ins[0].shape, ins[0].dtype)])


def same_as_inputs(op: Op, ins, outs) -> None:
    """One result per input, of its shape and dtype (a bucket of collectives, a wait)."""
    _arity(ins, 1, 1 << 30)
    _expect(outs, [(t.shape, t.dtype) for t in ins])
    if op.name != "wait" and len({t.dtype for t in ins}) > 1:
        raise TypeRuleError("a bucket packs values of one dtype, found "
                            + ", ".join(sorted({t.dtype.value for t in ins})))


def send(op: Op, ins, outs) -> None:
    _arity(ins, 1)
    _expect(outs, [])


def recv(op: Op, ins, outs) -> None:
    _arity(ins, 0)
    _one_result(outs)


# ---------------------------------------------------------------- quantization

def _groups(op: Op, t: TensorType) -> int:
    g = op.attrs["group_size"]
    if g < 1:
        raise TypeRuleError(f"group_size must be >= 1, found {g}")
    return -(-t.numel // g)


def _bits(op: Op) -> int:
    b = op.attrs["bits"]
    if not 1 <= b <= 8:
        raise TypeRuleError(f"bits must be 1 to 8, found {b}")
    return b


def piece_layout(numel: int, pieces: int, group: int) -> tuple[int, int]:
    """The flat layout of ``quantize{pieces}``: each of ``pieces`` equal chunks of the
    zero-padded flattened tensor holds ``k`` values, padded to whole groups (``kq``)."""
    k = -(-numel // pieces)
    return k, -(-k // group) * group


def _pieces(op: Op) -> int | None:
    p = op.attrs.get("pieces")
    if p is not None and p < 1:
        raise TypeRuleError(f"pieces must be >= 1, found {p}")
    return p


def quantize(op: Op, ins, outs) -> None:
    """q and scales (and zeros); with ``pieces`` the flat layout of ``piece_layout``: q is
    ``[pieces * kq]`` and there are ``pieces * kq / group_size`` scales, so a flat shard of
    the input quantizes to a dim-0 shard of each result on its own."""
    _arity(ins, 1, 2)
    _bits(op)
    x = ins[0]
    if not x.dtype.is_float:
        raise TypeRuleError(f"quantize takes a float tensor, found {_fmt(x)}")
    stochastic = op.attrs.get("rounding", "nearest") == "stochastic"
    if stochastic != (len(ins) == 2):
        raise TypeRuleError("stochastic rounding takes an rng key as second input, "
                            "nearest rounding none")
    if stochastic and (ins[1].dtype is not DType.key or ins[1].shape != ()):
        raise TypeRuleError(f"the rng key must be key[], found {_fmt(ins[1])}")
    qdt = DType.i8 if op.attrs.get("scheme", "symmetric") == "symmetric" else DType.u8
    h = op.attrs.get("hadamard")
    if h is not None and (h < 1 or h & (h - 1) or _group(op) % h):
        raise TypeRuleError(f"hadamard={h} must be a power of two dividing group_size "
                            f"{_group(op)}")
    pieces = _pieces(op)
    if pieces is None:
        qshape, groups = x.shape, (_groups(op, x),)
    else:
        _, kq = piece_layout(x.numel, pieces, _group(op))
        qshape, groups = (pieces * kq,), (pieces * kq // _group(op),)
    want = [(qshape, qdt), (groups, x.dtype)]
    if op.attrs.get("scheme", "symmetric") == "asymmetric":
        want.append((groups, x.dtype))
    _expect(outs, want)


def _group(op: Op) -> int:
    g = op.attrs["group_size"]
    if g < 1:
        raise TypeRuleError(f"group_size must be >= 1, found {g}")
    return g


def dequantize(op: Op, ins, outs) -> None:
    """The values of quantize's q and scales; with ``pieces`` the declared result is the
    shape quantize was given (its padding dropped)."""
    _arity(ins, 2, 3)
    _bits(op)
    q = ins[0]
    pieces = _pieces(op)
    if pieces is not None:
        t = _one_result(outs)
        _, kq = piece_layout(t.numel, pieces, _group(op))
        if q.shape != (pieces * kq,):
            raise TypeRuleError(f"{_fmt(q)} is not the {pieces}-piece layout of {_fmt(t)} "
                                f"(want [{pieces * kq}])")
        ngroups = pieces * kq // _group(op)
        for s in ins[1:]:
            if s.shape != (ngroups,):
                raise TypeRuleError(f"scales must be [{ngroups}] for {_fmt(q)}, found "
                                    f"{_fmt(s)}")
        _expect(outs, [(t.shape, DType.parse(str(op.attrs["dtype"])))])
        return
    for s in ins[1:]:
        if s.shape != (_groups(op, q),):
            raise TypeRuleError(f"scales must be [{_groups(op, q)}] for {_fmt(q)}, found "
                                f"{_fmt(s)}")
    _expect(outs, [(q.shape, DType.parse(str(op.attrs["dtype"])))])


def hadamard(op: Op, ins, outs) -> None:
    """The orthonormal Sylvester Hadamard transform of each contiguous block of the
    flattened tensor: same shape and dtype; the element count must be whole blocks."""
    _arity(ins, 1)
    b = op.attrs.get("block", 32)
    if b < 1 or b & (b - 1):
        raise TypeRuleError(f"block must be a power of two, found {b}")
    if ins[0].numel % b or not ins[0].dtype.is_float:
        raise TypeRuleError(f"hadamard{{block={b}}} needs a float tensor of whole blocks, "
                            f"found {_fmt(ins[0])}")
    _expect(outs, [(ins[0].shape, ins[0].dtype)])


def take_piece(op: Op, ins, outs) -> None:
    """A device's piece along ``dim`` of a whole value: its shape but for ``dim``, which
    the piece's size divides."""
    _arity(ins, 1)
    t, x = _one_result(outs), ins[0]
    d = int(op.attrs["dim"])
    if t.rank != x.rank or t.dtype is not x.dtype or not 0 <= d < x.rank or \
            t.shape[:d] + t.shape[d + 1:] != x.shape[:d] + x.shape[d + 1:] or \
            t.shape[d] == 0 or x.shape[d] % t.shape[d]:
        raise TypeRuleError(f"take_piece{{dim={d}}} of {_fmt(x)} cannot give {_fmt(t)}: the "
                            "same shape but a divisor of dim's size")


def as_shard(op: Op, ins, outs) -> None:
    """A device's 1-D value as its piece of a sharded value of the declared shape."""
    _arity(ins, 1)
    t = _one_result(outs)
    if ins[0].rank != 1 or t.dtype is not ins[0].dtype:
        raise TypeRuleError(f"as_shard takes a 1-D value of the result's dtype, found "
                            f"{_fmt(ins[0])} for {_fmt(t)}")


def rng_next(op: Op, ins, outs) -> None:
    """A key -> the next key (a stream of keys, one per step)."""
    _arity(ins, 1)
    if ins[0].dtype is not DType.key or ins[0].shape != ():
        raise TypeRuleError(f"rng_next takes a key[], found {_fmt(ins[0])}")
    _expect(outs, [((), DType.key)])


def pack(op: Op, ins, outs) -> None:
    _arity(ins, 1)
    bits = _bits(op)
    _expect(outs, [((math.ceil(ins[0].numel * bits / 8),), DType.u8)])


def unpack(op: Op, ins, outs) -> None:
    _arity(ins, 1)
    bits = _bits(op)
    t = _one_result(outs)
    if ins[0].dtype is not DType.u8 or ins[0].shape != (math.ceil(t.numel * bits / 8),):
        raise TypeRuleError(f"{_fmt(ins[0])} does not hold {t.numel} {bits}-bit values")
    _expect(outs, [(t.shape, DType.parse(str(op.attrs["dtype"])))])


# ---------------------------------------------------------------- control flow

def _sig(ts: Sequence[TensorType]) -> list[str]:
    return [str(t) for t in ts]   # placements included: a region sees what its op passes


def _match(what: str, got: Sequence[TensorType], want: Sequence[TensorType]) -> None:
    if _sig(got) != _sig(want):
        raise TypeRuleError(f"{what}: ({', '.join(_sig(got))}) does not match "
                            f"({', '.join(_sig(want))})")


def region_types(op: Op, types: dict[str, TensorType]):
    """(arg types, yield types) of each region of ``op``, given every value's type."""
    return [([a.type for a in r.args], [types[y] for y in r.yields]) for r in op.regions]


def check_call(op: Op, ins, outs, regions) -> None:
    if len(regions) != 1:
        raise TypeRuleError(f"call has one region, found {len(regions)}")
    _match("region arguments vs inputs", regions[0][0], ins)
    _match("region yields vs results", regions[0][1], outs)


def check_cond(op: Op, ins, outs, regions) -> None:
    if not ins or ins[0].shape != () or not (ins[0].dtype.is_int or ins[0].dtype is DType.bool):
        raise TypeRuleError("cond's first input is a scalar int or bool selecting the branch")
    if not regions:
        raise TypeRuleError("cond needs at least one branch region")
    for i, (args, ys) in enumerate(regions):
        _match(f"branch {i} arguments vs inputs", args, ins[1:])
        _match(f"branch {i} yields vs results", ys, outs)


def check_while(op: Op, ins, outs, regions) -> None:
    if len(regions) != 2:
        raise TypeRuleError(f"while has regions cond and body, found {len(regions)}")
    (cargs, cys), (bargs, bys) = regions
    _match("cond arguments vs inputs", cargs, ins)
    if _sig(cys) != ["bool[]"]:
        raise TypeRuleError(f"cond must yield one bool[], yields ({', '.join(_sig(cys))})")
    _match("body arguments vs inputs", bargs, ins)
    _match("body yields vs inputs", bys, ins)
    _match("results vs inputs", outs, ins)


def check_scan(op: Op, ins, outs, regions) -> None:
    if len(regions) != 1:
        raise TypeRuleError(f"scan has one body region, found {len(regions)}")
    n = op.attrs["length"]
    nc, nk = op.attrs.get("num_consts", 0), op.attrs["num_carry"]
    consts, carry, xs = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]
    for x in xs:
        if not x.shape or x.shape[0] != n:
            raise TypeRuleError(f"scanned input {_fmt(x)} must have leading dim {n}")
    args, ys = regions[0]
    x_slices = [x.with_shape(x.shape[1:]) for x in xs]
    _match("body arguments vs consts+carry+slices", args, list(consts) + list(carry) + x_slices)
    if len(ys) < nk:
        raise TypeRuleError(f"body yields {len(ys)} values, fewer than num_carry={nk}")
    _match("body carry yields vs carry inputs", ys[:nk], carry)
    stacked = [y.with_shape((n,) + y.shape) for y in ys[nk:]]
    _match("results vs carry+stacked outputs", outs, list(carry) + stacked)
