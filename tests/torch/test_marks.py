"""The torch frontend marks what passes must know of an aten op it keeps whole: draws from
the global generator carry ``rng=global``, views carry ``view=true``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import diphoma_compile  # noqa: E402
from diphoma_compile.ir.ops import is_view, random_draw  # noqa: E402


class Picky(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)

    def forward(self, x):
        h = torch.nn.functional.dropout(self.fc(x), 0.5, training=True)
        return h[:, 1:4].unsqueeze(0).sum()


def test_dropout_and_views_are_marked():
    model = Picky()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model, opt, x):
        loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    g = diphoma_compile.trace(step, model, opt, torch.randn(3, 6))
    opaque = {str(op.attrs["target"]): op for op in g.ops if op.name == "opaque"}
    drawn = [t for t, op in opaque.items() if random_draw(op) == "global"]
    assert drawn and all("dropout" in t or "bernoulli" in t or "rand" in t for t in drawn)
    views = sorted(t for t, op in opaque.items() if is_view(op))
    assert any(t.startswith("aten.unsqueeze") for t in views), views
    assert all(not is_view(op) for t, op in opaque.items() if "dropout" in t)
