"""One process group per mesh axis: which ranks share an axis, and this rank's place on it.

Ranks map to mesh coordinates row-major in the order the mesh names its axes, as
``torch.distributed.device_mesh.init_device_mesh`` lays them out: in
``Mesh({"dp": 2, "tp": 2})`` ranks 0 and 1 are dp index 0 (tp indices 0 and 1), ranks 2 and
3 dp index 1. The ranks that differ only in one axis's coordinate form that axis's group."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..mesh import Mesh


def coordinates(mesh: Mesh, rank: int) -> dict[str, int]:
    """The mesh coordinate of the ``rank``-th device, by axis (row-major, last axis fastest)."""
    out: dict[str, int] = {}
    stride = mesh.size
    for name, size in mesh.axes:
        stride //= size
        out[name] = (rank // stride) % size
    return out


def axis_ranks(mesh: Mesh, axis: str) -> list[list[int]]:
    """Every group of ``axis``: the mesh ranks that differ only in their ``axis``
    coordinate, each group in axis order, the groups in rank order of their first member."""
    groups: dict[tuple, list[int]] = {}
    for r in range(mesh.size):
        c = coordinates(mesh, r)
        key = tuple(v for a, v in c.items() if a != axis)
        groups.setdefault(key, []).append(r)
    return list(groups.values())


def new_axis_groups(mesh: Mesh, parent: Any = None) -> dict[str, Any]:
    """This rank's process group of every axis of more than one device, made with
    ``dist.new_group`` (a collective: every rank of ``parent`` calls it, and it makes every
    axis's every group in the same order on all of them). ``parent`` (default WORLD) holds
    the mesh's ranks in mesh order."""
    me = dist.get_rank(parent)
    mine: dict[str, Any] = {}
    for name, size in mesh.axes:
        if size == 1:
            continue
        for members in axis_ranks(mesh, name):
            ranks = [r if parent is None else dist.get_global_rank(parent, r) for r in members]
            g = dist.new_group(ranks)
            if me in members:
                mine[name] = g
    return mine



def level_ranks(mesh: Mesh, axis: str, local: int) -> dict[str, list[list[int]]]:
    """The two levels of ``axis`` split into nodes of ``local`` consecutive devices: for
    ``local`` the devices of each node, for ``node`` the devices with the same place in
    their node (one per node, in node order), over every group of the axis."""
    out: dict[str, list[list[int]]] = {"local": [], "node": []}
    for members in axis_ranks(mesh, axis):
        out["local"] += [members[a:a + local] for a in range(0, len(members), local)]
        out["node"] += [members[b::local] for b in range(local)]
    return out


def new_level_groups(mesh: Mesh, axis: str, local: int) -> dict[str, tuple[int, int, Any]]:
    """This rank's (size, index, process group) at each level of ``axis`` split into nodes
    of ``local`` devices (``dist.new_group`` on every rank, every group in the same order;
    mesh ranks are world ranks)."""
    me = dist.get_rank()
    mine: dict[str, tuple[int, int, Any]] = {}
    for level, groups in level_ranks(mesh, axis, local).items():
        for members in groups:
            g = dist.new_group(members)
            if me in members:
                mine[level] = (len(members), members.index(me), g)
    return mine
