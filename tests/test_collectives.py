"""The mesh ops: stacked (simulated-mesh) implementations against a slow per-device reference,
eager single-device semantics, and fake-impl shapes."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from partita import Mesh
from partita.ir import collectives
from partita.runtime import stacked
from partita.runtime.stacked import STACKED_IMPLS

MESHES = [
    Mesh.create((2,), ("x",)),
    Mesh.create((2, 2), ("x", "y")),
    Mesh.create((2, 4), ("x", "y")),
    Mesh.create((2, 2, 2), ("x", "y", "z")),
    Mesh([5, 3, 7, 1, 0, 2, 6, 4], (2, 4), ("x", "y")),
    Mesh([3, 0, 2, 1], (2, 2), ("a", "b")),
]
DTYPES = [torch.float32, torch.bfloat16, torch.int64]


def _axes_choices(mesh: Mesh) -> list[tuple[str, ...]]:
    """Every non-empty subset of the mesh axes in every order."""
    out = []
    for r in range(1, mesh.ndim + 1):
        for combo in itertools.permutations(mesh.axis_names, r):
            out.append(combo)
    return out


CASES = [
    pytest.param(mesh, axes, id=f"{mesh!r}-{'.'.join(axes)}")
    for mesh in MESHES
    for axes in _axes_choices(mesh)
]


def _stack(mesh: Mesh, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Distinct small integers per device (exact in bfloat16 sums for these sizes)."""
    g = torch.Generator().manual_seed(mesh.size * 100 + len(shape))
    return torch.randint(-8, 9, (mesh.size, *shape), generator=g).to(dtype)


def _groups(mesh: Mesh, axes: tuple[str, ...]) -> list[list[int]]:
    """Groups as lists of mesh positions, members in group order."""
    return [[mesh.position(d) for d in group] for group in mesh.groups(axes)]


def _ref_reduce(parts: list[torch.Tensor], op: str) -> torch.Tensor:
    stack = torch.stack(parts)
    if op == "sum":
        return stack.sum(0, dtype=stack.dtype)
    if op == "max":
        return stack.amax(0)
    if op == "min":
        return stack.amin(0)
    total = stack.sum(0, dtype=stack.dtype)
    if total.is_floating_point():
        return total / len(parts)
    return torch.div(total, len(parts), rounding_mode="trunc")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("mesh", "axes"), CASES)
def test_all_gather(mesh: Mesh, axes: tuple[str, ...], dtype: torch.dtype) -> None:
    x = _stack(mesh, (3, 2), dtype)
    g = mesh.axes_size(axes)
    for dim in (0, 1):
        out = stacked.all_gather(mesh, x, dim, axes, g)
        for group in _groups(mesh, axes):
            expected = torch.cat([x[p] for p in group], dim=dim)
            for p in group:
                assert torch.equal(out[p], expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("mesh", "axes"), CASES)
def test_all_reduce(mesh: Mesh, axes: tuple[str, ...], dtype: torch.dtype) -> None:
    x = _stack(mesh, (3, 2), dtype)
    g = mesh.axes_size(axes)
    for op in collectives.REDUCE_OPS:
        if op == "avg" and dtype == torch.bfloat16:
            continue  # bfloat16 division rounding differs from the reference order
        out = stacked.all_reduce(mesh, x, op, axes, g)
        for group in _groups(mesh, axes):
            expected = _ref_reduce([x[p] for p in group], op)
            for p in group:
                assert torch.equal(out[p], expected), (op, group)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("mesh", "axes"), CASES)
def test_reduce_scatter(mesh: Mesh, axes: tuple[str, ...], dtype: torch.dtype) -> None:
    g = mesh.axes_size(axes)
    x = _stack(mesh, (2 * g, 3), dtype)
    for op in ("sum", "max", "min"):
        for dim, xx in ((0, x), (1, x.transpose(1, 2).contiguous())):
            out = stacked.reduce_scatter(mesh, xx, dim, op, axes, g)
            for group in _groups(mesh, axes):
                full = _ref_reduce([xx[p] for p in group], op)
                for i, p in enumerate(group):
                    assert torch.equal(out[p], full.chunk(g, dim)[i])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("mesh", "axes"), CASES)
def test_all_to_all(mesh: Mesh, axes: tuple[str, ...], dtype: torch.dtype) -> None:
    g = mesh.axes_size(axes)
    x = _stack(mesh, (2 * g, 3, g), dtype)
    for split_dim, concat_dim in [(0, 1), (1 - 1, 0), (2, 0), (0, 2), (2, 1)]:
        out = stacked.all_to_all(mesh, x, split_dim, concat_dim, axes, g)
        for group in _groups(mesh, axes):
            for j, p in enumerate(group):
                received = [x[q].chunk(g, split_dim)[j] for q in group]
                assert torch.equal(out[p], torch.cat(received, dim=concat_dim))


@pytest.mark.parametrize("mesh", MESHES, ids=repr)
def test_collective_permute_partial_pairs(mesh: Mesh) -> None:
    x = _stack(mesh, (2, 3), torch.float32)
    ids = list(mesh.device_ids)
    # A rotation over the first half of the devices; the rest receive nothing.
    half = ids[: max(2, mesh.size // 2)]
    pairs = [v for s, d in zip(half, half[1:] + half[:1], strict=True) for v in (s, d)]
    out = stacked.collective_permute(mesh, x, pairs, list(mesh.axis_names))
    senders = dict(zip(pairs[1::2], pairs[0::2], strict=True))
    for device in ids:
        p = mesh.position(device)
        if device in senders:
            assert torch.equal(out[p], x[mesh.position(senders[device])])
        else:
            assert torch.equal(out[p], torch.zeros_like(x[p]))


def test_collective_permute_rejects_double_send() -> None:
    mesh = Mesh.create((4,), ("x",))
    with pytest.raises(ValueError, match="send to one device"):
        stacked.collective_permute(mesh, torch.zeros(4, 1), [0, 1, 0, 2], ["x"])


@pytest.mark.parametrize(("mesh", "axes"), CASES)
def test_axis_index_and_shard_slice(mesh: Mesh, axes: tuple[str, ...]) -> None:
    g = mesh.axes_size(axes)
    like = torch.zeros(mesh.size, 1)
    index = stacked.axis_index(mesh, like, axes)
    for group in _groups(mesh, axes):
        for i, p in enumerate(group):
            assert int(index[p]) == i
    for n in (1, g - 1 or 1, g, 2 * g + 1):
        x = _stack(mesh, (n, 2), torch.int64)
        out = stacked.shard_slice(mesh, x, 0, axes, g)
        c = -(-n // g)
        assert out.shape == (mesh.size, c, 2)
        for p in range(mesh.size):
            padded = torch.cat([x[p], x.new_zeros(c * g - n, 2)])
            assert torch.equal(out[p], padded[int(index[p]) * c : (int(index[p]) + 1) * c])


def test_stacked_impls_cover_every_mesh_op() -> None:
    assert set(STACKED_IMPLS) == set(collectives.MESH_OPS)
    assert len(collectives.COLLECTIVE_OPS) == 5
    assert len(collectives.MESH_OPS) == 7


def test_fake_shapes_match_eager_and_stacked() -> None:
    mesh = Mesh.create((2, 4), ("x", "y"))
    x = torch.arange(8 * 12 * 6, dtype=torch.float32).reshape(8, 12, 6)
    calls = [
        (collectives.all_gather, (1, ["y"], 4), stacked.all_gather),
        (collectives.all_reduce, ("sum", ["y"], 4), stacked.all_reduce),
        (collectives.reduce_scatter, (0, "max", ["y"], 4), stacked.reduce_scatter),
        (collectives.all_to_all, (0, 1, ["y"], 4), stacked.all_to_all),
        (collectives.collective_permute, ([0, 1, 1, 0], ["y"]), stacked.collective_permute),
        (collectives.axis_index, (["x", "y"],), stacked.axis_index),
        (collectives.shard_slice, (1, ["y", "x"], 8), stacked.shard_slice),
    ]
    for wrapper, args, impl in calls:
        eager = wrapper(x[0], *args)
        with FakeTensorMode():
            fake = wrapper(torch.empty(12, 6), *args)
        out = impl(mesh, x, *args)
        assert tuple(fake.shape) == tuple(eager.shape) == tuple(out.shape[1:]), wrapper
        assert fake.dtype == eager.dtype == out.dtype


def test_eager_single_device_semantics() -> None:
    x = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(collectives.all_gather(x, 0, ["x"], 1), x)
    assert torch.equal(collectives.all_reduce(x, "sum", ["x"], 1), x)
    assert torch.equal(collectives.reduce_scatter(x, 1, "sum", ["x"], 1), x)
    assert torch.equal(collectives.all_to_all(x, 0, 1, ["x"], 1), x)
    assert torch.equal(collectives.shard_slice(x, 1, ["x"], 1), x)
    assert int(collectives.axis_index(x, ["x"])) == 0
    # Every device holding the same x: an all_reduce(sum) over 4 is 4x; a shard_slice keeps
    # chunk 0 of the padded dim.
    assert torch.equal(collectives.all_reduce(x, "sum", ["x"], 4), 4 * x)
    assert torch.equal(collectives.shard_slice(x, 1, ["x"], 2), x[:, :2])
