"""A reversible encoding of JAX primitive parameters into IR attribute values.

Attributes hold None, bool, int, float, str and tuples of them. Everything else a primitive
carries is written with a tag that ``decode`` reads back to the very same object:

- a string starting with ``!`` is a tagged scalar: ``!dtype:float32``,
  ``!enum:jax._src.lax.lax:Precision:HIGHEST``, ``!prng:threefry2x32``; a user string that
  starts with ``!`` is escaped as ``!!...``;
- a tuple whose first item is a tagged string is a tagged compound:
  ``("!named:jax._src.lax.slicing:GatherDimensionNumbers", field0, field1, ...)`` (a
  NamedTuple), ``("!scalar:float32", 1.5)`` (a numpy scalar), ``("!list", ...)``,
  ``("!array:int32", shape, data)``, ``("!unsharded", *spec)`` (a NamedSharding over the
  empty mesh, which JAX records on ops that nothing shards).

Jaxprs, functions and shardings over real meshes have no encoding: ``encode`` raises
EncodingError and the frontend reports the primitive. Decoding imports classes only from
jax, jaxlib and numpy.
"""

from __future__ import annotations

import enum
import importlib
from typing import Any

import numpy as np

from ..ir.core import AttrValue
from ..ir.ops import op_def

_SAFE_MODULES = ("jax", "jaxlib", "numpy", "ml_dtypes")

# attributes of an opaque op that are the IR's own (its table row's), not the primitive's
# parameters
OPAQUE_RESERVED = tuple(op_def("opaque").attrs)


class EncodingError(ValueError):
    """A parameter value that has no attribute encoding; the message says what it is."""


def _qualified(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _resolve(qualified: str) -> Any:
    module, _, qualname = qualified.partition(":")
    if module.split(".")[0] not in _SAFE_MODULES:
        raise EncodingError(f"refusing to import {module!r}: encoded parameters name classes "
                            f"of {', '.join(_SAFE_MODULES)} only")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _prng_impls() -> dict[str, Any]:
    from jax._src.random import prng
    return prng.prngs


def _is_unsharded(value: Any) -> bool:
    """A NamedSharding over the empty mesh: what JAX records where nothing is sharded."""
    from jax.sharding import NamedSharding
    return isinstance(value, NamedSharding) and not value.mesh.axis_names and \
        value.memory_kind is None


def is_trivial_sharding(value: Any) -> bool:
    """True for None and for a sharding over the empty mesh (both mean: not sharded)."""
    return value is None or _is_unsharded(value)


def encode(value: Any) -> AttrValue:
    """The attribute value for a primitive parameter; EncodingError when there is none."""
    if isinstance(value, enum.Enum):   # before numbers: an IntEnum is an int too
        return f"!enum:{_qualified(type(value))}:{value.name}"
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        return "!" + value if value.startswith("!") else value
    if isinstance(value, np.dtype) or (isinstance(value, type) and issubclass(value, np.generic)):
        return f"!dtype:{np.dtype(value).name}"
    if isinstance(value, np.generic):
        return (f"!scalar:{value.dtype.name}", value.item())
    if isinstance(value, np.ndarray):
        return (f"!array:{value.dtype.name}", tuple(value.shape),
                tuple(value.ravel().tolist()))
    if type(value).__name__ == "PRNGImpl" and hasattr(value, "name"):
        if _prng_impls().get(value.name) is not value:
            raise EncodingError(f"PRNG implementation {value.name!r} is not registered")
        return f"!prng:{value.name}"
    if _is_unsharded(value):
        return ("!unsharded",) + tuple(encode(v) for v in value.spec)
    if isinstance(value, tuple) and hasattr(type(value), "_fields"):
        return (f"!named:{_qualified(type(value))}",) + tuple(encode(v) for v in value)
    if isinstance(value, tuple):
        return tuple(encode(v) for v in value)
    if isinstance(value, list):
        return ("!list",) + tuple(encode(v) for v in value)
    raise EncodingError(f"a {type(value).__module__}.{type(value).__qualname__} value "
                        f"({str(value)[:60]!r})")


def decode(value: AttrValue) -> Any:
    """The parameter value that ``encode`` wrote as ``value``."""
    if isinstance(value, str):
        if value.startswith("!!"):
            return value[1:]
        if not value.startswith("!"):
            return value
        tag, _, rest = value[1:].partition(":")
        if tag == "dtype":
            return np.dtype(_resolve_dtype(rest))
        if tag == "enum":
            qualified, _, member = rest.rpartition(":")
            return _resolve(qualified)[member]
        if tag == "prng":
            return _prng_impls()[rest]
        raise EncodingError(f"unknown tag in encoded parameter {value!r}")
    if isinstance(value, tuple):
        head = value[0] if value else None
        if isinstance(head, str) and head.startswith("!") and not head.startswith("!!"):
            tag, _, rest = head[1:].partition(":")
            items = value[1:]
            if tag == "named":
                return _resolve(rest)(*(decode(v) for v in items))
            if tag == "scalar":
                return np.dtype(_resolve_dtype(rest)).type(items[0])
            if tag == "array":
                shape, data = items
                return np.asarray(data, dtype=_resolve_dtype(rest)).reshape(shape)
            if tag == "list":
                return [decode(v) for v in items]
            if tag == "unsharded":
                from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec
                return NamedSharding(AbstractMesh((), ()), PartitionSpec(*map(decode, items)))
            # any other tagged string heads an ordinary tuple
        return tuple(decode(v) for v in value)
    return value


def _resolve_dtype(name: str) -> Any:
    # bfloat16 and the float8 types are not numpy builtins; jax.numpy names them all.
    import jax.numpy as jnp
    return np.dtype(getattr(jnp, name, name))
