"""Where a step's forward pass combines different examples of its batch.

Data and pipeline parallelism run the forward on a share of the batch (a device's, a
microbatch's) and average what comes out, as DDP does. That equals the single-device step
when the loss is a mean over examples of per-example terms. It does not when the forward
ties examples together: a batch norm's statistics, a contrastive loss's product of every
image with every text, a mean over tokens divided by a count of the batch's mask (which
data parallelism makes exact by summing the count over the devices: ``CountedMean``).

``batch_coupling`` finds those ops. It splits the batch inputs along dimension 0 (the
dimension both passes split) and follows the split through the forward ops with the ops'
own sharding strategies (``strategies.py``), as a partitioner would on a batch axis: a value
is split along some dimension, whole (computed from weights alone), a partial sum over the
examples (a sum or mean over the batch), or a constant that may be built in whatever
placement a consumer needs. An op none of whose strategies takes its inputs as they are
combines examples: each share's result is not a slice, nor a part of a sum, of the whole
batch's. Ops without strategies (a framework op with no rule, a random draw) are not
judged: what they make from rows is taken as rows where it keeps the batch's first
dimension (``_unjudged``); one that makes anything else from rows (a loss of no rule summed
over them, a count) is reported, since nothing shows its devices' results average to the
batch's; a sum or mean over the batch read by one is reported where it is a matrix (a
covariance into eigh) and let through where it is a scalar (``nan_to_num`` of the loss).
Ops that take some of the rows or join pieces of rows (slices or chunks of the batch for
gradient accumulation, ``_rows_kept``) keep rows: each row is still one example (one
example picked out, ``x[0]``, drops the rows' dimension and is found)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from .analysis import free_inputs
from .core import Graph, InputKind, Op, OutputKind, Phase
from .framework_ops import FrameworkOpRule, framework_rule
from .grad_seed import differentiated
from .opdef import Category, is_view, op_def, random_draw
from .row_probe import RowProbe
from .strategies import (Strategy, group_counts, no_strategies, replicate_only,
                         strategies_of)
from .types import REPLICATE, Partial, Placement, Replicate, Shard, TensorType

# a value no strategy could place (an op without a rule made it): not followed
_UNKNOWN = None


@dataclass(frozen=True)
class Coupling:
    """One op of the forward that combines examples of the batch."""

    where: str          # the op's source line, or its name
    op: str             # the op (a framework op's target)
    why: str            # what it does with the batch, in words
    certain: bool       # False: exact when every share counts alike (a mask's count)

    def __str__(self) -> str:
        return f"{self.where} ({self.op}): {self.why}"


@dataclass(frozen=True)
class CountedMean:
    """A mean over a count that the batch's values sum to: a masked mean
    (``sum(l * mask) / sum(mask)``, the count clamped or not), cross-entropy's mean over
    the targets it does not ignore. Each share divides by its own count; dividing by the
    count summed over the shares makes it the batch's (``passes/global_counts.py``).

    ``made`` is the share's mean: the division's result, or the framework op's mean
    result, which ``summing`` (that op summing its rows instead, from its rule's
    ``row_sum``) makes a sum. ``count`` is what it divides by: the divisor, or the op's
    count result (its backward reads it again). ``sums`` are the sums over the rows the
    count is made from, each with how the shares' values combine into the batch's ("sum",
    "avg"); ``math`` the values the count's scalar math makes from them, in program order
    (a clamp to at least 1, a constant added), the count last when there is any.
    ``numerator`` says how the shares' numerators combine ("sum": a sum over rows; "avg":
    a mean)."""

    made: str
    count: str
    sums: tuple[tuple[str, str], ...]
    math: tuple[str, ...]
    numerator: str
    coupling: Coupling
    summing: Op | None = None
    # the count's additions of whole values to a sum (sum(mask) + eps), found as
    # couplings: summed over the devices first, each adds its value once
    shifts: tuple[Coupling, ...] = ()


@dataclass(frozen=True)
class BatchSplit:
    """What splitting the batch by rows does to a step: the forward ops that combine
    examples, and how each returned value made from the batch (the loss, a metric, a
    buffer's new value) that is a sum or a mean over it combines across the shares:
    ``sum`` (the shares' values add up to the batch's: ``reduction="sum"``, a sum divided
    by the global batch's size, a count of correct answers), ``avg`` (they average to
    it: a mean, an exponential average of a batch mean), or ``max`` / ``min`` (a maximum
    or minimum over the batch: the largest of the shares' is the batch's)."""

    couplings: tuple[Coupling, ...]
    combine: Mapping[str, str]
    # the forward's values split by rows: name -> the dim holding the batch's rows
    rows: Mapping[str, int] = field(default_factory=dict)
    # the couplings that are means over counts the shares' values sum to
    counted: tuple[CountedMean, ...] = ()
    # False: not analysed (every batch input of one row and no probe at more rows)
    judged: bool = True
    # True: analysed on the step traced at more rows per share (each share has one)
    probed: bool = False
    # the means over counts found there that have no match in the step that runs
    unmatched: tuple[str, ...] = ()
    # how the gradients combine ("sum", "avg") where the backward's seed shows the value
    # differentiated (``FrameworkOpRule.seeds_gradient``), which may not be the loss the
    # step returns (a sum differentiated, its mean logged); None: as that loss
    gradients: str | None = None


def split_batch(graph: Graph, probe: RowProbe | None = None,
                traced: Graph | None = None) -> BatchSplit:
    """``BatchSplit`` of ``graph``. When every batch input holds one row (a share of one
    example, as traced: its rows cannot be told from the dimensions they merge into), the
    analysis runs on ``probe``, the same step traced at more rows per share (the frontends
    trace it, ``api.trace_step``), and is carried back to the values ``graph`` has alike
    (``row_probe.py``); without one, nothing is found and ``judged`` is False, and so it
    is where a mean over a count found there has no match in ``graph``. A batch
    input of one row beside others of more (a temperature passed with the batch) is taken
    as whole. ``traced``: the step as traced, before any pass, where the value a backward
    pass differentiates is looked for when ``graph`` no longer has it (``jax.grad``'s
    value, unused, dropped as dead)."""
    if one_row_per_share(graph):
        if probe is None or one_row_per_share(probe.graph):
            return BatchSplit((), {}, judged=False)
        return _kept_in(split_batch(probe.graph), graph, probe)
    if probe is not None and one_row_windows(graph) and not one_row_windows(probe.graph):
        # windows of one row cannot show which dims are rows either (a position
        # embedding (1, S, E) added to one looks like a row): judged on the probe
        return _kept_in(split_batch(probe.graph), graph, probe)
    follow, found = _followed(graph)
    chance = _by_chance(follow.scaled, probe) if probe is not None else frozenset()
    if chance:
        follow, found = _followed(graph, chance)
    combine = {o.name: s.op for o in graph.outputs
               if isinstance(s := follow.state(o.name), Partial)
               and s.op in ("sum", "avg", "max", "min")}
    rows = {n: s.dim for n, s in follow.at.items()
            if isinstance(s, Shard) and isinstance(s.dim, int)}
    values = differentiated(graph)
    gradients = _gradients(values, follow)
    if values is None and traced is not None and traced is not graph:
        values = differentiated(traced)
        if values:
            before, _ = _followed(traced, chance)
            gradients = _gradients(values, before)
    return BatchSplit(found, combine, rows, tuple(follow.counted), gradients=gradients)


def _followed(graph: Graph, by_chance: frozenset[str] = frozenset()
              ) -> tuple[_Follow, tuple[Coupling, ...]]:
    """The analysis of ``graph`` run, and what it found. Where random draws took the
    placement of a later use (``_Follow.commit_draws``), it runs again with them placed
    so from the start: a use before that one (the mask's count taken first,
    ``n = m.sum()``, then ``(l * m).sum() / n``) sees them as the rows they are."""
    follow = _Follow(graph, by_chance)
    found = tuple(follow.run())
    if follow.commits:
        follow = _Follow(graph, by_chance, follow.commits)
        found = tuple(follow.run())
    return follow, found


def _gradients(values: Sequence[str] | None, follow: _Follow) -> str | None:
    """How the gradients combine across the shares ("sum" or "avg"): as ``values``, the
    values the backward passes differentiate (``grad_seed.differentiated`` of the graph
    ``follow`` ran on), where each is a sum or a mean over the batch, and all alike; None
    otherwise."""
    kinds = set()
    for name in values or ():
        op = follow.producer.get(name)
        if op is not None and op.phase is Phase.backward and name not in follow.at:
            follow.place(op)        # a value differentiated, not returned: not followed
        state = follow.state(name)
        if not isinstance(state, Partial) or state.op not in ("sum", "avg"):
            return None
        kinds.add(state.op)
    return kinds.pop() if len(kinds) == 1 else None


def scaled_by_rows(graph: Graph) -> list[str]:
    """Where (source lines) the batch analysis of ``graph`` takes a sum over the rows
    divided by a constant for a mean, or a mean times a constant for a sum, the constant
    being as many as the elements summed: a sum divided by a number that only equals them
    here (``sum() / 2`` at 2 rows a share) looks the same, and only the step traced at
    more rows tells them apart (``split_batch``'s probe). A division the frontend made as
    a mean of the rows' own sum (``div{mean=true}``: jnp.mean) is not listed: it is a
    mean at any rows."""
    follow, _ = _followed(graph)
    ops = [follow.producer[n] for n, mean in follow.scaled.items()
           if mean and n not in follow.certain]
    return list(dict.fromkeys(op.loc or follow.near(op) or op.name for op in ops))


def _by_chance(scaled: Mapping[str, bool], probe: RowProbe) -> frozenset[str]:
    """The divisions ``scaled`` takes for means (a sum over the rows over their number),
    and the products it takes for sums (a mean times that number), that in ``probe`` (the
    step traced at more rows per share) scale by the same kind of constant no longer equal
    to the elements summed: a number that equalled the rows by coincidence, so a sum (a
    mean) scaled. One with no match there is taken as it was."""
    theirs, _ = _followed(probe.graph)
    ours = {v: k for k, v in probe.names.items()}
    return frozenset(n for n, mean in scaled.items()
                     if mean and theirs.scaled.get(ours.get(n, "")) is False)


def one_row_per_share(graph: Graph) -> bool:
    """True when every batch input of ``graph`` (and there is one) holds one row."""
    rows = [i.value.type.shape[0] for i in graph.inputs
            if i.role.kind is InputKind.batch and i.value.type.rank >= 1]
    return bool(rows) and all(r == 1 for r in rows)


def one_row_windows(graph: Graph) -> bool:
    """True when the step takes windows of one row of a batch input of more (each half of
    a gradient accumulation at two rows a device, per-example micro-batches): what it
    computes on them cannot show which dims are their rows, as at one row per share."""
    batch = {i.name: i.value.type for i in graph.inputs
             if i.role.kind is InputKind.batch and i.value.type.rank >= 1
             and i.value.type.shape[0] > 1}
    return any(n in batch and t.rank == batch[n].rank and t.shape[0] == 1 and
               t.shape[1:] == batch[n].shape[1:]
               for op in graph.ops if (op.phase or Phase.forward) is Phase.forward
               for n in op.inputs for t in (v.type for v in op.results))


def _kept_in(split: BatchSplit, graph: Graph, probe: RowProbe) -> BatchSplit:
    """``split`` (of ``probe``'s graph, ``graph``'s step traced at more rows per share)
    for ``graph``, through the values the two traces have alike (``probe.names``) that
    ``graph`` still has (a pass may have dropped dead ones). A mean over a count whose
    values do not all match is left out, named in ``unmatched``, and the split is not
    ``judged``: it would stay each device's own mean, and the plan must say so."""
    have = graph.value_types()
    names = {k: v for k, v in probe.names.items() if v in have}
    made_by = {v.name: op for op in graph.ops for v in op.results}
    counted, unmatched = [], []
    for c in split.counted:
        used = (c.made, c.count, *(n for n, _ in c.sums), *c.math)
        matched = all(n in names for n in used)
        summing = None
        if matched and c.summing is not None:
            # the op summing its rows, made from graph's own
            op = made_by.get(names[c.made])
            found = _row_sum(op, [have[n] for n in op.inputs],
                             [v.type for v in op.results]) if op is not None else None
            summing = found[0] if found is not None else None
        if not matched or (c.summing is not None and summing is None):
            unmatched.append(str(c.coupling))
            continue
        counted.append(replace(
            c, made=names[c.made], count=names[c.count],
            sums=tuple((names[n], how) for n, how in c.sums),
            math=tuple(names[n] for n in c.math), summing=summing))
    outputs = {p.name: g.name for p, g in zip(probe.graph.outputs, graph.outputs)}
    return BatchSplit(split.couplings,
                      {outputs[k]: v for k, v in split.combine.items() if k in outputs},
                      {names[k]: v for k, v in split.rows.items() if k in names},
                      tuple(counted), judged=not unmatched, probed=True,
                      unmatched=tuple(dict.fromkeys(unmatched)), gradients=split.gradients)


def _row_sum(op: Op, ins: Sequence[TensorType], outs: Sequence[TensorType]
             ) -> tuple[Op, int, int] | None:
    """The rule's ``row_sum`` of this call of a framework op (the call summing its rows
    instead of dividing by its count, with where its sum and count are), or None."""
    rule = framework_rule(op)
    return rule.row_sum(op, ins, outs) if rule is not None and rule.row_sum is not None \
        else None


def batch_coupling(graph: Graph) -> list[Coupling]:
    """The forward ops of ``graph`` that combine examples of its batch, in program order
    (``split_batch``)."""
    return list(split_batch(graph).couplings)


def split_notes(found: Sequence[Coupling]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What a plan says of the couplings ``found``: those that change the step whatever
    the data, then those exact only when every share counts alike; one line per source
    line and reason."""

    def lines(certain: bool) -> tuple[str, ...]:
        return tuple(dict.fromkeys(str(c) for c in found if c.certain is certain))
    return lines(True), lines(False)


def _norm(p: Placement) -> Placement:
    """A mean over the batch is a partial sum scaled by a constant: one kind to the
    strategies (what is linear in a sum is linear in a mean)."""
    return Partial("sum") if isinstance(p, Partial) and p.op in ("sum", "avg") else p


def _mean_kept(out: Placement, states: Sequence[object]) -> Placement:
    """A strategy's partial-sum result is a mean when it is linear in means alone."""
    if out == Partial("avg"):       # a mean over the batch (reduce_mean of rows)
        return out
    parts = {s.op for s in states if isinstance(s, Partial)}
    return Partial("avg") if _norm(out) == Partial("sum") and parts == {"avg"} else _norm(out)


def _affine_in_a_mean(op: Op, states: Sequence[object], ins: Sequence[TensorType],
                      outs: Sequence[TensorType]) -> bool:
    """A mean over the batch plus or minus whole values (a weight decay term added to the
    loss), or cast to another dtype: the shares' results average to the batch's. (A sum
    over the batch is taken as a mean here, as data parallelism takes it: JAX writes a
    mean as a sum divided by the count, which cannot be told from a scaled sum.)"""
    split = [s for s in states if _split(s)]
    if len(split) != 1 or _norm(split[0]) != Partial("sum"):
        return False
    if op.name in ("add", "sub"):
        return True
    return len(ins) == 1 and len(outs) == 1 and ins[0].shape == outs[0].shape and \
        ins[0].dtype != outs[0].dtype and _has_strategies(op)


@dataclass(frozen=True, eq=False)
class _Summed:
    """A scalar computed from sums over the batch by math not linear in them (a count
    clamped to at least 1): judged by what reads it. Dividing by it is a mean over a count;
    anything else (or returning it) combines examples, found at ``made_by``."""

    made_by: Op
    # the reciprocal of a count (``1 / sum(mask)``, times constants): its value and the
    # count's; multiplying a sum over the rows by it is a mean over that count
    inverse: tuple[str, str] | None = None


def _split(p: object) -> bool:
    """True for a state that depends on the batch (a split, a partial sum, a scalar of
    sums)."""
    return isinstance(p, (Shard, Partial, _Summed))


class _Follow:
    def __init__(self, graph: Graph, by_chance: frozenset[str] = frozenset(),
                 committed: Mapping[str, Placement] | None = None) -> None:
        self.graph = graph
        # random draws placed by a later use (``commit_draws``): name -> placement, those
        # found on a first run (``committed``) and those this run finds (``commits``)
        self.committed = dict(committed or {})
        self.commits: dict[str, Placement] = {}
        # a sum over the rows divided by a constant, or a mean over them multiplied by
        # one -> whether the constant is as many as the elements summed (a mean:
        # ``jnp.mean``, ``sum() / x.shape[0]``; a sum: ``mean * len(x)``); ``by_chance``:
        # those whose constant only equals them at these rows (``sum() / 2`` at 2 rows a
        # share, found on the step traced at more: ``_by_chance``)
        self.scaled: dict[str, bool] = {}
        self.by_chance = by_chance
        # sums made by summing the split rows themselves (a reduce over dim 0 of a value
        # split by rows), and the divisions of ``scaled`` the frontend made as means of
        # such a sum (``div{mean=true}``, jnp.mean's): means at any rows, no probe needed
        self.row_sums: set[str] = set()
        self.certain: set[str] = set()
        self.types = graph.value_types()
        # name -> a Placement, a frozenset of placements (a constant: any of these),
        # or _UNKNOWN; values not here are whole (weights, optimizer state)
        self.at: dict[str, object] = {}
        for i in graph.inputs:
            t = i.value.type
            if i.role.kind is InputKind.batch and t.rank >= 1 and t.shape[0] > 1:
                self.at[i.name] = Shard(0)
        # the share's rows, where its batch inputs agree: a sum over rows merged with
        # other dims (tokens flattened) divided by them is a mean over examples
        rows = {i.value.type.shape[0] for i in graph.inputs if i.name in self.at}
        self.batch_rows = rows.pop() if len(rows) == 1 else None
        self.producer = {v.name: op for op in graph.ops for v in op.results}
        # a value split by rows or summed over them -> the sizes of the other dims summed
        # into it; a sum over the rows -> its ``_Count``: what a mean divides by; a mean
        # over them -> the ``_Count`` it divided by
        self.extra: dict[str, tuple[int, ...]] = {}
        self.summed: dict[str, _Count] = {}
        self.meaned: dict[str, _Count] = {}
        self.mean_plus: dict[str, _Count] = {}      # a mean plus a whole value
        self.found: list[Coupling] = []
        self.counts: set[int] = set()     # scalars of sums divided by: counts (ids of ops)
        # a value split by rows -> the windows of its rows that slices read, with their ops
        self.windows: dict[str, list[tuple[range, Op]]] = {}
        # a window's result -> the value it was taken from and its rows
        self.window_of: dict[str, tuple[str, range]] = {}
        self.constant_made: dict[str, bool] = {}
        # a value of rows computed from windows of a value's rows -> those windows
        self.tags: dict[str, frozenset[tuple[str, range]]] = {}
        self.read = {n for op in graph.ops for n in free_inputs(op)} | \
            {o.name for o in graph.outputs}
        self.counted: list[CountedMean] = []
        # a scalar sum over the batch plus or minus whole values -> its coupling
        self.shifted: dict[str, Coupling] = {}
        self.position = {v.name: k for k, op in enumerate(graph.ops) for v in op.results}
        self.kinds = {i.name: i.role.kind for i in graph.inputs}
        # values drawn at random (and elementwise math on them alone) in whatever
        # placement their use asks for: ``commit_draws``
        self.drawn: set[str] = set()

    def run(self) -> list[Coupling]:
        later: list[str] = []
        late: set[str] = set()
        returned = {o.name for o in self.graph.outputs
                    if o.role.kind in (OutputKind.loss, OutputKind.metric)}
        for op in self.graph.ops:
            if (op.phase or Phase.forward) is Phase.forward:
                self.place(op)
                self.pair_windows(op)
            elif op.phase is Phase.update and any(
                    n in late or isinstance(s := self.state(n), Shard)
                    or (isinstance(s, Partial) and n not in returned)
                    for n in free_inputs(op)):
                # a metric of the batch computed after the optimizer step, from its rows
                # (``(out.argmax(-1) == y).sum()`` in the return) or from a sum or mean
                # over them not returned (``loss_sum.item() / 2``): data parallelism runs
                # it per device; not the update's reads of a returned loss, which data
                # parallelism syncs first
                self.place(op)
                late.update(v.name for v in op.results)
            else:
                later += free_inputs(op)
                if op.phase is Phase.update and self.share_sized(op):
                    self.report(op, "multiplies the batch's mean, averaged over the devices "
                                    "first, by a number equal to this device's share of the "
                                    "batch's size: if it is that size, not the batch's "
                                    "(return the loss times its size from before the "
                                    "optimizer step, or scale it outside the step)",
                                certain=True)
        # a scalar of sums made by nonlinear math that the step returns, or that backward
        # differentiates (a loss whose square root is backpropagated, another returned)
        made = {id(s.made_by): s.made_by for n in later + [o.name for o in self.graph.outputs]
                if isinstance(s := self.state(n), _Summed) and id(s.made_by) not in self.counts}
        for op in made.values():
            self.report(op, _NONLINEAR, certain=True)
        for o in self.graph.outputs:
            s = self.state(o.name)
            if o.role.kind is OutputKind.loss and isinstance(s, Partial) and s.op in _SWAP:
                op = self.made_by(o.name)
                self.report(op, "makes the loss a maximum or minimum over the batch: each "
                                "share's gradients are those of its own", certain=True)
        self.positional_rows()
        self.shape_counts()
        return self.found

    def shape_counts(self) -> None:
        """A returned value, or a buffer's new value, that no batch value reaches but that
        is made from the number of the share's rows (``seen += x.shape[0]``,
        ``torch.tensor(x.shape[0])``, ``ones(x.shape[0]).sum()``): traced at a share, the
        batch's size is the share's, so each device counts its own rows, not the batch's.
        A number equal to the rows can be something else (8 heads beside a batch of 8):
        the words say "if". A value made from the parameters is not looked at."""
        rows = {i.value.type.shape[0] for i in self.graph.inputs
                if self.state(i.name) == Shard(0) and i.value.type.rank}
        if len(rows) != 1:
            return
        (n,) = rows
        kinds = {i.name: i.role.kind for i in self.graph.inputs}
        made: set[int] = set()
        batch: dict[str, bool] = {}
        for o in self.graph.outputs:
            kind = o.role.kind
            if not (kind in (OutputKind.loss, OutputKind.metric) or
                    kind is OutputKind.replaces and kinds.get(o.role.target) is InputKind.buffer):
                continue
            state = self.state(o.name)
            if state != REPLICATE and not isinstance(state, frozenset) or \
                    self.reads_batch(o.name, kinds, batch):
                continue            # made from the batch: judged by what made it
            if self.reads_param(o.name):
                # from the parameters (a norm of them): a constant of as many rows is of
                # a parameter's shape (8 rows of a weight beside 8 rows a device)
                continue
            op = self.counted_rows(o.name, n, set(), self.types[o.name].numel == 1)
            if op is None or id(op) in made:
                continue
            made.add(id(op))
            made_by, where = self.producer.get(o.name), None
            if not op.loc and not self.near(op):
                # a constant without a source line: where it is used, or what it makes
                if made_by is not None and made_by.loc:
                    op = made_by
                else:
                    where = f"the step's result %{o.name}"
            what = f"the new value of buffer %{o.role.target}" \
                if kind is OutputKind.replaces else "a value the step returns"
            self.report(op, f"makes {what} from the number {n}, the rows of the share of "
                            "the batch it was traced with, and from nothing else of the "
                            "batch: if that is the batch's size (x.shape[0], a tensor of "
                            "ones at it), each device counts its own share's rows, not the "
                            "batch's (count outside the step, where the batch's size is "
                            "known, or from values of the batch, a mask's sum, which the "
                            "devices add up)",
                        certain=True, where=where)

    def reads_batch(self, name: str, kinds: dict[str, InputKind],
                    memo: dict[str, bool]) -> bool:
        """Whether a batch input reaches ``name`` (a gradient does, through backward)."""
        if name not in memo:
            memo[name] = False          # (no cycles; a guard while it is worked out)
            op = self.producer.get(name)
            memo[name] = kinds.get(name) is InputKind.batch if op is None else any(
                self.reads_batch(x, kinds, memo) for x in free_inputs(op))
        return memo[name]

    def counted_rows(self, name: str, n: int, seen: set[str], scalar: bool) -> Op | None:
        """The op making a constant part of ``name`` (built from no input) that holds the
        number ``n`` (a ``full`` of it) or has ``n`` rows; None if there is none."""
        if name in seen:
            return None
        seen.add(name)
        op = self.producer.get(name)
        if op is None or op.regions:
            return None
        if self.built(name):
            return self.holds(name, n, set(), scalar)
        for x in op.inputs:
            found = self.counted_rows(x, n, seen, scalar)
            if found is not None:
                return found
        return None

    def built(self, name: str) -> bool:
        """Made by ops that read no input of the graph (constants and math on them)."""
        got = self.constant_made.get(name)
        if got is None:
            op = self.producer.get(name)
            got = op is not None and not op.regions and \
                all(self.built(x) for x in op.inputs)
            self.constant_made[name] = got
        return got

    def holds(self, name: str, n: int, seen: set[str], scalar: bool) -> Op | None:
        """In the constant part ``name``: a ``full`` of the number ``n``, or, where what
        it makes is a scalar (a count: ``ones(n).sum()``), a value of ``n`` rows (a
        causal mask of n x n positions rebuilt into a buffer is not a count)."""
        if name in seen:
            return None
        seen.add(name)
        op, t = self.producer[name], self.types[name]
        if op.name == "full" and t.rank == 0 and op.attrs.get("value") == n or \
                scalar and t.rank >= 1 and t.shape[0] == n:
            return op
        for x in op.inputs:
            found = self.holds(x, n, seen, scalar)
            if found is not None:
                return found
        return None

    def note_windows(self, op: Op, actual: Sequence[object], ins: Sequence[TensorType],
                     outs: Sequence[TensorType]) -> None:
        """Record the rows a slice or split takes of a value split by rows (the results
        nothing reads left out: ``jnp.split``'s unused pieces)."""
        if not actual or actual[0] != Shard(0) or not ins[0].rank:
            return
        if op.name == "slice":
            strides = op.attrs.get("strides") or (1,) * ins[0].rank
            got = [range(int(op.attrs["starts"][0]), int(op.attrs["limits"][0]),
                         int(strides[0]))]
        else:
            rule = framework_rule(op) if op.name == "opaque" else None
            got = None if rule is None or rule.row_window is None else \
                rule.row_window(op, ins, outs)
        if got is None or len(got) != len(op.results):
            return
        for rows, v in zip(got, op.results):
            if v.name in self.read and len(rows) < ins[0].shape[0]:
                self.windows.setdefault(op.inputs[0], []).append((rows, op))
                self.window_of[v.name] = (op.inputs[0], rows)

    def positional_rows(self) -> None:
        """Slices of the batch's rows that, together, leave some rows out: ``x[:n // 2]``
        picks examples by their position, and a device's share has other examples at those
        positions. (Windows covering every row, the micro-batches of gradient accumulation,
        treat each row alike: each share runs them on its own rows.)"""
        for name, windows in self.windows.items():
            n = self.types[name].shape[0]
            taken = set().union(*(set(r) for r, _ in windows))
            apart = {r: op for r, op in windows}        # one window taken twice: once
            if sum(len(r) for r in apart) > len(taken):
                (a, _), (b, op) = _overlapping(list(apart.items()))
                a, b = sorted((a, b), key=lambda r: (r.start, r.stop))
                self.report(op, f"takes rows {_span(a)} and {_span(b)} of {n}, which "
                                "overlap: it pairs examples by their position (neighbouring "
                                "rows), and a device's share pairs other examples",
                            certain=True)
                continue
            if len(taken) == n:
                continue
            rows, op = windows[0]
            self.report(op, f"takes rows {_span(rows)} of {n} by their position, not every "
                            "row: a device's share of the batch holds other examples there "
                            "(take the rows before the step, or pass only the rows to train "
                            "on)",
                        certain=True)

    def pair_windows(self, op: Op) -> None:
        """Row values made from two windows of one value's rows meeting in one op (``z1,
        z2 = z.chunk(2); z1 - z2``, ``model(x[:4]) - model(x[4:])``): row i of one window
        is paired with row i of the other, which a device's share pairs differently.
        (Windows that overlap are found by ``positional_rows``; the pieces of gradient
        accumulation meet only as sums over their rows.) Joined again, in order, the
        windows are the rows themselves."""
        if op.regions:
            return
        rule = framework_rule(op) if op.name == "opaque" else None
        tags: set[tuple[str, range]] = set()
        for n in op.inputs:
            if self.state(n) == Shard(0):
                tags |= self.tags.get(n, frozenset())
                if n in self.window_of:
                    tags.add(self.window_of[n])
        if not tags or _takes_or_joins(op, rule):
            return
        by_source: dict[str, set[range]] = {}
        for src, rows in tags:
            by_source.setdefault(src, set()).add(rows)
        for src, windows in by_source.items():
            apart = sorted(windows, key=lambda r: (r.start, r.stop))
            if len(apart) > 1 and not any(set(a) & set(b) for a in apart for b in apart
                                          if a is not b):
                n = self.types[src].shape[0]
                self.report(op, f"pairs rows {_span(apart[0])} and {_span(apart[1])} of "
                                f"{n} by their position (row i of one with row i of the "
                                "other): a device's share of the batch pairs other examples",
                            certain=True)
                return
        for v in op.results:
            if self.state(v.name) == Shard(0):
                self.tags[v.name] = frozenset(tags)

    def reorders(self, op: Op) -> bool:
        """A concatenation of windows of one value's rows in an order other than theirs
        (``jnp.roll`` along the batch: its last rows, then its first)."""
        got = [self.window_of.get(n) for n in op.inputs]
        if any(g is None for g in got) or len({src for src, _ in got}) != 1:
            return False
        rows = [r for _, r in got]
        return any(a.step != 1 or b.step != 1 or a.stop != b.start
                   for a, b in zip(rows, rows[1:]))

    def made_by(self, name: str) -> Op:
        return self.producer[name]

    def state(self, name: str) -> object:
        return self.at.get(name, REPLICATE)

    def place(self, op: Op) -> None:
        outs = [v.type for v in op.results]
        if op.regions:      # control flow: not judged, its batch-dependent results dropped
            if any(_split(self.state(n)) or self.state(n) is _UNKNOWN
                   for n in free_inputs(op)):
                self.set(op, [_UNKNOWN] * len(outs))
            return
        states = [self.state(n) for n in op.inputs]
        if any(s is _UNKNOWN for s in states):
            self.set(op, [_UNKNOWN] * len(outs))
            return
        ins = [self.types[n] for n in op.inputs]
        if not any(_split(s) for s in states):
            self.place_whole(op, states, ins, outs)
            return
        rule = framework_rule(op) if op.name == "opaque" else None
        if rule is not None and rule.batch_stats and Shard(0) in states:
            # (split on another dim it normalizes per example: instance norm's view)
            self.report(op, "normalizes with statistics over the batch (a batch norm in "
                            "training mode)", certain=True)
            self.set(op, [_UNKNOWN] * len(outs))
            return
        actual = [_norm(s) if isinstance(s, Placement) else s for s in states]
        self.note_windows(op, actual, ins, outs)
        if any(isinstance(s, _Summed) for s in actual):
            self.place_summed(op, actual, ins, outs)
            return
        if op.name == "neg" and isinstance(actual[0], Partial) and actual[0].op in _SWAP:
            # -max over the batch is a min over it: a metric data parallelism combines so
            self.set(op, [Partial(_SWAP[actual[0].op])])
            return
        menu = strategies_of(op, ins, outs,
                             group_counts(s for s in actual if isinstance(s, Placement)))
        fit = _first_fit(menu, _broadcast_at_one_row(actual, ins))
        if fit is not None:
            self.set(op, [self.mean_or_sum(op, p, states, actual, ins) for p in fit.outputs])
            self.commit_draws(op, fit)
            return
        if op.name == "reshape" and (moved := _reshaped_rows(actual, ins, outs)) is not None:
            self.set(op, [moved])
            return
        if rule is not None and rule.row_picks is not None and \
                (dim := self.picked_per_row(op, rule, actual, ins, outs)) is not None:
            self.set(op, [Shard(dim)])
            return
        if _affine_in_a_mean(op, states, ins, outs):
            summed = [n for n, st in zip(op.inputs, states) if st == Partial("sum")]
            if summed and op.name in ("add", "sub"):
                self.report(op, "adds a whole value to a sum over the batch: adding the "
                                "devices' values up counts it once per device, averaging "
                                "them divides the sum", certain=True)
                if len(op.results) == 1 and outs[0].numel == 1:
                    # a count plus a constant (sum(mask) + eps): summed over the devices
                    # first, the constant is added once (``count_parts``)
                    self.shifted[op.results[0].name] = self.found[-1]
            elif summed and summed[0] in self.summed:
                for v in op.results:                # a cast of a sum
                    self.summed[v.name] = self.summed[summed[0]]
                self.set(op, [Partial("sum")] * len(outs))
                return
            meaned = [n for n, st in zip(op.inputs, states) if st == Partial("avg")]
            if meaned and meaned[0] in self.meaned:
                # a cast of a mean keeps its count; a mean plus a whole value is noted
                # (times the batch's size it is not a sum)
                into = self.meaned if op.name not in ("add", "sub") else self.mean_plus
                into.update((v.name, self.meaned[meaned[0]]) for v in op.results)
            self.set(op, [Partial("avg")] * len(outs))
            return
        if rule is not None and rule.row_mean and \
                all(s == Shard(0) or not _split(s) for s in actual):
            # a mean over the rows that it counts by value (cross-entropy's ignored
            # targets): a mean over examples when it counts every row
            weighted = rule.row_weighted is not None and rule.row_weighted(op, ins, outs)
            self.report(op, rule.row_mean + (": weighted by class, the devices' means of "
                                              "their shares are not the batch's"
                                              if weighted else ""), certain=weighted)
            self.set(op, [Partial("avg")] * len(outs))
            n, t = next((n, t) for n, a, t in zip(op.inputs, actual, ins) if a == Shard(0))
            # what it may have counted: the rows and some of the other dims' elements
            self.meaned.update((v.name, _Count(t.shape[0], tuple(t.shape[1:]),
                                               self.window_rows(n))) for v in op.results)
            summing = _row_sum(op, ins, outs)
            if summing is not None and not any(self.from_windows(x) for x in op.inputs):
                made, count = (op.results[k].name for k in summing[1:])
                self.counted.append(CountedMean(made, count, ((count, "sum"),), (), "sum",
                                                self.found[-1], summing[0]))
            return
        if not _has_strategies(op, ins, outs):
            if random_draw(op) is None and any(isinstance(a, Partial) and t.rank >= 2
                                               for a, t in zip(actual, ins)):
                # a matrix summed over the batch into an op of no rule (eigh, cholesky,
                # an LU or a solve: a covariance penalty): nothing says it is linear in
                # it (a scalar mean into one, nan_to_num of the loss, is let through)
                self.report(op, _NONLINEAR + " (an op of no known rule: not shown linear)",
                            certain=True)
                self.set(op, [_UNKNOWN] * len(outs))
                return
            placed = _unjudged(actual, ins, outs)
            if random_draw(op) is None and \
                    op_def(op.name).category is not Category.collective and \
                    any(isinstance(a, Shard) for a in actual) and \
                    any(p is _UNKNOWN and t.numel for p, t in zip(placed, outs)):
                # rows into an op of no known rule that does not keep them (a loss summed
                # over the batch, a count, a product): nothing says the devices' results
                # average to the batch's (a collective an earlier pass placed, tensor
                # parallelism's all-reduce of a MoE's experts, is its own: not reported)
                self.report(op, "reduces or rearranges the batch's rows in an op of no "
                                "known rule: not shown to be a mean over examples",
                            certain=True)
            self.set(op, placed)
            return
        if op.name == "concat" and int(op.attrs["dim"]) == 0 and self.reorders(op):
            self.report(op, "joins windows of the batch's rows in another order (a roll of "
                            "the rows): each device's share would pair other examples",
                        certain=True)
            self.set(op, [_UNKNOWN] * len(outs))
            return
        if _takes_or_joins(op, rule) and _rows_kept(actual, ins, outs):
            self.set(op, [Shard(0)] * len(outs))
            return
        inverse = self.inverse_of(op, actual, ins, outs)     # 1 / sum(mask)
        if inverse is not None or (op.name != "div" and _scalar_math(actual, ins, outs)):
            self.set(op, [_Summed(op, inverse)] * len(outs))     # judged by its reader
            return
        why = _why(op, actual)
        if why is _COUNT and self.whole_over_count(op, actual):
            why = _WHOLE_OVER_COUNT
        certain = why is not _COUNT      # a division by a sum: exact when shares sum alike
        self.report(op, why, certain=certain)
        if not certain:
            self.note_count(op, *op.inputs, op.results[0].name)
        # a mean over a count stays followed (a weight decay term may be added to it)
        self.set(op, [_UNKNOWN if certain else Partial("avg")] * len(outs))

    def mean_or_sum(self, op: Op, out: Placement, states: Sequence[object],
                    actual: Sequence[object], ins: Sequence[TensorType]) -> Placement:
        """A strategy's result, a sum over the rows told from a mean. An op summing split
        rows (``reduce_sum`` over dim 0, a loss with reduction ``sum``) makes a sum of
        its rows, noted with the other dims it sums; dividing that by the number of
        elements summed (the rows times some of those dims: ``jnp.mean``, ``sum() /
        x.shape[0]``) makes a mean, by any other constant (the global batch's size, a
        scale) leaves a sum. What is linear in means alone is a mean, in sums alone a sum;
        a mean and a sum added (or a sum and a whole value) are found: the devices'
        values combine to the single-device one neither by averaging nor by adding."""
        split = [(n, a, t) for n, a, t in zip(op.inputs, actual, ins) if _split(a)]
        extra = next((self.extra.get(n, ()) for n, a, _ in split if a == Shard(0)), ())
        if out == Shard(0):       # a per-row sum adds its dims to what a mean counts
            more = tuple(ins[0].shape[d] for d in op.attrs.get("dims", ())) \
                if op.name == "reduce_sum" else ()
            for v in op.results:
                if extra or more:
                    self.extra[v.name] = extra + more
        if _norm(out) != Partial("sum"):
            return out
        row_split = [(n, t) for n, a, t in split if a == Shard(0)]
        if row_split:           # summing rows (and maybe other dims) of a split value
            n, t = row_split[0]
            dims = tuple(op.attrs.get("dims", range(t.rank))) \
                if op.name in ("reduce_sum", "reduce_mean") else tuple(range(t.rank))
            count = _Count(t.shape[0], extra + tuple(t.shape[d] for d in dims if d != 0),
                           self.window_rows(n))
            if out == Partial("avg") and op.name != "div":     # reduce_mean, a loss's mean
                self.meaned.update((v.name, count) for v in op.results)
                return out
            for v in op.results:
                self.summed[v.name] = count
                self.row_sums.add(v.name)
            return Partial("sum")
        if out == Partial("avg") and op.name != "div":
            return out
        parts = {s.op for s in states if isinstance(s, Partial)}
        if parts == {"sum"} and op.name in ("div", "mul") and len(split) == 1:
            # the constant divided by, or multiplied by on either side
            other = [n for n in op.inputs if n != split[0][0]]
            scale = self.constant(other[0]) if len(other) == 1 and (
                op.name == "mul" or split[0][0] == op.inputs[0]) else None
            counted = self.summed.get(split[0][0])
            if scale is not None and counted is not None:
                n = scale if op.name == "div" else (1 / scale if scale else None)
                mean = n is not None and counted.counts(n, self.batch_rows)
                self.scaled[op.results[0].name] = mean
                if mean and op.attrs.get("mean") and self.sums_rows(split[0][0]):
                    self.certain.add(op.results[0].name)
                if mean and op.results[0].name not in self.by_chance:
                    self.meaned.update((v.name, counted) for v in op.results)
                    return Partial("avg")
            if counted is not None:
                for v in op.results:
                    self.summed[v.name] = counted
            return Partial("sum")
        if parts == {"sum"} and len(split) == 1 and split[0][0] in self.summed:
            for v in op.results:                 # -sum, a cast of a sum
                self.summed[v.name] = self.summed[split[0][0]]
        if parts == {"sum"} and op.name == "add" and len(split) == 2 and \
                (both := self.summed_apart(split[0][0], split[1][0])) is not None:
            self.summed.update((v.name, both) for v in op.results)   # two pieces' sums
        if parts == {"avg"} and len(split) == 1 and (
                split[0][0] in self.meaned or split[0][0] in self.mean_plus):
            meaned = split[0][0] in self.meaned
            counted = self.meaned.get(split[0][0]) or self.mean_plus[split[0][0]]
            other = [n for n in op.inputs if n != split[0][0]]
            scale = self.constant(other[0]) if op.name in ("mul", "div") and \
                len(other) == 1 else None
            total = scale is not None and op.name == "mul" and \
                counted.counts(scale, self.batch_rows)
            if total:
                # a mean times as many as it averaged (``mean * len(x)``) is their sum
                self.scaled[op.results[0].name] = True
                if op.results[0].name not in self.by_chance:
                    if not meaned:
                        self.report(op, "multiplies a mean over the batch plus a whole "
                                        "value by the batch's size: a sum over it plus that "
                                        "value times the share's size, which the devices' "
                                        "values neither average nor add up to",
                                    certain=True)
                        return Partial("avg")
                    self.summed.update((v.name, counted) for v in op.results)
                    return Partial("sum")
            elif scale is not None and op.name == "mul":
                self.scaled[op.results[0].name] = False
            if meaned and (scale is not None or op.name not in ("mul", "div")):
                # -mean, a cast, a copy, a mean times or over a number (``0.5 * mean``)
                self.meaned.update((v.name, counted) for v in op.results)
        if parts == {"avg"} and op.name in ("add", "sub") and len(split) == 2 and \
                len({self.meaned.get(n) for n, _, _ in split} - {None}) == 1 and \
                all(n in self.meaned for n, _, _ in split):
            # two means of the same count added (label smoothing's two terms)
            self.meaned.update((v.name, self.meaned[split[0][0]]) for v in op.results)
        if parts == {"avg", "sum"}:
            self.report(op, "adds a mean over the batch and a sum over it: the devices' "
                            "values neither average nor add up to the single-device one",
                        certain=True)
            return Partial("avg")
        return _mean_kept(out, states)

    def share_sized(self, op: Op) -> bool:
        """A product of a mean over the batch by as many as it averaged (``loss *
        len(x)``), where the mean is one that data parallelism averages over the devices
        before ``op`` reads it (a returned loss read after the optimizer step): the
        share's size, not the batch's, multiplies the batch's mean."""
        if op.name != "mul" or len(op.inputs) != 2:
            return False
        for k in (0, 1):
            mean, scale = op.inputs[k], self.constant(op.inputs[1 - k])
            count = self.meaned.get(mean)
            if self.state(mean) == Partial("avg") and count is not None and \
                    scale is not None and count.counts(scale, self.batch_rows):
                return True
        return False

    def summed_apart(self, a: str, b: str) -> _Count | None:
        """What two sums over the rows added together sum (``loss(x[:k]).sum() +
        loss(x[k:]).sum()``, the pieces of a share): their rows added, where they sum the
        same other dims of windows of the same rows; else None."""
        ca, cb = self.summed.get(a), self.summed.get(b)
        if ca is None or cb is None or ca.others != cb.others or ca.whole != cb.whole:
            return None
        return _Count(ca.rows + cb.rows, ca.others, ca.whole)

    def window_rows(self, name: str) -> int | None:
        """The rows of the value that ``name``'s rows are a window of (``x.chunk(2)``,
        ``x[:k]``, and the values of rows made from them), where there is one such value;
        else None."""
        got = {src for src, _ in self.tags.get(name, ())}
        if name in self.window_of:
            got.add(self.window_of[name][0])
        rows = {self.types[src].shape[0] for src in got}
        return rows.pop() if len(rows) == 1 else None

    def sums_rows(self, name: str) -> bool:
        """Whether ``name`` is a sum over the split rows made by the reduce that sums them
        (through casts), not a value already summed upstream."""
        op = self.producer.get(name)
        while name not in self.row_sums and op is not None and op.name == "convert":
            name = op.inputs[0]
            op = self.producer.get(name)
        return name in self.row_sums

    def constant(self, name: str) -> float | None:
        """The value of a constant filled in (``full``, converted), or None."""
        op = self.producer.get(name)
        while op is not None and op.name == "convert":
            op = self.producer.get(op.inputs[0])
        if op is None or op.name != "full":
            return None
        return float(op.attrs["value"])

    def picked_per_row(self, op: Op, rule: FrameworkOpRule, actual: Sequence[object],
                       ins: Sequence[TensorType], outs: Sequence[TensorType]) -> int | None:
        """A gather of each row's own entry (``logp[arange(n), labels]``): the operand's
        rows split, every index operand's rows split (or a constant), and the index picking
        the operand's rows holding each row's position (an entry of the index vector, or
        each element). The result's split dim, or None."""
        picks, out_dim = rule.row_picks(op, ins, outs)
        operand = actual[0]
        if not isinstance(operand, Shard) or operand.dim not in picks or out_dim is None:
            return None
        # the indices broadcast together: each split with the rows, or whole and broadcast
        # along them (an index of the columns, arange(S)[None, :])
        rank = max(t.rank for t in ins[1:])
        for a, t in zip(actual[1:], ins[1:]):
            row = t.rank - rank
            by_row = a == Shard(0) or isinstance(a, frozenset) and Shard(0) in a
            along = not _split(a) and (row < 0 or t.shape[row] == 1)
            if not (by_row or along):
                return None
        at, entry = picks[operand.dim]
        if ins[at].rank < (1 if entry is None else 2) or \
                ins[at].shape[0] != ins[0].shape[operand.dim]:
            return None
        return out_dim if self.positions(op.inputs[at], entry) else None

    def positions(self, name: str, entry: int | None) -> bool:
        """Whether each element of a value (``entry`` None), or entry ``entry`` of its last
        dim, is the position of its row along dim 0: an iota along dim 0 (built at the
        share's rows, as the share's own positions; a framework op counting so, its
        ``iota_dim``), normalized for negative indices
        (``select(i < 0, i + n, i)``), broadcast, reshaped or converted to one element
        per row, joined beside other entries (``concat`` on the last dim)."""
        op, t = self.producer.get(name), self.types[name]
        if op is None or t.rank == 0:
            return False
        if op.name == "iota":
            return int(op.attrs["dim"]) == 0
        if op.name == "literal" and t.rank == 1:        # x[range(n), y]
            data = op.attrs["data"]
            data = tuple(data) if isinstance(data, (tuple, list)) else (data,)
            return data in (tuple(range(t.shape[0])), tuple(range(-t.shape[0], 0)))
        if is_view(op) and len(op.inputs) == 1:
            # a view of one element per row as one element per row (arange(n)[:, None])
            src = self.types[op.inputs[0]]
            return src.rank >= 1 and src.numel == src.shape[0] == t.shape[0] == t.numel \
                and self.positions(op.inputs[0], None)
        rule = framework_rule(op) if op.name == "opaque" else None
        if rule is not None and rule.iota_dim is not None:     # torch.arange(n)
            return rule.iota_dim(op, [self.types[n] for n in op.inputs],
                                 [v.type for v in op.results]) == 0
        if op.name == "concat" and entry is not None and int(op.attrs["dim"]) == t.rank - 1:
            for x in op.inputs:
                if entry < self.types[x].shape[-1]:
                    return self.positions(x, entry)
                entry -= self.types[x].shape[-1]
            return False
        if op.name in ("broadcast_in_dim", "reshape", "convert"):
            src = self.types[op.inputs[0]]
            if op.name == "convert":
                return self.positions(op.inputs[0], entry)
            dims = tuple(op.attrs.get("dims", (0,)))
            return src.rank >= 1 and src.shape[0] == t.shape[0] and dims[0] == 0 and \
                src.numel == src.shape[0] and self.positions(op.inputs[0], None)
        if op.name == "select":
            pred, _, kept = op.inputs
            lt, zero = self.producer.get(pred), None
            if lt is not None and lt.name == "lt" and lt.inputs[0] == kept:
                zero = self.producer.get(lt.inputs[1])
            return zero is not None and zero.name == "full" and \
                float(zero.attrs["value"]) == 0 and self.positions(kept, entry)
        return False

    def place_summed(self, op: Op, actual: list[object], ins: Sequence[TensorType],
                     outs: Sequence[TensorType]) -> None:
        """An op reading a scalar of sums: a division by it is a mean over a count; more
        scalar math keeps it a scalar of sums; anything else combines examples."""
        inverse = self.over_inverse(op, actual)
        if self.reciprocal(op, actual, ins, outs):      # 1 / max(sum(mask), 1)
            self.set(op, [_Summed(actual[1].made_by, self.inverse_of(op, actual, ins, outs))])
        elif op.name == "div" and len(actual) == 2 and isinstance(actual[1], _Summed) \
                and not isinstance(actual[0], _Summed):
            self.counts.add(id(actual[1].made_by))   # backward reads it too: that is fine
            whole = self.whole_over_count(op, actual)
            self.report(op, _WHOLE_OVER_COUNT if whole else _COUNT, certain=whole)
            if not whole:
                self.note_count(op, *op.inputs, op.results[0].name)
            self.set(op, [Partial("avg")] * len(outs))
        elif inverse is not None:          # a sum over the rows times 1 / its count
            numerator, (made, count) = inverse
            self.counts.add(id(next(a for a in actual if isinstance(a, _Summed)).made_by))
            self.report(op, _COUNT, certain=False)
            self.note_count(op, numerator, count, made)
            self.set(op, [Partial("avg")] * len(outs))
        elif _scalar_math(actual, ins, outs):
            summed = [a for a in actual if isinstance(a, _Summed)]
            inv = self.inverse_of(op, actual, ins, outs) or (
                summed[0].inverse if len(summed) == 1 and op.name in ("mul", "convert")
                and self.constants_beside(op, actual) else None)
            self.set(op, [_Summed(summed[0].made_by, inv)] * len(outs))
        else:
            made = {id(a.made_by): a.made_by for a in actual if isinstance(a, _Summed)}
            for m in made.values():
                self.report(m, _NONLINEAR, certain=True)
            self.set(op, [_UNKNOWN] * len(outs))

    def reciprocal(self, op: Op, actual: Sequence[object], ins: Sequence[TensorType],
                   outs: Sequence[TensorType]) -> bool:
        """A constant divided by a count of the batch (``1 / sum(mask)``): the count's
        reciprocal, a mean when it multiplies a sum over the rows (``over_inverse``)."""
        return op.name == "div" and len(actual) == 2 and _scalar_math(actual, ins, outs) \
            and isinstance(actual[1], (Partial, _Summed)) and not _split(actual[0]) and \
            (not isinstance(actual[1], Partial) or actual[1].op in ("sum", "avg")) and \
            not self.reads_param(op.inputs[0])

    def inverse_of(self, op: Op, actual: Sequence[object], ins: Sequence[TensorType],
                   outs: Sequence[TensorType]) -> tuple[str, str] | None:
        """(the value, the count) where ``op`` takes the reciprocal of a count of the
        batch (``reciprocal(sum(mask))``, ``1 / sum(mask)``), else None."""
        if op.name == "reciprocal" and _scalar_math(actual, ins, outs):
            return op.results[0].name, op.inputs[0]
        if self.reciprocal(op, actual, ins, outs):
            return op.results[0].name, op.inputs[1]
        return None

    def constants_beside(self, op: Op, actual: Sequence[object]) -> bool:
        """Whether every operand of ``op`` but the scalar of sums it reads is a whole value
        no parameter reaches (a constant, a hyperparameter)."""
        return all(isinstance(a, _Summed) or (not _split(a) and not self.reads_param(n))
                   for n, a in zip(op.inputs, actual))

    def over_inverse(self, op: Op, actual: Sequence[object]
                     ) -> tuple[str, tuple[str, str]] | None:
        """(the numerator, the count's reciprocal and the count) where ``op`` multiplies a
        sum or mean over the rows by a count's reciprocal (``sum(l * m) * (1 /
        sum(m))``), else None."""
        if op.name != "mul" or len(actual) != 2:
            return None
        for k in (0, 1):
            num, inv = actual[k], actual[1 - k]
            if isinstance(num, Partial) and num.op in ("sum", "avg") and \
                    isinstance(inv, _Summed) and inv.inverse is not None:
                return op.inputs[k], inv.inverse
        return None

    def whole_over_count(self, op: Op, actual: Sequence[object]) -> bool:
        """A division of a whole value of the parameters (a weight decay term) by a count
        of the batch: each device divides by its share's count, about 1/N of the batch's,
        whatever the data. (A constant over a count, ``1 / sum(mask)`` to multiply by, is
        a mean's reciprocal.)"""
        return not _split(actual[0]) and self.reads_param(op.inputs[0])

    def note_count(self, op: Op, numerator: str, count: str, made: str) -> None:
        """Note the division ``op`` (``numerator / count``; or ``numerator`` times the
        count's reciprocal ``made``), just reported, as a ``CountedMean`` where its count
        can be summed over the shares: a float made from sums over the rows (by scalar
        math on them and on whole values) that reads no parameter, so that no gradient
        flows through it, and a numerator that is a sum or a mean over the rows."""
        how = self.state(numerator)
        if not isinstance(how, Partial) or how.op not in ("sum", "avg") or \
                not self.types[count].dtype.is_float or self.differentiates_param(count):
            return
        if self.from_windows(count):
            # a count over a window of the rows (gradient accumulation inside the step):
            # summed over the devices, it counts other rows than the batch's window
            return
        sums: dict[str, str] = {}
        math: set[str] = set()
        if self.count_parts(count, sums, math):
            self.counted.append(CountedMean(
                made, count, tuple(sums.items()),
                tuple(sorted(math, key=self.position.__getitem__)), how.op, self.found[-1],
                shifts=tuple(self.shifted[m] for m in math if m in self.shifted)))

    def count_parts(self, name: str, sums: dict[str, str], math: set[str]) -> bool:
        """Collect the sums over the rows a count is made from (``sums``) and the values
        its scalar math makes from them (``math``); False where it reads anything else of
        the batch (its rows, a value not followed)."""
        if name in sums or name in math:
            return True
        op = self.producer.get(name)
        if name in self.shifted and op is not None and not op.regions:
            math.add(name)              # a sum plus a constant: added again once summed
            return all(self.count_parts(x, sums, math) for x in op.inputs)
        state = self.state(name)
        if isinstance(state, Partial) and state.op in ("sum", "avg"):
            sums[name] = state.op
            return True
        if not _split(state) and state is not _UNKNOWN:
            return True                 # a whole value or a constant: read as it is
        if not isinstance(state, _Summed) or op is None or op.regions or \
                len(op.results) != 1:
            return False
        math.add(name)
        return all(self.count_parts(x, sums, math) for x in op.inputs)

    def from_windows(self, name: str) -> bool:
        """Whether ``name`` is made from a window of some value's rows (a slice of them:
        ``out[:h]``, gradient accumulation's pieces). Values of rows carry their windows
        (``tags``); what is made from them by sums and scalar math is walked back to them."""
        return self.walk_back(
            name, lambda n: n in self.window_of or n in self.tags,
            lambda n: isinstance(self.state(n), (Partial, _Summed)))  # sums, math on them

    def reads_param(self, name: str) -> bool:
        """Whether a parameter (or optimizer state) reaches ``name``."""
        return self.walk_back(
            name, lambda n: n not in self.producer and
            self.kinds.get(n) in (InputKind.param, InputKind.opt_state), lambda n: True)

    def differentiates_param(self, name: str) -> bool:
        """Whether a gradient can flow from ``name`` back to a parameter: a parameter
        reaches it through float values alone (a count of ``isnan(loss)``, as ``nanmean``
        counts, reads the parameters through a boolean: no gradient flows through it)."""
        return self.walk_back(
            name, lambda n: n not in self.producer and
            self.kinds.get(n) in (InputKind.param, InputKind.opt_state),
            lambda n: self.types[n].dtype.is_float)

    def walk_back(self, name: str, hit: Callable[[str], bool],
                  through: Callable[[str], bool]) -> bool:
        """Whether ``hit`` holds for ``name`` or a value it is made from, walking back
        through the producers of the values ``through`` admits (without recursion)."""
        todo, seen = [name], set()
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            if hit(n):
                return True
            op = self.producer.get(n)
            if op is not None and through(n):
                todo += free_inputs(op)
        return False

    def place_whole(self, op: Op, states: list[object], ins: Sequence[TensorType],
                    outs: Sequence[TensorType]) -> None:
        """An op reading no batch value: whole, or, where it reads constants, in any
        placement its strategies can build it in from theirs; a broadcast is uniform along
        the dims it adds, so it can also be built split along them."""
        if not _has_strategies(op) and (not op.inputs or any(
                isinstance(s, frozenset) for s in states)) or op.name == "iota" or \
                random_draw(op) is not None:
            # made at the share's shape from no batch value (torch.ones(B, S), a DropPath's
            # rand(B, 1, 1), positions arange(B) to pick each row's entry, a table indexed
            # by positions repeated per row): what the share builds for its rows is what
            # the batch builds for them (an iota weighting examples by their position would
            # differ: not found); a random draw of the share's shape is the share's draw
            self.set(op, [frozenset({REPLICATE, *(Shard(d) for d in range(t.rank))})
                          for t in outs])
            if random_draw(op) is not None or any(x in self.drawn for x in op.inputs):
                self.drawn.update(v.name for v in op.results)
            return
        have = [s if isinstance(s, frozenset) else frozenset({s}) for s in states]
        if all(h == {REPLICATE} for h in have) and op.name != "broadcast_in_dim" \
                and op.inputs:
            self.set(op, [REPLICATE] * len(outs))
            return
        allowed: list[set[Placement]] = [set() for _ in outs]
        for s in strategies_of(op, ins, outs):
            if all(p in h for p, h in zip(s.inputs, have)):
                for a, p in zip(allowed, s.outputs):
                    a.add(_norm(p))
        if op.name == "broadcast_in_dim":
            dims = tuple(op.attrs["dims"])
            allowed[0].update(Shard(e) for e in range(outs[0].rank)
                              if e not in dims or ins[0].shape[dims.index(e)] == 1)
        self.set(op, [REPLICATE if a == {REPLICATE} else frozenset(a) for a in allowed])
        if any(x in self.drawn for x in op.inputs):
            self.drawn.update(v.name for v in op.results)

    def commit_draws(self, op: Op, fit: Strategy) -> None:
        """Random numbers drawn at the share's shape that meet the batch's rows (a mask
        drawn in the step, ``rand(per.shape) < p``, times the per-token losses) are that
        share's draw of its rows, for every later use too: each share draws its own, so a
        sum of them is a count of the share's rows (``sum(l * m) / sum(m)``), not a
        whole value (a sum divided by a constant, as before 2026-12-07: the losses added
        up over the devices)."""
        for n, p in zip(op.inputs, fit.inputs):
            if n in self.drawn and isinstance(self.state(n), frozenset) and _split(p):
                self.at[n] = p
                self.commits[n] = p

    def set(self, op: Op, states: Sequence[object]) -> None:
        for v, s in zip(op.results, states):
            if isinstance(s, frozenset) and v.name in self.committed:
                s = self.committed[v.name]
            if isinstance(s, Replicate):
                self.at.pop(v.name, None)
            else:
                self.at[v.name] = s

    def report(self, op: Op, why: str, certain: bool, where: str | None = None) -> None:
        name = str(op.attrs.get("target", "")) if op.name == "opaque" else op.name
        self.found.append(Coupling(where or op.loc or self.near(op) or name, name, why,
                                   certain))

    def near(self, op: Op) -> str | None:
        """For an op the frontend gave no source line (inside a library's decomposed
        function: jnp.std's subtraction), the line of the closest forward op reading what
        it makes, in program order."""
        ops = [o for o in self.graph.ops if (o.phase or Phase.forward) is Phase.forward]
        names = {v.name for v in op.results}
        start = next((k for k, o in enumerate(ops) if o is op), len(ops))
        for o in ops[start + 1:]:
            if names & set(o.inputs):
                if o.loc:
                    return o.loc
                names |= {v.name for v in o.results}
        return None


def _has_strategies(op: Op, ins: Sequence[TensorType] | None = None,
                    outs: Sequence[TensorType] | None = None) -> bool:
    """Whether the op's menu says how it splits (not: runs whole only, for want of a rule
    or because it draws random numbers or runs control flow; nor, given the call's types,
    where its rule has no opinion on the call's form)."""
    if op.name == "opaque":
        rule = framework_rule(op)
        if rule is None or rule.strategies is None:
            return False
        return ins is None or rule.strategies(op, ins, outs) is not None
    return op_def(op.name).strategies not in (None, replicate_only, no_strategies)


def _unjudged(actual: Sequence[object], ins: Sequence[TensorType],
              outs: Sequence[TensorType]) -> list[object]:
    """What an op without strategies makes from split rows (a random draw of their shape,
    an indexing op picking a position per row): taken as rows again where its result keeps
    the batch's rows as its first dimension, not followed otherwise. Not judging the op
    itself, this can only move a finding later, never make one. (One that reads a sum or
    mean over the batch is reported before this: ``place``.)"""
    if any(_split(a) and a != Shard(0) for a in actual):
        return [_UNKNOWN] * len(outs)
    rows = {t.shape[0] for a, t in zip(actual, ins) if _split(a)}
    if len(rows) != 1:
        return [_UNKNOWN] * len(outs)
    (b,) = rows
    return [Shard(0) if t.rank and t.shape[0] == b else _UNKNOWN for t in outs]


@dataclass(frozen=True)
class _Count:
    """What a sum over the rows added up: ``rows`` rows and the dims of sizes ``others``;
    ``whole``: the rows of the value its rows are a window of (gradient accumulation's
    pieces, ``x.chunk(2)``), None for all of them."""

    rows: int
    others: tuple[int, ...]
    whole: int | None = None

    def counts(self, n: float, batch_rows: int | None = None) -> bool:
        """Whether ``n`` is the number of elements the sum added up (the rows and some of
        the other dims), or the share's ``batch_rows`` where the rows are a multiple of
        them (the rows merged with other dims: a sum over the tokens of
        ``logits.reshape(-1, V)`` divided by the sequences), or the rows the window was
        taken from (a piece's sum over the share's size: its part of the share's mean): a
        mean divides by it."""
        counts = {self.rows}
        if batch_rows and self.rows > batch_rows and self.rows % batch_rows == 0:
            counts.add(batch_rows)
        if self.whole:
            counts.add(self.whole)
        for d in self.others:
            counts |= {c * d for c in counts}
        return any(abs(n - c) <= 1e-6 * c for c in counts)


def _broadcast_at_one_row(actual: Sequence[object], ins: Sequence[TensorType]
                          ) -> list[object]:
    """``actual`` with each whole operand that has one element along a dim another operand
    of its rank holds split at one row also offered split there: it is broadcast over the
    rows (GPT-2's position embedding ``(1, S, E)`` added to a slice of one row, each half
    of a gradient accumulation at two rows a device, was taken for a value per row and
    the step for one that combines examples; a review's probe, 2026-12-07)."""
    ones = {(a.dim, t.rank) for a, t in zip(actual, ins) if isinstance(a, Shard)
            and a.groups == 1 and isinstance(a.dim, int) and a.dim < t.rank
            and t.shape[a.dim] == 1}
    if not ones:
        return list(actual)
    return [frozenset({a, *(Shard(d) for d, r in ones if r == t.rank and t.shape[d] == 1)})
            if isinstance(a, Replicate) and any(r == t.rank and t.shape[d] == 1
                                                for d, r in ones) else a
            for a, t in zip(actual, ins)]


def _first_fit(menu: Sequence[Strategy], actual: Sequence[object]) -> Strategy | None:
    """The first strategy taking every input as it is (a constant: in a placement it can
    be built in)."""
    for s in menu:
        if s.masked or len(s.inputs) != len(actual):
            continue
        if all(p in a if isinstance(a, frozenset) else _norm(p) == a
               for p, a in zip(s.inputs, actual)):
            return s
    return None


_SWAP = {"max": "min", "min": "max"}
_COUNT = "divides by a sum over the batch (a count of its examples or tokens)"
_WHOLE_OVER_COUNT = ("divides a value of the weights (a regularizer) by a sum over the batch: "
                     "each device divides by its share's count, about 1/N of the batch's")
_NONLINEAR = "reads a sum or mean over the batch in math that is not linear in it"


def _overlapping(windows: list[tuple[range, Op]]
                 ) -> tuple[tuple[range, Op], tuple[range, Op]]:
    """Two of ``windows`` sharing a row, in program order."""
    for i, (a, op_a) in enumerate(windows):
        for b, op_b in windows[i + 1:]:
            if set(a) & set(b):
                return (a, op_a), (b, op_b)
    raise AssertionError("no two windows overlap")


def _span(rows: range) -> str:
    step = f":{rows.step}" if rows.step != 1 else ""
    return f"[{rows.start}:{rows.stop}{step}]"


def _reshaped_rows(actual: Sequence[object], ins: Sequence[TensorType],
                   outs: Sequence[TensorType]) -> Shard | None:
    """Where a reshape puts a split the strategies do not carry: a dim merged inside
    another (``nn.MultiheadAttention(batch_first=True)`` views its (S, B, H, d) heads as
    (S B, E): the batch's rows become a split of S groups of the merged dim, each device
    holding its piece of every group) and back. A split of g groups of dim d is a split
    of the flat tensor's runs (as many as the elements before dim d, times g), each device
    holding the same piece of every run; it is a split of h groups of result dim j when
    the result has as many runs of as many elements there, and the elements after dim j
    divide those after dim d (so each device's piece of a run is whole rows of dim j)."""
    if len(actual) != 1 or not isinstance(actual[0], Shard) or \
            not isinstance(actual[0].dim, int):
        return None
    p, src, dst = actual[0], ins[0].shape, outs[0].shape
    d, g = p.dim, p.groups
    if src[d] % g:
        return None
    groups = math.prod(src[:d]) * g
    run = src[d] // g * math.prod(src[d + 1:])
    for j in range(len(dst)):
        before = math.prod(dst[:j])
        if groups % before or dst[j] % (groups // before):
            continue
        h = groups // before
        after = math.prod(dst[j + 1:])
        if dst[j] // h > 1 and dst[j] // h * after == run and \
                math.prod(src[d + 1:]) % after == 0:
            return Shard(j, h) if h > 1 else Shard(j)
    return None


def _takes_or_joins(op: Op, rule: FrameworkOpRule | None) -> bool:
    """A slice, split or concatenation: the ops whose results' rows are rows of their
    operands (``_rows_kept``); a sort or top-k over the rows makes fewer rows too."""
    return op.name in ("slice", "concat") or rule is not None and (
        rule.row_window is not None or rule.joins_rows)


def _rows_kept(actual: Sequence[object], ins: Sequence[TensorType],
               outs: Sequence[TensorType]) -> bool:
    """Some of the share's rows, or the rows of several pieces joined (slices or chunks of
    the batch for gradient accumulation, the pieces concatenated again): each row is still
    one example. Every split operand and result has the same rows' shape, and each result
    fewer rows than its one split operand, or one result as many as its split operands
    together."""
    split = [t for a, t in zip(actual, ins) if _split(a)]
    if not outs or any(_split(a) and a != Shard(0) for a in actual) or \
            any(t.rank == 0 or t.shape[1:] != outs[0].shape[1:] for t in split + list(outs)):
        return False
    if len(split) == 1:         # slices or chunks of the rows
        return all(t.shape[0] < split[0].shape[0] for t in outs)
    return len(outs) == 1 and outs[0].shape[0] == sum(t.shape[0] for t in split)


def _scalar_math(actual: Sequence[object], ins: Sequence[TensorType],
                 outs: Sequence[TensorType]) -> bool:
    """Math on scalars alone, reading sums over the batch and nothing split by rows."""
    return all(t.numel == 1 for t in list(ins) + list(outs)) and \
        not any(isinstance(a, Shard) for a in actual)


def _why(op: Op, actual: Sequence[object]) -> str:
    if any(isinstance(a, Partial) and a.op in _SWAP for a in actual):
        return "reads a maximum or minimum over the batch in math that is not combined so"
    if op.name == "div" and len(actual) == 2 and isinstance(actual[1], Partial):
        return _COUNT
    if any(isinstance(a, Partial) for a in actual):
        return _NONLINEAR
    return "combines different examples of the batch (a product or comparison across them)"
