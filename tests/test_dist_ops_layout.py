"""The flat buffers of ``runtime.dist_ops``' reduce_scatter ops, in one process.

The torch call is replaced by a stand-in that records the flat buffer it is given and answers
as if every member held the same values (member ``t`` of the torch group receives the sum of
every member's chunk ``t``): the buffer must hold member ``t``'s chunk of every value in row
``t`` (member-major), each chunk in the order of its value moved to dim 0, and each result
must be this rank's chunk of its value times the group size. The processes' own tests
(``test_distributed.py``) run the real collectives. Last, a ``DistributedShardedTensor`` keeps
its shard for the next program to read. On Gloo a reduce_scatter is an all_to_all and a local
sum in the torch group's order, checked with a stand-in all_to_all the same way.
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


def _fake_all_to_all(seen: list[torch.Tensor], held: list[torch.Tensor], me: int) -> Any:
    """torch group rank ``t`` holds ``held[t]`` (this rank's own buffer stands for its own):
    row ``t`` of the receive buffer is ``held[t]``'s row ``me``, as an all_to_all gives."""

    def call(recv: torch.Tensor, send: torch.Tensor, **_: Any) -> _Done:
        seen.append(send.clone())
        n = len(held)
        for t in range(n):
            rows = (send if t == me else held[t]).view(n, -1)
            recv.view(n, -1)[t].copy_(rows[me])
        return _Done()

    return call


@pytest.mark.parametrize("torch_order", [(0, 1, 2, 3), (0, 2, 1, 3)])
def test_gloo_reduce_scatter_sums_in_torch_order(
    monkeypatch: pytest.MonkeyPatch, torch_order: tuple[int, ...]
) -> None:
    """On Gloo a reduce_scatter is an all_to_all of the same member-major buffer and a local
    sum of the received rows in torch group order (the devices' order, as the simulated mesh
    sums): values whose sum depends on the order (1e8 + 1 - 1e8 + 1 is 1.0 in that order in
    float32, 2.0 or 0.0 in others) show the order."""
    members = (0, 1, 2, 3)
    g = Group(None, members, torch_order, 0, scatter_by_all_to_all=True)
    me = torch_order.index(0)
    # torch rank t's value: every element its term of the order-revealing sum
    terms = [1e8, 1.0, -1e8, 1.0]
    held = [torch.full((4, 2), terms[t]) for t in range(4)]
    seen: list[torch.Tensor] = []
    monkeypatch.setattr(
        dist_ops.dist, "all_to_all_single", _fake_all_to_all(seen, [h.clone() for h in held], me)
    )
    monkeypatch.setattr(dist_ops, "REDUCE_SCATTER", None)  # never called on Gloo
    x = held[me].clone()
    got = dist_ops.run(dist_ops.reduce_scatter_bucket(g, [x], [0], "sum", ["data"], "n"))
    (sent,) = seen
    assert torch.equal(sent, _rows(x, 0, 4, g.to_torch).reshape(-1))
    want = torch.zeros(1, 2)
    for t in range(4):  # member 0's chunk, summed rank after rank
        want = want + held[t][:1]
    assert torch.equal(want, torch.full((1, 2), 1.0))
    assert torch.equal(got[0], want)
    avg = dist_ops.run(dist_ops.reduce_scatter(g, x, 0, "avg", ["data"], "n"))
    assert torch.equal(avg, want / 4)


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
