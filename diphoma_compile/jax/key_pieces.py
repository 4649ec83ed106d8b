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
    """A ``random_bits`` draw not made yet: only its rows' piece will be."""

    key: Any
    bit_width: int
    shape: tuple[int, ...]


def deferred_draws(graph: Graph) -> set[str]:
    """The results of ``random_bits`` ops read only by ``take_piece`` ops of the same
    program (not returned, nor sent to another pipeline stage's program)."""
    readers: dict[str, set[str]] = {o.name: {"output"} for o in graph.outputs}
    for op in graph.ops:
        for n in op.inputs:
            readers.setdefault(n, set()).add(op.name)
    return {op.results[0].name for op in graph.ops
            if op.name == "opaque" and str(op.attrs.get("target")) == "jax:random_bits"
            and readers.get(op.results[0].name) == {"take_piece"}}


def defer(op: Op, key: Any) -> Deferred:
    return Deferred(key, int(op.attrs.get("bit_width", 32)),
                    tuple(int(d) for d in decode(op.attrs["shape"])))


def _partitionable(d: Deferred) -> bool:
    try:
        impl = str(jax.random.key_impl(d.key))
    except TypeError:          # a raw uint32[2] key: not a typed key array
        return False
    return "threefry" in impl and bool(jax.config.jax_threefry_partitionable) and \
        d.bit_width in (8, 16, 32) and math.prod(d.shape) < 2 ** 32


def piece(d: Deferred, axis: str, n: int, dim: int) -> Any:
    """This device's piece along ``dim`` of the draw ``d`` (device i of the axis: the i-th
    of n equal pieces)."""
    if not _partitionable(d):
        bits = jax.random.bits(d.key, d.shape, np.dtype(f"uint{d.bit_width}"))
        chunk = d.shape[dim] // n
        return lax.dynamic_slice_in_dim(bits, lax.axis_index(axis) * chunk, chunk, axis=dim)
    local = list(d.shape)
    local[dim] //= n
    strides = [math.prod(d.shape[k + 1:]) for k in range(len(d.shape))]
    u32 = np.dtype("uint32")
    count = lax.full(local, 0, u32)
    for k in range(len(d.shape)):
        coord = lax.broadcasted_iota(u32, local, k)
        if k == dim:
            coord = coord + lax.convert_element_type(lax.axis_index(axis) * local[k], u32)
        count = count + coord * np.uint32(strides[k])
    words = jax.random.key_data(d.key)
    hi, lo = threefry2x32_p.bind(words[0], words[1], lax.full(local, 0, u32), count)
    bits = hi ^ lo
    return bits if d.bit_width == 32 else \
        lax.convert_element_type(bits, np.dtype(f"uint{d.bit_width}"))
