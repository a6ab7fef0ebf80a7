"""Lifting Python floats to program inputs, so a step's program does not change every step.

The optimizer hands the learning rate, ``1 - lr * weight_decay`` and Adam's bias corrections to
aten ops as Python floats whose values change from step to step. Baked into the graph, each
new value would be a new program; lifted, they become 0-dim tensor inputs. An op's float can be
lifted when the op has a form taking that number as a tensor; :data:`_REPLAY` holds, per op,
the arguments that may be lifted and how to compute the op with them as tensors. This module
does not record or compile.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["lift_extras", "liftable_positions", "replay_op"]

aten = torch.ops.aten


def _as(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The lifted number in the dtype an op computes a Python scalar in (the tensor's own)."""
    return value.to(like.dtype) if like.is_floating_point() else value


def _binary(op: Any) -> Callable[..., torch.Tensor]:
    def run(a: torch.Tensor, b: Any, **kw: Any) -> torch.Tensor:
        b = _as(b, a) if isinstance(b, torch.Tensor) and b.ndim == 0 else b
        return op(a, b, **kw)

    return run


def _add_alpha(op: Any, sign: float) -> Callable[..., torch.Tensor]:
    def run(a: torch.Tensor, b: Any, alpha: Any = 1) -> torch.Tensor:
        b = _as(b, a) if isinstance(b, torch.Tensor) and b.ndim == 0 else b
        if isinstance(alpha, torch.Tensor):
            return op(a, b * _as(alpha, a))
        return op(a, b, alpha=alpha)

    return run


def _addc(pointwise: Any) -> Callable[..., torch.Tensor]:
    def run(a: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor, value: Any = 1) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return a + _as(value, a) * pointwise(t1, t2)
        return (aten.addcdiv if pointwise is torch.div else aten.addcmul).default(
            a, t1, t2, value=value
        )

    return run


def _lerp(a: torch.Tensor, end: torch.Tensor, weight: Any, small: bool | None = None) -> Any:
    if not isinstance(weight, torch.Tensor):
        return aten.lerp.Scalar(a, end, weight)
    w = _as(weight, a)
    if small is None:
        return aten.lerp.Tensor(a, end, w.expand(()))
    # PyTorch's lerp (and its decomposition) with the branch on |weight| < 0.5 taken when the
    # op was recorded (``small`` is part of the step's key): no mask, no select per element.
    if small:
        return w * (end - a) + a
    return (w - 1) * (end - a) + end


#: op -> (argument positions/names whose float is lifted, the op computed with tensors).
_REPLAY: dict[Any, tuple[frozenset[int | str], Callable[..., torch.Tensor]]] = {
    aten.mul.Tensor: (frozenset({1}), _binary(aten.mul.Tensor)),
    aten.div.Tensor: (frozenset({1}), _binary(aten.div.Tensor)),
    aten.mul.Scalar: (frozenset({1}), _binary(aten.mul.Tensor)),
    aten.div.Scalar: (frozenset({1}), _binary(aten.div.Tensor)),
    aten.add.Tensor: (frozenset({1, "alpha"}), _add_alpha(aten.add.Tensor, 1.0)),
    aten.sub.Tensor: (frozenset({1, "alpha"}), _add_alpha(aten.sub.Tensor, -1.0)),
    aten.addcdiv.default: (frozenset({"value"}), _addc(torch.div)),
    aten.addcmul.default: (frozenset({"value"}), _addc(torch.mul)),
    aten.lerp.Scalar: (frozenset({2}), _lerp),
}

_INPLACE = {
    aten.mul_.Tensor: aten.mul.Tensor,
    aten.div_.Tensor: aten.div.Tensor,
    aten.mul_.Scalar: aten.mul.Scalar,
    aten.div_.Scalar: aten.div.Scalar,
    aten.add_.Tensor: aten.add.Tensor,
    aten.sub_.Tensor: aten.sub.Tensor,
    aten.addcdiv_.default: aten.addcdiv.default,
    aten.addcmul_.default: aten.addcmul.default,
    aten.lerp_.Scalar: aten.lerp.Scalar,
}


_LERPS = (aten.lerp.Scalar, aten.lerp_.Scalar)


def lift_extras(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """Extra constant keyword templates an op's lifted floats need: which branch ``lerp``
    takes for its weight (known when recorded; a step that takes the other branch has another
    key, so it is compiled for that branch).

    Example:
        >>> lift_extras(torch.ops.aten.lerp_.Scalar, (None, None, 0.1), {})
        (('small', ('c', True)),)
    """
    if func is not _LERPS[0] and func is not _LERPS[1]:  # by identity: an op's hash is Python
        return ()
    weight = args[2] if len(args) > 2 else kwargs.get("weight")
    if type(weight) is not float:
        return ()
    return (("small", ("c", abs(weight) < 0.5)),)


def liftable_positions(func: Any) -> frozenset[int | str]:
    """The arguments of ``func`` whose Python floats become program inputs.

    Example:
        >>> sorted(map(str, liftable_positions(torch.ops.aten.addcdiv_.default)))
        ['value']
    """
    entry = _REPLAY.get(_INPLACE.get(func, func))
    return entry[0] if entry else frozenset()


def replay_op(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``func`` where some Python floats of its arguments are 0-dim tensors now."""
    functional = _INPLACE.get(func)
    entry = _REPLAY.get(functional or func)
    if entry is None or not any(
        isinstance(v, torch.Tensor) and k in entry[0]
        for k, v in [*enumerate(args), *kwargs.items()]
    ):
        kwargs = {k: v for k, v in kwargs.items() if k != "small"}  # lift_extras' only
        return func(*args, **kwargs)
    out = entry[1](*args, **kwargs)
    if functional is None:
        return out
    return args[0].copy_(out)  # the in-place form: write the value into its argument
