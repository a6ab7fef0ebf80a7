"""The local copies a process makes around each collective call: packing and unpacking.

A mesh op of the per-device program is one ``torch.distributed`` call on a flat buffer, but
the process that runs it also copies: ``runtime.dist_ops`` copies a bucket's members into
one flat buffer before the launch, and after the wait copies a gathered member out of
its ``[group, numel]`` rows into its own layout (a gather bucket's members all in one
``split_with_sizes_copy``), or a scattered chunk back into a strided layout. These copies are
local memory-bound work, neither an op of the per-device program (the mesh op costs no
compute there) nor part of the collective's fitted time (``bench/bench_collectives.py`` times
calls on flat tensors: bare torch calls, and the runtime's own reduce_scatter, whose sum of the
received rows on Gloo is part of the call's time), so the step estimate
(``partition.estimate``) adds them as ops of their own where they run: the packing at the
launch, the unpacking at the wait.

:func:`call_copies` answers, for one mesh op node and its operands' fake values, the bytes
(read plus written) of each copy the runtime makes, by applying the runtime's own reshapes to
tensors of the operands' shapes and strides on the meta device: a reshape that torch can do as
a view copies nothing, one that it cannot copies the tensor. ``tests/test_cost_copies.py``
checks the answer against the copying aten ops that ``runtime.dist_ops`` itself runs for every
collective of GPT-S's presets. Not counted: the copy of an ``all_reduce``'s input that the
runtime reduces in a copy (``runtime.donate`` reduces most in place) and the reordering of
chunks for a group whose torch order differs from partita's (groups over several mesh axes
listed minor-first); a ``collective_permute`` runs in ``runtime.permute`` and is not counted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, fx

__all__ = ["call_copies"]


def call_copies(node: fx.Node, vals: Mapping[fx.Node, Any]) -> tuple[list[int], list[int]]:
    """``(at launch, at wait)``: bytes read and written by each copy the runtime makes for the
    mesh op ``node`` (a ``partita::`` collective or bucket, ``runtime.dist_ops``) whose
    operands' values (fake or real) are in ``vals``; empty lists for a group of one and for
    the ops the runtime does not copy around.

    >>> from partita.ir import collectives
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> gm = make_fx(lambda x: collectives.all_gather(x, 1, ["data"], 4))(torch.ones(8, 2))
    >>> node = next(n for n in gm.graph.nodes if n.op == "call_function")
    >>> x = next(iter(gm.graph.nodes))
    >>> call_copies(node, {x: torch.ones(8, 2)})  # gathered along dim 1: 8 x 8 floats copied
    ([], [512])
    """
    kind = node.target._schema.name.split("::")[-1]  # type: ignore[union-attr]
    if kind not in _RULES or int(node.args[-1]) <= 1:  # type: ignore[arg-type]
        return [], []
    n = int(node.args[-1])  # type: ignore[arg-type]
    first: Any = node.args[0]
    operands: Any = (
        [_meta(vals[x]) for x in first] if isinstance(first, (list, tuple)) else _meta(vals[first])
    )
    return _RULES[kind](operands, node.args[1:-1], n)


def _meta(v: Tensor) -> Tensor:
    return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _copy(t: Tensor) -> int:
    """Bytes one copy of ``t`` reads and writes."""
    return 2 * _nbytes(t)


def _reshape_copies(t: Tensor, shape: Sequence[int]) -> bool:
    """Whether ``t.reshape(shape)`` copies (torch cannot give it as a view)."""
    try:
        t.view(shape)
    except RuntimeError:
        return True
    return False


def _avg(reduce_op: Any, out: Tensor) -> list[int]:
    """``comm.finish_avg``: an average divides the sum out of place."""
    return [_copy(out)] if reduce_op == "avg" and out.numel() else []


def _gathered(parts: Tensor, shape: Sequence[int], dim: int) -> tuple[Tensor, list[int]]:
    """``dist_ops._gathered``: ``[n, numel]`` rows -> the value concatenated along ``dim``."""
    out = list(shape)
    out[dim] *= parts.shape[0]
    moved = parts.reshape(parts.shape[0], *shape).movedim(0, dim)
    return moved, [_copy(moved)] if _reshape_copies(moved, out) else []


def _all_gather(x: Tensor, rest: Sequence[Any], n: int) -> tuple[list[int], list[int]]:
    (dim, _axes) = rest
    launch = [] if x.is_contiguous() else [_copy(x)]
    parts = torch.empty(n, x.numel(), dtype=x.dtype, device="meta")
    return launch, _gathered(parts, x.shape, int(dim))[1]


def _all_gather_bucket(
    xs: list[Tensor], rest: Sequence[Any], n: int
) -> tuple[list[int], list[int]]:
    dims, _axes = rest
    launch = [2 * sum(_nbytes(x) for x in xs)]  # torch.cat into this rank's slot
    wait = [n * launch[0]]  # split_with_sizes_copy: every value's columns, one kernel
    for x, d in zip(xs, dims, strict=True):
        piece = torch.empty(n, x.numel(), dtype=x.dtype, device="meta")
        wait += _gathered(piece, x.shape, int(d))[1]  # a gather along dim > 0 moves it
    return launch, wait


def _all_reduce(x: Tensor, rest: Sequence[Any], n: int) -> tuple[list[int], list[int]]:
    reduce_op, _axes = rest[0], rest[1]
    return [], _avg(reduce_op, x)


def _all_reduce_bucket(
    xs: list[Tensor], rest: Sequence[Any], n: int
) -> tuple[list[int], list[int]]:
    reduce_op, _axes = rest
    total = sum(_nbytes(x) for x in xs)
    flat = torch.empty(total // max(1, xs[0].element_size()), dtype=xs[0].dtype, device="meta")
    return [2 * total], _avg(reduce_op, flat)


def _rows(x: Tensor, dim: int, n: int) -> Tensor:
    """``dist_ops._scatter_rows`` (group in torch order): ``x`` as ``[n, chunk...]``."""
    rest = [s for i, s in enumerate(x.shape) if i != dim]
    return x.movedim(dim, 0).reshape(n, x.shape[dim] // n, *rest)


def _reduce_scatter(x: Tensor, rest: Sequence[Any], n: int) -> tuple[list[int], list[int]]:
    dim, reduce_op, _axes = int(rest[0]), rest[1], rest[2]
    chunks = _rows(x, dim, n)
    flat = chunks.reshape(-1, *chunks.shape[2:])
    launch = [] if flat.is_contiguous() else [_copy(flat)]
    out = torch.empty(chunks.shape[1:], dtype=x.dtype, device="meta")
    moved = out.movedim(0, dim)
    return launch, _avg(reduce_op, out) + ([] if moved.is_contiguous() else [_copy(moved)])


def _reduce_scatter_bucket(
    xs: list[Tensor], rest: Sequence[Any], n: int
) -> tuple[list[int], list[int]]:
    dims, reduce_op, _axes = rest
    chunked = [_rows(x, int(d), n) for x, d in zip(xs, dims, strict=True)]
    launch = [_copy(c) for c in chunked]  # each member's chunks straight into its flat row
    numel = sum(x.numel() for x in xs) // n
    wait = _avg(reduce_op, torch.empty(numel, dtype=xs[0].dtype, device="meta"))
    for c, d in zip(chunked, dims, strict=True):
        piece = torch.empty(c.shape[1:], dtype=c.dtype, device="meta").movedim(0, int(d))
        wait += [] if piece.is_contiguous() else [_copy(piece)]
    return launch, wait


def _all_to_all(x: Tensor, rest: Sequence[Any], n: int) -> tuple[list[int], list[int]]:
    return [_copy(x)], [_copy(x)]  # torch.stack of the chunks sent, torch.cat of those received


_RULES: dict[str, Any] = {
    "all_gather": _all_gather,
    "all_gather_bucket": _all_gather_bucket,
    "all_reduce": _all_reduce,
    "all_reduce_bucket": _all_reduce_bucket,
    "reduce_scatter": _reduce_scatter,
    "reduce_scatter_bucket": _reduce_scatter_bucket,
    "all_to_all": _all_to_all,
}
