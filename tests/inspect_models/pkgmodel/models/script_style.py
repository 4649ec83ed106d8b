"""In a package's folder, but written to run from that folder: it imports its sibling by
its bare name, as `python script_style.py` would find it."""

import torch.nn as nn

from layers import Block


class Stack(nn.Module):
    def __init__(self, width=16, depth=2):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])

    def forward(self, x):
        return self.blocks(x)
