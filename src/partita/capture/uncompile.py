"""Take a function or module back out of ``torch.compile`` before partita captures it.

``torch.compile(fn)`` returns a wrapper that runs TorchDynamo on each call; capturing through it
would trace Inductor's generated kernels (which read raw data pointers, impossible on fake
tensors), and ``torch.compile(model)`` renames every parameter ``_orig_mod.<name>``, which
presets and ``state_dict`` keys would then carry. partita partitions the whole program
itself, and compiles the per-device programs with Inductor when asked (the
``inductor`` option), so it captures what the user wrote: the wrapped callable.
"""

from __future__ import annotations

from typing import Any

from partita.errors import PartitaWarning, warn

__all__ = ["uncompiled"]


def uncompiled(obj: Any, api: str) -> Any:
    """``obj`` itself, or the function / module ``torch.compile`` wrapped (with a warning
    naming ``api``, the partita entry point that got it)."""
    inner = _wrapped(obj)
    if inner is None:
        return obj
    what = "module" if hasattr(obj, "_orig_mod") else "function"
    name = type(inner).__name__ if what == "module" else getattr(inner, "__name__", "?")
    warn(
        PartitaWarning(
            f"{api} got a torch.compile'd {what} ({name}): partita captures the {what} "
            f"torch.compile wrapped and partitions it; TorchDynamo's compiled code is not "
            f"used. Pass the uncompiled {what} to silence this; to compile the per-device "
            f"programs with Inductor, set the option inductor=True (options={{'inductor': True}})."
        )
    )
    return inner


def _wrapped(obj: Any) -> Any:
    # Duck-typed: importing torch._dynamo to isinstance-check would cost ~1 s at import.
    if type(obj).__name__ == "OptimizedModule" and hasattr(obj, "_orig_mod"):
        return obj._orig_mod
    return getattr(obj, "_torchdynamo_orig_callable", None)
