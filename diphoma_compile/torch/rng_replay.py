"""Random draws that torch itself replays inside a step: activation checkpointing.

``torch.utils.checkpoint`` saves the CPU generator's state before a block's forward
(``torch.get_rng_state()``) and, when backward recomputes the block, restores it inside
``torch.random.fork_rng`` so that the recomputation draws the same dropout masks; leaving
the fork restores the generator to where it was. Eager code so draws each mask once.

A traced step records every draw as an op of the program, the recomputation's too, and
the program would draw those afresh: other masks in backward than in forward, wrong
gradients with no error. ``RngPositions`` follows where the generator stands while the
step is traced: each state torch saves is noted with the generator's position then (in
draws), and each state torch restores moves the position back. A draw made at a position
an earlier draw already took repeats that draw: ``replay`` makes the program read the
earlier draw's result instead (the same op on the same shape, else a FrontendError).
The generator then advances as eager's does, by the first draws only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from ..errors import FrontendError
from .ops import draws_random


class RngPositions:
    """The CPU generator's position, in draws, through one trace; ``draws`` counts the
    draws traced so far."""

    def __init__(self, draws: Callable[[], int]) -> None:
        self.draws = draws
        self.saved: dict[int, tuple[torch.Tensor, int]] = {}   # id(state) -> (state, position)
        self.moves: list[tuple[int, int]] = [(0, 0)]          # (draws so far, position then)

    def position(self) -> int:
        at, pos = self.moves[-1]
        return pos + self.draws() - at

    def noted(self, state: torch.Tensor) -> torch.Tensor:
        """A state torch saved (checkpoint, fork_rng), noted with the position it holds."""
        self.saved[id(state)] = (state, self.position())
        return state

    def restored(self, state: torch.Tensor) -> None:
        """Torch restores a state: the generator stands where it stood when it was saved."""
        got = self.saved.get(id(state))
        if got is None:
            raise FrontendError(
                "torch restores a random generator state inside the step that was not saved "
                "in it; the traced program cannot tell which draws that repeats",
                hint="save and restore generator states outside the step")
        self.moves.append((self.draws(), got[1]))

    def replays(self, total: int) -> dict[int, int]:
        """Draw index -> the earlier draw it repeats, of ``total`` draws."""
        first: dict[int, int] = {}
        out: dict[int, int] = {}
        k = 0
        for i in range(total):
            while k + 1 < len(self.moves) and self.moves[k + 1][0] <= i:
                k += 1
            at, pos = self.moves[k]
            p = pos + i - at
            if p in first:
                out[i] = first[p]
            else:
                first[p] = i
        return out

    def replay(self, gm: fx.GraphModule) -> int:
        """Point every repeated draw's readers at the draw it repeats and drop it; how many
        were dropped."""
        if len(self.moves) == 1:
            return 0
        nodes = [n for n in gm.graph.nodes
                 if n.op == "call_function" and draws_random(n.target)]
        pairs = self.replays(len(nodes))
        for i, j in pairs.items():
            again, first = nodes[i], nodes[j]
            if again.target is not first.target or _shape(again) != _shape(first):
                raise FrontendError(
                    f"torch replays random draws inside the step (activation checkpointing "
                    f"recomputing a block), but the draw it repeats differs: "
                    f"{first.target} {_shape(first)} then {again.target} {_shape(again)}",
                    hint="recompute the same ops (a deterministic block), or turn off "
                         "preserve_rng_state / dropout in the checkpointed block")
            again.replace_all_uses_with(first)
            _erase_with_dead_inputs(gm.graph, again)
        if pairs:
            gm.recompile()
        return len(pairs)


def _shape(node: fx.Node) -> Any:
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _erase_with_dead_inputs(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node``, then the pure ops only it read (the ``empty_like`` it drew into)."""
    todo = [node]
    while todo:
        n = todo.pop()
        ins = [a for a in n.all_input_nodes]
        graph.erase_node(n)
        for a in ins:
            pure = a.op == "call_function" and not draws_random(a.target) and \
                not getattr(getattr(a.target, "_schema", None), "is_mutable", False)
            if pure and not a.users and a not in todo:
                todo.append(a)
