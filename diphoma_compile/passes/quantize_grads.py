"""SDP4Bit's quantized gradients (TLq-HS; Jia et al. 2024, arXiv 2410.15526): one hop, two
hops (node x local), or plain data parallelism's all-reduces.

Weight-update sharding reduce-scatters each gradient in fp32. This pass makes that
reduce-scatter an all-to-all of ``bits``-bit integers: each device transforms its whole
gradient with the orthonormal Hadamard transform of each 32-element block (which spreads
outliers over their block, so a group's absmax is smaller), quantizes it per group of
``group`` values in the piece layout of weight-update sharding (chunk j of the flattened
gradient, padded to whole groups, is device j's), packs two values per byte and sends chunk j
to device j with ``all_to_all`` (with one fp32 scale per group); each device dequantizes
the N chunks it receives, averages them, applies the inverse transform (the same orthonormal
transform) and holds the result as its flat piece of the averaged gradient (``as_shard``).

Stochastic rounding draws from an explicit key, ``%qg.key: key[] comm_state(slot=rng_key)``,
advanced by ``rng_next`` per gradient and returned; each device rounds with numbers of its
own (a varying value draws by its place among the devices' values laid end to end).

Levels: with ``levels=2, local=L`` (or ``local=L`` under ``levels=auto``) the data axis's
N devices are N/L nodes of L consecutive devices and the exchange takes SDP4Bit's two hops:
``intra-bits`` (8) among each node's devices (``all_to_all{local=L, level=local}``, the
pieces reordered so that chunk b holds the rows of the devices b of every node), the
receivers average and requantize their node's partial mean to ``bits`` (4), then
``all_to_all{level=node}`` among the devices with the same place in their node. A level
of one device gives one hop. ``all-reduce=true`` rewrites plain data parallelism's
gradient all-reduces instead: the quantized exchange above, then each device's averaged
piece quantized to ``bits``, all-gathered and dequantized whole. A gradient whose piece is
smaller than a group stays fp32; the plan lists it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..ir.core import (Attrs, Graph, Input, InputKind, InputRole, Op, Output, OutputKind,
                       OutputRole, Value)
from ..ir.ops import op_def
from ..ir.shape_rules import piece_layout
from ..ir.types import VARYING, DType, Shard, TensorType, Varying
from .base import Pass, PassContext, PassFailure, register_pass
from .data_parallel import require_axis
from .quantize_weight_diff import KEY_SLOT, error_bound, moved_to_front


@dataclass(frozen=True)
class QuantizeGradsRecord:
    """What quantize-grads decided: which reduce-scatters became quantized all-to-alls."""

    axis: str
    bits: int
    group: int
    hadamard: int
    hops: int
    quantized: tuple[str, ...]              # gradients (the reduce-scatter's result)
    kept: tuple[tuple[str, str], ...]       # (gradient, why it stays fp32)
    bytes_before: Mapping[str, int]
    bytes_after: Mapping[str, int]
    params: Mapping[str, str] = field(default_factory=dict)    # gradient -> its parameter
    # collective result -> (the tensor it belongs to, what it serves), for the plan
    payloads: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    local: int = 0          # two hops: devices per node (hop 1 among them, in intra_bits)
    intra_bits: int = 8
    all_reduce: bool = False    # all-reduces: the averaged pieces all-gathered in `bits` too

    @property
    def bound(self) -> str:
        """The declared error of one device's contribution, per group (Hadamard domain);
        two hops: each hop's, the second's of the node's partial sum."""
        if self.hops == 2:
            out = (f"{error_bound(self.intra_bits, 'stochastic')} inside a node + "
                   f"{error_bound(self.bits, 'stochastic')} of the node's sum across nodes")
        else:
            out = error_bound(self.bits, "stochastic")
        if self.all_reduce:
            out += (f", then {error_bound(self.bits, 'stochastic')} of the averaged "
                    "gradient's group (all-gathered)")
        return out

    def to_dict(self) -> dict[str, Any]:
        """The plan's ``notes["quantize-grads"]``."""
        return {"axis": self.axis, "bits": self.bits, "group": self.group,
                "hadamard": self.hadamard, "hops": self.hops, "error_bound": self.bound,
                "local": self.local, "intra_bits": self.intra_bits,
                "all_reduce": self.all_reduce,
                "quantized": list(self.quantized), "kept": [list(k) for k in self.kept],
                "bytes_before": dict(self.bytes_before), "bytes_after": dict(self.bytes_after),
                "params": dict(self.params)}


def param_of(g: Graph, value: str) -> str | None:
    """The parameter a gradient is for: the first state (a parameter, or state that names
    its parameter) that values of the gradient's size made from it replace."""
    inputs = {i.name: i for i in g.inputs}
    numel = g.value_types()[value].numel
    users: dict[str, list[Op]] = {}
    for op in g.ops:
        for i in op.inputs:
            users.setdefault(i, []).append(op)
    replaced = {o.name: o.role.target for o in g.outputs
                if o.role.kind is OutputKind.replaces}
    todo, seen = [value], set()
    while todo:
        v = todo.pop(0)
        if v in seen:
            continue
        seen.add(v)
        target = inputs.get(replaced.get(v, ""))
        if target is not None:
            return target.name if target.role.kind is InputKind.param else target.role.of
        for op in users.get(v, ()):
            todo.extend(r.name for r in op.results if r.type.numel == numel)
    return None


@register_pass
@dataclass(frozen=True)
class QuantizeGrads(Pass):
    """Reduce-scatter gradients as Hadamard-transformed, quantized all-to-alls."""

    name = "quantize-grads"
    axis: str = "dp"
    bits: int = 4
    intra_bits: int = 8
    group: int = 128
    hadamard: int = 32
    levels: str = "auto"
    # devices per node: the axis's N devices as N/local nodes of `local` consecutive ones
    # (row-major ranks), for the two-hop form; 0: one level
    local: int = 0
    # data parallelism without weight-update sharding: each gradient's all-reduce becomes
    # the quantized reduce-scatter (all-to-all) and a 4-bit all-gather of the averaged piece
    all_reduce: bool = False

    def __call__(self, graph: Graph, ctx: PassContext) -> Graph:
        n = require_axis(graph, self.axis, self.name)
        if self.bits not in (4, 8) or self.intra_bits not in (4, 8):
            raise PassFailure(f"{self.name}: bits={self.bits}, intra-bits={self.intra_bits}; "
                              "4 and 8 are supported")
        if self.group < 1:
            raise PassFailure(f"{self.name}: group={self.group} must be a positive number of "
                              "elements (each group is quantized with its own scale)")
        h = self.hadamard
        if h < 0 or (h and (h & (h - 1) or self.group % h)):
            raise PassFailure(f"{self.name}: hadamard={h} must be 0 or a power of two that "
                              f"divides group={self.group}")
        if self.levels not in ("auto", "1", "2"):
            raise PassFailure(f"{self.name}: levels={self.levels!r} is not auto, 1 or 2")
        hops = self.hops(n)
        types = graph.value_types()
        if self.all_reduce:
            sites = [op for op in graph.ops if op.name == "all_reduce" and len(op.inputs) == 1
                     and op.attrs.get("axis") == self.axis
                     and isinstance(types[op.inputs[0]].placement(self.axis), Varying)
                     and param_of(graph, op.result.name) is not None]
            if not sites:
                raise PassFailure(f"{self.name}: no gradient is all-reduced over "
                                  f"{self.axis!r}",
                                  hint=f"run data-parallel{{axis={self.axis}}} first (and "
                                       "this pass before comm-fusion); after "
                                       "weight-update-sharding leave all-reduce unset")
        else:
            sites = [op for op in graph.ops if op.name == "reduce_scatter"
                     and len(op.inputs) == 1 and op.attrs.get("axis") == self.axis
                     and isinstance(types[op.inputs[0]].placement(self.axis), Varying)]
        if not sites:
            raise PassFailure(f"{self.name}: no gradient is reduce-scattered over "
                              f"{self.axis!r}",
                              hint=f"run weight-update-sharding{{axis={self.axis}}} first "
                                   "(and this pass before comm-fusion)")
        if n == 1:
            return graph
        return self.rewrite(graph, n, sites, ctx, hops)

    def hops(self, n: int) -> int:
        """1 or 2: two when the axis is split into nodes (``local`` devices each) of more
        than one device and there is more than one node."""
        two = self.levels == "2" or (self.levels == "auto" and self.local > 0)
        if not two:
            return 1
        if self.local <= 0:
            raise PassFailure(f"{self.name}: levels=2 needs the devices per node",
                              hint="give local=L (the axis's N devices are N/L nodes of L "
                                   "consecutive devices), e.g. levels=2, local=2")
        if n % self.local:
            raise PassFailure(f"{self.name}: local={self.local} does not divide the axis's "
                              f"{n} devices into nodes",
                              hint="local must divide the data axis size")
        if self.local in (1, n):
            return 1          # one node, or one device per node: a level of size 1
        return 2

    def exchange(self, emit: Any, var: Any, gname: str, q: str, s: str, nq: int, bits: int,
                 level: dict[str, Any], st: DType) -> tuple[str, str]:
        """pack q, then all_to_all the bytes and the scales (of dtype ``st``) over
        ``level``'s devices: (received bytes, received scales)."""
        ng = nq // self.group
        nb = nq * bits // 8
        (p,) = emit("pack", (q,), [(f"{gname}.qg.packed", var((nb,), DType.u8))], bits=bits)
        (pr,) = emit("all_to_all", (p,), [(f"{gname}.qg.packed.recv", var((nb,), DType.u8))],
                     axis=self.axis, from_dim=0, to_dim=0, **level)
        (sr,) = emit("all_to_all", (s,), [(f"{gname}.qg.scales.recv", var((ng,), st))],
                     axis=self.axis, from_dim=0, to_dim=0, **level)
        return pr, sr

    def receive(self, emit: Any, var: Any, gname: str, pr: str, sr: str, nq: int,
                senders: int, each: int, dtype: DType, red: str, bits: int) -> list[str]:
        """unpack and dequantize what ``senders`` devices sent (``each`` values from each),
        then their mean (or sum): [the result]."""
        (qr,) = emit("unpack", (pr,), [(f"{gname}.qg.q.recv", var((nq,), DType.i8))],
                     bits=bits, dtype="i8")
        (dq,) = emit("dequantize", (qr, sr), [(f"{gname}.qg.recv", var((nq,), dtype))],
                     bits=bits, group_size=self.group, dtype=dtype.value)
        (rows,) = emit("reshape", (dq,), [(f"{gname}.qg.rows", var((senders, each), dtype))])
        return emit(red, (rows,), [(f"{gname}.qg.sum", var((each,), dtype))],
                    dims=(0,), keepdim=False)

    def gather(self, emit: Any, var: Any, ops: list[Op], common: dict, gname: str, tot: str,
               key: str, res: Value, n: int, kq: int) -> tuple[str, str]:
        """The all-reduce's second half: this device's averaged piece ``tot`` quantized
        to ``bits`` (stochastic, ``key``), its bytes and scales all-gathered, the whole
        dequantized into ``res``: (gathered bytes, gathered scales)."""
        ax, G, dt = self.axis, self.group, res.type.dtype
        nb = kq * self.bits // 8
        q, s = emit("quantize", (tot, key), [(f"{gname}.qg.mean.q", var((kq,), DType.i8)),
                                             (f"{gname}.qg.mean.scales", var((kq // G,), dt))],
                    bits=self.bits, group_size=G, rounding="stochastic")
        (p,) = emit("pack", (q,), [(f"{gname}.qg.mean.packed", var((nb,), DType.u8))],
                    bits=self.bits)
        piece = Shard(0)
        (ps,) = emit("as_shard", (p,), [(f"{gname}.qg.mean.piece",
                                         TensorType((n * nb,), DType.u8)
                                         .with_placement(ax, piece))], axis=ax, dim=0)
        (ss,) = emit("as_shard", (s,), [(f"{gname}.qg.mean.scales.piece",
                                         TensorType((n * kq // G,), dt)
                                         .with_placement(ax, piece))], axis=ax, dim=0)
        (pg,) = emit("all_gather", (ps,), [(f"{gname}.qg.mean.full",
                                            TensorType((n * nb,), DType.u8))], axis=ax, dim=0)
        (sg,) = emit("all_gather", (ss,), [(f"{gname}.qg.mean.scales.full",
                                            TensorType((n * kq // G,), dt))], axis=ax, dim=0)
        (qg,) = emit("unpack", (pg,), [(f"{gname}.qg.mean.q.full",
                                        TensorType((n * kq,), DType.i8))],
                     bits=self.bits, dtype="i8")
        ops.append(Op("dequantize", (qg, sg), (res,),
                      Attrs({"bits": self.bits, "group_size": G, "pieces": n,
                             "dtype": dt.value}), **common))
        return pg, sg

    @staticmethod
    def reorder(emit: Any, var: Any, v: str, shape: tuple[int, int, int], dtype: DType,
                hint: str) -> str:
        """Flat v of (nodes, local, m) rows as (local, nodes, m), flattened again."""
        k, ll, m = shape
        (r,) = emit("reshape", (v,), [(f"{hint}.rows", var(shape, dtype))])
        (t,) = emit("transpose", (r,), [(f"{hint}.by_local", var((ll, k, m), dtype))],
                    perm=(1, 0, 2))
        (f,) = emit("reshape", (t,), [(f"{hint}.sorted", var((k * ll * m,), dtype))])
        return f

    def rewrite(self, g: Graph, n: int, sites: list[Op], ctx: PassContext,
                hops: int = 1) -> Graph:
        ax, G = self.axis, self.group
        names = g.fresh_names()
        types = g.value_types()
        key = names("qg.key")
        key_t = TensorType((), DType.key)
        key_now = key
        replace: dict[int, list[Op]] = {}
        quantized, kept, before, after = [], [], {}, {}
        params: dict[str, str] = {}
        payloads: dict[str, tuple[str, str]] = {}
        h = self.hadamard
        for site in sites:
            gname, res = site.inputs[0], site.result
            gt = types[gname]
            before[res.name] = op_def(site.name).comm_bytes(site, [gt], [res.type], n)
            after[res.name] = before[res.name]
            k, kq = piece_layout(gt.numel, n, G)
            param = param_of(g, res.name)
            if param is not None:
                params[res.name] = param
            if site.attrs.get("op") not in ("avg", "sum"):
                kept.append((res.name, f"op={site.attrs.get('op')} is not a sum"))
                continue
            if k < G:
                kept.append((res.name, f"its piece ({k} values) is smaller than a group "
                                       f"({G})"))
                continue
            common = {"phase": site.phase, "loc": site.loc}
            ops: list[Op] = []

            def emit(name: str, ins: tuple[str, ...], results: list[tuple[str, TensorType]],
                     ops: list[Op] = ops, common: dict = common, **attrs: Any) -> list[str]:
                vals = tuple(Value(names(hint), t) for hint, t in results)
                ops.append(Op(name, ins, vals, Attrs(attrs), **common))
                return [v.name for v in vals]

            def var(shape: tuple[int, ...], dtype: DType) -> TensorType:
                return TensorType(shape, dtype).with_placement(ax, VARYING)

            red = "reduce_mean" if site.attrs["op"] == "avg" else "reduce_sum"
            first_bits = self.intra_bits if hops == 2 else self.bits
            nq, ng = n * kq, n * kq // G
            qattrs = {"bits": first_bits, "group_size": G, "pieces": n,
                      "rounding": "stochastic"}
            if self.hadamard:
                qattrs["hadamard"] = self.hadamard
            dim = site.attrs.get("dim", "flat")
            moved = not self.all_reduce and dim not in ("flat", 0)
            src = gname
            if moved:       # a shard along dim d: its pieces are chunks once d is first
                perm, inv, mshape = moved_to_front(gt.shape, int(dim))
                (src,) = emit("transpose", (gname,), [(f"{gname}.qg.moved",
                                                       var(mshape, gt.dtype))], perm=perm)
            q, s = emit("quantize", (src, key_now),
                        [(f"{gname}.qg.q", var((nq,), DType.i8)),
                         (f"{gname}.qg.scales", var((ng,), gt.dtype))], **qattrs)
            if hops == 1:
                pr, sr = self.exchange(emit, var, gname, q, s, nq, self.bits, {}, gt.dtype)
                (tot,) = self.receive(emit, var, gname, pr, sr, nq, n, kq, gt.dtype, red,
                                      self.bits)
            else:
                L = self.local
                K = n // L
                # hop 1, inside a node: the rows (pieces) sent to local device b are those
                # of the devices b of every node; reordered (node, local) -> (local, node)
                q, s = (self.reorder(emit, var, v, (K, L, m), dt, f"{gname}.qg.{what}")
                        for v, m, dt, what in ((q, kq, DType.i8, "q"),
                                               (s, kq // G, gt.dtype, "scales")))
                lv = {"local": L, "level": "local"}
                pr, sr = self.exchange(emit, var, gname, q, s, nq, first_bits, lv, gt.dtype)
                (part,) = self.receive(emit, var, gname, pr, sr, nq, L, K * kq, gt.dtype,
                                       red, first_bits)
                # hop 2, across nodes: the node's partial sum requantized in ``bits``
                (key_now,) = emit("rng_next", (key_now,), [("qg.key.next", key_t)])
                q2, s2 = emit("quantize", (part, key_now),
                              [(f"{gname}.qg.q2", var((K * kq,), DType.i8)),
                               (f"{gname}.qg.scales2", var((K * kq // G,), gt.dtype))],
                              bits=self.bits, group_size=G, rounding="stochastic")
                nv = {"local": L, "level": "node"}
                pr2, sr2 = self.exchange(emit, var, f"{gname}.2", q2, s2, K * kq, self.bits,
                                         nv, gt.dtype)
                (tot,) = self.receive(emit, var, f"{gname}.2", pr2, sr2, K * kq, K, kq,
                                      gt.dtype, red, self.bits)
                payloads.update({pr: (param or res.name, f"gradient of {param or res.name} "
                                      f"({first_bits}-bit inside a node, Hadamard {h})"),
                                 sr: (param or res.name, f"scales of the gradient of "
                                      f"{param or res.name} inside a node")})
                pr, sr = pr2, sr2
            if self.hadamard:
                (tot,) = emit("hadamard", (tot,), [(f"{gname}.qg.back",
                                                    var((kq,), gt.dtype))],
                              block=self.hadamard)
            if self.all_reduce:
                (key_now,) = emit("rng_next", (key_now,), [("qg.key.next", key_t)])
                gathered = self.gather(emit, var, ops, common, gname, tot, key_now, res, n,
                                       kq)
            elif moved:
                (piece,) = emit("as_shard", (tot,),
                                [(f"{gname}.qg.piece",
                                  TensorType(mshape, gt.dtype).with_placement(ax, Shard(0)))],
                                axis=ax, dim=0)
                ops.append(Op("transpose", (piece,), (res,), Attrs({"perm": inv}), **common))
            else:
                ops.append(Op("as_shard", (tot,), (res,), Attrs({"axis": ax, "dim": dim}),
                              **common))
            (key_now,) = emit("rng_next", (key_now,), [("qg.key.next", key_t)])
            sent = {v.name: v.type for o in ops for v in o.results}
            after[res.name] = sum(op_def(o.name).comm_bytes(o, [sent[o.inputs[0]]],
                                                            [o.result.type], n)
                                  for o in ops if o.name in ("all_to_all", "all_gather"))
            replace[id(site)] = ops
            quantized.append(res.name)
            across = " across nodes" if hops == 2 else ""
            what = f"gradient of {param or res.name} ({self.bits}-bit{across}, Hadamard {h})"
            owner = param or res.name
            payloads.update({pr: (owner, what), sr: (owner, f"scales of the {what}")})
            if self.all_reduce:
                mean = f"averaged gradient of {owner} ({self.bits}-bit)"
                payloads.update({gathered[0]: (owner, mean),
                                 gathered[1]: (owner, f"scales of the {mean}")})
        record = QuantizeGradsRecord(ax, self.bits, G, self.hadamard, hops, tuple(quantized),
                                     tuple(kept), before, after, params, payloads,
                                     self.local if hops == 2 else 0, self.intra_bits,
                                     self.all_reduce)
        ctx.decisions[self.name] = record
        if not quantized:      # every gradient too small: the plan says why, nothing changes
            return g
        body: list[Op] = []
        for op in g.ops:
            body.extend(replace.get(id(op), [op]))
        inputs = g.inputs + (Input(Value(key, key_t), InputRole(InputKind.comm_state,
                                                                slot=KEY_SLOT)),)
        outputs = g.outputs + (Output(key_now, OutputRole(OutputKind.replaces, key)),)
        return g.replace(inputs=inputs, ops=tuple(body), outputs=outputs)
