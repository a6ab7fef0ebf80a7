"""Rules of scaled-dot-product attention: ``partita::sdpa`` / ``partita::sdpa_backward`` (what
capture normalises attention to) and the CPU flash kernels they replace.

``q [b h t d], k [b h s d], v [b h s e] -> out [b h t e], logsumexp [b h t]``. Batch ``b`` and
heads ``h`` pass through; the query sequence ``t`` passes through unless the attention is
causal (the causal mask depends on the *global* query position, so ``t`` is need-replication
there); the key sequence ``s`` and the head dims ``d``, ``e`` are need-replication (sharding
them needs a flash-style online-softmax lowering). In the backward, ``grad_key`` and
``grad_value`` sum over ``t``: they are partial over its mesh axes when it is sharded
(``result_reductions``). A mask broadcasts to ``[b h t s]``.

Grouped-query attention (``enable_gqa=True``: ``Hq`` query heads, ``Hkv`` key/value heads,
``Hq % Hkv == 0``): the query's head dim is the compound ``(h g)``, kv head ``h`` major and
group ``g`` minor, ``h`` shared with the keys and values. Sharding ``h`` splits the query's heads
into whole groups, consistently with the keys'; ``grad_key`` and ``grad_value`` also sum over
``g``. Attention with dropout inside the
kernel is not supported (capture takes the math path for it).
"""

from __future__ import annotations

from partita.rules.common import Dim, aten_ops, broadcast_dims, build
from partita.rules.factor import FactorRule, OpInfo
from partita.rules.facts import OpFacts
from partita.rules.ruleset import RuleSet

RULES = RuleSet("attention")

__all__ = ["sdpa_backward_rule", "sdpa_rule"]

_K = ["b", "h", "s", "d"]
_V = ["b", "h", "s", "e"]


def _heads(info: OpInfo, q_index: int) -> Dim:
    """The factors of the query's head dim: ``h`` when the query has as many heads as the keys,
    ``(h g)`` (kv head major, group minor) for grouped-query attention."""
    q, k = info.operands[q_index], info.operands[q_index + 1]
    hq, hk = q.shape[1], k.shape[1]
    if hq == hk:
        return "h"
    if hk == 0 or hq % hk:
        raise NotImplementedError(
            f"{info.target}: the query has {hq} heads and the key/value {hk} (query {q.shape}, "
            f"key {k.shape}); grouped-query attention needs the query's head count to be a "
            f"multiple of the key's. Repeat the key/value heads to a divisor of {hq}."
        )
    return ("h", "g")


def _check(info: OpInfo, q_index: int) -> list[str]:
    """The need-replication factors; raises for what no rule here expresses."""
    if info.arg("dropout_p", 0.0):
        raise NotImplementedError(f"{info.target} with dropout_p > 0 has no sharding rule")
    if info.operands[q_index].ndim != 4:
        raise NotImplementedError(
            f"{info.target} on a {info.operands[q_index].ndim}-d query (want [b, h, t, d])"
        )
    return ["s", "d", "e", *(["t"] if info.arg("is_causal", False) else [])]


def _masks(info: OpInfo, q_index: int, n_fixed: int, heads: Dim) -> list[list[Dim]]:
    """Factors of the attention masks (the operands after the fixed ones), broadcast to the
    scores ``[b h t s]``."""
    q, k = info.operands[q_index], info.operands[q_index + 1]
    scores = (*q.shape[:3], k.shape[2])
    return [broadcast_dims(m, scores, ["b", heads, "t", "s"]) for m in info.operands[n_fixed:]]


def sdpa_rule(info: OpInfo) -> FactorRule:
    """``b h t d, b h s d, b h s e -> b h t e, b h t; need-replication=s,d,e``; with grouped
    query heads ``b (h g) t d, b h s d, b h s e -> b (h g) t e, b (h g) t``."""
    rep = _check(info, 0)
    heads = _heads(info, 0)
    q: list[Dim] = ["b", heads, "t", "d"]
    out: list[Dim] = ["b", heads, "t", "e"]
    operands = [q, _K, _V, *_masks(info, 0, 3, heads)]
    return build(info, operands, [out, ["b", heads, "t"]], need_replication=rep)


def sdpa_backward_rule(info: OpInfo) -> FactorRule:
    """``grad, q, k, v, out, lse -> grad_q, grad_k, grad_v``; grad_k and grad_v sum over ``t``
    and, with grouped query heads, over the group ``g``."""
    rep = _check(info, 1)
    heads = _heads(info, 1)
    q: list[Dim] = ["b", heads, "t", "d"]
    out: list[Dim] = ["b", heads, "t", "e"]
    operands = [out, q, _K, _V, out, ["b", heads, "t"], *_masks(info, 1, 6, heads)]
    summed = ([] if "t" in rep else ["t"]) + (["g"] if heads != "h" else [])
    red = {j: summed for j in (1, 2) if summed and info.results[j] is not None}
    return build(info, operands, [q, _K, _V], need_replication=rep, result_reductions=red)


RULES.register(
    *aten_ops(["_scaled_dot_product_flash_attention_for_cpu.default"]),
    facts=OpFacts(same_dtype=True),
)(sdpa_rule)
RULES.register(*aten_ops(["_scaled_dot_product_flash_attention_for_cpu_backward.default"]))(
    sdpa_backward_rule
)


def _register_partita_ops() -> None:
    import torch

    import partita.capture.ops  # noqa: F401  (defines partita::sdpa)

    RULES.register(torch.ops.partita.sdpa.default)(sdpa_rule)
    RULES.register(torch.ops.partita.sdpa_backward.default)(sdpa_backward_rule)


_register_partita_ops()
