"""JAX behind the Framework protocol: jaxpr conversion, the primitive<->IR<->lax table,
the jit and shard_map runners. The only package that imports jax, flax and optax."""
