"""The rank a state dict of shards came from: marked when it is taken, checked when loaded.

Under weight-update sharding an optimizer's state tensors are this rank's shards between
steps (and under ``shard_params`` the module's parameters too), so ``opt.state_dict()`` and
``model.state_dict()`` hold one rank's pieces. The usual DDP checkpoint (rank 0 saves,
every rank loads) would give every rank rank 0's pieces, of the very shapes each rank
holds: nothing else would notice. ``mark_optimizer`` and ``mark_module`` hook the state
dicts: one taken notes the rank and world size, and one loaded on another rank, or over
another world size, is refused. A state dict of the whole state (``ParallelStep.
state_dict()``, a single-device checkpoint) carries no mark and loads as before.

``take_pieces`` hooks a module's ``load_state_dict`` so that the whole state (the usual
checkpoint) loads into a module holding pieces: each rank keeps its piece.

``guard_forward`` hooks the forward of each submodule whose parameters this rank holds as
pieces (tensor-parallel shards, ``shard_params``' flat chunks, a pipeline's other stages'
parameters emptied): called outside the step, between steps, it would compute on the
pieces (a shape error deep in torch, or a wrong answer where the shapes happen to fit), so
it is refused with what to do instead."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from ..errors import DiphomaError

_KEY = "diphoma_shards"


def _refuse(what: str, mark: dict, rank: int, world: int) -> None:
    if mark.get("rank") == rank and mark.get("world") == world:
        return
    raise DiphomaError(
        f"this {what} state dict holds rank {mark.get('rank')}'s shards (of "
        f"{mark.get('world')} ranks), and this is rank {rank} of {world}: under sharding "
        "each rank holds its own pieces, so loading another rank's would train on them",
        hint="save and load each rank's own state dict, or save the whole state "
             "(ParallelStep.state_dict(); runner.gather_optimizer_state()) and load that")


def mark_optimizer(opt: torch.optim.Optimizer, rank: int, world: int) -> None:
    """Hook ``opt``'s state dicts: marked with ``rank`` and ``world`` when taken, refused
    when loaded with another's mark."""
    def taken(_opt: Any, sd: dict) -> dict:
        sd[_KEY] = {"rank": rank, "world": world}
        return sd

    def loading(_opt: Any, sd: dict) -> dict:
        if _KEY not in sd:
            return sd
        _refuse("optimizer", sd[_KEY], rank, world)
        return {k: v for k, v in sd.items() if k != _KEY}

    opt.register_state_dict_post_hook(taken)
    opt.register_load_state_dict_pre_hook(loading)


def mark_module(module: torch.nn.Module, rank: int, world: int) -> None:
    """Hook ``module``'s state dicts (its parameters held as shards): marked in the root's
    metadata when taken, refused when loaded with another rank's mark."""
    def taken(_m: Any, sd: dict, prefix: str, meta: dict) -> None:
        if not prefix:
            meta[_KEY] = {"rank": rank, "world": world}

    def loading(_m: Any, sd: dict, prefix: str, meta: dict, *rest: Any) -> None:
        if not prefix and _KEY in meta:
            _refuse("model", meta[_KEY], rank, world)

    module.register_state_dict_post_hook(taken)
    module.register_load_state_dict_pre_hook(loading)


def guard_forward(module: torch.nn.Module, whole: dict[int, tuple[int, ...]]) -> None:
    """Refuse a forward of ``module``'s submodules, outside a trace, while a parameter one
    holds directly is not its whole shape (``whole``: id(parameter) -> that shape)."""
    for path, sub in module.named_modules():
        mine = [(f"{path}.{n}" if path else n, p, whole[id(p)])
                for n, p in sub.named_parameters(recurse=False) if id(p) in whole]
        if not mine:
            continue

        def check(_m: Any, _args: Any, mine: list = mine, path: str = path) -> None:
            if get_proxy_mode() is not None:      # the step traced again: not a forward
                return
            for name, p, shape in mine:
                if tuple(p.shape) != shape:
                    held = (f"holds none of {name} (another pipeline stage's)"
                            if p.numel() == 0 and math.prod(shape) else
                            f"holds only its piece of {name} (shape {tuple(p.shape)} of "
                            f"{shape})")
                    raise DiphomaError(
                        f"the module {path or type(module).__name__!r} was called outside "
                        f"the parallel step, but this rank {held}: between steps the "
                        "module's parameters are this rank's pieces, as under FSDP2, and "
                        "its forward would compute on them",
                        hint="evaluate a whole copy (eval_model.load_state_dict("
                             "step.state_dict()): a collective, every rank calls it), or "
                             "parallelize an evaluation step too")

        sub.register_forward_pre_hook(check)


def take_pieces(module: torch.nn.Module,
                piece: dict[int, tuple[tuple[int, ...], Callable[[torch.Tensor], torch.Tensor]]]
                ) -> None:
    """Hook ``module``'s ``load_state_dict``: a whole tensor loaded into a parameter this
    rank holds as a piece (``piece``: id(parameter) -> its whole shape and the cut to this
    rank's piece) is cut to the piece first, as FSDP2's ``set_model_state_dict`` takes a
    full state dict, so that ``model.load_state_dict(step.state_dict())`` resumes between
    steps. Torch loads from its own copy of the dict: the caller's is left as it was."""
    names = {n: p for n, p in module.named_parameters(remove_duplicate=False)
             if id(p) in piece}

    def loading(_m: Any, sd: dict, prefix: str, *rest: Any) -> None:
        if prefix:
            return
        for name, p in names.items():
            whole, cut = piece[id(p)]
            t = sd.get(name)
            if isinstance(t, torch.Tensor) and tuple(t.shape) == whole != tuple(p.shape):
                sd[name] = cut(t)

    module.register_load_state_dict_pre_hook(loading)
