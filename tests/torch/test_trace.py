"""The traced IR of PyTorch steps: goldens, roles, schedulers, dropout, errors."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

import diphoma_compile  # noqa: E402
from diphoma_compile.errors import FrontendError  # noqa: E402
from diphoma_compile.ir import (InputKind, OutputKind, Phase, parse, print_graph,  # noqa: E402
                                verify)

from models import (GPT, MLP, OPTIMIZERS, classify_step, clipped_step, lm_batches,  # noqa: E402
                     lm_step, mlp_batches)


def mlp_graph(opt_name: str):
    torch.manual_seed(0)
    model = MLP()
    opt = OPTIMIZERS[opt_name](model.parameters(), True)
    return diphoma_compile.trace(clipped_step, model, opt, mlp_batches(1)[0])


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_mlp_golden(opt_name, golden):
    g = mlp_graph(opt_name)
    text = print_graph(g)
    assert parse(text) == g
    golden(f"torch_mlp_{opt_name}.ir", text)


def test_roles_names_and_phases():
    g = mlp_graph("adamw")
    roles = {i.name: i.role for i in g.inputs}
    assert roles["fc1.weight"].kind is InputKind.param
    assert roles["fc1.weight.exp_avg"].kind is InputKind.opt_state
    assert roles["fc1.weight.exp_avg"].of == "fc1.weight"
    assert roles["fc1.weight.step"].slot == "step"
    assert roles["lr"].kind is InputKind.hyper
    assert roles["batch.x"].kind is InputKind.batch
    replaced = {o.role.target for o in g.outputs if o.role.kind is OutputKind.replaces}
    assert {"fc1.weight", "fc2.bias", "fc1.weight.exp_avg", "fc2.bias.step"} <= replaced
    assert g.outputs[0].role.kind is OutputKind.loss
    phases = [op.phase for op in g.ops]
    assert phases.index(Phase.backward) > 0 and phases.index(Phase.update) > \
        phases.index(Phase.backward)
    assert sorted(phases, key=[Phase.forward, Phase.backward, Phase.update].index) == phases
    assert any(op.loc and op.loc.startswith("models.py:") for op in g.ops)
    # no in-place op survives
    for op in g.walk():
        target = str(op.attrs.get("target", ""))
        assert not target.split(".")[1].endswith("_") if target.startswith("aten.") else True


def test_learning_rate_and_step_are_inputs_so_schedulers_work():
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0123)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.0123)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    data = mlp_batches(6)
    compiled = diphoma_compile.compile(clipped_step, model, opt, data[0])
    for batch in data:
        assert torch.equal(compiled(model, opt, batch), clipped_step(ref, ref_opt, batch))
        sched.step()
        ref_sched.step()
    assert opt.param_groups[0]["lr"] == 0.0123 * 0.5 ** 3
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    assert all(not (op.name == "full" and op.attrs.get("value") == 0.0123) for op in
               compiled.graph.ops), "the learning rate is baked into the graph"


def test_dropout_matches_eager_with_a_fixed_seed():
    torch.manual_seed(0)
    model = GPT(dropout=0.2)
    ref = copy.deepcopy(model)
    opt = OPTIMIZERS["adamw"](model.parameters(), True)
    ref_opt = OPTIMIZERS["adamw"](ref.parameters(), True)
    data = lm_batches(3)
    compiled = diphoma_compile.compile(lm_step_dropout, model, opt, data[0])
    rng_ops = [op for op in compiled.graph.ops if op.attrs.get("rng") == "global"]
    assert rng_ops and all(op.attrs.get("effectful") for op in rng_ops)
    for i, batch in enumerate(data):
        torch.manual_seed(100 + i)
        loss = compiled(model, opt, batch)
        torch.manual_seed(100 + i)
        assert torch.equal(loss, lm_step_dropout(ref, ref_opt, batch))
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_dropout_on_a_transposed_activation_draws_eager_mask():
    """nn.TransformerEncoderLayer(batch_first=True) applies dropout to attention's output,
    a transposed view: eager draws into ``empty_like(x)`` with x's strides, so the program
    does too (the functional ``bernoulli.p`` draws into a contiguous tensor: the same
    numbers on other elements, a loss 4e-3 off)."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.3, batch_first=True)
    ref = copy.deepcopy(layer)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (layer, ref))

    def step(model, opt, x):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    xs = [torch.randn(4, 6, 16) for _ in range(3)]
    compiled = diphoma_compile.compile(step, layer, opt, xs[0])
    for i, x in enumerate(xs):
        torch.manual_seed(10 + i)
        loss = compiled(layer, opt, x)
        torch.manual_seed(10 + i)
        assert torch.equal(loss, step(ref, ref_opt, x)), i
    for p, q in zip(layer.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_runs_as_eager_and_its_backward_is_backward(reentrant):
    """torch.utils.checkpoint recomputes a block's forward in backward; the reentrant form
    runs a backward inside the outer one, whose end once labelled the rest of the outer
    backward as the update (data parallelism then refused the step). The block's dropout
    is recomputed from the generator state saved before its forward: the program reads
    the forward's mask there (torch/rng_replay.py), and leaves the generator where eager
    does."""
    from torch.utils.checkpoint import checkpoint

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.fc3 = (torch.nn.Linear(16, 32), torch.nn.Linear(32, 32),
                                            torch.nn.Linear(32, 5))

        def forward(self, x):
            h = F.gelu(self.fc1(x))
            h = checkpoint(lambda t: F.dropout(F.gelu(self.fc2(t)), 0.3, self.training), h,
                           use_reentrant=reentrant)
            return self.fc3(h)

    def step(model, opt, x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    data = [(torch.randn(8, 16), torch.randint(0, 5, (8,))) for _ in range(3)]
    compiled = diphoma_compile.compile(step, model, opt, *data[0])
    assert {op.phase.value for op in compiled.graph.ops
            if "gelu_backward" in str(op.attrs.get("target", ""))} == {"backward"}
    for i, (x, y) in enumerate(data):
        torch.manual_seed(i)
        loss = compiled(model, opt, x, y)
        after = torch.get_rng_state()
        torch.manual_seed(i)
        assert torch.equal(loss, step(ref, ref_opt, x, y))
        assert torch.equal(after, torch.get_rng_state())
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
    assert sum(op.attrs.get("rng") == "global" for op in compiled.graph.ops) == 1


def lm_step_dropout(model, opt, batch):
    model.train()
    loss = F.cross_entropy(model(batch["idx"]).flatten(0, 1), batch["targets"].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_compiled_code_is_readable_python():
    torch.manual_seed(0)
    model = MLP()
    opt = OPTIMIZERS["sgd"](model.parameters(), True)
    compiled = diphoma_compile.compile(clipped_step, model, opt, mlp_batches(1)[0])
    assert "torch.ops.aten.addmm.default" in compiled.code
    assert "def forward(self, fc1_weight" in compiled.code


def test_passes_run_on_traced_graph():
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    opt = OPTIMIZERS["sgd_momentum"](model.parameters(), True)
    ref_opt = OPTIMIZERS["sgd_momentum"](ref.parameters(), True)
    data = mlp_batches(3)
    compiled = diphoma_compile.compile(clipped_step, model, opt, data[0], passes="dce,cse")
    assert compiled.graph.passes == ("dce", "cse")
    for batch in data:
        assert torch.equal(compiled(model, opt, batch), clipped_step(ref, ref_opt, batch))


# ------------------------------------------------------------------ errors

def test_data_dependent_control_flow_is_named():
    def step(model, opt, batch):
        loss = F.cross_entropy(model(batch["x"]), batch["y"])
        if loss > 1.0:  # Python control flow on a tensor value
            loss = loss * 2
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    model = MLP()
    opt = OPTIMIZERS["sgd"](model.parameters(), True)
    with pytest.raises(FrontendError) as e:
        diphoma_compile.trace(step, model, opt, mlp_batches(1)[0])
    msg = str(e.value)
    assert "depends on tensor data" in msg
    assert "test_trace.py" in msg and "if loss > 1.0:" in msg
    assert "torch.where" in msg


@pytest.mark.parametrize("case", ["mask", "nonzero", "unique"])
def test_sizes_that_depend_on_tensor_data_are_named(case):
    """A boolean mask index, nonzero or unique traces (make_fx gives its size an unbacked
    symbol) and then failed importing with torch's GuardOnDataDependentSymNode, no line
    and no way out; now a FrontendError names the op, the user's line and the masked-mean
    form that keeps shapes static."""
    def step(model, opt, batch):
        out, y = model(batch["x"]), batch["y"]
        keep = y > 0
        if case == "mask":
            loss = F.cross_entropy(out[keep], y[keep])
        elif case == "nonzero":
            loss = F.cross_entropy(out[keep.nonzero()[:, 0]], y[keep.nonzero()[:, 0]])
        else:
            loss = F.cross_entropy(out, y) / torch.unique(y).numel()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    model = MLP()
    opt = OPTIMIZERS["sgd"](model.parameters(), True)
    with pytest.raises(FrontendError) as e:
        diphoma_compile.trace(step, model, opt, mlp_batches(1)[0])
    msg = str(e.value)
    op = {"mask": "aten.index.Tensor", "nonzero": "aten.nonzero", "unique": "aten._unique2"}
    assert f"the size of {op[case]}" in msg and "depends on tensor data" in msg, msg
    assert "test_trace.py:" in msg and "reduction='none') * keep).sum()" in msg


@pytest.mark.parametrize("fn", ["inv", "cholesky", "solve"])
def test_linalg_functions_that_raise_on_the_host_are_named_with_their_ex_form(fn):
    """torch.linalg.inv, cholesky and solve check their result on the host
    (aten._linalg_check_errors, an ordered effect to make_fx): tracing failed with torch's
    "Could not find a token for effect" and a hint about fake kernels and Hugging Face
    experts (a reviewer's probe, 2026-12-07). Now the error says what the op does and
    names the _ex forms, which trace and match eager bit for bit."""
    calls = {"inv": lambda a: torch.linalg.inv(a), "cholesky": torch.linalg.cholesky,
             "solve": lambda a: torch.linalg.solve(a, torch.ones(4))}
    ex = {"inv": lambda a: torch.linalg.inv_ex(a)[0],
          "cholesky": lambda a: torch.linalg.cholesky_ex(a)[0],
          "solve": lambda a: torch.linalg.solve_ex(a, torch.ones(4))[0]}

    def make(f):
        def step(model, opt, batch):
            w = model.fc2.weight            # 4 x 16: a positive-definite 4 x 4 below
            loss = F.cross_entropy(model(batch["x"]), batch["y"]) + \
                0.01 * f(w @ w.T + torch.eye(4)).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step
    torch.manual_seed(0)
    model = MLP(d_out=4)
    opt = OPTIMIZERS["sgd"](model.parameters(), True)
    batch = {"x": torch.randn(8, 8), "y": torch.randint(0, 4, (8,))}
    with pytest.raises(FrontendError, match="checks its result on the host") as e:
        diphoma_compile.trace(make(calls[fn]), model, opt, batch)
    assert f"{fn}_ex" in e.value.hint and "test_trace.py" in str(e.value)
    ref = copy.deepcopy(model)
    ref_opt = OPTIMIZERS["sgd"](ref.parameters(), True)
    step = diphoma_compile.compile(make(ex[fn]), model, opt, batch)
    for _ in range(2):
        assert torch.equal(step(model, opt, batch), make(ex[fn])(ref, ref_opt, batch))
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_a_second_update_in_one_step_is_refused_by_name():
    """A GAN's step (the discriminator's update, then the generator's backward and update)
    failed with the IR verifier's internal error (an update op relabelled forward); now a
    FrontendError names the first optimizer step and what to do."""
    torch.manual_seed(0)
    g, d = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)
    opt_g = torch.optim.Adam(g.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(d.parameters(), lr=1e-3)

    def gan_step(g, d, opt_g, opt_d, real, z):
        fake = g(z)
        loss_d = F.softplus(-d(real)).mean() + F.softplus(d(fake.detach())).mean()
        opt_d.zero_grad()
        loss_d.backward()
        opt_d.step()
        loss_g = F.softplus(-d(fake)).mean()
        opt_g.zero_grad()
        loss_g.backward()
        opt_g.step()
        return loss_d, loss_g
    with pytest.raises(FrontendError, match=r"runs backward\(\) again after Adam.step\(\) "
                                            r"at test_trace.py:\d+: one traced step holds "
                                            "one update") as e:
        diphoma_compile.trace(gan_step, g, d, opt_g, opt_d, torch.randn(8, 8),
                              torch.randn(8, 4))
    assert "compile one step per update" in e.value.hint


def _refusal_through(op) -> str:
    """The FrontendError's message for an MLP step whose logits pass through ``op``."""
    def step(model, opt, batch):
        out = op(model(batch["x"]))
        loss = F.cross_entropy(out, batch["y"])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    model = MLP()
    opt = OPTIMIZERS["sgd"](model.parameters(), True)
    with pytest.raises(FrontendError) as e:
        diphoma_compile.trace(step, model, opt, mlp_batches(1)[0])
    return str(e.value)


def test_an_op_whose_fake_kernel_refuses_the_inputs_is_named():
    """An op whose fake kernel (what tracing runs) is stricter than its CPU kernel, as
    aten._grouped_mm's asks bf16 where the CPU one takes float32 (Hugging Face Mixtral's
    default experts, found 2026-12-04): the error names the op and says what to do."""
    lib = torch.library.Library("diphoma_strict", "FRAGMENT")  # noqa: TOR901
    lib.define("bf16_only(Tensor x) -> Tensor")
    lib.impl("bf16_only", lambda x: x * 2, "CPU")

    def fake(x):
        if x.dtype != torch.bfloat16:
            raise RuntimeError(f"Expected inputs of BF16 type but got {x.dtype}")
        return torch.empty_like(x)
    torch.library.register_fake("diphoma_strict::bf16_only", fake, lib=lib)

    msg = _refusal_through(torch.ops.diphoma_strict.bf16_only)
    assert "in diphoma_strict.bf16_only.default: RuntimeError: Expected inputs of BF16" in msg
    assert "test_trace.py" in msg and "another implementation of the layer" in msg


def test_op_without_mapping_is_named():
    lib = torch.library.Library("diphoma_test", "FRAGMENT")  # noqa: TOR901
    lib.define("opaque_scale(Tensor x) -> Tensor")
    lib.impl("opaque_scale", lambda x: x * 2, "CPU")

    msg = _refusal_through(torch.ops.diphoma_test.opaque_scale)
    assert "diphoma_test.opaque_scale" in msg
    assert "test_trace.py" in msg and "register_fake" in msg


def test_step_without_optimizer():
    model = MLP()
    with pytest.raises(FrontendError, match="uses no torch.optim optimizer"):
        diphoma_compile.trace(lambda m, b: m(b["x"]).sum(), model, mlp_batches(1)[0])


def test_step_returning_a_python_number():
    def step(model, opt, batch):
        loss = F.cross_entropy(model(batch["x"]), batch["y"])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()
    model = MLP()
    opt = OPTIMIZERS["sgd"](model.parameters(), True)
    with pytest.raises(FrontendError, match="returns a"):
        diphoma_compile.trace(step, model, opt, mlp_batches(1)[0])


def test_step_returning_none_or_a_none_among_its_results():
    """``return None`` (or no return), and a None beside the loss (a metric computed on
    some steps only), come back as None; the update matches eager's."""
    for give in (lambda loss: None, lambda loss: (loss, None)):
        def step(model, opt, batch):
            loss = F.cross_entropy(model(batch["x"]), batch["y"])
            loss.backward()
            opt.step()
            opt.zero_grad()
            return give(loss)  # noqa: B023 (called in this iteration)
        torch.manual_seed(0)
        model, ref = MLP(), MLP()
        ref.load_state_dict(model.state_dict())
        opt = OPTIMIZERS["sgd"](model.parameters(), True)
        ref_opt = OPTIMIZERS["sgd"](ref.parameters(), True)
        compiled = diphoma_compile.compile(step, model, opt, mlp_batches(1)[0])
        for batch in mlp_batches(2):
            got, want = compiled(model, opt, batch), step(ref, ref_opt, batch)
            if want is None:
                assert got is None
            else:
                assert got[1] is None and torch.equal(got[0], want[0])
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("case", ["radam", "batch norm momentum=None", "clip raising",
                                  "averaged model"])
def test_torch_code_reading_a_tensor_value_says_what_to_do(case, monkeypatch):
    """torch's own code that reads a tensor's value on the host (an optimizer branching on
    its state, a BatchNorm's cumulative average, a clip that raises on a non-finite norm)
    is refused naming that code and what to use instead, not with advice about the user's
    own control flow. RAdam stands for such an optimizer with its capturable form turned
    off (it is traced in that form: tests/torch/test_step_count_optimizers.py)."""
    import diphoma_compile.torch.capture as capture
    monkeypatch.setattr(capture, "counts_on_host", lambda opt: False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16),
                                torch.nn.BatchNorm1d(16, momentum=None), torch.nn.Linear(16, 3)) \
        if case.startswith("batch") else MLP()
    opt = torch.optim.RAdam(model.parameters()) if case == "radam" else \
        torch.optim.SGD(model.parameters(), lr=0.1)

    ema = torch.optim.swa_utils.AveragedModel(model)

    def step(model, opt, batch):
        loss = F.cross_entropy(model(batch["x"]), batch["y"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0,
                                       error_if_nonfinite=case == "clip raising")
        opt.step()
        opt.zero_grad()
        if case == "averaged model":
            ema.update_parameters(model)
        return loss
    want = {"radam": r"torch.optim's radam step\(\) branches on a value of its state",
            "averaged model": r"AveragedModel.update_parameters\(\) branches on its "
                              r"n_averaged count .* copy.deepcopy\(model\)",
            "batch norm momentum=None": r"BatchNorm with momentum=None .* give it a momentum",
            "clip raising": r"error_if_nonfinite=True\) reads the norm on the host"}[case]
    with pytest.raises(FrontendError, match=want):
        diphoma_compile.trace(step, model, opt, mlp_batches(1)[0])


def test_a_returned_constant_tensor_comes_back():
    """``torch.tensor(batch["x"].shape[0])`` returned beside the loss is a constant of the
    trace (a host number until read); the program returns it (it failed to build with a
    bare KeyError)."""
    def step(model, opt, batch):
        loss = F.cross_entropy(model(batch["x"]), batch["y"])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss, torch.tensor(batch["x"].shape[0])
    model = MLP()
    opt = OPTIMIZERS["sgd"](model.parameters(), True)
    batch = mlp_batches(1)[0]
    loss, n = diphoma_compile.compile(step, model, opt, batch)(model, opt, batch)
    assert n.dtype == torch.int64 and int(n) == batch["x"].shape[0]


def test_wrong_shape_at_call_time():
    model = MLP()
    opt = OPTIMIZERS["sgd"](model.parameters(), True)
    compiled = diphoma_compile.compile(clipped_step, model, opt, mlp_batches(1)[0])
    bad = {"x": torch.randn(3, 8), "y": torch.zeros(3, dtype=torch.long)}
    with pytest.raises(diphoma_compile.DiphomaError, match=r"traced for an argument of shape"):
        compiled(model, opt, bad)


def test_graph_verifies_and_round_trips_for_gpt():
    torch.manual_seed(0)
    model = GPT()
    opt = OPTIMIZERS["adamw"](model.parameters(), True)
    g = diphoma_compile.trace(lm_step, model, opt, lm_batches(1)[0])
    verify(g)
    assert parse(print_graph(g)) == g
    # tied embedding/head weight is one parameter
    assert [i.name for i in g.inputs].count("tok.weight") == 1
    assert "head.weight" not in {i.name for i in g.inputs}


@pytest.mark.parametrize("foreach", [True, False])
def test_adamw_update_is_all_neutral_ops(foreach):
    """Weight-update sharding must understand the optimizer math: no opaque op in it."""
    torch.manual_seed(0)
    model = MLP()
    opt = OPTIMIZERS["adamw"](model.parameters(), foreach)
    g = diphoma_compile.trace(classify_step, model, opt, mlp_batches(1)[0])
    update = [op for op in g.ops if op.phase is Phase.update]
    assert len(update) > 50
    assert [op for op in update if op.name == "opaque"] == []
    assert {"lerp", "addcmul", "addcdiv", "sqrt"} <= {op.name for op in update}


def test_frozen_parameters_and_two_param_groups():
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    for m in (model, ref):
        m.fc1.bias.requires_grad_(False)

    def make(m):
        return torch.optim.AdamW([{"params": [m.fc1.weight], "lr": 0.02},
                                  {"params": [m.fc2.weight, m.fc2.bias], "lr": 0.005}])
    opt, ref_opt = make(model), make(ref)
    data = mlp_batches(4)
    compiled = diphoma_compile.compile(clipped_step, model, opt, data[0])
    names = {i.name for i in compiled.graph.inputs}
    assert {"opt0.group0.lr", "opt0.group1.lr"} <= names
    assert "fc1.bias.exp_avg" not in names
    for batch in data:
        assert torch.equal(compiled(model, opt, batch), clipped_step(ref, ref_opt, batch))
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
