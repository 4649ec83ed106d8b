"""SDP4Bit's quantized weight differences (qWD; Jia et al. 2024, arXiv 2410.15526).

After weight-update sharding each device holds the exact new piece of every parameter and
all-gathers it in fp32. This pass makes the all-gather move ``bits``-bit integers instead:
each device quantizes the difference between its exact new piece and the copy every device
holds (the reconstruction: the parameter itself, which the forward pass reads), packs it two
values per byte, and all-gathers the bytes and one fp32 scale per group; every device
dequantizes and adds the difference to its copy. Because the difference is taken against
the reconstruction, not the exact old weights, the rounding error does not accumulate: the
parameter is always within one quantization step of the exact weights.

The exact weights are no longer what the parameter holds, so each device keeps its exact
piece as step state: an input ``%w.master`` with the role ``comm_state(of=%w, slot=master)``
(placed like the piece) and an output that replaces it, which a checkpoint holds like
optimizer state; the update reads it where it read its piece of the parameter. A runtime
starts it from the parameter's own piece (the first step's weights are exact). Stochastic
rounding draws from an explicit key, ``%qwd.key: key[] comm_state(slot=rng_key)``, advanced
once per parameter by ``rng_next`` and returned, so runs are reproducible.

A tensor whose piece is smaller than one group stays an fp32 all-gather (its scales and
padding would outweigh it); the plan lists it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..ir.core import (Attrs, Graph, Input, InputKind, InputRole, Op, Output, OutputKind,
                       OutputRole, Value)
from ..ir.ops import op_def
from ..ir.rewrite import rename_uses
from ..ir.shape_rules import piece_layout
from ..ir.sharding_rules import propagate
from ..ir.types import FLAT, FLAT_DIRTY, DType, Shard, TensorType
from .base import Pass, PassContext, PassFailure, register_pass
from .data_parallel import require_axis

KEY_SLOT = "rng_key"
MASTER_SLOT = "master"
# the pieces a quantized payload is cut into: flat pieces (the PyTorch layout) or dim-0
# shards of a dimension the axis divides (the JAX layout): either way device j's piece is
# chunk j of the flattened tensor. A shard along another dimension d is moved to dim 0
# first (``moved_to_front``), and back after.


def moved_to_front(shape: tuple[int, ...], dim: int) -> tuple[tuple[int, ...],
                                                                tuple[int, ...],
                                                                tuple[int, ...]]:
    """(perm moving ``dim`` to the front, its inverse, the moved shape)."""
    perm = (dim,) + tuple(i for i in range(len(shape)) if i != dim)
    inv = tuple(perm.index(i) for i in range(len(shape)))
    return perm, inv, tuple(shape[i] for i in perm)


def error_bound(bits: int, rounding: str) -> str:
    """The declared error of one quantized value, per group (the plan's wording)."""
    q = (1 << (bits - 1)) - 1
    return f"absmax/{q}" if rounding == "stochastic" else f"absmax/{2 * q}"


@dataclass(frozen=True)
class QuantizeWeightDiffRecord:
    """What quantize-weight-diff decided: which all-gathers carry quantized differences."""

    axis: str
    bits: int
    group: int
    rounding: str
    quantized: tuple[str, ...]                 # parameters whose new value moves quantized
    kept: tuple[tuple[str, str], ...]          # (parameter, why it moves in fp32)
    bytes_before: Mapping[str, int]            # parameter -> bytes one device sends, fp32
    bytes_after: Mapping[str, int]             # parameter -> packed bytes + scales
    # collective result -> (the tensor it belongs to, what it serves), for the plan
    payloads: Mapping[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def bound(self) -> str:
        """The declared error of the parameters, per group of their difference."""
        return error_bound(self.bits, self.rounding)

    def to_dict(self) -> dict[str, Any]:
        """The plan's ``notes["quantize-weight-diff"]``."""
        return {"axis": self.axis, "bits": self.bits, "group": self.group,
                "rounding": self.rounding, "error_bound": self.bound,
                "quantized": list(self.quantized), "kept": [list(k) for k in self.kept],
                "bytes_before": dict(self.bytes_before), "bytes_after": dict(self.bytes_after)}


@register_pass
@dataclass(frozen=True)
class QuantizeWeightDiff(Pass):
    """Move weight-update sharding's new parameters as quantized differences."""

    name = "quantize-weight-diff"
    axis: str = "dp"
    bits: int = 4
    group: int = 2048
    rounding: str = "stochastic"
    # the ablation of SDP4Bit's paper: quantize the new weights themselves (ZeRO++'s qwZ at
    # 4 bits) instead of their difference; every device computes with the rounded weights
    naive: bool = False

    def __call__(self, graph: Graph, ctx: PassContext) -> Graph:
        n = require_axis(graph, self.axis, self.name)
        if self.bits not in (4, 8):
            raise PassFailure(f"{self.name}: bits={self.bits}; 4 and 8 are supported",
                              hint="use bits=4 (SDP4Bit) or bits=8 (ZeRO++ qwZ)")
        if self.rounding not in ("stochastic", "nearest"):
            raise PassFailure(f"{self.name}: rounding={self.rounding!r} is not stochastic or "
                              "nearest")
        if self.group < 2 or self.group % 2:
            raise PassFailure(f"{self.name}: group={self.group} must be even (two values per "
                              "byte)")
        targets = _gathered_params(graph, self.axis)
        if not targets:
            raise PassFailure(f"{self.name}: no parameter is all-gathered from flat or "
                              f"dim-0 pieces over {self.axis!r}",
                              hint=f"run weight-update-sharding{{axis={self.axis}}} first")
        if n == 1:
            return graph
        dirty: set[str] = set()
        for _ in range(4):
            out, record, more = self.rewrite(graph, n, targets, dirty)
            if not more:
                break
            dirty |= more
        else:  # pragma: no cover - each round only adds names
            raise PassFailure(f"{self.name}: state placements did not settle")
        ctx.decisions[self.name] = record
        return out

    def rewrite(self, g: Graph, n: int, targets: dict[str, Op], dirty: set[str]
                ) -> tuple[Graph, QuantizeWeightDiffRecord, set[str]]:
        ax = self.axis
        names = g.fresh_names()
        types = g.value_types()
        quantized, kept, before, after = [], [], {}, {}
        payloads: dict[str, tuple[str, str]] = {}
        inputs = [Input(Value(i.name, i.value.type.with_placement(ax, FLAT_DIRTY)), i.role)
                  if i.name in dirty else i for i in g.inputs]
        key = names("qwd.key")
        key_t = TensorType((), DType.key)
        key_now = key
        reads: dict[str, str] = {}       # the update's read of a parameter's piece -> master
        new_ops: dict[int, list[Op]] = {}   # index of the all-gather -> what replaces it
        extra_outputs: list[Output] = []
        for w, gather in targets.items():
            new = gather.inputs[0]
            new_t = types[new]
            wt = types[w]
            d = op_def("all_gather")
            before[w] = d.comm_bytes(gather, [new_t], [gather.result.type], n)
            k, kq = piece_layout(wt.numel, n, self.group)
            after[w] = before[w]
            if k < self.group:
                kept.append((w, f"its piece ({k} values) is smaller than a group "
                                f"({self.group})"))
                continue
            pieces = [op for op in g.ops if op.name == "take_shard" and op.inputs == (w,)
                      and op.attrs.get("axis") == ax]
            if len(pieces) != 1:
                kept.append((w, "the update does not read it through one local piece"))
                continue
            old_piece = pieces[0].result.name
            master = names(f"{w}.master")
            m_place = new_t.placement(ax)
            if m_place != FLAT_DIRTY and master in dirty:
                m_place = FLAT_DIRTY
            inputs.append(Input(Value(master, wt.with_placement(ax, m_place)),
                                InputRole(InputKind.comm_state, of=w, slot=MASTER_SLOT)))
            reads[old_piece] = master
            extra_outputs.append(Output(new, _replaces(master)))
            common = {"phase": gather.phase, "loc": gather.loc}
            dim = gather.attrs["dim"]
            piece_t = new_t.with_placement(ax, new_t.placement(ax) if dim != "flat"
                                           else FLAT_DIRTY if new_t.placement(ax) == FLAT_DIRTY
                                           else FLAT)
            ops: list[Op] = []

            def emit(name: str, ins: tuple[str, ...], results: list[tuple[str, TensorType]],
                     ops: list[Op] = ops, common: dict = common, **attrs: Any) -> list[str]:
                vals = tuple(Value(names(h), t) for h, t in results)
                ops.append(Op(name, ins, vals, Attrs(attrs), **common))
                return [v.name for v in vals]

            nq, ng = n * kq, n * kq // self.group
            shard0 = Shard(0)
            if self.naive:
                diff = new
            else:
                (diff,) = emit("sub", (new, old_piece), [(f"{w}.qwd.diff", piece_t)])
            moved = dim not in ("flat", 0)
            if moved:       # a shard along dim d: its pieces are chunks once d is first
                perm, inv, mshape = moved_to_front(wt.shape, int(dim))
                (diff,) = emit("transpose", (diff,),
                               [(f"{w}.qwd.diff.moved",
                                 TensorType(mshape, wt.dtype).with_placement(ax, shard0))],
                               perm=perm)
            qins = (diff, key_now) if self.rounding == "stochastic" else (diff,)
            q, s = emit("quantize", qins,
                        [(f"{w}.qwd.q", TensorType((nq,), DType.i8).with_placement(ax, shard0)),
                         (f"{w}.qwd.scales",
                          TensorType((ng,), wt.dtype).with_placement(ax, shard0))],
                        bits=self.bits, group_size=self.group, pieces=n,
                        rounding=self.rounding)
            nbytes = nq * self.bits // 8
            (p,) = emit("pack", (q,), [(f"{w}.qwd.packed",
                                        TensorType((nbytes,), DType.u8)
                                        .with_placement(ax, shard0))], bits=self.bits)
            (pg,) = emit("all_gather", (p,), [(f"{w}.qwd.packed.full",
                                              TensorType((nbytes,), DType.u8))], axis=ax, dim=0)
            (sg,) = emit("all_gather", (s,), [(f"{w}.qwd.scales.full",
                                              TensorType((ng,), wt.dtype))], axis=ax, dim=0)
            (qg,) = emit("unpack", (pg,), [(f"{w}.qwd.q.full", TensorType((nq,), DType.i8))],
                         bits=self.bits, dtype="i8")
            (delta,) = emit("dequantize", (qg, sg), [(f"{w}.qwd.delta",
                                                      TensorType(mshape if moved else wt.shape,
                                                                 wt.dtype))],
                            bits=self.bits, group_size=self.group, pieces=n,
                            dtype=wt.dtype.value)
            if moved:
                (delta,) = emit("transpose", (delta,),
                                [(f"{w}.qwd.delta.back", TensorType(wt.shape, wt.dtype))],
                                perm=inv)
            if self.naive:     # the dequantized weights are the new value itself
                ops[-1] = ops[-1].replace(results=(gather.result,))
            else:
                ops.append(Op("add", (w, delta), (gather.result,), **common))
            sent = {v.name: v.type for o in ops for v in o.results}
            after[w] = sum(d.comm_bytes(o, [sent[o.inputs[0]]], [o.result.type], n)
                           for o in ops if o.name == "all_gather")
            if self.rounding == "stochastic":
                (key_now,) = emit("rng_next", (key_now,), [("qwd.key.next", key_t)])
            new_ops[g.ops.index(gather)] = ops
            quantized.append(w)
            what = f"new value of {w} ({self.bits}-bit {'value' if self.naive else 'difference'})"
            payloads.update({pg: (w, what), sg: (w, f"scales of the {what}")})
        if not quantized:      # every parameter too small: the plan says why, nothing changes
            return g, QuantizeWeightDiffRecord(ax, self.bits, self.group, self.rounding, (),
                                               tuple(kept), before, after), set()
        # the update reads the exact piece (master) where it read the parameter's piece;
        # the difference (new ops, not renamed) reads the parameter's piece: the old
        # reconstruction
        fixed: list[Op] = []
        for idx, op in enumerate(rename_uses(g.ops, reads)):
            fixed.extend(new_ops.get(idx, [op]))
        outputs = list(g.outputs) + extra_outputs
        if self.rounding == "stochastic":
            inputs.append(Input(Value(key, key_t), InputRole(InputKind.comm_state,
                                                             slot=KEY_SLOT)))
            outputs.append(Output(key_now, _replaces(key)))
        ops_out, more = _replace_placements(tuple(fixed), inputs, outputs, ax)
        graph = g.replace(inputs=tuple(inputs), ops=ops_out, outputs=tuple(outputs))
        record = QuantizeWeightDiffRecord(ax, self.bits, self.group, self.rounding,
                                          tuple(quantized), tuple(kept), before, after,
                                          payloads)
        return graph, record, more - dirty


def _replaces(name: str) -> OutputRole:
    return OutputRole(OutputKind.replaces, name)


def _gathered_params(g: Graph, axis: str) -> dict[str, Op]:
    """Parameter -> the all-gather of its pieces (flat or along a dim) that makes its new
    value."""
    params = {i.name for i in g.inputs if i.role.kind is InputKind.param}
    producer = {v.name: op for op in g.ops for v in op.results}
    out: dict[str, Op] = {}
    for o in g.outputs:
        if o.role.kind is not OutputKind.replaces or o.role.target not in params:
            continue
        op = producer.get(o.name)
        if op is not None and op.name == "all_gather" and len(op.inputs) == 1 and \
                op.attrs.get("axis") == axis:
            out[o.role.target] = op
    return out


def _replace_placements(ops: tuple[Op, ...], inputs: list[Input], outputs: list[Output],
                        axis: str) -> tuple[tuple[Op, ...], set[str]]:
    """Placements again after the update reads the master pieces (which may carry dirty
    padding, Fx): each op whose input types changed gets its results from the op table's
    sharding rule. Returns the ops and the state inputs whose new value came out Fx while
    they are declared F (to declare Fx and rewrite again)."""
    types = {i.name: i.value.type for i in inputs}
    out = []
    for op in ops:
        d = op_def(op.name)
        ins = [types[i] for i in op.inputs]
        if d.category.value in ("collective", "sync", "constant", "opaque", "control") or \
                op.name == "quantize":
            out.append(op)
            types.update((v.name, v.type) for v in op.results)
            continue
        got = propagate(op, ins, [v.type for v in op.results], axis, d.sharding_rule)
        if got is None:
            raise PassFailure(f"quantize-weight-diff: {op.name} cannot read the exact pieces "
                              "as they are placed", op=op)
        results = tuple(Value(v.name, v.type.with_placement(axis, p))
                        for v, p in zip(op.results, got))
        if results != op.results:
            op = op.replace(results=results)
        out.append(op)
        types.update((v.name, v.type) for v in op.results)
    more = set()
    for o in outputs:
        if o.role.kind is OutputKind.replaces and o.name in types:
            want = types[o.role.target].placement(axis)
            got_p = types[o.name].placement(axis)
            if want == FLAT and got_p == FLAT_DIRTY:
                more.add(o.role.target)
    return tuple(out), more
