"""Train a small GPT-style language model (flax + optax) on synthetic tokens with
``diphoma_compile.parallelize`` over 8 virtual CPU devices, print the plan and the loss, and
check every step against the plain ``jax.jit(step)`` on one device: the loss agrees to
float32 noise, and the parameters deviate from it no more than (twice) JAX's own data
parallelism does (GSPMD: the same step under jax.jit with the batch sharded). Summing the
devices' gradients in another order changes the last bits, and AdamW magnifies that where
gradients are tiny, under any data-parallel reduction.

    python examples/jax_gpt_parallel.py [--steps 5] [--devices 8] [--tp 1]

The step is written for one device; ``parallelize`` takes the global batch, gives each
device its share, keeps parameters whole, splits the AdamW state over the devices (1/N
each), reduce-scatters gradients and all-gathers new parameters, all inside one jax.jit.
With ``--tp N`` the devices form a mesh dp x tp and each block's attention and MLP are also
split over tp (Megatron's layer pairs, found in the traced step): every device holds its
share of those weights, and the plan lists the pairs and their all-reduces."""

from __future__ import annotations

import argparse
import os
import sys

# the virtual devices must be asked for before jax is imported
_n = next((a.split("=")[1] for a in sys.argv if a.startswith("--devices=")), None)
if _n is None and "--devices" in sys.argv[:-1]:
    _n = sys.argv[sys.argv.index("--devices") + 1]
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={_n or 8}").strip()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import diphoma_compile  # noqa: E402

VOCAB, SEQ, DIM, HEADS, LAYERS = 128, 32, 64, 4, 2
LOSS_RTOL = 1e-4      # the mean over devices vs over the whole batch: summation order


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS)(nn.LayerNorm()(x), mask=mask)
        h = nn.Dense(4 * DIM)(nn.LayerNorm()(x))
        return x + nn.Dense(DIM)(nn.gelu(h))


class GPT(nn.Module):
    @nn.compact
    def __call__(self, idx):
        wte = nn.Embed(VOCAB, DIM)
        x = wte(idx) + self.param("wpe", nn.initializers.normal(0.02), (SEQ, DIM))
        for _ in range(LAYERS):
            x = Block()(x)
        return wte.attend(nn.LayerNorm()(x))        # tied output embedding


model = GPT()
tx = optax.adamw(3e-3)


def train_step(params, opt_state, batch):
    def loss_fn(p):
        logits = model.apply({"params": p}, batch["idx"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def make_batch(batch: int, seed: int) -> dict:
    """Random token ids; the target of each token is the next id, (idx + 1) % vocab."""
    idx = np.random.default_rng(seed).integers(0, VOCAB, (batch, SEQ)).astype(np.int32)
    return {"idx": jnp.asarray(idx), "targets": jnp.asarray((idx + 1) % VOCAB)}


def max_dev(a, b) -> float:
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a),
                                                                jax.tree.leaves(b)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--devices", type=int, default=8, help="virtual CPU devices (default 8)")
    p.add_argument("--batch", type=int, default=32, help="global batch (default 32)")
    p.add_argument("--tp", type=int, default=1,
                   help="devices per tensor-parallel group (default 1: data parallelism only)")
    a = p.parse_args()
    if a.tp < 1 or a.devices % a.tp:
        p.error(f"--tp {a.tp} must divide --devices {a.devices}")
    devices = np.array(jax.devices()[:a.devices])
    mesh = (jax.sharding.Mesh(devices, ("dp",)) if a.tp == 1 else
            jax.sharding.Mesh(devices.reshape(a.devices // a.tp, a.tp), ("dp", "tp")))
    params = jax.jit(model.init)(jax.random.key(0), make_batch(2, 0)["idx"])["params"]
    opt_state = jax.jit(tx.init)(params)
    pstep = diphoma_compile.parallelize(train_step, mesh)
    ref_step = jax.jit(train_step)
    P = jax.sharding.PartitionSpec
    rep, split = (jax.sharding.NamedSharding(mesh, s) for s in (P(), P("dp")))
    gspmd = jax.jit(train_step, in_shardings=(rep, rep, split), out_shardings=rep)
    ours, ref, their = ((params, opt_state),) * 3
    ok = True
    for i in range(a.steps):
        batch = make_batch(a.batch, seed=i)                     # the global batch
        *ours, loss = pstep(*ours, batch)
        if i == 0:
            print(pstep.plan.summary(), flush=True)
        *ref, ref_loss = ref_step(*ref, batch)
        *their, _ = gspmd(*their, batch)
        dev, gspmd_dev = max_dev(ours[0], ref[0]), max_dev(their[0], ref[0])
        same = abs(float(loss) - float(ref_loss)) <= LOSS_RTOL * abs(float(ref_loss)) \
            and dev <= 2 * gspmd_dev + 1e-6
        ok &= same
        print(f"step {i}: loss {float(loss):.6f}  single device {float(ref_loss):.6f}  "
              f"params max |diff| {dev:.2e} (GSPMD {gspmd_dev:.2e})  "
              f"{'ok' if same else 'DIFFERS'}", flush=True)
    mem = pstep.memory_report()
    whole = sum(x.nbytes for x in jax.tree.leaves(opt_state))
    print(f"optimizer state per device: {mem.opt_state_bytes} bytes (single device: {whole})")
    print("matches the single-device run" if ok else "MISMATCH")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
