"""The integer program over a :class:`~partita.auto.space.Space`, built as sparse matrices
(:mod:`partita.auto.highs` solves it).

Variables, in one vector:

* ``x[b, i]``: block ``b`` takes candidate ``i`` (binary; one per block sums to 1), priced with
  the candidate's compute, op-internal collectives and its followers' reshards;
* the reshard links of every value (:mod:`partita.auto.links`): per use a transport between
  the shardings the producer gives and those the use needs (``f``), and where several uses
  may need one sharding a copy variable (``w``) that pays its reshard once (copy reuse).

Rows: one-hot per block, the links' transport and copy rows, and optional ``<=`` rows
(under a memory limit, the per-device bytes held at the nodes where plans peak,
:mod:`partita.auto.memory`; compute at most a bound, for ``objective="bytes"``).

Prices are computed once per signature (``Block.sig``, ``auto.candidates``): the blocks of a
repeated layer, and the links between them, reuse the first copy's prices, so the build's
pricing work does not grow with the layers (``Model.priced_ops``, ``Model.priced_edges``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from partita.auto.costs import Pricer
from partita.auto.links import Edges, Rows, add_links
from partita.auto.memory import PeakRows, peak_rows
from partita.auto.space import Space
from partita.values.spec import Sharding

__all__ = ["MIP_GAP", "Edges", "Model", "Solution", "add_memory", "build_model"]

#: The MILP stops within this relative gap of its bound.
MIP_GAP = 0.01


@dataclass
class Model:
    """The LP's arrays, and where each block's x starts."""

    cost: np.ndarray
    eq_rows: list[np.ndarray]
    eq_cols: list[np.ndarray]
    eq_vals: list[np.ndarray]
    eq_rhs: list[float]
    ub_rows: list[np.ndarray]
    ub_cols: list[np.ndarray]
    ub_vals: list[np.ndarray]
    ub_rhs: list[float]
    offsets: np.ndarray  # per block: where its (shared) x columns start; one past the end last
    n_x: int
    stored: np.ndarray  # per x: per-device bytes of the values it gives (the tie-break's)
    compute: np.ndarray  # per x: modelled compute seconds
    build_seconds: float = 0.0
    #: per block, the block whose x columns it shares (``auto.clusters``); itself when none
    rep: list[int] = field(default_factory=list)
    #: blocks that have columns of their own (the clusters' count)
    clusters: int = 0
    #: per block, its number of candidates
    widths: list[int] = field(default_factory=list)
    edges: Edges = field(default_factory=lambda: Edges())
    #: price computations the build did (cache misses): blocks priced, (value, need) price
    #: tables; a repeated layer adds none
    priced_ops: int = 0
    priced_edges: int = 0
    #: link variables: transport (``f``) and copy (``w``) columns (``auto.links``)
    transport: int = 0
    copies: int = 0
    #: per x, its own price (without the reshards ``auto.links`` puts on x columns: the
    #: greedy pass prices those through ``edges``)
    own: np.ndarray = field(default_factory=lambda: np.zeros(0))
    #: the peak-memory rows (``auto.memory``), made by :func:`add_memory` under a memory limit
    memory: PeakRows | None = None


@dataclass
class Solution:
    """A choice per block and the solver's figures."""

    choice: list[int]
    objective: float
    bound: float
    gap: float
    integral_lp: bool
    solver: str
    variables: int
    rows: int
    build_seconds: float
    solve_seconds: float
    status: str = ""
    extra: dict[str, float] = field(default_factory=dict)


def build_model(space: Space, pricer: Pricer, rep: list[int] | None = None) -> Model:
    """The arrays of the program (see the module); prices from ``pricer``. ``rep[b]``: the
    block whose x columns block ``b`` shares (``auto.clusters``): its prices are added to
    those columns, and its values whose links repeat another's share their variables."""
    start = time.perf_counter()
    nb = len(space.blocks)
    rep = list(range(nb)) if rep is None else rep
    widths = [len(block.assigns) for block in space.blocks]
    starts = [0] * nb
    n_x = 0
    for b in range(nb):
        if rep[b] == b:
            starts[b] = n_x
            n_x += widths[b]
        else:
            starts[b] = starts[rep[b]]
    offsets = np.array([*starts, n_x], dtype=np.int64)
    eq, ub = Rows(), Rows()
    # prices by signature (``Block.sig``): a repeated layer's blocks are priced once
    memo: dict[Any, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    priced_ops = 0
    found_of: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for b, block in enumerate(space.blocks):
        if rep[b] == b:
            lo, width = starts[b], widths[b]
            eq.add(list(range(lo, lo + width)), [1.0] * width, 1.0)
        bsig = (block.sig, tuple([f.sig for f in block.followers]))
        found = memo.get(bsig) if block.sig is not None else None
        if found is None:
            found = _block_prices(space, pricer, block)
            priced_ops += 1 + len(block.followers)
            if block.sig is not None:
                memo[bsig] = found
        found_of.append(found)
    cost, compute, stored = (_summed(found_of, k, starts, widths, n_x) for k in range(3))
    for key in space.outputs:  # a partial result is reduced before it is returned
        b = space.producer[key]
        lo = offsets[b]
        for i, got in enumerate(space.blocks[b].columns[key]):
            if got is not None and got.partial:
                whole = Sharding(got.mesh, got.dim_axes)
                cost[lo + i] += pricer.reshard(got, whole, space.shapes[key], space.dtypes[key])
    links = add_links(space, pricer, offsets, n_x, eq, ub)
    total = links.cost
    total[:n_x] += cost

    def arrays(rows: Rows) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
        return (
            [np.array(rows.rows, dtype=np.int64)],
            [np.array(rows.cols, dtype=np.int64)],
            [np.array(rows.vals, dtype=np.float64)],
        )

    return Model(
        total, *arrays(eq), list(eq.rhs), *arrays(ub), list(ub.rhs),
        offsets, n_x, stored, compute, time.perf_counter() - start, rep,
        sum(1 for b in range(nb) if rep[b] == b), widths, links.edges,
        priced_ops=priced_ops, priced_edges=links.priced,
        transport=links.transport, copies=links.copies, own=cost,
    )  # fmt: skip


def add_memory(model: Model, space: Space, pricer: Pricer) -> PeakRows:
    """The model's peak-memory rows (``auto.memory``), made once: a solve with ``memory=``
    bounds them."""
    if model.memory is None:
        model.memory = peak_rows(space, pricer, model.offsets, model.widths, model.n_x)
    return model.memory


def _summed(
    found_of: Sequence[tuple[np.ndarray, ...]],
    k: int,
    starts: list[int],
    widths: list[int],
    n_x: int,
) -> np.ndarray:
    """Per x column, the sum of the ``k``-th price array of every block on it, added in block
    order (``np.add.at`` adds unbuffered, in index order: each column sums exactly as one
    ``+=`` per block would), in one call instead of one per block."""
    out = np.zeros(n_x)
    if found_of:
        first = np.repeat(np.array(starts, dtype=np.int64), widths)
        within = np.arange(len(first)) - np.repeat(np.cumsum(widths) - widths, widths)
        np.add.at(out, first + within, np.concatenate([f[k] for f in found_of]))
    return out


def _block_prices(
    space: Space, pricer: Pricer, block: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per candidate of ``block``: the price the objective counts (compute, internal
    collectives, its followers' reshards, a tie-break on stored bytes), the modelled compute,
    and the stored bytes per device."""
    width = len(block)
    price, compute = np.zeros(width), np.zeros(width)
    if block.op is not None:
        p, c = pricer.op(block.node, block.op.rule, block.assigns, block.local_bytes)
        price += p
        compute += c
    for f in block.followers:
        p, c = pricer.op(f.op.node, f.op.rule, f.assigns, f.local_bytes)
        shape, dtype = space.shapes[f.value], space.dtypes[f.value]
        bucketed = shape in space.stored_shapes
        moves = [
            pricer.reshard(h, n, shape, dtype, bucketed)
            for h, n in zip(f.has, f.needs, strict=True)
        ]
        price += np.array(p) + np.array(moves)
        compute += c
    mine = np.zeros(width)
    for k, column in block.columns.items():
        for i, s in enumerate(column):
            if s is not None:
                mine[i] += pricer.local_bytes(s, space.shapes[k], space.dtypes[k])
    # ties: of two equal plans, the one storing fewer bytes per device
    return price + mine * pricer.per_stored_byte, compute, mine
