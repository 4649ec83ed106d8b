"""The strategy menus of the neutral ops, run in PyTorch: every strategy over 2 and 4
devices gives the op's whole result (tests/strategy_props.py says how)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from diphoma_compile.errors import UnsupportedOpError  # noqa: E402
from diphoma_compile.ir import DType, Graph, Op, Shard  # noqa: E402
from diphoma_compile.ir.strategies import Strategy  # noqa: E402
from diphoma_compile.torch.build import build_module  # noqa: E402
from diphoma_compile.torch.ops import DTYPE_TO_TORCH  # noqa: E402

from tests.strategy_props import assert_all, check_case, neutral_cases  # noqa: E402


def _dot(x, y, a) -> torch.Tensor:
    """dot by einsum: result dims are batch, lhs free, rhs free."""
    lb, rb = tuple(a.get("lhs_batch", ())), tuple(a.get("rhs_batch", ()))
    lc, rc = tuple(a["lhs_contract"]), tuple(a["rhs_contract"])
    letters = iter("abcdefghijklmnopqrstuvwxyz")
    lsub = [next(letters) for _ in range(x.dim())]
    rsub = [next(letters) for _ in range(y.dim())]
    for i, j in zip(lb + lc, rb + rc):
        rsub[j] = lsub[i]
    out = [lsub[i] for i in lb] + [lsub[i] for i in range(x.dim()) if i not in lb + lc] + \
        [rsub[j] for j in range(y.dim()) if j not in rb + rc]
    return torch.einsum(f"{''.join(lsub)},{''.join(rsub)}->{''.join(out)}", x, y)


def _index_select(x, idx, ax):
    out = x.index_select(ax, idx.reshape(-1).long())
    return out.reshape(x.shape[:ax] + idx.shape + x.shape[ax + 1:])


def _index_add(base, idx, upd, ax):
    flat = upd.reshape(base.shape[:ax] + (-1,) + base.shape[ax + 1:])
    return base.index_add(ax, idx.reshape(-1).long(), flat)


def _slice(x, a):
    strides = a.get("strides", (1,) * x.dim())
    return x[tuple(slice(s, e, k) for s, e, k in zip(a["starts"], a["limits"], strides))]


def _pad(x, a):
    pairs = [p for lo, hi in reversed(list(zip(a["low"], a["high"]))) for p in (lo, hi)]
    return torch.nn.functional.pad(x, pairs, value=a.get("value", 0))


def _iota(t, a):
    d = a["dim"]
    line = torch.arange(t.shape[d]).reshape([-1 if i == d else 1 for i in range(t.rank)])
    return line.expand(t.shape).to(DTYPE_TO_TORCH[t.dtype]).contiguous()


def _reduce_prod(x, a):
    out = x
    for d in sorted(a["dims"], reverse=True):
        out = out.prod(d, keepdim=True)
    return out if a.get("keepdim") else out.reshape(
        [s for i, s in enumerate(x.shape) if i not in a["dims"]])


# IR ops the torch backend has no lowering for yet: their meaning, written with torch here
# (the strategies are about the op's meaning, not about one lowering of it)
_REFERENCE = {
    "copy": lambda o, x: x.clone(), "sin": lambda o, x: torch.sin(x),
    "cos": lambda o, x: torch.cos(x), "floor": lambda o, x: torch.floor(x),
    "ceil": lambda o, x: torch.ceil(x), "round": lambda o, x: torch.round(x),
    "expm1": lambda o, x: torch.expm1(x), "log1p": lambda o, x: torch.log1p(x),
    "erf": lambda o, x: torch.erf(x),
    "gelu": lambda o, x: torch.nn.functional.gelu(x, approximate=o.attrs.get("approximate",
                                                                              "none")),
    "integer_pow": lambda o, x: x ** o.attrs["exponent"],
    "logical_not": lambda o, x: torch.logical_not(x),
    "isfinite": lambda o, x: torch.isfinite(x), "isnan": lambda o, x: torch.isnan(x),
    "rem": lambda o, x, y: torch.fmod(x, y), "atan2": lambda o, x, y: torch.atan2(x, y),
    "and": lambda o, x, y: torch.bitwise_and(x, y), "or": lambda o, x, y: torch.bitwise_or(x, y),
    "xor": lambda o, x, y: torch.bitwise_xor(x, y),
    "clamp": lambda o, x, lo, hi: torch.clamp(x, lo, hi),
    "bitcast": lambda o, x: x.view(DTYPE_TO_TORCH[DType(o.attrs["dtype"])]),
    "reduce_prod": lambda o, x: _reduce_prod(x, o.attrs),
    "argmax": lambda o, x: torch.argmax(x, o.attrs["dims"][0], o.attrs.get("keepdim", False)),
    "argmin": lambda o, x: torch.argmin(x, o.attrs["dims"][0], o.attrs.get("keepdim", False)),
    "dot": lambda o, x, y: _dot(x, y, o.attrs),
    "slice": lambda o, x: _slice(x, o.attrs),
    "pad": lambda o, x: _pad(x, o.attrs),
    "concat": lambda o, *xs: torch.cat(xs, o.attrs["dim"]),
    "index_select": lambda o, x, i: _index_select(x, i, o.attrs["axis"]),
    "index_add": lambda o, b, i, u: _index_add(b, i, u, o.attrs["axis"]),
    "gather": lambda o, x, i: torch.gather(x, o.attrs["dim"], i),
    "scatter_add": lambda o, b, i, u: torch.scatter_add(b, o.attrs["dim"], i, u),
    "iota": lambda o: _iota(o.result.type, o.attrs),
}


def _reference(op: Op, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [_REFERENCE[op.name](op, *xs)]


def _run_one(graph: Graph, arrays: list[np.ndarray]) -> list[np.ndarray]:
    """The one-op graph through build_module, or through its torch meaning where the
    backend has no lowering for the op (or for this form of it: dot beyond mm and bmm)."""
    xs = [torch.from_numpy(np.array(a)) for a in arrays]
    (op,) = graph.ops
    try:
        outs = build_module(graph)(*xs)
    except UnsupportedOpError:
        outs = _reference(op, xs)
    return [o.numpy() if isinstance(o, torch.Tensor) else np.asarray(o) for o in outs]


def run_torch(jobs) -> list[list[np.ndarray]]:
    """Each (graph, arrays) job run on its own."""
    return [_run_one(g, xs) for g, xs in jobs]


CASES = neutral_cases(seed=0)


@pytest.mark.parametrize("family", sorted({c.name for c in CASES}))
def test_every_strategy_gives_the_whole_result(family):
    checked = [check_case(c, run_torch, seed=k)
               for k, c in enumerate(CASES) if c.name == family]
    assert_all(checked)


@pytest.mark.parametrize("family", sorted({c.name for c in CASES}))
def test_every_grouped_split_gives_the_whole_result(family):
    # every plain split made a split of 2 groups (strategies.regrouped), and reshape's
    # own grouped splits (a dimension of groups viewed as two), checked the same way
    checked = [check_case(c, run_torch, ns=(2,), seed=k, groups=(2,))
               for k, c in enumerate(CASES) if c.name == family]
    assert all(not c.failures for c in checked), [c.failures for c in checked]
    if family in ("add", "dot", "reduce_sum", "transpose", "reshape"):
        assert any(c.ran for c in checked), f"{family}: no grouped split ran"


def test_a_wrong_strategy_fails_its_check(monkeypatch):
    # the check can fail: a transpose that claims its split stays on the same dim
    import tests.strategy_props as props
    case = next(c for c in CASES if c.name == "transpose" and c.attrs["perm"] == (1, 2, 0))
    wrong = Strategy((Shard(0),), (Shard(0),), "split")
    monkeypatch.setattr(props, "candidates", lambda op, ins, outs, n, masked=False, **kw: [wrong])
    checked = check_case(case, run_torch)
    assert checked.failures and "S(0)) -> (S(0)) [split] over 2 devices" in checked.failures[0]
