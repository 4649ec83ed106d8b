"""JAX data parallelism two (three) ways on N virtual CPU devices: plain GSPMD (jax.jit of the
user's step, batch split over 'data', everything else replicated), hand-written ZeRO-1
shardings (optimizer state split on 'data' through jit's in/out shardings), and
diphoma_compile.parallelize (weight-update sharding under shard_map; diphoma-fused adds
comm-fusion and schedule-comm: bucketed, early-issued collectives), training a flax GPT-style
LM with AdamW.

    python benchmarks/jax_dp_vs_gspmd.py [--devices 8] [--steps 5] [--layers 2 --dim 128
        --vocab 2048 --seq 64 --batch 16] [--variants gspmd,zero1,diphoma,diphoma-fused]

One row per variant: s/step (median over the timed steps, after one warm-up call),
first s (the first call: tracing and compiling), opt MB and param MB (bytes one device
holds, the largest over devices, 1 MB = 1e6 B), loss (the last step's; variants should
agree closely). No asserts: the machine is noisy; read the ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("--devices", type=int, default=8)
ap.add_argument("--steps", type=int, default=5)
ap.add_argument("--layers", type=int, default=2)
ap.add_argument("--dim", type=int, default=128)
ap.add_argument("--vocab", type=int, default=2048)
ap.add_argument("--seq", type=int, default=64)
ap.add_argument("--batch", type=int, default=16)
ap.add_argument("--variants", default="gspmd,zero1,diphoma,diphoma-fused")
args = ap.parse_args()
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={args.devices}")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from diphoma_compile.jax.parallel import per_device_bytes  # noqa: E402
from diphoma_compile import parallelize  # noqa: E402


FUSED = ("dce,data-parallel{axis=data},weight-update-sharding{axis=data, layout=dims-or-flat},"
         "comm-fusion{bucket-mb=25},schedule-comm,dce")


class Block(nn.Module):
    dim: int

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + nn.MultiHeadDotProductAttention(num_heads=4, use_bias=False)(
            nn.LayerNorm()(x), mask=mask)
        return x + nn.Dense(self.dim)(nn.gelu(nn.Dense(4 * self.dim)(nn.LayerNorm()(x))))


class GPT(nn.Module):
    vocab: int
    dim: int
    layers: int

    @nn.compact
    def __call__(self, ids):
        emb = nn.Embed(self.vocab, self.dim)
        x = emb(ids)
        for _ in range(self.layers):
            x = Block(self.dim)(x)
        return emb.attend(nn.LayerNorm()(x))


def main() -> None:
    model = GPT(args.vocab, args.dim, args.layers)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, args.vocab, (args.batch, args.seq + 1)).astype(np.int32)
    batch = {"ids": jnp.asarray(ids[:, :-1]), "labels": jnp.asarray(ids[:, 1:])}
    abstract = jax.eval_shape(model.init, jax.random.key(0), batch["ids"])["params"]
    params = jax.tree.map(lambda a: jnp.asarray(
        (rng.standard_normal(a.shape) * 0.02).astype(np.float32)), abstract)
    tx = optax.adamw(1e-3)
    opt_state = tx.init(params)

    def step(params, opt_state, batch):
        def loss_fn(p):
            logits = model.apply({"params": p}, batch["ids"])
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, batch["labels"]).mean()
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    n = len(jax.devices())
    rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def zero1_spec(x):
        for d, s in enumerate(x.shape):
            if s % n == 0:
                return NamedSharding(mesh, P(*([None] * d), "data"))
        return rep
    state_sh = jax.tree.map(zero1_spec, opt_state)
    runners = {
        "gspmd": lambda: jax.jit(step, in_shardings=(rep, rep, split), out_shardings=rep),
        "zero1": lambda: jax.jit(step, in_shardings=(rep, state_sh, split),
                                 out_shardings=(rep, state_sh, rep)),
        "diphoma": lambda: parallelize(step, mesh, axis="data"),
        "diphoma-fused": lambda: parallelize(step, mesh, axis="data", passes=FUSED),
    }
    print(f"{n} devices, GPT layers={args.layers} dim={args.dim} vocab={args.vocab} "
          f"seq={args.seq} batch={args.batch}, adamw")
    print(f"{'variant':13} {'s/step':>8} {'first s':>8} {'opt MB':>8} {'param MB':>9} {'loss':>9}")
    for name in args.variants.split(","):
        fn = runners[name]()
        t0 = time.perf_counter()
        p, s, loss = jax.block_until_ready(fn(params, opt_state, batch))
        first = time.perf_counter() - t0
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            p, s, loss = jax.block_until_ready(fn(p, s, batch))
            times.append(time.perf_counter() - t0)
        print(f"{name:13} {statistics.median(times):8.3f} {first:8.2f} "
              f"{per_device_bytes(jax.tree.leaves(s)) / 1e6:8.2f} "
              f"{per_device_bytes(jax.tree.leaves(p)) / 1e6:9.2f} {float(loss):9.5f}")


if __name__ == "__main__":
    main()
