"""The fx program build_module emits for IR written by hand: which aten overload each op
form calls, host scalars as Python numbers, and the error for an op without a lowering."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from diphoma_compile.errors import UnsupportedOpError  # noqa: E402
from diphoma_compile.ir import parse  # noqa: E402
from diphoma_compile.torch.build import build_module  # noqa: E402

FORMS = """# diphoma-ir v1
graph @forms (%a: f32[4] param, %b: f32[4] param, %lr: f64[] hyper) {
  %zero: f32[] = full() {value=0.0}
  %lt: bool[4] = lt(%a, %zero)
  %ge: bool[4] = ge(%a, %b)
  %quarter: f32[] = full() {value=0.25}
  %l1: f32[4] = lerp(%a, %b, %quarter)
  %l2: f32[4] = lerp(%a, %b, %l1)
  %half: f64[] = full() {value=0.5}
  %step: f64[] = mul(%lr, %half)
  %step32: f32[] = convert(%step) {dtype=f32}
  %m: f32[4] = mul(%l2, %step32)
  %mx: f32[4] = max(%m, %zero)
  %p1: f32[4] = pow(%mx, %quarter)
  %p2: f32[4] = pow(%quarter, %b)
  %p3: f32[4] = pow(%b, %a)
  %s: f32[4] = sub(%p1, %p2) {alpha=2.0}
  return (
    %lt other,
    %ge other,
    %s other,
    %p3 other,
  )
}
"""


def test_overloads_and_host_scalars():
    gm = build_module(parse(FORMS))
    code = gm.code
    for call in ("aten.lt.Scalar(a, 0.0)", "aten.ge.Tensor(a, b)", "aten.lerp.Scalar(a, b, 0.25)",
                 "aten.lerp.Tensor(a, b, lerp_scalar)", "aten.pow.Tensor_Scalar(",
                 "aten.pow.Scalar(0.25, b)", "aten.pow.Tensor_Tensor(b, a)",
                 "aten._local_scalar_dense.default(lr)", "alpha = 2.0"):
        assert call in code, call
    # maximum takes no number: the 0-d constant is made a tensor for it
    assert "aten.scalar_tensor.default(0.0, dtype = torch.float32)" in code
    # the learning-rate math runs on Python floats; mul takes the result as a number
    assert "_local_scalar_dense_default * 0.5" in code
    g = torch.Generator().manual_seed(0)
    a, b = torch.rand(4, generator=g) - 0.5, torch.rand(4, generator=g)
    lr = torch.tensor(0.1, dtype=torch.float64)
    lt, ge, s, p3 = gm(a, b, lr)
    l2 = torch.lerp(a, b, torch.lerp(a, b, 0.25))
    p1 = torch.pow(torch.maximum(l2 * (0.1 * 0.5), torch.tensor(0.0)), 0.25)
    assert torch.equal(lt, a < 0) and torch.equal(ge, a >= b)
    assert torch.equal(s, torch.sub(p1, torch.pow(0.25, b), alpha=2.0))
    assert torch.equal(p3, torch.pow(b, a))


def test_op_without_lowering():
    g = parse("""# diphoma-ir v1
graph @g (%a: f32[4] param) {
  %e: f32[4] = erf(%a)
  return (
    %e other,
  )
}
""")
    with pytest.raises(UnsupportedOpError, match="cannot run IR op 'erf'"):
        build_module(g)


def test_dot_of_a_matrix_and_a_vector_has_no_lowering():
    # mm takes two matrices: a contraction of the same dims with a vector is not mm
    g = parse("""# diphoma-ir v1
graph @g (%a: f32[4,3] param, %v: f32[3] param) {
  %y: f32[4] = dot(%a, %v) {lhs_contract=[1], rhs_contract=[0]}
  return (
    %y other,
  )
}
""")
    with pytest.raises(UnsupportedOpError, match="no lowering for dot"):
        build_module(g)


def test_concat_and_slice_run_as_cat_and_strided_slices():
    """concat and slice (the pipeline packs a stage's gradient norms with them) run as
    torch.cat and aten.slice, one dimension at a time."""
    g = parse("""# diphoma-ir v1
graph @g (%a: f32[2,3] param, %b: f32[1,3] param) {
  %c: f32[3,3] = concat(%a, %b) {dim=0}
  %s: f32[2,2] = slice(%c) {starts=[1, 0], limits=[3, 3], strides=[1, 2]}
  return (
    %c other,
    %s other,
  )
}
""")
    a, b = torch.randn(2, 3), torch.randn(1, 3)
    c, s = build_module(g)(a, b)
    want = torch.cat([a, b], 0)
    assert torch.equal(c, want) and torch.equal(s, want[1:3, 0:3:2])
