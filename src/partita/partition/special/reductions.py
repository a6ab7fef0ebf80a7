"""The reduction handlers ``mean`` (a masked local sum over the global count, a partial sum)
and ``weighted_mean`` (nll_loss forward/backward with the batch or the classes sharded)."""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.fx as fx

from partita.partition.emit import Emitter, Proxy, emitting, op_of
from partita.partition.handlers import Handler, register
from partita.partition.lowering_api import LoweringAPI
from partita.partition.special.common import Assign, aten, axes_of, fake_value
from partita.rules import FactorRule
from partita.rules.handler_names import HandlerName
from partita.values.layout import ceil_div

# --- mean ---------------------------------------------------------------------------------------


def _reduced_axes(rule: FactorRule, assign: Assign) -> tuple[str, ...]:
    return tuple(a for f in rule.reduction_factors for a in assign.get(f, ()))


def _mean_applies(low: LoweringAPI, node: fx.Node, rule: FactorRule, assign: Assign) -> bool:
    return bool(_reduced_axes(rule, assign))


@emitting
def _mean_lower(e: Emitter, node: fx.Node, rule: FactorRule, assign: Assign) -> Proxy:
    """A local sum of the (zero-masked) tile divided by the global count: a partial sum."""
    (x,) = e.operands(rule, assign)
    shape = tuple(fake_value(node.args[0]).shape)
    dtype = node.kwargs.get("dtype")
    if node.target == aten.mean.dim:
        args: tuple[Any, ...] = node.args  # mean.dim(self, dim, keepdim, dtype)
        kwargs: dict[str, Any] = dict(node.kwargs)
        given = args[1] if len(args) > 1 else kwargs.get("dim")
        keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
        dims = list(range(len(shape))) if not given else [d % len(shape) for d in given]
        if len(args) > 3:
            dtype = args[3]
        s = x.sum(dims, keepdim, dtype=dtype)
    else:
        dims = list(range(len(shape)))
        s = x.sum(dtype=dtype)
    return s / math.prod(shape[d] for d in dims)


register(Handler(HandlerName.MEAN.value, _mean_applies, _mean_lower))


# --- weighted_mean: nll_loss_forward and nll_loss_backward ----------------------------------------

_NONE, _MEAN, _SUM = 0, 1, 2
#: The ignore_index of the local op when the classes are split: the targets outside this
#: device's tile and the ignored ones get it (a negative value is never a local class).
_LOCAL_IGNORE = -100


def _class_axes(node: fx.Node, rule: FactorRule, x: int, assign: Assign) -> tuple[str, ...]:
    """The mesh axes of the class dim (the last) of operand ``x``, the log-probabilities."""
    return axes_of(rule, x, fake_value(node.args[x]).ndim - 1, assign)


def _batch_axes(node: fx.Node, rule: FactorRule, t: int, assign: Assign) -> tuple[str, ...]:
    """The mesh axes of the batch dim of operand ``t``, the targets (none when 0-d)."""
    return axes_of(rule, t, 0, assign) if fake_value(node.args[t]).ndim else ()


def _local_targets(
    e: Emitter, node: fx.Node, rule: FactorRule, assign: Assign, where: tuple[int, int, int]
) -> list[Any]:
    """The op's arguments for the local op: its local operands, the targets and ignore_index
    replaced. ``where`` holds the positions of the input, the target and ignore_index in
    ``node.args``, which are also the input's and the target's positions among the rule's
    operands (tensors come first in both ops).

    Padded batch rows get ``ignore_index``. With the classes split over some mesh axes, each
    device shifts the targets by its tile's first class; the targets outside its tile, in its
    padding (past the last class) or ignored become ``_LOCAL_IGNORE``, so the local op picks
    ``target - offset`` only where this device holds that class and adds 0 elsewhere; a
    target outside ``[0, classes)`` that is not ignored stays out of bounds, so the local op
    raises as the unsharded one does."""
    x, t, i = where
    it = iter(e.operands(rule, assign))
    args: list[Any] = [
        next(it) if isinstance(fake_value(a), torch.Tensor) else a for a in node.args
    ]
    ignore = int(args[i])
    target = args[t]
    batch = _batch_axes(node, rule, t, assign)
    if batch:
        n = int(fake_value(node.args[t]).shape[0])
        args[t] = target = e.mask_padding(target, batch, n, 1, 0, ignore)
    classes = _class_axes(node, rule, x, assign)
    if not classes:
        return args
    size = int(fake_value(node.args[x]).shape[-1])
    group = e.mesh.axes_size(classes)
    tile = ceil_div(size, group)
    local = target - e.tile_offset(target, classes, tile)
    kept = target != ignore
    inside = torch.logical_and(torch.logical_and(local >= 0, local < tile), kept)
    if tile * group > size:  # padded classes: a target past the last one is never picked
        inside = torch.logical_and(inside, target < size)
    # A target outside [0, classes) that is not ignored is an error of the unsharded op
    # ("Target 12 is out of bounds"); dropping it would change the loss silently. Every device
    # passes it to its local op as it is, out of its tile's bounds too, so each one raises
    # (one equal to the local ignore_index is moved off it, still out of bounds).
    valid = torch.logical_and(target >= 0, target < size)
    invalid = torch.logical_and(torch.logical_not(valid), kept)
    bad = torch.where(target == _LOCAL_IGNORE, _LOCAL_IGNORE - 1, target)
    args[t] = torch.where(inside, local, torch.where(invalid, bad, _LOCAL_IGNORE))
    args[i] = _LOCAL_IGNORE
    return args


def _nll_lower(e: Emitter, node: fx.Node, rule: FactorRule, assign: Assign) -> Proxy:
    """The local op on the local targets (``_local_targets``) with ``reduction=sum``: for sum
    the loss and total_weight stay partial over the batch and class axes; for mean one
    all_reduce of ``(sum, total_weight)`` over them and a divide. With ``reduction=none`` the
    per-target loss is partial over the class axes (each target is picked on one device)."""
    args = _local_targets(e, node, rule, assign, (0, 1, 4))
    reduction = int(args[3])
    if reduction == _NONE:
        return op_of(node)(*args)
    args[3] = _SUM
    res = op_of(node)(*args)
    if reduction == _SUM:
        return res
    dtype = node.meta["val"][0].dtype
    what = "loss sum and total weight"
    red = _reduced_axes(rule, assign)
    both = e.all_reduce(
        torch.stack([res[0], res[1]]), red, "sum", shape=(2,), dtype=dtype, what=what
    )
    total, weight = both.select(0, 0), both.select(0, 1)
    for f in rule.reduction_factors:  # the results are reduced already
        assign.pop(f, None)
    return e.tuple(total / weight, weight)


def _nll_applies(low: LoweringAPI, node: fx.Node, rule: FactorRule, assign: Assign) -> bool:
    if node.target == aten.nll_loss_backward.default:
        return bool(_batch_axes(node, rule, 2, assign) or _class_axes(node, rule, 1, assign))
    return bool(_reduced_axes(rule, assign) or _batch_axes(node, rule, 1, assign))


def _nll_backward_lower(e: Emitter, node: fx.Node, rule: FactorRule, assign: Assign) -> Proxy:
    """``nll_loss_backward`` on the local targets (``_local_targets``): the gradient of the
    picked ``(i, target_i - offset)`` where this device holds the class, 0 elsewhere; the global
    ``total_weight`` (an operand) makes the rest local."""
    args = _local_targets(e, node, rule, assign, (1, 2, 5))
    return op_of(node)(*args)


#: The lowering of each op the weighted_mean rule names.
_NLL_LOWER = {
    aten.nll_loss_forward.default: _nll_lower,
    aten.nll_loss_backward.default: _nll_backward_lower,
}


@emitting
def _nll_dispatch(e: Emitter, node: fx.Node, rule: FactorRule, assign: Assign) -> Proxy:
    return _NLL_LOWER[cast(torch._ops.OpOverload, node.target)](e, node, rule, assign)


register(Handler(HandlerName.WEIGHTED_MEAN.value, _nll_applies, _nll_dispatch))
