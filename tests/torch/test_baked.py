"""What a torch trace holds that may change between calls (torch/pystate.py, runtime.py):
a scalar the step's code reads from its globals or closure, changed between calls, is
refused naming it; a module's scalar attribute changed is warned of once; a parameter
replaced by another tensor is refused."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import diphoma_compile  # noqa: E402
from diphoma_compile.errors import DiphomaError, DiphomaWarning  # noqa: E402
from diphoma_compile.torch.pystate import step_reads  # noqa: E402

KL = 1.0
CFG = {"kl": 1.0, "clip": 10.0}
shape = 3       # a global named like an attribute the step reads (x.shape): not watched


class Tempered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 3)
        self.temp = 1.0

    def forward(self, x):
        return self.fc(x) / self.temp


def global_step(model, opt, x, y):
    out = model(x)
    loss = F.cross_entropy(out, y) + KL * out.pow(2).mean() + 0 * x.shape[0]
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CFG["clip"])
    opt.step()
    opt.zero_grad()
    return loss


def _setup():
    torch.manual_seed(0)
    model = Tempered()
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 8), \
        torch.randint(0, 3, (4,))


def test_what_a_step_reads_is_found():
    """The globals the step loads (a number, a dict of numbers) and its closure's numbers;
    not functions or modules, nor a global that shares an attribute's name."""
    weight = 0.5

    def closure_step(model, opt, x, y):
        return F.cross_entropy(model(x), y) * weight

    assert [n for n, _, _ in step_reads(global_step)] == ["global KL", "global CFG"]
    assert [n for n, _, _ in step_reads(closure_step)] == ["closure variable weight"]


@pytest.mark.parametrize("change", ["global", "dict", "closure"])
def test_a_value_the_step_reads_changed_between_calls_is_refused(change):
    """Annealing a KL weight by reassigning a global (or a closure variable) ran the old
    value with no word until 2026-12-07: the trace holds it; refused now. A config dict's
    entry changed is warned of (the step may read another entry of it)."""
    global KL
    scale = 1.0

    def closure_step(model, opt, x, y):
        loss = F.cross_entropy(model(x), y) * scale
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    fn = closure_step if change == "closure" else global_step
    model, opt, x, y = _setup()
    step = diphoma_compile.compile(fn, model, opt, x, y)
    step(model, opt, x, y)
    try:
        if change == "global":
            KL = 2.0
        elif change == "dict":
            CFG["clip"] = 0.5
        else:
            scale = 3.0      # read by the closure
        want = {"global": "global KL: 1.0 -> 2.0", "closure": "closure variable scale",
                "dict": "global CFG"}[change]
        if change == "dict":
            # (a config dict the loop moves other entries of: warned, not refused)
            with pytest.warns(DiphomaWarning, match=want):
                step(model, opt, x, y)
        else:
            with pytest.raises(DiphomaError, match=want):
                step(model, opt, x, y)
    finally:
        KL, scale = 1.0, 1.0
        CFG["clip"] = 10.0
    step(model, opt, x, y)       # back to the traced values: runs again


@dataclasses.dataclass
class Options:
    clip: float = 10.0


OPTIONS = Options()


class Trainer:
    """A trainer object whose method is the step, reading a weight off itself and a clip
    off a global config object."""

    def __init__(self) -> None:
        self.kl = 1.0

    def step(self, model, opt, x, y):
        out = model(x)
        loss = F.cross_entropy(out, y) + self.kl * out.pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIONS.clip)
        opt.step()
        opt.zero_grad()
        return loss


@pytest.mark.parametrize("change", ["self", "config object"])
def test_an_attribute_the_step_reads_changed_between_calls_is_refused(change):
    """``self.kl`` and ``OPTIONS.clip`` (a dataclass): the trace holds the values read
    then, and nothing watched them (a review's probe, 2026-12-07: a KL weight annealed on
    the trainer trained at its first value). Put back, the step runs again."""
    model, opt, x, y = _setup()
    trainer = Trainer()
    assert [n for n, _, _ in step_reads(trainer.step)] == ["self.kl", "global OPTIONS.clip"]
    step = diphoma_compile.compile(trainer.step, model, opt, x, y)
    step(model, opt, x, y)
    if change == "self":
        trainer.kl = 0.5
        want = r"self.kl: 1.0 -> 0.5 changed since the step was traced"
    else:
        OPTIONS.clip = 0.5
        want = r"global OPTIONS.clip: 10.0 -> 0.5 changed since the step was traced"
    try:
        with pytest.raises(DiphomaError, match=want):
            step(model, opt, x, y)
    finally:
        trainer.kl, OPTIONS.clip = 1.0, 10.0
    step(model, opt, x, y)


def test_a_module_attribute_changed_is_warned_of_once():
    """``model.temp`` set between calls: the trace holds the old temperature. It is warned
    of (the forward may not read it: a counter kept on the model), once per change."""
    model, opt, x, y = _setup()
    step = diphoma_compile.compile(global_step, model, opt, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DiphomaWarning)
        step(model, opt, x, y)
    model.temp = 2.0
    with pytest.warns(DiphomaWarning, match=r"model.temp: 1.0 -> 2.0 changed since"):
        step(model, opt, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DiphomaWarning)
        step(model, opt, x, y)


def test_a_replaced_parameter_is_refused():
    """A head re-initialised by assigning a new module between calls: the program trained
    the new parameters while the optimizer (and eager) held the old ones, with no word
    (a review, 2026-12-07); values copied into the old parameter in place keep working."""
    model, opt, x, y = _setup()
    step = diphoma_compile.compile(global_step, model, opt, x, y)
    step(model, opt, x, y)
    old = model.fc
    model.fc = nn.Linear(8, 3)
    with pytest.raises(DiphomaError, match="the parameter fc.weight is another tensor"):
        step(model, opt, x, y)
    model.fc = old
    with torch.no_grad():
        old.weight.copy_(torch.zeros(3, 8))
    step(model, opt, x, y)


def test_a_generator_of_the_steps_own_is_refused_with_what_to_do():
    """``torch.rand(..., generator=g)``: the error named only "a value of type Generator
    where a tensor was expected" (a review, 2026-12-07)."""
    from diphoma_compile.errors import UnsupportedOpError
    gen = torch.Generator().manual_seed(5)

    def step(model, opt, x, y):
        keep = (torch.rand(x.shape, generator=gen) > 0.3).to(x.dtype)
        loss = F.cross_entropy(model(x * keep), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    model, opt, x, y = _setup()
    with pytest.raises(UnsupportedOpError, match="a torch.Generator of its own") as e:
        diphoma_compile.compile(step, model, opt, x, y)
    assert "torch.manual_seed" in str(e.value)


def test_a_call_at_another_batch_size_says_what_to_do():
    model, opt, x, y = _setup()
    step = diphoma_compile.compile(global_step, model, opt, x, y)
    with pytest.raises(DiphomaError, match="drop_last=True"):
        step(model, opt, x[:3], y[:3])


def test_donate_on_a_torch_step_is_warned_of():
    """``donate=`` is JAX's; a PyTorch step updates the live tensors whatever it says
    (it was ignored with no word, a review found, 2026-12-07)."""
    model, opt, x, y = _setup()
    with pytest.warns(DiphomaWarning, match="donate=False is for JAX steps"):
        diphoma_compile.parallelize(global_step, {"dp": 1}, donate=False).trace(
            model, opt, x, y)
