"""The text form round-trips: ``parse(print_graph(g)) == g`` for random well-formed graphs.

The hypothesis strategy below builds graphs that pass ``verify``: a random mesh, inputs of
every role, ops of most categories whose result types follow the shape rules and whose
declared placements follow the sharding rules, op metadata that respects phase and stage
order, nested regions (call, cond, while, scan; two levels deep at most), outputs of every
role, and names, strings and floats that stress the printer's quoting and number forms."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path

from hypothesis import given, note, settings
from hypothesis import strategies as st

from diphoma_compile.ir.sharding_rules import propagate
from diphoma_compile.ir import (FLAT, REPLICATE, Attrs, DType, FlatShard, Graph, Input,
                                InputKind, InputRole, Op, Output, OutputKind, OutputRole,
                                Partial, Phase, Region, Shard, TensorType, Value, op_def, parse,
                                print_graph, verify)
from diphoma_compile.ir.types import REDUCE_OPS
from diphoma_compile.mesh import Mesh

EXAMPLE = Path(__file__).parents[2] / "examples" / "mlp_sgd_step.ir"

# ---------------------------------------------------------------- leaf strategies

# Names: plain ones, and ones the printer must quote (spaces, quotes, unicode, sigils, ...).
_ODD_NAMES = ["a b", 'q"uote', "back\\slash", "ünïcode", "λ", "日本", "at@sign", "co:lon",
              "per%cent", "hash#x", "new\nline", "tab\tx", "", "0", "1e5", "-x", "x-", "a/b",
              "🙂", "{b}", "(p)", "[s]", ",", "=", "^c", "nan", "true", "graph", "return",
              "yield", "\x00", "\u2028"]
NAMES = st.one_of(
    st.from_regex(r"[a-z_][a-z0-9_]{0,5}(\.[a-z0-9_]{1,4})?", fullmatch=True),
    st.sampled_from(_ODD_NAMES),
    st.text(max_size=5),
)

_ODD_STRINGS = ["true", "false", "none", "nan", "inf", "-inf", "1", "1.5", "", "a b", "x\ny",
                'q"', "back\\", "é", "日本", "🙂", "R", "S(0)", "%x", "@g", "^r", "#c", "{", "}",
                "[", "]", ",", "=", "phase", "loc", "dce", "\t", "\x7f", "\u2028", "e5",
                "inf-x", "a.b-c"]
STRINGS = st.one_of(
    st.text(max_size=8),
    st.sampled_from(_ODD_STRINGS),
    st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,6}", fullmatch=True),
)
# Attribute names are words; some look like keywords or op metadata.
ATTR_KEYS = st.one_of(
    st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,7}", fullmatch=True),
    st.sampled_from(["true", "none", "nan", "inf", "phase", "stage", "mb", "loc", "R", "F",
                     "a.b-c", "_", "dims"]),
)

FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 0.0, 1e-300, 5e-324, 1e300, 1e16,
                     0.1, -2.5, 1.7976931348623157e308]),
)
INTS = st.one_of(st.integers(-1000, 1000), st.integers(-(2 ** 100), 2 ** 100),
                 st.sampled_from([0, -1, 2 ** 63, -(2 ** 63) - 1, 10 ** 30]))
NUMBERS = st.one_of(INTS, FLOATS)
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, STRINGS)
ATTR_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.lists(inner, max_size=3).map(tuple)),
    max_leaves=8,
)
LOCS = st.one_of(st.text(max_size=10),
                 st.sampled_from(["mlp.py:9", 'a"b', "tab\there", "new\nline", "ü/λ.py:1", "",
                                  "# not a comment", "back\\slash", "{x}=[y]"]))
PASSES = st.one_of(
    st.sampled_from(["dce", "cse", "comm-fusion{bucket-mb=25}", "dp{axis=dp}", "wus",
                     "pipeline(stages=2)", "true", "nan", "none", "", "a b", "1"]),
    st.text(max_size=6),
)

OPAQUE_ATTRS = st.dictionaries(ATTR_KEYS.filter(lambda k: k not in ("target", "effectful")),
                               ATTR_VALUES, max_size=4)

PHASES = (Phase.forward, Phase.backward, Phase.update)
_RANK = {p: i for i, p in enumerate(PHASES)}
# Strategies built once: hypothesis validates every new strategy object, which is slow.
PHASES_FROM = [st.none() | st.sampled_from(PHASES[k:]) for k in range(len(PHASES))]
MAYBE_LOC = st.none() | LOCS
MAYBE_BOOL = st.none() | st.booleans()
BOOL = st.booleans()
NUM_DTYPES = [d for d in DType if d is not DType.key]
FLOAT_DTYPES = [d for d in DType if d.is_float]
INT_DTYPES = [d for d in DType if d.is_int]

UNARY = ("neg abs exp log log1p expm1 sqrt rsqrt tanh sigmoid relu sin cos erf sign floor ceil "
         "round reciprocal square copy gelu integer_pow logical_not isfinite isnan").split()
TO_BOOL = {"logical_not", "isfinite", "isnan"}
BINARY = "add sub mul div pow max min rem atan2 and or xor".split()
COMPARE = "eq ne lt le gt ge".split()
REDUCE = "reduce_sum reduce_max reduce_min reduce_mean reduce_prod argmax argmin".split()
COLLECTIVES = ("all_reduce reduce_scatter all_gather take_shard all_to_all broadcast send "
               "recv").split()


@functools.cache
def _ints(lo: int, hi: int, maybe: bool = False) -> st.SearchStrategy:
    return st.none() | st.integers(lo, hi) if maybe else st.integers(lo, hi)


@functools.cache
def _index_lists(n: int, min_size: int, max_size: int) -> st.SearchStrategy:
    return st.lists(st.integers(0, n - 1), min_size=min_size, max_size=max_size)


@functools.cache
def _perms(n: int) -> st.SearchStrategy:
    return st.permutations(range(n))


def _has_partial(t: TensorType) -> bool:
    return any(isinstance(p, Partial) for _, p in t.placements)


def _only_sum_partials(t: TensorType) -> bool:
    return all(p == Partial("sum") for _, p in t.placements if isinstance(p, Partial))


# ---------------------------------------------------------------- the graph builder

class _Block:
    """Ops of one block being built, and the value names visible in it."""

    def __init__(self, visible: list[str]) -> None:
        self.visible = list(visible)
        self.ops: list[Op] = []


class _Builder:
    """Draws a well-formed graph op by op; every value name is unique graph-wide."""

    def __init__(self, draw, mesh: dict[str, int]) -> None:
        self.draw = draw
        self.mesh = mesh
        self.used: set[str] = set()
        self.region_names: set[str] = set()
        self.types: dict[str, TensorType] = {}
        # phase rank and stage of each value's producer op (None: input, argument, unset)
        self.prod: dict[str, tuple[int | None, int | None]] = {}

    # ------------------------------------------------------------ helpers
    def fresh(self, taken: set[str] | None = None) -> str:
        taken = self.used if taken is None else taken
        base = self.draw(NAMES)
        name, k = base, 0
        while name in taken:
            k += 1
            name = f"{base}.{k}"
        taken.add(name)
        return name

    def define(self, blk: _Block, name: str, t: TensorType,
               prod: tuple[int | None, int | None] = (None, None)) -> None:
        self.types[name] = t
        self.prod[name] = prod
        blk.visible.append(name)

    def integer(self, lo: int, hi: int) -> int:
        return self.draw(_ints(lo, hi))

    def coin(self) -> bool:
        return self.draw(BOOL)

    def choice(self, seq):
        seq = list(seq)
        return seq[self.integer(0, len(seq) - 1)]

    def some(self, seq, max_size: int, min_size: int = 0) -> list:
        """Up to ``max_size`` items of ``seq``, repeats allowed; [] when ``seq`` is empty."""
        seq = list(seq)
        if not seq:
            return []
        return [seq[i] for i in self.draw(_index_lists(len(seq), min_size, max_size))]

    def shuffle(self, seq) -> list:
        seq = list(seq)
        return [seq[i] for i in self.draw(_perms(len(seq)))]

    def pick(self, blk: _Block, pred: Callable[[TensorType], bool] = lambda t: True):
        cands = [n for n in blk.visible if pred(self.types[n])]
        return self.choice(cands) if cands else None

    def pick_many(self, blk: _Block, pred, max_size: int, min_size: int = 0) -> list[str]:
        cands = [n for n in blk.visible if pred(self.types[n])]
        return self.some(cands, max_size, min_size)

    def shape(self, max_rank: int = 3, max_dim: int = 6) -> tuple[int, ...]:
        return tuple(self.some(range(max_dim + 1), max_rank))

    def split_dims(self, shape: tuple[int, ...], placements, axis: str) -> list[int]:
        """Dims that ``axis`` may split, given the other axes' placements: the sizes of all
        axes splitting one dim must multiply to a divisor of it."""
        n = self.mesh[axis]
        return [d for d, s in enumerate(shape)
                if s % (n * math.prod(self.mesh[a] for a, p in placements
                                      if a != axis and p == Shard(d))) == 0]

    def placements(self, shape: tuple[int, ...], partial: bool = True, flat: bool = True):
        """A random placement on each mesh axis, splitting only dims the axes divide."""
        out: list = []
        for axis in self.mesh:
            kinds = ["R", "R", "S"] + (["F"] if flat else []) + (["P"] if partial else [])
            kind = self.choice(kinds)
            dims = self.split_dims(shape, out, axis)
            if kind == "S" and dims:
                out.append((axis, Shard(self.choice(dims))))
            elif kind == "F":
                out.append((axis, FLAT))
            elif kind == "P":
                out.append((axis, Partial(self.choice(REDUCE_OPS))))
        return tuple(out)

    def fits(self, t: TensorType) -> bool:
        return all(p.dim in self.split_dims(t.shape, t.placements, a)
                   for a, p in t.placements if isinstance(p, Shard))

    def meta(self, inputs: list[str]) -> dict:
        """Phase and stage no earlier than those of the ops making the inputs."""
        lo_p = max((self.prod[n][0] for n in inputs if self.prod[n][0] is not None), default=0)
        lo_s = max((self.prod[n][1] for n in inputs if self.prod[n][1] is not None), default=0)
        d = self.draw
        return dict(phase=d(PHASES_FROM[lo_p]), stage=d(_ints(lo_s, lo_s + 2, maybe=True)),
                    microbatch=d(_ints(0, 3, maybe=True)), loc=d(MAYBE_LOC))

    def emit(self, blk: _Block, name: str, inputs: list[str], outs: list[TensorType],
             attrs: dict | None = None, regions: tuple[Region, ...] = (),
             derive: bool = True) -> list[str] | None:
        """Append an op; with ``derive``, result placements come from the op's sharding rule
        (None, and nothing appended, when the rule rejects the inputs' placements)."""
        ins = [self.types[n] for n in inputs]
        attrs_ = Attrs(attrs or {})
        if derive and self.mesh:
            probe = Op(name, tuple(inputs), tuple(Value("?", t) for t in outs), attrs_, regions)
            rule = op_def(name).sharding_rule
            per_axis = {}
            for axis in self.mesh:
                want = propagate(probe, ins, outs, axis, rule)
                if want is None or len(want) != len(outs):
                    return None
                per_axis[axis] = want
            outs = [TensorType(t.shape, t.dtype, tuple((a, per_axis[a][k]) for a in self.mesh))
                    for k, t in enumerate(outs)]
            if not all(self.fits(t) for t in outs):
                return None
        meta = self.meta(inputs)
        results = tuple(Value(self.fresh(), t) for t in outs)
        op = Op(name, tuple(inputs), results, attrs_, regions, **meta)
        blk.ops.append(op)
        prod = (None if op.phase is None else _RANK[op.phase], op.stage)
        for v in results:
            self.define(blk, v.name, v.type, prod)
        return [v.name for v in results]

    def full(self, blk: _Block, t: TensorType, value=None) -> str:
        """A ``full`` constant of type ``t`` (always valid unless ``t`` is partial)."""
        value = self.draw(NUMBERS) if value is None else value
        return self.emit(blk, "full", [], [t], {"value": value}, derive=False)[0]

    def matching(self, blk: _Block, t: TensorType) -> str:
        """A visible value of type ``t`` (placements included), or a new constant."""
        v = self.pick(blk, lambda u: u == t)
        if v is None or self.integer(0, 4) == 0:
            v = self.full(blk, t)
        return v

    # ------------------------------------------------------------ blocks
    def block(self, blk: _Block, depth: int, max_ops: int) -> None:
        gens = [self.unary, self.unary, self.binary, self.binary, self.ternary, self.convert,
                self.reduce, self.transpose, self.reshape, self.broadcast, self.slice,
                self.pad, self.concat, self.dot, self.index_select, self.gather_scatter,
                self.constant, self.constant, self.rng, self.collective, self.collective,
                self.quant, self.opaque]
        if depth < 2:
            gens += [self.call, self.cond, self.while_, self.scan]
        target = self.integer(0, max_ops)
        for _ in range(3 * target):  # a generator may find nothing to work on: retry
            if len(blk.ops) >= target:
                break
            gen = self.choice(gens) if blk.visible else self.constant
            gen(blk, depth)

    def region(self, blk: _Block, depth: int, arg_types: list[TensorType]):
        """A region's name, arguments and ops; the caller picks the yields."""
        name = self.fresh(self.region_names)
        inner = _Block(blk.visible)
        args = []
        for t in arg_types:
            a = self.fresh()
            self.define(inner, a, t)
            args.append(Value(a, t))
        self.block(inner, depth + 1, 4 if depth == 0 else 2)
        return name, tuple(args), inner

    # ------------------------------------------------------------ elementwise
    def unary(self, blk: _Block, depth: int) -> None:
        x = self.pick(blk, lambda t: t.dtype is not DType.key and _only_sum_partials(t))
        if x is None:
            return
        t = self.types[x]
        name = self.choice(["neg", "copy"] if _has_partial(t) else UNARY)
        attrs = {}
        if name == "gelu" and self.coin():
            attrs["approximate"] = self.choice(["none", "tanh"])
        if name == "integer_pow":
            attrs["exponent"] = self.integer(-3, 4)
        dt = DType.bool if name in TO_BOOL else t.dtype
        self.emit(blk, name, [x], [TensorType(t.shape, dt)], attrs)

    def binary(self, blk: _Block, depth: int) -> None:
        x = self.pick(blk, lambda t: t.dtype is not DType.key)
        if x is None:
            return
        t = self.types[x]
        if self.integer(0, 3):
            y = self.pick(blk, lambda u: u == t)  # identical type: the placement carries over
            name = self.choice(["add", "sub"] if _has_partial(t) else BINARY + COMPARE)
        else:  # a replicated scalar operand broadcasts; the sharding rule decides
            y = self.pick(blk, lambda u: u.shape == () and u.dtype is t.dtype
                          and not u.placements)
            if y is None:
                return
            name = self.choice(BINARY + COMPARE)
        ins = self.shuffle([x, y])
        dt = DType.bool if name in COMPARE else t.dtype
        attrs = {"alpha": self.draw(NUMBERS)} if name in ("add", "sub") and self.coin() else {}
        self.emit(blk, name, ins, [TensorType(t.shape, dt)], attrs)

    def ternary(self, blk: _Block, depth: int) -> None:
        x = self.pick(blk, lambda t: t.dtype is not DType.key and not _has_partial(t))
        if x is None:
            return
        t = self.types[x]
        y = self.pick(blk, lambda u: u == t)
        plain = TensorType(t.shape, t.dtype)
        if self.coin():
            name = self.choice(["clamp", "lerp", "addcmul", "addcdiv"])
            z = self.pick(blk, lambda u: u == t)
            attrs = {"value": self.draw(NUMBERS)} if name[:4] == "addc" and self.coin() else {}
            self.emit(blk, name, [x, y, z], [plain], attrs)
            return
        c = self.emit(blk, self.choice(COMPARE), [x, y], [TensorType(t.shape, DType.bool)])
        if c is not None:
            self.emit(blk, "select", [c[0], x, y], [plain])

    def convert(self, blk: _Block, depth: int) -> None:
        x = self.pick(blk, lambda t: t.dtype is not DType.key and not _has_partial(t))
        if x is None:
            return
        t = self.types[x]
        if self.coin():
            name, dt = "convert", self.choice(NUM_DTYPES)
        else:
            name = "bitcast"
            dt = self.choice([d for d in NUM_DTYPES if d.itemsize == t.dtype.itemsize])
        self.emit(blk, name, [x], [TensorType(t.shape, dt)], {"dtype": dt.value})

    # ------------------------------------------------------------ reductions, dot
    def reduce(self, blk: _Block, depth: int) -> None:
        x = self.pick(blk, lambda t: t.dtype is not DType.key)
        if x is None:
            return
        t = self.types[x]
        if any(isinstance(p, FlatShard) and t.numel % dict(self.mesh)[a]
               for a, p in t.placements):
            return   # the verifier refuses sums over zero padding that math may have changed
        name = self.choice(REDUCE)
        if name in ("argmax", "argmin"):
            if t.rank == 0:
                return
            dims = [self.integer(0, t.rank - 1)]
        else:
            dims = sorted(set(self.some(range(t.rank), t.rank)))
        keep = self.draw(MAYBE_BOOL)
        attrs = {"dims": dims} if keep is None else {"dims": dims, "keepdim": keep}
        shape = tuple(1 if i in dims else s for i, s in enumerate(t.shape)) if keep else \
            tuple(s for i, s in enumerate(t.shape) if i not in dims)
        dt = DType.i64 if name in ("argmax", "argmin") else t.dtype
        self.emit(blk, name, [x], [TensorType(shape, dt)], attrs)

    def dot(self, blk: _Block, depth: int) -> None:
        x = self.pick(blk, lambda t: t.dtype in NUM_DTYPES and t.dtype is not DType.bool)
        if x is None:
            return
        t = self.types[x]
        perm = self.shuffle(range(t.rank))
        nb = self.integer(0, min(1, t.rank))
        nc = self.integer(0, t.rank - nb)
        lb, lc = list(perm[:nb]), list(perm[nb:nb + nc])
        free = self.some(range(5), 1)
        rshape = tuple(t.shape[i] for i in lb + lc) + tuple(free)
        y = self.pick(blk, lambda u: u.shape == rshape and u.dtype is t.dtype)
        if y is None:
            y = self.full(blk, TensorType(rshape, t.dtype,
                                          self.placements(rshape, partial=False)))
        attrs = {"lhs_contract": lc, "rhs_contract": list(range(nb, nb + nc))}
        if nb or self.coin():
            attrs.update(lhs_batch=lb, rhs_batch=list(range(nb)))
        lf = [i for i in range(t.rank) if i not in lb + lc]
        shape = tuple(t.shape[i] for i in lb + lf) + tuple(free)
        self.emit(blk, "dot", [x, y], [TensorType(shape, t.dtype)], attrs)

    # ------------------------------------------------------------ layout and indexing
    def transpose(self, blk: _Block, depth: int) -> None:
        x = self.pick(blk)
        if x is None:
            return
        t = self.types[x]
        perm = self.shuffle(range(t.rank))
        self.emit(blk, "transpose", [x], [TensorType(tuple(t.shape[p] for p in perm), t.dtype)],
                  {"perm": perm})

    def reshape(self, blk: _Block, depth: int) -> None:
        x = self.pick(blk)
        if x is None:
            return
        t = self.types[x]
        s = t.shape
        options = [(t.numel,), s + (1,), (1,) + s, tuple(d for d in s if d != 1)]
        if t.rank >= 2:
            i = self.integer(0, t.rank - 2)
            options.append(s[:i] + (s[i] * s[i + 1],) + s[i + 2:])
        if t.numel == 0:
            options.append((3, 0))
        self.emit(blk, "reshape", [x], [TensorType(self.choice(options), t.dtype)])

    def broadcast(self, blk: _Block, depth: int) -> None:
        x = self.pick(blk, lambda t: t.rank <= 2)
        if x is None:
            return
        t = self.types[x]
        rank = t.rank + self.integer(0, 2)
        dims = sorted(self.shuffle(range(rank))[:t.rank])
        shape = []
        for j in range(rank):
            if j in dims:
                s = t.shape[dims.index(j)]
                shape.append(s if s != 1 else self.integer(0, 3))
            else:
                shape.append(self.integer(0, 4))
        self.emit(blk, "broadcast_in_dim", [x], [TensorType(tuple(shape), t.dtype)],
                  {"dims": dims})

    def slice(self, blk: _Block, depth: int) -> None:
        x = self.pick(blk)
        if x is None:
            return
        t = self.types[x]
        starts, limits, strides = [], [], []
        for s in t.shape:
            a = self.integer(0, s)
            starts.append(a)
            limits.append(self.integer(a, s))
            strides.append(self.integer(1, 3))
        attrs = {"starts": starts, "limits": limits}
        if self.coin():
            attrs["strides"] = strides
        else:
            strides = [1] * t.rank
        shape = tuple(-(-(e - a) // k) for a, e, k in zip(starts, limits, strides))
        self.emit(blk, "slice", [x], [TensorType(shape, t.dtype)], attrs)

    def pad(self, blk: _Block, depth: int) -> None:
        x = self.pick(blk)
        if x is None:
            return
        t = self.types[x]
        low = [self.integer(0, 2) for _ in range(t.rank)]
        high = [self.integer(0, 2) for _ in range(t.rank)]
        attrs: dict = {"low": low, "high": high}
        if self.coin():
            attrs["value"] = self.draw(NUMBERS)
        shape = tuple(s + a + b for s, a, b in zip(t.shape, low, high))
        self.emit(blk, "pad", [x], [TensorType(shape, t.dtype)], attrs)

    def concat(self, blk: _Block, depth: int) -> None:
        x = self.pick(blk, lambda t: t.rank >= 1)
        if x is None:
            return
        t = self.types[x]
        d = self.integer(0, t.rank - 1)

        def joins(u: TensorType) -> bool:
            return u.dtype is t.dtype and u.rank == t.rank and u.placements == t.placements \
                and all(a == b for i, (a, b) in enumerate(zip(u.shape, t.shape)) if i != d)
        parts = self.shuffle([x] + self.pick_many(blk, joins, 2))
        shape = list(t.shape)
        shape[d] = sum(self.types[p].shape[d] for p in parts)
        self.emit(blk, "concat", parts, [TensorType(tuple(shape), t.dtype)], {"dim": d})

    def index_select(self, blk: _Block, depth: int) -> None:
        src = self.pick(blk, lambda t: t.rank >= 1)
        if src is None:
            return
        t = self.types[src]
        idx = self.pick(blk, lambda u: u.dtype.is_int)
        if idx is None:
            dt = self.choice(INT_DTYPES)
            idx = self.emit(blk, "iota", [], [TensorType((self.integer(0, 4),), dt)],
                            {"dim": 0}, derive=False)[0]
        i = self.types[idx]
        ax = self.integer(0, t.rank - 1)
        shape = t.shape[:ax] + i.shape + t.shape[ax + 1:]
        self.emit(blk, "index_select", [src, idx], [TensorType(shape, t.dtype)], {"axis": ax})

    def _indices(self, blk: _Block, rank: int) -> str:
        """A visible integer value of this rank, or a new constant (iota when rank >= 1)."""
        idx = self.pick(blk, lambda u: u.dtype.is_int and u.rank == rank)
        if idx is None:
            t = TensorType(tuple(self.integer(0, 4) for _ in range(rank)),
                           self.choice(INT_DTYPES))
            if rank == 0:
                return self.full(blk, t, self.integer(0, 3))
            idx = self.emit(blk, "iota", [], [t], {"dim": 0}, derive=False)[0]
        return idx

    def gather_scatter(self, blk: _Block, depth: int) -> None:
        x = self.pick(blk, lambda t: t.rank >= 1 and t.dtype is not DType.key)
        if x is None:
            return
        t = self.types[x]
        name = self.choice(["gather", "scatter_add", "index_add"])
        if name == "index_add":
            idx = self._indices(blk, self.integer(0, 2))
            ax = self.integer(0, t.rank - 1)
            upd = self.matching(blk, TensorType(
                t.shape[:ax] + self.types[idx].shape + t.shape[ax + 1:], t.dtype))
            self.emit(blk, name, [x, idx, upd], [TensorType(t.shape, t.dtype)], {"axis": ax})
            return
        idx = self._indices(blk, t.rank)
        attrs = {"dim": self.integer(0, t.rank - 1)}
        if name == "gather":
            self.emit(blk, name, [x, idx], [TensorType(self.types[idx].shape, t.dtype)], attrs)
        else:
            upd = self.matching(blk, TensorType(self.types[idx].shape, t.dtype))
            self.emit(blk, name, [x, idx, upd], [TensorType(t.shape, t.dtype)], attrs)

    # ------------------------------------------------------------ constants and rng
    def constant(self, blk: _Block, depth: int) -> None:
        kind = self.choice(["full", "full", "literal", "iota"])
        if kind == "full":
            shape = self.shape()
            value = self.draw(NUMBERS)
            pl = self.placements(shape, partial=False)
            if value == 0 and self.mesh and self.coin():
                # only zeros are a valid partial sum
                pl = ((self.choice(list(self.mesh)), Partial("sum")),)
            dt = self.choice(NUM_DTYPES)
            self.full(blk, TensorType(shape, dt, pl), value)
        elif kind == "literal":
            shape = self.shape(max_rank=2, max_dim=3)
            n = math.prod(shape)
            if n == 1 and self.coin():
                data = self.draw(SCALARS)
            else:
                data = [self.draw(ATTR_VALUES) for _ in range(n)]
            dt = self.choice(NUM_DTYPES)
            t = TensorType(shape, dt, self.placements(shape, partial=False))
            self.emit(blk, "literal", [], [t], {"data": data}, derive=False)
        else:
            shape = self.shape()
            if not shape:
                shape = (self.integer(0, 5),)
            dt = self.choice(INT_DTYPES + FLOAT_DTYPES)
            t = TensorType(shape, dt, self.placements(shape, partial=False))
            self.emit(blk, "iota", [], [t], {"dim": self.integer(0, len(shape) - 1)},
                      derive=False)

    def rng(self, blk: _Block, depth: int) -> None:
        name = self.choice(["rng_uniform", "rng_normal", "rng_bernoulli"])
        key = None
        if self.coin():
            key = self.pick(blk, lambda u: u.dtype is DType.key and u.shape == ()
                            and not u.placements)
        outs = [TensorType(self.shape(), self.choice(FLOAT_DTYPES))]
        if key is not None and self.coin():
            outs.append(TensorType((), DType.key))
        attrs = {}
        if self.coin():
            attrs["seed"] = self.draw(INTS)
        extra = {"rng_uniform": ("low", "high"), "rng_normal": ("mean", "std"),
                 "rng_bernoulli": ()}[name]
        for k in extra:
            if self.coin():
                attrs[k] = self.draw(NUMBERS)
        if name == "rng_bernoulli":
            attrs["p"] = self.draw(NUMBERS)
        self.emit(blk, name, [] if key is None else [key], outs, attrs)

    # ------------------------------------------------------------ collectives
    def _dim_or_flat(self, t: TensorType, axis: str, flat: bool = True):
        """A ``dim`` attribute (a dim that ``axis`` may split, or flat) and its placement."""
        dims = self.split_dims(t.shape, t.placements, axis)
        dim = self.choice(dims + (["flat"] if flat else []))
        return dim, (FLAT if dim == "flat" else Shard(dim))

    def _take_dims(self, t: TensorType, axis: str, flat: bool = True) -> list:
        """The ``dim`` attributes take_shard on ``axis`` may split ``t`` by: never a piece
        of another axis's piece of the same dim (a flat piece splits every dim), which the
        sharding rule refuses (which axis is major would be the backends' guess)."""
        others = [p for a, p in t.placements if a != axis]
        if any(isinstance(p, FlatShard) for p in others):
            return []
        dims = [d for d in self.split_dims(t.shape, t.placements, axis) if Shard(d) not in others]
        return dims + (["flat"] if flat and not any(isinstance(p, Shard) for p in others) else [])

    def _take_shard(self, blk: _Block, axis: str, flat: bool = True) -> str | None:
        """Split a value replicated on ``axis`` (R -> S(d) or F); its name, or None."""
        x = self.pick(blk, lambda u: u.placement(axis) == REPLICATE
                      and bool(self._take_dims(u, axis, flat)))
        if x is None:
            return None
        t = self.types[x]
        dim = self.choice(self._take_dims(t, axis, flat))
        p = FLAT if dim == "flat" else Shard(dim)
        return self.emit(blk, "take_shard", [x], [t.with_placement(axis, p)],
                         {"axis": axis, "dim": dim}, derive=False)[0]

    def collective(self, blk: _Block, depth: int) -> None:
        if not self.mesh:
            return
        axis = self.choice(list(self.mesh))
        n = self.mesh[axis]
        name = self.choice(COLLECTIVES)
        attrs: dict = {"axis": axis}
        if name in ("all_reduce", "reduce_scatter"):
            def reducible(u: TensorType) -> bool:
                # a max or min of partial sums over another axis is not a partial sum of
                # the max: the verifier refuses it (strategies.linear_collective)
                p = u.placement(axis)
                return isinstance(p, Partial) and (p.op in ("sum", "avg") or not any(
                    isinstance(q, Partial) for a, q in u.placements if a != axis))
            x = self.pick(blk, reducible)
            if x is None:  # make a partial sum: a zero constant may be declared P(sum)
                t = TensorType(self.shape(), self.choice(NUM_DTYPES), ((axis, Partial("sum")),))
                x = self.full(blk, t, 0)
            t = self.types[x]
            attrs["op"] = t.placement(axis).op
            if name == "all_reduce":
                out = t.with_placement(axis, REPLICATE)
            else:
                attrs["dim"], p = self._dim_or_flat(t, axis)
                out = t.with_placement(axis, p)
        elif name == "all_gather":
            x = self.pick(blk, lambda u: isinstance(u.placement(axis), (Shard, FlatShard)))
            if x is None and (x := self._take_shard(blk, axis)) is None:
                return
            t = self.types[x]
            p = t.placement(axis)
            attrs["dim"] = p.dim if isinstance(p, Shard) else "flat"
            out = t.with_placement(axis, REPLICATE)
        elif name == "take_shard":
            self._take_shard(blk, axis)
            return
        elif name == "all_to_all":
            x = self.pick(blk, lambda u: isinstance(u.placement(axis), Shard))
            if x is None and (x := self._take_shard(blk, axis, flat=False)) is None:
                return
            t = self.types[x]
            to = self._dim_or_flat(t, axis, flat=False)[0]
            attrs.update(from_dim=t.placement(axis).dim, to_dim=to)
            out = t.with_placement(axis, Shard(to))
        elif name in ("broadcast", "send"):
            x = self.pick(blk)
            if x is None:
                return
            t = self.types[x]
            if name == "send":
                attrs["peer"] = self.integer(-1, n)
                self.emit(blk, name, [x], [], attrs, derive=False)
                return
            attrs["root"] = self.integer(0, n - 1)
            out = t.with_placement(axis, REPLICATE)
        else:  # recv: replicated on the other axes, anything on its own
            shape = self.shape()
            own = [p for a, p in self.placements(shape) if a == axis]
            attrs["peer"] = self.integer(0, n)
            t = TensorType(shape, self.choice(NUM_DTYPES), tuple((axis, p) for p in own))
            self.emit(blk, name, [], [t], attrs, derive=False)
            return
        self.emit(blk, name, [x], [out], attrs, derive=False)

    # ------------------------------------------------------------ quantization
    def quant(self, blk: _Block, depth: int) -> None:
        x = self.pick(blk, lambda u: u.dtype.is_float
                      and all(isinstance(p, FlatShard) for _, p in u.placements))
        if x is None:
            return
        t = self.types[x]
        bits = self.integer(1, 8)
        if self.coin():
            packed = self.emit(blk, "pack", [x], [TensorType((math.ceil(t.numel * bits / 8),),
                                                             DType.u8)], {"bits": bits})
            if packed and self.coin():
                self.emit(blk, "unpack", packed, [TensorType(t.shape, t.dtype)],
                          {"bits": bits, "dtype": t.dtype.value})
            return
        gs = self.integer(1, 8)
        attrs: dict = {"bits": bits, "group_size": gs}
        inputs = [x]
        rounding = self.choice([None, "nearest", "stochastic"])
        if rounding == "stochastic":
            key = self.pick(blk, lambda u: u.dtype is DType.key and u.shape == ()
                            and not u.placements)
            if key is None:
                rounding = "nearest"
            else:
                inputs.append(key)
        if rounding:
            attrs["rounding"] = rounding
        scheme = self.choice([None, "symmetric", "asymmetric"])
        if scheme:
            attrs["scheme"] = scheme
        groups = (-(-t.numel // gs),)
        outs = [TensorType(t.shape, DType.u8 if scheme == "asymmetric" else DType.i8),
                TensorType(groups, t.dtype)]
        if scheme == "asymmetric":
            outs.append(TensorType(groups, t.dtype))
        q = self.emit(blk, "quantize", inputs, outs, attrs)
        if q and self.coin():
            dt = self.choice(FLOAT_DTYPES)
            self.emit(blk, "dequantize", q, [TensorType(t.shape, dt)],
                      {"bits": bits, "group_size": gs, "dtype": dt.value})

    # ------------------------------------------------------------ opaque
    def opaque(self, blk: _Block, depth: int) -> None:
        ins = self.pick_many(blk, lambda u: not u.placements, 3)
        outs = [TensorType(self.shape(), self.choice(list(DType)))
                for _ in range(self.integer(0, 2))]
        attrs = self.draw(OPAQUE_ATTRS)
        attrs["target"] = self.draw(STRINGS)
        if self.coin():
            attrs["effectful"] = self.coin()
        self.emit(blk, "opaque", ins, outs, attrs)

    # ------------------------------------------------------------ control flow
    def _replicated(self, blk: _Block, max_size: int, min_size: int = 0) -> list[str]:
        return self.pick_many(blk, lambda u: not u.placements, max_size, min_size)

    def _replicated_in(self, blk: _Block) -> list[str]:
        # control-flow results are replicated, and a region yields exactly their types
        return [v for v in blk.visible if not self.types[v].placements]

    def call(self, blk: _Block, depth: int) -> None:
        ins = self._replicated(blk, 3)
        name, args, inner = self.region(blk, depth, [self.types[i] for i in ins])
        ys = self.some(self._replicated_in(inner), 3)
        attrs = {"callee": self.draw(STRINGS)} if self.coin() else {}
        self.emit(blk, "call", ins, [self.types[y].replicated() for y in ys], attrs,
                  (Region(name, args, tuple(inner.ops), tuple(ys)),))

    def cond(self, blk: _Block, depth: int) -> None:
        pred = self.pick(blk, lambda u: u.shape == () and not u.placements
                         and (u.dtype is DType.bool or u.dtype.is_int))
        if pred is None or self.integer(0, 3) == 0:
            dt = self.choice([DType.bool, DType.i32, DType.u8])
            pred = self.full(blk, TensorType((), dt), self.choice([0, 1]))
        ins = self._replicated(blk, 2)
        arg_types = [self.types[i] for i in ins]
        outs: list[TensorType] | None = None
        regions = []
        for _ in range(self.choice([2, 2, 2, 1, 3])):
            name, args, inner = self.region(blk, depth, arg_types)
            if outs is None:
                ys = self.some(self._replicated_in(inner), 2)
                outs = [self.types[y].replicated() for y in ys]
            else:
                ys = [self.matching(inner, t) for t in outs]
            regions.append(Region(name, args, tuple(inner.ops), tuple(ys)))
        self.emit(blk, "cond", [pred] + ins, outs, regions=tuple(regions))

    def while_(self, blk: _Block, depth: int) -> None:
        ins = self._replicated(blk, 2, min_size=1)
        if not ins:
            ins = [self.full(blk, TensorType(self.shape(), self.choice(NUM_DTYPES)))]
        types = [self.types[i] for i in ins]
        cname, cargs, cblk = self.region(blk, depth, types)
        cy = self.matching(cblk, TensorType((), DType.bool))
        bname, bargs, bblk = self.region(blk, depth, types)
        bys = [self.matching(bblk, t) for t in types]
        self.emit(blk, "while", ins, types,
                  regions=(Region(cname, cargs, tuple(cblk.ops), (cy,)),
                           Region(bname, bargs, tuple(bblk.ops), tuple(bys))))

    def scan(self, blk: _Block, depth: int) -> None:
        consts = self._replicated(blk, 1)
        carry = self._replicated(blk, 2)
        xs = self._replicated(blk, 1)
        xs = [x for x in xs if self.types[x].rank >= 1]
        if xs:
            length = self.types[xs[0]].shape[0]
            xs += self.pick_many(blk, lambda u: not u.placements and u.rank >= 1
                                 and u.shape[0] == length, 1)
        else:
            length = self.integer(0, 4)
        ct = [self.types[c] for c in consts + carry]
        xt = [self.types[x].with_shape(self.types[x].shape[1:]) for x in xs]
        name, args, inner = self.region(blk, depth, ct + xt)
        ys = [self.matching(inner, self.types[c]) for c in carry]
        ys += self.some(self._replicated_in(inner), 2)
        stacked = [TensorType((length,) + self.types[y].shape, self.types[y].dtype)
                   for y in ys[len(carry):]]
        attrs: dict = {"length": length, "num_carry": len(carry)}
        if consts or self.coin():
            attrs["num_consts"] = len(consts)
        if self.coin():
            attrs["reverse"] = self.coin()
        self.emit(blk, "scan", consts + carry + xs,
                  [self.types[c].replicated() for c in carry] + stacked, attrs,
                  (Region(name, args, tuple(inner.ops), tuple(ys)),))


# ---------------------------------------------------------------- the graph strategy

@st.composite
def graphs(draw) -> Graph:
    """A random graph that passes ``verify``."""
    n_axes = draw(st.sampled_from([0, 1, 1, 2, 2]))
    axes = draw(st.lists(st.sampled_from(["dp", "tp", "pp", "x_1", "R", "inf", "true"]),
                         unique=True, min_size=n_axes, max_size=n_axes))
    mesh = {a: draw(st.integers(1, 4)) for a in axes}
    b = _Builder(draw, mesh)
    top = _Block([])

    # inputs: every role; optimizer state links to a parameter declared anywhere
    kinds = draw(st.lists(st.sampled_from(list(InputKind)), max_size=6))
    typed = []
    for kind in kinds:
        if kind is InputKind.rng:
            t = TensorType(draw(st.sampled_from([(), (), (2,)])), DType.key)
        else:
            shape = b.shape()
            t = TensorType(shape, draw(st.sampled_from(NUM_DTYPES)), b.placements(shape))
        name = b.fresh()
        b.define(top, name, t)
        typed.append((name, kind, t))
    params = [n for n, k, _ in typed if k is InputKind.param]
    inputs = []
    for name, kind, t in typed:
        of = slot = None
        if kind is InputKind.opt_state:
            if params and draw(st.integers(0, 3)):
                of = draw(st.sampled_from(params))
            slot = draw(st.none() | STRINGS)
        elif draw(st.integers(0, 4)) == 0:
            slot = draw(STRINGS)  # the role allows a slot on any kind
        inputs.append(Input(Value(name, t), InputRole(kind, of, slot)))

    b.block(top, 0, 12)

    # outputs: at most one scalar loss, metrics, each input replaced at most once, others
    outputs = []
    if draw(st.booleans()):
        loss = b.pick(top, lambda t: t.numel == 1)
        if loss is not None:
            outputs.append(Output(loss, OutputRole(OutputKind.loss)))
    for i in draw(st.permutations(inputs)):
        if draw(st.booleans()):
            new = b.pick(top, lambda t, want=i.value.type: t == want)
            outputs.append(Output(new, OutputRole(OutputKind.replaces, i.name)))
    for n in b.pick_many(top, lambda t: True, 3):
        kind = draw(st.sampled_from([OutputKind.metric, OutputKind.other]))
        outputs.append(Output(n, OutputRole(kind)))
    outputs = draw(st.permutations(outputs))

    return Graph(draw(NAMES), tuple(inputs), tuple(top.ops), tuple(outputs),
                 Mesh(tuple(mesh.items())), tuple(draw(st.lists(PASSES, max_size=3))))


# ---------------------------------------------------------------- properties

@settings(max_examples=120, deadline=None)
@given(graphs())
def test_random_graphs_round_trip(g: Graph) -> None:
    verify(g)  # the strategy makes only well-formed graphs
    text = print_graph(g)
    note(text)
    back = parse(text)
    assert back == g
    assert print_graph(back) == text
    verify(back)


# ---------------------------------------------------------------- plain tests

def test_example_round_trips_and_verifies() -> None:
    g = parse(EXAMPLE.read_text())
    verify(g)
    assert g.name == "mlp_sgd_step"
    text = print_graph(g)
    assert parse(text) == g
    assert print_graph(parse(text)) == text


CANONICAL = """\
# diphoma-ir v1
graph @"step one" mesh[dp=2, tp=4] passes[dce, "comm-fusion{bucket-mb=25}"] (
  %w: f32[8,4] {dp: S(0), tp: S(1)} param,
  %"w m": f32[8,4] {dp: S(0), tp: S(1)} opt_state(of=%w, slot="m\\u00e9"),
  %x: f32[2,8] {dp: P(sum)} batch,
  %k: key[] rng,
  %"b\\"q": bf16[0,3] {tp: F} buffer(slot=x),
) {
  %y: f32[2,8] {dp: P(sum)} = neg(%x) phase=forward stage=0 mb=1 loc="a\\nb \\u03bb"
  %z: f32[2,8] = all_reduce(%y) {axis=dp, op=sum} phase=forward
  %r: f32[3] = opaque(%z) {e=-0.0, f=[nan, inf, -inf, 1e-300], n=none, s="true", target=t, u=[]}
  %c: i32[] = full() {value=1}
  %"o@:": f32[2,8] = cond(%c, %z) (
    ^then(%a: f32[2,8]) {
      %a2: f32[2,8] = copy(%a) phase=backward
      yield %a2
    }
    ^"else branch"(%b: f32[2,8]) {
      yield %b
    }
  )
  return (
    %"o@:" metric,
    %w replaces(%w),
    %r,
  )
}
"""


def test_printing_is_canonical() -> None:
    g = parse(CANONICAL)
    verify(g)
    assert print_graph(g) == CANONICAL
    assert parse(print_graph(g)) == g


def test_attrs_equality_by_text_form() -> None:
    assert Attrs(v=math.nan) == Attrs(v=float("nan"))
    assert Attrs(v=[1, math.nan]) == Attrs(v=(1, float("nan")))
    assert hash(Attrs(v=math.nan)) == hash(Attrs(v=float("nan")))
    assert Attrs(v=-0.0) != Attrs(v=0.0)
    assert Attrs(v=0) != Attrs(v=0.0)
    assert Attrs(v=True) != Attrs(v=1)
    assert Attrs(v=[]) == Attrs(v=())
    op = Op("full", results=(Value("x", TensorType((), DType.f32)),), attrs={"value": math.nan})
    assert op == op.replace(attrs=Attrs(value=float("nan")))
    assert op != op.replace(attrs=Attrs(value=0.0))
