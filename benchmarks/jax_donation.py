"""What donating the parameters and optimizer state saves a JAX parallel step, per device:
XLA's own memory analysis of the compiled program (arguments, outputs, the bytes outputs
alias into donated arguments, temporaries) for ``parallelize(step, mesh)`` with
``donate=False`` and ``donate=True``, and the median step time of each. Model: a flax
GPT-style LM whose vocab and width do not divide the device count (so the optimizer state is
stored flat, jax/layout.py), AdamW.

    python benchmarks/jax_donation.py [--devices 8] [--layers 2 --dim 66 --vocab 509
        --seq 32 --batch 16] [--steps 5]

"peak" = arguments + outputs - aliased + temporaries: what the program needs at once beyond
what the caller keeps. No asserts: read the ratios.
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
ap.add_argument("--dim", type=int, default=66)
ap.add_argument("--vocab", type=int, default=509)
ap.add_argument("--seq", type=int, default=32)
ap.add_argument("--batch", type=int, default=16)
args = ap.parse_args()
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={args.devices}")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from diphoma_compile import parallelize  # noqa: E402


class Block(nn.Module):
    dim: int

    @nn.compact
    def __call__(self, x):
        x = x + nn.Dense(self.dim)(nn.tanh(nn.Dense(self.dim)(nn.LayerNorm()(x))))
        return x + nn.Dense(self.dim)(nn.gelu(nn.Dense(4 * self.dim)(nn.LayerNorm()(x))))


class LM(nn.Module):
    @nn.compact
    def __call__(self, ids):
        emb = nn.Embed(args.vocab, args.dim)
        x = emb(ids)
        for _ in range(args.layers):
            x = Block(args.dim)(x)
        return emb.attend(nn.LayerNorm()(x))


def main() -> None:
    module, tx = LM(), optax.adamw(1e-3)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, args.vocab, (args.batch, args.seq + 1)).astype(np.int32)
    batch = {"ids": jnp.asarray(ids[:, :-1]), "labels": jnp.asarray(ids[:, 1:])}

    def step(params, opt_state, batch):
        def loss_of(p):
            logits = module.apply({"params": p}, batch["ids"])
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, batch["labels"]).mean()
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = jax.jit(module.init)(jax.random.key(0), batch["ids"])["params"]
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("dp",))
    rows = []
    for donate in (False, True):
        pstep = parallelize(step, mesh, donate=donate)
        p, s = params, jax.jit(tx.init)(params)
        p, s, loss = pstep(p, s, batch)          # compiles; s is now the stored form
        leaves, _ = pstep.runner.flatten((p, s, batch))
        mem = pstep.runner.jitted.lower(*leaves).compile().memory_analysis()
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            p, s, loss = jax.block_until_ready(pstep(p, s, batch))
            times.append(time.perf_counter() - t)
        arg, out = mem.argument_size_in_bytes, mem.output_size_in_bytes
        alias, temp = mem.alias_size_in_bytes, mem.temp_size_in_bytes
        rows.append((donate, arg, out, alias, temp, arg + out - alias + temp,
                     statistics.median(times), float(loss)))
    print(f"{args.devices} devices, LM layers={args.layers} dim={args.dim} "
          f"vocab={args.vocab}; bytes per device (1 MB = 1e6 B)")
    print(f"{'donate':>7} {'args MB':>8} {'outs MB':>8} {'aliased MB':>10} {'temp MB':>8} "
          f"{'peak MB':>8} {'s/step':>8} {'loss':>9}")
    for donate, arg, out, alias, temp, peak, t, loss in rows:
        print(f"{donate!s:>7} {arg / 1e6:8.3f} {out / 1e6:8.3f} {alias / 1e6:10.3f} "
              f"{temp / 1e6:8.3f} {peak / 1e6:8.3f} {t:8.4f} {loss:9.5f}")
    print(f"peak with donation / without: {rows[1][5] / rows[0][5]:.3f}; "
          f"step time: {rows[1][6] / rows[0][6]:.3f}")


if __name__ == "__main__":
    main()
