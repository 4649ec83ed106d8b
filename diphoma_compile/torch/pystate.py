"""The Python values a torch step can reach: noted before it is traced, compared and put
back afterwards; and those it reads, watched between calls.

A step that changes a Python value (``self.steps += 1``, a closure's dict, a list it appends
to, a new attribute on its trainer or a module) would change it once, while traced, and
never in the compiled step. ``PythonState`` notes those values (scalars by value, tensors and
other objects by identity, containers and plain objects a few levels down), and after the
trace says what changed and puts it back; ``changed_error`` is the refusal.

A trace also holds the numbers the step's Python code reads (a KL weight, a temperature, a
dropout probability) as constants. Changed between calls, they would change the eager step
and not the compiled one, so each call compares them with their values at trace time
(``step_reads``, ``module_scalars``): the plain values (numbers, strings, dicts, lists and
tuples of them) the step function names from its globals or closure, whose change is an
error, since its own code reads them; and the modules' scalar attributes (``model.temp``,
``nn.Dropout.p``), whose change is warned of, since nothing shows the forward reads that
one (a counter kept on the model). An attribute the step's code reads of a global, a
closure variable or its bound object (``cfg.clip``, ``self.kl_weight``) is watched as such
a value. Values read through other functions' globals, or two attributes down, are not
seen."""

from __future__ import annotations

import dis
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import FrontendError

_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_MAX_ITEMS = 10_000       # bigger containers are compared by identity and length only
_SKIPPED_TYPES = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
                  types.MethodType, type, torch.nn.Module, torch.optim.Optimizer)


def _is_scheduler(v: Any) -> bool:
    return isinstance(v, torch.optim.lr_scheduler.LRScheduler)


def _fingerprint(v: Any, depth: int) -> Any:
    """A comparable summary of ``v``: scalars by value, tensors and other objects by
    identity, lists, tuples, dicts, sets and plain objects' public attributes ``depth``
    levels down."""
    if isinstance(v, _SCALARS):
        return (type(v).__name__, repr(v))
    if isinstance(v, torch.Tensor) or isinstance(v, _SKIPPED_TYPES) or _is_scheduler(v):
        return ("id", id(v))
    if depth <= 0:
        return ("id", id(v), len(v) if isinstance(v, (list, dict, set)) else None)
    if isinstance(v, (list, tuple)) and type(v) in (list, tuple):
        if len(v) > _MAX_ITEMS:
            return ("id", id(v), len(v))
        # a tuple is its items (they cannot change); a list is also itself
        return (type(v).__name__, id(v) if type(v) is list else None,
                tuple(_fingerprint(x, depth - 1) for x in v))
    if type(v) is dict:
        if len(v) > _MAX_ITEMS:
            return ("id", id(v), len(v))
        return ("dict", id(v), tuple((repr(k), _fingerprint(x, depth - 1))
                                     for k, x in v.items()))
    if type(v) is set:
        return ("set", id(v), len(v), frozenset(repr(x) for x in v) if len(v) < 100 else None)
    attrs = getattr(v, "__dict__", None)
    if type(attrs) is dict and len(attrs) <= 200:
        return ("obj", id(v), tuple((k, _fingerprint(x, depth - 1)) for k, x in attrs.items()
                                    if not k.startswith("_")))
    return ("id", id(v))


_MISSING = object()


def _by_value(v: Any) -> bool:
    return isinstance(v, _SCALARS) or type(v) is tuple


@dataclass
class _Entry:
    """One Python value the step can reach: how to read it and how to put it back."""

    label: str
    get: Callable[[], Any]
    put: Callable[[Any], None] | None
    depth: int = 2
    names: bool = False        # the value is an object's attribute names


class PythonState:
    """The Python values a step can change: its own object's attributes (a method's
    ``self``), its closure and the globals it names, its non-tensor arguments, and the
    plain attributes of the modules and optimizers it uses."""

    def __init__(self, fn: Callable, args: tuple, modules: list[torch.nn.Module],
                 opts: list[torch.optim.Optimizer]) -> None:
        self.entries: list[_Entry] = []
        owner = getattr(fn, "__self__", None)
        func = getattr(fn, "__func__", fn)
        if owner is None and not isinstance(fn, types.FunctionType) and \
                type(getattr(fn, "__dict__", None)) is dict:
            owner = fn                   # a callable object: its attributes are its state
        if owner is not None and not isinstance(owner, _SKIPPED_TYPES):
            self._attributes("self", owner, public_only=False, depth=2)
        code = getattr(func, "__code__", None)
        for name, cell in zip(getattr(code, "co_freevars", ()),
                              getattr(func, "__closure__", None) or ()):
            self.entries.append(_Entry(name, _cell_getter(cell), _cell_setter(cell)))
        glb = getattr(func, "__globals__", None)
        if code is not None and isinstance(glb, dict):
            for name in code.co_names:
                v = glb.get(name, _MISSING)
                if v is _MISSING or not isinstance(v, _SKIPPED_TYPES):
                    self.entries.append(_Entry(name, _global_getter(glb, name),
                                               _global_setter(glb, name)))
        try:
            names = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            names = []
        for i, a in enumerate(args):
            if not isinstance(a, (torch.Tensor, *_SKIPPED_TYPES)):
                label = f"argument {names[i]!r}" if i < len(names) else f"argument {i}"
                self.entries.append(_Entry(label, (lambda a=a: a), None, depth=3))
        for mi, m in enumerate(modules):
            for q, sub in m.named_modules():
                self._attributes(f"module{mi}" + (f".{q}" if q else ""), sub, public_only=True,
                                 depth=0, skip=("training",))
        for oi, opt in enumerate(opts):
            self._attributes(f"optimizer{oi}", opt, public_only=True, depth=0,
                             skip=("defaults", "state", "param_groups"))
        self.before: dict[int, tuple[Any, Any, Any]] = {}

    def _attributes(self, prefix: str, obj: Any, public_only: bool, depth: int,
                    skip: tuple[str, ...] = ()) -> None:
        d = obj.__dict__

        def names() -> tuple[str, ...]:
            return tuple(k for k in d if not (public_only and k.startswith("_")))

        def drop_new(before: tuple[str, ...]) -> None:
            for k in set(names()) - set(before):
                del d[k]
        # an attribute set for the first time (self.last_loss = loss) is a change too
        self.entries.append(_Entry(prefix, names, drop_new, names=True))
        for k in list(d):
            if k in skip or (public_only and k.startswith("_")):
                continue
            v = d[k]
            if depth == 0 and not isinstance(v, (*_SCALARS, torch.Tensor)):
                continue      # a module's submodules, configs and caches are its own
            self.entries.append(_Entry(f"{prefix}.{k}", _attr_getter(d, k), _attr_setter(d, k),
                                       depth))

    def snapshot(self) -> None:
        """Note every value (and a copy of each container, to put it back)."""
        self.before = {}
        for i, e in enumerate(self.entries):
            v = e.get()
            copy = list(v) if type(v) is list else dict(v) if type(v) is dict else \
                set(v) if type(v) is set else None
            self.before[i] = (v, copy, _fingerprint(v, e.depth))

    def changed(self) -> list[tuple[_Entry, Any, Any]]:
        """(entry, value before, value now) for each value the trace changed."""
        out = []
        for i, e in enumerate(self.entries):
            v, _, fp = self.before[i]
            now = e.get()
            # an equal number or tuple made again is no change; any other object only
            # as itself
            rebound = now is not v and not (_by_value(v) and _by_value(now))
            if rebound or _fingerprint(now, e.depth) != fp:
                out.append((e, v, now))
        return out

    def restore(self, changes: list[tuple[_Entry, Any, Any]]) -> None:
        """Put back what the trace changed (top level: a container's items, a rebinding)."""
        for e, _, _ in changes:
            i = self.entries.index(e)
            v, copy, _ = self.before[i]
            if e.get() is not v and e.put is not None:
                e.put(v)
            if type(v) is list:
                v[:] = copy
            elif type(v) in (dict, set):
                v.clear()
                v.update(copy)


def _cell_getter(cell: Any) -> Callable[[], Any]:
    def get() -> Any:
        try:
            return cell.cell_contents
        except ValueError:
            return _MISSING
    return get


def _cell_setter(cell: Any) -> Callable[[Any], None]:
    def put(v: Any) -> None:
        if v is not _MISSING:
            cell.cell_contents = v
    return put


def _global_getter(glb: dict, name: str) -> Callable[[], Any]:
    return lambda: glb.get(name, _MISSING)


def _global_setter(glb: dict, name: str) -> Callable[[Any], None]:
    def put(v: Any) -> None:
        if v is _MISSING:
            glb.pop(name, None)
        else:
            glb[name] = v
    return put


def _attr_getter(d: dict, k: str) -> Callable[[], Any]:
    return lambda: d.get(k, _MISSING)


def _attr_setter(d: dict, k: str) -> Callable[[Any], None]:
    return _global_setter(d, k)


def _short(v: Any) -> str:
    if v is _MISSING:
        return "(unset)"
    text = repr(v) if _by_value(v) else type(v).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def changed_error(changes: list[tuple[_Entry, Any, Any]]) -> FrontendError:
    """The refusal of the first change(s) ``PythonState.changed()`` found."""
    def label(c: tuple[_Entry, Any, Any]) -> str:
        e, old, new = c
        return (", ".join(f"{e.label}.{k}" for k in new if k not in old) or e.label) \
            if e.names else e.label
    e, old, new = changes[0]
    more = f" (and {', '.join(label(c) for c in changes[1:4])})" if len(changes) > 1 else ""
    if e.names:
        what = f"sets {label(changes[0])}"
    elif old is not new or isinstance(old, _SCALARS):
        what = f"changes {e.label} from {_short(old)} to {_short(new)}"
    else:
        what = f"changes the contents of {e.label}"
    return FrontendError(
        f"the step {what}{more} while it is traced: a Python value, so the change would "
        "happen once, at trace time, and never in the compiled step (it has been put back)",
        hint="keep such values outside the step (count calls around it), or in tensors the "
             "step's modules hold (register_buffer), which are traced state")


def _plain(v: Any, depth: int = 0) -> bool:
    """A scalar, or a dict, list or tuple of them (two levels deep at most, 64 items
    each: a vocabulary is not compared on every call)."""
    if isinstance(v, _SCALARS):
        return True
    if depth >= 2 or type(v) not in (dict, list, tuple) or len(v) > 64:
        return False
    items = list(v.items()) if type(v) is dict else list(enumerate(v))
    return all(isinstance(k, _SCALARS) and _plain(x, depth + 1) for k, x in items)


def _globals_loaded(code: types.CodeType) -> list[str]:
    """The global names ``code`` loads, its nested functions' and comprehensions' too (not
    the attribute names ``co_names`` also holds)."""
    names = [i.argval for i in dis.get_instructions(code)
             if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")]
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names += _globals_loaded(c)
    return names


def _attributes_read(code: types.CodeType) -> list[tuple[str, str]]:
    """(name, attribute) for each ``name.attribute`` ``code`` reads of a global, a closure
    variable or a local (``cfg.clip``, ``self.kl_weight``), in order, once each."""
    ins = list(dis.get_instructions(code))
    return list(dict.fromkeys(
        (a.argval, b.argval) for a, b in zip(ins, ins[1:])
        if a.opname in ("LOAD_GLOBAL", "LOAD_DEREF", "LOAD_FAST") and b.opname == "LOAD_ATTR"))


def _attr_of(base: Callable[[], Any], attr: str) -> Callable[[], Any]:
    def get() -> Any:
        obj = base()
        if obj is _MISSING or isinstance(obj, (torch.Tensor, *_SKIPPED_TYPES)) or \
                _is_scheduler(obj) or type(obj) in (dict, list, tuple, set):
            return _MISSING
        try:
            return getattr(obj, attr)
        except Exception:        # noqa: BLE001 (a property that fails: nothing to watch)
            return _MISSING
    return get


def step_reads(fn: Callable) -> tuple[tuple[str, Callable[[], Any], bool], ...]:
    """(name, a getter of its value, whether it is a scalar) for each plain value the step
    function ``fn`` (a bound method's function, a ``functools.partial``'s) names from its
    globals or closure, or reads as an attribute of one of them or of its bound object
    (``cfg.clip``, ``self.kl_weight``: a config object, a trainer), in the order its code
    names them. (A container's change is only warned of: the step may read one entry of a
    config dict whose other entries the loop moves.)"""
    fn = getattr(fn, "func", fn)
    owner = getattr(fn, "__self__", None)
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):
        return ()
    bases: dict[str, tuple[str, Callable[[], Any]]] = {}
    glb = getattr(fn, "__globals__", None)
    if isinstance(glb, dict):
        bases.update((n, (f"global {n}", _global_getter(glb, n)))
                     for n in dict.fromkeys(_globals_loaded(code)))
    bases.update((name, (f"closure variable {name}", _cell_getter(cell))) for name, cell
                 in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()))
    getters = list(bases.values())
    if owner is not None and code.co_varnames:
        bases[code.co_varnames[0]] = (code.co_varnames[0], lambda: owner)
    getters += [(f"{bases[n][0]}.{attr}", _attr_of(bases[n][1], attr))
                for n, attr in _attributes_read(code) if n in bases]
    return tuple((name, get, isinstance(v, _SCALARS)) for name, get in getters
                 if (v := get()) is not _MISSING and _plain(v))


def read_now(reads: tuple[tuple[str, Callable[[], Any], bool], ...]) -> tuple[str, ...]:
    """The values of ``reads`` as text (a dict changed in place shows)."""
    return tuple(_short(v) if (v := get()) is _MISSING else repr(v) for _, get, _ in reads)


def submodules(modules: list[torch.nn.Module]) -> list[tuple[str, torch.nn.Module]]:
    """(``"model.sub"``, the module) for every module under ``modules``."""
    out = []
    for k, top in enumerate(modules):
        head = "model" if len(modules) == 1 else f"module{k}"
        out += [(f"{head}{'.' + path if path else ''}", sub)
                for path, sub in top.named_modules()]
    return out


def module_scalars(subs: list[tuple[str, torch.nn.Module]]) -> dict[str, Any]:
    """``"model.sub.attr"`` -> value for each public scalar attribute of each of ``subs``
    (``submodules``; ``training`` is checked with the modes)."""
    return {f"{path}.{attr}": v for path, sub in subs for attr, v in vars(sub).items()
            if isinstance(v, _SCALARS) and attr != "training" and not attr.startswith("_")}


def attribute_slots(subs: list[tuple[str, torch.nn.Module]], names: Any
                    ) -> list[tuple[str, dict, str]]:
    """(``"model.sub.attr"``, the module's ``__dict__``, the attribute) for each of
    ``names`` (``module_scalars``' keys at trace time): read again on each call without
    walking every module's attributes."""
    want = set(names)
    return [(f"{path}.{attr}", vars(sub), attr) for path, sub in subs for attr in vars(sub)
            if f"{path}.{attr}" in want]


def changed_values(slots: list[tuple[str, dict, str]], before: dict[str, Any]
                   ) -> list[tuple[str, Any, str]]:
    """(name, value now, ``"name: old -> new"``) for each of ``slots`` whose value differs
    from ``before`` (by type and value: 1 and 1.0 and True differ)."""
    out = []
    for name, d, attr in slots:
        old, now = before[name], d.get(attr, _MISSING)
        if type(now) is not type(old) or now != old:
            out.append((name, now, f"{name}: {old!r} -> {_short(now)}"))
    return out
