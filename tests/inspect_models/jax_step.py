"""A linear model in plain JAX with an optax step and its example arguments."""

import jax
import jax.numpy as jnp
import optax

tx = optax.sgd(0.1, momentum=0.9)


def init_params(key, d=64):
    return {"w": jax.random.normal(key, (d, 8)) * 0.1, "b": jnp.zeros((8,))}


def step(params, opt_state, batch):
    def loss_fn(p):
        pred = batch["x"] @ p["w"] + p["b"]
        return jnp.mean((pred - batch["y"]) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def example_inputs():
    params = init_params(jax.random.PRNGKey(0))
    batch = {"x": jnp.ones((128, 64)), "y": jnp.zeros((128, 8))}
    return params, tx.init(params), batch
