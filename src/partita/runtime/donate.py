"""Donated inputs: the ``all_reduce`` nodes of a rank's program that may reduce in place.

``torch.distributed.all_reduce`` reduces its tensor in place, and a mesh op is functional, so
``runtime.dist_ops.all_reduce`` reduces a copy of its input. The copy is only needed when the
program reads the input again or the input shares its memory with a value it reads. Under
Megatron tensor parallelism every row-parallel matmul's result goes straight into an
all_reduce over the model axis (16 calls of 1 MiB per step of the 4-layer GPT on a 2 x 2
mesh): :func:`donated_all_reduces` names those whose copy can be skipped, and
``runtime.distributed`` passes ``donate=True`` to them. The values are the same either way.

This module only reads graphs; it does not run or change them.
"""

from __future__ import annotations

import torch
from torch import fx

from partita.runtime.in_place import fresh

__all__ = ["donated_all_reduces"]

_ALL_REDUCE = torch.ops.partita.all_reduce.default


def donated_all_reduces(graph: fx.Graph) -> set[str]:
    """Names of the ``partita::all_reduce`` nodes whose input nothing else reads or shares:
    the input is the result of an aten op that returns a new tensor (one return, no alias in
    its schema, no mutation, not a hidden view; or ``runtime.in_place``'s rewrite of one:
    ``in_place.fresh``) and the all_reduce is its only user.

    Example (an all_reduce of a matmul's result is donated, of a transpose's is not):
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> from partita.ir import collectives
        >>> def f(a, b):
        ...     x = collectives.all_reduce(torch.mm(a, b), "sum", ["model"], 2)
        ...     return x, collectives.all_reduce(a.t(), "sum", ["model"], 2)
        >>> gm = make_fx(f)(torch.ones(2, 2), torch.ones(2, 2))
        >>> sorted(donated_all_reduces(gm.graph))
        ['all_reduce']
    """
    out: set[str] = set()
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not _ALL_REDUCE:
            continue
        x = node.args[0]
        if isinstance(x, fx.Node) and len(x.users) == 1 and fresh(x):
            out.add(node.name)
    return out
