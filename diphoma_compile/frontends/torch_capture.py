"""Capture a PyTorch training step as one functional aten graph.

The step is ordinary PyTorch: it calls the model, ``loss.backward()``, maybe
``clip_grad_norm_``, ``opt.step()`` and ``opt.zero_grad()``. We swap the modules' parameters
and buffers, the optimizers' state and learning rates for fake tensors that are graph inputs,
trace the call with make_fx in fake mode (no real tensor is touched), and functionalize the
result so that no in-place op survives. ``Captured`` holds the fx graph, where each flat input
comes from and each flat output goes to, and the phase and source line of every node."""

from __future__ import annotations

import contextlib
import inspect
import os
import re
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree

from ..errors import FrontendError
from ..ir.core import Phase

aten = torch.ops.aten
LR_DTYPE = torch.float64  # a Python float learning rate is a double: keep it one


@dataclass(frozen=True)
class Slot:
    """Where a flat graph input comes from, or where an output goes."""

    kind: str    # param, buffer, opt_state, lr, arg
    owner: int   # index of the module or optimizer (arg: 0)
    key: tuple   # param/buffer: (qualname,); opt_state: (param index, state key);
                 # lr: (group index,); arg: (leaf index,)
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
    state_keys: list[list[tuple[str, torch.Size, torch.dtype]]]  # per param: its state
    phase: dict[str, Phase] = field(default_factory=dict)   # fx node name -> phase
    loc: dict[str, str] = field(default_factory=dict)       # fx node name -> "file:line"
    name: str = "step"
    settings: tuple = ()   # what the trace baked in, from settings_of(); checked per call
    clears_grads: bool = True   # the step zero_grads before backward: a leftover .grad is moot


_LIVE_KEYS = {"params", "lr", "initial_lr"}   # read per call, or not used by step()


def settings_of(modules: list[torch.nn.Module], opts: list[torch.optim.Optimizer]) -> tuple:
    """Everything a trace bakes in that a user may change between calls: the optimizers'
    hyperparameters other than the learning rate, their group count, train/eval modes."""
    groups = tuple(tuple(sorted((k, repr(v)) for k, v in g.items() if k not in _LIVE_KEYS))
                   for opt in opts for g in opt.param_groups)
    modes = tuple(sub.training for m in modules for sub in m.modules())
    return tuple(len(o.param_groups) for o in opts), groups, modes


# ------------------------------------------------------------------ finding the state

def _closure_objects(fn: Callable) -> list[Any]:
    out = []
    for c in getattr(fn, "__closure__", None) or ():
        with contextlib.suppress(ValueError):
            out.append(c.cell_contents)
    code, glb = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
    if code is not None:
        out.extend(glb[n] for n in code.co_names if n in glb)
    return out


def find_state(fn: Callable, args: tuple) -> tuple[list[torch.nn.Module],
                                                   list[torch.optim.Optimizer]]:
    """Modules and optimizers among the arguments (top level) and the closure of ``fn``."""
    modules: list[torch.nn.Module] = []
    opts: list[torch.optim.Optimizer] = []
    for obj in list(args) + _closure_objects(fn):
        if isinstance(obj, torch.nn.Module) and all(obj is not m for m in modules):
            modules.append(obj)
        elif isinstance(obj, torch.optim.Optimizer) and all(obj is not o for o in opts):
            opts.append(obj)
    # a submodule of another module found is owned by that one
    return [m for m in modules if not any(
        m is not o and any(m is s for s in o.modules()) for o in modules)], opts


def _is_state(x: Any) -> bool:
    return isinstance(x, (torch.nn.Module, torch.optim.Optimizer))


def _param_names(fn: Callable) -> list[str]:
    """The names of ``fn``'s parameters, in order (none for builtins without a signature)."""
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def _arg_path_name(path: tuple, by_pos: dict[int, str]) -> str:
    """``batch.x`` for the leaf x of the step's argument named batch."""
    if path and hasattr(path[0], "idx") and path[0].idx in by_pos:
        rest = _path_name(path[1:])
        return by_pos[path[0].idx] + ("." + rest if rest else "")
    return _path_name(path)


def _path_name(path: tuple) -> str:
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
    return ".".join(parts)


# ------------------------------------------------------------------ phases and locations

class _Marks:
    """Node counts of the graph being traced when the step enters and leaves backward."""

    def __init__(self) -> None:
        self.marks: list[tuple[int, Phase]] = [(0, Phase.forward)]

    def mark(self, phase: Phase) -> None:
        mode = get_proxy_mode()
        if mode is not None:
            self.marks.append((len(mode.tracer.graph.nodes), phase))

    def phase_of(self, index: int) -> Phase:
        cur = Phase.forward
        for start, ph in self.marks:
            if index >= start:
                cur = ph
        return cur

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        orig_backward, orig_grad = torch.autograd.backward, torch.autograd.grad

        def wrap(orig):
            def inner(*a, **k):
                self.mark(Phase.backward)
                try:
                    return orig(*a, **k)
                finally:
                    self.mark(Phase.update)  # gradient clipping and the optimizer follow
            return inner
        with mock.patch("torch.autograd.backward", wrap(orig_backward)), \
                mock.patch("torch.autograd.grad", wrap(orig_grad)):
            yield


_INTERNAL = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)),
             os.path.dirname(contextlib.__file__))
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def user_location(stack_trace: str | None) -> str | None:
    """The innermost frame of a node's stack trace that is the user's code: ``file:line``."""
    if not stack_trace:
        return None
    best = None
    for path, line, _ in _FRAME.findall(stack_trace):
        if not path.startswith(_INTERNAL) and not path.startswith("<"):
            best = f"{os.path.basename(path)}:{line}"
    return best


# ------------------------------------------------------------------ tracing

@contextlib.contextmanager
def _bind_optimizer(opt: torch.optim.Optimizer, groups: list[list[torch.Tensor]],
                    state: dict, lrs: list[torch.Tensor]) -> Iterator[None]:
    """Point ``opt`` at traced parameters, state and learning rates; restore afterwards."""
    saved = [(g["params"], g["lr"]) for g in opt.param_groups]
    saved_state = opt.state
    try:
        for g, ps, lr in zip(opt.param_groups, groups, lrs):
            g["params"], g["lr"] = ps, lr
        opt.state = state
        yield
    finally:
        for g, (ps, lr) in zip(opt.param_groups, saved):
            g["params"], g["lr"] = ps, lr
        opt.state = saved_state


class _Step:
    """The user's step as a function of flat tensors: params, buffers, state, lrs, args."""

    def __init__(self, fn: Callable, args: tuple, modules, opts) -> None:
        self.fn, self.args, self.modules, self.opts = fn, args, modules, opts
        params = _param_names(fn)
        names = {id(a): params[i] for i, a in enumerate(args) if i < len(params)}
        prefix = len(modules) > 1
        self.param_slots: list[Slot] = []
        self.params: list[torch.Tensor] = []
        self.buffer_slots: list[Slot] = []
        self.buffers: list[torch.Tensor] = []
        index_of: dict[int, int] = {}
        seen_buffers: set[int] = set()
        for mi, m in enumerate(modules):
            pre = (names.get(id(m), f"module{mi}") + ".") if prefix else ""
            for q, p in m.named_parameters():
                if id(p) in index_of:
                    continue   # shared with a module found earlier: one input, not two
                index_of[id(p)] = len(self.params)
                self.param_slots.append(Slot("param", mi, (q,), pre + q))
                self.params.append(p)
            for q, b in m.named_buffers():
                if id(b) in seen_buffers:
                    continue
                seen_buffers.add(id(b))
                self.buffer_slots.append(Slot("buffer", mi, (q,), pre + q))
                self.buffers.append(b)
        self.groups: list[list[list[int]]] = []   # optimizer -> group -> param indices
        for oi, opt in enumerate(opts):
            gs = []
            for g in opt.param_groups:
                idx = []
                for p in g["params"]:
                    if id(p) not in index_of:
                        raise FrontendError(
                            f"optimizer {oi} ({type(opt).__name__}) updates a tensor of shape "
                            f"{tuple(p.shape)} that is a parameter of no module the step "
                            "uses", hint="pass the module(s) owning the optimizer's parameters"
                                         " to the step")
                    idx.append(index_of[id(p)])
                gs.append(idx)
            self.groups.append(gs)
        self.lr_slots = [Slot("lr", oi, (gi,), "lr" if len(opts) == 1 and len(gs) == 1
                              else f"opt{oi}.group{gi}.lr")
                         for oi, gs in enumerate(self.groups) for gi in range(len(gs))]
        leaves, self.arg_spec = pytree.tree_flatten_with_path(args, is_leaf=_is_state)
        self.arg_leaves = [leaf for _, leaf in leaves]
        by_pos = dict(enumerate(params))
        self.arg_slots = [Slot("arg", 0, (i,), _arg_path_name(path, by_pos) or f"arg{i}")
                          for i, (path, leaf) in enumerate(leaves)
                          if isinstance(leaf, torch.Tensor)]
        self.state_keys: list[list[tuple[str, torch.Size, torch.dtype]]] = []
        self.user_spec: pytree.TreeSpec | None = None
        self.n_user = 0
        self.grads_left: list[int] = []    # params whose .grad the step leaves set
        self.cleared_first = False         # zero_grad came before the first backward
        self.backward_seen = False

    # --------------------------------------------------------------- optimizer state
    def live_state_keys(self) -> list[list[tuple[str, torch.Size, torch.dtype]]] | None:
        """State layout from the optimizers' live state, None when they have none yet."""
        keys, empty, full = [], 0, 0
        owner = self._owner_of_param()
        for pi, p in enumerate(self.params):
            opt = owner.get(pi)
            st = opt.state.get(p, {}) if opt is not None else {}
            if not st:
                empty += 1
            else:
                full += 1
            keys.append([(k, v.shape, v.dtype) for k, v in sorted(st.items())
                         if isinstance(v, torch.Tensor)])
            bad = [k for k, v in st.items() if not isinstance(v, torch.Tensor)]
            if bad:
                raise FrontendError(f"optimizer state {bad[0]!r} of {self.param_slots[pi].name}"
                                    " is not a tensor", hint="only tensor state can be traced")
        if full and empty:
            raise FrontendError("some parameters have optimizer state and some do not",
                                hint="trace before the first step or after it, not between")
        return keys if full else None

    def _owner_of_param(self) -> dict[int, torch.optim.Optimizer]:
        return {pi: self.opts[oi] for oi, gs in enumerate(self.groups) for g in gs for pi in g}

    def state_slots(self) -> list[Slot]:
        """One slot per optimizer state tensor: ``<param>.<key>``."""
        owner = {pi: oi for oi, gs in enumerate(self.groups) for g in gs for pi in g}
        return [Slot("opt_state", owner[pi], (pi, k), f"{self.param_slots[pi].name}.{k}")
                for pi, keys in enumerate(self.state_keys) for k, _, _ in keys]

    # --------------------------------------------------------------- the flat function
    def __call__(self, *flat: torch.Tensor):
        n_p, n_b = len(self.params), len(self.buffers)
        n_s = sum(len(k) for k in self.state_keys)
        n_lr = len(self.lr_slots)
        # frozen parameters stay frozen: no gradient is computed for them
        ps = [t.detach().requires_grad_(p.requires_grad) for t, p in zip(flat[:n_p], self.params)]
        bs = list(flat[n_p:n_p + n_b])
        ss = flat[n_p + n_b:n_p + n_b + n_s]
        lrs = list(flat[n_p + n_b + n_s:n_p + n_b + n_s + n_lr])
        us = iter(flat[n_p + n_b + n_s + n_lr:])
        leaves = [next(us) if isinstance(leaf, torch.Tensor) else leaf
                  for leaf in self.arg_leaves]
        args = pytree.tree_unflatten(leaves, self.arg_spec)
        state: dict = defaultdict(dict)
        it = iter(ss)
        for pi, keys in enumerate(self.state_keys):
            for k, _, _ in keys:
                state[ps[pi]][k] = next(it)
        with contextlib.ExitStack() as stack:
            for mi, m in enumerate(self.modules):
                tensors = {s.key[0]: t for s, t in zip(self.param_slots, ps) if s.owner == mi}
                tensors.update({s.key[0]: t for s, t in zip(self.buffer_slots, bs)
                                if s.owner == mi})
                stack.enter_context(_reparametrize_module(m, tensors, tie_weights=True))
            stack.enter_context(self._watch_grad_clearing())
            lr_it = iter(lrs)
            for oi, opt in enumerate(self.opts):
                groups = [[ps[i] for i in g] for g in self.groups[oi]]
                # .item() of a fake tensor is a symbolic float: the optimizer does its usual
                # Python-double arithmetic on it, and that arithmetic is traced
                glrs = [next(lr_it).item() for _ in groups]
                stack.enter_context(_bind_optimizer(opt, groups, state, glrs))
            out = self.fn(*args)
            new_buffers = [self._buffer_now(m_slot, bs[i]) for i, m_slot in
                           enumerate(self.buffer_slots)]
        out_leaves, self.user_spec = pytree.tree_flatten(out)
        for leaf in out_leaves:
            if not isinstance(leaf, torch.Tensor):
                raise FrontendError(f"the step returns a {type(leaf).__name__}; a traced step "
                                    "returns tensors (the loss, metrics) or nothing",
                                    hint="return loss, not loss.item()")
        self.n_user = len(out_leaves)
        new_state = [state[ps[pi]][k] for pi, keys in enumerate(self.state_keys)
                     for k, _, _ in keys]
        # gradients the step leaves in .grad (zero_grad before backward) are outputs too
        self.grads_left = [pi for pi, p in enumerate(ps) if p.grad is not None]
        return (*[t.detach() for t in out_leaves], *[p.detach() for p in ps],
                *new_buffers, *new_state, *[ps[pi].grad.detach() for pi in self.grads_left])

    @contextlib.contextmanager
    def _watch_grad_clearing(self) -> Iterator[None]:
        """Notes whether the step clears gradients (zero_grad) before its first backward:
        if not, eager would add to whatever .grad holds when it is called."""
        self.cleared_first = False
        self.backward_seen = False
        zero_opt, zero_mod = torch.optim.Optimizer.zero_grad, torch.nn.Module.zero_grad
        backward, grad = torch.autograd.backward, torch.autograd.grad

        def clearing(orig):
            def inner(*a, **k):
                self.cleared_first |= not self.backward_seen
                return orig(*a, **k)
            return inner

        def differentiating(orig):
            def inner(*a, **k):
                self.backward_seen = True
                return orig(*a, **k)
            return inner
        with mock.patch.object(torch.optim.Optimizer, "zero_grad", clearing(zero_opt)), \
                mock.patch.object(torch.nn.Module, "zero_grad", clearing(zero_mod)), \
                mock.patch("torch.autograd.backward", differentiating(backward)), \
                mock.patch("torch.autograd.grad", differentiating(grad)):
            yield

    def _buffer_now(self, slot: Slot, traced: torch.Tensor) -> torch.Tensor:
        # A module may rebind a buffer (self.num_batches_tracked = t + 1) instead of
        # updating it in place: read whatever the module holds now.
        mod = self.modules[slot.owner]
        *path, leaf = slot.key[0].split(".")
        for p in path:
            mod = getattr(mod, p)
        now = getattr(mod, leaf)
        return now if isinstance(now, torch.Tensor) else traced


def _discover_state(step: _Step) -> list[list[tuple[str, torch.Size, torch.dtype]]]:
    """The state layout a fresh optimizer creates in its first step(), learned by running
    only the optimizers, on fake parameters with zero gradients."""
    fake = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True)
    ps = [_fake_of(fake, p).requires_grad_(p.requires_grad) for p in step.params]
    state: dict = defaultdict(dict)
    with fake, contextlib.ExitStack() as stack:
        for fp in ps:
            if fp.requires_grad:
                fp.grad = torch.zeros_like(fp)
        for oi, opt in enumerate(step.opts):
            groups = [[ps[i] for i in g] for g in step.groups[oi]]
            stack.enter_context(_bind_optimizer(opt, groups, state,
                                                [g["lr"] for g in opt.param_groups]))
        for opt in step.opts:
            opt.step()
    return [[(k, v.shape, v.dtype) for k, v in sorted(state[fp].items())
             if isinstance(v, torch.Tensor)] for fp in ps]


def _fake_of(fake: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    """A fake copy of ``t``. A meta tensor (a model built on the meta device, to plan
    without allocating it) becomes a fake CPU tensor, so that it mixes with the CPU
    tensors the model's own code makes (``torch.arange(t)``) as real parameters would."""
    t = t.detach()
    if t.is_meta:
        with fake:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
    return fake.from_tensor(t)


def _fake_inputs(step: _Step) -> list[torch.Tensor]:
    # A fresh fake mode per trace, with a shape environment so that .item() (Adam's step
    # count, the learning rate) gives a symbolic float instead of failing.
    fake = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True)

    def f(t: torch.Tensor) -> torch.Tensor:
        return _fake_of(fake, t)
    # optimizer state starts as meta tensors: no memory for it, even at 124M parameters
    states = [torch.empty(shape, dtype=dt, device="meta") for keys in step.state_keys
              for _, shape, dt in keys]
    lrs = [torch.zeros((), dtype=LR_DTYPE) for _ in step.lr_slots]
    return ([f(p) for p in step.params] + [f(b) for b in step.buffers] + [f(t) for t in states]
            + [f(t) for t in lrs]
            + [f(t) for t in step.arg_leaves if isinstance(t, torch.Tensor)])


def _trace(step: _Step, inputs: list[torch.Tensor], marks: _Marks | None,
           stack_traces: bool) -> fx.GraphModule:
    if stack_traces:
        # make_fx keeps only frames of forward() methods and registered anchors: anchor
        # the step itself so that its own lines (loss.backward(), opt.step()) show too.
        anchor = getattr(fx.proxy, "_register_stack_trace_anchor", None)
        if anchor is not None:
            anchor(step.fn)
    ctx = marks.watching() if marks is not None else contextlib.nullcontext()
    with ctx:
        return make_fx(step, tracing_mode="fake", record_stack_traces=stack_traces)(*inputs)


class _Replay(fx.Interpreter):
    """Runs a traced graph node by node, noting which new nodes each one made."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.made: list[tuple[int, fx.Node]] = []

    def run_node(self, n: fx.Node) -> Any:
        mode = get_proxy_mode()
        if mode is not None:
            self.made.append((len(mode.tracer.graph.nodes), n))
        return super().run_node(n)


def _functionalize(gm: fx.GraphModule, inputs: list[torch.Tensor]):
    replay = _Replay(gm)
    # Views stay views: a transposed weight must reach addmm as a view, as in eager code,
    # or the matrix kernel takes another path and rounds differently.
    fn = torch.func.functionalize(lambda *a: replay.run(*a), remove="mutations")
    return make_fx(fn, tracing_mode="fake")(*inputs), replay.made


def capture(step_fn: Callable, *args: Any) -> Captured:
    """Trace ``step_fn(*args)`` into a functional aten graph without running it for real."""
    modules, opts = find_state(step_fn, args)
    if not opts:
        raise FrontendError("the step uses no torch.optim optimizer (none among its "
                            "arguments or in its closure)",
                            hint="pass the optimizer to the step, e.g. step(model, opt, batch)")
    step = _Step(step_fn, args, modules, opts)
    live = step.live_state_keys()
    step.state_keys = live if live is not None else _discover_state(step)
    marks = _Marks()
    gm1 = _trace(step, _fake_inputs(step), marks, True)
    gm1_nodes = list(gm1.graph.nodes)
    gm2, made = _functionalize(gm1, _fake_inputs(step))
    phase, loc = _attribute(gm1_nodes, marks, gm2, made)
    if step.grads_left and not step.cleared_first:
        raise FrontendError(
            "the step leaves gradients in .grad without clearing them before backward(), so "
            "eager PyTorch would add each call's gradients to the previous ones",
            hint="call opt.zero_grad() in the step (before backward or after opt.step())")
    outputs: list[Slot | None] = [None] * step.n_user
    outputs += step.param_slots + step.buffer_slots + step.state_slots()
    outputs += [Slot("grad", 0, (pi,), f"{step.param_slots[pi].name}.grad")
                for pi in step.grads_left]
    slots = step.param_slots + step.buffer_slots + step.state_slots() + step.lr_slots + \
        step.arg_slots
    return Captured(gm2, slots, outputs, step.user_spec, modules, opts, step.params,
                    step.state_keys, phase, loc, getattr(step_fn, "__name__", "step"),
                    settings_of(modules, opts), step.cleared_first)


def _attribute(gm1_nodes: list[fx.Node], marks: _Marks, gm2: fx.GraphModule,
               made: list[tuple[int, fx.Node]]):
    """Phase and source location of every node of the functional graph, from its origin."""
    index1 = {n: i for i, n in enumerate(gm1_nodes)}
    phase: dict[str, Phase] = {}
    loc: dict[str, str] = {}
    k = -1
    for i, n in enumerate(gm2.graph.nodes):
        while k + 1 < len(made) and made[k + 1][0] <= i:
            k += 1
        if n.op not in ("call_function", "get_attr") or k < 0:
            continue
        origin = made[k][1]
        phase[n.name] = marks.phase_of(index1.get(origin, 0))
        where = user_location(origin.meta.get("stack_trace"))
        if where:
            loc[n.name] = where
    return phase, loc
