"""Pipeline parallelism: cut the traced step into stages over a mesh axis, each stage with
its forward, backward and its parameters' update, and the values that cross stages sent
and received.

The forward ops are cut, in program order, at the S - 1 places that balance the stages'
time among the places where fewest bytes cross (layer boundaries: the residual stream):
each op's roofline seconds on a device model, its backward's and update's counted at the
forward op they will run beside (``balance=forward-flops``: the forward's flops alone).
Each cut then moves, between its neighbours, to where the longer of its two stages plus
its sends (latency and bytes on the link) take least time.
A backward op runs on the stage of the latest forward activations it reads (its forward
op's stage, which holds them); one that reads none runs on the highest stage that reads its
results; then those a later stage could run, reading only what it received in forward, move
there where fewer bytes cross (``pipeline_refine``). An update op runs on the stage of the
parameter it updates (the lowest stage that reads the parameter in forward); other update
math over several stages' values (a global gradient-norm clip) runs where most of its input
bytes are, so only scalars cross. Values
that depend only on the batch, hyperparameters and constants (label shifts, masks, the
learning rate's scalar math) are computed again on each stage that reads them rather than
sent. Every other value read on another stage than its own becomes a ``send`` on its stage
and a ``recv`` on the reader's, a pair sharing a ``tag``. A parameter read on two stages
(GPT-2's tied embedding and LM head) is held on both: its gradient contributions are summed
on its home stage, which updates it and sends the new value to the other (whose ``recv`` is
read by nothing: the runtime writes it into its copy).

Microbatching is the data-parallel idea over time: the step is traced at one microbatch
(the local batch / M), the forward and backward ops run once per microbatch, and what leaves
them for the update or the step's results (gradients, the loss) is averaged over the M
microbatches, as data-parallel averages over devices (the loss is a mean over the batch).
The graph keeps one copy of the per-microbatch ops; the schedule (GPipe, 1F1B, interleaved
1F1B, the zero-bubble ones) orders their runs on each stage, and is the runtime's. With
several stages per rank, stage s runs on rank s mod P (zbv and dualpipev: in a V, rank r
holds r and 2P - 1 - r); a send's ``peer`` is the other end's rank, its ``stage`` field
its stage."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import DiphomaError
from ..ir.analysis import free_inputs, op_cost
from ..ir.batch_coupling import BatchSplit, CountedMean, split_batch, split_notes
from ..ir.core import Attrs, Graph, InputKind, Op, OutputKind, Phase, Value
from ..ir.device_model import DeviceModel, device_model
from ..ir.types import DType
from ..ir.framework_ops import framework_rule
from ..ir.ops import draws_from_a_key, op_def, random_draw
from ..ir.rewrite import rename_region
from .base import Pass, PassContext, PassFailure, register_pass
from .data_parallel import DataParallelRecord, require_axis
from .global_counts import count_globally
from .pipeline_balance import balanced_cuts, cheapest_near, forward_costs, op_seconds
from .pipeline_draws import microbatch_draws
from .pipeline_orders import rank_orders
from .pipeline_pack import pack_update_scalars
from .pipeline_refine import pull_up_backward
from .pipeline_timeline import bubble, timeline
from .spec import parse_spec

SCHEDULES = ("gpipe", "1f1b", "interleaved", "interleaved-zb", "zbv", "looped-bfs",
             "dualpipev")
# schedules that run several stages per rank: stage s on rank s mod the axis size, or for
# the V-shaped zbv and dualpipev rank r holds stages r and 2P - 1 - r
LOOPED = ("interleaved", "interleaved-zb", "zbv", "looped-bfs", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")
# schedules that split each backward into input-gradient (I) and weight-gradient (W) runs
# (dualpipev some of them: its whole backwards run as I then W)
SPLIT_BACKWARD = ("interleaved-zb", "zbv", "dualpipev")
# what the stages are balanced on: each op's seconds on the device model with its backward
# and update, or (as before) the forward ops' flops alone
BALANCE = ("time", "forward-flops")
GATHER = ("step", "microbatch")


def stage_rank(schedule: str, stage: int, stages: int, ranks: int) -> int:
    """The rank (index on the pipeline axis) that runs ``stage``."""
    if schedule in V_SHAPED:
        return stage if stage < ranks else 2 * ranks - 1 - stage
    return stage % ranks
# inputs every rank has: each passes its batch, the optimizer's hyperparameters are scalars
_EVERYWHERE = (InputKind.batch, InputKind.hyper, InputKind.other)


def bubble_fraction(schedule: str, stages: int, microbatches: int, ranks: int | None = None
                    ) -> float:
    """The idle share of a rank's step under ``schedule`` with equal stages: its per-rank
    orders (``pipeline_orders``) laid out in time (``pipeline_timeline``) with every
    stage's backward twice its forward (the zero-bubble schedules' input- and
    weight-gradient runs each as long as the forward). With M >= P microbatches that is
    the textbook (P - 1) / (M + P - 1) for GPipe and 1F1B over P = S ranks (1F1B saves
    memory, not time), (P - 1) / (v M + P - 1) for interleaved 1F1B and looped BFS with v
    = S / P stages per rank (each rank's fill and drain are v times shorter), and (P - 1) /
    (3 v M + P - 1) for the zero-bubble ones (which fill the fill and drain with
    weight-gradient runs; zbv from M >= 2P - 1, the microbatches its generator plans
    for); with fewer microbatches the ranks wait longer than those formulas say (looped
    BFS and interleaved: 1 - v M / ((v - 1) P + M + P - 1)). Raises ValueError for M a
    schedule refuses."""
    p = stages if ranks is None else ranks
    orders = rank_orders(schedule, p, microbatches, stages)
    return bubble(timeline(orders, [1.0] * stages, [2.0] * stages))


@dataclass(frozen=True)
class StageInfo:
    """One stage: the layers and parameters it holds, its flops and parameter bytes."""

    index: int
    layers: tuple[str, ...]
    params: tuple[str, ...]
    flops: int
    param_bytes: int
    ops: int
    forward_flops: int = 0          # of ``flops``: the forward's and the backward's, per
    backward_flops: int = 0         # microbatch (the rest is the update, once a step)
    input_grad_flops: int = 0       # of the backward's: its input-gradient part (I)
    # per device, one microbatch's forward values the stage's backward reads (the plan
    # fills it in: report/plan.py)
    activation_bytes: int = 0
    # what the stages were balanced on, per microbatch: with balance=time, the roofline
    # seconds of the stage's forward and backward ops plus its update's / M on the pass's
    # device model; with forward-flops, its forward flops
    balanced: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """The stage as plain data."""
        return {"index": self.index, "layers": list(self.layers), "params": list(self.params),
                "flops": self.flops, "param_bytes": self.param_bytes, "ops": self.ops,
                "forward_flops": self.forward_flops, "backward_flops": self.backward_flops,
                "input_grad_flops": self.input_grad_flops,
                "activation_bytes": self.activation_bytes, "balanced": self.balanced}


@dataclass(frozen=True)
class PipelineRecord:
    """What pipeline decided: the stages, the schedule, what crosses and what is tied."""

    axis: str
    schedule: str
    microbatches: int
    stages: tuple[StageInfo, ...]
    sent_bytes: tuple[int, ...]           # bytes crossing each cut (stage s -> s + 1), per mb
    tied: dict[str, tuple[int, ...]] = field(default_factory=dict)   # param -> stages
    bubble: float = 0.0
    ranks: int = 0          # devices of the axis; stage s runs on rank s mod ranks
    balance: str = "time"   # what StageInfo.balanced measures (the pass's option)
    device_model: str = ""  # whose roofline, for balance=time
    # with microbatches > 1, forward ops that combine examples of the batch, computed per
    # microbatch (DataParallelRecord's two lists, ir/batch_coupling.py)
    batch_coupled: tuple[str, ...] = ()
    batch_counted: tuple[str, ...] = ()
    # means over counts of the batch divided by the count summed over the microbatches
    # (and the data-parallel devices): the single-device step's (passes/global_counts.py)
    counted_globally: tuple[str, ...] = ()
    # of those means' counts, the constants added to them (sum(mask) + 1) that the sum
    # over the shares adds once: exact, whatever data-parallel listed (not in the plan)
    shifted_globally: tuple[str, ...] = ()
    # draws from the step's key made for every microbatch, each keeping its rows
    # (passes/pipeline_draws.py), by source line
    random_per_microbatch: tuple[str, ...] = ()
    # where parameters held as pieces are gathered: once a step, or per microbatch
    gather: str = "step"

    def rank_of(self, stage: int) -> int:
        """The rank (index on the axis) that runs ``stage``."""
        return stage_rank(self.schedule, stage, len(self.stages), self.ranks or len(self.stages))

    def to_dict(self) -> dict[str, Any]:
        """The plan's ``notes["pipeline"]``."""
        return {"axis": self.axis, "schedule": self.schedule,
                "microbatches": self.microbatches,
                "stages": [s.to_dict() for s in self.stages],
                "sent_bytes": list(self.sent_bytes),
                "tied": {k: list(v) for k, v in self.tied.items()}, "bubble": self.bubble,
                "ranks": self.ranks or len(self.stages), "balance": self.balance,
                "device_model": self.device_model,
                "batch_coupled": list(self.batch_coupled),
                "batch_counted": list(self.batch_counted),
                "counted_globally": list(self.counted_globally),
                "random_per_microbatch": list(self.random_per_microbatch),
                "gather": self.gather}


@register_pass
@dataclass(frozen=True)
class PipelineParallel(Pass):
    """Cut the step into stages over mesh axis ``axis``; ``stages=auto`` is the axis size
    (twice it for the interleaved schedule, which runs stage s on rank s mod the size).
    ``balance=time`` balances the stages' forward, backward and update seconds on the
    roofline of ``device_model`` (a name in ``ir.device_model.MODELS``);
    ``balance=forward-flops`` their forward flops alone (passes/pipeline_balance.py).
    ``gather``: where a stage gathers the parameters a rank holds as pieces
    (``shard_params``): ``step``, once a step before the schedule, kept whole until its
    last backward (torch's pipelines keep FSDP's so); ``microbatch``, in every
    microbatch's forward and backward (2M gathers a step, the least memory)."""

    name = "pipeline"
    axis: str = "pp"
    stages: str = "auto"
    microbatches: int = 1
    schedule: str = "1f1b"
    balance: str = "time"           # or forward-flops
    device_model: str = "h100-nccl"  # whose roofline times the ops for balance=time
    gather: str = "step"            # or microbatch

    def __call__(self, graph: Graph, ctx: PassContext) -> Graph:
        n = require_axis(graph, self.axis, self.name)
        if self.schedule not in SCHEDULES:
            raise PassFailure(f"pipeline: unknown schedule {self.schedule!r}",
                              hint=f"one of {', '.join(SCHEDULES)}")
        looped = self.schedule in LOOPED
        auto = 2 * n if looped else n
        s = auto if self.stages == "auto" else _int(self.stages, "stages")
        if not looped and s != n:
            raise PassFailure(f"pipeline: stages={s} but the mesh axis {self.axis!r} has {n} "
                              f"devices; schedule {self.schedule} runs one stage per device",
                              hint="leave stages=auto, or schedule=interleaved for several "
                                   "stages per device")
        if looped and (s < 2 * n or s % n):
            raise PassFailure(f"pipeline: stages={s} is not a multiple of the {n} devices "
                              f"of the mesh axis {self.axis!r} of two or more stages per "
                              f"device, which schedule {self.schedule} runs",
                              hint=f"stages=auto ({auto}) or another multiple of {n}, or "
                                   "schedule=1f1b for one stage per device")
        if self.microbatches < 1:
            raise PassFailure("pipeline: microbatches must be at least 1",
                              hint="microbatches=M with M >= 1 (M >= stages keeps the "
                                   "bubble small)")
        norms = _batch_norms(graph)
        stats = _written_buffers(graph) or norms
        if self.microbatches > 1 and stats:
            more = f" and {len(stats) - 3} more" if len(stats) > 3 else ""
            buffers = not norms     # a counter, an average: no batch norm writes them
            raise PassFailure(
                (f"pipeline: the step's forward writes buffers ({', '.join(stats[:3])}"
                 f"{more}: running statistics, a counter); over {self.microbatches} "
                 "microbatches each forward would write them once per microbatch (a "
                 f"statistic of a microbatch, not the batch; a count {self.microbatches} "
                 "times)"
                 if buffers else
                 f"pipeline: the step's forward normalizes over the batch "
                 f"({', '.join(stats[:3])}{more}: BatchNorm in training mode); over "
                 f"{self.microbatches} microbatches each forward would normalize a "
                 "microbatch, not the batch") +
                ", and the step would differ from the single-device one",
                hint="microbatches=1 (schedule=gpipe), a norm without batch statistics "
                     "(LayerNorm, GroupNorm), or those layers in eval mode" if not buffers
                else "microbatches=1 (schedule=gpipe), or update such buffers outside the "
                     "step (after it returns)")
        empty = _empty_windows(graph)
        if empty and self.microbatches > 1:
            raise PassFailure(
                f"pipeline: at a microbatch's rows the step takes a window of no rows of "
                f"its batch ({empty}: a gradient accumulation inside the step over "
                f"x[:len(x) // 2] at one row a microbatch); the step is traced at one of "
                f"the {self.microbatches} microbatches, so that window would be empty",
                hint="fewer microbatches (each at least as many rows as the step's windows "
                     "need), or accumulate over the microbatches instead of inside the step")
        traced = graph      # the step as traced: what its batch analysis judges
        split = split_batch(traced, ctx.batch_probe, ctx.traced)
        graph, kept, drawn = microbatch_draws(graph, self.microbatches, split.rows)
        keyed = _keyed_draws_on_the_batch(graph, kept)
        if self.microbatches > 1 and keyed:
            raise PassFailure(
                f"pipeline: random numbers drawn from a key the step holds meet the batch "
                f"here ({', '.join(keyed[:3])}: dropout inside a lax.scan, or a draw not "
                f"made at the shape of the batch's rows); the step is traced at one "
                f"microbatch, so each of the {self.microbatches} microbatches would draw "
                "the same numbers from the same key (one mask repeated) instead of the "
                "whole batch's (a draw at the shape of the batch's rows, flax's or "
                "equinox's dropout outside a scan, is made for every microbatch)",
                hint="microbatches=1, dropout off (rate 0, or deterministic=True) for the "
                     "pipeline, or draw the random numbers outside the step and pass them "
                     "in with the batch")
        if self.schedule in V_SHAPED and s != 2 * n:
            raise PassFailure(f"pipeline: schedule {self.schedule} runs two stages per device "
                              f"in a V, not {s} stages on {n} devices",
                              hint=f"stages=auto ({2 * n})")
        try:
            rank_orders(self.schedule, n, self.microbatches, s)
        except ValueError as e:         # interleaved rounds: torch's generators refuse it too
            fit = (f"microbatches={s} or more (at least the {s} stages)"
                   if self.schedule == "dualpipev" else
                   f"microbatches={n * max(1, self.microbatches // n)} (a multiple of the "
                   f"{n} devices)")
            raise PassFailure(f"pipeline: schedule {self.schedule} cannot run "
                              f"{self.microbatches} microbatches on {n} devices: {e}",
                              hint=fit) from None
        if self.gather not in GATHER:
            raise PassFailure(f"pipeline: unknown gather {self.gather!r}",
                              hint="gather=step (each parameter held as pieces gathered "
                                   "once a step) or gather=microbatch (in every "
                                   "microbatch's forward and backward: less memory)")
        if self.balance not in BALANCE:
            raise PassFailure(f"pipeline: unknown balance {self.balance!r}",
                              hint=f"one of {', '.join(BALANCE)}")
        try:
            model = device_model(self.device_model)
        except DiphomaError as e:
            raise PassFailure(f"pipeline: {e}", hint="device-model=NAME, a name in "
                              "diphoma_compile.ir.device_model.MODELS") from None
        notes: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
        counted: tuple[str, ...] = ()
        shifted: tuple[str, ...] = ()
        if self.microbatches > 1:
            _refuse_summed_over_devices(ctx.decision(DataParallelRecord), self.microbatches,
                                        graph)
            _refuse_summed(traced, split, self.microbatches)
            _refuse_per_example(traced, split, self.microbatches)
            graph, made = _count_over_shares(graph, split, ctx.decision(DataParallelRecord),
                                             self.microbatches)
            exact = {id(x) for c in made for x in (c.coupling, *c.shifts)}
            notes = split_notes([c for c in split.couplings if id(c) not in exact])
            counted = tuple(dict.fromkeys(str(c.coupling) for c in made))
            shifted = tuple(dict.fromkeys(str(x) for c in made for x in c.shifts))
        cut = _Cut(graph, s, self.axis, n, self.schedule, self.microbatches, self.balance,
                   model)
        out = cut.rewrite()
        ctx.decisions[self.name] = replace(cut.record(self.schedule, self.microbatches),
                                           gather=self.gather,
                                           batch_coupled=notes[0], batch_counted=notes[1],
                                           counted_globally=counted,
                                           shifted_globally=shifted,
                                           random_per_microbatch=drawn)
        return out


def _empty_windows(graph: Graph) -> str | None:
    """Where the forward takes a window of no rows of a batch input (its source line, or
    the op), or None."""
    batch = {i.name for i in graph.inputs if i.role.kind is InputKind.batch
             and i.value.type.rank >= 1 and i.value.type.shape[0] > 0}
    for op in graph.ops:
        if (op.phase or Phase.forward) is Phase.forward and batch & set(op.inputs) and \
                any(v.type.rank >= 1 and v.type.shape[0] == 0 for v in op.results):
            return op.loc or op.name
    return None


def _count_over_shares(graph: Graph, split: BatchSplit, dp: DataParallelRecord | None,
                       microbatches: int) -> tuple[Graph, tuple[CountedMean, ...]]:
    """``graph`` with each mean over a count of the batch (a masked mean, cross-entropy's
    targets not ignored) dividing by the count summed over the microbatches, and over the
    data-parallel devices when the batch is split over them too (``global_counts.py``);
    and those means. Else each microbatch divides by its own count and the runtime
    averages the results: the single-device step's only when every microbatch counts
    alike (one that counts nothing divides 0 by 0)."""
    axis, n = None, 1
    if dp is not None:
        if dp.counted_globally:
            raise PassFailure(
                "pipeline: data-parallel already divides the step's means over counts by "
                f"the count summed over its devices ({dp.counted_globally[0]}); over "
                f"{microbatches} microbatches the pipeline sums them over both",
                hint="run data-parallel with counts=local before the pipeline pass (what "
                     "parallelize does)")
        n = dict(graph.mesh.axes).get(dp.axis, 1)
        axis = dp.axis if n > 1 else None
    if not split.counted:
        return graph, ()
    return count_globally(graph, split.counted, axis, n, split.rows, microbatches)


def _refuse_summed(graph: Graph, split: BatchSplit, microbatches: int) -> None:
    """The runtimes average the microbatches' losses, metrics and gradients: a loss or
    metric that is a sum over the batch (``ir/batch_coupling.py``), or a sum
    differentiated (the gradients of ``loss_sum.backward()``, its mean returned), would
    come out 1/M of the single-device step's."""
    summed = [o for o in graph.outputs if split.combine.get(o.name) == "sum"
              and o.role.kind in (OutputKind.loss, OutputKind.metric)]
    extreme = [o for o in graph.outputs if split.combine.get(o.name) in ("max", "min")
               and o.role.kind in (OutputKind.loss, OutputKind.metric)]
    if extreme:
        _refuse_extreme(graph, extreme[0].name, split.combine[extreme[0].name],
                        microbatches)
    if summed or split.gradients == "sum":
        if not summed:
            what = "the value the step differentiates"
        elif summed[0].role.kind is OutputKind.loss:
            what = "the step's loss"
        else:
            what = f"the step's metric %{summed[0].name}{_made_at(graph, summed[0].name)}"
        raise PassFailure(
            f"pipeline: {what} is a sum over the batch; over {microbatches} "
            "microbatches the pipeline averages the microbatches' losses and gradients, "
            f"which would give 1/{microbatches} of the single-device step's",
            hint="make it a mean over the batch (divide by the batch's size, "
                 "reduction='mean'), or microbatches=1")


def _refuse_per_example(graph: Graph, split: BatchSplit, microbatches: int) -> None:
    """The runtimes average what each microbatch returns: a returned value made from the
    batch that is neither a sum, mean, maximum nor minimum over it (per-example logits or
    losses, an argmax) would come out the elementwise mean of the microbatches' values,
    not the batch's. Data parallelism refuses such values first where it runs (its
    ``_combine``); this is the pipeline without it. A float scalar is averaged, as DDP
    averages one. Values made from the gradients (a norm per layer) are the step's, once:
    the gradients leave the microbatches summed as they should."""
    from_batch = {i.name for i in graph.inputs if i.role.kind is InputKind.batch}
    for op in graph.ops:       # not through the backward: the gradients are summed right
        if op.phase is not Phase.backward and any(n in from_batch for n in free_inputs(op)):
            from_batch.update(v.name for v in op.results)
    types = graph.value_types()
    for o in graph.outputs:
        t = types[o.name]
        if o.role.kind not in (OutputKind.loss, OutputKind.metric) or \
                o.name not in from_batch or o.name in split.combine or \
                t.numel == 1 and t.dtype.is_float:
            continue
        what = f"a {list(t.shape)} value" if t.numel != 1 else f"a scalar of type {t.dtype}"
        raise PassFailure(
            f"pipeline: the step returns %{o.name}{_made_at(graph, o.name)}, {what} "
            f"computed from the batch that is not a sum, mean, maximum or minimum over it; "
            f"over {microbatches} microbatches the pipeline averages the microbatches' "
            "results, which would not give the single-device step's",
            hint="return scalars (the loss, a mean or count over the batch) and compute "
                 "per-example outputs outside the step (PyTorch: on a copy of the model "
                 "loaded from step.state_dict(); JAX: from the parameters the step "
                 "returns), or microbatches=1")


def _loc(graph: Graph, name: str) -> str | None:
    """The source line (file:line) of the op making ``name``, where the trace recorded it."""
    op = next((o for o in graph.ops if name in (v.name for v in o.results)), None)
    return op.loc if op is not None and op.loc else None


def _made_at(graph: Graph, name: str) -> str:
    """`` (made at file:line)`` of the op making ``name``, or nothing: an IR name alone
    (%516) tells the user nothing."""
    loc = _loc(graph, name)
    return f" (made at {loc})" if loc else ""


def _refuse_extreme(graph: Graph, name: str, how: str, microbatches: int,
                    over: str = "") -> None:
    """A returned maximum or minimum over the batch: the runtimes average the
    microbatches' metrics, which would give the mean of the microbatches' maxima (a
    review found it returned with no word, 2026-12-07)."""
    loc = _loc(graph, name)
    at = f" at {loc}" if loc else ""
    word, words = ("maximum", "maxima") if how == "max" else ("minimum", "minima")
    raise PassFailure(
        f"pipeline: a metric the step returns{at} is a {word} over the batch{over}; over "
        f"{microbatches} microbatches the pipeline averages the microbatches' metrics, "
        f"which would give the mean of their {words}, not the batch's",
        hint="compute it outside the step (PyTorch: on a copy of the model loaded from "
             "step.state_dict(); JAX: from the parameters the step returns), or "
             "microbatches=1")


def _refuse_summed_over_devices(dp: DataParallelRecord | None, microbatches: int,
                                graph: Graph) -> None:
    """``_refuse_summed`` where data parallelism ran first: it has added up the devices'
    sums (and taken their maxima), so the graph this pass reads returns whole values; its
    record says which were sums over the batch (the loss, where the gradients are added
    up; metrics such as a count of correct answers), maxima or minima."""
    if dp is None:
        return
    extreme = sorted(n for n, how in dp.combined.items() if how in ("max", "min"))
    if extreme:
        _refuse_extreme(graph, extreme[0], dp.combined[extreme[0]], microbatches,
                        f" (over the {dp.axis} devices too)")
    summed = sorted(n for n, how in dp.combined.items() if how == "sum")
    if dp.gradients == "sum" or summed:
        what = "loss" if dp.gradients == "sum" else \
            f"metric{'s' if len(summed) > 1 else ''} " + \
            ", ".join(f"%{n}{_made_at(graph, n)}" for n in summed)
        raise PassFailure(
            f"pipeline: the step's {what} is a sum over the batch (added up over the "
            f"{dp.axis} devices); over {microbatches} microbatches the pipeline averages "
            "the microbatches' losses, metrics and gradients, which would give "
            f"1/{microbatches} of the single-device step's",
            hint="make it a mean over the batch (divide by the batch's size, "
                 "reduction='mean'), or microbatches=1")


def new_values(graph: Graph) -> dict[str, str]:
    """Each input the step gives a new value -> the output holding it. An input returned
    unchanged (the output is the input: a frozen parameter, a buffer the step only reads)
    has none."""
    return {o.role.target: o.name for o in graph.outputs if o.role.kind is OutputKind.replaces
            and o.name != o.role.target}


def updated_buffers(graph: Graph) -> dict[str, str]:
    """Each buffer the step writes a new value of (BatchNorm's running statistics) -> the
    output holding it."""
    buffers = {i.name for i in graph.inputs if i.role.kind is InputKind.buffer}
    return {b: new for b, new in new_values(graph).items() if b in buffers}


def _forward_after_backward(graph: Graph) -> str | None:
    """The first forward op reading a parameter after a backward op, in program order (a
    second forward through the model: gradient accumulation inside the step), if any.
    Forward ops reading no parameter may come late (optax.MultiSteps' step counting)."""
    params = {i.name for i in graph.inputs if i.role.kind is InputKind.param}
    backward = False
    for op in graph.ops:
        if op.phase is Phase.backward:
            backward = True
        elif backward and op.phase is Phase.forward and params & set(free_inputs(op)):
            what = op.attrs.get("target", op.name)
            return what + (f" at {op.loc}" if op.loc else "")
    return None


def _written_buffers(graph: Graph) -> list[str]:
    """The buffers the step's forward writes a new value of (running statistics, a
    counter): written once per microbatch under a pipeline."""
    phase = {v.name: op.phase or Phase.forward for op in graph.ops for v in op.results}
    return [b for b, new in updated_buffers(graph).items()
            if phase.get(new, Phase.update) is Phase.forward]


def _batch_norms(graph: Graph) -> list[str]:
    """The batch norms in training mode in the step's forward (by source line): each
    normalizes over the whole batch at once, with running statistics or none."""
    return [f"a batch norm at {op.loc or '?'}" for op in graph.ops
            if (op.phase or Phase.forward) is Phase.forward and op.name == "opaque"
            and getattr(framework_rule(op), "batch_stats", False)]


def _keyed_draws_on_the_batch(graph: Graph, kept: set[str] = frozenset()) -> list[str]:
    """Where numbers drawn from a key the step holds (JAX's keys; ``random_draw`` "key")
    meet values computed from the batch in forward or backward, by source line: a draw
    that reads batch values itself, or an op reading both a batch value and a drawn value
    of its result's shape (a mask). Not listed: draws from the process's own generator
    (torch's dropout draws anew on each call), noise on a weight (a weight plus a draw is
    a weight, the same on every microbatch as on one device), and the update's draws (it
    runs once a step: optax's noisy_sgd draws once, as on one device), nor draws made for
    every microbatch, whose rows the values ``kept`` hold (``pipeline_draws.py``)."""
    types = graph.value_types()
    kind = {i.name: i.role.kind for i in graph.inputs}
    batch = {n for n, k in kind.items() if k is InputKind.batch}
    weights = {n for n, k in kind.items()
               if k in (InputKind.param, InputKind.opt_state, InputKind.buffer)}
    drawn: set[str] = set()
    kept = set(kept)
    out: list[str] = []
    for op in graph.ops:
        if op.phase is Phase.update:
            continue
        ins = free_inputs(op)
        keyed = draws_from_a_key(op)
        shape = op.results[0].type.shape if op.results else None
        if ins and all(n in kept for n in ins):
            # made from the microbatch's own keys (one per example) or draws alone
            kept.update(v.name for v in op.results)
        elif any(n in batch for n in ins):
            if keyed or any(n in drawn and types[n].numel > 1 and types[n].shape == shape
                            for n in ins):
                out.append(op.loc or op.name)
            batch.update(v.name for v in op.results)
        elif any(n in weights for n in ins):
            weights.update(v.name for v in op.results)
        elif keyed or any(n in drawn for n in ins):
            drawn.update(v.name for v in op.results if v.name not in kept)
    return list(dict.fromkeys(out))


def _buffers_read_where_written(ops: list[Op], graph: Graph) -> None:
    """A buffer the step updates must be read only on the stage that writes its new value:
    a stage reading its own copy would read it stale from the second step on (one
    BatchNorm applied at two depths, on two stages)."""
    made = {v.name: op.stage for op in ops for v in op.results}
    for buf, new in updated_buffers(graph).items():
        writer = made.get(new)
        if writer is None:
            continue
        readers = {op.stage for op in ops if buf in op.inputs} - {writer}
        if readers:
            raise PassFailure(
                f"pipeline: the buffer %{buf} is updated on stage {writer} but "
                f"read on stage {min(readers)}, whose copy would stay as it was (a module "
                "with running statistics applied at two depths of the model)",
                hint="apply such a module once, keep its uses within one stage (fewer "
                     "stages), or put it in eval mode")


def _int(v: str, what: str) -> int:
    try:
        return int(v)
    except ValueError:
        raise PassFailure(f"pipeline: {what}={v!r} is not a number or auto",
                          hint=f"{what}=auto or {what}=N") from None


class _Cut:
    """One run of pipeline: stage of every op, then the rewritten graph."""

    def __init__(self, graph: Graph, stages: int, axis: str, ranks: int,
                 schedule: str, microbatches: int, balance: str, model: DeviceModel) -> None:
        self.g, self.n, self.ax, self.ranks = graph, stages, axis, ranks
        self.balance, self.model = balance, model
        self.rank = [stage_rank(schedule, s, stages, ranks) for s in range(stages)]
        self.types = graph.value_types()
        self.kind = {i.name: i.role.kind for i in graph.inputs}
        self.made: dict[str, Op] = {v.name: op for op in graph.ops for v in op.results}
        self.stage: dict[int, int] = {}          # id(op) -> stage
        self.free: set[int] = set()              # id(op) of ops recomputed where read
        self.local: set[str] = set()             # names every stage has or computes
        self.home: dict[str, int] = {}           # param -> its home stage
        self.readers: dict[str, set[int]] = defaultdict(set)   # param -> stages reading it
        # a parameter held as pieces, gathered whole -> the pieces it is gathered from
        self.gathered: dict[str, tuple[str, ...]] = {}
        self.sizes = dict(graph.mesh.axes)
        self.phase = {id(op): op.phase or Phase.forward for op in graph.ops}
        self._seen: set[tuple[str, int]] = set()     # (free value, stage) cloned there
        self.microbatches = microbatches
        self.find_free()
        self.cut_forward()
        self.place_rest()

    # 1. values every stage can compute itself: from the batch, hyperparameters, constants
    def find_free(self) -> None:
        """Mark ops computed from inputs every rank has and constants only. A buffer the
        step reads but never replaces (Llama's rotary inv_freq, a causal mask) is one: every
        rank holds the whole model's buffers, so the values made from it alone (the rotary
        cos/sin every layer reads) are recomputed on each stage rather than sent."""
        local = self.local
        replaced = updated_buffers(self.g)
        local.update(n for n, k in self.kind.items() if k in _EVERYWHERE
                     or k in (InputKind.rng, InputKind.microbatch)
                     or (k is InputKind.buffer and n not in replaced))
        for op in self.g.ops:
            d = op_def(op.name)
            # a parameter held as pieces (shard_params), gathered whole: each stage that
            # reads the whole value gathers it from its own pieces (a tied embedding's
            # on both), rather than receive it from another stage every microbatch
            if op.name == "all_gather" and not op.attrs.get("async") and \
                    len(op.results) == 1 and op.inputs and \
                    all(self.kind.get(n) is InputKind.param for n in op.inputs):
                self.gathered[op.results[0].name] = op.inputs
                continue
            # a draw from the step's key (with the microbatch's index: the same numbers on
            # every stage) is made again where it is read, as the batch's values are; one
            # from a process's own generator is not, nor one that reads no key (XLA's
            # stateful rng_uniform, which JAX's frontend marks as keyed)
            if d.effectful or op.regions or random_draw(op) == "global" or \
                    (random_draw(op) and not any(self.types[n].dtype is DType.key
                                                 for n in op.inputs)):
                continue
            if all(n in local for n in free_inputs(op)):
                self.free.add(id(op))
                local.update(v.name for v in op.results)

    # 2. forward: S contiguous pieces of program order, cut where few bytes cross
    def cut_forward(self) -> None:
        """Stage the forward ops: balanced flops among the cheapest cut points."""
        fwd = [op for op in self.g.ops if self.phase[id(op)] is Phase.forward
               and id(op) not in self.free]
        if len(fwd) < self.n:
            raise PassFailure(f"pipeline: the step's forward pass has {len(fwd)} ops to "
                              f"place, fewer than the {self.n} stages asked for",
                              hint=f"use a mesh axis {self.ax!r} of at most {len(fwd)} "
                                   "devices, or a deeper model")
        rest = [op for op in self.g.ops if self.phase[id(op)] is not Phase.forward
                and id(op) not in self.free]
        cost = forward_costs(self.g, fwd, rest, self.types, self.sizes, self.microbatches,
                             self.model, self.balance)
        at = {v.name: k for k, op in enumerate(fwd) for v in op.results}
        last_use: dict[str, int] = {}
        for k, op in enumerate(fwd):
            for name in free_inputs(op):
                if name in at:
                    last_use[name] = k
        # bytes and values live across the point before op k (made before k, read at k or
        # later): what a cut there sends
        delta = [0] * (len(fwd) + 1)
        dcount = [0] * (len(fwd) + 1)
        for name, k0 in at.items():
            k1 = last_use.get(name)
            if k1 is not None and k1 > k0:
                delta[k0 + 1] += self.types[name].nbytes
                delta[k1 + 1] -= self.types[name].nbytes
                dcount[k0 + 1] += 1
                dcount[k1 + 1] -= 1
        crossing, live = [0] * (len(fwd) + 1), 0
        values, n_live = [0] * (len(fwd) + 1), 0
        for k in range(len(fwd) + 1):
            live += delta[k]
            n_live += dcount[k]
            crossing[k], values[k] = live, n_live
        pre = [0]
        for c in cost:
            pre.append(pre[-1] + c)
        # every stage holds a parameter: a forward op of its own that reads one
        # (or the whole value gathered from its pieces, under shard_params: the gather
        # itself holds nothing, the op reading what it gathers does)
        holds = [not any(v.name in self.gathered for v in op.results) and
                 any(self.kind.get(n) is InputKind.param or n in self.gathered
                     for n in free_inputs(op)) for op in fwd]
        # the narrowest crossing away from the ends (after the loss only a scalar
        # crosses), among the points before the last op reading a parameter: a cut after
        # it would leave the last stage none (the ops there, as optax.MultiSteps' step
        # counting, read no activations, and their narrow crossing hid the layers'
        # boundaries)
        m = 1 + max((k for k, h in enumerate(holds) if h), default=len(fwd) - 1)
        lo, hi = pre[m] / (2 * self.n), pre[m] * (1 - 1 / (2 * self.n))
        # away from the ends by cost; failing that, by position, each stage then holding a
        # weight matrix (an update weighed on the last layer, as optax.MultiSteps' cond,
        # moved the cost window onto the narrow head; a stage of a bias add alone is not a
        # layer)
        matrices = [h and any((self.kind.get(n) is InputKind.param or n in self.gathered)
                              and self.types[n].rank >= 2 for n in free_inputs(op))
                    for h, op in zip(holds, fwd)]
        for inside, need in ((lambda k: lo <= pre[k] <= hi, holds),
                             (lambda k: m / (2 * self.n) <= k <= m * (1 - 1 / (2 * self.n)),
                              matrices)):
            inner = [crossing[k] for k in range(1, m) if inside(k)] or \
                [crossing[k] for k in range(1, m)]
            low = min(inner) if inner else 0
            # the layer boundaries: where no more than the residual stream (and a little)
            # lives
            points = [k for k in range(1, m) if crossing[k] <= low * 1.5 + 64]
            cuts = balanced_cuts(cost, points, self.n, need)
            if cuts is not None:
                holds = need
                break
        if cuts is None and (again := _forward_after_backward(self.g)) is not None:
            raise PassFailure(
                f"pipeline: the step runs its forward again after a backward ({again} reads "
                "a parameter after the first backward: gradient accumulation over chunks of "
                "the batch, or a second call of the model), and no cut gives each stage "
                "its layers; a pipeline cuts one forward and one backward into stages, and "
                "accumulates the microbatches itself",
                hint="write the step for the whole local batch, one forward and one "
                     "backward, and pass microbatches=M to parallelize")
        if cuts is None:
            scanned = any(op.regions and h for op, h in zip(fwd, holds))
            raise PassFailure(
                f"pipeline: the forward pass has {len(points)} places to cut where few bytes "
                f"cross (layer boundaries), too few for {self.n} stages that each hold a "
                "layer with parameters" + (" (a lax.scan over layers is one layer here: it "
                                           "runs whole on one stage)" if scanned else ""),
                hint=f"use fewer stages than {self.n} (fewer devices on the {self.ax!r} "
                     "axis, or a schedule with one stage per device), or a model with more "
                     "layers")
        # each cut moved to where its two stages' longer one plus the sends (a message's
        # latency each, and its bytes, forward and back) take least time
        link = self.model.link_of(self.ax)
        xfer = [2 * (values[k] * link.latency_s + crossing[k] / link.bytes_per_s)
                for k in range(len(fwd) + 1)]
        cuts = cheapest_near(cuts, points, pre, xfer, holds)
        self.cuts = cuts
        self.cut_bytes = tuple(crossing[k] for k in cuts)
        bounds = [0, *cuts, len(fwd)]
        for s in range(self.n):
            for op in fwd[bounds[s]:bounds[s + 1]]:
                self.stage[id(op)] = s
        for op in fwd:
            for name in free_inputs(op):
                if self.kind.get(name) is InputKind.param:
                    self.readers[name].add(self.stage[id(op)])
                for p in self.gathered.get(name, ()):      # read through its gather
                    self.readers[p].add(self.stage[id(op)])
        for name, where in self.readers.items():
            self.home[name] = min(where)

    # 3. backward by the activations it reads; update by the parameter it updates
    def place_rest(self) -> None:
        """Stage backward and update ops (forward ones are placed): first those that read
        activations or update a parameter, then gradient-only math by who reads it."""
        of = {i.name: i.role.of for i in self.g.inputs if i.role.kind is InputKind.opt_state}
        todo = [op for op in self.g.ops if id(op) not in self.stage and id(op) not in self.free]
        for op in todo:
            reads = free_inputs(op)
            acts = {self.stage[id(self.made[n])] for n in reads if n in self.made
                    and id(self.made[n]) in self.stage
                    and self.phase[id(self.made[n])] is Phase.forward}
            mine = {self.home.get(n if self.kind.get(n) is InputKind.param else of.get(n), -1)
                    for n in reads if n in self.kind} - {-1}
            if self.phase[id(op)] is Phase.update and mine:
                self.stage[id(op)] = min(mine)
            elif self.phase[id(op)] is Phase.backward and acts:
                # the forward op's own results are saved on its stage; its inputs may come
                # from earlier ones
                self.stage[id(op)] = max(acts)
        # gradient-only math (reshapes, sums of contributions, a bias's gradient) runs
        # where its results are read: in reverse, so that readers are placed first
        readers: dict[str, list[Op]] = defaultdict(list)
        for op in self.g.ops:
            for n in free_inputs(op):
                readers[n].append(op)
        moved: list[Op] = []
        for op in reversed(todo):
            if id(op) in self.stage or self.phase[id(op)] is not Phase.backward:
                continue
            at = {self.stage[id(r)] for v in op.results for r in readers.get(v.name, ())
                  if id(r) in self.stage}
            if at:      # the highest reader: from there the result flows down
                self.stage[id(op)] = max(at)
                moved.append(op)
        # the op making a parameter's or its state's new value runs where they live (its
        # parameter's home), whatever it reads: a momentum's new value made from a term of
        # the old one and the gradient, two inputs of one size, went to the lower stage of
        # the two, and the state's holder never saw it
        owner = {}
        for o in self.g.outputs:
            p = o.role.target if o.role.kind is OutputKind.replaces else None
            p = of.get(p, p)
            if p in self.home and o.name in self.made:
                owner[id(self.made[o.name])] = self.home[p]
        for op in todo:
            if id(op) in self.stage:
                continue
            reads = free_inputs(op)
            mine = {self.home.get(n if self.kind.get(n) is InputKind.param else of.get(n), -1)
                    for n in reads if n in self.kind} - {-1}
            others = {self.stage[id(self.made[n])] for n in reads if n in self.made
                      and id(self.made[n]) in self.stage}
            if id(op) in owner and self.phase[id(op)] is Phase.update:
                s = owner[id(op)]
            elif others and self.phase[id(op)] is Phase.update:
                # update math on values of several stages (a global gradient-norm clip:
                # each gradient's norm, their total, each gradient times the factor) runs
                # where most of its input bytes are, so only scalars cross
                held: dict[int, int] = defaultdict(int)
                for n in reads:
                    if n in self.made and id(self.made[n]) in self.stage:
                        held[self.stage[id(self.made[n])]] += self.types[n].nbytes
                s = max(held, key=lambda k: (held[k], -k))
            elif others:
                s = min(others)
            elif mine:
                s = min(mine)
            else:        # reads nothing placed: backward starts on the last stage
                s = self.n - 1 if self.phase[id(op)] is Phase.backward else 0
            self.stage[id(op)] = s
        # an op whose inputs all come from one later stage and are larger than its results
        # (a sum of two gradient contributions) runs there and sends its result instead
        for op in reversed(moved):
            src = {self.stage[id(self.made[n])] for n in op.inputs if n in self.made
                   and id(self.made[n]) in self.stage}
            if len(src) == 1 and min(src) > self.stage[id(op)]:
                size_in = sum(self.types[n].nbytes for n in op.inputs if n in self.made)
                if size_in > sum(v.type.nbytes for v in op.results):
                    self.stage[id(op)] = min(src)
        # the backward of a later stage's forward op that reads only what that stage
        # received (a cut's activation, a parameter it uses) moves there where fewer bytes
        # then cross (pipeline_refine)
        pull_up_backward(list(self.g.ops), self.stage, self.phase, self.made, self.local,
                         self.types, self.n, self.microbatches)
        for op in todo:
            if self.phase[id(op)] is not Phase.forward:
                for n in free_inputs(op):
                    if self.kind.get(n) is InputKind.param:
                        self.readers[n].add(self.stage[id(op)])
                    for p in self.gathered.get(n, ()):
                        self.readers[p].add(self.stage[id(op)])

    # 4. the graph with stages, clones of free values, and send/recv pairs
    def rewrite(self) -> Graph:
        """The staged graph."""
        names = self.g.fresh_names()
        out: list[Op] = []
        where: dict[tuple[str, int], str] = {}     # (value, stage) -> its name there
        for i in self.g.inputs:
            for s in range(self.n):
                where[(i.name, s)] = i.name
        origin = {v.name: op for op in self.g.ops for v in op.results}
        tags = iter(range(1 << 30))
        self.sent: list[tuple[str, int, int, Phase]] = []

        def have(name: str, s: int, before: Phase) -> str:
            got = where.get((name, s))
            if got is not None:
                return got
            op = origin[name]
            if id(op) not in self.free and name in self.gathered:
                # gathered again here from this stage's pieces (named anew)
                self._seen.update((v.name, self.stage[id(op)]) for v in op.results)
            if id(op) in self.free or name in self.gathered:
                clone = self.clone(op, s, names, have, before)
                out.append(clone)
                for v, c in zip(op.results, clone.results):
                    where[(v.name, s)] = c.name
                return where[(name, s)]
            src = self.stage[id(op)]
            tag = next(tags)
            t = self.types[name]
            ph = self.phase[id(op)]
            out.append(Op("send", (where[(name, src)],), (), Attrs(axis=self.ax,
                                                                   peer=self.rank[s],
                                                                   tag=tag),
                          phase=ph, stage=src, loc=op.loc))
            new = names(f"{name}.s{s}")
            out.append(Op("recv", (), (Value(new, t),),
                          Attrs(axis=self.ax, peer=self.rank[src], tag=tag),
                          phase=ph, stage=s, loc=op.loc))
            self.sent.append((name, src, s, ph))
            where[(name, s)] = new
            return new

        for op in self.g.ops:
            if id(op) in self.free:
                continue
            s = self.stage[id(op)]
            ren = {n: have(n, s, self.phase[id(op)]) for n in free_inputs(op)}
            op = op.replace(inputs=tuple(ren.get(n, n) for n in op.inputs), stage=s)
            if op.regions:
                op = _rename_captures(op, ren)
            out.append(op)
            for v in op.results:
                where[(v.name, s)] = v.name
        outputs = list(self.g.outputs)
        # the step's results are made where their stage puts them; a free value returned
        # is computed on the stage reading the buffer it replaces (equinox BatchNorm's
        # first-call flag, made False), or else on the last stage (a metric of the batch)
        reading: dict[str, set[int]] = {}
        for op in out:
            for n in op.inputs:
                reading.setdefault(n, set()).add(op.stage)
        at = [self._stage_of(o.name, reading.get(o.role.target, set())
                             if o.role.kind is OutputKind.replaces else set())
              for o in outputs]
        for o, s in zip(outputs, at):
            if (o.name, s) not in where and o.name in origin:
                have(o.name, s, Phase.forward)
        outputs = [type(o)(where.get((o.name, s), o.name), o.role)
                   for o, s in zip(outputs, at)]
        # a parameter read on several stages: its home updates it, the others receive it;
        # a frozen one (no new value: the step returns the parameter itself) is never sent:
        # every stage's copy stays as it is
        self.tied: dict[str, tuple[int, ...]] = {}
        changed = new_values(self.g)
        new_of = {o.role.target: o.name for o in outputs if o.role.kind is OutputKind.replaces}
        for p, stages in sorted(self.readers.items()):
            if len(stages) < 2 or p not in changed:
                continue
            self.tied[p] = tuple(sorted(stages))
            src = self._stage_of(new_of[p])
            for s in sorted(stages - {src}):
                tag = next(tags)
                out.append(Op("send", (new_of[p],), (), Attrs(axis=self.ax, peer=self.rank[s],
                                                  tag=tag), phase=Phase.update, stage=src))
                out.append(Op("recv", (), (Value(names(f"{p}.new.s{s}"),
                                                 self.types[p]),),
                              Attrs(axis=self.ax, peer=self.rank[src], tag=tag),
                              phase=Phase.update,
                              stage=s))
        self.check_flow(out)
        _buffers_read_where_written(out, self.g)
        out = pack_update_scalars(out, names)
        self.out = out
        return self.g.replace(ops=tuple(out), outputs=tuple(outputs))

    def _stage_of(self, name: str, readers: set[int] = frozenset()) -> int:
        """The stage making ``name``; for a free value, the first of ``readers`` (the
        stages reading the buffer it replaces), or the last stage."""
        op = self.made.get(name)
        if op is None:
            return 0
        if id(op) in self.free:
            return min(readers, default=self.n - 1)
        return self.stage[id(op)]

    def clone(self, op: Op, s: int, names, have, before: Phase) -> Op:
        """A copy of the free op ``op`` on stage ``s`` (renamed unless it is the first)."""
        ins = {n: have(n, s, before) for n in free_inputs(op)}
        first = all((v.name, t) not in self._seen for v in op.results for t in range(self.n))
        results = op.results if first else tuple(
            Value(names(f"{v.name}.s{s}"), v.type) for v in op.results)
        for v in op.results:
            self._seen.add((v.name, s))
        return op.replace(inputs=tuple(ins.get(n, n) for n in op.inputs), results=results,
                          stage=s)

    def check_flow(self, ops: list[Op]) -> None:
        """Values cross stages only the ways a pipeline schedule orders: forward ones to
        later stages, backward ones to earlier stages (gradients flow back)."""
        for name, src, dst, ph in self.sent:
            if ph is Phase.backward and dst > src:
                raise PassFailure(
                    f"pipeline: cannot cut the step into {self.n} stages: the backward "
                    f"value %{name} would be made on stage {src} and read on the later "
                    f"stage {dst}, but a schedule runs a microbatch's backward from the last "
                    "stage to the first", op=self.made.get(name),
                    hint="use fewer stages (each should hold whole layers), or a deeper "
                         "model")

    def record(self, schedule: str, microbatches: int) -> PipelineRecord:
        """What this run decided, for the plan."""
        flops = [0] * self.n
        count = [0] * self.n
        by_phase: dict[Phase, list[int]] = {p: [0] * self.n for p in Phase}
        in_grad = [0] * self.n
        split = input_gradient_ops(self.out)
        types = dict(self.types)
        types.update((v.name, v.type) for op in self.out for v in op.results)
        for op in self.out:
            if id(op) in split:
                in_grad[op.stage] += op_cost(op, types, self.sizes).flops
        balanced = [0.0] * self.n
        for op in self.g.ops:
            if id(op) in self.stage:
                s = self.stage[id(op)]
                c = op_cost(op, self.types, self.sizes)
                flops[s] += c.flops
                by_phase[self.phase[id(op)]][s] += c.flops
                count[s] += 1
                if self.balance == "time":
                    balanced[s] += op_seconds(c, self.phase[id(op)], self.model, microbatches)
                elif self.phase[id(op)] is Phase.forward:
                    balanced[s] += c.flops
        stages = []
        for s in range(self.n):
            params = tuple(p for p in (i.name for i in self.g.inputs)
                           if s in self.readers.get(p, ()))
            if count[s] == 0:
                raise PassFailure(f"pipeline: stage {s} would hold no op",
                                  hint="use fewer stages")
            if not params:
                # the cut fell between ops of one layer (an embedding's sum, say): the
                # model has fewer layers than stages
                raise PassFailure(
                    f"pipeline: stage {s} of {self.n} would hold no parameter: the model "
                    f"has too few layers to give each of {self.n} stages one",
                    hint=f"use fewer stages than {self.n} (fewer devices on the "
                         f"{self.ax!r} axis, or a schedule with one stage per device), or "
                         "a model with more layers")
            layers = tuple(dict.fromkeys(p.rsplit(".", 1)[0] for p in params))
            stages.append(StageInfo(s, layers, params, flops[s],
                                    sum(self.types[p].nbytes for p in params), count[s],
                                    by_phase[Phase.forward][s], by_phase[Phase.backward][s],
                                    in_grad[s], balanced=balanced[s]))
        return PipelineRecord(self.ax, schedule, microbatches, tuple(stages), self.cut_bytes,
                              dict(self.tied),
                              bubble_fraction(schedule, self.n, microbatches, self.ranks),
                              self.ranks, self.balance, self.model.name)


def _rename_captures(op: Op, ren: dict[str, str]) -> Op:
    """``op`` with the values its regions capture from outside renamed as its operands
    were: a capture made on another stage is read from its recv on this one (a lax.scan
    over layers reading the activation the stage before sent)."""
    mapping = {k: v for k, v in ren.items() if k != v}
    if not mapping:
        return op
    return op.replace(regions=tuple(rename_region(r, mapping) for r in op.regions))


def pipeline_of(graph: Graph) -> PipelineParallel | None:
    """The pipeline pass a planned graph went through (its options), from its header."""
    for spec in graph.passes:
        if spec.startswith(PipelineParallel.name + "{") or spec == PipelineParallel.name:
            got = parse_spec(spec)
            return got[0] if got else None
    return None



def input_gradient_ops(ops: tuple[Op, ...] | list[Op]) -> set[int]:
    """id() of the backward ops of a staged graph that a split backward runs as its
    input-gradient part I, walking back inside each stage's backward from two kinds of
    value: the backward values the stage sends to an earlier stage, and the backward
    values read by two or more of the stage's backward ops (a gradient that fans out is an
    activation's: the chain of activation gradients, which on the first stage sends
    nothing but still runs down to the embedding). The rest of a stage's backward, in-trees
    of ops that each end in a parameter's gradient (a weight's matmul, a bias's sum, an
    embedding's scatter), is its W part."""
    phase_of = {v.name: op.phase for op in ops for v in op.results}
    # every backward value sent (an activation's gradient, or a weight's gradient the
    # stage before updates: received in its I, per microbatch, as I runs)
    grad_tags = {op.attrs["tag"] for op in ops if op.name == "recv"
                 and phase_of.get(op.results[0].name) is Phase.backward}
    made = {(v.name, op.stage): op for op in ops for v in op.results}
    need = [(op.inputs[0], op.stage) for op in ops if op.name == "send"
            and op.phase is Phase.backward and op.attrs["tag"] in grad_tags]
    readers: dict[tuple[str, int | None], int] = {}
    for op in ops:
        if op.phase is Phase.backward and op.name not in ("send", "recv"):
            for n in set(free_inputs(op)):
                readers[(n, op.stage)] = readers.get((n, op.stage), 0) + 1
    need += [key for key, count in readers.items()
             if count > 1 and phase_of.get(key[0]) is Phase.backward]
    out: set[int] = set()
    while need:
        name, stage = need.pop()
        op = made.get((name, stage))
        if op is None or id(op) in out or op.phase is not Phase.backward or op.name == "recv":
            continue
        out.add(id(op))
        need.extend((n, stage) for n in free_inputs(op))
    return out
