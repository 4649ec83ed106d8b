"""The plan as text: a summary a person reads first, then tables (tensors, collectives)
and the decisions the passes recorded (what stayed replicated and why)."""

from __future__ import annotations

import re
from collections import Counter
from typing import TYPE_CHECKING

from ..passes.comm_fusion import CommFusionRecord
from ..passes.data_parallel import DataParallelRecord
from ..passes.pipeline_parallel import SPLIT_BACKWARD, V_SHAPED, PipelineRecord
from ..passes.quantize_grads import QuantizeGradsRecord
from ..passes.quantize_weight_diff import QuantizeWeightDiffRecord
from ..passes.schedule_comm import ScheduleCommRecord
from ..passes.shard_params import ShardParamsRecord
from ..passes.tensor_parallel import TensorParallelRecord
from ..passes.weight_update_sharding import WeightUpdateShardingRecord
from ..ir.opdef import is_local
from .units import flops_text, human, seconds_text

if TYPE_CHECKING:
    from .plan import Memory, Plan

__all__ = ["human", "render", "summary"]


def _ratio(part: int, whole: int) -> str:
    if not whole or part == whole:
        return ""
    return f" (1/{whole / part:.2f} of {human(whole)})" if part else f" (of {human(whole)})"


def _table(rows: list[list[str]], head: list[str]) -> list[str]:
    widths = [max(len(str(r[k])) for r in [head, *rows]) for k in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return ["  " + fmt.format(*head).rstrip()] + ["  " + fmt.format(*r).rstrip() for r in rows]


def _group(name: str) -> str:
    """A layer-agnostic key: numbers in a name become #, so repeated layers group."""
    return re.sub(r"(?<=[._/])\d+(?=[._/])", "#", name)


def _count(n: int) -> str:
    """An element count as 124.44M / 3.20K / 17."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def _summary(plan: Plan) -> list[str]:
    m = plan.memory
    mesh = ", ".join(f"{a}={n}" for a, n in plan.mesh.items()) or "one device"
    moved = [c for c in plan.collectives if not is_local(c.kind)]
    kinds = Counter(c.kind for c in moved)
    ctx = plan.context
    lines = [f"plan for @{plan.graph} on mesh {mesh}"]
    model = ctx.get("model", "")
    lines.append(f"model: {model + ', ' if model else ''}{_count(plan.param_count)} parameters "
                 f"({human(m.single_device_params)})")
    lines += [f"{k}: {ctx[k]}" for k in ("init", "inputs", "loss", "optimizer") if ctx.get(k)]
    lines += [
        f"passes: {', '.join(plan.passes) or 'none'}",
        "",
        "per device (vs one device running the whole step):",
        f"  parameters       {human(m.params)}{_ratio(m.params, m.single_device_params)}",
        f"  gradients        {human(m.grads)}{_ratio(m.grads, m.single_device_grads)}",
        f"  optimizer state  {human(m.opt_state)}"
        f"{_ratio(m.opt_state, m.single_device_opt_state)}",
        f"  activations      {human(m.activations)}"
        f"{_ratio(m.activations, m.single_device_activations)}"
        "  (estimate: forward values kept for backward)",
        f"  total            {human(m.params + m.grads + m.opt_state + m.activations)}",
        _peak_line(m),
        f"communication per step per device: {human(plan.comm_bytes_per_step)}"
        + (" (the fullest pipeline rank; by pp rank: "
           + ", ".join(human(b) for b in plan.comm_bytes_per_rank) + ", each collective "
           "as often as its program runs)" if plan.comm_bytes_per_rank else "")
        + f" in {sum(kinds.values())} collectives"
        + (" (" + ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items())) + ")"
           if kinds else "") + _calls_text(plan),
    ]
    lines += _compute_lines(plan)
    if plan.idle_axes:
        axes = ", ".join(f"{a}={n}" for a, n in plan.idle_axes.items())
        lines.append(f"unused mesh axes: {axes}: no pass in this pipeline partitions over "
                     "them, so every device along them repeats the same step on the same "
                     "tensors (the figures above hold for each)")
    return lines


def _peak_line(m: Memory) -> str:
    """The peak: of the program, or under a pipeline of the fullest rank, with each rank's."""
    if m.peak_per_rank:
        ranks = ", ".join(human(b) for b in m.peak_per_rank)
        return (f"  peak             {human(m.peak)} while the step runs (the fullest pipeline "
                f"rank: its stages' programs in its schedule's order, with the microbatches "
                f"it keeps; {m.peak_at}); by pp rank: {ranks}")
    return (f"  peak             {human(m.peak)} while the step runs (liveness over the program: "
            f"what the step holds plus the values live at its busiest op, "
            f"{m.peak_at or 'none'})")


def _compute_lines(plan: Plan) -> list[str]:
    """Flops per device and per step, the estimated step time, ops of unknown cost."""
    c = plan.compute
    if c is None:
        return []
    lines = [f"compute: {flops_text(float(c.flops_per_device))} per device per step "
             f"({flops_text(c.flops_per_step)} whole step); est. {seconds_text(c.total_s)}/step "
             f"on {c.device_model} = {seconds_text(c.compute_s)} compute + "
             f"{seconds_text(c.exposed_comm_s)} exposed communication"
             + (f" + {seconds_text(c.bubble_s)} pipeline bubble (the last rank to finish: "
                "its stages' programs, M microbatches, in its schedule's order)"
                if c.bubble_s else "")]
    if c.unknown_cost_ops:
        lines.append(f"cost unknown ({len(c.unknown_cost_ops)} framework ops no rule gives "
                     "flops for, counted as zero): " + ", ".join(c.unknown_cost_ops))
    return lines


def summary(plan: Plan) -> str:
    """The summary lines of the report, without the tables."""
    return "\n".join(_summary(plan)) + "\n"


def render(plan: Plan, max_rows: int = 60) -> str:
    """The text report of ``plan``: summary, tensors, collectives, the passes' decisions.
    Tables longer than ``max_rows`` group repeated layers (layer numbers become #)."""
    lines = _summary(plan) + ["", "tensors:"]
    rows = [[t.name, t.role, f"{t.dtype}{list(t.shape)}", t.placement,
             human(t.bytes_per_device)] for t in plan.tensors]
    lines += _table(_fold(rows, max_rows), ["name", "role", "type", "placement",
                                            "bytes/device"])
    lines += ["", "collectives (bytes/device: what one device sends per step):"]
    moved = [c for c in plan.collectives if not is_local(c.kind)]
    crow = [[c.kind, c.axis, c.reduction or "", c.serves or c.tensor, c.tensor,
             human(c.bytes_per_device)] for c in moved]
    lines += _table(_fold_collectives(crow, max_rows),
                    ["kind", "axis", "op", "for", "tensor", "bytes/device"]) \
        if crow else ["  none"]
    local = Counter(c.kind for c in plan.collectives if is_local(c.kind))
    if local.get("take_shard"):
        lines += [f"  and {local['take_shard']} take_shard (each device keeps its own piece "
                  "of a whole tensor: no traffic)"]
    if local.get("as_partial"):
        lines += [f"  and {local['as_partial']} as_partial (a whole tensor kept on one device "
                  "to be summed, as a row layer's bias: no traffic)"]
    if local.get("as_varying"):
        lines += [f"  and {local['as_varying']} as_varying (a whole value as each device's own, "
                  "as a scan's carry or a summed count that backward reads per device: "
                  "no traffic)"]
    lines += _tensor_parallel_lines(plan.decision(TensorParallelRecord))
    lines += _update_lines(plan.decision(WeightUpdateShardingRecord))
    lines += _shard_params_lines(plan.decision(ShardParamsRecord),
                                 plan.decision(PipelineRecord))
    lines += _data_parallel_lines(plan.decision(DataParallelRecord))
    lines += pipeline_lines(plan.decision(PipelineRecord), plan.mesh)
    lines += _batch_lines(plan.decision(DataParallelRecord), plan.decision(PipelineRecord))
    lines += _quantized_lines(plan)
    lines += _comm_lines(plan)
    return "\n".join(lines) + "\n"


def _layer_groups(layers: tuple[str, ...]) -> str:
    """Module names folded to their numbered layer: ``h.0.attn.c_attn`` -> ``h.0`` (torch),
    ``params/Block_0/Dense_0/kernel`` -> ``Block_0`` (flax: the first numbered module);
    an unnumbered flax parameter to its module (``params/LayerNorm_0/scale`` ->
    ``LayerNorm_0``)."""
    out: list[str] = []
    for name in layers:
        if "/" in name:
            parts = [p for p in name.split("/") if p != "params"]
            k = next((i for i, p in enumerate(parts) if p.rpartition("_")[2].isdigit()),
                     None)
            short = parts[k] if k is not None else "/".join(parts[:-1] or parts)
        else:
            parts = name.split(".")
            k = next((i for i, p in enumerate(parts) if p.isdigit()), None)
            short = ".".join(parts[:k + 1]) if k is not None else name
        if short not in out:
            out.append(short)
    return ", ".join(out)


def pipeline_lines(pp: PipelineRecord | None, mesh: dict[str, int]) -> list[str]:
    """The stages (layers, parameters, flops), the schedule and its bubble, the rank grid."""
    if pp is None:
        return []
    n = len(pp.stages)
    ranks = pp.ranks or n
    looped = ranks != n
    vm = "3 v M" if pp.schedule in SPLIT_BACKWARD else "v M"
    theory = (f"(P - 1) / ({vm} + P - 1), P = {ranks} ranks, v = {n // ranks} stages per "
              "rank" if looped else "(S - 1) / (M + S - 1)")
    k = (3 if pp.schedule in SPLIT_BACKWARD else 1) * (n // ranks if looped else 1)
    if abs(pp.bubble - (ranks - 1) / (k * pp.microbatches + ranks - 1)) > 1e-9:
        theory = (f"laid out in its order, above {theory}: too few microbatches to fill "
                  "the schedule")
    lines = ["", f"pipeline over {pp.axis}={ranks}: " + (f"{n} stages, " if looped else "")
                 + f"schedule {pp.schedule}, "
                 f"{pp.microbatches} microbatch(es), bubble {pp.bubble:.1%} of each rank's "
                 f"step ({theory}, equal stages)"]
    timed = pp.balance == "time"
    rows = [[str(s.index), _layer_groups(s.layers), str(len(s.params)), human(s.param_bytes),
             flops_text(s.flops), human(s.activation_bytes),
             seconds_text(s.balanced) if timed else flops_text(s.balanced)]
            + ([str(pp.rank_of(s.index))] if looped else [])
            for s in pp.stages]
    lines += _table(rows, ["stage", "layers", "params", "param bytes", "flops/microbatch",
                           "saved/microbatch",
                           f"balanced on: {pp.device_model} time" if timed
                           else "balanced on: forward flops"]
                    + (["rank"] if looped else []))
    if pp.sent_bytes:
        lines.append("  activations crossing each cut per microbatch: "
                     + ", ".join(human(b) for b in pp.sent_bytes))
    for p, stages in pp.tied.items():
        lines.append(f"  tied: {p} held on stages {', '.join(map(str, stages))} (gradients "
                     f"summed on stage {stages[0]}, which updates it and sends the new value)")
    if pp.random_per_microbatch:
        lines.append(f"  random draws from a key by microbatch "
                     f"({', '.join(pp.random_per_microbatch)}): made for the whole batch, "
                     "each microbatch keeping its rows, the numbers the single-device step "
                     "draws")
    if pp.counted_globally:
        lines.append("  means over counts of the batch (a masked mean, the targets not "
                     "ignored): each microbatch divides its sum by the count summed over "
                     "the microbatches (and the data-parallel devices), the "
                     "single-device step's (the runtime runs what the count is made "
                     "of on every microbatch first):")
        lines += [f"    {w}" for w in pp.counted_globally]
    # ranks row-major over the mesh's axes, as init_device_mesh lays them out
    axes = list(mesh.items())
    size = 1
    for _, k in axes:
        size *= k
    groups: dict[str, list[int]] = {}
    for r in range(size):
        coord, stride = {}, size
        for a, k in axes:
            stride //= k
            coord[a] = (r // stride) % k
        key = ", ".join(f"{a}={v}" for a, v in coord.items() if a != pp.axis) or "all"
        groups.setdefault(key, []).append(r)
    lines.append(f"  rank grid (row-major over {', '.join(a for a, _ in axes)}): ranks of "
                 f"{pp.axis} 0..{ranks - 1}" + _placement(pp, ranks, n, looped))
    lines += [f"    {k}: {' '.join(map(str, v))}" for k, v in groups.items()]
    return lines


def _placement(pp: PipelineRecord, ranks: int, stages: int, looped: bool) -> str:
    """Which stage runs where on the pipeline axis, as the rank grid's heading says it."""
    if not looped:
        return f" (stages 0..{stages - 1})"
    if pp.schedule in V_SHAPED:
        return f" (stages r and {2 * ranks - 1} - r on {pp.axis} r, a V)"
    return f" (stage s on {pp.axis} s mod {ranks})"


def _tensor_parallel_lines(tp: TensorParallelRecord | None) -> list[str]:
    """The layer pairs tensor-parallel split, and its collectives by phase."""
    if tp is None:
        return []
    lines = ["", f"tensor parallel over {tp.axis}={tp.size}: {len(tp.pairs)} layer pair(s), "
                 "column layers split by output features, row layers by input features"]
    for p in tp.pairs:
        lines.append(f"  {', '.join(p.column)} -> {p.row}")
    by_phase: dict[str, dict[str, int]] = {}
    for phase, kind, _ in tp.collectives:
        by_phase.setdefault(phase, {}).setdefault(kind, 0)
        by_phase[phase][kind] += 1
    counts = "; ".join(f"{phase}: " + ", ".join(f"{k} x{n}" for k, n in sorted(c.items()))
                       for phase, c in by_phase.items()) or "none"
    lines.append(f"  its collectives: {counts}")
    for p, shape, d in tp.undivided:
        lines.append(f"  kept whole: {p} {list(shape)}: dim {d} ({shape[d]}) does not divide "
                     f"{tp.size}")
    return lines


def _update_lines(wus: WeightUpdateShardingRecord | None) -> list[str]:
    """What weight-update-sharding kept whole, expanded, or left sharded."""
    if wus is None:
        return []
    lines = []
    if wus.replicated:
        lines += ["", "kept whole in the update:"]
        lines += [f"  {what}: {why}" for what, why in wus.replicated]
    if wus.expanded:
        lines += ["", f"expanded to shard: {len(wus.expanded)} op(s) "
                      f"({', '.join(sorted(set(wus.expanded)))})"]
    if wus.grads_left_sharded:
        lines += ["", "gradient outputs left sharded (no full .grad): "
                  + ", ".join(wus.grads_left_sharded)]
    return lines


def _calls_text(plan: Plan) -> str:
    """Under a pipeline, the calls a step the fullest rank makes (a collective in a
    program run per microbatch calls M times)."""
    per_rank = plan.comm_bytes_per_rank
    if not per_rank:
        return ""
    r = max(range(len(per_rank)), key=lambda k: per_rank[k])
    return (f"; pp rank {r} makes {plan.comm_calls_per_rank[r]} calls a step (sends "
            "included, receives not)")


def _shard_params_lines(sp: ShardParamsRecord | None,
                        pp: PipelineRecord | None = None) -> list[str]:
    """Which parameters are held as pieces, and where they are gathered."""
    if sp is None:
        return []
    where = ", ".join(f"{phase} {n}" for phase, n in sp.gathers.items()) or "none"
    how = ("again before backward (FSDP)" if sp.backward == "regather" else
           "once, kept through backward (gathered at the next step's forward)")
    lines = ["", f"parameters held as pieces over {sp.axis}: {len(sp.sharded)} of them, "
                 f"gathered where read, {how}; all-gathers: {where}"]
    if pp is not None and pp.gather == "step":
        lines[1] = (f"parameters held as pieces over {sp.axis}: {len(sp.sharded)} of them, "
                    "gathered once a step on each pipeline stage that reads them (once "
                    "for the stages of a rank), before its first microbatch, and kept "
                    "whole until its last backward (the pipeline's gather=step; "
                    "gather=microbatch gathers them in every microbatch's forward and "
                    "backward)")
    elif pp is not None:
        lines[1] += f", in each of the {pp.microbatches} microbatches (gather=microbatch)"
    lines += [f"  kept whole: {p}: {why}" for p, why in sp.whole]
    return lines


def _data_parallel_lines(dp: DataParallelRecord | None) -> list[str]:
    """Where data-parallel differs from the single-device step: counts and random draws."""
    if dp is None:
        return []
    lines = []
    if not dp.differentiates:
        lines += ["", "the step computes no gradient (it has no backward): the devices split "
                      "the batch and combine what the step returns, and no gradient is "
                      "averaged. If it should train, call backward (torch) or take the "
                      "gradient (jax.grad) inside the step"]
    if dp.gradients == "sum":
        lines += ["", "the loss is a sum over the batch: the devices' losses and gradients "
                      "are added up, not averaged (each device's share holds a part of it)"]
    drawn = dp.random_per_device
    if drawn:
        lines += ["", f"random draws per device ({', '.join(drawn)}): each process draws from "
                      "its own generator, as under DDP, so dropout matches the single-device "
                      "step in distribution, not bit for bit"]
    if not dp.batch_judged:
        lines += ["", _unjudged(dp)]
    elif dp.batch_probed:
        lines += ["", "each device's share of the batch has one row, which cannot show "
                      "which dims hold examples: the batch was judged on the step traced "
                      "again at more rows per device"]
    if dp.counted_globally:
        lines += ["", "means over counts of the batch (a masked mean, the targets not "
                      "ignored): each device divides its sum by the count summed over the "
                      "devices, the single-device step's (one scalar all-reduce each):"]
        lines += [f"  {w}" for w in dp.counted_globally]
    if dp.random_per_row:
        lines += ["", f"random draws from a key by row ({', '.join(dp.random_per_row)}): each "
                      "device draws them at the global batch's shape and keeps its own rows, "
                      "the numbers the single-device step draws"]
    return lines


def _unjudged(dp: DataParallelRecord) -> str:
    """What a plan says where the batch of one row per device was not judged: the step
    could not be traced at more rows per device, or that trace's means over counts have
    no match in the step that runs."""
    if dp.batch_unmatched:
        where = "; ".join(dp.batch_unmatched)
        return ("each device's share of the batch has one row, which cannot show which "
                "dims hold examples, and the step traced at more rows per device to judge "
                f"it does not match the one that runs at {where} (its code branches on "
                "the batch's size, or squeezes its rows away): that mean over a count "
                "stays each device's own, averaged as under DDP (a device whose row "
                "counts nothing divides 0 by 0). Pass two or more rows per device to "
                "have it made the batch's.")
    return ("each device's share of the batch has one row, and the step could not be "
            "traced at more rows per device (its code fixes the batch's size or branches "
            "on it), so which of its dims hold examples is unknown and whether its "
            "forward combines examples was not judged: a masked mean or a cross-entropy "
            "with ignore_index stays each device's own mean, averaged as under DDP (a "
            "device whose row counts nothing divides 0 by 0), and a batch norm or "
            "contrastive loss goes unwarned. Pass two or more rows per device to have the "
            "step checked.")


def _shares(dp: DataParallelRecord | None, pp: PipelineRecord | None, field: str) -> str:
    """Who computes a batch-coupled op alone: each device's share, each microbatch."""
    who = [w for w, r in (("each device's share of the batch", dp),
                          ("each microbatch", pp)) if r is not None and getattr(r, field)]
    return " and ".join(who)


def _places(dp: DataParallelRecord | None, pp: PipelineRecord | None, field: str
            ) -> list[str]:
    """The places both records list under ``field`` (batch_coupled, batch_counted), once;
    not the counts the pipeline sums over the microbatches and the devices, nor the
    constants added to them there (``sum(mask) + 1``: added once to the summed count)."""
    exact = set(pp.counted_globally) | set(pp.shifted_globally) if pp else set()
    return [w for w in dict.fromkeys((getattr(dp, field) if dp else ()) +
                                     (getattr(pp, field) if pp else ())) if w not in exact]


def _batch_lines(dp: DataParallelRecord | None, pp: PipelineRecord | None) -> list[str]:
    """Where the forward combines examples of the batch, which a split batch computes per
    share (ir/batch_coupling.py): always different, then exact only for equal counts."""
    lines = []
    for field, text in (
            ("batch_coupled", "the forward combines examples of the batch; {who} computes "
                              "these alone and the results are averaged, as under DDP, so "
                              "the step differs from the single-device one:"),
            ("batch_counted", "the forward divides by counts over the batch; {who} divides "
                              "by its own count and the results are averaged, as under DDP: "
                              "the single-device step's only when every share counts "
                              "alike:")):
        where = _places(dp, pp, field)
        if where:
            lines += ["", text.format(who=_shares(dp, pp, field))]
            lines += [f"  {w}" for w in where]
    return lines


def coupling_warning(dp: DataParallelRecord | None, pp: PipelineRecord | None) -> str | None:
    """The warning ``parallelize`` gives for a forward that combines examples of the batch
    under a plan that splits the batch, or None."""
    where = _places(dp, pp, "batch_coupled")
    if dp is not None and not dp.batch_judged:
        return _unjudged(dp)
    if not where:
        return _counted_warning(dp, pp)
    return (f"the step's forward combines examples of its batch: {_first_two(where)}. "
            f"Under this plan {_shares(dp, pp, 'batch_coupled')} computes it alone "
            "and the results are averaged, as DDP does, so what it feeds (the loss and "
            "gradients, a metric, a buffer) differs from the single-device step's. To match "
            "it, compute such terms from values that do not mix examples (LayerNorm or "
            "GroupNorm for a batch norm), or run the step without splitting its batch.")


def _first_two(where: list[str]) -> str:
    """The first two places of ``where``, and how many more the plan lists."""
    more = f" (and {len(where) - 2} more: the plan lists them)" if len(where) > 2 else ""
    return "; ".join(where[:2]) + more


def _counted_warning(dp: DataParallelRecord | None, pp: PipelineRecord | None
                     ) -> str | None:
    """The warning for means over counts the plan could not count over the whole batch
    (a mean over the labels kept of each half of an in-step gradient accumulation): each
    share divides by its own count, as under DDP (a review found the plan listed them and
    parallelize said nothing, 2026-12-07). Not where data-parallel was asked for each
    device's own counts (``counts=local``), nor in a loss the devices add up (a mean over a
    count times the batch's size: its count is not summed over the devices either)."""
    where = _places(dp, pp, "batch_counted")
    # (a pipeline runs data-parallel with counts=local and sums the counts itself)
    if not where or dp is not None and (dp.counts == "local" and pp is None or
                                        dp.gradients != "avg"):
        return None
    return (f"the step's forward divides by counts of parts of its batch: "
            f"{_first_two(where)}. Under this plan "
            f"{_shares(dp, pp, 'batch_counted')} divides by its own part's count and the "
            "results are averaged, as DDP does, so the loss and gradients are the "
            "single-device step's only when every share counts alike (a mean over the "
            "labels not ignored, taken per half of a gradient accumulation in the step). "
            "To match it, divide by a count of the whole batch the step gets (Hugging "
            "Face's num_items_in_batch).")


def _quantized_lines(plan: Plan) -> list[str]:
    """What the quantizing passes moved: bytes before and after per tensor, the declared
    error bound, what stayed fp32 and why."""
    out: list[str] = []
    qg = plan.decision(QuantizeGradsRecord)
    qwd = plan.decision(QuantizeWeightDiffRecord)
    if qg is not None:
        hops = ("1 hop" if qg.hops == 1 else
                f"2 hops: {qg.intra_bits}-bit among each node's {qg.local} devices, then "
                f"{qg.bits}-bit across nodes")
        out += ["", f"quantize-grads ({qg.bits}-bit, group {qg.group}, Hadamard {qg.hadamard}, "
                    f"{hops}; error per group <= {qg.bound} of each device's "
                    "transformed gradient, stochastic):"]
        out += _before_after({qg.params.get(g, g): (qg.bytes_before[g], qg.bytes_after[g])
                              for g in qg.quantized})
        out += [f"  kept fp32: {qg.params.get(g, g)}: {why}" for g, why in qg.kept]
    if qwd is not None:
        out += ["", f"quantize-weight-diff ({qwd.bits}-bit, group {qwd.group}, {qwd.rounding}; "
                    f"error per group <= {qwd.bound} of the step's difference, not "
                    "accumulated):"]
        out += _before_after({w: (qwd.bytes_before[w], qwd.bytes_after[w])
                              for w in qwd.quantized})
        out += [f"  kept fp32: {w}: {why}" for w, why in qwd.kept]
    if out:
        out += ["  (quantizing costs compute on every device: on a fast link it can be slower "
                "than fp32, so it is opt-in)"]
    return out


def _before_after(rows: dict[str, tuple[int, int]]) -> list[str]:
    return [f"  {name}: {human(b)} -> {human(a)} ({a / b:.2f}x)" if b else f"  {name}"
            for name, (b, a) in rows.items()]


def _comm_lines(plan: Plan) -> list[str]:
    """What comm-fusion and schedule-comm did, and how the backend carries it out."""
    out = []
    fusion = plan.decision(CommFusionRecord)
    if fusion:
        out += ["", f"comm-fusion (buckets of {fusion.bucket_mb:g} MB): "
                    f"{fusion.collectives_before} collectives, "
                    f"{human(fusion.bytes_before)} -> {fusion.collectives_after} "
                    f"collectives, {human(fusion.bytes_after)} "
                    f"({len(fusion.buckets)} buckets)"]
    sched = plan.decision(ScheduleCommRecord)
    if sched:
        out += [f"schedule-comm: {sched.overlapped} collectives issued as soon as their "
                "inputs are ready and awaited where first needed"]
    if plan.backend:
        out += [f"backend: {plan.backend}"]
    return out


def _fold_collectives(rows: list[list[str]], max_rows: int) -> list[list[str]]:
    """Collectives of repeated layers fold like tensors: same kind, axis, op, purpose
    (layer numbers aside) and bytes become one row; the tensor column gives the count."""
    if len(rows) <= max_rows:
        return rows
    groups: dict[tuple, int] = {}
    for kind, axis, op, what, _, nbytes in rows:
        key = (kind, axis, op, _group(what), nbytes)
        groups[key] = groups.get(key, 0) + 1
    out = [[k, a, o, w, f"(x{n})" if n > 1 else "", b] for (k, a, o, w, b), n in
           groups.items()]
    return _cut(out, max_rows)


def _cut(rows: list[list[str]], max_rows: int) -> list[list[str]]:
    if len(rows) <= max_rows:
        return rows
    return rows[:max_rows] + [[f"... {len(rows) - max_rows} more rows (the JSON report lists "
                               "them all)", *[""] * (len(rows[0]) - 1)]]


def _fold(rows: list[list[str]], max_rows: int) -> list[list[str]]:
    """At most ``max_rows`` rows: repeated layers (same name but for layer numbers, same
    type and placement) fold into one row with a count."""
    if len(rows) <= max_rows:
        return rows
    groups: dict[tuple, list[list[str]]] = {}
    for r in rows:
        groups.setdefault((_group(r[0]), *r[1:]), []).append(r)
    out = []
    for key, rs in groups.items():
        if len(rs) == 1:
            out.append(rs[0])
        else:
            out.append([f"{key[0]} (x{len(rs)})", *key[1:]])
    return _cut(out, max_rows)
