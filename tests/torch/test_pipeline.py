"""The pipeline pass on traced PyTorch steps (golden IR, stages, tied weights, errors),
parallelize's choice of it from a pp axis, and the schedules' per-rank action lists taken
from torch.distributed.pipelining (a private API: these goldens pin what we rely on)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

import diphoma_compile  # noqa: E402
from diphoma_compile.errors import BackendError, DiphomaError, PassError  # noqa: E402
from diphoma_compile.ir import parse, print_graph  # noqa: E402
from diphoma_compile.mesh import Mesh  # noqa: E402
from diphoma_compile.passes import PassContext, Pipeline, PipelineRecord  # noqa: E402
from diphoma_compile.torch.pipeline_schedule import schedule_actions  # noqa: E402

from models import GPT, MLP, NormedMLP, classify_step, mlp_batches, mse_step  # noqa: E402
from models import lm_step as lm_step_clipped  # noqa: E402


def lm_step(model, opt, batch):
    loss = F.cross_entropy(model(batch["idx"]).flatten(0, 1), batch["targets"].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def traced_gpt(layers: int = 2, mesh: dict | None = None, momentum: float = 0.0,
               seqs: int = 2, step=None):
    key = (layers, momentum, seqs, step or lm_step)
    if key not in _TRACES:
        _TRACES[key] = _traced_gpt(*key)
    return _TRACES[key].replace(mesh=Mesh(mesh or {"pp": 2}))


# each traced step once for the module (a Graph is immutable; a trace of the 4-layer GPT
# takes about a second, and ten tests plan it)
_TRACES: dict[tuple, object] = {}


def _traced_gpt(layers: int, momentum: float, seqs: int, step):
    torch.manual_seed(0)
    model = GPT(vocab=16, d=8, layers=layers, heads=2, block=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(0, 16, (seqs, 5), generator=g)
    batch = {"idx": seq[:, :-1], "targets": seq[:, 1:]}
    return diphoma_compile.trace(step, model, opt, batch)


def run(graph, spec: str):
    ctx = PassContext()
    return Pipeline.from_spec(spec).run(graph, ctx), ctx


def test_golden_pipeline_two_stages(golden):
    out, _ = run(traced_gpt(), "dce,pipeline{axis=pp, microbatches=2}")
    text = print_graph(out)
    assert parse(text) == out
    golden("torch_gpt_sgd.pp2.ir", text)


def test_stages_balance_and_only_send_recv_cross():
    """Every op has a stage; each send has its recv (same tag, peers swapped); the layers
    split two and two; one activation crosses each way per cut; the tied embedding is on
    the first and last stage, its gradient sent down and its new value up."""
    out, ctx = run(traced_gpt(layers=4, momentum=0.9),
                   "dce,pipeline{axis=pp, microbatches=4, schedule=gpipe}")
    rec = ctx.decision(PipelineRecord)
    assert all(op.stage is not None for op in out.ops)
    made = {v.name: op.stage for op in out.ops for v in op.results}
    for op in out.ops:
        for n in op.inputs:
            assert n not in made or made[n] == op.stage, (op, n)
    sends = {op.attrs["tag"]: op for op in out.ops if op.name == "send"}
    recvs = {op.attrs["tag"]: op for op in out.ops if op.name == "recv"}
    assert sends.keys() == recvs.keys()
    for tag, s in sends.items():
        assert s.attrs["peer"] == recvs[tag].stage and recvs[tag].attrs["peer"] == s.stage
    assert [s.layers for s in rec.stages] == [
        ("tok", "pos", "blocks.0.ln1", "blocks.0.qkv", "blocks.0.proj", "blocks.0.ln2",
         "blocks.0.up", "blocks.0.down", "blocks.1.ln1", "blocks.1.qkv", "blocks.1.proj",
         "blocks.1.ln2", "blocks.1.up", "blocks.1.down"),
        ("tok", "blocks.2.ln1", "blocks.2.qkv", "blocks.2.proj", "blocks.2.ln2", "blocks.2.up",
         "blocks.2.down", "blocks.3.ln1", "blocks.3.qkv", "blocks.3.proj", "blocks.3.ln2",
         "blocks.3.up", "blocks.3.down", "ln")]
    flops = [s.flops for s in rec.stages]
    assert max(flops) <= 1.25 * min(flops), flops
    assert rec.tied == {"tok.weight": (0, 1)}
    kinds = sorted((s.phase.value, s.stage, recvs[t].stage) for t, s in sends.items())
    assert kinds == [("backward", 1, 0), ("backward", 1, 0), ("forward", 0, 1),
                     ("update", 0, 1)], kinds
    assert rec.schedule == "gpipe" and rec.microbatches == 4
    assert rec.bubble == pytest.approx(1 / 5)


@pytest.mark.parametrize("stages, words", [
    (16, "fewer than the 16 stages"),
    (5, "too few for 5 stages"),
    (4, "too few for 4 stages that each hold a layer with parameters"),
])
def test_a_model_too_small_to_split_is_refused(stages, words):
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = diphoma_compile.trace(classify_step, model, opt, mlp_batches(1)[0]).replace(
        mesh=Mesh({"pp": stages}))
    with pytest.raises(PassError) as e:
        run(g, "dce,pipeline")
    assert words in str(e.value), str(e.value)
    assert "hint: use" in str(e.value)


def sum_lm_step(model, opt, batch):
    loss = F.cross_entropy(model(batch["idx"]).flatten(0, 1), batch["targets"].flatten(),
                           reduction="sum")
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def logged_mean_step(model, opt, batch):
    return sum_lm_step(model, opt, batch) / batch["targets"].numel()


def extreme_metric_step(model, opt, batch):
    logits = model(batch["idx"])
    loss = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss, logits.detach().abs().max()


@pytest.mark.parametrize("mesh", [{"pp": 2}, {"dp": 2, "pp": 2}])
def test_a_maximum_over_the_batch_is_refused_over_microbatches(mesh):
    """A returned maximum over the batch (the largest logit): the pipeline averages its
    microbatches' metrics, so it returned the mean of the microbatches' maxima with no
    word (0.41 where eager gave 0.49 on 2 gloo ranks, a review's probe, 2026-12-07). It is
    refused, naming its line; at one microbatch it plans."""
    torch.manual_seed(0)
    model = GPT(vocab=16, d=8, layers=2, heads=2, block=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seq = torch.randint(0, 16, (4, 5), generator=torch.Generator().manual_seed(3))
    batch = {"idx": seq[:, :-1], "targets": seq[:, 1:]}
    pstep = diphoma_compile.parallelize(extreme_metric_step, mesh, microbatches=2)
    with pytest.raises(DiphomaError, match=r"returns at test_pipeline.py:\d+ is a maximum "
                                           r"over the batch.*the mean of their maxima"):
        pstep.trace(model, opt, batch)
    diphoma_compile.parallelize(extreme_metric_step, mesh, microbatches=1,
                                schedule="gpipe").trace(model, opt, batch)


def test_a_loss_summed_over_the_batch_is_refused_over_microbatches():
    """The pipeline averages its microbatches' losses and gradients: a loss that is a sum
    over the batch (reduction="sum") would be 1/M of the single-device step's. At one
    microbatch nothing is averaged, and the step is cut."""
    torch.manual_seed(0)
    model = GPT(vocab=16, d=8, layers=2, heads=2, block=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seq = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(3))
    g = diphoma_compile.trace(sum_lm_step, model, opt,
                              {"idx": seq[:, :-1], "targets": seq[:, 1:]})
    g = g.replace(mesh=Mesh({"pp": 2}))
    with pytest.raises(PassError) as e:
        run(g, "dce,pipeline{axis=pp, microbatches=2}")
    assert "the step's loss is a sum over the batch; over 2 microbatches" in str(e.value)
    assert "hint: make it a mean over the batch" in str(e.value)
    run(g, "dce,pipeline{axis=pp, microbatches=1, schedule=gpipe}")
    # the sum backpropagated, its mean per token returned: the gradients would be 1/M
    g = diphoma_compile.trace(logged_mean_step, model, opt,
                              {"idx": seq[:, :-1], "targets": seq[:, 1:]})
    with pytest.raises(PassError, match="the value the step differentiates is a sum"):
        run(g.replace(mesh=Mesh({"pp": 2})), "dce,pipeline{axis=pp, microbatches=2}")
    # with data parallelism first, which adds the devices' sums up: its record says so (a
    # review found it planned, 2026-12-06: JAX's loss 0.41 of jax.jit's on dp4 x pp2)
    seq = torch.randint(0, 16, (4, 5), generator=torch.Generator().manual_seed(3))
    pstep = diphoma_compile.parallelize(sum_lm_step, {"dp": 2, "pp": 2}, microbatches=2)
    with pytest.raises(DiphomaError, match="the step's loss is a sum over the batch .added "
                                           "up over the dp devices.; over 2 microbatches"):
        pstep.trace(model, opt, {"idx": seq[:, :-1], "targets": seq[:, 1:]})


def returning(extra):
    """A classification step that also returns ``extra(logits, batch)``."""
    def step(model, opt, batch):
        out = model(batch["x"])
        loss = F.cross_entropy(out, batch["y"])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss, *extra(out.detach(), batch)
    return step


logits_step = returning(lambda out, batch: (out,))
argmax_step = returning(lambda out, batch: (out.sum(1).argmax(),
                                            (out.argmax(1) == batch["y"]).float().mean()))


def per_example_step(model, opt, batch):
    each = F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")
    each.mean().backward()
    opt.step()
    opt.zero_grad()
    return each.mean().detach(), each.detach()


@pytest.mark.parametrize("step, what", [
    (logits_step, r"a \[16, 4\] value"),
    (per_example_step, r"a \[16\] value"),
    (argmax_step, "a scalar of type i64"),
])
def test_per_example_results_are_refused_over_microbatches(step, what):
    """Without data parallelism (which refuses them itself) nothing refused a returned
    value the microbatches' average gets wrong: logits or per-example losses came back
    the elementwise mean of the microbatches' (a review's probe, 2026-12-07). A float
    scalar (an accuracy, a mean) is averaged; at one microbatch nothing is."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = diphoma_compile.trace(step, model, opt, mlp_batches(1)[0])
    g = g.replace(mesh=Mesh({"pp": 2}))
    with pytest.raises(PassError, match=r"pipeline: the step returns %\d+ \(made at "
                                        rf"\S+:\d+\), {what} computed from the batch "
                                        "that is not a sum, mean"):
        run(g, "dce,pipeline{axis=pp, microbatches=2, schedule=gpipe}")
    run(g, "dce,pipeline{axis=pp, microbatches=1, schedule=gpipe}")


def grad_norms_step(model, opt, batch):
    loss = F.cross_entropy(model(batch["x"]), batch["y"])
    loss.backward()
    norms = torch.stack([p.grad.norm() for p in model.parameters()])
    opt.step()
    opt.zero_grad()
    return loss, norms, model.fc1.weight.detach().norm(dim=1)


def test_vectors_made_from_gradients_or_parameters_are_not_refused():
    """Per-layer gradient norms and the new weights' row norms are the step's values,
    made once from gradients the microbatches sum right: the per-example refusal once
    followed the batch through the backward and refused them (a review's probe,
    2026-12-07)."""
    torch.manual_seed(0)
    model = MLP()
    g = diphoma_compile.trace(grad_norms_step, model,
                              torch.optim.SGD(model.parameters(), lr=0.1), mlp_batches(1)[0])
    run(g.replace(mesh=Mesh({"pp": 2})), "dce,pipeline{axis=pp, microbatches=2, "
                                         "schedule=gpipe}")


@pytest.mark.parametrize("mesh, spec", [
    ({"pp": 4}, "dce,pipeline{axis=pp, schedule=interleaved}"),     # 8 stages
    ({"pp": 8}, "dce,pipeline"),
])
def test_fewer_layers_than_stages_is_refused(mesh, spec):
    """A 1-layer GPT has 6 pieces with parameters between the places where only the
    residual stream crosses (token and position embeddings, attention, MLP, final norm,
    tied head): 8 stages are refused, saying the model has too few layers. A 2-layer GPT
    has 8 and is cut into them, each stage holding a parameter; the cut points inside the
    embedding's sum once left a stage with ops but none (refused then as "stage 2 of 8
    would hold no parameter"), and no cut does now."""
    with pytest.raises(PassError) as e:
        run(traced_gpt(layers=1, mesh=mesh), spec)
    assert "too few for 8 stages that each hold a layer with parameters" in str(e.value)
    assert "hint: use fewer stages than 8" in str(e.value)
    _, ctx = run(traced_gpt(layers=2, mesh=mesh), spec)
    rec = ctx.decision(PipelineRecord)
    assert [st.layers for st in rec.stages] == [
        ("tok",), ("pos",), ("blocks.0.ln1", "blocks.0.qkv", "blocks.0.proj"),
        ("blocks.0.ln2", "blocks.0.up", "blocks.0.down"),
        ("blocks.1.ln1", "blocks.1.qkv", "blocks.1.proj"),
        ("blocks.1.ln2", "blocks.1.up", "blocks.1.down"), ("ln",), ("tok",)]
    assert set(rec.sent_bytes) == {4 * 2 * 8 * 4}      # the residual stream alone


def test_a_global_gradient_clip_is_staged():
    """clip_grad_norm_ sums every stage's gradients: each gradient's norm is taken on its
    stage, the norms cross packed (one message of all a stage's norms) to the stage that
    totals them (the one holding most), and the clip factor goes back to every other stage
    as a scalar; no gradient crosses in the update (the only other tensor sent there is the
    tied embedding's new value)."""
    torch.manual_seed(0)
    model = GPT(vocab=16, d=8, layers=4, heads=2, block=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seq = torch.randint(0, 16, (2, 5))
    g = diphoma_compile.trace(lm_step_clipped, model, opt,
                              {"idx": seq[:, :-1], "targets": seq[:, 1:]})
    out, ctx = run(g.replace(mesh=Mesh({"pp": 4})), "dce,pipeline")
    types = out.value_types()
    recvs = [op for op in out.ops if op.name == "recv" and op.phase.value == "update"]
    shapes = sorted((op.stage, types[op.results[0].name].shape) for op in recvs)
    total = next(s for s, shape in shapes if len(shape) == 1)     # gets the packed norms
    packed = [(s, shape) for s, shape in shapes if s == total]
    back = [(s, shape) for s, shape in shapes if s != total]
    assert len(packed) == 3 and all(n > 1 for _, (n,) in packed), packed
    # the three other stages: the clip factor, and the last the tied embedding's new value
    assert sorted(s for s, shape in back if shape == ()) == [s for s in range(4) if s != total]
    assert [shape for _, shape in back if shape != ()] == [types["tok.weight"].shape]
    sizes = sum(n for _, (n,) in packed)
    norms_on = sum(1 for op in out.ops if op.name == "norm" and op.stage != total
                   and op.phase.value == "update")
    assert sizes == norms_on, (sizes, norms_on)


def test_parallelize_picks_the_pipeline_pass_from_the_axis_name():
    """dp=2 x pp=2: data parallelism with weight-update sharding over dp, then the pipeline
    over pp with microbatches = the axis size by default, its stages balanced on the
    CPU's device model (where the parameters live); the step is traced at one microbatch
    of the local batch."""
    torch.manual_seed(0)
    model = GPT(vocab=16, d=8, layers=2, heads=2, block=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seq = torch.randint(0, 16, (4, 5))
    step = diphoma_compile.parallelize(lm_step, {"dp": 2, "pp": 2})
    step.trace(model, opt, {"idx": seq[:, :-1], "targets": seq[:, 1:]})
    names = [p.split("{")[0] for p in step.graph.passes]
    assert names == ["dce", "data-parallel", "weight-update-sharding", "dce", "pipeline"]
    assert step.graph.passes[-1] == "pipeline{axis=pp, stages=auto, microbatches=2, " \
                                    "schedule=1f1b, balance=time, device-model=cpu-gloo, " \
                                    "gather=step}"
    batch = [i.value.type.shape for i in step.graph.inputs if i.role.kind.value == "batch"]
    assert batch == [(2, 4), (2, 4)]
    assert "pipeline" in step.plan.notes


GOLDEN_ACTIONS = {
    ("gpipe", 2, 3): ["F0 F1 F2 B0 B1 B2", "F0 F1 F2 B0 B1 B2"],
    ("1f1b", 2, 3): ["F0 F1 B0 F2 B1 B2", "F0 B0 F1 B1 F2 B2"],
    ("1f1b", 4, 4): ["F0 F1 F2 F3 B0 B1 B2 B3", "F0 F1 F2 B0 F3 B1 B2 B3",
                     "F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"],
    ("1f1b", 4, 6): ["F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5",
                     "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5",
                     "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5",
                     "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"],
}


# interleaved 1F1B (schedule, stages, microbatches, ranks): stage s runs on rank s mod ranks;
# an action is written stage, kind, microbatch (torch's own notation)
GOLDEN_INTERLEAVED = {
    ("interleaved", 8, 4, 4): [
        "0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 4B0 4B1 4B2 4B3 0B0 0B1 0B2 0B3",
        "1F0 1F1 1F2 1F3 5F0 5F1 5F2 5F3 5B0 5B1 5B2 5B3 1B0 1B1 1B2 1B3",
        "2F0 2F1 2F2 2F3 6F0 6F1 6F2 6B0 6F3 6B1 6B2 6B3 2B0 2B1 2B2 2B3",
        "3F0 3F1 3F2 3F3 7F0 7B0 7F1 7B1 7F2 7B2 7F3 7B3 3B0 3B1 3B2 3B3"],
    ("interleaved", 4, 4, 2): [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"],
    # zero-bubble: each backward as its input-gradient (I) and weight-gradient (W) runs
    ("interleaved-zb", 4, 4, 2): [
        "0F0 0F1 2F0 2F1 2I0 2W0 0F2 2I1 2W1 0F3 0I0 0W0 2F2 0I1 0W1 2F3 2I2 2W2 2I3 2W3 0I2 "
        "0W2 0I3 0W3",
        "1F0 1F1 3F0 3I0 3F1 3I1 3W0 1F2 1I0 3W1 1F3 1I1 1W0 3F2 3I2 1W1 3F3 3I3 3W2 1I2 3W3 "
        "1I3 1W2 1W3"],
    # breadth first: every microbatch through a rank's first stage, then its next; the
    # backwards last stage first, last microbatch first
    ("looped-bfs", 4, 4, 2): [
        "0F0 0F1 0F2 0F3 2F0 2F1 2F2 2F3 2B3 2B2 2B1 2B0 0B3 0B2 0B1 0B0",
        "1F0 1F1 1F2 1F3 3F0 3F1 3F2 3F3 3B3 3B2 3B1 3B0 1B3 1B2 1B1 1B0"],
    # the V: rank r runs stages r and 2P - 1 - r
    ("zbv", 4, 4, 2): [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 "
        "0W2 0I3 0W3",
        "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 "
        "1W2 2W3 1W3"],
    # DualPipeV: zbv's V; torch's overlapped (F; B) pairs run forward first, its whole
    # backwards as I then W (rank 0: (0F3;3B1) (3F2;0B0) (3F3;0B1) in torch's notation)
    ("dualpipev", 4, 4, 2): [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3I1 3W1 3F2 0I0 0W0 3I2 3W2 3F3 0I1 0W1 3I3 3W3 0I2 "
        "0W2 0I3 0W3",
        "1F0 2F0 1F1 2F1 1F2 2I0 2W0 2F2 1I0 1W0 1F3 2I1 2W1 2F3 1I1 1W1 2I2 2W2 1I2 1W2 2I3 "
        "1I3 2W3 1W3"],
}


@pytest.mark.parametrize("key", list(GOLDEN_ACTIONS))
def test_schedule_actions_from_torch_are_pinned(key):
    got = [" ".join(f"{k}{m}" for k, m, _ in rank) for rank in schedule_actions(*key)]
    assert got == GOLDEN_ACTIONS[key]
    assert all(s == r for r, rank in enumerate(schedule_actions(*key)) for _, _, s in rank)


@pytest.mark.parametrize("schedule, ranks, microbatches",
                         [("gpipe", 2, 1), ("gpipe", 4, 2), ("gpipe", 4, 7), ("1f1b", 2, 2),
                          ("1f1b", 2, 5), ("1f1b", 4, 4), ("1f1b", 4, 7), ("1f1b", 3, 8)])
def test_written_out_orders_are_torchs(schedule, ranks, microbatches):
    """The orders the JAX runtime uses (passes/pipeline_orders.py, written out) are torch's
    generators' action for action."""
    from diphoma_compile.passes.pipeline_orders import rank_orders
    ours = rank_orders(schedule, ranks, microbatches)
    torchs = schedule_actions(schedule, ranks, microbatches, ranks)
    assert [list(r) for r in ours] == [[tuple(a) for a in r] for r in torchs]


@pytest.mark.parametrize("schedule", ["interleaved", "interleaved-zb"])
@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("per_rank", [2, 3])
def test_written_out_interleaved_orders_are_torchs(schedule, ranks, per_rank):
    """The interleaved 1F1B and interleaved zero-bubble orders written out for JAX are
    torch's generators' (Interleaved1F1B, InterleavedZeroBubble), action for action, for M
    a multiple of the ranks, M below the ranks, and M = P + 1, 2P + 1 (rounds of P + 1
    microbatches, or refused, as torch refuses them)."""
    from diphoma_compile.passes.pipeline_orders import rank_orders
    for m in (1, ranks - 1, ranks, 2 * ranks, 3 * ranks, ranks + 1, 2 * ranks + 1):
        try:
            torchs = schedule_actions(schedule, ranks * per_rank, m, ranks)
        except BackendError:
            with pytest.raises(ValueError, match="rounds"):
                rank_orders(schedule, ranks, m, ranks * per_rank)
            continue
        ours = rank_orders(schedule, ranks, m, ranks * per_rank)
        assert [list(r) for r in ours] == [[tuple(a) for a in r] for r in torchs], m


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("per_rank", [2, 3])
def test_written_out_looped_bfs_orders_are_torchs(ranks, per_rank):
    """The looped BFS orders written out for JAX are torch's ScheduleLoopedBFS's, action for
    action, for M below, at and above the ranks."""
    from diphoma_compile.passes.pipeline_orders import rank_orders
    for m in (1, ranks - 1, ranks, ranks + 1, 2 * ranks + 1):
        ours = rank_orders("looped-bfs", ranks, m, ranks * per_rank)
        torchs = schedule_actions("looped-bfs", ranks * per_rank, m, ranks)
        assert [list(r) for r in ours] == [[tuple(a) for a in r] for r in torchs], m


@pytest.mark.parametrize("ranks", [2, 3, 4, 5])
def test_written_out_zbv_orders_are_torchs(ranks):
    """The ZB-V orders written out for JAX are torch's ZBVZeroBubble's, action for action,
    from one microbatch to past the 2P - 1 its generator plans for."""
    from diphoma_compile.passes.pipeline_orders import rank_orders
    for m in range(1, 3 * ranks + 1):
        ours = rank_orders("zbv", ranks, m)
        torchs = schedule_actions("zbv", 2 * ranks, m, ranks)
        assert [list(r) for r in ours] == [[tuple(a) for a in r] for r in torchs], m


@pytest.mark.parametrize("ranks", [2, 3, 4, 5])
def test_written_out_dualpipev_orders_are_torchs(ranks):
    """The DualPipeV orders written out for JAX are torch's ScheduleDualPipeV's (its
    overlapped pairs forward first, its whole backwards as I then W), action for action,
    from M = 2P (the fewest it takes) to past 4P; fewer are refused, as torch refuses."""
    from diphoma_compile.passes.pipeline_orders import rank_orders
    for m in range(2 * ranks, 4 * ranks + 2):
        ours = rank_orders("dualpipev", ranks, m)
        torchs = schedule_actions("dualpipev", 2 * ranks, m, ranks)
        assert [list(r) for r in ours] == [[tuple(a) for a in r] for r in torchs], m
    with pytest.raises(ValueError, match="at least as many microbatches as stages"):
        rank_orders("dualpipev", ranks, 2 * ranks - 1)
    with pytest.raises(BackendError, match="microbatches=.* or more"):
        schedule_actions("dualpipev", 2 * ranks, 2 * ranks - 1, ranks)


@pytest.mark.parametrize("key", list(GOLDEN_INTERLEAVED))
def test_interleaved_schedule_actions_from_torch_are_pinned(key):
    got = [" ".join(f"{s}{k}{m}" for k, m, s in rank) for rank in schedule_actions(*key)]
    assert got == GOLDEN_INTERLEAVED[key]


def test_1f1b_with_fewer_microbatches_than_ranks_is_refused_with_torchs_reason():
    with pytest.raises(BackendError) as e:
        schedule_actions("1f1b", 4, 2, 4)
    assert "refuses 2 microbatches on 4 ranks" in str(e.value)
    assert "microbatches=4 or more" in str(e.value)


def test_interleaved_schedule_refuses_microbatches_torch_refuses():
    """torch's interleaved generators want M a multiple of its rounds (max(1, M // P)): 5
    microbatches on 2 ranks are refused with its reason, 3 are fine."""
    with pytest.raises(BackendError) as e:
        schedule_actions("interleaved", 4, 5, 2)
    assert "refuses 5 microbatches on 2 ranks" in str(e.value)
    assert "hint: microbatches=4" in str(e.value)
    assert len(schedule_actions("interleaved", 4, 3, 2)[0]) == 2 * 2 * 3


def test_looped_bfs_cuts_and_places_stages_as_interleaved_does():
    """schedule=looped-bfs differs from interleaved only in the order each rank runs its
    actions: the same 4 stages on 2 ranks (stage s on rank s mod 2), the same program text
    but for the pass's own options (the golden of interleaved's covers it); its bubble with
    M = 1 is that of equal stages laid out (1 - v M / ((v - 1) P + M + P - 1) = 1/2, where
    (P - 1) / (v M + P - 1) says 1/3), and the plan says the schedule is not filled."""
    from diphoma_compile.report.text import pipeline_lines
    spec = "dce,pipeline{axis=pp, microbatches=1, schedule=%s}"
    bfs, ctx = run(traced_gpt(layers=4), spec % "looped-bfs")
    inter, _ = run(traced_gpt(layers=4), spec % "interleaved")
    rec = ctx.decision(PipelineRecord)
    assert [rec.rank_of(s) for s in range(4)] == [0, 1, 0, 1]
    assert print_graph(bfs).replace("looped-bfs", "interleaved") == print_graph(inter)
    assert rec.bubble == pytest.approx(1 / 2)
    text = "\n".join(pipeline_lines(rec, {"pp": 2}))
    assert "schedule looped-bfs, 1 microbatch(es), bubble 50.0%" in text
    assert "too few microbatches to fill the schedule" in text


def test_golden_pipeline_interleaved_four_stages_on_two_ranks(golden):
    """schedule=interleaved: stages=auto is twice the axis (4 stages of a 4-layer model on 2
    ranks); stage s runs on rank s mod 2, so a send's peer is the rank of the reader's
    stage; the record's bubble is (P - 1) / (v M + P - 1)."""
    out, ctx = run(traced_gpt(layers=4), "dce,pipeline{axis=pp, microbatches=2, "
                                         "schedule=interleaved}")
    rec = ctx.decision(PipelineRecord)
    assert len(rec.stages) == 4 and rec.ranks == 2
    assert [rec.rank_of(s) for s in range(4)] == [0, 1, 0, 1]
    recvs = {op.attrs["tag"]: op for op in out.ops if op.name == "recv"}
    for op in out.ops:
        if op.name == "send":
            dst = recvs[op.attrs["tag"]]
            assert op.attrs["peer"] == dst.stage % 2 and dst.attrs["peer"] == op.stage % 2
    assert {op.stage for op in out.ops} == {0, 1, 2, 3}
    assert rec.tied == {"tok.weight": (0, 3)}
    assert rec.bubble == pytest.approx(1 / (2 * 2 + 1))
    text = print_graph(out)
    assert parse(text) == out
    golden("torch_gpt_sgd.pp2_interleaved.ir", text)


@pytest.mark.parametrize("spec, words", [
    ("pipeline{axis=pp, stages=3, schedule=interleaved}", "not a multiple of the 2 devices"),
    # one stage per device: torch's looped generators want two or more
    ("pipeline{axis=pp, stages=2, schedule=looped-bfs}", "two or more stages per device"),
    ("pipeline{axis=pp, stages=4}", "runs one stage per device"),
    ("pipeline{axis=pp, schedule=zigzag}", "unknown schedule 'zigzag'"),
    # torch's interleaved generators run M in rounds of max(1, M // P): refused at planning
    ("pipeline{axis=pp, microbatches=5, schedule=interleaved}",
     "schedule interleaved cannot run 5 microbatches on 2 devices"),
])
def test_pipeline_options_that_do_not_fit_the_axis_are_refused(spec, words):
    with pytest.raises(PassError) as e:
        run(traced_gpt(layers=4), "dce," + spec)
    assert words in str(e.value), str(e.value)


@pytest.mark.parametrize("key", [("gpipe", 4, 8, 4), ("1f1b", 4, 4, 4), ("1f1b", 4, 8, 4),
                                 ("interleaved", 8, 4, 4), ("interleaved", 8, 8, 4),
                                 ("interleaved", 4, 8, 2), ("interleaved-zb", 8, 8, 4),
                                 ("zbv", 8, 8, 4), ("zbv", 4, 8, 2),
                                 ("looped-bfs", 8, 4, 4), ("looped-bfs", 6, 8, 2),
                                 ("dualpipev", 4, 4, 2), ("dualpipev", 8, 8, 4),
                                 ("dualpipev", 8, 16, 4)])
def test_schedules_laid_out_in_time_have_the_textbook_bubble(key):
    """report/schedule.timeline places torch's action lists in time (each action when its
    rank is free and its input is done): with equal stages, backward twice the forward, the
    idle share is the record's bubble, (P - 1) / (v M + P - 1), and for the zero-bubble
    schedules (input and weight gradients each as long as the forward) (P - 1) /
    (3 v M + P - 1); DualPipeV's too, its overlapped pairs run one after the other (the
    overlap hides communication on a GPU, which equal stages do not model)."""
    from diphoma_compile.passes.pipeline_parallel import bubble_fraction
    from diphoma_compile.passes.pipeline_timeline import bubble, timeline
    schedule, stages, micro, ranks = key
    blocks = timeline(schedule_actions(*key), [1.0] * stages, [2.0] * stages)
    split = "zb" in schedule or schedule == "dualpipev"
    assert len(blocks) == (3 if split else 2) * stages * micro
    assert bubble(blocks) == pytest.approx(bubble_fraction(schedule, stages, micro, ranks))
    v = stages // ranks
    textbook = (ranks - 1) / ((3 if split else 1) * v * micro + ranks - 1)
    assert bubble(blocks) == pytest.approx(textbook)


@pytest.mark.parametrize("key", [("interleaved", 8, 2, 4), ("looped-bfs", 8, 3, 4),
                                 ("looped-bfs", 6, 1, 2), ("interleaved-zb", 8, 3, 4),
                                 ("zbv", 8, 4, 4)])
def test_fewer_microbatches_than_ranks_leave_more_bubble_than_the_textbook(key):
    """With M below P (zbv: below 2P - 1, what its generator plans for) the looped and
    zero-bubble schedules cannot fill their pipeline: the pass's bubble is that of equal
    stages laid out in the schedule's order (for interleaved and looped BFS 1 - v M / ((v
    - 1) P + M + P - 1)), not the textbook formula, which says 7-25 points less (the plan
    reported it until 2026-12-04)."""
    from diphoma_compile.passes.pipeline_parallel import bubble_fraction
    from diphoma_compile.passes.pipeline_timeline import bubble, timeline
    schedule, stages, micro, ranks = key
    got = bubble_fraction(schedule, stages, micro, ranks)
    assert got == pytest.approx(bubble(timeline(schedule_actions(*key), [1.0] * stages,
                                                [2.0] * stages)))
    v = stages // ranks
    textbook = (ranks - 1) / ((3 if "zb" in schedule else 1) * v * micro + ranks - 1)
    assert got > textbook + 0.05, (got, textbook)
    if "zb" not in schedule:
        assert got == pytest.approx(1 - v * micro / ((v - 1) * ranks + micro + ranks - 1))


def test_a_schedule_whose_actions_wait_on_each_other_is_refused():
    from diphoma_compile.passes.pipeline_timeline import ScheduleError, timeline
    # rank 0 runs its backward before rank 1 has run the forward it waits for: stuck
    acts = [[("F", 0, 0), ("B", 0, 0)], [("B", 0, 1), ("F", 0, 1)]]
    with pytest.raises(ScheduleError, match="cannot run"):
        timeline(acts, [1.0, 1.0], [2.0, 2.0])


def test_a_run_is_replayed_with_its_own_durations():
    """``durations`` gives single actions their own length (a measured run's), the rest keep
    their stage's: 1F1B on 2 ranks, 2 microbatches, by hand."""
    from diphoma_compile.passes.pipeline_timeline import bubble, timeline
    acts = [[("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0)],
            [("F", 0, 1), ("B", 0, 1), ("F", 1, 1), ("B", 1, 1)]]
    blocks = timeline(acts, [1.0, 1.0], [2.0, 2.0], durations={("F", 0, 1): 3.0})
    got = {(b.kind, b.microbatch, b.stage): (b.start, b.end) for b in blocks}
    # rank 1's slow first forward (1 -> 4) delays its backward (4 -> 6), rank 0's backward
    # of microbatch 0 (6 -> 8) and rank 1's second forward (6 -> 7)
    assert got == {("F", 0, 0): (0, 1), ("F", 1, 0): (1, 2), ("F", 0, 1): (1, 4),
                   ("B", 0, 1): (4, 6), ("F", 1, 1): (6, 7), ("B", 0, 0): (6, 8),
                   ("B", 1, 1): (7, 9), ("B", 1, 0): (9, 11)}
    assert bubble(blocks) == pytest.approx(1 - 6 / 11)


def traced_normed(momentum: float = 0.9):
    torch.manual_seed(0)
    model = NormedMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    g = diphoma_compile.trace(mse_step, model, opt, torch.randn(8, 16))
    return g.replace(mesh=Mesh({"pp": 4}))


def test_a_forward_that_updates_batch_statistics_is_not_microbatched():
    """BatchNorm's running statistics over M > 1 microbatches would each normalize a part
    of the batch (the step differs from the single-device one): refused, saying how."""
    with pytest.raises(PassError) as e:
        run(traced_normed(), "dce,pipeline{axis=pp, microbatches=2, schedule=gpipe}")
    msg = str(e.value)
    assert "bn.running_mean, bn.running_var, bn.num_batches_tracked" in msg, msg
    assert "microbatches=1" in msg, msg


class Normed(torch.nn.Module):
    """Four layers, a BatchNorm after the first (unless ``norm`` is False); with ``ema``,
    instead, the input scaled by a buffer the forward then updates from the output (read
    at the start, written at the end)."""

    def __init__(self, track: bool = True, ema: bool = False, norm: bool = True) -> None:
        super().__init__()
        self.fc = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(4)])
        self.bn = torch.nn.BatchNorm1d(16, track_running_stats=track)
        self.ema = ema
        self.norm = norm and not ema
        self.register_buffer("scale", torch.ones(16))

    def forward(self, x):
        if self.ema:
            x = x * self.scale
        for k, fc in enumerate(self.fc):
            x = torch.tanh(fc(x))
            if k == 0 and self.norm:
                x = self.bn(x)
        if self.ema:
            with torch.no_grad():
                self.scale.mul_(0.9).add_(0.1 * x.mean(0))
        return x


def traced_normed_pp2(pp: int = 2, **kw):
    torch.manual_seed(0)
    model = Normed(**kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = diphoma_compile.trace(mse_step, model, opt, torch.randn(8, 16))
    return g.replace(mesh=Mesh({"pp": pp}))


class Counting(torch.nn.Module):
    """Four residual layers and a buffer counting the forwards (no batch norm)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        self.calls.add_(1)
        return x


def test_a_buffer_a_forward_writes_is_refused_over_microbatches_in_its_own_words():
    """A counter the forward increments would count once per microbatch: refused, as a
    batch norm's statistics are, but the message spoke of BatchNorm and its hint of
    LayerNorm (a review found it, 2026-12-07); it names the buffer as one the forward
    writes now."""
    torch.manual_seed(0)
    model = Counting()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = diphoma_compile.trace(mse_step, model, opt, torch.randn(8, 16))
    with pytest.raises(PassError, match=r"writes buffers \(calls: running statistics, a "
                                        r"counter\).*a count 2 times") as e:
        run(g.replace(mesh=Mesh({"pp": 2})),
            "dce,pipeline{axis=pp, microbatches=2, schedule=gpipe}")
    assert "LayerNorm" not in str(e.value)


def test_a_batch_norm_without_running_statistics_is_not_microbatched_either():
    with pytest.raises(PassError, match=r"normalizes over the batch \(a batch norm at "):
        run(traced_normed_pp2(track=False), "dce,pipeline{axis=pp, microbatches=2, schedule=gpipe}")
    run(traced_normed_pp2(track=False), "dce,pipeline{axis=pp, microbatches=1, schedule=gpipe}")


def test_a_weight_gradient_that_would_flow_up_moves_to_its_layers_stage():
    """Four Linear + tanh layers over pp=4: layer 2's weight gradient reads the activation
    stage 1 made, so it was placed there, and stage 2 (which transposes it for its update)
    would have received a gradient from an earlier stage: "cannot cut the step into 4
    stages". pipeline_refine now moves such ops up to the stage that reads them."""
    out, _ = run(traced_normed_pp2(pp=4, norm=False),
                 "dce,pipeline{axis=pp, microbatches=1, schedule=gpipe}")
    types = out.value_types()
    sends = sorted((op.phase.value, op.stage, types[op.inputs[0]].shape) for op in out.ops
                   if op.name == "send")
    assert sends == sorted([("forward", s, (8, 16)) for s in range(3)]
                           + [("backward", s, (8, 16)) for s in range(1, 4)]), sends


def test_a_buffer_read_on_another_stage_than_its_update_is_refused():
    """A buffer read at the start of the forward (stage 0) and updated from the output at
    its end (stage 1): rank 0's copy would never change, so the pass refuses."""
    with pytest.raises(PassError, match="scale is updated on stage 1 but read on stage 0"):
        run(traced_normed_pp2(ema=True), "dce,pipeline{axis=pp, microbatches=1, "
            "schedule=gpipe}")


def test_new_state_is_made_where_it_lives_and_read_only_buffers_are_recomputed():
    """SGD momentum's new buffer (a term of the old one plus the gradient, two inputs of one
    size) is made on its parameter's stage: it went to the stage below, whose rank never
    held that state (the runtime failed writing it), and the weight gradient followed it
    down. Each layer's weight gradient is now on its own stage, one activation crosses
    each cut each way, and the scale made from the read-only buffer ``freq`` is computed
    on every stage (it was sent from stage 0)."""
    g = traced_normed()
    out, _ = run(g, "dce,pipeline{axis=pp, microbatches=1, schedule=gpipe}")
    stage_of = {v.name: op.stage for op in out.ops for v in op.results}
    for o in g.outputs:
        t = o.role.target or ""
        if t.startswith("fc."):          # a weight, a bias, or its momentum buffer
            layer = int(t.split(".")[1])
            assert stage_of[o.name] == layer, (t, stage_of[o.name])
    types = out.value_types()
    sends = [(op.phase.value, op.stage, types[op.inputs[0]].shape) for op in out.ops
             if op.name == "send"]
    assert sorted(sends) == sorted([("forward", s, (8, 16)) for s in range(3)]
                                   + [("backward", s, (8, 16)) for s in range(1, 4)]), sends
    cos = [op.stage for op in out.ops if op.attrs.get("target") == "aten.cos.default"]
    assert sorted(cos) == [0, 1, 2, 3]
    # the buffers the step updates are not recomputed anywhere: read and written on the
    # norm's stage only
    for b in ("bn.running_mean", "bn.num_batches_tracked"):
        assert {op.stage for op in out.ops if b in op.inputs} == {2}, b


def test_zbv_places_stages_in_a_v():
    """zbv: 4 stages on 2 ranks as 0 1 | 1 0 (stage 1 and 2 on rank 1: their pair is sent
    and received on that rank); stages=auto is twice the axis, any other count refused."""
    out, ctx = run(traced_gpt(layers=4), "dce,pipeline{axis=pp, microbatches=2, schedule=zbv}")
    rec = ctx.decision(PipelineRecord)
    assert [rec.rank_of(s) for s in range(4)] == [0, 1, 1, 0]
    recvs = {op.attrs["tag"]: op for op in out.ops if op.name == "recv"}
    pairs = {(op.stage, recvs[op.attrs["tag"]].stage, op.attrs["peer"]) for op in out.ops
             if op.name == "send" and op.phase.value == "forward"}
    assert pairs == {(0, 1, 1), (1, 2, 1), (2, 3, 0)}
    # the plan costs each backward's input-gradient part: on every stage, the first too
    # (its activation gradients run down to the embedding though nothing is sent), a part
    # of the backward near the others' (it failed: the first stage's I was empty, its W the
    # whole backward, a zero-bubble schedule's longest run)
    grads = [(st.input_grad_flops, st.backward_flops) for st in rec.stages]
    assert all(0 < i < b for i, b in grads), grads
    shares = [i / b for i, b in grads]
    assert max(shares) - min(shares) < 0.1, shares
    with pytest.raises(PassError, match="two stages per device in a V"):
        run(traced_gpt(layers=4), "dce,pipeline{axis=pp, stages=6, schedule=zbv}")


def test_golden_pipeline_global_clip_packed(golden):
    """The clipped step over pp=2: stage 1's gradient norms cross packed into one message
    (reshape to [1], concat, send; recv, slice, reshape), the factor comes back."""
    torch.manual_seed(0)
    model = GPT(vocab=16, d=8, layers=2, heads=2, block=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seq = torch.randint(0, 16, (2, 5))
    g = diphoma_compile.trace(lm_step_clipped, model, opt,
                              {"idx": seq[:, :-1], "targets": seq[:, 1:]})
    out, _ = run(g.replace(mesh=Mesh({"pp": 2})), "dce,pipeline")
    names = [op.name for op in out.ops]
    assert names.count("concat") == 1 and names.count("slice") > 1
    text = print_graph(out)
    assert parse(text) == out
    golden("torch_gpt_clip.pp2.ir", text)


def test_plan_memory_is_the_fullest_ranks_with_its_microbatches_in_flight():
    """Under a pipeline the plan's memory per device is one rank's: the parameters its
    stages read, and the activations of the microbatches its schedule keeps at once (GPipe:
    all M; 1F1B: P - r on rank r; zbv: to each weight-gradient run), not the whole step's
    for one microbatch."""
    from diphoma_compile.report.plan import _saved_by_stage, build_plan
    plans = {}
    for schedule in ("gpipe", "1f1b"):
        out, ctx = run(traced_gpt(layers=4),
                       f"dce,pipeline{{axis=pp, microbatches=4, schedule={schedule}}}")
        plans[schedule] = build_plan(out, ctx.decisions).memory
        saved = _saved_by_stage(out, {"pp": 2}, out.value_types())
    s0, s1 = saved[0], saved[1]
    assert s0 > 0 and s1 > 0
    assert plans["gpipe"].activations == 4 * max(s0, s1)
    assert plans["1f1b"].activations == max(2 * s0, s1)       # rank 0 keeps two
    assert plans["1f1b"].single_device_activations == 4 * (s0 + s1)   # M microbatches
    stages = ctx.decision(PipelineRecord).stages
    assert plans["1f1b"].params == max(st.param_bytes for st in stages) \
        < plans["1f1b"].single_device_params
    # zbv over 2 ranks (stages 0 and 3 on rank 0, 1 and 2 on rank 1), M = 4: a forward
    # keeps its stage's saved values until its weight-gradient run W. Rank 0 runs
    # 0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 ..., rank 1 1F0 2F0 1F1 2F1 2I0 2W0 1F2 ...
    out, _ = run(traced_gpt(layers=4), "dce,pipeline{axis=pp, microbatches=4, schedule=zbv}")
    v = _saved_by_stage(out, {"pp": 2}, out.value_types())
    assert len(v) == 4 and all(v.values())
    assert build_plan(out, {}).memory.activations == max(
        3 * v[0] + v[3], 4 * v[0], 2 * v[1] + 2 * v[2], 3 * v[1] + v[2])


def test_update_programs_write_in_place_and_each_rank_has_its_peak():
    """The update programs of a staged step mark each new parameter and momentum buffer as
    replacing its input (so the torch runtime writes it into the input's storage where it is
    made, as the unstaged step does) and each backward the gradients its sums may start
    from; the plan walks each rank's programs in its schedule's
    order for that rank's peak (report/pipeline_peak.py; the distributed check measures it):
    GPipe's first rank, keeping all 4 microbatches, peaks above 1F1B's (2), and writing the
    update in place lowers no rank's peak below what it holds."""
    from diphoma_compile.passes.pipeline_programs import rank_stage_programs
    from diphoma_compile.report.pipeline_peak import pipeline_peak
    from diphoma_compile.report.plan import build_plan
    from diphoma_compile.torch.framework import TorchFramework
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        out, ctx = run(traced_gpt(layers=4, momentum=0.9),
                       f"dce,pipeline{{axis=pp, microbatches=4, schedule={schedule}}}")
        replaced = {o.role.target for cut in rank_stage_programs(out)
                    for (_, kind), prog in cut.programs.items() if kind.startswith("U")
                    for o in prog.graph.outputs if o.role.target is not None}
        params = {i.name for i in out.inputs if i.role.kind.value in ("param", "opt_state")}
        assert replaced == params, params ^ replaced
        # the gradient sums start from a backward's own tensors (no copy), never from one
        # it sends or one that shares its storage with another summed value
        for cut in rank_stage_programs(out):
            for (_, kind), prog in cut.programs.items():
                assert set(prog.acc_owned) <= set(prog.acc)
                assert not set(prog.acc_owned) & {n for n, _, _ in prog.sends}
                if kind == "B":
                    assert prog.acc_owned, "no gradient sum starts without a copy"
                else:
                    assert not prog.acc_owned, kind
        in_place = TorchFramework().in_place_updates(out)
        assert len(in_place) == len(params)
        mem = build_plan(out, ctx.decisions, in_place=in_place).memory
        assert len(mem.peak_per_rank) == 2 and mem.peak == max(mem.peak_per_rank)
        opts = ctx.decision(PipelineRecord)
        copies = pipeline_peak(out, opts, ())       # new values made beside the old
        assert all(a <= b for a, b in zip(mem.peak_per_rank, (p.bytes for p in copies)))
        peaks[schedule] = mem.peak_per_rank
    assert peaks["gpipe"][0] > peaks["1f1b"][0]


def test_a_pipelines_compute_counts_every_microbatch_and_its_bubble():
    """The plan's compute under a pipeline (report/pipeline_time.py): a staged graph is
    traced at the microbatch, so the step's flops are every stage's forward and backward M
    times and the update once: the unstaged step's on all M microbatches at once (one pass
    over the staged graph counted one microbatch); a rank does its stages' share; the step
    time adds the schedule's bubble, which more microbatches shrink when the link costs
    nothing."""
    from diphoma_compile.ir.device_model import Link, device_model
    from diphoma_compile.report.plan import build_plan
    free = device_model("cpu-gloo").replace(link=Link(1e30, 0.0), launch_s=0.0)
    share = {}
    for m in (2, 8):
        whole = build_plan(traced_gpt(layers=4, mesh={"dp": 1}, seqs=2 * m), {}).compute
        out, ctx = run(traced_gpt(layers=4), f"dce,pipeline{{axis=pp, microbatches={m}}}")
        c = build_plan(out, ctx.decisions, device_model=free).compute
        assert abs(c.flops_per_step - whole.flops_per_step) <= 0.01 * whole.flops_per_step, \
            (m, c.flops_per_step, whole.flops_per_step)
        assert c.flops_per_step / 2 <= c.flops_per_device < c.flops_per_step
        assert c.bubble_s > 0 and c.total_s == c.compute_s + c.exposed_comm_s + c.bubble_s
        share[m] = c.bubble_s / c.total_s
    assert share[8] < share[2]


def test_stages_balance_forward_backward_and_update_time_not_forward_flops():
    """Fine-tuning an 8-layer MLP whose first 4 layers are frozen, pp=2: the frozen layers'
    backward computes no weight gradients (and none at all below the first trainable
    layer), so equal forward flops (balance=forward-flops: 4 and 4 layers) leave the first
    stage with under a third of the last one's time on the device model. Balanced on each
    op's roofline seconds with the backward and update that run beside it (the default),
    the first stage takes 6 layers and the two stages' times are within 10%."""
    from diphoma_compile.ir.analysis import op_cost
    from diphoma_compile.ir.device_model import device_model
    from models import frozen_mlp, mse_step, trainable

    torch.manual_seed(0)
    model = frozen_mlp(layers=8, frozen=4, width=64)
    opt = torch.optim.SGD(trainable(model), lr=0.1, momentum=0.9)
    g = diphoma_compile.trace(mse_step, model, opt, torch.randn(32, 64)).replace(
        mesh=Mesh({"pp": 2}))
    hw = device_model("h100-nccl")
    got = {}
    for balance in ("time", "forward-flops"):
        out, ctx = run(g, f"dce,pipeline{{axis=pp, microbatches=2, balance={balance}}}")
        types, seconds = out.value_types(), [0.0, 0.0]
        for op in out.ops:
            c = op_cost(op, types, {})
            runs = 0.5 if op.phase.value == "update" else 1.0    # once a step, M = 2
            seconds[op.stage] += runs * hw.compute_s(c.flops, c.bytes)
        got[balance] = ([len(s.layers) for s in ctx.decision(PipelineRecord).stages],
                        seconds)
    (layers, (a, b)), (flat, (c, d)) = got["time"], got["forward-flops"]
    assert flat == [4, 4] and d > 3 * c, got
    assert layers == [6, 2] and max(a, b) <= 1.1 * min(a, b), got


def test_an_unknown_balance_or_device_model_is_refused():
    with pytest.raises(PassError, match="unknown balance 'bytes'"):
        run(traced_gpt(), "dce,pipeline{axis=pp, balance=bytes}")
    with pytest.raises(PassError, match="unknown device model 'tpu'") as e:
        run(traced_gpt(), "dce,pipeline{axis=pp, device-model=tpu}")
    assert "hint: device-model=NAME" in str(e.value)


def test_the_device_a_torch_step_runs_on_is_its_parameters():
    """What parallelize picks the pipeline's device model from: the first parameter of a
    module (or of an optimizer, or the first tensor) among the step's arguments."""
    from diphoma_compile.torch.framework import FRAMEWORK
    cpu, meta = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta")
    assert FRAMEWORK.device((cpu, torch.optim.SGD(cpu.parameters(), lr=0.1))) == ("cpu", "")
    assert FRAMEWORK.device((meta,)) == ("meta", "")
    assert FRAMEWORK.device((torch.optim.SGD(meta.parameters(), lr=0.1), 3)) == ("meta", "")
    assert FRAMEWORK.device((torch.nn.ReLU(), torch.zeros(1, device="meta"))) == ("meta", "")
    assert FRAMEWORK.device(({"lr": 0.1},)) == ("", "")


def test_a_frozen_tied_parameter_is_held_on_both_stages_and_never_sent():
    """The tied embedding frozen (fine-tuning): the step's "new value" of it is the
    parameter itself, which the pass sent from its home stage's update as a tied
    parameter's new value, from a program that does not hold it (a KeyError on that rank,
    the others waiting, in a 4-rank run of Hugging Face GPT-2). Now it is read on both
    stages, not tied, and no update value crosses."""
    torch.manual_seed(0)
    model = GPT(vocab=16, d=8, layers=2, heads=2, block=4)
    model.tok.weight.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    seq = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(3))
    g = diphoma_compile.trace(lm_step, model, opt, {"idx": seq[:, :-1],
                                                     "targets": seq[:, 1:]})
    out, ctx = run(g.replace(mesh=Mesh({"pp": 2})), "dce,pipeline{axis=pp, microbatches=2}")
    rec = ctx.decision(PipelineRecord)
    assert rec.tied == {}
    assert [s.layers[0] for s in rec.stages] == ["tok", "tok"]
    assert not [op for op in out.ops if op.name == "send" and op.phase.value == "update"]


def test_a_send_and_its_receive_of_different_cadence_are_refused():
    """A value sent by a program run per microbatch and received by one run once a step
    (or the other way round) would leave the ranks waiting on each other forever (GPT-NeoX
    at pp=4 hung so, 2026-12-04): rank_stage_programs refuses such a cut."""
    from diphoma_compile.errors import DiphomaError
    from diphoma_compile.passes.pipeline_programs import (StageProgram, StagePrograms,
                                                          _check_cadence)
    g = traced_gpt(layers=1)

    def cut(kind: str, sends=(), recvs=()) -> StagePrograms:
        out = StagePrograms("FBU", 1)
        out.programs[(0, kind)] = StageProgram(g, sends=list(sends), recvs=list(recvs))
        return out
    _check_cadence([cut("B", sends=[("g", 0, 5)]), cut("B", recvs=[("g.s0", 1, 5)])])
    with pytest.raises(DiphomaError, match="one of them run per microbatch"):
        _check_cadence([cut("B", sends=[("g", 0, 5)]), cut("U0", recvs=[("g.s0", 1, 5)])])


def test_dualpipev_defaults_to_as_many_microbatches_as_stages():
    """Other schedules default to M = P; DualPipeV takes M >= 2P (its stages), so its
    default is 2P (with M = P every plan of it was refused)."""
    from diphoma_compile.api import pipeline_settings
    from diphoma_compile.mesh import Mesh
    mesh = Mesh({"dp": 2, "pp": 4})
    assert pipeline_settings(mesh, None, None, "dualpipev").microbatches == 8
    assert pipeline_settings(mesh, None, None, "zbv").microbatches == 4
    assert pipeline_settings(mesh, None, 12, "dualpipev").microbatches == 12


def test_a_clipped_step_is_cut_where_the_unclipped_one_is():
    """clip_grad_norm_'s factor is made from every stage's norms (weighed on the last
    stage), and each gradient's scaling by it was weighed there too: the balance then
    sought its cuts near the end alone, and a 6-layer residual MLP (or a 4-layer BERT) at
    pp=2 or pp=4 was refused as having too few places to cut (a reviewer's probe). The
    scaling is weighed where its gradient is now: the same stages as without the clip."""
    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Linear(8, 16)
            self.layers = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(4)])
            self.out = torch.nn.Linear(16, 4)

        def forward(self, x):
            x = self.emb(x)
            for layer in self.layers:
                x = x + torch.tanh(layer(x))
            return self.out(x)

    def step(model, opt, x, y, clip):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
        return loss
    for pp in (2, 4):
        stages = []
        for clip in (False, True):
            torch.manual_seed(0)
            m = Net()
            o = torch.optim.AdamW(m.parameters(), lr=1e-2)
            ps = diphoma_compile.parallelize(step, {"pp": pp}, microbatches=2)
            ps.trace(m, o, torch.randn(8, 8), torch.randint(0, 4, (8,)), clip)
            stages.append([s.layers for s in ps.plan.decision(PipelineRecord).stages])
        assert stages[0] == stages[1] and len(stages[0]) == pp, stages


def test_gradient_accumulation_inside_the_step_that_cannot_be_cut_says_why():
    """Two backward() calls in one step (accumulating over chunks) under pp=4 on a tiny
    Hugging Face GPT-2: the two forwards leave no cut giving each stage its layers, and the
    refusal said the model had too few places to cut; it names the second forward now, and
    microbatches= as the way. (Where the cuts are found, as an MLP's at pp=2, the step runs
    and its parameters match the single-device step.)"""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")

    def accum(model, opt, ids):
        for part in ids.chunk(2):
            loss = model(input_ids=part, labels=part).loss / 2
            loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=4, n_head=2))
    opt = torch.optim.AdamW(model.parameters())
    ps = diphoma_compile.parallelize(accum, {"pp": 4}, microbatches=2)
    with pytest.raises(PassError, match="runs its forward again after a backward") as e:
        ps.trace(model, opt, torch.randint(0, 64, (8, 16)))
    assert "microbatches=M" in str(e.value)


def test_a_mean_over_targets_divides_by_the_count_over_all_microbatches():
    """F.cross_entropy (a mean over the targets not ignored: aten's nll_loss returns that
    count beside the mean) over pp=2 with 2 microbatches: the last stage gets a count
    program C, the targets not equal to ignore_index counted (nll_loss's rule, row_count:
    no logits, nor zeros in their place), whose count the runtime adds up over the
    microbatches (microbatch_sum) before the schedule; the forward program reads the total
    divided by the shares (program T, run once on the sums) and keeps none of it; the mean
    divides by the total / M. The plan lists it as counted over the microbatches, not as
    each microbatch's own. With data-parallel summing the counts over dp first, refused;
    with the pipeline summing them over dp, the all-reduce runs once a step in the stage's
    program T, on the total, not in each microbatch's F."""
    from diphoma_compile.passes.pipeline_programs import stage_programs
    from diphoma_compile.report.plan import build_plan
    out, ctx = run(traced_gpt(), "dce,pipeline{axis=pp, microbatches=2}")
    rec = ctx.decision(PipelineRecord)
    assert len(rec.counted_globally) == 1 and "nll_loss_forward" in rec.counted_globally[0]
    assert rec.batch_counted == ()
    (total,) = [op for op in out.ops if op.name == "microbatch_sum"]
    assert total.stage == 1 and total.attrs["op"] == "sum"
    cut = stage_programs(out, [0, 1], "1f1b")
    assert set(cut.counts) == {1}
    c = cut.counts[1]
    # the targets' copy and reshape, then those not ignored counted
    assert [op.name for op in c.graph.ops][-4:] == ["full", "ne", "convert", "reduce_sum"]
    assert all(op.results[0].type.numel <= 8 for op in c.graph.ops)     # nothing logits-sized
    assert {i.role.kind.value for i in c.graph.inputs} == {"batch"}
    assert cut.totals[1] == {total.results[0].name: (total.inputs[0], "sum")}
    assert c.outputs == [total.inputs[0]]
    forward = cut.programs[(1, "F")]
    t = cut.once[1]             # the total divided by the shares, once a step
    assert t.inputs == [total.results[0].name] and [op.name for op in t.graph.ops] == [
        "full", "div"]
    assert t.outputs[0] in forward.inputs
    assert not any(op.name in ("ne", "full") for op in forward.graph.ops), \
        "the count stays in C and T"
    text = build_plan(out, ctx.decisions).to_text()
    assert "divides its sum by the count summed over the microbatches" in text
    assert "divides by its own count" not in text
    g = traced_gpt(mesh={"dp": 2, "pp": 2}, seqs=4)
    with pytest.raises(PassError, match="data-parallel already divides the step's means "
                                        "over counts"):
        run(g, "dce,data-parallel{axis=dp},pipeline{axis=pp, microbatches=2}")
    out, _ = run(g, "dce,data-parallel{axis=dp, counts=local},pipeline{axis=pp, microbatches=2}")
    # over dp the total is all-reduced once a step, in program T, not in every microbatch's F
    cut = stage_programs(out, [0, 1], "1f1b")
    (total,) = [op.results[0].name for op in out.ops if op.name == "microbatch_sum"]
    t = cut.once[1]
    assert t.inputs == [total]
    assert [(op.attrs["axis"], op.attrs["op"]) for op in t.graph.ops
            if op.name == "all_reduce"] == [("dp", "sum")]
    forward = cut.programs[(1, "F")]
    assert set(t.outputs) <= set(forward.inputs) | set(cut.programs[(1, "B")].inputs)
    assert total not in forward.inputs
    assert not any(op.name == "all_reduce" for op in forward.graph.ops)



@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_data_parallel_all_reduces_run_once_a_step_on_the_sums(schedule):
    """Over dp=2 x pp=2 with 2 microbatches the gradients' and the loss's all-reduces over
    dp run in the update programs, on the sums over the microbatches, not in each
    microbatch's forward or backward (M times the bytes: the plan counts each collective
    once a step). What leaves the microbatch is the local gradient, summed; a split
    backward (zbv: I and W) keeps none either."""
    from diphoma_compile.passes.pipeline_programs import stage_programs
    g = traced_gpt(layers=4, mesh={"dp": 2, "pp": 2}, seqs=4)
    out, _ = run(g, "dce,data-parallel{axis=dp, counts=local},"
                    f"pipeline{{axis=pp, microbatches=2, schedule={schedule}}}")
    reduces = {op.results[0].name: op for op in out.ops if op.name == "all_reduce"}
    cut = stage_programs(out, sorted({op.stage for op in out.ops}), schedule)
    where = {}
    for (_, kind), prog in cut.programs.items():
        where.update((op.results[0].name, kind) for op in prog.graph.ops
                     if op.name == "all_reduce")
        if not kind.startswith("U"):
            assert not set(prog.acc) & set(reduces), "a reduced value summed per microbatch"
    for prog in cut.once.values():
        where.update((op.results[0].name, "T") for op in prog.graph.ops
                     if op.name == "all_reduce")
    # the count's all-reduce runs once in program T; every other one in an update
    assert where.keys() == reduces.keys()
    assert sorted(where.values()) == ["T"] + ["U0"] * (len(reduces) - 1)
    grads = [n for n, op in reduces.items() if op.phase.value == "backward"]
    assert len(grads) > 10 and all(where[n] == "U0" for n in grads)


def test_the_plan_counts_each_collective_as_often_as_its_program_runs():
    """dp=2 x pp=2, M = 3: each collective of the plan names its pp rank and how often it
    runs a step (a send of the forward or backward M times, the gradients' reductions in
    the update once); its bytes count every run; the step's bytes are the fullest rank's,
    not every stage's summed (the distributed check matches them to the bytes sent); a send
    to another stage of the same rank moves none."""
    from diphoma_compile.report.plan import build_plan
    g = traced_gpt(mesh={"dp": 2, "pp": 2}, seqs=6)
    out, ctx = run(g, "dce,data-parallel{axis=dp, counts=local},"
                      "pipeline{axis=pp, microbatches=3}")
    plan = build_plan(out, ctx.decisions)
    by = {(c.kind, c.phase, c.runs) for c in plan.collectives}
    assert ("send", "forward", 3) in by and ("send", "backward", 3) in by
    assert {c.runs for c in plan.collectives if c.kind == "all_reduce"
            and c.phase == "backward"} == {1}
    assert {c.pp_rank for c in plan.collectives} == {0, 1}
    assert all(c.bytes_per_device % c.runs == 0 for c in plan.collectives)
    assert len(plan.comm_bytes_per_rank) == 2
    assert plan.comm_bytes_per_step == max(plan.comm_bytes_per_rank) > 0
    assert sum(plan.comm_bytes_per_rank) == sum(c.bytes_per_device for c in plan.collectives)
    text = plan.to_text()
    assert "(the fullest pipeline rank; by pp rank: " in text
    # the calls a step (the distributed check counts them too): forward and backward sends
    # M times, the update's reductions once
    calls = plan.comm_calls_per_rank
    assert len(calls) == 2 and all(n > 0 for n in calls)
    assert calls[0] == sum(c.runs for c in plan.collectives if c.pp_rank == 0
                           and c.kind in ("send", "all_reduce", "reduce_scatter", "all_gather"))
    r = max((0, 1), key=lambda k: plan.comm_bytes_per_rank[k])
    assert f"pp rank {r} makes {calls[r]} calls a step" in text
    # zbv: stages 0 and 3 on rank 0 hold the tied embedding; what one sends the other is
    # handed over in memory (the distributed check measured it: the plan said 40 KB more)
    out, ctx = run(traced_gpt(layers=4), "dce,pipeline{axis=pp, microbatches=2, schedule=zbv}")
    plan = build_plan(out, ctx.decisions)
    local = [c for c in plan.collectives if c.kind == "send" and c.pp_rank == 0 and
             "tok" in str(c.belongs_to) + c.serves]
    peers = {op.inputs[0]: op.attrs["peer"] for op in out.ops if op.name == "send"}
    assert local and all(c.bytes_per_device == 0 for c in local if peers[c.value] == 0)

def masked_by_draw_step(model, opt, batch):
    """A mean over tokens drawn at random in the step (as BERT's masking), divided by how
    many were drawn."""
    logits = model(batch["idx"]).flatten(0, 1)
    per = F.cross_entropy(logits, batch["targets"].flatten(), reduction="none")
    drawn = (torch.rand(per.shape) < 0.7).float()
    loss = (per * drawn).sum() / drawn.sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_a_count_of_random_draws_stays_each_microbatchs_own():
    """A count made from numbers drawn in the step cannot be made again before the
    schedule (drawn again, it would count other tokens than the loss sums): it stays each
    microbatch's own and listed, where the same count of a mask the step is given is
    summed over the microbatches."""
    out, ctx = run(traced_gpt(step=masked_by_draw_step), "dce,pipeline{axis=pp, microbatches=2}")
    rec = ctx.decision(PipelineRecord)
    assert rec.counted_globally == () and len(rec.batch_counted) == 1
    assert not any(op.name == "microbatch_sum" for op in out.ops)


class _Weighted(torch.nn.Module):
    """GPT with class weights for its loss held as a frozen parameter, and a buffer the
    step moves (what a mask compares the targets with)."""

    def __init__(self):
        super().__init__()
        self.gpt = GPT(vocab=16, d=8, layers=2, heads=2, block=4)
        self.cw = torch.nn.Parameter(torch.linspace(0.5, 1.5, 16), requires_grad=False)
        self.register_buffer("lo", torch.tensor(2))


def weighted_step(model, opt, batch):
    logits = model.gpt(batch["idx"]).flatten(0, 1)
    loss = F.cross_entropy(logits, batch["targets"].flatten(), weight=model.cw,
                           ignore_index=0)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def moved_buffer_step(model, opt, batch):
    keep = (batch["targets"].flatten() >= model.lo).float()
    logits = model.gpt(batch["idx"]).flatten(0, 1)
    per = F.cross_entropy(logits, batch["targets"].flatten(), reduction="none")
    loss = (per * keep).sum() / keep.sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    model.lo.add_(1)
    return loss


def test_a_count_program_reads_class_weights_and_refuses_a_moved_buffer():
    """Class weights held as a frozen parameter: the count program's copy of nll_loss
    reads zeros for the logits alone and the weights as they are (a review found the
    weights zeroed too: a count of 0, an infinite loss). (Without class weights the
    targets are counted without the copy: the test above.) A mask made from a buffer the
    step updates cannot be made again before the schedule (only the stage that updates
    it holds the new value): that count stays each microbatch's own, and is listed."""
    from diphoma_compile.passes.pipeline_programs import stage_programs
    torch.manual_seed(0)
    model = _Weighted()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seq = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(3))
    batch = {"idx": seq[:, :-1], "targets": seq[:, 1:]}
    g = diphoma_compile.trace(weighted_step, model, opt, batch).replace(mesh=Mesh({"pp": 2}))
    out, ctx = run(g, "dce,pipeline{axis=pp, microbatches=2}")
    assert len(ctx.decision(PipelineRecord).counted_globally) == 1
    c = stage_programs(out, [0, 1], "1f1b").counts[1]
    count = c.graph.ops[-1]
    zeros = [op.results[0].name for op in c.graph.ops if op.name == "full"]
    weight = next(i.name for i in c.graph.inputs if i.role.kind.value == "param")
    assert "nll_loss_forward" in count.attrs["target"] and count.inputs[0] in zeros
    assert weight in count.inputs
    g = diphoma_compile.trace(moved_buffer_step, model, opt, batch).replace(
        mesh=Mesh({"pp": 2}))
    out, ctx = run(g, "dce,pipeline{axis=pp, microbatches=2}")
    rec = ctx.decision(PipelineRecord)
    assert rec.counted_globally == () and len(rec.batch_counted) == 1


def test_one_microbatch_over_dp_and_pp_sums_counts_over_dp():
    """With one microbatch nothing is summed over time: data-parallel sums a mean's count
    over its devices, as without a pipeline (a review found it left each device's own)."""
    torch.manual_seed(0)
    model = GPT(vocab=16, d=8, layers=2, heads=2, block=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seq = torch.randint(0, 16, (4, 5), generator=torch.Generator().manual_seed(3))
    pstep = diphoma_compile.parallelize(lm_step, {"dp": 2, "pp": 2}, microbatches=1,
                                        schedule="gpipe")
    pstep.trace(model, opt, {"idx": seq[:, :-1], "targets": seq[:, 1:]})
    notes = pstep.plan.notes
    assert len(notes["data-parallel"]["counted_globally"]) == 1
    assert notes["pipeline"]["counted_globally"] == []


SHARDED = ("dce,data-parallel{axis=dp, counts=local},weight-update-sharding{axis=dp},dce,"
           "shard-params{axis=dp},dce,pipeline{axis=pp, microbatches=4%s}")


def test_parameters_held_as_pieces_are_gathered_once_a_step():
    """shard_params over dp=2 x pp=2, M = 4: each stage gathers each parameter it reads
    once a step, in its program T, before the schedule (gather=step, the default); its
    forward and backward programs gather nothing. The tied embedding is gathered on both
    stages from their own pieces, never sent whole from one to the other (it was, every
    microbatch). gather=microbatch keeps the gathers in every microbatch's forward and
    backward: the plan counts them 4 times, and the step's bytes are higher. The peak
    counts the whole parameters T holds through the schedule."""
    from diphoma_compile.passes.pipeline_programs import stage_programs
    from diphoma_compile.report.plan import build_plan
    g = traced_gpt(layers=4, mesh={"dp": 2, "pp": 2}, seqs=8)
    plans, programs, graphs = {}, {}, {}
    for gather in ("step", "microbatch"):
        out, ctx = run(g, SHARDED % ("" if gather == "step" else ", gather=microbatch"))
        graphs[gather] = out
        params = {i.name for i in out.inputs if i.role.kind.value == "param"}
        whole = {op.results[0].name for op in out.ops if op.name == "all_gather"
                 and set(op.inputs) <= params}
        assert not [op for op in out.ops if op.name == "send" and op.inputs[0] in whole]
        cut = stage_programs(out, [0, 1], "1f1b")
        programs[gather] = {key: [op.inputs[0] for op in p.graph.ops if op.name == "all_gather"]
                            for key, p in cut.programs.items()}
        programs[gather].update({(st, "T"): [op.inputs[0] for op in p.graph.ops
                                             if op.name == "all_gather"]
                                 for st, p in cut.once.items()})
        plans[gather] = build_plan(out, ctx.decisions)
    got = programs["step"]
    assert all(not v for (_, kind), v in got.items() if kind != "T"), got
    for st in (0, 1):
        assert got[(st, "T")] and len(got[(st, "T")]) == len(set(got[(st, "T")]))
        assert "tok.weight" in got[(st, "T")]
    assert set(got[(0, "T")]) | set(got[(1, "T")]) == params
    old = programs["microbatch"]
    for st in (0, 1):
        assert not old.get((st, "T")) and "tok.weight" in old[(st, "F")]
        assert set(old[(st, "F")]) == set(got[(st, "T")])
        assert old[(st, "B")]           # gathered again for the backward
    step, micro = plans["step"], plans["microbatch"]
    assert {c.runs for c in step.collectives if c.kind == "all_gather"} == {1}
    assert {c.runs for c in micro.collectives if c.kind == "all_gather"} == {4}
    assert len([c for c in step.collectives if c.kind == "all_gather"]) == \
        len(got[(0, "T")]) + len(got[(1, "T")])
    gathered = [sum(c.bytes_per_device for c in p.collectives
                    if c.kind == "all_gather" and c.pp_rank == r)
                for p in (step, micro) for r in (0, 1)]
    assert gathered[2] > 4 * gathered[0] and gathered[3] > 4 * gathered[1], gathered
    assert max(step.comm_bytes_per_rank) < max(micro.comm_bytes_per_rank)
    # the parameters whole all through the schedule: a higher peak than gathered per use
    assert step.memory.peak > micro.memory.peak
    assert "gathered once a step on each pipeline stage that reads them (once" in step.to_text()
    assert "in each of the 4 microbatches (gather=microbatch)" in micro.to_text()
    assert step.to_dict()["notes"]["pipeline"]["gather"] == "step"
    # the step-time estimate counts T's gathers, once, before the schedule
    assert 0 < step.compute.exposed_comm_s < micro.compute.exposed_comm_s
    assert step.compute.total_s < micro.compute.total_s
    from diphoma_compile.ir.device_model import device_model
    from diphoma_compile.passes.pipeline_parallel import pipeline_of
    from diphoma_compile.passes.pipeline_programs import rank_stage_programs
    from diphoma_compile.report.pipeline_time import pipeline_compute
    cuts = rank_stage_programs(graphs["step"])
    model = device_model("h100-nccl")
    counted = pipeline_compute(graphs["step"], pipeline_of(graphs["step"]), model, cuts)
    for cut in cuts:
        cut.once.clear()
    left_out = pipeline_compute(graphs["step"], pipeline_of(graphs["step"]), model, cuts)
    assert counted.exposed_comm_s > left_out.exposed_comm_s
    with pytest.raises(PassError, match="unknown gather 'never'"):
        run(g, SHARDED % ", gather=never")


def test_a_rank_gathers_a_parameter_two_of_its_stages_read_once():
    """zbv over dp=2 x pp=2: rank 0 runs the first and the last of the 4 stages, and both
    read the tied embedding. The first's program T gathers it; the last stage's programs
    read that value, and the rank gathers nothing twice (it gathered the embedding on each
    stage, and held two whole copies through the schedule). The plan counts one gather of
    it on pp rank 0, and the text says so."""
    from diphoma_compile.passes.pipeline_programs import rank_stage_programs
    from diphoma_compile.report.plan import build_plan
    g = traced_gpt(layers=4, mesh={"dp": 2, "pp": 2}, seqs=8)
    out, ctx = run(g, SHARDED % ", schedule=zbv")
    cuts = rank_stage_programs(out)
    assert sorted(cuts[0].once) == [0, 3] and sorted(cuts[1].once) == [1, 2]
    for cut in cuts:
        gathered = [op.inputs[0] for p in cut.once.values() for op in p.graph.ops
                    if op.name == "all_gather"]
        assert len(gathered) == len(set(gathered)), sorted(gathered)
        for key, prog in cut.programs.items():
            assert not any(op.name == "all_gather" for op in prog.graph.ops), key
    first = cuts[0].once[0]
    whole = next(op.results[0].name for op in first.graph.ops
                 if op.name == "all_gather" and op.inputs[0] == "tok.weight")
    assert whole in first.outputs
    assert whole in cuts[0].programs[(3, "F")].inputs     # the LM head reads stage 0's
    assert not any(op.name == "all_gather" and op.inputs[0] == "tok.weight"
               for op in cuts[0].once[3].graph.ops)
    plan = build_plan(out, ctx.decisions)
    emb = [c for c in plan.collectives if c.kind == "all_gather" and c.value == "tok.weight"]
    assert [(c.pp_rank, c.runs) for c in emb] == [(0, 1)]
    assert "(once for the stages of a rank)" in plan.to_text()
