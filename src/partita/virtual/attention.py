"""``F.scaled_dot_product_attention`` on the virtual device: recorded as one attention op.

``aten::scaled_dot_product_attention`` is a composite op: PyTorch picks a fused kernel for CPU
and CUDA tensors in C++, and every other device (the virtual device is PyTorch's PrivateUse1
backend) gets the *math* decomposition — scale, ``expand``, a ``reshape`` that merges batch and
heads into one dim, ``bmm``, softmax, ``bmm``. Recorded that way, the step's program differs
from ``train_step``'s: the merged ``(batch heads)`` dim can carry the heads' mesh axis only when
the batch is fully split (propagation's invariant 6), so with the batch over ``data`` and the
heads over ``model`` every attention reshape gathers over ``model`` (8 extra all-gathers, +256
KiB per device on the bench's 2-layer GPT).

:func:`sdpa` is the op's kernel for the device's autograd key (``AutogradPrivateUse1``): where
PyTorch's CPU dispatcher would pick the flash kernel, it calls
``aten._scaled_dot_product_flash_attention_for_cpu`` — the op the CPU eager run and
``train_step``'s trace use, whose derivative (``..._backward``) autograd records for the
backward — so the recording holds one op per attention (and a copy to the contiguous layout
``partita::sdpa`` returns), which capture turns into ``partita::sdpa`` with its own sharding
rule. Anything the CPU flash kernel does not take
(dropout, grouped-query broadcasting, other ranks or dtypes, flash switched off) runs PyTorch's
own math decomposition, as before.
"""

from __future__ import annotations

from typing import Any

import torch

from partita.capture import ops as partita_ops

__all__ = ["flash_applies", "sdpa"]

_aten = torch.ops.aten
_FLASH_DTYPES = frozenset({torch.float32, torch.float64, torch.bfloat16, torch.float16})


def flash_applies(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    enable_gqa: bool,
) -> bool:
    """Whether PyTorch's CPU dispatcher would run these arguments on its flash kernel (a
    conservative copy of ``use_flash_attention_cpp``'s checks)."""
    if dropout_p > 0.0 or enable_gqa or not torch.backends.cuda.flash_sdp_enabled():
        return False
    if not (q.dim() == k.dim() == v.dim() == 4):
        return False
    if not (q.dtype == k.dtype == v.dtype and q.dtype in _FLASH_DTYPES):
        return False
    if not (q.shape[:2] == k.shape[:2] == v.shape[:2]):
        return False  # broadcasting batch or heads (grouped-query) is the math path's
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]) or 0 in (q.shape[-2], k.shape[-2]):
        return False
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        return False
    if attn_mask is not None and (
        attn_mask.dim() not in (2, 4)
        or attn_mask.dtype not in (torch.bool, q.dtype)
        or attn_mask.requires_grad  # the attention op gives no gradient to its mask
    ):
        return False
    return True


class _Attention(torch.autograd.Function):
    """``partita::sdpa`` forward, ``partita::sdpa_backward`` backward, on the device's tensors."""

    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None,
        is_causal: bool,
        scale: float | None,
    ) -> torch.Tensor:
        out, lse = partita_ops.sdpa(query, key, value, attn_mask, 0.0, is_causal, scale)
        ctx.save_for_backward(query, key, value, out, lse, attn_mask)
        ctx.is_causal, ctx.scale = is_causal, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, out, lse, attn_mask = ctx.saved_tensors
        gq, gk, gv = partita_ops.sdpa_backward(
            grad_out, query, key, value, out, lse, attn_mask, 0.0, ctx.is_causal, ctx.scale
        )
        return gq, gk, gv, None, None, None


def sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Any:
    """``aten::scaled_dot_product_attention`` for virtual-device tensors (see the module
    docstring)."""
    if flash_applies(query, key, value, attn_mask, dropout_p, enable_gqa):
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            # What PyTorch's CPU path does before its flash kernel, which takes float masks.
            attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(
                attn_mask.logical_not(), float("-inf")
            )
        return _Attention.apply(query, key, value, attn_mask, is_causal, scale)
    return _aten.scaled_dot_product_attention.default.decompose(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )
