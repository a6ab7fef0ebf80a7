"""Adding nodes to an fx graph without fx's per-argument check for symbolic ints.

``Graph.create_node`` (behind ``call_function`` and ``node_copy``) walks every argument of
a new ``call_function`` node with pytree to warn about a raw ``SymInt``; partita's programs
are traced with static shapes and have none, and the walk was 10-15 % of partitioning
GPT-M and of inlining its layers' copies. :func:`add_node` and :func:`copy_node` create the
node bare (no arguments, nothing to walk) and then set its arguments through fx's own
``Node.args`` / ``Node.kwargs`` setters, which record the uses as ``create_node`` does: the
graph is the same, node for node and name for name.

:func:`tag_copy` names a node as a copy of a part's node (``meta["layer_copy"]``, a
:class:`CopyTag`): every copy of one part node has the same ``token``, and the tag keeps the
argument objects the copy was made with, so a later pass that rewrites the node's arguments
(fx makes new ones) leaves a tag that no longer matches (``CopyTag.holds``). Passes that
rewrite every copy of a node the same way keep the tags: :func:`replace_uses` (a node's uses
moved to another node: a user's arguments change only in which node they name) and
:func:`retag` (a node replaced by a new op computed from its arguments and value alone).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch.fx as fx

__all__ = ["COPY_META", "CopyTag", "add_node", "copy_node", "replace_uses", "retag", "tag_copy"]

#: the node meta key of a copy's :class:`CopyTag`
COPY_META = "layer_copy"
_TOKEN = "layer_copy_token"  # on a part's node: one token per part node


class _Token:
    """One part node's copies; ``derived`` holds the tokens of what a pass rewrote them to."""

    __slots__ = ("derived",)

    def __init__(self) -> None:
        self.derived: dict[Any, _Token] = {}


class CopyTag:
    """A copy of a part's node: ``token`` names the part node (equal for all its copies),
    ``args`` and ``kwargs`` are the copy's argument objects as copied. Copying the tag (a
    graph or its meta copied) keeps the same tag; on a node whose arguments are other
    objects it no longer :meth:`holds`."""

    __slots__ = ("args", "kwargs", "token")

    def __init__(self, token: object, args: Any, kwargs: Any) -> None:
        self.token, self.args, self.kwargs = token, args, kwargs

    def holds(self, node: fx.Node) -> bool:
        """``node``'s arguments are still those it was copied with."""
        return node.args is self.args and node.kwargs is self.kwargs

    def __copy__(self) -> CopyTag:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> CopyTag:
        return self


def add_node(
    graph: fx.Graph,
    target: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    name: str | None = None,
) -> fx.Node:
    """``graph.create_node("call_function", target, args, kwargs, name)``, at the graph's
    insertion point."""
    node = graph.create_node("call_function", target, name=name)
    node.args = args
    if kwargs:
        node.kwargs = kwargs
    return node


def copy_node(graph: fx.Graph, node: fx.Node, arg_transform: Callable[[fx.Node], Any]) -> fx.Node:
    """``graph.node_copy(node, arg_transform)``: the node with its arguments mapped, its name
    and a shallow copy of its meta."""
    if node.op != "call_function":
        return graph.node_copy(node, arg_transform)
    new = graph.create_node("call_function", node.target, name=node.name, type_expr=node.type)
    new.args = fx.map_arg(node.args, arg_transform)
    if node.kwargs:
        new.kwargs = fx.map_arg(node.kwargs, arg_transform)
    new.meta = copy.copy(node.meta)
    return new


def tag_copy(new: fx.Node, original: fx.Node) -> None:
    """Tag ``new`` (made by :func:`copy_node` from ``original``) as a copy of it."""
    token = original.meta.get(_TOKEN)
    if token is None:
        token = original.meta[_TOKEN] = _Token()
    new.meta[COPY_META] = CopyTag(token, new.args, new.kwargs)


def _holding(node: fx.Node) -> CopyTag | None:
    tag = node.meta.get(COPY_META)
    return tag if isinstance(tag, CopyTag) and tag.holds(node) else None


def replace_uses(node: fx.Node, new: fx.Node) -> None:
    """``node.replace_all_uses_with(new)``, keeping the copy tags of its users that held:
    their arguments differ only in naming ``new`` where they named ``node``."""
    held = [(u, t) for u in node.users if (t := _holding(u)) is not None]
    node.replace_all_uses_with(new)
    for u, t in held:
        u.meta[COPY_META] = CopyTag(t.token, u.args, u.kwargs)


def retag(new: fx.Node, old: fx.Node, why: Any) -> None:
    """Tag ``new``, which replaces ``old`` by a rewrite (named by ``why``) computed from
    ``old``'s arguments and value alone, as the same rewrite of every copy of ``old``'s part
    node (no tag when ``old``'s did not hold)."""
    tag = _holding(old)
    if tag is None or not isinstance(tag.token, _Token):
        new.meta.pop(COPY_META, None)
        return
    token = tag.token.derived.get(why)
    if token is None:
        token = tag.token.derived[why] = _Token()
    new.meta[COPY_META] = CopyTag(token, new.args, new.kwargs)
