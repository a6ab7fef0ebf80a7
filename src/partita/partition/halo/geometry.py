"""Halo geometry: an op's windowed dims (``Geo``, read from the node) and the exchange that
one dim split into ``k`` tiles needs (``HaloPlan``). Pure computation, no graph emitted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from partita.errors import InternalError
from partita.rules import FactorKind, FactorRule
from partita.values.layout import ceil_div

__all__ = ["Geo", "HaloPlan", "halo_plan"]

aten = torch.ops.aten
partita_ops = torch.ops.partita
Assign = dict[str, tuple[str, ...]]

CONV = aten.convolution.default
CONV_BWD = aten.convolution_backward.default
MAXPOOL = aten.max_pool2d_with_indices.default
MAXPOOL_BWD = aten.max_pool2d_with_indices_backward.default
AVGPOOL = aten.avg_pool2d.default
AVGPOOL_BWD = aten.avg_pool2d_backward.default
PAD = aten.constant_pad_nd.default
BACKWARD_OPS = (CONV_BWD, MAXPOOL_BWD, AVGPOOL_BWD)


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
    c_in, c_out = ceil_div(g.n, k), ceil_div(g.m, k)
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


def node_arg(node: fx.Node, i: int, name: str, default: Any = None) -> Any:
    if i < len(node.args):
        return node.args[i]
    return node.kwargs.get(name, default)


def int_list(v: Any, k: int, default: list[int] | None = None) -> list[int]:
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
class WindowedOp:
    x_index: int  # the operand whose windowed dims are exchanged (input / self)
    x_shape: tuple[int, ...]
    geos: dict[int, Geo]  # by input dim
    fill: float


def read_op(node: fx.Node) -> WindowedOp:
    t = node.target
    if t in (CONV, CONV_BWD):
        xi = 1 if t is CONV_BWD else 0
        off = 1 if t is CONV_BWD else 0
        x, w = _shape(node.args[xi]), _shape(node.args[xi + 1])
        out = _shape(node.args[0]) if t is CONV_BWD else _shape_of_result(node)
        k = len(x) - 2
        stride = int_list(node_arg(node, 3 + off, "stride"), k)
        pad = int_list(node_arg(node, 4 + off, "padding"), k)
        dil = int_list(node_arg(node, 5 + off, "dilation"), k)
        geos = {
            2 + i: Geo(2 + i, x[2 + i], out[2 + i], w[2 + i], stride[i], pad[i], dil[i])
            for i in range(k)
        }
        return WindowedOp(xi, x, geos, 0.0)
    if t in (MAXPOOL, MAXPOOL_BWD, AVGPOOL, AVGPOOL_BWD):
        bwd = t in (MAXPOOL_BWD, AVGPOOL_BWD)
        xi = 1 if bwd else 0
        x = _shape(node.args[xi])
        out = _shape(node.args[0]) if bwd else _shape_of_result(node)
        ks = int_list(node_arg(node, 1 + xi, "kernel_size"), 2)
        stride = int_list(node_arg(node, 2 + xi, "stride"), 2, ks)
        pad = int_list(node_arg(node, 3 + xi, "padding", 0), 2)
        dil = (
            int_list(node_arg(node, 4 + xi, "dilation", 1), 2)
            if t in (MAXPOOL, MAXPOOL_BWD)
            else [1, 1]
        )
        d0 = len(x) - 2
        geos = {
            d0 + i: Geo(d0 + i, x[d0 + i], out[d0 + i], ks[i], stride[i], pad[i], dil[i])
            for i in range(2)
        }
        fill = float("-inf") if t is MAXPOOL else 0.0
        return WindowedOp(xi, x, geos, fill)
    if t is PAD:
        x = _shape(node.args[0])
        pads = list(node_arg(node, 1, "pad"))
        value = node_arg(node, 2, "value", 0)
        geos = {}
        for i in range(0, len(pads), 2):
            d = len(x) - 1 - i // 2
            lo, hi = int(pads[i]), int(pads[i + 1])
            geos[d] = Geo(d, x[d], x[d] + lo + hi, 1, 1, lo, 1)
        return WindowedOp(0, x, geos, float(value if value is not None else 0))
    raise InternalError(
        f"halo handler: no window geometry for op {t} (its rule names the halo handler). "
        f"{InternalError.REPORT}"
    )


def _shape_of_result(node: fx.Node) -> tuple[int, ...]:
    val = node.meta["val"]
    if isinstance(val, (tuple, list)):
        val = val[0]
    return tuple(int(s) for s in val.shape)


def sharded_windowed_dims(
    rule: FactorRule, op: WindowedOp, assign: Assign
) -> dict[int, tuple[str, ...]]:
    """Sharded windowed dims of the exchanged operand: ``{dim: (factor, *mesh axes)}``."""
    out: dict[int, Any] = {}
    factors = rule.operands[op.x_index] or ()
    for d, dim in enumerate(factors):
        for f in dim:
            if rule.kind(f) is FactorKind.WINDOWED and assign.get(f) and d in op.geos:
                out[d] = (f, *assign[f])
    return out


def window_shape(shape: list[int], halos: dict[int, Any]) -> list[int]:
    out = list(shape)
    for d, (_, _, h) in halos.items():
        out[d] = h.w
    return out
