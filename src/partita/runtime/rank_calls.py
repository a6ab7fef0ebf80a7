"""Fewer Python calls in a rank's program: view chains folded, the optimizer's ops grouped.

A DistributedMesh runs the per-device ``GraphModule`` as generated Python: one call and one
dispatch per node, about 2 us each before the kernel does anything. The 4-layer GPT's FSDP
step has about 1 400 of them per rank, most of them the AdamW update of every parameter tile
(``mul``, ``add``, ``sqrt``, ``div``, ... once per parameter: 780 elementwise calls) and views
(``permute`` of a ``permute``, ``reshape`` to the shape the value already has). On 4 Gloo
processes, ``perf`` put about 13% of a rank's samples in the Python interpreter and torch's
bindings (docs/performance.md).

:func:`fewer_calls` rewrites a rank's graph, before its collectives are bound and scheduled:

- ``fold_permutes`` and ``fold_views`` (``runtime.flat_views``): a chain of permutes or views
  as one, an identity permute or a reshape to the same shape dropped. Views of the same
  storage either way: no value changes and no copy appears or goes.
- ``foreach_elementwise`` (``runtime.flat_foreach``), grouped by the distance to the end of
  the program: the same step of every parameter's update as one ``torch._foreach_*`` call,
  as ``torch.optim``'s ``foreach=True`` does; on the CPU each member runs the same kernel as
  before, so every result is the same bit for bit. The groups hold that step's temporaries
  for all parameters at once (the parameter tiles of one rank, at the end of the step).
- ``reuse_dead_operands`` (``runtime.in_place``): an elementwise op left ungrouped writes its
  result into an operand that dies there (``a.add_(b)`` for ``a + b``), the same kernel on the
  same elements: a step allocates fewer temporaries (the AdamW update of a large tile 6 instead
  of 14), so fewer holes are left in the heap between the tensors that live on.

Mesh ops are left where they are (they are not elementwise or views), so every rank still
issues the same collectives; the overlap schedule (``runtime.overlap``) runs afterwards.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor, fx

from partita.runtime.flat_foreach import foreach_elementwise
from partita.runtime.flat_views import fold_permutes, fold_views
from partita.runtime.in_place import reuse_dead_operands

__all__ = ["fewer_calls"]


def fewer_calls(graph: fx.Graph, owner: fx.GraphModule, vals: Mapping[str, Tensor]) -> int:
    """Rewrite ``graph`` (a rank's program, unbound) in place as the module doc says;
    returns how many elementwise ops were grouped. ``owner``: the module whose attributes it
    reads; ``vals``: the metadata of each node's result by name (a first run's, on the
    ``meta`` device) where the graph has none: without them nothing is grouped."""
    for node in graph.nodes:
        if "val" not in node.meta and node.name in vals:
            node.meta["val"] = vals[node.name]
    gm = fx.GraphModule(owner, graph)
    fold_permutes(gm)
    fold_views(gm)
    grouped = foreach_elementwise(gm, from_outputs=True)
    reuse_dead_operands(gm)
    return grouped
