"""A step over flax.nnx objects as the step convention the JAX frontend traces.

flax.nnx writes ``train_step(model, optimizer, batch, *rest) -> loss`` (or metrics), the
step updating the model and the optimizer in place (``optimizer.update(model, grads)``),
run under ``nnx.jit``. ``NnxStep`` runs it as ``step(params, (opt_state, counters),
batch, *rest, [model_state]) -> (params, (opt_state, counters), [model_state],
*metrics)``, as ``nnx.jit`` does: the leading nnx objects are split into their ``Param``
variables, the optimizer's state (``OptState``), the other variables whose values are
single numbers or keys (the ``Rngs`` streams' counts and keys, travelling with the
optimizer state) and the rest (``BatchStat``: model state the step returns). The objects
are merged inside the traced function, the step runs on them, and their new state is
split out again; after each call the user's own objects are updated in place
(``nnx.update``), as the eager step would leave them."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from flax.nnx import graph as nnx_graph

from ..errors import FrontendError


def _single(path: Any, value: Any) -> bool:
    """A variable whose value is one number or one key (an Rngs stream's count, key)."""
    return all(np.size(x) == 1 for x in jax.tree.leaves(value))


_FILTERS = (nnx.Param, nnx.OptState, _single, ...)


def leading_objects(args: tuple) -> int:
    """How many leading arguments are nnx objects (modules, optimizers)."""
    k = 0
    while k < len(args) and nnx_graph.is_graph_node(args[k]):
        k += 1
    return k


class NnxStep:
    """``step_fn(model, optimizer, ..., *rest)`` as the traced convention; ``args`` and
    ``result`` convert a call's arguments and the program's results."""

    # the program's new state goes into the user's objects, which must hold it in the
    # user's shapes (``ParallelStep`` gives stored flat leaves their shapes back first)
    writes_back = True

    def __init__(self, step_fn: Callable, args: tuple) -> None:
        self.step_fn, self.k = step_fn, leading_objects(args)
        objects = args[:self.k]
        if not any(isinstance(o, nnx.Optimizer) for o in objects):
            raise FrontendError("the step takes nnx objects but no nnx.Optimizer among its "
                                "leading arguments: the traced step updates parameters "
                                "through an optimizer it is given",
                                hint="pass the nnx.Optimizer to the step after the model: "
                                     "train_step(model, optimizer, batch)")
        self.graphdef, _, _, _, held = nnx.split(objects, *_FILTERS)
        self.held = bool(jax.tree.leaves(held))
        self.returns_tuple = False
        functools.update_wrapper(self, step_fn)

    def args(self, args: tuple) -> tuple:
        """The traced step's arguments for a call ``step(*objects, *rest)``."""
        if leading_objects(args) != self.k:
            raise FrontendError(f"the step was traced with {self.k} nnx objects leading its "
                                f"arguments and is now given {leading_objects(args)}",
                                hint="pass the same model and optimizer")
        _, params, opt_state, counters, held = nnx.split(args[:self.k], *_FILTERS)
        out = (params, (opt_state, counters), *args[self.k:])
        return out + ((held,) if self.held else ())

    def __call__(self, params: Any, opt: Any, *rest: Any) -> tuple:
        opt_state, counters = opt
        states = [params, opt_state, counters]
        if self.held:
            *rest, held = rest
            states.append(held)
        objects = nnx.merge(self.graphdef, *states)
        out = self.step_fn(*objects, *rest)
        self.returns_tuple = isinstance(out, (tuple, list))
        metrics = tuple(out) if self.returns_tuple else (out,)
        _, params, opt_state, counters, held = nnx.split(objects, *_FILTERS)
        result = (params, (opt_state, counters)) + ((held,) if self.held else ())
        return (*result, *metrics)

    def result(self, out: Any, args: tuple) -> Any:
        """Update the user's objects with the program's new state; the step's own
        return value."""
        states = [out[0], *out[1]] + ([out[2]] if self.held else [])
        nnx.update(args[:self.k], *states)
        metrics = tuple(out[3 if self.held else 2:])
        return metrics if self.returns_tuple else metrics[0]

    def batch_argnums(self, nums: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """The traced step's argument numbers of the user's batch arguments."""
        if nums is None:
            return None
        if any(k < self.k for k in nums):
            raise FrontendError("batch_argnums names an nnx object",
                                hint=f"name arguments from {self.k} on")
        return tuple(k - self.k + 2 for k in nums)
