"""The IR's core: values, ops, regions and graphs, all immutable."""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Union

from ..errors import IRError
from ..mesh import Mesh
from .printer import print_graph
# the roles are part of the IR's vocabulary: importable from here too
from .roles import InputKind as InputKind
from .roles import InputRole, OutputRole, Phase
from .roles import OutputKind as OutputKind
from .types import TensorType

AttrValue = Union[None, bool, int, float, str, tuple["AttrValue", ...]]  # noqa: UP007 (recursive alias)


_ATTR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*\Z")


def _attr_key(v: Any) -> Any:
    # Floats compare by repr so that nan == nan and -0.0 != 0.0: the text form tells them apart.
    if isinstance(v, bool) or v is None:
        return ("b", v)
    if isinstance(v, int):
        return ("i", v)
    if isinstance(v, float):
        return ("f", repr(v))
    if isinstance(v, str):
        return ("s", v)
    return ("t", tuple(_attr_key(x) for x in v))


def _freeze_attr(key: str, v: Any) -> AttrValue:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, enum.Enum):
        return str(v.value)
    if isinstance(v, (list, tuple)):
        return tuple(_freeze_attr(key, x) for x in v)
    raise IRError(f"attribute {key!r} has a value of type {type(v).__name__}; attributes hold "
                  "None, bool, int, float, str or tuples of them")


class Attrs(Mapping[str, AttrValue]):
    """An immutable, sorted mapping of op attributes with text-form equality."""

    __slots__ = ("_items", "_hash")

    def __init__(self, items: Mapping[str, Any] | None = None, **kw: Any) -> None:
        merged = dict(items or {})
        merged.update(kw)
        for k in merged:
            if not isinstance(k, str) or not _ATTR_NAME.match(k):
                raise IRError(f"attribute name {k!r} is not an identifier",
                              hint="attribute names are words like axis or bucket_mb")
        self._items = tuple(sorted((str(k), _freeze_attr(k, v)) for k, v in merged.items()))
        self._hash: int | None = None

    def __getitem__(self, key: str) -> AttrValue:
        for k, v in self._items:
            if k == key:
                return v
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def _key(self) -> tuple:
        return tuple((k, _attr_key(v)) for k, v in self._items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Attrs):
            return self._key() == other._key()
        if isinstance(other, Mapping):
            return self == Attrs(other)
        return NotImplemented

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(self._key())
        return self._hash

    def __repr__(self) -> str:
        return f"Attrs({dict(self._items)!r})"

    def set(self, **kw: Any) -> Attrs:
        """A copy with some attributes replaced or added."""
        return Attrs(dict(self._items), **kw)


@dataclass(frozen=True)
class Value:
    """An SSA value: a unique name and a type."""

    name: str
    type: TensorType


@dataclass(frozen=True)
class Input:
    """A graph input: a value and its role."""

    value: Value
    role: InputRole = InputRole()

    @property
    def name(self) -> str:
        """The input's value name."""
        return self.value.name


@dataclass(frozen=True)
class Output:
    """A graph output: the name of a value and its role."""

    name: str
    role: OutputRole = OutputRole()


def _replace(obj: Any, kw: dict[str, Any]) -> Any:
    names = {f.name for f in dataclasses.fields(obj)}
    unknown = set(kw) - names
    if unknown:
        raise TypeError(f"{type(obj).__name__} has no field(s) {sorted(unknown)}")
    return dataclasses.replace(obj, **kw)


@dataclass(frozen=True)
class Region:
    """A nested block: arguments, ops, and the names it yields (JAX bodies, stage bodies)."""

    name: str
    args: tuple[Value, ...] = ()
    ops: tuple[Op, ...] = ()
    yields: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "args", tuple(self.args))
        object.__setattr__(self, "ops", tuple(self.ops))
        object.__setattr__(self, "yields", tuple(self.yields))

    def replace(self, **kw: Any) -> Region:
        """A copy with the named fields changed; unknown fields are an error."""
        return _replace(self, kw)


@dataclass(frozen=True)
class Op:
    """One operation: ``results = name(inputs) {attrs}`` with phase, stage and micro-batch."""

    name: str
    inputs: tuple[str, ...] = ()
    results: tuple[Value, ...] = ()
    attrs: Attrs = Attrs()
    regions: tuple[Region, ...] = ()
    phase: Phase | None = None
    stage: int | None = None
    microbatch: int | None = None
    loc: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "results", tuple(self.results))
        object.__setattr__(self, "regions", tuple(self.regions))
        if not isinstance(self.attrs, Attrs):
            object.__setattr__(self, "attrs", Attrs(self.attrs))
        if self.phase is not None and not isinstance(self.phase, Phase):
            object.__setattr__(self, "phase", Phase(self.phase))

    @property
    def result(self) -> Value:
        """The single result of a one-result op."""
        if len(self.results) != 1:
            raise IRError(f"op {self.name} has {len(self.results)} results, not one")
        return self.results[0]

    def replace(self, **kw: Any) -> Op:
        """A copy with the named fields changed; unknown fields are an error."""
        return _replace(self, kw)


@dataclass(frozen=True)
class Graph:
    """A whole program: typed inputs with roles, ops in program order, outputs with roles."""

    name: str = "main"
    inputs: tuple[Input, ...] = ()
    ops: tuple[Op, ...] = ()
    outputs: tuple[Output, ...] = ()
    mesh: Mesh = Mesh()
    passes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "ops", tuple(self.ops))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        object.__setattr__(self, "passes", tuple(self.passes))

    def replace(self, **kw: Any) -> Graph:
        """A copy with the named fields changed; unknown fields are an error."""
        return _replace(self, kw)

    def __str__(self) -> str:
        return print_graph(self)

    # ------------------------------------------------------------ lookups
    def input(self, name: str) -> Input:
        """The input with this value name."""
        for i in self.inputs:
            if i.name == name:
                return i
        raise KeyError(name)

    def walk(self) -> Iterator[Op]:
        """Every op, nested ones included, in program order (pre-order)."""
        yield from walk_ops(self.ops)

    def value_types(self) -> dict[str, TensorType]:
        """Type of every value in the graph, nested regions included."""
        types = {i.name: i.value.type for i in self.inputs}
        for op in self.walk():
            for r in op.regions:
                types.update((a.name, a.type) for a in r.args)
            types.update((v.name, v.type) for v in op.results)
        return types

    def fresh_names(self) -> NameSupply:
        """A supply of value names not used anywhere in this graph."""
        return NameSupply(self.value_types())


def walk_ops(ops: tuple[Op, ...]) -> Iterator[Op]:
    """Ops and the ops of their regions, pre-order."""
    for op in ops:
        yield op
        for r in op.regions:
            yield from walk_ops(r.ops)


class NameSupply:
    """Hands out value names that clash with none already taken."""

    def __init__(self, taken: Mapping[str, Any] | set[str]) -> None:
        self._taken = set(taken)
        self._counter = 0

    def __call__(self, hint: str | None = None) -> str:
        """A new name: ``hint`` if free, else ``hint.1``, ``hint.2``...; numbers without hint."""
        if hint is not None:
            name, k = hint, 0
            while name in self._taken:
                k += 1
                name = f"{hint}.{k}"
        else:
            while str(self._counter) in self._taken:
                self._counter += 1
            name = str(self._counter)
        self._taken.add(name)
        return name

