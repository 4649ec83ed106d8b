"""A pipeline schedule laid out in time: each rank's actions (forward or backward of a
microbatch on one of its stages, in the schedule's order) placed at the earliest moment the
rank is free and the action's input has arrived, with each stage's forward and backward
costs, and the bubble it implies. The pipeline pass reports the bubble of equal stages
laid out so (``bubble_fraction``); the plan's step time lays out the stages' own costs
(``report/pipeline_time.py``), ``diphoma inspect --plot`` draws it (``report/schedule.py``)
and the benchmark replays measured runs.

A forward of stage s waits for the same microbatch's forward on stage s - 1, a backward for
its backward on stage s + 1 (the last stage's for its own forward); sending takes no time
unless given (the plan gives it the device model's point-to-point time).
A split backward (zero-bubble schedules) is its input-gradient part I, which the earlier
stage waits for, and its weight-gradient part W, which waits for I only.
With equal stages this gives the textbook bubbles ((P - 1) / (M + P - 1) for GPipe and 1F1B,
(P - 1) / (v M + P - 1) interleaved with M >= P); with the stages' own costs it gives what
an uneven cut costs."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import DiphomaError

Action = tuple[str, int, int]          # ("F" | "B" | "I" | "W", microbatch, stage)


class ScheduleError(DiphomaError):
    """A schedule that cannot be laid out (an action waits for one that never runs), or a
    picture that cannot be drawn."""


@dataclass(frozen=True)
class Block:
    """One action in time."""

    rank: int
    kind: str
    microbatch: int
    stage: int
    start: float
    end: float


def timeline(actions: list[list[Action]] | tuple, forward: list[float],
             backward: list[float], input_share: float | list[float] = 0.5,
             send_forward: list[float] | None = None,
             send_backward: list[float] | None = None,
             durations: dict[Action, float] | None = None) -> list[Block]:
    """Each rank's ``actions`` placed in time, ``forward[s]`` / ``backward[s]`` long on stage
    s (any unit; a split backward's I takes ``input_share`` of it, or ``input_share[s]``,
    W the rest), or ``durations[action]`` for an action given there (one run's own
    durations, to replay it): an action starts when its rank is free and its input is
    done, and, when that input was made on another rank, has arrived: ``send_forward[s]``
    after stage s's forward ends, ``send_backward[s]`` after its backward (or I) does
    (default: at once)."""
    shares = input_share if isinstance(input_share, list) else [input_share] * len(forward)
    stages = len(forward)
    rank_of = {s: r for r, acts in enumerate(actions) for _, _, s in acts}
    lag = {"F": send_forward or [0.0] * stages, "B": send_backward or [0.0] * stages}
    lag["I"] = lag["B"]

    def arrives(dep: tuple[str, int, int], here: int) -> float:
        kind, _, s = dep
        return done[dep] + (lag[kind][s] if rank_of.get(s) != here else 0.0)
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * len(actions)
    nxt = [0] * len(actions)
    out: list[Block] = []
    left = sum(len(a) for a in actions)
    while left:
        moved = False
        for r, acts in enumerate(actions):
            while nxt[r] < len(acts):
                kind, mb, s = acts[nxt[r]]
                if kind == "F":
                    dep = ("F", mb, s - 1) if s > 0 else None
                elif kind == "W":
                    dep = ("I", mb, s)
                elif s == stages - 1:
                    dep = ("F", mb, s)
                else:           # the next stage's backward, whole or its input part
                    dep = ("B", mb, s + 1) if ("B", mb, s + 1) in done else ("I", mb, s + 1)
                if dep is not None and dep not in done:
                    break
                start = max(free[r], arrives(dep, r) if dep is not None else 0.0)
                if durations and (kind, mb, s) in durations:
                    cost = durations[(kind, mb, s)]
                else:
                    cost = {"F": forward[s], "B": backward[s], "I": shares[s] * backward[s],
                            "W": (1 - shares[s]) * backward[s]}[kind]
                end = start + cost
                done[(kind, mb, s)] = free[r] = end
                out.append(Block(r, kind, mb, s, start, end))
                nxt[r] += 1
                left -= 1
                moved = True
        if not moved:
            stuck = {r: acts[nxt[r]] for r, acts in enumerate(actions) if nxt[r] < len(acts)}
            raise ScheduleError(f"the schedule cannot run: each rank's next action waits for "
                                f"one that no rank can run first ({stuck})",
                                hint="use another schedule or number of microbatches")
    return out


def bubble(blocks: list[Block]) -> float:
    """The idle share of the idlest rank's step: 1 - its busy time / the step (the
    makespan over all ranks)."""
    span = max(b.end for b in blocks) - min(b.start for b in blocks)
    ranks = {b.rank for b in blocks}
    busy = min(sum(b.end - b.start for b in blocks if b.rank == r) for r in ranks)
    return 1 - busy / span if span else 0.0


__all__ = ["Action", "Block", "ScheduleError", "bubble", "timeline"]
