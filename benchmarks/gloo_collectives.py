"""The collectives of data parallelism on gloo, timed side by side in one launch of N CPU
ranks: torch's all_reduce, reduce_scatter and all_gather, and the reduce-scatter the torch
runtime runs on gloo (``collectives.reduce_scatter``: an all_to_all of the rows and a local
sum, since gloo's own reduce-scatter all-reduces the whole input).

    python benchmarks/gloo_collectives.py [--nproc 4] [--mb 0.5,2.8,9.6,20] [--reps 12]

Rank 0 prints, per buffer size (the whole float32 buffer a reduce-scatter reduces, or an
all-gather produces), the median over --reps calls (after 2 warmup calls; a barrier before
each, the slowest rank's time) of:
  all_reduce       dist.all_reduce of the whole buffer;
  reduce_scatter   dist.reduce_scatter_tensor (gloo: an all-reduce of a copy, then a chunk);
  diphoma rs       collectives.reduce_scatter, as a generated program calls it;
  all_gather       dist.all_gather_into_tensor of a chunk into the whole buffer;
and checks that torch's and diphoma's reduce-scatter agree (float32 rounding: the two sum
the ranks' rows in other orders). No asserts: the machine is noisy; read the ratios."""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from diphoma_compile.torch import collectives  # noqa: E402


def _time(fn, reps: int) -> float:
    """The median, over reps calls after 2 warmups, of the slowest rank's seconds."""
    times = []
    for k in range(reps + 2):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dt = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if k >= 2:
            times.append(float(dt))
    return statistics.median(times)


def _worker(rank: int, world: int, a: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    comm = collectives.Comm("dp", world, rank)
    g = torch.Generator().manual_seed(rank)
    rows = []
    for mb in a.mb:
        k = max(1, int(mb * 1e6 / 4) // world)
        x = torch.randn(world * k, generator=g)
        chunk = x[:k].clone()

        def all_reduce(x=x):
            dist.all_reduce(x.clone())

        def reduce_scatter(x=x, k=k):
            out = torch.empty(k)
            dist.reduce_scatter_tensor(out, x)
            return out

        def ours(x=x, k=k):
            return collectives.reduce_scatter(comm, x, "sum", 0, [k])

        def all_gather(chunk=chunk, k=k):
            dist.all_gather_into_tensor(torch.empty(world * k), chunk)
        times = {name: _time(fn, a.reps) for name, fn in
                 (("all_reduce", all_reduce), ("reduce_scatter", reduce_scatter),
                  ("diphoma rs", ours), ("all_gather", all_gather))}
        diff = float((reduce_scatter() - ours()).abs().max())
        rows.append((world * k * 4 / 1e6, times, diff))
    if rank == 0:
        print(f"{world} gloo ranks, one thread each; median ms per call (slowest rank)")
        print(f"{'MB':>8}{'all_reduce':>12}{'reduce_scatter':>16}{'diphoma rs':>12}"
              f"{'all_gather':>12}{'rs / ours':>11}{'max diff':>10}")
        for mb, t, diff in rows:
            print(f"{mb:>8.2f}{t['all_reduce'] * 1e3:>12.1f}{t['reduce_scatter'] * 1e3:>16.1f}"
                  f"{t['diphoma rs'] * 1e3:>12.1f}{t['all_gather'] * 1e3:>12.1f}"
                  f"{t['reduce_scatter'] / t['diphoma rs']:>11.2f}{diff:>10.1e}")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--mb", default="0.5,2.8,9.6,20",
                   help="buffer sizes in MB (comma-separated)")
    p.add_argument("--reps", type=int, default=12)
    a = p.parse_args()
    a.mb = [float(v) for v in a.mb.split(",") if v.strip()]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(a.nproc, a, port), nprocs=a.nproc)


if __name__ == "__main__":
    main()
