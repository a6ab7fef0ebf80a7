"""The ``halo`` handler: windowed dims (convolution, pooling, constant_pad_nd) sharded along
mesh axes lower to a halo exchange with neighbours (docs/halo.md).

For one windowed dim of global input size ``n`` and output size ``m`` split into ``k`` tiles
(ceil padding: input tiles of ``c_in = ceil(n/k)``, output tiles of ``c_out = ceil(m/k)``,
aligned to the global output), device ``t`` computes outputs ``[t*c_out, (t+1)*c_out)``, whose
input window starts at ``L_t = t*c_out*s - p`` and is ``W = (c_out-1)*s + (K-1)*d + 1`` long.
Each device

1. sends its last ``Lh`` rows to its right neighbour and its first ``Rh`` rows to its left one
   (``partita::collective_permute`` over the dim's mesh axes; edge devices receive zeros), where
   ``Lh``/``Rh`` are the most *real* rows any device with real outputs needs from a neighbour;
2. concatenates ``[left halo, local tile, right halo]`` (zero-extended where a window reaches
   past it: only padding lives there) and cuts its window (a static slice when every device's
   window starts at the same place, else ``index_select`` at an ``axis_index``-based offset);
3. sets every window position outside ``[0, n)`` to the op's padding value (0, ``-inf`` for
   max pooling, the pad value for constant_pad_nd) with ``where`` - skipped when the split is
   even and the value is 0, since then those rows are already the permute's zeros;
4. runs the op with the dim's padding set to 0; the local output is exactly ``c_out`` long.

When a halo would be larger than a neighbour's tile, that dim falls back to gathering: the
operands are resharded unsplit on it, the op runs with its own padding and each result is cut
with ``shard_slice`` (made partial again where the result sums over the dim).

Backward ops (convolution_backward, max_pool2d_with_indices_backward, avg_pool2d_backward) run
on the same windows and send the halo part of the local input gradient back to its owner,
which adds it (the transpose of the exchange). ``max_pool2d_with_indices``' indices are
converted to global flat positions (so they equal the unsharded op's) and back to window
positions in the backward. avg_pool sums locally (``divisor_override=1``) and divides by the
global divisor of each output, computed from its global position. A convolution's bias is
added on one member of each group when the input channels are sharded (the result is partial).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from partita.explain import op_name
from partita.layout import local_shape
from partita.partition.handlers import Handler, register
from partita.partition.masks import emit_mask_padding
from partita.partition.plan import CollectiveRecord
from partita.rules import FactorKind, FactorRule
from partita.spec import Sharding

if TYPE_CHECKING:
    from partita.partition.lower import Lowering

__all__ = ["HaloPlan", "halo_plan"]

aten = torch.ops.aten
partita_ops = torch.ops.partita
Assign = dict[str, tuple[str, ...]]

_CONV = aten.convolution.default
_CONV_BWD = aten.convolution_backward.default
_MAXPOOL = aten.max_pool2d_with_indices.default
_MAXPOOL_BWD = aten.max_pool2d_with_indices_backward.default
_AVGPOOL = aten.avg_pool2d.default
_AVGPOOL_BWD = aten.avg_pool2d_backward.default
_PAD = aten.constant_pad_nd.default
_BACKWARD = (_CONV_BWD, _MAXPOOL_BWD, _AVGPOOL_BWD)


def _pack(*xs: Any) -> tuple[Any, ...]:
    """A tuple-valued node for multi-result ops whose results are built separately."""
    return tuple(xs)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# --- geometry --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Geo:
    """One windowed dim of an op: input dim ``dim`` of global size ``n`` -> output size ``m``;
    output ``o`` reads inputs ``o*stride - pad + j*dil`` for ``j < kernel``."""

    dim: int
    n: int
    m: int
    kernel: int
    stride: int
    pad: int
    dil: int


@dataclass(frozen=True)
class HaloPlan:
    """The halo exchange of one windowed dim split into ``k`` tiles (see the module doc).

    Device ``t``'s window starts at index ``t*step + base`` of its extended buffer
    ``[EL zeros, Lh rows of t-1, c_in own rows, Rh rows of t+1, ER zeros]`` (length ``b2``).
    """

    k: int
    c_in: int
    c_out: int
    w: int
    lh: int
    rh: int
    el: int
    er: int
    step: int
    base: int

    @property
    def b(self) -> int:
        return self.lh + self.c_in + self.rh

    @property
    def b2(self) -> int:
        return self.el + self.b + self.er


def halo_plan(g: Geo, k: int) -> HaloPlan | None:
    """The exchange for ``g`` split into ``k`` tiles, or None when a halo exceeds a tile."""
    c_in, c_out = _ceil_div(g.n, k), _ceil_div(g.m, k)
    w = (c_out - 1) * g.stride + (g.kernel - 1) * g.dil + 1
    reach = (g.kernel - 1) * g.dil
    lh = rh = 0
    real = [t for t in range(k) if t * c_out < g.m]
    for t in real:
        first = t * c_out * g.stride - g.pad
        last = (min((t + 1) * c_out, g.m) - 1) * g.stride - g.pad + reach
        a, b = max(first, 0), min(last + 1, g.n)
        if a < b:  # real rows needed: those outside the own tile come from neighbours
            lh = max(lh, t * c_in - a)
            rh = max(rh, b - (t + 1) * c_in)
    if lh > c_in or rh > c_in:
        return None
    starts = [t * c_out * g.stride - g.pad - (t * c_in - lh) for t in real]
    el = max(0, -min(starts))
    er = max(0, max(starts) + w - (lh + c_in + rh))
    return HaloPlan(k, c_in, c_out, w, lh, rh, el, er, c_out * g.stride - c_in, lh - g.pad + el)


# --- reading the op --------------------------------------------------------------------------


def _arg(node: fx.Node, i: int, name: str, default: Any = None) -> Any:
    if i < len(node.args):
        return node.args[i]
    return node.kwargs.get(name, default)


def _ints(v: Any, k: int, default: list[int] | None = None) -> list[int]:
    if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):
        assert default is not None
        return list(default)
    if isinstance(v, int):
        return [v] * k
    v = [int(a) for a in v]
    return v * k if len(v) == 1 else v


def _shape(node: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in node.meta["val"].shape)


@dataclass
class _Op:
    x_index: int  # the operand whose windowed dims are exchanged (input / self)
    x_shape: tuple[int, ...]
    geos: dict[int, Geo]  # by input dim
    fill: float


def _read(node: fx.Node) -> _Op:
    t = node.target
    if t in (_CONV, _CONV_BWD):
        xi = 1 if t is _CONV_BWD else 0
        off = 1 if t is _CONV_BWD else 0
        x, w = _shape(node.args[xi]), _shape(node.args[xi + 1])
        out = _shape(node.args[0]) if t is _CONV_BWD else _shape_of_result(node)
        k = len(x) - 2
        stride = _ints(_arg(node, 3 + off, "stride"), k)
        pad = _ints(_arg(node, 4 + off, "padding"), k)
        dil = _ints(_arg(node, 5 + off, "dilation"), k)
        geos = {
            2 + i: Geo(2 + i, x[2 + i], out[2 + i], w[2 + i], stride[i], pad[i], dil[i])
            for i in range(k)
        }
        return _Op(xi, x, geos, 0.0)
    if t in (_MAXPOOL, _MAXPOOL_BWD, _AVGPOOL, _AVGPOOL_BWD):
        bwd = t in (_MAXPOOL_BWD, _AVGPOOL_BWD)
        xi = 1 if bwd else 0
        x = _shape(node.args[xi])
        out = _shape(node.args[0]) if bwd else _shape_of_result(node)
        ks = _ints(_arg(node, 1 + xi, "kernel_size"), 2)
        stride = _ints(_arg(node, 2 + xi, "stride"), 2, ks)
        pad = _ints(_arg(node, 3 + xi, "padding", 0), 2)
        dil = (
            _ints(_arg(node, 4 + xi, "dilation", 1), 2) if t in (_MAXPOOL, _MAXPOOL_BWD) else [1, 1]
        )
        d0 = len(x) - 2
        geos = {
            d0 + i: Geo(d0 + i, x[d0 + i], out[d0 + i], ks[i], stride[i], pad[i], dil[i])
            for i in range(2)
        }
        fill = float("-inf") if t is _MAXPOOL else 0.0
        return _Op(xi, x, geos, fill)
    if t is _PAD:
        x = _shape(node.args[0])
        pads = list(_arg(node, 1, "pad"))
        value = _arg(node, 2, "value", 0)
        geos = {}
        for i in range(0, len(pads), 2):
            d = len(x) - 1 - i // 2
            lo, hi = int(pads[i]), int(pads[i + 1])
            geos[d] = Geo(d, x[d], x[d] + lo + hi, 1, 1, lo, 1)
        return _Op(0, x, geos, float(value if value is not None else 0))
    raise NotImplementedError(f"halo handler: unknown op {t}")


def _shape_of_result(node: fx.Node) -> tuple[int, ...]:
    val = node.meta["val"]
    if isinstance(val, (tuple, list)):
        val = val[0]
    return tuple(int(s) for s in val.shape)


def _windowed(rule: FactorRule, op: _Op, assign: Assign) -> dict[int, tuple[str, str, ...]]:
    """Sharded windowed dims of the exchanged operand: ``{dim: (factor, *mesh axes)}``."""
    out: dict[int, Any] = {}
    factors = rule.operands[op.x_index] or ()
    for d, dim in enumerate(factors):
        for f in dim:
            if rule.kind(f) is FactorKind.WINDOWED and assign.get(f) and d in op.geos:
                out[d] = (f, *assign[f])
    return out


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
    groups = low.mesh.groups(axes)
    pairs: list[int] = []
    for g in groups:
        for i in range(len(g)):
            if 0 <= i + shift < len(g):
                pairs += [int(g[i]), int(g[i + shift])]
    out = low.call(partita_ops.collective_permute.default, x, pairs, list(axes))
    low.plan.collectives.append(
        CollectiveRecord(
            kind="collective_permute",
            mesh_axes=tuple(axes),
            groups=tuple(tuple(int(d) for d in g) for g in groups),
            shape=tuple(shape),
            dtype=dtype,
            value=node.name,
            reason=f"halo exchange: {what} for {op_name(node.target)} (%{node.name})",
            source=node.meta.get("source"),
            detail=f"shift {shift:+d}",
        )
    )
    return out


def _with(shape: list[int], dim: int, size: int) -> list[int]:
    out = list(shape)
    out[dim] = size
    return out


def _window_index(low: Lowering, like: fx.Node, axes: tuple[str, ...], h: HaloPlan) -> fx.Node:
    t = low.call(partita_ops.axis_index.default, like, list(axes))
    off = low.call(aten.add.Tensor, low.call(aten.mul.Tensor, t, h.step), h.base)
    ar = low.call(aten.arange.default, h.w, dtype=torch.int64)
    return low.call(aten.clamp.default, low.call(aten.add.Tensor, ar, off), 0, h.b2 - 1)


def _window_start(low: Lowering, like: fx.Node, axes: tuple[str, ...], g: Geo, h: HaloPlan):
    """``L_t = t*c_out*stride - pad``: the global position of the window's first row."""
    t = low.call(partita_ops.axis_index.default, like, list(axes))
    return low.call(aten.sub.Tensor, low.call(aten.mul.Tensor, t, h.c_out * g.stride), g.pad)


def _exchange(
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
        start = _window_start(low, x, axes, g, h)
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


def _return_halo(
    low: Lowering,
    node: fx.Node,
    gwin: fx.Node,
    shape: list[int],
    dtype: torch.dtype,
    g: Geo,
    axes: tuple[str, ...],
    h: HaloPlan,
) -> tuple[fx.Node, list[int]]:
    """The transpose of :func:`_exchange` for a gradient of the window: every device adds the
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


# --- the handler -----------------------------------------------------------------------------


def _cin_axes(node: fx.Node, rule: FactorRule, assign: Assign) -> tuple[str, ...]:
    return tuple(a for f in rule.reduction_factors for a in assign.get(f, ()))


def _applies(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> bool:
    op = _read(node)
    if _windowed(rule, op, assign):
        return True
    has_bias = node.target is _CONV and _arg(node, 2, "bias") is not None
    return has_bias and bool(_cin_axes(node, rule, assign))


def _lower(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> fx.Node:
    op = _read(node)
    sharded = _windowed(rule, op, assign)
    halos: dict[int, tuple[Geo, tuple[str, ...], HaloPlan]] = {}
    gathered: dict[str, tuple[str, ...]] = {}  # windowed factor -> its mesh axes
    for d, (f, *axes) in sorted(sharded.items()):
        g = op.geos[d]
        h = halo_plan(g, low.mesh.axes_size(axes))
        if h is None:
            gathered[f] = tuple(axes)
        else:
            halos[d] = (g, tuple(axes), h)
    assign2 = {f: a for f, a in assign.items() if f not in gathered}
    operands = low.localize_operands(node, rule, assign2)
    in_shardings = [
        Sharding(low.mesh, low.dims_of(fs, assign2)) if fs is not None else None
        for fs in rule.operands
    ]
    x_val = node.args[op.x_index].meta["val"]
    x_shape = list(local_shape(in_shardings[op.x_index], op.x_shape))
    dtype = x_val.dtype
    x = operands[op.x_index]

    def window(x: fx.Node, fill: float) -> tuple[fx.Node, list[int], list[int]]:
        shape = list(x_shape)
        for _, (g, axes, h) in sorted(halos.items()):
            x, shape = _exchange(low, node, x, shape, dtype, g, axes, h, fill)
        return x, shape, [0 if d in halos else op.geos[d].pad for d in sorted(op.geos)]

    def unwindow(gx: fx.Node, shape: list[int]) -> fx.Node:
        for _, (g, axes, h) in sorted(halos.items(), reverse=True):
            gx, shape = _return_halo(low, node, gx, shape, dtype, g, axes, h)
        return gx

    t = node.target
    args = list(node.args)
    rest_kwargs = dict(node.kwargs)
    if t is _PAD:
        win, _, _ = window(x, op.fill)
        pads = list(_arg(node, 1, "pad"))
        for d in halos:
            i = 2 * (len(op.x_shape) - 1 - d)
            pads[i] = pads[i + 1] = 0
        out = win
        if any(pads):
            out = low.call(_PAD, win, pads, *args[2:], **rest_kwargs)
        elif out is x:
            out = low.call(aten.clone.default, x)
    elif t is _CONV:
        xw, _, pad = window(x, op.fill)
        w = operands[1]
        bias = operands[2] if len(operands) > 2 else None
        cin = _cin_axes(node, rule, assign2)
        if bias is not None and cin:
            first = low.call(
                aten.eq.Scalar, low.call(partita_ops.axis_index.default, bias, list(cin)), 0
            )
            bias = low.call(aten.where.ScalarOther, first, bias, 0.0)
        out = low.call(
            t,
            xw,
            w,
            bias,
            _arg(node, 3, "stride"),
            pad,
            _arg(node, 5, "dilation"),
            _arg(node, 6, "transposed"),
            _arg(node, 7, "output_padding"),
            _arg(node, 8, "groups"),
        )
    elif t in (_MAXPOOL, _AVGPOOL):
        xw, wshape, pad = window(x, op.fill)
        if t is _MAXPOOL:
            ks, stride, dil, ceil = _pool_args(node)
            res = low.call(t, xw, ks, stride, pad, dil, ceil)
            vals = low.call(operator.getitem, res, 0)
            idx = low.call(operator.getitem, res, 1)
            idx = _indices_to_global(low, op, idx, wshape, halos, x)
            out = low.call(_pack, vals, idx)
        else:
            out = _avg_pool(low, node, op, xw, pad, halos, x)
    elif t is _CONV_BWD:
        gout, _, w = operands
        mask = list(_arg(node, 10, "output_mask"))
        if mask[1]:
            xw, wshape, pad = window(x, op.fill)
        else:
            wshape = _window_shape(x_shape, halos)
            xw = low.call(aten.new_zeros.default, x, wshape)
            pad = [0 if d in halos else op.geos[d].pad for d in sorted(op.geos)]
        res = low.call(
            t,
            gout,
            xw,
            w,
            _arg(node, 3, "bias_sizes"),
            _arg(node, 4, "stride"),
            pad,
            _arg(node, 6, "dilation"),
            _arg(node, 7, "transposed"),
            _arg(node, 8, "output_padding"),
            _arg(node, 9, "groups"),
            mask,
        )
        gx = low.call(operator.getitem, res, 0) if mask[0] else None
        if gx is not None:
            gx = unwindow(gx, wshape)
        gw = low.call(operator.getitem, res, 1) if mask[1] else None
        gb = low.call(operator.getitem, res, 2) if mask[2] else None
        out = low.call(_pack, gx, gw, gb)
    elif t in (_MAXPOOL_BWD, _AVGPOOL_BWD):
        gout = operands[0]
        for d, (g, axes, _) in halos.items():
            gout = emit_mask_padding(low.graph, gout, low.mesh, axes, g.m, len(op.x_shape), d, 0)
        wshape = _window_shape(x_shape, halos)
        xw = low.call(aten.new_zeros.default, x, wshape)
        pad = [0 if d in halos else op.geos[d].pad for d in sorted(op.geos)]
        ks, stride, dil, ceil = _pool_args(node)
        if t is _MAXPOOL_BWD:
            idx = _indices_to_local(low, op, operands[2], wshape, halos, x)
            gx = low.call(t, gout, xw, ks, stride, pad, dil, ceil, idx)
        else:
            include = bool(_arg(node, 6, "count_include_pad", True))
            over = _arg(node, 7, "divisor_override")
            if over is None:
                gout = low.call(aten.div.Tensor, gout, _avg_divisor(low, node, op, halos, x))
                over = 1
            gx = low.call(t, gout, xw, ks, stride, pad, ceil, include, over)
        out = unwindow(gx, wshape)
    else:  # pragma: no cover - _read raised already
        raise NotImplementedError(str(t))
    return _finish_gathered(low, node, rule, assign, gathered, out)


def _pool_args(node: fx.Node) -> tuple[list[int], list[int], list[int], bool]:
    """(kernel_size, stride, dilation, ceil_mode) of a pooling op or its backward."""
    t = node.target
    xi = 1 if t in _BACKWARD else 0
    ks = _ints(_arg(node, 1 + xi, "kernel_size"), 2)
    stride = _ints(_arg(node, 2 + xi, "stride"), 2, ks)
    if t in (_MAXPOOL, _MAXPOOL_BWD):
        dil = _ints(_arg(node, 4 + xi, "dilation", 1), 2)
        ceil = bool(_arg(node, 5 + xi, "ceil_mode", False))
    else:
        dil = [1, 1]
        ceil = bool(_arg(node, 4 + xi, "ceil_mode", False))
    return ks, stride, dil, ceil


def _window_shape(shape: list[int], halos: dict[int, Any]) -> list[int]:
    out = list(shape)
    for d, (_, _, h) in halos.items():
        out[d] = h.w
    return out


def _spatial_offsets(low, op, halos, like):
    """Per spatial dim (last two): the window's first global row (a node, or 0)."""
    offs = []
    for d in sorted(op.geos):
        if d in halos:
            g, axes, h = halos[d]
            offs.append(_window_start(low, like, axes, g, h))
        else:
            offs.append(0)
    return offs


def _indices_to_global(low, op, idx, wshape, halos, like):
    if not halos:
        return idx
    _, dw = sorted(op.geos)
    off_h, off_w = _spatial_offsets(low, op, halos, like)
    lw = wshape[dw]
    h = low.call(aten.div.Tensor_mode, idx, lw, rounding_mode="floor")
    w = low.call(aten.remainder.Scalar, idx, lw)
    if not isinstance(off_h, int):
        h = low.call(aten.add.Tensor, h, off_h)
    if not isinstance(off_w, int):
        w = low.call(aten.add.Tensor, w, off_w)
    return low.call(aten.add.Tensor, low.call(aten.mul.Tensor, h, op.x_shape[dw]), w)


def _indices_to_local(low, op, idx, wshape, halos, like):
    if not halos:
        return idx
    dh, dw = sorted(op.geos)
    off_h, off_w = _spatial_offsets(low, op, halos, like)
    n_w = op.x_shape[dw]
    h = low.call(aten.div.Tensor_mode, idx, n_w, rounding_mode="floor")
    w = low.call(aten.remainder.Scalar, idx, n_w)
    if not isinstance(off_h, int):
        h = low.call(aten.sub.Tensor, h, off_h)
    if not isinstance(off_w, int):
        w = low.call(aten.sub.Tensor, w, off_w)
    flat = low.call(aten.add.Tensor, low.call(aten.mul.Tensor, h, wshape[dw]), w)
    return low.call(aten.clamp.default, flat, 0, wshape[dh] * wshape[dw] - 1)


def _avg_divisor(low, node, op, halos, like) -> fx.Node:
    """avg_pool2d's divisor of each local output (PyTorch's formula, per global position)."""
    include = bool(_arg(node, 6 if node.target is _AVGPOOL_BWD else 5, "count_include_pad", True))
    dims = sorted(op.geos)
    facs = []
    for i, d in enumerate(dims):
        g = op.geos[d]
        if d in halos:
            _, axes, h = halos[d]
            t = low.call(partita_ops.axis_index.default, like, list(axes))
            o = low.call(
                aten.add.Tensor,
                low.call(aten.arange.default, h.c_out, dtype=torch.int64),
                low.call(aten.mul.Tensor, t, h.c_out),
            )
            size = h.c_out
        else:
            o = low.call(aten.arange.default, g.m, dtype=torch.int64)
            size = g.m
        start = low.call(aten.sub.Tensor, low.call(aten.mul.Tensor, o, g.stride), g.pad)
        end = low.call(
            aten.clamp_max.default, low.call(aten.add.Tensor, start, g.kernel), g.n + g.pad
        )
        if include:
            cnt = low.call(aten.sub.Tensor, end, start)
        else:
            cnt = low.call(
                aten.sub.Tensor,
                low.call(aten.clamp_max.default, end, g.n),
                low.call(aten.clamp_min.default, start, 0),
            )
        cnt = low.call(aten.clamp_min.default, cnt, 1)
        shape = [size] + [1] * (len(dims) - 1 - i)
        facs.append(low.call(aten.reshape.default, cnt, shape))
    div = low.call(aten.mul.Tensor, facs[0], facs[1])
    return low.call(aten._to_copy.default, div, dtype=node.args[0].meta["val"].dtype)


def _avg_pool(low, node, op, xw, pad, halos, like) -> fx.Node:
    args = list(node.args)
    ks = _ints(args[1], 2)
    stride = _ints(_arg(node, 2, "stride"), 2, ks)
    ceil_mode = _arg(node, 4, "ceil_mode", False)
    include = _arg(node, 5, "count_include_pad", True)
    over = _arg(node, 6, "divisor_override")
    if over is not None:
        return low.call(_AVGPOOL, xw, ks, stride, pad, ceil_mode, include, over)
    s = low.call(_AVGPOOL, xw, ks, stride, pad, ceil_mode, include, 1)
    return low.call(aten.div.Tensor, s, _avg_divisor(low, node, op, halos, like))


def _finish_gathered(low, node, rule, assign, gathered, out) -> fx.Node:
    """Results of an op computed whole on gathered windowed dims: cut each such dim to the
    tile the assignment wants; results that sum over it become partial over its axes."""
    if not gathered:
        return out
    multi = isinstance(node.meta["val"], (tuple, list))
    items = []
    for j, fs in enumerate(rule.results):
        r = low.call(operator.getitem, out, j) if multi else out
        if fs is not None:
            for d, dim in enumerate(fs):
                for f in dim:
                    if f in gathered:
                        axes = list(gathered[f])
                        r = low.call(
                            partita_ops.shard_slice.default, r, d, axes, low.mesh.axes_size(axes)
                        )
            made_partial = [
                a for f in rule.result_reductions.get(j, ()) if f in gathered for a in gathered[f]
            ]
            if made_partial:
                idx = low.call(partita_ops.axis_index.default, r, made_partial)
                r = low.call(aten.where.ScalarOther, low.call(aten.eq.Scalar, idx, 0), r, 0.0)
        items.append(r)
    return low.call(_pack, *items) if multi else items[0]


register(Handler("halo", _applies, _lower))
