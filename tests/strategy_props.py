"""Property checks of sharding strategies (``diphoma_compile.ir.strategies``), shared by the
torch and JAX tests: every strategy an op's menu offers over ``n`` devices must give the
op's whole result.

A check builds the one-op graph on whole tensors and runs it; then, for each strategy of
``candidates(op, ins, outs, n)``, it cuts each input as its placement says (a split: chunk k
of n; a partial sum: n random pieces that sum to the input), builds the same op on the local
types (local shapes; attributes that carry shapes adjusted, ``ADJUST``), runs it once per
device on that device's pieces, combines the local results as the result placements say
(a split: concatenate; a partial sum or max: reduce; replicated: every device's result is
the whole one) and compares with the whole result. A masked strategy (vocab-parallel
lookups) shifts and masks indices as the strategies module says (``MASK``).

The framework runs the graphs: ``Runner(jobs) -> results``, a job being a graph and its
input arrays (numpy), a result the arrays of its outputs. The cases are seeded and small;
``neutral_cases`` builds them for every neutral op row with a menu (a framework's tests
build cases of the ops it keeps opaque the same way, ``Case("opaque", ...)``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from diphoma_compile.ir import (Attrs, DType, Graph, Input, InputKind, InputRole, Op, Output,
                                Partial, Replicate, Shard, TensorType, Value, verify)
from diphoma_compile.ir.ops import OPS
from diphoma_compile.ir.strategies import Strategy, candidates, strategies_of

Job = tuple[Graph, list[np.ndarray]]          # a graph and its input arrays
Runner = Callable[[Sequence[Job]], list[list[np.ndarray]]]   # each job's result arrays
# (op, local input types, local result types, strategy, n) -> the local op's attributes
Adjust = Callable[[Op, list[TensorType], list[TensorType], Strategy, int], Attrs]
# (op, strategy, n, device, local inputs) -> (inputs to run, fix of the local results)
Mask = Callable[[Op, Strategy, int, int, list[np.ndarray]],
                tuple[list[np.ndarray], Callable[[list[np.ndarray]], list[np.ndarray]]]]

NUMPY_OF = {DType.f32: np.float32, DType.f64: np.float64, DType.i32: np.int32,
            DType.i64: np.int64, DType.u32: np.uint32, DType.u8: np.uint8,
            DType.bool: np.bool_}
DTYPE_OF = {np.dtype(v): k for k, v in NUMPY_OF.items()}


@dataclass
class Case:
    """One op on whole inputs: its name, attributes, input arrays and result types."""

    name: str
    data: list[np.ndarray]
    outs: list[TensorType]
    attrs: dict = field(default_factory=dict)
    hyper: tuple[int, ...] = ()   # inputs that are host scalars (a scale given at run time)

    @property
    def ins(self) -> list[TensorType]:
        return [TensorType(a.shape, DTYPE_OF[a.dtype]) for a in self.data]

    @property
    def op(self) -> Op:
        return op_of(self.name, self.ins, self.outs, self.attrs)

    def __str__(self) -> str:
        ins = ", ".join(map(str, self.ins))
        attrs = ", ".join(f"{k}={v}" for k, v in self.attrs.items() if k != "target")
        what = self.attrs.get("target", self.name)
        return f"{what}({ins}) {{{attrs}}} -> {', '.join(map(str, self.outs))}"


def op_of(name: str, ins: Sequence[TensorType], outs: Sequence[TensorType],
          attrs: dict | Attrs) -> Op:
    """The op reading inputs a0, a1, ... and giving r0, r1, ..."""
    return Op(name, tuple(f"a{i}" for i in range(len(ins))),
              tuple(Value(f"r{i}", t) for i, t in enumerate(outs)), Attrs(dict(attrs)))


def graph_of(op: Op, ins: Sequence[TensorType], hyper: Sequence[int] = ()) -> Graph:
    """The verified one-op graph of ``op``; inputs at ``hyper`` are hyperparameters."""
    roles = [InputRole(InputKind.hyper if i in hyper else InputKind.other)
             for i in range(len(ins))]
    g = Graph("one_op", tuple(Input(Value(f"a{i}", t), r)
                              for i, (t, r) in enumerate(zip(ins, roles))), (op,),
              tuple(Output(v.name) for v in op.results))
    verify(g)
    return g


# ---------------------------------------------------------------- placements

def local_type(t: TensorType, p, n: int) -> TensorType:
    """The type of one device's piece."""
    if isinstance(p, Shard):
        shape = list(t.shape)
        shape[p.dim] //= n
        return TensorType(tuple(shape), t.dtype)
    return TensorType(t.shape, t.dtype)


def pieces(x: np.ndarray, p, n: int, rng: np.random.Generator) -> tuple[np.ndarray, list]:
    """(the whole value, each device's piece) of input ``x`` placed ``p``; a partial sum's
    whole value is the sum of its random pieces."""
    if isinstance(p, Replicate):
        return x, [x] * n
    if isinstance(p, Shard):
        # a split of k groups: device r holds the r-th piece of every group, in group order
        per_group = [np.split(g, n, axis=p.dim) for g in np.split(x, p.groups, axis=p.dim)]
        return x, [np.concatenate([g[r] for g in per_group], axis=p.dim) for r in range(n)]
    if isinstance(p, Partial) and p.op == "sum":
        if x.dtype == np.bool_:
            raise AssertionError("a partial sum of booleans")
        if np.issubdtype(x.dtype, np.integer):
            ps = [rng.integers(-3, 4, x.shape).astype(x.dtype) for _ in range(n)]
        else:
            ps = [rng.standard_normal(x.shape).astype(x.dtype) for _ in range(n)]
        return np.sum(ps, axis=0).astype(x.dtype), ps
    if isinstance(p, Partial) and p.op in ("max", "min") and x.dtype.kind == "f":
        # each element whole on one device, below (above) it on the others
        owner = rng.integers(n, size=x.shape)
        gap = (np.abs(rng.standard_normal((n,) + x.shape)) + 0.1).astype(x.dtype)
        sign = -1 if p.op == "max" else 1
        return x, [np.where(owner == k, x, x + sign * gap[k]).astype(x.dtype)
                   for k in range(n)]
    raise AssertionError(f"no test pieces for input placement {p}")


def combine(outs: list[np.ndarray], p, whole: np.ndarray) -> np.ndarray:
    """The value the devices' results stand for under placement ``p``."""
    if isinstance(p, Shard):
        per_device = [np.split(o, p.groups, axis=p.dim) for o in outs]
        return np.concatenate([per_device[r][g] for g in range(p.groups)
                               for r in range(len(outs))], axis=p.dim)
    if isinstance(p, Replicate):
        for o in outs[1:]:
            close(o, outs[0], "devices disagree on a replicated result")
        return outs[0]
    if isinstance(p, Partial):
        red = {"sum": np.sum, "max": np.max, "min": np.min, "avg": np.mean}[p.op]
        # partial sums of a float32 result are added in float64: the test's own rounding
        # must not hide (or fake) a difference
        acc = np.stack(outs).astype(np.float64) if whole.dtype.kind == "f" else np.stack(outs)
        return red(acc, axis=0).astype(whole.dtype)
    raise AssertionError(f"no combination for result placement {p}")


def close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Equal for integers and booleans, equal to rounding for floats (NaN equals NaN)."""
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    if got.dtype.kind == "f":
        scale = max(1.0, float(np.nanmax(np.abs(np.where(np.isinf(want), 0, want)),
                                         initial=0.0)))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale, equal_nan=True,
                                   err_msg=what)
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


# ---------------------------------------------------------------- local ops

def adjust_slice(op: Op, ins, outs, s: Strategy, n: int) -> Attrs:
    """A split dim of a slice is untouched: its limit is the local size."""
    limits = list(op.attrs["limits"])
    if isinstance(s.inputs[0], Shard):
        limits[s.inputs[0].dim] = ins[0].shape[s.inputs[0].dim]
    return op.attrs.set(limits=tuple(limits))


ADJUST: dict[str, Adjust] = {"slice": adjust_slice}


def _vocab_shift(idx: np.ndarray, chunk: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(indices into device k's chunk, clamped into it; where they fall in it)."""
    local = idx - k * chunk
    inside = (local >= 0) & (local < chunk)
    return np.where(inside, local, 0).astype(idx.dtype), inside


def _around(mask: np.ndarray, before: int, after: int) -> np.ndarray:
    """The index-shaped mask broadcastable over a value with ``before`` dims before the
    indexed ones and ``after`` after them."""
    return mask.reshape((1,) * before + mask.shape + (1,) * after)


def mask_index_select(op: Op, s: Strategy, n: int, k: int, xs: list[np.ndarray]):
    """Vocab-parallel lookup: device k looks up the indices of its rows, zeros the rest."""
    table, idx = xs
    ax = op.attrs["axis"]
    local, inside = _vocab_shift(idx, table.shape[ax], k)
    m = _around(inside, ax, table.ndim - ax - 1)
    return [table, local], lambda outs: [np.where(m, outs[0], np.zeros((), outs[0].dtype))]


def mask_index_add(op: Op, s: Strategy, n: int, k: int, xs: list[np.ndarray]):
    """Vocab-parallel update: device k adds the updates of its rows, drops the rest."""
    base, idx, upd = xs
    ax = op.attrs["axis"]
    local, inside = _vocab_shift(idx, base.shape[ax], k)
    m = _around(inside, ax, base.ndim - ax - 1)
    return [base, local, np.where(m, upd, np.zeros((), upd.dtype))], lambda outs: outs


MASK: dict[str, Mask] = {"index_select": mask_index_select, "index_add": mask_index_add}


def family(op: Op) -> str:
    """The key of an op in ADJUST and MASK: its name, or an opaque op's target."""
    return str(op.attrs["target"]) if op.name == "opaque" else op.name


def local_op(op: Op, ins: Sequence[TensorType], s: Strategy, n: int,
             adjust: dict[str, Adjust]) -> tuple[Op, list[TensorType]]:
    """The op each device runs, and its input types."""
    lins = [local_type(t, p, n) for t, p in zip(ins, s.inputs)]
    louts = [local_type(v.type, p, n) for v, p in zip(op.results, s.outputs)]
    fn = adjust.get(family(op))
    attrs = fn(op, lins, louts, s, n) if fn else op.attrs
    return op_of(op.name, lins, louts, attrs), lins


# ---------------------------------------------------------------- the property

@dataclass
class Checked:
    """What one case's check covered: strategies run (by n), and the failures."""

    family: str = ""
    ran: list[tuple[int, Strategy]] = field(default_factory=list)
    offered: set[str] = field(default_factory=set)   # the kinds of strategy on the menu
    failures: list[str] = field(default_factory=list)

    @property
    def kinds(self) -> set[str]:
        """The kinds of strategy that ran (their names; a masked one marked)."""
        return {kind(s) for _, s in self.ran}


def kind(s: Strategy) -> str:
    """A strategy's name, marked when it is masked."""
    return f"{s.name} (masked)" if s.masked else s.name


def check_case(case: Case, run: Runner, ns: Sequence[int] = (2, 4),
               adjust: dict[str, Adjust] | None = None, mask: dict[str, Mask] | None = None,
               seed: int = 0, groups: Sequence[int] = ()) -> Checked:
    """Run every candidate strategy of the case's op over each ``n`` and compare (with
    ``groups``: only the menu's splits of that many groups, ``regrouped`` ones included)."""
    return check_cases([case], run, ns, adjust, mask, seed, groups)[0]


def check_cases(cases: Sequence[Case], run: Runner, ns: Sequence[int] = (2, 4),
                adjust: dict[str, Adjust] | None = None, mask: dict[str, Mask] | None = None,
                seed: int = 0, groups: Sequence[int] = ()) -> list[Checked]:
    """``check_case`` of each case; all their graphs go to the runner at once (JAX
    compiles them as one program)."""
    adjust = {**ADJUST, **(adjust or {})}
    mask = {**MASK, **(mask or {})}
    jobs: list[Job] = []
    checked, plans = [], []
    for k, case in enumerate(cases):
        done = Checked(family(case.op))
        plans += _plan_case(case, ns, adjust, mask, np.random.default_rng(seed + k), jobs, done,
                            groups)
        checked.append(done)
    results = _run_all(run, jobs)
    for done, where, s, (whole, devices) in plans:
        try:
            _compare(s, results[whole], [(results[j], fix) for j, fix in devices])
        except Exception as e:    # noqa: BLE001 - every failure is reported with its case
            done.failures.append(f"{where}: {type(e).__name__}: {e}")
    return checked


def _grouped(s: Strategy) -> bool:
    return any(isinstance(p, Shard) and p.groups > 1 for p in s.inputs + s.outputs)


def _plan_case(case: Case, ns, adjust, mask, rng, jobs: list[Job], done: Checked,
               groups: Sequence[int] = ()) -> list:
    """Add the case's graphs to ``jobs``; the strategies to compare once they ran."""
    op, ins = case.op, case.ins
    outs = [v.type for v in op.results]
    base = len(jobs)
    jobs.append((graph_of(op, ins, case.hyper), list(case.data)))
    menu = [s for s in strategies_of(op, ins, outs, groups) if not groups or _grouped(s)]
    done.offered |= {kind(s) for s in menu}
    done.failures += [f"{case}: {s}: {e}" for s in menu if (e := malformed(s, ins, outs))]
    plans = []
    for n in ns:
        for s in candidates(op, ins, outs, n, masked=True, **({"groups": groups} if groups
                                                               else {})):
            if groups and not _grouped(s):
                continue
            where = f"{case} under {s} over {n} devices"
            done.ran.append((n, s))
            try:
                plans.append((done, where, s, _plan(case, s, n, adjust, mask, rng, jobs, base)))
            except Exception as e:    # noqa: BLE001
                done.failures.append(f"{where}: {type(e).__name__}: {e}")
    return plans


def malformed(s: Strategy, ins: Sequence[TensorType], outs: Sequence[TensorType]) -> str:
    """What is wrong with a strategy's shape, or "": a placement per operand and result,
    and splits of dims that exist (``fits_axis`` drops the others without a word, so that a
    wrong dim would hide a strategy instead of failing its check)."""
    if len(s.inputs) != len(ins) or len(s.outputs) != len(outs):
        return (f"{len(s.inputs)} input and {len(s.outputs)} result placements for "
                f"{len(ins)} inputs and {len(outs)} results")
    for p, t in list(zip(s.inputs, ins)) + list(zip(s.outputs, outs)):
        if isinstance(p, Shard) and not 0 <= p.dim < t.rank:
            return f"splits dim {p.dim} of {t}"
    return ""


def _plan(case, s, n, adjust, mask, rng, jobs: list[Job], whole: int):
    """Add the strategy's graphs to ``jobs``: (the job of the whole result, and each
    device's job with the fix of its results)."""
    op, ins = case.op, case.ins
    cut = [pieces(x, p, n, rng) for x, p in zip(case.data, s.inputs)]
    if any(isinstance(p, Partial) for p in s.inputs):
        jobs.append((graph_of(op, ins, case.hyper), [w for w, _ in cut]))
        whole = len(jobs) - 1
    lop, lins = local_op(op, ins, s, n, adjust)
    g = graph_of(lop, lins, case.hyper)
    devices = []
    for k in range(n):
        xs = [ps[k] for _, ps in cut]
        fix = None
        if s.masked:
            xs, fix = mask[family(op)](op, s, n, k, xs)
        jobs.append((g, xs))
        devices.append((len(jobs) - 1, fix))
    return whole, devices


def _run_all(run: Runner, jobs: list[Job]) -> list:
    """Each job's results, or the exception it raised (one failing graph must not hide
    what the others show)."""
    try:
        return list(run(jobs))
    except Exception:    # noqa: BLE001 - run them one by one to say which failed
        out = []
        for job in jobs:
            try:
                out.append(run([job])[0])
            except Exception as e:    # noqa: BLE001
                out.append(e)
        return out


def _compare(s: Strategy, whole, devices) -> None:
    for r, _ in [(whole, None)] + devices:
        if isinstance(r, Exception):
            raise r
    local = [fix(r) if fix else r for r, fix in devices]
    for i, (p, w) in enumerate(zip(s.outputs, whole)):
        w = np.asarray(w)
        close(combine([np.asarray(o[i]) for o in local], p, w), w, f"result {i}")


def assert_all(checked: Sequence[Checked]) -> None:
    """Fail with every failure listed, and when a kind of strategy the menus offered never
    ran (no case had dims it could split evenly: the check would prove nothing of it)."""
    failures = [f for c in checked for f in c.failures]
    assert not failures, f"{len(failures)} failing strategies:\n" + "\n".join(failures[:40])
    for name in sorted({c.family for c in checked}):
        offered = set().union(*(c.offered for c in checked if c.family == name))
        ran = set().union(*(c.kinds for c in checked if c.family == name))
        assert offered - {"replicate"}, f"{name}: the cases offer no strategy but running whole"
        assert offered <= ran, f"{name}: offered but never run: {sorted(offered - ran)}"


# ---------------------------------------------------------------- cases of the neutral ops

UNARY = ("neg copy abs sqrt square relu tanh sin sign floor ceil round expm1 log1p erf exp "
         "log rsqrt sigmoid cos reciprocal").split()
POSITIVE = {"sqrt", "log", "rsqrt", "log1p", "reciprocal", "pow", "rem", "div", "addcdiv"}
BINARY = "add sub max min mul div pow rem atan2".split()
BITWISE = "and or xor".split()
COMPARE = "eq ne lt le gt ge".split()
REDUCE = "reduce_sum reduce_max reduce_min reduce_mean reduce_prod".split()


def _shape(rng: np.random.Generator, rank: int, sizes=(1, 2, 3, 4, 8)) -> tuple[int, ...]:
    # mostly even sizes (splittable over 2 and 4), some odd and some 1 (broadcast, unsplit);
    # at least one splittable dim, so that a case checks more than running whole
    shape = [int(rng.choice(sizes, p=[.1, .3, .1, .3, .2])) for _ in range(rank)]
    if rank and not any(d % 2 == 0 for d in shape):
        shape[int(rng.integers(rank))] = 4
    return tuple(shape)


def sample(rng: np.random.Generator, shape, dtype=np.float32, positive=False) -> np.ndarray:
    """Random values of a dtype: normal floats (above 0.5 when ``positive``), small
    integers, fair booleans."""
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-5, 6, shape).astype(dtype)
    x = rng.standard_normal(shape).astype(dtype)
    return (np.abs(x) + 0.5).astype(dtype) if positive else x


def _operand_shape(rng, out: tuple[int, ...]) -> tuple[int, ...]:
    """An operand that broadcasts to ``out``: the same, some dims 1, a suffix, or 0-d."""
    kind = rng.integers(4)
    if kind == 0:
        return out
    if kind == 1:
        return tuple(1 if rng.random() < 0.5 else d for d in out)
    if kind == 2:
        return out[rng.integers(len(out) + 1):]
    return ()


def _t(shape, dtype=DType.f32) -> TensorType:
    return TensorType(tuple(shape), dtype)


def _elementwise_cases(rng) -> list[Case]:
    cases = []
    for name in UNARY:
        x = sample(rng, _shape(rng, int(rng.integers(1, 4))), positive=name in POSITIVE)
        cases.append(Case(name, [x], [_t(x.shape)]))
    for approx in ("none", "tanh"):
        x = sample(rng, _shape(rng, 2))
        cases.append(Case("gelu", [x], [_t(x.shape)], {"approximate": approx}))
    x = sample(rng, _shape(rng, 3))
    cases.append(Case("integer_pow", [x], [_t(x.shape)], {"exponent": int(rng.choice([2, 3]))}))
    b = sample(rng, _shape(rng, 2), np.bool_)
    cases.append(Case("logical_not", [b], [_t(b.shape, DType.bool)]))
    for name in ("isfinite", "isnan"):
        x = sample(rng, _shape(rng, 2))
        specials = np.array([np.nan, np.inf, -np.inf], np.float32)
        x.flat[::3] = specials[np.arange(len(x.flat[::3])) % 3]
        cases.append(Case(name, [x], [_t(x.shape, DType.bool)]))
    for name in BINARY + COMPARE + BITWISE:
        for _ in range(2):
            out = _shape(rng, int(rng.integers(1, 4)))
            dt = np.int32 if name in BITWISE and rng.random() < 0.5 else \
                np.bool_ if name in BITWISE else np.float32
            shapes = [_operand_shape(rng, out), _operand_shape(rng, out)]
            shapes[int(rng.integers(2))] = out    # one operand has the result's shape
            xs = [sample(rng, s, dt, positive=name in POSITIVE) for s in shapes]
            rdt = DType.bool if name in COMPARE else DTYPE_OF[np.dtype(dt)]
            attrs = {}
            if name in ("add", "sub") and rng.random() < 0.5:
                if rng.random() < 0.5:
                    attrs["alpha"] = 2.0
                else:
                    xs.append(np.array(0.5, np.float32))   # alpha computed at run time
            cases.append(Case(name, xs, [_t(out, rdt)], attrs, hyper=(2,)))
    for name in ("select", "clamp", "lerp", "addcmul", "addcdiv"):
        for _ in range(2):
            out = _shape(rng, int(rng.integers(1, 4)))
            shapes = [_operand_shape(rng, out) for _ in range(3)]
            shapes[int(rng.integers(3))] = out
            xs = [sample(rng, s, positive=name in POSITIVE and i == 2)
                  for i, s in enumerate(shapes)]
            attrs = {}
            if name == "select":
                xs[0] = sample(rng, shapes[0], np.bool_)
            if name == "clamp":
                xs[1], xs[2] = -np.abs(xs[1]), np.abs(xs[2])   # lo <= hi
            if name == "lerp":
                xs[2] = rng.random(shapes[2]).astype(np.float32)  # weights both sides of 0.5
            if name in ("addcmul", "addcdiv") and rng.random() < 0.5:
                if rng.random() < 0.5:
                    attrs["value"] = 0.5
                else:
                    xs.append(np.array(-1.5, np.float32))
            cases.append(Case(name, xs, [_t(out)], attrs, hyper=(3,)))
    for src, dst in ((np.float32, DType.i32), (np.int32, DType.f32), (np.float32, DType.f64)):
        x = sample(rng, _shape(rng, 2), src)
        cases.append(Case("convert", [x * 3 if src == np.float32 else x], [_t(x.shape, dst)],
                          {"dtype": dst.value}))
    x = sample(rng, _shape(rng, 3))
    cases.append(Case("bitcast", [x], [_t(x.shape, DType.i32)], {"dtype": "i32"}))
    return cases


def _reduced(shape, dims, keep) -> tuple[int, ...]:
    return tuple(1 if i in dims else s for i, s in enumerate(shape)) if keep else \
        tuple(s for i, s in enumerate(shape) if i not in dims)


def _reduce_cases(rng) -> list[Case]:
    cases = []
    for name in REDUCE + ["norm", "argmax", "argmin"]:
        for draw in range(3):
            # the first draw keeps a dim, so that more than the reduced dims can split
            shape = _shape(rng, int(rng.integers(2 if draw == 0 else 1, 4)))
            rank = len(shape)
            if name in ("argmax", "argmin"):
                dims = (int(rng.integers(rank)),)
            else:
                k = 1 if draw == 0 else int(rng.integers(1, rank + 1))
                dims = tuple(sorted(int(d) for d in rng.choice(rank, k, replace=False)))
            keep = bool(rng.random() < 0.5)
            x = sample(rng, shape, positive=name == "reduce_prod")
            attrs = {"dims": dims, "keepdim": keep}
            dt = DType.f32
            if name == "norm":
                attrs["ord"] = float(rng.choice([1.0, 2.0, math.inf]))
            if name in ("argmax", "argmin"):
                dt = DType.i64
            cases.append(Case(name, [x], [_t(_reduced(shape, dims, keep), dt)], attrs))
        # kept dims that split over 2 and 4, around a reduced one
        x = sample(rng, (4, 6, 8), positive=name == "reduce_prod")
        attrs = {"dims": (1,), "keepdim": False, **({"ord": 2.0} if name == "norm" else {})}
        dt = DType.i64 if name in ("argmax", "argmin") else DType.f32
        cases.append(Case(name, [x], [_t((4, 8), dt)], attrs))
    return cases


def _dot_cases(rng) -> list[Case]:
    cases = []
    configs = [(0, 1, 1, 1), (1, 1, 1, 1), (0, 1, 2, 1), (2, 1, 1, 1), (1, 2, 1, 2),
               (0, 2, 1, 1), (1, 1, 0, 1), (0, 1, 1, 0)]
    for nb, nc, nlf, nrf in configs:
        b, c = _shape(rng, nb), _shape(rng, nc)
        lf, rf = _shape(rng, nlf), _shape(rng, nrf)
        # lhs dims: batch, free, contract in a random order (rhs likewise)
        lkinds = [("b", i) for i in range(nb)] + [("f", i) for i in range(nlf)] + \
            [("c", i) for i in range(nc)]
        rkinds = [("b", i) for i in range(nb)] + [("c", i) for i in range(nc)] + \
            [("f", i) for i in range(nrf)]
        if rng.random() < 0.5:
            lkinds = [lkinds[i] for i in rng.permutation(len(lkinds))]
            rkinds = [rkinds[i] for i in rng.permutation(len(rkinds))]
        size = {"b": b, "c": c}

        lhs = sample(rng, tuple(lf[i] if k == "f" else size[k][i] for k, i in lkinds))
        rhs = sample(rng, tuple(rf[i] if k == "f" else size[k][i] for k, i in rkinds))
        attrs = {"lhs_contract": tuple(lkinds.index(("c", i)) for i in range(nc)),
                 "rhs_contract": tuple(rkinds.index(("c", i)) for i in range(nc))}
        if nb:
            attrs["lhs_batch"] = tuple(lkinds.index(("b", i)) for i in range(nb))
            attrs["rhs_batch"] = tuple(rkinds.index(("b", i)) for i in range(nb))
        lf_dims = [lhs.shape[j] for j, (k, _) in enumerate(lkinds) if k == "f"]
        rf_dims = [rhs.shape[j] for j, (k, _) in enumerate(rkinds) if k == "f"]
        cases.append(Case("dot", [lhs, rhs], [_t(b + tuple(lf_dims) + tuple(rf_dims))], attrs))
    return cases


def _layout_cases(rng) -> list[Case]:
    cases = []
    for _ in range(4):
        shape = _shape(rng, int(rng.integers(1, 5)))
        perm = tuple(int(p) for p in rng.permutation(len(shape)))
        cases.append(Case("transpose", [sample(rng, shape)],
                          [_t(tuple(shape[p] for p in perm))], {"perm": perm}))
    x = sample(rng, (2, 4, 8))       # a permutation that is not its own inverse
    cases.append(Case("transpose", [x], [_t((4, 8, 2))], {"perm": (1, 2, 0)}))
    B, S, D, H = 4, 8, 8, 2
    for src, dst in (((B, S, D), (B * S, D)),            # merge batch and sequence
                     ((B, S, D), (B, S, H, D // H)),      # split heads
                     ((B, S, H, D // H), (B, S, D)),      # merge heads
                     ((B, S, D), (B, S, D)),              # unchanged
                     ((4, 6), (4, 2, 3)),                 # dim 0 unchanged, 6 split
                     ((2, 4, 6), (48,)),                  # flatten everything
                     ((8, 1, 4), (2, 4, 4)),              # split dim 0, drop a 1
                     ((4, 4), (4, 1, 4))):                # insert a 1
        cases.append(Case("reshape", [sample(rng, src)], [_t(dst)]))
    for _ in range(4):
        out = _shape(rng, int(rng.integers(1, 4)))
        r = int(rng.integers(0, len(out) + 1))
        dims = tuple(sorted(int(d) for d in rng.choice(len(out), r, replace=False)))
        src = tuple(out[d] if rng.random() < 0.7 else 1 for d in dims)
        cases.append(Case("broadcast_in_dim", [sample(rng, src)], [_t(out)], {"dims": dims}))
    for _ in range(4):
        shape = _shape(rng, int(rng.integers(1, 4)))
        starts, limits, strides, out = [], [], [], []
        for s in shape:
            if rng.random() < 0.5:       # untouched
                a, e, k = 0, s, 1
            else:
                a = int(rng.integers(0, s))
                e = int(rng.integers(a, s + 1))
                k = int(rng.integers(1, 3))
            starts.append(a)
            limits.append(e)
            strides.append(k)
            out.append(-(-(e - a) // k))
        attrs = {"starts": tuple(starts), "limits": tuple(limits)}
        if rng.random() < 0.5:
            attrs["strides"] = tuple(strides)
        else:
            out = [e - a for a, e in zip(starts, limits)]
        cases.append(Case("slice", [sample(rng, shape)], [_t(out)], attrs))
    for value in (0.0, 0.0, 1.5):
        shape = _shape(rng, int(rng.integers(1, 4)))
        low = tuple(int(rng.integers(0, 3)) if rng.random() < 0.5 else 0 for _ in shape)
        high = tuple(int(rng.integers(0, 3)) if rng.random() < 0.5 else 0 for _ in shape)
        out = tuple(s + a + b for s, a, b in zip(shape, low, high))
        cases.append(Case("pad", [sample(rng, shape)], [_t(out)],
                          {"low": low, "high": high, "value": value}))
    for k in (2, 3, 2):
        base = _shape(rng, int(rng.integers(1, 4)))
        dim = int(rng.integers(len(base)))
        xs = []
        for _ in range(k):
            s = list(base)
            s[dim] = int(rng.integers(1, 4))
            xs.append(sample(rng, s))
        out = list(base)
        out[dim] = sum(x.shape[dim] for x in xs)
        cases.append(Case("concat", xs, [_t(out)], {"dim": dim}))
    xs = [sample(rng, (4, 2)), sample(rng, (4, 4))]   # every piece splits along dim 1 too
    cases.append(Case("concat", xs, [_t((4, 6))], {"dim": 1}))
    return cases


def _index_cases(rng) -> list[Case]:
    cases = []
    for table_shape, ax, idx_shape in (((8, 4), 0, (2, 4)), ((8, 4), 0, ()), ((4, 8), 1, (4,)),
                                       ((2, 8, 4), 1, (4, 2)), ((4, 6, 2), 2, (3,))):
        table = sample(rng, table_shape)
        idx = rng.integers(0, table_shape[ax], idx_shape).astype(np.int32)
        out = table_shape[:ax] + idx_shape + table_shape[ax + 1:]
        cases.append(Case("index_select", [table, idx], [_t(out)], {"axis": ax}))
        upd = sample(rng, out)
        base = sample(rng, table_shape)
        cases.append(Case("index_add", [base, idx.astype(np.int64), upd], [_t(table_shape)],
                          {"axis": ax}))
    for src_shape, dim, idx_shape in (((4, 8), 1, (4, 4)), ((8, 4), 0, (2, 4)),
                                      ((4, 6, 4), 1, (4, 3, 4)), ((4, 8), 1, (2, 4)),
                                      ((8,), 0, (4,)), ((4, 8), 1, (4, 8))):
        src = sample(rng, src_shape)
        idx = rng.integers(0, src_shape[dim], idx_shape).astype(np.int64)
        cases.append(Case("gather", [src, idx], [_t(idx_shape)], {"dim": dim}))
        cases.append(Case("scatter_add", [src, idx, sample(rng, idx_shape)], [_t(src_shape)],
                          {"dim": dim}))
    return cases


def _constant_cases(rng) -> list[Case]:
    cases = []
    for value in (0.0, 1.5, 0.0):
        cases.append(Case("full", [], [_t(_shape(rng, int(rng.integers(1, 4))))],
                          {"value": value}))
    for dt in (DType.i32, DType.f32, DType.i64):
        shape = _shape(rng, int(rng.integers(1, 4)))
        cases.append(Case("iota", [], [_t(shape, dt)], {"dim": int(rng.integers(len(shape)))}))
    cases.append(Case("iota", [], [_t((4, 8), DType.i32)], {"dim": 1}))
    return cases


def neutral_cases(seed: int = 0) -> list[Case]:
    """Seeded cases for every neutral op whose table row has a strategy menu."""
    rng = np.random.default_rng(seed)
    return (_elementwise_cases(rng) + _reduce_cases(rng) + _dot_cases(rng) +
            _layout_cases(rng) + _index_cases(rng) + _constant_cases(rng))


def rows_with_strategies() -> set[str]:
    """The neutral ops whose table rows have a strategy menu."""
    return {name for name, d in OPS.items() if d.strategies is not None}
