"""``.contiguous()`` (traced as clone with a memory format) keeps its layout change: kernels
that require a contiguous input (group norm after a transpose) get one, as in eager."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import diphoma_compile  # noqa: E402


class TransposedNorm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(6, 8)
        self.norm = torch.nn.GroupNorm(2, 8)

    def forward(self, x):                      # x: (batch, time, 6)
        h = self.proj(x).transpose(1, 2).contiguous()     # (batch, 8, time)
        return self.norm(h).square().mean()


def _step(model, opt, x):
    loss = model(x)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_group_norm_after_contiguous_transpose_matches_eager():
    torch.manual_seed(0)
    model = TransposedNorm()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    xs = [torch.randn(3, 5, 6) for _ in range(3)]
    step = diphoma_compile.compile(_step, model, opt, xs[0])
    for x in xs:
        assert torch.equal(step(model, opt, x), _step(ref, ref_opt, x))
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_the_layout_change_is_kept_in_the_ir_and_under_data_parallelism():
    from diphoma_compile.mesh import Mesh
    from diphoma_compile.passes import PassContext, Pipeline
    from diphoma_compile.passes.defaults import default_passes
    model = TransposedNorm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = diphoma_compile.trace(_step, model, opt, torch.randn(4, 5, 6))
    clones = [op for op in g.ops if op.name == "opaque"
              and str(op.attrs["target"]).startswith("aten.clone")]
    assert clones and all("contiguous" in str(op.attrs.get("kw_memory_format")) for op in clones)
    Pipeline.from_spec(default_passes("dp", layout="flat")).run(
        g.replace(mesh=Mesh({"dp": 2})), PassContext())
