"""Registering the virtual device ``spmd``: PyTorch's PrivateUse1 backend, renamed, in Python.

``register()`` makes ``torch.device("spmd")`` a real device once per process: the backend is
renamed, given a device module, hooks and a device guard (without the guard the autograd
engine aborts the process on the first ``requires_grad`` tensor of the device; without the hooks
``backward()`` refuses to run), and two factory kernels (``empty.memory_format`` and
``empty_strided``) return a :class:`~partita.virtual.lazy.LazyTensor`. Those two kernels are
what ``tensor.to(dev)``, ``module.to(dev)`` and ``torch.zeros(..., device=dev)`` call.

This module only registers; recording lives in :mod:`partita.virtual.dispatch`. Nothing is
registered when partita is imported: ``partita.use_spmd`` (or
:func:`partita.virtual.register_device`) calls :func:`register`. The registration is
process-global and cannot be undone (a PyTorch limitation), it needs the Python PrivateUse1
hooks of torch >= 2.9 (:data:`MIN_TORCH`), and it must come before the process's first
``backward()`` (:func:`register` checks).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from partita.errors import VirtualDeviceError
from partita.virtual import attention, autocast, draws, grad_scaler, lazy, rnn, state
from partita.virtual.state import DEVICE_NAME, Registration

__all__ = [
    "DEVICE_NAME",
    "MIN_TORCH",
    "VirtualDeviceError",
    "activate",
    "register",
]

#: The first torch release whose PrivateUse1 backend can be registered from Python.
MIN_TORCH = (2, 9)


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def check_torch(version: tuple[int, int] | None = None) -> None:
    """Raise :class:`VirtualDeviceError` unless torch is recent enough for the virtual device.

    Example:
        >>> check_torch((2, 13))
    """
    version = version or _torch_version()
    ok = version >= MIN_TORCH and hasattr(torch._C, "_acc")
    if not ok:
        need = ".".join(map(str, MIN_TORCH))
        raise VirtualDeviceError(
            f"partita.use_spmd: the virtual device needs torch >= {need}, but torch "
            f"{'.'.join(map(str, version))} is installed. The device is registered through "
            f"PyTorch's Python PrivateUse1 hooks (torch._C._acc), which older releases lack. "
            f"Upgrade torch (pip install 'torch>={need}'), or use partita.jit / "
            f"partita.train_step, which work on every supported torch."
        )


def activate() -> None:
    """Report the device as available from now on (``use_spmd``): the backend hooks and
    torch.utils.checkpoint's RNG stash ask. The device *module* never reports itself
    available (:meth:`_DeviceModule.is_available`)."""
    state.get().active = True


class _DeviceModule:
    """What ``torch.spmd`` answers: one device, its streams and RNG state."""

    @staticmethod
    def is_available() -> bool:
        # Never, even after use_spmd: code that looks for an accelerator by itself
        # (``torch.accelerator.is_available()``, DataLoader(pin_memory=True), DCP's
        # ``_get_available_device_type()``) must treat the machine as the CPU machine it is.
        # DataLoader would pin every batch for it, and a Python backend cannot give torch a
        # pinned-memory allocator (the first batch raised NotImplementedError). The device is
        # named explicitly instead: ``dev = partita.use_spmd(mesh)``.
        return False

    @property
    def _initialized(self) -> bool:
        # torch.utils.checkpoint saves and restores the device's RNG state only when set.
        return state.get().active

    @staticmethod
    def device(index: Any) -> contextlib.AbstractContextManager[None]:
        del index  # one device
        return contextlib.nullcontext()

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        del seed

    # The device's random ops run on the CPU generator (a step runs on CPU tensors), so its
    # RNG state is the CPU's, with the number of draws recorded but not yet run:
    # torch.random.fork_rng and activation checkpointing save and restore it through these
    # once the device is available (partita.virtual.draws).
    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        del device
        return draws.device_rng_state()

    @staticmethod
    def set_rng_state(rng: torch.Tensor, device: Any = None) -> None:
        del device
        draws.set_device_rng_state(rng)

    @staticmethod
    def get_amp_supported_dtype() -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    # Streams, as code written for accelerators asks them (torch.distributed.checkpoint's
    # writer copies device tensors to the CPU on the device's current stream). The device has
    # one stream and its copies to the CPU finish before they return (they sync the step).
    @staticmethod
    def current_stream(device: Any = None) -> _Stream:
        del device
        return _STREAM

    @staticmethod
    def default_stream(device: Any = None) -> _Stream:
        del device
        return _STREAM

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager[None]:
        del stream
        return contextlib.nullcontext()

    @staticmethod
    def synchronize(device: Any = None) -> None:
        """Wait for the steps already submitted (what ``torch.cuda.synchronize`` is to kernels);
        recorded ops still run at the next ``partita.sync()``."""
        del device
        state.get().wait_in_flight()


class _Stream:
    """The virtual device's one stream: its work is ordered, and a copy out is complete."""

    device_type = DEVICE_NAME
    device_index = 0

    def synchronize(self) -> None:
        _DeviceModule.synchronize()

    def wait_stream(self, stream: Any) -> None:
        del stream

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"<{DEVICE_NAME} stream>"


_STREAM = _Stream()


def _registration() -> Registration:
    registration = state.get().registration
    assert registration is not None, "the device's kernels run only once it is registered"
    return registration


def _empty_memory_format(size: Any, **kwargs: Any) -> torch.Tensor:
    return _registration().factory(tuple(size), kwargs.get("dtype"))


def _empty_strided(size: Any, stride: Any, **kwargs: Any) -> torch.Tensor:
    return _registration().factory(tuple(size), kwargs.get("dtype"))


#: Factories whose kernels write into an ``out`` they resize (``torch.eye(n, device=dev)`` makes
#: an empty tensor and fills it with ``eye.m_out``), which a device tensor without storage
#: cannot be: the result would silently stay empty. They run on the CPU, and are wrapped.
_CPU_FACTORIES = (
    "arange", "arange.start", "arange.start_step", "eye", "eye.m", "tril_indices",
    "triu_indices", "hann_window", "hann_window.periodic", "hamming_window",
    "hamming_window.periodic", "hamming_window.periodic_alpha",
    "hamming_window.periodic_alpha_beta", "blackman_window", "blackman_window.periodic",
    "bartlett_window", "bartlett_window.periodic", "kaiser_window", "kaiser_window.periodic",
    "kaiser_window.beta",
)  # fmt: skip


def _on_cpu(name: str) -> Callable[..., torch.Tensor]:
    """The PrivateUse1 kernel of the factory ``name``: computed on the CPU, then wrapped."""
    packet, _, overload = name.partition(".")
    op = getattr(getattr(torch.ops.aten, packet), overload or "default")

    def kernel(*args: Any, **kwargs: Any) -> torch.Tensor:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "pin_memory")}
        return _registration().wrap(op(*args, **kwargs))

    return kernel


def _copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    # torch.tensor(data, device=dev), torch.as_tensor and Tensor.new_tensor build the value on
    # the CPU and copy it in with the Python dispatch key excluded, so the copy reaches the
    # backend's kernel rather than the LazyTensor's __torch_dispatch__: hand it there.
    del non_blocking
    return lazy.dispatch(torch.ops.aten.copy_.default, (dst, src), {})  # type: ignore[no-any-return]


class _Hooks(torch._C._acc.PrivateUse1Hooks):  # type: ignore[misc]
    """The backend hooks torch's accelerator API asks: available only once switched on."""

    def is_available(self) -> bool:
        return state.get().active

    def has_primary_context(self, dev_id: int) -> bool:
        del dev_id
        return True


def register(factory: Callable[..., torch.Tensor], wrap: Callable[..., torch.Tensor]) -> None:
    """Register the device once; ``factory(shape, dtype)`` makes a new device tensor and
    ``wrap(cpu_tensor)`` one holding that value."""
    device = state.get()
    if device.registration is not None:
        return
    check_torch()
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    current = torch._C._get_privateuse1_backend_name()
    if current not in ("privateuseone", DEVICE_NAME):
        raise VirtualDeviceError(
            f"partita.use_spmd: PyTorch's PrivateUse1 backend is already registered as "
            f"{current!r} in this process, so it cannot become {DEVICE_NAME!r}. A process has one "
            f"PrivateUse1 backend; run the virtual device in a process without {current!r}."
        )
    registration = device.registration = Registration(factory, wrap)
    _setup_privateuseone_for_python_backend(
        rename=DEVICE_NAME if current != DEVICE_NAME else None,
        backend_module=_DeviceModule(),
        hook=_Hooks(),
    )
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("empty.memory_format", _empty_memory_format, "PrivateUse1")
    lib.impl("empty_strided", _empty_strided, "PrivateUse1")
    for name in _CPU_FACTORIES:
        lib.impl(name, _on_cpu(name), "PrivateUse1")
    lib.impl("_copy_from", _copy_from, "PrivateUse1")
    # One attention op in the recording rather than PyTorch's math decomposition (see
    # partita.virtual.attention); at the autograd key, so autograd records its derivative.
    lib.impl("scaled_dot_product_attention", attention.sdpa, "AutogradPrivateUse1")
    # nn.LSTM / nn.GRU: their fused cells (CUDA kernels) as the ops the CPU computes them with.
    lib.impl("_thnn_fused_lstm_cell", rnn.lstm_cell, "AutogradPrivateUse1")
    lib.impl("_thnn_fused_gru_cell", rnn.gru_cell, "AutogradPrivateUse1")
    # torch.amp.GradScaler: its unscale and scale-update kernels as ordinary ops.
    lib.impl("_amp_foreach_non_finite_check_and_unscale_", grad_scaler.unscale_,
             "AutogradPrivateUse1")  # fmt: skip
    lib.impl("_amp_update_scale_", grad_scaler.update_scale_, "AutogradPrivateUse1")
    # Mixed precision: torch.autocast("spmd", dtype=...) with PyTorch's CPU policy.
    fallback = torch.library.Library("_", "IMPL")
    autocast.register(lib, fallback)
    registration.libraries += [lib, fallback]  # kept: dropping a Library drops its kernels
    registration.backward_runs = _backward_runs()


class _Probe(torch.autograd.Function):
    """A backward that runs no op: enough for the autograd engine to pick the device's queue."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        del ctx
        return x.detach()  # runs at once on data (partita.virtual.immediate): nothing recorded

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        del ctx
        return grad


def _backward_runs() -> bool:
    """Whether a ``backward()`` can run on the device: False when this process ran one before
    the device was registered.

    PyTorch's autograd engine makes one queue per accelerator device at the process's first
    ``backward()`` and never again; a device registered later has none, and every backward on
    it fails an internal assert. One backward through a node on the device tells.
    """
    try:
        # use_spmd may be called under no_grad (the first ShardedTensor op outside jit is).
        with torch.inference_mode(False), torch.enable_grad():
            x = lazy.new_data(torch.zeros(()), requires_grad=True)
            torch.autograd.grad(_Probe.apply(x), x, lazy.new_data(torch.ones(())))
    except RuntimeError as e:
        if "device_ready_queues_" not in str(e):
            raise
        return False
    return True


def check_backward() -> None:
    """Raise :class:`VirtualDeviceError` when no ``backward()`` can run on the registered
    device (``use_spmd`` asks; ShardedTensor ops outside jit run no backward and do not)."""
    registration = state.get().registration
    if registration is not None and not registration.backward_runs:
        raise VirtualDeviceError(
            "partita.use_spmd: this process ran a backward() before the virtual device was "
            "registered, and PyTorch's autograd engine sizes its per-device queues at the "
            "first backward() of a process, so no backward can run on the device in this "
            "process. Call partita.use_spmd(mesh) (or partita.virtual.register_device()) before "
            "the first backward() of the process, e.g. at the top of the script."
        )
