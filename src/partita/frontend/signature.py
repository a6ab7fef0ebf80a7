"""The input signature of one ``partita.jit`` call: its cache key, cheap on a cache hit.

A signature is the argument structure plus, per tensor leaf, its global shape, dtype and
Sharding (a static leaf: its value). :class:`Signatures` computes it on every call, so it keeps
what does not change between calls of a training loop: the ``in_specs`` broadcast over an
argument structure (keyed by that structure and by the ``in_specs`` object; ``jit`` reads
``in_specs`` when it is built) and the Sharding a spec gives a plain tensor of a rank. It never
caches a leaf's own layout: every call reads each leaf's shape, dtype and sharding, so a
changed layout is a new key (and the RecompileWarning names it). PartitionSpecs for tracing are
built only on a cache miss (:meth:`Signatures.leaf_specs`). This module only computes keys.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from partita.capture.kv_cache import flatten_registering_caches, is_transformers_cache
from partita.capture.trace import broadcast_specs
from partita.errors import CaptureError, ShardingError
from partita.values.annotations import marks_made
from partita.values.mesh import Mesh
from partita.values.spec import P, PartitionSpec, Sharding
from partita.values.tensor import ShardedTensor

__all__ = [
    "Signatures",
    "by_name",
    "placeholder_names",
    "readable_name",
    "replicated_batch",
    "trace_specs",
]

_TENSORS = (torch.Tensor, ShardedTensor)

#: How many (argument structure, in_specs) broadcasts a jitted function keeps.
_BROADCASTS_KEPT = 64


class Signatures:
    """The cache keys of one jitted function's calls (see the module docstring)."""

    def __init__(self, mesh: Mesh, name: str) -> None:
        self.mesh = mesh
        self.name = name
        self._user: dict[tuple[Any, int, int], tuple[Any, list[PartitionSpec | None]]] = {}
        self._plain: dict[tuple[PartitionSpec | None, int], Sharding] = {}

    def _user_specs(
        self, tree: Any, source: Any, in_specs: Callable[[], Any], args: tuple[Any, ...]
    ) -> list[PartitionSpec | None]:
        """The user's spec per leaf of ``(args, kwargs)``, broadcast once per structure."""
        memo = (tree, id(source), marks_made())  # a weight's mark_sharding: specs anew
        hit = self._user.get(memo)
        if hit is not None and hit[0] is source:
            return hit[1]
        n_args = tree.child(0).num_leaves
        user: list[PartitionSpec | None] = [None] * tree.num_leaves
        specs, kwarg_specs = in_specs()
        if specs is not None:
            user[:n_args] = broadcast_specs(specs, args, "in_specs", self.name)
        if kwarg_specs is not None:  # in_specs by name: the keyword arguments' too
            kwargs = pytree.tree_unflatten([None] * (len(user) - n_args), tree.child(1))
            user[n_args:] = broadcast_specs(kwarg_specs, kwargs, "in_specs", self.name)
        if len(self._user) >= _BROADCASTS_KEPT:
            self._user.clear()
        self._user[memo] = (source, user)  # holds ``source``: its id stays its own
        return user

    def leaf_specs(
        self, tree: Any, source: Any, in_specs: Callable[[], Any], args: tuple[Any, ...],
        leaves: list[Any], shardings: list[Sharding | None],
    ) -> list[PartitionSpec | None]:  # fmt: skip
        """What trace annotates on each leaf of ``(args, kwargs)`` (built on a cache miss
        only). A positional leaf: its Sharding's spec (a plain tensor without a spec is
        replicated). A keyword leaf: a ShardedTensor's own spec, the spec ``in_specs`` gave by
        name, else None (propagation chooses); a keyword argument that is an object pytree
        knows (a KV cache passed back) is left to propagation whole."""
        n_args = tree.child(0).num_leaves
        out = trace_specs(shardings[:n_args])
        user = self._user_specs(tree, source, in_specs, args)[n_args:]
        specs = [leaf.sharding.spec if isinstance(leaf, ShardedTensor) else spec
                 for leaf, spec in zip(leaves[n_args:], user, strict=True)]  # fmt: skip
        start = 0
        for sub in tree.child(1).children():
            mine, start = specs[start : start + sub.num_leaves], start + sub.num_leaves
            out += mine if _builtin(sub) else [None] * sub.num_leaves
        return out

    def _plain_sharding(self, spec: PartitionSpec | None, ndim: int) -> Sharding:
        sharding = self._plain.get((spec, ndim))
        if sharding is None:
            sharding = (spec or P()).to_sharding(self.mesh, ndim)
            self._plain[(spec, ndim)] = sharding
        return sharding

    def key(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        source: Any,
        in_specs: Callable[[], Any],
    ) -> tuple[list[Any], list[Sharding | None], Hashable]:
        """The leaves of ``(args, kwargs)``, each tensor leaf's Sharding and the cache key.

        ``in_specs()`` gives the in_specs prefix of ``args`` and the specs of ``kwargs`` (None:
        no keyword specs); it is called only for a new (argument structure, ``source``) pair,
        ``source`` being the object it derives from.
        """
        leaves, tree = pytree.tree_flatten((args, kwargs))
        if any(is_transformers_cache(leaf) for leaf in leaves if not isinstance(leaf, _TENSORS)):
            paths, tree = flatten_registering_caches((args, kwargs))  # a KV cache passed back
            leaves = [leaf for _, leaf in paths]
        user = self._user_specs(tree, source, in_specs, args)
        mesh = self.mesh
        shardings: list[Sharding | None] = []
        key: list[Hashable] = [tree]
        for leaf, spec in zip(leaves, user, strict=True):
            if isinstance(leaf, ShardedTensor):
                sharding = leaf.sharding
                if sharding.mesh is not mesh and sharding.mesh != mesh:
                    raise ShardingError(
                        f"{self.name}: an argument lives on {leaf.mesh!r}, but the function was "
                        f"compiled for {mesh!r}. Reshard it onto the jit's mesh first."
                    )
            elif isinstance(leaf, torch.Tensor):
                sharding = self._plain_sharding(spec, leaf.ndim)
            else:
                shardings.append(None)
                key.append(("static", _hashable(leaf)))
                continue
            shardings.append(sharding)
            key.append((tuple(leaf.shape), leaf.dtype, sharding))
        return leaves, shardings, tuple(key)


def _builtin(tree: pytree.TreeSpec) -> bool:
    """Whether ``tree`` holds only dicts, lists and tuples (no registered object)."""
    if tree.is_leaf():
        return True
    return tree.type in (dict, list, tuple) and all(_builtin(c) for c in tree.children())


def trace_specs(shardings: list[Sharding | None]) -> list[PartitionSpec | None]:
    """The PartitionSpec of each leaf, for tracing (built on a cache miss only)."""
    return [None if s is None else s.spec for s in shardings]


def _hashable(x: Any) -> Hashable:
    try:
        hash(x)
    except TypeError:
        return repr(x)
    return x


def readable_name(name: str, fn: Callable[..., Any], module: Any = None) -> str:
    """What the user calls the input ``name`` (``args[1]['w']``, as capture names it):
    ``parameter 'fc.weight'`` for a module's weights, else the function's own parameter name
    (``w1`` for ``args[1]`` of ``def mlp(x, w1, w2)``, ``mask`` for ``kwargs['mask']``).

    Example:
        >>> readable_name("args[1]['w']", lambda x, params: x)
        "params['w']"
    """
    if name.startswith("kwargs['"):
        key, rest = name[len("kwargs['") :].split("']", 1)
        return key + rest
    if module is not None:
        return module.leaf_name(name)
    if not name.startswith("args["):
        return name
    index, rest = name[len("args[") :].split("]", 1)
    positional = _positional_names(fn)
    return positional[int(index)] + rest if int(index) < len(positional) else name


def _positional_names(fn: Callable[..., Any]) -> list[str]:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C function: no signature
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in parameters if p.kind in kinds]


def placeholder_names(program: Any, fn: Callable[..., Any], module: Any = None) -> dict[str, str]:
    """The readable name of each user input of ``program``, by its placeholder's node name
    (for ``Plan.explain``); lifted constants (the trailing placeholders) have none."""
    names = [readable_name(name, fn, module) for name in program.input_names]
    nodes = program.input_nodes[: len(names)]
    return {node.name: name for node, name in zip(nodes, names, strict=True)}


def by_name(
    in_specs: Any, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, dict[str, Any] | None]:
    """``in_specs`` given by parameter name (``{"input_ids": P("data"), "mask": P("data")}``, a
    dict whose keys are all names of ``fn``'s parameters) as ``(specs of the positional
    arguments, specs of the keyword arguments)``, for this call's arguments; any other
    ``in_specs`` is the positional prefix it always was, with no keyword specs.

    Example:
        >>> by_name({"mask": P("x")}, lambda ids, mask=None: ids, (1,), {"mask": 2})
        ((None,), {'mask': P('x')})
    """
    if not (isinstance(in_specs, dict) and in_specs and all(isinstance(k, str) for k in in_specs)):
        return in_specs, None
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return in_specs, None
    # A name the signature lacks is a keyword of **kwargs only if this call passes it.
    unknown = [k for k in in_specs if k not in parameters]
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    if unknown and (not takes_any or not set(unknown) <= set(kwargs)):
        raise CaptureError(
            f"in_specs names {unknown}, which {getattr(fn, '__qualname__', fn)!r} has no "
            f"parameter for (its parameters: {list(parameters)}). in_specs may be given by "
            f"parameter name ({{'input_ids': P('data')}}, for positional and keyword "
            f"arguments alike) or as a tuple, one entry per positional argument (for one dict "
            f"argument: in_specs=({{...}},))."
        )
    positional = _positional_names(fn)
    arg_specs = tuple(
        in_specs.get(positional[i]) if i < len(positional) else None for i in range(len(args))
    )
    return arg_specs, {k: in_specs.get(k) for k in kwargs}


def replicated_batch(plan: Any, module: Any, in_specs: Any) -> str | None:
    """The warning for a module's inputs left replicated over the mesh's ``data`` axis because
    ``jit`` was given no ``in_specs`` (None when there are none): every device along ``data``
    then computes the whole batch, a data-parallel plan in name only."""
    if module is None or in_specs is not None or "data" not in plan.mesh.axis_names:
        return None
    names = [
        name for node, name in plan.input_names.items()
        if not name.startswith(("parameter ", "buffer "))
        and (s := plan.shardings.get(node)) is not None and s.ndim
        and not any("data" in axes for axes in s.dim_axes)
    ]  # fmt: skip
    if not names:
        return None
    specs = ", ".join(f"{n!r}: P('data')" for n in names[:3])
    return (
        f"partita.jit({type(module.module).__name__}): {', '.join(names[:3])} got no in_specs, so "
        f"{'they are' if len(names) > 1 else 'it is'} replicated over 'data': every device "
        f"along 'data' computes the whole batch (plan.explain() lists the inputs). Split the "
        f"batch with in_specs={{{specs}}} (by parameter name, keyword arguments included), or "
        f"give in_specs explicitly (P() for a replicated input) to keep this layout."
    )
