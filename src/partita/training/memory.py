"""The sizes and full values of a TrainStep's sharded state (``TrainStep.memory`` and friends).

``partita.train_step`` owns the training state as ShardedTensors: :func:`state_memory` counts
its bytes per device and unsharded, :func:`full_values` gathers a pytree of it to full tensors.
This module only measures and gathers; it decides nothing about layouts.
"""

from __future__ import annotations

import math
from typing import Any

from torch.utils import _pytree as pytree

from partita.values.tensor import ShardedTensor

__all__ = ["full_values", "state_memory"]


def _is_sharded(x: Any) -> bool:
    return isinstance(x, ShardedTensor)


def full_values(tree: Any) -> Any:
    """``tree`` with every ShardedTensor gathered to its full tensor."""
    return pytree.tree_map(lambda t: t.full(), tree, is_leaf=_is_sharded)


def _local_bytes(t: ShardedTensor) -> int:
    return math.prod(t.local_shape) * t.dtype.itemsize


def state_memory(params: Any, buffers: Any, opt_state: Any) -> dict[str, tuple[int, int]]:
    """``{"parameters" | "buffers" | "optimizer": (bytes per device, unsharded bytes)}``;
    per-device bytes include ceil padding, "optimizer" counts the moments and the step."""
    groups = {
        "parameters": pytree.tree_leaves(params, is_leaf=_is_sharded),
        "buffers": pytree.tree_leaves(buffers, is_leaf=_is_sharded),
        "optimizer": pytree.tree_leaves(opt_state, is_leaf=_is_sharded),
    }
    return {
        k: (
            sum(_local_bytes(t) for t in ts),
            sum(t.shape.numel() * t.dtype.itemsize for t in ts),
        )
        for k, ts in groups.items()
    }
