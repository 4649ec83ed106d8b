"""Means over counts made exact under data parallelism: each device divides by the count
summed over all devices.

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

``ir/batch_coupling.py`` finds these (``CountedMean``): counts that no parameter reaches
(no gradient flows through them), made from sums over the rows by scalar math (a clamp to
at least 1), which is run again on the summed values."""

from __future__ import annotations

from collections.abc import Sequence

from ..ir.batch_coupling import CountedMean
from ..ir.core import Attrs, Graph, Op, Phase, Value
from ..ir.types import REPLICATE, VARYING, TensorType


def count_globally(graph: Graph, counted: Sequence[CountedMean], axis: str, n: int
                   ) -> Graph:
    """``graph`` (placed by data-parallel on ``axis`` of ``n`` devices) with each of
    ``counted`` dividing by its count summed over the devices."""
    done: dict[tuple[str, str], tuple[str, str]] = {}
    for c in counted:
        graph = _one(graph, c, axis, n, done)
    return graph


def _one(graph: Graph, c: CountedMean, axis: str, n: int,
         done: dict[tuple[str, str], tuple[str, str]]) -> Graph:
    """One mean over a count; ``done``: the summed counts made so far (a count two means
    divide by is summed once)."""
    names = graph.fresh_names()
    types = graph.value_types()
    made_by = {v.name: op for op in graph.ops for v in op.results}
    after = c.made if c.summing is not None else c.count
    added: list[Op] = []

    def emit(name: str, inputs: tuple[str, ...], like: TensorType, attrs: Attrs,
             hint: str) -> str:
        out = names(hint)
        added.append(Op(name, inputs, (Value(out, like.with_placement(axis, REPLICATE)),),
                        attrs, phase=Phase.forward, loc=made_by[after].loc))
        return out

    key = (c.count, c.numerator)
    if key not in done:
        done[key] = _summed_count(c, axis, n, types, made_by, names, emit, added)
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
            op = op.replace(inputs=(op.inputs[0], count))
        if op.phase is Phase.backward and c.count in op.inputs:
            op = op.replace(inputs=tuple(varying if x == c.count else x for x in op.inputs))
        ops.append(op)
        if after in {v.name for v in op.results}:
            ops += added
    outputs = graph.outputs
    if mean is not None:
        outputs = tuple(type(o)(mean if o.name == c.made else o.name, o.role) for o in outputs)
    return graph.replace(ops=tuple(ops), outputs=outputs)


def _summed_count(c: CountedMean, axis: str, n: int, types: dict[str, TensorType],
                  made_by: dict[str, Op], names, emit, added: list[Op]) -> tuple[str, str]:
    """The ops making ``c``'s count summed over the devices (divided by ``n`` where the
    numerator is a sum), appended to ``added``: the count as one whole value, and as each
    device's own (the backward's reads were of a per-device value: what they make stays
    per device)."""
    renamed: dict[str, str] = {}
    for s, how in c.sums:
        renamed[s] = emit("all_reduce", (s,), types[s], Attrs(axis=axis, op=how),
                          f"{s}.{how}")
    for m in c.math:            # the count's scalar math again, on the summed values
        op = made_by[m]
        (res,) = op.results
        out = names(f"{m}.all")
        added.append(op.replace(inputs=tuple(renamed.get(x, x) for x in op.inputs),
                                results=(Value(out, res.type.with_placement(axis,
                                                                            REPLICATE)),),
                                phase=Phase.forward))
        renamed[m] = out
    t = types[c.count]
    count = renamed[c.count]
    if c.numerator == "sum":
        size = emit("full", (), t.with_shape(()), Attrs(value=float(n)), "devices")
        count = emit("div", (count, size), t, Attrs(), f"{c.count}.per_device")
    varying = names(f"{count}.v")
    added.append(Op("as_varying", (count,), (Value(varying, t.with_placement(axis, VARYING)),),
                    Attrs(axis=axis), phase=Phase.forward, loc=added[-1].loc))
    return count, varying
