"""Counting the copies ``runtime.dist_ops`` makes, op by op (``tests/test_cost_copies.py`` and
``tests/test_cost_fit.py`` check ``cost.copies`` against them)."""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

#: The aten ops of dist_ops that copy (the rest are views and allocations).
COPYING = (
    "aten.cat.",
    "aten.clone.",
    "aten.stack.",
    "aten.div.",
    "aten.index.",
    "aten.copy_.",
    "aten.split_with_sizes_copy.",
)


class Copies(TorchDispatchMode):
    """Bytes read and written by each copying aten op run inside it (``sizes``, in order)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if name.startswith(COPYING):
            result = out[0] if isinstance(out, (list, tuple)) and out else out
            if name.startswith("aten.split_with_sizes_copy."):  # writes into its out list
                result = args[0]
            self.sizes.append(2 * result.numel() * result.element_size())
        return out
