"""Rules of the FFT primitives every ``torch.fft`` function becomes: ``_fft_r2c``, ``_fft_c2c``,
``_fft_c2r``.

Decision: "gather, compute, keep replicated" on the transformed dims. A sharded FFT dim would
need a distributed transform (transposes through all_to_all); partita gathers the transformed
dims (need-replication, recorded in the Plan with the op as the reason) and leaves them
replicated in the result (whose size there may differ: a one-sided real transform keeps
``n // 2 + 1`` entries). Every other dim is a batch dim of the transform and passes through.
This module does not cover window functions or ``stft`` (they decompose into these ops).
"""

from __future__ import annotations

from partita.rules.common import Dim, Names, aten_ops, build, norm_dims
from partita.rules.factor import FactorRule, OpInfo
from partita.rules.ruleset import RuleSet

RULES = RuleSet("fft")

__all__ = ["fft_rule"]


@RULES.register(*aten_ops(["_fft_c2c.default", "_fft_c2r.default", "_fft_r2c.default"]))
def fft_rule(info: OpInfo) -> FactorRule:
    """``a b -> a 1; need-replication=b`` for ``_fft_r2c(x, [1], ...)``."""
    (x,), (out,) = info.operands, info.results
    dims = norm_dims(list(info.arg("dim")), x.ndim)
    if not dims or out.ndim != x.ndim:
        raise NotImplementedError(f"{info.target} over dims {info.arg('dim')} of {x.shape}")
    names = Names().take(x.ndim)
    res: list[Dim] = [None if i in dims else f for i, f in enumerate(names)]
    return build(info, [names], [res], need_replication=[names[i] for i in dims])
