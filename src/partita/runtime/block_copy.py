"""One strided copy for a re-layout whose per-device runs form a regular pattern.

``runtime.device_route`` re-lays out a value by copying, for every device, runs of rows from
the devices they were sent from (the q|k|v gradients of a fused projection over ``model``:
each device's three runs come from three devices). When every run comes from one source, the
runs cut into blocks of one size, and the source address of each block of the result is a sum
of strides over some factoring of the blocks' order (block ``b`` of the global value is block
``b // devices`` of device ``b % devices``), all the runs are one ``copy_`` from an
``as_strided`` view of the source (:func:`copy_at_once`): 4 copies per GPT-S step instead of
96. The blocks are checked one by one against the runs, so a pattern that does not factor is
left to the per-device copies.
"""

from __future__ import annotations

import itertools
import math

from torch import Tensor

from partita.values.mesh import Mesh

__all__ = ["copy_at_once", "factor_blocks", "unravel"]

Axes = tuple[bool, ...]  # the mesh axes a value varies along (``runtime.local``)
Run = tuple[int, int, int, int, int]  # (source, sender, source start, destination start, length)


def unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The mesh coordinates of flat position ``flat`` (row-major, as the stacked storage)."""
    out = []
    for s in reversed(shape):
        flat, c = divmod(flat, s)
        out.append(c)
    return tuple(reversed(out))


def copy_at_once(
    out: Tensor,
    out_axes: Axes,
    index_axes: Axes,
    runs: tuple[tuple[Run, ...], ...],
    inputs: list[tuple[Tensor, Axes]],
    dim: int,
    mesh: Mesh,
) -> bool:
    """Fill ``out`` with one strided copy when the runs form a regular pattern: one source,
    blocks of one size ``L``, and the source address of each ``L``-row block of ``out``
    (outer devices, then the devices of the index axes side by side with the blocks, as
    ``out`` is laid out) a sum of per-dim strides over some factoring of those blocks (q|k|v
    gradients re-laid out over ``model``: block ``b`` of the global value is block
    ``b // devices`` of device ``b % devices``). False, writing nothing, otherwise."""
    flat = [r for rs in runs for r in rs]
    if len({r[0] for r in flat}) != 1 or flat[0][0] < 0:
        return False
    value, axes = inputs[flat[0][0]]
    size = math.gcd(*(x for r in flat for x in r[2:]))
    lead = [i for i, v in enumerate(out_axes) if v]
    outer = [i for i in lead if not index_axes[i]]
    inner = [i for i in lead if index_axes[i]]
    k = sum(axes)
    held_strides = dict(zip([i for i, v in enumerate(axes) if v], value.stride()[:k], strict=True))
    row = value.stride(k + dim)
    mesh_strides = [math.prod(mesh.shape[i + 1 :]) for i in range(mesh.ndim)]

    def blocks(coords: dict[int, int]) -> list[int]:  # source address of each block, in order
        p = sum(coords.get(i, 0) * mesh_strides[i] for i in range(mesh.ndim))
        out: list[int] = []
        for _, sender, src, _, n in runs[p]:
            held = unravel(sender, mesh.shape)
            base = sum(held[i] * s for i, s in held_strides.items())
            out += [base + (src + t) * row for t in range(0, n, size)]
        return out

    def grid(dims: list[int], fixed: dict[int, int]) -> list[int]:  # inner devices x blocks
        return [
            a
            for c in itertools.product(*(range(mesh.shape[i]) for i in dims))
            for a in blocks({**fixed, **dict(zip(dims, c, strict=True))})
        ]

    base = grid(inner, {})
    factors = factor_blocks(base)
    if factors is None or any(s < 0 for _, s in factors):
        return False
    # each outer device dim: a constant shift of every block's address
    outer_steps = [grid(inner, {i: 1})[0] - base[0] if mesh.shape[i] > 1 else 0 for i in outer]
    if any(s < 0 for s in outer_steps):
        return False
    for c in itertools.product(*(range(mesh.shape[i]) for i in outer)):
        shift = sum(x * s for x, s in zip(c, outer_steps, strict=True))
        if grid(inner, dict(zip(outer, c, strict=True))) != [a + shift for a in base]:
            return False
    local = list(out.shape[len(lead) :])
    # ``out`` in memory order: [outer, local[:dim], inner devices and blocks, L, local[dim + 1:]]
    pos = {a: j for j, a in enumerate(lead)}
    order = [*(pos[a] for a in outer), *range(len(lead), len(lead) + dim)]
    order += [*(pos[a] for a in inner), *range(len(lead) + dim, out.dim())]
    shape = [*(mesh.shape[i] for i in outer), *local[:dim], *(n for n, _ in factors), size]
    shape += local[dim + 1 :]
    dst = out.permute(order).view(shape)
    stride = [*outer_steps, *value.stride()[k : k + dim], *(s for _, s in factors), row]
    stride += value.stride()[k + dim + 1 :]
    dst.copy_(value.as_strided(shape, stride, value.storage_offset() + base[0]))
    return True


def factor_blocks(addresses: list[int]) -> list[tuple[int, int]] | None:
    """``[(size, stride), ...]`` (outermost first) with ``addresses[i]`` equal to
    ``addresses[0]`` plus the strides weighted by ``i``'s digits in those sizes, or None."""
    n = len(addresses)
    if n == 1:
        return []
    step = addresses[1] - addresses[0]
    for inner in range(n, 1, -1):  # the longest run of ``step`` that repeats
        if n % inner or any(
            addresses[c + b] != addresses[c] + b * step
            for c in range(0, n, inner)
            for b in range(inner)
        ):
            continue
        rest = factor_blocks(addresses[::inner])
        return None if rest is None else [*rest, (inner, step)]
    return None
