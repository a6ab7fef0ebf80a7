"""The solver's reshard collectives planned on a normalised shape (``partita.auto.moves``)
equal the partitioner's plan on the real shape: the same collectives, kinds, mesh axes and
bytes, for every pair of shardings of a few shapes on (2, 4), even and uneven, partial or not."""

from __future__ import annotations

import itertools

import pytest

from partita import Mesh
from partita.auto.moves import collectives, signature
from partita.partition.reshard import plan_reshard
from partita.values.spec import Sharding

MESH = Mesh.create((2, 4), ("data", "model"))


def _shardings(rank: int) -> list[Sharding]:
    """Every way to put each mesh axis on a dim (or nowhere, or partial), both orders."""
    out = []
    places = [None, "partial", *range(rank)]
    for a, b in itertools.product(places, repeat=2):
        orders = (
            [("data", "model"), ("model", "data")]
            if a == b and a not in ("partial", None)
            else [("data", "model")]
        )
        for order in orders:
            dims: list[tuple[str, ...]] = [() for _ in range(rank)]
            partial = []
            for axis in order:
                where = a if axis == "data" else b
                if where == "partial":
                    partial.append(axis)
                elif where is not None:
                    dims[where] = (*dims[where], axis)
            out.append(Sharding(MESH, tuple(dims), tuple(partial)))
    return out


def _direct(
    src: Sharding, dst: Sharding, shape: tuple[int, ...]
) -> list[tuple[str, tuple[str, ...], int]]:
    out = []
    for step in plan_reshard(src, dst, shape):
        if step.is_collective:
            local = step.in_local_shape if step.kind == "reduce_scatter" else step.out_local_shape
            n = 1
            for d in local:
                n *= d
            out.append((step.kind, tuple(step.mesh_axes), n))
    return out


@pytest.mark.parametrize(
    "shape", [(16, 128, 256), (24, 6, 64), (3, 16, 1), (2048, 768), (16, 8, 128, 32)]
)
def test_a_normalised_reshard_plans_the_partitioners_collectives(shape: tuple[int, ...]) -> None:
    shardings = _shardings(len(shape))
    merged = 0
    for src in shardings:
        for dst in shardings:
            if dst.partial and src.partial != dst.partial:
                continue
            norm, _ = signature(src, dst, shape)
            merged += norm != shape
            assert collectives(src, dst, shape) == _direct(src, dst, shape), (src, dst)
    assert merged  # the normalisation did change shapes
