"""Op-table cases of advanced indexing, scatters and scans (``partita.rules.indexing``,
``partita.rules.scan``): one sample call per op, uneven sizes (5, 6, 7) included.

Imported at the end of ``op_cases`` (it registers into the same ``CASES``). Scatters without
accumulation get indices that are unique along the scattered dim, so that the unsharded result
is deterministic.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from op_cases import case, f, ints, pos, small_ints_f  # isort: skip

aten = torch.ops.aten


def unique_rows(n: int, k: int, cols: int) -> Callable[[torch.Generator], torch.Tensor]:
    """A [k, cols] index into a dim of size ``n``: each column holds k distinct rows."""
    return lambda g: torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(cols)], 1)


def unique_cols(n: int, rows: int, k: int) -> Callable[[torch.Generator], torch.Tensor]:
    """A [rows, k] index into a dim of size ``n``: each row holds k distinct columns."""
    return lambda g: unique_rows(n, k, rows)(g).t().contiguous()


# x[i, :, j] with i [4, 1] and j [3]: broadcast to [4, 3], separated by a slice (so the
# broadcast dims come first: result [4, 3, 5]).
case(
    aten.index.Tensor,
    lambda x, i, j: aten.index.Tensor(x, [i, None, j]),
    f(6, 5, 7),
    ints(6, 4, 1),
    ints(7, 3),
    partial=True,
)
case(
    aten.index_put.default,
    lambda x, i, v: aten.index_put.default(x, [None, i], v, True),
    f(6, 5, 4),
    ints(5, 3),
    f(6, 3, 4),
)
case(
    aten.scatter.src,
    lambda x, i, s: aten.scatter.src(x, 0, i, s),
    f(6, 5),
    unique_rows(6, 4, 5),
    f(4, 5),
)
case(
    aten.scatter.value,
    lambda x, i: aten.scatter.value(x, 1, i, 2.5),
    f(6, 5),
    unique_cols(5, 6, 3),
)
case(
    aten.scatter_add.default,
    lambda x, i, s: aten.scatter_add.default(x, 0, i, s),
    f(7, 5),
    ints(7, 4, 5),
    f(4, 5),
    tol="reduction",
)
case(
    aten.scatter_reduce.two,
    lambda x, i, s: aten.scatter_reduce.two(x, 1, i, s, "amax", include_self=False),
    f(6, 5),
    ints(5, 6, 7),
    f(6, 7),
)
case(
    aten.slice_scatter.default,
    lambda x, s: aten.slice_scatter.default(x, s, 1, 1, 3),
    f(6, 5),
    f(6, 2),
)
case(aten.flip.default, lambda x: aten.flip.default(x, [0, 2]), f(6, 5, 3), partial=True)
case(aten.histc.default, lambda x: aten.histc.default(x, 7, -2.0, 2.0), f(6, 5))
case(aten.unfold.default, lambda x: aten.unfold.default(x, 1, 3, 2), f(6, 7), partial=True)
case(aten.cummax.default, lambda x: aten.cummax.default(x, 1), small_ints_f(6, 5))
case(aten.cummin.default, lambda x: aten.cummin.default(x, 0), pos(7, 5))
