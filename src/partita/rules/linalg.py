"""Rules of linear-algebra decompositions and solvers: svd, qr, eigh, eig, det, slogdet, inv,
cholesky, lu, solves, pinv, matrix_exp, householder products.

Decision: "gather, compute, keep replicated" (``batched.py``). A sharded matrix decomposition
would be a distributed algorithm of its own (ScaLAPACK); partita gathers the matrix dims
(need-replication, so the Plan records each gather with this op as its reason), computes the
op whole and keeps its matrix dims replicated. The leading batch dims pass through: every batch
element is decomposed on its own, so a batched ``inv`` or ``qr`` sharded on its batch dim needs
no communication. The exception are ops that raise on padding garbage (``RAISES_ON_PADDING``:
svd, eigh, eig, pinv, cholesky), which are gathered whole. Each rule lists, per operand and
per result, how many trailing dims are the matrix (2), vector (1) or scalar (0) core. Matrix
products are in ``matmul.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

from partita.rules.batched import batched_rule
from partita.rules.common import aten_ops
from partita.rules.factor import FactorRule, OpInfo, TensorMeta
from partita.rules.ruleset import RuleSet

RULES = RuleSet("linalg")

__all__ = ["LINALG_CORES", "RAISES_ON_PADDING", "linalg_rule"]

#: op name -> (core dims of each operand, core dims of each result).
LINALG_CORES: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "_linalg_det.default": ((2,), (0, 2, 1)),
    "_linalg_eigh.default": ((2,), (1, 2)),
    "_linalg_slogdet.default": ((2,), (0, 0, 2, 1)),
    "_linalg_svd.default": ((2,), (2, 1, 2)),
    "cholesky.default": ((2,), (2,)),
    "cholesky_inverse.default": ((2,), (2,)),
    "cholesky_solve.default": ((2, 2), (2,)),
    "geqrf.default": ((2,), (2, 1)),
    "linalg_cholesky_ex.default": ((2,), (2, 0)),
    "linalg_eig.default": ((2,), (1, 2)),
    "linalg_householder_product.default": ((2, 1), (2,)),
    "linalg_inv_ex.default": ((2,), (2, 0)),
    "linalg_ldl_factor_ex.default": ((2,), (2, 1, 0)),
    "linalg_ldl_solve.default": ((2, 1, 2), (2,)),
    "linalg_lu.default": ((2,), (2, 2, 2)),
    "linalg_lu_factor_ex.default": ((2,), (2, 1, 0)),
    "linalg_lu_solve.default": ((2, 1, 2), (2,)),
    "linalg_matrix_exp.default": ((2,), (2,)),
    "linalg_qr.default": ((2,), (2, 2)),
    "linalg_solve_triangular.default": ((2, 2), (2,)),
    "lu_unpack.default": ((2, 1), (2, 2, 2)),
    "ormqr.default": ((2, 1, 2), (2,)),
    "triangular_solve.default": ((2, 2), (2, 2)),
}


#: Ops that *raise* on the values a padded batch element may hold (NaN or inf after an
#: elementwise op, zeros): LAPACK's eigensolvers and SVD fail to converge, Cholesky needs a
#: positive-definite input. A sharded uneven batch dim would run them on that padding, so their
#: batch dims are gathered too until the partitioner can fill batch padding with a valid matrix.
RAISES_ON_PADDING = frozenset(
    {
        "_linalg_eigh.default",
        "_linalg_svd.default",
        "cholesky.default",
        "cholesky_inverse.default",
        "linalg_eig.default",
        "linalg_pinv.atol_rtol_tensor",
    }
)


@RULES.register(*aten_ops(sorted(LINALG_CORES)))
def linalg_rule(info: OpInfo) -> FactorRule:
    """``a b c -> a 1 1; need-replication=b,c`` for ``linalg_inv_ex`` on ``[n, m, m]``;
    ``* -> 1 1, 1 1 1`` (everything gathered) for the ops of :data:`RAISES_ON_PADDING`."""
    core, core_out = LINALG_CORES[_name(info)]
    return _batched(info, core, core_out)


def _batched(info: OpInfo, core: Sequence[int], core_out: Sequence[int]) -> FactorRule:
    if _name(info) in RAISES_ON_PADDING:
        return batched_rule(info, [None] * len(core), core_out)
    return batched_rule(info, core, core_out)


def _name(info: OpInfo) -> str:
    return str(info.target).removeprefix("aten.")


def _is_vector_rhs(a: TensorMeta, b: TensorMeta) -> bool:
    """torch.linalg.solve's rule: ``B`` is a batch of vectors when it is 1-d or when it has
    ``A``'s batch shape plus one dim."""
    return b.ndim == 1 or (b.ndim == a.ndim - 1 and tuple(b.shape) == tuple(a.shape[:-1]))


@RULES.register(*aten_ops(["_linalg_solve_ex.default"]))
def solve_rule(info: OpInfo) -> FactorRule:
    """``a b c, a b d -> a 1 1, a 1 1, a 1, a; need-replication=b,c,d`` for ``solve(A, B)``
    (result, LU, pivots, info); a vector right-hand side has one core dim."""
    a, b = info.operands
    k = 1 if _is_vector_rhs(a, b) else 2
    return batched_rule(info, [2, k], [k, 2, 1, 0])


@RULES.register(*aten_ops(["linalg_pinv.atol_rtol_tensor"]))
def pinv_rule(info: OpInfo) -> FactorRule:
    """``a b c, a -> a 1 1; need-replication=b,c`` for ``pinv(A, atol=t)`` (the tolerances are
    per batch element)."""
    return _batched(info, [2, *([0] * (len(info.operands) - 1))], [2])
