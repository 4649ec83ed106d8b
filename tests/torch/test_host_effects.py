"""What a step does on the host besides tensor math: replayed around the compiled program
where eager runs it (LR schedulers, torch.manual_seed), or refused at trace time (Python
counters, parameter-group edits, GradScaler, loose EMA tensors, print and logging, Python's
generator). Never run once at trace time and then dropped."""

from __future__ import annotations

import copy
import logging
import random

import pytest

torch = pytest.importorskip("torch")

import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import diphoma_compile  # noqa: E402
from diphoma_compile.errors import DiphomaError, FrontendError  # noqa: E402

from models import MLP, mlp_batches  # noqa: E402

sched_lib = torch.optim.lr_scheduler


def pair(make_opt=lambda ps: torch.optim.SGD(ps, lr=0.1), model=MLP):
    """A model and optimizer, and an identical copy of both for the eager reference."""
    torch.manual_seed(0)
    m = model()
    r = copy.deepcopy(m)
    return m, make_opt(m.parameters()), r, make_opt(r.parameters())


def assert_same(model, ref):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name


def loss_of(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"])


# ------------------------------------------------------------------ schedulers, replayed

def sched_after_step(model, opt, sched, batch):
    loss = loss_of(model, batch)
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    return loss


def test_step_lr_inside_the_step_runs_each_call():
    """StepLR stepped after opt.step() inside the step halves the lr every call, as eager."""
    m, opt, r, ref_opt = pair()
    sched, ref_sched = sched_lib.StepLR(opt, 1, 0.5), sched_lib.StepLR(ref_opt, 1, 0.5)
    data = mlp_batches(4)
    step = diphoma_compile.compile(sched_after_step, m, opt, sched, data[0])
    for b in data:
        assert torch.equal(step(m, opt, sched, b), sched_after_step(r, ref_opt, ref_sched, b))
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    assert sched.last_epoch == ref_sched.last_epoch == 4, "the trace stepped the scheduler"
    assert sched.get_last_lr() == ref_sched.get_last_lr() == [0.1 * 0.5 ** 4]
    assert_same(m, r)
    assert [(e.what, e.when) for e in step.captured.effects] == [("StepLR.step()", "after")]


def test_warm_restarts_inside_the_step_runs_each_call():
    """CosineAnnealingWarmRestarts' step() does not count its steps (_step_count stays 0),
    which was read as "created inside the step" and refused (a reviewer's probe); it is
    replayed each call, restarts included, as eager."""
    m, opt, r, ref_opt = pair()
    sched = sched_lib.CosineAnnealingWarmRestarts(opt, T_0=2)
    ref_sched = sched_lib.CosineAnnealingWarmRestarts(ref_opt, T_0=2)
    data = mlp_batches(5)
    step = diphoma_compile.compile(sched_after_step, m, opt, sched, data[0])
    for b in data:
        assert torch.equal(step(m, opt, sched, b), sched_after_step(r, ref_opt, ref_sched, b))
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    assert sched.last_epoch == ref_sched.last_epoch == 5
    assert_same(m, r)
    with pytest.raises(FrontendError, match="a StepLR is created inside the step"):
        diphoma_compile.compile(lambda m, o, b: sched_after_step(m, o, sched_lib.StepLR(o, 1),
                                                                 b), m, opt, data[0])


def warmup_first(model, opt, sched, batch):
    sched.step()              # before opt.step(): this call's update uses the new lr
    loss = loss_of(model, batch)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


@pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")
def test_scheduler_before_the_optimizer_step_sets_this_calls_lr():
    m, opt, r, ref_opt = pair()

    def warm(s):
        return (s + 1) / 4
    sched, ref_sched = sched_lib.LambdaLR(opt, warm), sched_lib.LambdaLR(ref_opt, warm)
    data = mlp_batches(4)
    step = diphoma_compile.compile(warmup_first, m, opt, sched, data[0])
    for b in data:
        assert torch.equal(step(m, opt, sched, b), warmup_first(r, ref_opt, ref_sched, b))
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    assert_same(m, r)
    assert step.captured.effects[0].when == "before"


OPTS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "sgd_momentum_foreach": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9,
                                                       foreach=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
}


def plain_step(model, opt, batch):
    loss = loss_of(model, batch)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


@pytest.mark.parametrize("where", ["inside", "outside"])
@pytest.mark.parametrize("opt_name", list(OPTS))
def test_one_cycle_cycling_momentum_matches_eager(opt_name, where):
    """OneCycleLR's default cycle_momentum=True writes betas[0] (Adam) or momentum (SGD)
    every step: those become graph inputs, read each call, so the step runs bit for bit as
    eager whether the scheduler is stepped inside the step or between calls."""
    m, opt, r, ref_opt = pair(OPTS[opt_name])
    sched = sched_lib.OneCycleLR(opt, max_lr=0.05, total_steps=10)
    ref_sched = sched_lib.OneCycleLR(ref_opt, max_lr=0.05, total_steps=10)
    data = mlp_batches(4)
    if where == "inside":
        step = diphoma_compile.compile(sched_after_step, m, opt, sched, data[0])
    else:
        step = diphoma_compile.compile(plain_step, m, opt, data[0])
    for b in data:
        if where == "inside":
            got, want = step(m, opt, sched, b), sched_after_step(r, ref_opt, ref_sched, b)
        else:
            got, want = step(m, opt, b), plain_step(r, ref_opt, b)
            sched.step()
            ref_sched.step()
        assert torch.equal(got, want)
    key = "betas" if "adam" in opt_name else "momentum"
    assert opt.param_groups[0][key] == ref_opt.param_groups[0][key]
    assert_same(m, r)
    for p, q in zip(m.parameters(), r.parameters()):
        for k, v in ref_opt.state[q].items():
            assert torch.equal(opt.state[p][k], v), k
    hyper = [i.name for i in step.graph.inputs if i.role.kind.value == "hyper"]
    assert hyper == ["lr", "beta1" if "adam" in opt_name else "momentum"]


def test_momentum_input_keeps_its_sign():
    """The optimizer branches on momentum != 0: a trace made with momentum > 0 refuses to
    run once it is 0."""
    m, opt, _, _ = pair(OPTS["sgd_momentum"])
    sched_lib.OneCycleLR(opt, max_lr=0.05, total_steps=10)
    data = mlp_batches(1)
    step = diphoma_compile.compile(plain_step, m, opt, data[0])
    opt.param_groups[0]["momentum"] = 0.0
    with pytest.raises(DiphomaError, match="momentum is 0.0 now; it was positive"):
        step(m, opt, data[0])


def two_updates(model, opt, sched, batch):
    for half in (slice(0, 8), slice(8, 16)):
        loss = F.cross_entropy(model(batch["x"][half]), batch["y"][half])
        loss.backward()
        opt.step()
        opt.zero_grad()
        if half.start == 0:
            sched.step()      # between the two updates: the second one uses the new lr
    return loss


def lr_after_scheduler(model, opt, sched, batch):
    loss = sched_after_step(model, opt, sched, batch)
    return loss, loss * opt.param_groups[0]["lr"]    # eager reads the scheduler's new lr


def last_lr(model, opt, sched, batch):
    loss = sched_after_step(model, opt, sched, batch)
    return loss * sched.get_last_lr()[0]


def plateau(model, opt, sched, batch):
    loss = plain_step(model, opt, batch)
    sched.step(loss)
    return loss


@pytest.mark.parametrize("fn, make, words", [
    # the second opt.step() would read an lr the scheduler changes on the host, after the
    # program; a second update in one step is refused first (since 2026-12-05)
    (two_updates, lambda o: sched_lib.StepLR(o, 1, 0.5), "the step runs backward() again "
     "after SGD.step() at test_host_effects.py"),
    (lr_after_scheduler, lambda o: sched_lib.StepLR(o, 1, 0.5), "reads the optimizer's 'lr'"),
    (last_lr, lambda o: sched_lib.StepLR(o, 1, 0.5), "StepLR.get_last_lr() is called inside"),
    (plateau, lambda o: sched_lib.ReduceLROnPlateau(o), "ReduceLROnPlateau.step(metric)"),
])
def test_scheduler_uses_that_cannot_be_replayed_are_refused(fn, make, words):
    m, opt, _, _ = pair()
    sched = make(opt)
    before = copy.deepcopy(sched.state_dict())
    with pytest.raises(FrontendError, match=words.replace("(", r"\(").replace(")", r"\)")):
        diphoma_compile.compile(fn, m, opt, sched, mlp_batches(1)[0])
    assert sched.state_dict() == before
    assert opt.param_groups[0]["lr"] == 0.1


# ------------------------------------------------------------------ torch.manual_seed

class DropMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(F.dropout(torch.relu(self.fc1(x)), 0.3, training=self.training))


def seeded(model, opt, batch):
    torch.manual_seed(1234)       # the same dropout masks on every call
    return plain_step(model, opt, batch)


def test_manual_seed_inside_the_step_is_replayed_each_call():
    m, opt, r, ref_opt = pair(model=DropMLP)
    data = mlp_batches(3)
    step = diphoma_compile.compile(seeded, m, opt, data[0])
    for b in data:
        torch.manual_seed(0)      # whatever the state before: the step re-seeds
        got = step(m, opt, b)
        after = torch.rand(3)     # the generator continues where eager's does
        torch.manual_seed(0)
        assert torch.equal(got, seeded(r, ref_opt, b))
        assert torch.equal(after, torch.rand(3))
    assert_same(m, r)


def seeded_between_draws(model, opt, batch):
    h = F.dropout(model.fc1(batch["x"]), 0.3)
    torch.manual_seed(5)
    loss = F.cross_entropy(model.fc2(F.dropout(torch.relu(h), 0.3)), batch["y"])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_manual_seed_between_random_draws_is_refused():
    m, opt, _, _ = pair(model=DropMLP)
    state = torch.get_rng_state()
    with pytest.raises(FrontendError, match=r"torch.manual_seed\(5\) is called inside the "
                                            r"step at test_host_effects.py:\d+ between random"):
        diphoma_compile.compile(seeded_between_draws, m, opt, mlp_batches(1)[0])
    assert torch.equal(torch.get_rng_state(), state)


# ------------------------------------------------------------------ Python values

class Trainer:
    def __init__(self) -> None:
        self.steps = 0
        self.history: list = []

    def count(self, model, opt, batch):
        self.steps += 1
        return plain_step(model, opt, batch)

    def keep_last(self, model, opt, batch):
        self.last = plain_step(model, opt, batch)
        return self.last

    def remember(self, model, opt, batch):
        loss = plain_step(model, opt, batch)
        self.history.append(loss.detach())
        return loss


COUNT = 0


def global_counter(model, opt, batch):
    global COUNT
    COUNT += 1
    return plain_step(model, opt, batch)


def closure_counter():
    calls = {"n": 0}

    def step(model, opt, batch):
        calls["n"] += 1
        return plain_step(model, opt, batch)
    return step, lambda: calls["n"]


def arg_counter(model, opt, batch, info):
    info["steps"] += 1
    return plain_step(model, opt, batch)


class CountingMLP(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


def test_python_counters_are_refused_and_put_back():
    data = mlp_batches(1)
    t = Trainer()
    step, calls = closure_counter()
    info = {"steps": 0}
    cases = [(t.count, (), lambda: t.steps, "self.steps from 0 to 1"),
             (t.remember, (), lambda: len(t.history), "the contents of self.history"),
             (t.keep_last, (), lambda: int(hasattr(t, "last")), "sets self.last while"),
             (global_counter, (), lambda: COUNT, "COUNT from 0 to 1"),
             (step, (), calls, "the contents of calls"),
             (arg_counter, (info,), lambda: info["steps"], "its argument info.steps from 0 to 1")]
    for fn, extra, value, words in cases:
        m, opt, _, _ = pair()
        with pytest.raises(FrontendError, match=words) as e:
            diphoma_compile.compile(fn, m, opt, data[0], *extra)
        assert "register_buffer" in str(e.value)
        assert value() == 0, f"{words}: not put back"
    m, opt, _, _ = pair(model=CountingMLP)
    with pytest.raises(FrontendError, match="module0.calls from 0 to 1"):
        diphoma_compile.compile(plain_step, m, opt, data[0])
    assert m.calls == 0


def halve_lr(model, opt, batch):
    loss = plain_step(model, opt, batch)
    for g in opt.param_groups:
        g["lr"] = g["lr"] * 0.5
    return loss


def more_decay(model, opt, batch):
    for g in opt.param_groups:
        g["weight_decay"] = g["weight_decay"] + 0.01
    return plain_step(model, opt, batch)


@pytest.mark.parametrize("fn, key", [(halve_lr, "lr"), (more_decay, "weight_decay")])
def test_param_group_edits_inside_the_step_are_refused(fn, key):
    m, opt, _, _ = pair()
    before = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    with pytest.raises(FrontendError, match=rf"sets param_groups\[0\]\['{key}'\] of SGD"):
        diphoma_compile.compile(fn, m, opt, mlp_batches(1)[0])
    assert {k: v for k, v in opt.param_groups[0].items() if k != "params"} == before


# ------------------------------------------------------------------ GradScaler

def scaled(scaler):
    def step(model, opt, batch):
        loss = loss_of(model, batch)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return loss
    return step


def test_grad_scaler_is_refused_unless_disabled():
    m, opt, r, ref_opt = pair()
    scaler = torch.amp.GradScaler("cpu")
    data = mlp_batches(3)
    with pytest.raises(FrontendError, match=r"GradScaler.scale\(\) is called inside the step"):
        diphoma_compile.compile(scaled(scaler), m, opt, data[0])
    assert scaler._scale is None, "the trace left a traced tensor in the scaler"
    off = torch.amp.GradScaler("cpu", enabled=False)
    step = diphoma_compile.compile(scaled(off), m, opt, data[0])
    for b in data:
        assert torch.equal(step(m, opt, b), scaled(off)(r, ref_opt, b))
    assert_same(m, r)


# ------------------------------------------------------------------ EMA weights

def ema_step(model, opt, ema, batch):
    loss = plain_step(model, opt, batch)
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.mul_(0.9).add_(p, alpha=0.1)
    return loss


def ema_list_step(model, opt, ema, batch):
    loss = plain_step(model, opt, batch)
    with torch.no_grad():
        for e, p in zip(ema, model.parameters()):
            e.mul_(0.9).add_(p, alpha=0.1)
    return loss


def test_ema_weights_in_a_module_are_state_and_loose_ones_are_refused():
    m, opt, r, ref_opt = pair()
    ema, ref_ema = copy.deepcopy(m), copy.deepcopy(r)
    data = mlp_batches(3)
    step = diphoma_compile.compile(ema_step, m, opt, ema, data[0])
    for b in data:
        assert torch.equal(step(m, opt, ema, b), ema_step(r, ref_opt, ref_ema, b))
    assert_same(ema, ref_ema)
    assert_same(m, r)
    # a list of tensors passed in: updated in place, which the program cannot write back
    loose = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(FrontendError, match="updates its argument ema.0 in place"):
        diphoma_compile.compile(ema_list_step, m, opt, loose, data[0])
    # the same list in the closure: a tensor the trace does not know
    with pytest.raises(FrontendError, match="neither an argument of the step nor"):
        diphoma_compile.compile(lambda model, o, b: ema_list_step(model, o, loose, b),
                                m, opt, data[0])


# ------------------------------------------------------------------ print, logging, random

def printing(model, opt, batch):
    loss = plain_step(model, opt, batch)
    print("loss", loss)
    return loss


def logging_step(model, opt, batch):
    loss = plain_step(model, opt, batch)
    logging.getLogger("diphoma-test").warning("step done")
    return loss


def python_random(model, opt, batch):
    x = batch["x"].flip(0) if random.random() < 0.5 else batch["x"]
    return plain_step(model, opt, {"x": x, "y": batch["y"]})


@pytest.mark.parametrize("fn, words", [
    (printing, r"print\(\) inside the step at test_host_effects.py:\d+"),
    (logging_step, r"logging inside the step at test_host_effects.py:\d+"),
    (python_random, "draws from or seeds random's generator"),
])
def test_print_logging_and_python_random_are_refused(fn, words):
    m, opt, _, _ = pair()
    state = random.getstate()
    with pytest.raises(FrontendError, match=words):
        diphoma_compile.compile(fn, m, opt, mlp_batches(1)[0])
    assert random.getstate() == state
