"""Lifting Python floats to program inputs, so a step's program does not change every step.

The optimizer hands the learning rate, ``1 - lr * weight_decay`` and Adam's bias corrections to
aten ops as Python floats whose values change from step to step. Baked into the graph, each
new value would be a new program; lifted, they become 0-dim tensor inputs. An op's float can be
lifted when the op has a form taking that number as a tensor; :data:`_REPLAY` holds, per op,
the arguments that may be lifted and how to compute the op with them as tensors.

torch.optim's foreach kernels (``_foreach_mul_``, ``_foreach_addcdiv_``, ``_foreach_lerp_``...)
take one number, or one per tensor, for a list of tensors. They are recorded as one op each and
replayed as their per-tensor op on each tensor of the lists (:func:`replay_op`), so capture and
propagation see ordinary ops, each tensor with its own sharding; their floats are lifted at the
same places as the per-tensor op's. This module does not record or compile.
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
    aten.add.Scalar: (frozenset({1, "alpha"}), _add_alpha(aten.add.Tensor, 1.0)),
    aten.sub.Scalar: (frozenset({1, "alpha"}), _add_alpha(aten.sub.Tensor, -1.0)),
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
    aten.add_.Scalar: aten.add.Scalar,
    aten.sub_.Scalar: aten.sub.Scalar,
    aten.addcdiv_.default: aten.addcdiv.default,
    aten.addcmul_.default: aten.addcmul.default,
    aten.lerp_.Scalar: aten.lerp.Scalar,
}


_LERPS = (aten.lerp.Scalar, aten.lerp_.Scalar)
_FOREACH_LERPS = frozenset(
    getattr(getattr(aten, name), overload)
    for name in ("_foreach_lerp", "_foreach_lerp_")
    for overload in ("Scalar", "ScalarList")
)


def lift_extras(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """Extra constant keyword templates an op's lifted floats need: which branch ``lerp``
    takes for its weight (known when recorded; a step that takes the other branch has another
    key, so it is compiled for that branch).

    Example:
        >>> lift_extras(torch.ops.aten.lerp_.Scalar, (None, None, 0.1), {})
        (('small', ('c', True)),)
    """
    if func is not _LERPS[0] and func is not _LERPS[1]:  # by identity: an op's hash is Python
        if func not in _FOREACH_LERPS:
            return ()
    weight = args[2] if len(args) > 2 else kwargs.get("weight")
    if type(weight) is float:
        return (("small", ("c", abs(weight) < 0.5)),)
    if isinstance(weight, (list, tuple)) and all(type(w) is float for w in weight):
        # a foreach lerp's weight per tensor: one branch each (split per tensor at replay)
        return (("small", ("c", tuple(abs(w) < 0.5 for w in weight))),)
    return ()


def liftable_positions(func: Any) -> frozenset[int | str]:
    """The arguments of ``func`` whose Python floats become program inputs.

    Example:
        >>> sorted(map(str, liftable_positions(torch.ops.aten.addcdiv_.default)))
        ['value']
    """
    foreach = _foreach(func)
    if foreach is not None:
        return foreach[1]
    entry = _REPLAY.get(_INPLACE.get(func, func))
    return entry[0] if entry else frozenset()


# --- torch.optim's foreach kernels: one op over a list of tensors ----------------------------

#: The per-tensor op of each ``_foreach_*`` overload whose floats can be lifted (the others
#: run their per-tensor op through its packet, which picks the overload); by the foreach
#: overload's name: ``.Scalar`` takes one number, ``.ScalarList`` one per tensor, ``.List`` a
#: second list of tensors.
_FOREACH_ELEMENT: dict[tuple[str, str], Any] = {
    **{
        (n, o): getattr(aten, n).Scalar
        for n in ("mul", "div", "add", "sub")
        for o in ("Scalar", "ScalarList")
    },
    ("add", "List"): aten.add.Tensor,
    ("sub", "List"): aten.sub.Tensor,
    **{
        (n, o): getattr(aten, n).default
        for n in ("addcdiv", "addcmul")
        for o in ("Scalar", "ScalarList")
    },
    ("lerp", "Scalar"): aten.lerp.Scalar,
    ("lerp", "ScalarList"): aten.lerp.Scalar,
}  # fmt: skip
_FOREACH_PREFIX = "aten::_foreach_"
_FOREACH_INFO: dict[Any, Any] = {}


def _foreach(func: Any) -> tuple[Any, frozenset[int | str], Any, bool] | None:
    """For a ``_foreach_*`` overload: (its per-tensor op, or packet when no float of it is
    lifted; the foreach arguments whose floats are lifted; the per-tensor op's schema arguments
    or None; whether it updates its first list in place); None for any other op."""
    if func in _FOREACH_INFO:
        return _FOREACH_INFO[func]
    schema = getattr(func, "_schema", None)
    info = None
    if schema is not None and schema.name.startswith(_FOREACH_PREFIX):
        base = schema.name.removeprefix(_FOREACH_PREFIX)
        inplace = base.endswith("_")
        element = _FOREACH_ELEMENT.get((base.rstrip("_"), func._overloadname))
        lifted: set[int | str] = set()
        if element is not None:
            element_lifted = _REPLAY[element][0]
            if inplace:
                element = getattr(
                    getattr(aten, element._schema.name.split("::")[1] + "_"), element._overloadname
                )
            # The i-th foreach argument is the i-th per-tensor argument (self, other, value...).
            for i, (fa, ea) in enumerate(
                zip(schema.arguments, element._schema.arguments, strict=False)
            ):
                if i in element_lifted or ea.name in element_lifted:
                    lifted.add(fa.name if fa.kwarg_only else i)
            info = (element, frozenset(lifted), element._schema.arguments, inplace)
        elif hasattr(aten, base):
            info = (getattr(aten, base), frozenset(), None, inplace)
        else:  # no in-place per-tensor op (``_foreach_maximum_``): compute, then write back
            info = (_write_back(getattr(aten, base.rstrip("_"))), frozenset(), None, inplace)
    _FOREACH_INFO[func] = info
    return info


def _write_back(op: Any) -> Callable[..., torch.Tensor]:
    def run(a: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return a.copy_(op(a, *args, **kwargs))

    return run


def _replay_foreach(info: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A ``_foreach_*`` op as its per-tensor op on each tensor of its lists (capture has no
    foreach ops to propagate: each tensor of the list gets its own sharding)."""
    element, _, element_args, inplace = info
    n = next(len(a) for a in args if isinstance(a, (list, tuple)))

    def pick(a: Any, i: int) -> Any:
        return a[i] if isinstance(a, (list, tuple)) else a

    results = []
    for i in range(n):
        args_i = [pick(a, i) for a in args]
        kwargs_i = {k: pick(v, i) for k, v in kwargs.items()}
        if element_args is None:
            results.append(element(*args_i, **kwargs_i))
            continue
        # Positional foreach arguments that are keyword-only in the per-tensor op (value=).
        for j in range(len(args_i) - 1, -1, -1):
            if j < len(element_args) and element_args[j].kwarg_only:
                kwargs_i[element_args[j].name] = args_i.pop(j)
        results.append(replay_op(element, tuple(args_i), kwargs_i))
    return None if inplace else results


def replay_op(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``func`` where some Python floats of its arguments are 0-dim tensors now."""
    foreach = _foreach(func)
    if foreach is not None:
        return _replay_foreach(foreach, args, kwargs)
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
