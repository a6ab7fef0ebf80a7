"""``partita.jit(fn, auto=True)``: which arguments are the solver's, and the baselines.

A positional argument whose ``in_specs`` entry is None (or all of them, without in_specs) is
open: its plain-tensor leaves are chosen by auto-sharding (``pipeline.compile_auto``). A given
spec, and a ShardedTensor argument's own sharding, are kept. The baselines scored beside the
solver's answer are ``replicated`` (open leaves whole on every device) and ``batch`` (each
open leaf's dim 0 split over every mesh axis whose size divides it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from partita.frontend.pipeline import Compiled, compile_auto
from partita.options import CompileOptions
from partita.values.mesh import Mesh
from partita.values.spec import P, PartitionSpec
from partita.values.tensor import ShardedTensor

__all__ = ["auto_compile", "dim0_spec"]


def _open_leaves(args: tuple[Any, ...], in_specs: Any, leaves: list[Any]) -> set[int]:
    given = in_specs if isinstance(in_specs, tuple | list) else None
    out: set[int] = set()
    start = 0
    for i, a in enumerate(args):
        n = len(pytree.tree_leaves(a))
        entry = None if in_specs is None else (given[i] if given and i < len(given) else in_specs)
        if entry is None:
            out.update(
                j
                for j in range(start, start + n)
                if isinstance(leaves[j], torch.Tensor) and not isinstance(leaves[j], ShardedTensor)
            )
        start += n
    return out


def dim0_spec(mesh: Mesh, leaf: torch.Tensor) -> PartitionSpec:
    """``leaf``'s dim 0 over the mesh axes that divide it (in mesh order), else replicated."""
    if leaf.ndim == 0:
        return P()
    axes = [a for a in mesh.axis_names if leaf.shape[0] % mesh.axes_size([a]) == 0]
    while axes and leaf.shape[0] % mesh.axes_size(axes):
        axes.pop()
    if not axes:
        return P()
    return P(axes[0] if len(axes) == 1 else tuple(axes), *([None] * (leaf.ndim - 1)))


def auto_compile(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    mesh: Mesh,
    in_specs: Any,
    specs: list[PartitionSpec | None],
    leaves: list[Any],
    out_specs: Any,
    options: CompileOptions,
) -> Compiled:
    """Compile ``fn`` with its open arguments' specs chosen by auto-sharding."""
    open_leaves = _open_leaves(args, in_specs, leaves)
    base = [None if i in open_leaves else s for i, s in enumerate(specs)]
    replicated = [P() if i in open_leaves else s for i, s in enumerate(specs)]
    batch = [dim0_spec(mesh, leaves[i]) if i in open_leaves else s for i, s in enumerate(specs)]
    names = {i: f"input {i}" for i in open_leaves}
    return compile_auto(
        fn, args, kwargs, mesh=mesh, specs=base, open_leaves=open_leaves, options=options,
        presets={"replicated": replicated, "batch": batch},
        out_specs_of=lambda _specs: out_specs, names=names,
    )  # fmt: skip
