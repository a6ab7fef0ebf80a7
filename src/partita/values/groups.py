"""The device groups of a collective, computed on demand: no list per device is ever stored.

A collective over some mesh axes runs in the groups of devices that differ only along those
axes (``Mesh.groups``). A :class:`DeviceGroups` is that set of groups as a value: the mesh's
shape, axis names and device ids, and the axes. Its length, one group (``groups[i]``) and the
group size are arithmetic; only iterating, hashing or printing every group touches every
device (with numpy). So a Plan of a 16,384-device mesh holds one small value per collective,
and lowering costs the same on any mesh size.

It compares equal to the tuple of tuples of device ids it stands for, so code and tests that
wrote ``record.groups == ((0, 1, 2, 3), (4, 5, 6, 7))`` keep working.

This module only describes groups; ``Mesh.device_groups`` builds them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["DeviceGroups"]

#: Up to this many devices a DeviceGroups prints every group, as a tuple of tuples would.
PRINT_ALL = 64


@dataclass(frozen=True, slots=True, eq=False)
class DeviceGroups:
    """The groups of devices that vary only along ``mesh_axes`` (see the module docstring).

    Groups are ordered by the other axes in mesh order; each lists device ids major-first by
    ``mesh_axes`` as given.

    Example:
        >>> from partita.values.mesh import Mesh
        >>> groups = Mesh.create((2, 4), ("x", "y")).device_groups(("x",))
        >>> len(groups), groups.size, groups[1]
        (4, 2, (1, 5))
        >>> groups == ((0, 4), (1, 5), (2, 6), (3, 7))
        True
    """

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    mesh_axes: tuple[str, ...]
    #: The mesh's device ids in row-major position order; None for ``0 .. n-1``.
    device_ids: tuple[int, ...] | None = None
    _hash: list[int] = field(default_factory=list, repr=False)  # computed once, on demand

    @property
    def size(self) -> int:
        """Devices per group (the product of the sizes of ``mesh_axes``)."""
        sizes = dict(zip(self.axis_names, self.shape, strict=True))
        return math.prod(sizes[a] for a in self.mesh_axes)

    def __len__(self) -> int:
        return math.prod(self.shape) // self.size

    def _positions(self) -> np.ndarray:
        """``[groups, size]`` flat mesh positions (numpy: one pass over the devices)."""
        rest = [i for i, a in enumerate(self.axis_names) if a not in self.mesh_axes]
        order = rest + [self.axis_names.index(a) for a in self.mesh_axes]
        grid = np.arange(math.prod(self.shape)).reshape(self.shape)
        return grid.transpose(order).reshape(-1, self.size)

    def _ids(self, positions: np.ndarray) -> np.ndarray:
        if self.device_ids is None:
            return positions
        return np.asarray(self.device_ids, dtype=np.int64)[positions]

    def __getitem__(self, i: int) -> tuple[int, ...]:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"group {i} of {n} device groups")  # the sequence protocol's
        i %= n
        rest = [a for a in self.axis_names if a not in self.mesh_axes]
        sizes = dict(zip(self.axis_names, self.shape, strict=True))
        at = dict(zip(rest, np.unravel_index(i, [sizes[a] for a in rest]), strict=True))
        inner = np.unravel_index(np.arange(self.size), [sizes[a] for a in self.mesh_axes])
        along = dict(zip(self.mesh_axes, inner, strict=True))
        coords = [along[a] if a in along else np.full(self.size, at[a]) for a in self.axis_names]
        positions = np.ravel_multi_index(coords, self.shape)
        return tuple(self._ids(positions).tolist())

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        return iter(self.as_tuples())

    def as_tuples(self) -> tuple[tuple[int, ...], ...]:
        """Every group as a tuple of device ids (touches every device)."""
        return tuple(map(tuple, self._ids(self._positions()).tolist()))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DeviceGroups):
            same = (self.shape, self.axis_names, self.mesh_axes, self.device_ids)
            if same == (other.shape, other.axis_names, other.mesh_axes, other.device_ids):
                return True
            return len(self) == len(other) and self.as_tuples() == other.as_tuples()
        if isinstance(other, (tuple, list)):
            if len(other) != len(self):
                return False
            return self.as_tuples() == tuple(tuple(g) for g in other)
        return NotImplemented

    def __hash__(self) -> int:  # the tuple of tuples' hash: equal values hash equal
        if not self._hash:
            self._hash.append(hash(self.as_tuples()))
        return self._hash[0]

    def __repr__(self) -> str:
        if math.prod(self.shape) <= PRINT_ALL:
            return repr(self.as_tuples())
        axes = "×".join(self.mesh_axes) or "no axes"
        return f"DeviceGroups({len(self)} groups of {self.size} over {axes})"

    def describe(self) -> str:
        """``{0,4} {1,5} ...`` for a small mesh; the count, the size and the first and last
        group for a large one."""
        if math.prod(self.shape) <= PRINT_ALL:
            return " ".join("{" + ",".join(map(str, g)) + "}" for g in self)
        first, last = (",".join(map(str, self[i])) for i in (0, -1))
        return f"{len(self)} groups of {self.size}: {{{_short(first)}}} ... {{{_short(last)}}}"

    def __reduce__(self) -> tuple[Any, ...]:  # pickles without the cached hash
        return DeviceGroups, (self.shape, self.axis_names, self.mesh_axes, self.device_ids)


def _short(ids: str, keep: int = 40) -> str:
    return ids if len(ids) <= keep else ids[: keep // 2] + ",...," + ids[-keep // 2 :].lstrip(",")
