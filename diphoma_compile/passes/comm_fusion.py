"""Communication fusion: many small collectives become a few bucketed ones.

A traced step holds one collective per tensor; their fixed cost dominates when tensors are
small (DDP buckets gradients into 25 MB, Horovod fuses into a 128 MB buffer, XLA combines
collectives). This pass groups collectives of the same kind, mesh axis, reduction, piece
layout and dtype, taken in program order — the order their inputs become ready, gradients in
backward order — into buckets of about ``bucket_mb`` megabytes. A bucket is one collective
op with k inputs and k results, placed where its last member was: the backend moves it as
one packed buffer, in which a device's piece is the concatenation of its pieces of the
members, so packing and unpacking are local copies (weight-update sharding's pieces stay
what they were). A bucket closes before a member whose input depends on an earlier member
(fusing them would make a cycle); readers of an earlier member's result that came before the
bucket move after it, keeping program order otherwise."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

from ..ir.analysis import free_inputs
from ..ir.core import Graph, Op
from ..ir.ops import OPS, op_def
from ..ir.types import TensorType, Varying
from .base import Pass, PassContext, PassFailure, register_pass

# the collectives that can be bucketed and run asynchronously: those with an async attribute
FUSABLE = frozenset(n for n, d in OPS.items() if "async" in d.attrs)


def _key(op: Op, types) -> tuple:
    t = types[op.inputs[0]]
    # the phase too: a bucket never mixes forward and backward (shard-params gathers the
    # same parameters in both, and a bucket of both would hold them whole in between)
    # and the other axes a value varies on: a bucket's members are one concatenation, and a
    # value the same on every device of an axis (a norm of the parameters, R on dp) beside
    # one that varies there (an activation) would come back varying
    varies = frozenset(a for a, p in t.placements
                       if isinstance(p, Varying) and a != op.attrs.get("axis"))
    return (op.name, op.attrs.get("axis"), op.attrs.get("op"), op.attrs.get("dim"),
            t.dtype, bool(op.attrs.get("async", False)), op.phase,
            op.attrs.get("from_dim"), op.attrs.get("to_dim"), op.attrs.get("local"),
            op.attrs.get("level"), varies)


def _bucketable(op: Op, types) -> bool:
    """A collective comm-fusion may put in a bucket: all_to_all only of 1-d payloads
    (chunk j to device j, as the quantized gradients move)."""
    if op.name != "all_to_all":
        return True
    return types[op.inputs[0]].rank == 1 and op.attrs.get("from_dim") == 0 == \
        op.attrs.get("to_dim")


def _bytes(op: Op, types) -> int:
    return sum(types[n].nbytes for n in op.inputs)


@dataclass(frozen=True)
class CommFusionRecord:
    """What comm-fusion did: collectives and bytes before and after, and the buckets."""

    bucket_mb: float
    collectives_before: int
    collectives_after: int
    bytes_before: int
    bytes_after: int
    buckets: tuple[tuple[str, ...], ...]   # the results each bucket packs

    def to_dict(self) -> dict[str, Any]:
        """The plan's ``notes["comm-fusion"]`` (docs/plan.md)."""
        return {"bucket_mb": self.bucket_mb,
                "collectives_before": self.collectives_before,
                "collectives_after": self.collectives_after,
                "bytes_before": self.bytes_before, "bytes_after": self.bytes_after,
                "buckets": [list(b) for b in self.buckets]}


@register_pass
@dataclass(frozen=True)
class CommFusion(Pass):
    """Bucket collectives of one kind, axis, reduction and dtype into ~bucket_mb buffers."""

    name = "comm-fusion"
    bucket_mb: float = 25.0

    def __call__(self, graph: Graph, ctx: PassContext) -> Graph:
        if not self.bucket_mb > 0 or self.bucket_mb == float("inf"):    # (nan too)
            raise PassFailure(f"comm-fusion: bucket-mb must be a positive number of "
                              f"megabytes, not {self.bucket_mb}")
        types = graph.value_types()
        ops = list(graph.ops)
        fused, dropped = _fuse(ops, _buckets(ops, types, self.bucket_mb * 1e6))
        new_ops = _stable_topo([fused.get(k, op) for k, op in enumerate(ops)
                                if k not in dropped], graph)
        ctx.decisions[self.name] = _record(self.bucket_mb, graph, types, new_ops)
        if not fused:
            return graph
        return graph.replace(ops=new_ops)


def _record(bucket_mb: float, graph: Graph, types: dict[str, TensorType],
            new_ops: tuple[Op, ...]) -> CommFusionRecord:
    """Collectives and bytes one device sends, before (``graph``) and after (``new_ops``)."""
    before = [op for op in graph.ops if op.name in FUSABLE]
    after = [op for op in new_ops if op.name in FUSABLE]
    sizes = {a: n for a, n in graph.mesh.axes}
    return CommFusionRecord(
        bucket_mb=bucket_mb,
        collectives_before=len(before), collectives_after=len(after),
        bytes_before=_comm_bytes(before, types, sizes),
        bytes_after=_comm_bytes(after, types, sizes),
        buckets=tuple(tuple(v.name for v in op.results) for op in after
                      if len(op.results) > 1))


def _buckets(ops: list[Op], types: dict[str, TensorType], limit: float) -> list[list[int]]:
    """Positions of same-key collectives per bucket, closed at ``limit`` bytes or where a
    member would make the fused program cyclic.

    A bucket runs as one op at its last member's place, so it needs every member's inputs
    and gives every member's results. A member therefore cannot join a bucket when it reads
    a value made from that bucket's members, nor from another bucket that itself (through
    any chain of buckets) reads from this one: the bucket closes and a new one starts. Each
    value carries the buckets it was made from (program order is a topological order)."""
    open_buckets: dict[tuple, int] = {}     # key -> id of its open bucket
    members: list[list[int]] = []           # bucket id -> op positions
    size: list[int] = []
    needs: list[set[int]] = []              # bucket id -> buckets its members read from
    made_from: dict[str, frozenset[int]] = {}

    def reaches(start: set[int], goal: int) -> bool:
        seen, todo = set(), list(start)
        while todo:
            b = todo.pop()
            if b == goal:
                return True
            if b not in seen:
                seen.add(b)
                todo.extend(needs[b])
        return False

    for k, op in enumerate(ops):
        reads = free_inputs(op)
        src = frozenset().union(*(made_from.get(n, frozenset()) for n in reads))
        if op.name in FUSABLE and len(op.inputs) == 1 and _bucketable(op, types):
            key = _key(op, types)
            b = open_buckets.get(key)
            if b is not None and (size[b] >= limit or b in src or reaches(set(src), b)):
                b = None
            if b is None:
                b = len(members)
                members.append([])
                size.append(0)
                needs.append(set())
                open_buckets[key] = b
            members[b].append(k)
            size[b] += _bytes(op, types)
            needs[b].update(src)
            src = src | {b}
        if src:
            for v in op.results:
                made_from[v.name] = src
    return members


def _fuse(ops: list[Op], buckets: list[list[int]]) -> tuple[dict[int, Op], set[int]]:
    """(position of each bucket's last member -> the fused op, positions of the others)."""
    fused: dict[int, Op] = {}
    dropped: set[int] = set()
    for b in buckets:
        if len(b) == 1:
            continue
        first = ops[b[0]]
        fused[b[-1]] = first.replace(
            inputs=tuple(n for j in b for n in ops[j].inputs),
            results=tuple(v for j in b for v in ops[j].results),
            loc=None if len({ops[j].loc for j in b}) > 1 else first.loc,
            phase=ops[b[-1]].phase)
        dropped.update(b[:-1])
    return fused, dropped


def _comm_bytes(ops: list[Op], types: dict[str, TensorType], sizes: dict[str, int]) -> int:
    """Bytes one device sends for ``ops``, by the op table's ring formulas."""
    total = 0
    for op in ops:
        ins = [types[n] for n in op.inputs]
        outs = [v.type for v in op.results]
        total += op_def(op.name).comm_bytes(op, ins, outs, sizes.get(op.attrs.get("axis"), 1),
                                              sizes)
    return total


def _stable_topo(ops: list[Op], graph: Graph) -> tuple[Op, ...]:
    """Program order, except that an op waits until its inputs are made (readers of an
    earlier bucket member move after the bucket)."""
    ready = {i.name for i in graph.inputs}
    made_by = {v.name: k for k, op in enumerate(ops) for v in op.results}
    waiting: dict[str, list[int]] = {}
    missing = []
    heap: list[int] = []
    for k, op in enumerate(ops):
        need = {n for n in free_inputs(op) if n in made_by and n not in ready}
        missing.append(len(need))
        for n in need:
            waiting.setdefault(n, []).append(k)
        if not need:
            heap.append(k)
    heapq.heapify(heap)
    out = []
    while heap:
        k = heapq.heappop(heap)
        out.append(ops[k])
        for v in ops[k].results:
            for j in waiting.pop(v.name, ()):
                missing[j] -= 1
                if missing[j] == 0:
                    heapq.heappush(heap, j)
    if len(out) != len(ops):   # pragma: no cover - a bucket closes before a dependent member
        raise PassFailure("comm-fusion: a bucket made a dependency cycle")
    return tuple(out)
