"""SDP4Bit's quantized collectives against plain weight-update sharding, by the loss they
reach: a small GPT (examples/gpt.py) trained on a learnable synthetic language with AdamW on
N gloo ranks, one variant after another from identical weights on identical batches.

    python benchmarks/quantized_convergence.py [--steps 300] [--nproc 4]
        [--variants plain,sdp4bit,naive4,nohadamard] [--layers 2 --embd 128 ...]
    python benchmarks/quantized_convergence.py --framework jax [--devices 8] ...

With ``--framework jax`` the same GPT in flax (examples/flax_gpt.py, tensor for tensor)
trains with optax's AdamW under ``parallelize`` on --devices virtual CPU devices (one
process, jax.jit over shard_map), on the same batches; the table has the same columns.

The language: a first-order Markov chain over --vocab tokens in which each token is followed
by one of 4 successors (fixed at random) with probabilities 0.6, 0.25, 0.1, 0.05, so the
best possible loss (its entropy rate) is printed beside the results.

Variants (all on the default pipeline: data parallelism, weight-update sharding,
comm-fusion, schedule-comm):
  plain       no quantization;
  sdp4bit     compression="sdp4bit": quantize-grads (4-bit, group 128, Hadamard 32) and
              quantize-weight-diff (4-bit weight differences, group 2048);
  naive4      the paper's ablation: the new weights themselves quantized to 4 bits
              (quantize-weight-diff{naive=true}), gradients as in sdp4bit;
  nohadamard  sdp4bit without the Hadamard transform (quantize-grads{hadamard=0});
  twohop      sdp4bit with SDP4Bit's two-hop gradients (quantize-grads{levels=2,
              local=--local}: 8-bit among each node's --local devices, 4-bit across);
              not in the default list.
Rank 0 prints, per variant: the mean training loss of the last 10 steps, the loss on 8
held-out batches (with the weights every rank computes with), the planned bytes per step
per device and their ratio to plain, and seconds per step. No asserts: read the table.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt import GPT, GPTConfig, train_step  # noqa: E402

import diphoma_compile  # noqa: E402
from diphoma_compile.passes.defaults import default_passes  # noqa: E402

VARIANTS = ("plain", "sdp4bit", "naive4", "nohadamard")
ALL_VARIANTS = VARIANTS + ("twohop",)
PROBS = torch.tensor([0.6, 0.25, 0.1, 0.05])


def language(vocab: int, seed: int = 0) -> torch.Tensor:
    """The successor table: 4 distinct next tokens per token."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(vocab, generator=g)[:4] for _ in range(vocab)])


def entropy_rate() -> float:
    """Nats per token of the chain (the loss a perfect model reaches)."""
    return float(-(PROBS * PROBS.log()).sum())


def sample(succ: torch.Tensor, batch: int, length: int, seed: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx, targets) of ``batch`` sequences of the chain."""
    g = torch.Generator().manual_seed(seed)
    vocab = succ.shape[0]
    seq = torch.empty(batch, length + 1, dtype=torch.int64)
    seq[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
    for t in range(length):
        pick = torch.multinomial(PROBS.expand(batch, 4), 1, generator=g).squeeze(1)
        seq[:, t + 1] = succ[seq[:, t], pick]
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def spec(variant: str, grad_bytes: int, local: int = 2) -> str | None:
    """The pass pipeline of a variant (None: parallelize's default)."""
    if variant == "plain":
        return None
    s = default_passes("dp", grad_bytes, compression="sdp4bit")
    if variant == "naive4":
        s = s.replace("rounding=stochastic}", "rounding=stochastic, naive=true}")
    if variant == "nohadamard":
        s = s.replace("hadamard=32", "hadamard=0")
    if variant == "twohop":
        s = s.replace("levels=auto", f"levels=2, local={local}")
    return s


def _run(variant: str, a: argparse.Namespace, cfg: GPTConfig, succ: torch.Tensor,
         rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kw = ({"compression": "sdp4bit"} if variant == "sdp4bit" else
          {"passes": spec(variant, grad_bytes, a.local)})
    step = diphoma_compile.parallelize(train_step, diphoma_compile.Mesh({"dp": world}), **kw)
    local = a.batch // world
    losses, times = [], []
    for i in range(a.steps):
        idx, tgt = sample(succ, a.batch, a.seq, seed=1000 + i)
        sl = slice(rank * local, (rank + 1) * local)
        dist.barrier()
        t0 = time.perf_counter()
        loss = step(model, opt, idx[sl], tgt[sl])
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    with torch.no_grad():
        val = [float(model(*sample(succ, a.batch, a.seq, seed=10 ** 6 + k))[1])
               for k in range(8)]
    times.sort()
    return {"train": sum(losses[-10:]) / len(losses[-10:]), "val": sum(val) / len(val),
            "bytes": step.plan.comm_bytes_per_step, "s_step": times[len(times) // 2],
            "first": losses[0]}


def _jax_spec(variant: str, grad_bytes: int, local: int = 2) -> str | None:
    """The pass pipeline of a variant on the JAX layout (whole dimensions)."""
    if variant == "plain":
        return None
    s = default_passes("dp", grad_bytes, layout="dims", compression="sdp4bit")
    if variant == "naive4":
        s = s.replace("rounding=stochastic}", "rounding=stochastic, naive=true}")
    if variant == "nohadamard":
        s = s.replace("hadamard=32", "hadamard=0")
    if variant == "twohop":
        s = s.replace("levels=auto", f"levels=2, local={local}")
    return s


def run_jax(a: argparse.Namespace) -> dict:
    """Every variant on --devices JAX devices: {variant: results}."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={a.devices}").strip()
    import jax
    import jax.numpy as jnp
    import optax
    from flax_gpt import GPT as FlaxGPT
    from flax_gpt import make_step

    model = FlaxGPT(a.vocab, a.seq, a.layers, a.heads, a.embd)
    tx = optax.adamw(a.lr)
    params0 = model.init(jax.random.key(0), jnp.zeros((1, a.seq), jnp.int32))["params"]
    grad_bytes = sum(x.size * 4 for x in jax.tree.leaves(params0))
    step_fn = make_step(model, tx)
    succ = language(a.vocab)

    def batch(seed: int) -> tuple:
        idx, tgt = sample(succ, a.batch, a.seq, seed)
        return jnp.asarray(idx.numpy(), jnp.int32), jnp.asarray(tgt.numpy(), jnp.int32)

    @jax.jit
    def loss_of(p, idx, tgt):
        logits = model.apply({"params": p}, idx)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tgt).mean()

    results = {}
    for v in a.variants:
        kw = ({"compression": "sdp4bit"} if v == "sdp4bit" else
              {"passes": _jax_spec(v, grad_bytes, a.local)})
        step = diphoma_compile.parallelize(step_fn, diphoma_compile.Mesh({"dp": a.devices}), **kw)
        p, o = params0, tx.init(params0)
        losses, times = [], []
        for i in range(a.steps):
            idx, tgt = batch(1000 + i)
            t0 = time.perf_counter()
            p, o, loss = step(p, o, idx, tgt)
            losses.append(float(loss))
            times.append(time.perf_counter() - t0)
        val = [float(loss_of(p, *batch(10 ** 6 + k))) for k in range(8)]
        times.sort()
        results[v] = {"train": sum(losses[-10:]) / len(losses[-10:]), "val": sum(val) / len(val),
                      "bytes": step.plan.comm_bytes_per_step, "s_step": times[len(times) // 2],
                      "first": losses[0]}
    n = sum(x.size for x in jax.tree.leaves(params0))
    _table(results, a, n, f"{a.devices} JAX CPU devices (flax, optax AdamW)")
    return results


def _table(results: dict, a: argparse.Namespace, n: int, where: str) -> None:
    print(f"GPT {a.layers} layers x {a.embd}, {n / 1e6:.2f}M parameters, vocab {a.vocab}, "
          f"seq {a.seq}, global batch {a.batch} on {where}, AdamW lr {a.lr}, "
          f"{a.steps} steps; entropy rate (best loss) {entropy_rate():.4f}, "
          f"uniform {math.log(a.vocab):.4f}")
    base = results.get("plain")
    print(f"{'variant':<11} {'train':>8} {'val':>8} {'val vs plain':>13} "
          f"{'bytes/step':>11} {'vs plain':>9} {'s/step':>8}")
    for v, r in results.items():
        rel = f"{(r['val'] / base['val'] - 1) * 100:+.2f}%" if base else ""
        ratio = f"{r['bytes'] / base['bytes']:.3f}" if base else ""
        print(f"{v:<11} {r['train']:8.4f} {r['val']:8.4f} {rel:>13} {r['bytes']:11d} "
              f"{ratio:>9} {r['s_step']:8.3f}")


def _worker(rank: int, world: int, a: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=a.timeout))
    cfg = GPTConfig(vocab_size=a.vocab, block_size=a.seq, n_layer=a.layers, n_head=a.heads,
                    n_embd=a.embd)
    succ = language(a.vocab)
    results = {v: _run(v, a, cfg, succ, rank, world) for v in a.variants}
    if rank == 0:
        n = sum(p.numel() for p in GPT(cfg).parameters())
        _table(results, a, n, f"{world} gloo ranks")
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=32, help="global batch (divides --nproc)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--framework", choices=("torch", "jax"), default="torch")
    p.add_argument("--local", type=int, default=2, help="devices per node (twohop)")
    p.add_argument("--devices", type=int, default=8, help="JAX devices (--framework jax)")
    a = p.parse_args()
    a.variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in a.variants if v not in ALL_VARIANTS]
    if bad or a.batch % a.nproc:
        p.error(f"variants from {ALL_VARIANTS}; --batch divisible by --nproc")
    if a.framework == "jax":
        if a.batch % a.devices:
            p.error("--batch divisible by --devices")
        run_jax(a)
        return
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    mp.spawn(_worker, args=(a.nproc, a), nprocs=a.nproc, join=True)


if __name__ == "__main__":
    main()
