"""Parity on a real GPU: compile() and parallelize() of small models on CUDA against the
eager step. Skipped where torch sees no CUDA device (CI, this project's CPU machines).

``DIPHOMA_TEST_DEVICE=cpu`` runs the same checks on the CPU, to check the tests themselves
where no GPU is at hand. Numerics: the fx code generator makes the eager step's own kernel
calls, so on one device results are equal bit for bit where the kernels are deterministic
(cuBLAS matmuls and the elementwise math here are; ``torch.use_deterministic_algorithms`` is
switched on so that scatter-add kernels, the embedding's backward, are too); Inductor
generates its own kernels, so its results are compared within a tolerance."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

DEVICE = os.environ.get("DIPHOMA_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                reason="no CUDA device")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch"))

import diphoma_compile  # noqa: E402

from models import GPT, MLP, OPTIMIZERS, classify_step, lm_batches, lm_step, mlp_batches  # noqa: E402,E501

STEPS = 3


@pytest.fixture(autouse=True)
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    if DEVICE == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def to_device(batch: dict) -> dict:
    return {k: v.to(DEVICE) for k, v in batch.items()}


def train(make_step, model, opt, batches):
    """Losses and final parameters after running ``make_step(model, opt, first)``'s step."""
    step = make_step(model, opt, batches[0])
    losses = [step(model, opt, b).detach().cpu() for b in batches]
    return losses, [p.detach().cpu().clone() for p in model.parameters()]


def pair(kind: str, opt_name: str, foreach: bool):
    torch.manual_seed(0)
    model = (MLP() if kind == "mlp" else GPT()).to(DEVICE)
    twin = copy.deepcopy(model)
    return (model, OPTIMIZERS[opt_name](model.parameters(), foreach),
            twin, OPTIMIZERS[opt_name](twin.parameters(), foreach))


CASES = [("mlp", "sgd_momentum", True), ("mlp", "adam", True), ("mlp", "adamw", False),
         ("gpt", "adamw", True), ("gpt", "adam", False), ("gpt", "sgd_momentum", False)]


@pytest.mark.parametrize("kind,opt_name,foreach", CASES)
def test_compile_fx_matches_eager_bit_for_bit(kind, opt_name, foreach):
    model, opt, twin, twin_opt = pair(kind, opt_name, foreach)
    step_fn = classify_step if kind == "mlp" else lm_step
    batches = [to_device(b) for b in (mlp_batches(STEPS) if kind == "mlp"
                                      else lm_batches(STEPS))]
    eager = train(lambda m, o, b: step_fn, twin, twin_opt, batches)
    ours = train(lambda m, o, b: diphoma_compile.compile(step_fn, m, o, b, codegen="fx"),
                 model, opt, batches)
    for a, b in zip(eager[0] + eager[1], ours[0] + ours[1]):
        assert torch.equal(a, b)
    # the optimizer's state lives with its parameters
    for p in model.parameters():
        for k, v in opt.state[p].items():
            want = torch.device("cpu") if k == "step" and not opt.defaults.get(
                "capturable") else p.device
            assert v.device.type == want.type, (k, v.device)


@pytest.mark.parametrize("kind,opt_name,foreach", CASES[:4])
def test_parallelize_one_device_matches_compile(kind, opt_name, foreach):
    model, opt, twin, twin_opt = pair(kind, opt_name, foreach)
    step_fn = classify_step if kind == "mlp" else lm_step
    batches = [to_device(b) for b in (mlp_batches(STEPS) if kind == "mlp"
                                      else lm_batches(STEPS))]
    eager = train(lambda m, o, b: step_fn, twin, twin_opt, batches)
    ours = train(lambda m, o, b: diphoma_compile.parallelize(step_fn, {"dp": 1},
                                                             codegen="fx"),
                 model, opt, batches)
    for a, b in zip(eager[0] + eager[1], ours[0] + ours[1]):
        assert torch.equal(a, b)


def test_inductor_close_to_eager():
    # SGD with momentum: Adam would divide the rounding noise of gradients that are exactly
    # zero in eager (the attention keys' bias) by itself, moving those weights by up to lr
    model, opt, twin, twin_opt = pair("gpt", "sgd_momentum", True)
    batches = [to_device(b) for b in lm_batches(STEPS)]
    eager = train(lambda m, o, b: lm_step, twin, twin_opt, batches)
    ours = train(lambda m, o, b: diphoma_compile.compile(lm_step, m, o, b, codegen="inductor"),
                 model, opt, batches)
    for a, b in zip(eager[0], ours[0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for a, b in zip(eager[1], ours[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
