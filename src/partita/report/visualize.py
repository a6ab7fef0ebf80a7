"""Sharding tables: which devices hold which piece of a tensor, drawn with ``rich``.

* rank 0: one cell listing every device;
* rank 1: one row of tiles;
* rank 2: a grid of tiles (rows split by dim 0, columns by dim 1);
* rank >= 3: one table row per tile, with the index range of every dim.

Each tile lists *all* the devices that hold it (replicas, and the devices holding the partial
values of a partial sharding, which a note under the table labels), its unpadded index range,
and whether it is padding only. On a terminal the tiles are coloured; anywhere else (a file, a
pipe, a test, a log) the table is plain ASCII without colour codes.

This module only draws; the index arithmetic comes from :mod:`partita.values.layout`.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from partita.errors import ShardingError
from partita.values.layout import index_ranges, local_shape, tile_coords
from partita.values.spec import Sharding
from partita.values.tensor import ShardedTensor

__all__ = ["format_sharding", "visualize_sharding"]

_COLOURS = (
    "on dark_green",
    "on dark_blue",
    "on dark_red",
    "on dark_magenta",
    "on dark_cyan",
    "on orange4",
    "on purple4",
    "on grey30",
)
_DIM_NAMES = ("rows", "cols")


@dataclass(frozen=True, slots=True)
class _Tile:
    coords: tuple[int, ...]  # tile index along each dim
    number: int  # row-major tile number, for colours
    devices: tuple[int, ...]  # device ids, mesh position order
    ranges: tuple[tuple[int, int], ...]  # unpadded [start, stop) per dim
    padding_only: bool


def _tiles(sharding: Sharding, shape: tuple[int, ...]) -> dict[tuple[int, ...], _Tile]:
    coords = tile_coords(sharding)
    ranges = index_ranges(sharding, shape)
    members: dict[tuple[int, ...], list[int]] = {}
    for position, tile in enumerate(map(tuple, coords.tolist())):
        members.setdefault(tile, []).append(position)
    ids = sharding.mesh.device_ids
    tiles = {}
    for tile, positions in members.items():
        r = tuple((int(a), int(b)) for a, b in ranges[positions[0]])
        empty = any(a == b for a, b in r) and any(n > 0 for n in shape)
        number = int(np.ravel_multi_index(tile, sharding.tile_shape)) if tile else 0
        tiles[tile] = _Tile(tile, number, tuple(ids[p] for p in positions), r, empty)
    return tiles


def _resolve(
    x: ShardedTensor | Sharding, shape: Sequence[int] | None, where: str
) -> tuple[Sharding, tuple[int, ...]]:
    if isinstance(x, ShardedTensor):
        if shape is not None and tuple(shape) != tuple(x.shape):
            raise ShardingError(
                f"{where}: shape {tuple(shape)} was given for a ShardedTensor of shape "
                f"{tuple(x.shape)}. Leave shape out for a ShardedTensor."
            )
        return x.sharding, tuple(x.shape)
    if isinstance(x, Sharding):
        if shape is None:
            raise ShardingError(
                f"{where}: a Sharding needs the global shape too, e.g. {where}(sharding, (8, 4))."
            )
        shape = tuple(int(n) for n in shape)
        x.check_shape(shape)
        return x, shape
    held = getattr(x, "sharding", None) if isinstance(x, torch.Tensor) else None
    if isinstance(held, Sharding):  # a tensor of the virtual device: its layout there
        return _resolve(held, x.shape if shape is None else shape, where)
    raise ShardingError(
        f"{where} expects a ShardedTensor, a tensor of the virtual device, or a Sharding and a "
        f"global shape; got a {type(x).__name__}"
        + (f" on {x.device}, which has no sharding" if isinstance(x, torch.Tensor) else "")
        + ". Shard it first: x = partita.mark_sharding(x, mesh, spec) (or move it to the "
        "device, x.to(partita.use_spmd(mesh)), and mark it there)."
    )


def _title(sharding: Sharding, shape: tuple[int, ...]) -> str:
    spec = repr(sharding.spec) if sharding.ndim else "P()"
    return f"{spec} on {sharding.mesh!r}: global {shape}, local {local_shape(sharding, shape)}"


def _caption(sharding: Sharding) -> str | None:
    notes = []
    if sharding.partial:
        notes.append(
            f"partial[{sharding.reduce_op}] over {', '.join(sharding.partial)}: the devices of a "
            f"tile hold partial values; the value is their {sharding.reduce_op}"
        )
    if sharding.replicated_axes:
        notes.append(f"replicated over {', '.join(sharding.replicated_axes)}")
    return "; ".join(notes) or None


def _range_text(dim: int, ndim: int, start: int, stop: int) -> str:
    if ndim == 2:
        return f"{_DIM_NAMES[dim]} {start}:{stop}"
    return f"{start}:{stop}"


def _cell(tile: _Tile, ndim: int) -> str:
    lines = [" ".join(str(d) for d in tile.devices)]
    if ndim == 1:
        lines.append(f"[{tile.ranges[0][0]}:{tile.ranges[0][1]}]")
    elif ndim == 2:
        lines.extend(_range_text(d, 2, *tile.ranges[d]) for d in range(2))
    else:
        lines.append("scalar")
    if tile.padding_only:
        lines.append("(padding)")
    return "\n".join(lines)


def _style(tile: _Tile, plain: bool) -> str | None:
    if plain:
        return None
    if tile.padding_only:
        return "dim"
    return _COLOURS[tile.number % len(_COLOURS)]


def _table(sharding: Sharding, shape: tuple[int, ...], plain: bool) -> Table:
    tiles = _tiles(sharding, shape)
    ndim = sharding.ndim
    table = Table(
        box=box.ASCII if plain else box.SQUARE,
        show_lines=True,
        header_style="" if plain else "bold",
        border_style="" if plain else "none",
    )
    tile_shape = sharding.tile_shape
    if ndim <= 2:
        rows = tile_shape[0] if ndim == 2 else 1
        cols = tile_shape[-1] if ndim >= 1 else 1
        table.show_header = False
        for _ in range(cols):
            table.add_column(justify="center", vertical="top")
        for r in range(rows):
            cells = []
            for c in range(cols):
                tile = tiles[(r, c) if ndim == 2 else (c,) if ndim == 1 else ()]
                cells.append(Text(_cell(tile, ndim), style=_style(tile, plain) or ""))
            table.add_row(*cells)
        return table
    table.add_column("tile", justify="right")
    for d in range(ndim):
        table.add_column(f"dim {d}", justify="center")
    table.add_column("devices")
    table.add_column("note")
    for coords in sorted(tiles):
        tile = tiles[coords]
        style = _style(tile, plain)
        table.add_row(
            Text(str(coords)),
            *(Text(_range_text(d, ndim, *tile.ranges[d])) for d in range(ndim)),
            Text(" ".join(str(d) for d in tile.devices)),
            Text("padding only" if tile.padding_only else ""),
            style=style or "",
        )
    return table


def _render(sharding: Sharding, shape: tuple[int, ...], plain: bool) -> Group:
    """The title line, the table, and a note on partial and replicated mesh axes."""
    parts: list[Text | Table] = [Text(_title(sharding, shape), style="" if plain else "bold")]
    parts.append(_table(sharding, shape, plain))
    caption = _caption(sharding)
    if caption:
        parts.append(Text(caption, style="" if plain else "italic"))
    return Group(*parts)


def visualize_sharding(
    x: ShardedTensor | Sharding,
    shape: Sequence[int] | None = None,
    *,
    console: Console | None = None,
) -> None:
    """Print which devices hold which tile of ``x`` (a ShardedTensor, or a Sharding + shape).

    On a terminal the tiles are coloured; otherwise the table is plain ASCII.

    Example:
        >>> mesh = Mesh.create((2, 4), ("data", "model"))
        >>> visualize_sharding(P("model").to_sharding(mesh, 1), (10,))
        P('model') on Mesh(data=2, model=4): global (10,), local (3,)
        +--------------------------------+
        |  0 4  |  1 5  |  2 6  |  3 7   |
        | [0:3] | [3:6] | [6:9] | [9:10] |
        +--------------------------------+
        replicated over data
        >>> x = partita.mark_sharding(torch.zeros(8, 4), mesh, P("data", None))
        >>> visualize_sharding(x)  # its own sharding and shape  # doctest: +ELLIPSIS
        P('data', None) on Mesh(data=2, model=4): global (8, 4), local (4, 4)
        ...
    """
    sharding, shape = _resolve(x, shape, "visualize_sharding")
    console = console if console is not None else Console()
    plain = not console.is_terminal
    console.print(_render(sharding, shape, plain))


def format_sharding(
    x: ShardedTensor | Sharding, shape: Sequence[int] | None = None, *, width: int = 100
) -> str:
    """The plain-text table :func:`visualize_sharding` prints off a terminal, as a string.

    Example:
        >>> mesh = Mesh.create((4,), ("x",))
        >>> print(format_sharding(P("x").to_sharding(mesh, 1), (10,)))
        P('x') on Mesh(x=4): global (10,), local (3,)
        +--------------------------------+
        |   0   |   1   |   2   |   3    |
        | [0:3] | [3:6] | [6:9] | [9:10] |
        +--------------------------------+
        <BLANKLINE>
    """
    sharding, shape = _resolve(x, shape, "format_sharding")
    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=False, color_system=None)
    console.print(_render(sharding, shape, plain=True))
    return out.getvalue()
