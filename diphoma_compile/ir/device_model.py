"""A device model: how long compute and collectives take on one kind of machine, so that
strategies, plans and step-time estimates can be compared in seconds.

Compute follows a roofline (the larger of flops over peak flop rate and bytes over memory
bandwidth); a collective costs a launch latency per ring step plus the bytes one device sends
over the link of its mesh axis. The figures are defaults to start from, not measurements of
any one machine; override them (``DeviceModel.replace``, ``with_link``) with your own, or
measure the device at hand (``torch/calibrate.py``, ``jax/calibrate.py``; ``parallelize(...,
device_model="measured")``), which registers the result by its name (``register``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import DiphomaError
from .opdef import is_local


@dataclass(frozen=True)
class Link:
    """One mesh axis's interconnect: bytes per second one device sends, and the latency of
    one step of a ring algorithm."""

    bytes_per_s: float
    latency_s: float


# ring steps of each collective over n devices (the latency it pays)
_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "reduce_scatter": lambda n: n - 1,
          "all_gather": lambda n: n - 1, "all_to_all": lambda n: n - 1,
          "broadcast": lambda n: n - 1, "send": lambda n: 1, "recv": lambda n: 0}


@dataclass(frozen=True)
class DeviceModel:
    """Peak rates of one device and the links between devices (per mesh axis)."""

    name: str
    flops_per_s: float
    mem_bytes_per_s: float
    link: Link                                      # every axis not named in axis_links
    axis_links: tuple[tuple[str, Link], ...] = ()
    launch_s: float = 0.0                           # fixed cost of starting any collective

    def link_of(self, axis: str | None) -> Link:
        """The link of a mesh axis."""
        return dict(self.axis_links).get(axis, self.link) if axis else self.link

    def with_link(self, axis: str, link: Link) -> DeviceModel:
        """The same model with its own link for one axis (e.g. a slower inter-node axis)."""
        links = dict(self.axis_links)
        links[axis] = link
        return dataclasses.replace(self, axis_links=tuple(sorted(links.items())))

    def replace(self, **fields) -> DeviceModel:
        """The same model with some figures changed."""
        return dataclasses.replace(self, **fields)

    def compute_s(self, flops: float, nbytes: float) -> float:
        """Seconds for an op of ``flops`` touching ``nbytes`` (roofline)."""
        return max(flops / self.flops_per_s, nbytes / self.mem_bytes_per_s)

    def collective_s(self, name: str, sent_bytes: float, n: int, axis: str | None) -> float:
        """Seconds for a collective over ``n`` devices that sends ``sent_bytes`` per device."""
        if n <= 1 or is_local(name):
            return 0.0
        link = self.link_of(axis)
        steps = _STEPS.get(name, lambda k: k - 1)(n)
        return self.launch_s + steps * link.latency_s + sent_bytes / link.bytes_per_s


# Defaults. CPU: 4 gloo processes on one host (about 0.4 GB/s measured for an all-reduce on
# a 2-core machine; a few GFLOP/s per process). H100/H200: dense bf16 peak, HBM bandwidth,
# NVLink 4 (450 GB/s per direction) inside a node, NCCL step latency about 10 us.
MODELS: dict[str, DeviceModel] = {
    "cpu-gloo": DeviceModel("cpu-gloo", flops_per_s=20e9, mem_bytes_per_s=10e9,
                            link=Link(0.4e9, 50e-6), launch_s=100e-6),
    "h100-nccl": DeviceModel("h100-nccl", flops_per_s=989e12, mem_bytes_per_s=3.35e12,
                             link=Link(450e9, 10e-6), launch_s=20e-6),
    "h200-nccl": DeviceModel("h200-nccl", flops_per_s=989e12, mem_bytes_per_s=4.8e12,
                             link=Link(450e9, 10e-6), launch_s=20e-6),
}


_DEFAULTS = frozenset(MODELS)


def model_for_device(kind: str, name: str = "", default: str = "h100-nccl") -> str:
    """The model's name for a device of ``kind`` (cpu, cuda or gpu, ...) called ``name``
    (an NVIDIA H200): cpu-gloo for the CPU, h200-nccl for an H200, h100-nccl for another
    GPU; ``default`` for what has no model here (a TPU; the meta device, planning for a
    machine not at hand)."""
    if kind == "cpu":
        return "cpu-gloo"
    if kind in ("cuda", "gpu"):
        return "h200-nccl" if "H200" in name.upper() else "h100-nccl"
    return default


def check(model: DeviceModel) -> DeviceModel:
    """``model`` as ``register`` would take it (the default of its name when it equals
    one); DiphomaError for other figures under a default's name or a rate that is not
    positive."""
    if model.name in _DEFAULTS:
        if model == MODELS[model.name]:        # the default itself, passed as an object
            return MODELS[model.name]
        raise DiphomaError(f"device model {model.name!r} is a default and is not replaced "
                           "by other figures", hint="give your model another name "
                           "(DeviceModel.replace(name=...), after with_link too)")
    if not (model.flops_per_s > 0 and model.mem_bytes_per_s > 0
            and model.link.bytes_per_s > 0 and model.link.latency_s >= 0):
        raise DiphomaError(f"device model {model.name!r} has a rate that is not positive: "
                           f"{model}", hint="measure again, or give the figures by hand")
    return model


def register(model: DeviceModel) -> DeviceModel:
    """Make ``model`` known by its name (a measured one: ``torch/calibrate.py``,
    ``jax/calibrate.py``), replacing a model of that name registered before; the defaults
    above cannot be replaced by other figures (one equal to a default is that default)."""
    model = check(model)
    MODELS[model.name] = model
    return model


def device_model(name: str) -> DeviceModel:
    """A model by name: a default (cpu-gloo, h100-nccl, h200-nccl) or a registered one."""
    try:
        return MODELS[name]
    except KeyError:
        raise DiphomaError(f"unknown device model {name!r}",
                           hint="use one of " + ", ".join(MODELS)) from None
