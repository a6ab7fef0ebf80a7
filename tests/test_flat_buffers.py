"""The flat buffers of the bucketed collectives are kept from one step to the next
(``runtime.comm.FlatBuffers``, used by ``runtime.dist_ops``): a bucket's second run sends from
and gathers into the same memory as its first, never into memory a result still reads, and
the results stay those of fresh buffers. A fake 2-rank torch (rank 1 of 2, reversed member
order) stands in for Gloo, and it keeps every buffer it was given alive: a buffer allocated
afresh could not land at the same address."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from partita.runtime import dist_ops
from partita.runtime.comm import FlatBuffers, Group


class _Done:
    def wait(self) -> None:
        pass


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[torch.Tensor]]:
    """The buffers each fake collective was handed, by kind (all kept alive)."""
    seen: dict[str, list[torch.Tensor]] = {"rs": [], "ag": []}

    def reduce_scatter(out: torch.Tensor, flat: torch.Tensor, **kw: Any) -> _Done:
        seen["rs"].append(flat)
        out.copy_(flat.reshape(2, -1)[0] * 2)  # torch rank 0's chunk, from 2 equal ranks
        return _Done()

    def all_gather(out: torch.Tensor, mine: torch.Tensor, **kw: Any) -> _Done:
        seen["ag"].append(out)
        out.reshape(2, -1)[0].copy_(mine + 100)  # torch rank 0's slot: the other rank's values
        return _Done()

    monkeypatch.setattr(dist_ops, "REDUCE_SCATTER", reduce_scatter)
    monkeypatch.setattr(dist_ops, "ALL_GATHER", all_gather)
    return seen


def _group() -> Group:
    return Group(None, (1, 0), (0, 1), 0)  # this is rank 1, partita's member 0, torch's rank 1


def test_a_bucket_reuses_its_flat_buffers_across_steps(sent: dict[str, list[torch.Tensor]]) -> None:
    g = _group()
    got = []
    for step in range(3):
        grads = [torch.arange(8.0).reshape(4, 2) + step, torch.arange(6.0) - step]
        got.append(
            dist_ops.run(dist_ops.reduce_scatter_bucket(g, grads, [0, 0], "sum", ["x"], "rs"))
        )
        xs = [torch.ones(2, 2) * step, torch.full((3,), 2.0 + step)]
        got.append(dist_ops.run(dist_ops.all_gather_bucket(g, xs, [0, 0], ["x"], "ag")))
    # one buffer of each size, every step (the fake holds every one it saw: none was freed)
    rs, ag = ({t.data_ptr() for t in sent[k]} for k in ("rs", "ag"))
    assert len(rs) == 1 and len(ag) == 1, (rs, ag)
    assert len(sent["rs"]) == len(sent["ag"]) == 3
    for step in range(3):  # and every result as from fresh buffers, none a view of one
        (a, b), (c, d) = got[2 * step], got[2 * step + 1]
        torch.testing.assert_close(a, (torch.arange(4.0, 8.0).reshape(2, 2) + step) * 2)
        torch.testing.assert_close(b, (torch.arange(3.0, 6.0) - step) * 2)
        torch.testing.assert_close(
            c, torch.cat([torch.ones(2, 2) * step, torch.ones(2, 2) * step + 100])
        )
        torch.testing.assert_close(d, torch.tensor([2.0 + step] * 3 + [102.0 + step] * 3))
        for r in (c, d):
            assert r.untyped_storage().data_ptr() not in ag


def test_a_gathered_view_keeps_its_buffer(sent: dict[str, list[torch.Tensor]]) -> None:
    """A one-value bucket gathered along dim 0 is a view of the gathered buffer: that buffer
    is not handed out again, so the next gather cannot overwrite the first result (a group in
    torch's member order: no reordering copy)."""
    g = Group(None, (0, 1), (0, 1), 1)  # rank 1, member 1 and torch rank 1
    first = dist_ops.run(dist_ops.all_gather_bucket(g, [torch.ones(2, 2)], [0], ["x"], "ag"))
    second = dist_ops.run(dist_ops.all_gather_bucket(g, [torch.zeros(2, 2)], [0], ["x"], "ag"))
    assert first[0].untyped_storage().data_ptr() == sent["ag"][0].data_ptr()  # a view indeed
    assert sent["ag"][1].data_ptr() != sent["ag"][0].data_ptr()
    torch.testing.assert_close(first[0], torch.cat([torch.ones(2, 2) + 100, torch.ones(2, 2)]))
    torch.testing.assert_close(second[0], torch.cat([torch.zeros(2, 2) + 100, torch.zeros(2, 2)]))


def test_buffers_in_flight_are_never_shared(sent: dict[str, list[torch.Tensor]]) -> None:
    """Two reduce_scatters of the same size in flight at once send from two buffers; once
    both are waited for, the next two reuse them."""
    g = _group()
    for _ in range(2):
        ops = [
            dist_ops.reduce_scatter_bucket(g, [torch.full((4,), float(i))], [0], "sum", ["x"], "rs")
            for i in range(2)
        ]
        for op in ops:
            next(op)
        results = [dist_ops.run(op) for op in ops]
        assert [r[0].tolist() for r in results] == [[0.0, 0.0], [2.0, 2.0]]
    ptrs = [t.data_ptr() for t in sent["rs"]]
    assert ptrs[0] != ptrs[1] and set(ptrs[2:]) == set(ptrs[:2])


def test_one_buffer_serves_smaller_requests() -> None:
    """Kept memory is what the buffers in use at once need: a buffer serves a smaller
    request, and one too small for a request is dropped rather than kept beside it."""
    pool = FlatBuffers()
    like = torch.zeros(1)
    a = pool.take(10, like)
    pool.give(a)
    b = pool.take(8, like)
    assert b.numel() == 8 and b.data_ptr() == a.data_ptr()
    pool.give(b)
    c = pool.take(12, like)  # a's buffer is too small: dropped, c is new
    pool.give(c)
    d = pool.take(10, like)
    assert d.data_ptr() == c.data_ptr() and d.untyped_storage().nbytes() == 12 * 4
    assert pool.take(10, like).data_ptr() not in (a.data_ptr(), c.data_ptr())  # nothing left
