"""The decomposition table of capture: which aten ops a captured program may contain.

The choice. Start from ``torch._decomp.core_aten_decompositions()`` (Core ATen IR: about 180
ops, all functional; built without its entries that ``make_fx`` applies anyway, see
``_core_table``) and keep, undecomposed, the high-level ops in :data:`KEPT_OPS`. Why: each
of them has a *simple* sharding rule (a batch dim that passes through, a normalised or reduced
dim that needs replication, a windowed spatial dim) and a fast fused kernel, while its
decomposition is a dozen elementwise ops and reductions whose rules would have to rediscover
the same structure (and whose per-device kernels are slower). The backward ops are kept for
the same reason: a training step's backward is then as easy to shard as its forward.

Device-specific attention kernels (``aten._scaled_dot_product_flash_attention_for_cpu`` and
its backward, which the CPU dispatcher picks for ``F.scaled_dot_product_attention``) are
rewritten to the device-neutral ``partita::sdpa`` / ``partita::sdpa_backward`` (see
:mod:`partita.capture.ops`), so the rules name one attention op. When the dispatcher picks the
math fallback (unsupported mask or dtype) attention decomposes to matmuls and softmax instead.

``as_strided`` (and its scatter) that reads a contiguous tensor whole and in order is traced as
the ``reshape`` it is (:data:`AS_STRIDED_OPS`); other calls stay as themselves.

Ops that are views (``view``, ``t``, ``transpose``, ``split`` ...) are not decomposed here,
not even those the core table decomposes (:data:`VIEW_OPS`);
:mod:`partita.capture.normalize` rewrites them after tracing. This module does not trace.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache
from typing import Any, cast

import torch
from torch._decomp import _core_aten_decompositions_post_autograd
from torch._export.utils import _get_decomp_for_cia, _is_preservable_cia_op
from torch.export.decomp_utils import PRESERVED_ATEN_CIA_OPS

from partita.capture import ops as partita_ops
from partita.capture.half_reductions import HALF_REDUCTION_OPS

__all__ = [
    "AS_STRIDED_OPS",
    "DROPPED_CHECKS",
    "KEPT_OPS",
    "NN_KERNEL_OPS",
    "SDPA_OPS",
    "VIEW_OPS",
    "decomposition_table",
]

aten = torch.ops.aten

#: High-level ops captured as themselves (not decomposed), sorted by name. Ops not listed here
#: and not in Core ATen IR are decomposed by the core table.
KEPT_OPS: tuple[torch._ops.OpOverload, ...] = tuple(
    sorted(
        (
            aten._log_softmax.default,
            aten._log_softmax_backward_data.default,
            aten._native_batch_norm_legit.default,
            aten._native_batch_norm_legit.no_stats,
            aten._native_batch_norm_legit_functional.default,
            aten._native_batch_norm_legit_no_training.default,
            aten._softmax.default,
            aten._softmax_backward_data.default,
            aten.avg_pool2d.default,
            aten.avg_pool2d_backward.default,
            aten.convolution.default,
            aten.convolution_backward.default,
            aten.embedding.default,
            aten.embedding_dense_backward.default,
            aten.gelu.default,
            aten.gelu_backward.default,
            aten.max_pool2d_with_indices.default,
            aten.max_pool2d_with_indices_backward.default,
            aten.native_batch_norm.default,
            aten.native_batch_norm_backward.default,
            aten.native_group_norm.default,
            aten.native_group_norm_backward.default,
            aten.native_layer_norm.default,
            aten.native_layer_norm_backward.default,
            aten.nll_loss_backward.default,
            aten.nll_loss_forward.default,
        ),
        key=str,
    )
)


def _sdpa_cpu(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return partita_ops.sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale)


def _sdpa_cpu_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return partita_ops.sdpa_backward(
        grad_out, query, key, value, out, logsumexp, attn_mask, dropout_p, is_causal, scale
    )


#: Data-dependent checks a captured program does not contain. ``aten._linalg_check_errors``
#: makes ``linalg.inv``, ``solve``, ``cholesky``... raise in eager when its ``info`` tensor
#: reports a singular or non-positive-definite input; whether it raises depends on values a
#: trace cannot see, so a captured program returns what the ``*_ex`` variant returns (inf or
#: NaN where eager would raise). Code that must detect it calls ``torch.linalg.inv_ex`` (etc.)
#: and reads ``info``. Capture drops these ops as they are dispatched (``functionalize``).
DROPPED_CHECKS: frozenset[torch._ops.OpOverload] = frozenset({aten._linalg_check_errors.default})

#: Device-specific attention kernels and the neutral partita op each becomes.
SDPA_OPS: dict[torch._ops.OpOverload, Callable[..., Any]] = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: _sdpa_cpu,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _sdpa_cpu_backward,
}


def _is_whole_reshape(
    x: torch.Tensor, size: list[int], stride: list[int], offset: int | None
) -> bool:
    """Whether ``as_strided(x, size, stride, offset)`` reads every element of ``x`` in order:
    ``x`` is contiguous from its storage offset and ``size``/``stride`` describe a contiguous
    tensor of the same numel (strides of size-1 dims do not matter) at that offset."""
    if not x.is_contiguous() or (offset is not None and offset != x.storage_offset()):
        return False
    if math.prod(size) != x.numel() or len(size) != len(stride):
        return False
    want = 1
    for n, st in zip(reversed(size), reversed(stride), strict=True):
        if n != 1 and st != want:
            return False
        want *= n
    return True


def _as_strided(
    x: torch.Tensor, size: list[int], stride: list[int], storage_offset: int | None = None
) -> Any:
    if _is_whole_reshape(x, size, stride, storage_offset):
        return aten.reshape.default(x, size)
    return NotImplemented  # traced as itself (no rule: docs/rules.md, "Not covered")


def _as_strided_scatter(
    x: torch.Tensor,
    src: torch.Tensor,
    size: list[int],
    stride: list[int],
    storage_offset: int | None = None,
) -> Any:
    if _is_whole_reshape(x, size, stride, storage_offset):
        return aten.reshape.default(src, list(x.shape)).to(x.dtype)
    return NotImplemented


def _transformer_encoder_layer_fwd(
    src: torch.Tensor,
    embed_dim: int,
    num_heads: int,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor,
    proj_weight: torch.Tensor,
    proj_bias: torch.Tensor,
    use_gelu: bool,
    norm_first: bool,
    eps: float,
    norm_weight_1: torch.Tensor,
    norm_bias_1: torch.Tensor,
    norm_weight_2: torch.Tensor,
    norm_bias_2: torch.Tensor,
    ffn_weight_1: torch.Tensor,
    ffn_bias_1: torch.Tensor,
    ffn_weight_2: torch.Tensor,
    ffn_bias_2: torch.Tensor,
    mask: torch.Tensor | None = None,
    mask_type: int | None = None,
) -> torch.Tensor:
    """``nn.TransformerEncoderLayer``'s inference fast path (eval, no grad) as the ops of its
    slow path. The kernel has no sharding rule and no backward; its math is a linear, masked
    softmax attention, layer norms and a two-linear MLP. Mask semantics are the kernel's: a
    float mask counts as a boolean one (nonzero = masked), a key padding mask (``mask_type``
    1) is ``[B, S]``, an attention mask ``[L, S]`` (0) or ``[B, H, L, S]`` (2); a query whose
    keys are all masked gives NaN, as in the kernel."""
    F = torch.nn.functional  # noqa: N806 - the PyTorch convention
    b, t, _ = src.shape
    head = embed_dim // num_heads

    def attention(x: torch.Tensor) -> torch.Tensor:
        qkv = F.linear(x, qkv_weight, qkv_bias).view(b, t, 3, num_heads, head)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        scores = (q / math.sqrt(head)) @ k.transpose(-2, -1)
        if mask is not None:
            m = mask if mask.dtype == torch.bool else mask != 0
            m = m[:, None, None, :] if mask_type == 1 else m
            scores = scores.masked_fill(m, float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, embed_dim)
        return F.linear(out, proj_weight, proj_bias)

    def mlp(x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, ffn_weight_1, ffn_bias_1)
        return F.linear(F.gelu(h) if use_gelu else F.relu(h), ffn_weight_2, ffn_bias_2)

    def norm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (embed_dim,), w, bias, eps)

    if norm_first:
        x = src + attention(norm(src, norm_weight_1, norm_bias_1))
        return x + mlp(norm(x, norm_weight_2, norm_bias_2))
    x = norm(src + attention(src), norm_weight_1, norm_bias_1)
    return norm(x + mlp(x), norm_weight_2, norm_bias_2)


def _embedding_renorm(
    weight: torch.Tensor, indices: torch.Tensor, max_norm: float, norm_type: float
) -> torch.Tensor:
    """``nn.Embedding(max_norm=...)``'s renormalisation (functional): every row that
    ``indices`` names and whose ``norm_type``-norm exceeds ``max_norm`` is scaled by
    ``max_norm / (norm + 1e-7)``, as the kernel does; the others are kept. As a scatter, a
    norm and a ``where``, the table's rows can stay split."""
    named = torch.zeros(weight.shape[0], dtype=torch.bool, device=weight.device)
    named = named.index_fill(0, indices.reshape(-1), True)
    norm = torch.linalg.vector_norm(weight, norm_type, dim=1)
    scale = torch.where(named & (norm > max_norm), max_norm / (norm + 1e-7), 1.0)
    return weight * scale.to(weight.dtype)[:, None]


def _weight_norm_interface_backward(
    grad_w: torch.Tensor,
    saved_v: torch.Tensor,
    saved_g: torch.Tensor,
    saved_norms: torch.Tensor,
    dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of weight norm ``w = g * v / ||v||`` (the norm over every dim but
    ``dim``, ``g`` and the norms keeping size 1 there): ``grad_g = sum(grad_w * v) / ||v||``,
    ``grad_v = g / ||v|| * (grad_w - v * grad_g / ||v||)``. Its forward already decomposes
    (torch's table); the backward kernel has no rule."""
    dims = [d for d in range(saved_v.ndim) if d != dim % saved_v.ndim]
    grad_g = (grad_w * saved_v).sum(dims, keepdim=True) / saved_norms
    grad_v = saved_g / saved_norms * (grad_w - saved_v * (grad_g / saved_norms))
    return grad_v, grad_g.to(saved_g.dtype)


#: Kernels of ``torch.nn`` modules without a sharding rule, rewritten to the ops they compute,
#: which have rules: ``nn.TransformerEncoderLayer``'s inference fast path (eval mode, no grad;
#: ``nn.MultiheadAttention`` skips its own fast path while ``make_fx`` traces, this layer does
#: not), ``nn.Embedding(max_norm=...)``'s in-place renormalisation of the looked-up rows, and
#: the backward of ``torch.nn.utils.parametrizations.weight_norm``.
def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``take`` as an index of the flattened tensor. The core decomposition writes
    ``flat[index]``, which turns a 0-d index into a Python int (a value capture cannot read)."""
    return aten.index.Tensor(x.reshape(-1), [index])


NN_KERNEL_OPS: dict[torch._ops.OpOverload, Callable[..., Any]] = {
    aten.take.default: _take,
    aten._transformer_encoder_layer_fwd.default: _transformer_encoder_layer_fwd,
    aten.embedding_renorm.default: _embedding_renorm,
    aten._weight_norm_interface_backward.default: _weight_norm_interface_backward,
}


#: ``as_strided`` that only re-reads a contiguous tensor in order is a ``reshape`` (and its
#: scatter overwrites the whole base). ATen emits such calls where the program has none: a
#: 1x1 ``adaptive_avg_pool2d`` of a channels-last-strided input restrides its result with
#: ``as_strided_`` (Swin's and ConvNeXt-like poolers of a transposed ``[B, L, C]``), and
#: autograd's copy of that view becomes ``as_strided_scatter``. Any other call stays as
#: itself.
AS_STRIDED_OPS: dict[torch._ops.OpOverload, Callable[..., Any]] = {
    aten.as_strided.default: _as_strided,
    aten.as_strided_copy.default: _as_strided,
    aten.as_strided_scatter.default: _as_strided_scatter,
}


#: View ops the core table decomposes that are traced as themselves: ``normalize`` rewrites
#: each to the same op its decomposition gives (``permute``, ``reshape``, ``slice`` ...), and
#: tracing a decomposition dispatches every such op twice (a GPT step has hundreds).
VIEW_OPS: tuple[torch._ops.OpOverload, ...] = (
    aten._unsafe_view.default,
    aten.detach.default,
    aten.split.Tensor,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.t.default,
    aten.transpose.int,
    aten.unbind.int,
)


#: Device types whose kernels decide whether ``make_fx`` decomposes a composite op itself
#: (``autograd_would_have_decomposed``: it does unless the op has a kernel for its tensors'
#: device).
_DEVICE_TYPES = (
    "cpu", "cuda", "hip", "meta", "mps", "xpu", "hpu", "xla", "lazy", "ipu", "mtia", "maia",
    "ve", "fpga", "privateuseone",
)  # fmt: skip


def _overload(name: str) -> torch._ops.OpOverload:
    """``torch.ops.aten.matmul.out`` for the dispatcher's name ``aten::matmul.out``."""
    namespace, rest = name.split("::")
    packet, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload or "default")


def _composite_ops_with_kernels() -> list[torch._ops.OpOverload]:
    """The ``CompositeImplicitAutograd`` ops that also have a kernel for some device: the
    C++ ones (names from the dispatcher) and those whose composite kernel is registered in
    Python (``py_impl``, which made their overload objects already)."""
    cia = torch._C.DispatchKey.CompositeImplicitAutograd
    with_kernels: set[str] = set()
    for device in _DEVICE_TYPES:
        key = torch._C._dispatch_key_for_device(device)
        with_kernels.update(torch._C._dispatch_get_registrations_for_dispatch_key(key))
    composite = set(torch._C._dispatch_get_registrations_for_dispatch_key(cia.name))
    ops = [_overload(name) for name in sorted(composite & with_kernels)]
    for name in list(torch.ops._dir):
        namespace = getattr(torch.ops, name)
        for packet in list(vars(namespace).values()):
            if isinstance(packet, torch._ops.OpOverloadPacket):
                ops.extend(
                    op
                    for op in list(vars(packet).values())
                    if isinstance(op, torch._ops.OpOverload)
                    and cia in op.py_kernels
                    and op.name() in with_kernels
                )
    return ops


def _core_table() -> dict[torch._ops.OpOverload, Callable[..., Any]]:
    """What ``torch._decomp.core_aten_decompositions()`` decomposes, built in a tenth of the
    time (0.02 s instead of 0.16 s of the first trace of a process).

    The core table is the explicit decompositions plus an entry for every functional
    ``CompositeImplicitAutograd`` op (about 500), and building it enumerates every overload
    of every op. An entry for a composite op only matters when the op has a kernel for its
    tensors' device: without one, ``make_fx`` decomposes an op that reaches it by the same
    composite kernel when the op is not in the table (``proxy_call``'s
    ``autograd_would_have_decomposed``), and functionalization did so already. So this table
    keeps the entries of the composite ops that have a device kernel (about 30: ``matmul``,
    ``dropout``, ``upsample_*``...) and leaves the others to ``make_fx``: the traced programs
    are the same (``tests/test_capture_decompositions.py`` checks both, op by op).
    """
    table = _core_aten_decompositions_post_autograd()
    for op in _composite_ops_with_kernels():
        if op not in table and op not in PRESERVED_ATEN_CIA_OPS and _is_preservable_cia_op(op):
            table[op] = _get_decomp_for_cia(op)
    # torch types the table by OperatorBase; every key here is an OpOverload
    return cast("dict[torch._ops.OpOverload, Callable[..., Any]]", table)


@cache
def _table() -> dict[torch._ops.OpOverload, Callable[..., Any]]:
    table = _core_table()
    for op in (*KEPT_OPS, *VIEW_OPS):
        table.pop(op, None)
    table.update(SDPA_OPS)
    table.update(AS_STRIDED_OPS)
    table.update(NN_KERNEL_OPS)
    table.update(HALF_REDUCTION_OPS)
    return table


def decomposition_table() -> dict[torch._ops.OpOverload, Callable[..., Any]]:
    """The table to pass to ``make_fx(..., decomposition_table=...)`` (a fresh copy).

    Example:
        >>> table = decomposition_table()
        >>> torch.ops.aten.native_layer_norm_backward.default in table
        False
    """
    return dict(_table())
