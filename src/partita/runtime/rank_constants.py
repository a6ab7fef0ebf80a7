"""A rank's program with its coordinates known: what depends only on them computed once.

On a DistributedMesh every process is one device, so each ``axis_index`` of its program is a
constant of that process. The partitioner's per-device selections are built on it: to split a
fused projection (GPT's q|k|v over ``model``), the program makes the per-device index tables
(``new_tensor`` of every device's columns), picks this device's row (``index_select`` by
``axis_index``), adds an ``arange`` and gathers the columns with ``index_select`` along the
last dimension. Run per step, that is a Python list turned into a tensor and, for each gather,
an element-by-element copy along the last dimension (about 0.5 ms for ``[8, 128, 512] ->
[8, 128, 128]``, 20 times a copy of the same bytes as rows).

- :func:`fold_rank_constants` computes, once per bound program, every op whose inputs are all
  known: ``axis_index`` (this rank's coordinate), ATen ops that read only constants (pure, or
  writing only a value nothing else reads: the ``add_`` of an ``arange``), ``new_tensor``; the
  program reads each value a computed op needs as a constant of the module. A value over
  :data:`MAX_BYTES` stays computed per step (held, it would stay resident). A value some op
  left in the program may write (directly or through a view), or that the program returns,
  stays computed per step.
- :func:`slice_gathers` replaces an ``index_select`` by a constant index made of runs of
  consecutive positions with those slices, copied (:func:`select_runs`): the same elements in
  the same order, in a new contiguous tensor, as ``index_select`` returns. Of a ``cat`` along
  the same dimension the slices are taken from its pieces, and a cat nothing else reads is
  no longer made (q, k and v straight from this rank's columns and the peer's).

Both change no value: the results are bit for bit those of the program as partitioned.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, fx
from torch.utils import _pytree as pytree

from partita.runtime.flat_effects import aliases, pure, writes

__all__ = ["MAX_BYTES", "fold_rank_constants", "rank_program", "select_runs", "slice_gathers"]

aten = torch.ops.aten
#: A computed value larger than this stays computed per step: held as a constant it would stay
#: resident between steps (the tables and offsets folded here are some kilobytes).
MAX_BYTES = 1 << 20
_AXIS_INDEX = torch.ops.partita.axis_index.default


def select_runs(xs: Sequence[Tensor], dim: int, runs: Sequence[tuple[int, int, int]]) -> Tensor:
    """``cat(xs, dim).index_select(dim, idx)`` for an ``idx`` made of ``runs`` (piece, start,
    length) of consecutive positions within one piece each: a new contiguous tensor holding
    the same elements, copied straight from the pieces."""
    pieces = [xs[i].narrow(dim, s, n) for i, s, n in runs]
    if len(pieces) == 1:
        return pieces[0].clone(memory_format=torch.contiguous_format)
    out = torch.cat(pieces, dim)
    return out if out.is_contiguous() else out.clone(memory_format=torch.contiguous_format)


def rank_program(
    gm: fx.GraphModule,
    graph: fx.Graph,
    coordinate: Callable[[Sequence[str]], int],
    device: torch.device | None,
) -> fx.GraphModule:
    """``graph`` (a copy of ``gm``'s, being bound for this rank) with :func:`fold_rank_constants`
    and :func:`slice_gathers` applied, as a module holding the constants it reads (``gm``
    itself when ``device``, the inputs' device, is not known yet: nothing folded)."""
    if device is None:
        return gm
    root = fx.GraphModule(gm, graph)
    fold_rank_constants(root, coordinate, device)
    slice_gathers(root)
    return root


def fold_rank_constants(
    gm: fx.GraphModule, coordinate: Callable[[Sequence[str]], int], device: torch.device
) -> int:
    """Fold ``gm``'s ops that depend only on this rank's coordinates and constants (see the
    module doc); returns how many nodes went. ``coordinate(mesh_axes)``: what ``axis_index``
    returns on this rank, as a tensor on ``device``."""
    graph = gm.graph
    values: dict[fx.Node, Any] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is _AXIS_INDEX:  # reads only a device
            values[node] = torch.tensor(coordinate(node.args[1]), dtype=torch.int64, device=device)
            continue
        if node.op != "call_function" or not all(n in values for n in node.all_input_nodes):
            continue
        if not _foldable(node, values):
            continue
        args, kwargs = pytree.tree_map_only(fx.Node, values.__getitem__, (node.args, node.kwargs))
        try:
            value = node.target(*args, **kwargs)
        except Exception:  # leave it to run as it did
            continue
        if not any(
            isinstance(t, Tensor) and t.nbytes > MAX_BYTES for t in pytree.tree_leaves(value)
        ):
            values[node] = value
    _keep_written(graph, values)
    folded = set(values)
    if not folded:
        return 0
    before = len(graph.nodes)
    for i, node in enumerate(n for n in graph.nodes if n in folded):
        if not isinstance(values[node], Tensor) or all(u in folded for u in node.users):
            continue
        name = f"_rank_constant_{i}"
        while hasattr(gm, name):
            name += "_"
        gm.register_buffer(name, values[node], persistent=False)
        with graph.inserting_before(node):
            attr = graph.get_attr(name)
        attr.meta = dict(node.meta)
        node.replace_all_uses_with(attr, delete_user_cb=lambda u: u not in folded)
    for node in reversed(list(graph.nodes)):
        if node in folded and not node.users:
            graph.erase_node(node)
    gm.recompile()
    return before - len(graph.nodes)


def _foldable(node: fx.Node, values: dict[fx.Node, Any]) -> bool:
    """Whether ``node`` (all of whose inputs are known) may be computed now: a pure ATen op,
    ``new_tensor``, or an ATen op that writes only known values nothing else reads."""
    if pure(node) or node.target is Tensor.new_tensor:
        return True
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return False
    if torch.Tag.nondeterministic_seeded in target.tags or "empty" in target.__name__:
        return False
    written = writes(node)
    return bool(written) and all(w in values and len(w.users) == 1 for w in written)


def _keep_written(graph: fx.Graph, values: dict[fx.Node, Any]) -> None:
    """Drop from ``values`` every node whose storage an op left in the program may write, or
    that the program returns (and what was computed from it), until none is left."""
    while True:
        roots: dict[fx.Node, set[fx.Node]] = {}
        bad: set[fx.Node] = set()
        for node in graph.nodes:
            reads = [roots[n] for n in node.all_input_nodes]
            roots[node] = {node}.union(*reads) if reads and aliases(node) else {node}
            if node.op == "output":
                bad.update(*reads)
            elif node not in values:
                for target in writes(node):
                    bad.update(roots[target])
        drop = {n for n in values if roots[n] & bad}
        if not drop:
            return
        for node in graph.nodes:  # and what was computed from a dropped value
            if node in values and (node in drop or any(a in drop for a in node.all_input_nodes)):
                drop.add(node)
                del values[node]


def slice_gathers(gm: fx.GraphModule) -> int:
    """Replace each ``index_select`` of ``gm`` by a constant index of consecutive runs with
    :func:`select_runs` (see the module doc); returns how many were replaced."""
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.index_select.default:
            continue
        x, dim, index = node.args
        idx = _constant(gm, index)
        if idx is None or idx.dim() != 1 or idx.numel() == 0 or idx.is_floating_point():
            continue
        val = x.meta.get("val") if isinstance(x, fx.Node) else None
        if not isinstance(val, Tensor) or not val.dim():
            continue
        dim = dim % val.dim()
        runs = _runs(idx.tolist(), val.shape[dim])
        if runs is None:
            continue
        pieces, at = _pieces(x, dim)
        node.target = select_runs
        node.args = (pieces, dim, _split(runs, at))
        for cat in _cats(x, dim):  # a cat only gathers read by nothing else now: not made
            if not cat.users:
                gm.graph.erase_node(cat)
        if not index.users:  # the index table, read by nothing else now
            gm.graph.erase_node(index)
        changed += 1
    if changed:
        gm.recompile()
    return changed


def _constant(gm: fx.GraphModule, node: Any) -> Tensor | None:
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    value = getattr(gm, str(node.target), None)
    return value if isinstance(value, Tensor) else None


def _runs(idx: list[int], size: int) -> list[tuple[int, int]] | None:
    """``idx`` as (start, length) runs of consecutive positions, each within ``size`` (no
    more than 8 runs), else None."""
    runs: list[list[int]] = []
    for i in idx:
        if not 0 <= i < size:
            return None
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1][1] += 1
        else:
            runs.append([i, 1])
    return [(s, n) for s, n in runs] if len(runs) <= 8 else None


def _cat_inputs(x: Any, dim: int) -> list[fx.Node] | None:
    """The inputs of ``x`` if it is an ``aten.cat`` along ``dim`` of values whose sizes are
    known, else None."""
    if not isinstance(x, fx.Node) or x.op != "call_function" or x.target is not aten.cat.default:
        return None
    parts = x.args[0]
    if not isinstance(parts, (list, tuple)) or not all(isinstance(p, fx.Node) for p in parts):
        return None
    nodes = [p for p in parts if isinstance(p, fx.Node)]
    vals = [p.meta.get("val") for p in nodes]
    ranks = {v.dim() if isinstance(v, Tensor) else 0 for v in vals}
    if len(ranks) != 1 or (rank := ranks.pop()) <= dim:
        return None
    cat_dim = x.args[1] if len(x.args) > 1 else x.kwargs.get("dim", 0)
    return nodes if isinstance(cat_dim, int) and cat_dim % rank == dim else None


def _pieces(x: fx.Node, dim: int) -> tuple[list[fx.Node], list[int]]:
    """The values ``x`` is made of along ``dim`` (through cats along ``dim``, nested too) and
    where each starts."""
    parts = _cat_inputs(x, dim)
    if parts is None:
        return [x], [0]
    pieces: list[fx.Node] = []
    at: list[int] = []
    offset = 0
    for p in parts:
        inner, starts = _pieces(p, dim)
        pieces += inner
        at += [offset + s for s in starts]
        offset += int(p.meta["val"].shape[dim])
    return pieces, at


def _cats(x: fx.Node, dim: int) -> list[fx.Node]:
    """The cats along ``dim`` that ``x`` is made of, outermost first."""
    parts = _cat_inputs(x, dim)
    if parts is None:
        return []
    return [x, *(c for p in parts for c in _cats(p, dim))]


def _split(runs: list[tuple[int, int]], at: list[int]) -> list[tuple[int, int, int]]:
    """``runs`` of the whole as (piece, start, length) runs within the pieces starting at
    ``at``."""
    out: list[tuple[int, int, int]] = []
    for start, length in runs:
        while length:
            i = max(j for j, a in enumerate(at) if a <= start)
            end = at[i + 1] if i + 1 < len(at) else start + length
            n = min(length, end - start)
            out.append((i, start - at[i], n))
            start, length = start + n, length - n
    return out
