"""Time to trace a GPT-2-small-sized training step (12 layers, d=768, AdamW, clipping)
into the IR, next to a bare make_fx of the same step, measured in one run.

    python benchmarks/trace_time.py [--layers 12] [--d 768] [--batch 8] [--seq 128]

Prints seconds per phase and the ratio of the IR conversion (import + verify) to the bare
make_fx trace. No asserts: the machine is noisy; read the ratio."""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from diphoma_compile.ir import print_graph, verify
from diphoma_compile.torch.capture import Step, capture, fake_inputs, find_state
from diphoma_compile.torch.importer import import_captured


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, block: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def train_step(model, opt, batch):
    loss = F.cross_entropy(model(batch["idx"]).flatten(0, 1), batch["targets"].flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return loss


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    a = p.parse_args()
    torch.manual_seed(0)
    model = GPT(a.vocab, a.d, a.layers, a.heads, a.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    seq = torch.randint(0, a.vocab, (a.batch, a.seq + 1))
    batch = {"idx": seq[:, :-1], "targets": seq[:, 1:]}
    n_params = sum(p.numel() for p in model.parameters())
    print(f"GPT: {a.layers} layers, d={a.d}, {n_params / 1e6:.1f}M parameters, "
          f"batch {a.batch}x{a.seq}, AdamW + clip_grad_norm_")

    cap, t_capture = timed(lambda: capture(train_step, model, opt, batch))
    # bare make_fx of the same step: one fake trace, no state discovery, no functionalization
    modules, opts = find_state(train_step, (model, opt, batch))
    step = Step(train_step, (model, opt, batch), modules, opts)
    step.state_keys = cap.state_keys
    inputs = fake_inputs(step)
    bare, t_bare = timed(lambda: make_fx(step, tracing_mode="fake")(*inputs))
    graph, t_import = timed(lambda: import_captured(cap))
    _, t_verify = timed(lambda: verify(graph))
    text, t_print = timed(lambda: print_graph(graph))

    n_bare = sum(1 for n in bare.graph.nodes if n.op == "call_function")
    print(f"bare make_fx (fake)                 {t_bare:7.2f} s   {n_bare:,} aten calls")
    print(f"capture (discovery + trace + functionalize) {t_capture:7.2f} s")
    print(f"IR import                           {t_import:7.2f} s   {len(graph.ops):,} IR ops")
    print(f"IR verify                           {t_verify:7.2f} s")
    print(f"IR print                            {t_print:7.2f} s   {len(text) / 1e6:.1f} MB")
    total = t_capture + t_import + t_verify
    print(f"trace() total                       {total:7.2f} s")
    print(f"ratio  IR conversion (import+verify) / bare make_fx = "
          f"{(t_import + t_verify) / t_bare:.2f}")
    print(f"ratio  trace() total / bare make_fx                  = {total / t_bare:.2f}")


if __name__ == "__main__":
    main()
