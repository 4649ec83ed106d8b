"""Mesh: named device axes with sizes; what placements in the IR refer to."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import MeshError

_AXIS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def _pairs(axes: Any) -> list[tuple[Any, Any]] | None:
    """``axes`` (any iterable: a list, ``dict.items()``, a ``zip``) as (name, size) pairs;
    None when it is not iterable or holds anything else."""
    try:
        got = list(axes)
    except TypeError:
        return None
    if not all(isinstance(a, (tuple, list)) and len(a) == 2 for a in got):
        return None
    return [tuple(a) for a in got]


@dataclass(frozen=True)
class Mesh:
    """An ordered set of named mesh axes, e.g. ``Mesh({"dp": 4, "tp": 2})``."""

    axes: tuple[tuple[str, int], ...] = ()

    def __init__(self, axes: Mapping[str, int] | tuple[tuple[str, int], ...] | None = None,
                 **kw: int) -> None:
        if axes is not None and not isinstance(axes, Mapping):
            pairs = None if isinstance(axes, (str, bytes)) else _pairs(axes)
            if pairs is None:
                raise MeshError(f"cannot read mesh axes from {axes!r}",
                                hint="give a dict of axis sizes, Mesh({'dp': 4}), or (name, "
                                     "size) pairs, Mesh((('dp', 4),))")
            axes = pairs
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

    @classmethod
    def of(cls, mesh: Any) -> Mesh:
        """A Mesh from a Mesh, a dict of axis sizes, a torch DeviceMesh or a jax Mesh."""
        if isinstance(mesh, Mesh):
            return mesh
        if isinstance(mesh, Mapping):
            return cls(mesh)
        names = getattr(mesh, "mesh_dim_names", None)      # torch DeviceMesh
        if names is not None or type(mesh).__name__ == "DeviceMesh":
            if not names:
                raise MeshError("the torch DeviceMesh has no dimension names",
                                hint="create it with mesh_dim_names=('dp', ...)")
            return cls(tuple(zip(names, (int(s) for s in mesh.mesh.shape))))
        shape = getattr(mesh, "shape", None)                # jax.sharding.Mesh
        if isinstance(shape, Mapping) and hasattr(mesh, "axis_names"):
            return cls(tuple((str(n), int(shape[n])) for n in mesh.axis_names))
        raise MeshError(f"cannot read a mesh from {type(mesh).__name__}",
                        hint="pass diphoma_compile.Mesh({'dp': 4}), a dict of axis sizes, a "
                             "torch DeviceMesh or a jax.sharding.Mesh")

    def check_world(self, world_size: int, what: str = "processes") -> None:
        """MeshError unless the mesh has exactly ``world_size`` devices."""
        if self.size != world_size:
            axes = " x ".join(f"{n}={s}" for n, s in self.axes) or "no axes"
            raise MeshError(f"the mesh ({axes}) has {self.size} devices but there are "
                            f"{world_size} {what}",
                            hint="make the product of the axis sizes equal the world size")

    def __contains__(self, name: object) -> bool:
        return any(n == name for n, _ in self.axes)

    def __bool__(self) -> bool:
        return bool(self.axes)

    def __str__(self) -> str:
        return "mesh[" + ", ".join(f"{n}={s}" for n, s in self.axes) + "]"


DATA_AXIS_NAMES = ("dp", "data", "batch")
TENSOR_AXIS_NAMES = ("tp", "tensor", "model")


def tensor_axis(mesh: Mesh) -> str | None:
    """The mesh axis layers are split over (tensor parallelism): one named tp, tensor or
    model, if the mesh has one."""
    for n in TENSOR_AXIS_NAMES:
        if n in mesh.names:
            return n
    return None


PIPELINE_AXIS_NAMES = ("pp", "pipe", "pipeline")


def pipeline_axis(mesh: Mesh) -> str | None:
    """The mesh axis the step is cut into stages over: one named pp, pipe or pipeline."""
    for n in PIPELINE_AXIS_NAMES:
        if n in mesh.names:
            return n
    return None


def data_axis(mesh: Mesh, axis: str | None) -> str:
    """The mesh axis the batch is split over: ``axis``, the only axis, or one named like
    dp/data/batch; MeshError naming the axes otherwise."""
    names = mesh.names
    if axis is not None:
        if axis not in names:
            raise MeshError(f"the mesh has no axis {axis!r} (it has "
                            f"{', '.join(names) or 'no axes'})",
                            hint="name one of the mesh's axes, or build the mesh with it")
        return axis
    if len(names) == 1 and names[0] in TENSOR_AXIS_NAMES:
        raise MeshError(f"the mesh has only the tensor-parallel axis {names[0]!r}: no axis "
                        "to split the batch over",
                        hint=f"add a data axis of size 1, e.g. {{'dp': 1, '{names[0]}': "
                             f"{mesh.axis_size(names[0])}}}")
    if len(names) == 1:
        return names[0]
    for n in DATA_AXIS_NAMES:
        if n in names:
            return n
    known = {"pp", "tp", *TENSOR_AXIS_NAMES}
    hint = "pass axis='...' to parallelize"
    if names and all(n in known for n in names):
        # pp and tp only (Mesh({"pp": 2, "tp": 4})): the batch is not split at all
        hint = ("add a data axis of size 1, e.g. {'dp': 1, " +
                ", ".join(f"'{n}': {mesh.axis_size(n)}" for n in names) + "}, or " + hint)
    raise MeshError(f"cannot tell which of the mesh axes {', '.join(names) or '(none)'} is "
                    "the data axis", hint=hint)


NODE_AXIS_NAMES = ("node", "nodes")


def fold_nodes(mesh: Mesh, axis: str) -> tuple[Mesh, int]:
    """A mesh whose data axis ``axis`` is split into nodes by an axis named node (just
    before it: ``{"node": K, "dp": L}``, ranks row-major, node = dp index // L) as the data
    parallelism runs it: (the mesh with the two merged into ``axis`` of K * L devices, L
    devices per node). (mesh, 0) when it has no node axis of more than one device;
    MeshError for a node axis elsewhere."""
    node = next((n for n in NODE_AXIS_NAMES if n in mesh.names), None)
    if node is None or mesh.axis_size(node) == 1:
        return mesh, 0
    names = list(mesh.names)
    if axis == node:
        # the batch split over the node axis itself: no devices within a node to split
        # it further, so the quantized collectives have one hop
        raise MeshError(f"the data axis is the node axis {node!r} itself; compression's "
                        f"node axis splits a data axis into nodes of several devices each",
                        hint=f"name the devices within a node as the data axis, e.g. "
                             f"{{{node!r}: K, 'dp': devices per node}}, or rename the axis "
                             f"to dp when each node has one device")
    if axis not in names or names.index(axis) != names.index(node) + 1:
        raise MeshError(f"the mesh axis {node!r} must come just before the data axis "
                        f"{axis!r}: it splits the data axis into nodes (found "
                        f"{', '.join(names)})",
                        hint=f"order the mesh as {{{node!r}: K, {axis!r}: devices per node, "
                             "...}")
    axes = []
    for name, size in mesh.axes:
        if name == node:
            continue
        axes.append((name, size * mesh.axis_size(node) if name == axis else size))
    return Mesh(tuple(axes)), mesh.axis_size(axis)
