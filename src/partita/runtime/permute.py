"""The collective-permutes of a rank's program on torch.distributed, receives posted ahead.

A ``collective_permute`` names pairs ``src -> dst`` of devices: this rank sends its tensor to
at most one device and receives from at most one (zeros when it receives nothing, a copy when
it is its own pair). The pairs are constants of the program, so :func:`bind_permutes` works
out this rank's part of each permute (its :class:`Route`) once, when a program is bound.

On Gloo a point-to-point transfer is a rendezvous: the receiver announces its receive, then
the sender's bytes follow; Gloo's event-loop thread handles the announcements and the bytes,
and it busy-polls while the rank's own thread holds the connection's lock (its ``epoll`` is
level-triggered and the handler only ``try_lock``s; measured with ``bench/bench_permute.py``
and docs/pipeline.md). So, on Gloo, a program's permutes run as a :class:`PermuteStream`: at the
start of each run it posts the receives of the coming permutes, in program order, as many as
fit within the program's ``overlap_bytes`` (the bytes a rank may hold for collectives in
flight; ``runtime.overlap``); each permute then takes its receive already posted, tops up the
receives ahead, sends, and waits for the bytes. The peers' announcements have all arrived
before the bytes move, which is when the busy polling happened. The send and the receive are
two plain ``ProcessGroup.send``/``recv`` calls on the default group with partita's own tag
(no ``batch_isend_irecv`` wrapper), so a user's own point-to-point messages never meet them.

The receives ahead are buffers of the permute's result (its local shape and dtype, from the
program), held from the start of the run until their permute: up to ``overlap_bytes`` more
memory. ``overlap_bytes=0``, a program's first (measuring) run, the loop bodies and the other
backends (NCCL) post each receive at its permute; other backends keep ``batch_isend_irecv``.
A run stopped between two permutes (an error on this rank) leaves receives posted that the
peers' next messages would fill: the next run of that program raises, as the ranks are out
of step (every process must restart).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, fx

from partita.errors import DistributedError, InternalError
from partita.runtime.comm import call_collective

__all__ = ["TAG", "PermuteStream", "Route", "bind_permutes"]

_PERMUTE = torch.ops.partita.collective_permute.default
#: The point-to-point tag of partita's permutes ("pa"): apart from a user's messages (tag 0).
TAG = 0x7061


@dataclass(frozen=True)
class Route:
    """This rank's part of one collective_permute, and the result's shape if known."""

    send_to: int | None
    recv_from: int | None
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    device: torch.device | None = None

    @property
    def nbytes(self) -> int:
        if self.shape is None or self.dtype is None:
            return 0
        return _numel(self.shape) * self.dtype.itemsize

    @property
    def postable(self) -> bool:
        """Receives from a peer, with a known result: its receive can be posted ahead."""
        return self.recv_from is not None and self.shape is not None


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def route_of(node: fx.Node, rank: int) -> Route:
    """This rank's part of permute ``node`` (its pairs are the graph's constants)."""
    pairs = [int(p) for p in node.args[1]]  # type: ignore[union-attr,arg-type]
    srcs, dsts = pairs[0::2], pairs[1::2]
    send_to = dsts[srcs.index(rank)] if rank in srcs else None
    recv_from = srcs[dsts.index(rank)] if rank in dsts else None
    val = node.meta.get("val")
    if recv_from in (None, rank) or not isinstance(val, Tensor) or val.device.type == "meta":
        return Route(send_to, recv_from)
    return Route(send_to, recv_from, tuple(val.shape), val.dtype, val.device)


class PermuteStream:
    """The permutes of one bound program, in program order (see the module doc)."""

    def __init__(self, routes: Sequence[Route], budget: int, rank: int, gloo: bool) -> None:
        self.routes = list(routes)
        self.budget = budget if gloo else 0
        self.rank = rank
        self.gloo = gloo
        self._posted: dict[int, tuple[Tensor, Any]] = {}  # index -> (buffer, recv work)
        self._next = 0  # the next permute whose receive may be posted ahead
        self._held = 0  # bytes of receives posted and not yet taken
        self._pg: Any = None

    def begin(self) -> None:
        """The start of a run: post the first receives (within the budget)."""
        if self._posted:
            first = min(self._posted)
            raise DistributedError(
                f"rank {self.rank}: the previous run of this program stopped before its "
                f"collective_permute #{first}, with the receives of {len(self._posted)} "
                f"permutes posted; the peers' next messages would fill them, so the ranks are "
                f"out of step. The run cannot continue: every process must be restarted."
            )
        self._next, self._held = 0, 0
        if self.budget:
            self._pg = dist.distributed_c10d._get_default_group()
            self._post_ahead()

    def permute(
        self,
        x: Tensor,
        pairs: Sequence[int],
        mesh_axes: Sequence[str],
        node: str = "",
        *,
        index: int,
    ) -> Tensor:
        """Permute ``index`` of the program on this rank (the graph's arguments)."""
        route = self.routes[index]
        if route.recv_from == self.rank:
            return x.clone()
        if not self.gloo:
            return _batched(x, route, pairs, mesh_axes, node)
        pg = self._pg = self._pg or dist.distributed_c10d._get_default_group()
        pending = self._posted.pop(index, None)
        if pending is not None:
            self._held -= route.nbytes
            if pending[0].shape != x.shape or pending[0].dtype != x.dtype:
                raise DistributedError(
                    f"collective_permute {node!r}: the receive posted ahead holds "
                    f"{tuple(pending[0].shape)} {pending[0].dtype}, the value sent is "
                    f"{tuple(x.shape)} {x.dtype}: the program's recorded shape is wrong. This "
                    f"is a partita bug: report it with the plan (step.lower(*args).explain())."
                )
        self._next = max(self._next, index + 1)
        peers = list(pairs)

        def exchange() -> Tensor:
            recv = pending
            if recv is None and route.recv_from is not None:
                buf = torch.empty_like(x)
                recv = (buf, pg.recv([buf], route.recv_from, TAG))
            if self.budget:
                self._post_ahead()
            send = None
            if route.send_to is not None:
                send = pg.send([x.contiguous()], route.send_to, TAG)
            if recv is not None:
                recv[1].wait()
            if send is not None:
                send.wait()
            return torch.zeros_like(x) if recv is None else recv[0]

        out: list[Tensor] = []
        call_collective(
            node, "collective_permute", mesh_axes, None, lambda: out.append(exchange()), peers
        )
        return out[0]

    def _post_ahead(self) -> None:
        """Post the coming receives in order, while they fit the budget."""
        while self._next < len(self.routes):
            route = self.routes[self._next]
            if route.recv_from not in (None, self.rank):  # stops at one it cannot post: the
                if not route.postable or self._held + route.nbytes > self.budget:  # order
                    return  # of the receives from one peer is the order of their messages
                if route.shape is None or route.recv_from is None:  # postable says it has both
                    raise InternalError(f"a receive posted ahead without its shape: {route}")
                buf = torch.empty(route.shape, dtype=route.dtype, device=route.device)
                self._posted[self._next] = (buf, self._pg.recv([buf], route.recv_from, TAG))
                self._held += route.nbytes
            self._next += 1


def _batched(
    x: Tensor, route: Route, pairs: Sequence[int], mesh_axes: Sequence[str], node: str
) -> Tensor:
    """One permute with ``batch_isend_irecv`` (the backends other than Gloo: NCCL groups the
    two calls, which it needs for a ring)."""
    out = torch.zeros_like(x) if route.recv_from is None else torch.empty_like(x)
    p2p = []
    if route.send_to is not None:
        p2p.append(dist.P2POp(dist.isend, x.contiguous(), route.send_to, tag=TAG))
    if route.recv_from is not None:
        p2p.append(dist.P2POp(dist.irecv, out, route.recv_from, tag=TAG))
    if p2p:

        def run() -> None:
            for work in dist.batch_isend_irecv(p2p):
                work.wait()

        call_collective(node, "collective_permute", mesh_axes, None, run, peers=list(pairs))
    return out


def bind_permutes(graph: fx.Graph, rank: int, budget: int, gloo: bool) -> PermuteStream | None:
    """Bind every collective_permute of ``graph`` (in place) to one :class:`PermuteStream` of
    this rank, in graph order, and start the graph with its ``begin``; None without permutes.
    ``budget``: the bytes of receives that may be posted ahead (0: none)."""
    nodes = [n for n in graph.nodes if n.op == "call_function" and n.target is _PERMUTE]
    if not nodes:
        return None
    stream = PermuteStream([route_of(n, rank) for n in nodes], budget, rank, gloo)
    for i, node in enumerate(nodes):
        node.target = stream.permute
        node.kwargs = {**node.kwargs, "node": node.name, "index": i}
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        graph.call_function(stream.begin, ())
    return stream
