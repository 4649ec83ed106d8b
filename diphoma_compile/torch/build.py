"""IR -> a runnable torch.fx GraphModule calling aten ops (its ``.code`` reads as Python).

Neutral ops go back to the aten overload the table of ``ops.py`` maps them from. 0-d values
made only from constants, hyperparameter inputs and ``.item()`` reads are *host scalars*:
computed with Python floats and passed to aten calls as Python numbers, as the eager
optimizer does with its learning rate and step count. Layout ops become views (permute,
expand, reshape), as eager code makes them. So the program makes the eager step's calls.

Each IR op is emitted by a small function of ``_EMIT``, found by the op's name: ops with a
form of their own (scales, flat shards, collectives) have their own emitter, and every
other op the aten table maps is emitted by the generic emitter of its IR category.

A graph placed over a mesh becomes one rank's program: every shape it builds (reshape
targets, constants, broadcasts) is the value's *local* shape (``TensorType.local_shape``; a
flat shard is a 1-D chunk), and collectives call the helpers of ``collectives.py`` on the
``Comm`` of their axis, which the program reads as an attribute (``self.comm_dp``)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch._ops import OpOverload

from ..errors import BackendError, UnsupportedOpError
from ..ir.analysis import free_inputs
from ..ir.core import Graph, InputKind, Op, OutputKind
from ..ir.ops import Category, op_def
from ..ir.types import DType, FlatShard, Shard, TensorType, Varying
from . import collectives, quant
from .op_rules import with_local_arguments
from .ops import (DTYPE_TO_TORCH, NEUTRAL, SCALAR_DTYPE, SCALAR_MATH, decode_arg, emit_target,
                  emit_target_for, resolve_target, takes_number)

aten = torch.ops.aten

_HOST_MATH = {ir: fn for fn, ir in SCALAR_MATH.items()}   # 0-d IR op -> Python operator
_HOST_DTYPES = frozenset(SCALAR_DTYPE.values())           # the dtypes of Python numbers
_DONE = object()   # an emitter's answer when it has bound the op's results itself


def _py_name(name: str) -> str:
    s = re.sub(r"\W", "_", name)
    return s if s and not s[0].isdigit() else f"v_{s}"


class _Builder:
    def __init__(self, graph: Graph, comms: dict[str, collectives.Comm] | None = None,
                 in_place: bool = True, device: torch.device | None = None,
                 host_reads: bool = True, out_variants: bool = False,
                 dry: bool = False) -> None:
        self.g = graph
        # dry: emit the program only to learn what it writes where (no module, no comms)
        self.dry = dry
        self.kernel_written: set[str] = set()   # new values a kernel wrote into place
        # whether 0-d tensors may be read into Python numbers (.item()); a code generator
        # wants none: a host read cuts its graph and bakes the value in
        self.host_reads = host_reads
        # where tensors the program makes go: the parameters' device (a CPU program names
        # none, as eager code does not)
        self.device = {} if device is None or torch.device(device).type == "cpu" \
            else {"device": torch.device(device)}
        self.fx = fx.Graph()
        self.env: dict[str, Any] = {}       # IR name -> fx node or Python scalar
        self.scalars: dict[str, Any] = {}   # IR name of a 0-d full -> its value
        self.dtype_of: dict[str, torch.dtype] = {}
        self.g_types = graph.value_types()
        self.sizes = dict(graph.mesh.axes)
        self.comms = dict(comms or {})
        self.comm_nodes: dict[str, fx.Node] = {}
        self.pending: dict[str, tuple[fx.Node, int, int]] = {}   # in-flight results
        self.uses: dict[str, int] = {}      # how often each value is read (outputs count)
        self.fresh: set[str] = set()        # values in storage of their own (not views)
        for op in graph.ops:
            for name in op.inputs:
                self.uses[name] = self.uses.get(name, 0) + 1
        for o in graph.outputs:
            self.uses[o.name] = self.uses.get(o.name, 0) + 1
        self.out_variants = out_variants
        self.aliases = input_aliases(graph) if in_place or out_variants else {}
        self.in_place = updates_in_place(graph, self.aliases) if in_place else {}
        # for write_into: the last op reading each input (or a view of it), where each
        # value is made, how often each value is read (regions and outputs included), and
        # the inputs a collective reads (its transfer may still read them after the op)
        self.last_read, self.made_at = _reads_and_makers(graph, self.aliases) \
            if out_variants else ({}, {})
        self.reads: dict[str, int] = {}
        self.collective_read: set[str] = set()
        if out_variants:
            for op in graph.ops:
                for n in free_inputs(op):
                    self.reads[n] = self.reads.get(n, 0) + 1
                    if op_def(op.name).category is Category.collective:
                        self.collective_read.update(self.aliases.get(n, ()))
            for o in graph.outputs:
                self.reads[o.name] = self.reads.get(o.name, 0) + 1
        # a collective's result -> the value its wait hands on (the name the step returns)
        self.handed_on: dict[str, str] = {}
        for op in graph.ops:
            if op.name == "wait":
                self.handed_on.update(zip(op.inputs, (v.name for v in op.results)))
        self.direct: set[str] = set()       # new values the collective wrote into place

    def build(self) -> fx.GraphModule:
        written = self.emit()
        # (a returned scalar constant, torch.tensor(n), is a host number until read)
        self.fx.output(tuple(self.node(written.get(o.name, o.name)) for o in self.g.outputs))
        self.fx.lint()
        root = torch.nn.Module()
        for axis, comm in self.comms.items():
            setattr(root, f"comm_{axis}", comm)
        return fx.GraphModule(root, self.fx, class_name=_py_name(self.g.name))

    def emit(self) -> dict[str, str]:
        """Every op into the fx graph; the new values written into an input's storage ->
        that input."""
        for i in self.g.inputs:
            self.env[i.name] = self.fx.placeholder(_py_name(i.name))
            self.env[i.name].meta["ir"] = [i.name]
            if i.role.kind is InputKind.hyper and i.value.type.shape == () and self.host_reads:
                self.set_host(i.name, self.call(aten._local_scalar_dense.default,
                                                [self.env[i.name]]), i.value.type.dtype)
        written: dict[str, str] = {}
        for op in self.g.ops:
            self.op(op)
            for v in op.results:
                target = self.in_place.get(v.name)
                node = self.env.get(v.name)
                if isinstance(node, fx.Node):       # which IR values a node holds
                    node.meta.setdefault("ir", []).append(v.name)
                if v.name in self.direct:
                    written[v.name] = target
                elif target is not None and isinstance(node, fx.Node) \
                        and v.name not in self.pending:
                    if self.out_variants and self.write_into(op, node, target):
                        # the op itself wrote the new value into the input's storage
                        written[v.name] = target
                        self.kernel_written.add(v.name)
                        continue
                    # the input is read no more: its storage takes the new value now, and
                    # the new tensor dies here instead of living to the end of the step
                    self.call(aten.copy_.default, [self.env[target], node])
                    written[v.name] = target
        return written

    def write_into(self, op: Op, node: fx.Node, target: str) -> bool:
        """Make the pointwise kernel that ``node`` calls write its result into the storage
        of input ``target`` (its ``out=`` overload), as eager's in-place optimizer math does,
        instead of a new tensor copied there: when nothing reads ``node`` yet and each of
        its tensor arguments is ``target`` itself or a value that cannot alias it (full
        overlap is what an in-place kernel does; a view of ``target`` would be partial).
        Then the chain of pointwise kernels feeding it through their first argument writes
        there too (AdamW's ``mul`` by 1 - lr wd before its ``addcdiv``, as eager's ``mul_``):
        each link of ``target``'s type, read once in the step (by the next), made where
        nothing reads ``target`` or a view of it any more and no collective reads it.
        False (nothing changed) otherwise."""
        dest = self.env[target]
        want = self.g_types[target]

        def aliasing(a: object) -> bool:     # a tensor argument that may share target's
            if not isinstance(a, fx.Node) or a is dest or a.meta.get("host"):
                return False
            names = a.meta.get("ir")
            return not names or any(target in self.aliases.get(k, ()) for k in names)

        def out_of(n: fx.Node) -> OpOverload | None:
            fn = n.target
            if n.op != "call_function" or not isinstance(fn, OpOverload) \
                    or torch.Tag.pointwise not in fn.tags \
                    or any(aliasing(a) for a in (*n.args, *n.kwargs.values())):
                return None
            return _out_overload(fn)

        out_fn = out_of(node) if not node.users else None
        if out_fn is None:
            return False
        node.target, node.kwargs = out_fn, {**node.kwargs, "out": dest}
        if target in self.collective_read:
            return True
        cur = node
        while cur.args and isinstance(cur.args[0], fx.Node):
            a = cur.args[0]
            names = a.meta.get("ir", [])
            rest = (*cur.args[1:], *(v for k, v in cur.kwargs.items() if k != "out"))
            if a is dest or len(a.users) != 1 or not names or dest in rest \
                    or sum(self.reads.get(k, 0) for k in names) != 1 \
                    or any(self.g_types.get(k) != want for k in names) \
                    or min(self.made_at.get(k, -1) for k in names) < \
                    self.last_read.get(target, -1):
                break
            out_fn = out_of(a)
            if out_fn is None:
                break
            a.target, a.kwargs = out_fn, {**a.kwargs, "out": dest}
            self.kernel_written.update(names)
            cur = a
        return True

    def destination(self, name: str) -> fx.Node | None:
        """The input whose storage a collective may write ``name`` into as it unpacks it
        (the parameter a gathered new value replaces), or None; the value is then marked as
        written in place."""
        final = self.handed_on.get(name, name)
        target = self.in_place.get(final)
        if target is None or not isinstance(self.env.get(target), fx.Node):
            return None
        self.direct.add(final)
        return self.env[target]

    def local(self, t: TensorType) -> list[int]:
        """The shape of the piece of a value this rank holds."""
        return list(t.local_shape(self.sizes)) if t.placements else list(t.shape)

    def call(self, target, args, kwargs=None):
        return self.fx.call_function(target, tuple(args), dict(kwargs or {}))

    def arg(self, name: str) -> Any:
        if name in self.scalars:
            return self.scalars[name]
        return self.node(name)

    def node(self, name: str) -> fx.Node:
        v = self.env.get(name)
        if v is None and name in self.scalars:
            v = self.env[name] = self.call(aten.scalar_tensor.default, [self.scalars[name]],
                                           {"dtype": self.dtype_of[name]})
        return v

    def operand(self, target: Any, name: str) -> Any:
        """``name`` as the last operand of ``target``: a host scalar stays a Python number
        where the overload takes one, and is made a 0-d tensor where it does not."""
        return self.arg(name) if takes_number(target) else self.node(name)

    def set_host(self, name: str, value: Any, dtype: DType) -> None:
        """Record ``name`` as a host scalar: a Python number or a node producing one."""
        self.scalars[name] = value
        if isinstance(value, fx.Node):
            value.meta["host"] = True
        self.dtype_of[name] = DTYPE_TO_TORCH[dtype]

    def host(self, op: Op) -> bool:
        """Compute a 0-d op with Python numbers when it makes, reads or combines host
        scalars (a constant, an ``.item()`` read, the optimizer's scalar math)."""
        if len(op.results) != 1 or op.result.type.shape != () or op.regions:
            return False
        t = op.result.type
        if op.name == "full":
            value = op.attrs["value"]   # folded into the ops that use it; made on demand
        elif not op.inputs:
            return False
        elif op.name == "convert" and op.inputs[0] not in self.scalars:
            if t.dtype not in _HOST_DTYPES or not self.host_reads:
                return False
            # .item(): read a 0-d tensor into a Python number
            value = self.call(aten._local_scalar_dense.default, [self.node(op.inputs[0])])
        elif all(i in self.scalars for i in op.inputs):
            value = self.host_math(op)
            if value is None:
                return False
        else:
            return False
        self.set_host(op.result.name, value, t.dtype)
        return True

    def host_math(self, op: Op) -> Any:
        """The Python value of a 0-d op on host scalars; None when it has no Python form."""
        vals = [self.scalars[i] for i in op.inputs]
        if op.name == "convert":
            # an .item() read, or a scalar handed to a tensor op (which rounds it itself)
            return vals[0]
        fn = _HOST_MATH.get(op.name)
        if fn is None or op.result.type.dtype not in _HOST_DTYPES:
            return None
        if op.name != "neg" and (op.attrs or len(vals) != 2):
            return None    # a scale (add's alpha) has no Python operator
        return self.call(fn, vals)

    def op(self, op: Op) -> None:
        if self.host(op):
            return
        op = self.one_element_beside_flat(op)
        emit = _EMIT.get(op.name)
        if emit is None:
            raise UnsupportedOpError(f"the torch backend cannot run IR op {op.name!r}",
                                     hint="this op has no torch lowering yet")
        out = emit(self, op)
        if out is not _DONE:
            self.bind(op, out)

    def one_element_beside_flat(self, op: Op) -> Op:
        """``op`` reading, in place of a whole value of one element and rank >= 2 beside a
        flat piece (``g.pow(2).sum(dims, keepdim=True)``, a [1, 1] a custom update divides
        the gradient by), that value as a 0-d tensor: torch broadcasting would make the
        piece's [k] a [1, k] and the in-place update refuse it."""
        if not op.results or not any(isinstance(p, FlatShard)
                                     for _, p in op.results[0].type.placements) or \
                (op_def(op.name).category not in _ELEMENTWISE and op.name not in _OWN_MATH):
            return op
        inputs = list(op.inputs)
        for k, name in enumerate(inputs):
            t = self.g_types.get(name)
            if t is None or t.numel != 1 or t.rank < 2 or name in self.scalars or \
                    t.placements:
                continue
            alias = f"{name}.as_0d"
            if alias not in self.env:
                self.env[alias] = self.call(aten.reshape.default, [self.node(name), []])
                self.g_types[alias] = TensorType((), t.dtype)
            inputs[k] = alias
        return op.replace(inputs=tuple(inputs)) if inputs != list(op.inputs) else op

    def bind(self, op: Op, out: Any) -> None:
        if _makes_storage(op):
            self.fresh.update(v.name for v in op.results)
        positions = _result_positions(op)
        if positions is None:
            self.env[op.result.name] = out
            return
        for v, i in zip(op.results, positions):
            self.env[v.name] = self.call(_getitem, [out, i])

    def comm(self, op: Op) -> fx.Node:
        """The program's node reading the Comm of the collective's axis."""
        axis = comm_key(op)
        if axis not in self.comms and not self.dry:
            raise BackendError(f"the program has a {op.name} over mesh axis {axis!r} but no "
                               "process group was given for that axis",
                               hint="run a distributed graph through "
                                    "diphoma_compile.torch.dist.TorchDistStep")
        if axis not in self.comm_nodes:
            self.comm_nodes[axis] = self.fx.get_attr(f"comm_{axis}")
        return self.comm_nodes[axis]


def comm_key(op: Op) -> str:
    """The Comm a collective runs on: its axis's, or with ``local=L, level=...`` the
    axis's level (``dp__local2`` among one node's L devices, ``dp__node2`` across nodes)."""
    axis = str(op.attrs["axis"])
    if op.attrs.get("local"):
        return f"{axis}__{op.attrs.get('level', 'local')}{int(op.attrs['local'])}"
    return axis


# ------------------------------------------------------------------ elementwise

def _emit_unary(b: _Builder, op: Op) -> fx.Node:
    """f(x) by the op's aten form."""
    return b.call(emit_target(op.name), [b.node(op.inputs[0])])


def _emit_binary(b: _Builder, op: Op) -> fx.Node:
    """x op y; a host-scalar y stays a number where the form takes one (mul, eq.Scalar)."""
    x, y = op.inputs
    target = emit_target_for(op.name, y in b.scalars)
    rhs = b.operand(target, y)    # before x: the order names the scalar tensors made
    return b.call(target, [b.node(x), rhs])


def _emit_ternary(b: _Builder, op: Op) -> fx.Node:
    """f(x, y, z); a host-scalar z stays a number where the form takes one (lerp.Scalar)."""
    x, y, z = op.inputs
    target = emit_target_for(op.name, z in b.scalars)
    return b.call(target, [b.node(x), b.node(y), b.operand(target, z)])


def _scale(b: _Builder, op: Op, key: str, position: int) -> dict[str, Any]:
    """The scale keyword of add/sub (alpha) or addcmul/addcdiv (value): the attribute, or
    the 0-d operand at ``position`` when it is computed at run time."""
    if len(op.inputs) == position + 1:
        return {key: b.arg(op.inputs[position])}
    return {key: op.attrs[key]} if key in op.attrs else {}


def _tensor_scale(b: _Builder, op: Op, position: int) -> fx.Node | None:
    """The 0-d operand at ``position`` when it scales as a tensor (a learning rate the
    program does not read on the host, as for Inductor): aten takes alpha and value only
    as numbers, so the product is then spelled out. None for a number or an attribute."""
    if len(op.inputs) == position + 1 and op.inputs[position] not in b.scalars:
        scale = b.node(op.inputs[position])
        return scale if isinstance(scale, fx.Node) else None
    return None


def _emit_scaled_binary(b: _Builder, op: Op) -> fx.Node:
    """x + alpha*y or x - alpha*y in one aten call (two with a tensor alpha)."""
    target = emit_target(op.name)
    scale = _tensor_scale(b, op, 2)
    if scale is not None:
        y = b.call(aten.mul.Tensor, [b.node(op.inputs[1]), scale])
        return b.call(target, [b.node(op.inputs[0]), y])
    kw = _scale(b, op, "alpha", 2)
    return b.call(target, [b.node(op.inputs[0]), b.operand(target, op.inputs[1])], kw)


def _emit_scaled_ternary(b: _Builder, op: Op) -> fx.Node:
    """addcmul / addcdiv: s + value*(t1 op t2) in one aten call (three with a tensor
    value)."""
    scale = _tensor_scale(b, op, 3)
    if scale is not None:
        s, t1, t2 = (b.node(i) for i in op.inputs[:3])
        inner = aten.mul.Tensor if op.name == "addcmul" else aten.div.Tensor
        term = b.call(aten.mul.Tensor, [b.call(inner, [t1, t2]), scale])
        return b.call(aten.add.Tensor, [s, term])
    kw = _scale(b, op, "value", 3)
    return b.call(emit_target(op.name), [b.node(i) for i in op.inputs[:3]], kw)


def _emit_square(b: _Builder, op: Op) -> fx.Node:
    """x * x (from an expanded norm): one rounding, as pow(x, 2)."""
    return b.call(aten.mul.Tensor, [b.node(op.inputs[0]), b.node(op.inputs[0])])


def _emit_pow(b: _Builder, op: Op) -> fx.Node:
    """x ** y by the overload for a number base, a number exponent, or two tensors."""
    x, y = op.inputs
    if x in b.scalars:
        return b.call(aten.pow.Scalar, [b.arg(x), b.node(y)])
    if y in b.scalars:
        return b.call(aten.pow.Tensor_Scalar, [b.node(x), b.arg(y)])
    return b.call(aten.pow.Tensor_Tensor, [b.node(x), b.node(y)])


def _emit_convert(b: _Builder, op: Op) -> fx.Node:
    """A tensor cast to another dtype."""
    return b.call(aten._to_copy.default, [b.node(op.inputs[0])],
                  {"dtype": DTYPE_TO_TORCH[DType(op.attrs["dtype"])]})


# ------------------------------------------------------------------ reductions and dot

def _emit_reduce(b: _Builder, op: Op) -> fx.Node:
    """A sum, mean, max or min over dims; over a flat shard, of its whole 1-D chunk."""
    a, x = op.attrs, b.g_types[op.inputs[0]]
    dims, keep = list(a["dims"]), bool(a.get("keepdim", False))
    if len(b.local(x)) == x.rank:
        return b.call(emit_target(op.name), [b.node(op.inputs[0]), dims, keep])
    # a flat shard (only a sum over every dimension is allowed): sum the 1-D chunk
    out = b.call(emit_target(op.name), [b.node(op.inputs[0]), [0], False])
    shape = b.local(op.result.type)
    return b.call(aten.reshape.default, [out, shape]) if shape else out


def _emit_norm(b: _Builder, op: Op) -> fx.Node:
    """The vector norm over dims (None for all of them, as eager's clip_grad_norm_ asks)."""
    a, x = op.attrs, b.g_types[op.inputs[0]]
    dims = list(a["dims"])
    full = dims == list(range(x.rank)) and not a.get("keepdim", False)
    if len(b.local(x)) != x.rank:
        raise BackendError(f"norm of a flat shard ({x}) has no lowering",
                           hint="expand norm (square, reduce_sum, sqrt) first")
    return b.call(aten.linalg_vector_norm.default,
                  [b.node(op.inputs[0]), a["ord"], None if full else dims,
                   bool(a.get("keepdim", False))])


def _emit_dot(b: _Builder, op: Op) -> fx.Node:
    """mm or bmm, the two contractions the aten table maps (matrices, batches of them)."""
    a = op.attrs
    lhs, rhs = (b.node(i) for i in op.inputs)
    ranks = tuple(b.g_types[i].rank for i in op.inputs)
    lb, rb = tuple(a.get("lhs_batch", ())), tuple(a.get("rhs_batch", ()))
    lc, rc = tuple(a["lhs_contract"]), tuple(a["rhs_contract"])
    if not lb and lc == (1,) and rc == (0,) and ranks == (2, 2):
        return b.call(emit_target("dot", "default"), [lhs, rhs])   # mm
    if lb == rb == (0,) and lc == (2,) and rc == (1,) and ranks == (3, 3):
        return b.call(aten.bmm.default, [lhs, rhs])
    raise UnsupportedOpError(f"the torch backend has no lowering for dot with attributes "
                             f"{dict(a)}")


# ------------------------------------------------------------------ layout and constants

def _emit_transpose(b: _Builder, op: Op) -> fx.Node:
    """A permuted view."""
    return b.call(emit_target(op.name), [b.node(op.inputs[0]), list(op.attrs["perm"])])


def _emit_reshape(b: _Builder, op: Op) -> Any:
    """A view of the local shape; a flat shard is the same 1-D chunk, whatever its shape."""
    src, dst = b.local(b.g_types[op.inputs[0]]), b.local(op.result.type)
    if src == dst and len(dst) < op.result.type.rank:
        return b.node(op.inputs[0])
    return b.call(emit_target(op.name), [b.node(op.inputs[0]), dst])


def _replicated(b: _Builder, op: Op) -> None:
    if any(b.g_types[n].placements for n in op.inputs) or op.result.type.placements:
        raise UnsupportedOpError(f"the torch backend runs {op.name} on whole values only, "
                                 "not on pieces of a sharded one",
                                 hint="this is a bug in the pass that made it")


def _emit_concat(b: _Builder, op: Op) -> fx.Node:
    """Values joined along ``dim`` (whole values: the pipeline packs scalars with it)."""
    _replicated(b, op)
    return b.call(aten.cat.default, [[b.node(n) for n in op.inputs], int(op.attrs["dim"])])


def _emit_slice(b: _Builder, op: Op) -> fx.Node:
    """A strided window of a whole value, one dimension at a time."""
    _replicated(b, op)
    x = b.node(op.inputs[0])
    strides = op.attrs.get("strides") or [1] * len(op.attrs["starts"])
    for d, (lo, hi, step) in enumerate(zip(op.attrs["starts"], op.attrs["limits"], strides)):
        x = b.call(aten.slice.Tensor, [x, d, int(lo), int(hi), int(step)])
    return x


def _emit_broadcast(b: _Builder, op: Op) -> fx.Node:
    """An expanded view, after a reshape that puts the kept dims where ``dims`` says."""
    src = b.g_types[op.inputs[0]]
    dst = op.result.type
    dims = tuple(op.attrs["dims"])
    x = b.node(op.inputs[0])
    src_shape, dst_shape = b.local(src), b.local(dst)
    if len(dst_shape) != dst.rank or len(src_shape) != src.rank:
        raise BackendError(f"broadcast_in_dim of a flat shard ({src} -> {dst}) has no "
                           "lowering")
    if dims != tuple(range(dst.rank - src.rank, dst.rank)):
        shape = [1] * dst.rank
        for i, d in enumerate(dims):
            shape[d] = src_shape[i]
        x = b.call(aten.reshape.default, [x, shape])
    return b.call(aten.expand.default, [x, dst_shape])


def _emit_literal(b: _Builder, op: Op) -> fx.Node:
    """A tensor of the listed values (replicated only)."""
    t = op.result.type
    if b.local(t) != list(t.shape):
        raise BackendError(f"a sharded literal ({t}) has no lowering",
                           hint="make the literal replicated and take_shard it")
    out = b.call(torch.tensor, [list(op.attrs["data"])],
                 {"dtype": DTYPE_TO_TORCH[t.dtype], **b.device})
    return b.call(aten.reshape.default, [out, list(t.shape)])


def _emit_full(b: _Builder, op: Op) -> fx.Node:
    """A filled tensor of the local shape (a 0-d one is a host scalar instead)."""
    t = op.result.type
    return b.call(aten.full.default, [b.local(t), op.attrs["value"]],
                  {"dtype": DTYPE_TO_TORCH[t.dtype], **b.device})


def _emit_opaque(b: _Builder, op: Op) -> fx.Node:
    """The aten call the op was imported from, with its arguments decoded."""
    target = resolve_target(str(op.attrs["target"]))
    ins = [b.node(i) for i in op.inputs]
    args = decode_arg(op.attrs.get("args", ()), ins)
    kwargs = {k[3:]: decode_arg(v, ins) for k, v in op.attrs.items() if k.startswith("kw_")}
    types = [b.g_types[i] for i in op.inputs] + [v.type for v in op.results]
    if any(t.placements for t in types):
        # a device runs the call on its pieces: arguments that name a whole shape (a
        # split's piece size, a slice's backward input_sizes) take the local one
        def local(t: TensorType) -> TensorType:
            return TensorType(tuple(b.local(t)), t.dtype)
        args, kwargs = with_local_arguments(
            op, args, kwargs, [local(b.g_types[i]) for i in op.inputs],
            [local(v.type) for v in op.results])
    if target is aten.bernoulli.p:
        # eager's dropout draws into empty_like(x) in place, x's strides kept; the
        # functional form draws into a contiguous tensor, so on a transposed activation
        # the same numbers would land on other elements
        like = b.call(aten.empty_like.default, [args[0]])
        return b.call(aten.bernoulli_.float, [like, *args[1:]], kwargs)
    return b.call(target, args, kwargs)


# ------------------------------------------------------------------ collectives

def _async(op: Op) -> dict[str, bool]:
    return {"async_op": True} if op.attrs.get("async", False) else {}


def _all_reduce(b: _Builder, op: Op, comm: fx.Node) -> fx.Node:
    """The reduction over the axis, in place when nothing else reads the value."""
    a, src = op.attrs, op.inputs[0]
    x = b.node(src)
    # a graph input is not owned: its storage is the caller's
    owned = b.uses.get(src, 0) == 1 and src in b.fresh
    return b.call(collectives.all_reduce, [comm, x, str(a["op"]), owned], _async(op))


def _reduce_scatter(b: _Builder, op: Op, comm: fx.Node) -> fx.Node:
    """This rank's piece of the reduction over the axis."""
    a, src = op.attrs, op.inputs[0]
    return b.call(collectives.reduce_scatter,
                  [comm, b.node(src), str(a["op"]), a["dim"], b.local(op.result.type)],
                  _async(op))


def _all_gather(b: _Builder, op: Op, comm: fx.Node) -> fx.Node:
    """The whole value from every rank's piece."""
    x = b.node(op.inputs[0])
    # the result's shape on this rank: still split over any other axis (a tensor-parallel
    # shard gathered over the data axis)
    return b.call(collectives.all_gather,
                  [comm, x, op.attrs["dim"], b.local(op.result.type)], _async(op))


def _take_shard(b: _Builder, op: Op, comm: fx.Node) -> fx.Node:
    """This rank's piece of a replicated value, without communication."""
    x = b.node(op.inputs[0])
    return b.call(collectives.take_shard, [comm, x, op.attrs["dim"], b.local(op.result.type)])


def _take_piece(b: _Builder, op: Op, comm: fx.Node) -> fx.Node:
    """This rank's piece along dim of a whole value, as its own value."""
    x = b.node(op.inputs[0])
    return b.call(collectives.take_shard, [comm, x, int(op.attrs["dim"]),
                                           list(op.result.type.shape)])


def _broadcast(b: _Builder, op: Op, comm: fx.Node) -> fx.Node:
    """The root rank's value on every rank."""
    x = b.node(op.inputs[0])
    return b.call(collectives.broadcast, [comm, x, int(op.attrs["root"])])


def _as_partial(b: _Builder, op: Op, comm: fx.Node) -> fx.Node:
    """A replicated value as a partial sum: kept on the axis's rank 0, zeros elsewhere."""
    return b.call(collectives.as_partial, [comm, b.node(op.inputs[0])])


def _as_varying(b: _Builder, op: Op, comm: fx.Node) -> fx.Node:
    """A replicated value as this rank's own: the same tensor, nothing sent."""
    return b.node(op.inputs[0])


# the collectives of one value; the helpers of collectives.py run them
_COLLECTIVES: dict[str, Callable[[_Builder, Op, fx.Node], fx.Node]] = {
    "all_reduce": _all_reduce, "reduce_scatter": _reduce_scatter, "all_gather": _all_gather,
    "take_shard": _take_shard, "broadcast": _broadcast, "as_partial": _as_partial,
    "as_varying": _as_varying, "take_piece": _take_piece,
}


def _bucket(b: _Builder, op: Op, comm: fx.Node) -> fx.Node:
    """k values moved as one packed buffer; the call returns a tuple (bound by getitem)."""
    a, xs = op.attrs, [b.node(i) for i in op.inputs]
    asy = _async(op)
    if op.name == "all_reduce":
        return b.call(collectives.all_reduce_bucket, [comm, xs, str(a["op"])], asy)
    if op.name == "reduce_scatter":
        return b.call(collectives.reduce_scatter_bucket,
                      [comm, xs, str(a["op"]), a["dim"],
                       [b.local(v.type) for v in op.results]], asy)
    if op.name == "all_gather":
        return b.call(collectives.all_gather_bucket,
                      [comm, xs, a["dim"], [b.local(v.type) for v in op.results]],
                      {**asy, "dests": [b.destination(v.name) for v in op.results]})
    if op.name == "all_to_all" and int(a["from_dim"]) == 0 == int(a["to_dim"]):
        return b.call(collectives.all_to_all_bucket, [comm, xs], asy)
    raise UnsupportedOpError(f"the torch backend has no bucketed {op.name}")


def _emit_collective(b: _Builder, op: Op) -> Any:
    """A collective on its axis's Comm; an async one's results exist only after its wait."""
    comm = b.comm(op)
    if len(op.inputs) > 1:
        out = _bucket(b, op, comm)
    else:
        out = _COLLECTIVES[op.name](b, op, comm)
    if not op.attrs.get("async", False):
        return out
    for k, v in enumerate(op.results):
        b.pending[v.name] = (out, k, len(op.results))
    return _DONE


def _emit_wait(b: _Builder, op: Op) -> Any:
    """Finish the in-flight collectives whose results this wait hands on."""
    done: dict[fx.Node, Any] = {}
    for v, i in zip(op.results, op.inputs):
        if i not in b.pending:      # already finished (a synchronous collective)
            b.env[v.name] = b.node(i)
            continue
        node, k, count = b.pending[i]
        if node not in done:
            done[node] = b.call(collectives.wait, [node])
        b.env[v.name] = done[node] if count == 1 else b.call(_getitem, [done[node], k])
    return _DONE


# ------------------------------------------------------------------ quantization

def _flat_offset(b: _Builder, t: TensorType) -> int:
    """Where this rank's piece of a flat- or dim-0-sharded value starts in the flattened
    whole (0 for a whole value): the index of its first element in a keyed random draw. A
    varying value (each device its own) draws as if the devices' values were laid end to
    end, so no two devices round with the same numbers."""
    for axis, p in t.placements:
        if (isinstance(p, (FlatShard, Varying)) or (isinstance(p, Shard) and p.dim == 0)) \
                and axis in b.comms:
            n = 1
            for s in b.local(t):
                n *= s
            return b.comms[axis].rank * n
    return 0


def _emit_quantize(b: _Builder, op: Op) -> fx.Node:
    """q and scales of x's groups (this rank's groups when x is a flat piece)."""
    a, x_t = op.attrs, b.g_types[op.inputs[0]]
    if a.get("scheme", "symmetric") != "symmetric":
        raise UnsupportedOpError("the torch backend quantizes symmetrically only",
                                 hint="use scheme=symmetric")
    local_pieces = a.get("pieces")
    if local_pieces is not None and any(not isinstance(p, Varying) for _, p in x_t.placements):
        local_pieces = 1     # a flat piece is one of the pieces: it quantizes alone
    key = b.node(op.inputs[1]) if len(op.inputs) > 1 else None
    n = 1
    for s in b.local(x_t):
        n *= s
    return b.call(quant.quantize_keyed, [b.node(op.inputs[0]), int(a["bits"]),
                                         int(a["group_size"]), key, local_pieces,
                                         _flat_offset(b, x_t), n, a.get("hadamard")])


def _emit_dequantize(b: _Builder, op: Op) -> fx.Node:
    a = op.attrs
    return b.call(quant.dequantize, [b.node(op.inputs[0]), b.node(op.inputs[1]),
                                     int(a["group_size"]),
                                     DTYPE_TO_TORCH[DType.parse(str(a["dtype"]))],
                                     b.local(op.result.type), a.get("pieces")])


def _emit_pack(b: _Builder, op: Op) -> fx.Node:
    return b.call(quant.pack, [b.node(op.inputs[0]), int(op.attrs["bits"])])


def _emit_unpack(b: _Builder, op: Op) -> fx.Node:
    a = op.attrs
    return b.call(quant.unpack, [b.node(op.inputs[0]), int(a["bits"]), b.local(op.result.type),
                                 DTYPE_TO_TORCH[DType.parse(str(a["dtype"]))]])


def _emit_hadamard(b: _Builder, op: Op) -> fx.Node:
    return b.call(quant.hadamard, [b.node(op.inputs[0]), int(op.attrs.get("block", 32))])


def _emit_rng_next(b: _Builder, op: Op) -> fx.Node:
    return b.call(quant.next_key, [b.node(op.inputs[0])])


def _emit_rng_uniform(b: _Builder, op: Op) -> Any:
    """A keyed uniform draw: this rank's part of the one-device draw (by element index);
    with a second result, the next key."""
    if not op.inputs:
        raise UnsupportedOpError("the torch backend lowers keyed rng_uniform only",
                                 hint="give the draw a key input")
    a, t = op.attrs, op.results[0].type
    shape = b.local(t)
    n = 1
    for s in shape:
        n *= s
    key = b.node(op.inputs[0])
    u = b.call(quant.uniform_shaped, [key, shape, _flat_offset(b, t),
                                      float(a.get("low", 0.0)), float(a.get("high", 1.0)),
                                      DTYPE_TO_TORCH[t.dtype]])
    if len(op.results) == 1:
        return u
    b.env[op.results[0].name] = u
    b.env[op.results[1].name] = b.call(quant.next_key, [key])
    return _DONE


def _all_to_all(b: _Builder, op: Op, comm: fx.Node) -> fx.Node:
    """Each rank's piece split along to_dim, chunk j to rank j, joined along from_dim."""
    a = op.attrs
    return b.call(collectives.all_to_all, [comm, b.node(op.inputs[0]), int(a["from_dim"]),
                                           int(a["to_dim"])], _async(op))


def _as_shard(b: _Builder, op: Op, comm: fx.Node) -> fx.Node:
    """This rank's value as its piece: its first elements, in the piece's shape."""
    t = op.result.type
    return b.call(quant.as_piece, [b.node(op.inputs[0]), b.local(t), _flat_offset(b, t),
                                   t.numel])


_COLLECTIVES["all_to_all"] = _all_to_all
_COLLECTIVES["as_shard"] = _as_shard

_QUANT: dict[str, Callable[[_Builder, Op], Any]] = {
    "quantize": _emit_quantize, "dequantize": _emit_dequantize, "pack": _emit_pack,
    "unpack": _emit_unpack, "hadamard": _emit_hadamard, "rng_next": _emit_rng_next,
    "rng_uniform": _emit_rng_uniform,
}


# ------------------------------------------------------------------ the table

_Emit = Callable[[_Builder, Op], Any]

# elementwise math: a value of one element beside a flat piece is read as a 0-d tensor
_ELEMENTWISE = (Category.unary, Category.binary, Category.ternary)
_OWN_MATH = ("add", "sub", "pow", "square", "addcmul", "addcdiv")

# IR ops with a form of their own
_OWN: dict[str, _Emit] = {
    "add": _emit_scaled_binary, "sub": _emit_scaled_binary, "pow": _emit_pow,
    "square": _emit_square, "addcmul": _emit_scaled_ternary, "addcdiv": _emit_scaled_ternary,
    "convert": _emit_convert, "norm": _emit_norm, "dot": _emit_dot,
    "transpose": _emit_transpose, "reshape": _emit_reshape,
    "concat": _emit_concat, "slice": _emit_slice,
    "broadcast_in_dim": _emit_broadcast, "literal": _emit_literal, "full": _emit_full,
    "opaque": _emit_opaque, "wait": _emit_wait,
    **{name: _emit_collective for name in _COLLECTIVES}, **_QUANT,
}

# every other IR op the aten table maps, by its category
_BY_CATEGORY: dict[Category, _Emit] = {
    Category.unary: _emit_unary, Category.binary: _emit_binary,
    Category.ternary: _emit_ternary, Category.reduce: _emit_reduce,
}


def _emitters() -> dict[str, _Emit]:
    """The emitter of each IR op the backend runs, by name."""
    table = dict(_OWN)
    for row in NEUTRAL:
        category = op_def(row.ir).category
        if row.ir not in table and category in _BY_CATEGORY:
            table[row.ir] = _BY_CATEGORY[category]
    return table


_EMIT = _emitters()

# the lowerings whose results may be views of (or aliases to) their inputs: permute,
# reshape, expand, narrow, the gathered buffer's view, and opaque calls (by their schema)
_VIEWS = {"transpose", "reshape", "broadcast_in_dim", "take_shard", "take_piece", "as_varying",
          "all_gather", "opaque", "slice"}


def _out_overload(fn: OpOverload) -> OpOverload | None:
    """The ``out=`` overload of an aten op: the same arguments, and one more, ``out``."""
    want = [(a.name, str(a.type)) for a in fn._schema.arguments]
    packet = fn.overloadpacket
    for name in packet.overloads():
        cand = getattr(packet, name)
        args = [(a.name, str(a.type)) for a in cand._schema.arguments]
        if args[:-1] == want and args[-1][0] == "out" and len(cand._schema.returns) == 1:
            return cand
    return None


def _makes_storage(op: Op) -> bool:
    """True when the op's results are new tensors, not views of (or aliases to) its inputs,
    so that a collective may reduce them in place when nothing else reads them."""
    if op.name != "opaque":
        return op.name not in _VIEWS
    target = str(op.attrs["target"])
    if "view" in target or "alias" in target:
        return False     # _unsafe_view shares storage though its schema says otherwise
    try:
        schema = resolve_target(target)._schema
    except (UnsupportedOpError, AttributeError):
        return False
    return all(r.alias_info is None for r in schema.returns)


def _returns_many(op: Op) -> bool:
    """True when the opaque op's aten call returns a tuple or a list (by its schema), even
    where the IR keeps only one of its results; without a schema, what the IR says."""
    try:
        returns = resolve_target(str(op.attrs["target"]))._schema.returns
    except (UnsupportedOpError, AttributeError):
        return "outs" in op.attrs or len(op.results) > 1
    return len(returns) != 1 or isinstance(returns[0].type, torch.ListType)


def _result_positions(op: Op) -> tuple[int, ...] | None:
    """Where each IR result sits in what the op's call returns; None when the call returns
    the one result itself.

    An opaque call that returns several values is always indexed: the importer keeps only
    the results that exist (``outs``, the positions that are not None: convolution_backward
    of a bias-free conv on an input without gradient returns ``(None, grad_weight, None)``),
    so a single IR result does not mean a single returned value."""
    if op.name != "opaque":
        return None if len(op.results) == 1 else tuple(range(len(op.results)))
    target = op.attrs["target"]
    if not _returns_many(op):
        if len(op.results) != 1 or "outs" in op.attrs:
            raise BackendError(f"{target} returns one tensor, but the op has "
                               f"{len(op.results)} results"
                               + (f" and outs={list(op.attrs['outs'])}"
                                  if "outs" in op.attrs else ""),
                               hint="give an op whose call returns one tensor one result "
                                    "and no outs attribute")
        return None
    positions = tuple(int(i) for i in op.attrs.get("outs", range(len(op.results))))
    if len(positions) != len(op.results) or len(set(positions)) != len(positions):
        raise BackendError(f"{target} has {len(op.results)} results but its outs attribute "
                           f"lists the positions {list(positions)}",
                           hint="outs names the position of each result in what the aten "
                                "call returns: one distinct position per result")
    return positions


def _getitem(x, i):
    return x[i]


def build_module(graph: Graph, comms: dict[str, collectives.Comm] | None = None,
                 in_place: bool = True, device: torch.device | None = None,
                 host_reads: bool = True, out_variants: bool = False) -> fx.GraphModule:
    """A GraphModule taking the graph's inputs in order and returning its outputs.

    ``comms`` gives the process group of each mesh axis the graph's collectives run on; the
    module holds them as ``comm_<axis>`` attributes. With ``in_place``, an output that
    replaces an input (a parameter, optimizer state, a buffer) is copied into that input's
    storage as soon as it is made, when nothing reads the input after that, and the module
    returns the (updated) input for it: no second copy of the model lives through the
    update. The caller's tensors are then updated by the call itself. Tensors the program
    makes (constants, padding) are made on ``device`` (default: the CPU); 0-d ones stay on
    the CPU, which every device's kernels read as scalars, as eager's do. Without
    ``host_reads`` no 0-d tensor is read into a Python number (for a code generator: the
    graph must be traced with the optimizers' tensor math, ``capture(tensor_hyper=True)``).
    With ``out_variants`` (the fx code generator's; Inductor plans its own buffers) a
    pointwise kernel making such a new value writes it straight into the input's storage
    (its ``out=`` overload), as eager's in-place optimizer kernels do, where it safely can
    (``_Builder.write_into``): no new tensor, no copy."""
    return _Builder(graph, comms, in_place, device, host_reads, out_variants).build()


def input_aliases(graph: Graph) -> dict[str, set[str]]:
    """Value -> the graph inputs whose storage it may share (itself, for an input; those of
    its operands, for a view or an op that may return an alias); values that own their
    storage are absent."""
    alias: dict[str, set[str]] = {i.name: {i.name} for i in graph.inputs}
    for op in graph.ops:
        if not _makes_storage(op):
            bases = set().union(*(alias.get(n, set()) for n in op.inputs)) if op.inputs \
                else set()
            for v in op.results:
                alias[v.name] = bases
    return alias


def written_by_kernels(graph: Graph) -> set[str]:
    """The new values of ``updates_in_place`` that the fx program's pointwise kernels write
    straight into the input they replace (``build_module(out_variants=True)``): they own no
    storage of their own. Emits the program to find them (no module, no process groups)."""
    b = _Builder(graph, None, True, None, True, out_variants=True, dry=True)
    b.emit()
    return b.kernel_written


def _reads_and_makers(graph: Graph, alias: dict[str, set[str]]
                      ) -> tuple[dict[str, int], dict[str, int]]:
    """(input -> index of the last op reading it or a value that may alias it, value ->
    index of the op making it)."""
    last: dict[str, int] = {}
    made: dict[str, int] = {}
    for k, op in enumerate(graph.ops):
        for n in free_inputs(op):
            for base in alias.get(n, ()):
                last[base] = k
        for v in op.results:
            made[v.name] = k
    return last, made


def updates_in_place(graph: Graph, alias: dict[str, set[str]] | None = None
                     ) -> dict[str, str]:
    """Value -> the input it replaces, for new values that can be written into the input's
    storage where they are made: the input (and every value that may alias it) is read by
    no later op and not returned, the value owns its storage, and the types agree.
    ``alias``: ``input_aliases(graph)``, when already made."""
    inputs = {i.name: i.value.type for i in graph.inputs}
    types = graph.value_types()
    alias = input_aliases(graph) if alias is None else alias   # value -> inputs it aliases
    last, made = _reads_and_makers(graph, alias)
    end = len(graph.ops)
    for o in graph.outputs:
        for base in alias.get(o.name, ()):
            last[base] = end
    out: dict[str, str] = {}
    returned = [o.name for o in graph.outputs]
    for o in graph.outputs:
        target = o.role.target if o.role.kind is OutputKind.replaces else None
        if (target is None or o.name not in made or returned.count(o.name) != 1
                or alias.get(o.name) or target in out.values()):
            continue
        if last.get(target, -1) <= made[o.name] and types[o.name] == inputs[target]:
            out[o.name] = target
    return out
