"""The per-rank orders of the pipeline schedules, written out.

The torch runtime takes its orders from torch.distributed.pipelining's own generators
(``torch/pipeline_schedule.py``); a runtime without them (JAX) takes these. An order is a
rank's list of actions ``(kind, microbatch, stage)``: ``F`` forward, ``B`` backward; with
one stage per rank, rank r runs stage r; the zero-bubble schedules split a backward into
``I`` (the input gradients, sent to the stage before) and ``W`` (the weight gradients).
``tests/torch/test_pipeline.py`` checks that they are torch's, action for action.

- GPipe: every forward, then every backward (fill, drain).
- 1F1B: rank r runs P - r forwards first (fewer when M is smaller), then alternates one
  backward and one forward, then the remaining backwards: at most P - r microbatches'
  activations are alive on rank r, where GPipe keeps all M.
- Interleaved 1F1B (Megatron's; torch's ``ScheduleInterleaved1F1B``): rank r runs the v
  stages r, r + P, ..., and its v M forwards in rounds of R = M / max(1, M // P)
  microbatches, stage after stage (R forwards of its first stage, R of its second, ...,
  then the next round); it runs (v - 1) R + 2 (P - 1 - r) forwards first, then alternates
  one forward and one backward, the backwards taking its stages in reverse, then the
  remaining backwards. Each rank's fill and drain are v times shorter than 1F1B's.
- Interleaved zero bubble (ZB1P; torch's ``ScheduleInterleavedZeroBubble``): the forwards
  and input-gradient runs of interleaved 1F1B, with (v - 1) R + P - 1 - r forwards first;
  rank r runs the weight-gradient run of its j-th backward after its (j + r)-th input
  gradient (late ranks defer W, filling the wait for the gradients coming back), and the
  r left over at the end.
- ZB-V (torch's ``ScheduleZBVZeroBubble``): rank r holds stages r and 2P - 1 - r, so the
  microbatches go down the ranks and back up (a V). It runs 2(P - r) - 1 forwards of its
  first stage; r pairs (second stage, first stage); P - r rounds of (second stage's F, I,
  W); then, while forwards are left, its first stage's F, I, W and its second stage's F,
  I, W; then r pairs of input gradients, P - r of (first stage's I, W), and the weight
  gradients left, second stage first. Planned for max(M, 2P - 1) microbatches, the ones
  past M dropped.
- DualPipeV (torch's ``ScheduleDualPipeV``; DeepSeek's DualPipe folded onto P ranks, the
  stages in zbv's V): rank r runs 2 (P - 1 - r) forwards of its first stage, r + 1 pairs
  (first, second); P - 1 - r rounds of its second stage's I, W and F; then pairs of
  (first stage's F, second stage's backward) and (second stage's F, first stage's
  backward) while forwards are left, each pair of a forward and a backward run together
  on a GPU (torch's ``OVERLAP_F_B``; here one after the other, forward first); then
  P - 1 - r rounds of (second's backward, second's F, first's backward); r + 1 pairs of
  backwards (second, first), whose later half (from the pair (r + 1) // 2, at its first
  backward on odd ranks, its second on even ones) runs only the input gradients, deferring
  the weight gradients; then P - 1 - r rounds of (a deferred W, the first stage's
  backward) and the deferred Ws left. A whole backward is written as its I then its W.
  Needs M >= 2P.
- Looped BFS (torch's ``ScheduleLoopedBFS``; breadth-first, as in Lamy-Poirier's
  "Breadth-First Pipeline Parallelism"): rank r holds stages r, r + P, ... (as interleaved)
  and runs every microbatch's forward of its first stage, then of its next, ...; then the
  backwards, its last stage first, each stage's microbatches last to first. Its fill and
  drain are interleaved's, v times shorter than GPipe's, but every stage keeps all M
  microbatches' activations until its backward (GPipe's memory, v times over)."""

from __future__ import annotations

Action = tuple[str, int, int]          # kind, microbatch, stage

ORDERED = ("gpipe", "1f1b", "interleaved", "interleaved-zb", "zbv", "looped-bfs",
           "dualpipev")


def rank_orders(schedule: str, ranks: int, microbatches: int, stages: int | None = None
                ) -> tuple[tuple[Action, ...], ...]:
    """Each rank's actions under ``schedule`` (one of ``ORDERED``) over ``stages`` stages
    (``ranks`` of them, one per rank, for GPipe and 1F1B; twice that by default for the
    interleaved schedules and looped BFS, stage s on rank s mod ``ranks``; 2 ``ranks`` for
    zbv and dualpipev, in a V)
    and ``microbatches`` microbatches."""
    if schedule not in ORDERED:
        raise ValueError(f"no written-out order for schedule {schedule!r}; "
                         f"these have one: {', '.join(ORDERED)}")
    if schedule in ("interleaved", "interleaved-zb"):
        return _interleaved(ranks, 2 * ranks if stages is None else stages, microbatches,
                            split=schedule == "interleaved-zb")
    if schedule == "looped-bfs":
        return _looped_bfs(ranks, 2 * ranks if stages is None else stages, microbatches)
    if schedule in ("zbv", "dualpipev"):
        if stages not in (None, 2 * ranks):
            raise ValueError(f"{schedule} runs two stages per rank, not {stages} stages on "
                             f"{ranks} ranks")
        if schedule == "zbv":
            return tuple(_zbv(ranks, r, microbatches) for r in range(ranks))
        if microbatches < 2 * ranks:
            raise ValueError(f"dualpipev needs at least as many microbatches as stages "
                             f"({2 * ranks}), not {microbatches}")
        return tuple(_dualpipev(ranks, r, microbatches) for r in range(ranks))
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


def _interleaved(ranks: int, stages: int, microbatches: int, split: bool = False
                 ) -> tuple[tuple[Action, ...], ...]:
    if stages % ranks:
        raise ValueError(f"the interleaved schedules need the stages ({stages}) to be a "
                         f"multiple of the ranks ({ranks})")
    v = stages // ranks
    rounds = max(1, microbatches // ranks)
    if microbatches % rounds:
        raise ValueError(f"the interleaved schedules run microbatches in rounds of "
                         f"{ranks}: {microbatches} is not a multiple of {rounds} rounds")
    per_round = microbatches // rounds
    return tuple(_interleaved_rank(ranks, r, v, per_round, microbatches, split)
                 for r in range(ranks))


def _interleaved_rank(ranks: int, r: int, v: int, per_round: int, microbatches: int,
                      split: bool) -> tuple[Action, ...]:
    total = v * microbatches
    ahead = ranks - 1 - r if split else 2 * (ranks - 1 - r)
    warm = min((v - 1) * per_round + ahead, total)
    back = "I" if split else "B"
    done = {"F": [0] * v, back: [0] * v, "W": [0] * v}     # microbatches run, per stage
    backwards: list[int] = []             # the local stage of each backward, in order
    order: list[Action] = []

    def run(kind: str, local: int) -> None:
        order.append((kind, done[kind][local], local * ranks + r))
        done[kind][local] += 1

    for k in range(total + warm):
        if k < total:
            run("F", (k // per_round) % v)
        if k >= warm:
            backwards.append(v - 1 - ((k - warm) // per_round) % v)
            run(back, backwards[-1])
            if split and len(backwards) > r:            # W trails its I by r backwards
                run("W", backwards[len(backwards) - 1 - r])
    if split:
        for local in backwards[max(0, len(backwards) - r):]:
            run("W", local)
    return tuple(order)


def _looped_bfs(ranks: int, stages: int, microbatches: int
                ) -> tuple[tuple[Action, ...], ...]:
    if stages % ranks:
        raise ValueError(f"looped BFS needs the stages ({stages}) to be a multiple of the "
                         f"ranks ({ranks})")
    mine = [range(r, stages, ranks) for r in range(ranks)]
    return tuple(tuple([("F", m, s) for s in own for m in range(microbatches)]
                       + [("B", m, s) for s in reversed(own)
                          for m in reversed(range(microbatches))])
                 for own in mine)


def _zbv(ranks: int, r: int, microbatches: int) -> tuple[Action, ...]:
    first, second = r, 2 * ranks - 1 - r
    n = max(2 * ranks - 1, microbatches)
    count = {(k, s): 0 for k in "FIW" for s in (first, second)}
    order: list[Action] = []

    def run(*acts: tuple[str, int]) -> None:
        for kind, s in acts:
            order.append((kind, count[(kind, s)], s))
            count[(kind, s)] += 1

    for _ in range(2 * (ranks - r) - 1):
        run(("F", first))
    for _ in range(r):
        run(("F", second), ("F", first))
    for _ in range(ranks - r):
        run(("F", second), ("I", second), ("W", second))
    while count[("F", second)] < count[("F", first)] or count[("F", first)] < n:
        if count[("F", first)] < n:
            run(("F", first))
        run(("I", first), ("W", first), ("F", second), ("I", second), ("W", second))
    for _ in range(r):
        run(("I", first), ("I", second))
    for _ in range(ranks - r):
        run(("I", first), ("W", first))
    for s in (second, first):
        while count[("W", s)] < count[("I", s)]:
            run(("W", s))
    return tuple(a for a in order if a[1] < microbatches)


def _dualpipev(ranks: int, r: int, microbatches: int) -> tuple[Action, ...]:
    first, second = r, 2 * ranks - 1 - r
    ahead = ranks - 1 - r                   # how far rank r is from the V's turn
    done = {(k, s): 0 for k in "FB" for s in (first, second)}
    deferred: list[tuple[int, int]] = []    # (microbatch, stage) whose W waits
    order: list[Action] = []

    def forward(s: int) -> None:
        order.append(("F", done[("F", s)], s))
        done[("F", s)] += 1

    def backward(s: int, defer_w: bool = False) -> None:
        m = done[("B", s)]
        done[("B", s)] += 1
        order.append(("I", m, s))
        if defer_w:
            deferred.append((m, s))
        else:
            order.append(("W", m, s))

    def deferred_w() -> None:
        if deferred:
            m, s = deferred.pop(0)
            order.append(("W", m, s))

    for _ in range(2 * ahead):
        forward(first)
    for _ in range(r + 1):
        forward(first)
        forward(second)
    for _ in range(ahead):
        backward(second, defer_w=True)
        deferred_w()
        forward(second)
    for _ in range(microbatches - 2 * ranks + r + 1):
        forward(first)
        backward(second)
        forward(second)
        backward(first)
    for _ in range(ahead):
        backward(second)
        forward(second)
        backward(first)
    split = False
    for i in range(r + 1):
        split |= i == (r + 1) // 2 and r % 2 == 1
        backward(second, defer_w=split)
        split |= i == (r + 1) // 2 and r % 2 == 0
        backward(first, defer_w=split)
    for _ in range(ahead):
        deferred_w()
        backward(first, defer_w=split)
    for _ in range(r + 1):
        deferred_w()
    return tuple(order)


__all__ = ["Action", "ORDERED", "rank_orders"]
