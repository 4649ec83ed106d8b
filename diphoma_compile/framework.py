"""The Framework protocol: everything the framework-neutral code asks of a framework package.

Each framework lives in its own subpackage (``diphoma_compile.torch``, ``diphoma_compile.jax``),
the only place that imports it, and exposes one object, ``FRAMEWORK``, in its ``framework``
module. The neutral code (the API, ``inspect``) finds that object here, by the step's example
arguments or by name, and calls it; it never imports a framework itself."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any, Protocol

from .errors import FrontendError
from .ir.core import Graph
from .ir.device_model import DeviceModel
from .mesh import Mesh

# name -> the module holding its FRAMEWORK object; the order is the order of detection
_MODULES = {"torch": "diphoma_compile.torch.framework", "jax": "diphoma_compile.jax.framework"}


class Framework(Protocol):
    """What one framework package provides."""

    name: str                       # "torch", "jax": as the plan and errors name it
    packages: tuple[str, ...]       # top-level modules whose use marks a user file as ours
    update_layout: str              # weight-update sharding's layout for its backend:
    #                                 flat, dims or dims-or-flat
    pipeline_update_layout: str     # the same under a pipeline
    backend: str                    # one line for the plan: how the program runs

    def owns(self, args: tuple) -> bool:
        """True when a step's example arguments are this framework's."""

    def trace(self, step_fn: Callable, args: tuple, **options: Any) -> tuple[Graph, Any]:
        """The step's IR, and what a runner needs besides it (traced at these arguments)."""

    def trace_local(self, step_fn: Callable, args: tuple, mesh: Mesh, axis: str, *,
                    batch_argnums: tuple[int, ...] | None = None,
                    codegen: str | None = None, microbatches: int = 1,
                    probe_rows: int = 1) -> tuple[Graph, Any]:
        """The step traced per device of ``axis``, for ``parallelize``; ``batch_argnums``
        names the batch arguments (None: the framework's convention decides); ``codegen``
        the code generator the program is for (None: the framework's default); with
        ``microbatches`` M > 1, at one microbatch (the per-device batch / M), as a
        pipeline runs it. ``probe_rows``: at that many times those rows, the probe
        ``ir/batch_coupling.py`` analyses where a share has one row."""

    def compile(self, graph: Graph, extra: Any) -> Callable:
        """A single-device callable running ``graph`` with the step's signature."""

    def parallel_runner(self, graph: Graph, extra: Any, user_mesh: Any, mesh: Mesh,
                        axis: str, donate: bool | None = None) -> Callable:
        """A callable running the per-device ``graph`` over ``mesh``; the single-device
        program where ``runs_on_one_device(graph)``. ``donate``: whether the step may
        consume its parameter and state arguments (None: the backend's default)."""

    def in_place_updates(self, graph: Graph, cuts: list | None = None) -> set[str]:
        """The graph's new parameter/state values its backend writes into the replaced
        input's storage where they are made (not held to the end of the step); ``cuts``:
        a staged graph's ``rank_stage_programs``, when already made."""
        ...

    def kernel_written(self, graph: Graph, cuts: list | None = None) -> set[str]:
        """Those of ``in_place_updates`` that the backend's kernels make in the replaced
        input's storage (an ``out=`` kernel): they own no storage at all."""
        ...

    def device(self, args: tuple) -> tuple[str, str]:
        """The kind of device the step's example arguments live on (cpu, cuda, gpu, tpu,
        meta) and its name where the framework tells it (NVIDIA H200), for the device
        model the pipeline's stages are balanced on; ("", "") when it cannot tell."""
        ...

    def measure_device(self, args: tuple) -> DeviceModel:
        """The device the step's example arguments live on, measured now (its matrix-
        product rate, memory bandwidth and, between processes, its link), registered by
        name; under a process group every rank calls it and all get the same model."""
        ...

    def collective_scratch(self, graph: Graph, device_model: str) -> dict[int, int]:
        """Top-level op index -> bytes the backend holds besides a collective's results
        while it is in flight (a packed send buffer), for the plan's peak; ``device_model``
        (a name in ``ir.device_model.MODELS``) is what the plan is made for."""
        ...

    def module_kinds(self) -> dict[str, tuple[type, ...]]:
        """``diphoma inspect``: the model base classes of this framework, by kind name."""

    def inspect_target(self) -> Any:
        """``diphoma inspect``: the module that builds a plannable step from a user's file."""

    def adapt_step(self, step_fn: Callable, args: tuple) -> Any | None:
        """Where the step's arguments follow another convention this framework runs (JAX: a
        flax TrainState), an adapter: a step of the traced convention with ``args(args)``
        and ``result(out, args)`` converting a call (and ``batch_argnums(nums)``); else
        None."""

    def pipeline_actions(self, schedule: str, stages: int, microbatches: int,
                         ranks: int) -> tuple[tuple[tuple[str, int, int], ...], ...]:
        """Each rank's (kind, microbatch, stage) runs under a pipeline ``schedule``, as this
        framework's runtime orders them; a BackendError where it has no pipeline runtime."""


def get(name: str) -> Framework:
    """The framework called ``name`` (its package is imported now)."""
    if name not in _MODULES:
        raise FrontendError(f"unknown framework {name!r}",
                            hint=f"one of {', '.join(_MODULES)}")
    return importlib.import_module(_MODULES[name]).FRAMEWORK


def imported() -> list[Framework]:
    """The frameworks whose own packages this process has imported, in detection order."""
    return [get(n) for n in _MODULES if n in sys.modules]


def of_args(args: tuple) -> Framework:
    """The framework a step's example arguments belong to; FrontendError when none does."""
    if not args:
        raise FrontendError("no example arguments: the step is traced with the arguments it "
                            "will be called with, so they come with it",
                            hint="compile(step, model, opt, batch) or "
                                 "trace(step, params, opt_state, batch)")
    for fw in imported():
        if fw.owns(args):
            return fw
    raise FrontendError("no PyTorch module/optimizer/tensor and no JAX array among the "
                        "example arguments", hint="pass the step's real example arguments")


def of_kind(kind: str | None) -> Framework | None:
    """The imported framework whose model base classes have this kind name, if any."""
    for fw in imported():
        if kind in fw.module_kinds():
            return fw
    return None


def module_kinds() -> dict[str, tuple[type, ...]]:
    """The model base classes of every imported framework, by kind name."""
    out: dict[str, tuple[type, ...]] = {}
    for fw in imported():
        out.update(fw.module_kinds())
    return out
