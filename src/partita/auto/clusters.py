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

import numpy as np
import torch

from partita.auto.space import Block, Space
from partita.ir import node_meta

__all__ = ["ROUNDS", "cluster_blocks"]

#: Refinement rounds: how far around a block two copies must look the same.
ROUNDS = 2

#: ``_refine`` reads the sequences of this many blocks or fewer whole, in Python.
_FEW = 16


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


def _start(
    block: Block, names: dict[int, str], described: dict[int, int], shape_ids: dict[Any, int]
) -> tuple[Any, ...]:
    node = block.node
    val = node.meta.get("val")
    # the copies of a layer share their value objects (capture copies a part's nodes with
    # their meta): described once per object, by ``id`` (alive while the graph is)
    # as a number, one per distinct description: the label hashes flat (a nested tuple's
    # hash is not kept, and labels are hashed once per block)
    shapes = described.get(id(val))
    if shapes is None:
        shapes = described[id(val)] = shape_ids.setdefault(_shapes(val), len(shape_ids))
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


def _refine(label: np.ndarray, ptr: np.ndarray, seq: np.ndarray, keys: np.ndarray) -> None:
    """Read into ``keys`` each block's sequence ``seq[ptr[b]:ptr[b + 1]]`` of labels: after
    it, two blocks have one key exactly when they had one before and their sequences are
    equal (their lengths are in ``keys`` already). Position ``j`` gives every block longer
    than ``j`` a new id per distinct (key, label) pair, above every id so far (an id names
    one sequence read so far, never a shorter one's); the longest blocks first, so each step
    touches only the blocks still reading."""
    lengths = np.diff(ptr)
    order = np.argsort(-lengths, kind="stable")
    longer = -lengths[order]  # ascending: the blocks longer than j are its first ones
    base = int(label.max(initial=0)) + 1
    top = int(keys.max(initial=0)) + 1
    for j in range(int(-longer[0]) if len(longer) else 0):
        active = order[: int(np.searchsorted(longer, -j, side="left"))]
        if len(active) <= _FEW:  # the rest of a few long ones (a value read by every
            # update): read whole, one tuple per block, not one numpy step per position
            rest: dict[tuple[Any, ...], int] = {}
            for b in active.tolist():
                tail = tuple(label[seq[ptr[b] + j : ptr[b + 1]]].tolist())
                keys[b] = top + rest.setdefault((int(keys[b]), tail), len(rest))
            return
        pair = keys[active] * base + label[seq[ptr[active] + j]]
        distinct, inverse = np.unique(pair, return_inverse=True)
        keys[active] = top + inverse.reshape(-1)
        top += len(distinct)


def _dense(*columns: np.ndarray) -> np.ndarray:
    """One id per distinct row of the columns (non-negative ints)."""
    key = np.zeros(len(columns[0]), dtype=np.int64)
    for c in columns:
        key = key * (int(c.max(initial=0)) + 1) + c
        key = np.unique(key, return_inverse=True)[1].reshape(-1)
    return key


def cluster_blocks(space: Space, rounds: int = ROUNDS) -> list[int]:
    """Per block, the block whose variables it uses (itself when it shares with no earlier
    block); see the module.

    A round's new label is an exact id of (the label, the operands' labels in operand order,
    the users' labels sorted), made with numpy: the lengths first, then the sequences read one
    position at a time (``_refine``), every distinct prefix a new id. Only which blocks share
    a label matters below, not the ids, so the result is that of labelling each block with
    the tuple itself."""
    n = len(space.blocks)
    get = space.producer.get
    pairs = [(u.block, p) for u in space.uses if (p := get(u.value)) is not None]
    edges = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    users, producers = edges[:, 0].copy(), edges[:, 1].copy()
    # a block's operands in the order of its uses; its users in any order (sorted by label)
    by_user = np.argsort(users, kind="stable")
    op_ptr = np.concatenate([[0], np.cumsum(np.bincount(users, minlength=n))])
    op_seq = producers[by_user]
    us_ptr = np.concatenate([[0], np.cumsum(np.bincount(producers, minlength=n))])
    ids: dict[Any, int] = {}
    names: dict[int, str] = {}  # str(target), once per target
    described: dict[int, int] = {}  # id of a value object -> the id of its _shapes
    shape_ids: dict[Any, int] = {}
    label = np.array(
        [ids.setdefault(_start(b, names, described, shape_ids), len(ids)) for b in space.blocks],
        dtype=np.int64,
    )
    lengths = (np.diff(op_ptr), np.diff(us_ptr))
    for _ in range(rounds):
        keys = _dense(label, *lengths)
        _refine(label, op_ptr, op_seq, keys)
        by_producer = np.lexsort((label[users], producers))  # per producer, its users' labels
        _refine(label, us_ptr, users[by_producer], keys)
        label = _dense(keys)
    first: dict[tuple[int, tuple[Any, ...]], int] = {}
    return [
        first.setdefault((lab, _candidates(space, block)), b)
        for b, (lab, block) in enumerate(zip(label.tolist(), space.blocks, strict=True))
    ]
