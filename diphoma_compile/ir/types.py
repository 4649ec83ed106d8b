"""Value types of the IR: dtypes, tensor types and placements over mesh axes."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from ..errors import IRError


class DType(enum.Enum):
    """Element types; the value is the short name used in the text form."""

    f64 = "f64"
    f32 = "f32"
    f16 = "f16"
    bf16 = "bf16"
    f8e4m3 = "f8e4m3"
    f8e5m2 = "f8e5m2"
    i64 = "i64"
    i32 = "i32"
    i16 = "i16"
    i8 = "i8"
    u64 = "u64"
    u32 = "u32"
    u16 = "u16"
    u8 = "u8"
    bool = "bool"
    c64 = "c64"
    c128 = "c128"
    key = "key"  # an opaque random-number-generator state

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _ITEMSIZE[self]

    @property
    def is_float(self) -> bool:
        """True for real floating-point types."""
        return self.value.startswith(("f", "bf"))

    @property
    def is_int(self) -> bool:
        """True for signed and unsigned integer types."""
        return self.value.startswith(("i", "u"))

    @property
    def is_complex(self) -> bool:
        """True for complex types."""
        return self.value.startswith("c")

    @classmethod
    def parse(cls, name: str) -> DType:
        """The dtype for a short name; IRError listing the valid names otherwise."""
        try:
            return cls(name)
        except ValueError:
            raise IRError(f"unknown dtype {name!r}",
                          hint="one of " + ", ".join(d.value for d in cls)) from None

    def __str__(self) -> str:
        return self.value


_ITEMSIZE = {
    DType.f64: 8, DType.f32: 4, DType.f16: 2, DType.bf16: 2, DType.f8e4m3: 1, DType.f8e5m2: 1,
    DType.i64: 8, DType.i32: 4, DType.i16: 2, DType.i8: 1, DType.u64: 8, DType.u32: 4,
    DType.u16: 2, DType.u8: 1, DType.bool: 1, DType.c64: 8, DType.c128: 16, DType.key: 8,
}


# ---------------------------------------------------------------- placements

@dataclass(frozen=True)
class Replicate:
    """Every device on the axis holds the whole tensor."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    """Split evenly along tensor dimension ``dim``; the axis size must divide it.

    With ``groups=k`` (written ``S(dim,k)``) the dimension is k equal groups laid end to end
    and each group is split evenly: device r holds the r-th piece of every group, in group
    order. A fused query/key/value projection's columns ``[q | k | v]`` split so that each
    device gets its own heads of all three is ``S(1,3)``. Every device holds ``size/n``
    elements of the dimension either way; the axis size times k must divide it."""

    dim: int
    groups: int = 1

    def __post_init__(self) -> None:
        if self.groups < 1:
            raise IRError(f"a shard's groups must be >= 1, found {self.groups}")

    def __str__(self) -> str:
        return f"S({self.dim})" if self.groups == 1 else f"S({self.dim},{self.groups})"


@dataclass(frozen=True)
class FlatShard:
    """The flattened tensor, padded to a multiple of the axis size, split evenly.

    Weight-update sharding uses it for tensors none of whose dimensions divide. ``F``: the
    padding is known to be zero (a reduce-scatter or take_shard made it, and only math that
    keeps zeros zero followed), so a sum over the shard is a partial sum of the tensor.
    ``Fx``: the padding may hold anything (``sqrt(v) + eps`` made it eps)."""

    dirty: bool = False

    def __str__(self) -> str:
        return "Fx" if self.dirty else "F"


@dataclass(frozen=True)
class Varying:
    """Each device holds its own value, computed from its own data (its local batch under
    data parallelism); the type's shape is the per-device shape. Only a reducing collective
    (all_reduce, reduce_scatter) gives the devices' values one meaning: their sum or mean."""

    def __str__(self) -> str:
        return "V"


REDUCE_OPS = ("sum", "avg", "max", "min")


@dataclass(frozen=True)
class Partial:
    """Each device holds a partial value; the true value is their ``op`` reduction."""

    op: str = "sum"

    def __post_init__(self) -> None:
        if self.op not in REDUCE_OPS:
            raise IRError(f"partial reduction {self.op!r} is not one of {', '.join(REDUCE_OPS)}")

    def __str__(self) -> str:
        return f"P({self.op})"


Placement = Replicate | Shard | FlatShard | Partial | Varying

REPLICATE = Replicate()
FLAT = FlatShard()
FLAT_DIRTY = FlatShard(dirty=True)
VARYING = Varying()


def dim_attr(p: Placement) -> int | str:
    """The ``dim`` attribute of a collective that makes or takes a value placed ``p``:
    ``"flat"`` for a flat shard, else the split dimension."""
    return "flat" if isinstance(p, FlatShard) else p.dim


def fits(declared: Placement, given: Placement) -> bool:
    """True when a value that ops give placed ``given`` may be declared ``declared``: the
    same, or a flat shard with known-zero padding declared as one with unknown padding."""
    return declared == given or (declared == FLAT_DIRTY and given == FLAT)


# ---------------------------------------------------------------- tensor types

@dataclass(frozen=True)
class TensorType:
    """A logical (global) tensor type plus its placement on each mesh axis.

    Placements are stored only for axes where the value is not replicated, sorted by axis
    name, so that equal types compare equal however they were built."""

    shape: tuple[int, ...]
    dtype: DType
    placements: tuple[tuple[str, Placement], ...] = ()

    def __post_init__(self) -> None:
        shape = tuple(self.shape)
        for d in shape:
            if isinstance(d, bool) or not isinstance(d, int) or d < 0:
                raise IRError(f"shape {shape} has a dimension {d!r}; dimensions are ints >= 0",
                              hint="dynamic shapes are not supported: trace with concrete sizes")
        object.__setattr__(self, "shape", shape)
        if not isinstance(self.dtype, DType):
            object.__setattr__(self, "dtype", DType.parse(str(self.dtype)))
        pl = dict(self.placements)
        if len(pl) != len(self.placements):
            raise IRError(f"placement names an axis twice: {self.placements}")
        canon = tuple(sorted(((a, p) for a, p in pl.items() if not isinstance(p, Replicate)),
                             key=lambda ap: ap[0]))
        object.__setattr__(self, "placements", canon)

    @property
    def rank(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    @property
    def numel(self) -> int:
        """Number of elements of the logical tensor."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the logical tensor."""
        return self.numel * self.dtype.itemsize

    def placement(self, axis: str) -> Placement:
        """Placement on ``axis`` (replicated when not recorded)."""
        for a, p in self.placements:
            if a == axis:
                return p
        return REPLICATE

    def with_placement(self, axis: str, placement: Placement) -> TensorType:
        """The same type with the placement on one axis replaced."""
        pl = dict(self.placements)
        pl[axis] = placement
        return TensorType(self.shape, self.dtype, tuple(pl.items()))

    def with_shape(self, shape: tuple[int, ...]) -> TensorType:
        """The same dtype and placements with another shape."""
        return TensorType(tuple(shape), self.dtype, self.placements)

    def replicated(self) -> TensorType:
        """The same type, replicated on every axis."""
        return TensorType(self.shape, self.dtype)

    def local_shape(self, axis_sizes: dict[str, int]) -> tuple[int, ...]:
        """Shape of the piece one device holds, given the size of each mesh axis."""
        shape = list(self.shape)
        flat = 1
        for axis, p in self.placements:
            n = axis_sizes.get(axis, 1)
            if isinstance(p, Shard):
                shape[p.dim] = -(-shape[p.dim] // n)
            elif isinstance(p, FlatShard):
                flat *= n
        if flat > 1:
            return (-(-math.prod(shape) // flat),)
        return tuple(shape)

    def local_nbytes(self, axis_sizes: dict[str, int]) -> int:
        """Bytes one device holds."""
        return math.prod(self.local_shape(axis_sizes)) * self.dtype.itemsize

    def __str__(self) -> str:
        text = f"{self.dtype.value}[{','.join(map(str, self.shape))}]"
        if self.placements:
            text += " {" + ", ".join(f"{a}: {p}" for a, p in self.placements) + "}"
        return text
