"""What a torch step does on the host, besides tensor math, while it is traced.

The traced program holds only tensor math; everything else the step's Python does would
run once, at trace time, and never again. ``HostWatch`` sees it during the trace and
either replays it on the host around the compiled program, where eager runs it relative to
the tensor math, or refuses it with a FrontendError:

- replayed: an LR scheduler's ``step()`` (before or after its optimizer's step: the
  learning rate the program reads is then the one eager uses) and ``torch.manual_seed``
  (before or after the step's random draws). Neither runs while tracing.
- refused: Python values the step changes (counters, lists, dicts, attributes of objects,
  modules and optimizers; found by ``pystate.PythonState``), ``print`` and logging from the
  user's code, draws from Python's or NumPy's generator, an enabled GradScaler (skipping a
  step on overflow is a decision on tensor data), ``ReduceLROnPlateau.step(metric)`` (it
  reads a value the step computes), ``get_last_lr()``, a scheduler stepped between two
  steps of its optimizer, seeding between random draws, and reading a learning rate after
  the scheduler that changes it.

What the trace changed is put back before a refusal is raised."""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..errors import FrontendError
from .pystate import PythonState, changed_error
from .rng_replay import RngPositions

# where torch, this package and the standard library live: frames there are not the user's
INTERNAL_PATHS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)),
                  os.path.dirname(contextlib.__file__))
_TORCH_PATH = os.path.dirname(torch.__file__)
_LOGGING_PATH = os.path.dirname(logging.__file__)


def is_library_file(path: str) -> bool:
    """True for torch, this package, the standard library and installed packages."""
    return (path.startswith(INTERNAL_PATHS) or path.startswith("<") or "site-packages" in path
            or "dist-packages" in path)


def _caller(skip: tuple[str, ...] = ()) -> tuple[str, str]:
    """(path, ``file:line``) of the innermost frame outside this module and ``skip``."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if path != __file__ and not path.startswith(skip):
            return path, f"{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return "", "?"


def _user_line() -> str:
    """``file:line`` of the innermost frame of code that is neither a library nor this
    package's (the user's step or model)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if not is_library_file(path):
            return f" at {os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return ""


@dataclass(frozen=True)
class HostEffect:
    """A call the runtime makes on the host each step, before or after the program."""

    when: str                 # "before" or "after"
    fn: Callable[..., Any]
    args: tuple
    what: str                 # for messages and reports: "StepLR.step()"

    def __call__(self) -> None:
        self.fn(*self.args)


def _being_made(sched: Any) -> bool:
    """Whether ``sched.step()`` is called by its own constructor (a scheduler made inside
    the step takes its first step there). Not told by ``_step_count == 0``: a scheduler
    whose step() does not count (CosineAnnealingWarmRestarts) keeps 0 after it is made."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name in ("__init__", "_initial_step") and \
                frame.f_locals.get("self") is sched:
            return True
        frame = frame.f_back
    return False


def _step_scheduler(sched: Any) -> None:
    sched.step()


class StaleValue:
    """Put in a parameter group after a scheduler that runs on the host after the program:
    a value read there inside the step is not the one eager reads, so using it raises."""

    def __init__(self, key: str, sched: str, where: str) -> None:
        self.key, self.sched, self.where = key, sched, where

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise FrontendError(
            f"the step reads the optimizer's {self.key!r}{_user_line()} after "
            f"{self.sched}.step(){self.where}; the scheduler runs on the host after the "
            "compiled step, so inside the step that value is not the one eager reads",
            hint="step the scheduler at the end of the step, after everything that reads "
                 "the optimizer's hyperparameters (opt.step() included), or outside it")

    def __repr__(self) -> str:
        return f"<{self.key} after {self.sched}.step(): not known while tracing>"


for _name in ("__float__", "__int__", "__index__", "__bool__", "__round__", "__format__",
              "__neg__", "__pos__", "__abs__", "__lt__", "__le__", "__gt__", "__ge__",
              "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
              "__truediv__", "__rtruediv__", "__pow__", "__rpow__", "__mod__", "__rmod__",
              "__floordiv__", "__rfloordiv__", "__getitem__", "__iter__", "__len__"):
    setattr(StaleValue, _name, StaleValue._refuse)


# ------------------------------------------------------------------ random generators

def _rng_states() -> dict[str, Any]:
    """The states of Python's and NumPy's generators and torch's CPU generator."""
    states: dict[str, Any] = {"random": random.getstate(), "torch": torch.get_rng_state()}
    np = sys.modules.get("numpy")
    if np is not None:
        states["numpy.random"] = np.random.get_state()
    return states


def _same_state(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    if hasattr(a, "shape") and hasattr(a, "tolist"):     # a NumPy array
        return a.tolist() == b.tolist()
    return a == b


def _set_rng_state(name: str, state: Any) -> None:
    if name == "random":
        random.setstate(state)
    elif name == "torch":
        torch.set_rng_state(state)
    else:
        sys.modules["numpy"].random.set_state(state)


# ------------------------------------------------------------------ the watch

def _scheduler_classes() -> list[type]:
    """LRScheduler and every subclass defined so far (the user's included)."""
    out, todo = [], [torch.optim.lr_scheduler.LRScheduler]
    while todo:
        cls = todo.pop()
        if cls not in out:
            out.append(cls)
            todo.extend(cls.__subclasses__())
    return out


@dataclass
class _Call:
    """A replayable call seen while tracing, and where it came relative to the program."""

    kind: str                 # "scheduler" or "seed"
    effect: HostEffect        # its ``when`` is decided at the end of the trace
    at: int                   # its optimizer's steps (scheduler) or random draws (seed) so far
    opt: Any                  # the scheduler's optimizer (None for a seed)
    where: str                # " at file:line"


class HostWatch:
    """Watches one trace of a step (see the module docstring); ``effects()`` afterwards."""

    def __init__(self, fn: Callable, args: tuple, modules: list[torch.nn.Module],
                 opts: list[torch.optim.Optimizer], draws: Callable[[], int]) -> None:
        self.opts = opts
        self.draws = draws
        self.rng = RngPositions(draws)
        self.state = PythonState(fn, args, modules, opts)
        self.calls: list[_Call] = []
        self.opt_steps: dict[int, int] = {}

    # ---------------------------------------------------------------- during the trace
    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Patch what the step may call, note Python values and generator states; on the
        way out put back what changed and refuse it."""
        self.state.snapshot()
        rng = _rng_states()
        ok = False
        try:
            with contextlib.ExitStack() as stack:
                for p in self._patches():
                    stack.enter_context(p)
                hook = register_optimizer_step_post_hook(self._opt_stepped)
                stack.callback(hook.remove)
                yield
            ok = True
        finally:
            changes = self.state.changed()
            self.state.restore(changes)
            moved = [k for k, v in _rng_states().items() if not _same_state(v, rng[k])]
            for k in moved:
                _set_rng_state(k, rng[k])
        if ok and changes:
            raise changed_error(changes)
        if ok and moved:
            raise FrontendError(
                f"the step draws from or seeds {moved[0]}'s generator; that runs once, while "
                "the step is traced, so each call would reuse the first call's choices",
                hint="draw such numbers outside the step and pass them in as tensors, or use "
                     "torch's random ops on tensors (torch.rand), which the program draws "
                     "each call; torch.manual_seed inside the step is replayed each call")

    def _opt_stepped(self, opt: Any, args: Any, kwargs: Any) -> None:
        self.opt_steps[id(opt)] = self.opt_steps.get(id(opt), 0) + 1

    def _patches(self) -> list[Any]:
        patches = []
        for cls in _scheduler_classes():
            if "step" in cls.__dict__:
                patches.append(mock.patch.object(cls, "step", self._scheduler_step()))
            if "get_last_lr" in cls.__dict__:
                patches.append(mock.patch.object(cls, "get_last_lr", _refuse_last_lr))
        seed = self._seed(torch.random.manual_seed)
        patches += [mock.patch.object(torch, "manual_seed", seed),
                    mock.patch.object(torch.random, "manual_seed", seed)]
        for mod, name in ((torch, "seed"), (torch.random, "seed")):
            patches.append(mock.patch.object(mod, name, _refuse_rng(getattr(mod, name))))
        for mod in (torch, torch.random):       # torch's own saves and restores: followed
            patches += [mock.patch.object(mod, "set_rng_state", _refuse_rng(
                            mod.set_rng_state, self.rng.restored)),
                        mock.patch.object(mod, "get_rng_state",
                                          _noting_rng(mod.get_rng_state, self.rng.noted))]
        if hasattr(torch, "cuda"):
            for name in ("manual_seed", "manual_seed_all"):
                if hasattr(torch.cuda, name):
                    patches.append(mock.patch.object(torch.cuda, name,
                                                     self._seed(getattr(torch.cuda, name))))
        scaler = torch.amp.grad_scaler.GradScaler
        for name in ("scale", "unscale_", "step", "update"):
            patches.append(mock.patch.object(scaler, name, _refuse_scaler(getattr(scaler, name))))
        patches.append(mock.patch.object(builtins, "print", _refuse_print(builtins.print)))
        patches.append(mock.patch.object(logging.Logger, "_log",
                                         _refuse_logging(logging.Logger._log)))
        return patches

    def _scheduler_step(self) -> Callable[..., None]:
        def step(sched: Any, *args: Any, **kwargs: Any) -> None:
            name = type(sched).__name__
            where = _user_line()
            if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
                raise FrontendError(
                    f"{name}.step(metric) is called inside the step{where}; it decides on a "
                    "value the step computes, which is not known while the step is traced",
                    hint=f"call {name}.step(loss) outside the step, with the loss it returns")
            if _being_made(sched):
                raise FrontendError(f"a {name} is created inside the step{where}",
                                    hint="create the scheduler once, outside the step")
            if args or kwargs:
                raise FrontendError(
                    f"{name}.step(...) is given arguments inside the step{where}; they are "
                    "Python values read once, while the step is traced",
                    hint=f"call {name}.step() without arguments")
            opt = sched.optimizer
            self.calls.append(_Call("scheduler", HostEffect("", _step_scheduler, (sched,),
                                                            f"{name}.step()"),
                                    self.opt_steps.get(id(opt), 0), opt, where))
            if self.opt_steps.get(id(opt), 0) and any(opt is o for o in self.opts):
                _mark_stale(opt, name, where, bool(getattr(sched, "cycle_momentum", False)))
        return step

    def _seed(self, orig: Callable) -> Callable:
        def seed(*args: Any, **kwargs: Any) -> Any:
            path, _ = _caller()
            if path.startswith(_TORCH_PATH):
                return orig(*args, **kwargs)     # torch's own (checkpoint's replay)
            if kwargs or len(args) != 1 or not isinstance(args[0], int):
                raise FrontendError(f"{orig.__name__}{args!r} inside the step{_user_line()}: "
                                    "the seed must be a Python int",
                                    hint="seed with a constant int, or outside the step")
            self.calls.append(_Call("seed", HostEffect("", orig, args,
                                                       f"torch.{orig.__name__}({args[0]})"),
                                    self.draws(), None, _user_line()))
            # torch.manual_seed returns the default generator, torch.cuda's return None
            return torch.default_generator if orig is torch.random.manual_seed else None
        return seed

    # ---------------------------------------------------------------- after the trace
    def effects(self) -> list[HostEffect]:
        """The replayed calls, each placed before or after the program; a FrontendError
        for one that has no such place."""
        out = []
        draws = self.draws()
        for c in self.calls:
            if c.kind == "scheduler":
                total = self.opt_steps.get(id(c.opt), 0)
                if c.at and c.at < total:
                    raise FrontendError(
                        f"{c.effect.what} is called inside the step{c.where} between two "
                        f"steps of its optimizer ({c.at} of {total} before it); the compiled "
                        "step reads each learning rate once",
                        hint="step the scheduler before or after all of the optimizer's "
                             "steps, or outside the step")
                when = "after" if c.at else "before"
            else:
                if 0 < c.at < draws:
                    raise FrontendError(
                        f"{c.effect.what} is called inside the step{c.where} between random "
                        f"draws ({c.at} of {draws} before it); the compiled step cannot "
                        "re-seed in the middle of its program",
                        hint="seed at the start or the end of the step, or outside it")
                when = "after" if c.at else "before"
            out.append(HostEffect(when, c.effect.fn, c.effect.args, c.effect.what))
        return out


def _mark_stale(opt: Any, sched: str, where: str, momentum: bool) -> None:
    """After a scheduler stepped after its optimizer: its learning rates (and momentum
    terms, which cycling schedulers change) are not known inside the step any more."""
    for g in opt.param_groups:
        g["lr"] = StaleValue("lr", sched, where)
        if not momentum:
            continue
        if "momentum" in g:
            g["momentum"] = StaleValue("momentum", sched, where)
        if "betas" in g and isinstance(g["betas"], tuple):
            g["betas"] = (StaleValue("betas", sched, where), *g["betas"][1:])


def _refuse_last_lr(sched: Any) -> Any:
    name = type(sched).__name__
    raise FrontendError(
        f"{name}.get_last_lr() is called inside the step{_user_line()}: a Python value read "
        "once, while the step is traced",
        hint="read the learning rate outside the step, or return what you need from it "
             "as a tensor")


def _noting_rng(orig: Callable, note: Callable[[Any], Any]) -> Callable:
    def get(*args: Any, **kwargs: Any) -> Any:
        state = orig(*args, **kwargs)
        path, _ = _caller()
        return note(state) if path.startswith(_TORCH_PATH) else state
    return get


def _refuse_rng(orig: Callable, follow: Callable[[Any], None] | None = None) -> Callable:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        path, _ = _caller()
        if path.startswith(_TORCH_PATH):
            if follow is not None:          # torch's own restore (fork_rng, checkpoint)
                follow(args[0] if args else kwargs["new_state"])
            return orig(*args, **kwargs)    # torch's own (fork_rng, checkpoint)
        raise FrontendError(
            f"torch.{orig.__name__}() is called inside the step{_user_line()}; it would run "
            "once, while the step is traced",
            hint="call it outside the step; torch.manual_seed(n) inside the step is replayed")
    return refuse


def _refuse_scaler(orig: Callable) -> Callable:
    def refuse(scaler: Any, *args: Any, **kwargs: Any) -> Any:
        if not scaler.is_enabled():
            return orig(scaler, *args, **kwargs)
        raise FrontendError(
            f"GradScaler.{orig.__name__}() is called inside the step{_user_line()}: a "
            "GradScaler skips the optimizer step when gradients overflow and changes its "
            "scale, decisions on tensor data the traced program cannot make",
            hint="drop the GradScaler (float32 and bfloat16 need none), or build it with "
                 "enabled=False")
    return refuse


def _refuse_print(orig: Callable) -> Callable:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        path, line = _caller()
        if is_library_file(path):
            return orig(*args, **kwargs)
        raise FrontendError(
            f"print() inside the step at {line} would run once, while the step is traced "
            "(printing placeholders, not values)",
            hint="return what you want to see from the step and print it outside")
    return refuse


def _refuse_logging(orig: Callable) -> Callable:
    def refuse(logger: Any, *args: Any, **kwargs: Any) -> Any:
        path, line = _caller(skip=(_LOGGING_PATH,))
        if is_library_file(path):
            return orig(logger, *args, **kwargs)
        raise FrontendError(
            f"logging inside the step at {line} would run once, while the step is traced "
            "(logging placeholders, not values)",
            hint="return what you want to log from the step and log it outside")
    return refuse
