"""Which leaves of a batch cannot be split with it: data parallelism gives each device, and
a pipeline each microbatch, a contiguous share of every batch leaf's rows (dim 0).

That is right for a leaf of one row per example, and for one of k rows per example kept
in example order (a batch's captions, k to an image; targets flattened to batch x length):
its rows are a whole multiple of the batch's, and its share is its examples' rows. A leaf of
other rows is not the batch's (a per-class table beside the examples): split with it, each
share would compute with a slice of it, and broadcasting may hide the shapes. The batch's
rows are the most common among the leaves; when two counts are as common, they are not
known, and the leaves are named instead of guessed at."""

from __future__ import annotations

from collections.abc import Sequence

from .errors import MeshError


def check_batch_rows(leaves: Sequence[tuple[str, int]], among: str, hint: str,
                     noun: str = "batch leaf") -> None:
    """MeshError unless every (name, rows) of ``leaves`` has a whole multiple of the batch's
    rows; ``among``: what the batch is split among, ``hint``: where such a leaf goes
    (``{name}`` is its name), ``noun``: what a leaf is called."""
    by_rows: dict[int, list[str]] = {}
    for name, rows in leaves:
        by_rows.setdefault(rows, []).append(name)
    if len(by_rows) < 2:
        return
    most = max(len(names) for names in by_rows.values())
    common = [r for r, names in by_rows.items() if len(names) == most]
    listed = "; ".join(f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''}: {r}"
                       for r, names in sorted(by_rows.items()))
    if len(common) > 1:
        raise MeshError(f"the batch's leaves have different numbers of rows ({listed}), as "
                        f"many of each, so the batch's rows are not known; it is split along "
                        f"its first dimension among {among}",
                        hint=f"give every leaf one row per example, or k rows per example "
                             f"for some k (shaped (batch, k, ...) or flattened in example "
                             f"order); {hint.format(name='a leaf that is not the batch')}")
    (rows,) = common
    # (a batch of no rows has no multiples: every other count is odd)
    odd = [(r, n) for r, names in by_rows.items() if r != rows and (rows == 0 or r % rows)
           for n in names]
    if odd:
        r, name = odd[0]
        raise MeshError(f"{noun} {name} has {r} rows, where the batch has {rows} ({listed})"
                        f": the batch is split along its first dimension among {among}, and a "
                        "leaf that is not a whole number of rows per example (a per-class "
                        "table) would be split with it",
                        hint=hint.format(name=name))
