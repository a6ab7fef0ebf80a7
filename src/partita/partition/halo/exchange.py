"""Emitting the halo exchange: ``collective_permute`` of edge rows to neighbours (recorded
in the Plan), extending and cutting each device's window, masking out-of-range rows, and the
transpose that sends a window gradient's halo rows back to their owners."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from partita.explain import op_name
from partita.partition.halo.geometry import Geo, HaloPlan, aten, partita_ops
from partita.partition.neighbours import emit_shift

if TYPE_CHECKING:
    from partita.partition.lower import Lowering


# --- emitting --------------------------------------------------------------------------------


def _pad_list(ndim: int, dim: int, lo: int, hi: int) -> list[int]:
    return [0, 0] * (ndim - 1 - dim) + [lo, hi]


def _permute(
    low: Lowering,
    node: fx.Node,
    x: fx.Node,
    axes: tuple[str, ...],
    shift: int,
    shape: list[int],
    dtype: torch.dtype,
    what: str,
) -> fx.Node:
    """Every group member ``i`` sends ``x`` to member ``i + shift`` (along ``axes``)."""
    reason = f"halo exchange: {what} for {op_name(node.target)} (%{node.name})"
    return emit_shift(low, node, x, axes, shift, shape, dtype, reason)


def _with(shape: list[int], dim: int, size: int) -> list[int]:
    out = list(shape)
    out[dim] = size
    return out


def _window_index(low: Lowering, like: fx.Node, axes: tuple[str, ...], h: HaloPlan) -> fx.Node:
    t = low.call(partita_ops.axis_index.default, like, list(axes))
    off = low.call(aten.add.Tensor, low.call(aten.mul.Tensor, t, h.step), h.base)
    ar = low.call(aten.arange.default, h.w, dtype=torch.int64)
    return low.call(aten.clamp.default, low.call(aten.add.Tensor, ar, off), 0, h.b2 - 1)


def window_start(low: Lowering, like: fx.Node, axes: tuple[str, ...], g: Geo, h: HaloPlan):
    """``L_t = t*c_out*stride - pad``: the global position of the window's first row."""
    t = low.call(partita_ops.axis_index.default, like, list(axes))
    return low.call(aten.sub.Tensor, low.call(aten.mul.Tensor, t, h.c_out * g.stride), g.pad)


def exchange_halos(
    low: Lowering,
    node: fx.Node,
    x: fx.Node,
    shape: list[int],
    dtype: torch.dtype,
    g: Geo,
    axes: tuple[str, ...],
    h: HaloPlan,
    fill: float,
) -> tuple[fx.Node, list[int]]:
    """The window of ``x`` on dim ``g.dim`` (halo exchange, extension, cut, mask)."""
    d, nd = g.dim, len(shape)
    parts = []
    if h.lh:
        edge = low.call(aten.slice.Tensor, x, d, h.c_in - h.lh, h.c_in)
        parts.append(
            _permute(
                low,
                node,
                edge,
                axes,
                1,
                _with(shape, d, h.lh),
                dtype,
                f"{h.lh} row(s) of dim {d} to the right neighbour",
            )
        )
    parts.append(x)
    if h.rh:
        edge = low.call(aten.slice.Tensor, x, d, 0, h.rh)
        parts.append(
            _permute(
                low,
                node,
                edge,
                axes,
                -1,
                _with(shape, d, h.rh),
                dtype,
                f"{h.rh} row(s) of dim {d} to the left neighbour",
            )
        )
    ext = low.call(aten.cat.default, parts, d) if len(parts) > 1 else x
    if h.el or h.er:
        ext = low.call(aten.constant_pad_nd.default, ext, _pad_list(nd, d, h.el, h.er), 0.0)
    if h.step == 0:
        if h.base != 0 or h.w != h.b2:
            ext = low.call(aten.slice.Tensor, ext, d, h.base, h.base + h.w)
        win = ext
    else:
        win = low.call(aten.index_select.default, ext, d, _window_index(low, x, axes, h))
    if g.n % h.k or fill != 0:
        start = window_start(low, x, axes, g, h)
        ar = low.call(aten.arange.default, h.w, dtype=torch.int64)
        pos = low.call(aten.add.Tensor, ar, start)
        valid = low.call(
            aten.logical_and.default,
            low.call(aten.ge.Scalar, pos, 0),
            low.call(aten.lt.Scalar, pos, g.n),
        )
        valid = low.call(aten.reshape.default, valid, [h.w] + [1] * (nd - d - 1))
        win = low.call(aten.where.ScalarOther, valid, win, fill)
    return win, _with(shape, d, h.w)


def return_halo(
    low: Lowering,
    node: fx.Node,
    gwin: fx.Node,
    shape: list[int],
    dtype: torch.dtype,
    g: Geo,
    axes: tuple[str, ...],
    h: HaloPlan,
) -> tuple[fx.Node, list[int]]:
    """The transpose of :func:`exchange_halos` for a gradient of the window: every device adds the
    halo rows' gradients to the neighbour that owns them."""
    d, nd = g.dim, len(shape)
    if h.step == 0:
        ext = low.call(
            aten.constant_pad_nd.default,
            gwin,
            _pad_list(nd, d, h.base, h.b2 - h.base - h.w),
            0.0,
        )
    else:
        zeros = low.call(aten.new_zeros.default, gwin, _with(shape, d, h.b2))
        ext = low.call(aten.index_add.default, zeros, d, _window_index(low, gwin, axes, h), gwin)
    own = low.call(aten.slice.Tensor, ext, d, h.el + h.lh, h.el + h.lh + h.c_in)
    if h.lh:
        part = low.call(aten.slice.Tensor, ext, d, h.el, h.el + h.lh)
        recv = _permute(
            low,
            node,
            part,
            axes,
            -1,
            _with(shape, d, h.lh),
            dtype,
            f"gradient of {h.lh} halo row(s) of dim {d} back to the left",
        )
        recv = low.call(aten.constant_pad_nd.default, recv, _pad_list(nd, d, h.c_in - h.lh, 0), 0.0)
        own = low.call(aten.add.Tensor, own, recv)
    if h.rh:
        s = h.el + h.lh + h.c_in
        part = low.call(aten.slice.Tensor, ext, d, s, s + h.rh)
        recv = _permute(
            low,
            node,
            part,
            axes,
            1,
            _with(shape, d, h.rh),
            dtype,
            f"gradient of {h.rh} halo row(s) of dim {d} back to the right",
        )
        recv = low.call(aten.constant_pad_nd.default, recv, _pad_list(nd, d, 0, h.c_in - h.rh), 0.0)
        own = low.call(aten.add.Tensor, own, recv)
    return own, _with(shape, d, h.c_in)
