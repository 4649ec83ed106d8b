"""The GPT of examples/gpt.py in flax, parameter for parameter: the same tensors (fused q, k,
v projection, biases, tied input and output embedding, learned positions), each of the same
number of elements (Dense kernels are the transposes of torch's Linear weights), GPT-2's
initialisation, and an AdamW training step in optax.

The quantized-collectives benchmark and tests import it, to run the same model on both
backends and compare what their plans move."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


class Block(nn.Module):
    n_head: int
    n_layer: int

    @nn.compact
    def __call__(self, x):
        b, t, c = x.shape
        init = nn.initializers.normal(0.02)
        proj = nn.initializers.normal(0.02 / math.sqrt(2 * self.n_layer))
        h = nn.LayerNorm(epsilon=1e-5, name="ln_1")(x)
        qkv = nn.Dense(3 * c, kernel_init=init, name="c_attn")(h)
        q, k, v = (z.reshape(b, t, self.n_head, c // self.n_head) for z in
                   jnp.split(qkv, 3, axis=-1))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(c // self.n_head)
        att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -jnp.inf)
        y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(att, axis=-1), v).reshape(b, t, c)
        x = x + nn.Dense(c, kernel_init=proj, name="attn_proj")(y)
        h = nn.LayerNorm(epsilon=1e-5, name="ln_2")(x)
        h = nn.gelu(nn.Dense(4 * c, kernel_init=init, name="c_fc")(h), approximate=False)
        return x + nn.Dense(c, kernel_init=proj, name="mlp_proj")(h)


class GPT(nn.Module):
    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int

    @nn.compact
    def __call__(self, idx):
        wte = nn.Embed(self.vocab_size, self.n_embd, embedding_init=nn.initializers.normal(0.02),
                       name="wte")
        wpe = self.param("wpe", nn.initializers.normal(0.02), (self.block_size, self.n_embd))
        x = wte(idx) + wpe[:idx.shape[1]]
        for i in range(self.n_layer):
            x = Block(self.n_head, self.n_layer, name=f"h_{i}")(x)
        return wte.attend(nn.LayerNorm(epsilon=1e-5, name="ln_f")(x))   # tied lm_head


def make_step(model: GPT, tx: optax.GradientTransformation):
    """``step(params, opt_state, idx, targets) -> (params, opt_state, loss)``."""
    def step(params, opt_state, idx, targets):
        def loss_fn(p):
            logits = model.apply({"params": p}, idx)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step
