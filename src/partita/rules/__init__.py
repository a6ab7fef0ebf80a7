"""THE registry of per-op sharding rules.

Every op partita can shard has exactly one rule function here, registered once with
``@register_rule(aten.mm.default)``; registering an op twice fails at import. A rule function
takes an :class:`~partita.rules.factor.OpInfo` and returns a
:class:`~partita.rules.factor.FactorRule`. Families live in their own modules and register from
sorted tuples of ops; this module imports them so that importing ``partita.rules`` fills the
registry.

Propagation and partitioning read rules only through :func:`get_rule` / :func:`rule_for`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from partita.errors import RuleRegistrationError
from partita.rules.factor import FactorKind, FactorRule, OpInfo, TensorMeta, einsum_rule
from partita.rules.handler_names import HandlerName

__all__ = [
    "FactorKind",
    "FactorRule",
    "HandlerName",
    "OpInfo",
    "RuleFn",
    "TensorMeta",
    "einsum_rule",
    "get_rule",
    "has_rule",
    "register_rule",
    "registered_ops",
]

RuleFn = Callable[[OpInfo], FactorRule]
#: A rule function, with whatever extra keyword arguments it takes (elementwise_rule's handler).
_Rule = TypeVar("_Rule", bound=Callable[..., FactorRule])

_REGISTRY: dict[Any, RuleFn] = {}


def register_rule(*ops: Any) -> Callable[[_Rule], _Rule]:
    """Register one rule function for one or more op overloads.

    Example:
        >>> @register_rule(aten.mm.default)            # doctest: +SKIP
        ... def mm(info: OpInfo) -> FactorRule:
        ...     return einsum_rule("m k, k n -> m n", info.operands, info.results, reduction="k")
    """

    def wrap(fn: _Rule) -> _Rule:
        for op in _flatten(ops):
            if op in _REGISTRY:
                raise RuleRegistrationError(
                    f"op {op} already has the sharding rule {_REGISTRY[op].__qualname__}; "
                    f"{fn.__qualname__} would register it twice"
                )
            _REGISTRY[op] = fn
        return fn

    return wrap


def _flatten(ops: Iterable[Any]) -> list[Any]:
    out: list[Any] = []
    for op in ops:
        if isinstance(op, (tuple, list)):
            out.extend(_flatten(op))
        else:
            out.append(op)
    return out


def has_rule(op: Any) -> bool:
    return op in _REGISTRY


def get_rule(op: Any) -> RuleFn | None:
    """The rule function of an op, or None."""
    return _REGISTRY.get(op)


def registered_ops() -> tuple[Any, ...]:
    """Every op with a rule, sorted by name."""
    return tuple(sorted(_REGISTRY, key=str))


# Families register on import. Keep this list sorted.
from partita.rules import (  # noqa: E402,F401
    annotate,
    attention,
    conv,
    creation,
    elementwise,
    embedding,
    fft,
    indexing,
    linalg,
    loss,
    matmul,
    misc,
    norm,
    random,
    reduction,
    scan,
    shape,
    slicing,
)
