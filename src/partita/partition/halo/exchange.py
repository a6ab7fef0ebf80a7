"""Emitting the halo exchange: ``collective_permute`` of edge rows to neighbours (recorded
in the Plan), extending and cutting each device's window, masking out-of-range rows, and the
transpose that sends a window gradient's halo rows back to their owners."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from partita.partition.emit import Proxy, node_of
from partita.partition.halo.geometry import Geo, HaloPlan
from partita.partition.neighbours import emit_shift
from partita.report.explain import op_name

if TYPE_CHECKING:
    from partita.partition.emit import Emitter


# --- emitting --------------------------------------------------------------------------------


def _pad_list(ndim: int, dim: int, lo: int, hi: int) -> list[int]:
    return [0, 0] * (ndim - 1 - dim) + [lo, hi]


def _permute(
    e: Emitter,
    x: Proxy,
    axes: tuple[str, ...],
    shift: int,
    shape: list[int],
    dtype: torch.dtype,
    what: str,
) -> Proxy:
    """Every group member ``i`` sends ``x`` to member ``i + shift`` (along ``axes``)."""
    reason = f"halo exchange: {what} for {op_name(e.node.target)} (%{e.node.name})"
    return e(emit_shift(e.low, e.node, node_of(x), axes, shift, shape, dtype, reason))


def _with(shape: list[int], dim: int, size: int) -> list[int]:
    out = list(shape)
    out[dim] = size
    return out


def _window_index(e: Emitter, like: Proxy, axes: tuple[str, ...], h: HaloPlan) -> Proxy:
    """The extended-buffer rows of this device's window: ``t*step + base + [0, w)``."""
    off = e.axis_index(like, axes) * h.step + h.base
    return (e.arange(h.w) + off).clamp(0, h.b2 - 1)


def window_start(e: Emitter, like: Proxy, axes: tuple[str, ...], g: Geo, h: HaloPlan) -> Proxy:
    """``L_t = t*c_out*stride - pad``: the global position of the window's first row."""
    return e.axis_index(like, axes) * (h.c_out * g.stride) - g.pad


def exchange_halos(
    e: Emitter,
    x: Proxy,
    shape: list[int],
    dtype: torch.dtype,
    g: Geo,
    axes: tuple[str, ...],
    h: HaloPlan,
    fill: float,
) -> tuple[Proxy, list[int]]:
    """The window of ``x`` on dim ``g.dim`` (halo exchange, extension, cut, mask)."""
    d, nd = g.dim, len(shape)
    parts = []
    if h.lh:
        what = f"{h.lh} row(s) of dim {d} to the right neighbour"
        edge = x.slice(d, h.c_in - h.lh, h.c_in)
        parts.append(_permute(e, edge, axes, 1, _with(shape, d, h.lh), dtype, what))
    parts.append(x)
    if h.rh:
        what = f"{h.rh} row(s) of dim {d} to the left neighbour"
        edge = x.slice(d, 0, h.rh)
        parts.append(_permute(e, edge, axes, -1, _with(shape, d, h.rh), dtype, what))
    ext: Proxy = torch.cat(parts, d) if len(parts) > 1 else x
    if h.el or h.er:
        ext = torch.constant_pad_nd(ext, _pad_list(nd, d, h.el, h.er), 0.0)
    if h.step == 0:  # every device's window starts at the same row: a static cut
        if h.base != 0 or h.w != h.b2:
            ext = ext.slice(d, h.base, h.base + h.w)
        win = ext
    else:
        win = ext.index_select(d, _window_index(e, x, axes, h))
    if g.n % h.k or fill != 0:  # rows outside [0, n) hold the op's padding value
        start = window_start(e, x, axes, g, h)
        pos = e.arange(h.w) + start
        valid = torch.logical_and(pos >= 0, pos < g.n)
        win = torch.where(valid.reshape([h.w] + [1] * (nd - d - 1)), win, fill)
    return win, _with(shape, d, h.w)


def return_halo(
    e: Emitter,
    gwin: Proxy,
    shape: list[int],
    dtype: torch.dtype,
    g: Geo,
    axes: tuple[str, ...],
    h: HaloPlan,
) -> tuple[Proxy, list[int]]:
    """The transpose of :func:`exchange_halos` for a gradient of the window: every device adds the
    halo rows' gradients to the neighbour that owns them."""
    d, nd = g.dim, len(shape)
    ext: Proxy
    if h.step == 0:
        ext = torch.constant_pad_nd(gwin, _pad_list(nd, d, h.base, h.b2 - h.base - h.w), 0.0)
    else:
        zeros = gwin.new_zeros(_with(shape, d, h.b2))
        ext = zeros.index_add(d, _window_index(e, gwin, axes, h), gwin)
    own = ext.slice(d, h.el + h.lh, h.el + h.lh + h.c_in)
    if h.lh:
        what = f"gradient of {h.lh} halo row(s) of dim {d} back to the left"
        part = ext.slice(d, h.el, h.el + h.lh)
        recv = _permute(e, part, axes, -1, _with(shape, d, h.lh), dtype, what)
        own = own + torch.constant_pad_nd(recv, _pad_list(nd, d, h.c_in - h.lh, 0), 0.0)
    if h.rh:
        what = f"gradient of {h.rh} halo row(s) of dim {d} back to the right"
        s = h.el + h.lh + h.c_in
        part = ext.slice(d, s, s + h.rh)
        recv = _permute(e, part, axes, 1, _with(shape, d, h.rh), dtype, what)
        own = own + torch.constant_pad_nd(recv, _pad_list(nd, d, 0, h.c_in - h.rh), 0.0)
    return own, _with(shape, d, h.c_in)
