"""The Gloo collectives as point-to-point messages (runtime.p2p_collectives), in one process.

Each member of a group runs its mesh op (``runtime.dist_ops``) in a thread of its own on a
fake Gloo process group that only has ``send`` and ``recv`` (messages matched by source,
destination and tag): the results must be the reference's (the members' values gathered,
summed, exchanged in partita member order), the same bits on every member for an
all-reduce, and no torch.distributed collective may run (the fake group has none: the code
before ``runtime.p2p_collectives`` called ``all_gather_single`` and the like on it and fails).
The multi-process runs are tests/test_distributed.py and tests/test_overlap.py.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

import pytest
import torch

from partita.runtime import dist_ops, p2p_collectives
from partita.runtime.comm import Group


class _Net:
    """Messages in flight between the fake ranks, by (source, destination, tag)."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.queues: dict[tuple[int, int, int], deque[torch.Tensor]] = defaultdict(deque)
        self.sends = 0


class _Done:
    def wait(self) -> bool:
        return True


class _Recv:
    def __init__(self, net: _Net, key: tuple[int, int, int], into: torch.Tensor) -> None:
        self.net, self.key, self.into = net, key, into

    def wait(self) -> bool:
        with self.net.cv:
            if not self.net.cv.wait_for(lambda: bool(self.net.queues[self.key]), timeout=20):
                raise RuntimeError(f"fake recv {self.key} timed out")
            got = self.net.queues[self.key].popleft()
        assert got.shape == self.into.shape and got.dtype == self.into.dtype
        self.into.copy_(got)
        return True


class _FakeGloo:
    """Rank ``rank`` (torch group order) of a fake Gloo group: send and recv only."""

    def __init__(self, net: _Net, rank: int) -> None:
        self.net, self.rank_ = net, rank

    def name(self) -> str:
        return "gloo"

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _Done:
        (t,) = tensors
        assert t.is_contiguous()
        with self.net.cv:
            self.net.queues[(self.rank_, dst, tag)].append(t.clone())
            self.net.sends += 1
            self.net.cv.notify_all()
        return _Done()

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _Recv:
        (t,) = tensors
        assert t.is_contiguous()
        return _Recv(self.net, (src, self.rank_, tag), t)


def _run_group(members: tuple[int, ...], op: Callable[[Group, int], Any]) -> tuple[list[Any], int]:
    """Run ``op(group, member index)`` on every member at once; the results (member order)
    and the messages sent."""
    net = _Net()
    torch_order = tuple(sorted(members))
    out: list[Any] = [None] * len(members)
    errors: list[BaseException] = []

    def member(i: int) -> None:
        pg = _FakeGloo(net, torch_order.index(members[i]))
        try:
            out[i] = dist_ops.run(op(Group(pg, members, torch_order, i), i))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=member, args=(i,)) for i in range(len(members))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out, net.sends


MEMBERS = [(0, 1), (0, 1, 2, 3), (2, 0, 3, 1)]  # the last: partita order != torch order


def _values(n: int, shape: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(n)]


@pytest.mark.parametrize("members", MEMBERS)
def test_all_gather_and_bucket(members: tuple[int, ...]) -> None:
    n = len(members)
    xs = _values(n, (3, 5))
    ys = _values(n, (2, 4), seed=1)
    out, sends = _run_group(members, lambda g, i: dist_ops.all_gather(g, xs[i], 1, ["a"], "x"))
    for o in out:
        assert torch.equal(o, torch.cat(xs, dim=1))
    assert sends == n * (n - 1)  # each member's chunk straight to every peer
    out, _ = _run_group(
        members,
        lambda g, i: dist_ops.all_gather_bucket(g, [xs[i], ys[i]], [0, 1], ["a"], "b"),
    )
    for o in out:
        assert torch.equal(o[0], torch.cat(xs, dim=0))
        assert torch.equal(o[1], torch.cat(ys, dim=1))


@pytest.mark.parametrize("members", MEMBERS)
@pytest.mark.parametrize("reduce_op", ["sum", "avg", "max"])
def test_reduce_scatter_and_bucket(members: tuple[int, ...], reduce_op: str) -> None:
    n = len(members)
    xs = _values(n, (4, 2 * n))
    ys = _values(n, (n, 3), seed=2)
    fold: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "sum": lambda s: s.sum(0),
        "avg": lambda s: s.sum(0) / n,
        "max": lambda s: s.amax(0),
    }
    want_x = fold[reduce_op](torch.stack(xs)).chunk(n, dim=1)
    want_y = fold[reduce_op](torch.stack(ys)).chunk(n, dim=0)
    out, _ = _run_group(
        members, lambda g, i: dist_ops.reduce_scatter(g, xs[i], 1, reduce_op, ["a"], "r")
    )
    for i, o in enumerate(out):
        torch.testing.assert_close(o, want_x[i])
    out, _ = _run_group(
        members,
        lambda g, i: dist_ops.reduce_scatter_bucket(
            g, [xs[i], ys[i]], [1, 0], reduce_op, ["a"], "b"
        ),
    )
    for i, o in enumerate(out):
        torch.testing.assert_close(o[0], want_x[i])
        torch.testing.assert_close(o[1], want_y[i])


@pytest.mark.parametrize("members", MEMBERS)
@pytest.mark.parametrize("numel", [3, 50_001])  # one round; a reduce-scatter then a gather
def test_all_reduce_same_bits_on_every_member(members: tuple[int, ...], numel: int) -> None:
    n = len(members)
    xs = _values(n, (numel,))
    out, sends = _run_group(
        members, lambda g, i: dist_ops.all_reduce(g, xs[i].clone(), "sum", ["a"], "r", True)
    )
    torch.testing.assert_close(out[0], torch.stack(xs).sum(0))
    for o in out[1:]:
        assert torch.equal(o, out[0])  # replicas must agree bit for bit
    direct = n == 2 or numel * 4 <= p2p_collectives.DIRECT_ALL_REDUCE_BYTES
    assert sends == n * (n - 1) * (1 if direct else 2)
    out, _ = _run_group(
        members, lambda g, i: dist_ops.all_reduce_bucket(g, [xs[i], 2 * xs[i]], "max", ["a"], "b")
    )
    for o in out:
        assert torch.equal(o[0], torch.stack(xs).amax(0))
        assert torch.equal(o[1], torch.stack([2 * x for x in xs]).amax(0))


@pytest.mark.parametrize("members", MEMBERS)
def test_all_to_all(members: tuple[int, ...]) -> None:
    n = len(members)
    xs = _values(n, (2 * n, 3))
    out, _ = _run_group(members, lambda g, i: dist_ops.all_to_all(g, xs[i], 0, 1, ["a"], "t"))
    for j, o in enumerate(out):  # member j: chunk j of every member's value, in member order
        assert torch.equal(o, torch.cat([x.chunk(n, dim=0)[j] for x in xs], dim=1))


def test_only_gloo_groups_go_point_to_point() -> None:
    class _Other:
        def name(self) -> str:
            return "nccl"

    assert p2p_collectives.p2p_group(_FakeGloo(_Net(), 0))
    assert not p2p_collectives.p2p_group(_Other())
    assert not p2p_collectives.p2p_group(object())
