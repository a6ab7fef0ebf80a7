"""Rules of the negative log-likelihood loss: ``nll_loss_forward`` and ``nll_loss_backward``
(what ``F.cross_entropy`` becomes after ``log_softmax``).

Decision: the class dim may stay sharded (vocabulary-parallel cross-entropy, Megatron's
vocab-parallel loss, DTensor's ``loss_parallel``). In the forward it is a reduction factor with
``handler="weighted_mean"``, like the vocabulary of a sharded embedding table: each device
shifts the targets by its tile's first class, the targets outside its tile (and the ignored
ones) become an ignore_index of the local op, so the loss and ``total_weight`` of each device
are partial sums over the class axes (every non-ignored target lies in exactly one tile). In
the backward the class dim passes through: the gradient at ``(i, target_i - offset)`` is local,
with the global ``total_weight``.
The batch dim passes through for ``reduction="none"``; for ``"sum"`` and ``"mean"`` it is a
reduction factor too: the partitioner masks padded targets to ``ignore_index`` (so padding adds
nothing to the loss or to total_weight) and runs the local op with ``reduction="sum"``; for sum
the results are partial sums, for mean it divides the all-reduced sum by the all-reduced
total_weight, one all_reduce of both over the batch and class axes (a local mean of means would
be wrong when shards hold different weights).
"""

from __future__ import annotations

from collections.abc import Sequence

from partita.errors import UnsupportedOpError
from partita.rules.common import Dim, aten_ops, build
from partita.rules.factor import FactorRule, OpInfo
from partita.rules.handler_names import HandlerName
from partita.rules.ruleset import RuleSet

__all__ = ["nll_loss_backward_rule", "nll_loss_rule"]

RULES = RuleSet("loss")

_NONE, _MEAN = 0, 1


def _dims(info: OpInfo, x_index: int) -> tuple[list[str], list[str], list[Dim]]:
    """(input dims, target dims, weight dims)."""
    x = info.operands[x_index]
    if x.ndim > 2:
        raise UnsupportedOpError(f"{info.target} on a {x.ndim}-d input (want [N, C] or [C])")
    batch = ["a"] if x.ndim == 2 else []
    return [*batch, "b"], batch, ["b"]


@RULES.register(*aten_ops(["nll_loss_forward.default"]))
def nll_loss_rule(info: OpInfo) -> FactorRule:
    """``a b, a, b -> , ; reduction=a,b; handler=weighted_mean`` (sum, mean) and
    ``a b, a, b -> a, ; reduction=b; handler=weighted_mean`` (none)."""
    x_dims, t_dims, w_dims = _dims(info, 0)
    operands: list[Sequence[Dim]] = [
        x_dims,
        t_dims,
        *([w_dims] if info.arg("weight") is not None else []),
    ]
    reduction = info.arg("reduction", _MEAN)
    if reduction == _NONE:
        return build(info, operands, [t_dims, []], reduction="b", handler=HandlerName.WEIGHTED_MEAN)
    return build(
        info, operands, [[], []], reduction=[*t_dims, "b"], handler=HandlerName.WEIGHTED_MEAN
    )


@RULES.register(*aten_ops(["nll_loss_backward.default"]))
def nll_loss_backward_rule(info: OpInfo) -> FactorRule:
    """``, a b, a, b, -> a b; handler=weighted_mean`` (grad_output, input, target, weight,
    total_weight); the handler masks padded targets to ``ignore_index`` when the batch is
    sharded (the kernel indexes with them) and shifts the targets into the local tile when the
    classes are."""
    x_dims, t_dims, w_dims = _dims(info, 1)
    grad = t_dims if info.arg("reduction", _MEAN) == _NONE else []
    weight = [w_dims] if info.arg("weight") is not None else []
    return build(
        info,
        [grad, x_dims, t_dims, *weight, []],
        [x_dims],
        handler=HandlerName.WEIGHTED_MEAN,
    )
