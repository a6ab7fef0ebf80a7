"""Manual per-device code: ``shard_map`` regions and the collectives usable inside them.

``partita.shard_map(fn, mesh=, in_specs=, out_specs=, axes=)`` runs ``fn`` on each device's local
blocks; inside it ``psum``, ``pmean``, ``pmax``, ``all_gather``, ``psum_scatter``,
``all_to_all``, ``ppermute``, ``axis_index`` and ``axis_size`` work over named manual mesh axes,
each differentiable. See docs/manual.md.
"""

from __future__ import annotations

from partita.manual.collectives import (
    all_gather,
    all_to_all,
    axis_index,
    axis_size,
    pmax,
    pmean,
    ppermute,
    psum,
    psum_scatter,
)
from partita.manual.shard_map import shard_map

__all__ = [
    "all_gather",
    "all_to_all",
    "axis_index",
    "axis_size",
    "pmax",
    "pmean",
    "ppermute",
    "psum",
    "psum_scatter",
    "shard_map",
]
