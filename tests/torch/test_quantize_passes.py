"""The quantizing passes on a traced torch step: golden IR of quantize-weight-diff after
weight-update sharding, its record (bytes before and after, the declared bound), and its
errors. (The 4-rank runs are in tests/distributed.)"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import diphoma_compile  # noqa: E402
from diphoma_compile.errors import PassError  # noqa: E402
from diphoma_compile.ir import InputKind, parse, print_graph  # noqa: E402
from diphoma_compile.mesh import Mesh  # noqa: E402
from diphoma_compile.passes import PassContext, Pipeline, QuantizeWeightDiffRecord  # noqa: E402
from diphoma_compile.passes.defaults import default_passes  # noqa: E402
from diphoma_compile.report.plan import build_plan  # noqa: E402

from models import MLP, OPTIMIZERS, classify_step, mlp_batches  # noqa: E402

QWD = "quantize-weight-diff{bits=4, group=64, rounding=stochastic}"


def traced(opt_name: str = "sgd_momentum"):
    torch.manual_seed(0)
    model = MLP(8, 64, 16)
    opt = OPTIMIZERS[opt_name](model.parameters(), True)
    return diphoma_compile.trace(classify_step, model, opt, mlp_batches(1)[0]).replace(
        mesh=Mesh({"dp": 4}))


def run(graph, spec: str):
    ctx = PassContext()
    return Pipeline.from_spec(spec).run(graph, ctx), ctx


def test_golden_quantize_weight_diff(golden):
    out, ctx = run(traced(), default_passes("dp") + "," + QWD + ",dce")
    text = print_graph(out)
    assert parse(text) == out
    golden("torch_mlp_sgd_momentum.qwd.ir", text)
    rec = ctx.decision(QuantizeWeightDiffRecord)
    assert rec.quantized == ("fc1.weight", "fc2.weight") and rec.bound == "absmax/7"
    assert [k for k, _ in rec.kept] == ["fc1.bias", "fc2.bias"]
    for w in rec.quantized:   # 4 bits + one fp32 scale per 64 values: under 1/6 of fp32
        assert rec.bytes_after[w] < rec.bytes_before[w] / 6
    masters = [i for i in out.inputs if i.role.kind is InputKind.comm_state]
    assert [(i.role.of, i.role.slot) for i in masters] == [
        ("fc1.weight", "master"), ("fc2.weight", "master"), (None, "rng_key")]


@pytest.mark.parametrize("opt_name", ["adam", "adamw"])
def test_dirty_padding_of_the_exact_pieces_settles(opt_name):
    """Adam's update leaves unknown padding in a piece: the exact pieces (and the state they
    reach through weight decay) are declared Fx, and the graph verifies."""
    out, ctx = run(traced(opt_name), default_passes("dp") + "," + QWD)
    m = out.input("fc1.weight.master")
    assert str(m.value.type.placement("dp")) == "Fx"


def test_errors():
    with pytest.raises(PassError, match="weight-update-sharding"):
        run(traced(), "data-parallel," + QWD)
    with pytest.raises(PassError, match="bits=3"):
        run(traced(), default_passes("dp") + ",quantize-weight-diff{bits=3}")
    # nothing large enough: the graph is unchanged and the plan says why
    g = run(traced(), default_passes("dp"))[0]
    out, ctx = run(g, "quantize-weight-diff{group=4096}")
    rec = ctx.decision(QuantizeWeightDiffRecord)
    assert out.ops == g.ops and out.inputs == g.inputs and rec.quantized == ()
    assert len(rec.kept) == 4


QG = "quantize-grads{bits=4, group=64, hadamard=32}"


def test_golden_quantize_grads_and_weight_diff(golden):
    out, ctx = run(traced(), default_passes("dp") + "," + QG + "," + QWD + ",dce")
    text = print_graph(out)
    assert parse(text) == out
    golden("torch_mlp_sgd_momentum.sdp4bit.ir", text)
    rec = ctx.decisions["quantize-grads"]
    assert rec.quantized == ("18.avg", "25.avg") and rec.hops == 1
    for g in rec.quantized:
        assert rec.bytes_after[g] < rec.bytes_before[g] / 6


QG2 = "quantize-grads{bits=4, intra-bits=8, group=64, hadamard=32, levels=2, local=2}"


def test_golden_two_hop_quantize_grads(golden):
    """levels=2, local=2 on 4 devices (2 nodes x 2): 8-bit all-to-all among each node's
    devices (the pieces reordered by their device's place in its node), then 4-bit across
    nodes; one hop when a level has one device (local=1, local=4)."""
    out, ctx = run(traced(), default_passes("dp") + "," + QG2 + ",dce")
    text = print_graph(out)
    assert parse(text) == out
    golden("torch_mlp_sgd_momentum.qg2hop.ir", text)
    rec = ctx.decisions["quantize-grads"]
    assert rec.hops == 2 and rec.local == 2 and "absmax/127 inside a node" in rec.bound
    a2a = [op for op in out.ops if op.name == "all_to_all"]
    assert [op.attrs.get("level") for op in a2a] == ["local", "local", "node", "node"] * 2
    for g in rec.quantized:      # 8 bits of all rows + 4 bits of half: under 1/3 of fp32
        assert rec.bytes_after[g] < rec.bytes_before[g] / 3
    text = build_plan(out, ctx.decisions).to_text()
    assert "2 hops: 8-bit among each node's 2 devices, then 4-bit across nodes" in text
    for local in (1, 4):
        spec = default_passes("dp") + f",quantize-grads{{group=64, local={local}}}"
        ctx1 = run(traced(), spec)[1]
        assert ctx1.decisions["quantize-grads"].hops == 1


def test_golden_quantized_all_reduce(golden):
    """all-reduce=true on plain data parallelism: each gradient's all-reduce becomes the
    quantized all-to-all, then a 4-bit all-gather of the averaged pieces (as_shard of each
    device's packed piece, dequantize{pieces} of the whole); small gradients and the loss
    stay fp32 all-reduces."""
    spec = "dce,data-parallel{axis=dp},dce,quantize-grads{group=64, all-reduce=true},dce"
    out, ctx = run(traced(), spec)
    text = print_graph(out)
    assert parse(text) == out
    golden("torch_mlp_sgd_momentum.qgar.ir", text)
    rec = ctx.decisions["quantize-grads"]
    assert rec.all_reduce and rec.quantized == ("18.avg", "25.avg")
    assert "then absmax/7 of the averaged gradient's group" in rec.bound
    assert [op.name for op in out.ops].count("all_gather") == 4
    for g in rec.quantized:
        assert rec.bytes_after[g] < rec.bytes_before[g] / 6
    with pytest.raises(PassError, match="no gradient is all-reduced"):
        run(traced(), default_passes("dp") + ",quantize-grads{all-reduce=true}")


def test_quantize_grads_errors():
    with pytest.raises(PassError, match="weight-update-sharding"):
        run(traced(), "data-parallel," + QG)
    with pytest.raises(PassError, match="levels=2 needs the devices per node") as e:
        run(traced(), default_passes("dp") + ",quantize-grads{levels=2}")
    assert "local=L" in str(e.value)
    with pytest.raises(PassError, match="local=3 does not divide"):
        run(traced(), default_passes("dp") + ",quantize-grads{levels=2, local=3}")
    with pytest.raises(PassError, match="levels='3'"):
        run(traced(), default_passes("dp") + ",quantize-grads{levels=3}")
    with pytest.raises(PassError, match="hadamard=24"):
        run(traced(), default_passes("dp") + ",quantize-grads{hadamard=24}")
    # (group=0 was a ZeroDivisionError "bug in the pass"; a negative one blamed hadamard)
    for group in (0, -5):
        with pytest.raises(PassError, match=f"group={group} must be a positive number"):
            run(traced(), default_passes("dp") + f",quantize-grads{{group={group}}}")


def test_naive_weights_ablation_quantizes_the_weights_themselves():
    out, ctx = run(traced(), default_passes("dp") + ",quantize-weight-diff{group=64, naive=true}")
    ops = {v.name: op for op in out.ops for v in op.results}
    new = next(o.name for o in out.outputs if o.role.target == "fc1.weight")
    assert ops[new].name == "dequantize"                  # not the old copy + a difference
    q = next(op for op in out.ops if op.name == "quantize")
    assert ops[q.inputs[0]].name == "add"                 # the new exact piece itself


def test_preset_buckets_and_overlaps_the_all_to_alls():
    """With comm-fusion and schedule-comm (the preset's tail), the quantized gradients'
    all-to-alls go in buckets by dtype (packed bytes, scales), the bytes' issued async and
    waited for later; the plan's bytes are unchanged by bucketing."""
    spec = default_passes("dp", 10 ** 6, compression="sdp4bit")
    out, ctx = run(traced(), spec.replace("group=128", "group=64").replace(
        "group=2048", "group=64"))
    a2a = [op for op in out.ops if op.name == "all_to_all"]
    assert len(a2a) == 2 and all(len(op.inputs) == 2 for op in a2a)
    assert {op.results[0].type.dtype.value for op in a2a} == {"u8", "f32"}
    issued = [op for op in a2a if op.attrs.get("async")]
    assert issued          # schedule-comm issues what has work to hide behind
    waits = [op for op in out.ops if op.name == "wait"
             and set(op.inputs) & {v.name for v in issued[0].results}]
    assert len(waits) == 1 and out.ops.index(waits[0]) > out.ops.index(issued[0]) + 1
    unfused, _ = run(traced(), spec.replace("group=128", "group=64").replace(
        "group=2048", "group=64").split(",comm-fusion")[0])
    assert build_plan(out).comm_bytes_per_step == build_plan(unfused).comm_bytes_per_step


def test_level_all_to_all_pays_its_levels_latency():
    """The step-time estimate charges a level all-to-all the ring steps of its level's
    devices (2 of 4 here: one step), not of the whole axis (three)."""
    from diphoma_compile.ir.device_model import DeviceModel, Link
    from diphoma_compile.report.compute import estimate_compute
    out, _ = run(traced(), default_passes("dp") + "," + QG2 + ",dce")
    level_ops = sum(op.name == "all_to_all" for op in out.ops)
    slow = DeviceModel("latency", flops_per_s=1e30, mem_bytes_per_s=1e30,
                       link=Link(bytes_per_s=1e30, latency_s=1.0))
    plain_ops = sum(op.name in ("all_gather", "all_reduce", "reduce_scatter")
                    for op in out.ops)
    got = estimate_compute(out, slow).exposed_comm_s
    # all_reduce over 4 devices: 6 steps; gathers and scatters: 3; a level all-to-all: 1
    want = sum(6 if op.name == "all_reduce" else 3 for op in out.ops
               if op.name in ("all_gather", "all_reduce", "reduce_scatter")) + level_ops
    assert plain_ops and level_ops == 8 and got == pytest.approx(want)
