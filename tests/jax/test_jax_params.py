"""Primitive parameters as IR attributes: encode, print, parse, decode gives them back."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")

import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from diphoma_compile.jax.params import EncodingError, decode, encode  # noqa: E402
from diphoma_compile.ir import Attrs, Graph, Op, Value, parse, print_graph  # noqa: E402
from diphoma_compile.ir.types import DType, TensorType  # noqa: E402

VALUES = [
    None, True, 3, -0.0, float("nan"), "plain", "!bang", "!!double", (), (1, (2, "x")),
    np.dtype("float32"), np.dtype(jax.numpy.bfloat16), lax.Precision.HIGHEST,
    lax.GatherScatterMode.CLIP, (lax.Precision.DEFAULT, None),
    lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,),
                               start_index_map=(0,)),
    np.int64(7), np.float32(1.5), [1, "a"], np.arange(6, dtype=np.int32).reshape(2, 3),
    ("!dtype:float32", 3),  # a plain tuple whose first item looks like a tag
    jax.sharding.NamedSharding(jax.sharding.AbstractMesh((), ()),
                               jax.sharding.PartitionSpec(None, None)),
]


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, float) and np.isnan(a):
        return isinstance(b, float) and np.isnan(b)
    if isinstance(a, (tuple, list)) and not hasattr(a, "_fields"):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b and repr(a) == repr(b)


@pytest.mark.parametrize("value", VALUES, ids=[repr(v)[:30] for v in VALUES])
def test_encode_decode_through_the_text_form(value):
    attr = encode(value)
    op = Op("opaque", (), (Value("y", TensorType((), DType.f32)),),
            Attrs(target="jax:test", p=attr))
    parsed = parse(print_graph(Graph("g", (), (op,), ())))
    assert _same(decode(parsed.ops[0].attrs["p"]), value)


@pytest.mark.parametrize("value", [lambda x: x, object(), {"a": 1}, frozenset()],
                         ids=["function", "object", "dict", "frozenset"])
def test_values_without_encoding_are_refused(value):
    with pytest.raises(EncodingError):
        encode(value)


def test_decoding_imports_only_jax_and_numpy_classes():
    with pytest.raises(EncodingError, match="refusing to import 'os'"):
        decode("!enum:os:PathLike:X")
