"""Normalisation passes over a freshly traced graph: fewer ops for rule writers.

After :mod:`partita.capture.trace` the graph is free of mutation (functionalization) but still
holds ATen's many spellings of "the same value, re-shaped". These passes rewrite them:

==========================================================  ==============================
ops in the traced graph                                     becomes
==========================================================  ==============================
view, _unsafe_view, view_copy, _reshape_alias, reshape,     ``aten.reshape.default``
squeeze (all overloads), unsqueeze, flatten, unflatten      (shape from the fake value)
t, transpose, permute_copy, transpose_copy, t_copy          ``aten.permute.default``
expand_copy, slice_copy, select_copy                        ``expand`` / ``slice`` / ``select``
split, split_with_sizes, unbind (and their ``_copy``)       one ``slice`` / ``select`` per use
slice, slice_scatter with open or negative bounds           the same op, bounds in [0, size]
detach, alias, lift_fresh_copy, clone, same-type _to_copy,  removed (uses take the input)
copy of an equal-shape, equal-dtype source                  removed (uses take the source)
slice_scatter whose source covers the whole destination     removed (uses take the source)
reshape of a cat back into its equal pieces (an RNN's        a cat of the pieces along a new
outputs)                                                    dim (``capture/stack.py``)
==========================================================  ==============================

The view ops that remain (``reshape``, ``permute``, ``expand``, ``slice``, ``select``, and any
other ATen view the program used directly) are read with *value* semantics: nothing in a
captured graph mutates, so their aliasing is unobservable. :data:`VALUE_VIEW_OPS` lists the
ones capture produces. Dead code is removed, except ``partita::annotate`` nodes.

Each rewritten node keeps the ``meta`` of the node it replaces (fake value, source line). This
module does not decompose ops (see ``decompositions``) and does not check shardings.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import fx

from partita.capture.annotate import ANNOTATE_OP
from partita.capture.control_flow import normalize_bodies
from partita.capture.fx_nodes import add_node, replace_uses, retag
from partita.capture.stack import stack_cat_reshapes
from partita.errors import UnsupportedOpError

__all__ = ["VALUE_VIEW_OPS", "normalize"]

aten = torch.ops.aten

#: View ops that capture emits, read with value semantics (no captured op mutates).
VALUE_VIEW_OPS = frozenset(
    {
        aten.reshape.default,
        aten.permute.default,
        aten.expand.default,
        aten.slice.Tensor,
        aten.select.int,
    }
)

_TO_RESHAPE = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.view_copy.default,
    aten._reshape_alias.default,
    aten._reshape_alias_copy.default,
    aten.reshape.default,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze_copy.default,
    aten.squeeze_copy.dim,
    aten.squeeze_copy.dims,
    aten.unsqueeze.default,
    aten.unsqueeze_copy.default,
    aten.flatten.using_ints,
    aten.unflatten.int,
}
_TO_PERMUTE = {
    aten.t.default,
    aten.t_copy.default,
    aten.transpose.int,
    aten.transpose_copy.int,
    aten.permute_copy.default,
    aten.numpy_T.default,
}
_RENAME = {
    aten.expand_copy.default: aten.expand.default,
    aten.slice_copy.Tensor: aten.slice.Tensor,
    aten.select_copy.int: aten.select.int,
}
_SPLITS = {
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.split_copy.Tensor,
    aten.split_with_sizes_copy.default,
    aten.unbind.int,
    aten.unbind_copy.int,
}
_IDENTITY = {
    aten.detach.default,
    aten.alias.default,
    aten.lift_fresh_copy.default,
    aten.alias_copy.default,
    aten.detach_copy.default,
}


def _val(node: fx.Node) -> torch.Tensor | None:
    v = node.meta.get("val")
    return v if isinstance(v, torch.Tensor) else None


def _replace(gm: fx.GraphModule, node: fx.Node, target: Callable, args: tuple) -> fx.Node:
    with gm.graph.inserting_before(node):
        new = add_node(gm.graph, target, args)
    new.meta = dict(node.meta)
    retag(new, node, target)  # the same rewrite of every copy of a layer's node
    replace_uses(node, new)
    gm.graph.erase_node(node)
    return new


def _is_identity(node: fx.Node) -> bool:
    if node.target in _IDENTITY:
        return True
    src = node.args[0] if node.args else None
    if not isinstance(src, fx.Node):
        return False
    out, inp = _val(node), _val(src)
    if out is None or inp is None:
        return False
    same = out.shape == inp.shape and out.dtype == inp.dtype and out.device == inp.device
    if node.target == aten.clone.default:
        return True
    if node.target == aten._to_copy.default:
        return same
    return False


def _permutation(node: fx.Node) -> list[int]:
    args: tuple[Any, ...] = node.args  # (self, dims) or (self, dim0, dim1): the schema's types
    x = _val(args[0])
    assert x is not None  # a permute of a tensor
    ndim = x.dim()
    if node.target == aten.permute_copy.default:
        return [d % ndim for d in args[1]]
    if node.target in (aten.transpose.int, aten.transpose_copy.int):
        d0, d1 = args[1] % ndim, args[2] % ndim
    else:  # t, numpy_T: reverse the dims
        return list(reversed(range(ndim)))
    perm = list(range(ndim))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return perm


def _split_to_slices(gm: fx.GraphModule, node: fx.Node) -> None:
    """Replace ``getitem(split(x), i)`` by ``slice(x, dim, start, end)`` (select for unbind)."""
    args: tuple[Any, ...] = node.args  # unbind(self, dim); split(self, size(s), dim)
    src: fx.Node = args[0]
    x = _val(src)
    assert x is not None  # a split of a tensor
    ndim = x.dim()
    unbind = node.target in (aten.unbind.int, aten.unbind_copy.int)
    dim_pos = 1 if unbind else 2
    dim = cast(int, node.kwargs.get("dim", args[dim_pos] if len(args) > dim_pos else 0)) % ndim
    pieces = node.meta["val"]
    starts = [0]
    for piece in pieces:
        starts.append(starts[-1] + (piece.shape[dim] if piece.dim() == ndim else 1))
    for user in list(node.users):
        if user.op != "call_function" or user.target is not operator.getitem:
            raise UnsupportedOpError(
                f"capture: {node.target} at node {node.name!r} has its result used whole by "
                f"{user.format_node()}; partita rewrites a split into slices and needs every use "
                f"to pick one piece (result[i]). Index the pieces before using them."
            )
        i = cast(int, user.args[1])  # getitem(result, i)
        if unbind:
            _replace(gm, user, aten.select.int, (src, dim, i))
        else:
            _replace(gm, user, aten.slice.Tensor, (src, dim, starts[i], starts[i + 1]))
    gm.graph.erase_node(node)


def normalize(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite ``gm`` in place to the normal op set described in the module docstring."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        target = node.target
        if target in _IDENTITY or target in (aten.clone.default, aten._to_copy.default):
            if _is_identity(node):
                replace_uses(node, node.args[0])
                gm.graph.erase_node(node)
        elif target == aten.copy.default and _copy_is_identity(node):
            replace_uses(node, node.args[1])
            gm.graph.erase_node(node)
        elif target in _TO_RESHAPE:
            _replace(gm, node, aten.reshape.default, (node.args[0], list(node.meta["val"].shape)))
        elif target in _TO_PERMUTE:
            _replace(gm, node, aten.permute.default, (node.args[0], _permutation(node)))
        elif target in _RENAME:
            _replace(gm, node, _RENAME[target], node.args)
        elif target in _SPLITS:
            _split_to_slices(gm, node)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _SLICE_BOUNDS:
            _clamp_slice_bounds(node)
            if _scatters_everything(node):
                node.replace_all_uses_with(node.args[1])
                gm.graph.erase_node(node)
    stack_cat_reshapes(gm)  # cat + reshape back into its pieces: a stack (capture/stack.py)
    _eliminate_dead_code(gm)
    gm.graph.lint()
    gm.recompile()
    normalize_bodies(gm, normalize)  # torch.cond, while_loop, scan, map: capture/control_flow
    return gm


#: Slicing ops and the argument position of their (dim, start, end); the dim's size is read
#: from argument 0 (the sliced tensor, or the destination of slice_scatter).
_SLICE_BOUNDS = {aten.slice.Tensor: 1, aten.slice_scatter.default: 2}


def _scatters_everything(node: fx.Node) -> bool:
    """A (clamped) slice_scatter whose source covers the whole destination: its value is the
    source. (Its global ``end`` would not fit a sharded dim's local size either.)"""
    if node.target != aten.slice_scatter.default:
        return False
    args: tuple[Any, ...] = node.args  # (self, src, dim, start, end, step), clamped above
    dst, src = _val(args[0]), _val(args[1])
    return (
        dst is not None
        and src is not None
        and dst.shape == src.shape
        and dst.dtype == src.dtype
        and args[3] == 0
        and args[5] == 1
    )


def _clamp_slice_bounds(node: fx.Node) -> None:
    """Write start/end of a slice as ints in ``[0, size]`` with ``start <= end``.

    ``x[..., 2:]`` traces to ``end=2**63 - 1`` (and its backward to a slice_scatter with that
    end), ``x[-2:]`` to a negative start; rules and ``torch.vmap`` must see the real bounds.
    Example: on a dim of size 8, ``(4, 2**63 - 1)`` becomes ``(4, 8)`` and ``(-2, None)``
    becomes ``(6, 8)``.
    """
    pos = _SLICE_BOUNDS[node.target]  # type: ignore[index]
    val = _val(node.args[0])  # type: ignore[arg-type]
    if val is None:
        return
    args: list[Any] = list(node.args) + [None] * (pos + 4 - len(node.args))
    for name, offset in (("dim", 0), ("start", 1), ("end", 2), ("step", 3)):
        if name in node.kwargs:
            args[pos + offset] = node.kwargs[name]
    dim = (args[pos] or 0) % val.dim()
    size = val.shape[dim]
    start = _clamp(args[pos + 1], 0, size)
    end = max(start, _clamp(args[pos + 2], size, size))
    args[pos : pos + 4] = [dim, start, end, 1 if args[pos + 3] is None else args[pos + 3]]
    node.args = tuple(args)
    node.kwargs = {}


def _clamp(index: int | None, default: int, size: int) -> int:
    if index is None:
        return default
    if index < 0:
        index += size
    return min(max(index, 0), size)


def _copy_is_identity(node: fx.Node) -> bool:
    """``copy(dst, src)`` is ``src`` when shapes, dtypes and devices agree (no broadcast/cast)."""
    dst, src = node.args[0], node.args[1]
    if not isinstance(dst, fx.Node) or not isinstance(src, fx.Node):
        return False
    a, b = _val(dst), _val(src)
    return (
        a is not None
        and b is not None
        and a.shape == b.shape
        and a.dtype == b.dtype
        and a.device == b.device
    )


def _eliminate_dead_code(gm: fx.GraphModule) -> None:
    """Remove unused pure nodes; keep annotate nodes (they constrain their input)."""
    for node in reversed(list(gm.graph.nodes)):
        if node.op in ("call_function", "get_attr") and not node.users:
            if node.op == "call_function" and node.target == ANNOTATE_OP:
                continue
            gm.graph.erase_node(node)
