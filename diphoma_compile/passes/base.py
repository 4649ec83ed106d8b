"""Pass infrastructure: the Pass type, what passes share in a run (PassContext, their
decisions and records), and the registry of passes by name (with entry-point plugins). Spec
strings are read in ``spec.py``; ``pipeline.py`` runs passes in order."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

from ..errors import DiphomaError, PassSpecError
from ..ir.core import Graph, Op
from ..ir.row_probe import RowProbe

ENTRY_POINT_GROUP = "diphoma_compile.passes"


class PassFailure(DiphomaError):
    """Raised by a pass that cannot do its job; ``op`` names where, when known."""

    def __init__(self, message: str, *, op: Op | None = None, hint: str | None = None) -> None:
        self.op = op
        super().__init__(message, hint=hint)


class Decision(Protocol):
    """What one pass decided, for the plan: a frozen dataclass; ``to_dict`` is its JSON form.
    (A plain dict of plain data is accepted too, as passes wrote before typed records.)"""

    def to_dict(self) -> dict[str, Any]:
        """The decision as plain data (lists, dicts, strings, numbers)."""
        ...


_D = TypeVar("_D")


def find_decision(decisions: Mapping[str, Any], kind: type[_D]) -> _D | None:
    """The last decision of type ``kind`` in ``decisions`` (pass name -> decision), or None."""
    found = [d for d in decisions.values() if isinstance(d, kind)]
    return found[-1] if found else None


@dataclass
class PassContext:
    """What a pipeline run shares with its passes: checks, dumps, timings, decisions."""

    verify: bool = True
    dump_after: frozenset[str] | str = frozenset()   # pass names, or "all"
    dump_dir: Path | None = None                      # files NN-pass.ir; else dump_stream
    dump_stream: Callable[[str], Any] = field(default=lambda s: sys.stderr.write(s))
    records: list[PassRecord] = field(default_factory=list)
    # pass name -> what it decided (a typed record), for the plan; a pass run twice keeps
    # its first place and its last record
    decisions: dict[str, Decision] = field(default_factory=dict)
    # the step traced at more rows per share where the graph has one: what the batch
    # analysis reads then (ir/batch_coupling.py's split_batch; api.trace_step traces it)
    batch_probe: RowProbe | None = None
    # the step as traced, before any pass: where the batch analysis finds the value a
    # backward pass differentiates when a pass dropped it as dead (jax.grad's value)
    traced: Graph | None = None

    def wants_dump(self, name: str) -> bool:
        """True when the IR after pass ``name`` should be dumped."""
        return self.dump_after == "all" or name in self.dump_after

    def decision(self, kind: type[_D]) -> _D | None:
        """The last decision of type ``kind`` a pass recorded (e.g. DataParallelRecord)."""
        return find_decision(self.decisions, kind)

    @property
    def notes(self) -> dict[str, Any]:
        """The decisions under their former name, for passes written before typed records:
        ``ctx.notes[name] = {...}`` still reaches the plan (a dict is its own JSON form)."""
        return self.decisions


@dataclass(frozen=True)
class PassRecord:
    """One pass run: its spec, whether it changed the graph, and how long it took."""

    spec: str
    changed: bool
    seconds: float
    verify_seconds: float


@dataclass(frozen=True)
class Pass:
    """A graph-to-graph rewrite; subclasses are frozen dataclasses whose fields are options.

    ``__call__`` must not mutate its input and returns the same object when nothing changed."""

    name: ClassVar[str] = ""

    def __call__(self, graph: Graph, ctx: PassContext) -> Graph:  # pragma: no cover
        raise NotImplementedError

    def spec(self) -> str:
        """This pass with all its options, as it would be written in a spec string."""
        opts = [f"{kebab(f.name)}={_fmt_opt(getattr(self, f.name))}"
                for f in dataclasses.fields(self)]
        return self.name + ("{" + ", ".join(opts) + "}" if opts else "")


def kebab(s: str) -> str:
    """An option's spec name: ``bucket_mb`` -> ``bucket-mb``."""
    return s.replace("_", "-")


def _fmt_opt(v: Any) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


# ------------------------------------------------------------------ registry

_REGISTRY: dict[str, type[Pass]] = {}
_PLUGINS_LOADED = False


def register_pass(cls: type[Pass]) -> type[Pass]:
    """Class decorator: make a Pass subclass available by its ``name`` in spec strings."""
    if not (isinstance(cls, type) and issubclass(cls, Pass)) or not cls.name:
        raise PassSpecError(f"{cls!r} is not a Pass subclass with a name",
                            hint="subclass diphoma_compile.passes.Pass, set name = '...'")
    if "__dataclass_params__" not in cls.__dict__ or not cls.__dataclass_params__.frozen:
        raise PassSpecError(f"pass {cls.name!r} must be a frozen dataclass",
                            hint="decorate it with @dataclass(frozen=True)")
    old = _REGISTRY.get(cls.name)
    if old is not None and old is not cls:
        raise PassSpecError(f"two passes are named {cls.name!r}: {old.__module__}."
                            f"{old.__qualname__} and {cls.__module__}.{cls.__qualname__}")
    _REGISTRY[cls.name] = cls
    return cls


def unregister_pass(name: str) -> None:
    """Remove a pass from the registry (tests and plugin reloads)."""
    _REGISTRY.pop(name, None)


def _load_plugins() -> None:
    global _PLUGINS_LOADED
    if _PLUGINS_LOADED:
        return
    _PLUGINS_LOADED = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            cls = ep.load()
        except Exception as e:
            raise PassSpecError(f"plugin pass {ep.name!r} ({ep.value}) failed to load: {e}",
                                hint="fix or uninstall the package that provides it") from e
        if getattr(cls, "name", None) != ep.name:
            raise PassSpecError(f"plugin entry point {ep.name!r} loads {cls!r}, whose name "
                                f"is {getattr(cls, 'name', None)!r}",
                                hint="the entry-point name must equal the pass's name")
        register_pass(cls)


def available_passes() -> dict[str, type[Pass]]:
    """Every registered pass, plugins included, by name."""
    _load_plugins()
    return dict(sorted(_REGISTRY.items()))


def get_pass(name: str) -> type[Pass]:
    """The pass class registered under ``name``; PassSpecError listing the known ones."""
    if name not in _REGISTRY:
        _load_plugins()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise PassSpecError(f"unknown pass {name!r}",
                            hint="known passes: " + ", ".join(sorted(_REGISTRY))) from None
