"""The process API: which process this is, in a run of one process per device.

Under ``torchrun`` every process runs the same script and is one device of the mesh: process
(rank) ``r`` holds device ``r``. Call :func:`initialize` first; from then on ``partita.jit``
runs on the distributed mesh (``partita.runtime.distributed``). Without a launcher,
:func:`initialize` is a no-op that says so, and everything runs on the simulated LocalMesh in
this one process (``process_index() == 0``, ``process_count() == 1``).

=======================  ===============================================================
``initialize()``         join the run (deadline ``PARTITA_JOIN_TIMEOUT``), create the group
``process_index()``      this process's rank: ``0 .. process_count() - 1``
``process_count()``      the number of processes (devices) in the run
``host_index()``         this host's node rank under torchrun (``--node-rank``)
``local_devices()``      the mesh device ids this process holds
``is_main_process()``    ``process_index() == 0``: gate logging, sampling and checkpoints
``barrier()``            wait for every process (bounded by the collective timeout)
``log(*args)``           ``print`` once, from the main process, flushed
=======================  ===============================================================

See ``docs/multi-host.md``. This module holds no executor code (``partita.runtime`` does).
"""

from __future__ import annotations

import atexit
import gc
import sys
from typing import Any

import torch.distributed as dist

from partita.runtime import launch
from partita.runtime.comm import call_collective
from partita.runtime.distributed import close_executors
from partita.values.mesh import Mesh

__all__ = [
    "barrier",
    "host_index",
    "initialize",
    "is_initialized",
    "is_main_process",
    "local_devices",
    "log",
    "process_count",
    "process_index",
    "shutdown",
]


def is_initialized() -> bool:
    """True once :func:`initialize` (or ``torch.distributed.init_process_group``) has run."""
    return dist.is_available() and dist.is_initialized()


def initialize(
    timeout: float | None = None,
    *,
    backend: str | None = None,
    collective_timeout: float | None = None,
) -> bool:
    """Join the multi-process run that torchrun started; return True if there is one.

    Args:
        timeout: seconds to wait for every rank to join (default ``PARTITA_JOIN_TIMEOUT``,
            else 300). After it, every waiting process raises
            :class:`~partita.errors.JoinTimeoutError` naming the ranks and hosts that never
            joined.
        backend: ``"gloo"`` or ``"nccl"``; default NCCL when CUDA is available, else Gloo.
        collective_timeout: seconds a collective waits for its peers before failing (default
            ``PARTITA_COLLECTIVE_TIMEOUT``, else 300): a dead rank cannot hang the others.

    Without torchrun's environment (``RANK``, ``WORLD_SIZE``, ...), this prints one line to
    stderr and returns False: the program runs on the simulated LocalMesh. Calling it again
    is a no-op.

    Example:
        >>> import partita.distributed as pd
        >>> pd.initialize()  # under torchrun --nproc-per-node=4  # doctest: +SKIP
        True
        >>> pd.log(f"{pd.process_count()} processes")  # printed once  # doctest: +SKIP
    """
    if is_initialized():
        return True
    env = launch.read_env()
    if env is None:
        print(
            "partita.distributed.initialize(): no torchrun environment (RANK, WORLD_SIZE, "
            "MASTER_ADDR, MASTER_PORT are unset), so this is a single process and partita.jit "
            "runs on the simulated LocalMesh. Launch with torchrun to run one process per "
            "device.",
            file=sys.stderr,
            flush=True,
        )
        return False
    launch.join_and_init(
        env, timeout=timeout, backend=backend, collective_timeout_s=collective_timeout
    )
    # Destroy the process groups before the interpreter tears down: left to static
    # destructors, a Gloo group whose store host (rank 0) has already exited can abort the
    # process at exit ("terminate called without an active exception", status -6).
    atexit.register(shutdown)
    return True


def shutdown() -> None:
    """Destroy the process groups (optional: :func:`initialize` registers this at exit).

    partita's executors release their groups first and the groups are freed here, while the
    interpreter is alive: freed during interpreter teardown, a Gloo group whose peer failed
    aborts the process instead of letting it exit with its own status.
    """
    close_executors()
    if is_initialized():
        dist.destroy_process_group()
    gc.collect()


def process_index() -> int:
    """This process's rank (0 in a single process). Device ``process_index()`` lives here."""
    return dist.get_rank() if is_initialized() else 0


def process_count() -> int:
    """The number of processes in the run (1 in a single process)."""
    return dist.get_world_size() if is_initialized() else 1


def host_index() -> int:
    """This host's node rank (``torchrun --node-rank``); 0 in a single process."""
    env = launch.read_env()
    return env.node_rank if env is not None and is_initialized() else 0


def local_devices(mesh: Mesh | None = None) -> list[int]:
    """The mesh device ids whose shards this process holds.

    Under torch.distributed: ``[process_index()]`` (one process per device). In a single
    process every device of ``mesh`` is simulated here, so all of ``mesh.device_ids``
    (``[0]`` without a mesh).
    """
    if is_initialized():
        return [dist.get_rank()]
    return list(mesh.device_ids) if mesh is not None else [0]


def is_main_process() -> bool:
    """True on process 0 only (always True in a single process)."""
    return process_index() == 0


def barrier() -> None:
    """Wait until every process reaches this point (a no-op in a single process).

    Bounded: if a process never arrives, this raises after the collective timeout.
    """
    if is_initialized():
        call_collective("", "barrier", (), None, dist.barrier)


def log(*args: Any, sep: str = " ", end: str = "\n", file: Any = None) -> None:
    """``print`` on the main process only, flushed at once (other processes print nothing).

    Arguments are formatted on every process, so ``log(x)`` of a sharded ShardedTensor is
    safe: formatting gathers it on every process (a collective), the main process prints it.

    Example:
        >>> log(f"loss={torch.tensor(2.5).item():.4f}")  # in one process: the main one
        loss=2.5000
    """
    text = sep.join(str(a) for a in args)  # on every process: str() of a tensor may gather
    if is_main_process():
        print(text, end=end, file=file or sys.stdout, flush=True)
