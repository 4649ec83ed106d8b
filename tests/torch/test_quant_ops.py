# ruff: noqa: E501  (IR text in the tests keeps its one-op-per-line form)
"""The quant ops of the IR lowered to torch (torch/quant.py through build.py): error within
the declared bound, stochastic rounding unbiased, pack/unpack exact, the Hadamard transform
its own inverse, keyed draws reproducible and a flat piece's draw its part of the whole."""

from __future__ import annotations

import math

import pytest
import torch

from diphoma_compile.errors import DiphomaError
from diphoma_compile.ir.parser import parse
from diphoma_compile.ir.verify import verify
from diphoma_compile.torch import quant
from diphoma_compile.torch.build import build_module


def roundtrip_graph(numel: int, bits: int, group: int, pieces: int, rounding: str) -> str:
    k = -(-numel // pieces)
    kq = -(-k // group) * group
    q, s, p = pieces * kq, pieces * kq // group, math.ceil(pieces * kq * bits / 8)
    key = ", %k" if rounding == "stochastic" else ""
    return f'''# diphoma-ir v1
graph @q (
  %x: f32[{numel}] param,
  %k: key[] comm_state(slot=key),
) {{
  %q: i8[{q}], %s: f32[{s}] = quantize(%x{key}) {{bits={bits}, group_size={group}, pieces={pieces}, rounding={rounding}}}
  %p: u8[{p}] = pack(%q) {{bits={bits}}}
  %q2: i8[{q}] = unpack(%p) {{bits={bits}, dtype=i8}}
  %y: f32[{numel}] = dequantize(%q2, %s) {{bits={bits}, dtype=f32, group_size={group}, pieces={pieces}}}
  %k2: key[] = rng_next(%k)
  return (%y, %s, %k2 replaces(%k))
}}
'''


def group_bound(x: torch.Tensor, group: int, pieces: int, qmax: int) -> torch.Tensor:
    """Per element: the absmax of its group (in quantize's piece layout) / qmax."""
    k = -(-x.numel() // pieces)
    kq = -(-k // group) * group
    rows = torch.nn.functional.pad(torch.nn.functional.pad(x, (0, pieces * k - x.numel()))
                                   .view(pieces, k), (0, kq - k))
    amax = rows.view(-1, group).abs().amax(1, keepdim=True).expand(-1, group)
    return amax.reshape(pieces, kq)[:, :k].reshape(-1)[:x.numel()] / qmax


@pytest.mark.parametrize("bits,group,pieces,rounding", [
    (4, 2048, 1, "stochastic"), (4, 2048, 4, "stochastic"), (4, 2048, 4, "nearest"),
    (8, 128, 1, "stochastic"), (8, 128, 3, "nearest")])
def test_error_within_declared_bound(bits, group, pieces, rounding):
    g = parse(roundtrip_graph(10_000, bits, group, pieces, rounding))
    verify(g)
    x = torch.randn(10_000) * torch.linspace(0.01, 3.0, 10_000)
    y, _, _ = build_module(g)(x, torch.tensor(5))
    qmax = (1 << (bits - 1)) - 1
    bound = group_bound(x, group, pieces, qmax)
    if rounding == "nearest":
        bound = bound / 2
    err = (y - x).abs()
    assert (err <= bound * (1 + 1e-5) + 1e-12).all(), float((err - bound).max())
    # and not trivially: the error uses a good part of the bound somewhere
    assert float((err / bound).max()) > 0.3


def test_stochastic_rounding_unbiased():
    g = build_module(parse(roundtrip_graph(4096, 4, 2048, 1, "stochastic")))
    x = torch.randn(4096)
    runs = torch.stack([g(x, torch.tensor(key))[0] for key in range(400)])
    mean_err = (runs.mean(0) - x)
    step = group_bound(x, 2048, 1, 7)
    # each draw's error is within a step, with mean zero: 400 draws -> std <= step / 40
    assert float((mean_err.abs() / step).mean()) < 0.05
    assert abs(float((mean_err / step).mean())) < 0.01
    # nearest rounding is biased by comparison (a deterministic error per element)
    near = build_module(parse(roundtrip_graph(4096, 4, 2048, 1, "nearest")))
    assert float(((near(x, torch.tensor(0))[0] - x).abs() / step).mean()) > 0.1


def test_keyed_draws_reproducible_and_pieces_agree():
    k = torch.tensor(11)
    a = quant.uniform(k, 1000)
    assert torch.equal(a, quant.uniform(k, 1000))
    assert not torch.equal(a, quant.uniform(quant.next_key(k), 1000))
    assert torch.equal(a[300:700], quant.uniform(k, 400, offset=300))
    assert 0.0 <= float(a.min()) and float(a.max()) < 1.0
    assert abs(float(a.mean()) - 0.5) < 0.05


def test_pack_unpack_exact():
    q = torch.randint(-7, 8, (1001,), dtype=torch.int8)
    p = quant.pack(q, 4)
    assert p.dtype == torch.uint8 and p.numel() == 501
    assert torch.equal(quant.unpack(p, 4, [1001], torch.int8), q)
    q8 = torch.randint(-127, 128, (300,), dtype=torch.int8)
    assert torch.equal(quant.unpack(quant.pack(q8, 8), 8, [300], torch.int8), q8)


def test_hadamard_is_its_own_inverse():
    g = parse('''# diphoma-ir v1
graph @h (%x: f32[64,96] param) {
  %h: f32[64,96] = hadamard(%x) {block=32}
  %back: f32[64,96] = hadamard(%h) {block=32}
  return (%h, %back)
}
''')
    verify(g)
    x = torch.randn(64, 96)
    h, back = build_module(g)(x)
    assert (back - x).abs().max() <= 4 * torch.finfo(torch.float32).eps * x.abs().max()
    # orthonormal: the norm of each block is kept, and it is not the identity
    assert torch.allclose(h.reshape(-1, 32).norm(dim=1), x.reshape(-1, 32).norm(dim=1),
                          rtol=1e-5)
    assert (h - x).abs().max() > 0.1
    hm = quant.sylvester(32)
    assert torch.allclose(hm @ hm, torch.eye(32), atol=1e-6)


def test_shape_rules_refuse_bad_layouts():
    bad = roundtrip_graph(5000, 4, 2048, 2, "stochastic").replace("f32[4] = quantize",
                                                                   "f32[3] = quantize")
    with pytest.raises(DiphomaError, match="result 1"):
        verify(parse(bad))
    with pytest.raises(DiphomaError, match="whole blocks"):
        verify(parse('''# diphoma-ir v1
graph @h (%x: f32[40] param) {
  %h: f32[40] = hadamard(%x) {block=32}
  return (%h)
}
'''))


def test_flat_piece_quantizes_to_dim0_piece():
    """quantize{pieces=N} of a flat shard gives dim-0 shards of q and scales; the payload
    all-gathered and dequantized is whole again."""
    g = parse('''# diphoma-ir v1
graph @q mesh[dp=4] (
  %x: f32[5000] {dp: F} param,
  %k: key[] comm_state(slot=key),
) {
  %q: i8[8192] {dp: S(0)}, %s: f32[4] {dp: S(0)} = quantize(%x, %k) {bits=4, group_size=2048, pieces=4, rounding=stochastic}
  %p: u8[4096] {dp: S(0)} = pack(%q) {bits=4}
  %pg: u8[4096] = all_gather(%p) {axis=dp, dim=0}
  %sg: f32[4] = all_gather(%s) {axis=dp, dim=0}
  %q2: i8[8192] = unpack(%pg) {bits=4, dtype=i8}
  %y: f32[5000] = dequantize(%q2, %sg) {bits=4, dtype=f32, group_size=2048, pieces=4}
  return (%y)
}
''')
    verify(g)
    with pytest.raises(DiphomaError):
        verify(parse(str(g).replace("%y: f32[5000] = dequantize(%q2, %sg)",
                                    "%y: f32[5000] = dequantize(%p, %sg)")))
