"""Quantization kernels of the IR's quant ops in plain torch ops: symmetric group
quantization with nearest or stochastic rounding, packing bits-bit integers into bytes, the
blockwise Hadamard transform, and the counter-based random numbers that drive stochastic
rounding (a hash of the key and each element's index in the whole tensor, so a device's
piece of a flat shard draws exactly its part of the one-device draw)."""

from __future__ import annotations

import functools
import math

import torch

_M32 = 0xFFFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32), in int64 so that every product stays exact in its
    low 32 bits."""
    x = x & _M32
    x = (x ^ (x >> 16)) * 0x7FEB352D & _M32
    x = (x ^ (x >> 15)) * 0x846CA68B & _M32
    return x ^ (x >> 16)


def next_key(key: torch.Tensor) -> torch.Tensor:
    """The key after ``key`` (a 0-d int64 tensor holding 32 bits)."""
    return _mix(key.to(torch.int64) + 0x9E3779B9)


def _i32(v: int) -> int:
    """A 32-bit constant as the signed int32 torch stores."""
    return v - (1 << 32) if v >= 1 << 31 else v


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer on int32 (products wrap; shifts made logical by masks)."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _i32(0x85EBCA6B)
    x = x ^ ((x >> 13) & 0x7FFFF)
    x = x * _i32(0xC2B2AE35)
    return x ^ ((x >> 16) & 0xFFFF)


def uniform(key: torch.Tensor, n: int, offset: int = 0) -> torch.Tensor:
    """n uniform float32 numbers in [0, 1): elements ``offset .. offset + n`` of the stream
    of ``key`` (the same for the same key and indices on every device). Counter-based: a
    hash of the key and each element's index (murmur3's finalizer), in int32 arithmetic
    done in place (shifts made logical by masks; products wrap)."""
    k = int(key) & _M32
    seed = _i32(int(_mix(torch.tensor(k, dtype=torch.int64))))
    x = torch.arange(offset, offset + n, dtype=torch.int32)
    x.mul_(_i32(0x9E3779B1)).add_(seed)
    t = torch.empty_like(x)
    for shift, mask, mul in ((16, 0xFFFF, 0x85EBCA6B), (13, 0x7FFFF, 0xC2B2AE35),
                             (16, 0xFFFF, None)):
        torch.bitwise_right_shift(x, shift, out=t)
        x.bitwise_xor_(t.bitwise_and_(mask))
        if mul is not None:
            x.mul_(_i32(mul))
    x.bitwise_right_shift_(8).bitwise_and_(0xFFFFFF)
    return x.to(torch.float32).mul_(1.0 / (1 << 24))


def qmax(bits: int) -> int:
    """The largest magnitude of a symmetric bits-bit code (7 for 4 bits, 127 for 8)."""
    return (1 << (bits - 1)) - 1


def _groups(flat: torch.Tensor, p: int, group: int, padded: bool) -> tuple[torch.Tensor, int]:
    """Flat values as rows of ``group``: zero-padded to p chunks of k, each chunk to whole
    groups when ``padded``, the whole to whole groups (a view when nothing needs padding);
    and the values the p chunks hold, padding included."""
    n = flat.numel()
    k = -(-n // p)
    kq = -(-k // group) * group if padded else k
    if p * k == n and kq == k and (p * kq) % group == 0:
        return flat.view(-1, group), p * kq
    rows = torch.nn.functional.pad(flat, (0, p * k - n)).view(p, k)
    if kq != k:
        rows = torch.nn.functional.pad(rows, (0, kq - k))
    whole = rows.reshape(-1)
    tail = (-whole.numel()) % group
    if tail:
        whole = torch.nn.functional.pad(whole, (0, tail))
    return whole.view(-1, group), p * kq


def quantize(x: torch.Tensor, bits: int, group: int, noise: torch.Tensor | None,
             pieces: int | None, hadamard_block: int | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8, scales) of x per group of ``group`` values: scale = absmax / qmax, q =
    round(x / scale) (stochastic: floor(x / scale + u)). ``pieces``: the flat layout of
    N chunks each padded to whole groups (this process holds one chunk when N is the
    axis size and x is its flat piece: pass pieces=1 then)."""
    flat = x.reshape(-1).to(torch.float32)
    p = 1 if pieces is None else pieces
    g, used = _groups(flat, p, group, pieces is not None)
    if hadamard_block:
        g = hadamard(g, hadamard_block)   # blocks divide the group: rows stay rows
    qm = qmax(bits)
    scale = g.abs().amax(dim=1) / qm
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = g / safe[:, None]                 # a new tensor: the in-place steps below are its own
    if noise is None:
        y.round_()
    else:
        u, _ = _groups(noise.reshape(-1), p, group, pieces is not None)
        y.add_(u).floor_()
    q = y.clamp_(-qm, qm).to(torch.int8).reshape(-1)[:used]
    if pieces is None:
        q = q.view(x.shape)
    return q, scale.to(x.dtype)


def dequantize(q: torch.Tensor, scales: torch.Tensor, group: int, dtype: torch.dtype,
               shape: list[int], pieces: int | None) -> torch.Tensor:
    """q * scale per group, in ``dtype``; with ``pieces`` the padding of each chunk and of
    the whole is dropped and the result has ``shape``."""
    flat = q.reshape(-1).to(torch.float32)
    tail = (-flat.numel()) % group
    g = torch.nn.functional.pad(flat, (0, tail)).view(-1, group) * scales.to(torch.float32)[:, None]
    out = g.reshape(-1)[:flat.numel()]
    if pieces is not None:
        numel = math.prod(shape)
        k = -(-numel // pieces)
        out = out.view(pieces, -1)[:, :k].reshape(-1)[:numel]
    return out.reshape(shape).to(dtype)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed bits-bit integers into uint8: 4 bits two per byte (low nibble first), 8 bits
    one per byte; each stored as q + 2^(bits-1) (in uint8, whose wrap-around makes the
    two's complement bits of q come out right)."""
    if bits not in (4, 8):
        raise NotImplementedError(f"pack of {bits}-bit values (4 and 8 are lowered)")
    u = q.reshape(-1).to(torch.int8).view(torch.uint8) + (1 << (bits - 1))
    if bits == 8:
        return u
    if u.numel() % 2:
        u = torch.cat([u, u.new_zeros(1)])
    pairs = u.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack(packed: torch.Tensor, bits: int, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """The inverse of ``pack``: ``shape`` signed integers."""
    b = packed.reshape(-1)
    n = math.prod(shape)
    if bits == 8:
        vals = b[:n] - 128
    elif bits == 4:
        vals = torch.stack([b & 0xF, b >> 4], dim=1).reshape(-1)[:n] - 8
    else:
        raise NotImplementedError(f"unpack of {bits}-bit values (4 and 8 are lowered)")
    return vals.view(torch.int8).reshape(shape).to(dtype)


@functools.lru_cache(maxsize=8)
def sylvester(block: int) -> torch.Tensor:
    """The Sylvester Hadamard matrix of order ``block`` (a power of two), scaled by
    1/sqrt(block) so that it is orthonormal and its own inverse."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(block)).to(torch.float32)


def hadamard(x: torch.Tensor, block: int) -> torch.Tensor:
    """The orthonormal Hadamard transform of each contiguous ``block`` of flattened x."""
    if x.numel() % block:
        raise ValueError(f"hadamard: {x.numel()} values are not whole blocks of {block}")
    h = sylvester(block).to(x.dtype)
    return (x.reshape(-1, block) @ h).reshape(x.shape)


def uniform_shaped(key: torch.Tensor, shape: list[int], offset: int, low: float, high: float,
                   dtype: torch.dtype) -> torch.Tensor:
    """A keyed uniform draw of ``shape`` in [low, high): elements from ``offset`` on."""
    n = math.prod(shape)
    u = uniform(key, n, offset)
    return (low + (high - low) * u).reshape(shape).to(dtype)


def quantize_keyed(x: torch.Tensor, bits: int, group: int, key: torch.Tensor | None,
                   pieces: int | None, offset: int, n: int,
                   hadamard_block: int | None = None) -> tuple[torch.Tensor, ...]:
    """quantize with the noise of ``key`` for elements ``offset .. offset + n`` of the whole
    (nearest rounding without a key)."""
    noise = None if key is None else uniform(key, n, offset)
    return quantize(x, bits, group, noise, pieces, hadamard_block)


def as_piece(x: torch.Tensor, shape: list[int], offset: int, numel: int) -> torch.Tensor:
    """The first elements of flat x in ``shape``: a device's piece starting at ``offset`` of
    a flattened tensor of ``numel`` values, whose padding past the end is set to zero (a
    flat piece promises zero padding)."""
    n = math.prod(shape)
    piece = x.reshape(-1)[:n]
    keep = max(0, min(n, numel - offset))
    if keep < n:
        piece = torch.cat([piece[:keep], piece.new_zeros(n - keep)])
    return piece.reshape(shape)
