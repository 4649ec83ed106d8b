"""Where an sdp4bit step's time goes, per rank: the model's own computation, each part of the
quantization arithmetic (timed alone on one thread, over the tensors the plan quantizes),
and the time its bytes take on a link of a given rate shared by the ranks, against DDP's.
It explains quantized_speed.py's ratios without a network namespace.

    python benchmarks/quantized_profile.py [--nproc 4] [--cores 2] [--rate-gbit 1]
        [--layers 2 --embd 256 ...]

The model and batch are quantized_speed.py's (GPT 2 x 256, global batch 16). One process,
one thread: the step (forward, backward, AdamW) at the local batch, then the kernels each
rank runs per step for quantize-grads (keyed draws, Hadamard, group quantization, packing;
at the receiver unpacking, dequantization, the mean, the inverse transform) and
quantize-weight-diff (the difference, draws, quantization, packing; unpacking,
dequantization and the add of the whole tensor), each the median of --repeat runs.
The estimate at the end: N ranks share C cores (compute x N / C when N > C) and one link
(every rank's bytes cross it: bytes x N / rate), computation and transfer not overlapped.
No asserts: read the table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt import GPT, GPTConfig, make_batch, train_step  # noqa: E402

import diphoma_compile  # noqa: E402
from diphoma_compile.ir.shape_rules import piece_layout  # noqa: E402
from diphoma_compile.torch import quant  # noqa: E402


def _median(fn, repeat: int) -> float:
    fn()                                   # warm-up
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def kernel_times(sizes_qg: list[int], sizes_qwd: list[int], n: int, repeat: int
                 ) -> dict[str, float]:
    """Seconds one rank spends per step in each part of the quantization arithmetic."""
    key = torch.tensor(1, dtype=torch.int64)
    parts: dict[str, float] = {}

    def add(name: str, fn) -> None:
        parts[name] = parts.get(name, 0.0) + _median(fn, repeat)
    g = torch.Generator().manual_seed(0)
    for numel in sizes_qg:
        k, kq = piece_layout(numel, n, 128)
        grad = torch.randn(numel, generator=g)
        u = quant.uniform(key, numel, 0)
        rows = torch.randn(n * kq, generator=g)
        q, s = quant.quantize(grad, 4, 128, u, n, 32)
        packed = quant.pack(q, 4)
        add("grads: keyed draws", lambda numel=numel: quant.uniform(key, numel, 0))
        add("grads: Hadamard (send)", lambda rows=rows: quant.hadamard(rows, 32))
        add("grads: quantize + pack (w/o Hadamard)",
            lambda grad=grad, u=u: quant.pack(quant.quantize(grad, 4, 128, u, n)[0], 4))
        add("grads: unpack + dequantize + mean",
            lambda p=packed, s=s, kq=kq: quant.dequantize(
                quant.unpack(p, 4, [n * kq], torch.int8), s, 128, torch.float32,
                [n * kq], None).view(n, kq).mean(0))
        add("grads: Hadamard (receive)", lambda r=rows[:kq]: quant.hadamard(r, 32))
    for numel in sizes_qwd:
        k, kq = piece_layout(numel, n, 2048)
        new, old = torch.randn(k, generator=g), torch.randn(k, generator=g)
        u = quant.uniform(key, k, 0)
        whole = torch.randn(numel, generator=g)
        q = torch.randint(-7, 8, (n * kq,), dtype=torch.int8, generator=g)
        s = torch.rand(n * kq // 2048, generator=g)
        packed = quant.pack(q, 4)
        add("weights: difference + keyed draws",
            lambda new=new, old=old, k=k: (new - old, quant.uniform(key, k, 0)))
        add("weights: quantize + pack",
            lambda new=new, u=u: quant.pack(quant.quantize(new, 4, 2048, u, 1)[0], 4))
        add("weights: unpack + dequantize + add",
            lambda p=packed, s=s, kq=kq, whole=whole, numel=numel: whole + quant.dequantize(
                quant.unpack(p, 4, [n * kq], torch.int8), s, 2048, torch.float32, [numel], n))
    return parts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--cores", type=int, default=2)
    p.add_argument("--rate-gbit", type=float, default=1.0)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--embd", type=int, default=256)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args()
    torch.set_num_threads(1)
    n = a.nproc
    cfg = GPTConfig(vocab_size=a.vocab, block_size=a.seq, n_layer=a.layers, n_head=a.heads,
                    n_embd=a.embd)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx, tgt = make_batch(cfg, a.batch // n, seed=0)
    step_s = _median(lambda: train_step(model, opt, idx, tgt), a.repeat)
    plans = {c: diphoma_compile.parallelize(train_step, diphoma_compile.Mesh({"dp": n}),
                                            compression=c).trace(model, opt, idx, tgt).plan
             for c in (None, "sdp4bit")}
    notes = plans["sdp4bit"].notes
    numel = {name: p_.numel() for name, p_ in model.named_parameters()}
    qg = [numel[notes["quantize-grads"]["params"][g]] for g in notes["quantize-grads"]["quantized"]]
    qwd = [numel[w] for w in notes["quantize-weight-diff"]["quantized"]]
    parts = kernel_times(qg, qwd, n, a.repeat)
    quant_s = sum(parts.values())
    grad_bytes = sum(numel.values()) * 4
    ddp_bytes = int(2 * (n - 1) / n * grad_bytes)
    rate = a.rate_gbit * 1e9 / 8
    nparams = sum(numel.values())
    print(f"GPT {a.layers} layers x {a.embd}, {nparams / 1e6:.2f}M parameters, local batch "
          f"{a.batch // n} of {a.batch}, {n} ranks; one thread, median of {a.repeat}")
    print(f"  {'the step (forward, backward, AdamW)':<42} {step_s * 1e3:8.1f} ms")
    for name, t in parts.items():
        print(f"  {name:<42} {t * 1e3:8.1f} ms")
    print(f"  {'quantization in all':<42} {quant_s * 1e3:8.1f} ms "
          f"({quant_s / step_s:.2f}x the step)")
    share = max(1.0, n / a.cores)
    rows = [("ddp", step_s, ddp_bytes), ("wus", step_s, plans[None].comm_bytes_per_step),
            ("sdp4bit", step_s + quant_s, plans["sdp4bit"].comm_bytes_per_step)]
    print(f"estimate: {n} ranks on {a.cores} cores (compute x {share:g}), one "
          f"{a.rate_gbit:g} Gbit/s link for all ranks (bytes x {n}), no overlap")
    print(f"{'variant':<9} {'compute':>9} {'wire':>9} {'s/step':>9} {'vs ddp':>7} "
          f"{'bytes/rank':>11}")
    base = None
    for v, comp, b in rows:
        wire = b * n / rate
        total = comp * share + wire
        base = base or total
        print(f"{v:<9} {comp * share:9.3f} {wire:9.3f} {total:9.3f} {total / base:7.2f} "
              f"{b:11d}")
    need = 0.6 * base - plans["sdp4bit"].comm_bytes_per_step * n / rate
    print(f"for sdp4bit at 0.6x DDP its computation would have to fit in {need:.3f} s "
          f"({max(need, 0) / share - step_s:.3f} s of quantization per rank, one thread)"
          if need > 0 else "sdp4bit cannot reach 0.6x DDP here even with free quantization")


if __name__ == "__main__":
    main()
