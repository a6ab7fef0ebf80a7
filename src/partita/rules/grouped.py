"""Rules of grouped matrix products, the kernels of mixtures of experts: ``aten._grouped_mm``
(``torch._grouped_mm`` / ``F.grouped_mm``) in its four forms, and ``transformers``' own
``transformers::grouped_mm_fallback`` and its backward (what a ``transformers`` MoE with its
default ``experts_implementation`` calls while traced).

A grouped product multiplies consecutive groups of rows by one matrix each: with ``offs``
(cumulative row counts, one per group), rows ``offs[g-1]:offs[g]`` of ``x [s, k]`` meet
``w[g] [k, n]``. The contracting ``k`` is a reduction factor, as in ``mm``, and ``n`` passes
through; the rows ``s`` and the groups ``e`` are *need-replication*: ``offs`` holds global row
positions, so a device holding some rows (or some groups) cannot tell which of its rows are
which group's without the whole. Expert parallelism routes the rows itself (the ``"ep"``
presets, docs/models.md "Experts") and calls these ops on whole local groups.

The library's ops are looked up by name (``"transformers.grouped_mm_fallback.default"``):
their op objects exist only once ``transformers`` registered them, and the table does not
import ``transformers``.
"""

from __future__ import annotations

from partita.rules.common import aten_ops, build
from partita.rules.factor import FactorRule, OpInfo
from partita.rules.facts import OpFacts
from partita.rules.ruleset import RuleSet

RULES = RuleSet("grouped")

__all__ = ["TRANSFORMERS_GROUPED_MM", "grouped_mm_backward_rule", "grouped_mm_rule"]

#: ``transformers::grouped_mm_fallback`` (forward, backward) by name.
TRANSFORMERS_GROUPED_MM = (
    "transformers.grouped_mm_fallback.default",
    "transformers.grouped_mm_fallback_backward.default",
)

_SAME_DTYPE = OpFacts(same_dtype=True)


@RULES.register(*aten_ops(["_grouped_mm.default"]), TRANSFORMERS_GROUPED_MM[0], facts=_SAME_DTYPE)
def grouped_mm_rule(info: OpInfo) -> FactorRule:
    """By the operands' ranks (``offs``: one entry per group ``e``):

    * ``s k, e k n, e -> s n`` (rows in groups; the MoE forward and input gradient);
    * ``k s, s n, e -> e k n`` (the weight gradient: ``s`` is summed per group);
    * ``e m k, k n, e -> m n`` (columns of the second operand in groups);
    * ``e m k, e k n -> e m n`` (no ``offs``: a batched product, ``bmm``).

    ``k`` is a reduction (need-replication when a bias is added: the bias must be counted
    once), except in the weight gradient where it passes through; ``s`` and ``e`` need
    replication, except in the batched form.
    """
    a, b = info.operands[0], info.operands[1]
    rest = len(info.operands) - 2  # offs and/or bias
    has_offs = rest >= 1 and info.operands[2].ndim == 1 and not (a.ndim == 3 and b.ndim == 3)
    has_bias = rest == 2 or (rest == 1 and not has_offs)
    red = ["k"]
    if a.ndim == 2 and b.ndim == 3:
        ops, out = [["s", "k"], ["e", "k", "n"]], [["s", "n"]]
        rep, bias = ["s", "e"], ["e", "n"]
    elif a.ndim == 2 and b.ndim == 2:  # s is summed within each group: never split
        ops, out = [["k", "s"], ["s", "n"]], [["e", "k", "n"]]
        rep, bias, red = ["s", "e"], ["e", "n"], []
    elif a.ndim == 3 and b.ndim == 2:
        ops, out = [["e", "m", "k"], ["k", "n"]], [["m", "n"]]
        rep, bias = ["e", "n"], ["e", "n"]
    else:
        ops, out = [["e", "m", "k"], ["e", "k", "n"]], [["e", "m", "n"]]
        rep, bias = [], ["e", "n"]
    if has_offs:
        ops.append(["e"])
    if has_bias:  # the bias is added once: its product is not split along a reduction
        ops.append(bias)
        rep, red = [*rep, *red], []
    return build(info, ops, out, reduction=red, need_replication=rep)


@RULES.register(TRANSFORMERS_GROUPED_MM[1], facts=_SAME_DTYPE)
def grouped_mm_backward_rule(info: OpInfo) -> FactorRule:
    """``s k, e k n, e, s n -> s k, e k n; result0-reduction=n; need-replication=s,e`` for
    ``grouped_mm_fallback_backward(x, w, offs, grad)`` (the input's and the weights'
    gradients): ``n`` is summed for the input's gradient and kept for the weights'."""
    return build(
        info,
        [["s", "k"], ["e", "k", "n"], ["e"], ["s", "n"]],
        [["s", "k"], ["e", "k", "n"]],
        need_replication=["s", "e"],
        result_reductions={0: ["n"]},
    )
