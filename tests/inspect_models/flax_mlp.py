"""An MLP classifier in Flax (linen), with an optax training step, as in the Flax examples."""

from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


class MLPBlock(nn.Module):
    features: int
    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.features)(x)
        x = nn.LayerNorm()(x)
        return nn.gelu(x)


class Classifier(nn.Module):
    """784 -> hidden -> ... -> num_classes."""
    hidden: Sequence[int] = (1024, 1024)
    num_classes: int = 10

    @nn.compact
    def __call__(self, x):
        x = x.reshape((x.shape[0], -1))
        for width in self.hidden:
            x = MLPBlock(width)(x)
        return nn.Dense(self.num_classes)(x)


def create_train_state(rng, learning_rate=1e-3):
    model = Classifier()
    params = model.init(rng, jnp.ones((1, 28, 28, 1)))["params"]
    tx = optax.adamw(learning_rate)
    return model, params, tx, tx.init(params)


if __name__ == "__main__":
    model, params, tx, opt_state = create_train_state(jax.random.PRNGKey(0))
    x = jnp.ones((32, 28, 28, 1))
    y = jnp.zeros((32,), jnp.int32)

    @jax.jit
    def train_step(params, opt_state):
        def loss_fn(p):
            logits = model.apply({"params": p}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    for i in range(3):
        params, opt_state, loss = train_step(params, opt_state)
        print(i, loss)
