"""The JAX frontend's entry point: a whole training step, via jax.make_jaxpr, into an IR Graph."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ..errors import DiphomaError, FrontendError, user_line
from ..ir.core import (Graph, Input, InputKind, InputRole, NameSupply, Op, Output, OutputKind,
                       Value)
from ..ir.analysis import free_inputs
from ..ir.rewrite import rename_uses
from ..ir.verify import verify
from .convert import JaxprConverter
from .phases import assign_phases
from .roles import StepSignature, numbers_as_arrays, step_inputs, step_outputs
from .trees import remember_tree

def _rename_results(ops: list[Op], mapping: dict[str, str]) -> tuple[Op, ...]:
    """Top-level ops with results (and every use) renamed by ``mapping``."""
    renamed = []
    for op in ops:
        if any(v.name in mapping for v in op.results):
            op = op.replace(results=tuple(Value(mapping.get(v.name, v.name), v.type)
                                          for v in op.results))
        renamed.append(op)
    return rename_uses(tuple(renamed), mapping)


def _graph_name(fn: Callable) -> str:
    name = getattr(fn, "__name__", "step")
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", name) or "step"


def trace_jax(step_fn: Callable, *example_args: Any, **options: Any) -> Graph:
    """Trace ``step_fn(*example_args)`` with jax.make_jaxpr into a verified IR Graph (see
    ``trace_jax_with_tree`` for the options)."""
    return trace_jax_with_tree(step_fn, *example_args, **options)[0]


# what make_jaxpr raises where the step needs an array's value while it is traced
_DATA_DEPENDENT = (jax.errors.ConcretizationTypeError, jax.errors.NonConcreteBooleanIndexError,
                   jax.errors.TracerArrayConversionError,
                   jax.errors.TracerIntegerConversionError)


def _data_dependent(e: Exception) -> FrontendError:
    """A FrontendError for a step that needs an array's value while traced: a boolean mask
    index (its result's size is the data's), Python control flow on an array, an array read
    into a Python number or NumPy array; naming the user's line."""
    at = _user_line(e)
    at = f" at {at}" if at else ""
    if isinstance(e, jax.errors.NonConcreteBooleanIndexError):
        return FrontendError(
            f"the size of a value the step computes depends on array data{at}: a boolean "
            "mask index (x[mask]) keeps as many elements as the data says, and a traced step "
            "has static shapes",
            hint="keep every element and weight by the mask instead "
                 "(jnp.sum(per_example * keep) / jnp.sum(keep)), or jnp.where(mask, x, 0) for "
                 "a selection; jnp.nonzero and jnp.unique take size= for a static size. "
                 "Under data parallelism such a mean is each device's over its own kept "
                 "rows, averaged (as under DDP; the plan lists it): divide by the rows "
                 "(keep.size) instead for the batch's exact value")
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return FrontendError(
        f"the step branches on, or reads into Python, a value that depends on array data"
        f"{at} ({type(e).__name__}: {first})",
        hint="use jnp.where, jax.lax.cond or jax.lax.select for a decision on array values, "
             "keep arrays as arrays (no float(x), int(x), np.asarray(x)), or move the "
             "decision out of the step")


def _forward_scalar(ops: list[Op], outs: list[str], roles: list, leaves: list,
                    transposed: set[str]) -> int | None:
    """Where the loss taken (the first scalar float metric, or one named loss) is made
    from the backward pass (a gradient norm returned before the loss, ``(gnorm, loss)``),
    the flat index of the one scalar float metric made by the forward alone; else None
    (with several, as ``(gnorm, accuracy, loss)``, which is the loss cannot be told: name
    it loss in a dict). The backward is what autodiff transposed."""
    at = next((k for k, (_, r) in enumerate(roles) if r.kind is OutputKind.loss), None)
    if at is None or not transposed:
        return None
    tainted: set[str] = set()
    for op in ops:
        if any(v.name in transposed for v in op.results) or \
                any(n in tainted for n in free_inputs(op)):
            tainted.update(v.name for v in op.results)
    if outs[at] not in tainted:
        return None
    forward = [k for k, (_, r) in enumerate(roles)
               if r.kind is OutputKind.metric and outs[k] not in tainted
               and leaves[k].shape == ()
               and jax.numpy.issubdtype(leaves[k].dtype, jax.numpy.floating)]
    return forward[0] if len(forward) == 1 else None


def _failed(e: Exception, args: tuple = (), sig: StepSignature | None = None
            ) -> FrontendError:
    """A FrontendError for any other failure while the step is traced (an attribute the
    model's output lacks, a gradient of a non-scalar), naming the user's line; the
    exception is chained. Where the optimizer state has 1-D leaves shaped as no parameter
    (a parallelized step's flat, padded storage), the hint says to convert it first."""
    at = _user_line(e)
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    hint = "the chained exception has the traceback"
    if sig is not None and _stored_flat(args, sig):
        hint = ("if this optimizer state (or these parameters) came from a parallelized "
                "step, it holds some leaves flat and padded: give pstep.user_shapes(tree) "
                "instead; " + hint)
    return FrontendError(f"tracing the step failed{f' at {at}' if at else ''}: "
                         f"{type(e).__name__}: {first}", hint=hint)


def _stored_flat(args: tuple, sig: StepSignature) -> bool:
    """Whether the optimizer state holds a 1-D leaf shaped as no parameter leaf."""
    if max(sig.params_argnum, sig.opt_state_argnum) >= len(args):
        return False
    shapes = {np.shape(x) for x in jax.tree.leaves(args[sig.params_argnum])}
    return any(np.ndim(x) == 1 and np.shape(x) not in shapes
               for x in jax.tree.leaves(args[sig.opt_state_argnum]))


def _user_line(e: BaseException) -> str | None:
    """``file:line: code`` of the user's innermost frame: outside JAX and this package."""
    import jaxlib
    return user_line(e, tuple(os.path.dirname(m.__file__) + os.sep
                              for m in (jax, jaxlib, sys.modules["diphoma_compile"])))


def _unplaced(x: Any) -> Any:
    """An array laid out over several devices as its shape and dtype alone: traced as it
    is, its sharding (a mesh's, from an earlier parallelized step) becomes a parameter of the
    ops it meets, which the IR does not hold; the plan, not the example, places it."""
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and \
            len(x.sharding.device_set) > 1:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type)
    return x


def trace_jax_with_tree(step_fn: Callable, *example_args: Any, params_argnum: int = 0,
                        opt_state_argnum: int = 1, batch_argnums: tuple[int, ...] = (2,),
                        locations: bool = True) -> tuple[Graph, Any]:
    """Trace ``step_fn(*example_args)`` with jax.make_jaxpr into a verified IR Graph.

    The step follows ``step(params, opt_state, batch, *rest) -> (params, opt_state,
    *metrics)`` over pytrees of arrays; the argnum options say which argument is which.
    Leaves of other arguments are ``rng`` (PRNG keys), ``hyper`` (single numbers: learning
    rates, step counts) or ``other``; a flax variables dict as the parameters holds
    ``buffer`` leaves in its collections other than "params" (``roles.flax_state``). The
    first scalar float metric is the loss. ``locations`` records the user's file:line on
    each op. Returns the graph and the PyTreeDef of the step's result."""
    sig = StepSignature(params_argnum, opt_state_argnum, tuple(batch_argnums))
    sig.check(len(example_args))
    example_args = numbers_as_arrays(example_args)
    inputs = step_inputs(example_args, sig)
    try:
        closed, out_shape = jax.make_jaxpr(step_fn, return_shape=True)(
            *jax.tree.map(_unplaced, example_args))
    except _DATA_DEPENDENT as e:
        raise _data_dependent(e) from e
    except TypeError as e:
        if "JAX type" not in str(e):
            raise _failed(e, example_args, sig) from e
        raise FrontendError(f"the step returned a value that is not a pytree of arrays: {e}",
                            hint="return (params, opt_state, *metrics) with array leaves") \
            from None
    except DiphomaError:
        raise
    except Exception as e:      # JAX and the user's code raise many types: name the line
        raise _failed(e, example_args, sig) from e
    roles = step_outputs(out_shape, example_args, sig, inputs)
    # an argument the step returns updated is model state (``roles.returned_state``)
    replaced = {r.target for _, r in roles if r.kind is OutputKind.replaces}
    inputs = [Input(i.value, InputRole(InputKind.buffer))
              if i.name in replaced and i.role.kind in (InputKind.other, InputKind.hyper)
              else i for i in inputs]

    names = NameSupply({i.name for i in inputs})
    converter = JaxprConverter(names, locations)
    ops, outs = converter.convert(closed, [i.name for i in inputs])
    if len(outs) != len(roles):
        raise FrontendError(f"the jaxpr has {len(outs)} outputs but the step's result has "
                            f"{len(roles)} leaves")
    better = _forward_scalar(ops, outs, roles, jax.tree.leaves(out_shape),
                             set(converter.transposed))
    if better is not None:
        roles = step_outputs(out_shape, example_args, sig, inputs, loss_at=better)
    # Name each output value after its place in the result (new/params/..., loss), unless
    # it is an input passed through or already named for an earlier output.
    input_names = {i.name for i in inputs}
    mapping: dict[str, str] = {}
    for value, (preferred, _) in zip(outs, roles):
        if value not in input_names and value not in mapping:
            mapping[value] = names(preferred)
    outputs = tuple(Output(mapping.get(v, v), role) for v, (_, role) in zip(outs, roles))
    graph = Graph(_graph_name(step_fn), tuple(inputs), _rename_results(ops, mapping), outputs)
    backward = {mapping.get(n, n) for n in converter.transposed}
    graph = verify(assign_phases(graph, backward))
    tree = jax.tree.structure(out_shape)
    remember_tree(graph, tree, tuple(jax.tree.structure(a) for a in example_args))
    return graph, tree
