"""What a traced torch step leaves for its runtimes: ``Captured`` (the functional fx graph
and where each input comes from and each output goes), its ``Slot``s, and the checks a
runtime makes on the live modules and optimizers each call. The capture (``capture.py``)
builds it; the runtimes (``runtime.py``, ``dist.py``) and the importer read it, so none of
them needs the tracing machinery."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..ir.core import Phase
from .effects import HostEffect

LR_DTYPE = torch.float64  # a Python float hyperparameter is a double: keep it one


# one optimizer state tensor: key, shape, dtype, and its device when that is not its
# parameter's (None: the parameter's)
StateKey = tuple[str, torch.Size, torch.dtype, "torch.device | None"]


@dataclass(frozen=True)
class Slot:
    """Where a flat graph input comes from, or where an output goes."""

    kind: str    # param, buffer, opt_state, hyper, arg
    owner: int   # index of the module or optimizer (arg: 0)
    key: tuple   # param/buffer: (qualname,); opt_state: (param index, state key);
                 # hyper: (group index, group key, index in a tuple value or None);
                 # arg: (leaf index,)
    name: str    # the IR value name


@dataclass
class Captured:
    """A functional fx graph of the whole step plus what a runtime needs to bind it."""

    gm: fx.GraphModule
    inputs: list[Slot]                 # one per placeholder, in order
    outputs: list[Slot | None]         # one per output; None for the step's own results
    user_out_spec: pytree.TreeSpec     # structure of what the step returns
    modules: list[torch.nn.Module]
    optimizers: list[torch.optim.Optimizer]
    params: list[torch.Tensor]         # live parameters, in the order of param slots
    state_keys: list[list[StateKey]]   # per param: its state
    phase: dict[str, Phase] = field(default_factory=dict)   # fx node name -> phase
    loc: dict[str, str] = field(default_factory=dict)       # fx node name -> "file:line"
    name: str = "step"
    settings: tuple = ()   # what the trace baked in, from settings_of(); checked per call
    clears_grads: bool = True   # the step zero_grads before backward: a leftover .grad is moot
    # calls the runtime makes on the host before or after the program (schedulers, seeds)
    effects: list[HostEffect] = field(default_factory=list)
    # sign (-1, 0, 1) of each hyperparameter input but lr at trace time: the optimizer may
    # branch on it (momentum != 0), so the trace holds only while it keeps that sign
    hyper_signs: dict[str, int] = field(default_factory=dict)
    # the device the parameters and buffers live on: constants the program makes go there
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    codegen: str = "fx"    # the code generator the graph was traced for (codegen.py)
    user_nones: tuple[int, ...] = ()   # leaves of what the step returns that are None
    # the step ends with zero_grad(set_to_none=False): it leaves zeros in .grad, and the
    # next call's backward adds to them (eager: 0 + g; the program: g)
    grads_zeroed: bool = False
    # the structure of the step's arguments, and each leaf that is not a tensor (modules,
    # optimizers, constants): (position among the leaves, the leaf, its path "args[0]")
    arg_spec: pytree.TreeSpec | None = None
    arg_fixed: tuple[tuple[int, Any, str], ...] = ()
    # plain Python values the step's code reads from its globals or closure (name, getter,
    # whether a scalar) and their values at trace time; the modules' scalar attributes
    # then (pystate.py)
    reads: tuple = ()
    read_values: tuple[str, ...] = ()
    module_attrs: dict[str, Any] = field(default_factory=dict)


_LIVE_KEYS = {"params", "lr", "initial_lr"}   # read per call, or not used by step()


def settings_of(modules: list[torch.nn.Module], opts: list[torch.optim.Optimizer],
                live: frozenset = frozenset()) -> tuple:
    """Everything a trace bakes in that a user may change between calls: the optimizers'
    hyperparameters other than those read per call (the learning rate, and ``live``:
    ``(optimizer index, key, tuple index or None)``), their group count, train/eval modes,
    which parameters are trained (``requires_grad``)."""
    def value(oi: int, k: str, v: Any) -> str:
        if isinstance(v, tuple) and any((oi, k, i) in live for i in range(len(v))):
            v = tuple("<input>" if (oi, k, i) in live else x for i, x in enumerate(v))
        return repr(v)
    groups = tuple(tuple(sorted((k, value(oi, k, v)) for k, v in g.items()
                                if k not in _LIVE_KEYS and (oi, k, None) not in live))
                   for oi, opt in enumerate(opts) for g in opt.param_groups)
    modes = tuple(sub.training for m in modules for sub in m.modules())
    trained = tuple(p.requires_grad for m in modules for p in m.parameters())
    return tuple(len(o.param_groups) for o in opts), groups, modes, trained


def hyper_value(opt: torch.optim.Optimizer, slot: Slot) -> Any:
    """The live value of a hyperparameter slot in ``opt``'s parameter groups."""
    gi, key, idx = slot.key
    v = opt.param_groups[gi][key]
    return v if idx is None else v[idx]


def sign(v: float) -> int:
    """-1, 0 or 1."""
    return (v > 0) - (v < 0)


def is_state(x: Any) -> bool:
    """True for a module or optimizer: state of the step, not a leaf of its arguments."""
    return isinstance(x, (torch.nn.Module, torch.optim.Optimizer))
