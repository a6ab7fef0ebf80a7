"""Op-table cases of the linear-algebra and FFT rules (``rules/linalg.py``, ``rules/fft.py``).

Imported at the end of ``op_cases_more``. Inputs are well-conditioned matrices built inside
each function from random ones (a symmetric positive-definite ``a @ a.mT + n * I``), with a
batch dim of uneven size (5 or 6) that the test may shard. Data only, like ``op_cases``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from op_cases import case, f, unit  # isort: skip

aten = torch.ops.aten

L = {"tol": "loose"}

# --- linear algebra (well-conditioned inputs built inside fn from random ones) -----------------


def _spd(a: torch.Tensor) -> torch.Tensor:
    """A symmetric positive-definite batch from any square batch."""
    n = a.shape[-1]
    return a @ a.mT + n * torch.eye(n)


def _lu(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return aten.linalg_lu_factor_ex.default(_spd(a))


def _linalg_cases() -> list[tuple[Any, Callable[..., Any], tuple[Any, ...]]]:
    sq, b = f(6, 3, 3), f(6, 3, 2)
    return [
        (aten._linalg_det.default, lambda a: aten._linalg_det.default(_spd(a))[0], (sq,)),
        (aten._linalg_eigh.default, lambda a: aten._linalg_eigh.default(_spd(a))[0], (sq,)),
        (aten._linalg_slogdet.default, lambda a: aten._linalg_slogdet.default(a)[:2], (sq,)),
        (
            aten._linalg_svd.default,
            lambda a: aten._linalg_svd.default(a, False, False)[1],
            (f(5, 4, 3),),
        ),
        (aten.cholesky.default, lambda a: aten.cholesky.default(_spd(a)), (sq,)),
        (aten.cholesky_inverse.default, lambda a: aten.cholesky_inverse.default(_spd(a)), (sq,)),
        (
            aten.cholesky_solve.default,
            lambda a, y: aten.cholesky_solve.default(y, aten.cholesky.default(_spd(a))),
            (sq, b),
        ),
        (aten.geqrf.default, lambda a: aten.geqrf.default(a)[0].abs(), (f(5, 4, 3),)),
        (
            aten.linalg_cholesky_ex.default,
            lambda a: aten.linalg_cholesky_ex.default(_spd(a)),
            (sq,),
        ),
        (
            aten.linalg_eig.default,
            lambda a: aten.linalg_eig.default(_spd(a))[0].real.sort(-1)[0],
            (sq,),
        ),
        (
            aten.linalg_householder_product.default,
            lambda a, t: aten.linalg_householder_product.default(a, t),
            (f(5, 4, 3), unit(5, 2)),
        ),
        (aten.linalg_inv_ex.default, lambda a: aten.linalg_inv_ex.default(_spd(a)), (sq,)),
        (
            aten.linalg_ldl_factor_ex.default,
            lambda a: aten.linalg_ldl_factor_ex.default(_spd(a))[0],
            (sq,),
        ),
        (
            aten.linalg_ldl_solve.default,
            lambda a, y: aten.linalg_ldl_solve.default(
                *aten.linalg_ldl_factor_ex.default(_spd(a))[:2], y
            ),
            (sq, b),
        ),
        (aten.linalg_lu.default, lambda a: aten.linalg_lu.default(_spd(a)), (sq,)),
        (aten.linalg_lu_factor_ex.default, _lu, (sq,)),
        (
            aten.linalg_lu_solve.default,
            lambda a, y: aten.linalg_lu_solve.default(*_lu(a)[:2], y),
            (sq, b),
        ),
        (aten.linalg_matrix_exp.default, lambda a: aten.linalg_matrix_exp.default(a * 0.3), (sq,)),
        (aten.linalg_qr.default, lambda a: aten.linalg_qr.default(a)[1].abs(), (f(5, 4, 3),)),
        (
            aten.linalg_solve_triangular.default,
            lambda a, y: aten.linalg_solve_triangular.default(
                aten.cholesky.default(_spd(a)), y, upper=False
            ),
            (sq, b),
        ),
        (
            aten.lu_unpack.default,
            lambda a: aten.lu_unpack.default(*_lu(a)[:2]),
            (sq,),
        ),
        (
            aten.ormqr.default,
            lambda a, y: aten.ormqr.default(*aten.geqrf.default(a), y),
            (f(6, 3, 3), b),
        ),
        (
            aten.triangular_solve.default,
            lambda a, y: aten.triangular_solve.default(y, aten.cholesky.default(_spd(a)), False),
            (sq, b),
        ),
        (
            aten._linalg_solve_ex.default,
            lambda a, y: aten._linalg_solve_ex.default(_spd(a), y)[0],
            (sq, f(6, 3)),
        ),
        (
            aten.linalg_pinv.atol_rtol_tensor,
            lambda a, t: aten.linalg_pinv.atol_rtol_tensor(a, atol=t, hermitian=False),
            (f(5, 4, 3), lambda g: torch.full((5,), 1e-3)),
        ),
    ]


for _op, _fn, _mks in _linalg_cases():
    case(_op, _fn, *_mks, **L)

# --- FFT ------------------------------------------------------------------------------------------

case(aten._fft_r2c.default, lambda x: aten._fft_r2c.default(x, [1], 0, True), f(6, 7), **L)
case(
    aten._fft_c2c.default,
    lambda x: aten._fft_c2c.default(aten._fft_r2c.default(x, [2], 0, False), [0, 2], 1, True),
    f(6, 5, 7),
    **L,
)
case(
    aten._fft_c2r.default,
    lambda x: aten._fft_c2r.default(aten._fft_r2c.default(x, [0], 2, True), [0], 2, 7),
    f(7, 5),
    **L,
)
