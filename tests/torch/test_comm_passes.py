"""comm-fusion and schedule-comm on a traced step with many small gradients: goldens, bucket
order and sizes, where issue and wait go, and the plan's counts before and after."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

import diphoma_compile  # noqa: E402
from diphoma_compile.ir import print_graph  # noqa: E402
from diphoma_compile.ir.analysis import free_inputs  # noqa: E402
from diphoma_compile.mesh import Mesh  # noqa: E402
from diphoma_compile.passes import PassContext, Pipeline  # noqa: E402

WUS = "dce,data-parallel,weight-update-sharding,dce"


class Deep(torch.nn.Module):
    """Six small layers: twelve small gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(6))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def step(model, opt, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def traced():
    torch.manual_seed(0)
    model = Deep()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = diphoma_compile.trace(step, model, opt, torch.randn(8, 8), torch.randn(8, 8))
    return g.replace(mesh=Mesh({"dp": 4}))


def run(spec: str):
    ctx = PassContext()
    return Pipeline.from_spec(spec).run(traced(), ctx), ctx


def test_golden_fused_and_scheduled(golden):
    # 1e-3 MB = 1000 bytes: a few layers' gradients per bucket
    g, _ = run(WUS + ",comm-fusion{bucket-mb=0.001},schedule-comm")
    golden("torch_deep_sgd.fused-scheduled.ir", print_graph(g))


def test_buckets_follow_backward_order_and_size():
    plain, _ = run(WUS)
    order = [op.inputs[0] for op in plain.ops if op.name == "reduce_scatter"]
    sizes = {op.inputs[0]: sum(plain.value_types()[n].nbytes for n in op.inputs)
             for op in plain.ops if op.name == "reduce_scatter"}
    g, ctx = run(WUS + ",comm-fusion{bucket-mb=0.001}")
    buckets = [op for op in g.ops if op.name == "reduce_scatter"]
    assert 1 < len(buckets) < len(order)
    assert [n for op in buckets for n in op.inputs] == order     # gradients in backward order
    for op in buckets[:-1]:     # a bucket closes once it reaches the size
        assert sum(sizes[n] for n in op.inputs) >= 1000
        assert sum(sizes[n] for n in op.inputs[:-1]) < 1000
    fusion = ctx.decision(diphoma_compile.passes.CommFusionRecord)
    assert fusion.collectives_before > fusion.collectives_after
    assert fusion.bytes_before == fusion.bytes_after   # same bytes, fewer messages
    one, ctx1 = run(WUS + ",comm-fusion")   # 25 MB: everything of a kind in one bucket
    assert sum(op.name == "reduce_scatter" for op in one.ops) == 1
    assert sum(op.name == "all_gather" for op in one.ops) == 1


def test_schedule_issues_after_the_last_input_and_waits_before_the_first_reader():
    g, ctx = run(WUS + ",comm-fusion{bucket-mb=0.001},schedule-comm")
    ops = list(g.ops)
    made = {v.name: k for k, op in enumerate(ops) for v in op.results}
    asyncs = [k for k, op in enumerate(ops) if op.attrs.get("async")]
    schedule = ctx.decision(diphoma_compile.passes.ScheduleCommRecord)
    assert asyncs and schedule.overlapped == len(asyncs)
    for k in asyncs:
        op = ops[k]
        assert k == max(made[n] for n in op.inputs) + 1 or \
            ops[k - 1].name in ("reduce_scatter", "all_gather", "all_reduce")
        waits = [j for j, w in enumerate(ops) if w.name == "wait" and
                 set(w.inputs) == {v.name for v in op.results}]
        assert len(waits) == 1
        j = waits[0]
        readers = [i for i, o in enumerate(ops) if set(free_inputs(o)) &
                   {v.name for v in ops[j].results}]
        assert not readers or min(readers) == j + 1 or all(
            ops[i].name == "wait" for i in range(j + 1, min(readers)))
        # nothing reads the in-flight values except the wait
        inflight = {v.name for v in op.results}
        assert all(not (set(o.inputs) & inflight) for o in ops if o.name != "wait")
        assert not ({o.name for o in g.outputs} & inflight)
    first_rs = next(k for k in asyncs if ops[k].name == "reduce_scatter")
    assert any(op.phase.value == "backward" for op in ops[first_rs + 1:]
               if op.phase is not None), "the first bucket overlaps the rest of backward"


def test_a_bucket_closes_before_a_member_computed_from_an_earlier_one():
    from diphoma_compile.ir import parse, verify
    g = parse("""# diphoma-ir v1
graph @chain mesh[dp=4] (
  %a: f32[4] {dp: V} batch,
  %b: f32[4] {dp: V} batch,
  %c: f32[4] {dp: V} batch,
) {
  %a.avg: f32[4] = all_reduce(%a) {axis=dp, op=avg}
  %b.avg: f32[4] = all_reduce(%b) {axis=dp, op=avg}
  %t: f32[4] = mul(%a.avg, %a.avg)
  %u: f32[4] {dp: V} = add(%t, %c)
  %u.avg: f32[4] = all_reduce(%u) {axis=dp, op=avg}
  %c.avg: f32[4] = all_reduce(%c) {axis=dp, op=avg}
  return (
    %b.avg other,
    %u.avg other,
    %c.avg other,
  )
}
""")
    out = Pipeline.from_spec("comm-fusion").run(g, PassContext())
    verify(out)
    buckets = [[v.name for v in op.results] for op in out.ops if op.name == "all_reduce"]
    # %u is computed from %a.avg: fusing it with %a and %b would need %a.avg before it is
    # made; the first bucket closes there and %u starts the next, which %c joins
    assert buckets == [["a.avg", "b.avg"], ["u.avg", "c.avg"]]


def test_buckets_of_an_adafactor_update_stay_acyclic():
    """torch.optim.Adafactor's update all-reduces partial sums (norms) that feed values other
    collectives move and the reverse, across collective kinds: a bucket that took a member
    reading (through another bucket) from itself made a cycle. Every bucket now closes where
    that would happen, and the program keeps its dataflow."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 10))
    opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    x, y = torch.randn(8, 16), torch.randn(8, 10)
    step(model, opt, x, y)                     # the state exists: row and column moments
    graph = diphoma_compile.trace(step, model, opt, x, y).replace(mesh=Mesh({"dp": 4}))
    ctx = PassContext()
    out = Pipeline.from_spec(WUS + ",comm-fusion{bucket-mb=25},schedule-comm").run(graph, ctx)
    made = {i.name for i in out.inputs}
    for op in out.ops:                          # every op reads values made before it
        assert set(free_inputs(op)) <= made, op
        made.update(v.name for v in op.results)
    rec = ctx.decisions["comm-fusion"]
    assert rec.collectives_after < rec.collectives_before
