"""The lazy tensor of the virtual device: a ``torch.Tensor`` whose operations are recorded.

A :class:`LazyTensor` is a wrapper subclass on ``spmd:0`` (shape, dtype and strides are real;
there is no storage). It points to a :class:`~partita.virtual.cell.Cell`, the value it stands
for, which is either *data* (a plain tensor, replicated, or a :class:`~partita.ShardedTensor`
laid out over the mesh) or *pending* (the result of an op recorded since the last ``sync``).
Every aten op that reaches ``__torch_dispatch__`` (forward, autograd's backward, the optimizer's
kernels) is handed to :mod:`partita.virtual.recording`; ``.item()``, ``.cpu()`` and ``repr``
sync first.

``detach``/``alias`` (what ``.data`` and ``nn.Parameter`` use) share the cell, so
``p.data.mul_(2)`` updates ``p``. ``__tensor_flatten__`` makes ``module.to(dev)`` swap tensors,
so an ``nn.Parameter`` keeps its identity. This module does not compile or run anything.

It sits below the layers that record and run ops (it imports only :mod:`partita.virtual.state`):
those hand it, once, the two calls it makes up into them (:func:`connect`): recording an op and
syncing the step.
"""

from __future__ import annotations

import contextvars
import threading
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from partita.errors import VirtualDeviceError
from partita.runtime.dist_tensor import DistributedShardedTensor
from partita.values.spec import PartitionSpec, Sharding
from partita.values.tensor import Shard, ShardedTensor
from partita.virtual import state
from partita.virtual.cell import Cell
from partita.virtual.state import DEVICE, DEVICE_NAME

__all__ = [
    "LazyTensor",
    "connect",
    "dispatch",
    "full_value",
    "held_value",
    "lazies",
    "new_data",
]


class _Above:
    """The calls into the layers above this module, given once by :func:`connect`."""

    dispatch: ClassVar[Callable[[Any, tuple[Any, ...], dict[str, Any]], Any] | None] = None
    sync: ClassVar[Callable[[], None] | None] = None


def connect(
    *,
    dispatch: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any],
    sync: Callable[[], None],
) -> None:
    """Give the lazy tensor the layers above it (``partita.virtual`` does at import):
    ``dispatch(func, args, kwargs)`` records or runs an op (:mod:`partita.virtual.dispatch`),
    ``sync()`` runs the recorded step (:mod:`partita.virtual.step`)."""
    _Above.dispatch, _Above.sync = dispatch, sync


class LazyTensor(torch.Tensor):
    """A tensor on the virtual device (see the module docstring)."""

    _cell: Cell
    # the documented way to turn __torch_function__ off in a subclass; torch's stub types the
    # attribute as a classmethod signature this function does not match
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]
    #: ``torch.device("spmd", 0)``, made on first use (only once the device is registered).
    _device: ClassVar[torch.device | None] = None

    @staticmethod
    def __new__(cls, cell: Cell, requires_grad: bool = False) -> LazyTensor:
        shape, stride, offset, dtype = cell.desc
        t = torch.Tensor._make_wrapper_subclass(
            cls,
            shape,
            strides=stride,
            storage_offset=offset,
            dtype=dtype,
            device=cls._device or cls._spmd_device(),
            requires_grad=requires_grad,
        )
        t._cell = cell
        return t

    def __init__(self, cell: Cell, requires_grad: bool = False) -> None:
        del cell, requires_grad

    @property
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
        rec = state.get().recording
        if not cell.has_value and rec is not None:  # pending: kept while this tensor is alive
            rec.live.append((weakref.ref(self), cell))

    @classmethod
    def _spmd_device(cls) -> torch.device:
        cls._device = torch.device(DEVICE_NAME, 0)
        return cls._device

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
    def __torch_dispatch__(  # type: ignore[override]  # torch's stub: (func, types, args, kwargs)
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict | None = None
    ) -> Any:
        with DEVICE:  # one op at a time on the device, whichever thread records it
            return _Above.dispatch(func, args, kwargs or {})  # type: ignore[misc]

    # torch.Tensor.__repr__ takes tensor_contents at runtime; its stub has no keyword
    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        del tensor_contents
        value = full_value(self)
        body = (
            repr(value)[len("tensor(") : -1] if repr(value).startswith("tensor(") else repr(value)
        )
        return f"tensor({body}, device='{self.device}')"

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        device = state.get()
        outer, device.copying = device.copying, True
        try:
            return super().__deepcopy__(memo)
        finally:
            device.copying = outer

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

    # --- the sharding, as a ShardedTensor answers it (docs/virtual-device.md) -------------

    @property
    def sharding(self) -> Sharding:
        """The layout of the value over the device's mesh (replicated unless sharded; syncs if
        it is pending: a computed value's layout is the one the step produced)."""
        return held_value(self).sharding

    @property
    def spec(self) -> PartitionSpec:
        """The PartitionSpec of :attr:`sharding`."""
        return self.sharding.spec

    @property
    def is_annotated(self) -> bool:
        """True after ``mark_sharding`` on this tensor (or its ``.data``), until
        ``clear_sharding``; a value the step computed is not annotated until marked."""
        return self._cell.annotation is not None

    @property
    def local_shards(self) -> list[Shard]:
        """One :class:`~partita.Shard` per device of the mesh (under torch.distributed, this
        process's): snapshots, as in PyTorch/XLA (syncs if pending). ``local_shard_views``
        gives read-only views of the device's storage instead."""
        return held_value(self).local_shards

    @property
    def local_shard_views(self) -> list[Shard]:
        """:attr:`local_shards` without the copy: views of the device's storage, read-only."""
        return held_value(self).local_shard_views


#: The C descriptor behind Tensor.data (a getset descriptor; torch's stubs type it as a Tensor).
_DATA: Any = torch._C.TensorBase.data


def dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Hand an op on device tensors to the recording layer, as ``__torch_dispatch__`` does
    (for the kernels and immediate ops that turn one op into another)."""
    return _Above.dispatch(func, args, kwargs)  # type: ignore[misc]


def new_data(value: torch.Tensor | ShardedTensor, requires_grad: bool = False) -> LazyTensor:
    """A LazyTensor holding ``value`` as data."""
    meta = torch.empty(tuple(value.shape), dtype=value.dtype, device="meta")
    return LazyTensor(Cell(meta, value), requires_grad=requires_grad)


def _sync_outside_dispatch() -> None:
    """Sync in a fresh thread when called from inside ``__torch_dispatch__``.

    Inside a subclass's ``__torch_dispatch__`` PyTorch excludes the dispatch keys above Python
    for this thread, functorch's ``vmap`` (which the LocalMesh runs on) among them; a thread
    starts with none excluded.
    """
    sync = _Above.sync
    assert sync is not None, "partita.virtual connects the lazy tensor at import"
    if not torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.FuncTorchBatched):
        sync()
        return
    errors: list[BaseException] = []

    def run() -> None:
        try:
            sync()
        except BaseException as e:  # re-raised in the caller's thread
            errors.append(e)

    # The caller's context goes along: partita.options.using(...) blocks apply to the sync.
    worker = threading.Thread(
        target=contextvars.copy_context().run, args=(run,), name="partita-sync"
    )
    with state.device_released():  # the worker's sync takes the device lock
        worker.start()
        worker.join()
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


def held_value(t: LazyTensor) -> ShardedTensor:
    """The value of ``t`` as the ShardedTensor the device holds, syncing when it is pending
    (no gather and no copy: a replicated plain value is viewed once per device)."""
    cell = t._cell
    if cell.is_pending:
        _sync_outside_dispatch()
    data = cell.data
    if isinstance(data, ShardedTensor):
        return data
    assert data is not None  # a synced cell always holds data
    mesh = state.get().mesh
    if mesh is None:
        raise VirtualDeviceError(
            "The virtual device has no mesh: a tensor on 'spmd' was used before "
            "partita.use_spmd(mesh). Call dev = partita.use_spmd(mesh) first."
        )
    sharding = Sharding.replicated(mesh, data.ndim)
    if dist.is_available() and dist.is_initialized():  # this process's device only
        return DistributedShardedTensor(data, sharding, data.shape, dist.get_rank())
    return ShardedTensor.from_held(data, (False,) * len(mesh.shape), sharding, data.shape)


def lazies(x: Any) -> list[LazyTensor]:
    """The LazyTensors in ``x`` (nested lists, tuples and dicts), in order."""
    if isinstance(x, LazyTensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in lazies(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in lazies(v)]
    return []
