"""The LocalMesh's steps between segments: mesh ops and contractions on held values.

A value is held as ``(value, axes)`` (``runtime.local``): one copy per position of the mesh
axes it varies along. An all_reduce, all_gather or reduce_scatter runs on the value as held
(``runtime.held``: a sum, flatten or split of its leading dims); the other mesh ops run on
the values spread to ``[n, *local]`` through ``runtime.stacked``, and their results are held
again (``compact``). A contraction (an ``mm`` read only by a sum over mesh axes) runs as one
matmul over the joined slices (``runtime.contraction``). Everything here is tensor ops on the
held values, so the whole step traces to one graph (``runtime.fused_step``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, fx
from torch.utils import _pytree as pytree

from partita.errors import ExecutionError
from partita.runtime.contraction import contract
from partita.runtime.held import all_gather_held, all_reduce_held, reduce_scatter_held
from partita.values.mesh import Mesh

__all__ = ["bind", "run_contraction", "run_mesh_op"]

# Mesh ops whose result is the same on every member of the group: over the whole mesh it is
# the same on every device, so the result can stay unbatched.
_REPLICATING_OPS = {
    torch.ops.partita.all_reduce.default,
    torch.ops.partita.all_gather.default,
    torch.ops.partita.all_reduce_bucket.default,
    torch.ops.partita.all_gather_bucket.default,
}
_ALL_REDUCES = {torch.ops.partita.all_reduce.default, torch.ops.partita.all_reduce_bucket.default}
_ALL_GATHERS = {torch.ops.partita.all_gather.default, torch.ops.partita.all_gather_bucket.default}
_REDUCE_SCATTERS = {
    torch.ops.partita.reduce_scatter.default,
    torch.ops.partita.reduce_scatter_bucket.default,
}

#: ``(stacked [n, *local], the mesh axes it is the same along) -> (value, axes)``
Compact = Callable[[Tensor, Sequence[str]], tuple[Tensor, Any]]
#: ``(value, axes) -> stacked [n, *local]``
Spread = Callable[[Any, Any], Any]


def run_mesh_op(
    mesh: Mesh, node: fx.Node, env: dict[fx.Node, Any], compact: Compact, spread: Spread
) -> Any:
    """The held result of mesh op ``node`` on the held values in ``env``."""
    from partita.runtime.stacked import STACKED_BUCKET_IMPLS, STACKED_IMPLS  # lazily

    if node.target in _ALL_REDUCES:
        bound = bind(node)
        group = {mesh.axis_index(a) for a in bound["mesh_axes"]}
        op = bound["reduce_op"]
        if "xs" in bound:
            return [all_reduce_held(mesh, env[x], op, group) for x in bound["xs"]]
        return all_reduce_held(mesh, env[bound["x"]], op, group)
    if node.target in _REDUCE_SCATTERS:
        bound = bind(node)
        op, axes = bound["reduce_op"], bound["mesh_axes"]
        if "xs" in bound:
            return [
                reduce_scatter_held(mesh, env[x], d, op, axes)
                for x, d in zip(bound["xs"], bound["dims"], strict=True)
            ]
        return reduce_scatter_held(mesh, env[bound["x"]], bound["dim"], op, axes)
    if node.target in _ALL_GATHERS:  # as held, where each value varies along the group
        bound = bind(node)
        bucket = "xs" in bound
        members = (
            list(zip(bound["xs"], bound["dims"], strict=True))
            if bucket
            else [(bound["x"], bound["dim"])]
        )
        outs = [all_gather_held(mesh, env[x], d, bound["mesh_axes"]) for x, d in members]
        if all(o is not None for o in outs):
            return outs if bucket else outs[0]

    def stacked(a: Any) -> Any:
        return spread(*env[a]) if isinstance(a, fx.Node) else a

    args, kwargs = pytree.tree_map(stacked, (node.args, node.kwargs))
    try:
        impl = STACKED_IMPLS.get(node.target) or STACKED_BUCKET_IMPLS[node.target]
        out = impl(mesh, *args, **kwargs)
    except Exception as e:
        raise ExecutionError(
            f"LocalMesh: mesh op {node.target} at node {node.name!r} failed on stacked "
            f"inputs of shapes {[tuple(a.shape) for a in args if isinstance(a, Tensor)]}: {e}"
        ) from e
    bound = bind(node)
    group = {mesh.axis_index(a) for a in bound["mesh_axes"]}
    ndim = mesh.ndim
    if node.target in _REPLICATING_OPS:
        # Every member of a group gets the same result: it varies along the axes its input
        # varies along, less the group's.
        def same(x: Any) -> list[str]:
            axes = env[x][1]
            return [mesh.axis_names[i] for i in range(ndim) if i in group or not axes[i]]
    elif node.target is torch.ops.partita.collective_permute.default:

        def same(x: Any) -> list[str]:
            return []
    else:  # each member gets its own part: the input's axes and the group's

        def same(x: Any) -> list[str]:
            axes = env[x][1] if isinstance(x, fx.Node) else (False,) * ndim
            return [mesh.axis_names[i] for i in range(ndim) if not (i in group or axes[i])]

    if isinstance(out, list):  # a bucket: (value, axes) per member
        return [compact(o, same(x)) for o, x in zip(out, bound["xs"], strict=True)]
    return compact(out, same(bound.get("x")))


def run_contraction(mesh: Mesh, node: fx.Node, env: dict[fx.Node, Any]) -> tuple[Tensor, Any]:
    """``mm(a, b)`` or ``addmm(c, a, b)`` read only by a sum over its group, as
    ``runtime.contraction.contract`` computes it."""
    (user,) = node.users
    return contract(
        mesh,
        node,
        env,
        bind(user)["mesh_axes"],
        user.target in _ALL_REDUCES,
        functools.partial(all_reduce_held, mesh),
    )


@functools.cache
def _arg_names(target: Any) -> tuple[str, ...]:
    return tuple(a.name for a in target._schema.arguments)


def bind(node: fx.Node) -> dict[str, Any]:
    """A mesh op node's arguments by schema name."""
    names = _arg_names(node.target)
    return {**dict(zip(names, node.args, strict=False)), **node.kwargs}  # trailing defaults
