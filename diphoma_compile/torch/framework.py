"""PyTorch behind the Framework protocol (``diphoma_compile.framework``)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from ..errors import FrontendError, MeshError
from ..ir.core import Graph
from ..ir.device_model import DeviceModel
from ..mesh import Mesh


class TorchFramework:
    """Steps over torch modules and optimizers; per-rank programs on torch.distributed."""

    name = "torch"
    packages = ("torch",)
    update_layout = "flat"
    pipeline_update_layout = "flat"
    backend = ("torch.distributed per-rank program; collectives run as planned (buckets "
               "packed, async ones waited where first needed)")

    def owns(self, args: tuple) -> bool:
        """True when the example arguments hold torch modules, optimizers or tensors."""
        from .trace import is_torch_step
        return is_torch_step(args)

    def device(self, args: tuple) -> tuple[str, str]:
        """The device of the first tensor among the arguments (a module's parameters)."""
        from .trace import first_tensor
        t = first_tensor(args)
        if t is None:
            return ("", "")
        name = torch.cuda.get_device_name(t.device) if t.device.type == "cuda" else ""
        return (t.device.type, name)

    def measure_device(self, args: tuple) -> DeviceModel:
        """The arguments' device measured (torch/calibrate.py; products in the first
        parameter's dtype); with a process group, every rank at once, the slowest rank's
        rates and rank 0's link to rank 1."""
        from .calibrate import measure_device
        from .trace import first_tensor
        t = first_tensor(args)
        if t is not None and t.device.type == "meta":
            raise FrontendError("device_model='measured': the step's tensors are on the "
                                "meta device, which runs nothing to measure",
                                hint="name the device model to plan for (h100-nccl, ...)")
        if t is None:        # no tensor to go by (inspect): the first GPU, else the CPU
            return measure_device("cuda" if torch.cuda.is_available() else "cpu")
        return measure_device(t.device, dtype=t.dtype if t.is_floating_point()
                              else torch.float32)

    def trace(self, step_fn: Callable, args: tuple, **options: Any) -> tuple[Graph, Any]:
        """The step's IR and its capture (which the runtime binds to the live state)."""
        from .trace import trace_torch
        # trace() alone plans with the reference program; compile() passes its codegen
        codegen = options.pop("codegen", None)
        if options:
            raise FrontendError(f"trace options {sorted(options)} are for JAX steps",
                                hint="a PyTorch step is traced from its arguments alone")
        return trace_torch(step_fn, *args, codegen=codegen)

    def trace_local(self, step_fn: Callable, args: tuple, mesh: Mesh, axis: str, *,
                    batch_argnums: tuple[int, ...] | None = None,
                    codegen: str | None = None, microbatches: int = 1,
                    probe_rows: int = 1) -> tuple[Graph, Any]:
        """As ``trace``: each rank passes its own local batch, as under DDP. Every tensor
        among the arguments is batch, so ``batch_argnums`` is refused. With
        ``microbatches`` M, traced at the first 1/M of every tensor's rows (a pipeline runs
        the step once per microbatch). ``probe_rows``: with every tensor's rows
        repeated that many times (the batch analysis's probe of a share of one row)."""
        if batch_argnums is not None:
            raise FrontendError(
                f"batch_argnums={batch_argnums} is for JAX steps: a PyTorch step's tensor "
                "arguments are all its batch (each rank passes its own local batch, as under "
                "DDP) and nothing is split", hint="drop batch_argnums=; keep a tensor that is "
                                                  "not batch in the step's closure or module")
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized() and \
                mesh.size > dist.get_world_size():
            # before the batch is cut: a mesh larger than the world is the first thing wrong
            raise MeshError(f"the mesh {mesh} has {mesh.size} devices but the process group "
                            f"has {dist.get_world_size()} processes",
                            hint=f"run under torchrun --nproc_per_node={mesh.size}, or plan "
                                 f"for a mesh of {dist.get_world_size()} devices")
        if microbatches > 1:
            from .trace import microbatch_args
            args = microbatch_args(args, microbatches)
        if probe_rows > 1:
            from .trace import repeated_args
            args = repeated_args(args, probe_rows)
        return self.trace(step_fn, args, codegen=codegen)

    def compile(self, graph: Graph, extra: Any) -> Callable:
        """A step that updates the live module and optimizer as the eager step would."""
        from .runtime import TorchStep
        return TorchStep(graph, extra)

    def parallel_runner(self, graph: Graph, extra: Any, user_mesh: Any, mesh: Mesh,
                        axis: str, donate: bool | None = None) -> Callable:
        """The per-rank program with a process group per mesh axis (a DeviceMesh's own
        groups; WORLD for a mesh with one axis of several devices; ``new_group`` per axis
        otherwise, ranks laid out row-major as ``init_device_mesh`` does). On a mesh of one
        device with no collective, in this process without a process group. ``donate``
        changes nothing: the program writes new values into the live tensors anyway."""
        from ..passes.pipeline_parallel import pipeline_of
        from .dist import TorchDistStep
        from .pipeline import TorchPipelineStep
        groups = None
        if hasattr(user_mesh, "get_group"):     # a torch DeviceMesh: its axes' groups
            groups = {a: user_mesh.get_group(a) for a, n in mesh.axes if n > 1}
        kind = TorchPipelineStep if pipeline_of(graph) is not None else TorchDistStep
        return kind(graph, extra, mesh, axis=axis, groups=groups)

    def in_place_updates(self, graph: Graph, cuts: list | None = None) -> set[str]:
        """New values build_module copies into their input's storage where they are made
        (a pipeline's: those of its update programs, which its runtime builds in place;
        ``cuts``: its ranks' programs, when already made)."""
        from .build import updates_in_place
        return _of_update_programs(graph, cuts, lambda g: set(updates_in_place(g)))

    def kernel_written(self, graph: Graph, cuts: list | None = None) -> set[str]:
        """The new values the fx program's pointwise kernels write straight into their
        input (``build.written_by_kernels``): the optimizers' updates, mostly. (An Inductor
        program plans its own buffers; the plan models the fx one.)"""
        from .build import written_by_kernels
        return _of_update_programs(graph, cuts, written_by_kernels)

    def collective_scratch(self, graph: Graph, device_model: str) -> dict[int, int]:
        """The packed send buffers of collectives.py, alive until each collective's wait
        (and on gloo a reduce-scatter's whole receive buffer: it runs as an all_to_all)."""
        from .build import updates_in_place
        from .collectives import plans_for_gloo, scratch_bytes
        return scratch_bytes(graph, set(updates_in_place(graph)),
                             receive_whole=plans_for_gloo(device_model))

    def module_kinds(self) -> dict[str, tuple[type, ...]]:
        """``torch-module``: subclasses of nn.Module."""
        return {"torch-module": (torch.nn.Module,)}

    def adapt_step(self, step_fn: Callable, args: tuple) -> None:
        """None: a torch step takes its modules and optimizers as they are."""
        return None

    def inspect_target(self) -> ModuleType:
        """The module building inspect's step from a torch model file."""
        from . import inspect_target
        return inspect_target

    def pipeline_actions(self, schedule: str, stages: int, microbatches: int,
                         ranks: int) -> tuple[tuple[tuple[str, int, int], ...], ...]:
        """torch.distributed.pipelining's action lists (pipeline_schedule.py)."""
        from .pipeline_schedule import schedule_actions
        return schedule_actions(schedule, stages, microbatches, ranks)


FRAMEWORK = TorchFramework()


def _of_update_programs(graph: Graph, cuts: list | None,
                        values: Callable[[Graph], set[str]]) -> set[str]:
    """``values`` of the graph, or of a pipeline's update programs (the only ones its
    runtime builds in place; ``cuts``: its ranks' programs, when already made)."""
    from ..passes.pipeline_parallel import pipeline_of
    if pipeline_of(graph) is None:
        return values(graph)
    from ..passes.pipeline_programs import rank_stage_programs
    return {n for cut in cuts or rank_stage_programs(graph) for (_, kind), prog in
            cut.programs.items() if kind.startswith("U") for n in values(prog.graph)}
