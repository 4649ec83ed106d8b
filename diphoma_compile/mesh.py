"""Mesh: named device axes with sizes; what placements in the IR refer to."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import MeshError

_AXIS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True)
class Mesh:
    """An ordered set of named mesh axes, e.g. ``Mesh({"dp": 4, "tp": 2})``."""

    axes: tuple[tuple[str, int], ...] = ()

    def __init__(self, axes: Mapping[str, int] | tuple[tuple[str, int], ...] | None = None,
                 **kw: int) -> None:
        items = list(dict(axes).items()) if isinstance(axes, Mapping) else list(axes or ())
        items += list(kw.items())
        seen: set[str] = set()
        for name, size in items:
            if not isinstance(name, str) or not _AXIS_NAME.match(name):
                raise MeshError(f"mesh axis name {name!r} is not an identifier",
                                hint="use names such as 'dp', 'tp' or 'pp'")
            if name in seen:
                raise MeshError(f"mesh axis {name!r} is given twice")
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise MeshError(f"mesh axis {name!r} has size {size!r}; a size is a positive int")
            seen.add(name)
        object.__setattr__(self, "axes", tuple((n, int(s)) for n, s in items))

    @property
    def names(self) -> tuple[str, ...]:
        """Axis names in mesh order."""
        return tuple(n for n, _ in self.axes)

    @property
    def size(self) -> int:
        """Number of devices in the mesh."""
        return math.prod(s for _, s in self.axes)

    def axis_size(self, name: str) -> int:
        """Size of one axis; MeshError naming the axes there are when it is absent."""
        for n, s in self.axes:
            if n == name:
                return s
        have = ", ".join(self.names) or "none"
        raise MeshError(f"mesh has no axis {name!r} (axes: {have})",
                        hint="name an axis of the mesh, or add it to the mesh")

    def __contains__(self, name: object) -> bool:
        return any(n == name for n, _ in self.axes)

    def __bool__(self) -> bool:
        return bool(self.axes)

    def __str__(self) -> str:
        return "mesh[" + ", ".join(f"{n}={s}" for n, s in self.axes) + "]"
