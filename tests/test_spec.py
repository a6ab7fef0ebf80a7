from __future__ import annotations

import dataclasses

import pytest

from partita import Mesh, P, PartitionSpec, Sharding, SpecError
from partita.values.spec import as_spec


def test_canonicalisation() -> None:
    assert P(["x", "y"]) == P(("x", "y"))
    assert P(["x", "y"]).entries == (("x", "y"),)
    assert P(("x",)) == P("x") and P(("x",)).entries == ("x",)
    assert P((), None).entries == (None, None)
    assert P([]) == P(None)
    assert P is PartitionSpec


def test_hash_eq_and_dict_key() -> None:
    table = {P(["x", "y"], None): "tuple"}
    assert table[P(("x", "y"), None)] == "tuple"
    assert hash(P("x", None)) == hash(P(["x"], None))
    assert P("x") != P("x", None)  # binding to a rank makes them equal, not the specs
    with pytest.raises(dataclasses.FrozenInstanceError):
        P("x").entries = ()  # type: ignore[misc]


def test_repr_and_sequence() -> None:
    assert repr(P("data", None)) == "P('data', None)"
    assert repr(P(("x", "y"), 1)) == "P(('x', 'y'), 1)"
    assert repr(P()) == "P()"
    spec = P("x", None, ("y", "z"))
    assert len(spec) == 3 and list(spec) == ["x", None, ("y", "z")] and spec[2] == ("y", "z")
    assert spec.mesh_axes == ("x", "y", "z")


def test_as_spec() -> None:
    assert as_spec(("x", None)) == P("x", None)
    assert as_spec(["x", None]) == P("x", None)
    assert as_spec(None) == P()
    spec = P("x")
    assert as_spec(spec) is spec
    with pytest.raises(SpecError, match=r"Expected a PartitionSpec such as P\('data', None\)"):
        as_spec("x")


def test_axis_used_twice_by_name() -> None:
    with pytest.raises(SpecError, match=r"uses mesh axis 'x' twice"):
        P("x", "x")
    with pytest.raises(SpecError, match=r"uses mesh axis 'x' twice"):
        P(("x", "y"), "x")


def test_axis_used_twice_by_name_and_index_when_bound() -> None:
    mesh = Mesh.create((2, 4), ("x", "y"))
    spec = P("x", 0)  # fine until bound: 0 is 'x' on this mesh
    # The message shows the spec as written (not P('x', 'x')) and which axis the index is.
    with pytest.raises(
        SpecError,
        match=r"P\('x', 0\) uses mesh axis 'x' twice on Mesh\(x=2, y=4\) \(index 0 is 'x'\)",
    ):
        spec.to_sharding(mesh, 2)


def test_unknown_axis() -> None:
    mesh = Mesh.create((2, 4), ("x", "y"))
    with pytest.raises(SpecError, match=r"refers to mesh axis 'z', which Mesh\(x=2, y=4\)"):
        P("z").to_sharding(mesh, 1)
    with pytest.raises(SpecError, match=r"refers to mesh axis index 2, but Mesh\(x=2, y=4\)"):
        P(2).to_sharding(mesh, 1)


def test_spec_longer_than_rank() -> None:
    mesh = Mesh.create((2, 4), ("x", "y"))
    with pytest.raises(SpecError, match=r"has 2 entries but the tensor has rank 1"):
        P("x", "y").to_sharding(mesh, 1)


@pytest.mark.parametrize("bad", [1.5, True, object(), {"x"}])
def test_bad_entry_types(bad: object) -> None:
    with pytest.raises(SpecError, match=r"must be a mesh axis name, a mesh axis index"):
        P("x", bad)
    with pytest.raises(SpecError, match=r"must be a mesh axis name"):
        P(("x", bad))


def test_to_sharding_pads_and_names_indices() -> None:
    mesh = Mesh.create((2, 4), ("x", "y"))
    s = P(1).to_sharding(mesh, 3)
    assert s.dim_axes == (("y",), (), ())
    assert s.spec == P("y", None, None)
    assert P(("y", 0)).to_sharding(mesh, 1).dim_axes == (("y", "x"),)


def test_sharding_properties() -> None:
    mesh = Mesh.create((2, 4), ("x", "y"))
    s = P("y", "x").to_sharding(mesh, 2)
    assert s.tile_shape == (4, 2)
    assert s.spec == P("y", "x")
    assert s.sharded_axes == ("y", "x") and s.replicated_axes == () and s.num_replicas == 1
    assert not s.is_replicated

    s = P("x", None).to_sharding(mesh, 2)
    assert s.tile_shape == (2, 1) and s.replicated_axes == ("y",) and s.num_replicas == 4

    r = Sharding.replicated(mesh, 2)
    assert r.is_replicated and r.replicated_axes == ("x", "y") and r.spec == P(None, None)


def test_sharding_partial() -> None:
    mesh = Mesh.create((2, 4), ("x", "y"))
    s = P("x", None).to_sharding(mesh, 2).with_partial(["y"], "max")
    assert s.partial == ("y",) and s.reduce_op == "max"
    assert s.replicated_axes == () and s.num_replicas == 1
    assert s.spec == P("x", None)  # partial axes are not part of a spec
    assert str(s) == "P('x', None) partial[max](y)"
    assert s.with_partial([]).reduce_op == "sum"
    # partial axes are kept in mesh order
    t = Sharding(mesh, ((), ()), ("y", "x"))
    assert t.partial == ("x", "y")


def test_sharding_str_and_eq() -> None:
    mesh = Mesh.create((2, 4), ("x", "y"))
    assert str(P("x", None).to_sharding(mesh, 2)) == "P('x', None)"
    assert repr(Sharding.replicated(mesh, 0)) == "P()"
    a = P(["x"], None).to_sharding(mesh, 2)
    b = P("x").to_sharding(mesh, 2)
    assert a == b and hash(a) == hash(b)
    assert a != P("x").to_sharding(Mesh.create((2, 4), ("x", "z")), 2)


def test_sharding_errors() -> None:
    mesh = Mesh.create((2, 4), ("x", "y"))
    with pytest.raises(SpecError, match=r"cannot both split a dim and hold partial values"):
        Sharding(mesh, (("x",),), ("x",))
    with pytest.raises(SpecError, match=r"reduce_op must be one of"):
        Sharding(mesh, (("x",),), ("y",), "mean")
    with pytest.raises(SpecError, match=r"is for rank 2, but the tensor has shape \(3,\)"):
        P("x").to_sharding(mesh, 2).check_shape((3,))
