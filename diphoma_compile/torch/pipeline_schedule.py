"""Per-rank action lists of a pipeline schedule, from torch.distributed.pipelining's own
schedule classes (its generators; the per-rank programs and communication are ours).

These are private torch APIs (``_schedule_visualizer.get_schedule_ops``, a schedule's
``pipeline_order`` built over mock stages), pinned by golden action lists in
tests/torch/test_pipeline_schedule.py. In torch 2.13 ``Schedule1F1B``'s ``pipeline_order``
is wrong for the last rank (it numbers that rank's forwards 1..M instead of 0..M-1), so that
rank's order is written out: 1F1B's strict F0 B0 F1 B1 ... alternation on the last rank
(``ScheduleInterleaved1F1B`` over one stage per rank gives the same, but refuses M that is
not a multiple of M // P)."""

from __future__ import annotations

from functools import lru_cache

from ..errors import BackendError

Action = tuple[str, int, int]      # ("F" | "B" | "I" | "W", microbatch, stage)
# torch's names of the generators, by our schedule name, for several stages per rank
_LOOPED = {"interleaved": "Interleaved1F1B", "interleaved-zb": "InterleavedZeroBubble",
           "zbv": "ZBVZeroBubble", "looped-bfs": "LoopedBFS", "dualpipev": "DualPipeV"}
_KINDS = {"F": "F", "FORWARD": "F", "B": "B", "FULL_BACKWARD": "B", "I": "I",
          "BACKWARD_INPUT": "I", "W": "W", "BACKWARD_WEIGHT": "W"}


@lru_cache(maxsize=64)
def schedule_actions(schedule: str, stages: int, microbatches: int, ranks: int | None = None
                     ) -> tuple[tuple[Action, ...], ...]:
    """For each rank, its forward and backward runs in order: one stage per rank for GPipe
    and 1F1B; ``stages`` / ``ranks`` per rank (stage s on rank s mod ranks) for the
    interleaved schedules and looped BFS; in a V for zbv and dualpipev. DualPipeV's
    overlapped pairs (``OVERLAP_F_B``: a forward and a backward run together, on a GPU)
    run one after the other, forward first; its whole backwards (``FULL_BACKWARD``, beside
    split ones on the same stage) run as the input-gradient program then the
    weight-gradient one, the two programs a split backward has."""
    ranks = stages if ranks is None else ranks
    try:
        from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    except ImportError as e:     # the private API moved
        raise BackendError(f"torch.distributed.pipelining's schedule generator is not "
                           f"available ({e})", hint="use torch 2.13") from None
    if schedule in _LOOPED:
        if stages % ranks:
            raise BackendError(f"schedule {schedule} needs the stages ({stages}) to be a "
                               f"multiple of the {ranks} ranks",
                               hint=f"stages={2 * ranks}")
        try:
            got = get_schedule_ops(_LOOPED[schedule], ranks, microbatches,
                                   num_stages_per_rank=stages // ranks)
        except (ValueError, AssertionError) as e:      # its own rules on M
            fit = (f"microbatches={stages} or more (at least the {stages} stages)"
                   if schedule == "dualpipev" else
                   f"microbatches={ranks * max(1, microbatches // ranks)} (a multiple of "
                   f"the {ranks} ranks)")
            raise BackendError(f"torch's {_LOOPED[schedule]} schedule refuses {microbatches} "
                               f"microbatches on {ranks} ranks: {e}", hint=fit) from None
        order = [list(r) for r in got]
    elif stages != ranks:
        raise BackendError(f"schedule {schedule} runs one stage per rank, not {stages} "
                           f"stages on {ranks} ranks", hint="schedule=interleaved")
    elif schedule == "gpipe":
        order = [list(r) for r in get_schedule_ops("GPipe", stages, microbatches)]
    elif schedule == "1f1b":
        try:
            order = [list(r) for r in get_schedule_ops("1F1B", stages, microbatches)]
        except ValueError as e:        # its own rule: M >= P
            raise BackendError(f"torch's 1F1B schedule refuses {microbatches} microbatches "
                               f"on {ranks} ranks: {e}",
                               hint=f"microbatches={ranks} or more, or schedule=gpipe"
                               ) from None
        last = [a.microbatch_index for a in order[-1] if a is not None
                and _kind(a) == "F"]
        if last == list(range(1, microbatches + 1)):
            # torch 2.13's Schedule1F1B numbers the last rank's forwards from 1: that
            # rank's 1F1B order is the strict alternation F0 B0 F1 B1 ...
            order[-1] = [_Written(k, m, stages - 1) for m in range(microbatches)
                         for k in ("F", "B")]
    else:
        raise BackendError(f"the torch runtime has no pipeline schedule {schedule!r}",
                           hint="schedule=gpipe, 1f1b, interleaved, interleaved-zb, zbv, "
                                "looped-bfs or dualpipev")
    out = []
    for rank, acts in enumerate(order):
        mine: list[Action] = []
        for a in _expanded(acts):
            kind = _KINDS.get(_kind(a))
            if kind == "B" and schedule == "dualpipev":
                mine += [("I", a.microbatch_index, a.stage_index),
                         ("W", a.microbatch_index, a.stage_index)]
            elif kind is not None:
                mine.append((kind, a.microbatch_index, a.stage_index))
        _check(mine, rank, microbatches, sorted({s for _, _, s in mine}))
        out.append(tuple(mine))
    return tuple(out)


def _expanded(acts: list) -> list:
    """The actions, each overlapped pair (``OVERLAP_F_B``) as its sub-actions in order."""
    out = []
    for a in acts:
        if a is None:
            continue
        subs = getattr(a, "sub_actions", None)
        out += _expanded(list(subs)) if subs else [a]
    return out


class _Written:
    """An action written here, read like torch's ``_Action``."""

    def __init__(self, kind: str, microbatch: int, stage: int) -> None:
        self.computation_type, self.microbatch_index, self.stage_index = kind, microbatch, stage


def _kind(a: object) -> str:
    t = a.computation_type       # type: ignore[attr-defined]
    return str(getattr(t, "value", t))


def _check(acts: list[Action], rank: int, microbatches: int, stages: list[int]) -> None:
    """Each of this rank's stages runs each microbatch's forward once, then its backward
    once (whole, or its input-gradient part then its weight-gradient part): else the
    generator changed."""
    split = any(k == "I" for k, _, _ in acts)
    want = sorted([(k, m, s) for m in range(microbatches) for s in stages
                   for k in ("FIW" if split else "FB")])
    before = {"F": None, "B": "F", "I": "F", "W": "I"}
    seen: set[tuple[str, int, int]] = set()
    for kind, m, s in acts:
        if before[kind] is not None and (before[kind], m, s) not in seen:
            break
        seen.add((kind, m, s))
    else:
        if sorted(acts) == want:
            return
    raise BackendError(f"torch's schedule generator gave rank {rank} the actions "
                       f"{acts}, not each microbatch's forward then backward",
                       hint="the private torch.distributed.pipelining API changed; use "
                            "schedule=gpipe or pin torch")
