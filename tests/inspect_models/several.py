"""Two unrelated models in one file, and one whose forward branches on tensor values."""

import torch
import torch.nn as nn


class Small(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return self.fc(x).relu()


class Gated(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.fc = nn.Linear(d, 1)

    def forward(self, x):
        y = self.fc(x)
        if y.sum() > 0:    # data-dependent Python control flow
            y = y * 2
        return y


class NeedsArgs(nn.Module):
    def __init__(self, width, depth):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])

    def forward(self, x):
        return self.layers(x)
