"""A device's rows of bits drawn from one key at the global batch's shape, without
drawing the rest.

Data parallelism draws a dropout mask from the step's key at the global batch's shape and
keeps each device's rows (``random_bits`` then ``take_piece``: passes/data_parallel.py), so
the masks are the single-device step's. Drawn whole, every device would do the whole
batch's random-number work. JAX's partitionable threefry (``jax_threefry_partitionable``,
the default) makes element i of ``random_bits(key, shape)`` a function of the key and i
alone: the hash of the 64-bit counter i. So a device computes its piece from the global
counters of its own elements, bit for bit the slice of the whole draw, at 1/N of the work
(what XLA's SPMD partitioner does with the same op under ``jit`` with shardings). Where
that does not hold (another generator, the flag off, 2**32 elements or more, 64-bit
draws) the draw is made whole and sliced."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.extend.random import threefry2x32_p

from ..ir.core import Graph, Op
from .params import decode


@dataclass(frozen=True)
class Deferred:
    """A ``random_bits`` draw not made yet: only a window of its rows will be. ``dim``,
    ``start`` (a traced integer or 0) and ``size``: the rows [start, start + size) of
    ``dim`` (None: the whole draw); ``pieces``: the window viewed as that many pieces along
    ``dim`` (a reshape's split of it, which a microbatch's pick narrows to one)."""

    key: Any
    bit_width: int
    shape: tuple[int, ...]
    dim: int | None = None
    start: Any = 0
    size: int | None = None
    pieces: int = 1


def deferred_draws(graph: Graph) -> set[str]:
    """The values a lowering keeps as ``Deferred`` windows: the results of ``random_bits``
    ops, and of the ``take_piece`` (a device's rows) and ``reshape`` (a pipeline's
    microbatches as pieces: passes/pipeline_draws.py) of such values, where every reader
    in the same program narrows them: a ``take_piece`` (made there, or kept deferred when
    its own readers narrow it), a ``reshape`` splitting one dim into pieces whose readers
    are ``index_select``s picking one (made there). Not returned, nor sent to another
    pipeline stage's program."""
    readers: dict[str, list[Op]] = {}
    for op in graph.ops:
        for n in op.inputs:
            readers.setdefault(n, []).append(op)
    returned = {o.name for o in graph.outputs}

    def narrowed(name: str, made_by: Op, pieces: bool) -> bool:
        got = readers.get(name, [])
        if name in returned or not got:
            return False
        for r in got:
            if r.inputs[0] != name:
                return False
            if pieces:          # a draw's window viewed as pieces: each reader picks one
                if r.name != "index_select":
                    return False
            elif r.name == "reshape":
                if not _splits_one_dim(made_by, r) or \
                        not narrowed(r.results[0].name, r, True):
                    return False
            elif r.name != "take_piece":
                return False
        return True

    out: set[str] = set()
    for op in graph.ops:
        if op.name == "opaque" and str(op.attrs.get("target")) == "jax:random_bits" and \
                narrowed(op.results[0].name, op, False):
            todo = [op.results[0].name]
            while todo:
                n = todo.pop()
                out.add(n)
                for r in readers.get(n, []):
                    v = r.results[0].name
                    if r.name == "reshape" or r.name == "take_piece" and \
                            narrowed(v, r, False):
                        todo.append(v)
    return out


def _splits_one_dim(src: Op, op: Op) -> bool:
    """A reshape of ``src``'s result that splits one dim d into (k, rest)."""
    a, b = src.results[0].type.shape, op.results[0].type.shape
    if len(b) != len(a) + 1:
        return False
    d = next((k for k in range(len(a)) if a[k] != b[k]), len(a) - 1)
    return a[:d] == b[:d] and a[d + 1:] == b[d + 2:] and b[d] * b[d + 1] == a[d]


def defer(op: Op, key: Any) -> Deferred:
    return Deferred(key, int(op.attrs.get("bit_width", 32)),
                    tuple(int(d) for d in decode(op.attrs["shape"])))


def narrow(d: Deferred, dim: int, offset: Any, size: int) -> Deferred:
    """Rows [offset, offset + size) of ``d``'s window along ``dim`` (its window's own
    dim; a draw's first window may be along any dim)."""
    if d.dim is not None and dim != d.dim:
        raise ValueError(f"a window along dim {d.dim} narrowed along {dim}")
    start = offset if isinstance(d.start, int) and d.start == 0 else d.start + offset
    return Deferred(d.key, d.bit_width, d.shape, dim, start, size)


def as_pieces(d: Deferred, dim: int, k: int) -> Deferred:
    """The window viewed as ``k`` pieces along ``dim`` (a reshape splitting it)."""
    if d.dim is not None and dim != d.dim:
        raise ValueError(f"a window along dim {d.dim} viewed as pieces along {dim}")
    size = d.shape[dim] if d.size is None else d.size
    return Deferred(d.key, d.bit_width, d.shape, dim, d.start, size, k)


def pick(d: Deferred, index: Any) -> Any:
    """Piece ``index`` of a window viewed as pieces (``as_pieces``), made."""
    each = d.size // d.pieces
    start = lax.convert_element_type(index, np.int32) * np.int32(each)
    return bits(narrow(d, d.dim, start, each))


def _partitionable(d: Deferred) -> bool:
    try:
        impl = str(jax.random.key_impl(d.key))
    except TypeError:          # a raw uint32[2] key: not a typed key array
        return False
    return "threefry" in impl and bool(jax.config.jax_threefry_partitionable) and \
        d.bit_width in (8, 16, 32) and math.prod(d.shape) < 2 ** 32


def piece(d: Deferred, axis: str, n: int, dim: int) -> Any:
    """This device's piece along ``dim`` of the draw ``d`` (device i of the axis: the i-th
    of n equal pieces), made."""
    return bits(device_piece(d, axis, n, dim))


def device_piece(d: Deferred, axis: str, n: int, dim: int) -> Deferred:
    """This device's piece of ``d``'s window along ``dim``, not made yet."""
    size = (d.shape[dim] if d.size is None else d.size) // n
    return narrow(d, dim, lax.axis_index(axis) * size, size)


def bits(d: Deferred) -> Any:
    """The bits of ``d``'s window: from the global counters of its elements alone where
    the generator allows (else the whole draw, sliced)."""
    dtype = np.dtype(f"uint{d.bit_width}")
    if d.dim is None:
        return jax.random.bits(d.key, d.shape, dtype)
    if not _partitionable(d):
        whole = jax.random.bits(d.key, d.shape, dtype)
        return lax.dynamic_slice_in_dim(whole, d.start, d.size, axis=d.dim)
    local = list(d.shape)
    local[d.dim] = d.size
    strides = [math.prod(d.shape[k + 1:]) for k in range(len(d.shape))]
    u32 = np.dtype("uint32")
    count = lax.full(local, 0, u32)
    for k in range(len(d.shape)):
        coord = lax.broadcasted_iota(u32, local, k)
        if k == d.dim:
            coord = coord + lax.convert_element_type(d.start, u32)
        count = count + coord * np.uint32(strides[k])
    words = jax.random.key_data(d.key)
    hi, lo = threefry2x32_p.bind(words[0], words[1], lax.full(local, 0, u32), count)
    out = hi ^ lo
    return out if d.bit_width == 32 else lax.convert_element_type(out, dtype)
