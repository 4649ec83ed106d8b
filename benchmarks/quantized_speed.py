"""Step time of PyTorch DDP, plain weight-update sharding (parallelize's default) and
SDP4Bit's quantized collectives (parallelize(compression="sdp4bit")) on N gloo ranks,
interleaved in one launch: each round runs one step of every variant, so the machine's
load drifts over all of them alike.

    python benchmarks/quantized_speed.py [--steps 10] [--nproc 4] [--layers 2 --embd 256 ...]
        [--shape 1gbit] [--profile 5]

Without --shape the ranks talk over the bare loopback. With --shape RATE (root only) the
script makes a private network namespace, shapes its loopback with
``tc qdisc add dev lo root tbf rate RATE burst 1mb latency 200ms``, runs itself inside it
and deletes it afterwards, so the link is RATE shared by all ranks.

Rank 0 prints per variant: the median seconds per step over --steps rounds (after one
warm-up round; a barrier before each step), the ratio to DDP, the planned bytes per step
per device (DDP: the all-reduce's 2(N-1)/N of the gradient bytes), and the last loss.
With --profile K, each rank then runs ``ParallelStep.profile`` on the parallelize
variants (K steps with every collective waited for at once, K as scheduled) and rank 0
prints every rank's computation, communication and exposed communication.
No asserts: the machine is noisy; read the ratios.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt import GPT, GPTConfig, make_batch, train_step  # noqa: E402

import diphoma_compile  # noqa: E402

VARIANTS = ("ddp", "wus", "sdp4bit")
_INNER = "DIPHOMA_QSPEED_INNER"


def _make(variant: str, cfg: GPTConfig, world: int, lr: float):
    torch.manual_seed(0)
    model = GPT(cfg)
    if variant == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=lr)
        n = sum(p.numel() * p.element_size() for p in model.parameters())
        return (lambda idx, tgt: train_step(ddp, opt, idx, tgt)), int(2 * (world - 1) / world * n)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    step = diphoma_compile.parallelize(train_step, diphoma_compile.Mesh({"dp": world}),
                                       compression="sdp4bit" if variant == "sdp4bit" else None)
    fn = lambda idx, tgt: step(model, opt, idx, tgt)  # noqa: E731
    fn.profile = lambda idx, tgt, steps: step.profile(model, opt, idx, tgt, steps=steps)
    return fn, step


def _worker(rank: int, world: int, a: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=a.timeout))
    cfg = GPTConfig(vocab_size=a.vocab, block_size=a.seq, n_layer=a.layers, n_head=a.heads,
                    n_embd=a.embd)
    local = a.batch // world
    runs = {v: _make(v, cfg, world, a.lr) for v in a.variants}
    times: dict[str, list[float]] = {v: [] for v in a.variants}
    last: dict[str, float] = {}
    for i in range(a.steps + 1):
        idx, tgt = make_batch(cfg, local, seed=i * world + rank)
        for v, (fn, _) in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            last[v] = float(fn(idx, tgt))
            if i:                      # the first round traces and warms up
                times[v].append(time.perf_counter() - t0)
    profiles: dict[str, dict] = {}
    if a.profile:       # computation vs communication of the parallelize variants
        idx, tgt = make_batch(cfg, local, seed=rank)
        for v, (fn, _) in runs.items():
            if hasattr(fn, "profile"):
                r = runs[v][1].runner
                comms = [*r.comms.values(), *getattr(r, "level_comms", {}).values()]
                c0 = sum(sum(c.calls.values()) for c in comms)
                profiles[v] = fn.profile(idx, tgt, a.profile).to_dict()
                calls = sum(sum(c.calls.values()) for c in comms) - c0
                profiles[v]["calls"] = calls / (2 * a.profile)
    # the slowest rank's median
    med = {v: sorted(t)[len(t) // 2] for v, t in times.items()}
    every: list = [None] * world
    dist.all_gather_object(every, med)
    if rank == 0:
        med = {v: max(m[v] for m in every) for v in a.variants}
        n = sum(p.numel() for p in GPT(cfg).parameters())
        link = os.environ.get(_INNER) or "bare loopback"
        print(f"GPT {a.layers} layers x {a.embd}, {n / 1e6:.2f}M parameters, vocab {a.vocab}, "
              f"seq {a.seq}, global batch {a.batch}, {world} gloo ranks on {link}, "
              f"median of {a.steps} interleaved steps")
        print(f"{'variant':<9} {'s/step':>8} {'vs ddp':>7} {'bytes/step':>11} {'loss':>8}")
        for v in a.variants:
            plan = runs[v][1]
            b = plan if isinstance(plan, int) else plan.plan.comm_bytes_per_step
            ratio = f"{med[v] / med['ddp']:.2f}" if "ddp" in med else ""
            print(f"{v:<9} {med[v]:8.3f} {ratio:>7} {b:11d} {last[v]:8.4f}")
    every_p: list = [None] * world
    dist.all_gather_object(every_p, profiles)
    if rank == 0 and profiles:
        print(f"profile (step.profile, {a.profile} steps; per rank, ms): collectives waited "
              "at once give communication, the rest computation")
        print(f"{'variant':<9} {'rank':>4} {'step':>8} {'compute':>8} {'comm':>8} "
              f"{'exposed':>8} {'collectives/step':>17}")
        for v in profiles:
            for r, prof in enumerate(every_p):
                q = prof[v]
                print(f"{v:<9} {r:>4} {q['step_s'] * 1e3:8.1f} {q['compute_s'] * 1e3:8.1f} "
                      f"{q['comm_s'] * 1e3:8.1f} {q['exposed_comm_s'] * 1e3:8.1f} "
                      f"{q['calls']:17.0f}")
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shaped(rate: str, argv: list[str]) -> int:
    """Run this script again inside a namespace whose loopback is shaped to ``rate``."""
    if os.geteuid() != 0:
        print("--shape needs root (ip netns, tc)", file=sys.stderr)
        return 2
    ns = f"dqspeed{os.getpid()}"
    run = ["ip", "netns", "exec", ns]
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(run + ["ip", "link", "set", "lo", "up"], check=True)
        subprocess.run(run + ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate,
                              "burst", "1mb", "latency", "200ms"], check=True)
        env = dict(os.environ, **{_INNER: f"a loopback shaped to {rate} (tc tbf)"})
        return subprocess.run(run + [sys.executable, os.path.abspath(__file__)] + argv,
                              env=env).returncode
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--embd", type=int, default=256)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="global batch (divides --nproc)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--shape", default=None, help="e.g. 1gbit: a shaped loopback (root)")
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--profile", type=int, default=0,
                   help="then profile the parallelize variants over this many steps")
    a = p.parse_args()
    if a.shape and not os.environ.get(_INNER):
        argv = [x for k, x in enumerate(sys.argv[1:])
                if x != "--shape" and (k == 0 or sys.argv[k] != "--shape")
                and not x.startswith("--shape=")]
        sys.exit(_shaped(a.shape, argv))
    a.variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in a.variants if v not in VARIANTS]
    if bad or a.batch % a.nproc or a.steps < 1:
        p.error(f"variants from {VARIANTS}; --batch divisible by --nproc; --steps >= 1")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    mp.spawn(_worker, args=(a.nproc, a), nprocs=a.nproc, join=True)


if __name__ == "__main__":
    main()
