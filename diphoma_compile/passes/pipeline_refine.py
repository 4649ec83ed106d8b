"""Pipeline: move backward ops placed on too early a stage to the later stage that holds
what they read, where that makes fewer bytes cross (a minimum cut, networkx).

The pipeline pass places a backward op on the stage that made the latest forward value it
reads. An op that reads only values a later stage received in forward (the activation
crossing a cut, rotary tables, a parameter that stage uses) is the backward of that later
stage's forward op, yet lands on the earlier stage: Llama's RMSNorm backward, read on the
value its stage received, ran on the stage before and made three tensors cross back for
one; BERT's tied decoder-weight gradient, which reads the hidden state the last stage
received, ran on the stage before it, so the whole logits gradient crossed back and the
weight gradient crossed again. A parameter read by such an op was held on both stages (a
tie, its gradient summed across them and its new value sent every step).

For each pair of stages s < t, the backward ops of s that could run on t (everything they
read is on t: forward values made or received there, parameters t reads in forward,
gradients made on t or later, or by ops moving with them) are labelled "stay on s" or
"move to t" by a minimum s-t cut: a gradient made on one side and read on the other costs
its bytes per microbatch, a parameter read on s only by movable ops costs two of its
copies per step (its gradient's and its new value's transfer) over the microbatches, and
a gradient may not flow from s up to t. The moves are taken only where they make fewer
bytes cross, or where an op left on s would send its gradient up to t (then they must be);
the ops moved are the fewest that reach the cut (the source side)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

import networkx as nx

from ..ir.analysis import free_inputs
from ..ir.core import Op, Phase, TensorType


def pull_up_backward(ops: list[Op], stage: dict[int, int], phase: Mapping[int, Phase],
                     made: Mapping[str, Op], anywhere: set[str],
                     types: Mapping[str, TensorType], stages: int,
                     microbatches: int = 1) -> None:
    """Restage backward ops in ``stage`` (id(op) -> stage, every non-free op placed) where
    a later stage holds their inputs and moving them makes fewer bytes cross; ``anywhere``:
    names every stage has or computes itself."""
    holders: dict[str, set[int]] = defaultdict(set)   # forward values and params: stages
    readers: dict[str, list[Op]] = defaultdict(list)
    for op in ops:
        for n in free_inputs(op):
            readers[n].append(op)
        if id(op) not in stage or phase[id(op)] is not Phase.forward:
            continue
        s = stage[id(op)]
        for n in [*free_inputs(op), *(v.name for v in op.results)]:
            holders[n].add(s)
    for s in range(stages - 2, -1, -1):
        for t in range(s + 1, stages):
            _pull(ops, stage, phase, made, anywhere, types, holders, readers, s, t,
                  microbatches)


def _pull(ops: list[Op], stage: dict[int, int], phase: Mapping[int, Phase],
          made: Mapping[str, Op], anywhere: set[str], types: Mapping[str, TensorType],
          holders: Mapping[str, set[int]], readers: Mapping[str, list[Op]], s: int, t: int,
          microbatches: int) -> None:
    """One pair of stages: move what the minimum cut moves from ``s`` to ``t``."""
    def backward_made(n: str) -> Op | None:
        p = made.get(n)
        return p if p is not None and phase[id(p)] is Phase.backward else None

    movable: dict[int, Op] = {}
    for op in ops:
        if stage.get(id(op)) != s or phase[id(op)] is not Phase.backward:
            continue
        ok = True
        for n in free_inputs(op):
            p = backward_made(n)
            if n in anywhere:
                continue
            if p is not None:
                ok = id(p) in movable or stage[id(p)] >= t
            else:
                ok = t in holders.get(n, ())
            if not ok:
                break
        if ok and all(phase[id(r)] is Phase.backward or stage.get(id(r)) == t
                      for v in op.results for r in readers.get(v.name, ())):
            movable[id(op)] = op
    if not movable:
        return
    g = nx.DiGraph()
    src, sink = "T", "S"

    def side(op: Op) -> object:
        """The node of a reader or maker: itself if movable, else its fixed side (None:
        a stage whose transfers do not change with the cut)."""
        if id(op) in movable:
            return id(op)
        where = stage.get(id(op))
        return src if where == t else sink if where == s else None

    current = 0
    forced = False
    for op in ops:        # gradients: made on one side, read on the other
        maker = side(op) if phase[id(op)] is Phase.backward else None
        if maker is None or maker == sink:
            continue
        for v in op.results:
            ends = {side(r) for r in readers.get(v.name, ())} - {None}
            if isinstance(maker, int) and src in ends:
                # read on t: left on s, this gradient would flow up to a later stage, which
                # no schedule runs (a layer's weight gradient, placed by the activation it
                # reads on the stage before, whose result the layer's stage transposes)
                g.add_edge(src, maker)          # no capacity: it must move
                forced = True
            if not ends - {src}:
                continue
            node = ("value", v.name)
            g.add_edge(maker, node, capacity=types[v.name].nbytes * microbatches)
            for e in ends:
                g.add_edge(node, e)             # no capacity: infinite
            if maker == src:
                current += types[v.name].nbytes * microbatches
            for e in ends:
                if isinstance(e, int):
                    g.add_edge(e, maker)        # no gradient flows up
    for op in movable.values():
        g.add_edge(id(op), sink, capacity=0)
    # a parameter read on s only by movable ops: held on both stages unless they all move
    on_s: dict[str, set[int]] = defaultdict(set)
    for op in ops:
        if stage.get(id(op)) == s:
            for n in free_inputs(op):
                if n not in made and n not in anywhere:
                    on_s[n].add(id(op))
    for n, users in on_s.items():
        if s in holders.get(n, ()) or not users <= movable.keys():
            continue
        node = ("param", n)
        g.add_edge(src, node, capacity=2 * types[n].nbytes)
        current += 2 * types[n].nbytes
        for u in users:
            g.add_edge(node, u)
    if src not in g:
        return
    cost, (upper, _) = nx.minimum_cut(g, src, sink)
    if cost >= current and not forced:
        return
    for k in upper:
        if isinstance(k, int):
            stage[k] = t


__all__ = ["pull_up_backward"]
