"""``diphoma inspect PATH[:NAME]``: the sharding plan of a model file the user already has,
on one machine, with no devices and no processes started.

The steps: read the options (inputs and mesh first: a typo fails before anything is
loaded), run the file, pick what to plan, build the model and its training step without
allocating parameters, trace it, run the pass pipeline for the mesh, print the plan."""

from __future__ import annotations

import argparse
import ast
import contextlib
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

from .. import framework as frameworks
from ..framework import Framework
from ..ir.device_model import MODELS, device_model
from ..mesh import Mesh, pipeline_axis
from ..report.compute import DEFAULT_DEVICE_MODEL
from .load import Candidate, kind_of, load_file, resolve, split_target
from .spec import InspectError, Target, inspect_axis, parse_input, parse_mesh


def _at_least_one(text: str) -> int:
    """An argparse type: an int of 1 or more."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} rows: give 1 or more")
    return n


def add_parser(sub: Any) -> None:
    """The ``inspect`` subcommand and its options."""
    p = sub.add_parser(
        "inspect", help="plan a model file for a mesh and print the plan (no devices needed)",
        description="Plan how a model file's training step is distributed over a mesh, "
                    "without devices, processes or memory for its parameters.")
    p.add_argument("target", metavar="PATH[:NAME]",
                   help="a Python file (a file inside a package is imported as part of it) "
                        "or a module path such as transformers.models.llama.modeling_llama, "
                        "and what in it to plan: an nn.Module or flax module class, a "
                        "function that builds one, or a step with example inputs")
    p.add_argument("--init", metavar="EXPR",
                   help="Python expression, evaluated in the file's namespace, that builds "
                        "the model, e.g. 'GPT(GPTConfig(n_layer=2))' (default: NAME())")
    p.add_argument("--input", action="append", default=[], metavar="SPEC",
                   help="one model input of the GLOBAL batch: [name=]DTYPE[D0,...][<HIGH], "
                        "e.g. 'int64[8,128]<50257' or 'x=f32[32,3,32,32]'; repeat per input")
    p.add_argument("--loss", default="auto", metavar="auto|output|ce|mean|EXPR",
                   help="the loss: the model's own, cross-entropy over the last dim, the "
                        "mean, or an expression of out and the inputs (default auto)")
    p.add_argument("--optimizer", default="adamw", metavar="NAME|EXPR",
                   help="adamw (default), adam, sgd, momentum, or an expression (torch: of "
                        "params; jax: an optax transformation)")
    p.add_argument("--mesh", default="dp=8", metavar="AXIS=N[,...]",
                   help="the mesh to plan for, any size (default dp=8)")
    p.add_argument("--axis", default=None, metavar="NAME",
                   help="the axis the batch is split over (default: the one named dp, data "
                        "or batch; no pass partitions over another axis yet)")
    p.add_argument("--passes", default=None, metavar="SPEC",
                   help="pass pipeline instead of the default data parallelism + weight-"
                        "update sharding")
    p.add_argument("--dump-ir-after", default="", metavar="PASS|all",
                   help="print the IR after these passes (comma-separated; 'trace' is the "
                        "IR before any pass) or all")
    p.add_argument("--device-model", default=DEFAULT_DEVICE_MODEL, metavar="NAME",
                   help="the machine the step time is estimated on: "
                        + ", ".join(MODELS) + f" (default {DEFAULT_DEVICE_MODEL}, whatever "
                        "this machine has: inspect needs no devices), or measured: this "
                        "machine's first GPU, else its CPU, measured now")
    p.add_argument("--schedule", default=None,
                   choices=("gpipe", "1f1b", "interleaved", "interleaved-zb", "zbv",
                            "looped-bfs", "dualpipev"),
                   help="the pipeline schedule with a pp axis (default 1f1b; interleaved, "
                        "looped-bfs, the zero-bubble ones interleaved-zb and zbv, with "
                        "split backward, and dualpipev (M >= 2P) run two stages per rank)")
    p.add_argument("--microbatches", type=int, default=None, metavar="M",
                   help="with a pp axis: the microbatches a step is cut into (default: the "
                        "pp axis size; for dualpipev twice that)")
    p.add_argument("--shard-params", action="store_true",
                   help="hold the parameters as pieces over the data axis (FSDP-class), as "
                        "parallelize(..., shard_params=True) does; under a pipeline each "
                        "stage gathers its parameters once a step")
    p.add_argument("--plot", metavar="FILE",
                   help="with a pp axis: draw the schedule (ranks x time, forward and "
                        "backward blocks, from the schedule's action lists and the stages' "
                        "flops) into FILE (.png, .svg, .pdf; needs matplotlib)")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--rows", type=_at_least_one, default=60,
                   help="text tables longer than this group repeated layers (default 60)")
    p.add_argument("--out", metavar="FILE", help="write the report here instead of stdout")
    p.add_argument("--timings", action="store_true",
                   help="print how long each stage took (to stderr)")
    p.add_argument("--verify-passes", action="store_true",
                   help="check the IR after every pass, which names the pass that broke it "
                        "(slower; by default the traced and the final graphs are checked)")
    p.set_defaults(func=cmd_inspect)


def _uses(module: ModuleType, packages: tuple[str, ...]) -> bool:
    for v in vars(module).values():
        name = v.__name__ if isinstance(v, ModuleType) else getattr(v, "__module__", None)
        if isinstance(name, str) and name.split(".")[0] in packages:
            return True
    return False


def _framework(module: ModuleType, cand: Candidate | None, init: str | None,
               kinds: dict[str, tuple[type, ...]]) -> Framework:
    """The framework of the file: from the candidate's kind, the class --init calls (told
    apart by ``kinds``, the imported frameworks' model classes), or what the file imports."""
    kind = cand.kind if cand is not None else None
    if init is not None:
        try:
            call = ast.parse(init, mode="eval").body
        except SyntaxError:
            call = None
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name):
            kind = kind_of(getattr(module, call.func.id, None), kinds) or kind
    if kind == "nnx-module":
        raise InspectError("flax.nnx modules are planned through a step: write "
                           "step(params, opt_state, batch) and example_inputs() in the file "
                           "and name the step (see docs/guide.md)")
    fw = frameworks.of_kind(kind)
    if fw is not None:
        return fw
    users = [fw for fw in frameworks.imported() if _uses(module, fw.packages)]
    if len(users) != 1:
        raise InspectError("cannot tell whether the file is PyTorch or JAX" if users else
                           "the file imports neither torch nor jax/flax")
    return users[0]


def build_target(args: argparse.Namespace, mesh: Mesh, axis: str) -> Target:
    """Load the file and make the step to plan, as ``args`` describe it."""
    specs = [parse_input(t) for t in args.input]
    path, name = split_target(args.target)
    module = load_file(path)
    kinds = frameworks.module_kinds()
    cand = resolve(module, path, name, kinds) if name is not None or args.init is None \
        else None
    if cand is None and args.init is None:
        raise InspectError(f"{Path(path).name} defines no nn.Module, flax module or step "
                           "with example inputs", hint="name what to build: PATH:NAME, or "
                                                       "--init EXPR")
    # "model.py:" when --init alone says what to build: the model's class completes it
    label = f"{Path(path).name}:{name or (cand.name if cand else '')}"
    fw = _framework(module, cand, args.init, kinds).inspect_target()
    # a pipeline axis alone splits no batch: every stage sees the whole of it
    n = 1 if axis == pipeline_axis(mesh) else mesh.axis_size(axis)
    if cand is not None and cand.kind == "step" and args.init is None:
        own = [o for o, given in (("--input", specs), ("--loss", args.loss != "auto"),
                                  ("--optimizer", args.optimizer != "adamw")) if given]
        if own:
            raise InspectError(f"{cand.name} is a whole step: it makes its own inputs with "
                               f"{cand.inputs_fn.__name__}() and has its own loss and "
                               f"optimizer; {', '.join(own)} is for model classes")
        return fw.step_target(cand, label, n, axis)
    return fw.model_target(cand, module, label, args.init, specs, args.loss, args.optimizer,
                           n, axis)


def plan_target(target: Target, mesh: Mesh, axis: str, passes: str | None, dump: Any,
                stream: Any, clock: list | None = None, verify_passes: bool = True,
                device_model: str = DEFAULT_DEVICE_MODEL, schedule: str | None = None,
                microbatches: int | None = None, shard_params: bool = False
                ) -> tuple[Any, Any, list]:
    """Trace the step, run the pipeline for ``mesh`` (dumping as asked), and build the
    plan, as ``ParallelStep.trace()`` does, estimating the step time on ``device_model``
    (``microbatches``, ``shard_params``: parallelize's); ``clock`` collects (stage, time)
    pairs.

    The traced graph is checked by the frontend; ``verify_passes`` checks the graph after
    every pass too, which names the pass that broke it, and is what ``trace()`` does.
    Without it only the final graph is checked: for GPT-2 small the checks after each of
    the six passes cost more than a second, and a broken graph is still caught."""
    clock = clock if clock is not None else []
    from ..errors import IRVerifyError, PassError
    from ..ir.verify import verify
    from ..api import pipeline_settings, run_passes, trace_step
    from ..passes import PassContext
    pipeline = pipeline_settings(mesh, passes, microbatches, schedule)
    if pipeline is not None:       # stages balanced on the device model planned for
        pipeline = replace(pipeline, device_model=device_model)
    fw, graph, _, probe = trace_step(target.step, target.args, mesh, axis, None,
                              pipeline.microbatches if pipeline is not None else 1)
    clock.append(("trace", time.perf_counter()))
    for name in unread_inputs(graph, target.inputs):
        given = target.inputs[name]
        short = name.rsplit("/", 1)[-1]
        called = "" if given.startswith(short + "=") else f" (called {short})"
        print(f"warning: --input {given}{called} is read neither by the model nor by the "
              "loss: it changes nothing in the plan", file=sys.stderr)
    if dump == "all" or "trace" in dump:
        from ..ir import print_graph
        stream(f"# IR after trace\n{print_graph(graph.replace(mesh=mesh))}")
    ctx = PassContext(dump_after=dump, dump_stream=stream, verify=verify_passes)
    graph, plan = run_passes(graph, fw, mesh, axis, passes, ctx, device_model,
                             shard_params=shard_params, pipeline=pipeline,
                             warn=False,     # the plan says it
                             probe=probe)
    clock.append(("passes", time.perf_counter()))
    _check_schedule(plan, fw)
    if not verify_passes and ctx.records:
        try:
            verify(graph)
        except IRVerifyError as e:
            raise PassError(f"the graph after the passes does not verify:\n{e}",
                            pass_name="<pipeline>",
                            before=tuple(r.spec for r in ctx.records),
                            hint="--verify-passes checks after every pass and names the "
                                 "one that broke it") from e
        clock.append(("verify (final graph)", time.perf_counter()))
    clock.append(("plan", time.perf_counter()))
    return graph, plan, ctx.records


def _check_schedule(plan: Any, fw: Any) -> None:
    """A BackendError where the framework's pipeline runtime would refuse the plan's
    schedule (torch's 1F1B with fewer microbatches than ranks): the plan of a step that
    cannot run says so here, as the run would (a review found 1F1B at M = 1 planned with a
    50% bubble, 2026-12-07)."""
    from ..passes.pipeline_parallel import PipelineRecord
    rec = plan.decision(PipelineRecord)
    if rec is not None:
        stages = len(rec.stages)
        fw.pipeline_actions(rec.schedule, stages, rec.microbatches, rec.ranks or stages)


def plot_schedule(plan: Any, framework: str, path: str) -> None:
    """``--plot``: the plan's pipeline schedule laid out in time, drawn into ``path``."""
    from ..passes.pipeline_parallel import PipelineRecord
    from ..passes.pipeline_timeline import bubble, timeline
    from ..report.schedule import plot
    rec = plan.decision(PipelineRecord)
    if rec is None:
        raise InspectError("--plot draws a pipeline schedule, and this plan has none",
                           hint="give the mesh a pp axis, e.g. --mesh pp=4")
    stages = len(rec.stages)
    actions = frameworks.get(framework).pipeline_actions(rec.schedule, stages,
                                                         rec.microbatches, rec.ranks or stages)
    blocks = timeline(actions, [max(s.forward_flops, 1) for s in rec.stages],
                      [max(s.backward_flops, 1) for s in rec.stages],
                      [s.input_grad_flops / max(s.backward_flops, 1) for s in rec.stages])
    plot(blocks, path, f"{rec.schedule}: {rec.ranks or stages} ranks, {stages} stages, "
                       f"{rec.microbatches} microbatches; bubble {bubble(blocks):.1%} with "
                       f"these stages ({rec.bubble:.1%} with equal ones)")


def unread_inputs(graph: Any, inputs: dict[str, str]) -> list[str]:
    """The graph inputs among ``inputs`` that no op and no output of ``graph`` reads."""
    from ..ir.analysis import users
    read = users(graph)
    outs = {o.name for o in graph.outputs}
    return [i.name for i in graph.inputs
            if i.name in inputs and not read.get(i.name) and i.name not in outs]


def cmd_inspect(args: argparse.Namespace) -> int:
    """Run ``diphoma inspect``; the report goes to stdout or ``--out``."""
    clock = [("start", time.perf_counter())]
    mesh = parse_mesh(args.mesh)
    axis = inspect_axis(mesh, args.axis)
    if args.shard_params and args.passes is not None:
        raise InspectError("--shard-params picks the default passes, but --passes was given "
                           "too", hint="add shard-params{axis=dp} after "
                                       "weight-update-sharding in --passes instead")
    if args.device_model != "measured":
        device_model(args.device_model)  # an unknown name fails before the file is loaded
    dump: Any = "all" if args.dump_ir_after == "all" else frozenset(
        x.strip() for x in args.dump_ir_after.split(",") if x.strip())
    out = sys.stdout
    stream = (lambda s: sys.stderr.write(s)) if args.format == "json" and not args.out \
        else (lambda s: out.write(s))
    # what the user's code prints (a parameter count, say) must not mix with the report
    with contextlib.redirect_stdout(sys.stderr):
        target = build_target(args, mesh, axis)
        clock.append(("load and build", time.perf_counter()))
        if args.device_model == "measured":     # the framework's device on this machine
            from .. import framework as frameworks
            args.device_model = frameworks.get(target.framework).measure_device(()).name
            clock.append(("measure the device", time.perf_counter()))
        graph, plan, records = plan_target(target, mesh, axis, args.passes, dump, stream,
                                           clock, args.verify_passes, args.device_model,
                                           args.schedule, args.microbatches,
                                           args.shard_params)
    if dump != "all":
        ran = {name.split("{", 1)[0].strip() for name in plan.passes} | {"trace"}
        unknown = sorted(dump - ran)
        if unknown:
            raise InspectError(f"--dump-ir-after {','.join(unknown)}: no pass of that name "
                               f"ran (these did: {', '.join(sorted(ran - {'trace'}))})",
                               hint="name passes that ran, 'trace' for the IR before any "
                                    "pass, or all")
    plan = replace(plan, context=dict(target.context))
    if args.plot:
        plot_schedule(plan, target.framework, args.plot)
        clock.append(("plot", time.perf_counter()))
    report = plan.to_json() + "\n" if args.format == "json" else plan.to_text(args.rows)
    if args.out:
        Path(args.out).write_text(report)
    else:
        sys.stdout.write(report)
    clock.append(("report", time.perf_counter()))
    if args.timings:
        print(f"# total: {clock[-1][1] - clock[0][1]:.2f} s wall, {time.process_time():.2f} s "
              "CPU in this process (imports included)", file=sys.stderr)
        for (_, t0), (what, t1) in zip(clock, clock[1:]):
            print(f"# {what}: {t1 - t0:.2f} s", file=sys.stderr)
        for r in records:
            checked = f" (+{r.verify_seconds:.2f} s verify)" if args.verify_passes else ""
            print(f"#   pass {r.spec}: {r.seconds:.2f} s{checked}", file=sys.stderr)
    return 0
