"""Pass infrastructure: the Pass type, the registry (with entry-point plugins), pipeline
spec strings, and the Pipeline that verifies, dumps and times every pass."""

from __future__ import annotations

import dataclasses
import re
import sys
import time
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

from ..errors import DiphomaError, IRVerifyError, PassError, PassSpecError
from ..ir.core import Graph, Op
from ..ir.printer import format_op_head, print_graph
from ..ir.verify import verify

ENTRY_POINT_GROUP = "diphoma_compile.passes"


class PassFailure(DiphomaError):
    """Raised by a pass that cannot do its job; ``op`` names where, when known."""

    def __init__(self, message: str, *, op: Op | None = None, hint: str | None = None) -> None:
        self.op = op
        super().__init__(message, hint=hint)


class Decision(Protocol):
    """What one pass decided, for the plan: a frozen dataclass; ``to_dict`` is its JSON form."""

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

    def wants_dump(self, name: str) -> bool:
        """True when the IR after pass ``name`` should be dumped."""
        return self.dump_after == "all" or name in self.dump_after

    def decision(self, kind: type[_D]) -> _D | None:
        """The last decision of type ``kind`` a pass recorded (e.g. DataParallelRecord)."""
        return find_decision(self.decisions, kind)


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
        opts = [f"{_kebab(f.name)}={_fmt_opt(getattr(self, f.name))}"
                for f in dataclasses.fields(self)]
        return self.name + ("{" + ", ".join(opts) + "}" if opts else "")


def _kebab(s: str) -> str:
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


# ------------------------------------------------------------------ spec strings

_SPEC_TOKEN = re.compile(r"\s*(?:(?P<name>[A-Za-z_][A-Za-z0-9_\-]*)|(?P<punct>[{},=])"
                         r"|(?P<value>[^{},=\s]+))")


def _coerce(pass_cls: type[Pass], key: str, raw: str) -> Any:
    fields = {_kebab(f.name): f for f in dataclasses.fields(pass_cls)}
    f = fields.get(key)
    if f is None:
        known = ", ".join(fields) or "none"
        raise PassSpecError(f"pass {pass_cls.name!r} has no option {key!r} (options: {known})")
    hint_t = typing.get_type_hints(pass_cls).get(f.name, str)
    try:
        if hint_t is bool:
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1")
        if hint_t in (int, float, str):
            return hint_t(raw)
        return raw
    except ValueError:
        raise PassSpecError(f"option {key}={raw!r} of pass {pass_cls.name!r} should be "
                            f"{getattr(hint_t, '__name__', hint_t)}") from None


def parse_spec(spec: str) -> list[Pass]:
    """``"dce,cse,comm-fusion{bucket-mb=25}"`` -> pass instances, options typed."""
    toks: list[tuple[str, str, int]] = []
    pos = 0
    while pos < len(spec):
        if spec[pos:].strip() == "":
            break
        m = _SPEC_TOKEN.match(spec, pos)
        if m is None:
            raise PassSpecError(f"cannot read pass spec {spec!r} at position {pos}")
        kind = m.lastgroup
        toks.append((kind, m.group(kind), m.start(kind)))
        pos = m.end()
    passes: list[Pass] = []
    i = 0

    def err(msg: str, at: int) -> PassSpecError:
        return PassSpecError(f"{msg} in pass spec {spec!r} at position {at}",
                             hint="write passes as name or name{option=value, ...}, "
                                  "separated by commas")
    while i < len(toks):
        kind, text, at = toks[i]
        if kind != "name":
            raise err(f"expected a pass name, found {text!r}", at)
        cls = get_pass(text)
        i += 1
        opts: dict[str, Any] = {}
        if i < len(toks) and toks[i][1] == "{":
            i += 1
            while i < len(toks) and toks[i][1] != "}":
                if i + 2 >= len(toks) or toks[i][0] != "name" or toks[i + 1][1] != "=":
                    raise err("expected option=value", toks[i][2])
                key, raw = toks[i][1], toks[i + 2][1]
                if toks[i + 2][0] == "punct":
                    raise err(f"option {key!r} has no value", toks[i + 2][2])
                if _kebab(key) in opts:
                    raise err(f"option {key!r} is given twice", toks[i][2])
                opts[_kebab(key)] = _coerce(cls, _kebab(key), raw)
                i += 3
                if i < len(toks) and toks[i][1] == ",":
                    i += 1
            if i >= len(toks):
                raise err("unclosed '{'", len(spec))
            i += 1
        passes.append(cls(**{k.replace("-", "_"): v for k, v in opts.items()}))
        if i < len(toks):
            if toks[i][1] != ",":
                raise err(f"expected ',' between passes, found {toks[i][1]!r}", toks[i][2])
            i += 1
            if i == len(toks):
                raise err("trailing ','", toks[i - 1][2])
    return passes


# ------------------------------------------------------------------ pipeline

@dataclass(frozen=True)
class Pipeline:
    """An ordered list of passes; ``run`` verifies after each, dumps and times them."""

    passes: tuple[Pass, ...] = ()

    @classmethod
    def from_spec(cls, spec: str) -> Pipeline:
        """Build a pipeline from a spec string such as ``"dce,cse"``."""
        return cls(tuple(parse_spec(spec)))

    def spec(self) -> str:
        """The spec string that rebuilds this pipeline."""
        return ",".join(p.spec() for p in self.passes)

    def run(self, graph: Graph, ctx: PassContext | None = None) -> Graph:
        """Apply every pass in order; PassError names the pass, those before it, the op."""
        ctx = ctx or PassContext()
        if ctx.verify:
            try:
                verify(graph)
            except IRVerifyError as e:
                raise PassError(f"the input graph does not verify, before any pass ran:\n{e}",
                                pass_name="<input>") from e
        done: list[str] = []
        for k, p in enumerate(self.passes):
            spec = p.spec()
            t0 = time.perf_counter()
            try:
                new = p(graph, ctx)
            except Exception as e:
                raise _pass_error(spec, done, e) from e
            if not isinstance(new, Graph):
                raise PassError(f"pass {spec!r} returned {type(new).__name__}, not a Graph",
                                pass_name=p.name, before=tuple(done))
            t1 = time.perf_counter()
            changed = new is not graph
            new = new.replace(passes=new.passes + (spec,))
            if ctx.verify:
                try:
                    verify(new)
                except IRVerifyError as e:
                    raise _pass_error(spec, done, e, "left a graph that does not verify") from e
            t2 = time.perf_counter()
            ctx.records.append(PassRecord(spec, changed, t1 - t0, t2 - t1))
            if ctx.wants_dump(p.name):
                _dump(ctx, k, p.name, new)
            done.append(spec)
            graph = new
        return graph


def _pass_error(spec: str, done: list[str], e: Exception,
                what: str = "failed") -> PassError:
    before = ", ".join(done) if done else "none"
    msg = f"pass {spec!r} {what} (passes run before it: {before})\n{e}"
    op = getattr(e, "op", None)
    if isinstance(op, Op):
        msg += f"\n  at op: {format_op_head(op)}"
    elif not isinstance(e, DiphomaError):
        msg = f"{msg}\n  ({type(e).__name__}; this is a bug in the pass)"
    # str(e) already carries e's hint
    return PassError(msg, pass_name=spec.split("{")[0], before=tuple(done))


def _dump(ctx: PassContext, k: int, name: str, graph: Graph) -> None:
    text = print_graph(graph)
    if ctx.dump_dir is not None:
        ctx.dump_dir.mkdir(parents=True, exist_ok=True)
        (ctx.dump_dir / f"{k:02d}-{name}.ir").write_text(text)
    else:
        ctx.dump_stream(f"# IR after {name}\n{text}")
