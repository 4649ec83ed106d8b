"""Train a small GPT-style language model on synthetic tokens with
``diphoma_compile.parallelize`` on 4 local processes (gloo, CPU), print the plan and the
loss, and check every step against the plain single-device step on the whole batch.

    python examples/torch_gpt_parallel.py [--nproc 4] [--steps 5]

Run like this it starts torchrun itself (``python -m torch.distributed.run --standalone``);
started by torchrun (RANK is set) it is one of the ranks. Each rank passes its own share of
the global batch, as with DDP; parameters stay whole on every rank, the AdamW state is split
across them (1/N each), gradients are reduce-scattered and new parameters all-gathered.
Rank 0 also runs the unmodified step on the whole batch and compares: the loss and every
parameter must agree within float32 reduction-order noise."""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
import warnings

# torch warns at import when numpy is absent (a fresh `pip install torch`); nothing here
# needs numpy
_QUIET = "ignore:Failed to initialize NumPy"
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from gpt import GPT, GPTConfig, make_batch, train_step  # noqa: E402  (examples/gpt.py)

LOSS_RTOL = 1e-4      # the mean over ranks vs the mean over the whole batch: summation order
PARAM_ATOL = 1e-4     # AdamW magnifies that noise where gradients are tiny; it stays small


def launch(nproc: int) -> int:
    """Re-run this script under torchrun with ``nproc`` local ranks; their exit status."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", os.path.abspath(__file__), *sys.argv[1:]]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONWARNINGS=",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), _QUIET])))
    return subprocess.run(cmd, env=env).returncode


def rank_main(steps: int, batch: int) -> int:
    import diphoma_compile
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64)
    torch.manual_seed(0)                 # every rank builds the same initial model
    model = GPT(cfg)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    pstep = diphoma_compile.parallelize(train_step, {"dp": world})
    share = batch // world
    ok = True
    for i in range(steps):
        idx, targets = make_batch(cfg, batch, seed=i)            # the global batch
        mine = slice(rank * share, (rank + 1) * share)          # this rank's share
        loss = pstep(model, opt, idx[mine], targets[mine])
        if i == 0 and rank == 0:
            print(pstep.plan.summary(), flush=True)
        if rank == 0:
            ref_loss = train_step(ref, ref_opt, idx, targets)
            dev = max((a - b).abs().max().item()
                      for a, b in zip(model.parameters(), ref.parameters()))
            same = abs(loss.item() - ref_loss.item()) <= LOSS_RTOL * abs(ref_loss.item()) \
                and dev <= PARAM_ATOL
            ok &= same
            print(f"step {i}: loss {loss.item():.6f}  single device {ref_loss.item():.6f}  "
                  f"params max |diff| {dev:.2e}  {'ok' if same else 'DIFFERS'}", flush=True)
    mem = pstep.memory_report()
    sizes = torch.tensor([mem.opt_state_bytes], dtype=torch.int64)
    gathered = [torch.zeros_like(sizes) for _ in range(world)]
    dist.all_gather(gathered, sizes)
    verdict = torch.tensor([int(ok)])
    dist.broadcast(verdict, 0)
    if rank == 0:
        whole = sum(t.nbytes for s in ref_opt.state.values() for t in s.values())
        print(f"optimizer state per rank: {', '.join(str(int(g)) for g in gathered)} bytes "
              f"(single device: {whole})")
        print("matches the single-device run" if verdict.item() else "MISMATCH")
    dist.destroy_process_group()
    return 0 if verdict.item() else 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4, help="local processes (default 4)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=16, help="global batch (default 16)")
    a = p.parse_args()
    if "RANK" not in os.environ:
        if a.batch % a.nproc:
            p.error(f"--batch {a.batch} does not divide among {a.nproc} processes")
        raise SystemExit(launch(a.nproc))
    raise SystemExit(rank_main(a.steps, a.batch))


if __name__ == "__main__":
    main()
