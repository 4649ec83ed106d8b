"""The per-rank orders of the GPipe and 1F1B schedules, written out.

The torch runtime takes its orders from torch.distributed.pipelining's own generators
(``torch/pipeline_schedule.py``); a runtime without them (JAX) takes these. An order is a
rank's list of actions ``(kind, microbatch, stage)``: ``F`` forward, ``B`` backward; with
one stage per rank, rank r runs stage r. ``tests/torch/test_pipeline.py`` checks that they
are torch's, action for action.

- GPipe: every forward, then every backward (fill, drain).
- 1F1B: rank r runs P - r forwards first (fewer when M is smaller), then alternates one
  backward and one forward, then the remaining backwards: at most P - r microbatches'
  activations are alive on rank r, where GPipe keeps all M."""

from __future__ import annotations

Action = tuple[str, int, int]          # kind, microbatch, stage

ORDERED = ("gpipe", "1f1b")


def rank_orders(schedule: str, ranks: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Each rank's actions under ``schedule`` (one of ``ORDERED``) over ``ranks`` stages,
    one per rank, and ``microbatches`` microbatches."""
    if schedule not in ORDERED:
        raise ValueError(f"no written-out order for schedule {schedule!r}; "
                         f"these have one: {', '.join(ORDERED)}")
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


__all__ = ["Action", "ORDERED", "rank_orders"]
