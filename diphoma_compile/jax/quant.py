"""The quant ops of the IR in JAX, per device inside shard_map: symmetric group
quantization with nearest or stochastic rounding, packing bits-bit integers into bytes, the
blockwise Hadamard transform, the counter-based keyed draws of stochastic rounding, and
``as_shard``. Each computes what the PyTorch lowering (torch/quant.py) computes, with the
same hash of the key and each element's index in the whole tensor, so a device's piece
draws exactly its part of the one-device draw and the two backends round alike (keys are
uint32 scalars here, 32 bits in an int64 there)."""

from __future__ import annotations

import functools
import math
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..errors import BackendError
from ..ir.core import Op
from ..ir.opdef import level_size
from ..ir.types import DType, FlatShard, Shard, TensorType, Varying
from .dtypes import numpy_dtype

_U32 = jnp.uint32


def _mix(x: Any) -> Any:
    """lowbias32 on uint32 (torch/quant.py's ``_mix``)."""
    x = x ^ (x >> 16)
    x = x * _U32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * _U32(0x846CA68B)
    return x ^ (x >> 16)


def _mix32(x: Any) -> Any:
    """murmur3's 32-bit finalizer on uint32 (torch/quant.py's ``_mix32``)."""
    x = x ^ (x >> 16)
    x = x * _U32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * _U32(0xC2B2AE35)
    return x ^ (x >> 16)


def next_key(key: Any) -> Any:
    """The key after ``key`` (a uint32 scalar)."""
    return _mix(key.astype(_U32) + _U32(0x9E3779B9))


def uniform(key: Any, n: int, offset: Any = 0) -> Any:
    """n uniform float32 numbers in [0, 1): elements ``offset .. offset + n`` of the stream
    of ``key``; ``offset`` may be traced (a device's place along a mesh axis)."""
    seed = _mix(key.astype(_U32))
    idx = jnp.arange(n, dtype=_U32) + jnp.asarray(offset).astype(_U32)
    bits = _mix32(idx * _U32(0x9E3779B1) + seed)
    return ((bits >> 8) & _U32(0xFFFFFF)).astype(jnp.float32) * np.float32(1.0 / (1 << 24))


def qmax(bits: int) -> int:
    """The largest magnitude of a symmetric bits-bit code (7 for 4 bits, 127 for 8)."""
    return (1 << (bits - 1)) - 1


@functools.lru_cache(maxsize=8)
def sylvester(block: int) -> np.ndarray:
    """The orthonormal Sylvester Hadamard matrix of order ``block`` (its own inverse)."""
    h = np.ones((1, 1))
    while h.shape[0] < block:
        h = np.block([[h, h], [h, -h]])
    return (h / math.sqrt(block)).astype(np.float32)


def hadamard(x: Any, block: int) -> Any:
    """The orthonormal Hadamard transform of each contiguous ``block`` of flattened x."""
    if x.size % block:
        raise BackendError(f"hadamard: {x.size} values are not whole blocks of {block}")
    h = jnp.asarray(sylvester(block), x.dtype)
    rows = jnp.reshape(x, (-1, block))
    return jnp.reshape(jnp.dot(rows, h, precision=lax.Precision.HIGHEST), x.shape)


def _layout(flat: Any, p: int, group: int, padded: bool) -> Any:
    """flat as groups: zero-padded to p chunks of k, each chunk to whole groups (when
    ``padded``), then the whole to whole groups."""
    k = -(-flat.shape[0] // p)
    kq = -(-k // group) * group if padded else k
    rows = jnp.reshape(jnp.pad(flat, (0, p * k - flat.shape[0])), (p, k))
    rows = jnp.pad(rows, ((0, 0), (0, kq - k)))
    whole = jnp.reshape(rows, (-1,))
    tail = (-whole.shape[0]) % group
    return jnp.reshape(jnp.pad(whole, (0, tail)), (-1, group)), p * kq


def quantize(x: Any, bits: int, group: int, noise: Any | None, pieces: int | None,
             hadamard_block: int | None = None) -> tuple[Any, Any]:
    """(q int8, scales) of x per group: scale = absmax / qmax, q = round(x / scale), or
    floor(x / scale + u) with ``noise`` u; ``pieces`` the flat layout of N chunks each
    padded to whole groups (a device's own piece is pieces=1)."""
    flat = jnp.reshape(x, (-1,)).astype(jnp.float32)
    p = 1 if pieces is None else pieces
    g, used = _layout(flat, p, group, pieces is not None)
    if hadamard_block:
        g = hadamard(g, hadamard_block)    # blocks divide the group: rows stay rows
    scale = jnp.max(jnp.abs(g), axis=1) / np.float32(qmax(bits))
    safe = jnp.where(scale > 0, scale, jnp.ones_like(scale))
    y = g / safe[:, None]
    if noise is None:
        q = jnp.round(y)
    else:
        u, _ = _layout(jnp.reshape(noise, (-1,)), p, group, pieces is not None)
        q = jnp.floor(y + u)
    q = jnp.clip(q, -qmax(bits), qmax(bits)).astype(jnp.int8)
    q = jnp.reshape(q, (-1,))[:used]
    if pieces is None:
        q = jnp.reshape(q, x.shape)
    return q, scale.astype(x.dtype)


def dequantize(q: Any, scales: Any, group: int, dtype: Any, shape: tuple[int, ...],
               pieces: int | None) -> Any:
    """q * scale per group in ``dtype``; with ``pieces`` each chunk's padding and the
    whole's are dropped and the result has ``shape``."""
    flat = jnp.reshape(q, (-1,)).astype(jnp.float32)
    n = flat.shape[0]
    tail = (-n) % group
    g = jnp.reshape(jnp.pad(flat, (0, tail)), (-1, group)) * \
        scales.astype(jnp.float32)[:, None]
    out = jnp.reshape(g, (-1,))[:n]
    if pieces is not None:
        numel = math.prod(shape)
        k = -(-numel // pieces)
        out = jnp.reshape(jnp.reshape(out, (pieces, -1))[:, :k], (-1,))[:numel]
    return jnp.reshape(out, shape).astype(dtype)


def pack(q: Any, bits: int) -> Any:
    """Signed bits-bit integers into uint8, each stored as q + 2^(bits-1): 4 bits two per
    byte (low nibble first), 8 bits one per byte."""
    flat = jnp.reshape(q, (-1,)).astype(jnp.int16) + (1 << (bits - 1))
    if bits == 8:
        return flat.astype(jnp.uint8)
    if bits != 4:
        raise BackendError(f"pack of {bits}-bit values has no JAX lowering (4 and 8 do)")
    if flat.shape[0] % 2:
        flat = jnp.pad(flat, (0, 1))
    pairs = jnp.reshape(flat, (-1, 2))
    return (pairs[:, 0] | (pairs[:, 1] << 4)).astype(jnp.uint8)


def unpack(packed: Any, bits: int, shape: tuple[int, ...], dtype: Any) -> Any:
    """The inverse of ``pack``: ``shape`` signed integers."""
    b = jnp.reshape(packed, (-1,)).astype(jnp.int16)
    if bits == 8:
        vals = b
    elif bits == 4:
        vals = jnp.reshape(jnp.stack([b & 0xF, b >> 4], axis=1), (-1,))
    else:
        raise BackendError(f"unpack of {bits}-bit values has no JAX lowering (4 and 8 do)")
    n = math.prod(shape)
    return jnp.reshape(vals[:n] - (1 << (bits - 1)), shape).astype(dtype)


# ---------------------------------------------------------------- per-device lowering

def _offset(t: TensorType, n: int) -> Any:
    """Where this device's piece (``n`` values) of a value of type ``t`` starts in the
    flattened whole, if it is a flat, dim-0 or varying piece (0 for a whole value): its
    first element's index in a keyed draw. A varying value draws as if the devices'
    values were laid end to end, so no two devices round with the same numbers."""
    for axis, p in t.placements:
        if isinstance(p, (FlatShard, Varying)) or (isinstance(p, Shard) and p.dim == 0):
            return lax.axis_index(axis).astype(_U32) * _U32(n)
    return 0


def _quantize(op: Op, ins: list) -> list:
    a = op.attrs
    if a.get("scheme", "symmetric") != "symmetric":
        raise BackendError("the JAX backend quantizes symmetrically only",
                           hint="use scheme=symmetric")
    # q is placed as the device's piece of x: dim-0 from a flat or dim-0 piece (which is
    # one of the pieces and quantizes alone), varying from a varying x (all N pieces)
    q_t = op.results[0].type
    pieces = a.get("pieces")
    if pieces is not None and any(isinstance(p, Shard) for _, p in q_t.placements):
        pieces = 1
    noise = None
    if len(ins) > 1:
        n = int(ins[0].size)
        noise = uniform(ins[1], n, _offset(q_t, n))
    return list(quantize(ins[0], int(a["bits"]), int(a["group_size"]), noise, pieces,
                         a.get("hadamard")))


def _as_shard(low: Any, op: Op, ins: list) -> list:
    """This device's value as its piece: its first elements in the piece's shape, with
    the padding past the whole's end set to zero (a flat piece promises zero padding)."""
    t = op.result.type
    shape = low.local(t).shape
    n = math.prod(shape)
    piece = jnp.reshape(ins[0], (-1,))[:n]
    if isinstance(t.placement(str(op.attrs["axis"])), FlatShard):
        start = jnp.asarray(_offset(t, n)).astype(jnp.int32)
        keep = jnp.arange(n, dtype=jnp.int32) + start < t.numel
        piece = jnp.where(keep, piece, jnp.zeros_like(piece))
    return [jnp.reshape(piece, shape)]


def level_all_to_all(rows: Any, axis: str, n: int, local: int, level: str) -> Any:
    """The all_to_all among the devices of one level of mesh axis ``axis`` (n devices as
    n/local nodes of ``local`` consecutive ones): among a node's devices (``local``) or
    among the devices with the same place in their node (``node``). ``rows`` is (M, w)
    with M the level's size: row j goes to the level's j-th device; the result's row i
    came from its i-th. M - 1 rounds of ``lax.ppermute`` (each device sends one row a
    round), so each device sends (M - 1) / M of its payload, as the plan counts."""
    nodes = n // local
    m = local if level == "local" else nodes

    def device(node: int, place: int) -> int:
        return node * local + place

    def member(pos: int, other: int) -> int:      # the pos-th device of a level group
        return device(other, pos) if level == "local" else device(pos, other)
    idx = lax.axis_index(axis)
    me = idx % local if level == "local" else idx // local
    got = [lax.dynamic_index_in_dim(rows, me, 0, keepdims=False)]      # round 0: my own
    groups = nodes if level == "local" else local
    for s in range(1, m):
        send = lax.dynamic_index_in_dim(rows, (me + s) % m, 0, keepdims=False)
        perm = [(member(q, g), member((q + s) % m, g)) for g in range(groups)
                for q in range(m)]
        got.append(lax.ppermute(send, axis, perm))     # from the device (me - s) % m
    by_shift = jnp.stack(got)
    return jnp.take(by_shift, (me - jnp.arange(m)) % m, axis=0)


def _dtype(name: Any) -> Any:
    return numpy_dtype(DType.parse(str(name)))


def emit(low: Any, op: Op, ins: list) -> list:
    """The results of quant op ``op`` on this device (``low``: the per-device lowering,
    which knows the local shapes)."""
    a = op.attrs
    if op.name == "quantize":
        return _quantize(op, ins)
    if op.name == "dequantize":
        return [dequantize(ins[0], ins[1], int(a["group_size"]), _dtype(a["dtype"]),
                           low.local(op.result.type).shape, a.get("pieces"))]
    if op.name == "pack":
        return [pack(ins[0], int(a["bits"]))]
    if op.name == "unpack":
        return [unpack(ins[0], int(a["bits"]), low.local(op.result.type).shape,
                       _dtype(a["dtype"]))]
    if op.name == "hadamard":
        return [hadamard(ins[0], int(a.get("block", 32)))]
    if op.name == "rng_next":
        return [next_key(ins[0])]
    if op.name == "as_shard":
        return _as_shard(low, op, ins)
    raise BackendError(f"the JAX backend has no lowering for quant op {op.name!r}",
                       hint="keyed rng_uniform and asymmetric quantization run on the "
                            "PyTorch backend only")


QUANT_OPS = frozenset({"quantize", "dequantize", "pack", "unpack", "hadamard", "rng_next",
                       "rng_uniform", "as_shard"})

__all__ = ["QUANT_OPS", "dequantize", "emit", "hadamard", "level_all_to_all", "level_size",
           "next_key", "pack", "quantize", "uniform", "unpack"]
