"""``parallelize(step_fn, mesh)``: the single-device training step as a distributed one.

The ParallelStep traces the step on its first call (or on ``.trace(*args)``, which plans
without running), runs the pass pipeline — by default data parallelism plus weight-update
sharding over the mesh's data axis — and hands the final IR to the framework's backend.

Conventions, as each framework's users expect them:
- PyTorch follows DDP: each rank (a torchrun process) passes its own local batch; the step
  is traced at that shape and the loss it returns is the mean over all ranks.
- JAX takes the global batch, which the step shards over the data axis; the step is traced
  at the per-device shape (global / N)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import DiphomaError, MeshError
from .ir.core import Graph, InputKind
from .mesh import Mesh
from .passes.base import PassContext, Pipeline
from .plan import Plan, build_plan

DATA_AXIS_NAMES = ("dp", "data", "batch")
BACKENDS = {
    "torch": "torch.distributed per-rank program; collectives run as planned (buckets packed, "
             "async ones waited where first needed)",
    "jax": "jax.jit over jax.shard_map with NamedSharding in/out; the collectives are explicit, "
           "so buckets run as planned (XLA's combiner thresholds are not used)",
}


def data_axis(mesh: Mesh, axis: str | None) -> str:
    """The mesh axis the batch is split over: ``axis``, the only axis, or one named like
    dp/data/batch; MeshError naming the axes otherwise."""
    names = mesh.names
    if axis is not None:
        if axis not in names:
            raise MeshError(f"the mesh has no axis {axis!r} (it has "
                            f"{', '.join(names) or 'no axes'})",
                            hint="name one of the mesh's axes, or build the mesh with it")
        return axis
    if len(names) == 1:
        return names[0]
    for n in DATA_AXIS_NAMES:
        if n in names:
            return n
    raise MeshError(f"cannot tell which of the mesh axes {', '.join(names) or '(none)'} is "
                    "the data axis", hint="pass axis='...' to parallelize")


def default_passes(framework: str, axis: str, grad_bytes: int | None = None) -> str:
    """The default pipeline: data parallelism plus weight-update sharding over ``axis``,
    then communication fusion and scheduling. JAX shardings need even splits, so there the
    update is split by dimensions. Given the gradient bytes, buckets are a quarter of them
    (so the first can overlap the rest of backward), between 1 and 25 MB."""
    layout = "flat" if framework == "torch" else "dims"
    spec = (f"dce,data-parallel{{axis={axis}}},"
            f"weight-update-sharding{{axis={axis}, layout={layout}}},dce")
    if grad_bytes is None:
        return spec
    return spec + f",comm-fusion{{bucket-mb={bucket_mb(grad_bytes):g}}},schedule-comm"


def bucket_mb(grad_bytes: int) -> float:
    """The default bucket size for a model with this many bytes of gradients."""
    return round(min(25.0, max(1.0, grad_bytes / 4 / 1e6)), 1)


class ParallelStep:
    """A callable with the step's signature that runs it distributed over a mesh."""

    def __init__(self, step_fn: Callable, mesh: Any, *, passes: str | None = None,
                 axis: str | None = None) -> None:
        self.step_fn = step_fn
        self.user_mesh = mesh
        self.mesh = Mesh.of(mesh)
        self.axis = data_axis(self.mesh, axis)
        self.passes = passes
        self.framework: str | None = None
        self._graph: Graph | None = None
        self._plan: Plan | None = None
        self._extra: Any = None       # what the backend needs besides the graph
        self._runner: Any = None

    # ---------------------------------------------------------------- planning
    def trace(self, *example_args: Any, ctx: PassContext | None = None) -> ParallelStep:
        """Trace and plan for these arguments without running anything; returns self.
        ``ctx`` (a PassContext) asks for IR dumps and collects pass timings."""
        self.framework, graph, self._extra = trace_step(self.step_fn, example_args,
                                                        self.mesh, self.axis)
        self._graph, self._plan = run_passes(graph, self.framework, self.mesh, self.axis,
                                             self.passes, ctx or PassContext())
        return self

    @property
    def graph(self) -> Graph:
        """The final IR (after every pass)."""
        self._need_trace()
        return self._graph

    @property
    def plan(self) -> Plan:
        """What the passes decided: placements, bytes per device, collectives."""
        self._need_trace()
        return self._plan

    def _need_trace(self) -> None:
        if self._graph is None:
            raise DiphomaError("the step has not been traced yet",
                               hint="call it once, or call .trace(*example_args) to plan "
                                    "without running")

    # ---------------------------------------------------------------- running
    def __call__(self, *args: Any) -> Any:
        if self._runner is None:
            if self._graph is None:
                self.trace(*args)
            self._runner = self._make_runner()
        return self._runner(*args)

    def _make_runner(self) -> Any:
        if self.framework == "torch":
            from .backends.torch_dist import TorchDistStep
            group = None
            if hasattr(self.user_mesh, "get_group"):   # a torch DeviceMesh: its axis's group
                group = self.user_mesh.get_group(self.axis)
            return TorchDistStep(self._graph, self._extra, self.mesh, group=group,
                                 axis=self.axis)
        from .backends.jax_parallel import JaxParallelStep
        return JaxParallelStep(self._graph, self._extra, mesh=self.user_mesh, axis=self.axis)

    @property
    def runner(self) -> Any:
        """The backend's runner (after the first call)."""
        if self._runner is None:
            raise DiphomaError("the step has not run yet", hint="call it once first")
        return self._runner

    def profile(self, *args: Any, steps: int = 5) -> Any:
        """PyTorch: per step, the time in computation, in communication, and the part of
        communication hidden behind computation (runs ``steps`` real steps twice)."""
        if self._runner is None:
            self(*args)
        if not hasattr(self._runner, "profile"):
            raise DiphomaError(f"profile() is not available for {self.framework} steps",
                               hint="under jax.jit, use jax.profiler")
        return self._runner.profile(*args, steps=steps)

    def memory_report(self) -> Any:
        """Bytes of parameters and optimizer state this process holds, measured from the
        live tensors (after the first call)."""
        return self.runner.memory_report()


def trace_step(step_fn: Callable, args: tuple, mesh: Mesh, axis: str
               ) -> tuple[str, Graph, Any]:
    """(framework, the step's IR traced per device, what the backend needs besides it):
    PyTorch at the local batch each rank passes; JAX at the global batch / N."""
    from .api import _framework
    framework = _framework(args)
    if framework == "torch":
        from .frontends.torch_trace import trace_torch
        graph, extra = trace_torch(step_fn, *args)
    else:
        from .frontends.jax_trace import trace_jax_with_tree
        local = _local_jax_args(args, mesh.axis_size(axis), axis)
        graph, extra = trace_jax_with_tree(step_fn, *local)
    return framework, graph, extra


def run_passes(graph: Graph, framework: str, mesh: Mesh, axis: str, passes: str | None,
               ctx: PassContext) -> tuple[Graph, Plan]:
    """The graph placed on ``mesh`` after the pipeline (``passes``, or the default one for
    the framework and the model's gradient bytes), and its plan."""
    graph = graph.replace(mesh=mesh)
    grad_bytes = sum(i.value.type.nbytes for i in graph.inputs
                     if i.role.kind is InputKind.param)
    spec = passes if passes is not None else default_passes(framework, axis, grad_bytes)
    if spec:
        graph = Pipeline.from_spec(spec).run(graph, ctx)
    ctx.notes["backend"] = BACKENDS[framework]
    return graph, build_plan(graph, ctx.notes)


def _local_jax_args(args: tuple, n: int, axis: str, batch_argnum: int = 2) -> tuple:
    """The step's arguments with each batch leaf's dim 0 divided among ``n`` devices (as
    abstract shapes: tracing reads no data)."""
    import jax
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


def parallelize(step_fn: Callable, mesh: Any, *, passes: str | None = None,
                axis: str | None = None) -> ParallelStep:
    """``step_fn`` as a distributed step over ``mesh`` (a diphoma Mesh, a dict of axis
    sizes, a torch DeviceMesh or a jax.sharding.Mesh). By default: data parallelism over
    the data axis with cross-replica weight-update sharding; ``passes`` overrides the
    pipeline, ``axis`` names the data axis when the mesh has several."""
    return ParallelStep(step_fn, mesh, passes=passes, axis=axis)
