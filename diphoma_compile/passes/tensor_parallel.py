"""Tensor (model) parallelism: Megatron's splits of each block, found by dataflow and
completed over the whole step by sharding propagation.

The pass finds the column/row layer pairs (``megatron.py``), fixes their weights' splits on
mesh axis ``axis`` (never gathered whole), and lets propagation (``ir/propagate.py``)
place everything else: the
other parameters (each column layer's bias follows its split; layer norms stay whole),
optimizer state like its parameter, activations, gradients and the update, inserting the
collectives the choice implies (one all-reduce after each pair in forward and one in
backward for a standard block). With ``sequence=true`` the all-reduces are forbidden, so
each becomes a reduce-scatter and an all-gather with the same bytes, and the ops between
them (layer norms, residual adds) run on pieces of the sequence or batch (Megatron's
sequence parallelism)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ..ir.core import Graph, InputKind, Phase
from ..errors import IRError
from ..ir.device_model import device_model
from ..ir.opdef import is_view
from ..ir.propagate import apply_assignment, complete
from .base import Pass, PassContext, PassFailure, register_pass
from .data_parallel import require_axis
from .megatron import LayerPair, find_pairs, undivided


@dataclass(frozen=True)
class TensorParallelRecord:
    """What tensor-parallel decided: the layer pairs, each weight's split, the collectives."""

    axis: str
    size: int
    pairs: tuple[LayerPair, ...]
    splits: tuple[tuple[str, str], ...]          # parameter -> placement, for every split one
    collectives: tuple[tuple[str, str, str], ...]   # (phase, collective, value)
    solve_seconds: float
    # weights a pair would split but for the axis size: (param, shape, the dim it would split)
    undivided: tuple[tuple[str, tuple[int, ...], int], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The plan's ``notes["tensor-parallel"]``."""
        return {"axis": self.axis, "size": self.size,
                "pairs": [{"column": list(p.column), "row": p.row} for p in self.pairs],
                "splits": dict(self.splits),
                "collectives": [{"phase": ph, "kind": k, "value": v}
                                for ph, k, v in self.collectives],
                "solve_seconds": round(self.solve_seconds, 3),
                "undivided": [{"param": p, "shape": list(shape), "dim": d}
                              for p, shape, d in self.undivided]}


@register_pass
@dataclass(frozen=True)
class TensorParallel(Pass):
    """Split Megatron's layer pairs over mesh axis ``axis``; place the rest by propagation."""

    name = "tensor-parallel"
    axis: str = "tp"
    sequence: bool = False
    device_model: str = "h100-nccl"

    def __call__(self, graph: Graph, ctx: PassContext) -> Graph:
        n = require_axis(graph, self.axis, self.name)
        pairs, seeds, groups = find_pairs(graph, n)
        whole = tuple(undivided(graph, n, seeds))
        if not pairs:
            sizes = "; ".join(f"{p} {list(shape)}: dim {d} ({shape[d]}) does not divide "
                              f"{n}" for p, shape, d in whole[:4])
            # layers scanned over (flax nn.scan, a lax.scan over stacked weights): their
            # matmuls are inside the scan's body, where the pair finder does not look
            scanned = any(op.name == "scan" and (op.phase or Phase.forward) is Phase.forward
                          for op in graph.ops)
            raise PassFailure(
                f"{self.name}: no column/row layer pair to split over {self.axis}={n}"
                + (f" ({sizes})" if sizes else "")
                + ("; the step's layers run inside a lax.scan (flax nn.scan), which "
                   "tensor parallelism does not look into yet" if scanned else ""),
                hint="tensor parallelism splits matmul pairs (an MLP, attention's "
                     "projections) on dimensions the axis divides, with nothing between the "
                     "two but elementwise math (a dropout between them keeps the pair whole: "
                     "a random draw runs whole only): make the heads and hidden sizes "
                     "multiples of it, move the dropout after the pair, use a smaller axis, "
                     "or drop it" + ("; unroll the scanned layers (a Python loop) to split "
                                     "them" if scanned else ""))
        params = [i.name for i in graph.inputs
                  if i.role.kind is InputKind.param and i.name not in seeds]
        model = device_model(self.device_model)
        t0 = time.perf_counter()
        activation = _activation_test(graph)
        weights = _param_views(graph)

        def avoid(collective: str, value: str) -> bool:
            # split weights are never gathered whole (that would undo the split); with
            # sequence parallelism activations are never all-reduced
            return (collective == "all_gather" and value in weights) or (
                self.sequence and collective == "all_reduce" and activation(value))
        try:
            a = complete(graph, self.axis, seeds, model, free=params, avoid=avoid,
                         groups=groups)
        except IRError:
            # a split weight is also needed whole somewhere (a framework op that runs whole
            # only): gather it there rather than fail
            a = complete(graph, self.axis, seeds, model, free=params,
                         avoid=lambda c, v: self.sequence and c == "all_reduce"
                         and activation(v), groups=groups)
        seconds = time.perf_counter() - t0
        out = apply_assignment(graph, a)
        splits = tuple(sorted((i.name, str(a.placements[i.name])) for i in graph.inputs
                              if i.role.kind is InputKind.param
                              and str(a.placements[i.name]) != "R"))
        moved = tuple((graph.ops[r.op_index].phase.value if r.op_index >= 0
                       and graph.ops[r.op_index].phase else "output", r.collective, r.value)
                      for r in a.collectives())
        ctx.decisions[self.name] = TensorParallelRecord(self.axis, n, tuple(pairs), splits,
                                                        moved, seconds, whole)
        return out


def _param_views(graph: Graph) -> set[str]:
    """Parameters and the values that are views of them (a transposed weight)."""
    out = {i.name for i in graph.inputs if i.role.kind is InputKind.param}
    for op in graph.ops:
        if is_view(op) and len(op.inputs) == 1 and op.inputs[0] in out:
            out.update(v.name for v in op.results)
    return out


def _activation_test(graph: Graph):
    """Activations and their gradients: values whose leading dimensions are the batch's
    (batch and sequence); parameter gradients are not (their all-reduce stays)."""
    batch = [i.value.type.shape for i in graph.inputs if i.role.kind is InputKind.batch
             and i.value.type.rank >= 2]
    lead = max(batch, key=len)[:2] if batch else None
    types = graph.value_types()
    return lambda name: lead is not None and types[name].shape[:2] == lead


def collectives_by_phase(record: TensorParallelRecord) -> dict[str, list[str]]:
    """The record's collectives grouped by phase (forward, backward, update, output)."""
    out: dict[str, list[str]] = {}
    for phase, kind, _ in record.collectives:
        out.setdefault(phase, []).append(kind)
    return out


__all__ = ["TensorParallel", "TensorParallelRecord", "collectives_by_phase"]
