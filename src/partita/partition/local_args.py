"""Rewriting the shape argument of an op's local call.

The generic lowering (``partition.lower``) emits an op with local shapes. A few ops carry
global facts in their *arguments*: a shape list (reshape, expand, full), an input size as an
int (group norm's ``N``), an index tensor whose padding must still be a valid index, or an
operand of which only the shape is read. Which op has which is declared next to its rule
(``FactorRule.facts``, :class:`~partita.rules.facts.OpFacts`); this module rewrites shape
arguments and emits nothing itself.
"""

from __future__ import annotations

from typing import Any

__all__ = ["localize_shape_args"]


def localize_shape_args(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    global_shape: tuple[int, ...],
    local: tuple[int, ...],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Replace the shape argument (a list of ints of the result's rank) by the local shape."""

    def is_shape(a: Any) -> bool:
        return (
            isinstance(a, (list, tuple))
            and len(a) == len(global_shape)
            and all(isinstance(x, int) for x in a)
        )

    new_args = list(args)
    for i, a in enumerate(new_args):
        if is_shape(a):
            new_args[i] = list(local)
            return tuple(new_args), kwargs
    for k, a in kwargs.items():
        if is_shape(a):
            return tuple(new_args), {**kwargs, k: list(local)}
    return tuple(new_args), kwargs
