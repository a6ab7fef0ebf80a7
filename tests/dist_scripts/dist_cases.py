"""Small programs run both on the LocalMesh (in pytest) and on 4 Gloo processes (ops.py).

Each case is ``name -> (mesh, fn, args, in_specs, out_specs, expected collective kinds)``;
the inputs come from a seeded generator, so every process builds the same global values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from partita import Mesh, P

MESH_2X2 = Mesh.create((2, 2), ("data", "model"))
MESH_4 = Mesh.create((4,), ("data",))

Case = tuple[Mesh, Callable[..., Any], tuple[Any, ...], Any, Any, set[str]]


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def cases() -> dict[str, Case]:
    x = _rand(8, 16, seed=1)
    w = _rand(16, 12, seed=2)
    y = _rand(8, 16, seed=3)
    signal = _rand(2, 4, 32, seed=4)
    kernel = _rand(4, 4, 3, seed=5)
    return {
        "elementwise": (
            MESH_2X2, lambda a, b: torch.sin(a) * 2 + b, (x, y),
            (P("data", "model"), P("data", "model")), None, set(),
        ),
        "mm_all_reduce": (
            MESH_2X2, lambda a, b: a @ b, (x, w),
            (P(None, "model"), P("model", None)), P(), {"all_reduce"},
        ),
        "mm_reduce_scatter": (
            MESH_2X2, lambda a, b: a @ b, (x, w),
            (P(None, "model"), P("model", None)), P("model", None), {"reduce_scatter"},
        ),
        # a sum over a split dim kept split: a reduce_scatter, over a group in torch's order
        # and over one listed minor-first (members 0, 2, 1, 3; torch's order 0, 1, 2, 3)
        "sum_reduce_scatter": (
            MESH_4, lambda a: a.sum(0), (_rand(8, 16, seed=7),),
            (P("data", None),), P("data"), {"reduce_scatter"},
        ),
        "sum_reduce_scatter_minor_first": (
            MESH_2X2, lambda a: a.sum(0), (_rand(8, 16, seed=8),),
            (P(("model", "data"), None),), P(("model", "data")), {"reduce_scatter"},
        ),
        "all_gather": (
            MESH_4, lambda a: a * 2, (x,), (P("data", None),), P(), {"all_gather"},
        ),
        "all_to_all": (
            MESH_4, lambda a: a * 3, (x,), (P("data", None),), P(None, "data"), {"all_to_all"},
        ),
        "conv_halo": (
            MESH_4, lambda s, k: F.conv1d(s, k, padding=1), (signal, kernel),
            (P(None, None, "data"), P()), None, {"collective_permute"},
        ),
        "uneven_sum": (
            MESH_2X2, lambda a: a.sum(0), (_rand(10, 6, seed=6),),
            (P(("data", "model"), None),), P(), {"all_reduce"},
        ),
        "slice_replicated": (
            MESH_2X2, lambda a: a + 1, (x,), (P(),), P("model", "data"), set(),
        ),
    }  # fmt: skip
