"""Op-table cases of the plane rules (``rules/conv.py``: adaptive, 3-d and fractional pools,
interpolations, grid sampling, forward and backward) and of ``_cdist_backward``.

Imported at the end of ``op_cases_more``; data only, like ``op_cases``. Batch and channel dims
(2, 3) and uneven spatial sizes (5, 6, 7) that the test may shard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from op_cases import f, case, unit  # isort: skip

aten = torch.ops.aten

L = {"tol": "loose"}

# --- plane pools and interpolations (grouped/transposed convolution: tests/test_gathered_rules.py)

X4, X5 = f(2, 3, 7, 6), f(2, 3, 5, 6, 7)


def _adaptive_max_backward(g: torch.Tensor, x: torch.Tensor) -> Any:
    _, idx = aten.adaptive_max_pool2d.default(x, [3, 2])
    return aten.adaptive_max_pool2d_backward.default(g, x, idx)


def _fractional(x: torch.Tensor, s: torch.Tensor, k: list[int], out: list[int]) -> Any:
    op = aten.fractional_max_pool2d if len(k) == 2 else aten.fractional_max_pool3d
    return op.default(x, k, out, s)


PLANE: list[tuple[Any, Callable[..., Any], tuple[Any, ...]]] = [
    (
        aten._adaptive_avg_pool2d.default,
        lambda x: aten._adaptive_avg_pool2d.default(x, [3, 2]),
        (X4,),
    ),
    (
        aten._adaptive_avg_pool2d_backward.default,
        lambda g, x: aten._adaptive_avg_pool2d_backward.default(g, x),
        (X4, X4),
    ),
    (
        aten._adaptive_avg_pool3d.default,
        lambda x: aten._adaptive_avg_pool3d.default(x, [2, 3, 2]),
        (X5,),
    ),
    (
        aten._upsample_bilinear2d_aa.default,
        lambda x: aten._upsample_bilinear2d_aa.default(x, [4, 3], False),
        (X4,),
    ),
    (
        aten.adaptive_max_pool2d.default,
        lambda x: aten.adaptive_max_pool2d.default(x, [3, 2]),
        (X4,),
    ),
    (aten.adaptive_max_pool2d_backward.default, _adaptive_max_backward, (f(2, 3, 3, 2), X4)),
    (
        aten.adaptive_max_pool3d.default,
        lambda x: aten.adaptive_max_pool3d.default(x, [2, 3, 2]),
        (X5,),
    ),
    (aten.avg_pool3d.default, lambda x: aten.avg_pool3d.default(x, [2, 2, 2], [2, 1, 2]), (X5,)),
    (
        aten.fractional_max_pool2d.default,
        lambda x, s: _fractional(x, s, [2, 2], [3, 4]),
        (X4, lambda g: torch.rand(2, 3, 2, generator=g)),
    ),
    (
        aten.fractional_max_pool3d.default,
        lambda x, s: _fractional(x, s, [2, 2, 2], [3, 4, 3]),
        (X5, lambda g: torch.rand(2, 3, 3, generator=g)),
    ),
    (
        aten.max_pool3d_with_indices.default,
        lambda x: aten.max_pool3d_with_indices.default(x, [2, 2, 2], [2, 2, 2]),
        (X5,),
    ),
    (
        aten.upsample_bicubic2d.default,
        lambda x: aten.upsample_bicubic2d.default(x, [9, 5], True),
        (X4,),
    ),
    (
        aten.upsample_bilinear2d.default,
        lambda x: aten.upsample_bilinear2d.default(x, [9, 5], False),
        (X4,),
    ),
    (
        aten.upsample_trilinear3d.default,
        lambda x: aten.upsample_trilinear3d.default(x, [6, 4, 5], False),
        (X5,),
    ),
    (
        aten.grid_sampler_2d.default,
        lambda x, grid: aten.grid_sampler_2d.default(x, grid, 0, 0, False),
        (X4, unit(2, 5, 6, 2)),
    ),
    (
        aten.grid_sampler_3d.default,
        lambda x, grid: aten.grid_sampler_3d.default(x, grid, 0, 0, False),
        (X5, unit(2, 5, 3, 6, 3)),
    ),
]
for _op, _fn, _mks in PLANE:
    case(_op, _fn, *_mks, **L)

# --- backwards of plane ops and distances ---------------------------------------------------------


def _grid_backward(g: torch.Tensor, x: torch.Tensor, grid: torch.Tensor) -> Any:
    return aten.grid_sampler_2d_backward.default(g, x, grid, 0, 0, False, [True, True])


def _grid3d_backward(g: torch.Tensor, x: torch.Tensor, grid: torch.Tensor) -> Any:
    return aten.grid_sampler_3d_backward.default(g, x, grid, 0, 0, True, [True, True])


def _max3d_backward(g: torch.Tensor, x: torch.Tensor) -> Any:
    _, idx = aten.max_pool3d_with_indices.default(x, [2, 2, 2], [2, 2, 2])
    return aten.max_pool3d_with_indices_backward.default(
        g, x, [2, 2, 2], [2, 2, 2], [0, 0, 0], [1, 1, 1], False, idx
    )


def _adaptive_max3d_backward(g: torch.Tensor, x: torch.Tensor) -> Any:
    _, idx = aten.adaptive_max_pool3d.default(x, [2, 3, 2])
    return aten.adaptive_max_pool3d_backward.default(g, x, idx)


def _cdist_backward(g: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> Any:
    d = aten._cdist_forward.default(a, b, 2.0, None)
    return aten._cdist_backward.default(g, a, b, 2.0, d)


G5 = f(2, 3, 2, 3, 2)
BACKWARDS: list[tuple[Any, Callable[..., Any], tuple[Any, ...]]] = [
    (
        aten._adaptive_avg_pool3d_backward.default,
        lambda g, x: aten._adaptive_avg_pool3d_backward.default(g, x),
        (X5, X5),
    ),
    (aten.adaptive_max_pool3d_backward.default, _adaptive_max3d_backward, (G5, X5)),
    (
        aten.avg_pool3d_backward.default,
        lambda g, x: aten.avg_pool3d_backward.default(
            g, x, [2, 2, 2], [2, 2, 3], [0, 0, 0], False, True, None
        ),
        (G5, X5),
    ),
    (aten.max_pool3d_with_indices_backward.default, _max3d_backward, (f(2, 3, 2, 3, 3), X5)),
    (aten.grid_sampler_2d_backward.default, _grid_backward, (f(2, 3, 5, 6), X4, unit(2, 5, 6, 2))),
    (
        aten.grid_sampler_3d_backward.default,
        _grid3d_backward,
        (f(2, 3, 5, 3, 6), X5, unit(2, 5, 3, 6, 3)),
    ),
    (aten._cdist_backward.default, _cdist_backward, (f(2, 6, 7), f(2, 6, 5), f(2, 7, 5))),
]
for _op, _fn, _mks in BACKWARDS:
    case(_op, _fn, *_mks, **L)

# --- interpolation backwards (batch and channels pass through: input_size is localised) -----------

#: op -> (output_size, input_size, extra args): grad [2, 3, *output_size] -> [2, 3, *input plane]
INTERPOLATION_BACKWARDS: dict[Any, tuple[list[int], list[int], tuple[Any, ...]]] = {
    aten._upsample_bicubic2d_aa_backward.default: ([4, 3], [7, 6], (False,)),
    aten._upsample_bilinear2d_aa_backward.default: ([4, 3], [7, 6], (False,)),
    aten._upsample_nearest_exact1d_backward.default: ([9], [5], ()),
    aten._upsample_nearest_exact2d_backward.default: ([9, 5], [7, 6], ()),
    aten._upsample_nearest_exact3d_backward.default: ([6, 4, 5], [5, 6, 7], ()),
    aten.upsample_bicubic2d_backward.default: ([9, 5], [7, 6], (True,)),
    aten.upsample_bilinear2d_backward.default: ([9, 5], [7, 6], (False,)),
    aten.upsample_linear1d_backward.default: ([9], [5], (False,)),
    aten.upsample_nearest1d_backward.default: ([9], [5], ()),
    aten.upsample_nearest2d_backward.default: ([9, 5], [7, 6], ()),
    aten.upsample_nearest3d_backward.default: ([6, 4, 5], [5, 6, 7], ()),
    aten.upsample_trilinear3d_backward.default: ([6, 4, 5], [5, 6, 7], (False,)),
}
for _op, (_out, _in, _extra) in INTERPOLATION_BACKWARDS.items():
    case(
        _op,
        lambda g, op=_op, o=_out, i=_in, e=_extra: op(g, o, [2, 3, *i], *e),
        f(2, 3, *_out),
        **L,
    )

# --- replication padding backwards: grad of the padded input, and the input ----------------------

for _op, _x, _pad in [
    (aten.replication_pad1d_backward.default, (3, 5), [1, 2]),
    (aten.replication_pad2d_backward.default, (2, 3, 7, 6), [1, 2, 2, 1]),
    (aten.replication_pad3d_backward.default, (2, 3, 5, 6, 7), [1, 0, 2, 1, 0, 2]),
]:
    _padded = [
        s + _pad[2 * (len(_x) - 1 - d)] + _pad[2 * (len(_x) - 1 - d) + 1]
        if d >= len(_x) - len(_pad) // 2
        else s
        for d, s in enumerate(_x)
    ]
    case(_op, lambda g, x, op=_op, p=_pad: op(g, x, p), f(*_padded), f(*_x), **L)
