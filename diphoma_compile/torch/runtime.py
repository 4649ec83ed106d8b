"""Runs a traced step on the live module and optimizer, and writes the new values back,
so that afterwards they look exactly as after the eager step. The host effects the trace
found (a scheduler's step(), torch.manual_seed) run before or after the program, where the
eager step runs them relative to its tensor math."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..errors import DiphomaError, DiphomaWarning, no_keywords
from ..ir.core import Graph
from .pystate import attribute_slots, changed_values, read_now, submodules
from .codegen import program
from .live_memory import MeasuredPeak, measure_peak
from .state import LR_DTYPE, Captured, Slot, hyper_value, is_state, settings_of, sign
from .ops import DTYPE_TO_TORCH


class TorchStep:
    """A callable with the user's step signature that runs the compiled IR graph."""

    def __init__(self, graph: Graph, captured: Captured,
                 module: fx.GraphModule | None = None) -> None:
        self.graph = graph
        self.captured = captured
        # the fx GraphModule, or it under Inductor (codegen.py)
        self.module = module if module is not None else program(graph, captured)
        self.codegen = captured.codegen
        sizes = dict(graph.mesh.axes)   # a rank is called with its own piece of the batch
        self._arg_types = [(tuple(i.value.type.local_shape(sizes)), i.value.type.dtype)
                           for i, s in zip(graph.inputs, captured.inputs) if s.kind == "arg"]
        self._n_user = captured.outputs.count(None)   # the step's own results come first
        self._with_grad = {s.key[0] for s in captured.outputs
                           if s is not None and s.kind == "grad"}
        # id(param) -> (id, version) of the zeros this runtime left in its .grad
        self._zeros_left: dict[int, tuple[int, int]] = {}
        self._module_attrs = dict(captured.module_attrs)    # as last seen (pystate.py)
        self._read_values = captured.read_values
        self._attr_slots = attribute_slots(submodules(captured.modules),
                                           captured.module_attrs)
        # (qualified name, module index) of each parameter, in cap.params' order
        self._param_keys = [(s.key[0], s.owner) for s in captured.inputs
                             if s.kind == "param"]
        read = {n for op in graph.walk() for n in op.inputs}
        # parameters whose optimizer state the step reads before writing it: a fresh
        # optimizer's starting values matter for these
        self._state_read = {s.key[0] for i, s in zip(graph.inputs, captured.inputs)
                            if s.kind == "opt_state" and i.name in read}
        self._live = frozenset((s.owner, s.key[1], s.key[2]) for s in captured.inputs
                               if s.kind == "hyper" and s.key[1] != "lr")

    @property
    def compile_s(self) -> float | None:
        """Seconds the code generator spent compiling on the first call (None for fx, or
        before the first call)."""
        return getattr(self.module, "compile_s", None)

    @property
    def code(self) -> str:
        """The generated program as Python source."""
        return self.module.code

    def _state(self, slot: Slot) -> torch.Tensor:
        cap = self.captured
        pi, key = slot.key
        p = cap.params[pi]
        opt = cap.optimizers[slot.owner]
        st = opt.state[p]
        if not st:
            # a fresh optimizer: start from the zero state the graph was traced with, where
            # that is what the optimizer's own first step starts from
            why = _not_zero_start(opt) if pi in self._state_read else None
            if why is not None:
                raise DiphomaError(
                    f"{type(opt).__name__} has no state yet, and {why}: the traced step (an "
                    "ordinary later step) would start from zeros and drift from eager",
                    hint="run one eager step (or load a checkpoint) so the optimizer has its "
                         "state, then call the compiled step")
            for k, shape, dtype, device in cap.state_keys[pi]:
                st[k] = torch.zeros(self._state_shape(pi, k, shape), dtype=dtype,
                                    device=p.device if device is None else device)
        if key not in st:
            raise DiphomaError(f"the optimizer state of {slot.name.rsplit('.', 1)[0]} has no "
                               f"{key!r} (it has {sorted(st)})",
                               hint="trace the step again after changing the optimizer")
        return st[key]

    def _state_shape(self, pi: int, key: str, shape: torch.Size) -> tuple[int, ...]:
        """The shape this process keeps a state tensor in (a shard under sharding)."""
        return tuple(shape)

    def _check_args(self, args: tuple) -> list[torch.Tensor]:
        """The tensors among ``args``, after checking that the trace still holds for them
        and for the live modules and optimizers."""
        cap = self.captured
        leaves, spec = pytree.tree_flatten(args, is_leaf=is_state)
        _check_structure(cap, spec, leaves)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        if len(tensors) != len(self._arg_types):
            raise DiphomaError(f"the step was traced with {len(self._arg_types)} tensor "
                               f"arguments but is called with {len(tensors)}",
                               hint="call it with arguments shaped like the example")
        for t, (shape, dtype) in zip(tensors, self._arg_types):
            if tuple(t.shape) != shape or t.dtype != DTYPE_TO_TORCH[dtype]:
                raise DiphomaError(f"the step was traced for an argument of shape {shape} "
                                   f"and dtype {dtype}, called with {tuple(t.shape)} and "
                                   f"{t.dtype}", hint=self._retrace_hint())
        if not cap.clears_grads and any(p.grad is not None and not self._zeros(p)
                                        for p in cap.params):
            raise DiphomaError("a parameter holds a .grad, and the traced step adds to it "
                               "(it does not call zero_grad before backward)",
                               hint="clear gradients before calling, or call "
                                    "opt.zero_grad() in the step")
        if settings_of(cap.modules, cap.optimizers, self._live) != cap.settings:
            raise DiphomaError(
                "the optimizer's hyperparameters (other than lr), its parameter groups, a "
                "module's train/eval mode, or which parameters are trained (requires_grad) "
                "changed since the step was traced; the trace baked them in",
                hint="trace the step again (only the learning rate may change between "
                     "calls, e.g. by a scheduler; momentum terms too where a OneCycleLR or "
                     "CyclicLR scheduler was made before tracing)")
        self._check_baked()
        self._check_params()
        return tensors

    def _retrace_hint(self) -> str:
        """What to do about a call with other shapes than traced."""
        return ("trace the step again for the new shapes (a DataLoader's smaller last "
                "batch: drop_last=True keeps one shape)")

    def _check_params(self) -> None:
        """Refuse a call after a parameter was replaced (a new head assigned, a parameter
        set anew): the optimizer holds the traced tensors, and the program would train the
        new one (eager trains neither: the optimizer's are not in the model any more)."""
        cap = self.captured
        parents: dict[tuple[int, str], Any] = {}
        for (name, owner), p in zip(self._param_keys, cap.params):
            path, _, leaf = name.rpartition(".")
            mod = parents.get((owner, path))
            if mod is None:
                mod = parents[(owner, path)] = _get_attr(cap.modules[owner], path) \
                    if path else cap.modules[owner]
            own = mod._parameters
            if (own[leaf] if leaf in own else getattr(mod, leaf)) is not p:
                raise DiphomaError(
                    f"the parameter {name} is another tensor than the one the step was "
                    "traced with (a module or parameter replaced since); the optimizer "
                    "holds the old one",
                    hint="build the optimizer over the new parameters and trace the step "
                         "again (or copy new values into the old parameter in place: "
                         "with torch.no_grad(): p.copy_(new))")

    def _check_baked(self) -> None:
        """Refuse a call after a plain value the step's code reads changed (its trace
        holds the old one); warn once of a module's scalar attribute changed."""
        cap = self.captured
        now = read_now(cap.reads)
        if now != self._read_values:
            moved = [(name, old, new, scalar) for (name, _, scalar), old, new
                     in zip(cap.reads, self._read_values, now) if old != new]
            numbers = [f"{n}: {o} -> {v}" for n, o, v, scalar in moved if scalar]
            if numbers:
                raise DiphomaError(
                    f"{', '.join(numbers)} changed since the step was traced; the trace "
                    "holds the value it read then",
                    hint="pass a value that changes between calls as a tensor argument of "
                         "the step (torch.tensor(kl)), or trace the step again")
            self._read_values = now
            warnings.warn(
                f"{', '.join(n for n, _, _, _ in moved)}, which the step names, changed since "
                "it was traced: where the step reads an entry that changed, the trace holds "
                "the value it read then. Pass a value that changes as a tensor argument, or "
                "trace the step again", DiphomaWarning, stacklevel=4)
        moved = changed_values(self._attr_slots, self._module_attrs)
        if moved:
            self._module_attrs.update((name, now) for name, now, _ in moved)
            said = [text for _, _, text in moved]
            warnings.warn(
                f"{', '.join(said[:4])}{' ...' if len(said) > 4 else ''} changed since the "
                "step was traced: where the forward reads it, the trace holds the value it "
                "read then (a dropout probability, a temperature). Pass a value that "
                "changes as a tensor argument or buffer, or trace the step again",
                DiphomaWarning, stacklevel=4)

    def _zeros(self, p: torch.Tensor) -> bool:
        """Whether ``p.grad`` is zeros a step ending with zero_grad(set_to_none=False)
        left: the tensor this runtime wrote, unchanged since (its version), or checked."""
        if not self.captured.grads_zeroed:
            return False
        g = p.grad
        left = self._zeros_left.get(id(p))
        return left is not None and left == (id(g), g._version) or not bool(g.any())

    def _gather(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The program's inputs, read from the live state and the argument tensors."""
        it = iter(tensors)
        return [self._input(slot, it) for slot in self.captured.inputs]

    def _input(self, slot: Slot, args_it) -> torch.Tensor:
        cap = self.captured
        if slot.kind in ("param", "buffer"):
            return _get_attr(cap.modules[slot.owner], slot.key[0]).detach()
        if slot.kind == "opt_state":
            return self._state(slot)
        if slot.kind == "hyper":
            v = hyper_value(cap.optimizers[slot.owner], slot)
            was = cap.hyper_signs.get(slot.name)
            if was is not None and sign(float(v)) != was:
                raise DiphomaError(
                    f"the optimizer's {slot.name} is {v} now; it was "
                    f"{('negative', 'zero', 'positive')[was + 1]} when the step was traced, "
                    "and the optimizer's code may branch on that (momentum != 0)",
                    hint="trace the step again")
            return torch.as_tensor(v, dtype=LR_DTYPE)
        return next(args_it)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        no_keywords(kwargs)
        cap = self.captured
        tensors = self._check_args(args)
        for effect in cap.effects:
            if effect.when == "before":
                effect()    # a scheduler stepped before opt.step(): the program reads its lr
        inputs = self._gather(tensors)
        with torch.no_grad():
            outs = list(self.module(*inputs))
            n_user = self._n_user
            # the program wrote these into the input's own storage already (build_module's
            # in-place updates): nothing to write back
            done = {k for k in range(n_user, len(outs))
                    if _is_input(outs[k], self._given(cap.outputs[k], inputs))}
            # An output that is (a view of) an input would change while earlier outputs are
            # written back (state = param.clone() reads the param before the update): copy.
            held = {t.untyped_storage().data_ptr() for t in inputs}
            outs = [o if k in done or o.untyped_storage().data_ptr() not in held else o.clone()
                    for k, o in enumerate(outs)]
            for k in range(n_user, len(outs)):
                if k not in done:
                    self._write(cap.outputs[k], outs[k])
        for pi, p in enumerate(cap.params):
            if pi not in self._with_grad:
                p.grad = None
        for effect in cap.effects:
            if effect.when == "after":
                effect()
        leaves = list(outs[:n_user])
        for i in cap.user_nones:
            leaves.insert(i, None)
        return pytree.tree_unflatten(leaves, cap.user_out_spec)

    def measure_memory(self, *args: Any) -> MeasuredPeak:
        """Run one real step (it updates the model) and measure the peak of tensor memory
        this process reaches in it, above the parameters, optimizer state, gradients and
        arguments it held before (``live_memory.measure_peak``): what the plan's
        ``memory.peak`` predicts. Under several processes every rank must call it."""
        cap = self.captured
        held = [p for m in cap.modules for p in m.parameters()]
        held += [p.grad for p in held if p.grad is not None]
        held += [b for m in cap.modules for b in m.buffers()]
        held += [st for opt in cap.optimizers for st in opt.state.values()]
        held += [a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]
        held += list(getattr(self, "comm_state", {}).values())
        return measure_peak(lambda: self(*args), held)

    def _given(self, slot: Slot, inputs: list[torch.Tensor]) -> torch.Tensor | None:
        """The tensor the program was given for the state ``slot`` replaces, if any."""
        for s, t in zip(self.captured.inputs, inputs):
            if s.kind == slot.kind and s.key == slot.key and s.owner == slot.owner:
                return t
        return None

    def _write(self, slot: Slot, new: torch.Tensor) -> None:
        cap = self.captured
        if slot.kind in ("param", "buffer"):
            _get_attr(cap.modules[slot.owner], slot.key[0]).copy_(new)
        elif slot.kind == "opt_state":
            pi, key = slot.key
            cap.optimizers[slot.owner].state[cap.params[pi]][key].copy_(new)
        elif slot.kind == "grad":
            p = cap.params[slot.key[0]]
            p.grad = new
            if cap.grads_zeroed:
                self._zeros_left[id(p)] = (id(p.grad), p.grad._version)


def _is_input(out: torch.Tensor, given: torch.Tensor | None) -> bool:
    """True when an output is the very tensor (storage, offset, shape) given as input."""
    return (given is not None and out.untyped_storage().data_ptr()
            == given.untyped_storage().data_ptr() and out.data_ptr() == given.data_ptr()
            and out.shape == given.shape)


def _get_attr(mod: torch.nn.Module, qualname: str) -> torch.Tensor:
    *path, leaf = qualname.split(".")
    for p in path:
        mod = getattr(mod, p)
    return getattr(mod, leaf)


# Optimizers whose first step() starts from zero state and then does what every later step
# does, so that a fresh one can run the traced (later-step) program from zeros: the
# moments, buffers and step counts of these are zeros before their first update.
_ZERO_START = {"Adam", "AdamW", "Adamax", "RMSprop", "Adadelta", "Adagrad", "Adafactor",
               "RAdam"}


def _not_zero_start(opt: torch.optim.Optimizer) -> str | None:
    """None when ``opt``'s first step starts from zero state; else why not. (Only asked when
    the step reads the state: state it only writes, as a custom optimizer keeping the
    previous parameter does, may start from anything.)"""
    name = type(opt).__name__
    builtin = type(opt).__module__.startswith("torch.optim")
    if builtin and name == "SGD":
        for g in opt.param_groups:
            if g.get("momentum", 0) and g.get("dampening", 0):
                return ("SGD with momentum and dampening copies the first gradient into its "
                        "momentum buffer instead of damping it")
        return None
    if builtin and name in _ZERO_START:
        return None
    return (f"its first step may initialize its state to values other than zero "
            f"(only {', '.join(sorted(_ZERO_START | {'SGD'}))} are known to start from "
            "zeros)")


def _check_structure(cap: Captured, spec: pytree.TreeSpec, leaves: list) -> None:
    """DiphomaError unless the call's arguments have the traced structure (the same
    nesting, dict keys in the same order: a dict's leaves are bound by position) and the
    traced modules, optimizers and constants where the trace had them: the program trains
    the modules and optimizers it was traced with, and bakes constants in."""
    if cap.arg_spec is None:
        return
    if spec != cap.arg_spec:
        raise DiphomaError(
            f"the step is called with arguments of another structure than it was traced "
            f"with (traced: {_short(cap.arg_spec)}; called: {_short(spec)}); their leaves "
            "are bound by position, so a dict with its keys in another order would swap them",
            hint="call it with arguments built as the example was (the same keys in the same "
                 "order), or trace again")
    for i, want, where in cap.arg_fixed:
        got = leaves[i]
        if is_state(want) or is_state(got):
            if got is not want:
                raise DiphomaError(
                    f"{where} is another {type(got).__name__} than the "
                    f"{type(want).__name__} the step was traced with; the compiled step "
                    "reads and updates the modules and optimizers it was traced with",
                    hint="compile the step again for these (diphoma_compile.compile(step, "
                         "model, opt, ...)), or call it with the traced ones")
        elif not _same_constant(got, want):
            raise DiphomaError(
                f"{where} was {want!r:.60} when the step was traced and is {got!r:.60} "
                "now; arguments that are not tensors are constants of the trace",
                hint="pass a value that changes between calls as a tensor "
                     "(torch.tensor(0.5)), or trace again")


def _same_constant(a: object, b: object) -> bool:
    """The same constant: the same object, or equal by ``==`` where that gives a bool."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    try:
        eq = a == b
    except Exception:
        return False
    return eq if isinstance(eq, bool) else False


def _short(spec: pytree.TreeSpec) -> str:
    text = " ".join(str(spec).split())
    return text if len(text) <= 160 else text[:157] + "..."

