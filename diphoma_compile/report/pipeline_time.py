"""The compute section of a pipeline's plan: flops and step time over each rank's stages
and microbatches, not one pass over the staged graph.

A staged graph is traced at the microbatch and holds every stage, so ``estimate_compute``
over it counts one microbatch of all the stages on one device, and its send/recv pairs as
collectives. Here each stage's programs (``passes/pipeline_programs.py``) are estimated on
their own (``estimate_compute``: roofline compute, their data-parallel collectives), and:

- ``flops_per_step``: every stage's forward and backward programs M times, the update
  once (and what runs before the schedule: the count programs C M times, T once);
  ``flops_per_device``: the same over the stages of the rank that does the most;
- the step time: what runs before the schedule (C and T: a count's all-reduce, the
  parameters held as pieces gathered once a step), the longest rank's, then the
  schedule's per-rank orders (``passes/pipeline_orders.py``) laid out in time with each
  stage's program times (``report/schedule.timeline``), a value sent to another rank
  arriving after the device model's point-to-point time for its bytes over the pipeline
  axis's link; then each rank's update. The step ends when the last rank's
  update does. ``compute`` and ``exposed_comm`` are that rank's own (its programs' compute
  and the stalls on their collectives), ``bubble`` the rest: the time it waits for other
  stages (the schedule's fill and drain, uneven stages, transfers)."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from ..ir.core import Graph
from ..ir.device_model import DeviceModel
from ..passes.pipeline_orders import rank_orders
from ..passes.pipeline_programs import (StageProgram, StagePrograms, rank_stage_programs,
                                        runs_per_step)
from ..passes.pipeline_timeline import timeline
from .compute import Compute, estimate_compute


def pipeline_compute(graph: Graph, opts: Any, model: DeviceModel,
                     cuts: list[StagePrograms] | None = None) -> Compute | None:
    """The compute section of the staged ``graph`` under its pipeline pass ``opts``; None
    when the schedule's order cannot be written out (microbatches it refuses). ``cuts``:
    ``rank_stage_programs(graph)``, when already made."""
    sizes = dict(graph.mesh.axes)
    ranks = sizes.get(opts.axis, 1)
    m = opts.microbatches
    cuts = cuts or rank_stage_programs(graph)
    nstages = 1 + max(st for cut in cuts for st, _ in cut.programs)
    try:
        orders = rank_orders(opts.schedule, ranks, m, nstages)
    except ValueError:
        return None
    est: dict[tuple[int, str], Compute] = {}
    progs: dict[tuple[int, str], StageProgram] = {}
    mine_of: list[list[tuple[int, str]]] = []       # by rank: its programs' keys
    for cut in cuts:
        keys = []
        for key, prog in [*cut.programs.items(), *(((s, "C"), p) for s, p in cut.counts.items()),
                          *(((s, "T"), p) for s, p in cut.once.items())]:
            est[key] = estimate_compute(prog.graph, model)
            progs[key] = prog
            keys.append(key)
        mine_of.append(keys)

    def times(key: tuple[int, str]) -> int:
        return runs_per_step(key[1], m)

    per_step = sum(e.flops_per_step * times(k) for k, e in est.items())
    per_rank = [sum((est[k].flops_per_device * times(k) for k in keys), Fraction(0))
                for keys in mine_of]
    before = max(sum(est[k].total_s * times(k) for k in keys if k[1] in ("C", "T"))
                 for keys in mine_of)
    unknown = sorted({u for e in est.values() for u in e.unknown_cost_ops})
    types = graph.value_types()
    rank_of = {st: r for r, cut in enumerate(cuts) for st, _ in cut.programs}

    def sent_s(key: tuple[int, str]) -> float:   # the point-to-point time of its sends
        nbytes = sum(types[n].local_nbytes(sizes) for n, peer, _ in progs[key].sends
                     if peer != rank_of[key[0]])
        return model.collective_s("send", nbytes, 2, opts.axis) if nbytes else 0.0

    split = any(k == "I" for _, k in est)
    fwd = [est[(s, "F")].total_s for s in range(nstages)]
    if split:
        inp = [est[(s, "I")].total_s for s in range(nstages)]
        bwd = [inp[s] + est[(s, "W")].total_s for s in range(nstages)]
        share = [inp[s] / bwd[s] if bwd[s] else 0.5 for s in range(nstages)]
        lag_b = [sent_s((s, "I")) for s in range(nstages)]
    else:
        bwd = [est[(s, "B")].total_s for s in range(nstages)]
        share = [0.5] * nstages
        lag_b = [sent_s((s, "B")) for s in range(nstages)]
    lag_f = [sent_s((s, "F")) for s in range(nstages)]
    blocks = timeline([list(o) for o in orders], fwd, bwd, share, lag_f, lag_b)
    ends = [max((b.end for b in blocks if b.rank == r), default=0.0) for r in range(ranks)]
    update = [sum(est[k].total_s for k in cut.programs if k[1].startswith("U")) for cut in cuts]
    finish = [before + e + u for e, u in zip(ends, update)]
    last = max(range(ranks), key=lambda r: finish[r])
    mine = mine_of[last]
    compute = sum(est[k].compute_s * times(k) for k in mine)
    exposed = sum(est[k].exposed_comm_s * times(k) for k in mine)
    return Compute(per_step, max(per_rank), tuple(unknown), model.name, compute, exposed,
                   bubble_s=max(0.0, finish[last] - compute - exposed))


__all__ = ["pipeline_compute"]
