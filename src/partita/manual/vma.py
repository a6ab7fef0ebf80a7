"""Which manual mesh axes each value of a shard_map body varies over (JAX's ``check_vma``).

Inside a region every tensor has a *varying manual axes* set (vma): the manual mesh axes over
which devices may hold different values. An input varies over the axes its in_spec shards it
on; a constant or a closed-over tensor varies over none; an op's result varies over the union
of its operands'; ``psum`` removes its axes, ``all_gather`` and friends add theirs.

Two things need it. (1) ``out_specs`` may only call an output replicated over an axis it does
not vary over (otherwise the devices disagree and the "replicated" value is a lie): checked at
the region's exit. (2) Gradients: when a value invariant over an axis meets one that varies,
the invariant one is broadcast by :class:`PVary` (identity forward), whose gradient is a
``psum`` over those axes: the cotangents the devices computed for the one shared value add up.
That is what makes the gradient of a replicated weight come out summed over the batch shards.

:class:`VmaMode` is a ``TorchFunctionMode`` active while a body runs: it reads the vma of every
tensor argument, inserts :class:`PVary` where they differ and labels the results. This module
does not emit the region's boundaries (``partita.capture.manual``) or check specs.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakTensorKeyDictionary

from partita.ir.collectives import all_reduce
from partita.values.mesh import Mesh

__all__ = [
    "PVary",
    "Region",
    "VmaMode",
    "current_region",
    "pvary",
    "region_scope",
    "set_vma",
    "vma",
]


@dataclass(frozen=True)
class Region:
    """The region a body is running in: its mesh, manual axes and name (for messages), and
    ``anchor``, one of its local blocks (None without tensor inputs): ops that create a local
    value from nothing (``axis_index``) read it, so the value is known to be local from its
    operands alone, as it must be when the region is replayed from a virtual-device recording
    (which keeps no trace-time tags)."""

    mesh: Mesh
    manual_axes: tuple[str, ...]
    name: str
    vmas: WeakTensorKeyDictionary
    anchor: Tensor | None = None


_REGION: contextvars.ContextVar[Region | None] = contextvars.ContextVar(
    "partita_manual_region", default=None
)


def current_region() -> Region | None:
    """The innermost running region, or None outside shard_map bodies."""
    return _REGION.get()


def vma(t: Tensor) -> frozenset[str]:
    """The manual axes ``t`` varies over in the current region (empty outside one)."""
    region = _REGION.get()
    if region is None:
        return frozenset()
    return region.vmas.get(t, frozenset())


def set_vma(t: Tensor, axes: frozenset[str]) -> Tensor:
    region = _REGION.get()
    if region is not None:
        region.vmas[t] = frozenset(axes)
    return t


class PVary(torch.autograd.Function):
    """Identity that marks an invariant value as varying over ``axes``; gradient: psum."""

    @staticmethod
    def forward(x: Tensor, axes: tuple[str, ...], size: int) -> Tensor:
        return x.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.axes, ctx.size = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return all_reduce(grad, "sum", ctx.axes, ctx.size), None, None


def pvary(x: Tensor, axes: frozenset[str] | tuple[str, ...]) -> Tensor:
    """``x`` marked varying over ``axes`` too (a no-op for the axes it already varies over)."""
    region = _REGION.get()
    have = vma(x)
    missing = tuple(
        a for a in (region.manual_axes if region else ()) if a in axes and a not in have
    )
    if not missing or region is None:
        return x
    out = PVary.apply(x, missing, region.mesh.axes_size(missing))
    return set_vma(out, have | set(missing))


class VmaMode(TorchFunctionMode):
    """Track vma through every torch call of a body; broadcast invariant operands."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        leaves = pytree.tree_leaves((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, Tensor)]
        union = frozenset().union(*(vma(t) for t in tensors)) if tensors else frozenset()
        if union and len(tensors) > 1 and any(vma(t) != union for t in tensors):

            def widen(a: Any) -> Any:
                return pvary(a, union) if isinstance(a, Tensor) and vma(a) != union else a

            args, kwargs = pytree.tree_map(widen, (args, kwargs))
        out = func(*args, **kwargs)
        if union:
            for t in pytree.tree_leaves(out):
                if isinstance(t, Tensor):
                    set_vma(t, union | vma(t))
        return out


@contextmanager
def region_scope(
    mesh: Mesh, manual_axes: tuple[str, ...], name: str, anchor: Tensor | None = None
) -> Iterator[Region]:
    """Run a body: the region is current and :class:`VmaMode` is on."""
    region = Region(mesh, manual_axes, name, WeakTensorKeyDictionary(), anchor)
    token = _REGION.set(region)
    try:
        with VmaMode():
            yield region
    finally:
        _REGION.reset(token)
