"""How the torch op rules read an aten call: its arguments by their schema names
(``_Call``), its tensors as the IR op's inputs in order of first use, the strategies it
allows as placements of named arguments, and the registration of a rule by target (the
rules themselves are in ``op_rules.py``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from ..ir.core import Op
from ..ir.framework_ops import FrameworkOpRule, register_framework_op
from ..ir.strategies import Strategy, replicated
from ..ir.types import REPLICATE, Partial, Placement, Shard, TensorType
from .ops import resolve_target

_R = REPLICATE
_P = Partial("sum")


@dataclass(frozen=True)
class _T:
    """A tensor argument: its position among the op's inputs."""

    index: int


def _decode(v: Any) -> Any:
    if isinstance(v, str) and v.startswith("%"):
        return _T(int(v[1:]))
    if isinstance(v, tuple):
        return tuple(_decode(x) for x in v)
    return v


@cache
def _arguments(target: str) -> tuple[tuple[str, bool, Any], ...]:
    """(name, kwarg-only, default) of each argument of the aten schema."""
    out = []
    for a in resolve_target(target)._schema.arguments:
        default = a.default_value if a.has_default_value() else None
        out.append((a.name, a.kwarg_only, default))
    return tuple(out)


class _Call:
    """An opaque aten op, its arguments by schema name, and its operand and result types."""

    def __init__(self, op: Op, ins: Sequence[TensorType], outs: Sequence[TensorType]) -> None:
        target = str(op.attrs["target"])
        pos = _decode(op.attrs.get("args", ()))
        kws = {k[3:]: _decode(v) for k, v in op.attrs.items() if k.startswith("kw_")}
        self.args: dict[str, Any] = {}
        i = 0
        for name, kwarg_only, default in _arguments(target):
            if not kwarg_only and i < len(pos):
                self.args[name] = pos[i]
                i += 1
            else:
                self.args[name] = kws.get(name, default)
        self.ins, self.outs = tuple(ins), tuple(outs)
        # the positions in the aten call's results of the op's results
        self.positions = tuple(op.attrs.get("outs", range(len(outs))))

    def __getitem__(self, name: str) -> Any:
        return self.args[name]

    def t(self, name: str) -> TensorType | None:
        """The type of a tensor argument (None when absent)."""
        v = self.args.get(name)
        return self.ins[v.index] if isinstance(v, _T) else None

    def out(self, position: int) -> TensorType | None:
        """The type of the aten call's result at ``position`` (None when the op drops it)."""
        return self.outs[self.positions.index(position)] if position in self.positions else None

    def strategy(self, places: dict[str, Placement | Sequence[Placement]],
                 results: Placement | Sequence[Placement], name: str,
                 masked: bool = False) -> Strategy | None:
        """The strategy giving these tensor arguments these placements (the others whole)
        and the aten call's results these (one for all, or one per result position); None
        when one tensor passed twice would need two placements."""
        pls: list[Placement | None] = [None] * len(self.ins)
        for arg, v in self.args.items():
            tensors = v if isinstance(v, tuple) else (v,)
            want = places.get(arg, _R)
            each = want if isinstance(want, (list, tuple)) else [want] * len(tensors)
            for t, p in zip(tensors, each):
                if isinstance(t, _T):
                    if pls[t.index] not in (None, p):
                        return None
                    pls[t.index] = p
        res = tuple(results[p] if isinstance(results, (list, tuple)) else results
                    for p in self.positions)
        return Strategy(tuple(_R if p is None else p for p in pls), res, name, masked)


def _dim(d: int, rank: int) -> int:
    return d % rank if rank else 0


def _along(t: TensorType | None, out: TensorType, d: int) -> Placement:
    """The placement of an operand broadcast to ``out`` when ``out`` is split on dim d: its
    aligned dim split, or whole where it is broadcast along d."""
    if t is None:
        return _R
    a = d - (out.rank - t.rank)
    return Shard(a) if a >= 0 and t.shape[a] == out.shape[d] else _R


def _menu(fn: Callable[[_Call], list]) -> Callable:
    """A strategy function (``ir.strategies.StrategyFn``) from one that lists strategies of
    a call: the all-replicated one first, invalid and repeated ones left out; None where
    the rule has no opinion on the call's form (it runs whole, and is not judged)."""
    def strategies(op: Op, ins: Sequence[TensorType], outs: Sequence[TensorType]):
        c = _Call(op, ins, outs)
        got = fn(c)
        if got is None:         # a form of the call the rule has no opinion on
            return None
        menu = [replicated(ins, outs)]
        for s in got:
            if s is not None and s not in menu:
                menu.append(s)
        return menu
    strategies.__doc__ = fn.__doc__
    return strategies


def _cost(fn: Callable[[_Call], float]) -> Callable:
    def cost(op: Op, ins: Sequence[TensorType], outs: Sequence[TensorType]) -> int:
        return int(fn(_Call(op, ins, outs)))
    return cost


def _on_call(fn: Callable[[_Call], Any] | None) -> Callable | None:
    """A framework rule's ``(op, ins, outs)`` function from one that reads the call."""
    return None if fn is None else (lambda op, ins, outs: fn(_Call(op, ins, outs)))


def _register(targets: str, flops: Callable[[_Call], float],
              strategies: Callable[[_Call], list] | None = None,
              nbytes: Callable[[_Call], float] | None = None, regroup: bool = True,
              batch_stats: bool = False, row_mean: str = "",
              row_window: Callable[[_Call], list[range] | None] | None = None,
              row_weighted: Callable[[_Call], bool] | None = None,
              joins_rows: bool = False,
              row_picks: Callable[[_Call], tuple[dict, int | None]] | None = None,
              iota_dim: Callable[[_Call], int | None] | None = None,
              row_sum: Callable[[Op, Sequence[TensorType], Sequence[TensorType]],
                                tuple[Op, int, int] | None] | None = None,
              row_count: Callable | None = None,
              copies: bool = False, seeds_gradient: bool = False) -> None:
    window, weighted, picks = _on_call(row_window), _on_call(row_weighted), _on_call(row_picks)
    for t in targets.split():
        register_framework_op(FrameworkOpRule(
            f"aten.{t}", _cost(flops), None if strategies is None else _menu(strategies),
            None if nbytes is None else _cost(nbytes), regroup, batch_stats, row_mean,
            row_window=window, row_weighted=weighted, joins_rows=joins_rows,
            row_picks=picks, iota_dim=_on_call(iota_dim), row_sum=row_sum,
            row_count=row_count, copies=copies, seeds_gradient=seeds_gradient))


def _numel(t: TensorType | None) -> int:
    return 0 if t is None else t.numel


def _nbytes(t: TensorType | None) -> int:
    return 0 if t is None else t.nbytes
