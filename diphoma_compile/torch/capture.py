"""Capture a PyTorch training step as one functional aten graph.

The step is ordinary PyTorch: it calls the model, ``loss.backward()``, maybe
``clip_grad_norm_``, ``opt.step()`` and ``opt.zero_grad()``. We swap the modules' parameters
and buffers, the optimizers' state and learning rates for fake tensors that are graph inputs,
trace the call once with make_fx in fake mode (no real tensor is touched), functionalizing as
it goes so that no in-place op survives. ``Captured`` holds the fx graph, where each flat input
comes from and each flat output goes to, the phase and source line of every node, and the
host effects (``effects.py``) the runtime replays around the program."""

from __future__ import annotations

import builtins
import contextlib
import inspect
import operator
import os
import sys
import types
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch._subclasses.functional_tensor import FunctionalTensorMode, dispatch_functionalize
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree

from ..errors import FrontendError
from ..ir.core import Phase
from .codegen import check_codegen
from .effects import INTERNAL_PATHS, HostWatch, StaleValue
from .library_hooks import tracing_known_to_libraries
from .ops import draws_random
from .pystate import module_scalars, read_now, step_reads, submodules
from .state import (LR_DTYPE, Captured, Slot, StateKey, hyper_value, is_state, settings_of,
                    sign)

aten = torch.ops.aten
def cycled_keys(opt: torch.optim.Optimizer) -> list[tuple[str, int | None]]:
    """The hyperparameters other than lr that a scheduler attached to ``opt`` changes.

    OneCycleLR and CyclicLR with ``cycle_momentum=True`` (their default) mark the groups
    with ``max_momentum`` and ``base_momentum`` and write ``betas[0]`` (Adam, AdamW) or
    ``momentum`` (SGD, RMSprop) on every step; no other torch scheduler writes anything but
    ``lr``. These become graph inputs only where such a scheduler is attached, so a step
    without one traces exactly as before."""
    if not any("max_momentum" in g and "base_momentum" in g for g in opt.param_groups):
        return []
    first = opt.param_groups[0]
    if isinstance(first.get("betas"), tuple):
        return [("betas", 0)]
    if "momentum" in first:
        return [("momentum", None)]
    return []


def _hyper_name(key: str, idx: int | None) -> str:
    if key == "betas" and idx is not None:
        return f"beta{idx + 1}"
    return key if idx is None else f"{key}.{idx}"


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

class _Recorder:
    """The phase and the user's source line of every node, noted as the tracer makes it.

    Phases: ops before ``backward()`` (or ``autograd.grad``) are forward, ops inside it
    backward, ops after it update (clipping, the optimizer). The line is that of the
    innermost frame on the Python stack that is a ``forward`` method or the step itself,
    outside torch and this package: found by walking the live frames, which costs far less
    than the formatted stack trace make_fx would record for every node."""

    def __init__(self, step_fn: Callable) -> None:
        code = getattr(step_fn, "__code__", None)
        self.anchors = {(code.co_filename, code.co_name)} if code is not None else set()
        self.current = Phase.forward
        self.draws = 0                      # random draws from the global generator so far
        self.phase: dict[str, Phase] = {}   # fx node name -> phase
        self.loc: dict[str, str] = {}       # fx node name -> "file:line"
        # code object -> its file's name if it is the user's, None if not, "" for the
        # function the trace starts in (the walk stops there)
        self._file: dict[Any, str | None] = {}

    def stop_at(self, fn: Callable) -> None:
        """Frames below ``fn``'s (the tracer's, the caller's) are not the step's."""
        self._file[fn.__code__] = ""

    def _user_file(self, code: Any) -> str | None:
        path = code.co_filename
        if code.co_name != "forward" and (path, code.co_name) not in self.anchors:
            return None
        if path.startswith(INTERNAL_PATHS) or path.startswith("<"):
            return None
        return os.path.basename(path)

    def user_line(self) -> str | None:
        """``file:line`` of the innermost frame of the user's model or step now running."""
        files = self._file
        frame = sys._getframe(1)
        while frame is not None:
            code = frame.f_code
            try:
                name = files[code]
            except KeyError:
                name = files[code] = self._user_file(code)
            if name is not None:
                return f"{name}:{frame.f_lineno}" if name else None
            frame = frame.f_back
        return None

    @contextlib.contextmanager
    def recording(self, tracer: Any) -> Iterator[None]:
        """Note phase and line of each op node ``tracer`` creates."""
        create = tracer.create_node

        def create_node(kind, target, *args, **kwargs):
            node = create(kind, target, *args, **kwargs)
            if kind in ("call_function", "get_attr"):
                self.phase[node.name] = self.current
                self.draws += kind == "call_function" and draws_random(target)
                # an element of a list result (a foreach op's) has its op's line
                where = self.user_line() if target is not operator.getitem else None
                if where is not None:
                    self.loc[node.name] = where
            return node
        tracer.create_node = create_node
        try:
            yield
        finally:
            del tracer.create_node

    @contextlib.contextmanager
    def watching(self, opts: list[torch.optim.Optimizer] = ()) -> Iterator[None]:
        """Follow the step into and out of backward; FrontendError for a backward after an
        optimizer in ``opts`` stepped (the IR's step has one update, after its backward)."""
        orig_backward, orig_grad = torch.autograd.backward, torch.autograd.grad

        since = [None]      # how many nodes were noted when the last backward ended
        depth = [0]         # backwards running (a reentrant checkpoint's inside another)
        stepped: list[str] = []     # where an optimizer stepped: "Adam.step() at file:line"

        def wrap(orig):
            def inner(*a, **k):
                if stepped and depth[0] == 0:
                    raise FrontendError(
                        f"the step runs backward() again after {stepped[0]}: one traced "
                        "step holds one update, after its last backward (a GAN's "
                        "alternating updates, or an optimizer step per micro-batch, are "
                        "several)",
                        hint="compile one step per update (a discriminator step and a "
                             "generator step, each with its own backward() and opt.step()), "
                             "or accumulate the micro-batches' gradients and step once")
                if since[0] is not None and depth[0] == 0:
                    # another backward (gradient accumulation over micro-batches): what ran
                    # since the last one was the next micro-batch's forward, not the update
                    for name in list(self.phase)[since[0]:]:
                        if self.phase[name] is Phase.update:
                            self.phase[name] = Phase.forward
                self.current = Phase.backward
                depth[0] += 1
                try:
                    return orig(*a, **k)
                finally:
                    depth[0] -= 1
                    if depth[0] == 0:   # gradient clipping and the optimizer follow
                        self.current = Phase.update
                        since[0] = len(self.phase)
            return inner
        def noting(opt: torch.optim.Optimizer) -> None:
            if not stepped:
                where = self.user_line()
                stepped.append(f"{type(opt).__name__}.step()"
                               + (f" at {where}" if where else ""))
        with _around_steps(opts, noting), \
                mock.patch("torch.autograd.backward", wrap(orig_backward)), \
                mock.patch("torch.autograd.grad", wrap(orig_grad)):
            yield


# ------------------------------------------------------------------ tracing

@contextlib.contextmanager
def _bind_optimizer(opt: torch.optim.Optimizer, groups: list[list[torch.Tensor]],
                    state: dict, values: list[dict[str, Any]]) -> Iterator[list[dict]]:
    """Point ``opt`` at traced parameters, state and hyperparameter values; yield the
    groups as bound; afterwards put back every group as it was, whatever the step did."""
    listed, saved_list = opt.param_groups, list(opt.param_groups)
    saved = [dict(g) for g in saved_list]
    saved_state = opt.state
    try:
        for g, ps, vals in zip(opt.param_groups, groups, values):
            g["params"] = ps
            g.update(vals)
        opt.state = state
        yield [dict(g) for g in opt.param_groups]
    finally:
        opt.param_groups = listed
        listed[:] = saved_list
        for g, before in zip(saved_list, saved):
            g.clear()
            g.update(before)
        opt.state = saved_state


def _same(a: Any, b: Any) -> bool:
    """The same parameter-group value (a symbolic one only as itself)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (bool, int, float, str, type(None))):
        return repr(a) == repr(b)
    return False


_UNSET = object()


def _check_group_edits(opts: list[torch.optim.Optimizer], bound: list[list[dict]]) -> None:
    """FrontendError when the step changed a parameter group: it would change once, at
    trace time (the groups are put back afterwards)."""
    for oi, (opt, groups) in enumerate(zip(opts, bound)):
        name = f"{type(opt).__name__} (optimizer {oi})"
        if len(opt.param_groups) != len(groups):
            raise FrontendError(f"the step adds or removes parameter groups of {name} while "
                                "it is traced", hint="change the parameter groups outside "
                                                     "the step, then trace it again")
        for gi, (g, b) in enumerate(zip(opt.param_groups, groups)):
            for k in list(g) + [k for k in b if k not in g]:
                v, w = g.get(k, _UNSET), b.get(k, _UNSET)
                if k == "params" or _same(v, w) or isinstance(v, StaleValue) or (
                        isinstance(v, tuple) and any(isinstance(x, StaleValue) for x in v)):
                    continue
                hint = ("set the learning rate between calls (it is read on every call), or "
                        "use a torch.optim.lr_scheduler scheduler, whose step() may be "
                        "called inside the step" if k == "lr" else
                        "set it outside the step and trace again (the trace bakes it in), "
                        "or use a torch.optim.lr_scheduler scheduler")
                raise FrontendError(
                    f"the step sets param_groups[{gi}][{k!r}] of {name} while it is traced; "
                    "the compiled step would make that change once, at trace time, and never "
                    "again (it has been put back)", hint=hint)


class Step:
    """The user's step as a function of flat tensors: params, buffers, state, lrs, args."""

    def __init__(self, fn: Callable, args: tuple, modules: list[torch.nn.Module],
                 opts: list[torch.optim.Optimizer]) -> None:
        self.fn, self.args, self.modules, self.opts = fn, args, modules, opts
        params = _param_names(fn)
        names = {id(a): params[i] for i, a in enumerate(args) if i < len(params)}
        self.param_slots: list[Slot] = []
        self.params: list[torch.Tensor] = []
        self.buffer_slots: list[Slot] = []
        self.buffers: list[torch.Tensor] = []
        index_of = self._add_module_tensors(names)
        self.groups = self._param_groups(index_of)   # optimizer -> group -> param indices
        # hyperparameters read on every call: each group's lr, and what a scheduler cycles
        one = len(opts) == 1 and all(len(gs) == 1 for gs in self.groups)
        self.hyper_slots = [
            Slot("hyper", oi, (gi, key, idx), _hyper_name(key, idx) if one
                 else f"opt{oi}.group{gi}.{_hyper_name(key, idx)}")
            for oi, gs in enumerate(self.groups) for gi in range(len(gs))
            for key, idx in [("lr", None)] + cycled_keys(opts[oi])]
        self.hyper_signs = {s.name: sign(hyper_value(opts[s.owner], s))
                            for s in self.hyper_slots if s.key[1] != "lr"}
        self.arg_paths, self.arg_spec = pytree.tree_flatten_with_path(args, is_leaf=is_state)
        self.arg_leaves = [leaf for _, leaf in self.arg_paths]
        by_pos = dict(enumerate(params))
        self.arg_names = [_arg_path_name(path, by_pos) or f"arg{i}"
                          for i, (path, _) in enumerate(self.arg_paths)]
        self.arg_slots = [Slot("arg", 0, (i,), _arg_path_name(path, by_pos) or f"arg{i}")
                          for i, (path, leaf) in enumerate(self.arg_paths)
                          if isinstance(leaf, torch.Tensor)]
        self.state_keys: list[list[StateKey]] = []
        self.user_spec: pytree.TreeSpec | None = None
        self.user_nones: tuple[int, ...] = ()
        self.n_user = 0
        self.grads_left: list[int] = []    # params whose .grad the step leaves set
        self.cleared_first = False         # zero_grad came before the first backward
        # parameters whose .grad a zero_grad(set_to_none=False) zeroed after the last
        # backward (their leftover .grad is zeros, which backward adds nothing to)
        self.zeroed_last: set[int] = set()
        self.backward_seen = False
        self.tensor_hyper = False          # every optimizer's math on tensors (Inductor)
        # the optimizers traced in their tensor (capturable) math alone: those whose eager
        # step() branches on its step count (counts_on_host)
        self.tensor_opts: frozenset[int] = frozenset()

    def _add_module_tensors(self, names: dict[int, str]) -> dict[int, int]:
        """Slots for the modules' parameters and buffers (each tensor once, named after the
        step's argument when there are several modules); id of a parameter -> its index."""
        prefix = len(self.modules) > 1
        index_of: dict[int, int] = {}
        seen_buffers: set[int] = set()
        for mi, m in enumerate(self.modules):
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
        return index_of

    def _param_groups(self, index_of: dict[int, int]) -> list[list[list[int]]]:
        """The parameter indices of each optimizer's groups; FrontendError for a tensor that
        is a parameter of no module found."""
        groups = []
        for oi, opt in enumerate(self.opts):
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
            groups.append(gs)
        return groups

    # --------------------------------------------------------------- optimizer state
    def live_state_keys(self) -> list[list[StateKey]] | None:
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
            keys.append([(k, v.shape, v.dtype, _device_of_state(v, p))
                         for k, v in sorted(st.items()) if isinstance(v, torch.Tensor)])
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
                for pi, keys in enumerate(self.state_keys) for k, *_ in keys]

    # --------------------------------------------------------------- the flat function
    def __call__(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The step's results, then the new parameters, buffers and optimizer state, then
        the gradients it leaves in .grad."""
        n_p, n_b = len(self.params), len(self.buffers)
        n_s = sum(len(k) for k in self.state_keys)
        n_h = len(self.hyper_slots)
        # frozen parameters stay frozen: no gradient is computed for them
        ps = [t.requires_grad_(p.requires_grad) for t, p in zip(flat[:n_p], self.params)]
        bs = list(flat[n_p:n_p + n_b])
        ss = flat[n_p + n_b:n_p + n_b + n_s]
        hyper = list(flat[n_p + n_b + n_s:n_p + n_b + n_s + n_h])
        us = iter(flat[n_p + n_b + n_s + n_h:])
        leaves = [next(us) if isinstance(leaf, torch.Tensor) else leaf
                  for leaf in self.arg_leaves]
        args = pytree.tree_unflatten(leaves, self.arg_spec)
        state: dict = defaultdict(dict)
        it = iter(ss)
        wide = self.wide_counts()
        for pi, keys in enumerate(self.state_keys):
            for k, *_ in keys:
                state[ps[pi]][k] = next(it)
        with contextlib.ExitStack() as stack:
            for mi, m in enumerate(self.modules):
                tensors = {s.key[0]: t for s, t in zip(self.param_slots, ps) if s.owner == mi}
                tensors.update({s.key[0]: t for s, t in zip(self.buffer_slots, bs)
                                if s.owner == mi})
                stack.enter_context(_reparametrize_module(m, tensors, tie_weights=True))
            stack.enter_context(self._watch_grad_clearing())
            if self.tensor_hyper or self.tensor_opts:
                stack.enter_context(self.tensor_math())
            values = self._hyper_values(hyper)
            bound = []
            for oi, opt in enumerate(self.opts):
                groups = [[ps[i] for i in g] for g in self.groups[oi]]
                bound.append(stack.enter_context(_bind_optimizer(opt, groups, state,
                                                                 values[oi])))
            if wide:
                stack.enter_context(_counts_widened(self.opts, {
                    oi: [(ps[pi], k) for pi, k in sorted(wide) if pi in set().union(*g)]
                    for oi, g in enumerate(self.groups) if oi in self.tensor_opts}))
            out = self.fn(*args)
            _check_group_edits(self.opts, bound)
            self._check_arguments(args, leaves)
            new_buffers = [self._buffer_now(m_slot, bs[i]) for i, m_slot in
                           enumerate(self.buffer_slots)]
        out_leaves, self.user_spec = pytree.tree_flatten(out)
        # None returned (alone, or in a tuple: no metric this step) comes back as None
        self.user_nones = tuple(i for i, leaf in enumerate(out_leaves) if leaf is None)
        out_leaves = [leaf for leaf in out_leaves if leaf is not None]
        for leaf in out_leaves:
            if not isinstance(leaf, torch.Tensor):
                raise FrontendError(f"the step returns a {type(leaf).__name__}; a traced step "
                                    "returns tensors (the loss, metrics), None or nothing",
                                    hint="return loss, not loss.item()")
        self.n_user = len(out_leaves)
        new_state = [state[ps[pi]][k].to(dt) if (pi, k) in wide else state[ps[pi]][k]
                     for pi, keys in enumerate(self.state_keys) for k, _, dt, _ in keys]
        # gradients the step leaves in .grad (zero_grad before backward) are outputs too
        self.grads_left = [pi for pi, p in enumerate(ps) if p.grad is not None]
        self.grads_zeroed = bool(self.grads_left) and \
            all(id(ps[pi]) in self.zeroed_last for pi in self.grads_left)
        return (*[t.detach() for t in out_leaves], *ps,
                *new_buffers, *new_state, *[ps[pi].grad.detach() for pi in self.grads_left])

    def _check_arguments(self, args: tuple, leaves: list[Any]) -> None:
        """FrontendError when the step changed its arguments (the traced copies of them):
        an item set or added, a tensor updated in place (EMA weights kept in a list). The
        program writes back only the modules' and optimizers' state."""
        now, spec = pytree.tree_flatten(args, is_leaf=is_state)
        hint = ("keep such values in a module passed to the step (parameters, or "
                "register_buffer; EMA weights in copy.deepcopy(model)), whose tensors are "
                "traced state, or change them outside the step")
        if spec != self.arg_spec:
            raise FrontendError("the step adds or removes items of its arguments while it is "
                                "traced; the compiled step would not", hint=hint)
        for name, v, w in zip(self.arg_names, now, leaves):
            if isinstance(w, torch.Tensor):
                elem = getattr(w, "elem", None)
                if v is w and not (elem is not None
                                   and torch._functionalize_has_data_mutation(elem)):
                    continue
                what = "updates its argument {} in place" if v is w else "replaces {}"
            elif v is w or _same(v, w):
                continue
            else:
                what = f"changes its argument {{}} from {w!r:.40} to {v!r:.40}"
            raise FrontendError(
                f"the step {what.format(name)}; the compiled step writes back only the "
                "parameters, buffers and optimizer state of the modules and optimizers it "
                "uses", hint=hint)

    def tensor_math(self) -> contextlib.AbstractContextManager:
        """Every optimizer's math on tensors (for Inductor), or only that of those whose
        step() branches on its step count, within their step()."""
        if self.tensor_hyper:
            return _tensor_optimizer_math(self.opts)
        return _tensor_optimizer_math([self.opts[i] for i in sorted(self.tensor_opts)],
                                      scoped=True)

    def wide_counts(self) -> set[tuple[int, str]]:
        """(parameter, state key) of the step counts that the optimizers branching on them
        (``counts_on_host``) count in float64 while traced, so that their math on the count
        (RAdam's rho_t, a difference of two numbers near 2 / (1 - beta2)) keeps the
        precision of eager's Python floats (``_counts_widened``); the new count is stored in
        its own dtype."""
        return {(pi, k) for oi in self.tensor_opts for g in self.groups[oi] for pi in g
                for k, shape, dt, _ in self.state_keys[pi]
                if k == "step" and shape == () and dt.is_floating_point}

    def _hyper_values(self, hyper: list[torch.Tensor]) -> list[list[dict[str, Any]]]:
        """Per optimizer and group, the traced values to bind. ``.item()`` of a fake tensor
        is a symbolic float: the optimizer does its usual Python-double arithmetic on it,
        and that arithmetic is traced. A value's sign is assumed (``torch._check``), so that
        the optimizer may branch on it (``if momentum != 0``); the runtime checks it."""
        values: list[list[dict[str, Any]]] = [[{} for _ in gs] for gs in self.groups]
        for slot, t in zip(self.hyper_slots, hyper):
            gi, key, idx = slot.key
            # for a code generator: the value stays a 0-d tensor, so no .item() cuts the graph
            v = t if self.tensor_hyper or slot.owner in self.tensor_opts else t.item()
            given = self.opts[slot.owner].param_groups[gi][key]
            given = given if idx is None else given[idx]
            if isinstance(given, torch.Tensor):
                # the user's own tensor (``lr=torch.tensor(1e-3)``): eager does tensor math
                # in its dtype, not Python doubles
                v = t.to(dtype=given.dtype)
            s = self.hyper_signs.get(slot.name)
            if s is not None and not isinstance(v, torch.Tensor):
                torch._check(v > 0 if s > 0 else v < 0 if s < 0 else v == 0)
            group = values[slot.owner][gi]
            if idx is None:
                group[key] = v
            else:
                whole = list(group.get(key, self.opts[slot.owner].param_groups[gi][key]))
                whole[idx] = v
                group[key] = tuple(whole)
        return values

    @contextlib.contextmanager
    def _watch_grad_clearing(self) -> Iterator[None]:
        """Notes whether the step clears gradients (zero_grad) before its first backward:
        if not, eager would add to whatever .grad holds when it is called."""
        self.cleared_first = False
        self.backward_seen = False
        self.zeroed_last = set()
        zero_opt, zero_mod = torch.optim.Optimizer.zero_grad, torch.nn.Module.zero_grad
        backward, grad = torch.autograd.backward, torch.autograd.grad

        def clearing(orig):
            def inner(*a, **k):
                self.cleared_first |= not self.backward_seen
                to_none = k.get("set_to_none", a[1] if len(a) > 1 else True)
                if not to_none:
                    owner = a[0]
                    params = [p for g in owner.param_groups for p in g["params"]] \
                        if isinstance(owner, torch.optim.Optimizer) else \
                        list(owner.parameters())
                    self.zeroed_last.update(id(p) for p in params)
                return orig(*a, **k)
            return inner

        def differentiating(orig):
            def inner(*a, **k):
                self.backward_seen = True
                self.zeroed_last = set()
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


def _discover_state(step: Step) -> list[list[StateKey]]:
    """The state layout a fresh optimizer creates in its first step(), learned by running
    only the optimizers on parameters with zero gradients: meta tensors first (no memory,
    and no dispatch through Python), fake tensors when the optimizer cannot run on meta
    tensors (it reads a value, or mixes them with CPU tensors it makes)."""
    with step.tensor_math() if step.tensor_opts else contextlib.nullcontext():
        try:
            return _run_optimizers(step, lambda p: torch.empty_strided(
                p.shape, p.stride(), dtype=p.dtype, device="meta"), contextlib.nullcontext())
        except Exception:
            fake = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True)
            with _unchecked_symbolic_floats():
                return _run_optimizers(step, lambda p: _fake_of(fake, p), fake)


def _run_optimizers(step: Step, make: Callable[[torch.Tensor], torch.Tensor],
                    mode: Any) -> list[list[StateKey]]:
    ps = [make(p).requires_grad_(p.requires_grad) for p in step.params]
    state: dict = defaultdict(dict)
    with mode, contextlib.ExitStack() as stack:
        for fp in ps:
            if fp.requires_grad:
                fp.grad = torch.zeros_like(fp)
        for oi, opt in enumerate(step.opts):
            groups = [[ps[i] for i in g] for g in step.groups[oi]]
            stack.enter_context(_bind_optimizer(opt, groups, state,
                                                [{} for _ in opt.param_groups]))
        for opt in step.opts:
            opt.step()
    return [[(k, v.shape, v.dtype, _device_of_state(v, fp)) for k, v in sorted(state[fp].items())
             if isinstance(v, torch.Tensor)] for fp in ps]


def _device_of_state(v: torch.Tensor, p: torch.Tensor) -> torch.device | None:
    """Where a state tensor lives: None for its parameter's device (moments, momentum
    buffers), else its own (Adam's ``step`` count stays a CPU scalar next to CUDA
    moments unless the optimizer is capturable)."""
    return None if v.device == p.device else v.device


def _fake_of(fake: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    """A fake copy of ``t`` on ``t``'s device. A meta tensor (a model built on the meta
    device, to plan without allocating it) becomes a fake CPU tensor, so that it mixes with
    the CPU tensors the model's own code makes (``torch.arange(t)``) as real parameters
    would. A fake tensor of another fake mode (a model made under FakeTensorMode on a
    device this machine lacks, e.g. CUDA) keeps its device."""
    t = t.detach()
    if t.is_meta or isinstance(t, FakeTensor):
        return _fake_empty(fake, t.shape, t.stride(), t.dtype, t.device)
    return fake.from_tensor(t)


def _fake_empty(fake: FakeTensorMode, shape: Any, stride: Any, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """A fake tensor of this shape on ``device`` (meta: CPU), made without the device."""
    if device.type == "meta":
        device = torch.device("cpu")
    meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    return fake.fake_tensor_converter.from_meta_and_device(fake, meta, device)


def compute_device(tensors: list[torch.Tensor]) -> torch.device:
    """The one device the step's parameters and buffers live on (CPU when it has none);
    FrontendError when they live on several: the traced program runs on one device."""
    devices = {}
    for t in tensors:
        d = t.device
        devices.setdefault(torch.device("cpu") if d.type == "meta" else d, t)
    if len(devices) > 1:
        names = ", ".join(str(d) for d in devices)
        raise FrontendError(f"the step's parameters and buffers live on several devices "
                            f"({names}); a traced step runs on one device",
                            hint="move the whole model to one device (model.to(device)) "
                                 "before tracing; use parallelize() to spread a step over "
                                 "several")
    return next(iter(devices), torch.device("cpu"))


def fake_inputs(step: Step) -> list[torch.Tensor]:
    """Fake tensors for the step's flat inputs, in the order ``Step`` takes them."""
    # A fresh fake mode per trace, with a shape environment so that .item() (Adam's step
    # count, the learning rate) gives a symbolic float instead of failing.
    fake = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True)

    def f(t: torch.Tensor) -> torch.Tensor:
        return _fake_of(fake, t)
    # optimizer state is made without memory, even at 124M parameters, on the device
    # its parameter (or, for a CPU step count, its own live tensor) has
    states = [_fake_empty(fake, shape, _contiguous(shape), dt,
                          device if device is not None else p.device)
              for p, keys in zip(step.params, step.state_keys)
              for _, shape, dt, device in keys]
    hyper = [torch.zeros((), dtype=LR_DTYPE) for _ in step.hyper_slots]
    return ([f(p) for p in step.params] + [f(b) for b in step.buffers] + states
            + [f(t) for t in hyper]
            + [f(t) for t in step.arg_leaves if isinstance(t, torch.Tensor)])


def _contiguous(shape: Any) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    strides, acc = [], 1
    for d in reversed(tuple(shape)):
        strides.append(acc)
        acc *= max(int(d), 1)
    return tuple(reversed(strides))


def _trace(step: Step, inputs: list[torch.Tensor], rec: _Recorder) -> fx.GraphModule:
    """One make_fx trace of the step on fake tensors, functionalized as it goes.

    Functionalization runs under the tracer, as in AOTAutograd: the step's tensors are
    FunctionalTensors, so autograd and the optimizer run on them as usual and every in-place
    op reaches the graph as its functional form. Views stay views (a transposed weight must
    reach addmm as a view, as in eager code, or the matrix kernel takes another path and
    rounds differently). The new values of mutated inputs are the step's outputs, so no
    copy back into the inputs is traced."""
    fn = dispatch_functionalize(step, FunctionalTensorMode())

    def traced(*flat: torch.Tensor):
        # the views functionalization makes again for the outputs, at the end, are noted
        # too: they belong to the phase the step ended in
        with rec.recording(get_proxy_mode().tracer):
            return fn(*flat)
    rec.stop_at(traced)
    with rec.watching(step.opts), _unchecked_symbolic_floats(), _lazy_graph_module(), \
            tracing_known_to_libraries():
        return make_fx(traced, tracing_mode="fake", **_MAKE_FX_OPTIONS)(*inputs)


def _lazy_graph_module() -> Any:
    """The traced GraphModule writes and compiles its Python code only when first called
    or asked for it: the IR is read from its graph, and the code of a graph of 5,000 nodes
    takes a few tenths of a second to generate and compile."""
    lazy = getattr(getattr(fx, "_lazy_graph_module", None), "_use_lazy_graph_module", None)
    return lazy(True) if lazy is not None else contextlib.nullcontext()


# make_fx's torch-function mode notes which torch function made each node (meta["torch_fn"]),
# which nothing here reads, at the cost of a Python call for every torch function the step
# calls (about 0.3 s of tracing GPT-2 small): off where this torch has the switch
_MAKE_FX_OPTIONS = ({"_disable_torch_fn_metadata_mode": True}
                    if "_disable_torch_fn_metadata_mode" in inspect.signature(make_fx).parameters
                    else {})


def _float_pow(self: torch.SymFloat, other: Any) -> Any:
    if not isinstance(other, (int, float, torch.SymInt, torch.SymFloat)):
        return NotImplemented
    return self.__float_pow__(other)


def _float_rpow(self: torch.SymFloat, other: Any) -> Any:
    if not isinstance(other, (int, float, torch.SymInt, torch.SymFloat)):
        return NotImplemented
    return self.__rfloat_pow__(other)


@contextlib.contextmanager
def _unchecked_symbolic_floats() -> Iterator[None]:
    """Arithmetic on symbolic floats without two checks torch makes with sympy.

    The optimizer's Python-double arithmetic on the learning rate and the step count is
    traced as scalar ops; for Adam that is several per parameter (``1 - beta1 ** step``,
    ``lr / bias_correction1``, ``bias_correction2 ** 0.5``). Two checks on them go through
    sympy's assumption system, a few milliseconds each, a good part of tracing Adam:

    - ``x ** y`` checks that the base is not negative. All the check would leave is a
      runtime assert in the shape environment, which the graph does not carry.
    - ``x / y`` raises ZeroDivisionError when the divisor is provably zero, which a
      divisor made of unknown values (the step count) never is.

    Both are checked where it matters, at run time: the backend computes these scalars
    with Python floats, as eager does, and so raises where eager raises."""
    patches = []
    if hasattr(torch.SymFloat, "__float_pow__") and hasattr(torch.SymFloat, "__rfloat_pow__"):
        patches += [mock.patch.object(torch.SymFloat, "__pow__", _float_pow),
                    mock.patch.object(torch.SymFloat, "__rpow__", _float_rpow)]
    try:
        from torch.utils._sympy.functions import FloatTrueDiv
    except ImportError:    # pragma: no cover - another torch
        FloatTrueDiv = None
    checked = getattr(FloatTrueDiv, "eval", None)
    if checked is not None:
        def unchecked(cls, base, divisor):
            if base.is_Number and divisor.is_Number:
                return checked(base, divisor)   # numbers: as torch does
            return None                         # symbols: left as a division

        patches.append(mock.patch.object(FloatTrueDiv, "eval", classmethod(unchecked)))
    patches += [mock.patch.object(builtins, "min", _symbolic_extremum(builtins.min, torch.sym_min)),
                mock.patch.object(builtins, "max", _symbolic_extremum(builtins.max, torch.sym_max))]
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield


def _symbolic_extremum(builtin: Any, symbolic: Any) -> Any:
    """``min``/``max`` that keeps two symbolic scalars symbolic (``torch.sym_min``):
    optimizers compare the step count with the learning rate on the host
    (``min(lr, 1 / step ** 0.5)`` in Adafactor), which would otherwise ask the trace for a
    value it does not have. Any other call is the builtin's."""
    def extremum(*args: Any, **kwargs: Any) -> Any:
        if len(args) == 2 and not kwargs and any(
                isinstance(a, (torch.SymFloat, torch.SymInt)) for a in args):
            return symbolic(*args)
        return builtin(*args, **kwargs)
    return extremum


@contextlib.contextmanager
def _counts_widened(opts: list[torch.optim.Optimizer],
                    wide: dict[int, list[tuple[torch.Tensor, str]]]) -> Iterator[None]:
    """Each optimizer ``wide`` names (by index) reads those (traced parameter, state key)
    counts as float64: widened as its step() begins, so that the conversion is part of the
    update (widened when bound, it was a forward op, and a pipeline ran it per microbatch
    and averaged it into the update: RAdam over pp=2 drifted 6e-4 from the single-device
    step in its third step)."""
    pairs = {id(opts[oi]): got for oi, got in wide.items()}

    def widening(opt: torch.optim.Optimizer) -> None:
        for p, k in pairs[id(opt)]:
            t = opt.state[p][k]
            if t.dtype != torch.float64:
                opt.state[p][k] = t.to(torch.float64)
    with _around_steps([opts[oi] for oi in wide], widening):
        yield


@contextlib.contextmanager
def _around_steps(opts: list[torch.optim.Optimizer],
                  before: Callable[[torch.optim.Optimizer], None],
                  after: Callable[[torch.optim.Optimizer], None] | None = None
                  ) -> Iterator[None]:
    """Each of ``opts``' step() calls ``before(opt)`` first (and ``after(opt)`` when it
    ends, however it ends) while the context is open: a bound method on the instance,
    over whatever step() was there (a scheduler's wrapper, which reads
    ``step.__func__``), put back afterwards."""
    own = [o.__dict__.get("step") for o in opts]

    def around(opt: torch.optim.Optimizer, run: Callable) -> Callable:
        def step(_: Any, *args: Any, **kwargs: Any) -> Any:
            before(opt)
            try:
                return run(*args, **kwargs)
            finally:
                if after is not None:
                    after(opt)
        return step
    try:
        for o in opts:
            o.step = types.MethodType(around(o, o.step), o)
        yield
    finally:
        for o, mine in zip(opts, own):
            if mine is None:
                o.__dict__.pop("step", None)
            else:
                o.step = mine


def counts_on_host(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt``'s eager step() branches on its step count read on the host (RAdam's
    rectification from its sixth step, ASGD's averaging from step t0), which no one trace
    can hold: such an optimizer is traced in its capturable form, which branches with
    ``torch.where`` and keeps the count a tensor."""
    return isinstance(opt, (torch.optim.RAdam, torch.optim.ASGD))


@contextlib.contextmanager
def _tensor_optimizer_math(opts: list[torch.optim.Optimizer],
                           scoped: bool = False) -> Iterator[None]:
    """The optimizers' code as torch.compile traces it: learning rates and step counts stay
    tensors (``capturable`` Adam-style math, ``torch.compiler.is_compiling()`` true), so
    the graph reads no value on the host and a code generator compiles it once, whatever
    the learning rate and step count are later. ``scoped``: ``is_compiling()`` is true only
    within these optimizers' step() (the rest of the step, other optimizers and the model,
    traced as eager runs it)."""
    saved = [[g.get("capturable") for g in o.param_groups] for o in opts]
    inside = [0]

    def enter(_: torch.optim.Optimizer) -> None:
        inside[0] += 1

    def leave(_: torch.optim.Optimizer) -> None:
        inside[0] -= 1
    compiling = torch.compiler.is_compiling
    try:
        for o in opts:
            for g in o.param_groups:
                if "capturable" in g:
                    g["capturable"] = True
        with _around_steps(opts if scoped else [], enter, leave), \
                mock.patch("torch.compiler.is_compiling",
                           (lambda: inside[0] > 0 or compiling()) if scoped else lambda: True):
            yield
    finally:
        for o, gs in zip(opts, saved):
            for g, c in zip(o.param_groups, gs):
                if c is not None:
                    g["capturable"] = c


@contextlib.contextmanager
def _device_errors(device: torch.device) -> Iterator[None]:
    """A FrontendError for tensors of two devices meeting in one op while the step is
    traced (a batch left on the CPU next to a CUDA model), instead of fake-tensor internals."""
    try:
        yield
    except RuntimeError as e:
        text = str(e)
        if not any(m in text for m in ("found two different devices",
                                       "Expected all tensors to be on the same device",
                                       "Unhandled FakeTensor Device Propagation")):
            raise
        raise FrontendError(
            f"the step mixes tensors of two devices in one operation (its parameters live on "
            f"{device}): {text.splitlines()[0][:300]}",
            hint=f"move every tensor the step computes with to {device} (the batch: "
                 f"x.to({str(device)!r})) before calling it") from None


def capture(step_fn: Callable, *args: Any, codegen: str | None = "fx") -> Captured:
    """Trace ``step_fn(*args)`` into a functional aten graph without running it for real,
    for the code generator ``codegen`` (None: fx). For
    Inductor the optimizers' learning rates and step counts stay tensors in the graph
    (their math is torch.compile's, not eager's, bit for bit)."""
    modules, opts = find_state(step_fn, args)
    if not opts:
        raise FrontendError("the step uses no torch.optim optimizer (none among its "
                            "arguments or in its closure)",
                            hint="pass the optimizer to the step, e.g. step(model, opt, batch)")
    for opt in opts:
        if any(g.get("fused") for g in opt.param_groups):
            raise FrontendError(
                f"{type(opt).__name__}(fused=True) runs one fused kernel over all its tensors, "
                "which the tracer cannot break into the IR's per-tensor ops",
                hint="build the optimizer without fused=True (the default or foreach=True)")
    step = Step(step_fn, args, modules, opts)
    device = compute_device(step.params + step.buffers)
    codegen = "inductor" if check_codegen(codegen) == "inductor" else "fx"
    step.tensor_hyper = codegen == "inductor"
    step.tensor_opts = frozenset(i for i, o in enumerate(opts) if counts_on_host(o))
    live = step.live_state_keys()
    step.state_keys = live if live is not None else _discover_state(step)
    rec = _Recorder(step_fn)
    inputs = fake_inputs(step)
    watch = HostWatch(step_fn, args, modules, opts, lambda: rec.draws)
    with watch.watching(), _device_errors(device):
        gm = _trace(step, inputs, rec)
    effects = watch.effects()
    watch.rng.replay(gm)     # draws activation checkpointing repeats read the first ones
    if step.grads_left and not step.cleared_first and not step.grads_zeroed:
        raise FrontendError(
            "the step leaves gradients in .grad when it ends and does not clear them before "
            "backward(), so each call's gradients would be added to what the last call left",
            hint="call opt.zero_grad() after opt.step() (zero_grad(set_to_none=False) too: "
                 "it leaves zeros), or before backward()")
    outputs: list[Slot | None] = [None] * step.n_user
    outputs += step.param_slots + step.buffer_slots + step.state_slots()
    outputs += [Slot("grad", 0, (pi,), f"{step.param_slots[pi].name}.grad")
                for pi in step.grads_left]
    slots = step.param_slots + step.buffer_slots + step.state_slots() + step.hyper_slots + \
        step.arg_slots
    live = frozenset((s.owner, s.key[1], s.key[2]) for s in step.hyper_slots
                     if s.key[1] != "lr")
    reads = step_reads(step_fn)
    return Captured(gm, slots, outputs, step.user_spec, modules, opts, step.params,
                    step.state_keys, rec.phase, rec.loc, getattr(step_fn, "__name__", "step"),
                    settings_of(modules, opts, live), step.cleared_first, effects,
                    step.hyper_signs, device, codegen, user_nones=step.user_nones,
                    grads_zeroed=step.grads_zeroed, arg_spec=step.arg_spec,
                    arg_fixed=tuple((i, leaf, "args" + pytree.keystr(path))
                                    for i, (path, leaf) in enumerate(step.arg_paths)
                                    if not isinstance(leaf, torch.Tensor)),
                    reads=reads, read_values=read_now(reads),
                    module_attrs=module_scalars(submodules(modules)))

