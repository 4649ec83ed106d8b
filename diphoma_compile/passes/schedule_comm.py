"""Communication scheduling: issue each collective as soon as its inputs are ready and wait
for it only where its result is first needed, so communication overlaps computation.

Every all_reduce / reduce_scatter / all_gather moves up to just after the op that makes its
last input (data dependencies are the only order it must keep: collectives are not
effects, and every device runs the same program, so all devices issue them in the same
order), is marked ``async=true``, and a ``wait`` op that hands its results on is placed
just before the first op (or output) that reads one of them. A collective whose first use
immediately follows it gets no wait: there is nothing to overlap."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..ir.analysis import free_inputs
from ..ir.core import Graph, Op, Output, Value
from ..ir.ops import OPS
from ..ir.rewrite import rename_uses
from .base import Pass, PassContext, register_pass

# the collectives that can be bucketed and run asynchronously: those with an async attribute
ASYNC = frozenset(n for n, d in OPS.items() if "async" in d.attrs)


@dataclass(frozen=True)
class ScheduleCommRecord:
    """What schedule-comm did: how many collectives it made asynchronous."""

    overlapped: int      # issued as soon as their inputs are ready, awaited where first needed

    def to_dict(self) -> dict[str, Any]:
        """The plan's ``notes["schedule-comm"]`` (docs/plan.md): ``{"async": n}``."""
        return {"async": self.overlapped}


@register_pass
@dataclass(frozen=True)
class ScheduleComm(Pass):
    """Issue collectives early (async) and wait for them late."""

    name = "schedule-comm"

    def __call__(self, graph: Graph, ctx: PassContext) -> Graph:
        ops = list(graph.ops)
        if not any(op.name in ASYNC and not op.attrs.get("async") for op in ops):
            return graph
        # 1. issue early: each collective right after the producer of its last input; a
        # gather of pieces the step receives (parameters held sharded) only one ahead: after
        # the first reader of the gather before it, so that whole parameters are not all
        # alive at once (FSDP's prefetch)
        made: dict[str, int] = {}
        order: list[Op] = []
        received = {i.name for i in graph.inputs}
        before: tuple[str, ...] = ()     # results of the last gather of received pieces
        for op in ops:
            if op.name in ASYNC and not op.attrs.get("async"):
                at = max((made[n] for n in op.inputs if n in made), default=-1)
                prefetch = op.name == "all_gather" and all(n in received for n in op.inputs)
                if prefetch and before:
                    readers = [k for k, o in enumerate(order) if set(before) & set(o.inputs)]
                    at = max(at, readers[0] if readers else len(order) - 1)
                if prefetch:
                    before = tuple(v.name for v in op.results)
                order.insert(at + 1, op)
                made = {v.name: k for k, o in enumerate(order) for v in o.results}
            else:
                order.append(op)
                made.update((v.name, len(order) - 1) for v in op.results)
        # 2. wait late: before the first reader of any result
        names = graph.fresh_names()
        out: list[Op] = []
        waits: dict[int, list[Op]] = {}    # position of the first reader -> waits before it
        rename: dict[str, str] = {}
        first_use: dict[str, int] = {}
        for k, op in enumerate(order):
            for n in free_inputs(op):
                first_use.setdefault(n, k)
        end = len(order)
        overlapped = 0
        for k, op in enumerate(order):
            if op.name not in ASYNC or op.attrs.get("async"):
                continue
            use = min(first_use.get(v.name, end) for v in op.results)
            if use == k + 1:
                continue   # read at once: a plain collective
            overlapped += 1
            order[k] = op.replace(attrs=op.attrs.set(**{"async": True}))
            ready = tuple(Value(names(f"{v.name}.ready"), v.type) for v in op.results)
            rename.update((v.name, r.name) for v, r in zip(op.results, ready))
            waits.setdefault(use, []).append(
                Op("wait", tuple(v.name for v in op.results), ready, phase=order[use].phase
                   if use < end else op.phase, loc=op.loc))
        for k, op in enumerate(order):
            out.extend(waits.get(k, ()))
            out.append(op)
        out.extend(waits.get(end, ()))
        # readers (not the waits themselves) take the waited names
        final: list[Op] = []
        for op in out:
            final.append(op if op.name == "wait" else rename_uses((op,), rename)[0])
        outputs = tuple(Output(rename.get(o.name, o.name), o.role) for o in graph.outputs)
        ctx.decisions[self.name] = ScheduleCommRecord(overlapped)
        return graph.replace(ops=tuple(final), outputs=outputs)
