"""Sharded data: a global tensor cut over a mesh, and the annotations users put on it.

A :class:`ShardedTensor` is a global value as the user sees it (global shape, dtype,
:class:`~partita.Sharding`) together with the storage of the simulated executor, the
*LocalMesh*: one torch tensor ``stacked`` of shape ``[mesh.size, *local_shape]`` that holds
every device's shard stacked along a leading device dim, in the mesh's flat row-major position
order, zero padded to the uniform (ceil) local shape. All cutting and gluing is the vectorised
arithmetic of :mod:`partita.values.layout`; nothing here loops over devices to move data.

This module works on *concrete* data only. It does not trace, propagate or partition, and it
does not communicate: :func:`reshard` is gather-then-slice until the partitioner's reshard
planner replaces it. A torch operation on a ShardedTensor (``x + 1``, ``model(x)``) is run by
the handler that :mod:`partita.virtual` installs with :func:`set_eager_ops`. Annotating traced
tensors inside a captured function is wired up in ``partita.frontend.annotate``.
"""

from __future__ import annotations

import reprlib
from collections.abc import Sequence
from typing import Any

import torch

from partita.errors import ShardingError
from partita.values.annotations import annotation_conflict
from partita.values.held import check_held, shard_held, stack_held, unshard_held
from partita.values.layout import (
    index_ranges,
    local_shape,
    replica_ids,
    shard_tensor,
    unshard_tensor,
)
from partita.values.mesh import Mesh
from partita.values.shard import Shard
from partita.values.spec import PartitionSpec, Sharding, as_spec
from partita.values.tensor_ops import EagerOps, set_eager_ops

__all__ = [
    "Shard",
    "ShardedTensor",
    "clear_sharding",
    "mark_sharding",
    "reshard",
    "reshard_target",
    "set_eager_ops",
]

SpecLike = PartitionSpec | Sequence[Any] | None


class ShardedTensor(EagerOps):
    """A global tensor whose shards live on the devices of a mesh (simulated in one process).

    Build one with :func:`mark_sharding`, :meth:`from_global` or :meth:`from_stacked`. The
    storage is ``stacked``: ``[mesh.size, *local_shape]``, shard ``p`` for mesh position ``p``;
    until that is first read, a value from :meth:`from_global` or :meth:`from_held` keeps each
    distinct tile once (``held``, ``values.held``).

    Example:
        >>> mesh = Mesh.create((4,), ("x",))
        >>> x = ShardedTensor.from_global(torch.arange(8.0), P("x").to_sharding(mesh, 1))
        >>> x.stacked.shape, x.full().tolist()
        (torch.Size([4, 2]), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    """

    __slots__ = ("_annotated", "_held", "_shape", "_sharding", "_stacked")

    def __init__(
        self,
        stacked: torch.Tensor | None,
        sharding: Sharding,
        shape: Sequence[int],
        *,
        annotated: bool = True,
        held: tuple[torch.Tensor, tuple[bool, ...]] | None = None,
    ) -> None:
        # Internal: use from_stacked / from_held (validated) or from_global. One of
        # ``stacked`` and ``held`` is set.
        self._stacked = stacked
        self._held = held
        self._sharding = sharding
        self._shape = torch.Size(shape)
        self._annotated = annotated

    # --- constructors --------------------------------------------------------------------

    @classmethod
    def from_global(cls, tensor: torch.Tensor, sharding: Sharding) -> ShardedTensor:
        """Cut a global tensor under ``sharding`` (the tensor is copied, not modified).

        Unless the sharding is partial, the copy is held as :meth:`from_held` holds a value,
        laid out as the global value (``values.held.shard_held``): ``partita.jit`` reads it
        as it reads a plain tensor; ``stacked`` is built on its first read.

        Example:
            >>> mesh = Mesh.create((2,), ("x",))
            >>> x = ShardedTensor.from_global(torch.zeros(3, 2), P("x").to_sharding(mesh, 2))
            >>> x.stacked.shape
            torch.Size([2, 2, 2])
        """
        tensor = _check_tensor(tensor, "ShardedTensor.from_global")
        _check_sharding(sharding, "ShardedTensor.from_global")
        sharding.check_shape(tensor.shape)
        if sharding.partial:
            return cls(shard_tensor(tensor, sharding), sharding, tensor.shape)
        return cls(None, sharding, tensor.shape, held=shard_held(tensor, sharding))

    @classmethod
    def from_stacked(
        cls, stacked: torch.Tensor, sharding: Sharding, shape: Sequence[int]
    ) -> ShardedTensor:
        """Wrap per-device storage ``[mesh.size, *local_shape]`` (what executors produce).

        The storage is used as is (not copied). Padding may hold anything: ``full()`` and
        ``unpadded_data`` slice it off.

        Example:
            >>> mesh = Mesh.create((2,), ("x",))
            >>> stacked = torch.tensor([[1, 2], [3, 0]])  # device 1 holds 3 and one padding
            >>> x = ShardedTensor.from_stacked(stacked, P("x").to_sharding(mesh, 1), (3,))
            >>> x.full().tolist()
            [1, 2, 3]
        """
        stacked = _check_tensor(stacked, "ShardedTensor.from_stacked")
        _check_sharding(sharding, "ShardedTensor.from_stacked")
        shape = tuple(int(n) for n in shape)
        sharding.check_shape(shape)
        expected = (sharding.mesh.size, *local_shape(sharding, shape))
        if tuple(stacked.shape) != expected:
            raise ShardingError(
                f"ShardedTensor.from_stacked got storage of shape {tuple(stacked.shape)}, but a "
                f"global shape {shape} under {sharding} on {sharding.mesh!r} needs {expected} "
                f"([mesh.size, *local_shape], local shapes ceil-padded). Check the global shape "
                f"and the sharding the storage was produced with."
            )
        return cls(stacked, sharding, shape)

    @classmethod
    def from_held(
        cls, value: torch.Tensor, axes: Sequence[bool], sharding: Sharding, shape: Sequence[int]
    ) -> ShardedTensor:
        """Wrap storage held once per position of the mesh axes it varies along: ``value`` is
        ``[*(mesh.shape[i] for the axes with axes[i] set), *local_shape]``, the same along
        every other axis (how the LocalMesh holds a weight sharded over ``model`` and
        replicated over ``data``). ``stacked`` copies it out to ``[mesh.size, *local]`` on its
        first read (a view when it varies along every axis or none), which drops the held
        form; ``partita.jit`` reads it as held, no copy."""
        value = _check_tensor(value, "ShardedTensor.from_held")
        _check_sharding(sharding, "ShardedTensor.from_held")
        axes = check_held(value, axes, sharding, tuple(int(n) for n in shape))
        return cls(None, sharding, shape, held=(value, axes))

    # --- the value -----------------------------------------------------------------------

    @property
    def sharding(self) -> Sharding:
        """The layout of the storage (still set after :func:`clear_sharding`)."""
        return self._sharding

    @property
    def spec(self) -> PartitionSpec:
        """The PartitionSpec of the dims (partial axes are in ``sharding.partial``)."""
        return self._sharding.spec

    @property
    def mesh(self) -> Mesh:
        return self._sharding.mesh

    @property
    def shape(self) -> torch.Size:
        """The global shape."""
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def dtype(self) -> torch.dtype:
        return self._held[0].dtype if self._held is not None else self._storage().dtype

    @property
    def stacked(self) -> torch.Tensor:
        """The storage: ``[mesh.size, *local_shape]``, one padded shard per mesh position."""
        return self._storage()

    @property
    def held(self) -> tuple[torch.Tensor, tuple[bool, ...]] | None:
        """``(value, axes)`` while held as :meth:`from_held` says, else None. Read-only."""
        return self._held

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The padded shape every device holds."""
        return local_shape(self._sharding, self._shape)

    def _storage(self) -> torch.Tensor:
        """``stacked``; the first read copies it out of the held form and drops that."""
        if self._stacked is None:
            assert self._held is not None  # one of the two is always set
            value, axes = self._held
            self._stacked = stack_held(value, axes, self.mesh.shape)
            self._held = None
        return self._stacked

    @property
    def is_annotated(self) -> bool:
        """False after :func:`clear_sharding`, until the next :func:`mark_sharding`."""
        return self._annotated

    def full(self) -> torch.Tensor:
        """Gather the global tensor (partial values reduced, padding removed); a new tensor.

        Example:
            >>> mark_sharding(torch.arange(3), Mesh.create((2,), ("x",)), P("x")).full()
            tensor([0, 1, 2])
        """
        held = self._held  # read in place: the held form stays (jit reads it as it is)
        if held is not None:
            value, out = held[0], unshard_held(*held, self._sharding, self._shape)
        else:
            value = self._storage()
            out = unshard_tensor(value, self._sharding, self._shape)
        if out.numel() and out.untyped_storage().data_ptr() == value.untyped_storage().data_ptr():
            out = out.clone()  # never hand out a view of the shards
        return out

    @property
    def local_shards(self) -> list[Shard]:
        """One :class:`Shard` per device, in mesh position order (padding-only devices too),
        each ``data`` a snapshot (a copy), as in PyTorch/XLA; :attr:`local_shard_views` views.

        Example:
            >>> x = mark_sharding(torch.arange(3), Mesh.create((2,), ("x",)), P("x"))
            >>> [(s.device, s.index, s.unpadded_data.tolist()) for s in x.local_shards]
            [(0, (slice(0, 2, None),), [0, 1]), (1, (slice(2, 3, None),), [2])]
        """
        return self._shards(copy=True)

    @property
    def local_shard_views(self) -> list[Shard]:
        """:attr:`local_shards` without the copy: each ``data`` views the storage (read-only)."""
        return self._shards(copy=False)

    def _shards(self, *, copy: bool) -> list[Shard]:
        replicas = replica_ids(self._sharding).tolist()
        storage = self._storage().clone() if copy else self._storage()
        shards = []
        for p, pairs in enumerate(index_ranges(self._sharding, self._shape).tolist()):
            data = storage[p]
            unpadded = data[tuple(slice(0, b - a) for a, b in pairs)]
            index = tuple(slice(a, b) for a, b in pairs)
            shards.append(Shard(data, unpadded, self.mesh.device_ids[p], index, replicas[p]))
        return shards

    def __repr__(self) -> str:
        # Indent the tensor's continuation lines under its first line.
        prefix = "ShardedTensor("
        body = repr(self.full()).replace("\n", "\n" + " " * len(prefix))
        cleared = "" if self._annotated else ", annotation cleared"
        return f"{prefix}{body}, sharding={self._sharding}, mesh={self.mesh!r}{cleared})"


# --- annotations ---------------------------------------------------------------------------


def mark_sharding(
    tensor: torch.Tensor | ShardedTensor, mesh: Mesh, spec: SpecLike
) -> ShardedTensor:
    """Shard a concrete tensor over ``mesh`` as ``spec`` says.

    ``spec`` is a ``P``, a tuple/list of entries (PyTorch/XLA style) or ``None`` (replicated);
    a spec shorter than the rank leaves the trailing dims unsplit.

    A ``torch.Tensor`` is left untouched: the result is a new ShardedTensor of a copy of its
    data. A ShardedTensor already annotated with the same sharding is returned as is, with
    another raises :class:`~partita.errors.AnnotationError`; once cleared
    (:func:`clear_sharding`) it is resharded *in place* and returned, as in PyTorch/XLA.

    Example:
        >>> mesh = Mesh.create((2, 4), ("data", "model"))
        >>> x = mark_sharding(torch.ones(8, 32), mesh, P("data", None))
        >>> x.sharding, x.local_shape
        (P('data', None), (4, 32))
    """
    if not isinstance(mesh, Mesh):
        raise ShardingError(
            f"mark_sharding expects a partita.Mesh as its second argument, got {mesh!r} of type "
            f"{type(mesh).__name__}. Build one with Mesh.create((2, 4), ('data', 'model'))."
        )
    if isinstance(tensor, ShardedTensor):
        return _mark_sharded(tensor, mesh, spec)
    tensor = _check_tensor(tensor, "mark_sharding")
    sharding = as_spec(spec).to_sharding(mesh, tensor.ndim)
    return ShardedTensor.from_global(tensor, sharding)


def _mark_sharded(x: ShardedTensor, mesh: Mesh, spec: SpecLike) -> ShardedTensor:
    sharding = as_spec(spec).to_sharding(mesh, x.ndim)
    if not x.is_annotated:
        fresh = ShardedTensor.from_global(x.full(), sharding)
        x._stacked, x._held = fresh._stacked, fresh._held
        x._sharding = sharding
        x._annotated = True
        return x
    if sharding == x.sharding:
        return x
    raise annotation_conflict(x.shape, x.sharding, sharding, mesh)


def clear_sharding(x: ShardedTensor) -> ShardedTensor:
    """Remove ``x``'s annotation in place and return ``x``.

    No data moves: the storage keeps its layout, and the next :func:`mark_sharding` may choose
    any sharding (even on another mesh) and reshards ``x`` in place, as in PyTorch/XLA.

    Example:
        >>> mesh = Mesh.create((2,), ("x",))
        >>> x = mark_sharding(torch.zeros(4, 2), mesh, P("x", None))
        >>> _ = clear_sharding(x)
        >>> mark_sharding(x, mesh, P(None, "x")) is x
        True
    """
    if not isinstance(x, ShardedTensor):
        raise ShardingError(
            f"clear_sharding expects a ShardedTensor (the result of mark_sharding), got "
            f"{type(x).__name__}. A plain torch.Tensor carries no annotation to clear."
        )
    x._annotated = False
    return x


def reshard_target(x: ShardedTensor, spec: SpecLike | Sharding) -> Sharding:
    """The sharding ``reshard(x, spec)`` moves ``x`` to; ``x`` must be a ShardedTensor."""
    if not isinstance(x, ShardedTensor):
        raise ShardingError(
            f"reshard expects a ShardedTensor, got {type(x).__name__}. For a plain "
            f"torch.Tensor use mark_sharding(tensor, mesh, spec)."
        )
    return spec if isinstance(spec, Sharding) else as_spec(spec).to_sharding(x.mesh, x.ndim)


def reshard(x: ShardedTensor, spec: SpecLike | Sharding) -> ShardedTensor:
    """A new ShardedTensor with the value of ``x`` under ``spec`` (on ``x``'s mesh).

    ``spec`` may also be a :class:`~partita.Sharding`, possibly on another mesh. Partial values
    are reduced. This is the move through the whole value (gather, then cut again), for a
    single process and for the two moves no program covers (another mesh, partial values):
    :func:`partita.reshard` (``partita.frontend.reshard``) plans every other move with the
    partitioner's collectives and runs under torch.distributed too.

    Example:
        >>> mesh = Mesh.create((2,), ("x",))
        >>> y = reshard(mark_sharding(torch.zeros(4, 2), mesh, P("x", None)), P(None, "x"))
        >>> y.sharding, y.local_shape
        (P(None, 'x'), (4, 1))
    """
    sharding = reshard_target(x, spec)
    return ShardedTensor.from_global(x.full(), sharding)


# --- checks ----------------------------------------------------------------------------------


def _check_tensor(value: Any, where: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ShardingError(
            f"{where} expects a torch.Tensor, got {reprlib.repr(value)} of type "
            f"{type(value).__name__}. "
            f"Convert it first, for example torch.as_tensor(value)."
        )
    return value


def _check_sharding(sharding: Any, where: str) -> None:
    if not isinstance(sharding, Sharding):
        raise ShardingError(
            f"{where} expects a partita.Sharding, got {sharding!r} of type "
            f"{type(sharding).__name__}. Bind a spec first: P('x', None).to_sharding(mesh, ndim)."
        )
