"""The public entry points: trace a training step into the IR, or compile it to run."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from .errors import FrontendError
from .ir.core import Graph
from .passes.base import PassContext, Pipeline


def _framework(args: tuple) -> str:
    if "torch" in sys.modules:
        from .frontends.torch_trace import is_torch_step
        if is_torch_step(args):
            return "torch"
    if "jax" in sys.modules:
        return "jax"
    raise FrontendError("no PyTorch module/optimizer/tensor and no JAX array among the "
                        "example arguments", hint="pass the step's real example arguments")


def trace(step_fn: Callable, *example_args: Any, **options: Any) -> Graph:
    """The IR graph of a whole training step (forward, loss, backward, optimizer update).

    PyTorch steps take their modules and optimizers as arguments (or in their closure);
    JAX steps follow ``step(params, opt_state, batch, *rest)``."""
    if _framework(example_args) == "torch":
        from .frontends.torch_trace import trace_torch
        return trace_torch(step_fn, *example_args)[0]
    from .frontends.jax_trace import trace_jax
    return trace_jax(step_fn, *example_args, **options)


def compile(step_fn: Callable, *example_args: Any, passes: str = "") -> Any:
    """A callable with ``step_fn``'s signature that runs the traced (and transformed) step.

    For PyTorch it updates the live module and optimizer exactly as the eager step would."""
    if _framework(example_args) != "torch":
        from .backends.jax_compile import compile_jax
        from .frontends.jax_trace import trace_jax_with_tree
        # this step's own output structure, whatever passes do to the graph
        graph, tree = trace_jax_with_tree(step_fn, *example_args)
        graph = Pipeline.from_spec(passes).run(graph, PassContext()) if passes else graph
        return compile_jax(graph, out_tree=tree)
    from .backends.torch_runtime import TorchStep
    from .frontends.torch_trace import trace_torch
    graph, cap = trace_torch(step_fn, *example_args)
    if passes:
        graph = Pipeline.from_spec(passes).run(graph, PassContext())
    return TorchStep(graph, cap)
