"""The plan's compute section (issue 16): flops per step and per device from the planned
graph's placements, the framework ops whose cost is unknown, and the step-time estimate
(compute + the communication computation does not hide) on a device model."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from diphoma_compile.cli import main
from diphoma_compile.ir import parse
from diphoma_compile.ir.device_model import DeviceModel, Link
from diphoma_compile.ir.framework_ops import FrameworkOpRule
from diphoma_compile.ir.verify import verify
from diphoma_compile.report.compute import estimate_compute
from diphoma_compile.report.plan import build_plan

# one device: 1 GFLOP/s, memory never the limit; links of 1 GB/s with no latency
SLOW = DeviceModel("slow", flops_per_s=1e9, mem_bytes_per_s=1e30, link=Link(1e9, 0.0))

# every kind of work on a dp=4 mesh: varying (one device's batch), split (a flat shard of
# the whole tensor), whole (a replicated op every device repeats)
MIXED = """
graph @step mesh[dp=4] (
  %x: f32[2,8] {dp: V} batch,
  %w: f32[8,16] param,
  %m: f32[8,16] {dp: F} opt_state(of=%w, slot=exp_avg),
) {
  %h: f32[2,16] {dp: V} = dot(%x, %w) {lhs_contract=[1], rhs_contract=[0]}
  %r: f32[8,16] = mul(%w, %w)
  %ws: f32[8,16] {dp: F} = take_shard(%w) {axis=dp, dim=flat}
  %u: f32[8,16] {dp: F} = mul(%ws, %m)
  return (
    %h,
    %u replaces(%m),
  )
}
"""


def graph(text: str):
    g = parse(text)
    verify(g)
    return g


def test_flops_per_device_follow_the_placements():
    c = estimate_compute(graph(MIXED), SLOW)
    dot = 2 * 2 * 16 * 8          # one device's batch of 2
    whole = 8 * 16                # the replicated mul, on every device
    split = 8 * 16                # the flat-shard mul: a quarter on each device
    assert c.flops_per_step == 4 * dot + whole + split
    assert c.flops_per_device == dot + whole + Fraction(split, 4)
    assert c.unknown_cost_ops == ()
    assert c.compute_s == pytest.approx(float(c.flops_per_device) / 1e9)
    assert c.exposed_comm_s == 0.0


def test_everything_split_gives_exactly_one_nth():
    text = MIXED.replace("  %r: f32[8,16] = mul(%w, %w)\n", "")
    c = estimate_compute(graph(text), SLOW)
    assert c.flops_per_device * 4 == c.flops_per_step


# a gradient all-reduce with 1 GFLOP of computation after it that does not need it
COMM = """
graph @step mesh[dp=4] (
  %g: f32[1000000] {dp: V},
  %a: f32[1000,1000],
  %b: f32[1000,500],
) {
  %s: f32[1000000] = all_reduce(%g) {axis=dp, op=sum%s}
  %c: f32[1000,500] = dot(%a, %b) {lhs_contract=[1], rhs_contract=[0]}
%w  return (
    %c,
    %r,
  )
}
"""


def comm_graph(asynchronous: bool):
    text = COMM.replace("op=sum%s", "op=sum, async=true" if asynchronous else "op=sum")
    if asynchronous:
        text = text.replace("%w  return", "  %r: f32[1000000] = wait(%s)\n  return")
    else:
        text = text.replace("%w  return", "  return").replace("%r,", "%s,")
    return graph(text)


def test_a_synchronous_collective_is_exposed_an_async_one_hides_behind_compute():
    send = 2 * 3 / 4 * 4e6                     # ring all-reduce: 2(N-1)/N of 4 MB
    sync = estimate_compute(comm_graph(False), SLOW)
    assert sync.compute_s == pytest.approx(1.0)          # 2 * 1000 * 500 * 1000 flops
    assert sync.exposed_comm_s == pytest.approx(send / 1e9)
    hidden = estimate_compute(comm_graph(True), SLOW)
    assert hidden.exposed_comm_s == 0.0
    # on a link so slow the all-reduce outlasts the dot, the rest shows at the wait
    crawl = SLOW.replace(link=Link(1e6, 0.0))
    part = estimate_compute(comm_graph(True), crawl)
    assert part.exposed_comm_s == pytest.approx(send / 1e6 - 1.0)
    assert part.total_s == pytest.approx(send / 1e6)


# ------------------------------------------------------------------ ops of unknown cost

def _cumsum_step():
    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.cumsum(self.fc(x), dim=1).square().mean()

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model, opt, x):
        opt.zero_grad()
        loss = model(x)
        loss.backward()
        opt.step()
        return loss

    return step, model, opt, torch.randn(8, 8)


def test_unknown_cost_ops_are_exactly_the_opaque_ops_without_a_rule(monkeypatch):
    from diphoma_compile import parallelize
    from diphoma_compile.ir import framework_ops
    step, model, opt, x = _cumsum_step()
    ps = parallelize(step, {"dp": 4}).trace(model, opt, x)
    g = ps.graph
    opaque = {str(op.attrs["target"]) for op in g.walk() if op.name == "opaque"}
    assert "aten.cumsum.default" in opaque
    # with the rules the framework registered; ParallelStep's plan says the same
    ruled = set(framework_ops.FRAMEWORK_OPS)
    unknown = tuple(sorted(opaque - ruled))
    assert ps.plan.compute.unknown_cost_ops == build_plan(g).compute.unknown_cost_ops == unknown
    text = ps.plan.to_text().splitlines()
    assert any(line.startswith("compute: ") for line in text)
    listed = [line for line in text if line.startswith("cost unknown (")]
    assert listed == ([f"cost unknown ({len(unknown)} framework ops no rule gives flops for, "
                       "counted as zero): " + ", ".join(unknown)] if unknown else [])
    # with none: every opaque op; with a rule for cumsum alone: all but cumsum
    monkeypatch.setattr(framework_ops, "FRAMEWORK_OPS", {})
    before = estimate_compute(g)
    assert before.unknown_cost_ops == tuple(sorted(opaque))
    framework_ops.register_framework_op(
        FrameworkOpRule("aten.cumsum.default", lambda op, ins, outs: 7 * outs[0].numel))
    after = estimate_compute(g)
    assert after.unknown_cost_ops == tuple(sorted(opaque - {"aten.cumsum.default"}))
    cumsums = sum(op.attrs.get("target") == "aten.cumsum.default" for op in g.walk())
    # torch traces at the batch each rank passes (8 x 8); the whole step has four of them
    assert cumsums == 2                      # forward, and backward's reversed cumsum
    assert after.flops_per_step - before.flops_per_step == 4 * cumsums * 7 * 8 * 8
    assert after.flops_per_device - before.flops_per_device == cumsums * 7 * 8 * 8


# ------------------------------------------------------------------ inspect

GPT2 = "transformers.models.gpt2.modeling_gpt2:GPT2LMHeadModel"


def inspect_json(capsys, *argv: str) -> dict:
    rc = main(["inspect", *argv, "--format", "json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


def test_gpt2_flops_match_the_matmul_count_and_split_four_ways(capsys):
    """A mid-size Hugging Face GPT-2 (elementwise work about 1% of the matmuls): the plan's
    flops per step are within 10% of 3 x tokens x forward matmul flops per token, and one
    device does a quarter of them at dp=4."""
    pytest.importorskip("transformers")
    d, layers, vocab, batch, seq = 256, 2, 1000, 8, 128
    init = (f"GPT2LMHeadModel(GPT2Config(n_embd={d}, n_layer={layers}, n_head=4, "
            f"vocab_size={vocab}, n_positions={seq}))")
    tokens = f"int64[{batch},{seq}]<{vocab}"
    plan = inspect_json(capsys, GPT2, "--init", init, "--input", f"input_ids={tokens}",
                        "--input", f"labels={tokens}", "--mesh", "dp=4")
    c = plan["compute"]
    # per token forward: every matmul weight (the head, tied to the embedding, included)
    # twice, and the attention scores and weighted values over the whole sequence
    weights = layers * 12 * d * d + vocab * d
    count = 3 * batch * seq * (2 * weights + 2 * 2 * layers * seq * d)
    assert c["flops_per_step"] == pytest.approx(count, rel=0.10)
    assert c["flops_per_step"] / c["flops_per_device"] == pytest.approx(4, rel=1e-3)
    assert c["device_model"] == "h100-nccl"
    est = c["estimated_step_s"]
    assert est["total"] == pytest.approx(est["compute"] + est["exposed_comm"])
    assert est["compute"] > 0 and est["exposed_comm"] >= 0


def test_device_model_option(capsys):
    pytest.importorskip("transformers")
    argv = [str(__import__("pathlib").Path(__file__).parents[1] / "inspect_models" /
                "hf_gpt2.py"), "--init", "GPT2LMHeadModel(config)",
            "--input", "input_ids=int64[8,32]<1000", "--input", "labels=int64[8,32]<1000",
            "--mesh", "dp=4"]
    fast = inspect_json(capsys, *argv)["compute"]
    slow = inspect_json(capsys, *argv, "--device-model", "cpu-gloo")["compute"]
    assert slow["device_model"] == "cpu-gloo"
    assert slow["flops_per_step"] == fast["flops_per_step"]
    assert slow["estimated_step_s"]["compute"] > 100 * fast["estimated_step_s"]["compute"]
    rc = main(["inspect", *argv, "--device-model", "a100"])
    out, err = capsys.readouterr()
    assert rc == 2
    assert "unknown device model 'a100'" in err and "cpu-gloo, h100-nccl, h200-nccl" in err
    rc = main(["inspect", *argv])
    out, err = capsys.readouterr()
    assert rc == 0
    line = next(x for x in out.splitlines() if x.startswith("compute: "))
    assert " per device per step (" in line and "/step on h100-nccl = " in line
    assert line.endswith(" exposed communication")


def test_a_hugging_face_gpt2_pipeline_counts_the_whole_batch_and_its_bubble(capsys):
    """inspect --mesh pp=2 on an unmodified Hugging Face GPT-2: the step's flops are the
    unstaged step's on the same global batch (report/pipeline_time.py counts every
    microbatch; one pass over the staged graph counted one), each rank does about half,
    the step time adds the schedule's bubble, and every rank has its planned peak."""
    pytest.importorskip("transformers")
    argv = [str(__import__("pathlib").Path(__file__).parents[1] / "inspect_models" /
                "hf_gpt2.py"), "--init", "GPT2LMHeadModel(config)",
            "--input", "input_ids=int64[8,32]<1000", "--input", "labels=int64[8,32]<1000"]
    whole = inspect_json(capsys, *argv, "--mesh", "dp=1")["compute"]
    plan = inspect_json(capsys, *argv, "--mesh", "pp=2")
    c = plan["compute"]
    assert c["flops_per_step"] == pytest.approx(whole["flops_per_step"], rel=0.01)
    assert c["flops_per_step"] / 2 <= c["flops_per_device"] < 0.75 * c["flops_per_step"]
    est = c["estimated_step_s"]
    assert est["bubble"] > 0
    assert est["total"] == pytest.approx(est["compute"] + est["exposed_comm"] + est["bubble"])
    mem = plan["memory"]
    assert len(mem["peak_per_rank"]) == 2 and mem["peak"] == max(mem["peak_per_rank"])
    rc = main(["inspect", *argv, "--mesh", "pp=2"])
    out, _ = capsys.readouterr()
    assert rc == 0
    line = next(x for x in out.splitlines() if x.startswith("compute: "))
    assert " pipeline bubble (the last rank to finish" in line


def test_the_device_model_can_be_measured_on_this_machine(capsys):
    """--device-model measured: this machine's device of the model's framework (the CPU
    here: no GPU), measured when the file is loaded, and the step time estimated on it."""
    from pathlib import Path
    from diphoma_compile.ir.device_model import device_model
    step = str(Path(__file__).parents[1] / "inspect_models" / "torch_step.py")
    c = inspect_json(capsys, step, "--mesh", "dp=4", "--device-model", "measured")["compute"]
    assert c["device_model"] == "measured-cpu-gloo"
    m = device_model("measured-cpu-gloo")
    assert 1e8 < m.flops_per_s < 1e14      # the order, not a timing
    assert c["estimated_step_s"]["compute"] > 0
