"""Trace an ordinary PyTorch training step into the IR, run the compiled step for ten
steps beside eager PyTorch, and show that both end bit for bit the same.

    python examples/torch_mlp.py [--steps 10] [--print-ir]
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import diphoma_compile
from diphoma_compile.ir.analysis import graph_cost, liveness
from diphoma_compile.ir.ops import op_def


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def train_step(model, opt, batch):
    loss = F.cross_entropy(model(batch["x"]), batch["y"])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--print-ir", action="store_true", help="print the whole IR graph")
    a = p.parse_args()
    torch.manual_seed(0)
    model, ref = MLP(), None
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=3, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(64, 32, generator=g) for _ in range(a.steps)]
    # a rule the model can learn: the class is the largest of the first ten features
    data = [{"x": x, "y": x[:, :10].argmax(1)} for x in xs]

    step = diphoma_compile.compile(train_step, model, opt, data[0], passes="dce,cse")
    graph = step.graph
    if a.print_ir:
        print(graph)
    counts: dict[str, int] = {}
    for op in graph.ops:
        key = f"{op.phase.value if op.phase else '-'}/{op_def(op.name).category.value}"
        counts[key] = counts.get(key, 0) + 1
    cost, _ = graph_cost(graph)
    print(f"traced {train_step.__name__}: {len(graph.inputs)} inputs, {len(graph.ops)} ops "
          f"after {', '.join(graph.passes)}; {cost.flops:,} flops; peak live "
          f"{liveness(graph).peak_bytes / 1024:.0f} KiB")
    print("ops by phase/category: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    exact = True
    for i, batch in enumerate(data):
        loss = step(model, opt, batch)
        ref_loss = train_step(ref, ref_opt, batch)
        sched.step()
        ref_sched.step()
        same = torch.equal(loss, ref_loss) and all(
            torch.equal(x, y) for x, y in zip(model.parameters(), ref.parameters()))
        exact &= same
        print(f"step {i}: loss {loss.item():.6f}  eager {ref_loss.item():.6f}  "
              f"lr {opt.param_groups[0]['lr']:.5f}  {'bit-exact' if same else 'DIFFERS'}")
    print("compiled step matches eager PyTorch bit for bit" if exact else "MISMATCH")
    raise SystemExit(0 if exact else 1)


if __name__ == "__main__":
    main()
