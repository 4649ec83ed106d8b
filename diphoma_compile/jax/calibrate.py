"""Measure JAX's first device: the matrix-product rate and the memory bandwidth of one
compiled program each, as a DeviceModel (``measured-cpu``, ``measured-gpu``, ...).

JAX runs every device of a host from one process, so there is no peer process to time a
link against here: the link figures come from the base model."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from ..ir.device_model import DeviceModel, device_model, register

_MM = {"cpu": 512}            # other platforms: 4096
_COPY_BYTES = {"cpu": 64 << 20}   # other platforms: 256 MiB (little beside a loaded GPU)


def _best(fn, repeat: int) -> float:
    """The shortest of ``repeat`` timed calls after one untimed one (compiling)."""
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_rate(device: jax.Device, repeat: int = 5) -> float:
    """Float32 flops per second of one n x n by n x n product on ``device``."""
    n = _MM.get(device.platform, 4096)
    a = jax.device_put(jnp.ones((n, n), jnp.float32), device)
    b = jax.device_put(jnp.full((n, n), 1.0 / n, jnp.float32), device)   # a @ b stays a
    reps = 16 if device.platform == "cpu" else 20

    @jax.jit
    def run(a, b):
        # a chain, so that XLA cannot drop or merge the products
        for _ in range(reps):
            a = a @ b
        return a
    return 2.0 * n ** 3 * reps / _best(lambda: run(a, b), repeat)


def copy_bandwidth(device: jax.Device, repeat: int = 5) -> float:
    """Bytes per second one elementwise program moves (read and written) on ``device``."""
    nbytes = _COPY_BYTES.get(device.platform, 256 << 20)
    x = jax.device_put(jnp.ones((nbytes // 4,), jnp.float32), device)
    scale = jax.jit(lambda v: v * 1.5)
    return 2.0 * nbytes / _best(lambda: scale(x), repeat)


def measure_device(device: jax.Device | None = None, base: str | None = None,
                   repeat: int = 5) -> DeviceModel:
    """A DeviceModel of ``device`` (default: the first device) as measured now, registered
    by its name (``measured-cpu``, ``measured-gpu``, ...); the link and launch latency come
    from ``base`` (default: cpu-gloo for the CPU, h100-nccl otherwise)."""
    device = device or jax.devices()[0]
    cpu = device.platform == "cpu"
    base_model = device_model(base or ("cpu-gloo" if cpu else "h100-nccl"))
    model = base_model.replace(name=f"measured-{device.platform}",
                               flops_per_s=matmul_rate(device, repeat),
                               mem_bytes_per_s=copy_bandwidth(device, repeat))
    register(model)
    return model
