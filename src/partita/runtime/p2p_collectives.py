"""The collectives of a Gloo group as point-to-point messages, every receive posted first.

Gloo's own collectives (``all_gather_single``, ``reduce_scatter_single``, ``all_reduce``) run
their algorithm on a Gloo worker thread, and Gloo's event-loop thread (``gloo_tcp_loop``)
moves the bytes. That loop's ``epoll`` is level-triggered and its handler only ``try_lock``s
the connection: while a worker thread holds the lock of a connection to write, bytes arriving
on it make the loop fire again and again for nothing (measured with ``perf stat`` on the
4-process GPT step: about 11 500 ``epoll_wait`` calls per step for 560 reads, the loop thread
16 ms of CPU per rank per step; ``bench/bench_distributed.py --threads`` and
docs/performance.md). ``runtime.permute`` found the same for collective-permutes.

So, on Gloo, ``runtime.dist_ops`` runs its collectives here, as ``send``/``recv`` on the
group's process group from the rank's own thread: a collective first posts *every* receive it
expects (each straight into its place in the result: no temporary buffer, no copy out), then
sends, and its :class:`Exchange` waits for them all. Each member's chunk goes directly to the
member that needs it (an all-gather sends its chunk to every peer, a reduce-scatter sends each
peer its chunk and sums the chunks it receives): the bytes each rank sends are those of a ring,
``(n - 1) / n`` of the buffer, with no step waiting for the previous one. An all-reduce is a
reduce-scatter of the flat buffer then an all-gather of the sums (its second round's receives
posted with the first). Sums add the members' chunks in torch group order, the same order on
every rank, so an all-reduce's result is the same bit for bit on every member.

Each collective of a group takes the next tag of that group (``Group.tags``: every member
issues the same collectives in the same order, so the tags agree), apart from the tags of
``runtime.permute`` and of a user's own messages (tag 0). This module knows no graphs and
no mesh axes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "Exchange",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "p2p_group",
    "reduce_scatter",
    "tag_sequence",
]

#: The tags of these collectives: ``TAG_BASE + (a group's collective count % TAG_SPAN)``.
TAG_BASE = 0x70700000
TAG_SPAN = 1 << 16


def p2p_group(pg: Any) -> bool:
    """Does this process group run its collectives here (a Gloo group)?"""
    name = getattr(pg, "name", None)
    return callable(name) and name() == "gloo"


def tag_sequence() -> Iterator[int]:
    """The tags of one group's collectives, in the order they are issued (``Group.tags``)."""
    return itertools.cycle(range(TAG_BASE, TAG_BASE + TAG_SPAN))


class Exchange:
    """The messages of one collective in flight: its sends, launched; :meth:`wait` posts its
    receives (``(buffer, source)``), waits for them and for the sends, then runs ``finish``
    (a sum of the chunks received, a second round)."""

    __slots__ = ("finish", "pg", "receives", "tag", "works")

    def __init__(
        self,
        pg: Any,
        tag: int,
        works: list[Any],
        receives: list[tuple[Tensor, int]] | None = None,
        finish: Callable[[], None] | None = None,
    ) -> None:
        self.pg, self.tag = pg, tag
        self.works = works
        self.receives = receives or []
        self.finish = finish

    def wait(self) -> None:
        receives, self.receives = self.receives, []
        works = [self.pg.recv([buf], src, self.tag) for buf, src in receives]
        works += self.works
        self.works = []
        for work in works:
            work.wait()
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()


def _peers(me: int, n: int) -> list[int]:
    """The other members, starting after this one (so the members do not all send to the
    same one first)."""
    return [(me + k) % n for k in range(1, n)]


def all_gather(pg: Any, tags: Iterator[int], rows: Tensor, me: int) -> Exchange:
    """Fill ``rows`` (``[n, numel]``, torch group order; row ``me`` holds this rank's chunk)
    with every member's chunk."""
    n, tag = rows.shape[0], next(tags)
    if not rows.numel():
        return Exchange(pg, tag, [])
    sends = [pg.send([rows[me]], t, tag) for t in _peers(me, n)]
    return Exchange(pg, tag, sends, [(rows[t], t) for t in _peers(me, n)])


def reduce_scatter(
    pg: Any, tags: Iterator[int], rows: Tensor, me: int, out: Tensor, reduce_op: str
) -> Exchange:
    """``out`` (``[numel]``) becomes the members' row ``me`` of ``rows`` (``[n, numel]``,
    torch group order: row ``t`` goes to member ``t``) reduced by ``reduce_op`` in member
    order."""
    n, tag = rows.shape[0], next(tags)
    if not rows.numel():
        return Exchange(pg, tag, [])
    sends = [pg.send([rows[t]], t, tag) for t in _peers(me, n)]
    got = [rows[me] if t == me else torch.empty_like(rows[me]) for t in range(n)]
    receives = [(got[t], t) for t in _peers(me, n)]
    return Exchange(pg, tag, sends, receives, lambda: _sum_into(out, got, reduce_op))


def _sum_into(out: Tensor, parts: Sequence[Tensor], reduce_op: str) -> None:
    """``out`` = the parts reduced in member order (``out`` may be one of them); ``avg`` is
    a sum here (``runtime.comm.finish_avg`` divides)."""
    fold = {"max": torch.maximum, "min": torch.minimum}.get(reduce_op, torch.add)
    total = fold(parts[0], parts[1])
    for p in parts[2:]:
        fold(total, p, out=total)
    out.copy_(total)


#: An all-reduce of at most this many bytes (or over two members) sends the whole buffer to
#: every peer and reduces it there, in one round; a larger one goes as a reduce-scatter and an
#: all-gather, which sends ``2 (n - 1) / n`` of it instead of ``n - 1``.
DIRECT_ALL_REDUCE_BYTES = 1 << 16


def all_reduce(
    pg: Any, tags: Iterator[int], flat: Tensor, me: int, n: int, reduce_op: str
) -> Exchange:
    """Reduce ``flat`` (1-D, contiguous) over the members in place (see the module doc)."""
    tag = next(tags)
    if not flat.numel():
        return Exchange(pg, tag, [])
    if n == 2 or flat.numel() * flat.element_size() <= DIRECT_ALL_REDUCE_BYTES:
        sends = [pg.send([flat], t, tag) for t in _peers(me, n)]
        whole = [flat if t == me else torch.empty_like(flat) for t in range(n)]
        receives = [(whole[t], t) for t in _peers(me, n)]
        return Exchange(pg, tag, sends, receives, lambda: _sum_into(flat, whole, reduce_op))
    pieces = list(flat.tensor_split(n))
    rows_tag = next(tags)
    sends = [pg.send([pieces[t]], t, tag) for t in _peers(me, n)]
    got = [pieces[me] if t == me else torch.empty_like(pieces[me]) for t in range(n)]

    def second_round() -> None:
        _sum_into(pieces[me], got, reduce_op)
        # member t sends its sum only after it has received all of this rank's pieces[t]
        gather = [pg.send([pieces[me]], t, rows_tag) for t in _peers(me, n)]
        Exchange(pg, rows_tag, gather, [(pieces[t], t) for t in _peers(me, n)]).wait()

    return Exchange(pg, tag, sends, [(got[t], t) for t in _peers(me, n)], second_round)


def all_to_all(pg: Any, tags: Iterator[int], send: Tensor, recv: Tensor, me: int) -> Exchange:
    """``recv[t]`` = member ``t``'s ``send[me]`` (both ``[n, ...]``, torch group order)."""
    n, tag = send.shape[0], next(tags)
    recv[me].copy_(send[me])
    if not send.numel():
        return Exchange(pg, tag, [])
    sends = [pg.send([send[t]], t, tag) for t in _peers(me, n)]
    return Exchange(pg, tag, sends, [(recv[t], t) for t in _peers(me, n)])
