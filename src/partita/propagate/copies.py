"""The copies of a layer's op: one rule per part node, mapped to every copy without a walk.

Capture inlines a repeated layer (or an optimizer's per-parameter update) by copying its
part's nodes, and tags each copy with the part node it copies (``capture.fx_nodes.CopyTag``).
Two copies of one part node that share their value object (capture copies the meta
shallowly, so the copies of one part share it; a part resized to other shapes has values of
its own) and still hold the arguments they were copied with are the same call up to the
names of their operand nodes: the same target, the same constants in the same places, the
same results. :class:`Copies` keeps, for the first such copy (the *template*), its rule's
shapes and where its tensor operands sit in its arguments; a later copy whose operands there
have the template's shapes and dtypes has the template's call key, so propagation gives it
the template's rule (``ProgramState._op_shape``) without reading its arguments one by one
(``propagate.call_key``).

A copy that does not match (its arguments rewritten by a later pass, an operand of another
shape, a node argument that is not a tensor, nested arguments) is keyed as any other node.

This module does not build rules; it only maps a template's to its copies.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from partita.capture.fx_nodes import COPY_META

__all__ = ["Copies"]

_Node = fx.Node
_Tensor = torch.Tensor


class _Template:
    __slots__ = ("places", "shape", "target")

    def __init__(
        self, target: Any, shape: Any, paths: list[tuple[int, int]], vals: list[Any]
    ) -> None:
        self.target, self.shape = target, shape
        #: per tensor operand: its place in the arguments, its value and (shape, dtype)
        self.places = [
            (i, j, v, (tuple(v.shape), v.dtype)) for (i, j), v in zip(paths, vals, strict=True)
        ]


def _operand_paths(node: fx.Node, operands: list[fx.Node]) -> list[tuple[int, int]] | None:
    """Where each of ``operands`` sits in ``node.args`` (position, and -1 or its index in a
    list argument), or None when the node arguments are not exactly ``operands`` in order (a
    node argument that is not a tensor, one in the kwargs, or deeper nesting)."""
    if any(isinstance(v, _Node) for v in node.kwargs.values()):
        return None
    paths: list[tuple[int, int]] = []
    found: list[fx.Node] = []
    for i, a in enumerate(node.args):
        if type(a) is _Node:
            paths.append((i, -1))
            found.append(a)
        elif isinstance(a, (list, tuple)):
            for j, x in enumerate(a):
                if isinstance(x, _Node):
                    paths.append((i, j))
                    found.append(x)
                elif isinstance(x, (list, tuple, dict)):
                    return None
        elif isinstance(a, dict):
            return None
    return paths if found == operands else None


class Copies:
    """Per (part node, value object), the template copy's rule shapes and operand places.

    Keyed by the ``id`` of value objects: valid while the graph holds them (one build)."""

    def __init__(self) -> None:
        self._templates: dict[tuple[object, int], _Template] = {}
        self.mapped = 0  # copies answered from a template (for tests)

    def find(self, node: fx.Node) -> tuple[Any, list[fx.Node]] | None:
        """The template's shapes and ``node``'s tensor operands (flattened order) when
        ``node`` is a matching copy of a template (see the module), else None."""
        meta = node.meta
        tag = meta.get(COPY_META)
        if tag is None or not tag.holds(node):
            return None
        t = self._templates.get((tag.token, id(meta.get("val"))))
        if t is None or t.target is not node.target:
            return None
        args: Any = node.args
        operands: list[fx.Node] = []
        for i, j, tval, desc in t.places:
            a = args[i] if j < 0 else args[i][j]
            val = a.meta.get("val")
            if val is not tval and (
                not isinstance(val, _Tensor) or (tuple(val.shape), val.dtype) != desc
            ):
                return None
            operands.append(a)
        self.mapped += 1
        return t.shape, operands

    def add(self, node: fx.Node, shape: Any, operands: list[fx.Node]) -> None:
        """Make ``node`` (keyed, its ``shape`` memoised by its call key) the template of its
        part node's later copies, when it is a copy whose operands are all its node
        arguments."""
        tag = node.meta.get(COPY_META)
        if tag is None or not tag.holds(node):
            return
        key = (tag.token, id(node.meta.get("val")))
        if key in self._templates:
            return
        paths = _operand_paths(node, operands)
        if paths is None:
            return
        vals = [a.meta.get("val") for a in operands]
        if not all(isinstance(v, _Tensor) for v in vals):
            return
        self._templates[key] = _Template(node.target, shape, paths, vals)

    def clear(self) -> None:
        self._templates.clear()
