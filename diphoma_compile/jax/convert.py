"""Jaxpr -> IR ops: walks equations, maps primitives through the table in jax/ops.py,
inlines nested calls, turns cond/while/scan into ops with regions, keeps the rest opaque."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, Literal

from ..errors import FrontendError, UnsupportedOpError
from ..ir.core import Attrs, NameSupply, Op, Region, Value
from ..ir.types import DType, TensorType
from .dtypes import ir_type
from .ops import BY_PRIMITIVE, DERIVED_PARAMS, INLINE, KEYED_RANDOM, EqnView
from .params import OPAQUE_RESERVED, EncodingError, encode

_CONTROL = ("cond", "while", "scan")


def _default_branch(platforms: Any) -> int:
    """The branch of jax.lax.platform_dependent that no platform names (its default): the
    IR is made for any device. (The others are one backend's kernels: a Pallas TPU one.)"""
    default = [k for k, p in enumerate(platforms) if p is None]
    if not default:
        raise UnsupportedOpError(
            f"jax.lax.platform_dependent with no default implementation (every branch names "
            f"its platforms: {platforms})",
            hint="give it a default= implementation, or keep it out of the step")
    return default[0]


_SCAN_PARAMS = {"reverse", "length", "jaxpr", "num_consts", "num_carry", "unroll", "linear",
                "_split_transpose"}


@dataclass
class _Block:
    """Ops being built for one scope (the graph or a region), with its constant cache."""

    ops: list[Op] = field(default_factory=list)
    consts: dict[tuple, str] = field(default_factory=dict)  # (dtype, shape, value) -> name


def _number(x: Any, dtype: DType, where: str) -> int | float:
    v = np.asarray(x).item()
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, (int, float)):
        return v
    raise FrontendError(f"{where} is the constant {v!r} of dtype {dtype}; the IR holds real "
                        "and integer constants only")


_REDUCTIONS = os.path.join("jax", "_src", "numpy", "reductions.py")


def _made_by_jnp_mean(eqn) -> bool:
    """Whether ``eqn`` (a division) is jnp.mean's own: the innermost frame of its trace in
    jax.numpy's reductions is ``mean``, which divides the sum it takes by the number of
    elements that sum adds up (a constant), and nothing else. The batch analysis takes
    such a division for a mean without tracing the step again at more rows."""
    tb = eqn.source_info.traceback
    for frame in (tb.frames if tb is not None else ()):
        if frame.file_name.endswith(_REDUCTIONS):
            return frame.function_name == "mean"
    return False


def _literal_value(v: Any) -> Any:
    """The Python number of a scalar literal operand, else None."""
    if not isinstance(v, Literal):
        return None
    arr = np.asarray(v.val)
    return arr.item() if arr.size == 1 else None


def _is_transposed(eqn) -> bool:
    """True when JAX's autodiff made ``eqn`` by transposing (the backward pass of grad,
    value_and_grad or vjp): its name stack reads ``transpose(jvp(...))``. Nested equations
    (of an inlined jit, a cond's branches) carry their stack relative to their parent's."""
    stack = getattr(eqn.source_info, "name_stack", None)
    return stack is not None and "transpose(" in str(stack)


class JaxprConverter:
    """Converts (closed) jaxprs into IR ops, drawing value names from one supply."""

    def __init__(self, names: NameSupply, locations: bool = True) -> None:
        self.names = names
        self.locations = locations
        # results of ops that JAX's autodiff made by transposing the forward pass (their
        # name stack says transpose(jvp(...))): the backward pass, as JAX itself knows it
        self.transposed: set[str] = set()
        self._in_transpose = False
        # platform_index's constants (the default branch of jax.lax.platform_dependent)
        self._platform: dict[str, int] = {}

    # ------------------------------------------------------------------ entry
    def convert(self, closed: ClosedJaxpr, inputs: list[str]) -> tuple[list[Op], list[str]]:
        """Ops computing ``closed`` on the values named ``inputs``, and its output names."""
        block = _Block()
        outs = self._inline(closed.jaxpr, list(closed.consts), inputs, block)
        return block.ops, outs

    # ------------------------------------------------------------------ helpers
    def _loc(self, eqn) -> str | None:
        if not self.locations:
            return None
        from jax._src import source_info_util
        frame = source_info_util.user_frame(eqn.source_info.traceback)
        if frame is None:
            return None
        return f"{os.path.basename(frame.file_name)}:{frame.start_line}"

    def _emit(self, block: _Block, name: str, inputs: list[str], attrs: dict[str, Any],
              types: list[TensorType], hint: str, loc: str | None = None,
              regions: tuple[Region, ...] = ()) -> list[str]:
        results = tuple(Value(self.names(hint), t) for t in types)
        block.ops.append(Op(name, tuple(inputs), results, Attrs(attrs), regions, loc=loc))
        if self._in_transpose:
            self.transposed.update(v.name for v in results)
        return [v.name for v in results]

    def _constant(self, value: Any, aval: Any, block: _Block, where: str) -> str:
        """The name of a constant op (full for scalars, literal otherwise), shared per block."""
        t = ir_type(aval, where)
        if t.dtype is DType.key:
            return self._key_constant(value, block, where)
        arr = np.asarray(value)
        if t.numel == 1 and arr.size == 1:
            v = _number(arr, t.dtype, where)
            key = (t.dtype, t.shape, "full", repr(v))
            if key not in block.consts:
                (block.consts[key],) = self._emit(block, "full", [], {"value": v}, [t], "c")
            return block.consts[key]
        data = tuple(_number(x, t.dtype, where) for x in arr.ravel())
        key = (t.dtype, t.shape, "literal", repr(data))
        if key not in block.consts:
            (block.consts[key],) = self._emit(block, "literal", [], {"data": data}, [t], "c")
        return block.consts[key]

    def _key_constant(self, key: Any, block: _Block, where: str) -> str:
        """A captured typed key (``jax.random.key(0)`` at module level): its words as a
        constant, wrapped as the key type by the same ops ``wrap_key_data`` traces to."""
        import jax
        words = jax.random.key_data(key)
        name = self._constant(np.asarray(words), words, block, where)
        wrap = jax.make_jaxpr(lambda w: jax.random.wrap_key_data(
            w, impl=jax.random.key_impl(key)))(words)
        return self._inline(wrap.jaxpr, list(wrap.consts), [name], block)[0]

    def _read(self, v: Any, env: dict, block: _Block) -> str:
        if isinstance(v, Literal):
            return self._constant(v.val, v.aval, block, "a literal")
        return env[v]

    def _bind_outs(self, outvars, names: list[str], env: dict) -> None:
        for v, n in zip(outvars, names):
            if not isinstance(v, DropVar):
                env[v] = n

    # ------------------------------------------------------------------ jaxprs
    def _inline(self, jaxpr: Jaxpr, consts: list, inputs: list[str], block: _Block) -> list[str]:
        """Emit ``jaxpr``'s equations into ``block``; its inputs are the values ``inputs``."""
        env: dict = {}
        for v, c in zip(jaxpr.constvars, consts):
            env[v] = self._constant(c, v.aval, block, "a captured constant")
        if len(jaxpr.invars) != len(inputs):
            raise FrontendError(f"a nested jaxpr takes {len(jaxpr.invars)} inputs but is "
                                f"given {len(inputs)}")
        env.update(zip(jaxpr.invars, inputs))
        for eqn in jaxpr.eqns:
            self._eqn(eqn, env, block)
        return [self._read(v, env, block) for v in jaxpr.outvars]

    def _region(self, name: str, closed: ClosedJaxpr | Jaxpr, captured: list[str]) -> Region:
        """A region for ``closed``: its first len(captured) inputs read outer values, the
        rest become region arguments."""
        jaxpr = closed.jaxpr if isinstance(closed, ClosedJaxpr) else closed
        consts = list(closed.consts) if isinstance(closed, ClosedJaxpr) else []
        args = [Value(self.names("arg"), ir_type(v.aval, f"an argument of region {name}"))
                for v in jaxpr.invars[len(captured):]]
        block = _Block()
        yields = self._inline(jaxpr, consts, captured + [a.name for a in args], block)
        return Region(name, tuple(args), tuple(block.ops), tuple(yields))

    # ------------------------------------------------------------------ equations
    def _eqn(self, eqn, env: dict, block: _Block) -> None:
        outer = self._in_transpose
        self._in_transpose = outer or _is_transposed(eqn)
        try:
            self._eqn_in_scope(eqn, env, block)
        finally:
            self._in_transpose = outer

    def _eqn_in_scope(self, eqn, env: dict, block: _Block) -> None:
        prim = eqn.primitive.name
        if prim in INLINE:
            inner = eqn.params[INLINE[prim]]
            ins = [self._read(v, env, block) for v in eqn.invars]
            if isinstance(inner, ClosedJaxpr):
                outs = self._inline(inner.jaxpr, list(inner.consts), ins, block)
            else:
                outs = self._inline(inner, [], ins, block)
            self._bind_outs(eqn.outvars, outs, env)
            return
        if prim == "platform_index":
            # jax.lax.platform_dependent's branch index (its cond, and a differentiated
            # step's backward cond, read it): the default implementation's, a constant
            default = _default_branch(eqn.params["platforms"])
            (env[eqn.outvars[0]],) = self._emit(block, "full", [], {"value": default},
                                                [ir_type(eqn.outvars[0].aval, "an index")],
                                                "c")
            self._platform[env[eqn.outvars[0]]] = default
            return
        if prim == "custom_linear_solve":
            # jax.lax.custom_linear_solve (jnp.linalg.solve, and slogdet's gradient): its
            # value is its solve jaxpr's on the solve's constants and b (JAX's own impl);
            # its custom derivatives are already written out in a differentiated step
            ins = [self._read(v, env, block) for v in eqn.invars]
            lengths = eqn.params["const_lengths"]
            at = lengths.matvec + lengths.vecmat
            solve = eqn.params["jaxprs"].solve
            outs = self._inline(solve.jaxpr, list(solve.consts),
                                ins[at:at + lengths.solve] + ins[sum(lengths):], block)
            self._bind_outs(eqn.outvars, outs, env)
            return
        if prim in _CONTROL:
            self._bind_outs(eqn.outvars, getattr(self, f"_{prim}")(eqn, env, block), env)
            return
        ins = [self._read(v, env, block) for v in eqn.invars]
        in_types = [ir_type(v.aval, f"operand {i} of {prim}") for i, v in enumerate(eqn.invars)]
        out_types = [ir_type(v.aval, f"result {i} of {prim}")
                     for i, v in enumerate(eqn.outvars)]
        loc = self._loc(eqn)
        outs = None
        row = BY_PRIMITIVE.get(prim)
        if row is not None:
            more = {"mean": True} if prim == "div" and _made_by_jnp_mean(eqn) else {}
            view = EqnView(
                prim, eqn.params, ins, in_types, out_types,
                [_literal_value(v) for v in eqn.invars],
                lambda name, i, a, t: self._emit(block, name, i,
                                                 {**a, **more} if name == "div" else a, t,
                                                 name, loc))
            outs = row.convert(view)
        if outs is None:
            outs = self._opaque(eqn, ins, out_types, block, loc)
        self._bind_outs(eqn.outvars, outs, env)

    def _opaque(self, eqn, ins: list[str], out_types: list[TensorType], block: _Block,
                loc: str | None) -> list[str]:
        prim = eqn.primitive.name
        attrs: dict[str, Any] = {"target": f"jax:{prim}"}
        if eqn.effects:
            attrs["effectful"] = True
        if prim in KEYED_RANDOM:
            attrs["rng"] = "key"
        if prim == "scatter" and eqn.params.get("update_jaxpr") is not None:
            # x.at[i].apply(f): the backend rebuilds scatters from their kind and would
            # replace instead of applying f
            raise UnsupportedOpError(
                "scatter with a custom update function (x.at[...].apply(f)) is not supported",
                hint="use .at[...].set/add/multiply/min/max, or apply f before the scatter")
        for k, v in eqn.params.items():
            if k in DERIVED_PARAMS.get(prim, ()):
                continue
            if k in OPAQUE_RESERVED:
                raise UnsupportedOpError(
                    f"primitive {prim!r} has a parameter named {k!r}, which the opaque op "
                    "reserves", hint="this primitive needs a row in jax/ops.py")
            try:
                attrs[k] = encode(v)
            except EncodingError as e:
                raise UnsupportedOpError(
                    f"primitive {prim!r}: its parameter {k!r} holds {e}, which IR "
                    "attributes cannot hold (expected numbers, strings, dtypes, enums and "
                    "tuples of them)",
                    hint="keep this primitive out of the traced step (callbacks, shardings "
                         "and custom solvers are not supported yet)") from None
        return self._emit(block, "opaque", ins, attrs, out_types, prim.replace("-", "_"), loc)

    # ------------------------------------------------------------------ control flow
    def _check_params(self, eqn, known: set[str]) -> None:
        extra = set(eqn.params) - known
        if extra:
            raise UnsupportedOpError(
                f"{eqn.primitive.name} has parameter(s) {', '.join(sorted(extra))} this "
                f"frontend does not know (expected only {', '.join(sorted(known))})")

    def _cond(self, eqn, env: dict, block: _Block) -> list[str]:
        index = self._read(eqn.invars[0], env, block)
        if index in self._platform:
            # jax.lax.platform_dependent (jnp.diagonal, so slogdet), or a differentiated
            # step's backward cond on its index: one implementation per platform of the
            # same math, picked when XLA lowers it. The IR is made for any device, so it
            # holds the default one, inlined (the others are one backend's kernels)
            self._check_params(eqn, {"branches", "branches_platforms"})
            branch = eqn.params["branches"][self._platform[index]]
            ins = [self._read(v, env, block) for v in eqn.invars[1:]]
            return self._inline(branch.jaxpr, list(branch.consts), ins, block)
        self._check_params(eqn, {"branches"})
        ins = [self._read(v, env, block) for v in eqn.invars]
        regions = tuple(self._region(f"branch{i}", br, [])
                        for i, br in enumerate(eqn.params["branches"]))
        out_types = [ir_type(v.aval, "a cond result") for v in eqn.outvars]
        return self._emit(block, "cond", ins, {}, out_types, "cond", self._loc(eqn), regions)

    def _while(self, eqn, env: dict, block: _Block) -> list[str]:
        p = eqn.params
        self._check_params(eqn, {"cond_jaxpr", "body_jaxpr", "cond_nconsts", "body_nconsts"})
        ins = [self._read(v, env, block) for v in eqn.invars]
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts, carry = ins[:nc], ins[nc:nc + nb], ins[nc + nb:]
        # The loop's constants become captures, so inputs, arguments and results line up.
        regions = (self._region("cond", p["cond_jaxpr"], cconsts),
                   self._region("body", p["body_jaxpr"], bconsts))
        out_types = [ir_type(v.aval, "a while result") for v in eqn.outvars]
        return self._emit(block, "while", carry, {}, out_types, "while", self._loc(eqn),
                          regions)

    def _scan(self, eqn, env: dict, block: _Block) -> list[str]:
        p = eqn.params
        self._check_params(eqn, _SCAN_PARAMS)
        if p.get("_split_transpose", False):
            raise UnsupportedOpError("scan with _split_transpose=True is not supported")
        ins = [self._read(v, env, block) for v in eqn.invars]
        attrs: dict[str, Any] = {"length": int(p["length"]), "num_carry": int(p["num_carry"]),
                                 "num_consts": int(p["num_consts"]),
                                 "reverse": bool(p["reverse"])}
        unroll = p.get("unroll", 1)
        unroll = int(p["length"]) if unroll is True else int(unroll)
        if unroll != 1:
            attrs["unroll"] = unroll
        region = self._region("body", p["jaxpr"], [])
        out_types = [ir_type(v.aval, "a scan result") for v in eqn.outvars]
        return self._emit(block, "scan", ins, attrs, out_types, "scan", self._loc(eqn),
                          (region,))
