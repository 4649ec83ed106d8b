"""JAX behind the Framework protocol (``diphoma_compile.framework``)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import jax

from ..errors import MeshError
from ..ir.core import Graph
from ..mesh import Mesh


class JaxFramework:
    """Steps ``step(params, opt_state, batch, *rest)`` over pytrees; jax.jit on a mesh."""

    name = "jax"
    packages = ("jax", "jaxlib", "flax", "optax")
    update_layout = "dims"       # shardings need even splits of whole dimensions
    backend = ("jax.jit over jax.shard_map with NamedSharding in/out; the collectives are "
               "explicit, so buckets run as planned (XLA's combiner thresholds are not used)")

    def owns(self, args: tuple) -> bool:
        """Any step once jax is imported and no other framework claimed it."""
        return True

    def trace(self, step_fn: Callable, args: tuple, **options: Any) -> tuple[Graph, Any]:
        """The step's IR and the PyTreeDef of its result."""
        from .trace import trace_jax_with_tree
        return trace_jax_with_tree(step_fn, *args, **options)

    def trace_local(self, step_fn: Callable, args: tuple, mesh: Mesh, axis: str
                    ) -> tuple[Graph, Any]:
        """The step at the per-device batch: the global batch's dim 0 divided by N."""
        return self.trace(step_fn, local_args(args, mesh.axis_size(axis), axis))

    def compile(self, graph: Graph, extra: Any) -> Callable:
        """The graph under jax.jit on one device, returning the step's own result tree."""
        from .compile import compile_jax
        return compile_jax(graph, out_tree=extra)

    def parallel_runner(self, graph: Graph, extra: Any, user_mesh: Any, mesh: Mesh,
                        axis: str) -> Callable:
        """jax.jit over shard_map on the user's mesh (or one made from ``mesh``)."""
        from .parallel import JaxParallelStep
        return JaxParallelStep(graph, extra, mesh=user_mesh, axis=axis)

    def module_kinds(self) -> dict[str, tuple[type, ...]]:
        """``flax-module`` (linen) and ``nnx-module``, when the file imported flax."""
        out: dict[str, tuple[type, ...]] = {}
        if "flax" not in sys.modules:
            return out
        try:
            import flax.linen as linen
            out["flax-module"] = (linen.Module,)
        except ImportError:     # pragma: no cover - a broken flax install
            pass
        try:
            from flax import nnx
            out["nnx-module"] = (nnx.Module,)
        except ImportError:     # pragma: no cover
            pass
        return out

    def inspect_target(self) -> ModuleType:
        """The module building inspect's step from a flax model file or a step."""
        from . import inspect_target
        return inspect_target


def local_args(args: tuple, n: int, axis: str, batch_argnum: int = 2) -> tuple:
    """The step's arguments with each batch leaf's dim 0 divided among ``n`` devices (as
    abstract shapes: tracing reads no data)."""
    if len(args) <= batch_argnum:
        return args

    def local(path, x):
        shape = getattr(x, "shape", None)
        if shape is None or len(shape) == 0:
            raise MeshError(f"batch leaf {jax.tree_util.keystr(path)} is a scalar; the batch "
                            f"is split along its first dimension over axis {axis!r}")
        if shape[0] % n:
            raise MeshError(f"batch leaf {jax.tree_util.keystr(path) or '(the batch)'} has "
                            f"{shape[0]} examples, which do not divide among the {n} devices "
                            f"of axis {axis!r}",
                            hint=f"use a global batch that is a multiple of {n}")
        return jax.ShapeDtypeStruct((shape[0] // n, *shape[1:]), x.dtype)
    batch = jax.tree_util.tree_map_with_path(local, args[batch_argnum])
    return (*args[:batch_argnum], batch, *args[batch_argnum + 1:])


FRAMEWORK = JaxFramework()
