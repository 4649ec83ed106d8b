"""Roles and phases: what a graph input or output is to the training step (a parameter, its
optimizer state, the batch, the loss, the new value of an input) and which part of the step
an op belongs to."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..errors import IRError


class Phase(enum.Enum):
    """Which part of the training step an op belongs to."""

    forward = "forward"
    backward = "backward"
    update = "update"


class InputKind(enum.Enum):
    """Role of a graph input."""

    param = "param"
    opt_state = "opt_state"
    batch = "batch"
    buffer = "buffer"
    rng = "rng"
    hyper = "hyper"
    # state a compressing pass keeps across steps (quantize-weight-diff: the exact shard of
    # a parameter whose full copy holds the receivers' reconstruction); like optimizer
    # state it names its parameter, and a checkpoint holds it
    comm_state = "comm_state"
    # the index of the microbatch a pipeline stage's program runs (0 .. M - 1), which the
    # pipeline runtime passes: what a key draw made for every microbatch keeps its rows by
    # (passes/pipeline_draws.py)
    microbatch = "microbatch"
    other = "other"


class OutputKind(enum.Enum):
    """Role of a graph output."""

    loss = "loss"
    metric = "metric"
    replaces = "replaces"  # the new value of an input (parameter, state, buffer, rng)
    other = "other"


@dataclass(frozen=True)
class InputRole:
    """An input's role; optimizer state names its parameter (``of``) and its slot."""

    kind: InputKind = InputKind.other
    of: str | None = None
    slot: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, InputKind):
            object.__setattr__(self, "kind", InputKind(self.kind))
        if self.of is not None and self.kind not in (InputKind.opt_state,
                                                     InputKind.comm_state):
            raise IRError("only optimizer and communication state link to a parameter, "
                          f"not {self.kind.value}")


@dataclass(frozen=True)
class OutputRole:
    """An output's role; ``replaces`` names the input whose new value this is."""

    kind: OutputKind = OutputKind.other
    target: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, OutputKind):
            object.__setattr__(self, "kind", OutputKind(self.kind))
        if (self.kind is OutputKind.replaces) != (self.target is not None):
            raise IRError("an output replaces an input exactly when it names that input")
