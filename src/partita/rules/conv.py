"""Rules of convolution and pooling, forward and backward.

Spatial dims are *windowed* (``handler="halo"``): a shard needs a few rows of its neighbours
(the kernel's reach), exchanged with collective_permute; edge shards see the zero padding
(canonical T23). A windowed factor's size differs between input and output when the op strides
or pools; ``sizes`` holds the input's. Kernel dims are need-replication, input channels a
reduction factor (``convolution`` with a bias, like ``addmm``, must add the bias once when it
is sharded), batch and output channels pass through. Grouped and transposed convolutions,
which the halo lowering does not cover, keep only their batch dim sharded (channels and space
gathered). ``max_pool2d_with_indices``' indices are positions in the (halo-extended) local
input: the backward must use the same tiling, which the halo handler guarantees.

Plane ops (``PLANE_CORES``: adaptive pools, 3-d and fractional pools, interpolations) and
``grid_sampler`` gather their spatial plane and pass batch and channels through ("gather,
compute, keep replicated", ``batched.py``); so do the interpolation backwards, whose global
``input_size`` argument the partitioner localises, and ``replication_pad*_backward``.
"""

from __future__ import annotations

from partita.rules.batched import batched_rule
from partita.rules.common import Names, aten_ops, build
from partita.rules.factor import FactorRule, OpInfo
from partita.rules.facts import OpFacts
from partita.rules.handler_names import HandlerName
from partita.rules.ruleset import RuleSet

RULES = RuleSet("conv")

__all__ = [
    "INTERPOLATION_BACKWARDS",
    "PLANE_CORES",
    "REPLICATION_PAD_BACKWARDS",
    "conv_backward_rule",
    "conv_rule",
    "interpolation_backward_rule",
    "plane_rule",
    "pool_rule",
    "replication_pad_backward_rule",
]


def _conv_names(info: OpInfo, x_index: int) -> tuple[list[str], list[str], str, str]:
    """(spatial factors, kernel factors, input-channel factor, output-channel factor)."""
    if info.arg("transposed", False) or info.arg("groups", 1) != 1:
        raise NotImplementedError(f"{info.target}: transposed or grouped convolution")
    x = info.operands[x_index]
    if x.ndim < 3:
        raise NotImplementedError(f"{info.target} on a {x.ndim}-d input (want [n, c, *spatial])")
    k = x.ndim - 2
    fresh = Names()
    fresh.take(3)  # a, b, c are n, c_in, c_out
    spatial = fresh.take(k)
    kernel = fresh.take(k)
    return spatial, kernel, "b", "c"


def _is_special(info: OpInfo) -> bool:
    """A transposed or grouped convolution (the halo lowering covers neither)."""
    return bool(info.arg("transposed", False)) or info.arg("groups", 1) != 1


def _special_conv_rule(info: OpInfo) -> FactorRule:
    """``a b c d, *, * -> a 1 1 1; need-replication=b,c,d``: a transposed or grouped
    convolution keeps only its batch dim sharded; channels and space are gathered and the
    result is replicated on them (gather, compute, keep replicated)."""
    x, (out,) = info.operands[0], info.results
    names = Names().take(x.ndim)
    rest = [None] * (len(info.operands) - 1)
    res = [names[0], *([None] * (out.ndim - 1))]
    return build(info, [names, *rest], [res], need_replication=names[1:])


def _special_conv_backward_rule(info: OpInfo) -> FactorRule:
    """``a b c d, a e f g, * -> a 1 1 1, 1 1 1 1, 1; result1-reduction=a; result2-reduction=a``:
    the batch dim passes through; grad_weight and grad_bias sum over it."""
    grad, x = info.operands[0], info.operands[1]
    fresh = Names()
    a = fresh.new()
    g_dims, x_dims = [a, *fresh.take(grad.ndim - 1)], [a, *fresh.take(x.ndim - 1)]
    results = [None if r is None else [None] * r.ndim for r in info.results]
    rep = [*g_dims[1:], *x_dims[1:]]
    red = {j: [a] for j in (1, 2) if info.results[j] is not None}
    if results[0] is not None:
        results[0] = [a, *results[0][1:]]
    else:  # no grad_input keeps the batch: it is gathered like the rest
        rep, red = [a, *rep], {}
    return build(info, [g_dims, x_dims, None], results, need_replication=rep, result_reductions=red)


@RULES.register(*aten_ops(["convolution.default"]), facts=OpFacts(same_dtype=True))
def conv_rule(info: OpInfo) -> FactorRule:
    """``a b d e, c b f g, c -> a c d e; reduction=b; need-replication=f,g; windowed=d,e;
    handler=halo`` (NCHW input, OIHW weight, bias)."""
    if _is_special(info):
        return _special_conv_rule(info)
    spatial, kernel, cin, cout = _conv_names(info, 0)
    operands = [["a", cin, *spatial], [cout, cin, *kernel]]
    if info.arg("bias") is not None:
        operands.append([cout])
    return build(
        info,
        operands,
        [["a", cout, *spatial]],
        reduction=[cin],
        need_replication=kernel,
        windowed=spatial,
        handler=HandlerName.HALO,
    )


@RULES.register(*aten_ops(["convolution_backward.default"]))
def conv_backward_rule(info: OpInfo) -> FactorRule:
    """``grad, x, w -> grad_x, grad_w, grad_b``: grad_x sums over output channels, grad_w over
    batch and space, grad_b over batch and space."""
    if _is_special(info):
        return _special_conv_backward_rule(info)
    spatial, kernel, cin, cout = _conv_names(info, 1)
    red = {0: [cout], 1: ["a", *spatial], 2: ["a", *spatial]}
    return build(
        info,
        [["a", cout, *spatial], ["a", cin, *spatial], [cout, cin, *kernel]],
        [["a", cin, *spatial], [cout, cin, *kernel], [cout]],
        need_replication=kernel,
        windowed=spatial,
        handler=HandlerName.HALO,
        result_reductions={j: fs for j, fs in red.items() if info.results[j] is not None},
    )


_POOL = aten_ops(
    [
        "avg_pool2d.default",
        "avg_pool2d_backward.default",
        "max_pool2d_with_indices.default",
        "max_pool2d_with_indices_backward.default",
    ]
)


@RULES.register(*_POOL)
def pool_rule(info: OpInfo) -> FactorRule:
    """``a b c d -> a b c d, a b c d; windowed=c,d; handler=halo`` for max_pool2d_with_indices;
    the backward ops map (grad_out, input[, indices]) to grad_input the same way."""
    x = info.operands[0]
    names = Names().take(x.ndim)
    spatial = names[-2:]
    return build(
        info,
        [names] * len(info.operands),
        [names if r is not None else None for r in info.results],
        windowed=spatial,
        handler=HandlerName.HALO,
    )


#: Pools and interpolations over a whole spatial plane: op -> (core dims of each operand, of
#: each result). Their windows are not fixed (adaptive pools, interpolation, random fractional
#: windows) or have no halo lowering yet (3-d pools), so the spatial dims are gathered and the
#: batch and channel dims pass through (``batched.py``).
PLANE_CORES: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "_adaptive_avg_pool2d.default": ((2,), (2,)),
    "_adaptive_avg_pool2d_backward.default": ((2, 2), (2,)),
    "_adaptive_avg_pool3d.default": ((3,), (3,)),
    "_adaptive_avg_pool3d_backward.default": ((3, 3), (3,)),
    "_upsample_bilinear2d_aa.default": ((2,), (2,)),
    "adaptive_max_pool2d.default": ((2,), (2, 2)),
    "adaptive_max_pool2d_backward.default": ((2, 2, 2), (2,)),
    "adaptive_max_pool3d.default": ((3,), (3, 3)),
    "adaptive_max_pool3d_backward.default": ((3, 3, 3), (3,)),
    "avg_pool3d.default": ((3,), (3,)),
    "avg_pool3d_backward.default": ((3, 3), (3,)),
    "fractional_max_pool2d.default": ((2, 1), (2, 2)),
    "fractional_max_pool3d.default": ((3, 1), (3, 3)),
    "max_pool3d_with_indices.default": ((3,), (3, 3)),
    "max_pool3d_with_indices_backward.default": ((3, 3, 3), (3,)),
    "upsample_bicubic2d.default": ((2,), (2,)),
    "upsample_bilinear2d.default": ((2,), (2,)),
    "upsample_trilinear3d.default": ((3,), (3,)),
}


@RULES.register(*aten_ops(sorted(PLANE_CORES)))
def plane_rule(info: OpInfo) -> FactorRule:
    """``a b c d -> a b 1 1; need-replication=c,d`` for ``_adaptive_avg_pool2d(x, [3, 2])``."""
    name = str(info.target).removeprefix("aten.")
    core, core_out = PLANE_CORES[name]
    if name.startswith("fractional"):
        # The random samples must lie in [0, 1): padding garbage would index out of the plane.
        return batched_rule(info, [None] * len(core), core_out)
    return batched_rule(info, core, core_out)


#: The backwards of the interpolations (``F.interpolate``: nearest, nearest-exact, linear,
#: bilinear, bicubic, trilinear; the forwards decompose into index ops or are plane ops). Their
#: arguments hold the *global* ``input_size`` ``[n, c, *plane]``; the partitioner gives it the
#: local sizes (``handler="localize_shape"``), so batch and channels pass through.
INTERPOLATION_BACKWARDS = aten_ops(
    [
        "_upsample_bicubic2d_aa_backward.default",
        "_upsample_bilinear2d_aa_backward.default",
        "_upsample_nearest_exact1d_backward.default",
        "_upsample_nearest_exact2d_backward.default",
        "_upsample_nearest_exact3d_backward.default",
        "upsample_bicubic2d_backward.default",
        "upsample_bilinear2d_backward.default",
        "upsample_linear1d_backward.default",
        "upsample_nearest1d_backward.default",
        "upsample_nearest2d_backward.default",
        "upsample_nearest3d_backward.default",
        "upsample_trilinear3d_backward.default",
    ]
)


@RULES.register(*INTERPOLATION_BACKWARDS)
def interpolation_backward_rule(info: OpInfo) -> FactorRule:
    """``a b c d -> a b 1 1; need-replication=c,d; handler=localize_shape`` for
    ``upsample_nearest2d_backward(grad [n, c, 2h, 2w], [2h, 2w], [n, c, h, w])``: each input
    pixel sums the output pixels the global scale maps to it, so the plane is gathered."""
    (grad,) = info.operands
    if grad.ndim < 3:
        raise NotImplementedError(f"{info.target} on a {grad.ndim}-d gradient")
    names = Names().take(grad.ndim)
    plane = [None] * (grad.ndim - 2)
    return build(
        info,
        [names],
        [[*names[:2], *plane]],
        need_replication=names[2:],
        handler=HandlerName.LOCALIZE_SHAPE,
    )


#: ``replication_padNd_backward(grad, x, padding)``: op -> N, the padded trailing dims (the
#: forwards decompose into index ops; reflection's backward decomposes too).
REPLICATION_PAD_BACKWARDS = {
    "replication_pad1d_backward.default": 1,
    "replication_pad2d_backward.default": 2,
    "replication_pad3d_backward.default": 3,
}


@RULES.register(*aten_ops(sorted(REPLICATION_PAD_BACKWARDS)))
def replication_pad_backward_rule(info: OpInfo) -> FactorRule:
    """``a b c d, a b e f -> a b 1 1; need-replication=c,d,e,f`` for 2-d padding: the edge
    rows sum the gradient of every copy of them, so the padded dims are gathered; the leading
    dims (batch, channels, or channels alone for an unbatched input) pass through."""
    x = info.operands[1]
    k = REPLICATION_PAD_BACKWARDS[str(info.target).removeprefix("aten.")]
    fresh = Names()
    lead = fresh.take(x.ndim - k)
    g_plane, x_plane = fresh.take(k), fresh.take(k)
    return build(
        info,
        [[*lead, *g_plane], [*lead, *x_plane]],
        [[*lead, *([None] * k)]],
        need_replication=[*g_plane, *x_plane],
    )


@RULES.register(*aten_ops(["grid_sampler_2d.default", "grid_sampler_3d.default"]))
def grid_sampler_rule(info: OpInfo) -> FactorRule:
    """``a b c d, a e f g -> a b e f; need-replication=c,d,g`` for ``grid_sampler_2d``: the
    grid's points pass through to the output's space (each point samples the whole input
    plane, which is gathered); batch and channels pass through."""
    x, grid = info.operands
    fresh = Names()
    n, c = fresh.take(2)
    plane = fresh.take(x.ndim - 2)
    points = fresh.take(grid.ndim - 2)
    coord = fresh.new()
    return build(
        info,
        [[n, c, *plane], [n, *points, coord]],
        [[n, c, *points]],
        need_replication=[*plane, coord],
    )


@RULES.register(*aten_ops(["grid_sampler_2d_backward.default", "grid_sampler_3d_backward.default"]))
def grid_sampler_backward_rule(info: OpInfo) -> FactorRule:
    """``a b e f, a b c d, a e f g -> a b c d, a e f g; need-replication=c,d,g;
    result0-reduction=e,f; result1-reduction=b``: grad_input sums over the grid's points,
    grad_grid over the channels."""
    x, grid = info.operands[1], info.operands[2]
    fresh = Names()
    n, c = fresh.take(2)
    plane = fresh.take(x.ndim - 2)
    points = fresh.take(grid.ndim - 2)
    coord = fresh.new()
    rep = [*plane, coord]
    red: dict[int, list[str]] = {}
    for j, summed in ((0, points), (1, [c])):
        if info.results[j] is None:
            rep.extend(summed)  # no result keeps or sums it: gathered
        else:
            red[j] = summed
    results = [[n, c, *plane], [n, *points, coord]]
    return build(
        info,
        [[n, c, *points], [n, c, *plane], [n, *points, coord]],
        [None if r is None else dims for r, dims in zip(info.results, results, strict=True)],
        need_replication=rep,
        result_reductions=red,
    )
