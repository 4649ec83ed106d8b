"""Parameters held as pieces under a pipeline, three ways side by side in one launch:
diphoma_compile.parallelize over a dp x pp mesh training the GPT of examples/gpt.py (tied
embedding and LM head) with AdamW on 4 gloo ranks on the CPU:

  whole       the default plan: each stage's parameters whole on its dp ranks, optimizer
              state sharded over dp (weight-update sharding);
  shard/step  shard_params=True: parameters held as dp pieces, each stage gathering each of
              its parameters once a step before its first microbatch and keeping them whole
              until its last backward (the pipeline's gather=step, the default; what
              torch's pipelines do with FSDP);
  shard/mb    the same with gather=microbatch: gathered in every microbatch's forward and
              again in its backward (2M gathers a step), the least memory.

    python benchmarks/pipeline_shard.py [--steps 8] [--warmup 2] [--micro 4]
        [--layers 4 --embd 128 --vocab 1024 --seq 64 --batch 16]

The variants' steps are interleaved (one step of each in turn, a barrier around each), so
the machine's noise falls on all three alike. Rank 0 prints one row per variant: the
median step time and its ratio to whole; the bytes each pp rank sent a step (counted by the
runtime: its collectives and its sends, ring model) beside the plan's; the parameter bytes
a rank holds between steps; the peak tensor memory a rank reaches in one more step
(measure_memory) beside the plan's peak for its pp rank; the last loss (the variants start
from the same weights and batches). No asserts: the machine is noisy; read the ratios.
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt import GPT, GPTConfig, train_step  # noqa: E402  (the example's own step)

MESH = {"dp": 2, "pp": 2}
VARIANTS = ("whole", "shard/step", "shard/mb")


def _build(rank: int, args, base: GPT, name: str, first: tuple, spec: str | None):
    """One variant's model, optimizer and parallel step, traced on ``first``."""
    import diphoma_compile
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if name == "whole":
        step = diphoma_compile.parallelize(train_step, MESH, microbatches=args.micro)
    elif name == "shard/step":
        step = diphoma_compile.parallelize(train_step, MESH, microbatches=args.micro,
                                           shard_params=True)
    else:
        step = diphoma_compile.parallelize(train_step, MESH, passes=spec)
    step.trace(model, opt, *first)
    return model, opt, step


def _run(rank: int, args, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=4)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=args.seq, vocab_size=args.vocab, n_layer=args.layers,
                    n_head=4, n_embd=args.embd)
    base = GPT(cfg)
    row, pp = rank // MESH["pp"], rank % MESH["pp"]
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(args.warmup + args.steps + 1):
        seq = torch.randint(0, args.vocab, (MESH["dp"] * args.batch, args.seq + 1),
                            generator=g)
        mine = seq[row * args.batch:(row + 1) * args.batch]
        batches.append((mine[:, :-1].contiguous(), mine[:, 1:].contiguous()))
    built = {}
    for name in VARIANTS:
        spec = None
        if name == "shard/mb":      # shard/step's passes, gathering per microbatch
            spec = ",".join(built["shard/step"][2].graph.passes).replace(
                "gather=step", "gather=microbatch")
        built[name] = _build(rank, args, base, name, batches[0], spec)
    walls: dict[str, list[float]] = {n: [] for n in VARIANTS}
    losses: dict[str, float] = {}
    sent0: dict[str, int] = {}
    for k, (idx, tgt) in enumerate(batches[:-1]):
        for name in VARIANTS:
            model, opt, step = built[name]
            if k == args.warmup:
                sent0[name] = step.runner.comm_bytes
            dist.barrier()
            t0 = time.perf_counter()
            losses[name] = step(model, opt, idx, tgt).item()
            dist.barrier()
            if k >= args.warmup:
                walls[name].append(time.perf_counter() - t0)
    rows = {}
    for name in VARIANTS:
        model, opt, step = built[name]
        sent = (step.runner.comm_bytes - sent0[name]) / args.steps
        held = step.memory_report().param_bytes
        got = step.measure_memory(model, opt, *batches[-1])
        plan = step.plan
        rows[name] = (statistics.median(walls[name]), sent, plan.comm_bytes_per_rank[pp],
                      held, got.peak, plan.to_dict()["memory"]["peak_per_rank"][pp],
                      losses[name])
    every = [None] * 4
    dist.all_gather_object(every, rows)
    if rank == 0:
        print(f"dp=2 x pp=2, 1f1b, M = {args.micro}; GPT {args.layers} layers, d={args.embd}, "
              f"vocab {args.vocab}, {MESH['dp'] * args.batch} x {args.seq} tokens a step; "
              f"AdamW; medians of {args.steps} interleaved steps")
        print(f"{'variant':11} {'s/step':>8} {'vs whole':>8}  {'sent/step by pp rank (plan)':>36}"
              f"  {'params held':>11}  {'peak by pp rank (plan)':>34}  {'loss':>8}")
        base_s = statistics.median([every[r]['whole'][0] for r in range(4)])
        for name in VARIANTS:
            s = statistics.median([every[r][name][0] for r in range(4)])
            sent = ", ".join(f"{every[r][name][1] / 1e3:.0f} KB ({every[r][name][2] / 1e3:.0f})"
                             for r in (0, 1))
            peak = ", ".join(f"{every[r][name][4] / 1e6:.2f} MB "
                             f"({every[r][name][5] / 1e6:.2f})" for r in (0, 1))
            held = max(every[r][name][3] for r in range(4))
            print(f"{name:11} {s:8.3f} {s / base_s:8.2f}  {sent:>36}  {held / 1e6:8.2f} MB"
                  f"  {peak:>34}  {every[0][name][6]:8.4f}")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="sequences per dp rank")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_run, args=(args, port), nprocs=4)


if __name__ == "__main__":
    main()
