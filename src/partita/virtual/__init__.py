"""The SPMD virtual device: an unchanged PyTorch training loop, sharded by annotating tensors.

``dev = partita.use_spmd(mesh)`` returns ``torch.device("spmd", 0)``. Tensors moved there are
lazy (:mod:`lazy`): their ops are recorded (:mod:`dispatch`, :mod:`recording`),
``partita.sync()`` compiles and runs the step (:mod:`step`), ``partita.compile(step_fn)``
replays a captured step (:mod:`compiled`), and ``partita.mark_sharding`` lays a tensor out over
the mesh in place. See docs/virtual-device.md.

The modules import one way, by job: :mod:`state` (the one :class:`~state.DeviceState`) at the
bottom; the lazy tensor and what it records (:mod:`lazy`, :mod:`recording`, :mod:`shapes`,
:mod:`peek`, :mod:`immediate`, :mod:`dispatch`) and the torch registration (:mod:`device`) above
it; the step and program layer (:mod:`step`, :mod:`compiled`) above those; :mod:`switch`
(``use_spmd``) and this package on top. The two calls the lazy tensor makes upward (record an
op, sync the step) are handed to it here, by :func:`lazy.connect`.

Importing this package changes nothing in torch (no device, no kernel, no setting):
``use_spmd`` registers the device (:mod:`switch`).
"""

from __future__ import annotations

from partita.values.tensor import set_eager_ops
from partita.virtual import lazy
from partita.virtual.compiled import CompiledStep, compile
from partita.virtual.device import MIN_TORCH, VirtualDeviceError, check_torch
from partita.virtual.dispatch import dispatch
from partita.virtual.lazy import LazyTensor
from partita.virtual.plans import last_plan
from partita.virtual.sharded_ops import eager_op
from partita.virtual.step import Metrics, metrics, sync
from partita.virtual.switch import register_device, sharded, use_spmd

__all__ = [
    "MIN_TORCH",
    "CompiledStep",
    "LazyTensor",
    "Metrics",
    "VirtualDeviceError",
    "check_torch",
    "compile",
    "last_plan",
    "metrics",
    "register_device",
    "sharded",
    "sync",
    "use_spmd",
]

lazy.connect(dispatch=dispatch, sync=sync)
# ShardedTensor operations outside partita.jit (``x + 1``) run on the virtual device: partita's
# own hook (partita.tensor_ops), not torch's.
set_eager_ops(eager_op)
