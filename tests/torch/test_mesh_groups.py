"""Ranks laid out on a mesh row-major, as torch's init_device_mesh does, and the ranks of
each axis's process groups."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from diphoma_compile.mesh import Mesh  # noqa: E402
from diphoma_compile.torch.groups import axis_ranks, coordinates  # noqa: E402


def test_ranks_are_row_major_in_the_mesh_order():
    mesh = Mesh({"dp": 2, "tp": 2})
    assert [coordinates(mesh, r) for r in range(4)] == [
        {"dp": 0, "tp": 0}, {"dp": 0, "tp": 1}, {"dp": 1, "tp": 0}, {"dp": 1, "tp": 1}]
    assert axis_ranks(mesh, "tp") == [[0, 1], [2, 3]]
    assert axis_ranks(mesh, "dp") == [[0, 2], [1, 3]]


def test_groups_of_three_axes_and_of_one_device_axes():
    mesh = Mesh({"pp": 2, "dp": 1, "tp": 3})
    assert coordinates(mesh, 4) == {"pp": 1, "dp": 0, "tp": 1}
    assert axis_ranks(mesh, "tp") == [[0, 1, 2], [3, 4, 5]]
    assert axis_ranks(mesh, "pp") == [[0, 3], [1, 4], [2, 5]]
    assert axis_ranks(mesh, "dp") == [[r] for r in range(6)]
