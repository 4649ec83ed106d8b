"""The device model: roofline compute, ring collectives with a launch cost and per-axis
links, overrides, and a clear error for an unknown name."""

from __future__ import annotations

import pytest

from diphoma_compile.errors import DiphomaError
from diphoma_compile.ir.device_model import MODELS, DeviceModel, Link, device_model


def test_compute_is_the_slower_of_flops_and_bytes():
    m = DeviceModel("m", flops_per_s=100.0, mem_bytes_per_s=10.0, link=Link(1.0, 0.0))
    assert m.compute_s(flops=1000, nbytes=50) == pytest.approx(10.0)      # flop-bound
    assert m.compute_s(flops=100, nbytes=500) == pytest.approx(50.0)      # memory-bound


def test_collectives_pay_launch_steps_and_bytes_on_their_axis_link():
    m = DeviceModel("m", 1.0, 1.0, link=Link(bytes_per_s=100.0, latency_s=1.0), launch_s=5.0)
    # all-reduce over 4: 2(n-1) = 6 ring steps; all-gather: n-1 = 3
    assert m.collective_s("all_reduce", 200, 4, "dp") == pytest.approx(5 + 6 + 2)
    assert m.collective_s("all_gather", 200, 4, "dp") == pytest.approx(5 + 3 + 2)
    assert m.collective_s("take_shard", 200, 4, "dp") == 0.0
    assert m.collective_s("all_reduce", 200, 1, "dp") == 0.0               # one device
    slow = m.with_link("pp", Link(bytes_per_s=10.0, latency_s=2.0))
    assert slow.collective_s("all_gather", 200, 4, "pp") == pytest.approx(5 + 6 + 20)
    assert slow.collective_s("all_gather", 200, 4, "dp") == pytest.approx(5 + 3 + 2)
    assert m.replace(launch_s=0.0).collective_s("all_gather", 200, 4, "dp") == \
        pytest.approx(3 + 2)


def test_defaults_and_unknown_names():
    assert {"cpu-gloo", "h100-nccl", "h200-nccl"} <= set(MODELS)
    assert device_model("h200-nccl").mem_bytes_per_s > device_model("h100-nccl").mem_bytes_per_s
    with pytest.raises(DiphomaError, match="unknown device model 'tpu'") as e:
        device_model("tpu")
    assert "h100-nccl" in e.value.hint


def test_a_device_is_mapped_to_its_model():
    """What parallelize balances a pipeline's stages on: the CPU's model, an H200's, another
    GPU's; a device with no model of its own (a TPU, the meta device) gets the default."""
    from diphoma_compile.ir.device_model import model_for_device
    assert model_for_device("cpu") == "cpu-gloo"
    assert model_for_device("cuda", "NVIDIA H200") == "h200-nccl"
    assert model_for_device("gpu", "NVIDIA H100 80GB HBM3") == "h100-nccl"
    assert model_for_device("cuda", "NVIDIA A100-SXM4-80GB") == "h100-nccl"
    assert model_for_device("meta") == "h100-nccl"
    assert model_for_device("tpu", "TPU v5", default="h200-nccl") == "h200-nccl"


def test_a_measured_model_is_registered_by_name_and_defaults_are_kept():
    """A measured (or hand-written) model is known by its name afterwards, so that pass
    options (``device-model=NAME``) and inspect can name it; the defaults cannot be
    replaced, and a model with a rate that is not positive is refused."""
    from diphoma_compile.ir.device_model import register
    mine = device_model("cpu-gloo").replace(name="test-host", flops_per_s=7e10)
    try:
        assert register(mine) is mine
        assert device_model("test-host").flops_per_s == 7e10
        register(mine.replace(flops_per_s=8e10))          # measured again: replaced
        assert device_model("test-host").flops_per_s == 8e10
    finally:
        MODELS.pop("test-host", None)
    with pytest.raises(DiphomaError, match="'cpu-gloo' is a default"):
        register(mine.replace(name="cpu-gloo"))
    assert register(device_model("h100-nccl").replace()) is device_model("h100-nccl")
    with pytest.raises(DiphomaError, match="not positive"):
        register(mine.replace(mem_bytes_per_s=0.0))
    with pytest.raises(DiphomaError, match="not positive"):
        register(mine.replace(link=Link(float("nan"), 0.0)))
    assert device_model("cpu-gloo").flops_per_s == 20e9
