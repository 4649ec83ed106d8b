"""Flat pieces over a mesh: how the JAX backend stores a value that weight-update sharding
split flat (``F`` or ``Fx``: the tensor flattened, zero-padded to a multiple of the axis
size N, cut into N equal pieces), because none of its dimensions divides N.

Between steps such a value is a global 1-D array of ``ceil(numel / N) * N`` elements,
sharded ``NamedSharding(mesh, P(axis))``: each device holds its piece, 1/N of the tensor
plus under one element per device of padding, whatever the tensor's shape. The step
returns it in that stored form (``Fx`` padding may hold anything) and takes either it or
the user's own array, which it pads and lays out first. ``to_user`` gives the user's
shape back (a slice and a reshape), for checkpoints and comparisons."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from ..errors import BackendError
from ..ir.types import FlatShard, Replicate, TensorType


def flat_axis(t: TensorType) -> str | None:
    """The mesh axis ``t`` is split flat over, or None."""
    axes = [a for a, p in t.placements if isinstance(p, FlatShard)]
    return axes[0] if axes else None


def stored_shape(t: TensorType, sizes: dict[str, int]) -> tuple[int, ...]:
    """The global shape of a flat-split value: its padded length, as one dimension."""
    axis = flat_axis(t)
    n = sizes[axis]
    return (-(-t.numel // n) * n,)


def flat_spec(t: TensorType, what: str) -> PartitionSpec:
    """The PartitionSpec of a flat-split graph input or output: its 1-D stored form split
    over the axis. A value split on another axis too has none."""
    axis = flat_axis(t)
    others = [f"{a}: {p}" for a, p in t.placements
              if a != axis and not isinstance(p, Replicate)]
    if others:
        raise BackendError(f"{what} is split flat over {axis!r} and also placed "
                           f"{', '.join(others)}: a flat piece of a piece has no global array",
                           hint="weight-update sharding splits such values along a "
                                "dimension, or keeps them whole")
    return PartitionSpec(axis)


@functools.cache
def _padder(shape: tuple[int, ...], length: int, sharding: NamedSharding) -> Any:
    def pad(x: Any) -> Any:
        flat = lax.reshape(x, (math.prod(shape),))
        if length > flat.shape[0]:
            flat = lax.pad(flat, np.array(0, flat.dtype), [(0, length - flat.shape[0], 0)])
        return flat
    return jax.jit(pad, out_shardings=sharding)


@functools.cache
def _unpadder(shape: tuple[int, ...]) -> Any:
    def unpad(x: Any) -> Any:
        return lax.reshape(lax.slice_in_dim(x, 0, math.prod(shape)), shape)
    return jax.jit(unpad)


def returned_whole(body: Any, outputs: Sequence[tuple[TensorType, bool]],
                   shardings: Sequence[NamedSharding], mesh: Any) -> tuple[Any, tuple]:
    """``body`` (the shard_map) with every flat-split output that replaces no input (a
    gradient the step returns) given its user's shape, whole on every device, as the
    step's other returned values are; and the out_shardings that go with it. ``outputs``:
    each output's type and whether it is new state (kept in its stored form)."""
    unpad = [k for k, (t, state) in enumerate(outputs) if flat_axis(t) is not None
             and not state]
    if not unpad:
        return body, tuple(shardings)
    shapes = {k: outputs[k][0].shape for k in unpad}

    def run(*leaves: Any) -> tuple:
        outs = list(body(*leaves))
        for k in unpad:
            outs[k] = lax.reshape(lax.slice_in_dim(outs[k], 0, math.prod(shapes[k])),
                                  shapes[k])
        return tuple(outs)
    whole = NamedSharding(mesh, PartitionSpec())
    return run, tuple(whole if k in shapes else s for k, s in enumerate(shardings))


class FlatLayout:
    """The flat-split inputs of one parallel step: the user's shape and the stored one."""

    def __init__(self, types: Sequence[TensorType], sizes: dict[str, int],
                 shardings: Sequence[NamedSharding]) -> None:
        self.user: dict[int, tuple[int, ...]] = {}
        self.stored: dict[int, tuple[int, ...]] = {}
        self.shardings: dict[int, NamedSharding] = {}
        for k, (t, s) in enumerate(zip(types, shardings)):
            if flat_axis(t) is not None:
                self.user[k], self.stored[k] = t.shape, stored_shape(t, sizes)
                self.shardings[k] = s
        self.offsets: list[int] | None = None     # first input of each argument
        self.treedefs: list[Any] = []

    def to_stored(self, k: int, leaf: Any) -> Any:
        """Input ``k`` as the step stores it: a leaf in the user's shape padded, flattened
        and laid out over the mesh; any other leaf as it is (the shape check follows)."""
        if k in self.user and tuple(np.shape(leaf)) == self.user[k] and \
                self.user[k] != self.stored[k]:
            return _padder(self.user[k], self.stored[k][0], self.shardings[k])(leaf)
        return leaf

    def note_arguments(self, treedefs: Sequence[Any]) -> None:
        """Where each argument's leaves start among the inputs (for ``to_user``)."""
        self.treedefs = list(treedefs)
        self.offsets = list(np.cumsum([0] + [td.num_leaves for td in treedefs])[:-1])

    def to_user(self, tree: Any, argnum: int | None = None) -> Any:
        """``tree`` (an argument or result of the step: parameters, optimizer state) with
        every leaf in its stored flat form given back the user's shape. ``argnum`` says
        which step argument it is laid out as; by default the one of the same structure."""
        if self.offsets is None:
            raise BackendError("the step has not run yet, so which inputs a tree's leaves "
                               "are is not known", hint="call the step once first")
        leaves, td = jax.tree.flatten(tree)
        if argnum is None:
            found = [k for k, t in enumerate(self.treedefs) if t == td]
            if len(found) != 1:
                raise BackendError(f"{len(found)} step arguments have this tree's structure",
                                   hint="pass argnum= (0: parameters, 1: optimizer state)")
            argnum = found[0]
        if not 0 <= argnum < len(self.treedefs) or self.treedefs[argnum] != td:
            raise BackendError(f"the tree does not have the structure of step argument "
                               f"{argnum}", hint="pass a tree the step takes or returns")
        start = self.offsets[argnum]
        out = []
        for j, x in enumerate(leaves):
            k = start + j
            if k in self.user and tuple(np.shape(x)) == self.stored[k] and \
                    self.user[k] != self.stored[k]:
                x = _unpadder(self.user[k])(x)
            out.append(x)
        return jax.tree.unflatten(td, out)


__all__ = ["FlatLayout", "flat_axis", "flat_spec", "returned_whole", "stored_shape"]
