"""Helpers shared by the rule families: factor naming, rule building, op lists, broadcasting.

Family modules build their factors as Python lists (one entry per dim: a factor name, a tuple
of names for a compound dim, or ``None`` for a dim no factor can shard) and hand them to
:func:`build`, which validates them through :func:`~partita.rules.factor.einsum_rule`. This
module holds no per-op knowledge and registers nothing.
"""

from __future__ import annotations

import string
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from partita.rules.factor import FactorRule, OpInfo, TensorMeta, einsum_rule

__all__ = [
    "Dim",
    "Names",
    "aten_ops",
    "broadcast_dims",
    "build",
    "norm_dim",
    "norm_dims",
]

Dim = str | tuple[str, ...] | None  # one factor, a compound dim (major first), or no factor
TensorDims = Sequence[Dim] | None  # None: an operand that is gathered / a non-tensor result


class Names:
    """Fresh factor names in order: ``a``, ``b``, ..., ``z``, ``f26``, ``f27``, ...

    Example:
        >>> n = Names(); n.take(3), n.new()
        (['a', 'b', 'c'], 'd')
    """

    def __init__(self) -> None:
        self._next = 0

    def new(self) -> str:
        i, self._next = self._next, self._next + 1
        return string.ascii_lowercase[i] if i < 26 else f"f{i}"

    def take(self, n: int) -> list[str]:
        return [self.new() for _ in range(n)]


def _dim(d: Dim) -> tuple[str, ...]:
    if d is None:
        return ()
    return (d,) if isinstance(d, str) else tuple(d)


def build(
    info: OpInfo,
    operands: Sequence[TensorDims],
    results: Sequence[TensorDims],
    **kwargs: Any,
) -> FactorRule:
    """A FactorRule from per-dim factor lists; keyword arguments go to ``einsum_rule``.

    Example:
        >>> a, b, c = TensorMeta((4, 8)), TensorMeta((8, 2)), TensorMeta((4, 2))
        >>> info = OpInfo(None, (a, b), {}, (a, b), (c,))
        >>> build(info, [["m", "k"], ["k", "n"]], [["m", "n"]], reduction="k")
        FactorRule(m k, k n -> m n; reduction=k)
    """
    ops = tuple(None if t is None else tuple(_dim(d) for d in t) for t in operands)
    res = tuple(None if t is None else tuple(_dim(d) for d in t) for t in results)
    return einsum_rule((ops, res), info.operands, info.results, **kwargs)


def aten_ops(names: Iterable[str]) -> tuple[Any, ...]:
    """Resolve ``"add.Tensor"`` style names to aten overloads, skipping ones this torch lacks.

    The names must be sorted (families register from sorted tuples).
    """
    names = tuple(names)
    if list(names) != sorted(names):
        raise ValueError(f"op names must be sorted: {names}")
    out = []
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet, None), overload or "default", None)
        if op is not None:
            out.append(op)
    return tuple(out)


def norm_dim(dim: int, ndim: int) -> int:
    """A possibly negative dim index made non-negative (0-d tensors accept 0 and -1)."""
    n = max(ndim, 1)
    if not -n <= dim < n:
        raise NotImplementedError(f"dim {dim} out of range for a {ndim}-d tensor")
    return dim % n


def norm_dims(dims: int | Sequence[int] | None, ndim: int) -> list[int]:
    """Dims of a reduction, sorted; ``None`` or ``[]`` means every dim."""
    if dims is None:
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    if len(dims) == 0:
        return list(range(ndim))
    return sorted({norm_dim(d, ndim) for d in dims} & set(range(ndim)))


def broadcast_dims(
    meta: TensorMeta, out_shape: Sequence[int], out_dims: Sequence[Dim]
) -> list[Dim]:
    """The factors of ``meta``'s dims when it broadcasts to ``out_shape`` (aligned from the
    right): a dim equal to the output's gets its factor, a size-1 dim that broadcasts gets
    none.

    Example:
        >>> broadcast_dims(TensorMeta((1, 8)), (4, 8), ["a", "b"])
        [None, 'b']
    """
    offset = len(out_shape) - meta.ndim
    if offset < 0:
        raise NotImplementedError(
            f"operand of shape {meta.shape} does not broadcast to {out_shape}"
        )
    dims: list[Dim] = []
    for i, n in enumerate(meta.shape):
        if n == out_shape[offset + i]:
            dims.append(out_dims[offset + i])
        elif n == 1:
            dims.append(None)
        else:
            raise NotImplementedError(
                f"operand of shape {meta.shape} does not broadcast to {tuple(out_shape)}"
            )
    return dims


def sizes_of(dims: Sequence[Sequence[str]], shape: Sequence[int]) -> Mapping[str, int]:
    """Sizes of single-factor dims (a helper for rules that pass ``sizes=``)."""
    return {d[0]: n for d, n in zip(dims, shape, strict=True) if len(d) == 1}
