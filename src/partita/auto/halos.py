"""A windowed op's halo exchanges under a factor assignment, as the partitioner's ``halo``
handler emits them (``partition.halo``): what :class:`~partita.auto.costs.Pricer` charges a
convolution, a pooling, a constant pad or one of their backwards whose windowed dims are split.

Per split windowed dim whose halo fits a tile (``halo_plan``), one collective_permute of the
left halo rows and one of the right (where there are any), over the dim's mesh axes. A forward
op exchanges its windowed input's edge rows, dim by dim: a dim exchanged before has its
window's width in the later dims' rows. A backward sends a window gradient's halo rows back to
their owners, dims in reverse order, from the window's shape. A convolution's backward does
both, as its ``output_mask`` asks: the window of ``x`` for the weight's gradient, the return
for the input's. A dim whose halo exceeds a tile is computed whole (the handler gathers it);
that gather is not one of these.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.fx as fx

from partita.partition.halo.geometry import (
    AVGPOOL,
    AVGPOOL_BWD,
    CONV,
    CONV_BWD,
    MAXPOOL,
    MAXPOOL_BWD,
    PAD,
    HaloPlan,
    halo_plan,
    node_arg,
    read_op,
    sharded_windowed_dims,
)
from partita.rules import FactorRule
from partita.values.mesh import Mesh

__all__ = ["halo_sends"]

#: per op: (it exchanges its input's window, it returns a window gradient's halo rows)
_SENDS: dict[Any, tuple[bool, bool]] = {
    PAD: (True, False),
    CONV: (True, False),
    MAXPOOL: (True, False),
    AVGPOOL: (True, False),
    MAXPOOL_BWD: (False, True),
    AVGPOOL_BWD: (False, True),
}


def halo_sends(
    mesh: Mesh, node: fx.Node, rule: FactorRule, assign: dict[str, tuple[str, ...]]
) -> list[tuple[float, tuple[str, ...]]]:
    """The collective_permutes of ``node`` under ``assign``: (bytes each device sends, mesh
    axes), in the order the handler emits them (see the module)."""
    op = read_op(node)
    plans: dict[int, tuple[tuple[str, ...], HaloPlan]] = {}
    whole: set[str] = set()
    for d, (f, *split) in sorted(sharded_windowed_dims(rule, op, assign).items()):
        h = halo_plan(op.geos[d], mesh.axes_size(split))
        if h is None:
            whole.add(f)
        else:
            plans[d] = (tuple(split), h)
    if not plans:
        return []
    if node.target is CONV_BWD:
        mask = list(node_arg(node, 10, "output_mask"))
        window, back = bool(mask[1]), bool(mask[0])
    else:
        window, back = _SENDS[node.target]
    x = cast(fx.Node, node.args[op.x_index]).meta["val"]
    item = torch.empty((), dtype=x.dtype).element_size()
    factors = rule.operands[op.x_index] or ()
    tile = [
        -(-n // mesh.axes_size([a for f in dim if f not in whole for a in assign.get(f, ())]))
        for n, dim in zip(op.x_shape, factors, strict=True)
    ]
    out: list[tuple[float, tuple[str, ...]]] = []

    def send(sizes: list[int], d: int, axes: tuple[str, ...], h: HaloPlan) -> None:
        row = math.prod(sizes) // sizes[d] * item
        out.extend((float(n * row), axes) for n in (h.lh, h.rh) if n)

    if window:
        sizes = list(tile)
        for d, (axes, h) in sorted(plans.items()):
            send(sizes, d, axes, h)
            sizes[d] = h.w
    if back:
        sizes = list(tile)
        for d, (_, h) in plans.items():
            sizes[d] = h.w
        for d, (axes, h) in sorted(plans.items(), reverse=True):
            send(sizes, d, axes, h)
            sizes[d] = h.c_in
    return out
