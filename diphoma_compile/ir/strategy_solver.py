"""The integer program that picks one strategy per op (HiGHS, through scipy.optimize.milp).

Variables: ``x[k, s]`` = 1 when op k runs under strategy s (exactly one per op); for each
use of a value whose producer's placement p differs from the placement q its consumer's
strategy needs, ``z >= y[p] + w[q] - 1`` pays the resharding collective (``y``: the sum of
the producer's x that give p; ``w``: the consumer's x that need q). Pairs no collective
joins are forbidden (``y[p] + w[q] <= 1``). The objective is the compute of every op under
its strategy plus every reshard, in microseconds. Exact for the model: no double counting
of shared ancestors, which a dynamic program over a DAG cannot avoid."""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ..errors import DiphomaWarning, IRError
from .core import Graph
from .strategies import Strategy
from .types import REPLICATE, Partial, Placement

_US = 1e6   # seconds -> microseconds, to keep the solver's numbers near 1
# the solver stops within 1% of the best plan under the model: the model's own error is
# larger, and at a large batch (GPT-2 small at 64 rows a device) the last 1% took HiGHS
# past its time limit, where the plan depends on how far it got (per process: torchrun's
# ranks then build different programs)
_GAP = 0.01


class _Program:
    """Rows and columns of the integer program, built incrementally."""

    def __init__(self) -> None:
        self.cost: list[float] = []
        self.upper: list[float] = []
        self.integer: list[int] = []
        self.rows: list[tuple[dict[int, float], float, float]] = []

    def var(self, cost: float, integer: bool) -> int:
        self.cost.append(cost)
        self.upper.append(1.0)
        self.integer.append(1 if integer else 0)
        return len(self.cost) - 1

    def pay(self, variables, seconds: float) -> None:
        """Each variable, when chosen, costs ``seconds`` more; inf: it cannot be chosen."""
        for var in variables:
            if seconds == math.inf:
                self.upper[var] = 0.0
            else:
                self.cost[var] += seconds * _US

    def row(self, coef: dict[int, float], lo: float, hi: float) -> None:
        self.rows.append((coef, lo, hi))

    def solve(self, time_limit_s: float) -> np.ndarray:
        # scipy's optimizer costs seconds and tens of MB to import: only plans that place
        # strategies (tensor parallelism) pay it
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_array
        r, c, v = [], [], []
        lo, hi = [], []
        for i, (coef, a, b) in enumerate(self.rows):
            for j, w in coef.items():
                r.append(i)
                c.append(j)
                v.append(w)
            lo.append(a)
            hi.append(b)
        a = coo_array((v, (r, c)), shape=(len(self.rows), len(self.cost))).tocsr()
        res = milp(np.array(self.cost), integrality=np.array(self.integer),
                   bounds=Bounds(np.zeros(len(self.cost)), np.array(self.upper)),
                   constraints=LinearConstraint(a, np.array(lo), np.array(hi)),
                   options={"time_limit": time_limit_s, "disp": False,
                            "mip_rel_gap": _GAP})
        if res.x is None:
            raise IRError(f"no consistent assignment of strategies exists ({res.message})",
                          hint="fix fewer placements, or placements that divide the axis")
        if res.status == 1:      # stopped at the time limit with a plan, not the best
            warnings.warn(
                f"the sharding solver stopped at its {time_limit_s:g} s limit with a plan "
                f"{getattr(res, 'mip_gap', float('nan')):.1%} from the best bound; it "
                "depends on how far the solver got, so ranks that plan the step by "
                "themselves may build different programs (refused when the step is built)",
                DiphomaWarning, stacklevel=2)
        return res.x


def _charge_input(prog: _Program, name: str, p: Placement,
                  by_q: dict[Placement, list[list[int]]], rc) -> None:
    """An input's placement is fixed: each consumer strategy pays its reshard (an
    approximation: ``apply_assignment`` reshards an input once per placement, so an input
    several consumers need moved is priced more than it costs; inputs are few)."""
    for q, uses in by_q.items():
        c = rc(p, q, name)
        for vars_q in uses:
            prog.pay(vars_q, c)


def _charge_value(prog: _Program, name: str, made: dict[Placement, list[int]],
                  by_q: dict[Placement, list[list[int]]], rc) -> None:
    """Bringing a value to placement q is paid once however many consumers need q:
    ``a[q]`` = some consumer needs q; ``u[p, q]`` = the value is p and must become q."""
    for q, uses in by_q.items():
        if all(p == q for p in made) and q in made:
            continue
        a = prog.var(0.0, False)
        for vars_q in uses:
            row = {var: 1.0 for var in vars_q}
            row[a] = -1.0
            prog.row(row, -math.inf, 0.0)              # a >= the use's indicator
        cover = {a: 1.0}
        for var in made.get(q, []):
            cover[var] = -1.0                          # the value is already q
        for p, vars_p in made.items():
            if p == q:
                continue
            c = rc(p, q, name)
            row = {var: 1.0 for var in vars_p}
            row[a] = 1.0
            if c == math.inf:
                prog.row(row, -math.inf, 1.0)          # p and a need for q exclude each other
                continue
            u = prog.var(c * _US, False)
            row[u] = -1.0
            prog.row(row, -math.inf, 1.0)              # u >= y[p] + a - 1
            cover[u] = -1.0
        prog.row(cover, -math.inf, 0.0)                # a <= y[q] + sum_p u[p, q]


def solve(graph: Graph, menus: Sequence[Sequence[Strategy]],
          fixed: Mapping[str, Placement], demands: Mapping[str, Placement | None],
          rc: Callable[[Placement, Placement, str], float],
          compute: Callable[[int, Strategy], float], time_limit_s: float,
          free: Mapping[str, Sequence[Placement]] | None = None,
          ties: Sequence[tuple[str, str]] = ()
          ) -> tuple[dict[int, Strategy], dict[str, Placement]]:
    """One strategy per top-level op of ``graph`` minimizing compute plus resharding, with
    ``fixed`` values placed as given and outputs brought to their ``demands``. Inputs in
    ``free`` take whichever of their candidate placements is cheapest; each pair in ``ties``
    (a value, an input) must end up placed alike (an updated parameter and the parameter,
    optimizer state and its parameter). Returns the strategies and the free inputs'
    placements."""
    free = dict(free or {})
    for op in graph.ops:
        if op.regions:
            where = f" at {op.loc}" if op.loc else ""
            phase = f", in the step's {op.phase.value}" if op.phase else ""
            raise IRError(f"sharding propagation does not enter nested regions yet: a "
                          f"{op.name} with {len(op.regions)} regions{where}{phase}",
                          hint="trace the step without control flow (unroll scans; "
                               "optax.MultiSteps and apply_if_finite branch with lax.cond "
                               "in the update: accumulate gradients outside the step, or "
                               "run it without the tp axis)")
    prog = _Program()
    x: list[list[int]] = []
    for k, menu in enumerate(menus):
        x.append([prog.var(compute(k, s) * _US, True) for s in menu])
        prog.row({j: 1.0 for j in x[k]}, 1.0, 1.0)

    # each value's placements: producer's variables giving each, or a fixed placement
    inputs = {i.name for i in graph.inputs} - set(free)
    made: dict[str, dict[Placement, list[int]]] = {}
    for name, options in free.items():
        made[name] = {p: [prog.var(0.0, True)] for p in dict.fromkeys(options)}
        prog.row({v[0]: 1.0 for v in made[name].values()}, 1.0, 1.0)
    for k, op in enumerate(graph.ops):
        for j, v in enumerate(op.results):
            by: dict[Placement, list[int]] = defaultdict(list)
            for s, var in zip(menus[k], x[k]):
                by[s.outputs[j]].append(var)
            made[v.name] = by
            if v.name in fixed:
                want = fixed[v.name]
                prog.row({var: 1.0 for var in by.get(want, [])}, 1.0, 1.0)

    # what the consumers need of each value: placement -> one indicator per use
    needs: dict[str, dict[Placement, list[list[int]]]] = defaultdict(lambda: defaultdict(list))
    for k, op in enumerate(graph.ops):
        for i, name in enumerate(op.inputs):
            need: dict[Placement, list[int]] = defaultdict(list)
            for s, var in zip(menus[k], x[k]):
                need[s.inputs[i]].append(var)
            for q, vars_q in need.items():
                needs[name][q].append(vars_q)
    for name, by_q in needs.items():
        if name in inputs:
            _charge_input(prog, name, fixed.get(name, REPLICATE), by_q, rc)
        else:
            _charge_value(prog, name, made[name], by_q, rc)
    for name, want in demands.items():
        if want is None:           # returned as it is, but not as partial sums
            for p, vars_p in made.get(name, {}).items():
                if isinstance(p, Partial):
                    prog.pay(vars_p, rc(p, REPLICATE, name))
            continue
        if name in inputs:
            if rc(fixed.get(name, REPLICATE), want, name) == math.inf:
                raise IRError(f"output %{name} is an input placed "
                              f"{fixed.get(name, REPLICATE)} and cannot become {want}")
            continue
        for p, vars_p in made[name].items():
            prog.pay(vars_p, rc(p, want, name))

    for a, b in ties:
        if a not in made or b not in made:
            continue
        for p in dict.fromkeys([*made[a], *made[b]]):  # in order, not by hash
            row = {var: 1.0 for var in made[a].get(p, [])}
            for var in made[b].get(p, []):
                row[var] = row.get(var, 0.0) - 1.0
            prog.row(row, 0.0, 0.0)                    # y_a[p] == y_b[p]

    sol = prog.solve(time_limit_s)
    chosen = {k: menus[k][int(np.argmax([sol[v] for v in x[k]]))] for k in range(len(menus))}
    placed = {name: max(by, key=lambda p: sol[by[p][0]]) for name, by in made.items()
              if name in free}
    return chosen, placed
