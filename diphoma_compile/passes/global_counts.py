"""Means over counts made exact under data parallelism and pipelines: each device (and
each microbatch) divides by the count summed over all devices (and microbatches).

A masked mean (``sum(l * mask) / sum(mask)``) or cross-entropy's mean over the targets it
does not ignore divides a sum over the batch by a count over it. Each device's share of
the batch divides its own sum by its own count, and averaging those means, as DDP does,
gives the batch's mean only when every share counts alike. The count is a scalar of the
batch alone (a mask's sum), so each device can sum it over the devices first, a scalar
all-reduce in the forward pass, and divide by that: with the devices' losses and gradients
averaged, the numerator of each is scaled by N, the axis size, so the average of the
devices' ``N S_i / C`` is the batch's ``sum_i S_i / C`` and so are its gradients. The
division's backward reads the same count (``S / C``'s gradient divides by C), so it reads
the summed one too. Cross-entropy (a framework op whose rule gives ``row_sum``) is run
summing its rows, then divided by the summed count; its backward reads that count.

Under a pipeline the batch is split over time as well: each of M microbatches divides
its sum by its own count and the runtime averages them. There each sum the count is made
of becomes ``microbatch_sum`` of it (the runtime runs what it is made of on every
microbatch before the schedule and adds them up), then all-reduced over the data axis
when there is one, and the numerator of a sum is scaled by M N alike.

``ir/batch_coupling.py`` finds these (``CountedMean``): counts that no parameter reaches
(no gradient flows through them), made from sums over the rows by scalar math (a clamp to
at least 1, a constant added), which is run again on the summed values, and not from
windows of the rows. Here a count is summed only where every use of it on the way to the
loss is such a mean of one kind and the backward reads it only as itself (``_exact``);
the others stay each device's own, as DDP, and the plan lists them."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from ..ir.analysis import free_inputs
from ..ir.batch_coupling import CountedMean
from ..ir.core import Attrs, Graph, InputKind, Op, OutputKind, Phase, Value
from ..ir.framework_ops import framework_rule
from ..ir.opdef import op_def, random_draw
from ..ir.types import REPLICATE, VARYING, TensorType


def count_globally(graph: Graph, counted: Sequence[CountedMean], axis: str | None, n: int,
                   rows: Collection[str] = (), microbatches: int = 1
                   ) -> tuple[Graph, tuple[CountedMean, ...]]:
    """``graph`` (placed by data-parallel on ``axis`` of ``n`` devices) with each of
    ``counted`` that can be (``_exact``) dividing by its count summed over the devices;
    and those. ``rows``: the values split by the batch's rows (``BatchSplit.rows``).
    ``microbatches``: M > 1 under a pipeline, whose counts are summed over the microbatches
    too (``axis`` None where the batch is not split over devices: ``n`` is then 1)."""
    made_by = {v.name: op for op in graph.ops for v in op.results}
    to_loss = _to_loss(graph, made_by)
    share = _per_share(graph, axis)
    alone = _of_the_batch(graph)
    learned = _of_the_parameters(graph)
    # only the forward's: a mean computed after the update (a validation loss in the
    # step) stays each device's own (its count summed in the forward phase did not verify)
    made = [c for c in counted if c.made in made_by and
            (made_by[c.made].phase or Phase.forward) is Phase.forward
            and _exact(graph, c, counted, share, made_by, to_loss, rows)
            and (microbatches == 1 or _adds_up(graph, c, made_by, alone, learned))]
    done: dict[tuple[str, str], tuple[str, str]] = {}
    for c in made:
        graph = _one(graph, c, axis, n, done, microbatches, alone)
    return graph, tuple(made)


def _of_the_batch(graph: Graph) -> set[str]:
    """The values made from the batch, hyperparameters, constants and buffers alone:
    what a pipeline runtime can compute again for every microbatch before the schedule.
    Draws from a key the step holds are (the same key and microbatch index draw the same
    numbers: ``pipeline_draws.py``); not draws from a process's own generator (a mask
    drawn in the step, as BERT's: drawn again, it would count other tokens than the ones
    the loss sums), nor buffers the step updates (only the stage that updates one holds
    its new value), nor what they make."""
    replaced = {o.role.target for o in graph.outputs if o.role.kind is OutputKind.replaces}
    alone = {i.name for i in graph.inputs if i.role.kind in (
        InputKind.batch, InputKind.hyper, InputKind.other, InputKind.rng,
        InputKind.microbatch) or i.role.kind is InputKind.buffer and i.name not in replaced}
    for op in graph.ops:
        if (op.phase or Phase.forward) is Phase.forward and not op.regions and \
                random_draw(op) in (None, "key") and not op_def(op.name).effectful and \
                all(x in alone for x in free_inputs(op)):
            alone.update(v.name for v in op.results)
    return alone


def _reached(graph: Graph, kinds: Collection[InputKind]) -> set[str]:
    """The graph's inputs of ``kinds`` and every value an op makes from one of them."""
    out = {i.name for i in graph.inputs if i.role.kind in kinds}
    for op in graph.ops:
        if any(x in out for x in free_inputs(op)):
            out.update(v.name for v in op.results)
    return out


def _of_the_parameters(graph: Graph) -> set[str]:
    """The values a parameter reaches (the logits a loss averages)."""
    return _reached(graph, (InputKind.param,))


def _per_share(graph: Graph, axis: str | None):
    """Whether a value is each share's own: varying over ``axis``, or without one, made
    from the batch or the microbatch's index (a key's draw made for every microbatch);
    not what the step computes alike for every microbatch."""
    if axis is not None:
        types = graph.value_types()
        return lambda x: types[x].placement(axis) != REPLICATE
    varies = _reached(graph, (InputKind.batch, InputKind.microbatch))
    return lambda x: x in varies


def _adds_up(graph: Graph, c: CountedMean, made_by: dict[str, Op], alone: set[str],
             learned: set[str]) -> bool:
    """Whether a pipeline runtime can add ``c``'s sums up over the microbatches before
    the schedule: each made from the batch alone (``alone``), or the count a framework
    op returns beside its mean (cross-entropy's targets not ignored: ``_count_alone``);
    and each a number it may average where the shares' values average (an integer's
    mean would be rounded)."""
    types = graph.value_types()
    return all((s in alone or _framework_count(c, s, made_by, alone, learned)) and
               (how == "sum" or types[s].dtype.is_float) for s, how in c.sums)


def _framework_count(c: CountedMean, s: str, made_by: dict[str, Op], alone: set[str],
                     learned: set[str]) -> bool:
    """Whether ``s`` is the count of the framework op that makes ``c``'s mean (its rule's
    ``row_sum``): a count of its targets, which the values it averages (its first
    operand, the logits, made from the parameters: ``learned``) do not change; its other
    operands made from the batch alone (``alone``: not targets drawn at random in the
    step) or parameters as they are (class weights held as a frozen parameter)."""
    op = made_by.get(s)
    if not (c.summing is not None and s == c.count and op is made_by.get(c.made)):
        return False
    first, *rest = op.inputs
    return (first in alone or first in learned) and \
        all(x in alone or x not in made_by and x in learned for x in rest)


def _copies(graph: Graph, name: str) -> set[str]:
    """``name`` and the backward's copies of it: results of backward ops that are the op
    making it again (torch's division backward converts an integer count to a float
    anew: ``convert(%sum)`` twice)."""
    made = next((op for op in graph.ops if name in {v.name for v in op.results}), None)
    out = {name}
    if made is None or len(made.results) != 1:
        return out
    for op in graph.ops:
        if op.phase is Phase.backward and op.name == made.name and \
                op.inputs == made.inputs and op.attrs == made.attrs and len(op.results) == 1:
            out.add(op.results[0].name)
    return out


def _to_loss(graph: Graph, made_by: dict[str, Op]) -> set[str]:
    """The values the forward computes the loss from (every output's without one)."""
    to_loss: set[str] = set()
    todo = [o.name for o in graph.outputs if o.role.kind is OutputKind.loss] or \
        [o.name for o in graph.outputs]
    while todo:
        x = todo.pop()
        if x not in to_loss:
            to_loss.add(x)
            if x in made_by and (made_by[x].phase or Phase.forward) is Phase.forward:
                todo += free_inputs(made_by[x])
    return to_loss


def _exact(graph: Graph, c: CountedMean, counted: Sequence[CountedMean], share,
           made_by: dict[str, Op], to_loss: set[str], rows: Collection[str]) -> bool:
    """Whether the count can be replaced by the summed one everywhere the gradient reads
    it: every forward op reading the per-device scalars it is made from on the way to the
    loss is a mean over it of the same kind, or makes such a mean's count (``counted``;
    another kind scales by other devices' sums, a regulariser divided by it would get the
    gradient of another loss than the one returned); and no backward op reads those
    scalars other than as the count itself (their own copies: summing those too is not
    done). ``share``: ``_per_share``; ``made_by``: each value's op; ``to_loss``:
    ``_to_loss``; ``rows``: values split by rows, never part of the count."""
    if not all(share(x) for x, _ in c.sums):
        # a sum the devices make alike in the graph's types (a mask drawn from each
        # process's own generator, typed whole): nothing to sum over the devices by type
        return False
    copies = _copies(graph, c.count)
    # the means of the same kind over this count or a copy of it (each division by an
    # integer count converts it anew): their counts are summed alike
    same = {x for m in counted if m.numerator == c.numerator for x in (m.made, m.count)}

    # the per-device scalars the count is made of (its sums, their casts, its math); not
    # the rows it sums (at one row per device a target or a mask of one element is a
    # scalar too, and read elsewhere: by the numerator)
    chain, todo = set(), [c.count]
    while todo:
        x = todo.pop()
        op = made_by.get(x)
        if x in chain or x in rows or op is None or \
                (op.phase or Phase.forward) is not Phase.forward:
            continue
        if graph_type(op, x).numel != 1 or not share(x):
            continue
        chain.add(x)
        todo += list(op.inputs)
    for op in graph.ops:
        read, made = set(op.inputs), {v.name for v in op.results}
        if op.phase is Phase.backward:
            if made & copies:
                continue
            if read & (chain - copies):
                return False
        elif read & chain and not made & (chain | same) and made & to_loss:
            # another use of the count on the way to the loss (its backward reads copies
            # of the same scalars, which cannot be told apart from this mean's)
            return False
    return True


def graph_type(op: Op, name: str) -> TensorType:
    """The type of ``name``, a result of ``op``."""
    return next(v.type for v in op.results if v.name == name)


def _one(graph: Graph, c: CountedMean, axis: str | None, n: int,
         done: dict[tuple[str, str], tuple[str, str]], microbatches: int,
         alone: set[str]) -> Graph:
    """One mean over a count; ``done``: the summed counts made so far (a count two means
    divide by is summed once)."""
    names = graph.fresh_names()
    types = graph.value_types()
    copies = _copies(graph, c.count)
    made_by = {v.name: op for op in graph.ops for v in op.results}
    after = c.made if c.summing is not None else c.count
    added: list[Op] = []

    def emit(name: str, inputs: tuple[str, ...], like: TensorType, attrs: Attrs,
             hint: str, whole: bool = True) -> str:
        """An op making a value of ``like``'s type, one whole value over the axis with
        ``whole``."""
        out = names(hint)
        if whole and axis is not None:
            like = like.with_placement(axis, REPLICATE)
        added.append(Op(name, inputs, (Value(out, like),), attrs, phase=Phase.forward,
                        loc=made_by[after].loc))
        return out

    key = (c.count, c.numerator)
    if key not in done:
        done[key] = _summed_count(c, axis, n, microbatches, types, made_by, names, emit,
                                  added, alone)
    count, varying = done[key]
    mean = None
    if c.summing is not None:
        mean = emit("div", (c.made, count), types[c.made], Attrs(), f"{c.made}.mean")
        # (a varying sum divided by a whole count stays varying)
        added[-1] = added[-1].replace(results=(Value(mean, types[c.made]),))
    ops: list[Op] = []
    for op in graph.ops:
        if c.summing is not None and op is made_by[after]:
            op = c.summing.replace(inputs=op.inputs, results=op.results, phase=op.phase,
                                   loc=op.loc)
        elif mean is not None and c.made in op.inputs:
            op = op.replace(inputs=tuple(mean if x == c.made else x for x in op.inputs))
        elif mean is None and c.made in {v.name for v in op.results}:
            # the division by the count (or the count's reciprocal) reads the summed one,
            # as each device's own value where nothing else it reads is (its result stays
            # per device, as typed)
            own = axis is not None and any(types[x].placement(axis) == VARYING
                                           for x in op.inputs if x != c.count)
            op = op.replace(inputs=tuple((count if own else varying) if x == c.count else x
                                         for x in op.inputs))
        if op.phase is Phase.backward and copies & set(op.inputs):
            op = op.replace(inputs=tuple(varying if x in copies else x for x in op.inputs))
        ops.append(op)
        if after in {v.name for v in op.results}:
            ops += added
    outputs = graph.outputs
    if mean is not None:
        outputs = tuple(type(o)(mean if o.name == c.made else o.name, o.role) for o in outputs)
    return graph.replace(ops=tuple(ops), outputs=outputs)


def _summed_count(c: CountedMean, axis: str | None, n: int, microbatches: int,
                  types: dict[str, TensorType], made_by: dict[str, Op], names, emit,
                  added: list[Op], alone: set[str]) -> tuple[str, str]:
    """The ops making ``c``'s count summed over the devices and the microbatches (divided
    by ``n`` M where the numerator is a sum), appended to ``added``: the count as one
    whole value, and as each device's own (the backward's reads were of a per-device
    value: what they make stays per device)."""
    renamed: dict[str, str] = {}
    for s, how in c.sums:
        x = s
        if microbatches > 1:
            if s not in alone:
                x = _count_alone(s, made_by, alone, types, names, emit, added)
            x = emit("microbatch_sum", (x,), types[s], Attrs(op=how), f"{s}.mb", whole=False)
        if axis is not None:
            x = emit("all_reduce", (x,), types[s], Attrs(axis=axis, op=how), f"{s}.{how}")
        renamed[s] = x
    for m in c.math:            # the count's scalar math again, on the summed values
        op = made_by[m]
        (res,) = op.results
        out = names(f"{m}.all")
        like = res.type if axis is None else res.type.with_placement(axis, REPLICATE)
        added.append(op.replace(inputs=tuple(renamed.get(x, x) for x in op.inputs),
                                results=(Value(out, like),), phase=Phase.forward))
        renamed[m] = out
    t = types[c.count]
    count = renamed[c.count]
    if c.numerator == "sum":
        shares = n * microbatches
        size = emit("full", (), t.with_shape(()), Attrs(value=float(shares)),
                    "devices" if microbatches == 1 else "shares")
        count = emit("div", (count, size), t, Attrs(),
                     f"{c.count}.per_device" if microbatches == 1 else f"{c.count}.per_share")
    if axis is None:
        return count, count
    varying = names(f"{count}.v")
    added.append(Op("as_varying", (count,), (Value(varying, t.with_placement(axis, VARYING)),),
                    Attrs(axis=axis), phase=Phase.forward, loc=added[-1].loc))
    return count, varying


def _count_alone(s: str, made_by: dict[str, Op], alone: set[str],
                 types: dict[str, TensorType], names, emit, added: list[Op]) -> str:
    """A copy of the framework op making the count ``s`` (cross-entropy's targets not
    ignored) that reads zeros for the values it averages (its first operand, the logits:
    ``_framework_count``), so that a pipeline runtime can count every microbatch's
    targets before any forward runs; its count does not depend on those values. The
    copy's count."""
    op = made_by[s]
    rule = framework_rule(op)
    if rule is not None and rule.row_count is not None:
        got = rule.row_count(op, [types[x] for x in op.inputs], [v.type for v in op.results],
                             names)
        if got is not None:         # counted from the targets alone (no zeros to make)
            made, count = got
            added.extend(o.replace(phase=Phase.forward) for o in made)
            return count
    first, *rest = op.inputs
    if first not in alone:
        first = emit("full", (), types[first], Attrs(value=0), f"{first}.zeros", whole=False)
    ins = (first, *rest)
    results = tuple(Value(names(f"{v.name}.count"), v.type) for v in op.results)
    added.append(op.replace(inputs=ins, results=results, phase=Phase.forward))
    return results[[v.name for v in op.results].index(s)].name
