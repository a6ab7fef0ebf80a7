"""The captured program: a functional fx graph plus how to call it with the user's pytrees.

This module holds the value type only; ``trace`` builds it, and later stages read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from partita.capture.annotate import Annotation

__all__ = ["Program"]


@dataclass
class Program:
    """A traced function.

    Attributes:
        graph_module: the functional graph of aten ops (and ``partita::`` ops). Its
            placeholders are the tensor leaves of ``(args, kwargs)`` in flattened order.
        in_tree: pytree spec of ``(args, kwargs)`` (tensor and static leaves).
        out_tree: pytree spec of the function's result (tensor leaves only).
        input_nodes: the placeholder nodes, in flattened order.
        num_inputs: ``len(input_nodes)``.
        annotations: each ``partita::annotate`` node and its Annotation.
        tensor_leaves: for each placeholder, its index among the leaves of ``in_tree``.
        static_leaves: the non-tensor leaves baked into the graph, by leaf index.
        name: the traced function's name (for messages).
    """

    graph_module: fx.GraphModule
    in_tree: pytree.TreeSpec
    out_tree: pytree.TreeSpec
    input_nodes: list[fx.Node]
    num_inputs: int
    annotations: dict[fx.Node, Annotation] = field(default_factory=dict)
    tensor_leaves: tuple[int, ...] = ()
    static_leaves: dict[int, Any] = field(default_factory=dict)
    name: str = "fn"

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph

    def flatten_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
    ) -> list[torch.Tensor]:
        """The graph inputs for ``fn(*args, **kwargs)`` (its tensor leaves, in order)."""
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
        if spec != self.in_tree:
            raise ValueError(
                f"Program {self.name!r} was traced for inputs of structure {self.in_tree}, "
                f"got {spec}. Trace again for the new structure."
            )
        return [leaves[i] for i in self.tensor_leaves]

    def unflatten_outputs(self, flat: list[Any] | tuple[Any, ...]) -> Any:
        return pytree.tree_unflatten(list(flat), self.out_tree)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the captured graph eagerly on real tensors (unsharded), with fn's signature."""
        flat = self.graph_module(*self.flatten_inputs(args, kwargs))
        return self.unflatten_outputs(flat)
