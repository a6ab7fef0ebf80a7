"""A solution as the partitioner realizes it.

:func:`write_solution` writes it into a traced program: every op's ``factor_axes`` and every
value's ``sharding`` as the solver chose them (what the partitioner consumes), over a
propagated program whose nodes share the solved program's names.

:func:`realized_price` prices it as the partitioner lowers it. The integer program prices
every reshard of a value from its producer's sharding (``auto.links``: linear, one term per
edge). The partitioner starts each reshard from whichever copy of the value made so far moves
the fewest elements (``partition.resharding.reshard_source``): a weight gathered whole for
the forward is sliced locally for the backward. So the realized price walks the uses in
program order, keeps each value's copies in the order they are made, and prices each new
target from the copy that rule picks (the same function). It is what the report gives as the
modelled price of a plan; the objective the solver minimised charges at least the reshards'
bytes of it (see docs/auto.md)."""

from __future__ import annotations

import functools
from typing import Any

import torch.fx as fx

from partita.auto.costs import Pricer
from partita.auto.greedy import onehot
from partita.auto.ilp import Model
from partita.auto.moves import moved_elements
from partita.auto.space import Space
from partita.ir import node_meta
from partita.partition.resharding import reshard_source
from partita.propagate.state import ValueKey
from partita.values.spec import Sharding

__all__ = ["realized_price", "realized_reshards", "write_solution"]


def write_solution(space: Space, choice: list[int], gm: fx.GraphModule) -> int:
    """Overwrite ``gm``'s factor assignments and shardings with ``choice`` (by node name);
    returns how many nodes were written. Annotation nodes of ``gm`` keep theirs."""
    by_name = {n.name: n for n in gm.graph.nodes}
    shardings: dict[str, dict[int | None, Sharding]] = {}
    written = 0
    for b, block in enumerate(space.blocks):
        i = choice[b]
        ops: list[tuple[Any, dict[str, tuple[str, ...]]]] = []
        if block.op is not None:
            ops.append((block.op, block.assigns[i]))
        ops.extend((f.op, f.assigns[i]) for f in block.followers)
        for op, assign in ops:
            node = by_name.get(op.node.name)
            if node is None or node_meta.annotation(node) is not None:
                continue
            node_meta.set_factor_axes(node, dict(assign))
            written += 1
        for (vnode, idx), s in block.result(i).items():
            shardings.setdefault(vnode.name, {})[idx] = s
    for name, by_idx in shardings.items():
        node = by_name.get(name)
        if node is None or node_meta.annotation(node) is not None:
            continue
        if None in by_idx:
            node_meta.set_sharding(node, by_idx[None])
        else:
            old = node_meta.sharding(node)
            if isinstance(old, tuple):
                node_meta.set_sharding(node, tuple(by_idx.get(j, s) for j, s in enumerate(old)))
    return written


def realized_price(space: Space, pricer: Pricer, model: Model, choice: list[int]) -> float:
    """``choice``'s price in ``model`` (built with ``pricer``) with its reshards priced as the
    partitioner makes them (:func:`realized_reshards`): the candidates' own prices (compute,
    op-internal collectives, the followers' reshards, the results' reductions, the
    stored-bytes tie-break) and the values' reshards."""
    return float(model.own @ onehot(model, choice)) + realized_reshards(space, pricer, choice)


def realized_reshards(space: Space, pricer: Pricer, choice: list[int]) -> float:
    """The price of the reshards between the values' producers and their users under
    ``choice``, as the partitioner makes them: uses in program order, a target already made
    reused for free, a new one resharded from the copy ``reshard_source`` picks among the
    value's own sharding and its copies made so far."""
    permuted = {use.value for use in space.uses if use.through}
    made: dict[ValueKey, dict[Sharding, None]] = {}
    total = 0.0
    for use in space.uses:
        key = use.value
        p = space.producer.get(key)
        if p is None:
            continue
        has = space.blocks[p].columns[key][choice[p]]
        need = use.needs[choice[use.block]]
        if has is None or need is None or need == has:
            continue
        copies = made.setdefault(key, {})
        if need in copies:
            continue
        shape, dtype = space.shapes[key], space.dtypes[key]
        src = reshard_source(has, copies, functools.partial(moved_elements, dst=need, shape=shape))
        # as ``auto.links``: a parameter's or gradient's collective is bucketed, not one for
        # a reader through a permute
        bucketed = shape in space.stored_shapes and key not in permuted
        total += pricer.reshard(src, need, shape, dtype, bucketed)
        copies[need] = None
    return total
