from dataclasses import dataclass


@dataclass
class TinyConfig:
    vocab_size: int = 64
    width: int = 32
    depth: int = 2
