"""Layer clusters: the blocks of identical layer copies share one set of variables.

A captured program inlines a model's repeated layers, so a 48-layer GPT has 48 copies of each
layer's ops (forward, backward and optimizer update), and the integer program 48 copies of each
one-hot group. Capture tags each copied node with the part node it copies
(``capture.fx_nodes.CopyTag``; propagation maps a copy's rule by it), but the clusters do not
use it: the copies of the first and last layers are copies too, yet their neighbourhoods
differ, and two ops must look the same around them to share. So the copies are found by
structure: every block gets a label from what it is (an op's target, its source line, its
result shapes and dtypes; an input's shape, dtype and group size) and is relabelled
``ROUNDS`` times with the labels of its neighbours (the producers of its operands, in operand
order, and the multiset of its users) -- Weisfeiler-Lehman refinement. After the rounds, two
blocks with one label look the same from ``ROUNDS`` hops around: in the middle layers, the same
op of two copies; the ops near the first and last layer, whose neighbourhoods differ, keep
labels of their own. Blocks with one label and the same candidate list (the same assignments
and result shardings, in the same order) form a cluster that shares its variables.

Sharing is Alpa's layer clustering: every copy takes the same choice, so the program is exact
on the plans whose copies agree and cannot express the others. :func:`partita.auto.ilp.build_model`
adds each member's prices to the shared columns (the price of the cluster is the count times
one copy's) and keeps every edge between values exact; edges that repeat between the same
clusters with the same prices share their variables too.
"""

from __future__ import annotations

from typing import Any

import torch

from partita.auto.space import Block, Space
from partita.ir import node_meta

__all__ = ["ROUNDS", "cluster_blocks"]

#: Refinement rounds: how far around a block two copies must look the same.
ROUNDS = 2


def _shapes(val: Any) -> tuple[Any, ...]:
    # the dtype object, not its name: labels are only compared, and dtypes are singletons
    if isinstance(val, torch.Tensor):
        return ((tuple(val.shape), val.dtype),)
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return tuple(
        [
            (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else type(v).__name__
            for v in vals
        ]
    )


def _start(block: Block, names: dict[int, str], described: dict[int, Any]) -> tuple[Any, ...]:
    node = block.node
    val = node.meta.get("val")
    # the copies of a layer share their value objects (capture copies a part's nodes with
    # their meta): described once per object, by ``id`` (alive while the graph is)
    shapes = described.get(id(val))
    if shapes is None:
        shapes = described[id(val)] = _shapes(val)
    if block.op is None:
        return ("input", shapes, len(block.inputs), len(block.assigns))
    target = names.get(id(node.target))  # by id: an OpOverload hashes in Python
    if target is None:
        target = names[id(node.target)] = str(node.target)
    return (
        "op",
        target,
        node_meta.source(node) or "",
        shapes,
        len(block.followers),
        len(block.assigns),
    )


def _candidates(space: Space, block: Block) -> tuple[Any, ...]:
    """The block's candidate list with the value keys taken out (what must agree to share):
    its signature and its followers' (``auto.candidates``: one signature, one list)."""
    if block.sig is not None:
        sigs = tuple([f.sig for f in block.followers])
        if None not in sigs:
            return ("sig", block.sig, sigs)
    res = tuple(
        tuple(sorted(str(s) for s in r.values())) for r in block.results
    )  # a value's key differs per copy, its shardings must not
    assigns = tuple(tuple(sorted(a.items())) for a in block.assigns)
    return (assigns, res)


def cluster_blocks(space: Space, rounds: int = ROUNDS) -> list[int]:
    """Per block, the block whose variables it uses (itself when it shares with no earlier
    block); see the module."""
    n = len(space.blocks)
    operands: list[list[int]] = [[] for _ in range(n)]
    users: list[list[int]] = [[] for _ in range(n)]
    for use in space.uses:
        p = space.producer.get(use.value)
        if p is None:
            continue
        operands[use.block].append(p)
        users[p].append(use.block)
    ids: dict[Any, int] = {}
    names: dict[int, str] = {}  # str(target), once per target
    described: dict[int, Any] = {}  # _shapes, once per value object
    label = [ids.setdefault(_start(b, names, described), len(ids)) for b in space.blocks]
    for _ in range(rounds):
        ids = {}
        at = label.__getitem__  # map(at, ...) runs the look-ups in C
        # the users' labels as a multiset: sorted, so their order does not matter
        label = [
            ids.setdefault(
                (label[b], tuple(map(at, operands[b])), tuple(sorted(map(at, users[b])))),
                len(ids),
            )
            for b in range(n)
        ]
    first: dict[tuple[int, tuple[Any, ...]], int] = {}
    return [
        first.setdefault((label[b], _candidates(space, block)), b)
        for b, block in enumerate(space.blocks)
    ]
