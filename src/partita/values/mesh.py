"""Device meshes: device ids folded into a shape, one name per mesh axis.

A :class:`Mesh` is a pure value. It knows which device id sits at which mesh coordinate and
which devices form a group along some mesh axes; it never touches a device or a process group
(that is the executors' job, in ``partita.runtime``).

Devices are *positions* first: the flat (row-major) position ``p`` of a device in the mesh is
where the simulated executor stores its shard (``stacked[p]``), and ``mesh.device_ids[p]`` is its
id. For ``Mesh.create`` the two are the same.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from partita.errors import MeshError
from partita.values.groups import DeviceGroups

__all__ = ["MAX_DEVICES", "DeviceGroups", "HybridMesh", "Mesh"]

MeshAxis = str | int

#: The largest mesh partita builds: 2**20 = 1,048,576 devices, 16x the 65,536 of the largest
#: meshes planned (docs) and more accelerators than any one job runs. A mesh stores one Python
#: int per device (and its numpy views and group lists), so a mistyped size such as 2**31
#: would allocate until the machine runs out of memory; it is refused before anything of the
#: mesh's size is allocated.
MAX_DEVICES = 2**20


def _as_int(value: Any, what: str) -> int:
    """Accept Python and numpy integers (not bools, not floats) and return a Python int."""
    if type(value) is int:  # the common case, without the slow ABC check below
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise MeshError(
            f"{what} must be integers, got {value!r} of type {type(value).__name__}. "
            f"Pass whole numbers, for example list(range(8))."
        )
    return int(value)


def _check_size(dims: tuple[int, ...], where: str) -> None:
    """Refuse a mesh of more than :data:`MAX_DEVICES` devices (before allocating it)."""
    n = math.prod(dims)
    if n > MAX_DEVICES:
        raise MeshError(
            f"{where}: shape {dims} holds {n:,} devices, more than partita's limit of "
            f"{MAX_DEVICES:,} (2**20); nothing was allocated. Check the shape for a typo (a "
            f"size multiplied twice, 2**31 for 2**3): a mesh has one entry per accelerator."
        )


def _flatten_ids(device_ids: Any) -> tuple[int, ...]:
    if isinstance(device_ids, range):
        return tuple(device_ids)  # Mesh.create's ids: nothing to flatten or convert
    if isinstance(device_ids, np.ndarray):
        if device_ids.dtype.kind in "iu":  # Python ints already, without a loop
            return tuple(device_ids.reshape(-1).tolist())
        flat: Iterable[Any] = device_ids.reshape(-1)
    elif isinstance(device_ids, (str, bytes)) or not isinstance(device_ids, Iterable):
        raise MeshError(
            f"Mesh device_ids must be a sequence of integers, got {device_ids!r}. "
            f"Pass for example list(range(8)) or np.arange(8)."
        )
    elif isinstance(device_ids, tuple) and all(type(d) is int for d in device_ids):
        return device_ids
    else:
        flat = _flatten_nested(device_ids)
    return tuple(_as_int(d, "Mesh device ids") for d in flat)


def _flatten_nested(values: Iterable[Any]) -> list[Any]:
    out: list[Any] = []
    for v in values:
        if isinstance(v, (list, tuple, np.ndarray)):
            out.extend(_flatten_nested(v))
        else:
            out.append(v)
    return out


@dataclass(frozen=True, slots=True, init=False)
class Mesh:
    """A logical mesh of devices with named axes.

    Args:
        device_ids: the device ids in row-major mesh order (a flat sequence, a nested list or
            a numpy array; it is flattened).
        shape: the size of each mesh axis; its product must equal the number of ids.
        axis_names: one unique name per mesh axis. ``None`` names them ``axis0``, ``axis1``...

    Example:
        >>> mesh = Mesh([0, 1, 2, 3, 4, 5, 6, 7], (2, 4), ("x", "y"))
        >>> mesh
        Mesh(x=2, y=4)
        >>> mesh.axis_size("y")
        4
    """

    device_ids: tuple[int, ...]
    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    _sizes: dict[str, int] = field(init=False, repr=False, compare=False, hash=False)
    # Computed once in __init__ (a mesh is frozen): the ids as a read-only numpy array of the
    # mesh's shape, whether they are 0 .. n-1, and the hash (of a tuple of every id).
    _devices: np.ndarray = field(init=False, repr=False, compare=False, hash=False)
    _contiguous: bool = field(init=False, repr=False, compare=False, hash=False)
    _hash: int = field(init=False, repr=False, compare=False, hash=False)

    def __init__(
        self,
        device_ids: Sequence[int] | np.ndarray,
        shape: Sequence[int],
        axis_names: Sequence[str] | None = None,
    ) -> None:
        if isinstance(shape, numbers.Integral) and not isinstance(shape, bool):
            shape = (int(shape),)
        if isinstance(shape, (str, bytes)) or not isinstance(shape, Iterable):
            raise MeshError(f"Mesh shape must be a sequence of integers, got {shape!r}.")
        dims = tuple(_as_int(s, "Mesh shape entries") for s in shape)
        if not dims:
            raise MeshError("Mesh shape must have at least one axis, got (). Use shape=(1,).")
        if any(s < 1 for s in dims):
            raise MeshError(f"Mesh shape entries must be positive, got {dims}.")
        _check_size(dims, "Mesh")
        ids = _flatten_ids(device_ids)
        # numpy, not Python loops: a mesh of 16,384 devices builds in about a millisecond
        array = np.asarray(ids, dtype=np.int64)
        contiguous = isinstance(device_ids, range) and device_ids == range(len(ids))
        if not contiguous and array.size and int(array.min()) < 0:
            raise MeshError(f"Mesh device ids must be non-negative, got {list(ids)}.")
        if not contiguous and np.unique(array).size != array.size:
            dupes = sorted({d for d in ids if ids.count(d) > 1})
            raise MeshError(
                f"Mesh device ids must be unique, but {dupes} appear more than once in "
                f"{list(ids)}. Each device can sit at only one mesh position."
            )
        if math.prod(dims) != len(ids):
            raise MeshError(
                f"Mesh shape {dims} holds {math.prod(dims)} devices, but {len(ids)} device ids "
                f"were given. Make the product of the shape equal the number of ids, for example "
                f"Mesh(list(range({math.prod(dims)})), {dims})."
            )
        if axis_names is None:
            names = tuple(f"axis{i}" for i in range(len(dims)))
        else:
            if isinstance(axis_names, str):
                axis_names = (axis_names,)
            names = tuple(axis_names)
            if any(not isinstance(n, str) or not n for n in names):
                raise MeshError(f"Mesh axis names must be non-empty strings, got {names!r}.")
            if len(names) != len(dims):
                raise MeshError(
                    f"Mesh has {len(dims)} axes (shape {dims}) but {len(names)} axis names "
                    f"{names!r}: give exactly one name per axis."
                )
            if len(set(names)) != len(names):
                twice = sorted({n for n in names if names.count(n) > 1})
                raise MeshError(
                    f"Mesh axis names must be unique, but {twice} appear more than once in "
                    f"{names!r}."
                )
        object.__setattr__(self, "device_ids", ids)
        object.__setattr__(self, "shape", dims)
        object.__setattr__(self, "axis_names", names)
        object.__setattr__(self, "_sizes", dict(zip(names, dims, strict=True)))
        array = array.reshape(dims)
        array.flags.writeable = False
        object.__setattr__(self, "_devices", array)
        contiguous = contiguous or bool((array.ravel() == np.arange(array.size)).all())
        object.__setattr__(self, "_contiguous", contiguous)
        object.__setattr__(self, "_hash", hash((ids, dims, names)))

    @classmethod
    def create(cls, shape: Sequence[int] | int, axis_names: Sequence[str] | None = None) -> Mesh:
        """A mesh over devices ``0 .. n-1`` in row-major order.

        Example:
            >>> Mesh.create((2, 4), ("data", "model"))
            Mesh(data=2, model=4)
        """
        if not isinstance(shape, numbers.Integral | Iterable):
            raise MeshError(
                f"Mesh.create(shape={shape!r}): the shape must be an int or a sequence of ints "
                f"(devices per mesh axis), got {type(shape).__name__}. Write "
                f"Mesh.create((2, 4), ('data', 'model')) or Mesh.create(8, ('data',))."
            )
        dims: tuple[Any, ...] = (shape,) if isinstance(shape, numbers.Integral) else tuple(shape)
        sizes = tuple(_as_int(s, "Mesh shape entries") for s in dims)
        if sizes and all(s >= 1 for s in sizes):
            _check_size(sizes, "Mesh.create")
        n = math.prod(sizes) if dims else 0
        return cls(range(n), dims, axis_names)

    # --- shape queries -------------------------------------------------------------------

    @property
    def size(self) -> int:
        """The number of devices."""
        return len(self.device_ids)

    @property
    def ndim(self) -> int:
        """The number of mesh axes."""
        return len(self.shape)

    @property
    def axis_sizes(self) -> dict[str, int]:
        """``{axis name: size}`` in mesh order."""
        return dict(zip(self.axis_names, self.shape, strict=True))

    @property
    def devices(self) -> np.ndarray:
        """The device ids as a numpy array of the mesh's shape (read-only)."""
        return self._devices

    def __hash__(self) -> int:
        return self._hash

    def __getstate__(self) -> tuple[Any, ...]:  # pickled as its ids, shape and names only
        return (self.device_ids, self.shape, self.axis_names)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        Mesh.__init__(self, *state)

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Mesh):
            return NotImplemented
        return (self._hash, self.shape, self.axis_names, self.device_ids) == (
            other._hash,
            other.shape,
            other.axis_names,
            other.device_ids,
        )

    def axis_name(self, mesh_axis: MeshAxis) -> str:
        """The name of a mesh axis given by name or by index."""
        if isinstance(mesh_axis, bool):
            raise MeshError(f"Mesh axis must be a name or an index, got {mesh_axis!r}.")
        if isinstance(mesh_axis, numbers.Integral):
            i = int(mesh_axis)
            if not -self.ndim <= i < self.ndim:
                raise MeshError(
                    f"Mesh axis index {i} is out of range for {self!r}, which has "
                    f"{self.ndim} axes {self.axis_names}."
                )
            return self.axis_names[i]
        if mesh_axis not in self.axis_names:
            raise MeshError(
                f"Unknown mesh axis {mesh_axis!r} for {self!r}; its axes are {self.axis_names}."
            )
        return mesh_axis

    def axis_index(self, mesh_axis: MeshAxis) -> int:
        """The position of a mesh axis given by name or by index."""
        return self.axis_names.index(self.axis_name(mesh_axis))

    def axis_size(self, mesh_axis: MeshAxis) -> int:
        """The number of devices along a mesh axis."""
        return self.shape[self.axis_index(mesh_axis)]

    def axes_size(self, mesh_axes: Iterable[MeshAxis]) -> int:
        """The product of the sizes of several mesh axes (1 for none)."""
        sizes = self._sizes
        return math.prod(sizes[a] if a in sizes else self.axis_size(a) for a in mesh_axes)

    # --- device queries ------------------------------------------------------------------

    def position(self, device: int) -> int:
        """The flat row-major position of a device id in this mesh."""
        if self._contiguous and isinstance(device, int) and 0 <= device < self.size:
            return device
        try:
            return self.device_ids.index(device)
        except ValueError:
            raise MeshError(
                f"Device {device} is not in {self!r} (ids {list(self.device_ids)})."
            ) from None

    def coords(self, device: int) -> dict[str, int]:
        """The mesh coordinate of a device id, ``{axis name: index}``."""
        flat = np.unravel_index(self.position(device), self.shape)
        return {name: int(c) for name, c in zip(self.axis_names, flat, strict=True)}

    def groups(self, mesh_axes: Iterable[MeshAxis]) -> list[list[int]]:
        """The device groups that vary only along ``mesh_axes``.

        Each group lists device ids ordered major-first by ``mesh_axes`` as given; groups are
        ordered by the remaining axes in mesh order. These are the groups a collective over
        those axes runs in.

        Example:
            >>> Mesh.create((2, 4), ("x", "y")).groups(["x"])
            [[0, 4], [1, 5], [2, 6], [3, 7]]
        """
        names = [self.axis_name(a) for a in mesh_axes]
        if len(set(names)) != len(names):
            raise MeshError(f"Mesh axes {names} repeat an axis.")
        rest = [n for n in self.axis_names if n not in names]
        order = [self.axis_names.index(n) for n in rest + names]
        arr = self.devices.transpose(order).reshape(-1, self.axes_size(names))
        return arr.tolist()

    def device_groups(self, mesh_axes: Iterable[MeshAxis]) -> DeviceGroups:
        """The groups of :meth:`groups` as a :class:`DeviceGroups`: computed on demand, equal
        to the tuple of tuples of ids (what a Plan's collective records hold).

        Example:
            >>> Mesh.create((2, 4), ("x", "y")).device_groups(["x"])[3]
            (3, 7)
        """
        names = tuple(self.axis_name(a) for a in mesh_axes)
        if len(set(names)) != len(names):
            raise MeshError(f"Mesh axes {list(names)} repeat an axis.")
        ids = None if self._contiguous else self.device_ids
        return DeviceGroups(self.shape, self.axis_names, names, ids)

    def __repr__(self) -> str:
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape, strict=True))
        if not self._contiguous:
            return f"Mesh({axes}, device_ids={list(self.device_ids)})"
        return f"Mesh({axes})"


def HybridMesh(  # noqa: N802 - named like a class, as in PyTorch/XLA
    ici_mesh_shape: Sequence[int],
    dcn_mesh_shape: Sequence[int] | None = None,
    axis_names: Sequence[str] | None = None,
    *,
    devices_per_host: int | None = None,
) -> Mesh:
    """A mesh over several hosts whose across-host (dcn) part of each axis is major.

    Host ``h`` owns devices ``h * d .. h * d + d - 1`` with ``d = prod(ici_mesh_shape)``, the
    usual numbering under ``torchrun`` (global rank = host * devices per host + local rank).
    The mesh has shape ``ici[i] * dcn[i]`` on each axis; along axis ``i`` the coordinate is
    ``dcn_coord * ici[i] + ici_coord``, so a collective over an axis whose dcn size is 1 stays
    inside one host.

    Example: two hosts of four devices, data parallel across hosts and model parallel within:

        >>> m = HybridMesh((1, 4), (2, 1), ("data", "model"))
        >>> m.devices.tolist()
        [[0, 1, 2, 3], [4, 5, 6, 7]]
        >>> m = HybridMesh(ici_mesh_shape=(2, 2), dcn_mesh_shape=(1, 2), axis_names=("x", "y"))
        >>> m.devices.tolist()
        [[0, 1, 4, 5], [2, 3, 6, 7]]

    ``devices_per_host``, when given, must equal ``prod(ici_mesh_shape)``; it exists to catch a
    mesh built for a different machine.
    """
    ici = tuple(_as_int(s, "HybridMesh ici_mesh_shape entries") for s in ici_mesh_shape)
    dcn = (
        (1,) * len(ici)
        if dcn_mesh_shape is None
        else tuple(_as_int(s, "HybridMesh dcn_mesh_shape entries") for s in dcn_mesh_shape)
    )
    if len(ici) != len(dcn):
        raise MeshError(
            f"HybridMesh ici_mesh_shape {ici} and dcn_mesh_shape {dcn} must have the same "
            f"number of axes; use 1 for an axis that does not span hosts (or stays in one host)."
        )
    if any(s < 1 for s in ici + dcn):
        raise MeshError(f"HybridMesh shapes must be positive, got ici={ici}, dcn={dcn}.")
    per_host = math.prod(ici)
    if devices_per_host is not None and devices_per_host != per_host:
        raise MeshError(
            f"HybridMesh ici_mesh_shape {ici} covers {per_host} devices per host, but each host "
            f"has {devices_per_host}. Make the product of ici_mesh_shape equal the devices per "
            f"host."
        )
    _check_size(tuple(d * i for d, i in zip(dcn, ici, strict=True)), "HybridMesh")
    n_hosts = math.prod(dcn)
    # ids[dcn coords..., ici coords...] = host * per_host + local, then interleave per axis.
    ids = np.arange(n_hosts * per_host).reshape(dcn + ici)
    k = len(ici)
    order = [j for i in range(k) for j in (i, k + i)]
    shape = tuple(d * i for d, i in zip(dcn, ici, strict=True))
    return Mesh(ids.transpose(order).reshape(shape), shape, axis_names)
