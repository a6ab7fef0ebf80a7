from __future__ import annotations

import dataclasses

import pytest
import torch

import partita
from partita import (
    AnnotationError,
    Mesh,
    P,
    Shard,
    ShardedTensor,
    ShardingError,
    SpecError,
    clear_sharding,
    mark_sharding,
    reshard,
)
from partita.values.layout import local_shape, shard_tensor


def _padded(unpadded: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    out = unpadded.new_zeros(shape)
    out[tuple(slice(0, n) for n in unpadded.shape)] = unpadded
    return out


@pytest.mark.parametrize(
    ("shape", "spec"),
    [((8, 6), P("x", "y")), ((10, 6), P("y", None)), ((9, 3), P(("y", "x"))), ((5,), None)],
)
def test_mark_full_local_shards(mesh_2x4: Mesh, shape: tuple[int, ...], spec: P | None) -> None:
    x = torch.randn(shape)
    before = x.clone()
    s = mark_sharding(x, mesh_2x4, spec)
    assert torch.equal(x, before)  # the tensor is untouched
    assert isinstance(s, ShardedTensor)
    assert s.shape == torch.Size(shape) and s.ndim == len(shape)
    assert s.mesh == mesh_2x4 and s.spec == s.sharding.spec
    assert s.sharding == partita.values.spec.as_spec(spec).to_sharding(mesh_2x4, len(shape))
    assert torch.equal(s.full(), x)
    shards = s.local_shards
    assert [sh.device for sh in shards] == list(mesh_2x4.device_ids)
    for sh in shards:
        assert isinstance(sh, Shard)
        assert sh.data.shape == local_shape(s.sharding, shape) == s.local_shape
        assert torch.equal(sh.unpadded_data, x[sh.index])
        assert torch.equal(sh.data, _padded(sh.unpadded_data, sh.data.shape))


def test_shard_views_view_the_stack_and_local_shards_are_snapshots(mesh_4: Mesh) -> None:
    s = mark_sharding(torch.arange(8.0), mesh_4, P("x"))
    shard = s.local_shard_views[2]
    assert shard.data.data_ptr() == s.stacked[2].data_ptr()
    snapshot = s.local_shards[2]
    assert snapshot.data.data_ptr() != s.stacked[2].data_ptr()
    snapshot.data.fill_(-1)  # a snapshot: the tensor is unchanged
    assert s.full().tolist() == list(range(8))
    assert shard.index == (slice(4, 6),) and shard.replica_id == 0 and shard.device == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        shard.device = 3  # type: ignore[misc]


def test_local_shards_replica_ids_and_device_ids() -> None:
    mesh = Mesh([3, 2, 1, 0], (2, 2), ("x", "y"))
    s = mark_sharding(torch.arange(4.0), mesh, P("x"))
    assert [(sh.device, sh.replica_id, sh.index) for sh in s.local_shards] == [
        (3, 0, (slice(0, 2),)),
        (2, 1, (slice(0, 2),)),
        (1, 0, (slice(2, 4),)),
        (0, 1, (slice(2, 4),)),
    ]


def test_padding_only_devices() -> None:
    s = mark_sharding(torch.arange(9.0), Mesh.create((8,), ("x",)), P("x"))
    last = s.local_shards[7]
    assert last.index == (slice(9, 9),)
    assert last.unpadded_data.numel() == 0
    assert torch.equal(last.data, torch.zeros(2))


def test_full_is_a_new_tensor(mesh_2x4: Mesh) -> None:
    s = mark_sharding(torch.ones(2, 2), mesh_2x4, None)
    out = s.full()
    out += 1
    assert torch.equal(s.full(), torch.ones(2, 2))


def test_xla_style_specs(mesh_2x4: Mesh) -> None:
    x = torch.zeros(4, 4)
    assert mark_sharding(x, mesh_2x4, ("x", None)).spec == P("x", None)
    assert mark_sharding(x, mesh_2x4, [0, 1]).spec == P("x", "y")
    assert mark_sharding(x, mesh_2x4, (("x", "y"),)).spec == P(("x", "y"), None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_dtype_preserved(mesh_2x4: Mesh, dtype: torch.dtype) -> None:
    x = (torch.arange(30).reshape(5, 6) % 3).to(dtype)
    s = mark_sharding(x, mesh_2x4, P("y", "x"))
    assert s.dtype == dtype and s.stacked.dtype == dtype
    out = s.full()
    assert out.dtype == dtype and torch.equal(out, x)
    assert reshard(s, P(None, "y")).full().dtype == dtype


def test_remark_same_is_noop(mesh_2x4: Mesh) -> None:
    s = mark_sharding(torch.zeros(4, 4), mesh_2x4, P("x", None))
    assert mark_sharding(s, mesh_2x4, P("x")) is s
    assert mark_sharding(s, mesh_2x4, ("x", None)) is s


def test_remark_different_raises(mesh_2x4: Mesh) -> None:
    s = mark_sharding(torch.zeros(4, 4), mesh_2x4, P("x", None))
    with pytest.raises(AnnotationError, match=r"Existing annotation must be cleared first") as e:
        mark_sharding(s, mesh_2x4, P(None, "y"))
    msg = str(e.value)
    assert "P('x', None)" in msg and "P(None, 'y')" in msg and "clear_sharding" in msg
    assert isinstance(e.value, ValueError)
    other = Mesh.create((8,), ("x",))
    with pytest.raises(AnnotationError, match=r"on Mesh\(x=2, y=4\).*on Mesh\(x=8\)"):
        mark_sharding(s, other, P("x", None))


def test_clear_then_mark_in_place(mesh_2x4: Mesh) -> None:
    x = torch.randn(5, 7)
    s = mark_sharding(x, mesh_2x4, P("x", None))
    assert clear_sharding(s) is s
    assert not s.is_annotated
    assert s.sharding == P("x", None).to_sharding(mesh_2x4, 2)  # the data has not moved
    assert "annotation cleared" in repr(s)
    assert mark_sharding(s, mesh_2x4, P(None, ("y", "x"))) is s
    assert s.is_annotated and s.spec == P(None, ("y", "x"))
    assert s.local_shape == (5, 1)
    assert torch.equal(s.full(), x)
    # a cleared tensor may move to another mesh
    clear_sharding(s)
    mark_sharding(s, Mesh.create((3,), ("z",)), P("z"))
    assert s.stacked.shape == (3, 2, 7) and torch.equal(s.full(), x)


def test_reshard(mesh_2x4: Mesh) -> None:
    x = torch.randn(6, 4)
    s = mark_sharding(x, mesh_2x4, P("x", "y"))
    r = reshard(s, P("y", None))
    assert r is not s and r.spec == P("y", None) and s.spec == P("x", "y")
    assert torch.equal(r.full(), x)
    other = P("x").to_sharding(Mesh.create((3,), ("x",)), 2)
    assert torch.equal(reshard(s, other).full(), x)


def test_reshard_reduces_partial(mesh_2x4: Mesh) -> None:
    sharding = P("x").to_sharding(mesh_2x4, 1).with_partial(["y"])
    stacked = torch.ones(8, 2)
    s = ShardedTensor.from_stacked(stacked, sharding, (4,))
    assert torch.equal(s.full(), torch.full((4,), 4.0))
    r = reshard(s, None)
    assert r.sharding.is_replicated and torch.equal(r.full(), torch.full((4,), 4.0))


def test_from_stacked_validates(mesh_4: Mesh) -> None:
    sharding = P("x").to_sharding(mesh_4, 1)
    s = ShardedTensor.from_stacked(torch.arange(12).reshape(4, 3), sharding, (10,))
    assert s.full().tolist() == list(range(10))
    with pytest.raises(ShardingError, match=r"got storage of shape \(4, 2\).*needs \(4, 3\)"):
        ShardedTensor.from_stacked(torch.zeros(4, 2), sharding, (10,))
    with pytest.raises(SpecError, match=r"is for rank 1, but the tensor has shape \(10, 2\)"):
        ShardedTensor.from_stacked(torch.zeros(4, 3, 2), sharding, (10, 2))
    with pytest.raises(ShardingError, match=r"expects a partita.Sharding, got P\('x'\)"):
        ShardedTensor.from_stacked(torch.zeros(4, 3), P("x"), (10,))  # type: ignore[arg-type]


def test_from_held_expands_on_first_read_and_validates(mesh_2x4: Mesh) -> None:
    """Held once per ``y`` position (replicated over ``x``): the stacked storage is the 4
    tiles repeated for each ``x`` row, built on the first read; a wrong shape is refused."""
    sharding = P(None, "y").to_sharding(mesh_2x4, 2)
    value = torch.arange(24.0).reshape(4, 3, 2)  # [y, *local]
    s = ShardedTensor.from_held(value, (False, True), sharding, (3, 8))
    assert s.held is not None and s.local_shape == (3, 2) and s.dtype == torch.float32
    assert torch.equal(s.full(), torch.cat(list(value), dim=1))
    assert s.held is not None  # full() reads the held form in place
    assert torch.equal(s.stacked, value.repeat(2, 1, 1)) and s.held is None
    with pytest.raises(ShardingError, match=r"from_held got a value of shape \(2, 3, 2\).*"
                       r"needs \(4, 3, 2\) \(one leading dim per mesh axis"):  # fmt: skip
        ShardedTensor.from_held(value[:2], (False, True), sharding, (3, 8))
    # Identical everywhere (or varying along every axis): held too (jit reads it as is);
    # its stacked storage is a view, a stride-0 expand, built on the first read.
    whole = ShardedTensor.from_held(value[0], (False, False), P().to_sharding(mesh_2x4, 2), (3, 2))
    assert whole.held is not None
    assert whole.stacked.stride(0) == 0 and whole.stacked.data_ptr() == value.data_ptr()
    assert whole.held is None


def test_from_global(mesh_4: Mesh) -> None:
    x = torch.arange(10)
    s = ShardedTensor.from_global(x, P("x").to_sharding(mesh_4, 1))
    assert s.stacked.shape == (4, 3) and torch.equal(s.full(), x)


@pytest.mark.parametrize(
    "spec", [P(), P("x"), P(None, "y"), P("y", "x"), P(("x", "y")), P(None, ("y", "x"))]
)
@pytest.mark.parametrize("shape", [(8, 12), (5, 7)])
def test_from_global_holds_tiles_of_one_global_copy(
    mesh_2x4: Mesh, spec: P, shape: tuple[int, int]
) -> None:
    """Each distinct tile once, as views of one row-major copy of the value where no padding
    needs a copy (a column tile is strided: the tiles joined along the columns are a view);
    ``full`` reads that form in place; ``stacked`` is the stacked layout of ``shard_tensor``."""
    value = torch.randn(shape)
    sharding = spec.to_sharding(mesh_2x4, 2)
    s = ShardedTensor.from_global(value, sharding)
    assert s.held is not None
    tiles, axes = s.held
    assert axes == tuple(a in sharding.sharded_axes for a in mesh_2x4.axis_names)
    assert tiles.untyped_storage().data_ptr() != value.untyped_storage().data_ptr()
    if shape == (8, 12) and spec == P(None, "y"):
        assert tiles.shape == (4, 8, 3) and tiles.stride() == (3, 12, 1)
    assert torch.equal(s.full(), value) and s.held is not None
    assert torch.equal(s.stacked, shard_tensor(value, sharding)) and s.held is None
    value.zero_()  # the caller's tensor was copied
    assert not torch.equal(s.full(), value)


def test_repr(mesh_4: Mesh) -> None:
    s = mark_sharding(torch.arange(4.0), mesh_4, P("x"))
    assert repr(s) == "ShardedTensor(tensor([0., 1., 2., 3.]), sharding=P('x'), mesh=Mesh(x=4))"
    m = mark_sharding(torch.zeros(2, 2), mesh_4, P("x", None))
    assert repr(m) == (
        "ShardedTensor(tensor([[0., 0.],\n"
        "                      [0., 0.]]), sharding=P('x', None), mesh=Mesh(x=4))"
    )


def test_errors(mesh_2x4: Mesh) -> None:
    with pytest.raises(ShardingError, match=r"mark_sharding expects a torch.Tensor, got \[1, 2\]"):
        mark_sharding([1, 2], mesh_2x4, P("x"))  # type: ignore[arg-type]
    with pytest.raises(ShardingError, match=r"expects a partita.Mesh as its second argument"):
        mark_sharding(torch.zeros(2), ("x",), P("x"))  # type: ignore[arg-type]
    with pytest.raises(SpecError, match=r"refers to mesh axis 'data', which Mesh\(x=2, y=4\)"):
        mark_sharding(torch.zeros(2), mesh_2x4, P("data"))
    with pytest.raises(SpecError, match=r"has 2 entries but the tensor has rank 1"):
        mark_sharding(torch.zeros(2), mesh_2x4, P("x", "y"))
    with pytest.raises(SpecError, match=r"Expected a PartitionSpec"):
        mark_sharding(torch.zeros(2), mesh_2x4, "x")  # type: ignore[arg-type]
    with pytest.raises(ShardingError, match=r"clear_sharding expects a ShardedTensor"):
        clear_sharding(torch.zeros(2))  # type: ignore[arg-type]
    with pytest.raises(ShardingError, match=r"reshard expects a ShardedTensor"):
        reshard(torch.zeros(2), P("x"))  # type: ignore[arg-type]
    with pytest.raises(ShardingError, match=r"from_global expects a torch.Tensor"):
        ShardedTensor.from_global(3, P("x").to_sharding(mesh_2x4, 1))  # type: ignore[arg-type]


def test_public_exports() -> None:
    for name in ["ShardedTensor", "Shard", "mark_sharding", "clear_sharding", "reshard"]:
        assert name in partita.__all__ and hasattr(partita, name)
    assert partita.__all__ == sorted(partita.__all__)


def test_public_reshard_is_the_planners_move(mesh_2x4: Mesh) -> None:
    """partita.reshard gathered the whole value and cut it again, whatever the move."""
    from partita.frontend import reshard as relayout

    x = torch.arange(48.0).reshape(8, 6)
    s = mark_sharding(x, mesh_2x4, P("x", "y"))
    for spec in (P(("x", "y"), None), P(None, "x"), P("y", None), P(), P("x", "y")):
        r = partita.reshard(s, spec)
        assert r.spec == spec.to_sharding(mesh_2x4, 2).spec and torch.equal(r.full(), x), spec
    move = relayout._move(s, P(("x", "y"), None))
    assert move.plan.counts() == {"all_to_all": 1}  # not a gather of the whole value


def test_metadata_methods_read_the_global_shape_without_running_an_op(
    mesh_2x4: Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """numel / size / dim answer on any mesh, without the virtual device (a KV cache's
    get_seq_length() reads keys.shape; transformers calls numel() on its tensors)."""
    from partita.values import tensor_ops

    monkeypatch.setattr(tensor_ops, "_EAGER_OPS", [])  # an op would raise: none may run
    x = partita.mark_sharding(torch.ones(6, 5, dtype=torch.float16), mesh_2x4, P("x", "y"))
    assert x.size() == torch.Size([6, 5]) and x.size(-1) == 5 and x.size(0) == 6
    assert x.dim() == x.ndimension() == 2
    assert x.numel() == x.nelement() == 30
    assert x.element_size() == 2 and x.is_floating_point() and not x.is_complex()
    with pytest.raises(TypeError, match=r"needs partita\.virtual"):
        x.sum()
