"""Steps that once went wrong: aliasing outputs, random draws under cse, changed settings,
constants in maximum, empty dim lists, wrong dtypes."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import diphoma_compile  # noqa: E402
from diphoma_compile.errors import DiphomaError  # noqa: E402

from models import MLP, OPTIMIZERS, clipped_step, mlp_batches  # noqa: E402


def run_both(make_model, make_opt, step, data, passes=""):
    torch.manual_seed(0)
    model = make_model()
    ref = copy.deepcopy(model)
    opt, ref_opt = make_opt(model), make_opt(ref)
    compiled = diphoma_compile.compile(step, model, opt, data[0], passes=passes)
    for i, batch in enumerate(data):
        torch.manual_seed(10 + i)
        loss = compiled(model, opt, batch)
        torch.manual_seed(10 + i)
        ref_loss = step(ref, ref_opt, batch)
        assert torch.equal(loss, ref_loss), f"loss differs at step {i}"
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.equal(p.grad, q.grad), name
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        assert torch.equal(b, c), name
    for p, q in zip(model.parameters(), ref.parameters()):
        for k, v in ref_opt.state[q].items():
            assert torch.equal(opt.state[p][k], v), k
    return model, opt, compiled


class PrevSGD(torch.optim.SGD):
    """Keeps the parameter from before the update in its state (an output that is an input)."""

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                self.state[p]["prev"] = p.clone()
        return super().step(closure)


class Shifter(MLP):
    """Rebinds buffers: the new `prev` is the old `cur`."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cur", torch.zeros(4))
        self.register_buffer("prev", torch.zeros(4))

    def forward(self, x):
        out = super().forward(x)
        self.prev = self.cur
        self.cur = out.detach().mean(0)
        return out


def test_outputs_that_alias_inputs_are_written_back_correctly():
    data = mlp_batches(3)
    run_both(MLP, lambda m: PrevSGD(m.parameters(), lr=0.1), clipped_step, data)
    run_both(Shifter, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), clipped_step, data)


def noisy_step(model, opt, batch):
    noise = torch.normal(0.0, 1.0, size=(16, 4)) + torch.normal(0.0, 1.0, size=(16, 4))
    loss = F.cross_entropy(model(batch["x"]) + noise, batch["y"])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_random_draws_are_not_merged_or_dropped():
    model, opt, compiled = run_both(MLP, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                                    noisy_step, mlp_batches(3), passes="dce,cse")
    assert sum(op.attrs.get("rng") == "global" for op in compiled.graph.ops) == 2


class Clamped(MLP):
    def forward(self, x):
        h = torch.maximum(self.fc1(x), torch.tensor(0.0))
        return self.fc2(h) + h.amax() * 0 + h.sum(dim=[]) * 0 + h.mean(dim=[]) * 0


class Masked(MLP):
    """A bool mask built in the step with entries set True (how a key padding mask is
    built), and a True filled in: constants the IR's ``full`` holds as 1."""

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        mask = torch.zeros(x.shape[0], h.shape[1], dtype=torch.bool)
        mask[:, -1] = True
        keep = torch.full((h.shape[1],), True)
        return self.fc2(h.masked_fill(mask & keep, 0.0))


def test_a_bool_mask_set_true_in_the_step():
    run_both(Masked, lambda m: torch.optim.AdamW(m.parameters(), lr=0.01), clipped_step,
             mlp_batches(3))


def test_constant_operand_of_maximum_and_empty_dim_lists():
    run_both(Clamped, lambda m: torch.optim.Adam(m.parameters(), lr=0.01), clipped_step,
             mlp_batches(3))


def test_changed_hyperparameters_or_mode_are_refused():
    torch.manual_seed(0)
    model = MLP()
    opt = OPTIMIZERS["sgd_momentum"](model.parameters(), True)
    data = mlp_batches(2)
    compiled = diphoma_compile.compile(clipped_step, model, opt, data[0])
    compiled(model, opt, data[0])
    opt.param_groups[0]["momentum"] = 0.5
    with pytest.raises(DiphomaError, match="hyperparameters .other than lr.* changed"):
        compiled(model, opt, data[1])
    opt.param_groups[0]["momentum"] = 0.9
    model.eval()
    with pytest.raises(DiphomaError, match="train/eval mode"):
        compiled(model, opt, data[1])
    model.train()
    compiled(model, opt, data[1])


@pytest.mark.parametrize("change", ["other model", "other optimizer", "dict key order",
                                    "constant", "frozen", "unfrozen"])
def test_calls_the_trace_does_not_hold_are_refused(change):
    """Each of these ran silently wrong until a reviewer's probe (2026-12-05): the program
    trained the traced model and optimizer whatever was passed; a dict batch's leaves were
    bound by position, so keys in another order swapped inputs and labels; a constant
    argument kept its traced value; a parameter frozen (or unfrozen) between calls kept
    (or missed) its update. Each is a DiphomaError now, and the traced call still runs."""
    torch.manual_seed(0)
    model, other = MLP(), MLP()
    model.fc1.weight.requires_grad_(change != "unfrozen")
    opt = OPTIMIZERS["sgd"](model.parameters(), True)

    def step(model, opt, batch, scale):
        loss = F.cross_entropy(model(batch["x"]), batch["y"]) * scale
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    b = mlp_batches(1)[0]
    compiled = diphoma_compile.compile(step, model, opt, b, 1.0)
    args = [model, opt, b, 1.0]
    if change == "other model":
        args[0] = other
        words = r"args\[0\] is another MLP than the MLP the step was traced with"
    elif change == "other optimizer":
        args[1] = OPTIMIZERS["sgd"](model.parameters(), True)
        words = r"args\[1\] is another SGD"
    elif change == "dict key order":
        args[2] = {"y": b["y"], "x": b["x"]}
        words = "another structure than it was traced with .* a dict with its keys"
    elif change == "constant":
        args[3] = 0.5
        words = "args.3. was 1.0 when the step was traced and is 0.5 now"
    else:
        model.fc1.weight.requires_grad_(change == "unfrozen")
        words = r"which parameters are trained \(requires_grad\)"
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(DiphomaError, match=words):
        compiled(*args)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    model.fc1.weight.requires_grad_(change != "unfrozen")
    compiled(model, opt, b, 1.0)


def test_wrong_dtype_at_call_time():
    model = MLP()
    opt = OPTIMIZERS["sgd"](model.parameters(), True)
    data = mlp_batches(1)
    compiled = diphoma_compile.compile(clipped_step, model, opt, data[0])
    bad = {"x": data[0]["x"].double(), "y": data[0]["y"]}
    with pytest.raises(DiphomaError, match="dtype f32, called with .* torch.float64"):
        compiled(model, opt, bad)


def test_two_modules_sharing_a_submodule():
    torch.manual_seed(0)
    shared = nn.Linear(8, 8)
    a, b = nn.Sequential(shared, nn.ReLU()), nn.Sequential(shared, nn.Linear(8, 4))
    opt = torch.optim.SGD(list(a.parameters()) + list(b[1].parameters()), lr=0.1)

    def step(a, b, opt, batch):
        loss = F.cross_entropy(b(a(batch["x"])), batch["y"])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    g = diphoma_compile.trace(step, a, b, opt, mlp_batches(1)[0])
    names = [i.name for i in g.inputs if i.role.kind.value == "param"]
    assert names == ["a.0.weight", "a.0.bias", "b.1.weight", "b.1.bias"]


def zero_first_step(model, opt, batch):
    opt.zero_grad()
    loss = F.cross_entropy(model(batch["x"]), batch["y"])
    loss.backward()
    opt.step()
    return loss


def test_zero_grad_first_leaves_the_same_grads_as_eager():
    model, opt, compiled = run_both(MLP, lambda m: OPTIMIZERS["adamw"](m.parameters(), True),
                                    zero_first_step, mlp_batches(3))
    assert all(p.grad is not None for p in model.parameters())
    assert sum(o.role.kind.value == "other" for o in compiled.graph.outputs) == 4


def test_accumulating_step_is_refused():
    def step(model, opt, batch):
        loss = F.cross_entropy(model(batch["x"]), batch["y"])
        loss.backward()
        opt.step()
        return loss
    model = MLP()
    opt = OPTIMIZERS["sgd"](model.parameters(), True)
    with pytest.raises(DiphomaError, match="each call's gradients would be added to what the last"):
        diphoma_compile.trace(step, model, opt, mlp_batches(1)[0])


def zero_last_step(model, opt, batch):
    loss = F.cross_entropy(model(batch["x"]), batch["y"])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    return loss


def test_zero_grad_to_zeros_after_the_step_runs_as_eager():
    """``opt.zero_grad(set_to_none=False)`` after the step leaves zeros in .grad, which the
    next call's backward adds to (refused before, as if they were gradients): bit for bit
    as eager over three steps (SGD momentum), zeros left in .grad. Gradients changed
    between calls are refused; zeros put back are not."""
    model, opt, compiled = run_both(MLP, lambda m: OPTIMIZERS["sgd"](m.parameters(), True),
                                    zero_last_step, mlp_batches(3))
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    data = mlp_batches(1)
    model.fc1.weight.grad.add_(1.0)          # a gradient the next call would add to
    with pytest.raises(DiphomaError, match="holds a .grad"):
        compiled(model, opt, data[0])
    model.fc1.weight.grad = torch.zeros_like(model.fc1.weight)
    compiled(model, opt, data[0])


def test_zero_grad_to_zeros_of_one_optimizer_leaving_anothers_grads_is_refused():
    """Two optimizers, one zeroing its gradients to zeros, the other's left as they are:
    the other's would be added to."""
    model = MLP()
    first = torch.optim.SGD(model.fc1.parameters(), lr=0.1)
    second = torch.optim.SGD(model.fc2.parameters(), lr=0.1)

    def step(model, first, second, batch):
        loss = F.cross_entropy(model(batch["x"]), batch["y"])
        loss.backward()
        first.step()
        second.step()
        first.zero_grad(set_to_none=False)
        return loss
    with pytest.raises(DiphomaError, match="each call's gradients would be added to what the last"):
        diphoma_compile.trace(step, model, first, second, mlp_batches(1)[0])


def test_leftover_grad_with_a_step_that_clears_late_is_refused():
    model = MLP()
    opt = OPTIMIZERS["sgd"](model.parameters(), True)
    data = mlp_batches(1)
    compiled = diphoma_compile.compile(clipped_step, model, opt, data[0])
    clipped_step(model, opt, data[0])   # eager: clears after the step, .grad is None
    model.fc1.weight.grad = torch.ones_like(model.fc1.weight)
    with pytest.raises(DiphomaError, match="holds a .grad"):
        compiled(model, opt, data[0])


@pytest.mark.parametrize("make_opt, words", [
    (lambda ps: torch.optim.NAdam(ps, lr=1e-2), "NAdam has no state yet"),
    (lambda ps: torch.optim.Rprop(ps, lr=1e-2), "Rprop has no state yet"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5),
     "copies the first gradient into its momentum buffer"),
], ids=["nadam", "rprop", "sgd-dampening"])
def test_fresh_optimizer_that_does_not_start_from_zeros_is_refused(make_opt, words):
    """Their first step initializes state to non-zero values (NAdam's mu_product, Rprop's
    step sizes) or differs from later steps: the traced later-step program would drift.
    After one eager step the same optimizer runs exactly as eager."""
    data = mlp_batches(3)
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref.parameters())
    compiled = diphoma_compile.compile(clipped_step, model, opt, data[0])
    with pytest.raises(DiphomaError, match=words):
        compiled(model, opt, data[0])
    for m, o in ((model, opt), (ref, ref_opt)):
        clipped_step(m, o, data[0])          # one eager step: the optimizer has its state
    for batch in data[1:]:
        compiled(model, opt, batch)
        clipped_step(ref, ref_opt, batch)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def accumulating_step(model, opt, batch):
    """Gradient accumulation over two micro-batches: two backward() calls, one update."""
    x, y = batch["x"], batch["y"]
    n = x.shape[0] // 2
    for xs, ys in ((x[:n], y[:n]), (x[n:], y[n:])):
        loss = F.cross_entropy(model(xs), ys) / 2
        loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_gradient_accumulation_over_micro_batches():
    """The second micro-batch's forward runs after the first backward: it is forward, not
    update, so the step traces, runs as eager does, and syncs each gradient once."""
    run_both(MLP, lambda m: OPTIMIZERS["adamw"](m.parameters(), True), accumulating_step,
             mlp_batches(3))
    torch.manual_seed(0)
    model = MLP()
    opt = OPTIMIZERS["sgd_momentum"](model.parameters(), True)
    pstep = diphoma_compile.parallelize(accumulating_step, {"dp": 4})
    pstep.trace(model, opt, mlp_batches(1)[0])
    g = pstep.graph
    dots = [op for op in g.ops if op.name == "opaque" and "addmm" in str(op.attrs["target"])]
    assert [op.phase.value for op in dots] == ["forward"] * 4   # two layers, two micro-batches
    synced = [n for op in g.ops if op.name == "reduce_scatter" for n in op.inputs]
    assert len(synced) == len(set(synced)) == len(list(model.parameters()))


def test_fused_optimizer_is_refused_by_name():
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    with pytest.raises(DiphomaError, match=r"Adam\(fused=True\) runs one fused kernel"):
        diphoma_compile.trace(clipped_step, model, opt, mlp_batches(1)[0])


@pytest.mark.parametrize("opt_name", ["adam", "adamw", "sgd"])
def test_a_tensor_learning_rate_is_bit_exact(opt_name):
    """``lr=torch.tensor(...)``: eager's optimizer does its step-size math in the tensor's
    float32, so the trace binds a float32 tensor too (it bound a Python double and Adam's
    parameters drifted by 3e-8); a new value set in place between steps is read."""
    make = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW,
            "sgd": lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9)}[opt_name]
    model, opt, compiled = run_both(MLP, lambda m: make(m.parameters(), lr=torch.tensor(1e-2)),
                                    clipped_step, mlp_batches(3))
    ref = copy.deepcopy(model)
    ref_opt = make(ref.parameters(), lr=torch.tensor(1e-2))
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))   # (its tensors, not shared)
    for o in (opt, ref_opt):
        o.param_groups[0]["lr"].fill_(3e-3)
    for batch in mlp_batches(2):
        assert torch.equal(compiled(model, opt, batch), clipped_step(ref, ref_opt, batch))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


def test_keyword_arguments_at_call_time_are_refused_by_name():
    """step(model=..., opt=..., batch=...) was a bare TypeError from the runtime's
    signature."""
    model = MLP()
    opt = OPTIMIZERS["sgd"](model.parameters(), True)
    b = mlp_batches(1)[0]
    compiled = diphoma_compile.compile(clipped_step, model, opt, b)
    with pytest.raises(DiphomaError, match=r"keyword arguments \(model, opt, batch\)"):
        compiled(model=model, opt=opt, batch=b)
