"""The JAX backend: an IR graph as a function under jax.jit that takes and returns the
user's pytrees."""

from __future__ import annotations

import functools

from collections import ChainMap
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax

from ..errors import BackendError, no_keywords
from ..ir.core import Graph, InputKind, Op, OutputKind, Region
from ..ir.types import DType, TensorType
from .dtypes import numpy_dtype
from .ops import SCATTERS, emitter
from .params import OPAQUE_RESERVED, decode
from .roles import number_as_array
from .trees import check_argument_trees, input_trees, output_tree

Env = MutableMapping[str, Any]

_PRIMITIVES: dict[str, Any] = {}


def primitive(name: str) -> Any:
    """The JAX primitive called ``name``; BackendError when this JAX has none."""
    if not _PRIMITIVES:
        from jax._src.interpreters import mlir
        from jax.extend.core import Primitive, primitives
        found = list(mlir._lowerings)
        for table in mlir._platform_specific_lowerings.values():
            found.extend(table)
        found.extend(p for p in vars(primitives).values() if isinstance(p, Primitive))
        for p in found:
            _PRIMITIVES.setdefault(p.name, p)
    try:
        return _PRIMITIVES[name]
    except KeyError:
        raise BackendError(f"this JAX ({jax.__version__}) has no primitive named {name!r}",
                           hint="trace and run with the same JAX version") from None


def _opaque(op: Op, ins: list) -> list:
    target = str(op.attrs["target"])
    if not target.startswith("jax:"):
        raise BackendError(f"opaque op with target {target!r} is not a JAX primitive",
                           hint="the JAX backend runs opaque ops traced from JAX only")
    name = target[4:]
    params = {k: decode(v) for k, v in op.attrs.items() if k not in OPAQUE_RESERVED}
    if name in SCATTERS:   # the frontend left out their update jaxpr: lax rebuilds it
        operand, indices, updates = ins
        return [SCATTERS[name](operand, indices, updates, **params)]
    prim = primitive(name)
    out = prim.bind(*ins, **params)
    return list(out) if prim.multiple_results else [out]


# ---------------------------------------------------------------- the interpreter

class Lowering:
    """How one op without regions becomes JAX calls. This one runs the whole program on one
    device; the per-device lowering of distributed graphs (jax/parallel.py) refines it."""

    def emit(self, op: Op, ins: list) -> list:
        """The op's result arrays, given its input arrays."""
        if op.name == "opaque":
            return _opaque(op, ins)
        return emitter(op)(op, ins, [v.type for v in op.results])


SINGLE_DEVICE = Lowering()


def _run_region(r: Region, outer: Env, args: Sequence[Any], low: Lowering) -> list:
    env: Env = ChainMap(dict(zip((a.name for a in r.args), args)), outer)
    run_ops(r.ops, env, low)
    return [env[y] for y in r.yields]


def _control(op: Op, ins: list, env: Env, low: Lowering) -> list:
    if op.name == "call":
        return _run_region(op.regions[0], env, ins, low)
    if op.name == "cond":
        branches = [lambda *a, r=r: tuple(_run_region(r, env, a, low)) for r in op.regions]
        return list(lax.switch(ins[0], branches, *ins[1:]))
    if op.name == "while":
        cond, body = op.regions
        out = lax.while_loop(lambda c: _run_region(cond, env, c, low)[0],
                             lambda c: tuple(_run_region(body, env, c, low)), tuple(ins))
        return list(out)
    if op.name == "scan":
        nc, nk = op.attrs.get("num_consts", 0), op.attrs["num_carry"]
        consts, carry, xs = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]
        (body,) = op.regions

        def step(c, x):
            ys = _run_region(body, env, list(consts) + list(c) + list(x), low)
            return tuple(ys[:nk]), tuple(ys[nk:])
        c, ys = lax.scan(step, tuple(carry), tuple(xs), length=op.attrs["length"],
                         reverse=op.attrs.get("reverse", False),
                         unroll=op.attrs.get("unroll", 1))
        return list(c) + list(ys)
    raise BackendError(f"the JAX backend has no lowering for control op {op.name!r}")


def run_ops(ops: Sequence[Op], env: Env, lowering: Lowering = SINGLE_DEVICE) -> None:
    """Evaluate ``ops`` in order, reading and writing values in ``env`` by name."""
    for op in ops:
        ins = [env[n] for n in op.inputs]
        if op.regions:
            outs = _control(op, ins, env, lowering)
        else:
            outs = lowering.emit(op, ins)
        if len(outs) != len(op.results):
            raise BackendError(f"{op.name} gave {len(outs)} results where the IR declares "
                               f"{len(op.results)}")
        for v, x in zip(op.results, outs):
            env[v.name] = x


def graph_function(graph: Graph, lowering: Lowering = SINGLE_DEVICE) -> Callable[..., tuple]:
    """The graph as a plain function of its input arrays (in order) returning its outputs."""
    names = [i.name for i in graph.inputs]

    def run(*leaves: Any) -> tuple:
        env: Env = dict(zip(names, leaves))
        run_ops(graph.ops, env, lowering)
        return tuple(env[o.name] for o in graph.outputs)
    run.__name__ = graph.name
    return run


# ---------------------------------------------------------------- pytrees in and out

def dtype_matches(dtype: Any, want: DType) -> bool:
    """True when an argument leaf's dtype is the IR dtype ``want`` (as JAX computes with it)."""
    if dtype is None:
        return False
    is_key = jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    if want is DType.key or is_key:
        return want is DType.key and is_key
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype)) == numpy_dtype(want)


def check_alive(name: str, leaf: Any) -> None:
    """BackendError for an array an earlier donating call consumed: passed to the jitted
    program it crashes the process (jax 0.10's C++ dispatch does not check)."""
    if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer) and \
            leaf.is_deleted():
        raise BackendError(f"input {name} is an array an earlier call of the step consumed "
                           "(donated: its buffer holds that call's new values)",
                           hint="pass the arrays the last call returned "
                                "(params, opt_state, loss = step(params, opt_state, batch)), "
                                "or parallelize(..., donate=False) to keep the old ones")


def _check_leaf(name: str, want: TensorType, leaf: Any) -> None:
    check_alive(name, leaf)
    shape = tuple(np.shape(leaf))
    dtype = getattr(leaf, "dtype", None)
    if shape != want.shape or not dtype_matches(dtype, want.dtype):
        raise BackendError(f"input {name} is {dtype}{list(shape)}; the graph expects "
                           f"{want.dtype}{list(want.shape)}",
                           hint="call the compiled step with arguments shaped like the "
                                "example arguments it was traced with")


def donated(graph: Graph) -> tuple[int, ...]:
    """The input positions a donating step consumes: parameters and optimizer state (their
    buffers hold the new values), as ``jax.jit(donate_argnums=...)`` users donate them."""
    return tuple(k for k, i in enumerate(graph.inputs)
                 if i.role.kind in (InputKind.param, InputKind.opt_state))


def user_leaves(args: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """(the leaves of the user's arguments, a Python number as the weakly typed array the
    trace took it as; the treedef of each argument)."""
    treedefs, leaves = [], []
    for a in args:
        ls, td = jax.tree.flatten(a)
        treedefs.append(td)
        leaves.extend(number_as_array(x) for x in ls)
    return leaves, treedefs


class JaxStep:
    """A compiled graph: call it like the user's step; it runs under jax.jit."""

    def __init__(self, graph: Graph, out_tree: Any = None, donate: bool = False) -> None:
        self.graph = graph
        self.out_tree = out_tree if out_tree is not None else output_tree(graph)
        self.fn = graph_function(graph)
        self.jitted = jax.jit(self.fn, donate_argnums=donated(graph) if donate else ())
        # The user's pytrees straight into jax.jit, as the user's own jax.jit(step) takes
        # them: jit flattens them, checks their shapes and finds the compiled program in
        # C++, and this step's checks and output tree run once, while jit traces. (The
        # flat path below spends Python time per leaf on every call: 1.3x the user's jit
        # on a small CPU step.) Donation names arguments, not leaves: it takes that path.
        self._tree_jit = (jax.jit(self._tree_fn)
                          if not donate and self.out_tree is not None else None)

    @functools.cached_property
    def traced_trees(self) -> tuple | None:
        """The argument structures the step was traced with (looked up once)."""
        return input_trees(self.graph)

    def leaves(self, args: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """(input leaves, the treedef of each argument); as many leaves as graph inputs."""
        leaves, treedefs = user_leaves(args)
        check_argument_trees(self.traced_trees, treedefs)
        # (a pipeline's microbatch index is an input its runtime passes, not the user)
        given = sum(1 for i in self.graph.inputs if i.role.kind is not InputKind.microbatch)
        if len(leaves) != given:
            raise BackendError(f"the step was called with {len(leaves)} array leaves; the "
                               f"graph takes {given} inputs",
                               hint="pass the same pytrees the step was traced with")
        return leaves, treedefs

    def flatten(self, args: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """(input leaves, the treedef of each argument), checked against the graph."""
        leaves, treedefs = self.leaves(args)
        for i, leaf in zip(self.graph.inputs, leaves):
            _check_leaf(i.name, i.value.type, leaf)
        return leaves, treedefs

    def _tree_fn(self, *args: Any) -> Any:
        # runs while jax.jit traces: the leaves are tracers with shapes and dtypes
        leaves, _ = JaxStep.flatten(self, args)
        return jax.tree.unflatten(self.out_tree, self.fn(*leaves))

    def _kept(self, result: Any) -> Any:
        """What the step returns (a runner that reports memory keeps it)."""
        return result

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        no_keywords(kwargs)
        if self._tree_jit is not None:
            return self._kept(self._tree_jit(*args))
        leaves, treedefs = self.flatten(args)
        outs = self.run(leaves)
        if self.out_tree is not None:
            return jax.tree.unflatten(self.out_tree, outs)
        return self._by_roles(args, treedefs, outs)

    def run(self, leaves: list[Any]) -> Sequence[Any]:
        """The program's output leaves for these input leaves."""
        return self.jitted(*leaves)

    def lower(self, *args: Any) -> Any:
        """jax.jit's Lowered for these arguments (for inspecting the XLA program)."""
        if self._tree_jit is not None:
            return self._tree_jit.lower(*args)
        return self.jitted.lower(*self.flatten(args)[0])

    def _by_roles(self, args: Sequence[Any], treedefs: list, outs: Sequence[Any],
                  graph: Graph | None = None) -> Any:
        """(params, opt_state, *metrics) rebuilt from roles, for graphs with no recorded
        output structure (rewritten by passes): each replacing output takes its input's
        place in the argument it came from; other outputs follow as flat leaves. ``graph``:
        the inputs and outputs the user's arguments and ``outs`` are (default: the step's)."""
        graph = self.graph if graph is None else graph
        where: dict[str, tuple[int, int]] = {}
        pos = 0
        for k, td in enumerate(treedefs):
            for j in range(td.num_leaves):
                where[graph.inputs[pos].name] = (k, j)
                pos += 1
        kinds = {i.name: i.role.kind for i in graph.inputs}
        first = {kind: next((where[n][0] for n, kd in kinds.items() if kd is kind), default)
                 for kind, default in ((InputKind.param, 0), (InputKind.opt_state, 1))}
        # a kind with no array leaves (optax.sgd's EmptyState) sits where the convention puts
        # it: params first, optimizer state second
        if len(set(first.values())) != 2 or max(first.values()) >= len(treedefs):
            return tuple(outs)
        new = {k: list(jax.tree.leaves(args[k])) for k in set(first.values())}
        metrics = []
        for o, x in zip(graph.outputs, outs):
            if o.role.kind is OutputKind.replaces and where[o.role.target][0] in new:
                k, j = where[o.role.target]
                new[k][j] = x
            else:
                metrics.append(x)
        trees = [jax.tree.unflatten(treedefs[first[kd]], new[first[kd]])
                 for kd in (InputKind.param, InputKind.opt_state)]
        return (*trees, *metrics)


def compile_jax(graph: Graph, *, out_tree: Any = None) -> JaxStep:
    """A callable running ``graph`` under jax.jit, taking and returning the user's pytrees.

    The output structure is ``out_tree`` if given, else the one the frontend recorded for
    a graph with this signature (the traced graph, or a pass's rewrite that keeps input
    and output names), else (params, opt_state, *metric leaves) rebuilt from the roles."""
    return JaxStep(graph, out_tree)
