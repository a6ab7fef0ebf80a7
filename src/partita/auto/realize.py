"""Write a solution into a traced program: every op's ``factor_axes`` and every value's
``sharding`` as the solver chose them (what the partitioner consumes), over a propagated
program whose nodes share the solved program's names."""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from partita.auto.space import Space
from partita.ir import node_meta
from partita.values.spec import Sharding

__all__ = ["write_solution"]


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
