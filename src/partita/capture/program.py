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
from partita.errors import ArgumentError

__all__ = ["Program"]


@dataclass
class Program:
    """A traced function.

    Attributes:
        graph_module: the functional graph of aten ops (and ``partita::`` ops). Its
            placeholders are the tensor leaves of ``(args, kwargs)`` in flattened order, then
            one per lifted tensor constant (see ``constants``).
        in_tree: pytree spec of ``(args, kwargs)`` (tensor and static leaves).
        out_tree: pytree spec of the function's result. The graph's outputs are its tensor
            leaves, then one new value per entry of ``mutated_inputs``.
        input_nodes: the placeholder nodes, in flattened order (constants last).
        num_inputs: ``len(input_nodes)``.
        annotations: each ``partita::annotate`` node and its Annotation.
        tensor_leaves: for each user-input placeholder, its index among the leaves of
            ``in_tree``.
        static_leaves: the non-tensor leaves baked into the graph, by leaf index.
        name: the traced function's name (for messages).
        constants: the tensors the function used without receiving them (closed-over tensors,
            literals, parameters of a called module), fed as the trailing placeholders.
        mutated_inputs: the user-input placeholders (by position) that the function updated in
            place; the graph returns their new values after the result, and the caller copies
            them back (``torch.compile`` semantics).
        input_names: a readable name per user-input placeholder (``args[0]['w']``).
        static_outputs: the result's non-tensor leaves (None, numbers, strings), by leaf index
            of ``out_tree``: fixed while tracing, so the same on every call.
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
    constants: tuple[torch.Tensor, ...] = ()
    mutated_inputs: tuple[int, ...] = ()
    input_names: tuple[str, ...] = ()
    static_outputs: dict[int, Any] = field(default_factory=dict)

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph

    def flatten_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
    ) -> list[torch.Tensor]:
        """The graph inputs for ``fn(*args, **kwargs)``: its tensor leaves, then the constants."""
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
        if spec != self.in_tree:
            raise ArgumentError(
                f"Program {self.name!r} was traced for inputs of structure {self.in_tree}, "
                f"got {spec}. Trace again for the new structure."
            )
        return [leaves[i] for i in self.tensor_leaves] + list(self.constants)

    @property
    def num_results(self) -> int:
        """How many of the graph's outputs are the result (the tensor leaves of ``out_tree``)."""
        return self.out_tree.num_leaves - len(self.static_outputs)

    def unflatten_outputs(self, flat: list[Any] | tuple[Any, ...]) -> Any:
        """The function's result from the graph outputs (the in-place updates are left out)."""
        tensors = iter(list(flat)[: self.num_results])
        leaves = [
            self.static_outputs[i] if i in self.static_outputs else next(tensors)
            for i in range(self.out_tree.num_leaves)
        ]
        return pytree.tree_unflatten(leaves, self.out_tree)

    def input_updates(self, flat: list[Any] | tuple[Any, ...]) -> list[tuple[int, Any]]:
        """``(input position, new value)`` for each input the function updated in place."""
        news = list(flat)[self.num_results :]
        return list(zip(self.mutated_inputs, news, strict=True))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the captured graph eagerly on real tensors (unsharded), with fn's signature;
        in-place updates of the inputs take effect, as in eager mode."""
        inputs = self.flatten_inputs(args, kwargs)
        flat = self.graph_module(*inputs)
        with torch.no_grad():
            for i, new in self.input_updates(flat):
                inputs[i].copy_(new)
        return self.unflatten_outputs(flat)
