"""A language model in a package: it reaches its config and its layers relatively."""

import torch.nn as nn

from ..config import TinyConfig
from .layers import Block


class TinyLM(nn.Module):
    def __init__(self, config: TinyConfig):
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.width)
        self.blocks = nn.Sequential(*[Block(config.width) for _ in range(config.depth)])
        self.head = nn.Linear(config.width, config.vocab_size)

    def forward(self, input_ids):
        return self.head(self.blocks(self.embed(input_ids)))
