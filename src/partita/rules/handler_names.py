"""The names of the special lowerings a rule may ask for (``FactorRule.handler``), in one place.

A rule says *that* an op needs more than local ops when a factor is sharded (a halo exchange,
a masked lookup, a cross-device softmax); ``partita.partition`` says *how*. The two are linked
by these names: ``FactorRule`` rejects a name that is not here, and ``partita.partition``
checks when it is imported that every name here has a registered lowering (or is one the
generic lowering covers), so a misspelt or missing handler fails at once instead of letting
the op silently run on gathered tensors.

Rule modules may pass the member (``handler=HandlerName.HALO``) or its string value
(``handler="halo"``); both mean the same handler. This module holds names only: no lowering.
"""

from __future__ import annotations

import enum

from partita.errors import CompilerError

__all__ = ["HandlerName", "check_handler_name"]


class HandlerName(str, enum.Enum):
    """Every handler name a rule may use; each value is the name the partitioner registers."""

    ADD_BIAS_ONCE = "add_bias_once"
    AS_STRIDED = "as_strided"
    BATCH_STATS = "batch_stats"
    CONTIGUOUS = "contiguous"
    GLOBAL_RANDOM = "global_random"
    HALO = "halo"
    INDEX_PADDING = "index_padding"
    LOCALIZE_SHAPE = "localize_shape"
    MASKED_EMBEDDING = "masked_embedding"
    MASK_WRITE = "mask_write"
    MEAN = "mean"
    RETILE = "retile"
    SHARDED_SCAN = "sharded_scan"
    SOFTMAX_REDUCE = "softmax_reduce"
    WEIGHTED_MEAN = "weighted_mean"


def check_handler_name(handler: str | None, where: str) -> str | None:
    """``handler`` as its plain string value, or a CompilerError naming the valid names.

    Example:
        >>> check_handler_name(HandlerName.HALO, "rule")
        'halo'
    """
    if handler is None:
        return None
    try:
        return HandlerName(handler).value
    except ValueError:
        valid = ", ".join(repr(h.value) for h in HandlerName)
        raise CompilerError(
            f"{where} names the partition handler {handler!r}, which does not exist (valid "
            f"names: {valid}). A rule whose handler is unknown would have its sharded factors "
            f"dropped and the op would run on gathered tensors, so this is refused. Fix the "
            f"spelling in the rule, or add the name to HandlerName "
            f"(partita/rules/handler_names.py) and register its lowering in partita.partition."
        ) from None
