"""The value a virtual-device tensor stands for: data, or a pending slot of the recording.

A :class:`Cell` is shared by a tensor and its aliases (``.data``, ``detach``, a Parameter): it
holds the value when it is known (a plain tensor means replicated, else a ShardedTensor), its
metadata (a meta tensor, or its description on the recording's fast path), its slot in the
current recording, and the annotation ``mark_sharding`` gave it. This module records nothing and
runs nothing; :mod:`partita.virtual.lazy` builds the tensors that point to cells.
"""

from __future__ import annotations

import torch

from partita.values.spec import Sharding
from partita.values.tensor import ShardedTensor
from partita.virtual import state

__all__ = ["Cell", "Desc"]

#: A value's metadata: shape, strides, storage offset, dtype.
Desc = tuple[tuple[int, ...], tuple[int, ...], int, torch.dtype]
_META = torch.device("meta")


class Cell:
    """One value of the virtual device: data, or a pending slot of the current recording.

    Attributes:
        data: the value when it is known (a plain tensor means replicated), else None.
        slot: its slot in the recording of ``epoch`` (None when not used there yet).
        meta: a meta tensor with its shape, dtype and strides.
        serial: increases with each cell made (which cells a call of a compiled step made).
        annotation: the sharding ``mark_sharding`` gave this value (None: not annotated, or
            cleared by ``clear_sharding``); aliases (``.data``, ``detach``) share it.
    """

    __slots__ = (
        "__weakref__",
        "_data",
        "_desc",
        "_meta",
        "annotation",
        "base",
        "dirty",
        "epoch",
        "in_flight",
        "serial",
        "slot",
    )

    def __init__(
        self,
        meta: torch.Tensor | None,
        data: torch.Tensor | ShardedTensor | None = None,
        base: Cell | None = None,
        desc: Desc | None = None,
    ) -> None:
        # Either a meta tensor or its description: recording's fast path knows an output's
        # description and builds the meta tensor only if something asks for it.
        self._meta = meta
        self._desc = desc
        self._data = data
        # True while a step that computes this value runs in the background (see step.sync):
        # the value exists, reading it waits.
        self.in_flight = False
        self.slot: int | None = None
        self.epoch = -1
        # The cell whose storage this one views (itself for a fresh value): an in-place update
        # of a view marks the base dirty, so reading the base syncs first.
        self.base: Cell = self if base is None else base.base
        self.dirty = False
        # Creation order: a compiled step tells the values it made from those it was given.
        self.serial = next(state.get().serials)
        self.annotation: Sharding | None = None

    @property
    def meta(self) -> torch.Tensor:
        """A meta tensor with the value's shape, dtype and strides (one object per cell)."""
        if self._meta is None:
            assert self._desc is not None
            shape, stride, offset, dtype = self._desc
            self._meta = torch.empty_strided(shape, stride, dtype=dtype, device=_META).as_strided(
                shape, stride, offset
            )
        return self._meta

    @property
    def desc(self) -> Desc:
        """``(shape, stride, storage offset, dtype)`` of the value."""
        desc = self._desc
        if desc is None:
            m = self.meta  # a meta tensor: its storage offset is a plain int
            desc = self._desc = (tuple(m.shape), m.stride(), int(m.storage_offset()), m.dtype)
        return desc

    @property
    def data(self) -> torch.Tensor | ShardedTensor | None:
        """The value (waits for the step computing it when that step is still running)."""
        if self.in_flight:
            state.get().wait_in_flight()
        return self._data

    @data.setter
    def data(self, value: torch.Tensor | ShardedTensor | None) -> None:
        self._data = value

    @property
    def has_value(self) -> bool:
        """True for data, including data a running step is computing."""
        return self._data is not None or self.in_flight

    @property
    def is_pending(self) -> bool:
        """True when the value is only known after the next sync."""
        return not self.has_value or self.base.dirty
