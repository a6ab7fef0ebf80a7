"""The DistributedMesh's collective-permutes (``runtime.permute``) without processes.

A fake process group stands in for Gloo's: it records every ``send`` and ``recv`` in the order
they are posted and delivers the messages each peer sent, matched in that order per peer, as
Gloo's point-to-point transfers are. The checks: every receive of a run is posted at its start
when the budget allows, in program order; the budget stops the posting (never skipping a
receive it cannot post, so the receives from one peer stay in the order of their messages);
each permute returns the message it was sent, zeros when it receives nothing and a copy for
its own pair; a run stopped between two permutes makes the next one raise. The multi-process
runs (tests/test_distributed.py, tests/test_pipeline_parallel.py, the ring matmul of
tests/test_shard_map.py) check the results under 4 Gloo processes.
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Any

import pytest
import torch
from torch import fx

from partita.errors import DistributedError
from partita.runtime import permute as pm
from partita.runtime.permute import TAG, PermuteStream, Route, bind_permutes


class FakeWork:
    def __init__(self, done: Any = None) -> None:
        self.done = done

    def wait(self) -> bool:
        if self.done is not None:
            self.done()
        return True


class FakeGroup:
    """Rank 1 of a group whose peers' messages are queued in ``inbox[peer]``, in order."""

    def __init__(self, inbox: dict[int, list[torch.Tensor]]) -> None:
        self.inbox = {p: deque(ms) for p, ms in inbox.items()}
        self.log: list[tuple[str, int, tuple[int, ...]]] = []
        self.sent: dict[int, list[torch.Tensor]] = defaultdict(list)

    def recv(self, bufs: list[torch.Tensor], src: int, tag: int) -> FakeWork:
        assert tag == TAG
        self.log.append(("recv", src, tuple(bufs[0].shape)))
        message = self.inbox[src].popleft()  # matched in posting order, as Gloo matches

        def fill() -> None:
            bufs[0].copy_(message)

        return FakeWork(fill)

    def send(self, bufs: list[torch.Tensor], dst: int, tag: int) -> FakeWork:
        assert tag == TAG
        self.log.append(("send", dst, tuple(bufs[0].shape)))
        self.sent[dst].append(bufs[0].clone())
        return FakeWork()


def _program(pairs_and_shapes: list[tuple[list[int], tuple[int, ...]]]) -> fx.Graph:
    """A graph of permutes of an input, one per (pairs, shape) in order (meta ``val`` as the
    partitioner records it), returning every result."""
    graph = fx.Graph()
    outs = []
    for i, (pairs, shape) in enumerate(pairs_and_shapes):
        x = graph.placeholder(f"x{i}")
        node = graph.call_function(pm._PERMUTE, (x, pairs, ["i"]))
        node.meta["val"] = torch.empty(shape)
        outs.append(node)
    graph.output(tuple(outs))
    return graph


def _run(
    monkeypatch: pytest.MonkeyPatch,
    steps: list[tuple[list[int], tuple[int, ...]]],
    budget: int,
    inbox: dict[int, list[torch.Tensor]],
    runs: int = 1,
) -> tuple[FakeGroup, list[Any]]:
    graph = _program(steps)
    stream = bind_permutes(graph, rank=1, budget=budget, gloo=True)
    assert stream is not None
    program = fx.GraphModule(torch.nn.Module(), graph)
    group = FakeGroup({p: ms * runs for p, ms in inbox.items()})
    monkeypatch.setattr(pm.dist.distributed_c10d, "_get_default_group", lambda: group)
    xs = [torch.full(shape, 10.0 + i) for i, (_, shape) in enumerate(steps)]
    results = [program(*xs) for _ in range(runs)]
    return group, results


# rank 1 of 4: receives from 0 at permutes 0 and 2, from 2 at 3 (a different size), nothing
# at 1, its own pair at 4
STEPS = [
    ([0, 1, 1, 2], (2, 3)),
    ([1, 2], (2, 3)),
    ([0, 1], (2, 3)),
    ([2, 1, 1, 0], (5,)),
    ([1, 1], (2, 3)),
]
INBOX = {0: [torch.full((2, 3), 1.0), torch.full((2, 3), 3.0)], 2: [torch.full((5,), 4.0)]}


def _check_results(results: list[Any]) -> None:
    for out in results:
        torch.testing.assert_close(out[0], torch.full((2, 3), 1.0))
        torch.testing.assert_close(out[1], torch.zeros(2, 3))  # receives nothing
        torch.testing.assert_close(out[2], torch.full((2, 3), 3.0))
        torch.testing.assert_close(out[3], torch.full((5,), 4.0))
        torch.testing.assert_close(out[4], torch.full((2, 3), 14.0))  # its own pair: a copy


def test_every_receive_is_posted_at_the_start_of_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    group, results = _run(monkeypatch, STEPS, budget=1 << 20, inbox=INBOX, runs=2)
    _check_results(results)
    run = [
        ("recv", 0, (2, 3)),  # permutes 0, 2 and 3's receives, before any send
        ("recv", 0, (2, 3)),
        ("recv", 2, (5,)),
        ("send", 2, (2, 3)),
        ("send", 2, (2, 3)),
        ("send", 0, (5,)),
    ]
    assert group.log == run + run
    assert [t[0, 0].item() for t in group.sent[2]] == [10.0, 11.0] * 2


def test_the_budget_stops_the_posting_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """24 bytes ahead at most (one (2, 3) float receive): the second receive from 0 waits
    until the first is taken, and the receive from 2 is never posted before it."""
    group, results = _run(monkeypatch, STEPS, budget=24, inbox=INBOX)
    _check_results(results)
    assert group.log == [
        ("recv", 0, (2, 3)),  # at the start: permute 0's only
        ("recv", 0, (2, 3)),  # permute 0 took its receive: permute 2's fits now
        ("send", 2, (2, 3)),
        ("send", 2, (2, 3)),
        ("recv", 2, (5,)),  # 20 B: posted once permute 2 took its receive
        ("send", 0, (5,)),
    ]


def test_without_budget_each_receive_is_posted_at_its_permute(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    group, results = _run(monkeypatch, STEPS, budget=0, inbox=INBOX)
    _check_results(results)
    assert group.log == [
        ("recv", 0, (2, 3)),
        ("send", 2, (2, 3)),
        ("send", 2, (2, 3)),
        ("recv", 0, (2, 3)),
        ("recv", 2, (5,)),
        ("send", 0, (5,)),
    ]


def test_an_unknown_shape_is_never_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A receive whose shape the program does not record cannot be posted ahead; the ones
    after it from the same peer must wait for it (else they would take its message)."""
    graph = _program(STEPS)
    first = next(n for n in graph.nodes if n.op == "call_function")
    del first.meta["val"]
    stream = bind_permutes(graph, rank=1, budget=1 << 20, gloo=True)
    assert stream is not None and stream.routes[0] == Route(2, 0)
    program = fx.GraphModule(torch.nn.Module(), graph)
    group = FakeGroup(INBOX)
    monkeypatch.setattr(pm.dist.distributed_c10d, "_get_default_group", lambda: group)
    _check_results([program(*[torch.full(s, 10.0 + i) for i, (_, s) in enumerate(STEPS)])])
    assert group.log[:2] == [("recv", 0, (2, 3)), ("recv", 0, (2, 3))]
    assert group.log[2] == ("recv", 2, (5,))  # all posted once permute 0 ran


def test_a_run_stopped_between_permutes_makes_the_next_one_raise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    graph = _program(STEPS)
    stream = bind_permutes(graph, rank=1, budget=1 << 20, gloo=True)
    assert isinstance(stream, PermuteStream)
    group = FakeGroup(INBOX)
    monkeypatch.setattr(pm.dist.distributed_c10d, "_get_default_group", lambda: group)
    stream.begin()  # receives posted; the run stops before its first permute
    with pytest.raises(DistributedError, match="out of step"):
        stream.begin()


def test_a_program_without_permutes_is_left_alone() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.ops.aten.neg.default, (x,)))
    assert bind_permutes(graph, rank=0, budget=1 << 20, gloo=True) is None
    assert [n.op for n in graph.nodes] == ["placeholder", "call_function", "output"]
