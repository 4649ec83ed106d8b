"""torch.optim's RAdam and ASGD branch on their step count in eager step() (RAdam's
rectification from its sixth step, ASGD's averaging from step t0): they are traced in their
capturable form (``torch.where`` on a count kept as a tensor, counted in float64 while
traced), and match eager to rounding across the step where the branch turns."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import diphoma_compile  # noqa: E402

from models import MLP, classify_step, mlp_batches  # noqa: E402

MAKERS = {
    "radam": lambda ps, fe: torch.optim.RAdam(ps, lr=1e-2, foreach=fe),
    "radamw": lambda ps, fe: torch.optim.RAdam(ps, lr=1e-2, weight_decay=0.1,
                                               decoupled_weight_decay=True, foreach=fe),
    "asgd": lambda ps, fe: torch.optim.ASGD(ps, lr=0.05, t0=4, weight_decay=0.01, foreach=fe),
}


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
@pytest.mark.parametrize("name", list(MAKERS))
def test_step_count_optimizers_match_eager(name, foreach):
    """12 steps against eager: losses, parameters and every state tensor within rounding
    (the capturable form orders its math otherwise; in float32 counts RAdam's rho_t, a
    difference of two numbers near 2 / (1 - beta2), drifted 300x further from a float64
    step than eager's), step counts equal and kept float32. RAdam starts fresh (its state
    starts from zeros); ASGD's first step sets eta = lr and mu = 1, so it runs one eager
    step first."""
    torch.manual_seed(0)
    model = MLP()
    opt = MAKERS[name](model.parameters(), foreach)
    batches = mlp_batches(13)
    if name == "asgd":
        classify_step(model, opt, batches[0])
    ref = copy.deepcopy((model, opt))
    compiled = diphoma_compile.compile(classify_step, model, opt, batches[0], codegen="fx")
    for b in batches[1:]:
        loss, want = compiled(model, opt, b), classify_step(*ref, b)
        assert abs(loss.item() - want.item()) <= 1e-6 * abs(want.item())
    for p, q in zip(model.parameters(), ref[0].parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7)
        assert opt.state[p].keys() == ref[1].state[q].keys()
        for k, v in ref[1].state[q].items():
            assert opt.state[p][k].dtype == v.dtype, k
            if k == "step":
                assert torch.equal(opt.state[p][k], v)
            torch.testing.assert_close(opt.state[p][k], v, rtol=0, atol=1e-7)


def test_another_optimizer_in_the_step_stays_bit_exact():
    """Only RAdam's step() runs in its capturable form: an Adam beside it in the same step
    (another module) keeps eager's math, bit for bit."""
    torch.manual_seed(0)
    a, b = nn.Linear(8, 16), nn.Linear(16, 4)
    opts = (torch.optim.Adam(a.parameters(), lr=1e-2), torch.optim.RAdam(b.parameters(), lr=1e-2))

    def step(a, b, opt_a, opt_b, x, y):
        loss = F.cross_entropy(b(torch.tanh(a(x))), y)
        loss.backward()
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
        return loss
    batches = mlp_batches(8)
    ref = copy.deepcopy((a, b, *opts))
    compiled = diphoma_compile.compile(step, a, b, *opts, batches[0]["x"], batches[0]["y"])
    for bt in batches:
        compiled(a, b, *opts, bt["x"], bt["y"])
        step(*ref, bt["x"], bt["y"])
    for p, q in zip(a.parameters(), ref[0].parameters(), strict=True):
        assert torch.equal(p, q)
    for p, q in zip(b.parameters(), ref[1].parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7)


def test_the_widened_count_is_part_of_the_update():
    """The float64 count is made as the optimizer's step() begins, an op of the update:
    made when the state was bound it was a forward op, which a pipeline runs per
    microbatch and averages into the update (RAdam over dp=2 x pp=2 drifted 2.7e-3 from
    the single-device step in 3 steps; the distributed check dp2-pp2-radam-1f1b)."""
    from diphoma_compile.ir.core import InputKind, Phase
    torch.manual_seed(0)
    model = MLP()
    opt = MAKERS["radam"](model.parameters(), False)
    g = diphoma_compile.trace(classify_step, model, opt, mlp_batches(1)[0])
    counts = {i.name for i in g.inputs if i.role.kind is InputKind.opt_state
              and i.role.slot == "step"}
    readers = [op for op in g.ops if counts & set(op.inputs)]
    assert len(readers) == len(counts) and all(op.phase is Phase.update for op in readers)
    assert all(op.results[0].type.dtype.name == "f64" for op in readers), readers
