"""A step over a flax ``TrainState`` as the step convention the JAX frontend traces.

Flax's own training loops write ``step(state, batch, *rest) -> (new_state, *metrics)``, the
state holding the parameters, the optimizer state, a step counter and, in subclasses, model
state (``batch_stats``). ``TrainStateStep`` runs such a step as ``step(params, (opt_state,
counters), *rest, [model_state]) -> (params, (opt_state, counters), [model_state],
*metrics)``: the counters (fields whose leaves are single numbers: ``step``) travel with
the optimizer state, as optax's own count does, and the other fields as model state that
the step returns a new value of (``roles.returned_state``), as a flax variables dict's
``batch_stats`` passed apart does. Static fields (``apply_fn``, ``tx``) are those of the
state the step was traced with."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import FrontendError
from .roles import infer_batch_argnums


def is_train_state(x: Any) -> bool:
    """A flax ``TrainState`` or a dataclass like it: parameters, optimizer state and
    ``replace``."""
    return dataclasses.is_dataclass(x) and not isinstance(x, type) and \
        all(hasattr(x, a) for a in ("params", "opt_state", "replace"))


class TrainStateStep:
    """``step_fn(state, *rest)`` as ``step(params, (opt_state, counters), *rest, ...)``;
    ``args`` and ``result`` convert a call's arguments and the program's results."""

    def __init__(self, step_fn: Callable, state: Any, rest: tuple = ()) -> None:
        self.step_fn, self.template = step_fn, state
        self.rest = rest            # the call's other arguments (the batch, a key)
        nodes = [f.name for f in dataclasses.fields(state)
                 if f.metadata.get("pytree_node", True)
                 and f.name not in ("params", "opt_state")]
        self.counters = [n for n in nodes
                         if all(np.size(x) == 1 for x in jax.tree.leaves(getattr(state, n)))]
        self.held = [n for n in nodes if n not in self.counters]
        functools.update_wrapper(self, step_fn)

    def _fields(self, state: Any, names: list[str]) -> dict[str, Any]:
        return {n: getattr(state, n) for n in names}

    def args(self, args: tuple) -> tuple:
        """The traced step's arguments for a call ``step(state, *rest)``."""
        state, rest = args[0], args[1:]
        if type(state) is not type(self.template):
            raise FrontendError(f"the step was traced with a {type(self.template).__name__} "
                                f"as its first argument and is now given a "
                                f"{type(state).__name__}",
                                hint="pass the state the step returned")
        # (TrainState.create starts the step at a Python 0: an array, as under jax.jit)
        counters = jax.tree.map(jnp.asarray, self._fields(state, self.counters))
        out = (state.params, (state.opt_state, counters), *rest)
        return out + ((self._fields(state, self.held),) if self.held else ())

    def __call__(self, params: Any, opt: Any, *rest: Any) -> tuple:
        opt_state, counters = opt
        held: dict[str, Any] = {}
        if self.held:
            *rest, held = rest
        state = self.template.replace(params=params, opt_state=opt_state, **counters, **held)
        out = self.step_fn(state, *rest)
        if not isinstance(out, (tuple, list)) or not out or not is_train_state(out[0]):
            raise FrontendError(
                f"the step takes a {type(state).__name__} and returns "
                f"{type(out).__name__}; expected (new_state, *metrics)",
                hint="return state.apply_gradients(grads=grads), loss")
        new = out[0]
        result = (new.params, (new.opt_state, self._fields(new, self.counters)))
        result += (self._fields(new, self.held),) if self.held else ()
        return (*result, *out[1:])

    def result(self, out: Any, args: tuple) -> tuple:
        """The user's ``(new_state, *metrics)`` from the program's results for ``args``."""
        opt_state, counters = out[1]
        k = 3 if self.held else 2
        held = out[2] if self.held else {}
        new = args[0].replace(params=out[0], opt_state=opt_state, **counters, **held)
        return (new, *out[k:])

    def user_state(self, state: Any, convert: Callable[[Any, int], Any]) -> Any | None:
        """``state`` (a TrainState the step returned) with its parameters and optimizer
        state put through ``convert(tree, argnum)`` (the runner's ``user_shapes``); None
        when ``state`` is not of the traced state's type."""
        if type(state) is not type(self.template):
            return None
        parts = self.args((state,))
        out = (convert(parts[0], 0), convert(parts[1], 1), *parts[2:])
        return self.result(out, (state,))[0]

    def batch_argnums(self, nums: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """The traced step's argument numbers of the user's batch arguments (the state,
        argument 0, becomes arguments 0 and 1). Not given: inferred among the user's own
        arguments, the model state the TrainState holds (``batch_stats``, passed last) left
        out: its rows are a layer's features, even where they number the batch's rows."""
        if nums is None:
            return infer_batch_argnums((None, None, *self.rest)) if self.held else None
        if 0 in nums:
            raise FrontendError("batch_argnums names argument 0, the TrainState",
                                hint="name the batch's own argument numbers (1, ...)")
        return tuple(k + 1 for k in nums)


def adapt(step_fn: Callable, args: tuple) -> TrainStateStep | None:
    """A ``TrainStateStep`` when the step's first argument is a TrainState, else None."""
    return TrainStateStep(step_fn, args[0], tuple(args[1:])) \
        if args and is_train_state(args[0]) else None
