"""What framework packages tell the IR about their own ops that stay ``opaque``: flops,
bytes and sharding strategies, registered by target (``aten.addmm.default``,
``jax:gather``). The IR never names a framework op; it looks the rule up here."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .core import Op
from .types import TensorType

CostFn = Callable[[Op, Sequence[TensorType], Sequence[TensorType]], int]


@dataclass(frozen=True)
class FrameworkOpRule:
    """One framework op's rule: its flops, its bytes (default: every operand and result
    read or written once) and its strategies (``strategies.StrategyFn``; default: run whole
    on every device; a function returning None for a call has no opinion on that call's
    form: it runs whole, and the batch analysis does not judge it). ``regroup``: its
    splits stay exact when the split dimension is permuted alike in every operand
    (``strategies.regrouped``); False where the op ties contiguous runs of a dimension
    together (grouped convolution, group norm).
    ``batch_stats``: it normalizes with statistics over the batch's rows (a batch norm in
    training mode), so a microbatch's result is not a slice of the batch's. ``row_mean``:
    where its strategies take no split rows, it is a mean over the rows that it counts by
    their values (cross-entropy's ignored targets and class weights); the words say so
    (``batch_coupling.py``: a share's mean is exact when every share counts alike).
    ``row_picks``: for a gather, the operand dims it picks one index at a time, each with
    the input position of the index operand that picks it and the entry of its index vector
    (None: each of its elements is an index), and the result's dim holding the indices'
    first dim; where that index is each row's own position (``logp[arange(n), labels]``),
    the operand's rows split with the indices' is a pick per example (``batch_coupling``).
    ``row_window``: for a slice or split, the rows of its first operand's dim 0 that each
    result holds (a ``range``), or None where it cuts another dim; ``batch_coupling`` finds
    rows taken by their position that no other window of the same value takes.
    ``row_weighted``: for a ``row_mean`` op, whether this call weights its rows by values
    (class weights): the shares' means then differ from the batch's for almost any data,
    reported as such, not as a count. ``shape_attr``: for an op that makes random numbers
    (or keys) from one key at a shape it names, the attribute holding that shape: data
    parallelism may draw at the global batch's shape and keep each device's rows
    (``passes/data_parallel.py``). ``joins_rows``: a concatenation (or a slice at run-time
    offsets) whose results' rows are its operands' rows: with the slices (``row_window``)
    the only framework ops whose pieces of the batch's rows stay rows (``batch_coupling``);
    any other op with strategies, none taking the rows split, combines examples (a sort
    or top-k along the batch). ``iota_dim``: for an op that makes positions (``arange``),
    the dim along which its result counts each element's own position (0, 1, ..., or -n,
    ..., -1, which index the same rows), else None. ``row_sum``: for a ``row_mean`` op, the
    same call summing its rows instead of dividing by its count (cross-entropy with
    reduction ``sum``), with the positions among its results of that sum and of the count
    (which its backward reads again), or None where this call has no such form (the count
    dropped): data parallelism then divides the sum by the count summed over the devices
    (``passes/global_counts.py``). ``row_count``: for such an op, the IR ops that make its
    count from its other operands alone (the targets, the class weights), not the values
    it averages, with the name of the count they make, given a maker of fresh names; None
    where this call has no such form: a pipeline counts every microbatch's targets with
    them before the schedule (``global_counts.py``). ``copies``: its one result is its
    first operand's value, unchanged (a clone): ``row_probe.py`` reads through such copies
    where one trace of a step makes them and another does not. ``seeds_gradient``: made in
    the backward at a scalar of the forward, it is the seed of a backward pass (ones at its
    operand's shape: torch's ``loss.backward()``), and its operand the value
    differentiated, which may not be the loss the step returns (``batch_coupling``: the
    gradients combine across devices as it does)."""

    target: str
    flops: CostFn
    strategies: Callable | None = None
    bytes: CostFn | None = None
    regroup: bool = True
    batch_stats: bool = False
    row_mean: str = ""
    row_picks: Callable[[Op, Sequence[TensorType], Sequence[TensorType]],
                        tuple[dict[int, tuple[int, int | None]], int | None]] | None = None
    row_window: Callable[[Op, Sequence[TensorType], Sequence[TensorType]],
                         list[range] | None] | None = None
    shape_attr: str = ""
    row_weighted: Callable[[Op, Sequence[TensorType], Sequence[TensorType]], bool] | None = None
    joins_rows: bool = False
    iota_dim: Callable[[Op, Sequence[TensorType], Sequence[TensorType]], int | None] | None = None
    row_sum: Callable[[Op, Sequence[TensorType], Sequence[TensorType]],
                      tuple[Op, int, int] | None] | None = None
    row_count: Callable[[Op, Sequence[TensorType], Sequence[TensorType], Callable],
                        tuple[list[Op], str] | None] | None = None
    copies: bool = False
    seeds_gradient: bool = False


FRAMEWORK_OPS: dict[str, FrameworkOpRule] = {}


def register_framework_op(rule: FrameworkOpRule) -> FrameworkOpRule:
    """Add the rule of a framework op, keyed by its ``target``; one rule per target."""
    if rule.target in FRAMEWORK_OPS:
        raise ValueError(f"framework op {rule.target!r} already has a rule")
    FRAMEWORK_OPS[rule.target] = rule
    return rule


def framework_rule(op: Op) -> FrameworkOpRule | None:
    """The registered rule of an opaque op, or None (its cost is then unknown)."""
    return FRAMEWORK_OPS.get(str(op.attrs.get("target", "")))
