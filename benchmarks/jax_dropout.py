"""What dropout from the step's key costs a JAX data-parallel step: the user's ``jax.jit``
step, ``parallelize`` (each device computes only its rows of the global batch's masks,
jax/key_pieces.py) and ``parallelize`` with the masks drawn whole on every device and
sliced (the key_pieces path turned off), each with dropout 0.1 and with none, interleaved
in one process; the cost is the median step with dropout minus the one without. Model: a
2-block residual MLP of width ``--width`` over a batch x seq x 128 input, dropout on four
activations, AdamW. With ``--pp P`` the parallel step is a pipeline over dp = devices / P
x pp = P with ``--microbatches`` M (each microbatch's rows of its share's draw made alone,
passes/pipeline_draws.py; drawn whole: each microbatch's program draws its share's M
microbatches and keeps one).

    python benchmarks/jax_dropout.py [--devices 8] [--batch 64 --seq 32 --width 512]
        [--steps 12] [--pp 2 --microbatches 4]

No asserts: read the costs and their ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

ap = argparse.ArgumentParser()
ap.add_argument("--devices", type=int, default=8)
ap.add_argument("--steps", type=int, default=12)
ap.add_argument("--batch", type=int, default=64)
ap.add_argument("--seq", type=int, default=32)
ap.add_argument("--width", type=int, default=512)
ap.add_argument("--pp", type=int, default=1)
ap.add_argument("--microbatches", type=int, default=4)
args = ap.parse_args()
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={args.devices}")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import diphoma_compile  # noqa: E402
from diphoma_compile.jax import key_pieces  # noqa: E402


class Blocks(nn.Module):
    rate: float

    @nn.compact
    def __call__(self, x):
        for _ in range(2):
            h = nn.Dense(args.width)(nn.LayerNorm()(x))
            h = nn.Dropout(self.rate, deterministic=self.rate == 0.0)(nn.gelu(h))
            x = x + nn.Dropout(self.rate, deterministic=self.rate == 0.0)(nn.Dense(128)(h))
        return nn.Dense(16)(x)


tx = optax.adamw(1e-3)
k = jax.random.split(jax.random.PRNGKey(0), 3)
batch = (jax.random.normal(k[1], (args.batch, args.seq, 128)),
         jax.random.normal(k[2], (args.batch, args.seq, 16)))
mesh = jax.sharding.Mesh(np.array(jax.devices()[:args.devices]), ("data",))


def make(rate: float):
    net = Blocks(rate)

    def step(params, opt_state, batch, key):
        def loss_of(p):
            out = net.apply({"params": p}, batch[0], rngs={"dropout": key})
            return jnp.mean((out - batch[1]) ** 2)
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step, net.init(k[0], batch[0])["params"]


runs = {}
for rate in (0.0, 0.1):
    step, params = make(rate)
    state = (params, tx.init(params))
    for name in ("jit", "parallel", "parallel, drawn whole"):
        if name == "jit":
            fn = jax.jit(step)
            jax.block_until_ready(fn(*state, batch, k[0]))
        else:
            fn = diphoma_compile.parallelize(step, mesh, axis="data", donate=False) \
                if args.pp == 1 else diphoma_compile.parallelize(
                    step, {"dp": args.devices // args.pp, "pp": args.pp}, donate=False,
                    microbatches=args.microbatches, batch_argnums=2)
            keep = key_pieces.deferred_draws
            if name.endswith("whole"):      # the program is built on the first call
                key_pieces.deferred_draws = lambda graph: set()
            try:
                jax.block_until_ready(fn(*state, batch, k[0]))
            finally:
                key_pieces.deferred_draws = keep
        runs[(name, rate)] = (fn, state)

times = {key: [] for key in runs}
for rep in range(args.steps):
    for key, (fn, state) in runs.items():
        t = time.perf_counter()
        jax.block_until_ready(fn(*state, batch, jax.random.PRNGKey(rep)))
        times[key].append(time.perf_counter() - t)
med = {key: statistics.median(v) * 1e3 for key, v in times.items()}
where = "" if args.pp == 1 else \
    f" (parallel: dp={args.devices // args.pp} x pp={args.pp}, M={args.microbatches})"
print(f"{args.devices} devices{where}, batch {args.batch} x {args.seq} x 128, width "
      f"{args.width}, medians of {args.steps} interleaved steps (ms)")
for name in ("jit", "parallel", "parallel, drawn whole"):
    cost = med[(name, 0.1)] - med[(name, 0.0)]
    print(f"  {name:22s} no dropout {med[(name, 0.0)]:7.1f}  dropout 0.1 "
          f"{med[(name, 0.1)]:7.1f}  dropout's cost {cost:7.1f}")
