"""Turn a captured functional aten graph into an IR Graph (names, roles, phases, locations)."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from ..errors import FrontendError, UnsupportedOpError
from ..ir.core import (Attrs, Graph, Input, InputKind, InputRole, NameSupply, Op, Output,
                       OutputKind, OutputRole, Value)
from ..ir.types import TensorType
from .state import Captured, Slot
from .ops import (BY_ATEN, COMPARISONS, DROPPED_TARGETS, IDENTITY, SCALAR_DTYPE, SCALAR_MATH,
                  Neutral, changes_layout, draws_random, encode_arg, ir_dtype, is_view_target,
                  target_name)

aten = torch.ops.aten

# foreach overloads -> the per-tensor overload CPU runs for each list element
_FOREACH_BASE = {
    "add": aten.add.Tensor, "sub": aten.sub.Tensor, "mul": aten.mul.Tensor,
    "div": aten.div.Tensor, "maximum": aten.maximum.default, "minimum": aten.minimum.default,
    "addcmul": aten.addcmul.default, "addcdiv": aten.addcdiv.default,
    "sqrt": aten.sqrt.default, "neg": aten.neg.default, "reciprocal": aten.reciprocal.default,
    "exp": aten.exp.default, "abs": aten.abs.default, "sign": aten.sign.default,
    "lerp": aten.lerp.Scalar,
}


def _ttype(val: Any) -> TensorType:
    if type(val) in SCALAR_DTYPE:
        return TensorType((), SCALAR_DTYPE[type(val)])
    if isinstance(val, torch.Generator):
        raise UnsupportedOpError(
            "the step draws random numbers from a torch.Generator of its own (torch.rand(..., "
            "generator=g)), which the trace cannot carry from call to call",
            hint="draw from the default generator (seeded with torch.manual_seed), or draw "
                 "the numbers outside the step and pass them in as a tensor argument")
    if not isinstance(val, torch.Tensor):
        raise UnsupportedOpError(f"a value of type {type(val).__name__} where a tensor was "
                                 "expected")
    return TensorType(tuple(int(d) for d in val.shape), ir_dtype(val.dtype))


_ROLE = {"param": InputKind.param, "buffer": InputKind.buffer, "hyper": InputKind.hyper,
         "arg": InputKind.batch}


class _Importer:
    def __init__(self, cap: Captured) -> None:
        self.cap = cap
        self.names = NameSupply(set())
        self.env: dict[fx.Node, Any] = {}      # fx node -> IR name (or list of names)
        self.types: dict[str, TensorType] = {}
        self.ops: list[Op] = []
        self.node: fx.Node | None = None

    # ------------------------------------------------------------------ helpers
    def emit(self, name: str, inputs: list[str], types: list[TensorType], attrs: dict,
             hint: str | None = None) -> list[str]:
        n = self.node
        outs = [self.names(hint if i == 0 else f"{hint}.{i}") if hint else self.names()
                for i in range(len(types))]
        for o, t in zip(outs, types):
            self.types[o] = t
        self.ops.append(Op(name, tuple(inputs), tuple(Value(o, t) for o, t in zip(outs, types)),
                           Attrs(attrs), phase=self.cap.phase.get(n.name) if n else None,
                           loc=self.cap.loc.get(n.name) if n else None))
        return outs

    def scalar(self, value: Any, dtype) -> str:
        return self.emit("full", [], [TensorType((), dtype)], {"value": _number(value)})[0]

    def convert(self, name: str, dtype) -> str:
        t = self.types[name]
        if t.dtype is dtype:
            return name
        return self.emit("convert", [name], [TensorType(t.shape, dtype)],
                         {"dtype": dtype.value})[0]

    # ------------------------------------------------------------------ nodes
    def run(self) -> Graph:
        cap = self.cap
        placeholders = [n for n in cap.gm.graph.nodes if n.op == "placeholder"]
        inputs = []
        for node, slot in zip(placeholders, cap.inputs):
            name = self.names(slot.name)
            t = _ttype(node.meta["val"])
            self.env[node] = name
            self.types[name] = t
            inputs.append(Input(Value(name, t), self._role(slot)))
        for node in cap.gm.graph.nodes:
            if node.op == "call_function":
                self.node = node
                self.call(node)
            elif node.op == "get_attr":
                self.node = node
                self.constant(node)
            elif node.op == "output":
                outputs = self.outputs(node)
        return Graph(cap.name, tuple(inputs), tuple(self.ops), tuple(outputs))

    def _role(self, slot: Slot) -> InputRole:
        if slot.kind == "opt_state":
            pi, key = slot.key   # parameter slots come first: input pi is parameter pi
            return InputRole(InputKind.opt_state, of=self.cap.inputs[pi].name, slot=key)
        return InputRole(_ROLE[slot.kind])

    def outputs(self, node: fx.Node) -> list[Output]:
        flat = node.args[0]
        outs = []
        loss_given = False
        for val, slot in zip(flat, self.cap.outputs):
            name = self.env[val]
            if slot is not None and slot.kind == "grad":
                outs.append(Output(name, OutputRole(OutputKind.other)))
            elif slot is None:
                t = self.types[name]
                is_loss = not loss_given and t.numel == 1 and t.dtype.is_float
                loss_given |= is_loss
                outs.append(Output(name, OutputRole(OutputKind.loss if is_loss
                                                    else OutputKind.metric)))
            else:
                outs.append(Output(name, OutputRole(OutputKind.replaces, slot.name)))
        return outs

    def constant(self, node: fx.Node) -> None:
        """A tensor constant the trace captured (``torch.tensor(1.0)`` in an optimizer)."""
        value = getattr(self.cap.gm, node.target)
        t = _ttype(value)
        flat = value.detach().reshape(-1).tolist()
        if len(set(flat)) == 1:
            self.env[node] = self.emit("full", [], [t], {"value": _number(flat[0])})[0]
        else:
            self.env[node] = self.emit("literal", [], [t], {"data": tuple(flat)})[0]

    def scalar_math(self, node: fx.Node) -> str:
        """Python arithmetic on symbolic scalars, as 0-d ops in double precision."""
        out_t = _ttype(node.meta["val"])
        ins = [self.operand(a, out_t.dtype) for a in node.args]
        return self.emit(SCALAR_MATH[node.target], ins, [out_t], {})[0]

    def call(self, node: fx.Node) -> None:
        target = node.target
        if target in SCALAR_MATH:
            self.env[node] = self.scalar_math(node)
            return
        if target is aten._local_scalar_dense.default or target is torch.sym_float:
            src = self.env[node.args[0]]
            self.env[node] = self.convert(src, _ttype(node.meta["val"]).dtype)
            return
        if target is operator.getitem:
            self.env[node] = self.env[node.args[0]][node.args[1]]
            return
        tname = target_name(target)
        if tname in DROPPED_TARGETS:
            return
        if target in IDENTITY and not changes_layout(node):
            self.env[node] = self.env[node.args[0]]
            return
        if target is aten.copy_.default:
            # functionalization writes the new value of a mutated input back into it; the
            # graph's outputs already carry that value
            if node.args[0].op != "placeholder":
                raise UnsupportedOpError("an in-place copy survived functionalization",
                                         hint="this is a bug in the torch frontend")
            return
        name = getattr(target, "_opname", "")
        if name.startswith("_foreach_") and self.foreach(node, name[len("_foreach_"):]):
            return
        row = BY_ATEN.get(target)
        if row is not None and (row.accepts is None or row.accepts(node.args, node.kwargs)):
            self.env[node] = self.neutral(row, node.args, node.kwargs, node.meta["val"])
        else:
            self.env[node] = self.opaque(node, tname)

    def foreach(self, node: fx.Node, base: str) -> bool:
        per = _FOREACH_BASE.get(base)
        if per is None:
            return False
        lists = [a for a in node.args if isinstance(a, (list, tuple))]
        n = len(lists[0])
        vals = node.meta["val"]
        outs = []
        for i in range(n):
            args = [a[i] if isinstance(a, (list, tuple)) else a for a in node.args]
            kwargs = dict(node.kwargs)
            if base in ("addcmul", "addcdiv") and len(args) > 3:
                kwargs["value"] = args.pop(3)   # positional in the foreach form
            outs.append(self.neutral(BY_ATEN[per], args, kwargs, vals[i]))
        self.env[node] = outs
        return True

    def operand(self, a: Any, dtype) -> str:
        if isinstance(a, fx.Node):
            return self.convert(self.env[a], dtype)
        if isinstance(a, (bool, int, float)):
            return self.scalar(a, dtype)
        raise UnsupportedOpError(f"operand {a!r} of type {type(a).__name__}")

    def neutral(self, row: Neutral, args, kwargs, val) -> str:
        out_t = _ttype(val)
        vals = [_concrete(a.meta["val"]) if isinstance(a, fx.Node) else a for a in args]
        compute = (ir_dtype(torch.result_type(vals[0], vals[1])) if row.ir in COMPARISONS
                   else out_t.dtype)
        ins = []
        for k, pos in enumerate(row.tensors):
            a = args[pos] if pos < len(args) else kwargs.get(("self", "other")[k])
            if row.ir == "select" and k == 0:
                ins.append(self.env[a])
            else:
                ins.append(self.operand(a, compute))
        attrs = dict(row.make_attrs(args, kwargs)) if row.make_attrs else {}
        for key, (src, default) in row.attrs.items():
            v = kwargs.get(src, default)
            if isinstance(v, fx.Node):
                # a scale computed at run time (the learning rate): an extra 0-d operand
                ins.append(self.env[v])
            elif v != default:
                attrs[key] = v
        return self.emit(row.ir, ins, [out_t], attrs)[0]

    def opaque(self, node: fx.Node, tname: str) -> Any:
        tensors: list[fx.Node] = []

        def index(n: fx.Node) -> int:
            if n not in tensors:
                tensors.append(n)
            return tensors.index(n)
        attrs = {"target": tname, "args": encode_arg(tuple(node.args), index)}
        if draws_random(node.target):
            attrs.update(rng="global", effectful=True)
        if is_view_target(tname):
            attrs["view"] = True
        for k, v in node.kwargs.items():
            attrs[f"kw_{k}"] = encode_arg(v, index)
        for t in tensors:
            if not isinstance(self.env.get(t), str):
                raise UnsupportedOpError(f"{tname} takes a list of tensors made by another "
                                         "list op", hint="this is a bug in the torch frontend")
        ins = [self.env[t] for t in tensors]
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return self.emit("opaque", ins, [_ttype(val)], attrs)[0]
        if isinstance(val, (list, tuple)) and all(isinstance(v, torch.Tensor) or v is None
                                                  for v in val):
            idx = [i for i, v in enumerate(val) if v is not None]
            attrs["outs"] = tuple(idx)
            names = self.emit("opaque", ins, [_ttype(val[i]) for i in idx], attrs)
            by_pos = dict(zip(idx, names))
            return [by_pos.get(i) for i in range(len(val))]
        raise UnsupportedOpError(
            f"{tname} returns {type(val).__name__}, not tensors"
            + (f" (at {self.cap.loc[node.name]})" if node.name in self.cap.loc else ""),
            hint="values read back to Python (.item(), .tolist(), sizes that depend on data) "
                 "cannot be part of a traced step")


def _concrete(v: Any) -> Any:
    """A stand-in Python number for a symbolic scalar (for type promotion only)."""
    if isinstance(v, torch.SymFloat):
        return 1.0
    if isinstance(v, torch.SymInt):
        return 1
    if isinstance(v, torch.SymBool):
        return True
    return v


def import_captured(cap: Captured) -> Graph:
    """The IR graph of a captured step."""
    _check_static_shapes(cap)
    return _Importer(cap).run()


def _check_static_shapes(cap: Captured) -> None:
    """FrontendError naming the first op whose result's size depends on tensor data (a
    boolean mask index ``x[mask]``, ``nonzero``, ``unique``, ``masked_select``): make_fx
    traces it with a size it cannot know (an unbacked symbol), and the IR, whose shapes
    are static, could not hold it."""
    for node in cap.gm.graph.nodes:
        val = node.meta.get("val")
        vals = val if isinstance(val, (list, tuple)) else [val]
        if node.op != "call_function" or not any(
                isinstance(v, torch.Tensor) and not all(isinstance(d, int) for d in v.shape)
                for v in vals):
            continue
        at = f" at {cap.loc[node.name]}" if node.name in cap.loc else ""
        raise FrontendError(
            f"the size of {target_name(node.target)}'s result depends on tensor data{at}: "
            "a boolean mask index (x[mask]), nonzero, unique or masked_select keeps as many "
            "elements as the data says, and a traced step has static shapes",
            hint="keep every element and weight by the mask instead, e.g. "
                 "(F.cross_entropy(out, y.clamp(min=0), reduction='none') * keep).sum() / "
                 "keep.sum(), or cross_entropy's ignore_index for labels to skip; "
                 "torch.where(mask, x, 0) for a selection. Under data parallelism such a "
                 "mean is each device's over its own kept rows, averaged (as under DDP; the "
                 "plan lists it): divide by the rows (keep.numel()) instead for the batch's "
                 "exact value")


def _number(value: Any) -> Any:
    """A fill value as the IR's ``full`` takes it: a number (True is 1; the result's
    dtype, bool, makes it True again)."""
    return int(value) if isinstance(value, bool) else value
