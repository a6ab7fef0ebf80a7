"""Handlers for ops whose sharded lowering needs more than local ops: the softmax family,
vocabulary-sharded embeddings, mean, nll_loss (mean), batch norm in training and random draws.

Each handler (``partition.handlers.Handler``) is named by a rule (``FactorRule.handler``):

=================  ==========================================================================
handler            lowering when a factor that needs it is sharded
=================  ==========================================================================
softmax_reduce     mask padding (-inf), local amax, all_reduce(max), exp, mask (0), local sum,
                   all_reduce(sum), divide (T12); backwards: one all_reduce(sum)
masked_embedding   local lookup of ``ids - tile_offset``, out-of-shard ids read row 0 and are
                   zeroed; the result is partial over the vocabulary axes (T24). Backward:
                   accumulate only this shard's rows
mean               local masked sum divided by the *global* count (a partial sum)
weighted_mean      nll_loss_forward: padded targets -> ignore_index, local reduction=sum,
                   one all_reduce of (sum, total_weight), divide
batch_stats        SyncBatchNorm: one all_reduce of per-channel (sum, sum of squares) with the
                   global count; backward: one all_reduce of (sum dy, sum dy*(x-mean))
global_random      draw the *global* random tensor (same generator state on every device, one
                   draw per program run) and keep this device's tile
=================  ==========================================================================

The all_reduces a handler emits are recorded in the Plan (``CollectiveRecord``) with the op,
the node and what is reduced. A few handlers change the op's factor assignment in place (the
``assign`` dict that ``Lowering`` also uses for the results' shardings): embedding_dense_backward
puts back the result-only vocabulary factor it produces locally, and weighted_mean (mean) drops
the batch factor because its results are already reduced.
"""

from __future__ import annotations

import json
import math
import operator
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from partita.explain import op_name
from partita.layout import local_shape
from partita.partition.handlers import Handler, register
from partita.partition.masks import emit_mask_padding, emit_tile_offset
from partita.partition.plan import CollectiveRecord
from partita.partition.reshard import emit_reshard, plan_reshard
from partita.rules import FactorRule
from partita.spec import Sharding

if TYPE_CHECKING:
    from partita.partition.lower import Lowering

__all__ = ["global_random_draw", "make_tuple"]

aten = torch.ops.aten
Assign = dict[str, tuple[str, ...]]


# --- shared helpers -----------------------------------------------------------------------------


def make_tuple(*xs: Any) -> tuple[Any, ...]:
    """The local result of a multi-output op built from several nodes (``getitem`` reads it)."""
    return tuple(xs)


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _axes_of(rule: FactorRule, tensor: int, dim: int, assign: Assign) -> tuple[str, ...]:
    factors = rule.operands[tensor]
    if factors is None:
        return ()
    return tuple(a for f in factors[dim] for a in assign.get(f, ()))


def _operand_sharding(low: Lowering, rule: FactorRule, i: int, assign: Assign) -> Sharding:
    factors = rule.operands[i]
    assert factors is not None
    return Sharding(low.mesh, low.dims_of(factors, assign))


def _all_reduce(
    low: Lowering,
    node: fx.Node,
    x: fx.Node,
    reduce_op: str,
    axes: tuple[str, ...],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    what: str,
) -> fx.Node:
    """Emit ``all_reduce(x)`` over ``axes`` and record it in the Plan."""
    n = low.mesh.axes_size(axes)
    out = low.call(torch.ops.partita.all_reduce.default, x, reduce_op, list(axes), n)
    low.plan.collectives.append(
        CollectiveRecord(
            kind="all_reduce",
            mesh_axes=tuple(axes),
            groups=tuple(tuple(g) for g in low.mesh.groups(axes)),
            shape=tuple(shape),
            dtype=dtype,
            value=f"{node.name}.{what.split()[0]}",
            reason=f"{op_name(node.target)} (%{node.name}) with a sharded dim: {what}",
            source=node.meta.get("source"),
            detail=f"{reduce_op}, {n}",
        )
    )
    return out


def _mask(
    low: Lowering, x: fx.Node, axes: tuple[str, ...], size: int, ndim: int, dim: int, fill: Any
) -> fx.Node:
    return emit_mask_padding(low.graph, x, low.mesh, axes, size, ndim, dim, fill)


def _cast(low: Lowering, x: fx.Node, have: torch.dtype, want: torch.dtype) -> fx.Node:
    return x if have == want else low.call(aten._to_copy.default, x, dtype=want)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


# --- softmax_reduce -----------------------------------------------------------------------------

_LOG = {aten._log_softmax.default, aten.log_softmax.int, aten._log_softmax_backward_data.default}
_BACKWARD = {aten._softmax_backward_data.default, aten._log_softmax_backward_data.default}


def _softmax_dim(node: fx.Node) -> int:
    ndim = _val(node.args[0]).ndim
    d = node.args[2] if node.target in _BACKWARD else node.args[1]
    return d % max(ndim, 1)


def _softmax_axes(node: fx.Node, rule: FactorRule, assign: Assign) -> tuple[str, ...]:
    if not _val(node.args[0]).ndim:
        return ()
    return _axes_of(rule, 0, _softmax_dim(node), assign)


def _softmax_applies(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> bool:
    return bool(_softmax_axes(node, rule, assign))


def _softmax_lower(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> fx.Node:
    d = _softmax_dim(node)
    axes = _softmax_axes(node, rule, assign)
    x_val, out_val = _val(node.args[0]), node.meta["val"]
    gshape = tuple(x_val.shape)
    n, ndim = gshape[d], len(gshape)
    red_shape = list(local_shape(_operand_sharding(low, rule, 0, assign), gshape))
    del red_shape[d]
    red_shape_t = tuple(red_shape)
    dt = out_val.dtype
    is_log = node.target in _LOG

    def reduce(v: fx.Node, op: str, fill: Any, what: str) -> fx.Node:
        v = _mask(low, v, axes, n, ndim, d, fill)
        fn = aten.amax.default if op == "max" else aten.sum.dim_IntList
        local = low.call(fn, v, [d])
        return low.call(
            aten.unsqueeze.default,
            _all_reduce(low, node, local, op, axes, red_shape_t, dt, what),
            d,
        )

    if node.target in _BACKWARD:
        grad, out = low.localize_operands(node, rule, assign)
        grad = _cast(low, grad, _val(node.args[0]).dtype, _val(node.args[1]).dtype)
        if is_log:  # grad - exp(out) * sum(grad)
            s = reduce(grad, "sum", 0, "sum of the gradient")
            res = low.call(
                aten.sub.Tensor, grad, low.call(aten.mul.Tensor, low.call(aten.exp.default, out), s)
            )
        else:  # grad*out - out * sum(grad*out)
            gy = low.call(aten.mul.Tensor, grad, out)
            s = reduce(gy, "sum", 0, "sum of grad * softmax")
            res = low.call(aten.sub.Tensor, gy, low.call(aten.mul.Tensor, out, s))
        return _cast(low, res, _val(node.args[1]).dtype, dt)

    (x,) = low.localize_operands(node, rule, assign)
    x = _cast(low, x, x_val.dtype, dt)
    x = _mask(low, x, axes, n, ndim, d, -math.inf)
    gmax = reduce(x, "max", -math.inf, "max for a stable softmax")
    shifted = low.call(aten.sub.Tensor, x, gmax)
    e = low.call(aten.exp.default, shifted)
    total = reduce(e, "sum", 0, "sum of exp")
    if is_log:
        res = low.call(aten.sub.Tensor, shifted, low.call(aten.log.default, total))
    else:
        res = low.call(aten.div.Tensor, e, total)
    if node.target == aten._safe_softmax.default:  # rows of only -inf give 0, not NaN
        empty = low.call(aten.eq.Scalar, gmax, -math.inf)
        res = low.call(aten.where.ScalarSelf, empty, 0.0, res)
    return res


register(Handler("softmax_reduce", _softmax_applies, _softmax_lower))


# --- masked_embedding ---------------------------------------------------------------------------


def _vocab_factor(node: fx.Node, rule: FactorRule) -> str:
    if node.target == aten.embedding_dense_backward.default:
        res = rule.results[0]
        assert res is not None
        return res[0][0]
    table = rule.operands[0]
    assert table is not None
    return table[0][0]


def _vocab_axes(node: fx.Node, rule: FactorRule, assign: Assign) -> tuple[str, ...]:
    v = _vocab_factor(node, rule)
    if node.target == aten.embedding_dense_backward.default:
        # v is result-only: the generic lowering computes it whole, so ``assign`` lacks it;
        # propagation's choice is in the node's meta.
        if bool(node.args[4] if len(node.args) > 4 else False):
            return ()  # scale_grad_by_freq counts ids globally: compute whole (generic)
        return tuple(node.meta.get("factor_axes", {}).get(v, ()))
    return assign.get(v, ())


def _embedding_applies(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> bool:
    return bool(_vocab_axes(node, rule, assign))


def _own_rows(
    low: Lowering, ids: fx.Node, axes: tuple[str, ...], rows: int
) -> tuple[fx.Node, fx.Node, int]:
    """(ids shifted into this shard, where the shifted id is one of this shard's rows, tile)."""
    tile = -(-rows // low.mesh.axes_size(axes))
    offset = emit_tile_offset(low.graph, ids, axes, tile)
    local = low.call(aten.sub.Tensor, ids, offset)
    inside = low.call(
        aten.logical_and.default,
        low.call(aten.ge.Scalar, local, 0),
        low.call(aten.lt.Scalar, local, tile),
    )
    return local, inside, tile


def _embedding_lower(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> fx.Node:
    axes = _vocab_axes(node, rule, assign)
    if node.target == aten.embedding_dense_backward.default:
        assign[_vocab_factor(node, rule)] = axes  # this lowering makes the V tiles itself
        grad, ids = low.localize_operands(node, rule, assign)
        num_weights = int(node.args[2])
        padding_idx = int(node.args[3]) if len(node.args) > 3 else -1
        local, inside, tile = _own_rows(low, ids, axes, num_weights)
        if padding_idx >= 0:
            inside = low.call(
                aten.logical_and.default, inside, low.call(aten.ne.Scalar, ids, padding_idx)
            )
        safe = low.call(aten.where.ScalarOther, inside, local, 0)
        keep = low.call(aten.unsqueeze.default, inside, -1)
        grad = low.call(aten.where.ScalarOther, keep, grad, 0.0)
        return low.call(aten.embedding_dense_backward.default, grad, safe, tile, -1, False)
    table, ids = low.localize_operands(node, rule, assign)
    rows = int(_val(node.args[0]).shape[0])
    local, inside, _ = _own_rows(low, ids, axes, rows)
    safe = low.call(aten.where.ScalarOther, inside, local, 0)
    out = low.call(aten.embedding.default, table, safe)
    keep = low.call(aten.unsqueeze.default, inside, -1)
    return low.call(aten.where.ScalarOther, keep, out, 0.0)  # partial sum over the vocab axes


register(Handler("masked_embedding", _embedding_applies, _embedding_lower))


# --- mean ---------------------------------------------------------------------------------------


def _reduced_axes(rule: FactorRule, assign: Assign) -> tuple[str, ...]:
    return tuple(a for f in rule.reduction_factors for a in assign.get(f, ()))


def _mean_applies(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> bool:
    return bool(_reduced_axes(rule, assign))


def _mean_lower(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> fx.Node:
    """A local sum of the (zero-masked) tile divided by the global count: a partial sum."""
    (x,) = low.localize_operands(node, rule, assign)
    shape = tuple(_val(node.args[0]).shape)
    dtype = node.kwargs.get("dtype")
    if node.target == aten.mean.dim:
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        keepdim = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
        dims = list(range(len(shape))) if not dims else [d % len(shape) for d in dims]
        if len(node.args) > 3:
            dtype = node.args[3]
        s = low.call(aten.sum.dim_IntList, x, dims, keepdim, dtype=dtype)
    else:
        dims = list(range(len(shape)))
        s = low.call(aten.sum.default, x, dtype=dtype)
    count = math.prod(shape[d] for d in dims)
    return low.call(aten.div.Scalar, s, count)


register(Handler("mean", _mean_applies, _mean_lower))


# --- weighted_mean: nll_loss_forward --------------------------------------------------------------

_SUM, _MEAN = 2, 1


def _nll_lower(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> fx.Node:
    """Padded targets become ``ignore_index``; the op runs with ``reduction=sum``. For sum the
    results stay partial; for mean one all_reduce of ``(sum, total_weight)`` and a divide."""
    it = iter(low.localize_operands(node, rule, assign))
    args = [next(it) if isinstance(_val(a), torch.Tensor) else a for a in node.args]
    reduction, ignore = int(args[3]), int(args[4])
    n = int(_val(node.args[1]).shape[0])
    axes = _axes_of(rule, 1, 0, assign)
    args[1] = _mask(low, args[1], axes, n, 1, 0, ignore)
    args[3] = _SUM
    res = low.call(node.target, *args)
    total, weight = (low.call(operator.getitem, res, i) for i in (0, 1))
    if reduction == _SUM:
        return res
    dtype = node.meta["val"][0].dtype
    both = low.call(aten.stack.default, [total, weight])
    red = _reduced_axes(rule, assign)
    both = _all_reduce(low, node, both, "sum", red, (2,), dtype, "loss sum and total weight")
    total, weight = (low.call(aten.select.int, both, 0, i) for i in (0, 1))
    for f in rule.reduction_factors:  # the results are reduced already
        assign.pop(f, None)
    return low.call(make_tuple, low.call(aten.div.Tensor, total, weight), weight)


def _nll_applies(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> bool:
    if node.target == aten.nll_loss_backward.default:
        return _val(node.args[2]).ndim > 0 and bool(_axes_of(rule, 2, 0, assign))
    return bool(_reduced_axes(rule, assign))


def _nll_backward_lower(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> fx.Node:
    """``nll_loss_backward`` with the batch sharded: padded targets become ``ignore_index`` (the
    kernel indexes with them); the global ``total_weight`` makes the rest local."""
    it = iter(low.localize_operands(node, rule, assign))
    args = [next(it) if isinstance(_val(a), torch.Tensor) else a for a in node.args]
    n = int(_val(node.args[2]).shape[0])
    args[2] = _mask(low, args[2], _axes_of(rule, 2, 0, assign), n, 1, 0, int(args[5]))
    return low.call(node.target, *args)


def _nll_dispatch(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> fx.Node:
    if node.target == aten.nll_loss_backward.default:
        return _nll_backward_lower(low, node, rule, assign)
    return _nll_lower(low, node, rule, assign)


register(Handler("weighted_mean", _nll_applies, _nll_dispatch))


# --- batch_stats: batch norm in training mode (SyncBatchNorm) ------------------------------------


def _bn_reduced(
    low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign, x_index: int
) -> tuple[list[int], tuple[str, ...]]:
    """The reduced dims (all but channels) and the mesh axes they are sharded over."""
    ndim = _val(node.args[x_index]).ndim
    dims = [d for d in range(ndim) if d != 1]
    axes: list[str] = []
    for d in dims:
        axes += [a for a in _axes_of(rule, x_index, d, assign) if a not in axes]
    return dims, tuple(axes)


def _bn_applies(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> bool:
    x_index = 1 if node.target == aten.native_batch_norm_backward.default else 0
    return bool(_bn_reduced(low, node, rule, assign, x_index)[1])


def _localized_args(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> list[Any]:
    it = iter(low.localize_operands(node, rule, assign))
    return [next(it) if isinstance(_val(a), torch.Tensor) else a for a in node.args]


def _channel_sums(
    low: Lowering,
    node: fx.Node,
    rule: FactorRule,
    assign: Assign,
    x_index: int,
    terms: list[fx.Node],
    acc: torch.dtype,
    what: str,
) -> list[fx.Node]:
    """Per-channel sums of ``terms`` (local tiles like the input, padding masked to 0) over the
    reduced dims, all-reduced in one collective."""
    gshape = tuple(_val(node.args[x_index]).shape)
    dims, axes = _bn_reduced(low, node, rule, assign, x_index)
    sums = []
    for t in terms:
        for d in dims:
            t = _mask(low, t, _axes_of(rule, x_index, d, assign), gshape[d], len(gshape), d, 0)
        sums.append(low.call(aten.sum.dim_IntList, t, dims))
    stacked = low.call(aten.stack.default, sums)
    c_local = local_shape(_operand_sharding(low, rule, x_index, assign), gshape)[1]
    out = _all_reduce(low, node, stacked, "sum", axes, (len(terms), c_local), acc, what)
    return [low.call(aten.select.int, out, 0, i) for i in range(len(terms))]


def _bn_lower(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> fx.Node:
    if node.target == aten.native_batch_norm_backward.default:
        return _bn_backward(low, node, rule, assign)
    args = _localized_args(low, node, rule, assign)
    x, w, b = args[0], args[1], args[2]
    no_stats = node.target == aten._native_batch_norm_legit.no_stats
    rm, rv = (None, None) if no_stats else (args[3], args[4])
    momentum, eps = (args[4], args[5]) if no_stats else (args[6], args[7])
    x_val = _val(node.args[0])
    gshape = tuple(x_val.shape)
    count = math.prod(gshape) // gshape[1]
    acc = _acc_dtype(x_val.dtype)
    xa = _cast(low, x, x_val.dtype, acc)
    s1, s2 = _channel_sums(
        low,
        node,
        rule,
        assign,
        0,
        [xa, low.call(aten.mul.Tensor, xa, xa)],
        acc,
        "per-channel sum and sum of squares (SyncBatchNorm)",
    )
    mean = low.call(aten.div.Scalar, s1, count)
    var = low.call(
        aten.sub.Tensor, low.call(aten.div.Scalar, s2, count), low.call(aten.mul.Tensor, mean, mean)
    )
    var = low.call(aten.clamp_min.default, var, 0.0)
    rstd = low.call(aten.rsqrt.default, low.call(aten.add.Scalar, var, eps))
    bshape = [1, -1] + [1] * (len(gshape) - 2)

    def per_channel(v: fx.Node) -> fx.Node:
        return low.call(aten.reshape.default, v, bshape)

    out = low.call(
        aten.mul.Tensor, low.call(aten.sub.Tensor, xa, per_channel(mean)), per_channel(rstd)
    )
    if w is not None:
        out = low.call(aten.mul.Tensor, out, per_channel(w))
    if b is not None:
        out = low.call(aten.add.Tensor, out, per_channel(b))
    vals = node.meta["val"]
    results: list[Any] = [
        _cast(low, out, acc, vals[0].dtype),
        _cast(low, mean, acc, vals[1].dtype),
        _cast(low, rstd, acc, vals[2].dtype),
    ]
    if node.target == aten._native_batch_norm_legit_functional.default:
        unbiased = low.call(aten.mul.Tensor, var, count / max(count - 1, 1))
        for running, stat in ((rm, mean), (rv, unbiased)):
            results.append(
                low.call(
                    aten.add.Tensor,
                    low.call(aten.mul.Tensor, stat, momentum),
                    low.call(aten.mul.Tensor, running, 1 - momentum),
                )
            )
    return low.call(make_tuple, *results)


def _bn_backward(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> fx.Node:
    """``native_batch_norm_backward(dy, x, w, rm, rv, save_mean, save_invstd, train, eps,
    mask)`` in training: one all_reduce of ``(sum dy, sum dy * (x - mean))`` per channel."""
    args = _localized_args(low, node, rule, assign)
    dy, x, w, save_mean, invstd = args[0], args[1], args[2], args[5], args[6]
    out_mask = list(node.args[9])
    x_val = _val(node.args[1])
    gshape = tuple(x_val.shape)
    count = math.prod(gshape) // gshape[1]
    acc = _acc_dtype(x_val.dtype)
    bshape = [1, -1] + [1] * (len(gshape) - 2)

    def per_channel(v: fx.Node) -> fx.Node:
        return low.call(aten.reshape.default, v, bshape)

    dy_a = _cast(low, dy, _val(node.args[0]).dtype, acc)
    centered = low.call(aten.sub.Tensor, _cast(low, x, x_val.dtype, acc), per_channel(save_mean))
    sum_dy, dot = _channel_sums(
        low,
        node,
        rule,
        assign,
        1,
        [dy_a, low.call(aten.mul.Tensor, dy_a, centered)],
        acc,
        "per-channel sums of dy and dy * (x - mean) (SyncBatchNorm backward)",
    )
    vals = node.meta["val"]
    results: list[Any] = [None, None, None]
    if out_mask[0]:
        grad_mean = low.call(aten.div.Scalar, sum_dy, count)
        proj_scale = low.call(
            aten.mul.Tensor,
            low.call(aten.div.Scalar, dot, count),
            low.call(aten.mul.Tensor, invstd, invstd),
        )
        scale = invstd if w is None else low.call(aten.mul.Tensor, invstd, w)
        proj = low.call(aten.mul.Tensor, centered, per_channel(proj_scale))
        gi = low.call(
            aten.sub.Tensor, low.call(aten.sub.Tensor, dy_a, proj), per_channel(grad_mean)
        )
        gi = low.call(aten.mul.Tensor, gi, per_channel(scale))
        results[0] = _cast(low, gi, acc, vals[0].dtype)
    if out_mask[1]:
        results[1] = _cast(low, low.call(aten.mul.Tensor, dot, invstd), acc, vals[1].dtype)
    if out_mask[2]:
        results[2] = _cast(low, sum_dy, acc, vals[2].dtype)
    return low.call(make_tuple, *results)


register(Handler("batch_stats", _bn_applies, _bn_lower))


# --- global_random -------------------------------------------------------------------------------

#: Random ops whose tensor operands' *values* matter (the others only give a shape).
_VALUE_OPERANDS = {aten.bernoulli.default}


def _encode(a: Any) -> Any:
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    if isinstance(a, (list, tuple)):
        return [_encode(x) for x in a]
    if isinstance(a, torch.dtype):
        return {"dtype": str(a).removeprefix("torch.")}
    if isinstance(a, torch.device):
        return {"device": str(a)}
    if isinstance(a, torch.layout):
        return {"layout": str(a).removeprefix("torch.")}
    if isinstance(a, torch.memory_format):
        return {"memory_format": str(a).removeprefix("torch.")}
    raise NotImplementedError(f"global_random cannot pass the argument {a!r} to a random op")


def _decode(a: Any, inputs: list[torch.Tensor]) -> Any:
    if isinstance(a, list):
        return [_decode(x, inputs) for x in a]
    if not isinstance(a, dict):
        return a
    if "tensor" in a:
        return inputs[a["tensor"]]
    if "like" in a:  # only its shape, strides and dtype matter
        shape, stride, dtype = a["like"]
        return torch.empty_strided(shape, stride, dtype=getattr(torch, dtype["dtype"]))
    if "device" in a:
        return torch.device(a["device"])
    ((_kind, name),) = a.items()
    return getattr(torch, name)


def _run_draw(inputs: list[torch.Tensor], op: str, args: str) -> list[torch.Tensor]:
    packet, overload = op.split(".")
    target = getattr(getattr(aten, packet), overload)
    spec = json.loads(args)
    out = target(
        *_decode(spec["args"], inputs), **{k: _decode(v, inputs) for k, v in spec["kwargs"].items()}
    )
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    return [o.clone() if any(o is i for i in inputs) else o for o in outs]


@torch.library.custom_op("partita::global_random_draw", mutates_args=())
def global_random_draw(inputs: list[torch.Tensor], op: str, args: str) -> list[torch.Tensor]:
    """Run the random aten op ``op`` on *global* arguments (JSON; ``{"like": [shape, stride,
    dtype]}`` stands for a tensor whose values the op ignores, ``{"tensor": i}`` for
    ``inputs[i]``). Every device runs it with the same generator state, so all hold the same
    global draw. Not tagged nondeterministic: an executor runs it like any local op (once per
    program run when its inputs are the same on every device)."""
    return _run_draw(inputs, op, args)


@global_random_draw.register_fake
def _(inputs: list[torch.Tensor], op: str, args: str) -> list[torch.Tensor]:
    return _run_draw(inputs, op, args)


def _random_applies(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> bool:
    return True  # even replicated: the executor runs the wrapped draw, never a raw random op


def _random_lower(low: Lowering, node: fx.Node, rule: FactorRule, assign: Assign) -> fx.Node:
    """Draw the global tensor(s) and keep this device's tile (docs/rules.md, random numbers)."""
    target = node.target
    if target == aten.native_dropout.default and node.args[2] is False:
        (x,) = low.localize_operands(node, rule, assign)
        ones = low.call(aten.ones_like.default, x, dtype=torch.bool)
        return low.call(make_tuple, low.call(aten.clone.default, x), ones)
    inputs: list[fx.Node] = []

    def enc(a: Any) -> Any:
        if isinstance(a, fx.Node):
            v = _val(a)
            if target in _VALUE_OPERANDS:
                dst = Sharding.replicated(low.mesh, v.ndim)
                why = f"{op_name(target)} (%{node.name}) draws from the global tensor"
                inputs.append(low.reshard(low.key(a), dst, why, node))
                return {"tensor": len(inputs) - 1}
            return {"like": [list(v.shape), list(v.stride()), _encode(v.dtype)]}
        return _encode(a)

    spec = {
        "args": [enc(a) for a in node.args],
        "kwargs": {k: enc(v) for k, v in node.kwargs.items()},
    }
    op = str(target).removeprefix("aten.")
    draw = low.call(torch.ops.partita.global_random_draw.default, inputs, op, json.dumps(spec))
    vals = node.meta["val"]
    vals = list(vals) if isinstance(vals, (tuple, list)) else [vals]
    shardings = low.result_shardings(rule, assign)
    tiles = []
    for j, (v, s) in enumerate(zip(vals, shardings, strict=True)):
        whole = low.call(operator.getitem, draw, j)
        if s is None:
            tiles.append(whole)
            continue
        steps = plan_reshard(Sharding.replicated(low.mesh, v.ndim), s, tuple(v.shape))
        assert not any(step.is_collective for step in steps)
        tiles.append(emit_reshard(low.graph, whole, steps, low.mesh))
    if target == aten.native_dropout.default:  # out = x * mask * scale, as the CPU kernel
        (x,) = low.localize_operands(node, rule, assign)
        p1m = 1.0 - float(node.args[1])
        scale = 0.0 if p1m == 0 else 1.0 / p1m
        mask = low.call(aten._to_copy.default, tiles[1], dtype=vals[0].dtype)
        tiles[0] = low.call(aten.mul.Tensor, low.call(aten.mul.Tensor, x, mask), scale)
    return tiles[0] if len(tiles) == 1 else low.call(make_tuple, *tiles)


register(Handler("global_random", _random_applies, _random_lower))
