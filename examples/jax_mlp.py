"""Trace a flax + optax training step into the IR, run the compiled step for ten steps beside
the user's own jax.jit(step), and show that both end bit for bit the same.

    python examples/jax_mlp.py [--steps 10] [--print-ir]
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import diphoma_compile
from diphoma_compile.ir import Phase


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(nn.gelu(nn.Dense(64)(x)))


def make_step(model: nn.Module, tx: optax.GradientTransformation):
    def train_step(params, opt_state, batch):
        def loss_fn(p):
            logits = model.apply({"params": p}, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return train_step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--print-ir", action="store_true", help="print the whole IR graph")
    a = p.parse_args()
    model = MLP()
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    rng = np.random.default_rng(1)
    xs = [rng.normal(size=(64, 32)).astype(np.float32) for _ in range(a.steps)]
    # a rule the model can learn: the class is the largest of the first ten features
    data = [{"x": jnp.asarray(x), "y": jnp.asarray(x[:, :10].argmax(1))} for x in xs]
    params = model.init(jax.random.key(0), data[0]["x"])["params"]
    opt_state = tx.init(params)
    step = make_step(model, tx)

    compiled = diphoma_compile.compile(step, params, opt_state, data[0], passes="dce,cse")
    graph = diphoma_compile.trace(step, params, opt_state, data[0])
    if a.print_ir:
        print(graph)
    update = [op for op in graph.ops if op.phase is Phase.update]
    print(f"traced: {len(graph.inputs)} inputs, {len(graph.ops)} ops; update region "
          f"{len(update)} ops, {sum(op.name == 'opaque' for op in update)} of them opaque")
    reference = jax.jit(step)
    ours, ref = (params, opt_state), (params, opt_state)
    exact = True
    for i, batch in enumerate(data):
        *ours, loss = compiled(*ours, batch)
        *ref, ref_loss = reference(*ref, batch)
        same = all(np.asarray(x).tobytes() == np.asarray(y).tobytes()
                   for x, y in zip(jax.tree.leaves((ours, loss)), jax.tree.leaves((ref, ref_loss))))
        exact &= same
        print(f"step {i}: loss {float(loss):.6f}  jax.jit {float(ref_loss):.6f}  "
              f"{'bit-exact' if same else 'DIFFERS'}")
    print("compiled step matches jax.jit(step) bit for bit" if exact else "MISMATCH")
    raise SystemExit(0 if exact else 1)


if __name__ == "__main__":
    main()
