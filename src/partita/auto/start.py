"""Starting points for the solver: a compiled plan's per-op shardings as a choice per block.

A preset's Plan is a point of the solver's space too: propagation gave every op a factor
assignment (``node_meta.factor_axes``) and every value a sharding. :func:`choice_of` reads them
back from the preset's propagated program (its nodes share the solved program's names) and
picks, per block, the candidate with that assignment; an input block takes the candidate with
the input's sharding. When no candidate matches exactly (propagation chose an assignment the
space does not list), the candidate whose result shardings agree with the plan's on the most
values is taken. A cluster's shared columns take its representative's choice.

:func:`cheapest_start` prices every such choice in the solver's own model (the greedy pass's
exact pricing of a choice) and returns the cheapest one within the memory budget: the MILP gets
it as its incumbent, so the solver's answer is never worse than the best preset under its model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.fx as fx

from partita.auto.greedy import Prices, onehot
from partita.auto.ilp import Model
from partita.auto.space import Block, Space
from partita.capture.gc_pause import gc_paused
from partita.ir import node_meta

__all__ = ["cheapest_start", "choice_of"]


def _assign_key(assign: Mapping[str, tuple[str, ...]]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    return tuple(sorted((f, tuple(a)) for f, a in assign.items() if a))


def _pick(block: Block, by_name: dict[str, fx.Node]) -> int:
    if block.op is None:
        node = by_name.get(block.node.name)
        got = node_meta.sharding(node) if node is not None else None
        for i, res in enumerate(block.results):  # the input's own sharding, not a follower's
            if res.get((block.node, None)) == got:
                return i
        return 0
    node = by_name.get(block.node.name)
    if node is None:
        return 0
    want = _assign_key(node_meta.factor_axes(node))
    keys = [_assign_key(a) for a in block.assigns]
    if want in keys:
        return keys.index(want)
    return _closest(block, by_name)


def _closest(block: Block, by_name: dict[str, fx.Node]) -> int:
    """The candidate whose result shardings agree with the plan's on the most values."""
    best, best_i = -1, 0
    for i, res in enumerate(block.results):
        agree = 0
        for (vnode, idx), s in res.items():
            node = by_name.get(vnode.name)
            got = node_meta.sharding(node) if node is not None else None
            if isinstance(got, tuple):
                got = got[idx] if idx is not None and idx < len(got) else None
            agree += got == s
        if agree > best:
            best, best_i = agree, i
    return best_i


def choice_of(space: Space, rep: list[int], gm: fx.GraphModule) -> list[int]:
    """The choice per block that reproduces the propagated program ``gm`` (see the module)."""
    by_name = {n.name: n for n in gm.graph.nodes}
    mine: dict[int, int] = {}
    out = []
    for b in range(len(space.blocks)):
        r = rep[b]
        if r not in mine:
            mine[r] = _pick(space.blocks[r], by_name) if len(space.blocks[r]) > 1 else 0
        out.append(mine[r])
    return out


@gc_paused()  # pricing a choice allocates many small objects: no full collections meanwhile
def cheapest_start(
    space: Space, model: Model, plans: Mapping[str, Any], memory: float | None = None
) -> tuple[str, list[int], float] | None:
    """Of the compiled ``plans`` (``{name: Compiled}``), the one whose choice the model prices
    lowest within ``memory``, the model's peak bytes (``model.memory``): (name, choice,
    objective); None when none fits."""
    best: tuple[str, list[int], float] | None = None
    prices = Prices(model)  # built once for every plan
    for name, compiled in plans.items():
        gm = getattr(getattr(compiled, "program", None), "graph_module", None)
        if gm is None:
            continue
        choice = choice_of(space, model.rep, gm)
        if (
            memory is not None
            and model.memory is not None
            and model.memory.peak(choice)[0] > memory
        ):
            continue
        objective = prices.total(onehot(model, choice))
        if best is None or objective < best[2]:
            best = (name, choice, objective)
    return best
