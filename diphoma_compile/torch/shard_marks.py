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


class _Mark:
    """A hook that knows this rank and the world size (an object, not a closure, so that
    ``torch.save`` of the optimizer or module still pickles)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world


class _MarkTaken(_Mark):
    """An optimizer's state-dict post-hook: the dict notes the rank and world size."""

    def __call__(self, _opt: Any, sd: dict) -> dict:
        sd[_KEY] = {"rank": self.rank, "world": self.world}
        return sd


class _MarkChecked(_Mark):
    """An optimizer's load pre-hook: another rank's mark refused, the mark dropped."""

    def __call__(self, _opt: Any, sd: dict) -> dict:
        if _KEY not in sd:
            return sd
        _refuse("optimizer", sd[_KEY], self.rank, self.world)
        return {k: v for k, v in sd.items() if k != _KEY}


class _ModuleMarkTaken(_Mark):
    """A module's state-dict post-hook: the root's metadata notes the rank."""

    def __call__(self, _m: Any, sd: dict, prefix: str, meta: dict) -> None:
        if not prefix:
            meta[_KEY] = {"rank": self.rank, "world": self.world}


class _ModuleMarkChecked(_Mark):
    """A module's load pre-hook: another rank's mark refused."""

    def __call__(self, _m: Any, sd: dict, prefix: str, meta: dict, *rest: Any) -> None:
        if not prefix and _KEY in meta:
            _refuse("model", meta[_KEY], self.rank, self.world)


def mark_optimizer(opt: torch.optim.Optimizer, rank: int, world: int) -> None:
    """Hook ``opt``'s state dicts: marked with ``rank`` and ``world`` when taken, refused
    when loaded with another's mark."""
    opt.register_state_dict_post_hook(_MarkTaken(rank, world))
    opt.register_load_state_dict_pre_hook(_MarkChecked(rank, world))


def mark_module(module: torch.nn.Module, rank: int, world: int) -> None:
    """Hook ``module``'s state dicts (its parameters held as shards): marked in the root's
    metadata when taken, refused when loaded with another rank's mark."""
    module.register_state_dict_post_hook(_ModuleMarkTaken(rank, world))
    module.register_load_state_dict_pre_hook(_ModuleMarkChecked(rank, world))


def _parameter(m: torch.nn.Module, path: str) -> torch.Tensor | None:
    """The parameter at ``path`` under ``m``, or None where the user replaced it."""
    try:
        return m.get_parameter(path)
    except AttributeError:
        return None


class _GuardForward:
    """A forward pre-hook refusing the call, outside a trace, while one of ``shapes``'
    parameters (a path under the hooked module -> its whole shape) is not whole. It reads
    the module it is called on, so a copy of the module (``copy.deepcopy``) is judged by
    what the copy holds."""

    def __init__(self, label: str, shapes: dict[str, tuple[int, ...]]) -> None:
        self.label, self.shapes = label, shapes

    def __call__(self, m: torch.nn.Module, _args: Any) -> None:
        if get_proxy_mode() is not None:      # the step traced again: not a forward
            return
        for path, shape in self.shapes.items():
            p = _parameter(m, path)
            if p is None or tuple(p.shape) == shape:
                continue
            name = f"{self.label}.{path}" if self.label else path
            held = (f"holds none of {name} (another pipeline stage's)"
                    if p.numel() == 0 and math.prod(shape) else
                    f"holds only its piece of {name} (shape {tuple(p.shape)} of {shape})")
            raise DiphomaError(
                f"the module {self.label or type(m).__name__!r} was called outside the "
                f"parallel step, but this rank {held}: between steps the module's parameters "
                "are this rank's pieces, as under FSDP2, and its forward would compute on "
                "them", hint="evaluate a whole copy: eval_model.load_state_dict("
                             "step.state_dict()) (a collective: every rank calls it), "
                             "eval_model being a model built as this one was")


def guard_forward(module: torch.nn.Module, whole: dict[int, tuple[int, ...]]) -> None:
    """Refuse a forward of ``module``, or of a submodule holding a parameter directly,
    outside a trace, while a parameter it covers is not its whole shape (``whole``:
    id(parameter) -> that shape). The root covers every parameter: a parent may use a
    child's weight without calling the child (``F.linear(x, self.a.weight)``)."""
    everywhere = {n: whole[id(p)] for n, p in module.named_parameters()
                  if id(p) in whole}
    if everywhere:
        module.register_forward_pre_hook(_GuardForward("", everywhere))
    for path, sub in module.named_modules():
        mine = {n: whole[id(p)] for n, p in sub.named_parameters(recurse=False)
                if id(p) in whole}
        if path and mine:
            sub.register_forward_pre_hook(_GuardForward(path, mine))


class _TakePieces:
    """A load pre-hook cutting a whole tensor, loaded into a parameter its module holds as
    a piece, to the piece (``piece``: a path under the module -> its whole shape and the
    cut). Copied or pickled with the module it does nothing (the copy is no step's)."""

    def __init__(self, piece: dict[str, tuple[tuple[int, ...], Callable]] | None) -> None:
        self.piece = piece

    def __reduce__(self) -> tuple:
        return (_TakePieces, (None,))

    def __call__(self, m: torch.nn.Module, sd: dict, prefix: str, *rest: Any) -> None:
        if prefix or not self.piece:
            return
        for path, (whole, cut) in self.piece.items():
            t, p = sd.get(path), _parameter(m, path)
            if isinstance(t, torch.Tensor) and p is not None and \
                    tuple(t.shape) == whole != tuple(p.shape):
                sd[path] = cut(t)


def take_pieces(module: torch.nn.Module,
                piece: dict[int, tuple[tuple[int, ...], Callable[[torch.Tensor], torch.Tensor]]]
                ) -> None:
    """Hook ``module``'s ``load_state_dict``: a whole tensor loaded into a parameter this
    rank holds as a piece (``piece``: id(parameter) -> its whole shape and the cut to this
    rank's piece) is cut to the piece first, as FSDP2's ``set_model_state_dict`` takes a
    full state dict, so that ``model.load_state_dict(step.state_dict())`` resumes between
    steps. Torch loads from its own copy of the dict: the caller's is left as it was."""
    paths = {n: piece[id(p)] for n, p in module.named_parameters(remove_duplicate=False)
             if id(p) in piece}
    if paths:
        module.register_load_state_dict_pre_hook(_TakePieces(paths))
