"""Rules of convolution and pooling, forward and backward.

Spatial dims are *windowed* (``handler="halo"``): a shard needs a few rows of its neighbours
(the kernel's reach), exchanged with collective_permute; edge shards see the zero padding
(canonical T23). A windowed factor's size differs between input and output when the op strides
or pools; ``sizes`` holds the input's. Kernel dims are need-replication, input channels a
reduction factor (``convolution`` with a bias, like ``addmm``, must add the bias once when it
is sharded), batch and output channels pass through. Grouped and transposed convolutions are
not supported. ``max_pool2d_with_indices``' indices are positions in the (halo-extended) local
input: the backward must use the same tiling, which the halo handler guarantees.
"""

from __future__ import annotations

from partita.rules import register_rule
from partita.rules.common import Names, arg, aten_ops, build
from partita.rules.factor import FactorRule, OpInfo

__all__ = ["conv_backward_rule", "conv_rule", "pool_rule"]


def _conv_names(info: OpInfo, x_index: int) -> tuple[list[str], list[str], str, str]:
    """(spatial factors, kernel factors, input-channel factor, output-channel factor)."""
    if arg(info, "transposed", False) or arg(info, "groups", 1) != 1:
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


@register_rule(*aten_ops(["convolution.default"]))
def conv_rule(info: OpInfo) -> FactorRule:
    """``a b d e, c b f g, c -> a c d e; reduction=b; need-replication=f,g; windowed=d,e;
    handler=halo`` (NCHW input, OIHW weight, bias)."""
    spatial, kernel, cin, cout = _conv_names(info, 0)
    operands = [["a", cin, *spatial], [cout, cin, *kernel]]
    if arg(info, "bias") is not None:
        operands.append([cout])
    return build(
        info,
        operands,
        [["a", cout, *spatial]],
        reduction=[cin],
        need_replication=kernel,
        windowed=spatial,
        handler="halo",
    )


@register_rule(*aten_ops(["convolution_backward.default"]))
def conv_backward_rule(info: OpInfo) -> FactorRule:
    """``grad, x, w -> grad_x, grad_w, grad_b``: grad_x sums over output channels, grad_w over
    batch and space, grad_b over batch and space."""
    spatial, kernel, cin, cout = _conv_names(info, 1)
    red = {0: [cout], 1: ["a", *spatial], 2: ["a", *spatial]}
    return build(
        info,
        [["a", cout, *spatial], ["a", cin, *spatial], [cout, cin, *kernel]],
        [["a", cin, *spatial], [cout, cin, *kernel], [cout]],
        need_replication=kernel,
        windowed=spatial,
        handler="halo",
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


@register_rule(*_POOL)
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
        handler="halo",
    )
