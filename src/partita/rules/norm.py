"""Rules of normalisation ops: layer norm, batch norm, group norm, forward and backward.

Decisions (and why):

* Layer norm: the normalised dims are need-replication (statistics over them would need an
  all_reduce of sums inside the op), on the input, weight and bias; the batch dims pass
  through. ``mean``/``rstd`` have the batch dims and size-1 normalised dims. In the backward,
  ``grad_weight``/``grad_bias`` sum over the batch dims (``result_reductions``: partial when a
  batch dim is sharded) while ``grad_input`` keeps them.
* Batch norm, training mode: the statistics are reduced over batch and spatial dims. Those
  dims pass through with the *mandatory* ``handler="batch_stats"``: sharded, the partitioner
  lowers the op as SyncBatchNorm (one all_reduce of the per-channel sums and sums of squares,
  with the global count; the backward all-reduces the per-channel sums of ``dy`` and
  ``dy * (x - mean)``, so its ``grad_weight``/``grad_bias`` come out replicated). The variants
  that update running stats *in place* (``native_batch_norm`` and ``_native_batch_norm_legit``
  with running stats; a captured program has the functional form instead) keep batch and
  spatial dims need-replication. Channels pass through. Eval mode: batch and spatial dims pass
  through, and the backward's ``grad_weight``/``grad_bias`` sum over them.
* Group norm: the batch dim passes through, channels and spatial dims are need-replication.

This module does not cover softmax (``reduction.py``).
"""

from __future__ import annotations

from partita.rules.common import Dim, Names, aten_ops, build
from partita.rules.factor import FactorRule, OpInfo
from partita.rules.facts import OpFacts, SizeArg
from partita.rules.ruleset import RuleSet

RULES = RuleSet("norm")

__all__ = ["batch_norm_rule", "layer_norm_backward_rule", "layer_norm_rule"]


def _present(info: OpInfo, names_: list[str]) -> list[str]:
    """Which of the optional tensor arguments ``names_`` the call passes, in order."""
    return [n for n in names_ if info.arg(n) is not None]


def _layer_norm_dims(info: OpInfo, x_index: int) -> tuple[list[str], list[str], list[Dim]]:
    x = info.operands[x_index]
    k = len(info.arg("normalized_shape"))
    names = Names().take(x.ndim)
    batch, normed = names[: x.ndim - k], names[x.ndim - k :]
    stats: list[Dim] = [*batch, *([None] * k)]
    return batch, normed, stats


@RULES.register(*aten_ops(["native_layer_norm.default"]))
def layer_norm_rule(info: OpInfo) -> FactorRule:
    """``a b c, c, c -> a b c, a b 1, a b 1; need-replication=c``."""
    batch, normed, stats = _layer_norm_dims(info, 0)
    params = [normed] * len(_present(info, ["weight", "bias"]))
    results = [[*batch, *normed], stats, stats]
    return build(info, [[*batch, *normed], *params], results, need_replication=normed)


@RULES.register(*aten_ops(["native_layer_norm_backward.default"]))
def layer_norm_backward_rule(info: OpInfo) -> FactorRule:
    """``grad, x, mean, rstd, w, b -> grad_x, grad_w, grad_b``; grad_w/grad_b sum over the
    batch dims."""
    batch, normed, stats = _layer_norm_dims(info, 1)
    full = [*batch, *normed]
    params = [normed] * len(_present(info, ["weight", "bias"]))
    operands = [full, full, stats, stats, *params]
    red = {j: batch for j in (1, 2) if info.results[j] is not None and batch}
    return build(
        info,
        operands,
        [full, normed, normed],
        need_replication=normed,
        result_reductions=red,
    )


def _bn_dims(
    info: OpInfo, x_index: int, training: bool, in_place: bool = False
) -> tuple[list[str], list[str], dict]:
    x = info.operands[x_index]
    names = Names().take(x.ndim)
    c = names[1]
    other = [f for i, f in enumerate(names) if i != 1]
    kw: dict = {}
    if training:
        kw = {"handler": "batch_stats"}
        if in_place:  # running stats updated in place: batch_stats does not lower that
            kw["need_replication"] = other
    return names, [c], kw


def _vec(info: OpInfo, index: int, c: list[str]) -> list[Dim]:
    """A per-channel vector: ``c``, or no dims when it is empty (eval-mode saved stats)."""
    m = info.operands[index] if index < len(info.operands) else None
    return c if m is None or m.shape[0] else [None]


_BN_FORWARD = aten_ops(
    [
        "_native_batch_norm_legit.default",
        "_native_batch_norm_legit.no_stats",
        "_native_batch_norm_legit_functional.default",
        "_native_batch_norm_legit_no_training.default",
        "native_batch_norm.default",
    ]
)


@RULES.register(*_BN_FORWARD)
def batch_norm_rule(info: OpInfo) -> FactorRule:
    """Training: ``a b c d, b, b, b, b -> a b c d, b, b, ...; handler=batch_stats`` (plus
    ``need-replication=a,c,d`` for the in-place variants); eval: everything passes through."""
    training = "no_training" not in str(info.target) and bool(info.arg("training", False))
    name = str(info.target)
    in_place = (
        name in ("aten.native_batch_norm.default", "aten._native_batch_norm_legit.default")
        and info.arg("running_mean") is not None
    )
    names, c, kw = _bn_dims(info, 0, training, in_place)
    operands = [names, *([c] * (len(info.operands) - 1))]
    results = [names] + [
        None if r is None else (c if r.shape and r.shape[0] else [None] * r.ndim)
        for r in info.results[1:]
    ]
    return build(info, operands, results, **kw)


@RULES.register(*aten_ops(["native_batch_norm_backward.default"]))
def batch_norm_backward_rule(info: OpInfo) -> FactorRule:
    """``grad, x, w, rm, rv, sm, sinv -> grad_x, grad_w, grad_b``."""
    training = bool(info.arg("train", False))
    names, c, kw = _bn_dims(info, 1, training)
    operands: list[list[Dim]] = [names, names]
    for m in info.operands[2:]:
        operands.append(c if m.shape and m.shape[0] else [None] * m.ndim)
    other = [f for f in names if f not in c]
    red = {} if training else {j: other for j in (1, 2) if info.results[j] is not None}
    return build(info, operands, [names, c, c], result_reductions=red, **kw)


@RULES.register(
    *aten_ops(["native_group_norm.default"]), facts=OpFacts(size_args=(SizeArg(3, 0, 0),))
)
def group_norm_rule(info: OpInfo) -> FactorRule:
    """``a b c d, b, b -> a b c d, a g, a g; need-replication=b,c,d,g``."""
    fresh = Names()
    names = fresh.take(info.operands[0].ndim)
    g = fresh.new()
    rep = [*names[1:], g]
    params = [[names[1]]] * (len(info.operands) - 1)
    stats = [names[0], g]
    return build(info, [names, *params], [names, stats, stats], need_replication=rep)


@RULES.register(
    *aten_ops(["native_group_norm_backward.default"]),
    facts=OpFacts(size_args=(SizeArg(5, 0, 0),)),
)
def group_norm_backward_rule(info: OpInfo) -> FactorRule:
    """``grad, x, mean, rstd, w -> grad_x, grad_w, grad_b``; grad_w/grad_b sum over ``a``."""
    fresh = Names()
    names = fresh.take(info.operands[0].ndim)
    g = fresh.new()
    params = [[names[1]]] * (len(info.operands) - 4)
    stats = [names[0], g]
    red = {j: [names[0]] for j in (1, 2) if info.results[j] is not None}
    return build(
        info,
        [names, names, stats, stats, *params],
        [names, [names[1]], [names[1]]],
        need_replication=[*names[1:], g],
        result_reductions=red,
    )


@RULES.register(*aten_ops(["_batch_norm_with_update_functional.default"]))
def batch_norm_with_update_rule(info: OpInfo) -> FactorRule:
    """``a b c, b, b, b, b -> a b c, b, b, 1, b, b; need-replication=a,c``: training batch norm
    that returns the updated running stats. Channels pass through; batch and spatial dims are
    gathered (the ``batch_stats`` handler lowers only the ``native_batch_norm`` family)."""
    names, c, _ = _bn_dims(info, 0, training=False)
    other = [f for f in names if f not in c]
    operands = [names, *([c] * (len(info.operands) - 1))]
    results: list[list[Dim] | None] = [
        None if r is None else (c if r.ndim == 1 and r.shape[0] else [None] * r.ndim)
        for r in info.results[1:]
    ]
    return build(info, operands, [names, *results], need_replication=other)
