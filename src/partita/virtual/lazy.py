"""The lazy tensor of the virtual device: a ``torch.Tensor`` whose operations are recorded.

A :class:`LazyTensor` is a wrapper subclass on ``spmd:0`` (shape, dtype and strides are real;
there is no storage). It points to a :class:`Cell`, the value it stands for, which is either
*data* (a plain tensor, replicated, or a :class:`~partita.ShardedTensor` laid out over the
mesh) or *pending* (the result of an op recorded since the last ``sync``). Every aten op that
reaches ``__torch_dispatch__`` (forward, autograd's backward, the optimizer's kernels) is
handed to :mod:`partita.virtual.recording`; ``.item()``, ``.cpu()`` and ``repr`` sync first.

``detach``/``alias`` (what ``.data`` and ``nn.Parameter`` use) share the cell, so
``p.data.mul_(2)`` updates ``p``. ``__tensor_flatten__`` makes ``module.to(dev)`` swap tensors,
so an ``nn.Parameter`` keeps its identity. This module does not compile or run anything.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any

import torch

from partita.errors import VirtualDeviceError
from partita.tensor import ShardedTensor
from partita.virtual.device import spmd_device

__all__ = [
    "COPYING",
    "DEVICE",
    "Cell",
    "Desc",
    "LazyTensor",
    "full_value",
    "lazies",
    "next_serial",
]

#: A value's metadata: shape, strides, storage offset, dtype.
Desc = tuple[tuple[int, ...], tuple[int, ...], int, torch.dtype]
_META = torch.device("meta")
_SERIALS = itertools.count()
#: True while ``copy.deepcopy`` copies a device tensor: a copy of data is data at once
#: (:mod:`partita.virtual.immediate`), so the copy can later be swapped by ``module.half()``,
#: which ``torch.utils.swap_tensors`` refuses for a pending tensor.
COPYING = [False]


class Cell:
    """One value of the virtual device: data, or a pending slot of the current recording.

    Attributes:
        data: the value when it is known (a plain tensor means replicated), else None.
        slot: its slot in the recording of ``epoch`` (None when not used there yet).
        meta: a meta tensor with its shape, dtype and strides.
        serial: increases with each cell made (which cells a call of a compiled step made).
    """

    __slots__ = (
        "__weakref__",
        "_data",
        "_desc",
        "_meta",
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
        self.serial = next(_SERIALS)

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
        if self._desc is None:
            m = self.meta
            self._desc = (tuple(m.shape), m.stride(), m.storage_offset(), m.dtype)
        return self._desc

    @property
    def data(self) -> torch.Tensor | ShardedTensor | None:
        """The value (waits for the step computing it when that step is still running)."""
        if self.in_flight:
            from partita.virtual.step import wait_in_flight

            wait_in_flight()
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


class LazyTensor(torch.Tensor):
    """A tensor on the virtual device (see the module docstring)."""

    _cell: Cell
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, cell: Cell, requires_grad: bool = False) -> LazyTensor:
        shape, stride, offset, dtype = cell.desc
        t = torch.Tensor._make_wrapper_subclass(
            cls,
            shape,
            strides=stride,
            storage_offset=offset,
            dtype=dtype,
            device=_DEVICE[0] if _DEVICE else _device(),
            requires_grad=requires_grad,
        )
        t._cell = cell
        return t

    def __init__(self, cell: Cell, requires_grad: bool = False) -> None:
        del cell, requires_grad

    @property  # type: ignore[override]
    def data(self) -> torch.Tensor:
        """A detached alias sharing this tensor's value (as ``torch.Tensor.data``)."""
        return _DATA.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        """``t.data = x``: ``t`` now stands for ``x``'s value (shape, dtype and later in-place
        updates shared), as eager ``Tensor.data`` assignment shares ``x``'s storage."""
        if not isinstance(value, LazyTensor):
            where = "a CPU" if value.device.type == "cpu" else f"a {value.device}"
            raise VirtualDeviceError(
                f"t.data = x: t ({list(self.shape)} {self.dtype}) is on the virtual device "
                f"{self.device}, x ({list(value.shape)} {value.dtype}) is {where} tensor; a "
                f"device tensor cannot hold a value that lives elsewhere. Fix: move it first, "
                f"t.data = x.to(t.device)"
            )
        _DATA.__set__(self, value)  # the wrapper's shape, strides and dtype
        self._cell = cell = value._cell
        if not cell.has_value:  # pending: an output of the step while this tensor is alive
            from partita.virtual.recording import current  # it imports this module

            current().live.append((weakref.ref(self), cell))

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return [], self._cell

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, Any], cell: Cell, outer_size: Any, outer_stride: Any
    ) -> LazyTensor:
        del inner, outer_size, outer_stride
        if torch.compiler.is_compiling():  # TorchDynamo making a fake copy of a device tensor
            raise VirtualDeviceError(
                "torch.compile was given tensors of the virtual device (spmd), which "
                "TorchDynamo cannot trace: their values exist only once a step runs. Call the "
                "model or function without torch.compile: every step on "
                "the device is already one compiled, sharded program; partita.compile(fn) "
                "captures a whole step function to replay it (docs/virtual-device.md)."
            )
        return LazyTensor(cell)

    @classmethod
    def __torch_dispatch__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict | None = None
    ) -> Any:
        if not _DISPATCH:
            from partita.virtual.recording import dispatch

            _DISPATCH.append(dispatch)
        with DEVICE:  # one op at a time on the device, whichever thread records it
            return _DISPATCH[0](func, args, kwargs or {})

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        del tensor_contents
        value = full_value(self)
        body = (
            repr(value)[len("tensor(") : -1] if repr(value).startswith("tensor(") else repr(value)
        )
        return f"tensor({body}, device='{self.device}')"

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        outer, COPYING[0] = COPYING[0], True
        try:
            return super().__deepcopy__(memo)
        finally:
            COPYING[0] = outer

    def __reduce_ex__(self, proto: Any) -> Any:
        """Pickled as its value, like an XLA tensor (``torch.save``): the CPU value, dtype and
        device, rebuilt by a function ``torch.load(weights_only=True)`` allows. Loading puts it
        on this device (``use_spmd`` must have run) or where ``map_location`` says. A sharding
        is not part of it: ``partita.checkpoint`` saves and restores shardings."""
        del proto
        rebuild = torch._utils._rebuild_device_tensor_from_cpu_tensor
        return rebuild, (full_value(self), self.dtype, str(self.device), self.requires_grad)

    def tolist(self) -> Any:
        """The value as (nested) Python numbers (syncs if it is pending)."""
        return full_value(self).tolist()

    def numpy(self, *, force: bool = False) -> Any:
        """The value as a numpy array (syncs if it is pending)."""
        return full_value(self).numpy(force=force)

    def full(self) -> torch.Tensor:
        """The global value as a plain CPU tensor (syncs if it is pending)."""
        return full_value(self)


_DATA = torch._C.TensorBase.data  # the C descriptor behind Tensor.data
#: Held while an op is recorded and while a sync takes the recording: the device records one
#: step for the whole process, so ops from several threads (two threads training their own
#: models, autograd's backward thread) go into it one at a time, never while a sync takes it.
DEVICE = threading.RLock()
_DEVICE: list[torch.device] = []
_DISPATCH: list[Any] = []  # recording.dispatch (imported on first use: it imports this module)


def _device() -> torch.device:
    _DEVICE.append(spmd_device())
    return _DEVICE[0]


def _sync_outside_dispatch() -> None:
    """Sync in a fresh thread when called from inside ``__torch_dispatch__``.

    Inside a subclass's ``__torch_dispatch__`` PyTorch excludes the dispatch keys above Python
    for this thread, functorch's ``vmap`` (which the LocalMesh runs on) among them; a thread
    starts with none excluded.
    """
    from partita.virtual.step import sync

    if not torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.FuncTorchBatched):
        sync()
        return
    errors: list[BaseException] = []

    def run() -> None:
        try:
            sync()
        except BaseException as e:  # re-raised in the caller's thread
            errors.append(e)

    worker = threading.Thread(target=run, name="partita-sync")
    held = DEVICE._release_save()  # type: ignore[attr-defined]  # the worker's sync takes it
    try:
        worker.start()
        worker.join()
    finally:
        DEVICE._acquire_restore(held)  # type: ignore[attr-defined]
    if errors:
        raise errors[0]


def full_value(t: LazyTensor) -> torch.Tensor:
    """The value of ``t`` as a plain CPU tensor, syncing the recording when it is pending."""
    cell = t._cell
    if cell.is_pending:
        _sync_outside_dispatch()
    data = cell.data
    value = data.full() if isinstance(data, ShardedTensor) else data
    assert value is not None  # a synced cell always holds data
    return value


def lazies(x: Any) -> list[LazyTensor]:
    """The LazyTensors in ``x`` (nested lists, tuples and dicts), in order."""
    if isinstance(x, LazyTensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in lazies(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in lazies(v)]
    return []


def next_serial() -> int:
    """A number above every cell's ``serial`` so far (cells made later have higher ones)."""
    return next(_SERIALS)
