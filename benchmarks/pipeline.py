"""Pipeline parallelism two ways, side by side in one launch: diphoma_compile.parallelize
over a pp axis and torch.distributed.pipelining (the same model cut by hand at the same
layer boundaries, the same schedule), training the GPT of examples/gpt.py (embedding and
LM head untied: torch's PipelineStage cannot hold a weight on two stages) with AdamW on N
gloo ranks on the CPU.

    python benchmarks/pipeline.py [--steps 6] [--warmup 2] [--nproc 4] [--micro 4]
        [--schedule 1f1b|gpipe|interleaved|interleaved-zb|zbv|looped-bfs|dualpipev] [--layers N]
        [--embd 128 --vocab 1024 --seq 64 --batch 16] [--no-torch]
        [--frozen K] [--balance time|forward-flops|both] [--pin]
        [--device-model cpu-gloo|measured-cpu-gloo]

--frozen K freezes the embeddings and the first K blocks (fine-tuning the rest: their
backward computes no weight gradients, and none at all below the first trainable block).
--balance picks what diphoma's stages are balanced on (the pipeline pass's balance option,
on the --device-model: cpu-gloo, or measured-cpu-gloo, measured on the ranks at the
start): each op's seconds with its backward and update (time, the default) or the
forward's flops alone; both runs the two side by side, one row each.

One layer per stage by default (n_layer = the stages: nproc, twice that for the schedules
with two stages per rank). Rank 0 prints one row per variant:
  s/step      median wall time of one step (a barrier before and after; after --warmup);
  bubble      diphoma: 1 - (seconds in its stage programs) / (step wall), the largest over
              ranks (the idle share: waiting for activations and gradients, plus the
              transfers and the update); torch: not measured (its executor is not
              instrumented here; it runs only 1f1b and gpipe);
  theory      the schedule's bubble with equal stages ((P - 1) / (v M + P - 1), the plan's);
  loss        the last step's loss (both variants start from the same weights and batches).
Then the peak tensor memory each rank reaches in one more step (every storage counted from
its making to its freeing; for diphoma beside the plan's peak for that rank). Then the
plan's own estimate of the step (a device model's roofline, each rank's programs laid out
in the schedule's order, transfers on the model's link) and the bubble's share of it,
beside the measured ones, on two models: cpu-gloo (fixed figures) and the one the ranks
measured at the start (torch/calibrate.py: a matrix product's rate, a copy's bandwidth,
a send's latency and bandwidth between ranks 0 and 1).
Then, for diphoma, the bubble of the forward/backward part alone, from the executor's
record of when each program ran on each rank (time.perf_counter, one clock for every
process of the machine), per timed step: 1 - (a rank's seconds in forward/backward programs)
/ (first forward start to last backward end over all ranks), the largest over ranks (the
median over steps, and the best step); beside it the same schedule laid out in time
(report/schedule.py): each step replayed with that step's own program durations and
transfers taking no time (measured / replayed: what the runtime adds, transfers and
dispatch; the step span over the replay's), with each program's mean duration (what the
schedule costs with these stages, uneven or not), and with equal stages (the theory). Where
replayed and mean differ, the programs' durations varied from one run to the next (on a
shared machine, the other ranks' work and the host's); where mean and equal differ, the
stages are uneven. No asserts: the machine is noisy; read the ratios.
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
    cfg = GPTConfig(block_size=args.seq, vocab_size=args.vocab, n_layer=args.layers,
                    n_head=4, n_embd=args.embd)
    model = GPT(cfg)
    model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())   # untied
    if args.frozen:
        for m in [model.wte, model.wpe, *model.h[:args.frozen]]:
            m.requires_grad_(False)
    return model


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


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


def _diphoma(rank: int, args, batches, balance: str) -> dict:
    import diphoma_compile
    model = _model(args)
    opt = torch.optim.AdamW(_trainable(model), lr=1e-3)
    spec = (f"dce,pipeline{{axis=pp, microbatches={args.micro}, schedule={args.schedule}, "
            f"balance={balance}, device-model={args.device_model}}}")
    step = diphoma_compile.parallelize(train_step, {"pp": args.nproc}, passes=spec)
    it = iter(batches * 100)

    def one() -> float:
        idx, tgt = next(it)
        return step(model, opt, idx, tgt).item()
    one()          # trace and build
    runner = step.runner
    runner.compute_s = runner.wall_s = 0.0
    records: list[list] = []

    def recorded() -> float:
        loss = one()
        records.append([b for b in runner.busy if b[0] != "U"])
        return loss
    s, loss = _timed(recorded, args.steps, args.warmup)
    share = 1 - runner.compute_s / max(runner.wall_s, 1e-12)
    worst = torch.tensor([share])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    every: list = [None] * args.nproc
    dist.all_gather_object(every, records[args.warmup:])
    rec = step.plan.notes["pipeline"]
    # one more step under measure_memory: the tensor memory each rank reaches, beside the
    # plan's peak for its rank
    idx, tgt = next(it)
    got = step.measure_memory(model, opt, idx, tgt)
    peaks: list = [None] * args.nproc
    dist.all_gather_object(peaks, (got.peak, step.plan.memory.peak_per_rank[rank]))
    return {"s": s, "bubble": worst.item(), "loss": loss, "theory": rec["bubble"],
            "records": every, "stages": len(rec["stages"]), "planned": _planned(step),
            "layers": _layer_span(rec),
            "balanced": [st["balanced"] for st in rec["stages"]],
            "peaks": peaks}


def _layer_span(rec: dict) -> str:
    """Each stage's blocks (h.0-h.3), and e/h for the embeddings and the head."""
    out = []
    for st in rec["stages"]:
        blocks = sorted({int(n.split(".")[1]) for n in st["layers"] if n.startswith("h.")})
        span = f"h.{blocks[0]}-{blocks[-1]}" if blocks else "-"
        extra = ("e+" if any(n in ("wte", "wpe") for n in st["layers"]) else "") + span + \
            ("+head" if any(n in ("ln_f", "lm_head") for n in st["layers"]) else "")
        out.append(extra)
    return " | ".join(out)


def _planned(step) -> dict:
    """The plan's step-time estimate of this pipeline (report/pipeline_time.py) on the
    cpu-gloo device model and on the one measured on these ranks at the start
    (torch/calibrate.py): seconds, and the bubble's share of them, by model name."""
    from diphoma_compile.ir.device_model import device_model
    from diphoma_compile.passes.pipeline_parallel import pipeline_of
    from diphoma_compile.report.pipeline_time import pipeline_compute
    out = {}
    for name in ("cpu-gloo", "measured-cpu-gloo"):
        c = pipeline_compute(step.graph, pipeline_of(step.graph), device_model(name))
        out[name] = {"s": c.total_s, "bubble": c.bubble_s / c.total_s if c.total_s else 0.0}
    return out


def _measured_bubble(every: list, stages: int, schedule: str, micro: int, ranks: int
                     ) -> dict[str, float]:
    """The forward/backward part's idle share, the largest over ranks, median over steps:
    measured; its best step; each step replayed (the schedule laid out with that step's own
    program durations, transfers taking no time); laid out with the mean durations; laid
    out with equal stages. And the median over steps of measured span / replayed span
    (what the runtime adds: transfers, dispatch, waiting on a shared core)."""
    from diphoma_compile.passes.pipeline_timeline import bubble, timeline
    from diphoma_compile.torch.pipeline_schedule import schedule_actions
    steps = len(every[0])
    acts = schedule_actions(schedule, stages, micro, ranks)
    measured, replayed, stretch = [], [], []
    dur: dict[tuple[str, int], list[float]] = {}
    for k in range(steps):
        blocks = [b for r in range(ranks) for b in every[r][k]]
        t0 = min(b[3] for b in blocks)
        t1 = max(b[4] for b in blocks)
        busy = [sum(b[4] - b[3] for b in every[r][k]) for r in range(ranks)]
        measured.append(1 - min(busy) / (t1 - t0))
        own = {(kind, mb, st): b - a for kind, mb, st, a, b in blocks}
        replay = timeline(acts, [0.0] * stages, [0.0] * stages, durations=own)
        replayed.append(bubble(replay))
        stretch.append((t1 - t0) / (max(b.end for b in replay) - min(b.start for b in replay)))
        for kind, _, st, a, b in blocks:
            dur.setdefault((kind, st), []).append(b - a)
    mean = {k: statistics.mean(v) for k, v in dur.items()}
    fwd = [mean[("F", s)] for s in range(stages)]
    if any(k == "I" for k, _, _ in acts[0]):
        bwd = [mean[("I", s)] + mean[("W", s)] for s in range(stages)]
        share = [mean[("I", s)] / bwd[s] for s in range(stages)]
    else:
        bwd = [mean[("B", s)] for s in range(stages)]
        share = [0.5] * stages
    return {"measured": statistics.median(measured), "best": min(measured),
            "replayed": statistics.median(replayed),
            "ratio": statistics.median(m / r for m, r in zip(measured, replayed)),
            "stretch": statistics.median(stretch),
            "laid": bubble(timeline(acts, fwd, bwd, share)),
            "stage_s": [f + b for f, b in zip(fwd, bwd)],
            "equal": bubble(timeline(acts, [1.0] * stages, [2.0] * stages))}


def _torch(rank: int, args, batches) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    model = _model(args)
    stage_mod = _Stage(model, rank, args.nproc)
    opt = torch.optim.AdamW(_trainable(stage_mod), lr=1e-3)
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
    from diphoma_compile.torch.live_memory import measure_peak
    held = list(stage_mod.parameters()) + [t for st in opt.state.values() for t in st.values()]
    got = measure_peak(one, held + [t for b in batches for t in b])
    peaks: list = [None] * args.nproc
    dist.all_gather_object(peaks, (got.peak, None))
    return {"s": s, "bubble": float("nan"), "loss": loss, "peaks": peaks}


def _run(rank: int, args, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if args.pin:        # rank r on core r (mod the cores): no migrations between cores
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    dist.init_process_group("gloo", rank=rank, world_size=args.nproc)
    from diphoma_compile.torch.calibrate import measure_device
    measured = measure_device("cpu")     # every rank at once: the slowest's figures
    cfg = GPTConfig(block_size=args.seq, vocab_size=args.vocab)
    batches = [make_batch(cfg, args.batch, seed) for seed in range(4)]
    modes = ("time", "forward-flops") if args.balance == "both" else (args.balance,)
    rows = {f"diphoma balance={b}": _diphoma(rank, args, copy.deepcopy(batches), b)
            for b in modes}
    if args.schedule in ("1f1b", "gpipe") and args.layers == args.nproc and not args.no_torch:
        rows["torch.distributed.pipelining"] = _torch(rank, args, batches)
    if rank == 0:
        m = args.micro
        ours = rows[f"diphoma balance={modes[0]}"]
        print(f"{args.nproc} gloo ranks, schedule {args.schedule}, {ours['stages']} stages, "
              f"{m} microbatches, batch {args.batch} x {args.seq}, d={args.embd}, "
              f"{args.layers} layers" + (f", the first {args.frozen} frozen"
                                         if args.frozen else ""))
        print(f"{'variant':30} {'s/step':>8} {'bubble':>7} {'theory':>7} {'loss':>8}")
        for name, r in rows.items():
            print(f"{name:30} {r['s']:8.4f} {r['bubble']:7.1%} {ours['theory']:7.1%} "
                  f"{r['loss']:8.4f}")
        print("peak tensor memory per rank, MB (measure_memory: every storage from its "
              "making to its freeing; diphoma's planned in brackets):")
        for name, r in rows.items():
            cells = [f"{m / 1e6:.2f}" + (f" [{p / 1e6:.2f}]" if p is not None else "")
                     for m, p in r["peaks"]]
            print(f"  {name:30} " + "  ".join(cells))
        if args.dump:
            torch.save(ours["records"], args.dump)
        print(f"measured device model: {measured.flops_per_s / 1e9:.1f} GFLOP/s (a 512 x 512 "
              f"product), {measured.mem_bytes_per_s / 1e9:.1f} GB/s (a copy), link "
              f"{measured.link.bytes_per_s / 1e9:.2f} GB/s and "
              f"{measured.link.latency_s * 1e6:.0f} us (ranks 0 and 1)")
        for b in modes:
            _report(rows[f"diphoma balance={b}"], f"balance={b}", args)
    dist.destroy_process_group()


def _report(ours: dict, name: str, args) -> None:
    print(f"{name}: stages {ours['layers']}")
    for model, plan in ours["planned"].items():
        print(f"  the plan's estimate ({model} device model, report/pipeline_time.py): "
              f"{plan['s']:.4f} s/step ({plan['s'] / ours['s']:.2f}x measured), bubble "
              f"{plan['bubble']:.1%} of it on the rank finishing last (measured: "
              f"{ours['s']:.4f} s/step, bubble {ours['bubble']:.1%})")
    b = _measured_bubble(ours["records"], ours["stages"], args.schedule, args.micro,
                         args.nproc)
    print("  each stage's mean forward + backward run, ms: "
          + ", ".join(f"{1e3 * t:.1f}" for t in b["stage_s"])
          + f" (longest / mean {max(b['stage_s']) / statistics.mean(b['stage_s']):.2f}); "
          "what the pass balanced, as shares of the mean: "
          + ", ".join(f"{t / statistics.mean(ours['balanced']):.2f}" for t in ours["balanced"]))
    print(f"  forward/backward bubble: measured {b['measured']:.1%} (best step "
          f"{b['best']:.1%}); each step replayed with its own durations "
          f"{b['replayed']:.1%} (measured / replayed {b['ratio']:.2f}, step span "
          f"{b['stretch']:.2f}x the replay's); laid out with the mean durations "
          f"{b['laid']:.1%}, with equal stages (theory) {b['equal']:.1%}; "
          f"measured / equal {b['measured'] / b['equal'] if b['equal'] else float('nan'):.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--schedule", default="1f1b",
                   choices=("1f1b", "gpipe", "interleaved", "interleaved-zb", "zbv",
                            "looped-bfs", "dualpipev"))
    p.add_argument("--layers", type=int, default=None,
                   help="layers of the GPT (default: one per stage)")
    p.add_argument("--dump", metavar="FILE",
                   help="save diphoma's per-rank records of its programs' runs (torch.save)")
    p.add_argument("--no-torch", action="store_true",
                   help="skip the torch.distributed.pipelining variant")
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--frozen", type=int, default=0, metavar="K",
                   help="freeze the embeddings and the first K blocks")
    p.add_argument("--pin", action="store_true",
                   help="pin rank r to core r (os.sched_setaffinity)")
    p.add_argument("--device-model", default="cpu-gloo",
                   choices=("cpu-gloo", "measured-cpu-gloo"),
                   help="the device model diphoma's stages are balanced on (measured: on "
                        "these ranks at the start)")
    p.add_argument("--balance", default="time", choices=("time", "forward-flops", "both"),
                   help="what diphoma's stages are balanced on (both: one row each)")
    args = p.parse_args()
    if args.layers is None:
        args.layers = args.nproc * (1 if args.schedule in ("1f1b", "gpipe") else 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_run, args=(args, port), nprocs=args.nproc)


if __name__ == "__main__":
    main()
