"""Partition specs (what users write) and Shardings (what every stage uses).

A :class:`PartitionSpec` (``P``) has one entry per tensor dim: a mesh axis name, a mesh axis
index, a tuple of those (the dim is split over several mesh axes, major first), or ``None``
(the dim is not split). A spec shorter than the tensor's rank means trailing ``None``s:
``P('data')`` on a 3-D tensor is ``P('data', None, None)``.

A :class:`Sharding` is the normalised form, bound to a :class:`~partita.Mesh` and a rank: for
each tensor dim the ordered tuple of mesh axis *names* it is split over, plus the mesh axes over
which the value is a *partial* (un-reduced) sum, max or min. Mesh axes used by no dim and not
partial mean replication.

This module holds values only; the index arithmetic of shards lives in ``partita.values.layout``.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Union

from partita.errors import SpecError
from partita.values.mesh import Mesh

__all__ = ["REDUCE_OPS", "P", "PartitionSpec", "Sharding", "as_spec"]

#: The reductions a partial value can be waiting for.
REDUCE_OPS = ("sum", "max", "min")

SpecAtom = Union[str, int]  # noqa: UP007 - a runtime alias; `|` needs Python 3.10 types
SpecEntry = Union[SpecAtom, tuple[SpecAtom, ...], None]  # noqa: UP007


def _canon_atom(atom: Any, where: str) -> SpecAtom:
    if isinstance(atom, bool) or not isinstance(atom, (str, numbers.Integral)):
        raise SpecError(
            f"PartitionSpec entry {where} must be a mesh axis name, a mesh axis index, a tuple "
            f"of those, or None; got {atom!r} of type {type(atom).__name__}."
        )
    return atom if isinstance(atom, str) else int(atom)


def _canon_entry(entry: Any, dim: int) -> SpecEntry:
    """Lists become tuples, 1-tuples their element, empty tuples None."""
    if entry is None:
        return None
    if isinstance(entry, (tuple, list)):
        atoms = tuple(_canon_atom(a, f"for dim {dim}") for a in entry)
        if not atoms:
            return None
        return atoms[0] if len(atoms) == 1 else atoms
    return _canon_atom(entry, f"for dim {dim}")


def _atoms(entry: SpecEntry) -> tuple[SpecAtom, ...]:
    if entry is None:
        return ()
    return entry if isinstance(entry, tuple) else (entry,)


@dataclass(frozen=True, slots=True, init=False)
class PartitionSpec:
    """How each dim of a tensor is split over mesh axes.

    Example:
        >>> P("data", None)
        P('data', None)
        >>> P(["x", "y"]) == P(("x", "y"))     # lists are canonicalised to tuples
        True
        >>> P(("x",)) == P("x")
        True
    """

    entries: tuple[SpecEntry, ...]

    def __init__(self, *entries: Any) -> None:
        canon = tuple(_canon_entry(e, i) for i, e in enumerate(entries))
        seen: list[SpecAtom] = []
        for atom in (a for e in canon for a in _atoms(e)):
            if atom in seen:
                raise SpecError(
                    f"PartitionSpec {_format_entries(canon)} uses mesh axis {atom!r} twice. "
                    f"A mesh axis can split at most one tensor dim; to split one dim over "
                    f"several axes write a tuple, e.g. P(('x', 'y'), None)."
                )
            seen.append(atom)
        object.__setattr__(self, "entries", canon)

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self):
        return iter(self.entries)

    def __getitem__(self, i: int) -> SpecEntry:
        return self.entries[i]

    def __repr__(self) -> str:
        return _format_entries(self.entries)

    @property
    def mesh_axes(self) -> tuple[SpecAtom, ...]:
        """Every mesh axis the spec uses, in order of appearance."""
        return tuple(a for e in self.entries for a in _atoms(e))

    def to_sharding(self, mesh: Mesh, ndim: int) -> Sharding:
        """Bind to a mesh and a tensor rank (pads with trailing ``None``).

        Raises :class:`~partita.errors.SpecError` for an unknown mesh axis, an axis used twice
        (by name and by index), or a spec longer than the rank.
        """
        if len(self.entries) > ndim:
            raise SpecError(
                f"PartitionSpec {self!r} has {len(self.entries)} entries but the tensor has rank "
                f"{ndim}. Give at most one entry per dim (trailing dims may be left out)."
            )
        dims: list[tuple[str, ...]] = []
        for entry in self.entries:
            names: list[str] = []
            for atom in _atoms(entry):
                if isinstance(atom, int) and not -mesh.ndim <= atom < mesh.ndim:
                    raise SpecError(
                        f"PartitionSpec {self!r} refers to mesh axis index {atom}, but "
                        f"{mesh!r} has {mesh.ndim} axes {mesh.axis_names}."
                    )
                if isinstance(atom, str) and atom not in mesh.axis_names:
                    raise SpecError(
                        f"PartitionSpec {self!r} refers to mesh axis {atom!r}, which {mesh!r} "
                        f"does not have. Its axes are {mesh.axis_names}."
                    )
                name = mesh.axis_name(atom)
                if any(name in d for d in (*dims, names)):
                    raise SpecError(
                        f"PartitionSpec {self!r} uses mesh axis {name!r} twice on {mesh!r}"
                        f"{f' (index {atom} is {name!r})' if isinstance(atom, int) else ''}: a "
                        f"mesh axis can split at most one dim. Use each axis once, or a tuple "
                        f"such as P(('data', 'model'), None) to split one dim over both."
                    )
                names.append(name)
            dims.append(tuple(names))
        dims.extend(() for _ in range(ndim - len(dims)))
        return Sharding(mesh, tuple(dims))


P = PartitionSpec


def _format_entries(entries: Sequence[SpecEntry]) -> str:
    return "P(" + ", ".join(repr(e) for e in entries) + ")"


def as_spec(spec: PartitionSpec | Sequence[Any] | None) -> PartitionSpec:
    """Accept a ``P``, a tuple/list of entries (PyTorch/XLA style) or ``None`` (replicated)."""
    if isinstance(spec, PartitionSpec):
        return spec
    if spec is None:
        return PartitionSpec()
    if isinstance(spec, (tuple, list)):
        return PartitionSpec(*spec)
    raise SpecError(
        f"Expected a PartitionSpec such as P('data', None), a tuple of entries, or None; "
        f"got {spec!r} of type {type(spec).__name__}."
    )


@dataclass(frozen=True, slots=True)
class Sharding:
    """The normalised sharding of one tensor on one mesh.

    Attributes:
        mesh: the mesh the value lives on.
        dim_axes: for each tensor dim, the mesh axis names it is split over, major first.
        partial: mesh axes over which the value is an un-reduced ``reduce_op`` (in mesh order).
        reduce_op: ``"sum"``, ``"max"`` or ``"min"``; meaningful only when ``partial`` is set.

    Example:
        >>> mesh = Mesh.create((2, 4), ("x", "y"))
        >>> s = P("y", "x").to_sharding(mesh, 2)
        >>> s.dim_axes, s.tile_shape
        ((('y',), ('x',)), (4, 2))
    """

    mesh: Mesh
    dim_axes: tuple[tuple[str, ...], ...]
    partial: tuple[str, ...] = ()
    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        dims = tuple(tuple(self.mesh.axis_name(a) for a in d) for d in self.dim_axes)
        used = [a for d in dims for a in d]
        if len(set(used)) != len(used):
            raise SpecError(f"Sharding {_format_dims(dims)} uses a mesh axis twice.")
        partial = {self.mesh.axis_name(a) for a in self.partial}
        if partial & set(used):
            raise SpecError(
                f"Mesh axes {sorted(partial & set(used))} cannot both split a dim and hold "
                f"partial values in one sharding."
            )
        if self.reduce_op not in REDUCE_OPS:
            raise SpecError(f"reduce_op must be one of {REDUCE_OPS}, got {self.reduce_op!r}.")
        object.__setattr__(self, "dim_axes", dims)
        object.__setattr__(self, "partial", tuple(a for a in self.mesh.axis_names if a in partial))
        if not partial:
            object.__setattr__(self, "reduce_op", "sum")

    # --- constructors --------------------------------------------------------------------

    @classmethod
    def replicated(cls, mesh: Mesh, ndim: int) -> Sharding:
        """Every device holds the whole value."""
        return cls(mesh, ((),) * ndim)

    # --- derived -------------------------------------------------------------------------

    @property
    def ndim(self) -> int:
        return len(self.dim_axes)

    @property
    def spec(self) -> PartitionSpec:
        """The PartitionSpec of the dims, one entry per dim (partial axes are not in a spec)."""
        entries: list[SpecEntry] = [
            None if not d else (d[0] if len(d) == 1 else d) for d in self.dim_axes
        ]
        return PartitionSpec(*entries)

    @property
    def tile_shape(self) -> tuple[int, ...]:
        """How many pieces each dim is cut into."""
        return tuple(self.mesh.axes_size(d) for d in self.dim_axes)

    @property
    def sharded_axes(self) -> tuple[str, ...]:
        """Mesh axes that split some dim, in dim order."""
        return tuple(a for d in self.dim_axes for a in d)

    @property
    def replicated_axes(self) -> tuple[str, ...]:
        """Mesh axes along which every device holds the same data (mesh order)."""
        busy = set(self.sharded_axes) | set(self.partial)
        return tuple(a for a in self.mesh.axis_names if a not in busy)

    @property
    def is_replicated(self) -> bool:
        return not self.sharded_axes and not self.partial

    @property
    def num_replicas(self) -> int:
        return self.mesh.axes_size(self.replicated_axes)

    def with_dims(self, dim_axes: Iterable[Iterable[str]]) -> Sharding:
        """The same mesh and partial axes with new dim axes."""
        return Sharding(self.mesh, tuple(tuple(d) for d in dim_axes), self.partial, self.reduce_op)

    def with_partial(self, partial: Iterable[str], reduce_op: str = "sum") -> Sharding:
        return Sharding(self.mesh, self.dim_axes, tuple(partial), reduce_op)

    def check_shape(self, shape: Sequence[int]) -> None:
        """Raise SpecError unless this sharding fits a tensor of ``shape``."""
        if len(shape) != self.ndim:
            raise SpecError(
                f"Sharding {self} is for rank {self.ndim}, but the tensor has shape "
                f"{tuple(shape)} (rank {len(shape)})."
            )

    def __repr__(self) -> str:
        return str(self)

    def __str__(self) -> str:
        text = repr(self.spec) if self.ndim else "P()"
        if self.partial:
            text += f" partial[{self.reduce_op}]({', '.join(self.partial)})"
        return text


def _format_dims(dims: Sequence[tuple[str, ...]]) -> str:
    return _format_entries([None if not d else (d[0] if len(d) == 1 else d) for d in dims])
