"""Per-device selections on the LocalMesh: an ``index_select`` whose index depends only on
the device, folded to per-device constants when the plan is made.

The partitioner lowers a slice at a device-dependent offset (``q|k|v`` cut out of a
column-parallel fused projection, tiles re-aligned after a collective_permute) to
``index_select(x, dim, idx)`` with ``idx`` computed from ``axis_index`` and constants
(``arange(L) + starts[axis_index]``, or ``table[axis_index]``). Under ``vmap`` that index is
batched, and the selection runs as a ``gather`` over an index expanded to the whole output.
But on the simulated mesh every device's index is known before the program runs: this module
evaluates it once per device (:func:`find_device_takes`), and the LocalMesh runs the
selection as a step between segments, outside vmap (:func:`run_take`), on the value as held
(``(value, axes)``, ``runtime.local``):

* the same index on every device: one ``narrow`` (a view) when it is a contiguous range,
  else one ``index_select`` with the constant index;
* contiguous ranges whose start is ``base + k * coordinate`` along one mesh axis: a strided
  view of the stack (that axis' stride becomes ``stride_axis + k * stride_dim``), no copy;
* any other per-device index made of a few ascending runs: each device's runs copied into
  one new stack (the output written once); beyond ``_MAX_RUNS`` runs, one ``index_select``
  per distinct device, stacked.

A ``cat`` along the same dim read by nothing but such selections does not run: they copy from
its pieces (a view of one piece when every device reads that one). The nodes that only
compute an index (and ``axis_index`` calls read by nothing else) do not run at all. The
result equals the per-device program's, device by device.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from torch import Tensor, fx

from partita.values.mesh import Mesh

__all__ = ["DeviceTake", "RoutedTakeAPI", "find_device_takes", "run_take", "take_inputs"]

aten = torch.ops.aten

Axes = tuple[bool, ...]  # the mesh axes a value varies along (``runtime.local``)


class RoutedTakeAPI(Protocol):
    """What this module uses of a ``runtime.device_route.RoutedTake`` (which imports this)."""

    @property
    def sources(self) -> tuple[fx.Node, ...]: ...  # read-only: RoutedTake is frozen

    def run(self, inputs: list[tuple[Tensor, Axes]], mesh: Mesh) -> tuple[Tensor, Axes]: ...


#: Per-device indices larger than this stay with vmap (evaluating them would cost memory).
_MAX_INDEX = 1 << 16
#: A device's index copied as at most this many ranges; beyond, one gather per device.
_MAX_RUNS = 8


@dataclass(frozen=True)
class DeviceTake:
    """``index_select(x, dim, idx)`` with ``idx`` a known constant on each device.

    ``table`` is ``[*(mesh.shape[i] for the axes it varies along), L]`` (int64) and ``axes``
    those axes; ``starts`` (same leading shape) is set when every row is a contiguous
    ascending range ``start .. start + L``. With ``from_cat`` the input is a ``cat`` along
    the same dim that runs for nothing else: the take reads its pieces instead."""

    dim: int  # in the local value, as the op has it (may be negative)
    table: Tensor
    axes: Axes
    starts: Tensor | None
    from_cat: bool = False


def take_inputs(node: fx.Node, take: DeviceTake | RoutedTakeAPI) -> list[fx.Node]:
    """The values a take step reads: its input, or the pieces of the cat it selects from."""
    if not isinstance(take, DeviceTake):  # a take routed through permutes (runtime.device_route)
        return list(take.sources)
    x = cast(fx.Node, node.args[0])  # the take's input: a cat of pieces, or one value
    return list(cast("Sequence[fx.Node]", x.args[0])) if take.from_cat else [x]


def _device_constant(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose value depends on nothing but the device: ``axis_index`` calls and ops
    whose every input is such a node (ops with no inputs, such as ``arange``, included)."""
    const: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":  # a constant of the program: the same on every device
            const.add(node)
        if node.op != "call_function":
            continue
        if node.target is torch.ops.partita.axis_index.default:
            const.add(node)
        elif getattr(node.target, "namespace", None) == "partita":
            continue  # a mesh op: moves data between devices
        elif torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
            continue
        elif all(i in const for i in node.all_input_nodes):
            const.add(node)
    return const


def _evaluate(
    gm: fx.GraphModule, nodes: list[fx.Node], target: fx.Node, mesh: Mesh, device: int
) -> Any:
    """``target`` on flat device ``device``, from the ancestor ``nodes`` in graph order."""
    from partita.runtime.stacked import axis_index  # lazily, as runtime.local does

    env: dict[fx.Node, Any] = {}
    for node in nodes:
        if node.op == "get_attr":
            env[node] = functools.reduce(getattr, cast(str, node.target).split("."), gm)
            continue
        if node.target is torch.ops.partita.axis_index.default:
            axes = node.kwargs.get("mesh_axes", node.args[1] if len(node.args) > 1 else None)
            coords = axis_index(mesh, torch.empty(0), cast("Sequence[str]", axes))
            env[node] = coords[device]
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
        env[node] = cast(Callable[..., Any], node.target)(*args, **kwargs)  # a call_function
    return env[target]


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            if n.target is not torch.ops.partita.axis_index.default:
                todo.extend(n.all_input_nodes)
    return seen


def _table(gm: fx.GraphModule, idx: fx.Node, mesh: Mesh) -> tuple[Tensor, Axes] | None:
    """The index on every device as ``(table, axes)`` (see :class:`DeviceTake`), or None when
    it is not a 1-D int64 index of a reasonable size."""
    mine = _ancestors(idx)
    nodes = [n for n in gm.graph.nodes if n in mine]
    rows: list[Tensor] = []
    for p in range(mesh.size):
        row = _evaluate(gm, nodes, idx, mesh, p)
        if not isinstance(row, Tensor) or row.dim() != 1 or row.dtype is not torch.int64:
            return None
        if row.numel() * mesh.size > _MAX_INDEX or (rows and row.shape != rows[0].shape):
            return None
        rows.append(row)
    full = torch.stack(rows).reshape(*mesh.shape, rows[0].shape[0])
    axes = tuple(
        bool((full != full.narrow(i, 0, 1)).any()) for i in range(mesh.ndim)
    )  # varies along axis i when some row differs from coordinate 0's
    return full[tuple(slice(None) if v else 0 for v in axes)], axes


def find_device_takes(
    gm: fx.GraphModule, mesh: Mesh
) -> tuple[dict[fx.Node, DeviceTake], set[fx.Node]]:
    """The ``index_select`` nodes of ``gm`` whose index is a per-device constant, and the
    nodes that need not run because they only compute such indices."""
    const = _device_constant(gm)
    takes: dict[fx.Node, DeviceTake] = {}
    for node in gm.graph.nodes:
        if node.target is not aten.index_select.default or node in const:
            continue
        if len(node.args) != 3 or node.kwargs:  # as aten traces it: (x, dim, index)
            continue
        x, dim, idx = node.args
        if not isinstance(idx, fx.Node) or idx not in const or not isinstance(x, fx.Node):
            continue
        if not isinstance(dim, int):
            continue
        found = _table(gm, idx, mesh)
        if found is None:
            continue
        table, axes = found
        length = table.shape[-1]
        if length == 0:
            continue
        ramp = torch.arange(length)
        first = table[..., :1]
        contiguous = bool((table == first + ramp).all())
        starts = first[..., 0].clone() if contiguous else None
        takes[node] = DeviceTake(dim, table, axes, starts)
    # Nodes read only as takes' indices (or by such nodes) need not run.
    skipped: set[fx.Node] = set()
    for node in reversed(gm.graph.nodes):
        if node not in const or not node.users:
            continue
        if all(u in skipped or (u in takes and u.args[2] is node) for u in node.users):
            skipped.add(node)
    # A cat read only by takes along its dim: the takes read its pieces, it does not run.
    for node in gm.graph.nodes:
        if node.target is not aten.cat.default or node in const or not node.users:
            continue
        cat_dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        readers = [u for u in node.users if u not in skipped]
        if readers and all(
            u in takes and u.args[0] is node and u.args[1] == cat_dim for u in readers
        ):
            skipped.add(node)
            for u in readers:
                takes[u] = dataclasses.replace(takes[u], from_cat=True)
    return takes, skipped


def run_take(
    take: DeviceTake | RoutedTakeAPI, inputs: list[tuple[Tensor, Axes]], mesh: Mesh
) -> tuple[Tensor, Axes]:
    """The take on its input as held, ``(value, axes)`` (``runtime.local``), or on the
    pieces of the ``cat`` it selects from (``DeviceTake.from_cat``): the result as
    ``(value, axes)``, varying along the axes of its input and of the index."""
    if not isinstance(take, DeviceTake):  # a take routed through permutes (runtime.device_route)
        return take.run(inputs, mesh)
    lead_shape = tuple(take.table.shape[:-1])
    rows = {r: take.table[r] for r in itertools.product(*(range(s) for s in lead_shape))}
    sizes = [v.shape[sum(a) + take.dim % (v.dim() - sum(a))] for v, a in inputs]
    starts = [e - n for e, n in zip(itertools.accumulate(sizes), sizes, strict=True)]
    which = {_piece_of(row, starts, sizes) for row in rows.values()}
    # every device reads one piece: maybe a view
    if len(which) == 1 and (j := next(iter(which))) is not None:
        shifted = {r: row - starts[j] for r, row in rows.items()}
        view = _take_view(take, shifted, *inputs[j], mesh)
        if view is not None:
            return view
    copied = _copy_runs(take, rows, inputs, starts, sizes, mesh)
    if copied is not None:
        return copied
    value, axes = inputs[0] if len(inputs) == 1 else _cat(inputs, take.dim, mesh)
    return _take_each(take, rows, value, axes, mesh)


def _piece_of(row: Tensor, starts: list[int], sizes: list[int]) -> int | None:
    """The piece of a cat holding every index of ``row``; None when it spans pieces."""
    lo, hi = int(row.min()), int(row.max())
    spans = zip(starts, sizes, strict=True)
    return next((j for j, (b, n) in enumerate(spans) if b <= lo and hi < b + n), None)


def _expanded(value: Tensor, axes: Axes, union: Axes, mesh: Mesh) -> Tensor:
    """``value`` with a leading dim for every axis of ``union`` (stride 0 where it does not
    vary): a view."""
    k = 0
    for i, v in enumerate(union):
        if v and not axes[i]:
            value = value.unsqueeze(k)
        k += v
    lead = [mesh.shape[i] for i, v in enumerate(union) if v]
    return value.expand(*lead, *value.shape[len(lead) :])


def _take_view(
    take: DeviceTake, rows: dict[tuple[int, ...], Tensor], value: Tensor, axes: Axes, mesh: Mesh
) -> tuple[Tensor, Axes] | None:
    """The same index on every device (a ``narrow``, or one ``index_select``), or ranges at
    an arithmetic start (a strided view); None otherwise."""
    if not any(take.axes):
        local_dim = take.dim % max(value.dim() - sum(axes), 1)
        return _select(value, sum(axes) + local_dim, rows[()], take.starts), axes
    union = _union([axes, take.axes])
    full = _expanded(value, axes, union, mesh)
    view = _strided(take, rows, full, union, sum(union))
    return None if view is None else (view, union)


def _runs(row: list[int], starts: list[int], sizes: list[int]) -> list[tuple[int, ...]] | None:
    """``row`` as ``(piece, source start, destination start, length)`` copies: its ascending
    runs, cut where the pieces meet; None beyond ``_MAX_RUNS`` (then a gather is cheaper)."""
    runs: list[tuple[int, ...]] = []
    i = 0
    while i < len(row):
        j = i
        while j + 1 < len(row) and row[j + 1] == row[j] + 1:
            j += 1
        lo, hi = row[i], row[j]
        while lo <= hi:
            p = next(
                p for p, (b, n) in enumerate(zip(starts, sizes, strict=True)) if b <= lo < b + n
            )
            end = min(hi, starts[p] + sizes[p] - 1)
            runs.append((p, lo - starts[p], i + lo - row[i], end - lo + 1))
            lo = end + 1
        if len(runs) > _MAX_RUNS:
            return None
        i = j + 1
    return runs


def _copy_runs(
    take: DeviceTake,
    rows: dict[tuple[int, ...], Tensor],
    inputs: list[tuple[Tensor, Axes]],
    starts: list[int],
    sizes: list[int],
    mesh: Mesh,
) -> tuple[Tensor, Axes] | None:
    """Each device's rows copied run by run from the piece holding them into one new
    stack: the output written once, nothing else."""
    found = {r: _runs(row.tolist(), starts, sizes) for r, row in rows.items()}
    runs = {r: v for r, v in found.items() if v is not None}
    if len(runs) != len(found):
        return None
    union = _union([take.axes, *(a for _, a in inputs)])
    lead = [mesh.shape[i] for i, v in enumerate(union) if v]
    first, first_axes = inputs[0]
    local = list(first.shape[sum(first_axes) :])
    dim = take.dim % max(len(local), 1)
    local[dim] = take.table.shape[-1]
    out = first.new_empty(*lead, *local)
    for pos in itertools.product(*(range(s) for s in lead)):
        coords = _coords(pos, union)
        dst = out[pos]
        for piece, src, at, length in runs[
            tuple(c for c, v in zip(coords, take.axes, strict=True) if v)
        ]:
            value, axes = inputs[piece]
            x = value[tuple(c for c, v in zip(coords, axes, strict=True) if v)]
            dst.narrow(dim, at, length).copy_(x.narrow(dim, src, length))
    return out, union


def _take_each(
    take: DeviceTake, rows: dict[tuple[int, ...], Tensor], value: Tensor, axes: Axes, mesh: Mesh
) -> tuple[Tensor, Axes]:
    """One ``index_select`` per distinct device (``union`` positions), stacked."""
    union = _union([axes, take.axes])
    lead = [mesh.shape[i] for i, v in enumerate(union) if v]
    full = _expanded(value, axes, union, mesh)
    pieces = []
    for pos in itertools.product(*(range(s) for s in lead)):
        r = tuple(c for c, v in zip(_coords(pos, union), take.axes, strict=True) if v)
        pieces.append(_select(full[pos], take.dim, rows[r], take.starts))
    out = torch.stack(pieces)
    return out.reshape(*lead, *out.shape[1:]), union


def _select(x: Tensor, dim: int, row: Tensor, contiguous: Tensor | None) -> Tensor:
    """``x.index_select(dim, row)``: a ``narrow`` (a view) when the rows are ranges."""
    if contiguous is not None:
        return x.narrow(dim, int(row[0]), row.shape[0])
    return x.index_select(dim, row.to(x.device))


def _strided(
    take: DeviceTake,
    rows: dict[tuple[int, ...], Tensor],
    value: Tensor,
    union: Axes,
    n_lead: int,
) -> Tensor | None:
    """Ranges starting at ``base + k * c`` along the one axis the index varies along (``c``
    the device's coordinate on it, ``k >= 0``): the selection is a view of ``value`` (its
    leading dims the ``union`` axes) in which that axis steps ``k`` further along the take's
    dim. None otherwise."""
    if take.starts is None or sum(take.axes) != 1:
        return None
    starts = [int(rows[(c,)][0]) for c in range(len(rows))]
    base = starts[0]
    step = starts[1] - base if len(starts) > 1 else 0
    if step < 0 or any(s != base + step * c for c, s in enumerate(starts)):
        return None
    dim = n_lead + take.dim % (value.dim() - n_lead)
    axis = take.axes.index(True)
    lead_dim = sum(union[:axis])  # where that axis is in ``value``
    size = list(value.shape)
    size[dim] = rows[(0,)].shape[0]
    stride = list(value.stride())
    stride[lead_dim] += step * stride[dim]
    return value.as_strided(size, stride, value.storage_offset() + base * stride[dim])


def _union(all_axes: list[Axes]) -> Axes:
    return tuple(any(col) for col in zip(*all_axes, strict=True))


def _coords(pos: tuple[int, ...], union: Axes) -> list[int]:
    """Mesh coordinates (0 along the axes not in ``union``) of a position over ``union``."""
    it = iter(pos)
    return [next(it) if v else 0 for v in union]


def _cat(inputs: list[tuple[Tensor, Axes]], dim: int, mesh: Mesh) -> tuple[Tensor, Axes]:
    """``cat(pieces, dim)`` on values as held: each expanded to the union of their axes."""
    union = _union([a for _, a in inputs])
    lead = [mesh.shape[i] for i, v in enumerate(union) if v]
    full = []
    for value, axes in inputs:
        k = 0
        for i, v in enumerate(union):
            if v and not axes[i]:
                value = value.unsqueeze(k)
            k += v
        full.append(value.expand(*lead, *value.shape[len(lead) :]))
    local_ndim = full[0].dim() - len(lead)
    return torch.cat(full, len(lead) + dim % local_ndim), union
