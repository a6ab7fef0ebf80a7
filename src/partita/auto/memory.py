"""The solver's model of a plan's per-device peak memory (``Plan.memory()``), as linear rows.

``Plan.memory()`` walks the per-device program in order and holds each value from the node that
makes it to its last use (a view holds its base instead; the step's inputs are held
throughout, its results to the end), and the peak is the most bytes held at once. This module
makes the same walk over the traced program, where every value's per-device bytes follow
from its producer's candidate (``Pricer.local_bytes`` of the sharding the candidate gives).
The bytes held after one node are then linear in the x columns: a *row*. The peak is the
largest row, so "peak <= limit" is one ``<=`` row per node; the model keeps only the rows that
bind (:func:`peak_rows` picks the nodes where a few reference plans peak, and the driver adds
the node where the solver's own answer peaks when that row is over the limit, a cutting plane).

So the model counts, per device and exactly as the Plan's walk does: the parameters, the
optimizer state and the batch (all along), the gradients and the activations (from the op
that makes each to its last reader: the activations saved for the backward are held across
it, once), and the step's updated state (to the end). What it does not see is what the
partitioner adds: the copies a reshard makes (an FSDP weight gathered whole, an activation
resharded for its reader) and collectives' outputs. Those are the difference to
``Plan.memory()`` (``tests/test_auto_memory.py`` measures it on the presets), which the exact
check after the solve catches (``auto.search``).

This module does not solve or price time; ``auto.ilp`` puts the rows in the program.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch.fx as fx

from partita.auto.costs import Pricer
from partita.auto.space import Space
from partita.cost.flops import is_view, value_bytes

__all__ = ["Lifetimes", "PeakRows", "lifetimes", "peak_rows"]


@dataclass
class Lifetimes:
    """Every value of the traced program with the positions it is held over (both ends
    included) and its per-device bytes under each candidate of the block that gives it.

    Attributes:
        born, dies: per value, the first and last node position it is held at.
        block: per value, the block that gives it.
        start: per value, where its bytes per candidate start in ``flat``.
        flat: the bytes per candidate of every value, one after the other.
        fixed: (born, dies, bytes) of values no block decides (their bytes as traced).
        names: the node name per position (for the report).
    """

    born: np.ndarray
    dies: np.ndarray
    block: np.ndarray
    start: np.ndarray
    flat: np.ndarray
    fixed: list[tuple[int, int, float]]
    names: list[str]

    def timeline(self, choice: list[int]) -> np.ndarray:
        """Bytes held at every node position under ``choice`` (a candidate per block)."""
        picked = np.asarray(choice, dtype=np.int64)[self.block]
        nbytes = self.flat[self.start + picked]
        diff = np.zeros(len(self.names) + 1)
        np.add.at(diff, self.born, nbytes)
        np.add.at(diff, self.dies + 1, -nbytes)
        for born, dies, b in self.fixed:
            diff[born] += b
            diff[dies + 1] -= b
        return np.cumsum(diff)[:-1]

    def row(
        self, at: int, offsets: np.ndarray, widths: list[int], n_x: int
    ) -> tuple[np.ndarray, float]:
        """The bytes held at position ``at`` as a row over the x columns (a cluster's copies
        add to its shared columns) and a constant (the values no block decides)."""
        out = np.zeros(n_x)
        held = np.nonzero((self.born <= at) & (self.dies >= at))[0]
        for k in held:
            b = int(self.block[k])
            w = widths[b]
            lo = int(offsets[b])
            out[lo : lo + w] += self.flat[self.start[k] : self.start[k] + w]
        const = sum(b for born, dies, b in self.fixed if born <= at <= dies)
        return out, float(const)


def lifetimes(space: Space, pricer: Pricer, graph: fx.Graph) -> Lifetimes:
    """The values of ``graph`` (the traced program ``space`` was built from) with the positions
    ``Plan.memory()``'s walk holds them over, and their bytes per candidate (see the module)."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    end = len(nodes) - 1
    root: dict[fx.Node, fx.Node] = {}
    last: dict[fx.Node, int] = {}
    output = nodes[-1]
    for n in nodes:
        ins = n.all_input_nodes
        root[n] = root[ins[0]] if is_view(n) and ins else n
        for i in ins:
            r = root[i]
            # a value the step returns is held to the end, as Plan.memory()'s walk holds it
            last[r] = end if n is output else max(last.get(r, -1), pos[n])
    keys_of: dict[fx.Node, list[Any]] = {}
    for key in space.producer:
        keys_of.setdefault(key[0], []).append(key)
    born, dies, block, start = [], [], [], []
    flat: list[float] = []
    fixed: list[tuple[int, int, float]] = []
    memo: dict[tuple[int, tuple[int, ...], Any], tuple[int, int]] = {}
    for n in nodes:
        if root[n] is not n or n.op == "output":
            continue
        first = 0 if n.op == "placeholder" else pos[n]
        final = end if n.op == "placeholder" else last.get(n, pos[n])
        keys = keys_of.get(n)
        if not keys:
            nbytes = float(value_bytes(n.meta.get("val")))
            if nbytes:
                fixed.append((first, final, nbytes))
            continue
        for key in keys:
            b = space.producer[key]
            column = space.blocks[b].columns[key]
            shape, dtype = space.shapes[key], space.dtypes[key]
            found = memo.get((id(column), shape, dtype))
            if found is None:
                per = [0.0 if s is None else pricer.local_bytes(s, shape, dtype) for s in column]
                found = memo[(id(column), shape, dtype)] = (len(flat), len(per))
                flat.extend(per)
            born.append(first)
            dies.append(final)
            block.append(b)
            start.append(found[0])
    return Lifetimes(
        np.array(born, dtype=np.int64), np.array(dies, dtype=np.int64),
        np.array(block, dtype=np.int64), np.array(start, dtype=np.int64),
        np.array(flat, dtype=np.float64), fixed, [n.name for n in nodes],
    )  # fmt: skip


@dataclass
class PeakRows:
    """The ``<=`` rows of "the modelled peak is within the budget": the bytes held at a few
    node positions (``at``), each a row over the x columns plus a constant.

    :meth:`peak` is the model's exact peak of a choice (the largest of *every* position's
    bytes, not only the rows'); :meth:`add` adds the row of a position where a choice peaks
    over the budget (a cutting plane: the rows only ever tighten towards that peak)."""

    lifetimes: Lifetimes
    offsets: np.ndarray
    widths: list[int]
    n_x: int
    at: list[int]
    rows: list[np.ndarray]
    consts: list[float]

    def peak(self, choice: list[int]) -> tuple[float, int]:
        """The modelled peak bytes of ``choice`` and the node position where it is reached."""
        live = self.lifetimes.timeline(choice)
        at = int(np.argmax(live))
        return float(live[at]), at

    def add(self, at: int) -> bool:
        """Add the row of position ``at``; False when it is already a row."""
        if at in self.at:
            return False
        row, const = self.lifetimes.row(at, self.offsets, self.widths, self.n_x)
        self.at.append(at)
        self.rows.append(row)
        self.consts.append(const)
        return True

    def held(self, chosen: np.ndarray) -> np.ndarray:
        """Per row, the bytes held under the x vector ``chosen``."""
        return np.array([r @ chosen + c for r, c in zip(self.rows, self.consts, strict=True)])


def peak_rows(
    space: Space, pricer: Pricer, offsets: np.ndarray, widths: list[int], n_x: int
) -> PeakRows:
    """The memory rows of ``space``'s program: the positions where the all-replicated choice
    (every block's first candidate: every value whole) and the smallest choice (every block's
    candidate of the fewest bytes) peak."""
    assert space.graph is not None, "the space was not built from a traced program"
    lt = lifetimes(space, pricer, space.graph)
    out = PeakRows(lt, offsets, widths, n_x, [], [], [])
    nb = len(space.blocks)
    smallest = [0] * nb
    per_block = np.zeros(max((int(offsets[b]) + widths[b] for b in range(nb)), default=0))
    for k in range(len(lt.block)):
        b = int(lt.block[k])
        lo, w = int(offsets[b]), widths[b]
        per_block[lo : lo + w] += lt.flat[lt.start[k] : lt.start[k] + w]
    for b in range(nb):
        lo, w = int(offsets[b]), widths[b]
        if w:
            smallest[b] = int(np.argmin(per_block[lo : lo + w]))
    for choice in ([0] * nb, smallest):
        out.add(out.peak(choice)[1])
    return out
