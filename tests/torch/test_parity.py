"""Ten steps through trace + torch backend equal ten eager steps, bit for bit."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import diphoma_compile  # noqa: E402

from models import (CNN, GPT, MLP, OPTIMIZERS, classify_step, clipped_step,  # noqa: E402
                     cnn_batches, lm_batches, lm_step, mlp_batches)

STEPS = 10
CASES = {
    "mlp": (MLP, clipped_step, mlp_batches),
    "cnn_bn": (CNN, classify_step, cnn_batches),
    "gpt": (GPT, lm_step, lm_batches),
}


def assert_same(tag: str, a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, tag
    if not torch.equal(a, b):
        diff = (a.double() - b.double()).abs().max().item()
        raise AssertionError(f"{tag} differs from eager, max abs diff {diff:.3g}")


def assert_state_equal(step: int, model, opt, ref, ref_opt) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_same(f"step {step} param {name}", p, q)
        assert p.grad is None and q.grad is None
        for key, v in ref_opt.state[q].items():
            assert_same(f"step {step} state {name}.{key}", opt.state[p][key], v)
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        assert_same(f"step {step} buffer {name}", b, c)


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "for-loop"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("case", list(CASES))
def test_bit_exact_against_eager(case, opt_name, foreach):
    make_model, step_fn, batches = CASES[case]
    torch.manual_seed(0)
    model = make_model()
    ref = copy.deepcopy(model)
    opt = OPTIMIZERS[opt_name](model.parameters(), foreach)
    ref_opt = OPTIMIZERS[opt_name](ref.parameters(), foreach)
    data = batches(STEPS)
    compiled = diphoma_compile.compile(step_fn, model, opt, data[0])
    for i, batch in enumerate(data):
        loss = compiled(model, opt, batch)
        ref_loss = step_fn(ref, ref_opt, batch)
        assert_same(f"step {i} loss", loss, ref_loss)
        assert_state_equal(i, model, opt, ref, ref_opt)
