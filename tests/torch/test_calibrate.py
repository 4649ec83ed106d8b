"""Measuring the device at hand (torch/calibrate.py) and costing a plan on the model of
the device the step runs on, a named one, one of the user's own, or one measured when the
step is traced (parallelize's ``device_model``)."""

from __future__ import annotations

import pytest
import torch

import diphoma_compile
from diphoma_compile.errors import DiphomaError
from diphoma_compile.ir.device_model import MODELS, device_model
from models import frozen_mlp, mse_step


def _step(mesh, **kw):
    torch.manual_seed(0)
    model = frozen_mlp(layers=2, frozen=0, width=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(8, 16)
    return diphoma_compile.parallelize(mse_step, mesh, **kw).trace(model, opt, x)


def test_the_cpu_is_measured_into_a_registered_model():
    """A matrix product's rate and a copy's bandwidth, measured on this CPU: figures a CPU
    can reach (a 2-core laptop class machine to a large server), registered by name; the
    link, with no process group to time it against, is the base model's."""
    from diphoma_compile.torch.calibrate import measure_device
    m = measure_device("cpu", repeat=2)
    assert m.name == "measured-cpu-gloo"
    # figures of the right order, not a timing (a loaded 2-core machine measured a copy
    # at 0.73 GB/s): a unit slip is a factor of 1e3
    assert 1e8 < m.flops_per_s < 1e14
    assert 1e7 < m.mem_bytes_per_s < 1e13
    assert m.link == device_model("cpu-gloo").link
    assert device_model("measured-cpu-gloo") is m
    torch.manual_seed(5)                         # it draws no random numbers of the user's
    measure_device("cpu", repeat=1)
    drawn = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(drawn, torch.rand(3))


def test_a_plan_is_costed_on_the_device_at_hand_or_the_one_asked_for():
    """By default the plan's step time is estimated on the model of the device the
    parameters live on (the CPU's here, not the H100 default inspect plans for); a name,
    a DeviceModel of the user's own, or 'measured' choose another."""
    assert _step({"dp": 1}).plan.compute.device_model == "cpu-gloo"
    assert _step({"dp": 1}, device_model="h200-nccl").plan.compute.device_model == "h200-nccl"
    mine = device_model("cpu-gloo").replace(name="test-my-cpu", flops_per_s=1e11,
                                          mem_bytes_per_s=1e11)
    try:
        plan = _step({"dp": 1}, device_model=mine).plan
        assert plan.compute.device_model == "test-my-cpu"
        slow = _step({"dp": 1}).plan.compute
        assert plan.compute.compute_s < slow.compute_s    # 5x and 10x cpu-gloo's rates
    finally:
        MODELS.pop("test-my-cpu", None)
    assert _step({"dp": 1}, device_model=device_model("h200-nccl")
                 ).plan.compute.device_model == "h200-nccl"
    with pytest.raises(DiphomaError, match="'h100-nccl' is a default"):    # before tracing
        diphoma_compile.parallelize(mse_step, {"dp": 1}, device_model=device_model(
            "h100-nccl").with_link("pp", device_model("cpu-gloo").link))
    measured = _step({"dp": 1}, device_model="measured")
    assert measured.plan.compute.device_model == "measured-cpu-gloo"
    assert measured.device_model == "measured-cpu-gloo"   # measured once, then named


def test_an_unknown_device_model_or_a_meta_one_to_measure_is_refused():
    with pytest.raises(DiphomaError, match="unknown device model 'tpu-v9'"):
        diphoma_compile.parallelize(mse_step, {"dp": 1}, device_model="tpu-v9")
    with pytest.raises(DiphomaError, match="neither a name nor a DeviceModel"):
        diphoma_compile.parallelize(mse_step, {"dp": 1}, device_model=3)
    model = frozen_mlp(layers=2, frozen=0, width=16).to("meta")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(DiphomaError, match="meta device, which runs nothing to measure"):
        diphoma_compile.parallelize(mse_step, {"dp": 1}, device_model="measured").trace(
            model, opt, torch.randn(8, 16, device="meta"))
