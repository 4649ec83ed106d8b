"""Random numbers a pipeline's microbatches draw from the step's key: each microbatch its
own rows of the whole batch's draw.

The step is traced at one microbatch, so a dropout mask drawn from the step's key at the
microbatch's shape would be one mask repeated on each of the M microbatches, where the
single-device step draws one mask for the whole batch. As data parallelism does for its
shares (``passes/data_parallel.py``: the draw made at the global batch's shape, each
device's rows kept by ``take_piece``), each draw from one key that meets the batch's rows
(a mask at the shape of the activations it drops; one key per example split from one key,
equinox's vmapped dropout) is made at M times the rows, and microbatch m keeps rows
[m b, (m + 1) b): under data parallelism those of its data-parallel share's piece, which
are the rows the runtimes give microbatch m of share d (rows [d L + m b, d L + (m + 1) b)
of the global batch, L = M b). The kept rows are picked by ``index_select`` of a reshape
(M pieces of b rows) with the microbatch's index, a new input of the graph (role
``microbatch``) that the pipeline runtime passes to each program reading it.

Draws inside control flow (a ``lax.scan`` over layers with dropout inside) are not
rewritten; the pipeline pass refuses them at M > 1 as before."""

from __future__ import annotations

from collections.abc import Mapping

from ..ir.core import Attrs, Graph, Input, InputKind, InputRole, Op, Value
from ..ir.framework_ops import framework_rule
from ..ir.types import DType, TensorType
from .data_parallel import key_draws_per_row

MICROBATCH = "microbatch"       # the name of the microbatch-index input


def microbatch_draws(graph: Graph, microbatches: int, rows: Mapping[str, int]
                     ) -> tuple[Graph, set[str], tuple[str, ...]]:
    """The graph with each key draw meeting the batch's rows made for all ``microbatches``
    and each microbatch's rows kept, the names of the values now holding a microbatch's
    rows (what the draws made before), and the draws' source lines (or names); the graph
    unchanged and nothing else when there is none. ``rows``: the values split by the
    batch's rows and the dim holding them (``split_batch``'s)."""
    found = key_draws_per_row(graph, rows)
    if not found or microbatches == 1:
        return graph, set(), ()
    ops: list[Op] = []
    kept: set[str] = set()
    taken = {last: (dim, draw) for draw, (dim, last) in found.items()}
    retyped: dict[str, TensorType] = {}
    mb = Value(MICROBATCH, TensorType((), DType.i32))
    for op in graph.ops:
        if id(op) in found:
            dim, last = found[id(op)]
            rule = framework_rule(op)
            (res,) = op.results
            t = _times(res.type, dim, microbatches)
            name = res.name if last != res.name else f"{res.name}.mbs"
            ops.append(op.replace(attrs=Attrs({**op.attrs, rule.shape_attr: list(t.shape)}),
                                  results=(Value(name, t),)))
            retyped[res.name] = t
            if last == res.name:
                ops += _pick(name, t, res, dim, microbatches, mb.name, op)
                kept.add(res.name)
            continue
        if op.name == "take_piece" and op.inputs[0] in retyped and \
                op.results[0].name in taken:
            (res,) = op.results
            dim = taken[res.name][0]
            t = _times(res.type, dim, microbatches)
            name = f"{res.name}.mbs"
            ops.append(op.replace(results=(Value(name, t),)))
            ops += _pick(name, t, res, dim, microbatches, mb.name, op)
            kept.add(res.name)
            continue
        ops.append(op)
    inputs = graph.inputs + (Input(mb, InputRole(InputKind.microbatch)),)
    drawn = tuple(sorted({op.loc or op.results[0].name for op in graph.ops
                          if id(op) in found}))
    return graph.replace(inputs=inputs, ops=tuple(ops)), kept, drawn


def _times(t: TensorType, dim: int, k: int) -> TensorType:
    return t.with_shape(tuple(n * k if d == dim else n for d, n in enumerate(t.shape)))


def _pick(name: str, t: TensorType, res: Value, dim: int, m: int, index: str,
          at: Op) -> list[Op]:
    """Microbatch ``index``'s rows of ``name`` (``t``: M times ``res``'s rows along
    ``dim``) as ``res``: reshaped to M pieces, the piece selected."""
    shape = res.type.shape
    pieces = Value(f"{res.name}.pieces", t.with_shape(shape[:dim] + (m,) + shape[dim:]))
    return [Op("reshape", (name,), (pieces,), phase=at.phase, loc=at.loc),
            Op("index_select", (pieces.name, index), (res,), Attrs(axis=dim),
               phase=at.phase, loc=at.loc)]
