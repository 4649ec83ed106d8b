"""JAX dtypes and abstract values as IR types, and back."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ..errors import FrontendError
from ..ir.types import DType, TensorType

# numpy dtype name -> IR dtype; extended (key) dtypes are handled apart.
_FROM_NUMPY = {
    "float64": DType.f64, "float32": DType.f32, "float16": DType.f16,
    "bfloat16": DType.bf16, "float8_e4m3fn": DType.f8e4m3, "float8_e5m2": DType.f8e5m2,
    "int64": DType.i64, "int32": DType.i32, "int16": DType.i16, "int8": DType.i8,
    "uint64": DType.u64, "uint32": DType.u32, "uint16": DType.u16, "uint8": DType.u8,
    "bool": DType.bool, "complex64": DType.c64, "complex128": DType.c128,
}
_TO_NUMPY = {v: k for k, v in _FROM_NUMPY.items()}


def is_key_dtype(dtype: Any) -> bool:
    """True for JAX's typed PRNG key dtypes (``key<fry>``)."""
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def ir_dtype(dtype: Any, where: str = "a value") -> DType:
    """The IR dtype of a JAX/numpy dtype; FrontendError for dtypes the IR lacks."""
    if is_key_dtype(dtype):
        return DType.key
    # what JAX computes with: numpy int64/float64 leaves become 32-bit unless x64 is on
    name = np.dtype(jax.dtypes.canonicalize_dtype(dtype)).name
    try:
        return _FROM_NUMPY[name]
    except KeyError:
        raise FrontendError(
            f"{where} has dtype {name}, which the IR cannot hold",
            hint="supported: " + ", ".join(sorted(_FROM_NUMPY)) + " and PRNG keys") from None


def numpy_dtype(dtype: DType) -> np.dtype:
    """The numpy dtype of an IR dtype (bf16 and f8 through ml_dtypes, as JAX does)."""
    if dtype is DType.key:
        raise TypeError("PRNG keys have no numpy dtype")
    return np.dtype(getattr(jax.numpy, _TO_NUMPY[dtype]))


def ir_type(aval: Any, where: str = "a value") -> TensorType:
    """The IR type of a JAX abstract value (ShapedArray) or anything with shape and dtype."""
    shape = tuple(getattr(aval, "shape", ()))
    if any(not isinstance(d, int) for d in shape):
        raise FrontendError(f"{where} has the symbolic shape {shape}",
                            hint="trace with concrete sizes")
    return TensorType(tuple(int(d) for d in shape), ir_dtype(aval.dtype, where))
