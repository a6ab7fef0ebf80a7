"""The flat buffers of ``runtime.dist_ops``' reduce_scatter ops, in one process.

The torch call is replaced by a stand-in that records the flat buffer it is given and answers
as if every member held the same values (member ``t`` of the torch group receives the sum of
every member's chunk ``t``): the buffer must hold member ``t``'s chunk of every value in row
``t`` (member-major), each chunk in the order of its value moved to dim 0, and each result
must be this rank's chunk of its value times the group size. The processes' own tests
(``test_distributed.py``) run the real collectives. Last, a ``DistributedShardedTensor`` keeps
its shard for the next program to read.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from partita.runtime import dist_ops
from partita.runtime.comm import Group


class _Done:
    def wait(self) -> None:
        pass


def _fake_reduce_scatter(seen: list[torch.Tensor], n: int, me: int) -> Any:
    def call(out: torch.Tensor, flat: torch.Tensor, **_: Any) -> _Done:
        seen.append(flat.clone())
        out.view(-1).copy_(flat.view(n, -1)[me] * n)
        return _Done()

    return call


def _rows(x: torch.Tensor, dim: int, n: int, order: list[int]) -> torch.Tensor:
    """The reference: row ``t`` holds chunk ``order[t]`` of ``x`` along ``dim``, moved to dim
    0 and flattened."""
    chunks = x.chunk(n, dim)
    return torch.stack([chunks[j].movedim(dim, 0).reshape(-1) for j in order])


@pytest.mark.parametrize("torch_order", [(0, 1), (1, 0)])
def test_reduce_scatter_bucket_member_major(
    monkeypatch: pytest.MonkeyPatch, torch_order: tuple[int, int]
) -> None:
    g = Group(None, (0, 1), torch_order, 0)
    me = torch_order.index(0)  # this rank's torch group rank
    seen: list[torch.Tensor] = []
    monkeypatch.setattr(dist_ops, "REDUCE_SCATTER", _fake_reduce_scatter(seen, 2, me))
    xs = [torch.randn(6, 4), torch.randn(3, 8), torch.randn(4, 2, 6)]
    dims = [0, 1, 2]  # a column-parallel weight's gradient is cut along dim 1
    got = dist_ops.run(dist_ops.reduce_scatter_bucket(g, xs, dims, "sum", ["data"], "n"))
    (flat,) = seen
    want = torch.cat([_rows(x, d, 2, g.to_torch) for x, d in zip(xs, dims, strict=True)], dim=1)
    assert torch.equal(flat, want.reshape(-1))
    for x, d, r in zip(xs, dims, got, strict=True):
        assert r.is_contiguous()
        assert torch.equal(r, x.chunk(2, d)[0] * 2)


@pytest.mark.parametrize("dim", [0, 1])
def test_reduce_scatter_one_value(monkeypatch: pytest.MonkeyPatch, dim: int) -> None:
    g = Group(None, (0, 1), (0, 1), 1)
    seen: list[torch.Tensor] = []
    monkeypatch.setattr(dist_ops, "REDUCE_SCATTER", _fake_reduce_scatter(seen, 2, 1))
    x = torch.randn(4, 6)
    got = dist_ops.run(dist_ops.reduce_scatter(g, x, dim, "avg", ["data"], "n"))
    (flat,) = seen
    chunks = x.chunk(2, dim)
    assert torch.equal(flat.view(2, -1), _rows(x, dim, 2, [0, 1]))
    assert got.is_contiguous()
    assert torch.equal(got, chunks[1] * 2 / 2)


def test_distributed_shard_is_the_shard() -> None:
    """A program's output is the next program's input: the shard itself is read back
    (``DistributedMesh.local_input``), not a view of it made per step."""
    from types import SimpleNamespace

    from partita import Mesh, P
    from partita.runtime.dist_tensor import DistributedShardedTensor

    mesh = Mesh.create((2,), ("data",))
    local = torch.randn(3, 4)
    x = DistributedShardedTensor.from_local(
        local, P("data").to_sharding(mesh, 2), (6, 4), SimpleNamespace(rank=1)
    )
    assert x.addressable_shard is local
    assert x.addressable_data.shape == (1, 3, 4)
    assert x.addressable_data.data_ptr() == local.data_ptr()
