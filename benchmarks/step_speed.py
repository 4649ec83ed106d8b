"""One training step, timed several ways in one process, interleaved: PyTorch eager,
``torch.compile(model)``, and diphoma_compile's ``fx`` and ``inductor`` code generators;
JAX ``jax.jit`` of the user's step against diphoma_compile's ``compile`` and
``parallelize`` on a one-device mesh. A GPT-2-style model with AdamW.

    python benchmarks/step_speed.py [--steps 10] [--layers 4 --embd 256 --vocab 8192
        --seq 128 --batch 8] [--device cpu|cuda] [--torch fx,inductor,eager,torch.compile]
        [--jax jit,compile,parallelize] [--skip-torch] [--skip-jax] [--memory]

Each variant trains its own copy of the same model (same seed) on the same batches. The
steps are interleaved (step k of every variant, in an order that rotates, before step k+1),
so that a machine shared with other work slows every variant alike. Printed per variant:
  first s   the first call (tracing and compiling included);
  median ms the median of the later calls (CUDA: synchronized);
  vs eager  the median's ratio to eager's (jax: to jax.jit's); below 1 is faster;
  loss dev  the largest |loss - eager loss| over the steps.
With --memory (torch), each diphoma variant then runs one more step under
``measure_memory()``: the peak of tensor memory the step reaches above what it held before
(parameters, optimizer state, gradients, batch), and the op where it peaks.
No asserts: the machine is noisy; read the ratios."""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))


def _timed(fn, sync) -> tuple[float, float]:
    """(seconds, loss) of one call."""
    t0 = time.perf_counter()
    loss = fn()
    loss = sync(loss)
    return time.perf_counter() - t0, loss


def _report(title: str, rows: dict[str, dict], base: str) -> None:
    print(f"\n{title}")
    print(f"{'variant':<16}{'first s':>10}{'median ms':>12}{'vs ' + base:>14}{'loss dev':>12}")
    ref = statistics.median(rows[base]["times"]) if base in rows else None
    for name, r in rows.items():
        med = statistics.median(r["times"])
        ratio = f"{med / ref:.3f}" if ref else "-"
        dev = max((abs(a - b) for a, b in zip(r["losses"], rows[base]["losses"])),
                  default=float("nan")) if base in rows else float("nan")
        print(f"{name:<16}{r['first']:>10.2f}{med * 1e3:>12.1f}{ratio:>14}{dev:>12.2e}")


def _interleave(variants: dict, steps: int, sync) -> dict[str, dict]:
    """Call every variant once per step, in a rotating order; first call timed apart."""
    rows = {n: {"times": [], "losses": []} for n in variants}
    names = list(variants)
    for k in range(steps + 1):
        order = names[k % len(names):] + names[:k % len(names)]
        for n in order:
            dt, loss = _timed(lambda n=n, k=k: variants[n](k), sync)
            if k == 0:
                rows[n]["first"] = dt
            else:
                rows[n]["times"].append(dt)
            rows[n]["losses"].append(loss)
    return rows


def bench_torch(a: argparse.Namespace) -> None:
    import torch

    import diphoma_compile
    from gpt import GPT, GPTConfig, make_batch, train_step

    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = GPTConfig(vocab_size=a.vocab, block_size=a.seq, n_layer=a.layers, n_head=4,
                    n_embd=a.embd)
    torch.manual_seed(0)
    base = GPT(cfg).to(device)
    batches = [tuple(t.to(device) for t in make_batch(cfg, a.batch, seed=k))
               for k in range(a.steps + 1)]

    def fresh():
        m = copy.deepcopy(base)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-3)

    variants = {}
    compiled = {}
    for name in a.torch:
        model, opt = fresh()
        if name == "eager":
            step = train_step
        elif name == "torch.compile":
            model = torch.compile(model)
            step = train_step
        else:
            step = diphoma_compile.compile(train_step, model, opt, *batches[0],
                                           codegen=name)
        label = name if name in ("eager", "torch.compile") else f"diphoma {name}"
        if label.startswith("diphoma"):
            compiled[label] = (step, model, opt)

        def run(k, step=step, model=model, opt=opt):
            return step(model, opt, *batches[k])
        variants[label] = run

    def sync(loss):
        if device.type == "cuda":
            torch.cuda.synchronize()
        return float(loss.detach())
    rows = _interleave(variants, a.steps, sync)
    _report(f"torch on {device} ({torch.get_num_threads()} threads): GPT {a.layers} layers, "
             f"d={a.embd}, vocab {a.vocab}, seq {a.seq}, batch {a.batch}, AdamW",
             rows, "eager")
    if a.memory:
        print("\nthe step's transient peak (measure_memory: above what it held before)")
        for label, (step, model, opt) in compiled.items():
            print(f"{label:<18}{step.measure_memory(model, opt, *batches[0])}")


def bench_jax(a: argparse.Namespace) -> None:
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import diphoma_compile

    vocab, dim, seq, layers = a.vocab, a.embd, a.seq, a.layers

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
            x = x + nn.MultiHeadDotProductAttention(num_heads=4)(nn.LayerNorm()(x), mask=mask)
            h = nn.Dense(4 * dim)(nn.LayerNorm()(x))
            return x + nn.Dense(dim)(nn.gelu(h))

    class GPT(nn.Module):
        @nn.compact
        def __call__(self, idx):
            wte = nn.Embed(vocab, dim)
            x = wte(idx) + self.param("wpe", nn.initializers.normal(0.02), (seq, dim))
            for _ in range(layers):
                x = Block()(x)
            return wte.attend(nn.LayerNorm()(x))

    model = GPT()
    tx = optax.adamw(1e-3)

    def train_step(params, opt_state, batch):
        def loss_fn(p):
            logits = model.apply({"params": p}, batch["idx"])
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, batch["targets"]).mean()
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def batch(k):
        idx = np.random.default_rng(k).integers(0, vocab, (a.batch, seq)).astype(np.int32)
        return {"idx": jnp.asarray(idx), "targets": jnp.asarray((idx + 1) % vocab)}
    batches = [batch(k) for k in range(a.steps + 1)]
    params = model.init(jax.random.PRNGKey(0), batches[0]["idx"])["params"]
    opt_state = tx.init(params)

    variants = {}
    for name in a.jax:
        if name == "jit":
            step = jax.jit(train_step)
        elif name == "compile":
            step = diphoma_compile.compile(train_step, params, opt_state, batches[0])
        else:
            step = diphoma_compile.parallelize(train_step, {"dp": 1})
        state = {"p": params, "s": opt_state}

        def run(k, step=step, state=state):
            state["p"], state["s"], loss = step(state["p"], state["s"], batches[k])
            return loss
        variants[name if name == "jit" else f"diphoma {name}"] = run

    def sync(loss):
        return float(jax.block_until_ready(loss))
    rows = _interleave(variants, a.steps, sync)
    _report(f"jax on {jax.devices()[0].platform}: GPT {layers} layers, d={dim}, vocab {vocab}, "
            f"seq {seq}, batch {a.batch}, AdamW", rows, "jit")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embd", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--device", default=None, help="torch device (default: cuda if present)")
    p.add_argument("--torch", default="eager,torch.compile,fx,inductor")
    p.add_argument("--jax", default="jit,compile,parallelize")
    p.add_argument("--skip-torch", action="store_true")
    p.add_argument("--skip-jax", action="store_true")
    p.add_argument("--memory", action="store_true",
                   help="also measure each diphoma variant's peak memory in one step")
    a = p.parse_args()
    a.torch = [v.strip() for v in a.torch.split(",") if v.strip()]
    a.jax = [v.strip() for v in a.jax.split(",") if v.strip()]
    if "eager" not in a.torch:
        a.torch.insert(0, "eager")
    if "jit" not in a.jax:
        a.jax.insert(0, "jit")
    if not a.skip_torch:
        bench_torch(a)
    if not a.skip_jax:
        bench_jax(a)


if __name__ == "__main__":
    main()
