"""Random ops on the virtual device that replay an earlier draw: ``torch.utils.checkpoint``.

Eagerly, ``checkpoint(block, x)`` saves the generator's state before ``block`` and restores it
to recompute ``block`` in the backward, so a dropout inside draws the forward's mask again. On
the virtual device a random op is only *recorded* (it draws when the step runs, at
``partita.sync()``): the generator does not move while recording, and every recorded dropout
would draw its own mask, the recomputed one too: a silently wrong gradient.

So the device's RNG state (what checkpoint and ``torch.random.fork_rng`` save and restore
through the device module) is the CPU generator's state *and* the number of draws recorded
since the last sync; each recorded random op is keyed by both. A random op recorded with the
key of an earlier one, the same op and the same shapes is that draw again: it reads the earlier
result (a dropout recomputes its output from its new input and the earlier mask, as the kernel
does). One it cannot repeat raises :class:`~partita.VirtualDeviceError`. The draws recorded
since the last sync are kept in the device's state (:mod:`partita.virtual.state`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch

from partita.capture.rng import draws_from_values, random_ops
from partita.errors import VirtualDeviceError
from partita.virtual import state

__all__ = ["device_rng_state", "is_random", "record_draw", "reset", "set_device_rng_state"]

aten = torch.ops.aten

_COUNT_BYTES = 8


def reset() -> None:
    """A sync ran the recorded draws: none is pending."""
    device = state.get()
    device.draws_pending, device.draws_seen, device.draw_keys = 0, {}, set()


def device_rng_state() -> torch.Tensor:
    """The CPU generator's state followed by the pending draw count (8 bytes)."""
    count = torch.tensor([state.get().draws_pending], dtype=torch.int64).view(torch.uint8)
    return torch.cat([torch.get_rng_state(), count])


def set_device_rng_state(rng: torch.Tensor) -> None:
    """Restore a :func:`device_rng_state` (or a plain CPU generator state)."""
    cpu_size = torch.get_rng_state().numel()
    if rng.numel() == cpu_size + _COUNT_BYTES:
        state.get().draws_pending = int(rng[cpu_size:].clone().view(torch.int64)[0])
        rng = rng[:cpu_size]
    torch.set_rng_state(rng.clone())


def is_random(func: Any) -> bool:
    return func in random_ops()


def record_draw(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], record: Callable[..., Any]
) -> Any:
    """Record ``func`` (a random op) with ``record``, or repeat the earlier draw it replays."""
    device = state.get()
    generator = hashlib.blake2b(torch.get_rng_state().numpy().tobytes(), digest_size=16).digest()
    key = (generator, device.draws_pending)
    device.draws_pending += 1
    signature = (key, func, *(_shape_or_value(a) for a in (*args, *sorted(kwargs.items()))))
    earlier = device.draws_seen.get(signature)
    if earlier is not None:
        return _repeat(func, args, earlier)
    if key in device.draw_keys:
        raise VirtualDeviceError(
            f"{func} draws again with the generator state of an earlier draw (torch.utils."
            f"checkpoint recomputing a block, or the generator's state set back) but with other "
            f"arguments, so the virtual device cannot repeat that draw as eager PyTorch does. "
            f"Keep the random op out of the checkpointed block, or train with partita.train_step."
        )
    result = record(func, args, kwargs)
    device.draws_seen[signature] = result
    device.draw_keys.add(key)
    return result


def _shape_or_value(a: Any) -> Any:
    """A tensor argument by its shape and dtype (a recomputed input is a new tensor with the
    same ones; dropout's and the fills' draws do not depend on their inputs' values)."""
    if isinstance(a, torch.Tensor):
        return ("tensor", tuple(a.shape), a.dtype)
    if isinstance(a, (list, tuple)):
        return tuple(_shape_or_value(x) for x in a)
    return repr(a)


def _repeat(func: Any, args: tuple[Any, ...], earlier: Any) -> Any:
    if func == aten.native_dropout.default:
        x, p = args[0], float(args[1])
        mask = aten.clone.default(earlier[1])  # a result of its own, as the op would return
        if len(args) > 2 and args[2] is False:  # evaluation: no draw to repeat
            return aten.clone.default(x), mask
        scale = 0.0 if p == 1.0 else 1.0 / (1.0 - p)
        return aten.mul.Scalar(aten.mul.Tensor(x, mask), scale), mask  # the kernel's formula
    if draws_from_values(func):
        raise VirtualDeviceError(
            f"{func} inside torch.utils.checkpoint draws from values the recomputation makes "
            f"again, which the virtual device cannot repeat as eager PyTorch does. Keep it out "
            f"of the checkpointed block, or train with partita.train_step."
        )
    return aten.clone.default(earlier)
