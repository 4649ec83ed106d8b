"""The per-rank orders of the GPipe, 1F1B and interleaved 1F1B schedules, written out.

The torch runtime takes its orders from torch.distributed.pipelining's own generators
(``torch/pipeline_schedule.py``); a runtime without them (JAX) takes these. An order is a
rank's list of actions ``(kind, microbatch, stage)``: ``F`` forward, ``B`` backward; with
one stage per rank, rank r runs stage r. ``tests/torch/test_pipeline.py`` checks that they
are torch's, action for action.

- GPipe: every forward, then every backward (fill, drain).
- 1F1B: rank r runs P - r forwards first (fewer when M is smaller), then alternates one
  backward and one forward, then the remaining backwards: at most P - r microbatches'
  activations are alive on rank r, where GPipe keeps all M.
- Interleaved 1F1B (Megatron's; torch's ``ScheduleInterleaved1F1B``): rank r runs the v
  stages r, r + P, ..., and its v M forwards in rounds of R = M / max(1, M // P)
  microbatches, stage after stage (R forwards of its first stage, R of its second, ...,
  then the next round); it runs (v - 1) R + 2 (P - 1 - r) forwards first, then alternates
  one forward and one backward, the backwards taking its stages in reverse, then the
  remaining backwards. Each rank's fill and drain are v times shorter than 1F1B's."""

from __future__ import annotations

Action = tuple[str, int, int]          # kind, microbatch, stage

ORDERED = ("gpipe", "1f1b", "interleaved")


def rank_orders(schedule: str, ranks: int, microbatches: int, stages: int | None = None
                ) -> tuple[tuple[Action, ...], ...]:
    """Each rank's actions under ``schedule`` (one of ``ORDERED``) over ``stages`` stages
    (``ranks`` of them, one per rank, for GPipe and 1F1B; twice that by default for the
    interleaved schedule, stage s on rank s mod ``ranks``) and ``microbatches``
    microbatches."""
    if schedule not in ORDERED:
        raise ValueError(f"no written-out order for schedule {schedule!r}; "
                         f"these have one: {', '.join(ORDERED)}")
    if schedule == "interleaved":
        return _interleaved(ranks, 2 * ranks if stages is None else stages, microbatches)
    out = []
    for r in range(ranks):
        if schedule == "gpipe":
            order = [("F", m, r) for m in range(microbatches)] + \
                    [("B", m, r) for m in range(microbatches)]
        else:
            warm = min(ranks - r, microbatches)
            order = [("F", m, r) for m in range(warm)]
            f = warm
            for b in range(microbatches):
                order.append(("B", b, r))
                if f < microbatches:
                    order.append(("F", f, r))
                    f += 1
        out.append(tuple(order))
    return tuple(out)


def _interleaved(ranks: int, stages: int, microbatches: int
                 ) -> tuple[tuple[Action, ...], ...]:
    if stages % ranks:
        raise ValueError(f"the interleaved schedule needs the stages ({stages}) to be a "
                         f"multiple of the ranks ({ranks})")
    v = stages // ranks
    rounds = max(1, microbatches // ranks)
    if microbatches % rounds:
        raise ValueError(f"the interleaved schedule runs microbatches in rounds of "
                         f"{ranks}: {microbatches} is not a multiple of {rounds} rounds")
    per_round = microbatches // rounds
    total = v * microbatches
    out = []
    for r in range(ranks):
        warm = min((v - 1) * per_round + 2 * (ranks - 1 - r), total)
        done = {"F": [0] * v, "B": [0] * v}      # microbatches run, per local stage
        order: list[Action] = []
        for k in range(total + warm):
            steps = ([("F", (k // per_round) % v)] if k < total else []) + \
                ([("B", v - 1 - ((k - warm) // per_round) % v)] if k >= warm else [])
            for kind, local in steps:
                order.append((kind, done[kind][local], local * ranks + r))
                done[kind][local] += 1
        out.append(tuple(order))
    return tuple(out)

__all__ = ["Action", "ORDERED", "rank_orders"]
