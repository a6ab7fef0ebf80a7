"""``torch.autocast("spmd", dtype=torch.bfloat16)``: mixed precision on the virtual device.

PyTorch casts an op's inputs under autocast at a dispatch key per backend. For the PrivateUse1
backend nothing is registered there, so without this module the first op in an autocast region
fails (``aten::copy_`` has no ``Autocastspmd`` kernel). :func:`register` installs a fallthrough
for every op, and for the ops of PyTorch's CPU autocast policy (the device's programs run on the
CPU, so a loop gets what ``torch.autocast("cpu")`` gives the same model) a kernel that casts the
floating-point device tensors among the op's arguments, then runs the op with autocast off:

- *lower precision* (matmuls, linear layers, convolutions, attention): to the region's dtype;
- *fp32* (losses, products, decompositions, padding...): to float32;
- *promote* (``cat``, ``stack``, ``index_copy``): to the widest floating dtype among them.

float64 tensors and tensors of other devices are left as they are, as PyTorch does. The casts
are ordinary recorded ops, so the step's program holds them and shards them like any other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["FP32", "LOWER_PRECISION", "PROMOTE", "register"]

_KEY = "AutocastPrivateUse1"

#: PyTorch's CPU policy (aten/src/ATen/autocast_mode.cpp), as ``name`` or ``name.overload``.
LOWER_PRECISION = (
    "conv1d", "conv1d.padding", "conv2d", "conv2d.padding", "conv3d", "conv3d.padding", "bmm",
    "mm", "linalg_vecdot", "baddbmm", "addmm", "_addmm_activation", "addbmm", "linear",
    "_convolution.deprecated", "matmul", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "prelu", "scaled_dot_product_attention",
)  # fmt: skip
FP32 = (
    "avg_pool3d", "binary_cross_entropy", "grid_sampler", "polar", "prod", "prod.dim_int",
    "quantile", "quantile.scalar", "nanquantile", "nanquantile.scalar", "cdist", "trace",
    "cholesky", "inverse", "pinverse", "max_pool3d", "adaptive_avg_pool3d", "reflection_pad1d",
    "reflection_pad2d", "replication_pad1d", "replication_pad2d", "replication_pad3d",
    "mse_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss",
    "poisson_nll_loss", "smooth_l1_loss", "cross_entropy_loss", "l1_loss", "huber_loss",
    "margin_ranking_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "kl_div", "multilabel_margin_loss", "binary_cross_entropy_with_logits", "linalg_solve",
    "linalg_cholesky", "linalg_svdvals", "linalg_eigvalsh", "linalg_inv", "linalg_qr", "qr",
    "svd", "linalg_svd", "linalg_eigh",
)  # fmt: skip
PROMOTE = ("stack", "cat", "index_copy")


def _eligible(x: Any) -> bool:
    return (
        isinstance(x, torch.Tensor)
        and x.is_floating_point()
        and x.dtype is not torch.float64
        and x.device.type == torch._C._get_privateuse1_backend_name()
    )


def _cast(x: Any, dtype: torch.dtype) -> Any:
    if _eligible(x):
        return x if x.dtype is dtype else x.to(dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(v, dtype) for v in x)
    return x


def _floats(x: Any) -> list[torch.dtype]:
    if _eligible(x):
        return [x.dtype]
    if isinstance(x, (list, tuple)):
        return [d for v in x for d in _floats(v)]
    return []


def _kernel(op: Any, policy: str) -> Callable[..., Any]:
    excluded = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, _KEY))

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        del keyset
        if policy == "lower":
            dtype = torch.get_autocast_dtype(torch._C._get_privateuse1_backend_name())
        elif policy == "fp32":
            dtype = torch.float32
        else:
            found = _floats((args, tuple(kwargs.values())))
            dtype = found[0] if found else torch.float32
            for d in found[1:]:
                dtype = torch.promote_types(dtype, d)
        with torch._C._ExcludeDispatchKeyGuard(excluded):
            return op(*_cast(args, dtype), **{k: _cast(v, dtype) for k, v in kwargs.items()})

    return kernel


def register(lib: torch.library.Library, fallback: torch.library.Library) -> None:
    """Install the autocast kernels in ``lib`` (an ``aten`` IMPL library) and the fallthrough
    for every other op in ``fallback`` (a ``_`` IMPL library); both must be kept alive."""
    fallback.fallback(torch.library.fallthrough_kernel, _KEY)
    for names, policy in ((LOWER_PRECISION, "lower"), (FP32, "fp32"), (PROMOTE, "promote")):
        for name in names:
            packet, _, overload = name.partition(".")
            op = getattr(getattr(torch.ops.aten, packet, None), overload or "default", None)
            if op is None:  # not in this torch release
                continue
            lib.impl(name, _kernel(op, policy), _KEY, with_keyset=True)
