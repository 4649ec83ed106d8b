"""Pipeline parallelism two ways, side by side in one launch: diphoma_compile.parallelize
over a pp axis and torch.distributed.pipelining (the same model cut by hand at the same
layer boundaries, the same schedule), training the GPT of examples/gpt.py (embedding and
LM head untied: torch's PipelineStage cannot hold a weight on two stages) with AdamW on N
gloo ranks on the CPU.

    python benchmarks/pipeline.py [--steps 6] [--warmup 2] [--nproc 4] [--micro 4]
        [--schedule 1f1b|gpipe] [--embd 128 --vocab 1024 --seq 64 --batch 16]

One stage per rank, one layer per stage (n_layer = nproc). Rank 0 prints one row per
variant:
  s/step      median wall time of one step (a barrier before and after; after --warmup);
  bubble      diphoma: 1 - (seconds in its stage programs) / (step wall), the largest over
              ranks (the idle share: waiting for activations and gradients, plus the
              transfers); torch: not measured (its executor is not instrumented here);
  theory      (S - 1) / (M + S - 1), the bubble of equal stages;
  loss        the last step's loss (both variants start from the same weights and batches).
No asserts: the machine is noisy; read the ratios.
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
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt import GPT, GPTConfig, make_batch  # noqa: E402


def train_step(model, opt, idx, targets):
    """The single-device step both variants run (examples/gpt.py's, without clipping)."""
    logits, _ = model(idx)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


class _Stage(nn.Module):
    """One stage of the GPT for torch.distributed.pipelining, cut by hand."""

    def __init__(self, model: GPT, k: int, n: int) -> None:
        super().__init__()
        self.first, self.last = k == 0, k == n - 1
        if self.first:
            self.wte, self.wpe = model.wte, model.wpe
        self.block = model.h[k]
        if self.last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        x = self.block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def _model(args) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=args.seq, vocab_size=args.vocab, n_layer=args.nproc, n_head=4,
                    n_embd=args.embd)
    model = GPT(cfg)
    model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())   # untied
    return model


def _timed(fn, steps: int, warmup: int) -> tuple[float, float]:
    walls, loss = [], 0.0
    for k in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        loss = fn()
        dist.barrier()
        if k >= warmup:
            walls.append(time.perf_counter() - t0)
    return statistics.median(walls), loss


def _diphoma(rank: int, args, batches) -> dict:
    import diphoma_compile
    model = _model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = diphoma_compile.parallelize(train_step, {"pp": args.nproc},
                                       microbatches=args.micro, schedule=args.schedule)
    it = iter(batches * 100)

    def one() -> float:
        idx, tgt = next(it)
        return step(model, opt, idx, tgt).item()
    one()          # trace and build
    runner = step.runner
    runner.compute_s = runner.wall_s = 0.0
    s, loss = _timed(one, args.steps, args.warmup)
    share = 1 - runner.compute_s / max(runner.wall_s, 1e-12)
    worst = torch.tensor([share])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {"s": s, "bubble": worst.item(), "loss": loss}


def _torch(rank: int, args, batches) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    model = _model(args)
    stage_mod = _Stage(model, rank, args.nproc)
    opt = torch.optim.AdamW(stage_mod.parameters(), lr=1e-3)
    stage = PipelineStage(stage_mod, rank, args.nproc, torch.device("cpu"))

    def loss_fn(logits, tgt):
        return F.cross_entropy(logits.flatten(0, 1), tgt.flatten())
    kind = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
    sched = kind(stage, args.micro, loss_fn=loss_fn)
    it = iter(batches * 100)

    def one() -> float:
        idx, tgt = next(it)
        losses: list[torch.Tensor] = []
        if rank == 0:
            sched.step(idx)
        elif rank == args.nproc - 1:
            sched.step(target=tgt, losses=losses)
        else:
            sched.step()
        opt.step()
        opt.zero_grad()
        loss = torch.stack(losses).mean() if losses else torch.zeros(())
        dist.broadcast(loss, src=args.nproc - 1)
        return float(loss)
    one()          # as many steps as diphoma's variant, whose first call traces
    s, loss = _timed(one, args.steps, args.warmup)
    return {"s": s, "bubble": float("nan"), "loss": loss}


def _run(rank: int, args, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.nproc)
    cfg = GPTConfig(block_size=args.seq, vocab_size=args.vocab)
    batches = [make_batch(cfg, args.batch, seed) for seed in range(4)]
    rows = {"diphoma": _diphoma(rank, args, copy.deepcopy(batches)),
            "torch.distributed.pipelining": _torch(rank, args, batches)}
    if rank == 0:
        s_, m = args.nproc, args.micro
        theory = (s_ - 1) / (m + s_ - 1)
        print(f"{args.nproc} gloo ranks, schedule {args.schedule}, {m} microbatches, "
              f"batch {args.batch} x {args.seq}, d={args.embd}")
        print(f"{'variant':30} {'s/step':>8} {'bubble':>7} {'theory':>7} {'loss':>8}")
        for name, r in rows.items():
            print(f"{name:30} {r['s']:8.4f} {r['bubble']:7.1%} {theory:7.1%} {r['loss']:8.4f}")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_run, args=(args, port), nprocs=args.nproc)


if __name__ == "__main__":
    main()
