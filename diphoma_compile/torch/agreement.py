"""What the ranks of a distributed step must agree on, checked once, when it is built or
first called: one program (each rank planned the step by itself), the values the plan
takes as the same on every rank (a count passed as a 0-d tensor), and, where the step
draws random numbers, the random generator of the ranks that hold the same values (the
tensor-parallel ranks: the draws are made on values each holds whole). Each check is one
small all_gather, over the world when the mesh is the world; a difference is refused on
every rank, so none is left waiting in a collective its peers left."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Peers:
    """Ranks that must agree: their process group (None: the world), what to call them in
    a message, how many they are, and the world rank of the r-th."""

    group: Any
    where: str
    size: int
    global_rank: Callable[[int], int]


def disagreeing(mine: torch.Tensor, peers: list[Peers]) -> tuple[Peers, int, list[int]] | None:
    """The first ``peers`` whose members' ``mine`` differ from this rank's: (them, the
    world rank of one that differs, the indices of ``mine``'s rows that differ), or None.
    A collective: every member of every ``peers`` calls it with a tensor of one shape."""
    for p in peers:
        if p.size == 1:
            continue
        every = [torch.empty_like(mine) for _ in range(p.size)]
        dist.all_gather(every, mine, group=p.group)
        other = [r for r, t in enumerate(every) if not torch.equal(t, mine)]
        if other:
            rows = [k for k in range(mine.shape[0])
                    if any(not torch.equal(t[k], mine[k]) for t in every)] \
                if mine.dim() else []
            return p, p.global_rank(other[0]), rows
    return None


def fingerprint(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Two float64 sums of ``t`` on ``device``: of its elements, and weighted by position
    (1/k), NaNs counted as a number."""
    flat = torch.nan_to_num(t.detach().flatten().double(), nan=-7.25e300)
    at = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
    return torch.stack([flat.sum(), (flat / at).sum()]).to(device)


def rng_digest(device: torch.device) -> int:
    """A 63-bit hash of the state of the default random generator the step draws from on
    ``device`` (the CPU's, or that GPU's)."""
    state = torch.cuda.get_rng_state(device) if device.type == "cuda" else \
        torch.get_rng_state()
    return int.from_bytes(hashlib.sha1(state.numpy().tobytes()).digest()[:8], "little") >> 1
