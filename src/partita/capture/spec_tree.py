"""``in_specs`` / ``out_specs`` as pytree prefixes: one PartitionSpec (or None) per leaf; and
argument trees rebuilt with their ``torch.Size`` values intact.

The JAX convention, PyTorch-spelled: a spec tree is a *prefix* of the values' pytree whose
leaves are ``P`` or None; a ``P`` given for a container applies to every tensor in it, and a
dict's specs match the values' dict by key, not by position.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from partita.errors import CaptureError
from partita.values.spec import PartitionSpec

__all__ = ["broadcast_specs", "flatten_with_path", "is_size", "unflatten_args"]


def flatten_with_path(
    tree: Any, is_leaf: Any = None
) -> tuple[list[tuple[Any, Any]], pytree.TreeSpec]:
    """``pytree.tree_flatten_with_path``, also over nodes registered without a
    ``flatten_with_keys_fn`` (diffusers registers its output classes so): such a node's
    children are named by its context when that is a list of their keys (a dict-like node),
    else by position."""
    leaves, spec = pytree.tree_flatten(tree, is_leaf=is_leaf)
    paths: list[tuple[Any, Any]] = []
    _walk(tree, is_leaf, (), paths)
    same = len(paths) == len(leaves)
    if not same or any(a is not b for (_, a), b in zip(paths, leaves, strict=True)):
        return pytree.tree_flatten_with_path(tree, is_leaf=is_leaf)  # its own error, if any
    return paths, spec


def _walk(node: Any, is_leaf: Any, path: tuple[Any, ...], out: list[tuple[Any, Any]]) -> None:
    if pytree.tree_is_leaf(node, is_leaf=is_leaf):
        out.append((path, node))
        return
    handler = pytree.SUPPORTED_NODES[pytree._get_node_type(node)]
    if handler.flatten_with_keys_fn is not None:
        keyed, _ = handler.flatten_with_keys_fn(node)
    else:
        children, context = handler.flatten_fn(node)
        names = list(context) if isinstance(context, (list, tuple)) else []
        if len(names) == len(children):
            keyed = [(pytree.MappingKey(k), c) for k, c in zip(names, children, strict=True)]
        else:
            keyed = [(pytree.SequenceKey(i), c) for i, c in enumerate(children)]
    for key, child in keyed:
        _walk(child, is_leaf, (*path, key), out)


class _NoSpec:
    """Stands for None in a spec tree (pytree treats None as an empty node)."""


_NO_SPEC = _NoSpec()


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, PartitionSpec)


def _key_ordered(specs: Any, tree: Any) -> Any:
    """``specs`` with every dict in the key order of ``tree``'s dict at the same place.

    ``torch.utils._pytree`` broadcasts a prefix by *position*, so ``{"b": P(), "a": P("x")}``
    given for ``{"a": ..., "b": ...}`` would annotate ``a`` with ``P()``. Dicts match by key.

    Example:
        >>> _key_ordered({"b": 1, "a": 2}, {"a": None, "b": None})
        {'a': 2, 'b': 1}
    """
    if isinstance(specs, dict) and isinstance(tree, dict) and set(specs) == set(tree):
        return {k: _key_ordered(specs[k], tree[k]) for k in tree}
    if (
        isinstance(specs, (tuple, list))
        and isinstance(tree, (tuple, list))
        and len(specs) == len(tree)
        and not isinstance(specs, PartitionSpec)
    ):
        items = [_key_ordered(s, t) for s, t in zip(specs, tree, strict=True)]
        return type(specs)(*items) if hasattr(specs, "_fields") else type(specs)(items)
    return specs


class _Shown:
    """A leaf shown by a short text in an error message."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _skeleton(tree: Any) -> Any:
    """``tree`` with each tensor shown as ``tensor[4, 3]``, for messages.

    Example:
        >>> _skeleton(((torch.ones(4), 2), {"mask": None}))
        ((tensor[4], 2), {'mask': None})
    """

    def show(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return _Shown(f"tensor{list(leaf.shape)}")
        return _Shown(f"{leaf!r:.40}")

    return pytree.tree_map(show, tree)


def broadcast_specs(specs: Any, tree: Any, what: str, fn_name: str) -> list[PartitionSpec | None]:
    """One spec (or None) per leaf of ``tree``; ``specs`` is a prefix of ``tree`` (dicts match
    by key)."""
    if isinstance(specs, dict) and isinstance(tree, (tuple, list)):
        raise CaptureError(
            f"{what} of {fn_name!r} is a dict ({', '.join(map(repr, specs))}), but the specs go "
            f"to the positional arguments, a tuple of {len(tree)}: for one dict argument write "
            f"{what}=({{...}},). partita.jit also takes {what} by parameter name, keyword "
            f"arguments included ({what}={{'ids': P('data')}} for fn(ids, mask=None)); "
            f"capture.trace takes keyword specs as kwarg_specs."
        )
    specs = _key_ordered(specs, tree)
    leaves, spec_tree = pytree.tree_flatten(specs, is_leaf=_is_spec_leaf)
    for leaf in leaves:
        if leaf is not None and not isinstance(leaf, PartitionSpec):
            raise CaptureError(
                f"{what} of {fn_name!r} must be a pytree of P(...) or None, but it holds "
                f"{leaf!r} of type {type(leaf).__name__}. Write P('x', None), not ('x', None)."
            )
    marked = pytree.tree_unflatten([_NO_SPEC if s is None else s for s in leaves], spec_tree)
    flat = pytree._broadcast_to_and_flatten(
        marked,
        pytree.tree_structure(tree),
        is_leaf=lambda x: isinstance(x, (_NoSpec, PartitionSpec)),
    )
    if flat is None:
        raise CaptureError(
            f"{what} of {fn_name!r} does not match the structure of the values: {what} is "
            f"{specs!r}, the values are {_skeleton(tree)!r}. Give a P or None per value (or "
            f"one for a whole container)."
        )
    return [None if isinstance(s, _NoSpec) else s for s in flat]


def is_size(value: Any) -> bool:
    return isinstance(value, torch.Size)


def unflatten_args(leaves: list[Any], tree: pytree.TreeSpec) -> Any:
    """``pytree.tree_unflatten``, except that a ``torch.Size`` argument comes back a
    ``torch.Size`` (the pytree registration ``make_fx`` installs rebuilds it as a plain tuple,
    and ``shape.numel()`` in the user's function would fail while tracing only)."""
    if tree.is_leaf():
        return leaves[0]
    if not _has_size(tree):
        return pytree.tree_unflatten(leaves, tree)
    children, start = [], 0
    for child in tree.children():
        children.append(unflatten_args(leaves[start : start + child.num_leaves], child))
        start += child.num_leaves
    if tree.type is torch.Size:
        return torch.Size(children)
    return pytree.SUPPORTED_NODES[tree.type].unflatten_fn(children, tree.context)


def _has_size(tree: pytree.TreeSpec) -> bool:
    return tree.type is torch.Size or any(_has_size(c) for c in tree.children())
