"""Measure the device at hand: the matrix-product rate, the memory bandwidth and (with a
process group) the point-to-point link, as a DeviceModel that plans and pipeline cuts can
be costed on instead of a datasheet's figures (Alpa and nnScaler profile their cluster the
same way before they search).

Under a process group every rank measures at the same time, as the ranks will run, and
all take the slowest rank's figures (an all-reduce of the minimum rates), so every rank
plans on the same numbers: a plan that differed between ranks would cut the step in
different places and hang."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from ..ir.device_model import DeviceModel, Link, device_model, register

# sizes: large enough to leave the caches and reach the steady rate, small enough to take
# a fraction of a second on a 2-core CPU (and little memory beside a loaded GPU's model)
_MM = {"cpu": 512, "cuda": 4096}
_COPY_BYTES = {"cpu": 64 << 20, "cuda": 256 << 20}
_MSG_BYTES = 4 << 20


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best(fn, device: torch.device, repeat: int) -> float:
    """The shortest of ``repeat`` timed calls after one untimed one (seconds)."""
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_rate(device: torch.device, repeat: int = 5,
                dtype: torch.dtype = torch.float32) -> float:
    """Flops per second of one n x n by n x n product in ``dtype`` on ``device`` (no random
    numbers: the user's generators are left as they were)."""
    n = _MM.get(device.type, _MM["cuda"])
    a = torch.full((n, n), 1.0 / n, device=device, dtype=dtype)
    b = torch.full((n, n), 1.0 / n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    reps = 16 if device.type == "cpu" else 20

    def run():
        for _ in range(reps):
            torch.mm(a, b, out=out)
    return 2.0 * n ** 3 * reps / _best(run, device, repeat)


def copy_bandwidth(device: torch.device, repeat: int = 5) -> float:
    """Bytes per second a copy moves (read and written) on ``device``."""
    nbytes = _COPY_BYTES.get(device.type, _COPY_BYTES["cuda"])
    bufs = [torch.ones(nbytes // 4, device=device), torch.empty(nbytes // 4, device=device)]
    rate = 2.0 * nbytes / _best(lambda: bufs[1].copy_(bufs[0]), device, repeat)
    bufs.clear()
    if device.type == "cuda":          # give the measurement's memory back to the model
        torch.cuda.empty_cache()
    return rate


def _ping_pong(peer: int, nbytes: int, device: torch.device, group: Any,
               repeat: int) -> float:
    """Half the shortest round trip of ``nbytes`` between this rank and ``peer``."""
    buf = torch.zeros(max(1, nbytes // 4), device=device)
    me = dist.get_rank(group)
    first = me < peer
    gpeer = dist.get_global_rank(group, peer) if group is not None else peer

    def once():
        if first:
            dist.send(buf, gpeer, group=group)
            dist.recv(buf, gpeer, group=group)
        else:
            dist.recv(buf, gpeer, group=group)
            dist.send(buf, gpeer, group=group)
    return _best(once, device, repeat) / 2


def _collective_device(device: torch.device, group: Any) -> torch.device:
    """Where the group's collectives take their tensors: the CPU under gloo."""
    return torch.device("cpu") if str(dist.get_backend(group)) == "gloo" else device


def link_figures(device: torch.device, group: Any = None, repeat: int = 5) -> Link | None:
    """Latency and bandwidth of one send between ranks 0 and 1 of ``group`` (every rank
    calls it; the others wait), or None without a process group of two or more. The
    buffers live where the group's backend sends from: the CPU under gloo."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
        return None
    device = _collective_device(device, group)
    me = dist.get_rank(group)
    latency = bandwidth = 0.0
    if me in (0, 1):
        peer = 1 - me
        latency = _ping_pong(peer, 4, device, group, repeat)
        big = _ping_pong(peer, _MSG_BYTES, device, group, repeat)
        bandwidth = _MSG_BYTES / max(big - latency, 1e-9)
    figures = torch.tensor([latency, bandwidth], dtype=torch.float64, device=device)
    dist.broadcast(figures, dist.get_global_rank(group, 0) if group is not None else 0,
                   group=group)
    latency, bandwidth = figures.tolist()
    return Link(bytes_per_s=bandwidth, latency_s=latency)


def measure_device(device: torch.device | str = "cpu", group: Any = None,
                   base: str | None = None, repeat: int = 5,
                   dtype: torch.dtype = torch.float32) -> DeviceModel:
    """A DeviceModel of ``device`` as measured now (matrix products in ``dtype``, the
    step's parameters' in ``parallelize``), registered by its name (``measured-cpu-gloo``,
    ``measured-cuda-nccl``) so that pass options and ``inspect`` can name it.

    Figures not measured (a link without a process group, the launch latency) come from
    ``base`` (default: cpu-gloo for the CPU, h100-nccl otherwise). Under an initialized
    process group every rank must call it: all measure at once and keep the slowest
    rank's rates and rank 0's link, so all hold the same model."""
    device = torch.device(device)
    base_model = device_model(base or ("cpu-gloo" if device.type == "cpu" else "h100-nccl"))
    grouped = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    if grouped:       # start together (an all-reduce, not barrier(): NCCL's guesses a GPU)
        dist.all_reduce(torch.zeros(1, device=_collective_device(device, group)),
                        group=group)
    rates = [matmul_rate(device, repeat, dtype), copy_bandwidth(device, repeat)]
    if grouped:
        t = torch.tensor(rates, dtype=torch.float64, device=_collective_device(device, group))
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        rates = t.tolist()
    link = link_figures(device, group, repeat) if grouped else None
    backend = "gloo" if device.type == "cpu" else "nccl"
    model = base_model.replace(name=f"measured-{device.type}-{backend}", flops_per_s=rates[0],
                               mem_bytes_per_s=rates[1], link=link or base_model.link)
    register(model)
    return model
