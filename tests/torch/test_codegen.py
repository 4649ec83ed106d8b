"""The code generators: ``codegen="inductor"`` against eager and the fx reference on a tiny
model (one Inductor compile for the whole file: it takes seconds even for a tiny step),
and the choices refused."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import diphoma_compile  # noqa: E402
from diphoma_compile.errors import DiphomaError  # noqa: E402
from diphoma_compile.torch.codegen import default_codegen  # noqa: E402

from models import MLP, OPTIMIZERS, classify_step, mlp_batches  # noqa: E402

# Inductor's kernels fuse and reorder float math: the losses agree with eager's to rounding,
# the parameters after a few AdamW steps to a few ulps of their updates
LOSS_TOL = 1e-5
PARAM_TOL = 1e-5


def test_inductor_matches_eager_and_reads_lr_every_call(monkeypatch, caplog):
    import logging
    caplog.set_level(logging.INFO, logger="diphoma_compile")
    from diphoma_compile.torch import runtime
    written = []      # what the runtime copies back into the model and optimizer
    write = runtime.TorchStep._write
    monkeypatch.setattr(runtime.TorchStep, "_write",
                        lambda self, slot, new: (written.append(slot.name),
                                                 write(self, slot, new)))
    torch.manual_seed(0)
    model = MLP()
    twin = copy.deepcopy(model)
    opt = OPTIMIZERS["adamw"](model.parameters(), True)
    twin_opt = OPTIMIZERS["adamw"](twin.parameters(), True)
    batches = mlp_batches(4)
    step = diphoma_compile.compile(classify_step, model, opt, batches[0], codegen="inductor")
    assert step.codegen == "inductor" and step.compile_s is None
    assert "_local_scalar_dense" not in step.code    # nothing read on the host
    compiled = None
    for k, b in enumerate(batches):
        if k == 2:     # a new learning rate: read on the call, not baked into the kernels
            for g in opt.param_groups + twin_opt.param_groups:
                g["lr"] = 3e-3
        ours = step(model, opt, b)
        want = classify_step(twin, twin_opt, b)
        assert abs(ours.item() - want.item()) <= LOSS_TOL
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=PARAM_TOL)
        if compiled is None:
            compiled = step.module.compiled
            assert step.compile_s is not None and step.compile_s > 0
        assert step.module.compiled is compiled      # compiled once, never again
    # the optimizer state is the optimizer's own, updated in place
    assert all(int(opt.state[p]["step"]) == len(batches) for p in model.parameters())
    # by the compiled program itself: nothing was written back after it ran
    assert written == []
    # the first call said it was compiling, and when it was done; no later call did
    said = [r.getMessage() for r in caplog.records if r.name == "diphoma_compile"]
    assert sum("Inductor is compiling the classify_step program" in m for m in said) == 1, said
    assert sum("Inductor compiled the classify_step program in" in m for m in said) == 1, said


def test_codegen_choices():
    torch.manual_seed(0)
    model = MLP()
    opt = OPTIMIZERS["sgd"](model.parameters(), True)
    b = mlp_batches(1)[0]
    with pytest.raises(DiphomaError, match="not a code generator") as e:
        diphoma_compile.compile(classify_step, model, opt, b, codegen="triton")
    assert "fx" in e.value.hint
    step = diphoma_compile.compile(classify_step, model, opt, b)
    assert step.codegen == default_codegen(torch.device("cpu")) == "fx"
    assert step.compile_s is None
    par = diphoma_compile.parallelize(classify_step, {"dp": 1}, codegen="fx")
    par(model, opt, b)
    assert par.runner.codegen == "fx" and par.compile_s is None


def test_jax_refuses_torch_code_generators():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy

    def step(params, opt_state, batch):
        return params, opt_state, jnp.sum(batch)
    with pytest.raises(DiphomaError, match="XLA"):
        diphoma_compile.compile(step, {"w": jnp.ones(2)}, (), jnp.ones((2, 2)),
                                codegen="inductor")


def test_default_rule_by_step_size(monkeypatch):
    from diphoma_compile.torch import codegen
    from diphoma_compile.torch.trace import trace_torch
    cpu = torch.device("cpu")
    big = "inductor" if codegen.inductor_available(cpu) else "fx"
    assert codegen.default_codegen(cpu, codegen.INDUCTOR_MIN_FLOPS) == big
    assert codegen.default_codegen(cpu, codegen.INDUCTOR_MIN_FLOPS / 2) == "fx"
    assert codegen.default_codegen(torch.device("meta"), 1e15) == "fx"
    torch.manual_seed(0)
    model = MLP()
    opt = OPTIMIZERS["adamw"](model.parameters(), True)
    b = mlp_batches(1)[0]
    # a tiny step stays on fx; the same step counted as big is traced for Inductor
    _, cap = trace_torch(classify_step, model, opt, b, codegen="auto")
    assert cap.codegen == "fx"
    monkeypatch.setattr(codegen, "inductor_available", lambda device: True)
    monkeypatch.setattr(codegen, "INDUCTOR_MIN_FLOPS", 0.0)
    _, cap = trace_torch(classify_step, model, opt, b, codegen="auto")
    assert cap.codegen == "inductor"
    # trace() alone plans with the reference program
    g = diphoma_compile.trace(classify_step, model, opt, b)
    assert g == trace_torch(classify_step, model, opt, b)[0]


def test_inductor_trace_of_a_cycled_momentum_says_use_fx(monkeypatch):
    from diphoma_compile.torch import codegen
    from diphoma_compile.torch.trace import trace_torch
    torch.manual_seed(0)
    model = MLP()
    opt = OPTIMIZERS["sgd_momentum"](model.parameters(), True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=100)

    def step(m, o, b):
        loss = classify_step(m, o, b)
        sched.step()
        return loss
    b = mlp_batches(1)[0]
    # SGD branches on its momentum, a tensor in Inductor's trace: a clear error ...
    with pytest.raises(DiphomaError, match="codegen='inductor'") as e:
        trace_torch(step, model, opt, b, codegen="inductor")
    assert "codegen='fx'" in e.value.hint
    # ... and the default falls back to fx where it would have picked Inductor
    monkeypatch.setattr(codegen, "inductor_available", lambda device: True)
    monkeypatch.setattr(codegen, "INDUCTOR_MIN_FLOPS", 0.0)
    _, cap = trace_torch(step, model, opt, b, codegen="auto")
    assert cap.codegen == "fx"


def test_inductor_runs_single_tensor_sgd():
    """Single-tensor SGD (foreach=False) adds ``alpha=-lr`` with lr a tensor under the
    Inductor trace; aten takes alpha only as a number, so the product is spelled out (it
    failed to compile before)."""
    torch.manual_seed(0)
    model = MLP()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9, foreach=False)
    batches = mlp_batches(3)
    step = diphoma_compile.compile(classify_step, model, opt, batches[0], codegen="inductor")
    for b in batches:
        ours, want = step(model, opt, b), classify_step(twin, twin_opt, b)
        assert abs(ours.item() - want.item()) <= LOSS_TOL
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=PARAM_TOL)


@pytest.mark.parametrize("name", ["sgd_momentum", "adamw", "adam"])
@pytest.mark.parametrize("foreach", [False, True])
def test_fx_updates_are_written_in_place_by_their_kernels(name, foreach):
    """The fx program copies no new parameter or optimizer state into place: the pointwise
    kernels making them write into the inputs (``out=``), as eager's in-place optimizer
    kernels do, and three steps stay equal to eager's bit for bit (parameters and state)."""
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    opt, ref_opt = (OPTIMIZERS[name](m.parameters(), foreach) for m in (model, ref))
    batches = mlp_batches(3)
    step = diphoma_compile.compile(classify_step, model, opt, batches[0], codegen="fx")
    assert "copy_" not in step.code
    assert step.code.count("out = ") >= len(list(model.parameters()))
    for b in batches:
        assert torch.equal(step(model, opt, b), classify_step(ref, ref_opt, b))
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
        for k, v in opt.state[p].items():
            assert torch.equal(v, ref_opt.state[q][k]), k


def test_an_update_term_read_again_later_is_not_written_into_place():
    """``p * p`` feeds the new ``p`` (an ``add`` writing into ``p``) and is read again after
    it: the ``mul`` must not write into ``p`` too (the sum would read the new value), though
    when the ``add`` is emitted nothing else reads it yet."""
    from diphoma_compile.ir.parser import parse
    from diphoma_compile.torch.build import build_module, written_by_kernels
    g = parse("""graph @step (
  %p: f32[4] param,
  %g: f32[4] batch,
) {
  %0: f32[4] = mul(%p, %p) phase=update
  %1: f32[4] = add(%0, %g) phase=update
  %2: f32[] = reduce_sum(%0) {dims=[0], keepdim=false} phase=update
  return (
    %2 loss,
    %1 replaces(%p),
  )
}""")
    gm = build_module(g, out_variants=True)
    assert "out = p" in gm.code and gm.code.count("out = ") == 1
    assert written_by_kernels(g) == {"1"}
    p, grad = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.ones(4)
    loss, new = gm(p, grad)
    assert loss.item() == 30.0 and torch.equal(new, torch.tensor([2.0, 5.0, 10.0, 17.0]))
    assert new.data_ptr() == p.data_ptr()


_HEAD = "graph @step (\n  %p: f32[4] param,\n  %g: f32[4] batch,\n  %s: f32[{s}] buffer,\n) {{\n"
_CHAINS = {
    # a view of p read between the link (g * g) and the update: the link keeps its storage
    "view read between": ("""  %v: f32[2,2] = reshape(%p) phase=update
  %0: f32[4] = mul(%g, %g) phase=update
  %1: f32[2,2] = mul(%v, %v) phase=update
  %2: f32[] = reduce_sum(%1) {dims=[0,1], keepdim=false} phase=update
  %3: f32[4] = add(%0, %g) phase=update
  return (
    %2 loss,
    %3 replaces(%p),
  )
}""", "4"),
    # links of another shape (broadcast) or dtype (a predicate) than p's
    "broadcasting link": ("""  %0: f32[1] = exp(%s) phase=update
  %1: f32[4] = mul(%0, %g) phase=update
  return (
    %1 replaces(%p),
  )
}""", "1"),
    "bool link": ("""  %0: bool[4] = gt(%g, %s) phase=update
  %1: f32[4] = select(%0, %g, %s) phase=update
  return (
    %1 replaces(%p),
  )
}""", "4"),
}


@pytest.mark.parametrize("case", list(_CHAINS))
def test_update_chains_write_into_place_only_where_nothing_else_sees_it(case):
    """Hand-written updates whose chain of kernels must not all write into ``p`` (a view of
    it read in between; a link of another shape or dtype): the program's results and ``p``
    after it equal those of the program that copies the new value in (each failed so
    before the check: a wrong loss, or ``p`` resized and an error)."""
    from diphoma_compile.ir.parser import parse
    from diphoma_compile.torch.build import build_module
    body, size = _CHAINS[case]
    g = parse(_HEAD.format(s=size) + body)
    args = [torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([1.0, 5.0, 1.0, 5.0]),
            torch.full((int(size),), 0.5)]
    mine, ref = [a.clone() for a in args], [a.clone() for a in args]
    got = build_module(g, out_variants=True)(*mine)
    want = build_module(g, out_variants=False)(*ref)
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
    assert torch.equal(mine[0], ref[0])
