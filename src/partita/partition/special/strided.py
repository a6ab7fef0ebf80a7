"""The ``as_strided`` handler: a strided window over storage, replayed in the trace's layout.

``as_strided(x, size, stride, offset)`` (``torch.stft`` frames its signal with one, so does a
hand-written sliding window) reads the *storage* of ``x``, not its logical elements: its
meaning depends on the strides ``x`` had when the program was traced. The per-device program
keeps values, not layouts (a gathered tile is contiguous in its own order, a transposed value
may be materialised either way), so running the op on the tile would read other elements.
The lowering therefore rebuilds the storage the trace had: permute the (gathered) operand into
the order of its traced strides, copy it contiguous, and apply the op with the offset taken
relative to the traced storage offset. ``as_strided_scatter`` (the op's backward) writes
through the same window and permutes the copy back. This holds whenever the traced operand is
dense (a permutation of a contiguous tensor) and the window stays inside its elements; any
other call (a window reading storage outside the tensor, an overlapping operand) stops with an
UnsupportedOpError at the user's line. The rule gathers every operand, so no collective is
added here, and the result is replicated.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.proxy import Proxy

from partita.capture.source import source_line
from partita.errors import UnsupportedOpError
from partita.partition.emit import Emitter, emitting
from partita.partition.handlers import Handler, register
from partita.partition.lowering_api import LoweringAPI
from partita.partition.special.common import Assign, aten, fake_value
from partita.rules import FactorRule
from partita.rules.handler_names import HandlerName


def _always(low: LoweringAPI, node: fx.Node, rule: FactorRule, assign: Assign) -> bool:
    return True  # a replicated tile's layout is not the trace's either


def _storage_order(x: torch.Tensor) -> list[int] | None:
    """The permutation that makes the traced ``x`` contiguous, or None if no permutation does
    (overlapping or gapped strides). Ties (size-1 dims) keep their logical order."""
    perm = sorted(range(x.ndim), key=lambda d: (-x.stride(d), d))
    want = 1
    for d in reversed(perm):
        if x.shape[d] != 1 and x.stride(d) != want:
            return None
        want *= x.shape[d]
    return perm


def _window(
    node: fx.Node, size: list[int], stride: list[int], offset: int | None
) -> tuple[list[int], int]:
    """``(perm, relative offset)`` of the op's window over its traced operand, or a typed error
    when the window cannot be replayed on a copy of the operand's elements."""
    x = fake_value(node.args[0])
    base = x.storage_offset()
    start = base if offset is None else int(offset)
    perm = _storage_order(x)
    last = start + sum((n - 1) * s for n, s in zip(size, stride, strict=True) if n > 0)
    empty = any(n == 0 for n in size)
    if perm is not None and (empty or (base <= start and last < base + x.numel())):
        return perm, start - base
    where = source_line(node) or node.name
    raise UnsupportedOpError(
        f"{node.target} at node {node.name} ({where}) cannot be partitioned: its operand has "
        f"shape {list(x.shape)}, strides {list(x.stride())} and storage offset {base}, and the "
        f"window (size {list(size)}, stride {list(stride)}, offset {start}) "
        + (
            "reads an operand whose elements overlap or leave gaps in storage"
            if perm is None
            else f"reads storage positions {start}..{last}, outside the operand's elements"
        )
        + ". as_strided reads storage, and partita rebuilds only the storage of the operand's "
        "own elements. Make the operand contiguous first (x.contiguous().as_strided(...)), or "
        "write the window with Tensor.unfold, slicing or indexing, which have rules."
    )


def _call(node: fx.Node) -> tuple[list[int], list[int], int | None]:
    """The call's ``size``, ``stride`` and ``storage_offset``, passed by position or name."""
    schema = node.target._schema.arguments  # type: ignore[union-attr]
    bound = dict(zip((a.name for a in schema), node.args, strict=False)) | dict(node.kwargs)
    return list(bound["size"]), list(bound["stride"]), bound.get("storage_offset")


@emitting
def _lower(e: Emitter, node: fx.Node, rule: FactorRule, assign: Assign) -> Proxy:
    tiles = list(e.operands(rule, assign))
    size, stride, offset = _call(node)
    perm, rel = _window(node, size, stride, offset)
    flat = aten.clone.default(
        aten.permute.default(tiles[0], perm), memory_format=torch.contiguous_format
    )
    if node.target != aten.as_strided_scatter.default:
        return aten.as_strided.default(flat, size, stride, rel)
    written = aten.as_strided_scatter.default(flat, tiles[1], size, stride, rel)
    inverse = sorted(range(len(perm)), key=perm.__getitem__)
    return aten.permute.default(written, inverse)


register(Handler(HandlerName.AS_STRIDED.value, _always, _lower))
