"""``transformers`` KV caches as pytree nodes, so a traced model may return one and take it back.

A ``transformers`` language model returns its key/value cache (a ``DynamicCache``, an
``EncoderDecoderCache``, ...) unless it is called with ``use_cache=False``: the default in eval
mode. A cache is a Python object holding tensors, which pytree sees as one opaque leaf. The
first time a traced function returns (or takes) one, its class is registered with
``torch.utils._pytree``: its tensors become results (or inputs) like any other, and the object
comes back rebuilt around them (holding ShardedTensors). Passing that cache back as
``past_key_values`` makes its tensors inputs of the next program, so a decoding loop works::

    out = jitted(input_ids=prompt)
    out = jitted(input_ids=next_token, past_key_values=out.past_key_values)

The flattening walks the object's attributes (lists, tuples, dicts and the cache's own layer
objects) and keeps everything that is not a tensor (flags, devices, dtypes, classes) in the
pytree context, as ``transformers`` does for ``torch.export``; unlike its helper, the leaves
may be ShardedTensors. A cache whose objects cannot be rebuilt that way (``__slots__``, bound
methods) stays an error that says to call the model with ``use_cache=False``.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Hashable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from partita.capture.spec_tree import flatten_with_path
from partita.errors import ArgumentTypeError
from partita.values.tensor import ShardedTensor

__all__ = ["flatten_registering_caches", "is_transformers_cache", "kv_cache_hint"]

#: What a cache keeps beside its tensors: flags, lengths, devices, dtypes, the layer class.
_STATIC = (type(None), bool, int, float, str, torch.device, torch.dtype, torch.Size, type,
           enum.Enum)  # fmt: skip
_UNSUPPORTED: set[type] = set()  # cache classes found not to flatten (see _flat)
#: Caches pytree rebuilt, by id: (a weak reference, the context they were rebuilt from, how
#: many tensors that context holds).
_REBUILT: dict[int, tuple[weakref.ref[Any], Hashable, int]] = {}


class _Leaf:
    """Marks where a tensor sat in a flattened cache's context."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Leaf)

    def __hash__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "<tensor>"


_LEAF = _Leaf()


def is_transformers_cache(obj: Any) -> bool:
    kind = type(obj)
    return kind.__module__.startswith("transformers") and kind.__name__.endswith("Cache")


def _flat(obj: Any, leaves: list[Any], names: list[str], name: str) -> Hashable:
    """The context of ``obj``; its tensors go to ``leaves`` (their attribute paths to
    ``names``). Raises TypeError for what cannot be rebuilt."""
    if isinstance(obj, torch.Tensor | ShardedTensor):
        leaves.append(obj)
        names.append(name)
        return _LEAF
    if isinstance(obj, _STATIC):
        return ("static", obj)
    if type(obj) in (list, tuple):
        items = tuple(_flat(x, leaves, names, f"{name}[{i}]") for i, x in enumerate(obj))
        return (type(obj).__name__, items)
    if type(obj) is dict:
        keys = tuple(obj)
        values = tuple(_flat(obj[k], leaves, names, f"{name}[{k!r}]") for k in keys)
        return ("dict", keys, values)
    kind = type(obj)
    if kind.__module__.startswith("transformers") and hasattr(obj, "__dict__"):
        state = vars(obj)
        keys = tuple(state)
        values = tuple(_flat(state[k], leaves, names, f"{name}.{k}") for k in keys)
        return ("object", kind, keys, values)
    # a bound method, a slotted object, ...: _register catches this (the type stays unregistered)
    raise ArgumentTypeError(
        f"cache entry {name or '(the cache)'} is a {kind.__name__}, which partita cannot split "
        f"into tensors and rebuild: a cache holds tensors, lists, tuples, dicts and transformers "
        f"cache objects. Pass the cache as one of those."
    )


def _rebuild(context: Any, leaves: list[Any]) -> Any:
    if context is _LEAF or isinstance(context, _Leaf):
        return leaves.pop()
    tag = context[0]
    if tag == "static":
        return context[1]
    if tag in ("list", "tuple"):
        items = [_rebuild(c, leaves) for c in context[1]]
        return items if tag == "list" else tuple(items)
    if tag == "dict":
        return {k: _rebuild(c, leaves) for k, c in zip(context[1], context[2], strict=True)}
    kind, keys, values = context[1:]
    obj = kind.__new__(kind)
    obj.__dict__.update({k: _rebuild(c, leaves) for k, c in zip(keys, values, strict=True)})
    return obj


def _by_context(obj: Any, context: Any, leaves: list[Any], names: list[str], name: str) -> None:
    """The leaves of an object rebuilt from ``context``, wherever the context has one: pytree
    rebuilds a cache around placeholders (``0``, a PartitionSpec) and flattens it again."""
    if isinstance(context, _Leaf):
        leaves.append(obj)
        names.append(name)
        return
    tag = context[0]
    if tag in ("list", "tuple"):
        for i, (x, c) in enumerate(zip(obj, context[1], strict=True)):
            _by_context(x, c, leaves, names, f"{name}[{i}]")
    elif tag == "dict":
        for k, c in zip(context[1], context[2], strict=True):
            _by_context(obj[k], c, leaves, names, f"{name}[{k!r}]")
    elif tag == "object":
        for k, c in zip(context[2], context[3], strict=True):
            _by_context(vars(obj)[k], c, leaves, names, f"{name}.{k}")


def _flat_names(cache: Any) -> tuple[list[Any], list[str], Hashable]:
    """Leaves, their names and the context of ``cache``. A cache pytree rebuilt around
    placeholders flattens by the context it was rebuilt from; one holding tensors (a rebuilt
    cache the model has since grown, say) by what it holds now."""
    leaves: list[Any] = []
    names: list[str] = []
    rebuilt = _REBUILT.get(id(cache))
    if rebuilt is None or rebuilt[0]() is not cache:
        return leaves, names, _flat(cache, leaves, names, "")
    try:
        context = _flat(cache, leaves, names, "")
        if sum(isinstance(x, torch.Tensor | ShardedTensor) for x in leaves) >= rebuilt[2]:
            return leaves, names, context
    except TypeError:  # a PartitionSpec or a marker where a tensor was
        pass
    leaves, names = [], []
    _by_context(cache, rebuilt[1], leaves, names, "")
    return leaves, names, rebuilt[1]


def _flatten(cache: Any) -> tuple[list[Any], Hashable]:
    leaves, _, context = _flat_names(cache)
    return leaves, context


def _flatten_with_keys(cache: Any) -> tuple[list[tuple[Any, Any]], Hashable]:
    leaves, names, context = _flat_names(cache)
    keys = [pytree.GetAttrKey(name.lstrip(".")) for name in names]
    return list(zip(keys, leaves, strict=True)), context


def _unflatten(values: Any, context: Hashable) -> Any:
    values = list(values)
    cache = _rebuild(context, values[::-1])  # popped from the end: reversed
    key = id(cache)
    _REBUILT[key] = (weakref.ref(cache, lambda _: _REBUILT.pop(key, None)), context, len(values))
    return cache


def _register(cache: Any) -> bool:
    """Register ``type(cache)``; False when its objects cannot be flattened and rebuilt."""
    kind = type(cache)
    if kind in pytree.SUPPORTED_NODES:
        return True
    if kind in _UNSUPPORTED:
        return False
    try:
        _flatten(cache)
    except TypeError:
        _UNSUPPORTED.add(kind)
        return False
    pytree.register_pytree_node(kind, _flatten, _unflatten, flatten_with_keys_fn=_flatten_with_keys)
    return True


def flatten_registering_caches(
    tree: Any, is_leaf: Any = None
) -> tuple[list[tuple[Any, Any]], pytree.TreeSpec]:
    """``pytree.tree_flatten_with_path(tree, is_leaf=is_leaf)`` (also over nodes without key
    functions: ``spec_tree.flatten_with_path``), with every ``transformers``
    cache in ``tree`` registered first, so that its tensors are leaves."""
    while True:
        paths, spec = flatten_with_path(tree, is_leaf=is_leaf)
        new = [leaf for _, leaf in paths if is_transformers_cache(leaf)]
        if not new or not all([_register(leaf) for leaf in new]):
            return paths, spec


def kv_cache_hint(leaf: Any) -> str:
    """For a cache that could not be registered: how to do without one."""
    if is_transformers_cache(leaf):
        return (
            " (a transformers KV cache, returned by default: call the model with "
            "use_cache=False, or set model.config.use_cache = False)"
        )
    return ""
