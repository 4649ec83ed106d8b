"""Small flax (linen and nnx) models and optax training steps shared by the JAX tests."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

VOCAB, DIM, SEQ, BATCH = 32, 16, 8, 2


class LinenMLP(nn.Module):
    """Two dense layers with a relu."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(16)(x))  # layers are named in the order they are built
        return nn.Dense(4)(h)


class LinenBlock(nn.Module):
    """A pre-norm transformer block: causal self-attention and a gelu MLP."""

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=2, use_bias=False)(h, mask=mask)
        h = nn.Dense(2 * DIM)(nn.LayerNorm()(x))
        return x + nn.Dense(DIM)(nn.gelu(h))


class LinenLM(nn.Module):
    """A one-block language model with tied input and output embeddings."""

    @nn.compact
    def __call__(self, ids):
        emb = nn.Embed(VOCAB, DIM)
        x = LinenBlock()(emb(ids))
        return emb.attend(nn.LayerNorm()(x))


class NnxMLP(nnx.Module):
    """The MLP in flax.nnx."""

    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(6, 16, rngs=rngs)
        self.l2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


class NnxLM(nnx.Module):
    """The one-block language model in flax.nnx."""

    def __init__(self, rngs: nnx.Rngs):
        self.emb = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.ln1 = nnx.LayerNorm(DIM, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=DIM, decode=False,
                                           use_bias=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(DIM, rngs=rngs)
        self.fc1 = nnx.Linear(DIM, 2 * DIM, rngs=rngs)
        self.fc2 = nnx.Linear(2 * DIM, DIM, rngs=rngs)
        self.ln_f = nnx.LayerNorm(DIM, rngs=rngs)

    def __call__(self, ids):
        x = self.emb(ids)
        mask = nnx.make_causal_mask(ids)
        x = x + self.attn(self.ln1(x), mask=mask)
        x = x + self.fc2(nnx.gelu(self.fc1(self.ln2(x))))
        return self.emb.attend(self.ln_f(x))


OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "sgd": lambda: optax.sgd(0.1),
    "adamw": lambda: optax.adamw(1e-2),
    "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)),
    "adam_schedule": lambda: optax.adam(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 10)),
}


# Data and initial values come from numpy: eager JAX compiles each op it runs, which costs
# seconds on a small machine, and these tests are about the step, not the initializers.
def _normal(seed: int, shape: tuple[int, ...], scale: float = 1.0) -> jax.Array:
    rng = np.random.default_rng(seed)
    return jnp.asarray((rng.standard_normal(shape) * scale).astype(np.float32))


def mlp_batch() -> tuple[jax.Array, jax.Array]:
    """Inputs and regression targets for the MLP."""
    return _normal(1, (8, 6)), _normal(2, (8, 4))


def lm_batch() -> dict[str, jax.Array]:
    """Token ids and next-token labels for the language model."""
    ids = np.random.default_rng(3).integers(0, VOCAB, (BATCH, SEQ + 1)).astype(np.int32)
    return {"ids": jnp.asarray(ids[:, :-1]), "labels": jnp.asarray(ids[:, 1:])}


def _init_like(abstract: Any) -> Any:
    """Concrete parameters for an abstract tree: LayerNorm scales near 1, the rest small."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    values = []
    for k, (path, leaf) in enumerate(leaves):
        base = 1.0 if "scale" in jax.tree_util.keystr(path) else 0.0
        values.append(base + _normal(100 + k, leaf.shape, 0.3))
    return jax.tree.unflatten(treedef, values)


def _mse(logits, batch):
    return jnp.mean((logits - batch[1]) ** 2)


def _xent(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def _train_step(apply: Callable, loss_of: Callable, inputs_of: Callable,
                tx: optax.GradientTransformation) -> Callable:
    def step(params, opt_state, batch):
        def loss_fn(p):
            return loss_of(apply(p, inputs_of(batch)), batch)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step


@functools.cache
def _model(model: str, flavour: str) -> tuple[Callable, Any]:
    """(apply(params, inputs), initial params), built once per model."""
    example = mlp_batch()[0] if model == "mlp" else lm_batch()["ids"]
    if flavour == "linen":
        module = LinenMLP() if model == "mlp" else LinenLM()
        abstract = jax.eval_shape(module.init, jax.random.key(0), example)["params"]

        def apply(p, x):
            return module.apply({"params": p}, x)
        return apply, _init_like(abstract)
    graphdef, abstract = nnx.split(
        nnx.eval_shape(lambda: (NnxMLP if model == "mlp" else NnxLM)(nnx.Rngs(0))), nnx.Param)

    def apply_nnx(p, x):
        return nnx.merge(graphdef, p)(x)
    return apply_nnx, _init_like(abstract)


def make_case(model: str, flavour: str, optimizer: str) -> tuple[Callable, tuple[Any, ...]]:
    """(step, (params, opt_state, batch)) for model mlp|lm, flavour linen|nnx, an optimizer."""
    tx = OPTIMIZERS[optimizer]()
    batch = mlp_batch() if model == "mlp" else lm_batch()
    loss_of = _mse if model == "mlp" else _xent
    inputs_of = (lambda b: b[0]) if model == "mlp" else (lambda b: b["ids"])
    apply, params = _model(model, flavour)
    step = _train_step(apply, loss_of, inputs_of, tx)
    return step, (params, tx.init(params), batch)


def squares_step(module: nn.Module, tx: optax.GradientTransformation) -> Callable:
    """A training step whose loss is the mean square of the module's output (for blocks
    that map activations to activations)."""
    def step(params, opt_state, x):
        def loss_fn(p):
            return jnp.mean(module.apply({"params": p}, x) ** 2)
        loss, g = jax.value_and_grad(loss_fn)(params)
        u, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, u), opt_state, loss
    return step


def assert_runs_like_one_device(step: Callable, params: Any, x: Any, placed: Any,
                                tx: optax.GradientTransformation, mesh: dict[str, int],
                                axis: str, steps: int = 3) -> tuple:
    """Run a placed graph on the first devices as ``mesh`` names them, ``steps`` steps on
    scaled copies of ``x``, against ``step`` on one device: losses within rtol 1e-5,
    parameters and optimizer state within rtol 1e-4 / atol 2e-5. Returns our state."""
    from diphoma_compile.jax.parallel import compile_jax_parallel
    devices = np.array(jax.devices()[:int(np.prod(list(mesh.values())))])
    jmesh = jax.sharding.Mesh(devices.reshape(tuple(mesh.values())), tuple(mesh))
    run = compile_jax_parallel(placed, mesh=jmesh, axis=axis)
    ref = ours = (params, tx.init(params))
    for i in range(steps):
        xi = x * (1.0 + 0.1 * i)
        *ref, ref_loss = step(*ref, xi)
        *ours, loss = run(*ours, xi)
        np.testing.assert_allclose(np.asarray(loss), np.asarray(ref_loss), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(ours)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=2e-5)
    return tuple(ours)


def keyed_steps(step: Callable, parallel: Callable, state: tuple, batch: Any,
                seeds: range) -> tuple[tuple, tuple]:
    """``step(*state, batch, key)`` under jax.jit and ``parallel`` (the same step made
    parallel), one call per seed's key, each from its own previous (params, opt_state);
    the losses (result 2) checked within 1e-5 at every step. The final states (jit's,
    the parallel one's)."""
    a = b = state
    for seed in seeds:
        key = jax.random.PRNGKey(seed)
        want, got = jax.jit(step)(*a, batch, key), parallel(*b, batch, key)
        np.testing.assert_allclose(float(got[2]), float(want[2]), rtol=1e-5)
        a, b = tuple(want[:2]), tuple(got[:2])
    return a, b
