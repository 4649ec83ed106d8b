"""IR -> a runnable torch.fx GraphModule calling aten ops (its ``.code`` reads as Python).

Neutral ops go back to the aten overload the frontend table maps them from. 0-d values
made only from constants, hyperparameter inputs and ``.item()`` reads are *host scalars*:
computed with Python floats and passed to aten calls as Python numbers, as the eager
optimizer does with its learning rate and step count. Layout ops become views (permute,
expand, reshape), as eager code makes them. So the program makes the eager step's calls.

A graph placed over a mesh becomes one rank's program: every shape it builds (reshape
targets, constants, broadcasts) is the value's *local* shape (``TensorType.local_shape``; a
flat shard is a 1-D chunk), and collectives call the helpers of ``collectives`` on the
``Comm`` of their axis, which the program reads as an attribute (``self.comm_dp``)."""

from __future__ import annotations

import operator
import re
from typing import Any

import torch
import torch.fx as fx

from ..errors import BackendError, UnsupportedOpError
from .ops import DTYPE_TO_TORCH, decode_arg, emit_target, resolve_target
from ..ir.core import Graph, InputKind, Op
from ..ir.types import DType, TensorType
from . import collectives

aten = torch.ops.aten

_ELEMENTWISE = {"neg", "abs", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "relu",
                "reciprocal", "sign", "mul", "div", "max", "min"}
_TAKES_NUMBER = {"mul", "div"}   # overloads whose second operand may be a Python number
_COMPARE = {"eq", "ne", "lt", "le", "gt", "ge"}
_HOST_OPS = {"mul": operator.mul, "add": operator.add, "sub": operator.sub,
             "div": operator.truediv, "pow": operator.pow}
_HOST_DTYPES = {DType.f64, DType.i64, DType.bool}
_REDUCE = {"reduce_sum", "reduce_mean", "reduce_max", "reduce_min"}
_COLLECTIVES = {"all_reduce", "reduce_scatter", "all_gather", "take_shard", "broadcast"}


def _py_name(name: str) -> str:
    s = re.sub(r"\W", "_", name)
    return s if s and not s[0].isdigit() else f"v_{s}"


class _Builder:
    def __init__(self, graph: Graph, comms: dict[str, collectives.Comm] | None = None) -> None:
        self.g = graph
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

    def build(self) -> fx.GraphModule:
        for i in self.g.inputs:
            self.env[i.name] = self.fx.placeholder(_py_name(i.name))
            if i.role.kind is InputKind.hyper and i.value.type.shape == ():
                self.set_host(i.name, self.call(aten._local_scalar_dense.default,
                                                [self.env[i.name]]), i.value.type.dtype)
        for op in self.g.ops:
            self.op(op)
        self.fx.output(tuple(self.env[o.name] for o in self.g.outputs))
        self.fx.lint()
        root = torch.nn.Module()
        for axis, comm in self.comms.items():
            setattr(root, f"comm_{axis}", comm)
        return fx.GraphModule(root, self.fx, class_name=_py_name(self.g.name))

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

    def set_host(self, name: str, value: Any, dtype: DType) -> None:
        """Record ``name`` as a host scalar: a Python number or a node producing one."""
        self.scalars[name] = value
        self.dtype_of[name] = DTYPE_TO_TORCH[dtype]

    def host(self, op: Op) -> bool:
        """Compute a 0-d op with Python numbers when its inputs are host scalars."""
        if len(op.results) != 1 or op.result.type.shape != () or not op.inputs:
            return False
        if not all(i in self.scalars for i in op.inputs) or op.regions:
            return False
        n, t = op.name, op.result.type
        vals = [self.scalars[i] for i in op.inputs]
        if n == "convert":
            # an .item() read, or a scalar handed to a tensor op (which rounds it itself)
            value = vals[0]
        elif n in _HOST_OPS and t.dtype in _HOST_DTYPES and not op.attrs and len(vals) == 2:
            value = self.call(_HOST_OPS[n], vals)
        elif n == "neg" and t.dtype in _HOST_DTYPES:
            value = self.call(operator.neg, vals)
        else:
            return False
        self.set_host(op.result.name, value, t.dtype)
        return True

    def op(self, op: Op) -> None:
        n, a, ins = op.name, op.attrs, op.inputs
        out: Any
        if n == "convert" and op.inputs[0] not in self.scalars and \
                op.result.type.shape == () and op.result.type.dtype in _HOST_DTYPES:
            # .item(): read a 0-d tensor into a Python number
            self.set_host(op.result.name, self.call(aten._local_scalar_dense.default,
                                                    [self.node(op.inputs[0])]),
                          op.result.type.dtype)
            return
        if self.host(op):
            return
        if n == "full" and op.result.type.shape == ():
            # folded into the ops that use it; materialized on demand
            self.set_host(op.result.name, a["value"], op.result.type.dtype)
            return
        if n == "opaque":
            out = self.opaque(op)
        elif n == "square":    # from an expanded norm: x * x, one rounding as pow(x, 2)
            out = self.call(aten.mul.Tensor, [self.node(ins[0]), self.node(ins[0])])
        elif n in _ELEMENTWISE and len(ins) == 1:
            out = self.call(emit_target(n), [self.node(ins[0])])
        elif n in ("add", "sub"):
            target = emit_target(n)
            kw = {"alpha": a["alpha"]} if "alpha" in a else {}
            if len(ins) == 3:
                kw = {"alpha": self.arg(ins[2])}
            out = self.call(target, [self.node(ins[0]), self.arg(ins[1])], kw)
        elif n == "pow":
            if ins[0] in self.scalars:
                out = self.call(aten.pow.Scalar, [self.arg(ins[0]), self.node(ins[1])])
            elif ins[1] in self.scalars:
                out = self.call(aten.pow.Tensor_Scalar, [self.node(ins[0]), self.arg(ins[1])])
            else:
                out = self.call(aten.pow.Tensor_Tensor, [self.node(ins[0]), self.node(ins[1])])
        elif n in _ELEMENTWISE:
            rhs = self.arg(ins[1]) if n in _TAKES_NUMBER else self.node(ins[1])
            out = self.call(emit_target(n), [self.node(ins[0]), rhs])
        elif n in _COMPARE:
            target = emit_target(n, "Scalar" if ins[1] in self.scalars else "Tensor")
            out = self.call(target, [self.node(ins[0]), self.arg(ins[1])])
        elif n == "select":
            out = self.call(emit_target(n), [self.node(i) for i in ins])
        elif n == "lerp":
            target = emit_target(n, "Scalar" if ins[2] in self.scalars else "Tensor")
            out = self.call(target, [self.node(ins[0]), self.node(ins[1]), self.arg(ins[2])])
        elif n in ("addcmul", "addcdiv"):
            kw = {"value": a["value"]} if "value" in a else {}
            if len(ins) == 4:
                kw = {"value": self.arg(ins[3])}
            out = self.call(emit_target(n), [self.node(i) for i in ins[:3]], kw)
        elif n == "dot":
            out = self.dot(op)
        elif n == "transpose":
            out = self.call(emit_target(n), [self.node(ins[0]), list(a["perm"])])
        elif n == "reshape":
            src, dst = self.local(self.g_types[ins[0]]), self.local(op.result.type)
            if src == dst and len(dst) < op.result.type.rank:
                out = self.node(ins[0])   # a flat shard: the same 1-D chunk, whatever shape
            else:
                out = self.call(emit_target(n), [self.node(ins[0]), dst])
        elif n == "broadcast_in_dim":
            out = self.broadcast(op)
        elif n in _REDUCE:
            out = self.reduce(op)
        elif n == "norm":
            x = self.g_types[ins[0]]
            dims = list(a["dims"])
            full = dims == list(range(x.rank)) and not a.get("keepdim", False)
            if len(self.local(x)) != x.rank:
                raise BackendError(f"norm of a flat shard ({x}) has no lowering",
                                   hint="expand norm (square, reduce_sum, sqrt) first")
            out = self.call(aten.linalg_vector_norm.default,
                            [self.node(ins[0]), a["ord"], None if full else dims,
                             bool(a.get("keepdim", False))])
        elif n == "convert":
            out = self.call(aten._to_copy.default, [self.node(ins[0])],
                            {"dtype": DTYPE_TO_TORCH[DType(a["dtype"])]})
        elif n == "literal":
            t = op.result.type
            if self.local(t) != list(t.shape):
                raise BackendError(f"a sharded literal ({t}) has no lowering",
                                   hint="make the literal replicated and take_shard it")
            out = self.call(torch.tensor, [list(a["data"])], {"dtype": DTYPE_TO_TORCH[t.dtype]})
            out = self.call(aten.reshape.default, [out, list(t.shape)])
        elif n == "full":
            t = op.result.type
            out = self.call(aten.full.default, [self.local(t), a["value"]],
                            {"dtype": DTYPE_TO_TORCH[t.dtype]})
        elif n in _COLLECTIVES:
            out = self.collective(op)
            if a.get("async", False):
                # in flight: the results exist only after their wait
                for k, v in enumerate(op.results):
                    self.pending[v.name] = (out, k, len(op.results))
                return
        elif n == "wait":
            self.wait(op)
            return
        else:
            raise UnsupportedOpError(f"the torch backend cannot run IR op {n!r}",
                                     hint="this op has no torch lowering yet")
        self.bind(op, out)

    def bind(self, op: Op, out: Any) -> None:
        if _makes_storage(op):
            self.fresh.update(v.name for v in op.results)
        if len(op.results) == 1:
            self.env[op.result.name] = out
            return
        idx = op.attrs.get("outs", tuple(range(len(op.results))))
        for v, i in zip(op.results, idx):
            self.env[v.name] = self.call(_getitem, [out, i])

    def reduce(self, op: Op) -> fx.Node:
        a, x = op.attrs, self.g_types[op.inputs[0]]
        dims, keep = list(a["dims"]), bool(a.get("keepdim", False))
        if len(self.local(x)) == x.rank:
            return self.call(emit_target(op.name), [self.node(op.inputs[0]), dims, keep])
        # a flat shard (only a sum over every dimension is allowed): sum the 1-D chunk
        out = self.call(emit_target(op.name), [self.node(op.inputs[0]), [0], False])
        shape = self.local(op.result.type)
        return self.call(aten.reshape.default, [out, shape]) if shape else out

    def collective(self, op: Op) -> fx.Node:
        a = op.attrs
        axis = str(a["axis"])
        if axis not in self.comms:
            raise BackendError(f"the program has a {op.name} over mesh axis {axis!r} but no "
                               "process group was given for that axis",
                               hint="run a distributed graph through "
                                    "diphoma_compile.torch.dist.TorchDistStep")
        if axis not in self.comm_nodes:
            self.comm_nodes[axis] = self.fx.get_attr(f"comm_{axis}")
        comm = self.comm_nodes[axis]
        if len(op.inputs) > 1:
            return self.bucket(op, comm)
        asy = {"async_op": True} if a.get("async", False) else {}
        x = self.node(op.inputs[0])
        name, src, dst = op.name, op.inputs[0], op.result.type
        if name == "all_reduce":
            # reduce in place when nothing else reads the value (not a graph input)
            owned = self.uses.get(src, 0) == 1 and src in self.fresh
            return self.call(collectives.all_reduce, [comm, x, str(a["op"]), owned], asy)
        if name == "reduce_scatter":
            return self.call(collectives.reduce_scatter,
                             [comm, x, str(a["op"]), a["dim"], self.local(dst)], asy)
        if name == "all_gather":
            return self.call(collectives.all_gather, [comm, x, a["dim"], list(dst.shape)], asy)
        if name == "take_shard":
            return self.call(collectives.take_shard, [comm, x, a["dim"], self.local(dst)])
        return self.call(collectives.broadcast, [comm, x, int(a["root"])])

    def wait(self, op: Op) -> None:
        """Finish the in-flight collectives whose results this wait hands on."""
        done: dict[fx.Node, Any] = {}
        for v, i in zip(op.results, op.inputs):
            if i not in self.pending:      # already finished (a synchronous collective)
                self.env[v.name] = self.node(i)
                continue
            node, k, count = self.pending[i]
            if node not in done:
                done[node] = self.call(collectives.wait, [node])
            self.env[v.name] = done[node] if count == 1 else self.call(_getitem,
                                                                     [done[node], k])

    def bucket(self, op: Op, comm: fx.Node) -> fx.Node:
        """k values moved as one packed buffer; the call returns a tuple (bound by getitem)."""
        a, xs = op.attrs, [self.node(i) for i in op.inputs]
        asy = {"async_op": True} if a.get("async", False) else {}
        if op.name == "all_reduce":
            return self.call(collectives.all_reduce_bucket, [comm, xs, str(a["op"])], asy)
        if op.name == "reduce_scatter":
            return self.call(collectives.reduce_scatter_bucket,
                             [comm, xs, str(a["op"]), a["dim"],
                              [self.local(v.type) for v in op.results]], asy)
        if op.name == "all_gather":
            return self.call(collectives.all_gather_bucket,
                             [comm, xs, a["dim"], [list(v.type.shape) for v in op.results]],
                             asy)
        raise UnsupportedOpError(f"the torch backend has no bucketed {op.name}")

    def dot(self, op: Op) -> fx.Node:
        a = op.attrs
        lhs, rhs = (self.node(i) for i in op.inputs)
        lb, rb = tuple(a.get("lhs_batch", ())), tuple(a.get("rhs_batch", ()))
        lc, rc = tuple(a["lhs_contract"]), tuple(a["rhs_contract"])
        if not lb and lc == (1,) and rc == (0,):
            return self.call(emit_target("dot", "default"), [lhs, rhs])   # mm
        if lb == rb == (0,) and lc == (2,) and rc == (1,):
            return self.call(aten.bmm.default, [lhs, rhs])
        raise UnsupportedOpError(f"the torch backend has no lowering for dot with attributes "
                                 f"{dict(a)}")

    def broadcast(self, op: Op) -> fx.Node:
        src = self.g_types[op.inputs[0]]
        dst = op.result.type
        dims = tuple(op.attrs["dims"])
        x = self.node(op.inputs[0])
        src_shape, dst_shape = self.local(src), self.local(dst)
        if len(dst_shape) != dst.rank or len(src_shape) != src.rank:
            raise BackendError(f"broadcast_in_dim of a flat shard ({src} -> {dst}) has no "
                               "lowering")
        if dims != tuple(range(dst.rank - src.rank, dst.rank)):
            shape = [1] * dst.rank
            for i, d in enumerate(dims):
                shape[d] = src_shape[i]
            x = self.call(aten.reshape.default, [x, shape])
        return self.call(aten.expand.default, [x, dst_shape])

    def opaque(self, op: Op) -> fx.Node:
        target = resolve_target(str(op.attrs["target"]))
        ins = [self.node(i) for i in op.inputs]
        args = decode_arg(op.attrs.get("args", ()), ins)
        kwargs = {k[3:]: decode_arg(v, ins) for k, v in op.attrs.items() if k.startswith("kw_")}
        return self.call(target, args, kwargs)


_VIEWS = {"transpose", "reshape", "broadcast_in_dim", "take_shard", "all_gather", "opaque"}


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


def _getitem(x, i):
    return x[i]


def build_module(graph: Graph,
                 comms: dict[str, collectives.Comm] | None = None) -> fx.GraphModule:
    """A GraphModule taking the graph's inputs in order and returning its outputs.

    ``comms`` gives the process group of each mesh axis the graph's collectives run on; the
    module holds them as ``comm_<axis>`` attributes."""
    return _Builder(graph, comms).build()
