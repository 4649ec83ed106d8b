"""Small models and training steps for the PyTorch frontend tests (kept stable: the golden
IR files quote line numbers of this file)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d_in: int = 8, d_hidden: int = 16, d_out: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class CNN(nn.Module):
    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.head = nn.Linear(6 * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        return self.head(h.flatten(1))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.heads = heads
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.down(F.gelu(self.up(self.ln2(x)), approximate="tanh")))


class GPT(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 2, heads: int = 4,
                 block: int = 16, dropout: float = 0.0) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.5 / math.sqrt(d))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def classify_step(model, opt, batch):
    loss = F.cross_entropy(model(batch["x"]), batch["y"])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def clipped_step(model, opt, batch):
    loss = F.cross_entropy(model(batch["x"]), batch["y"])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return loss


def lm_step(model, opt, batch):
    logits = model(batch["idx"])
    loss = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return loss


def counted_step(model, opt, batch):
    """Cross-entropy over the targets not ignored plus a masked mean whose count is clamped
    to at least 1: two means over counts of the batch."""
    out = model(batch["x"])
    ce = F.cross_entropy(out, batch["y"], ignore_index=-100)
    reg = ((out ** 2).sum(-1) * batch["m"]).sum() / batch["m"].sum().clamp(min=1)
    loss = ce + 0.1 * reg
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def hf_lm_step(model, opt, ids):
    """A Hugging Face causal LM's own loss on a batch of token ids (labels = the ids)."""
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    opt.step()
    opt.zero_grad()
    return out.loss


OPTIMIZERS = {
    "sgd": lambda ps, fe: torch.optim.SGD(ps, lr=0.05, foreach=fe),
    "sgd_momentum": lambda ps, fe: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=fe),
    "adam": lambda ps, fe: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, foreach=fe),
    "adamw": lambda ps, fe: torch.optim.AdamW(ps, lr=1e-2, foreach=fe),
    # factored second moments; min(lr, 1 / step ** 0.5) takes each side within ten steps
    "adafactor": lambda ps, fe: torch.optim.Adafactor(ps, lr=0.5, foreach=fe),
}


def mlp_batches(n: int, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(16, 8, generator=g), "y": torch.randint(0, 4, (16,), generator=g)}
            for _ in range(n)]


def cnn_batches(n: int, seed: int = 2) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(4, 3, 8, 8, generator=g),
             "y": torch.randint(0, 5, (4,), generator=g)} for _ in range(n)]


def lm_batches(n: int, seed: int = 3, vocab: int = 64, t: int = 16) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        seq = torch.randint(0, vocab, (4, t + 1), generator=g)
        out.append({"idx": seq[:, :-1], "targets": seq[:, 1:]})
    return out


class BasicBlock(nn.Module):
    """torchvision's residual BasicBlock: two bias-free 3x3 convs with BatchNorm."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)) + x)


class ResNetStem(nn.Module):
    """A torchvision-style ResNet, small: the 7x7 stride-2 bias-free stem conv on the images
    (which need no gradient: its convolution_backward returns only the weight's gradient),
    BatchNorm, ReLU, max pool, one BasicBlock, average pool, a linear head."""

    def __init__(self, c: int = 8, classes: int = 5) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, c, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = BasicBlock(c)
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        h = F.adaptive_avg_pool2d(self.layer1(h), 1)
        return self.fc(h.flatten(1))


def image_batches(n: int, seed: int = 4, batch: int = 4, size: int = 16,
                  classes: int = 5) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(batch, 3, size, size, generator=g),
             "y": torch.randint(0, classes, (batch,), generator=g)} for _ in range(n)]


class NormedMLP(nn.Module):
    """Four layers, a BatchNorm on the third (running statistics the forward updates) and a
    buffer the step only reads (a per-feature scale made from it, as Llama's rotary tables
    are from inv_freq)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.ModuleList([nn.Linear(16, 16) for _ in range(4)])
        self.bn = nn.BatchNorm1d(16)
        self.register_buffer("freq", torch.linspace(0.5, 1.5, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.cos(self.freq) * 2
        for k, fc in enumerate(self.fc):
            x = torch.tanh(fc(x)) * scale
            if k == 2:
                x = self.bn(x)
        return x


def mse_step(model, opt, x):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def frozen_mlp(layers: int = 8, frozen: int = 4, width: int = 32) -> nn.Sequential:
    """A stack of Linear + tanh layers whose first ``frozen`` Linears are frozen (fine-tuning
    the rest): their backward computes no weight gradient, and below the first trainable
    layer no backward runs at all."""
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.Tanh()]
    model = nn.Sequential(*mods)
    for p in model[:2 * frozen].parameters():
        p.requires_grad_(False)
    return model


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimizer fine-tuning ``model`` holds."""
    return [p for p in model.parameters() if p.requires_grad]
