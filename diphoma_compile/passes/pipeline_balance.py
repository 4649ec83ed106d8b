"""Where the pipeline pass cuts the forward: what each forward op weighs (its time on a
device model with the backward and update that will run beside it, or its forward flops),
the S - 1 cut points that balance the stages (a dynamic program over prefix sums), and
each cut's move to where its stages' time plus its sends' is least."""

from __future__ import annotations

from collections import defaultdict

from ..ir.analysis import OpCost, free_inputs, op_cost
from ..ir.core import Graph, InputKind, Op, Phase
from ..ir.device_model import DeviceModel
from ..ir.types import TensorType


def op_seconds(cost: OpCost, phase: Phase | None, model: DeviceModel,
               microbatches: int) -> float:
    """An op's roofline seconds on ``model`` per microbatch: an update's over M (it runs
    once a step, the forward and backward once per microbatch)."""
    return model.compute_s(cost.flops, cost.bytes) / (
        microbatches if phase is Phase.update else 1)


def forward_costs(graph: Graph, fwd: list[Op], rest: list[Op], types: dict[str, TensorType],
                  sizes: dict[str, int], microbatches: int, model: DeviceModel,
                  balance: str = "time") -> list[float]:
    """What balancing weighs for each of the forward ops ``fwd`` (``rest``: the backward
    and update ops that stages run, not those every stage recomputes), in seconds.
    ``balance=forward-flops``: its flops at the model's peak rate.
    ``balance=time`` (the default): the seconds of the op on the device model (a
    roofline: flops or bytes, the slower), plus those of every backward and update op
    that will run on its stage, attributed as the pass places them: a backward op to
    the latest forward op whose activations it reads, an update op to the first forward
    op reading its parameter, gradient-only math to where its results are read. A
    layer whose weights are frozen has a short backward (no weight gradients) or none
    at all (below the first trainable layer), which forward flops alone do not see."""
    if balance == "forward-flops":     # as seconds at the peak flop rate
        return [max(op_cost(op, types, sizes).flops, 1) / model.flops_per_s for op in fwd]

    def seconds(op: Op) -> float:
        return op_seconds(op_cost(op, types, sizes), op.phase, model, microbatches)

    cost = [seconds(op) for op in fwd]
    at = {v.name: k for k, op in enumerate(fwd) for v in op.results}
    kind = {i.name: i.role.kind for i in graph.inputs}
    first: dict[str, int] = {}              # param -> the first forward op reading it
    for k, op in enumerate(fwd):
        for n in free_inputs(op):
            if kind.get(n) is InputKind.param:
                first.setdefault(n, k)
    of = {i.name: i.role.of for i in graph.inputs if i.role.kind is InputKind.opt_state}
    anchor: dict[int, int] = {}             # id(op) -> forward index
    for op in rest:
        reads = free_inputs(op)
        acts = [at[n] for n in reads if n in at]
        home = [first[p] for n in reads
                if (p := n if kind.get(n) is InputKind.param else of.get(n)) in first]
        if op.phase is Phase.update and home:
            anchor[id(op)] = min(home)
        elif acts:
            anchor[id(op)] = max(acts)
    readers: dict[str, list[Op]] = defaultdict(list)
    for op in rest:
        for n in free_inputs(op):
            readers[n].append(op)
    for op in reversed(rest):         # gradient-only math: where its results are read
        if id(op) not in anchor and op.phase is Phase.backward:
            got = [anchor[id(r)] for v in op.results for r in readers.get(v.name, ())
                   if id(r) in anchor]
            if got:
                anchor[id(op)] = max(got)
    made = {v.name: id(op) for op in rest for v in op.results}
    for op in rest:                   # the rest: where its inputs were made
        if id(op) not in anchor:
            # a tensor's, not a scalar's: a clip's factor times each gradient runs where
            # that gradient is (the factor, made from every stage's norms, is anchored at
            # the last: with it, every gradient's scaling weighed on the last stage, and a
            # clipped step's cut points were sought near the end alone)
            made_here = [n for n in free_inputs(op) if made.get(n) in anchor]
            wide = [n for n in made_here if types[n].numel > 1]
            got = [anchor[made[n]] for n in (wide or made_here)]
            anchor[id(op)] = max(got) if got else (
                len(fwd) - 1 if op.phase is Phase.backward else 0)
        cost[anchor[id(op)]] += seconds(op)
    return [max(c, 1e-12) for c in cost]


def _holding(holds: list[bool] | None, n: int) -> list[int]:
    """Prefix counts of the forward ops that read a parameter (every op when ``holds`` is
    None): a stage [a, b) holds one when the counts at a and b differ."""
    out = [0]
    for k in range(n):
        out.append(out[-1] + (1 if holds is None or holds[k] else 0))
    return out


def cheapest_near(cuts: list[int], points: list[int], pre: list[float], xfer: list[float],
                  holds: list[bool] | None = None) -> list[int]:
    """Each balanced cut moved, between its neighbours, to the point where the longer of its
    two stages plus the time its sends take is least (the same point on a tie): balancing
    alone may cut a norm after its rsqrt, sending the [b, s, 1] statistic beside the
    activation, one message more than one op earlier. A move never leaves either stage
    without an op that reads a parameter (``holds``, per forward op)."""
    has = _holding(holds, len(pre) - 1)
    out: list[int] = []
    for i, c in enumerate(cuts):
        lo = out[-1] if out else 0
        hi = cuts[i + 1] if i + 1 < len(cuts) else len(pre) - 1

        def score(p: int, lo: int = lo, hi: int = hi) -> float:
            return max(pre[p] - pre[lo], pre[hi] - pre[p]) + xfer[p]

        near = [p for p in points if lo < p < hi and has[p] > has[lo] and has[hi] > has[p]]
        out.append(min(near, key=lambda p: (score(p), abs(pre[p] - pre[c]), p), default=c))
    return out


def balanced_cuts(cost: list[float], points: list[int], stages: int,
                  holds: list[bool] | None = None) -> list[int] | None:
    """S - 1 cut points among ``points`` that minimise the largest stage's cost (dynamic
    programming over prefix sums), every stage holding a forward op that reads a parameter
    (``holds``, per forward op; None: any op will do); None when no such cuts exist."""
    if stages == 1:
        return []
    if len(points) < stages - 1:
        return None
    pre = [0]
    for c in cost:
        pre.append(pre[-1] + c)
    end = len(cost)
    has = _holding(holds, end)
    cand = [0, *points]
    inf = float("inf")

    def stage_cost(a: int, b: int) -> float:      # ops [a, b): none holding one is no stage
        return pre[b] - pre[a] if has[b] > has[a] else inf
    # best[j][k]: the smallest largest cost of j stages covering ops [0, cand[k]) ending at k
    best = [[inf] * len(cand) for _ in range(stages)]
    back = [[-1] * len(cand) for _ in range(stages)]
    for k in range(1, len(cand)):
        best[0][k] = stage_cost(0, cand[k])
    for j in range(1, stages - 1):
        for k in range(1, len(cand)):
            for m in range(1, k):
                v = max(best[j - 1][m], stage_cost(cand[m], cand[k]))
                if v < best[j][k]:
                    best[j][k], back[j][k] = v, m
    top, arg = inf, -1
    for k in range(1, len(cand)):
        v = max(best[stages - 2][k], stage_cost(cand[k], end))
        if v < top:
            top, arg = v, k
    if arg < 0 or top == inf:
        return None
    cuts = [cand[arg]]
    j, k = stages - 2, arg
    while j > 0:
        k = back[j][k]
        if k < 0:
            return None
        cuts.append(cand[k])
        j -= 1
    return sorted(cuts)
