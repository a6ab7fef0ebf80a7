"""The "gather, compute, keep replicated" rule shape: batch dims pass through, core dims are
gathered.

Many ops mix every element of their trailing *core* dims in a way no collective reassembles
cheaply (a matrix decomposition, an inverse, an FFT over a dim, an adaptive pool or an
interpolation over the spatial plane). Their sharding rule says so honestly: the core dims are
need-replication on the operands (the Plan records each gather with the op as its reason), the
results' core dims carry no factor (they come out replicated), and the leading *batch* dims
pass through, because the op treats every batch element on its own: a batched ``svd`` sharded
on its batch dim needs no communication at all.

Batch dims broadcast like elementwise ops (aligned from the right; a size-1 batch dim carries no
factor). A call whose shapes do not fit that pattern (a result without the batch dims, say
``svd``'s empty ``U`` when ``compute_uv=False``) gets no factor on that tensor: it is gathered
or replicated, which is always correct. This module registers nothing; the family modules
(``linalg.py``, ``conv.py``, ...) use :func:`batched_rule`.
"""

from __future__ import annotations

from collections.abc import Sequence

from partita.errors import RuleError
from partita.rules.common import Dim, Names, build
from partita.rules.factor import FactorRule, OpInfo, TensorMeta

__all__ = ["batch_shape", "batched_rule"]


def batch_shape(
    operands: Sequence[TensorMeta], core: Sequence[int | None]
) -> tuple[int, ...] | None:
    """The broadcast shape of the operands' leading (batch) dims, or None if they do not
    broadcast.

    Example:
        >>> batch_shape([TensorMeta((4, 1, 3, 3)), TensorMeta((5, 3, 2))], [2, 2])
        (4, 5)
    """
    if any(c is not None and c > m.ndim for m, c in zip(operands, core, strict=True)):
        return None
    shapes = [
        tuple(m.shape[: m.ndim - c]) for m, c in zip(operands, core, strict=True) if c is not None
    ]
    n = max((len(s) for s in shapes), default=0)
    out = [1] * n
    for s in shapes:
        for i, size in enumerate(s):
            j = n - len(s) + i
            if size != 1 and out[j] not in (1, size):
                return None
            out[j] = size if size != 1 else out[j]
    return tuple(out)


def _batch_dims(
    shape: Sequence[int], n_core: int, batch: Sequence[int], names: Sequence[str]
) -> list[Dim] | None:
    """The factors of a tensor's batch dims aligned from the right (None: they do not fit)."""
    lead = len(shape) - n_core
    if lead < 0 or lead > len(batch):
        return None
    offset = len(batch) - lead
    dims: list[Dim] = []
    for i in range(lead):
        if shape[i] == batch[offset + i]:
            dims.append(names[offset + i])
        elif shape[i] == 1:
            dims.append(None)
        else:
            return None
    return dims


def batched_rule(
    info: OpInfo,
    core: Sequence[int | None],
    core_out: Sequence[int],
    *,
    handler: str | None = None,
) -> FactorRule:
    """``a b c, a d -> a 1 1, a 1; need-replication=b,c,d`` for ``linalg_eigh`` on ``[n, m, m]``
    (core dims 2, results' core dims 1 and 2).

    ``core[i]`` is the number of trailing core dims of operand ``i`` (``None``: the whole
    operand is gathered); ``core_out[j]`` those of result ``j``. Operands whose batch dims do
    not broadcast, and results whose leading dims are not the batch shape, get no factors.

    Example:
        >>> a, s = TensorMeta((4, 3, 3)), TensorMeta((4, 3))
        >>> batched_rule(OpInfo(None, (a,), {}, (a,), (s, a)), [2], [1, 2])
        FactorRule(a b c -> a 1, a 1 1; need-replication=b,c)
    """
    if len(core) != len(info.operands) or len(core_out) != len(info.results):
        raise RuleError(
            f"{info.target}: {len(info.operands)} operands and {len(info.results)} results, "
            f"but core dims were given for {len(core)} and {len(core_out)}"
        )
    fresh = Names()
    batch = batch_shape(info.operands, core)
    if batch is None:  # no common batch: gather every operand
        core = [None] * len(core)
        batch = ()
    names = fresh.take(len(batch))
    operands: list[list[Dim] | None] = []
    need_rep: list[str] = []
    for m, c in zip(info.operands, core, strict=True):
        lead = None if c is None else _batch_dims(m.shape, c, batch, names)
        if lead is None:
            operands.append(None)
            continue
        own = fresh.take(m.ndim - len(lead))
        need_rep.extend(own)
        operands.append([*lead, *own])
    results: list[list[Dim] | None] = []
    for r, c in zip(info.results, core_out, strict=True):
        if r is None:
            results.append(None)
            continue
        lead = _batch_dims(r.shape, c, batch, names)
        if lead is None:
            lead = [None] * r.ndim
        results.append([*lead, *([None] * (r.ndim - len(lead)))])
    return build(info, operands, results, need_replication=need_rep, handler=handler)
