"""``torch.amp.GradScaler`` on the virtual device: its two CUDA kernels as ordinary ops.

Loss scaling (float16 training) calls two fused kernels that have no meta kernel and no
sharding rule: ``_amp_foreach_non_finite_check_and_unscale_`` (multiply every gradient by the
inverse scale, and set ``found_inf`` if any element is not finite) and ``_amp_update_scale_``
(back the scale off after an overflow, grow it after ``growth_interval`` clean steps).
Registered at the device's autograd key, :func:`unscale_` and :func:`update_scale_` compute
the same with elementwise ops and reductions, so the recording holds ops the partitioner
knows (``found_inf`` is an ``any`` over every shard, one all-reduce) and the scale follows the
CPU kernel step for step. ``scaler.step(opt)`` reads ``found_inf`` with ``.item()``, as on any
device, so a step with a GradScaler runs as two programs (forward, backward and unscale; then
the optimizer's update).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["unscale_", "update_scale_"]


def unscale_(
    grads: Sequence[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> None:
    """``torch._amp_foreach_non_finite_check_and_unscale_``: ``g *= inv_scale`` for every
    gradient, and ``found_inf = 1`` if any gradient holds an inf or a NaN."""
    for grad in grads:
        bad = grad.isfinite().logical_not().any().to(found_inf.dtype)
        found_inf.copy_(torch.maximum(found_inf, bad))
        grad.mul_(inv_scale.to(grad.dtype))


def update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> torch.Tensor:
    """``torch._amp_update_scale_``, as its CPU kernel: after an overflow the scale is
    multiplied by ``backoff_factor`` and the tracker reset; otherwise the tracker counts clean
    steps, and at ``growth_interval`` the scale grows by ``growth_factor`` (if that stays
    finite) and the tracker restarts."""
    overflow = found_inf > 0
    clean_steps = growth_tracker + 1
    grown = scale * growth_factor
    grow = overflow.logical_not() & (clean_steps == growth_interval) & grown.isfinite()
    reset = overflow | (clean_steps == growth_interval)
    new_scale = torch.where(overflow, scale * backoff_factor, torch.where(grow, grown, scale))
    growth_tracker.copy_(torch.where(reset, torch.zeros_like(clean_steps), clean_steps))
    scale.copy_(new_scale)
    return scale
