"""Mesh: construction from the frameworks' meshes, and world-size checks."""

from __future__ import annotations

import pytest

from diphoma_compile import Mesh
from diphoma_compile.errors import MeshError


def test_of_dict_and_mesh():
    m = Mesh.of({"dp": 2, "tp": 4})
    assert m.axes == (("dp", 2), ("tp", 4)) and m.size == 8
    assert Mesh.of(m) is m


def test_of_jax_mesh():
    jax = pytest.importorskip("jax")
    import numpy as np
    from jax.sharding import Mesh as JaxMesh
    devices = np.array(jax.devices()[:1]).reshape(1, 1)
    assert Mesh.of(JaxMesh(devices, ("data", "model"))).axes == (("data", 1), ("model", 1))


def test_of_torch_device_mesh_without_process_group():
    torch = pytest.importorskip("torch")

    class FakeDeviceMesh:   # the attributes Mesh.of reads, without starting a process group
        mesh_dim_names = ("dp", "tp")
        mesh = torch.arange(8).reshape(2, 4)
    assert Mesh.of(FakeDeviceMesh()).axes == (("dp", 2), ("tp", 4))

    class Unnamed:
        mesh_dim_names = None
        mesh = torch.arange(4)
    Unnamed.__name__ = "DeviceMesh"
    with pytest.raises(MeshError, match="no dimension names"):
        Mesh.of(Unnamed())


def test_bad_meshes():
    with pytest.raises(MeshError, match="cannot read a mesh from int"):
        Mesh.of(4)
    # not (name, size) pairs: a ValueError from unpacking, or a TypeError, before
    for bad in ("dp", [("dp",)], [("dp", 2, 3)], 5):
        with pytest.raises(MeshError, match="cannot read mesh axes from"):
            Mesh(bad)
    assert Mesh([("dp", 2), ["tp", 2]]) == Mesh({"dp": 2, "tp": 2})
    sizes = {"dp": 2, "tp": 4}        # any iterable of pairs, as before
    assert Mesh(sizes.items()) == Mesh(zip(sizes, sizes.values())) == Mesh(sizes)
    with pytest.raises(MeshError, match=r"has 8 devices but there are 4 processes"):
        Mesh({"dp": 2, "tp": 4}).check_world(4)
    Mesh({"dp": 4}).check_world(4)
