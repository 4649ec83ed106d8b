"""JAX behind the Framework protocol (``diphoma_compile.framework``)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import jax
import numpy as np

from ..batch_rows import check_batch_rows
from ..errors import BackendError, FrontendError, MeshError
from ..ir.analysis import runs_on_one_device
from ..ir.core import Graph
from ..ir.device_model import DeviceModel
from ..mesh import Mesh, pipeline_axis
from . import op_rules  # noqa: F401 - registers the rules of the primitives kept opaque
from .roles import (StepSignature, batch_rows, infer_batch_argnums, path_name,
                    returned_state)


class JaxFramework:
    """Steps ``step(params, opt_state, batch, *rest)`` over pytrees; jax.jit on a mesh."""

    name = "jax"
    packages = ("jax", "jaxlib", "flax", "optax")
    # shardings need even splits: a dimension N divides, else the padded flat form stored
    # as a 1-D array (jax/layout.py)
    update_layout = "dims-or-flat"
    # a pipeline's stages run values split along a dimension only (jax/pipeline.py)
    pipeline_update_layout = "dims"
    backend = ("jax.jit over jax.shard_map with NamedSharding in/out; the collectives are "
               "explicit, so buckets run as planned (XLA's combiner thresholds are not used)")

    def owns(self, args: tuple) -> bool:
        """Any step once jax is imported and no other framework claimed it."""
        return True

    def device(self, args: tuple) -> tuple[str, str]:
        """JAX's default backend's first device (where the step's arrays are placed)."""
        import jax
        d = jax.devices()[0]
        return (d.platform, getattr(d, "device_kind", ""))

    def measure_device(self, args: tuple) -> DeviceModel:
        """JAX's first device measured (jax/calibrate.py; the link is the base model's)."""
        from .calibrate import measure_device
        return measure_device()

    def trace(self, step_fn: Callable, args: tuple, **options: Any) -> tuple[Graph, Any]:
        """The step's IR and the PyTreeDef of its result."""
        from .trace import trace_jax_with_tree
        _check_codegen(options.pop("codegen", None))
        return trace_jax_with_tree(step_fn, *args, **options)

    def trace_local(self, step_fn: Callable, args: tuple, mesh: Mesh, axis: str, *,
                    batch_argnums: tuple[int, ...] | None = None,
                    codegen: str | None = None, microbatches: int = 1,
                    probe_rows: int = 1) -> tuple[Graph, Any]:
        """The step at the per-device batch: each batch leaf's dim 0 divided by N. The batch
        is ``batch_argnums``, or argument 2 and the later arguments with its rows. With a
        pipeline axis, at one microbatch: the device's share divided by ``microbatches``.
        ``probe_rows``: at that many times those rows (the batch analysis's probe of a
        share of one row)."""
        _check_codegen(codegen)
        pp = pipeline_axis(mesh)
        staged = pp is not None and mesh.axis_size(pp) > 1
        if microbatches != 1 and not staged:
            raise FrontendError("microbatches are for pipeline parallelism, and the mesh "
                                "has no pp axis of several devices",
                                hint="add a pp axis to the mesh, or leave microbatches unset")
        # the global batch is cut into the data axis's shares, each into M microbatches
        n = (1 if staged and axis == pp else mesh.axis_size(axis)) * microbatches
        if batch_argnums is None:
            state = _state_argnums(step_fn, args)
            if getattr(step_fn, "held", False):
                # an adapter's model state (flax.nnx's BatchNorm statistics, a TrainState's
                # batch_stats), its last argument: never batch, whatever its rows
                # (BatchNorm(16) at a batch of 16)
                state = (*state, len(args) - 1)
            nums = infer_batch_argnums(args, state=state)
            check_rows_pair(step_fn, args, nums, n)
        else:
            nums = tuple(batch_argnums)
            StepSignature(batch_argnums=nums).check(len(args))
        among = (f"{n // microbatches} data-parallel shares x {microbatches} microbatches"
                 if staged else None)
        return self.trace(step_fn, local_args(args, n, axis, nums, among,
                                              times=probe_rows),
                          batch_argnums=nums)

    def compile(self, graph: Graph, extra: Any) -> Callable:
        """The graph under jax.jit on one device, returning the step's own result tree."""
        from .compile import compile_jax
        return compile_jax(graph, out_tree=extra)

    def parallel_runner(self, graph: Graph, extra: Any, user_mesh: Any, mesh: Mesh,
                        axis: str, donate: bool | None = None) -> Callable:
        """jax.jit over shard_map on the user's mesh (or one made from ``mesh``); on a mesh
        of one device, the single-device program under jax.jit, as ``compile`` runs it.
        ``donate`` None: the mesh's step (data-parallel or pipelined) donates parameters
        and optimizer state (the old model's buffers hold the new one; docs/jax.md), the
        one-device step does not (it is ``compile``'s program, straight into jax.jit)."""
        from ..passes.pipeline_parallel import pipeline_of
        from .comm_state import JaxCommStateStep, has_comm_state
        from .parallel import JaxOneDeviceStep, JaxParallelStep
        if pipeline_of(graph) is not None:
            from .pipeline import JaxPipelineStep
            return JaxPipelineStep(graph, extra, mesh=user_mesh,
                                   donate=True if donate is None else donate)
        if runs_on_one_device(graph):
            return JaxOneDeviceStep(graph, extra, mesh=user_mesh, donate=bool(donate))
        donate = True if donate is None else donate
        if has_comm_state(graph):
            return JaxCommStateStep(graph, extra, mesh=user_mesh, axis=axis, donate=donate)
        return JaxParallelStep(graph, extra, mesh=user_mesh, axis=axis, donate=donate)

    def in_place_updates(self, graph: Graph, cuts: list | None = None) -> set[str]:
        """None: the plan counts old and new values side by side. (A step over a mesh
        donates its parameters and state by default, which the runner decides after the
        plan is made; the planned peak does not count it yet.)"""
        return set()

    def kernel_written(self, graph: Graph, cuts: list | None = None) -> set[str]:
        """None: XLA places its buffers itself."""
        return set()

    def collective_scratch(self, graph: Graph, device_model: str) -> dict[int, int]:
        """None counted: XLA places the collectives' buffers itself."""
        return {}

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

    def adapt_step(self, step_fn: Callable, args: tuple) -> Any | None:
        """A step over a flax TrainState (``train_state.py``) or over flax.nnx objects
        (``nnx_step.py``) as the traced convention."""
        from .train_state import adapt
        adapter = adapt(step_fn, args)
        if adapter is None and "flax" in sys.modules:
            from .nnx_step import NnxStep, leading_objects
            if leading_objects(args):
                return NnxStep(step_fn, args)
        return adapter

    def inspect_target(self) -> ModuleType:
        """The module building inspect's step from a flax model file or a step."""
        from . import inspect_target
        return inspect_target

    def pipeline_actions(self, schedule: str, stages: int, microbatches: int,
                         ranks: int) -> tuple[tuple[tuple[str, int, int], ...], ...]:
        """Each rank's (kind, microbatch, stage) actions: the orders the JAX runtime runs."""
        from .pipeline import schedule_orders
        return schedule_orders(schedule, ranks, microbatches, stages)


def _resized(args: tuple, nums: Sequence[int], size: Callable[[str, Any], Any]) -> tuple:
    """``args`` with each leaf of the arguments ``nums`` replaced by ``size(name, leaf)``."""
    sig = StepSignature(batch_argnums=tuple(nums))
    out = list(args)
    for k in nums:
        out[k] = jax.tree_util.tree_map_with_path(
            lambda path, x, k=k: size(path_name(sig.prefix(k), path), x), args[k])
    return tuple(out)


def _check_rows_within(args: tuple, nums: Sequence[int], among: str) -> None:
    """MeshError for a leaf of a batch argument that cannot be split with it
    (``batch_rows.check_batch_rows``: a per-class table in the batch dict)."""
    sig = StepSignature(batch_argnums=tuple(nums))
    for k in nums:
        check_batch_rows(
            [(path_name(sig.prefix(k), path), int(np.shape(x)[0]))
             for path, x in jax.tree_util.tree_leaves_with_path(args[k]) if np.ndim(x) >= 1],
            among, f"pass {{name}} as an argument of its own after the batch, with "
                   f"batch_argnums=({k},) (an argument outside the batch is whole on every "
                   "device)")


def local_args(args: tuple, n: int, axis: str, batch_argnums: Sequence[int] = (2,),
               among: str | None = None, times: int = 1) -> tuple:
    """The step's arguments with each batch leaf's dim 0 divided among ``n`` devices (as
    abstract shapes: tracing reads no data), times ``times``; ``among`` says what the n
    parts are, for the error (default: the devices of ``axis``)."""
    among = among or f"the {n} devices of axis {axis!r}"
    nums = [k for k in batch_argnums if k < len(args)]
    if n > 1:
        _check_rows_within(args, nums, among)

    def local(name: str, x: Any) -> Any:
        shape = getattr(x, "shape", None)
        if shape is None or len(shape) == 0:
            raise MeshError(f"batch leaf {name} is a scalar; the batch is split along its "
                            f"first dimension over axis {axis!r}",
                            hint="move it out of the batch into an argument of its own "
                                 "(a scalar argument is whole on every device), or, if the "
                                 "batch is another argument, name it with batch_argnums=")
        if shape[0] % n:
            raise MeshError(f"batch leaf {name} has {shape[0]} examples, which do not divide "
                            f"among {among}",
                            hint=f"use a global batch that is a multiple of {n}")
        return jax.ShapeDtypeStruct((shape[0] // n * times, *shape[1:]), x.dtype)
    return _resized(args, nums, local)


def _state_argnums(step_fn: Callable, args: tuple) -> tuple[int, ...]:
    """The arguments the step returns a new value of (model state such as haiku's: not
    batch), from its abstract result; none when it cannot be evaluated so (the trace then
    says why). Only evaluated when arguments follow the batch. Argument 2 is a candidate
    only where it cannot be the batch (its first leaf has no rows: equinox's state, whose
    first leaf is a BatchNorm's first-call flag, passed before the batch)."""
    if len(args) <= 3:
        return ()
    try:
        out = jax.eval_shape(step_fn, *args)
    except Exception:       # the trace that follows reports the step's own error
        return ()
    if not isinstance(out, (tuple, list)) or len(out) < 3:
        return ()
    sig = StepSignature(batch_argnums=(2,) if batch_rows(args[2]) is not None else ())
    return tuple(returned_state(out, args, sig).values())


def check_rows_pair(step_fn: Callable, args: tuple, nums: Sequence[int], n: int) -> None:
    """FrontendError unless each batch argument after the first, found by its number of
    rows alone, does pair with the batch's rows: with the other batch arguments cut to a
    device's share and it left whole, the step must fail to trace. One that traces anyway
    is a value with the batch's size by coincidence (a per-feature weight, a table), or
    one whose rows meet the batch's only through reductions: splitting it is a guess."""
    if n == 1 or len(nums) < 2:
        return                     # nothing is split, or nothing was inferred
    rows = batch_rows(args[nums[0]]) or 0
    # a share of one row broadcasts against any number of rows: probe with two or more
    factor = (lambda d: d // n) if rows // n >= 2 else (lambda d: d * 2)

    def cut(name: str, x: Any) -> Any:
        shape = np.shape(x)
        return jax.ShapeDtypeStruct((factor(shape[0]), *shape[1:]) if shape else shape,
                                    x.dtype)
    for k in nums[1:]:
        try:
            jax.eval_shape(step_fn, *_resized(args, [j for j in nums if j != k], cut))
        except Exception:     # any failure says its rows meet the batch's
            continue
        raise FrontendError(
            f"step argument {k} has the batch's {rows} rows, but the step also runs with "
            f"it whole while the batch (argument {nums[0]}) is cut to a device's share: its "
            "rows need not be the batch's examples, so splitting it would be a guess",
            hint=f"pass batch_argnums= to parallelize: {tuple(nums)} if it is batch "
                 f"(split with it), or {tuple(j for j in nums if j != k)} to give it whole "
                 "to every device")


FRAMEWORK = JaxFramework()


def _check_codegen(codegen: str | None) -> None:
    """A JAX step is compiled by XLA under jax.jit: ``codegen`` is None (or "xla")."""
    if codegen not in (None, "auto", "xla"):
        raise BackendError(f"codegen={codegen!r} is for PyTorch steps; a JAX step is "
                           "compiled by XLA (jax.jit)", hint="leave codegen unset")
