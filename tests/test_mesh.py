from __future__ import annotations

import dataclasses
import resource
from typing import Any

import numpy as np
import pytest

from partita import HybridMesh, Mesh, MeshError
from partita.values.mesh import MAX_DEVICES


def test_construction_and_queries() -> None:
    mesh = Mesh([0, 1, 2, 3, 4, 5, 6, 7], (2, 4), ("x", "y"))
    assert mesh.device_ids == tuple(range(8))
    assert mesh.shape == (2, 4)
    assert mesh.axis_names == ("x", "y")
    assert mesh.size == 8 and mesh.ndim == 2
    assert mesh.axis_sizes == {"x": 2, "y": 4}
    assert mesh.axis_size("y") == 4 and mesh.axis_size(0) == 2 and mesh.axis_size(-1) == 4
    assert mesh.axes_size(["x", "y"]) == 8 and mesh.axes_size([]) == 1
    assert mesh.devices.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert mesh.coords(6) == {"x": 1, "y": 2}
    assert mesh.position(6) == 6


def test_nested_and_numpy_ids() -> None:
    a = Mesh([[3, 2], [1, 0]], (2, 2), ("a", "b"))
    b = Mesh(np.array([3, 2, 1, 0]), (2, 2), ("a", "b"))
    assert a == b
    assert a.device_ids == (3, 2, 1, 0)
    assert a.position(0) == 3
    assert a.coords(0) == {"a": 1, "b": 1}


def test_printing() -> None:
    assert repr(Mesh.create((2, 4), ("x", "y"))) == "Mesh(x=2, y=4)"
    assert repr(Mesh([1, 0], (2,), ("x",))) == "Mesh(x=2, device_ids=[1, 0])"
    assert repr(Mesh.create((2, 2))) == "Mesh(axis0=2, axis1=2)"


def test_hash_eq_frozen() -> None:
    a = Mesh.create((2, 4), ("x", "y"))
    b = Mesh(list(range(8)), [2, 4], ["x", "y"])
    assert a == b and hash(a) == hash(b)
    assert {a: 1}[b] == 1
    assert a != Mesh.create((2, 4), ("x", "z"))
    assert a != Mesh.create((4, 2), ("x", "y"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.shape = (8,)  # type: ignore[misc]


def test_create() -> None:
    assert Mesh.create((2, 4), ("data", "model")) == Mesh(range(8), (2, 4), ("data", "model"))
    assert Mesh.create(4, ("x",)).shape == (4,)


def test_duplicate_ids() -> None:
    with pytest.raises(MeshError, match=r"must be unique, but \[1\] appear more than once"):
        Mesh([0, 1, 1, 2], (4,), ("x",))


def test_shape_product_mismatch() -> None:
    with pytest.raises(MeshError, match=r"holds 8 devices, but 6 device ids were given"):
        Mesh(range(6), (2, 4), ("x", "y"))


def test_duplicate_axis_names() -> None:
    with pytest.raises(MeshError, match=r"axis names must be unique, but \['x'\]"):
        Mesh.create((2, 2), ("x", "x"))


@pytest.mark.parametrize("names", [("x",), ("x", "y", "z")])
def test_wrong_number_of_axis_names(names: tuple[str, ...]) -> None:
    with pytest.raises(MeshError, match=r"give exactly one name per axis"):
        Mesh.create((2, 2), names)


@pytest.mark.parametrize("shape", [None, 2.5j, object()])
def test_create_with_a_shape_that_is_no_shape(shape: object) -> None:
    # Mesh.create(None) used to fail with a bare "TypeError: 'NoneType' object is not iterable".
    with pytest.raises(
        MeshError,
        match=r"Mesh.create\(shape=.*\): the shape must be an int or a "
        r"sequence of ints .*got \w+\. Write Mesh.create\(\(2, 4\)",
    ):
        Mesh.create(shape)  # type: ignore[arg-type]


def test_empty_axis_name() -> None:
    with pytest.raises(MeshError, match=r"non-empty strings"):
        Mesh.create((2,), ("",))


@pytest.mark.parametrize("bad", [1.0, True, "1", None])
def test_non_integer_ids(bad: object) -> None:
    with pytest.raises(MeshError, match=r"Mesh device ids must be integers, got"):
        Mesh([0, bad], (2,), ("x",))


def test_non_sequence_ids() -> None:
    with pytest.raises(MeshError, match=r"must be a sequence of integers"):
        Mesh("01", (2,), ("x",))


def test_bad_shapes() -> None:
    with pytest.raises(MeshError, match=r"at least one axis"):
        Mesh([], (), ())
    with pytest.raises(MeshError, match=r"must be positive"):
        Mesh([], (0,), ("x",))
    with pytest.raises(MeshError, match=r"Mesh shape entries must be integers"):
        Mesh(range(2), (2.0,), ("x",))


def test_negative_ids() -> None:
    with pytest.raises(MeshError, match=r"non-negative"):
        Mesh([-1, 0], (2,), ("x",))


def test_unknown_axis_and_device() -> None:
    mesh = Mesh.create((2, 4), ("x", "y"))
    with pytest.raises(MeshError, match=r"Unknown mesh axis 'z'"):
        mesh.axis_size("z")
    with pytest.raises(MeshError, match=r"index 2 is out of range"):
        mesh.axis_size(2)
    with pytest.raises(MeshError, match=r"Device 9 is not in Mesh\(x=2, y=4\)"):
        mesh.position(9)


def test_groups() -> None:
    mesh = Mesh.create((2, 4), ("x", "y"))
    assert mesh.groups(["x"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.groups(["y"]) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert mesh.groups(["x", "y"]) == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert mesh.groups(["y", "x"]) == [[0, 4, 1, 5, 2, 6, 3, 7]]
    assert mesh.groups([]) == [[d] for d in range(8)]
    with pytest.raises(MeshError, match=r"repeat an axis"):
        mesh.groups(["x", 0])


def test_hybrid_mesh_positional_and_keyword() -> None:
    a = HybridMesh((1, 4), (2, 1), ("data", "model"))
    assert a.devices.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    b = HybridMesh(ici_mesh_shape=(2, 2), dcn_mesh_shape=(1, 2), axis_names=("x", "y"))
    assert b.devices.tolist() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert repr(b) == "Mesh(x=2, y=4, device_ids=[0, 1, 4, 5, 2, 3, 6, 7])"


def test_hybrid_mesh_dcn_major_on_each_axis() -> None:
    # Two hosts of four devices, hosts split along y: the host is the major part of y.
    mesh = HybridMesh((2, 2), (1, 2), ("x", "y"))
    host = mesh.devices // 4
    assert host.tolist() == [[0, 0, 1, 1], [0, 0, 1, 1]]
    # A collective over x stays within a host.
    assert all(len({d // 4 for d in group}) == 1 for group in mesh.groups(["x"]))
    assert HybridMesh((2, 4)) == Mesh.create((2, 4))


def test_hybrid_mesh_errors() -> None:
    with pytest.raises(MeshError, match=r"must have the same number of axes"):
        HybridMesh((2, 2), (2,))
    with pytest.raises(MeshError, match=r"shapes must be positive"):
        HybridMesh((2, 0), (1, 1))
    with pytest.raises(MeshError, match=r"covers 4 devices per host, but each host has 8"):
        HybridMesh((2, 2), (2, 1), devices_per_host=8)


@pytest.mark.parametrize(
    ("build", "where"),
    [
        (lambda: Mesh.create((2**31,)), r"Mesh.create: shape \(2147483648,\) holds 2,147,483,648"),
        (lambda: Mesh.create((2**16, 2**16), ("a", "b")), r"Mesh.create: shape \(65536, 65536\)"),
        (lambda: Mesh(list(range(8)), (2**31,)), r"Mesh: shape \(2147483648,\) holds"),
        (lambda: HybridMesh((2**16,), (2**16,)), r"HybridMesh: shape \(4294967296,\) holds"),
    ],
)
def test_a_mesh_above_the_limit_is_refused_before_allocating(build: Any, where: str) -> None:
    """A mesh of more than MAX_DEVICES (2**20) devices is a MeshError naming the size and the
    limit, raised before anything of the mesh's size exists: the process's peak memory does
    not grow by the gigabytes a 2**31-id tuple takes."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(MeshError, match=where + r".*limit of 1,048,576 \(2\*\*20\); nothing was"):
        build()
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000  # KiB


def test_a_mesh_at_the_limit_is_built() -> None:
    """2**16 and 2**20 devices (the limit) build, with the ids in order."""
    assert MAX_DEVICES == 2**20
    mesh = Mesh.create((2**6, 2**10), ("data", "model"))
    assert mesh.size == 2**16 and mesh.device_ids[-1] == 2**16 - 1
    mesh = Mesh.create((MAX_DEVICES,), ("data",))
    assert mesh.size == MAX_DEVICES and mesh.axis_size("data") == MAX_DEVICES
