"""Which values of a step traced at one row per share are which of the same step traced at
more (the probe the batch analysis reads: ``batch_coupling.split_batch``); also of a step
traced at several rows whose analysis divides a sum over them by a constant equal to
their number, a mean or a sum scaled by a number that only equals them at these rows.

A share of one example cannot show which dims hold the batch's rows: a dim of size 1
merges into any other. So the frontends trace the step again at ``probe_rows`` rows per
share, and what the analysis finds there (a mean over a count, the rows' dim of a value)
is carried back to the program that runs. That row count is a prime no constant of the
step is a multiple of (7 unless one is): the analysis takes a division by a constant
equal to the rows it sums (times other dims it sums) for a mean, and at two rows a loss
halved by hand (``sum(...) / 2``) would be one. The two traces are the same code but
need not be the same ops: at one row torch skips copies that a size-1 dim makes needless
(a ``clone`` before a ``view`` in Hugging Face's attention), and JAX picks one label per
row with an index of another rank. ``probe_names`` aligns the two op sequences (difflib,
on each op's kind, target, source line and result ranks) and accepts a pair only where
its operands are values already matched, looking through copies one side has and the
other does not. What is not matched is not carried back: the analysis says less, never
something of another value."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass

from .core import Graph, Op
from .framework_ops import framework_rule
from .types import TensorType


@dataclass(frozen=True)
class RowProbe:
    """A step traced at more rows per share (``graph``) and which value of the step
    as traced (at one row, or at a ``probe_rows``-th of the probe's) each of its values is
    (``names``, from ``probe_names``: both traces as the frontend made them, before any
    pass)."""

    graph: Graph
    names: Mapping[str, str]

    @staticmethod
    def of(traced: Graph, probe: Graph, rows: int) -> RowProbe:
        """The probe ``probe``, at ``rows`` times the rows per share, of the step
        ``traced``."""
        return RowProbe(probe, probe_names(traced, probe, rows))


# rows per share to probe with: primes, the first that no constant of the step is a
# multiple of (nor its reciprocal)
_PRIMES = (7, 11, 13, 17, 19, 23, 29, 31, 37)


def probe_rows(graph: Graph) -> int:
    """The rows per share to trace ``graph``'s step at, for the batch analysis: the first
    of ``_PRIMES`` that no constant the step fills in (nor its reciprocal) is a multiple
    of, so that no division by a constant is taken for a mean over the probe's rows by
    coincidence."""
    values = {abs(float(op.attrs["value"])) for op in graph.walk()
              if op.name == "full" and isinstance(op.attrs.get("value"), (int, float))}
    values = {v for v in values if 0 < v < float("inf")}
    scales = values | {1 / v for v in values}

    def multiple(s: float, p: int) -> bool:
        # a whole number (within rounding) that p divides, up to float32's whole numbers
        # (beyond them a constant is a mask's fill, -1e9, not a count)
        n = round(s)
        return p <= n <= 2 ** 24 and abs(s - n) <= 1e-6 * s and n % p == 0

    def clear(p: int) -> bool:
        return not any(multiple(s, p) for s in scales)
    return next((p for p in _PRIMES if clear(p)), _PRIMES[-1])


def probe_names(graph: Graph, probe: Graph, rows: int) -> dict[str, str]:
    """Value name in ``probe`` (at ``rows`` times ``graph``'s rows per share, one or
    more) -> the value of ``graph`` it is (inputs by name; op results where the ops
    align, their shapes fit (``_fits``) and they read matched values); the values left
    out have no match.

    Ops are aligned on their kind, target, source line and result ranks; in the stretches
    left between, on all but the ranks (JAX picks one label per row with a gather whose
    index drops a dim of size 1 at one row). A pair whose results do not fit, made by ops
    reading matched values (``links``: the same computation at another shape), lets the
    ops after it be matched, but its own results are not named: what is carried back
    must be the same value at the same layout. An op reading nothing must fit (the
    rows' ``arange(1)`` is not the heads' ``arange(12)``)."""
    have = {i.name: i.value.type for i in graph.inputs}
    names = {i.name: i.name for i in probe.inputs
             if i.name in have and _fits(i.value.type, have[i.name], rows)}
    links = dict(names)
    ours, theirs = list(probe.ops), list(graph.ops)
    pairs: dict[int, Op] = {}
    match = difflib.SequenceMatcher(None, [_key(op) for op in ours],
                                    [_key(op) for op in theirs], autojunk=False)
    for tag, i1, i2, j1, j2 in match.get_opcodes():
        if tag == "equal":
            pairs.update((id(ours[i1 + k]), theirs[j1 + k]) for k in range(i2 - i1))
        elif tag == "replace":
            gap = difflib.SequenceMatcher(None, [_key(op)[:-1] for op in ours[i1:i2]],
                                          [_key(op)[:-1] for op in theirs[j1:j2]],
                                          autojunk=False)
            for i, j, size in gap.get_matching_blocks():
                pairs.update((id(ours[i1 + i + k]), theirs[j1 + j + k]) for k in range(size))
    paired = {id(op) for op in pairs.values()}
    types, probe_types = graph.value_types(), probe.value_types()
    # graph values a copy of theirs makes that the probe has no op for: read through
    through = {op.results[0].name: op.inputs[0] for op in theirs
               if id(op) not in paired and _copy(op, types)}

    def root(name: str) -> str:
        while name in through:
            name = through[name]
        return name
    for op in ours:
        other = pairs.get(id(op))
        if other is None:
            if _copy(op, probe_types) and op.inputs[0] in links:
                links[op.results[0].name] = links[op.inputs[0]]
                if op.inputs[0] in names:
                    names[op.results[0].name] = names[op.inputs[0]]
            continue
        if not all(n in links and root(links[n]) == root(m)
                   for n, m in zip(op.inputs, other.inputs)):
            continue
        fit = all(_fits(v.type, w.type, rows) for v, w in zip(op.results, other.results))
        if fit or op.inputs:
            links.update((v.name, w.name) for v, w in zip(op.results, other.results))
        if fit:
            names.update((v.name, w.name) for v, w in zip(op.results, other.results))
    return names


def _key(op: Op) -> tuple:
    """What two traces of one op share: its kind, framework target, source line, operand
    count and result ranks and dtypes (not names, not shapes)."""
    return (op.name, op.attrs.get("target"), op.loc, len(op.inputs), len(op.regions),
            tuple((v.type.rank, v.type.dtype) for v in op.results))


def _fits(more: TensorType, one: TensorType, rows: int) -> bool:
    """Whether a value of shape ``more`` at ``rows`` times the rows per share can be one
    of shape ``one``: each dim the same, or ``rows`` times it (the rows, or a dim they
    merge into). (An ``arange(1)`` of the rows is not an ``arange(12)`` of the heads.)"""
    return more.rank == one.rank and all(a in (b, rows * b)
                                         for a, b in zip(more.shape, one.shape))


def _copy(op: Op, types: dict[str, TensorType]) -> bool:
    """True for an op whose one result is its one operand's value in its layout (a clone,
    a reshape to the same shape; not a transpose of a square matrix)."""
    if len(op.inputs) != 1 or len(op.results) != 1 or op.regions:
        return False
    rule = framework_rule(op)
    if not (op.name == "reshape" or (rule is not None and rule.copies)):
        return False
    return op.inputs[0] in types and types[op.inputs[0]].shape == op.results[0].type.shape
