"""Data parallelism: every device runs the step on its own part of the batch, and the
gradients (and the loss) are averaged across devices where they are complete.

The graph is the step traced at the *local* batch (each device's share): batch inputs become
varying (``V``, one value per device), every op that reads a varying value becomes a
per-device computation, and each varying value that the update or an output reads gets an
``all_reduce{op=avg}`` right where it is made (the end of backward for a gradient). This is
the DDP convention: the step's loss is a mean over the examples of the batch, so the mean of
the devices' gradients is the gradient of the global batch. Buffers that the forward pass
updates from the batch (BatchNorm statistics) take device 0's new value, as DDP does."""

from __future__ import annotations

from dataclasses import dataclass

from ..ir.core import Attrs, Graph, InputKind, Op, OutputKind, Phase, Value
from ..ir.ops import op_def
from ..ir.sharding import propagate
from ..ir.types import VARYING, TensorType, Varying
from .base import Pass, PassContext, PassFailure, register_pass
from .dce import dce_graph


def require_axis(graph: Graph, axis: str, pass_name: str) -> int:
    """The size of mesh axis ``axis``; PassFailure when the graph's mesh lacks it."""
    sizes = dict(graph.mesh.axes)
    if axis not in sizes:
        have = ", ".join(f"{a}={n}" for a, n in graph.mesh.axes) or "no mesh"
        raise PassFailure(f"{pass_name}: the mesh has no axis {axis!r} (it has {have})",
                          hint=f"give the mesh an axis {axis!r}, or name the axis: "
                               f"{pass_name}{{axis=...}}")
    return sizes[axis]


def _varying(t: TensorType, axis: str) -> bool:
    return isinstance(t.placement(axis), Varying)


def _sums_contributions(op: Op, ins: list[TensorType], axis: str) -> bool:
    """An update-phase sum of two per-device values: two contributions to one gradient (a
    tied embedding). Averaging commutes with it, so it stays per device and the gradient is
    averaged once, after it."""
    return op.name in ("add", "sub") and len(ins) == 2 and all(_varying(t, axis) for t in ins)


@register_pass
@dataclass(frozen=True)
class DataParallel(Pass):
    """Split the batch over mesh axis ``axis``; average gradients, loss and metrics there."""

    name = "data-parallel"
    axis: str = "dp"

    def __call__(self, graph: Graph, ctx: PassContext) -> Graph:
        require_axis(graph, self.axis, self.name)
        # dead reads must not sync anything (traced views leave dead update ops behind)
        graph = dce_graph(graph)
        ax = self.axis
        batch = [i.name for i in graph.inputs if i.role.kind is InputKind.batch]
        if not batch:
            raise PassFailure("data-parallel: the step has no batch input to split",
                              hint="pass the batch as an argument of the step (not a "
                                   "closure or a global)")
        types: dict[str, TensorType] = {}
        inputs = []
        for i in graph.inputs:
            t = i.value.type
            if i.role.kind is InputKind.batch:
                t = t.with_placement(ax, VARYING)
                i = type(i)(Value(i.name, t), i.role)
            types[i.name] = t
            inputs.append(i)

        # 1. every op before the update that reads a per-device value computes per device;
        #    the update reads averaged values instead (step 2)
        need: dict[str, str] = {}        # varying name -> how it is synchronized
        ops: list[Op] = []
        for op in graph.ops:
            ins = [types[n] for n in op.inputs]
            if op.phase is Phase.update and _sums_contributions(op, ins, ax):
                op = op.replace(phase=Phase.backward)
            if op.phase is Phase.update:
                for n, t in zip(op.inputs, ins):
                    if n in batch:
                        raise PassFailure(f"data-parallel: the optimizer update reads the "
                                          f"batch input %{n} directly", op=op,
                                          hint="the update may read gradients, parameters "
                                               "and optimizer state, not the batch")
                    if _varying(t, ax):
                        need.setdefault(n, "avg")
            elif any(_varying(t, ax) for t in ins):
                if op.regions:
                    raise PassFailure(f"data-parallel: {op.name} with nested regions reads the "
                                      "batch; per-device control flow is not supported yet",
                                      op=op, hint="trace the step without lax.scan/while "
                                                  "over batch data")
                outs = [v.type for v in op.results]
                got = propagate(op, ins, outs, ax, op_def(op.name).sharding_rule)
                if got is None:
                    raise PassFailure(f"data-parallel: {op.name} mixes per-device and split "
                                      "values", op=op)
                op = op.replace(results=tuple(Value(v.name, v.type.with_placement(ax, p))
                                              for v, p in zip(op.results, got)))
            types.update((v.name, v.type) for v in op.results)
            ops.append(op)

        # 2. where a per-device value leaves per-device code, average it across devices
        roles = {i.name: i.role for i in inputs}
        for o in graph.outputs:
            if not _varying(types[o.name], ax):
                continue
            if o.role.kind is OutputKind.replaces and \
                    roles[o.role.target].kind is InputKind.buffer:
                need[o.name] = "root0"
            else:
                need.setdefault(o.name, "avg")
        for n, how in need.items():
            if how == "avg" and not types[n].dtype.is_float:
                raise PassFailure(f"data-parallel: the {types[n].dtype} value %{n} is computed "
                                  "from the batch and leaves the per-device part of the step; "
                                  "only floating-point values can be averaged across devices",
                                  hint="return it as a float, or compute it outside the step")

        names = graph.fresh_names()
        made: dict[str, str] = {}
        out_ops: list[Op] = []

        def sync(n: str, at: Op | None) -> None:
            t = types[n]
            new = names(f"{n}.{'avg' if need[n] == 'avg' else 'bcast'}")
            attrs = Attrs(axis=ax, op="avg") if need[n] == "avg" else Attrs(axis=ax, root=0)
            kind = "all_reduce" if need[n] == "avg" else "broadcast"
            phase = at.phase if at is not None else Phase.backward
            out_ops.append(Op(kind, (n,), (Value(new, t.replicated()),), attrs,
                              phase=phase, loc=at.loc if at is not None else None))
            made[n] = new

        for n in need:
            if n in types and any(i.name == n for i in inputs):
                sync(n, None)
        for op in ops:
            if made:
                renamed = tuple(made.get(n, n) for n in op.inputs)
                if renamed != op.inputs and op.phase is Phase.update:
                    op = op.replace(inputs=renamed)
            out_ops.append(op)
            for v in op.results:
                if v.name in need:
                    sync(v.name, op)
        outputs = tuple(type(o)(made.get(o.name, o.name), o.role) for o in graph.outputs)
        ctx.notes[self.name] = {
            "axis": ax, "batch": batch,
            "averaged": [n for n, how in need.items() if how == "avg"],
            "broadcast": [n for n, how in need.items() if how != "avg"],
        }
        return graph.replace(inputs=tuple(inputs), ops=tuple(out_ops), outputs=outputs)
