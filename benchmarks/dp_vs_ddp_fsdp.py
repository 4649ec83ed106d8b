"""Data parallelism three ways, side by side in one launch: PyTorch DDP, FSDP2
(fully_shard) and diphoma_compile.parallelize, training the same GPT (examples/gpt.py)
with AdamW on N gloo ranks on the CPU.

    python benchmarks/dp_vs_ddp_fsdp.py [--steps 10] [--warmup 3] [--nproc 4]
        [--layers 4 --embd 256 --vocab 8192 --seq 128 --batch 16]
        [--variants ddp,fsdp2,diphoma,diphoma-shard]
        [--buckets 1,5,25] [--profile]

The script spawns the ranks itself. Every variant starts from identical weights (same seed)
and sees the same batches; each rank trains on its own slice (global batch / N). Rank 0
prints one row per variant:
  s/step      median wall time of one step over the timed steps (after --warmup steps; a
              barrier before and after each step, the slowest rank's time);
  first s     the first call (for diphoma it includes tracing and compiling);
  opt MB      optimizer-state bytes held by one rank (the largest over ranks), 1 MB = 1e6 B:
              DDP/FSDP2 sum the tensors in opt.state (FSDP2: the local shards),
              diphoma reports pstep.memory_report().opt_state_bytes;
  param MB    parameter bytes held by one rank, counted the same way;
  vs DDP      the ratio to the DDP row (below 1 is better);
  peak MB     the peak resident memory a rank reaches in the steps after the first, above
              what it held before the model was built (the largest over ranks; every
              variant has imported torch's DDP and FSDP and diphoma_compile by then, so a
              diphoma figure includes what tracing and compiling leave, not the imports): the
              high-water mark is reset after step 1 (/proc/self/clear_refs) and freed
              tensors leave the resident set (MALLOC_MMAP_THRESHOLD_=65536 is set for the
              ranks). Variants run one after another in the same ranks: run one variant per
              launch (--variants ddp, ...) for figures that cannot see each other's leftovers;
  step MB     the same high-water mark above what the rank held between steps (after step 1):
              the step's own transient memory;
  plan MB     diphoma's planned transient per device, beside step MB: the plan's peak
              (pstep.plan.memory.peak: liveness over the per-rank program) less the
              parameters and optimizer state the step holds throughout;
  loss        the last step's loss, averaged over ranks (variants should agree closely).
Variants: ddp, fsdp2, diphoma (the default pipeline: data parallelism, weight-update
sharding, comm-fusion with a bucket a quarter of the gradient bytes, schedule-comm),
diphoma-shard (the same with parallelize(shard_params=True): parameters held as shards too,
to set beside fsdp2),
diphoma-unfused (one collective per tensor, synchronous), diphoma-fx and diphoma-inductor
(the default pipeline with that code generator; plain diphoma lets parallelize choose:
Inductor for a step of 1e10 flops or more, which this GPT's is), and diphoma-bX for each X in
--buckets (fusion with X MB buckets: the sweep). --profile adds, per diphoma variant, the
time in computation and communication and the part of communication hidden (after the
timed steps; it runs 2 x --steps more steps).
The goal for diphoma: DDP's s/step or better with FSDP2's 1/N optimizer memory.
No asserts: the machine is noisy; read the ratios.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import socket
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt import GPT, GPTConfig, make_batch, train_step  # noqa: E402

# every variant's ranks load the same libraries before the baseline of the memory figures,
# so that peak MB compares what each variant's step makes, not which packages it imported
import diphoma_compile  # noqa: E402,F401
from diphoma_compile.torch.live_memory import measure_peak  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402,F401
from torch.nn.parallel import DistributedDataParallel  # noqa: E402,F401

VARIANTS = ("ddp", "fsdp2", "diphoma", "diphoma-shard", "diphoma-unfused", "diphoma-fx",
            "diphoma-inductor")
BASE = "dce,data-parallel,weight-update-sharding,dce"


def _passes(variant: str) -> str | None:
    """The pass pipeline of a diphoma variant (None: parallelize's default)."""
    if variant == "diphoma-unfused":
        return BASE
    if variant.startswith("diphoma-b"):
        return BASE + f",comm-fusion{{bucket-mb={variant[len('diphoma-b'):]}}},schedule-comm"
    return None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # DTensor -> this rank's shard


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(_local(v).nbytes for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(_local(p).nbytes for p in model.parameters())  # parameters() skips tied copies


def _rss() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _high_water() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_high_water() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:    # not Linux, or not allowed: the peak then covers the whole run
        pass


def _build(variant: str, cfg: GPTConfig, world: int, lr: float):
    """(step callable, model, optimizer, memory function) for one variant."""
    torch.manual_seed(0)
    model = GPT(cfg)
    if variant == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model)
    elif variant == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        for block in model.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    if not variant.startswith("diphoma"):
        return train_step, model, opt, lambda: (_state_bytes(opt), _param_bytes(model))
    codegen = {"diphoma-fx": "fx", "diphoma-inductor": "inductor"}.get(variant)
    pstep = diphoma_compile.parallelize(train_step, diphoma_compile.Mesh({"dp": world}),
                                        passes=_passes(variant),
                                        shard_params=variant == "diphoma-shard",
                                        codegen=codegen)

    def memory() -> tuple[int, int]:
        rep = pstep.memory_report()
        return int(rep.opt_state_bytes), int(rep.param_bytes)
    return pstep, model, opt, memory


def _run(variant: str, a: argparse.Namespace, cfg: GPTConfig, batches: list) -> dict:
    world = dist.get_world_size()
    gc.collect()
    before = _rss()
    step, model, opt, memory = _build(variant, cfg, world, a.lr)
    times, loss = [], None
    for i, (idx, targets) in enumerate(batches):
        dist.barrier()
        t0 = time.perf_counter()
        loss = step(model, opt, idx, targets)
        dist.barrier()
        times.append(time.perf_counter() - t0)
        if i == 0:
            gc.collect()
            _reset_high_water()
            between = _rss()          # what a rank holds between steps
    peak = _high_water() - before
    transient = _high_water() - between
    # one more step with every tensor storage counted from its making to its freeing
    idx, targets = batches[-1]
    if hasattr(step, "measure_memory"):
        live = step.measure_memory(model, opt, idx, targets)
    else:
        held = [p for p in model.parameters()] + [p.grad for p in model.parameters()
                                                  if p.grad is not None]
        held += [st for st in opt.state.values()] + [idx, targets]
        live = measure_peak(lambda: step(model, opt, idx, targets), held)
    # the slowest rank's time per step, and the loss averaged over ranks
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    lv = torch.tensor([float(loss.detach())], dtype=torch.float64)
    dist.all_reduce(lv)
    opt_b, par_b = memory()
    planned = 0
    if hasattr(step, "plan"):       # the plan's peak above what the step holds (its inputs)
        m = step.plan.memory
        planned = m.peak - m.params - m.opt_state
    mem = torch.tensor([opt_b, par_b, peak, transient, planned, live.peak, live.transient,
                        step.plan.memory.peak if hasattr(step, "plan") else 0],
                       dtype=torch.int64)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    out = {"median": statistics.median(t[a.warmup:].tolist()), "first": t[0].item(),
           "opt": mem[0].item(), "param": mem[1].item(), "peak": mem[2].item(),
           "transient": mem[3].item(), "plan": mem[4].item(), "tensors": mem[5].item(),
           "tensors_step": mem[6].item(), "plan_peak": mem[7].item(),
           "loss": lv.item() / world}
    if a.profile and variant.startswith("diphoma") and step.runner.codegen != "inductor":
        out["profile"] = str(step.profile(model, opt, *batches[-1], steps=a.steps))
    return out


def _worker(rank: int, world: int, a: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=a.timeout))
    cfg = GPTConfig(vocab_size=a.vocab, block_size=a.seq, n_layer=a.layers,
                    n_head=a.heads, n_embd=a.embd)
    local = a.batch // world
    # batch of step i on rank r: seed i * world + r, the same for every variant
    batches = [make_batch(cfg, local, seed=i * world + rank) for i in range(a.warmup + a.steps)]
    results: dict[str, dict | str] = {}
    for v in a.variants:
        try:
            res: dict | str = _run(v, a, cfg, batches)
        except Exception as e:  # noqa: BLE001 - a failing variant must not hide the others
            if rank == 0 and a.verbose:
                traceback.print_exc()
            res = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        # agree on success: if any rank failed, report the first failure
        every: list = [None] * world
        dist.all_gather_object(every, res)
        errors = [r for r in every if isinstance(r, str)]
        results[v] = errors[0] if errors else res
        gc.collect()
        dist.barrier()
    if rank == 0:
        _report(a, cfg, results)
    dist.destroy_process_group()


def _report(a: argparse.Namespace, cfg: GPTConfig, results: dict) -> None:
    n = sum(p.numel() for p in GPT(cfg).parameters())
    print(f"GPT {a.layers} layers, d={a.embd}, vocab {a.vocab}, seq {a.seq}, {n / 1e6:.2f}M "
          f"params; AdamW; global batch {a.batch} on {a.nproc} gloo ranks "
          f"({a.batch // a.nproc} each); {a.warmup} warmup + {a.steps} timed steps")
    base = results.get("ddp") if isinstance(results.get("ddp"), dict) else None

    def ratio(r: dict, key: str) -> str:
        return f"{r[key] / base[key]:.2f}x" if base and base[key] else "-"
    print(f"{'variant':<16} {'s/step':>8} {'vs DDP':>7} {'first s':>8} {'opt MB':>8} "
          f"{'vs DDP':>7} {'param MB':>9} {'vs DDP':>7} {'peak MB':>8} {'vs DDP':>7} "
          f"{'step MB':>8} {'vs DDP':>7} {'plan MB':>8} {'loss':>10}")
    for v, r in results.items():
        if isinstance(r, str):
            print(f"{v}: unavailable ({r})")
            continue
        plan = f"{r['plan'] / 1e6:>8.2f}" if r["plan"] else f"{'-':>8}"
        print(f"{v:<16} {r['median']:>8.3f} {ratio(r, 'median'):>7} {r['first']:>8.2f} "
              f"{r['opt'] / 1e6:>8.2f} {ratio(r, 'opt'):>7} {r['param'] / 1e6:>9.2f} "
              f"{ratio(r, 'param'):>7} {r['peak'] / 1e6:>8.2f} {ratio(r, 'peak'):>7} "
              f"{r['transient'] / 1e6:>8.2f} {ratio(r, 'transient'):>7} "
              f"{plan} {r['loss']:>10.5f}")
    print("tensor memory, measured (every storage counted from its making to its freeing, "
          "one more step; the largest over ranks):")
    print(f"{'variant':<16} {'peak MB':>8} {'vs DDP':>7} {'step MB':>8} {'vs DDP':>7} "
          f"{'plan peak MB':>13} {'measured/plan':>14}")
    for v, r in results.items():
        if not isinstance(r, dict):
            continue
        plan = (f"{r['plan_peak'] / 1e6:>13.2f} {r['tensors'] / r['plan_peak']:>14.3f}"
                if r["plan_peak"] else f"{'-':>13} {'-':>14}")
        print(f"{v:<16} {r['tensors'] / 1e6:>8.2f} {ratio(r, 'tensors'):>7} "
              f"{r['tensors_step'] / 1e6:>8.2f} {ratio(r, 'tensors_step'):>7} {plan}")
    _criteria(results, a.nproc)
    for v, r in results.items():
        if isinstance(r, dict) and "profile" in r:
            print(f"{v} profile (rank 0): {r['profile']}")
    losses = [r["loss"] for r in results.values() if isinstance(r, dict)]
    if len(losses) > 1:
        print(f"largest difference of final losses: {max(losses) - min(losses):.2e}")


def _criteria(results: dict, world: int) -> None:
    """Issue 15's targets, from the figures above: the default plan's peak at most DDP's
    less the optimizer state it stops holding ((N-1)/N of it), shard_params' peak at most
    1.05x FSDP2's and its step time within 1.1x."""
    ok = {k: v for k, v in results.items() if isinstance(v, dict)}
    ddp, dflt = ok.get("ddp"), ok.get("diphoma") or ok.get("diphoma-fx")
    if ddp and dflt:
        saved = ddp["opt"] * (world - 1) / world
        for key, what in (("tensors", "tensor"), ("peak", "resident")):
            bound = ddp[key] - saved
            print(f"default plan {what} peak {dflt[key] / 1e6:.1f} MB vs DDP's less "
                  f"{(world - 1)}/{world} of its optimizer state {bound / 1e6:.1f} MB: "
                  f"{'met' if dflt[key] <= bound else 'NOT met'}")
    fsdp, shard = ok.get("fsdp2"), ok.get("diphoma-shard")
    if fsdp and shard:
        for key, what in (("tensors", "tensor peak"), ("peak", "resident peak"),
                          ("median", "s/step")):
            limit = 1.1 if key == "median" else 1.05
            r = shard[key] / fsdp[key] if fsdp[key] else float("nan")
            print(f"shard_params {what} / FSDP2's: {r:.3f} (target <= {limit}): "
                  f"{'met' if r <= limit else 'NOT met'}")


def _is_bucket(v: str) -> bool:
    try:
        return v.startswith("diphoma-b") and float(v[len("diphoma-b"):]) > 0
    except ValueError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (>= 1)")
    p.add_argument("--nproc", type=int, default=4, help="gloo ranks")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embd", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16, help="global batch, split over ranks")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--variants", default="ddp,fsdp2,diphoma,diphoma-shard")
    p.add_argument("--buckets", default="", help="bucket sizes (MB) to sweep, e.g. 1,5,25")
    p.add_argument("--profile", action="store_true",
                   help="profile each diphoma variant (compute / communication / hidden)")
    p.add_argument("--timeout", type=int, default=300, help="seconds a collective may wait")
    p.add_argument("--verbose", action="store_true", help="print a failing variant's traceback")
    a = p.parse_args()
    a.variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    a.variants += [f"diphoma-b{b.strip()}" for b in a.buckets.split(",") if b.strip()]
    bad = [v for v in a.variants if v not in VARIANTS and not _is_bucket(v)]
    if bad or a.batch % a.nproc or a.warmup < 1 or a.steps < 1:
        p.error(f"variants from {VARIANTS}; --batch divisible by --nproc; warmup, steps >= 1"
                + (f" (unknown: {bad})" if bad else ""))
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")   # freed tensors leave the RSS
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    mp.spawn(_worker, args=(a.nproc, a), nprocs=a.nproc, join=True)


if __name__ == "__main__":
    main()
