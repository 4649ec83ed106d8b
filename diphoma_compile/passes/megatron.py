"""Finding Megatron's layer pairs in a traced step by dataflow, not by module names.

A *column* layer is a matmul-like op (a dot, or a framework op with a ``column`` strategy)
one of whose operands is a parameter (through views); split by its output features, its
result is split too. Following that split forward through the ops' strategies, while every
op keeps its result split and takes its other operands whole (or from parameters), leads to
a *row* layer: a parameter matmul that contracts the split dimension and leaves partial sums.
The column layers that reach it and the row layer form a pair (the MLP's two matmuls around
its activation; attention's query, key and value projections and its output projection,
with the heads split in between). Column layers that reach anything else (a layer norm over
the split features, the residual stream) are not split; where a layer has several splits
(a kernel ``[D, heads, head_dim]``), the next one is tried."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ..ir.core import Graph, InputKind, Op, Phase
from ..ir.opdef import is_view
from ..ir.strategies import GROUPS, Strategy, candidates, group_counts, strategies_of
from ..ir.types import REPLICATE, Partial, Placement, Shard, TensorType


@dataclass(frozen=True)
class LayerPair:
    """Column layers (their weights split by output features) feeding one row layer."""

    column: tuple[str, ...]      # weight parameters of the column layers
    row: str                     # weight parameter of the row layer


@dataclass(frozen=True)
class _Weight:
    position: int                # operand position of the op
    param: str
    chain: tuple[Op, ...]        # view ops from the parameter to the operand


def _weights(graph: Graph) -> dict[int, list[_Weight]]:
    """For each forward op, its operands that are parameters seen through views."""
    params = {i.name for i in graph.inputs if i.role.kind is InputKind.param}
    made = {v.name: op for op in graph.ops for v in op.results}
    out: dict[int, list[_Weight]] = {}
    for k, op in enumerate(graph.ops):
        if op.phase is not Phase.forward:
            continue
        found = []
        for i, x in enumerate(op.inputs):
            chain: list[Op] = []
            while x in made and is_view(made[x]) and len(made[x].inputs) == 1:
                chain.append(made[x])
                x = made[x].inputs[0]
            if x in params:
                found.append(_Weight(i, x, tuple(reversed(chain))))
        if found:
            out[k] = found
    return out


def _static_values(graph: Graph) -> set[str]:
    """Values computed from constants alone (no graph input): masks, iotas, scales."""
    static: set[str] = set()
    for op in graph.ops:
        if all(x in static for x in op.inputs) and not op.regions:
            static.update(v.name for v in op.results)
    return static


def _group_counts(graph: Graph, types: dict[str, TensorType]) -> set[int]:
    """The numbers of groups the step's ops split into by their own menus (a fused
    projection's result cut into query, key and value: 3): the grouped splits to try."""
    found: set[int] = set()
    for op in graph.ops:
        ins, outs = [types[x] for x in op.inputs], [v.type for v in op.results]
        for s in strategies_of(op, ins, outs):
            if s.name == GROUPS:
                found |= group_counts(s.inputs + s.outputs)
    return found


def _through_chain(chain: Sequence[Op], q: Placement, types: dict[str, TensorType],
                   n: int, groups: set[int]) -> Placement | None:
    """The parameter's placement that gives placement ``q`` at the end of a view chain
    (splits the axis size ``n`` divides only)."""
    for op in reversed(chain):
        ins, outs = [types[x] for x in op.inputs], [v.type for v in op.results]
        back = [s.inputs[0] for s in candidates(op, ins, outs, n, groups=groups)
                if s.outputs[0] == q]
        if not back:
            return None
        q = back[0]
    return q


def undivided(graph: Graph, n: int, here: dict[str, Placement]
              ) -> list[tuple[str, tuple[int, ...], int]]:
    """The weights that a pair would split on an axis of any size but not on one of ``n``
    devices, given the splits ``find_pairs(graph, n)`` made (``here``): (parameter, its
    shape, the dimension the pair splits), because that dimension does not divide by ``n``
    (heads that do not divide, say)."""
    if n <= 1:
        return []
    anywhere = find_pairs(graph, 1).seeds
    shapes = {i.name: i.value.type.shape for i in graph.inputs}
    return [(p, shapes[p], q.dim) for p, q in anywhere.items()
            if p not in here and isinstance(q, Shard) and shapes[p][q.dim] % n]


class Pairs(NamedTuple):
    """What ``find_pairs`` found."""

    pairs: list[LayerPair]
    seeds: dict[str, Placement]      # the placement of each of their weights
    groups: set[int]                 # the numbers of groups of the grouped splits on the way


def find_pairs(graph: Graph, n: int) -> Pairs:
    """The Megatron pairs of a traced step for an axis of ``n`` devices, the placement of
    each of their weights (what a tensor-parallel pass fixes), and the grouped splits their
    activations take on the way (for propagation to offer: GPT-2's fused projection splits
    in 3 groups, and heads merged with the batch, [B, H] -> [B*H], split in B groups)."""
    types = graph.value_types()
    weights = _weights(graph)
    # operands that may take any split (each device slices its own): parameters, values
    # seen through their views, and values made from constants only (masks, scales)
    free = {w.param for ws in weights.values() for w in ws}
    free |= {op.results[0].name for ws in weights.values() for w in ws for op in w.chain}
    free |= _static_values(graph)
    groups = _group_counts(graph, types)

    def menu(k: int, given: Sequence[Placement] = ()) -> list[Strategy]:
        # the grouped splits of the step's own group counts, and of those its inputs have
        op = graph.ops[k]
        return candidates(op, [types[x] for x in op.inputs], [v.type for v in op.results], n,
                          groups=groups | group_counts(given))

    def whole_or_param(op: Op, s: Strategy, skip: set[int]) -> bool:
        return all(i in skip or s.inputs[i] == REPLICATE or op.inputs[i] in free
                   for i in range(len(op.inputs)))

    def contracts(op: Op, w: _Weight) -> bool:
        # splitting the weight along with an activation can leave partial sums, whether or
        # not that dimension divides n (a column split never splits it: an input width of
        # 5 under tp=4 is no reason to refuse the pair)
        return any(isinstance(s.inputs[w.position], Shard) and s.outputs[:1] ==
                   (Partial("sum"),)
                   for s in strategies_of(op, [types[x] for x in op.inputs],
                                          [v.type for v in op.results], groups))

    # the column options of each matmul-like op with a weight: weight split, activations
    # whole, result split (an op is matmul-like when it contracts the weight)
    options: dict[int, list[tuple[Strategy, _Weight]]] = {}
    for k, ws in weights.items():
        op = graph.ops[k]
        for w in ws:
            if types[op.inputs[w.position]].rank < 2 or not contracts(op, w):
                continue
            for s in menu(k):
                if (isinstance(s.inputs[w.position], Shard) and len(s.outputs) >= 1
                        and isinstance(s.outputs[0], Shard)
                        and whole_or_param(op, s, {w.position})):
                    options.setdefault(k, []).append((s, w))
    choice = {k: 0 for k in options}
    rows: dict[int, tuple[Strategy, frozenset[int]]] = {}
    failed: set[int] = set()
    for _ in range(8):
        used = dict(choice)       # this round's choices: the pairs are built from these
        tracked: dict[str, tuple[Placement, frozenset[int]]] = {}
        rows, failed = {}, set()
        for k, op in enumerate(graph.ops):
            if op.phase is not Phase.forward:
                continue
            hit = [i for i, x in enumerate(op.inputs) if x in tracked]
            if not hit:
                if k in choice:
                    s, _ = options[k][choice[k]]
                    tracked[op.results[0].name] = (s.outputs[0], frozenset({k}))
                continue
            srcs = frozenset().union(*(tracked[op.inputs[i]][1] for i in hit))
            match = [s for s in menu(k, [tracked[op.inputs[i]][0] for i in hit])
                     if all(s.inputs[i] == tracked[op.inputs[i]][0] for i in hit)
                     and whole_or_param(op, s, set(hit))]
            row = [s for s in match if k in weights and s.outputs == (Partial("sum"),)
                   and any(isinstance(s.inputs[w.position], Shard) for w in weights[k])]
            if row:
                rows[k] = (row[0], srcs)
                continue
            split = [s for s in match if all(isinstance(p, Shard) for p in s.outputs)]
            if split:
                for v, p in zip(op.results, split[0].outputs):
                    tracked[v.name] = (p, srcs)
            else:
                failed |= srcs
        if not failed:
            break
        for k in failed:
            choice[k] += 1
            if choice[k] >= len(options[k]):
                del choice[k]
    choice = used
    pairs, seeds, taken = [], {}, set()
    for k, (s, srcs) in sorted(rows.items()):
        if srcs & failed:
            continue      # the search did not settle for these columns: leave them whole
        cols = sorted(c for c in srcs if c in choice)
        if not cols:
            continue
        w_row = next(w for w in weights[k] if isinstance(s.inputs[w.position], Shard))
        fixed = {w_row.param: _through_chain(w_row.chain, s.inputs[w_row.position], types, n,
                                             groups)}
        for c in cols:
            cs, cw = options[c][choice[c]]
            fixed[cw.param] = _through_chain(cw.chain, cs.inputs[cw.position], types, n,
                                             groups)
        if None in fixed.values() or any(seeds.get(p, q) != q for p, q in fixed.items()):
            continue        # a weight seen through views no split passes, or split two ways
        seeds.update(fixed)
        pairs.append(LayerPair(tuple(options[c][choice[c]][1].param for c in cols),
                               w_row.param))
        taken.update(cols)
    seen = group_counts(p for p, srcs in tracked.values() if srcs & taken)
    return Pairs(pairs, seeds, seen | group_counts(seeds.values()))
