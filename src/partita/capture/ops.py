"""partita's own custom ops that appear in captured programs.

- ``partita::annotate(Tensor x, int key) -> Tensor``: a sharding annotation. Returns a copy of
  ``x`` (custom ops may not alias their inputs); the gradient passes through unchanged. ``key``
  indexes the annotation table of :mod:`partita.capture.annotate`.
- ``partita::sdpa`` / ``partita::sdpa_backward``: scaled-dot-product attention (and its
  gradient) as one device-neutral op, so that sharding rules are written once instead of for
  each of ATen's device-specific fused kernels. Same arguments and results as
  ``aten._scaled_dot_product_flash_attention_for_cpu`` (and ``..._backward``), with
  ``attn_mask`` and ``scale`` positional: ``(out [..., L, Ev], logsumexp [..., L])``. On CPU
  they call ATen's fused CPU kernels; elsewhere they run the same math with plain tensor ops.

Each op has a fake impl (shapes only, for tracing) and a vmap rule (for the simulated mesh,
which runs a per-device program over a stack of devices). This module does not decide where
the ops go; ``decompositions`` and ``annotate`` put them in graphs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, overload

import torch
from torch import Tensor

from partita.errors import UnsupportedOpError

__all__ = ["annotate_op", "sdpa", "sdpa_backward", "sdpa_backward_cpu", "sdpa_cpu"]

_SDPA_SCHEMA = (
    "(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, float dropout_p, "
    "bool is_causal, float? scale) -> (Tensor, Tensor)"
)
_SDPA_BWD_SCHEMA = (
    "(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, Tensor logsumexp, "
    "Tensor? attn_mask, float dropout_p, bool is_causal, float? scale) "
    "-> (Tensor, Tensor, Tensor)"
)


# --- annotate ------------------------------------------------------------------------------


@torch.library.custom_op(
    "partita::annotate", mutates_args=(), schema="(Tensor x, int key) -> Tensor"
)
def annotate_op(x: Tensor, key: int) -> Tensor:
    return x.clone()


@annotate_op.register_fake
def _(x: Tensor, key: int) -> Tensor:
    return torch.empty_like(x)


#: An annotation's key -> the key of the annotation of its gradient, for the annotations made
#: with ``gradient=True`` (``capture.annotate`` fills it while a trace runs, and empties it
#: after): the backward of such an annotate node is an annotate node of the gradient.
GRADIENT_KEYS: dict[int, int] = {}


def _annotate_setup(ctx: Any, inputs: tuple[Tensor, int], output: Tensor) -> None:
    ctx.key = inputs[1]


def _annotate_backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
    key = GRADIENT_KEYS.get(ctx.key)
    return (grad if key is None else annotate_op(grad, key)), None


annotate_op.register_autograd(_annotate_backward, setup_context=_annotate_setup)


@annotate_op.register_vmap
def _(
    info: object, in_dims: tuple[int | None, ...], x: Tensor, key: int
) -> tuple[Tensor, int | None]:
    return annotate_op(x, key), in_dims[0]


# --- scaled-dot-product attention ------------------------------------------------------------


def _scores(
    q: Tensor, k: Tensor, mask: Tensor | None, is_causal: bool, scale: float | None
) -> Tensor:
    """Masked, scaled attention scores ``q k^T`` in float32 or wider."""
    s = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q, k.transpose(-2, -1)) * s
    if is_causal:
        lq, lk = q.shape[-2], k.shape[-2]
        keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if mask is not None:
        scores = (
            scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        )
    return scores


def _heads_inner_empty(like: Tensor, shape: Sequence[int]) -> Tensor:
    """An empty ``[..., H, L, E]`` tensor laid out as ``[..., L, H, E]`` (heads inside
    positions), the layout ATen's fused CPU kernels write ``out`` and the gradients in: a
    model's ``out.transpose(-3, -2).reshape(..., L, H * E)`` is then a view, not a copy.
    Below rank 3 (no heads dim), contiguous."""
    if len(shape) < 3:
        return like.new_empty(shape)
    *lead, h, length, e = shape
    return like.new_empty((*lead, length, h, e)).transpose(-3, -2)


def _as_heads_inner(t: Tensor) -> Tensor:
    """``t`` in the layout of :func:`_heads_inner_empty` (the fakes'): as is when it already
    is (the fused CPU kernels' results), else copied into it."""
    if t.dim() < 3:
        return t.contiguous()
    *lead, h, length, e = t.shape
    strides = torch.empty((*lead, length, h, e), device="meta").stride()
    if t.stride() == (*strides[:-3], strides[-2], strides[-3], strides[-1]):
        return t
    return _heads_inner_empty(t, t.shape).copy_(t)


@torch.library.custom_op("partita::sdpa", mutates_args=(), schema=_SDPA_SCHEMA)
def sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
) -> tuple[Tensor, Tensor]:
    # Reference math for devices without a kernel mapping (dropout is not supported here).
    if dropout_p:
        raise UnsupportedOpError(
            f"partita::sdpa: dropout_p={dropout_p} on a non-CPU device; partita's reference "
            f"attention has no dropout. Use dropout_p=0.0 here, or run on CPU."
        )
    scores = _scores(query, key, attn_mask, is_causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), value)
    return _as_heads_inner(out), lse


@sdpa.register_kernel("cpu")
def sdpa_cpu(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
) -> tuple[Tensor, Tensor]:
    """``partita::sdpa``'s CPU kernel (the fused executor calls it directly)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )
    # the fake's strides: a compiled caller (Inductor) relies on them
    return _as_heads_inner(out), lse.contiguous()


@sdpa.register_fake
def _(query, key, value, attn_mask, dropout_p, is_causal, scale):
    out = _heads_inner_empty(query, (*query.shape[:-1], value.shape[-1]))
    lse = query.new_empty(query.shape[:-1], dtype=torch.float32)
    return out, lse


@torch.library.custom_op("partita::sdpa_backward", mutates_args=(), schema=_SDPA_BWD_SCHEMA)
def sdpa_backward(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    logsumexp: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    if dropout_p:
        raise UnsupportedOpError(
            f"partita::sdpa_backward: dropout_p={dropout_p} on a non-CPU device; partita's "
            f"reference attention has no dropout. Use dropout_p=0.0 here, or run on CPU."
        )
    s = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    probs = torch.exp(_scores(query, key, attn_mask, is_causal, scale) - logsumexp.unsqueeze(-1))
    grad_v = torch.matmul(probs.transpose(-2, -1), grad_out)
    grad_p = torch.matmul(grad_out, value.transpose(-2, -1))
    delta = (grad_out * out).sum(-1, keepdim=True)
    grad_s = probs * (grad_p - delta) * s
    grad_q, grad_k = torch.matmul(grad_s, key), torch.matmul(grad_s.transpose(-2, -1), query)
    return _as_heads_inner(grad_q), _as_heads_inner(grad_k), _as_heads_inner(grad_v)


@sdpa_backward.register_kernel("cpu")
def sdpa_backward_cpu(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    logsumexp: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``partita::sdpa_backward``'s CPU kernel (the fused executor calls it directly)."""
    gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, dropout_p, is_causal,
        attn_mask=attn_mask, scale=scale,
    )  # fmt: skip
    return _as_heads_inner(gq), _as_heads_inner(gk), _as_heads_inner(gv)


@sdpa_backward.register_fake
def _(grad_out, query, key, value, out, logsumexp, attn_mask, dropout_p, is_causal, scale):
    # the layout both kernels return (empty_like would keep a permuted input's strides)
    return tuple(_heads_inner_empty(t, t.shape) for t in (query, key, value))


# --- vmap: fold the vmapped dim into the leading batch dim -----------------------------------


@overload
def _fold(x: Tensor, dim: int | None, size: int) -> Tensor: ...
@overload
def _fold(x: None, dim: int | None, size: int) -> None: ...
def _fold(x: Tensor | None, dim: int | None, size: int) -> Tensor | None:
    """Move the vmapped dim to the front (broadcasting unbatched values) and merge it."""
    if x is None:
        return None
    x = x.unsqueeze(0).expand(size, *x.shape) if dim is None else x.movedim(dim, 0)
    return x.reshape(size * x.shape[1], *x.shape[2:]) if x.dim() > 1 else x


def _fold_mask(
    mask: Tensor | None, dim: int | None, size: int, q: Tensor, k: Tensor
) -> Tensor | None:
    """A mask that broadcasts against the folded ``q k^T`` of shape ``[size * b, ..., Lq, Lk]``."""
    if mask is None or (dim is None and mask.dim() <= 2):
        return mask  # broadcasts as is
    per_example = (q.shape[0] // size, *q.shape[1:-1], k.shape[-2])
    mask = mask.unsqueeze(0).expand(size, *mask.shape) if dim is None else mask.movedim(dim, 0)
    while mask.dim() < 1 + len(per_example):  # an example's mask broadcasts from the right:
        mask = mask.unsqueeze(1)  # its missing leading dims go after the devices dim
    return mask.expand(size, *per_example).reshape(size * per_example[0], *per_example[1:])


def _unfold(x: Tensor, size: int) -> Tensor:
    return x.reshape(size, x.shape[0] // size, *x.shape[1:])


def _heads_fold(tensors: Sequence[tuple[Tensor | None, int | None, int]], size: int) -> bool:
    """Whether to fold the vmapped dim into the heads dim rather than the batch dim: when
    that copies fewer of the tensors. It is a view when the devices sit just outside the
    heads in memory (the devices of a ``model`` axis holding the heads of one projection
    side by side); the fused kernel then reads them in place and writes its result with
    those devices' heads side by side, as the unsharded result is laid out. ``tensors``:
    ``(t, dim, heads)``, ``heads`` the heads dim counted from the end (per device
    ``[B, H, L, E]``, logsumexp ``[B, H, L]``)."""
    batched = [(t, d, h) for t, d, h in tensors if t is not None and d is not None]
    if size == 1 or not batched or any(t.dim() + h != 2 for t, _, h in batched):
        return False

    def merges(x: Tensor, i: int) -> bool:  # dims i, i + 1 flatten as a view
        return x.shape[i + 1] == 1 or x.stride(i) == x.shape[i + 1] * x.stride(i + 1)

    heads = sum(not merges(t.movedim(d, h - 1), t.dim() + h - 1) for t, d, h in batched)
    batch = sum(not merges(t.movedim(d, 0), 0) for t, d, _ in batched)
    return heads < batch


def _fold_heads(x: Tensor, dim: int | None, size: int, heads_dim: int) -> Tensor:
    """The vmapped dim merged into the heads dim (``heads_dim`` from the end) as its outer
    part; an unbatched ``x`` is broadcast."""
    if dim is None:
        x = x.unsqueeze(heads_dim - 1)
        shape = list(x.shape)
        shape[heads_dim - 1] = size
        x = x.expand(shape)
    else:
        x = x.movedim(dim, heads_dim - 1)
    return x.flatten(heads_dim - 1, heads_dim)


def _unfold_heads(x: Tensor, size: int, heads_dim: int) -> Tensor:
    d = x.dim() + heads_dim
    return x.unflatten(d, (size, x.shape[d] // size)).movedim(d, 0)


@sdpa.register_vmap
def _(info, in_dims, query, key, value, attn_mask, dropout_p, is_causal, scale):
    n = info.batch_size
    qkv = (query, key, value)
    simple_mask = attn_mask is None or (in_dims[3] is None and attn_mask.dim() <= 2)
    if simple_mask and _heads_fold([(t, d, -3) for t, d in zip(qkv, in_dims[:3], strict=True)], n):
        q, k, v = (_fold_heads(t, d, n, -3) for t, d in zip(qkv, in_dims[:3], strict=True))
        out, lse = sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale)
        return (_unfold_heads(out, n, -3), _unfold_heads(lse, n, -2)), (0, 0)
    q, k, v = (_fold(t, d, n) for t, d in zip(qkv, in_dims[:3], strict=True))
    mask = _fold_mask(attn_mask, in_dims[3], n, q, k)
    out, lse = sdpa(q, k, v, mask, dropout_p, is_causal, scale)
    return (_unfold(out, n), _unfold(lse, n)), (0, 0)


@sdpa_backward.register_vmap
def _(
    info,
    in_dims,
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    attn_mask,
    dropout_p,
    is_causal,
    scale,
):
    n = info.batch_size
    tensors = (grad_out, query, key, value, out, logsumexp)
    heads = (-3, -3, -3, -3, -3, -2)
    simple_mask = attn_mask is None or (in_dims[6] is None and attn_mask.dim() <= 2)
    if simple_mask and _heads_fold(list(zip(tensors, in_dims[:6], heads, strict=True)), n):
        folded = [
            _fold_heads(t, d, n, h) for t, d, h in zip(tensors, in_dims[:6], heads, strict=True)
        ]
        grads = sdpa_backward(*folded, attn_mask, dropout_p, is_causal, scale)
        return tuple(_unfold_heads(g, n, -3) for g in grads), (0, 0, 0)
    folded = [_fold(t, d, n) for t, d in zip(tensors, in_dims[:6], strict=True)]
    mask = _fold_mask(attn_mask, in_dims[6], n, folded[1], folded[2])
    grads = sdpa_backward(*folded, mask, dropout_p, is_causal, scale)
    return tuple(_unfold(g, n) for g in grads), (0, 0, 0)
