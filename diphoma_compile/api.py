"""The public entry points: ``trace`` a training step into the IR, ``compile`` it to run on
one device, or ``parallelize`` it over a mesh.

``parallelize`` returns a ParallelStep, which traces the step on its first call (or on
``.trace(*args)``, which plans without running), runs the pass pipeline — by default data
parallelism plus weight-update sharding over the mesh's data axis — and hands the final IR
to the framework's backend.

Conventions, as each framework's users expect them:
- PyTorch follows DDP: each rank (a torchrun process) passes its own local batch; the step
  is traced at that shape and the loss it returns is the mean over all ranks.
- JAX takes the global batch, which the step shards over the data axis; the step is traced
  at the per-device shape (global / N). The batch is argument 2 and every later array
  argument with its number of rows (``batch_argnums=`` says so explicitly).

A mesh whose data axis has one device runs the single-device program: no pass has anything
to split, and the step runs as ``compile()`` runs it (bit for bit), with no process group
(PyTorch) and no shard_map (JAX)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable
from typing import Any

from . import framework as frameworks
from .errors import DiphomaError, DiphomaWarning, MeshError, no_keywords
from .framework import Framework
from .ir.analysis import runs_on_one_device
from .ir.batch_coupling import one_row_per_share, one_row_windows, scaled_by_rows
from .ir.row_probe import RowProbe, probe_rows
from .ir.device_model import (MODELS, DeviceModel, check, device_model, model_for_device,
                              register)
from .ir.core import Graph, InputKind
from .mesh import Mesh, data_axis, fold_nodes, pipeline_axis, tensor_axis
from .passes.base import PassContext, find_decision
from .passes.data_parallel import DataParallelRecord
from .passes.defaults import COMPRESSION, default_passes
from .passes.pipeline import Pipeline
from .passes.pipeline_parallel import SCHEDULES, PipelineParallel, PipelineRecord
from .passes.pipeline_programs import is_staged, rank_stage_programs
from .passes.spec import parse_spec
from .report.compute import DEFAULT_DEVICE_MODEL
from .report.plan import Plan, build_plan
from .report.text import coupling_warning


def trace(step_fn: Callable, *example_args: Any, **options: Any) -> Graph:
    """The IR graph of a whole training step (forward, loss, backward, optimizer update).

    PyTorch steps take their modules and optimizers as arguments (or in their closure);
    JAX steps follow ``step(params, opt_state, batch, *rest)``."""
    fw = frameworks.of_args(example_args)
    _, step_fn, example_args = _adapt(fw, step_fn, example_args)
    return fw.trace(step_fn, example_args, **options)[0]


def _adapt(fw: Framework, step_fn: Callable, args: tuple) -> tuple[Any, Callable, tuple]:
    """(the framework's adapter of the step's convention or None, the step and arguments
    to trace: the adapter's where there is one)."""
    adapter = fw.adapt_step(step_fn, args)
    return (None, step_fn, args) if adapter is None else (adapter, adapter, adapter.args(args))


class _Adapted:
    """A compiled step of the traced convention, called with the user's own arguments."""

    def __init__(self, adapter: Any, run: Callable) -> None:
        self.adapter, self.run = adapter, run

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        no_keywords(kwargs)
        return self.adapter.result(self.run(*self.adapter.args(args)), args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.run, name)


def compile(step_fn: Callable, *example_args: Any, passes: str = "",
            codegen: str | None = None) -> Any:
    """A callable with ``step_fn``'s signature that runs the traced (and transformed) step.

    For PyTorch it updates the live module and optimizer exactly as the eager step would.
    ``codegen`` (PyTorch) picks the code generator: ``"fx"`` (the eager step's own kernel
    calls, bit for bit) or ``"inductor"`` (compiled on the first call, results within
    rounding of eager's); None picks the default (docs/torch.md). JAX steps run under
    jax.jit."""
    fw = frameworks.of_args(example_args)
    adapter, step_fn, example_args = _adapt(fw, step_fn, example_args)
    # the runner keeps this step's own argument and output structure, whatever passes do
    graph, extra = fw.trace(step_fn, example_args, codegen=codegen or "auto")
    if passes:
        graph = Pipeline.from_spec(passes).run(graph, PassContext())
    run = fw.compile(graph, extra)
    return run if adapter is None else _Adapted(adapter, run)


class ParallelStep:
    """A callable with the step's signature that runs it distributed over a mesh."""

    def __init__(self, step_fn: Callable, mesh: Any, *, passes: str | None = None,
                 axis: str | None = None,
                 batch_argnums: int | Iterable[int] | None = None,
                 donate: bool | None = None, shard_params: bool = False,
                 codegen: str | None = None, microbatches: int | None = None,
                 schedule: str | None = None, compression: str | None = None,
                 device_model: str | DeviceModel | None = None) -> None:
        shard_params = flag("shard_params", shard_params)
        if shard_params and passes is not None:
            raise DiphomaError("shard_params=True picks the default pipeline's passes, but "
                               f"passes={passes!r} was given too",
                               hint="add shard-params{axis=dp} after weight-update-sharding "
                                    "in your passes instead")
        self.step_fn = step_fn
        self.codegen = codegen
        self.donate = None if donate is None else flag("donate", donate)  # None: the default
        self.shard_params = shard_params
        self.user_mesh = mesh
        self.mesh = Mesh.of(mesh)
        self.axis = data_axis(self.mesh, axis)
        self.passes = passes
        self.compression = check_compression(compression, passes, self.shard_params)
        self.local = 0      # devices per node: a node axis split the data axis
        if self.compression is not None:
            self.mesh, self.local = fold_nodes(self.mesh, self.axis)
            if self.local:
                if not isinstance(mesh, (dict, Mesh)):
                    raise DiphomaError("a node axis in a framework's own mesh object is not "
                                       "folded into the data axis",
                                       hint="pass the mesh as a dict or a diphoma Mesh, "
                                            "e.g. {'node': 2, 'dp': 4}")
                self.user_mesh = self.mesh
        self.batch_argnums = argnums(batch_argnums)
        self.pipeline = pipeline_settings(self.mesh, passes, microbatches, schedule)
        self.device_model = chosen_device_model(device_model)
        self.framework: str | None = None
        self._fw: Framework | None = None
        self._graph: Graph | None = None
        self._plan: Plan | None = None
        self._extra: Any = None       # what the backend needs besides the graph
        self._runner: Any = None
        self._adapter: Any = None     # the framework's adapter of the step's convention

    # ---------------------------------------------------------------- planning
    def trace(self, *example_args: Any, ctx: PassContext | None = None) -> ParallelStep:
        """Trace and plan for these arguments without running anything; returns self.
        ``ctx`` (a PassContext) asks for IR dumps and collects pass timings."""
        mb = self.pipeline.microbatches if self.pipeline is not None else 1
        self._adapter, step_fn, example_args = _adapt(frameworks.of_args(example_args),
                                                      self.step_fn, example_args)
        nums = self.batch_argnums if self._adapter is None else \
            self._adapter.batch_argnums(self.batch_argnums)
        self._fw, graph, self._extra, probe = trace_step(
            step_fn, example_args, self.mesh, self.axis, nums, mb,
            codegen=self.codegen or self._auto())
        self.framework = self._fw.name
        if self.framework == "torch" and self.donate is not None:
            warnings.warn(f"donate={self.donate} is for JAX steps: a PyTorch step writes the "
                          "new values into the module's and optimizer's own tensors in any "
                          "case", DiphomaWarning, stacklevel=2)
        model = self.device_model
        if model == "measured":      # measured once, on the first trace (every rank)
            model = self.device_model = self._fw.measure_device(example_args).name
        elif isinstance(model, DeviceModel):    # registered now: this step's figures
            model = register(model).name
        elif model is None:          # the model of the device at hand
            model = model_for_device(*self._fw.device(example_args),
                                     default=DEFAULT_DEVICE_MODEL)
        pipeline = self.pipeline
        if pipeline is not None:     # stages balanced on that model
            pipeline = dataclasses.replace(pipeline, device_model=model)
        self._graph, self._plan = run_passes(graph, self._fw, self.mesh, self.axis,
                                             self.passes, ctx or PassContext(),
                                             device_model=model,
                                             shard_params=self.shard_params,
                                             pipeline=pipeline,
                                             compression=self.compression, local=self.local,
                                             probe=probe)
        self._refuse_idle_axes(self._plan.idle_axes)
        return self

    def _refuse_idle_axes(self, idle: dict[str, int]) -> None:
        """Mesh axes of several devices that no pass uses: refused under torch (each rank
        passes its own data, and ranks along such an axis would drift apart) and, under
        JAX, where the trace split the batch over it (each device would train on its share
        alone); otherwise warned of (one JAX controller passes the global batch: the
        devices along the axis repeat the same work on the same data)."""
        if not idle:
            return
        axes = ", ".join(f"{a}={n}" for a, n in idle.items())
        if self.framework == "torch":
            raise MeshError(
                f"mesh axis {axes} is used by no pass: every rank along it would repeat "
                "the same step, and ranks along it given other data (each rank passes its "
                "own) would drift apart without a word (inspect lists such axes)",
                hint="name each axis for what it does (dp, data or batch: data parallelism; "
                     "pp, pipe or pipeline: pipeline stages; tp, tensor or model: tensor "
                     "parallelism), drop it from the mesh, or pass passes= that use it")
        if self.axis in idle:
            raise MeshError(
                f"mesh axis {self.axis}={idle[self.axis]}, over which the batch is split, "
                "is used by no pass: each device would run the step on its share of the "
                "batch alone, and no gradient would be averaged over it",
                hint="let passes= hold a data-parallel pass (the default passes do; "
                     "inspect --passes shows a list's plan), or drop the axis from the mesh")
        warnings.warn(f"mesh axis {axes} is used by no pass: every device along it repeats "
                      "the same step on the same data (name the axis for what it does: dp, "
                      "data or batch; pp; tp; or drop it from the mesh)",
                      DiphomaWarning, stacklevel=3)

    def _auto(self) -> str | None:
        # the framework picks the code generator by the step's size for the plans checked
        # under both; pipelines, parameter sharding and compression run the framework's
        # reference program (PyTorch: fx) unless codegen= asks
        plain = self.pipeline is None and not self.shard_params and self.compression is None
        return "auto" if plain else None

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
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        no_keywords(kwargs)
        if self._runner is None:
            if self._graph is None:
                self.trace(*args)
            self._runner = self._fw.parallel_runner(self._graph, self._extra, self.user_mesh,
                                                    self.mesh, self.axis, self.donate)
        if self._adapter is not None:
            out = self._runner(*self._adapter.args(args))
            if getattr(self._adapter, "writes_back", False) and \
                    hasattr(self._runner, "user_shapes"):
                # the user's own objects (flax.nnx's model and optimizer) receive the new
                # state: in their own shapes, not the runner's flat, padded storage
                out = (self._runner.user_shapes(out[0], 0),
                       self._runner.user_shapes(out[1], 1), *out[2:])
            return self._adapter.result(out, args)
        return self._runner(*args)

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

    def state_dict(self) -> Any:
        """PyTorch: the module's whole state dict on every rank, tensor-parallel shards
        gathered (a collective: every rank calls it; after the first call). Between steps
        the module's own parameters are this rank's shards, as under FSDP2."""
        if not hasattr(self.runner, "state_dict"):
            raise DiphomaError(f"state_dict() is not available for {self.framework} steps",
                               hint="a JAX step returns its parameters; read them there")
        return self.runner.state_dict()

    def user_shapes(self, tree: Any, argnum: int | None = None) -> Any:
        """JAX: ``tree`` (the parameters or optimizer state the step returned) in the
        user's shapes. The step stores a tensor none of whose dimensions divides the data
        axis as a padded, flattened 1-D array split over it (docs/jax.md); this gives each
        such leaf its own shape back, whole on every device. ``argnum``: which step argument
        the tree is (0 parameters, 1 optimizer state); by default the one of its structure.
        A flax ``TrainState`` the step returned comes back whole, its parameters and
        optimizer state in the user's shapes."""
        if not hasattr(self.runner, "user_shapes"):
            if self.framework == "jax":     # one device: nothing is stored flat
                return tree
            raise DiphomaError(f"user_shapes() is not available for {self.framework} steps",
                               hint="a PyTorch step keeps the module's and optimizer's own "
                                    "tensors; use state_dict()")
        own = getattr(self._adapter, "user_state", None)
        if own is not None and argnum is None:
            # the adapter's own state (a flax TrainState): its parts, each by its argument
            state = own(tree, self.runner.user_shapes)
            if state is not None:
                return state
        try:
            return self.runner.user_shapes(tree, argnum)
        except DiphomaError as e:
            if own is None:
                raise
            raise type(e)(e.message, hint="pass the whole state the step returned "
                                          "(user_shapes(state)): its parameters and "
                                          "optimizer state come back in your shapes") \
                from None

    @property
    def compile_s(self) -> float | None:
        """PyTorch: seconds the code generator spent compiling on the first call (None for
        the fx code generator)."""
        return getattr(self.runner, "compile_s", None)

    def measure_memory(self, *args: Any) -> Any:
        """PyTorch: run one real step with these arguments (it trains, like any call) and
        return the peak of tensor memory this process reached in it (a ``MeasuredPeak``:
        ``held`` before the step, ``peak``, ``transient``), to set beside
        ``plan.memory.peak``. Every rank must call it."""
        if self._runner is None:
            self(*args)
        if not hasattr(self._runner, "measure_memory"):
            raise DiphomaError(f"measure_memory() is not available for {self.framework} "
                               "steps", hint="under JAX, use jax.profiler's device memory "
                                             "profile")
        return self._runner.measure_memory(*args)

    def memory_report(self) -> Any:
        """Bytes of parameters and optimizer state this process holds, measured from the
        live tensors (after the first call)."""
        return self.runner.memory_report()


def argnums(batch_argnums: int | Iterable[int] | None) -> tuple[int, ...] | None:
    """``batch_argnums`` as a tuple of argument numbers (None: the framework infers them);
    DiphomaError for anything but ints."""
    if batch_argnums is None:
        return None
    try:
        nums = (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums)
    except TypeError:
        nums = ()
    if not nums or any(isinstance(n, bool) or not isinstance(n, int) for n in nums):
        raise DiphomaError(f"batch_argnums={batch_argnums!r} is not one or more argument "
                           "numbers", hint="pass the positions of the step's batch "
                                           "arguments, e.g. batch_argnums=(2, 3)")
    return nums


def trace_step(step_fn: Callable, args: tuple, mesh: Mesh, axis: str,
               batch_argnums: tuple[int, ...] | None = None, microbatches: int = 1, *,
               codegen: str | None = None) -> tuple[Framework, Graph, Any, RowProbe | None]:
    """(framework, the step's IR traced per device, what the backend needs besides it, a
    probe): PyTorch at the local batch each rank passes; JAX at the global batch / N, the
    batch being the arguments ``batch_argnums`` (None: inferred by the framework); under a
    pipeline of M microbatches, at one microbatch. ``codegen``: the code generator the
    program is for; "auto" lets the framework choose by the step's size, None plans with
    its reference program. Where the batch is split into shares of one row, or the batch
    analysis takes a sum over the rows divided by a constant for a mean (the constant may
    equal the rows by coincidence, ``sum() / 2`` at two), the probe is the same program
    traced at more (``batch_probe``), else None."""
    fw = frameworks.of_args(args)
    kw = {"microbatches": microbatches} if microbatches != 1 else {}
    graph, extra = fw.trace_local(step_fn, args, mesh, axis, batch_argnums=batch_argnums,
                                  codegen=codegen, **kw)
    probe = None
    if microbatches > 1 or dict(mesh.axes).get(axis, 1) > 1:
        one_row = one_row_per_share(graph) or one_row_windows(graph)
        scaled = [] if one_row else scaled_by_rows(graph)
        if one_row or scaled:
            probe = batch_probe(fw, graph, step_fn, args, mesh, axis, batch_argnums, kw)
        if scaled and probe is None:
            warnings.warn(
                f"the step divides a sum over its batch's rows by as many as it sums, or "
                f"multiplies a mean by that many ({', '.join(scaled[:3])}), and could not "
                "be traced at more rows per device to tell whether that is the batch's "
                "size or a number that equals it at this share's size (sum() / 2 at 2 "
                "rows): it is taken for the size, the quotient a mean (the devices' "
                "gradients averaged) and the product a sum (added up); a number there "
                "wants the other (to have the two told apart, let the step trace at any "
                "batch size: no size fixed in its code, as x.view(2, -1) does)",
                DiphomaWarning, stacklevel=3)
    return fw, graph, extra, probe


def batch_probe(fw: Framework, graph: Graph, step_fn: Callable, args: tuple, mesh: Mesh,
                axis: str, batch_argnums: tuple[int, ...] | None, kw: dict) -> RowProbe | None:
    """The step traced at several times the rows per share (``probe_rows``: a prime that
    no constant of ``graph`` is a multiple of), matched value by value with ``graph``, the
    step as traced (``ir/row_probe.py``), for the batch analysis
    (``ir/batch_coupling.py``: a share of one row cannot show which dims are its rows, and
    a division by a constant equal to the rows cannot show whether it is a mean); or None
    where it cannot be traced (its code fixes the batch's size: at one row per share the
    plan then says the batch was not judged; at more, such divisions stay means)."""
    rows = probe_rows(graph)
    try:
        probe, _ = fw.trace_local(step_fn, args, mesh, axis, batch_argnums=batch_argnums,
                                  probe_rows=rows, **kw)
    except Exception:       # any failure (x.view(1, -1)) leaves the batch unjudged
        return None
    return RowProbe.of(graph, probe, rows)


def chosen_device_model(model: str | DeviceModel | None) -> str | DeviceModel | None:
    """``parallelize``'s ``device_model``, checked: a model's name, a DeviceModel (kept,
    and registered under its name when the step is traced), ``"measured"`` (measured
    then), or None (the model of the device the step's arguments live on)."""
    if model is None or model == "measured":
        return model
    if isinstance(model, DeviceModel):
        return check(model)          # refused now, not at the first call
    if not isinstance(model, str):
        raise DiphomaError(f"device_model={model!r} is neither a name nor a DeviceModel",
                           hint="pass a name (" + ", ".join(MODELS) + ", or 'measured'), "
                                "a DeviceModel, or leave it unset")
    return device_model(model).name


def flag(name: str, value: Any) -> bool:
    """``value`` of the option ``name``, which must be True or False: a string such as
    "False" or "no" is truthy, and would turn the option on."""
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and
                                   type(value).__name__ in ("bool", "bool_")):   # numpy's
        return bool(value)
    raise DiphomaError(f"{name}={value!r}: the option is True or False",
                       hint=f"pass {name}=True or {name}=False")


def pipeline_settings(mesh: Mesh, passes: str | None, microbatches: int | None,
                      schedule: str | None) -> PipelineParallel | None:
    """The pipeline pass a plan will run: the one ``passes`` names, or, by default, one
    over the mesh's pipeline axis (named pp, pipe or pipeline) when it has several devices,
    with ``microbatches`` (default: the axis size; for dualpipev twice that, the stages,
    the fewest it takes) and ``schedule`` (default 1f1b); None without one. A schedule or
    microbatches other than the defaults (1f1b, 1) given where no pipeline runs, or beside
    ``passes`` that say otherwise, is refused: either would be ignored."""
    if microbatches is not None and (isinstance(microbatches, bool) or
                                     not isinstance(microbatches, int) or microbatches < 1):
        raise DiphomaError(f"microbatches={microbatches!r}: the number of microbatches is a "
                           "whole number of at least 1",
                           hint="microbatches=M with M >= 1 (M >= the pipeline's stages keeps "
                                "its bubble small), or leave it unset")
    if schedule is not None and schedule not in SCHEDULES:
        raise DiphomaError(f"unknown schedule {schedule!r}",
                           hint="one of " + ", ".join(SCHEDULES))
    if passes is not None:
        found = [p for p in parse_spec(passes) if isinstance(p, PipelineParallel)]
        got = found[-1] if found else None
        if microbatches is not None and microbatches != (got.microbatches if got else 1):
            raise DiphomaError(
                f"microbatches={microbatches} was given beside passes=, whose "
                + (f"pipeline pass says microbatches={got.microbatches}" if got else
                   "passes have no pipeline pass"),
                hint="say the microbatches in the pipeline pass of passes= "
                     "(pipeline{axis=pp, microbatches=M}), or leave microbatches unset")
        if schedule is not None and schedule != (got.schedule if got else "1f1b"):
            raise DiphomaError(
                f"schedule={schedule!r} was given beside passes=, whose "
                + (f"pipeline pass runs schedule={got.schedule}" if got else
                   "passes have no pipeline pass"),
                hint="say the schedule in the pipeline pass of passes= "
                     "(pipeline{axis=pp, schedule=...}), or leave schedule unset")
        return got
    pp = pipeline_axis(mesh)
    if pp is None or mesh.axis_size(pp) == 1:
        if microbatches not in (None, 1):
            raise DiphomaError(f"microbatches={microbatches} is for pipeline parallelism, "
                               "and the mesh has no pipeline axis of several devices",
                               hint="add a pp axis to the mesh (Mesh({'dp': 2, 'pp': 2})), "
                                    "or leave microbatches unset")
        if schedule not in (None, "1f1b"):      # the default, as microbatches=1 is
            raise DiphomaError(f"schedule={schedule!r} is for pipeline parallelism, and the "
                               "mesh has no pipeline axis of several devices",
                               hint="add a pp axis to the mesh (Mesh({'dp': 2, 'pp': 2})), "
                                    "or leave schedule unset")
        return None
    schedule = "1f1b" if schedule is None else schedule
    m = microbatches if microbatches is not None else \
        mesh.axis_size(pp) * (2 if schedule == "dualpipev" else 1)
    return PipelineParallel(axis=pp, microbatches=m, schedule=schedule)


def check_compression(compression: str | None, passes: str | None,
                      shard_params: bool = False) -> str | None:
    """``compression`` when it names a preset (None: no compression); DiphomaError for an
    unknown one, or one given beside an explicit pass pipeline."""
    if compression is None:
        return None
    if compression not in COMPRESSION:
        raise DiphomaError(f"unknown compression {compression!r}",
                           hint="use compression=" + " or ".join(repr(c) for c in COMPRESSION)
                                + ", or leave it unset for fp32 collectives")
    if passes is not None:
        raise DiphomaError("compression= and passes= were both given; compression chooses "
                           "passes of the default pipeline",
                           hint="add the quantizing passes to passes= yourself "
                                "(quantize-grads, quantize-weight-diff after "
                                "weight-update-sharding), or drop passes=")
    if shard_params:
        raise DiphomaError("compression= and shard_params=True were both given; the "
                           "quantized weight differences need every device to hold the "
                           "whole parameters between steps",
                           hint="choose one of them")
    return compression


def run_passes(graph: Graph, fw: Framework, mesh: Mesh, axis: str, passes: str | None,
               ctx: PassContext, device_model: str = DEFAULT_DEVICE_MODEL,
               shard_params: bool = False, pipeline: PipelineParallel | None = None,
               compression: str | None = None, local: int = 0,
               warn: bool = True, probe: RowProbe | None = None) -> tuple[Graph, Plan]:
    """The graph placed on ``mesh`` after the pipeline (``passes``, or the default one for
    the framework and the model's gradient bytes), and its plan, with the step time
    estimated on ``device_model`` (a name in ``ir.device_model.MODELS``). With ``warn``, a
    DiphomaWarning where the plan splits a batch whose forward combines examples
    (``ir/batch_coupling.py``; ``inspect`` prints it in the plan instead).

    The default pipeline is tensor parallelism over the mesh's tensor axis (named tp,
    tensor or model) when it has more than one device, then data parallelism with
    weight-update sharding over the data axis when that has more than one. On a mesh of
    one device it is empty: there is nothing to split or to exchange, and the
    single-device program is what runs (any rewrite, even a bucket of collectives over one
    device, changes how XLA fuses the step and its last bits). ``probe``: the step traced
    at several rows per share where ``graph`` has one (``trace_step``), for the passes' batch
    analysis (``PassContext.batch_probe``)."""
    graph = graph.replace(mesh=mesh)
    if probe is not None:
        ctx.batch_probe = probe
    ctx.traced = graph
    grad_bytes = sum(i.value.type.nbytes for i in graph.inputs
                     if i.role.kind is InputKind.param)
    tp = tensor_axis(mesh)
    if passes is not None:
        spec = passes
    else:
        parts = []
        if tp is not None and tp != axis and mesh.axis_size(tp) > 1:
            if compression is not None:
                raise DiphomaError(f"compression={compression!r} is not lowered beside "
                                   f"tensor parallelism yet (the mesh's axis {tp}: the "
                                   "quantized collectives take whole-parameter pieces)",
                                   hint=f"drop the {tp} axis, or leave compression unset")
            parts.append(f"dce,tensor-parallel{{axis={tp}, device-model={device_model}}}")
        data = pipeline is None or axis != pipeline.axis
        if compression is not None and mesh.axis_size(axis) > 1 and pipeline is not None:
            raise DiphomaError(f"compression={compression!r} is not lowered for pipelines "
                               "yet (it needs weight-update shards outside a pipeline)",
                               hint="run the step without a pp axis, or leave "
                                    "compression unset")
        if pipeline is not None:
            # per-microbatch collectives over dp, no buckets: a bucket would mix stages
            if data and mesh.axis_size(axis) > 1:
                # (with microbatches, counts=local: the pipeline pass sums a mean's
                # count over the microbatches and the dp devices both,
                # passes/global_counts.py; with one, data-parallel sums it over dp)
                counts = "local" if pipeline.microbatches > 1 else "global"
                parts.append(default_passes(axis, layout=fw.pipeline_update_layout,
                                            shard_params=shard_params, counts=counts))
            else:
                parts.append("dce")
            parts.append(pipeline.spec())
        elif mesh.axis_size(axis) > 1:
            parts.append(default_passes(axis, grad_bytes, layout=fw.update_layout,
                                        shard_params=shard_params, compression=compression,
                                        local=local))
        spec = ",".join(parts)
    if spec:
        graph = Pipeline.from_spec(spec).run(graph, ctx)
        coupled = coupling_warning(find_decision(ctx.decisions, DataParallelRecord),
                                   find_decision(ctx.decisions, PipelineRecord))
        if coupled and warn:
            warnings.warn(coupled, DiphomaWarning, stacklevel=2)
    backend = fw.backend
    if runs_on_one_device(graph):
        backend = (f"the single-device program, as compile() runs it: the mesh has one "
                   f"device ({fw.name})")
    cuts = rank_stage_programs(graph) if is_staged(graph) else None   # pp ranks' programs
    return graph, build_plan(graph, ctx.decisions, backend=backend, device_model=device_model,
                             in_place=fw.in_place_updates(graph, cuts),
                             written=fw.kernel_written(graph, cuts),
                             scratch=fw.collective_scratch(graph, device_model), cuts=cuts)


def parallelize(step_fn: Callable, mesh: Any, *, passes: str | None = None,
                axis: str | None = None,
                batch_argnums: int | Iterable[int] | None = None,
                donate: bool | None = None, shard_params: bool = False,
                codegen: str | None = None, microbatches: int | None = None,
                schedule: str | None = None, compression: str | None = None,
                device_model: str | DeviceModel | None = None) -> ParallelStep:
    """``step_fn`` as a distributed step over ``mesh`` (a diphoma Mesh, a dict of axis
    sizes, a torch DeviceMesh or a jax.sharding.Mesh). By default: tensor parallelism
    (Megatron's layer pairs) over an axis named tp, tensor or model, and data parallelism
    over the data axis with cross-replica weight-update sharding (``{"dp": 2, "tp": 4}``;
    ``{"dp": 1, "tp": 4}`` for tensor parallelism alone); ``passes`` overrides the
    pipeline, ``axis`` names the data axis when the mesh has several.

    ``batch_argnums`` (JAX) names the step's batch arguments, which are split over the
    data axis; by default they are argument 2 and every later array argument with as many
    rows as it (keys and single numbers are not batch). A mesh of one device runs the
    single-device program.

    ``donate`` (JAX) lets the step consume the parameter and optimizer-state arrays it is
    given, as ``jax.jit(donate_argnums=...)`` does: their buffers hold the new values, so
    the old and new model do not both live through the step (a pipelined step: each
    stage's update). By default (None) a step over more than one device donates (0.76x
    the peak bytes per device of not donating, on a 4-layer LM at dp=8:
    ``benchmarks/jax_donation.py``); arrays the step returned are then
    consumed when passed back, so write ``params, opt_state, loss = step(params,
    opt_state, b)`` and do not read the old ones again (arrays in another layout, such as
    the user's own first ones, are copied onto the mesh and left alone). ``donate=False``
    keeps them; on a mesh of one device nothing is donated unless ``donate=True``. PyTorch
    steps write new values into the live tensors in any case.

    ``shard_params=True`` holds the parameters sharded over the data axis too (ZeRO-3 /
    FSDP class, the ``shard-params`` pass): each device keeps its piece between steps and
    gathers each whole parameter where the step reads it, in forward and again in
    backward. PyTorch: the module's parameters between steps are the rank's flat 1-D
    pieces (as FSDP2 holds its shards); ``ParallelStep.state_dict()`` gathers the whole
    model on every rank.

    ``codegen`` (PyTorch) is the per-rank program's code generator, as for ``compile``
    (a pipeline's stage programs each, default fx); under Inductor the collectives are
    ``_c10d_functional`` ops it overlaps its kernels with.

    A mesh axis named pp (or pipe, pipeline) cuts the step into that many pipeline stages
    (``pipeline{axis=pp, microbatches=M, schedule=...}``, docs/pipeline.md): each rank
    passes its whole local batch, which runs as ``microbatches`` M microbatches (default:
    the axis size) on ``schedule``: ``1f1b`` or ``gpipe`` (a stage per rank),
    ``interleaved``, ``looped-bfs``, the zero-bubble ``interleaved-zb`` and ``zbv``, or
    ``dualpipev`` (two stages per rank; dualpipev takes M >= 2P).

    ``compression="sdp4bit"`` (opt-in) quantizes the data axis's collectives as
    SDP4Bit does: gradients reduce-scattered as Hadamard-transformed 4-bit all-to-alls,
    new weights all-gathered as 4-bit differences from what every device holds
    (``quantize-grads``, ``quantize-weight-diff``; docs/quantized.md). The plan gives the
    bytes before and after and the declared error per tensor. A mesh axis named node just
    before the data axis (``{"node": 2, "dp": 4}``) is folded into it and the gradients
    take SDP4Bit's two hops: 8-bit among each node's devices, 4-bit across nodes.

    ``device_model`` is what the plan is costed on (its step-time estimate, and the
    pipeline's balanced cuts): by default the model of the device the step's arguments
    live on (cpu-gloo, h200-nccl, h100-nccl; ``ir/device_model.py``), or a name, a
    ``DeviceModel`` of your own figures, or ``"measured"``: the device measured when the
    step is traced (its matrix-product rate and memory bandwidth; PyTorch under a process
    group also the send latency and bandwidth between ranks 0 and 1, every rank measuring
    at once and all keeping the slowest rank's figures)."""
    return ParallelStep(step_fn, mesh, passes=passes, axis=axis,
                        batch_argnums=batch_argnums, donate=donate, shard_params=shard_params,
                        codegen=codegen, microbatches=microbatches, schedule=schedule,
                        compression=compression, device_model=device_model)
