from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from partita import Mesh, P, Sharding
from partita.values.layout import (
    index_ranges,
    local_shape,
    num_devices_with_data,
    replica_ids,
    shard_tensor,
    tile_assignment,
    unshard_tensor,
)

# --- the test vectors on Mesh.create((2, 4), ("x", "y")) ---------------------------


def test_tile_assignment_y_x(mesh_2x4: Mesh) -> None:
    ta = tile_assignment(P("y", "x").to_sharding(mesh_2x4, 2))
    assert ta.shape == (4, 2)
    assert ta.reshape(-1).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_tile_assignment_x_none_has_replication_dim(mesh_2x4: Mesh) -> None:
    s = P("x", None).to_sharding(mesh_2x4, 2)
    ta = tile_assignment(s)
    assert s.tile_shape == (2, 1)
    assert ta.shape == (2, 1, 4)
    assert ta.reshape(-1).tolist() == list(range(8))
    assert replica_ids(s).tolist() == [0, 1, 2, 3, 0, 1, 2, 3]


def test_tile_assignment_two_axes_on_one_dim(mesh_2x4: Mesh) -> None:
    ta = tile_assignment(P(("y", "x")).to_sharding(mesh_2x4, 1))
    assert ta.shape == (8,)
    assert ta.tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_ten_by_six_on_four_devices(mesh_4: Mesh) -> None:
    s = P("x", None).to_sharding(mesh_4, 2)
    assert local_shape(s, (10, 6)) == (3, 6)
    assert index_ranges(s, (10, 6))[:, 0].tolist() == [[0, 3], [3, 6], [6, 9], [9, 10]]
    x = torch.arange(60.0).reshape(10, 6)
    stacked = shard_tensor(x, s)
    assert stacked.shape == (4, 3, 6)
    assert torch.equal(stacked[3, 0], x[9])
    assert torch.equal(stacked[3, 1:], torch.zeros(2, 6))  # two rows of padding
    assert torch.equal(unshard_tensor(stacked, s, (10, 6)), x)


def test_nine_rows_on_eight_devices() -> None:
    s = P("x").to_sharding(Mesh.create((8,), ("x",)), 1)
    assert local_shape(s, (9,)) == (2,)
    r = index_ranges(s, (9,))[:, 0].tolist()
    assert r == [[0, 2], [2, 4], [4, 6], [6, 8], [8, 9], [9, 9], [9, 9], [9, 9]]
    assert num_devices_with_data(s, (9,)) == 5
    x = torch.arange(9.0)
    stacked = shard_tensor(x, s)
    assert torch.equal(stacked[5:], torch.zeros(3, 2))
    assert torch.equal(unshard_tensor(stacked, s, (9,)), x)


def test_zero_size_dims(mesh_2x4: Mesh) -> None:
    # A dim of size 0 has local size 0 everywhere; every device holds an empty shard.
    s = P("x", "y").to_sharding(mesh_2x4, 2)
    x = torch.zeros(0, 5)
    stacked = shard_tensor(x, s)
    assert stacked.shape == (8, 0, 2)
    assert unshard_tensor(stacked, s, (0, 5)).shape == (0, 5)
    assert num_devices_with_data(s, (0, 5)) == 0


def test_rank_zero(mesh_2x4: Mesh) -> None:
    s = Sharding.replicated(mesh_2x4, 0)
    stacked = shard_tensor(torch.tensor(3.0), s)
    assert stacked.shape == (8,)
    assert unshard_tensor(stacked, s, ()).item() == 3.0
    assert replica_ids(s).tolist() == list(range(8))


def test_unshard_checks_storage_shape(mesh_4: Mesh) -> None:
    s = P("x").to_sharding(mesh_4, 1)
    with pytest.raises(ValueError, match=r"Stacked storage has shape \(4, 2\), expected \(4, 3\)"):
        unshard_tensor(torch.zeros(4, 2), s, (10,))


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.bfloat16])
def test_partial_sum_keeps_dtype(mesh_2x4: Mesh, dtype: torch.dtype) -> None:
    s = P("x").to_sharding(mesh_2x4, 1).with_partial(["y"])
    x = (torch.arange(5) % 2).to(dtype)
    out = unshard_tensor(shard_tensor(x, s), s, (5,))
    assert out.dtype == dtype and torch.equal(out, x)


# --- properties over random meshes, shapes and specs ----------------------------------------


@st.composite
def cases(draw: st.DrawFn) -> tuple[Sharding, tuple[int, ...]]:
    mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    mesh = Mesh.create(mesh_shape, tuple("abc"[: len(mesh_shape)]))
    rank = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 12), min_size=rank, max_size=rank)))
    # Each mesh axis splits a random dim (-1: none), in a random order; the rest may be partial.
    order = draw(st.permutations(mesh.axis_names))
    dims: list[list[str]] = [[] for _ in range(rank)]
    unused = []
    for name in order:
        d = draw(st.integers(-1, rank - 1))
        (dims[d] if d >= 0 else unused).append(name)
    partial = [a for a in unused if draw(st.booleans())]
    reduce_op = draw(st.sampled_from(["sum", "max", "min"]))
    return Sharding(mesh, tuple(map(tuple, dims)), tuple(partial), reduce_op), shape


@given(cases(), st.integers(0, 2**31))
def test_round_trip(case: tuple[Sharding, tuple[int, ...]], seed: int) -> None:
    sharding, shape = case
    x = torch.randint(-100, 100, shape, generator=torch.Generator().manual_seed(seed))
    stacked = shard_tensor(x, sharding)
    assert stacked.shape == (sharding.mesh.size, *local_shape(sharding, shape))
    assert torch.equal(unshard_tensor(stacked, sharding, shape), x)
    # Float values round-trip exactly too (partial sums add zeros only).
    xf = x.to(torch.float32) / 7
    assert torch.equal(unshard_tensor(shard_tensor(xf, sharding), sharding, shape), xf)


@given(cases())
def test_each_replica_group_tiles_the_index_space_once(
    case: tuple[Sharding, tuple[int, ...]],
) -> None:
    sharding, shape = case
    ranges = index_ranges(sharding, shape)
    replicas = replica_ids(sharding)
    partial_coord = _partial_coords(sharding)
    assert sorted(set(replicas.tolist())) == list(range(sharding.num_replicas))
    for r in range(sharding.num_replicas):
        # Among devices with replica id r, those at partial coordinate 0 hold one addend each
        # of a tile; every other partial coordinate holds another full set of addends.
        for p in set(partial_coord.tolist()):
            count = np.zeros(shape, dtype=np.int64)
            for position in np.flatnonzero((replicas == r) & (partial_coord == p)):
                count[tuple(slice(a, b) for a, b in ranges[position])] += 1
            assert (count == 1).all()


@given(cases())
def test_replica_ids_distinct_within_each_tile(case: tuple[Sharding, tuple[int, ...]]) -> None:
    sharding, _shape = case
    ta = tile_assignment(sharding)
    n_tiles = int(np.prod(sharding.tile_shape))
    replicas = replica_ids(sharding)
    partial_coord = _partial_coords(sharding)
    mesh = sharding.mesh
    for tile_devices in ta.reshape(n_tiles, -1):
        positions = [mesh.position(int(d)) for d in tile_devices]
        for p in set(partial_coord[positions].tolist()):
            ids = sorted(int(replicas[q]) for q in positions if partial_coord[q] == p)
            assert ids == list(range(sharding.num_replicas))


@given(cases())
def test_shards_hold_their_index_range(case: tuple[Sharding, tuple[int, ...]]) -> None:
    sharding, shape = case
    x = torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape) + 1
    ranges = index_ranges(sharding, shape)
    stacked = shard_tensor(x, sharding.with_partial([]))  # partial moves values, not indices
    for position in range(sharding.mesh.size):
        index = tuple(slice(a, b) for a, b in ranges[position])
        local = tuple(slice(0, b - a) for a, b in ranges[position])
        assert torch.equal(stacked[position][local], x[index])
        padding = stacked[position].clone()
        padding[local] = 0
        assert not padding.any()


def _partial_coords(sharding: Sharding) -> np.ndarray:
    """Row-major index of each position along the partial axes."""
    mesh = sharding.mesh
    coords = np.indices(mesh.shape).reshape(mesh.ndim, -1)
    out = np.zeros(mesh.size, dtype=np.int64)
    for a in sharding.partial:
        out = out * mesh.axis_size(a) + coords[mesh.axis_index(a)]
    return out
