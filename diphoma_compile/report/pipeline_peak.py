"""The peak one rank of a pipeline reaches: its stages' programs walked in its schedule's
order, with what the executor keeps between them.

``ir.analysis.peak_memory`` over a staged graph sees every stage and one microbatch; a
rank runs only its stages, and keeps several microbatches at once. This walk follows each
rank's order (``passes/pipeline_orders.py``) over its programs
(``passes/pipeline_programs.py``) and counts what both runtimes hold:

- from the start: the graph inputs its programs read (parameters, optimizer state) and
  every batch input, whole (each rank is passed all M microbatches);
- each stage's program T (run once before the schedule): its peak, then what it makes
  (the parameters gathered whole, with the pipeline's ``gather=step``) until the last
  backward, or to the end where an update reads it;
- a receive's buffer from when it is posted (one action ahead of the program that reads
  it) until that microbatch's values on the stage are dropped;
- while a program runs, its own liveness peak above its inputs (``peak_memory``);
- after it, the values it returns (what later programs read, sends, sums) kept per
  (stage, microbatch) until that microbatch's backward B, or its weight-gradient run W,
  drops them; a value sent to another rank stays until the end of the step (the send is
  waited for there, and holds its tensor until then); one handed to another stage of the
  same rank is shared with it;
- the sums over microbatches (gradients, the loss): the first microbatch's value, taken
  as it is where ``stage_programs`` allows (``acc_owned``) or else a copy, divided by M in
  place for the update;
- the update rounds: their peaks, and their results kept to the end (written back after
  the step), except the new values the backend writes into the inputs they replace where
  they are made (``in_place``; the torch runtime does, for those ``stage_programs`` marks).

Each rank's figure comes with the action and the op where it peaks. It knows nothing of
a backend's fusion or of a communication library's own buffers."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from ..ir.analysis import peak_memory, view_bases
from ..ir.core import Graph, InputKind
from ..passes.pipeline_orders import rank_orders
from ..passes.pipeline_programs import StageProgram, StagePrograms, rank_stage_programs


@dataclass(frozen=True)
class RankPeak:
    """The most bytes one rank holds at once: ``bytes``, on pipeline rank ``rank``, while
    it runs ``at`` (``"rank 1, stage 1 B of microbatch 3: #12 mm (backward)"``)."""

    bytes: int
    rank: int
    at: str


def pipeline_peak(graph: Graph, opts: Any, in_place: Collection[str] = (),
                  cuts: list[StagePrograms] | None = None,
                  written: Collection[str] = ()) -> list[RankPeak] | None:
    """Each pipeline rank's peak in the staged ``graph`` under its pipeline pass ``opts``,
    by rank; None when the schedule's order cannot be written out (microbatches it
    refuses). ``in_place``: the update programs' new values the backend writes into the
    input they replace where they are made (``Framework.in_place_updates``), those in
    ``written`` by their own kernel (no storage of their own; ``Framework.kernel_written``);
    ``cuts``: ``rank_stage_programs(graph)``, when already made."""
    sizes = dict(graph.mesh.axes)
    ranks = sizes.get(opts.axis, 1)
    nstages = 1 + max(op.stage for op in graph.ops if op.stage is not None)
    try:
        orders = rank_orders(opts.schedule, ranks, opts.microbatches, nstages)
    except ValueError:
        return None
    cuts = cuts or rank_stage_programs(graph)
    return [_RankWalk(graph, sizes, opts.microbatches, cut, r, set(in_place),
                      set(written)).run(orders[r]) for r, cut in enumerate(cuts)]


class _RankWalk:
    """One rank's walk: storages by key, each with the holders that keep it alive."""

    def __init__(self, graph: Graph, sizes: dict[str, int], microbatches: int,
                 cut: StagePrograms, rank: int, in_place: set[str],
                 written: set[str] = frozenset()) -> None:
        self.sizes = sizes
        self.written = written
        self.m = microbatches
        self.rank = rank
        self.in_place = in_place
        self.cut = cut
        self.types = graph.value_types()
        read = self.cut.inputs_read
        self.base = 0
        for i in graph.inputs:
            nbytes = i.value.type.local_nbytes(sizes)
            if i.role.kind is InputKind.batch:
                self.base += nbytes * microbatches
            elif i.name in read:
                self.base += nbytes
        self.size: dict[Any, int] = {}
        self.holders: dict[Any, set] = {}
        self.now = self.base
        self.best, self.at = self.base, f"rank {rank}, before the step"
        self._peaks: dict[tuple[int, str], tuple[int, str]] = {}
        self._bases: dict[str, dict[str, str]] = {}    # program name -> its view bases
        self.local: dict[tuple[int, int], Any] = {}     # (microbatch, tag) -> storage

    # ------------------------------------------------------------------ storages
    def hold(self, key: Any, nbytes: int, holder: Any) -> None:
        if key not in self.holders:
            self.holders[key] = set()
            self.size[key] = nbytes
            self.now += nbytes
        self.holders[key].add(holder)

    def drop(self, holder: Any) -> None:
        for key in [k for k, h in self.holders.items() if holder in h]:
            h = self.holders[key]
            h.discard(holder)
            if not h:
                del self.holders[key]
                self.now -= self.size.pop(key)

    def note(self, extra: int, at: str) -> None:
        if self.now + extra > self.best:
            self.best, self.at = self.now + extra, at

    def nbytes(self, name: str) -> int:
        return self.types[name].local_nbytes(self.sizes)

    # ------------------------------------------------------------------ programs
    def program_peak(self, key: tuple[int, str], prog: StageProgram) -> tuple[int, str]:
        """A program's peak above its inputs, and the op there."""
        if key not in self._peaks:
            p = peak_memory(prog.graph, self.in_place & set(prog.outputs),
                            written=self.written)
            at = ""
            if p.index >= 0:
                op = prog.graph.ops[p.index]
                name = op.attrs.get("target", op.name) if op.name == "opaque" else op.name
                at = f"#{p.index} {name}" + (f" ({op.phase.value})" if op.phase else "")
            self._peaks[key] = (p.bytes - p.inputs_bytes, at)
        return self._peaks[key]

    def bases(self, prog: StageProgram) -> dict[str, str]:
        """``view_bases`` of a program, computed once (the walk meets it M times)."""
        name = prog.graph.name
        if name not in self._bases:
            self._bases[name] = view_bases(prog.graph)
        return self._bases[name]

    def owned_outputs(self, prog: StageProgram) -> dict[str, int]:
        """The storages a program's results own (their bases), by base name: a result that
        is a view of an input owns nothing."""
        base = self.bases(prog)
        ins = set(prog.inputs)
        out: dict[str, int] = {}
        for n in prog.outputs:
            b = base.get(n, n)
            if b not in ins:
                out[b] = self.nbytes(b)
        return out

    def run_program(self, prog: StageProgram, st: int, kind: str, mb: int) -> None:
        """Its peak on top of what is held; then its results, kept for the microbatch."""
        extra, op = self.program_peak((st, kind), prog)
        self.note(extra, f"rank {self.rank}, stage {st} {kind} of microbatch {mb}: "
                         f"{op or 'no op'}")
        for b, nbytes in self.owned_outputs(prog).items():
            self.hold(("v", st, mb, b), nbytes, ("env", st, mb))

    def receive(self, prog: StageProgram, st: int, mb: int) -> None:
        for name, peer, tag in prog.recvs:
            if peer == self.rank:       # from this rank's other stage: shared, not copied
                key = self.local.pop((mb, tag), None)
                if key is not None:
                    self.holders[key].add(("env", st, mb))
                    self.holders[key].discard(("local", mb, tag))
            else:
                self.hold(("v", st, mb, name), self.nbytes(name), ("env", st, mb))

    def send(self, prog: StageProgram, st: int, mb: int) -> None:
        base = self.bases(prog)
        for name, peer, tag in prog.sends:
            key = ("v", st, mb, base.get(name, name))
            if key not in self.holders:  # sent straight from an input: nothing new held
                continue
            if peer == self.rank:
                self.local[(mb, tag)] = key
                self.holders[key].add(("local", mb, tag))
            else:
                self.holders[key].add("pending")

    # ------------------------------------------------------------------ the walk
    def run(self, order: tuple[tuple[str, int, int], ...]) -> RankPeak:
        summed: set[str] = set()
        by_update = {n for (_, k), p in self.cut.programs.items() if k.startswith("U")
                     for n in p.inputs}
        for st, prog in sorted(self.cut.once.items()):     # each stage's T, before all
            extra, op = self.program_peak((st, "T"), prog)
            self.note(extra, f"rank {self.rank}, stage {st} T: {op or 'no op'}")
            for b, nbytes in self.owned_outputs(prog).items():
                self.hold(("once", st, b), nbytes, "end" if b in by_update else "once")
        for k, (kind, mb, st) in enumerate(order):
            prog = self.cut.programs[(st, kind)]
            self.receive(prog, st, mb)
            if k + 1 < len(order):      # the next action's receives, posted now
                nk, nmb, nst = order[k + 1]
                nxt = self.cut.programs[(nst, nk)]
                for name, peer, _ in nxt.recvs:
                    if peer != self.rank:
                        self.hold(("v", nst, nmb, name), self.nbytes(name),
                                  ("env", nst, nmb))
            self.run_program(prog, st, kind, mb)
            base = self.bases(prog)
            for n in prog.acc:
                if n in summed:
                    continue
                summed.add(n)           # the first microbatch's value starts the sum
                if n in prog.acc_owned:     # taken as it is
                    self.holders[("v", st, mb, base.get(n, n))].add("acc")
                else:                   # a copy
                    self.hold(("acc", n), self.nbytes(n), "acc")
            self.note(0, f"rank {self.rank}, after stage {st} {kind} of microbatch {mb}")
            self.send(prog, st, mb)
            if kind in "BW":
                self.drop(("env", st, mb))
        self.drop("once")               # T's values no update reads: let go here
        stages = sorted({st for st, _ in self.cut.programs})
        for r in range(self.cut.nrounds):
            for st in stages:
                prog = self.cut.programs[(st, f"U{r}")]
                for name, peer, _ in prog.recvs:
                    if peer != self.rank:
                        self.hold(("v", st, self.m, name), self.nbytes(name), "end")
                extra, op = self.program_peak((st, f"U{r}"), prog)
                self.note(extra, f"rank {self.rank}, stage {st} update: {op or 'no op'}")
                for b, nbytes in self.owned_outputs(prog).items():
                    if b not in self.in_place:      # written into its input: no new storage
                        self.hold(("v", st, self.m, b), nbytes, "end")
        for name, _, _ in self.cut.writes.values():
            self.hold(("w", name), self.nbytes(name), "end")
        self.note(0, f"rank {self.rank}, end of the step")
        return RankPeak(self.best, self.rank, self.at)


__all__ = ["RankPeak", "pipeline_peak"]
