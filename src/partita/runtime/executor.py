"""The one executor protocol: what ``partita.jit`` (and the virtual device) call to run a program.

Both executors take a compiled signature (:class:`CompiledProgram`: the per-device program and
the shardings and shapes of its flattened inputs and outputs) and the global-level arguments
(ShardedTensors, or plain tensors holding the whole value), and return one
:class:`~partita.ShardedTensor` per output:

* :class:`~partita.runtime.local.LocalMesh` simulates every device of the mesh in this process;
* :class:`~partita.runtime.distributed.DistributedMesh` runs this process's device under
  torch.distributed and returns distributed ShardedTensors (this rank's tiles only).

:func:`executor_for` picks one, so callers never special-case either.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from torch import fx

from partita.runtime.distributed import distributed_executor
from partita.runtime.local import LocalMesh
from partita.values.mesh import Mesh
from partita.values.spec import Sharding
from partita.values.tensor import ShardedTensor

__all__ = ["CompiledProgram", "Executor", "executor_for"]


class CompiledProgram(Protocol):
    """A per-device program with the shardings and global shapes of its flat inputs/outputs.

    The distributed executor also reads ``program`` (the global program) to check that every
    process runs the same one; ``partita.jit``'s ``Compiled`` has it.
    """

    # Read-only members (properties), so a frozen dataclass holding lists satisfies them.
    @property
    def local(self) -> fx.GraphModule: ...
    @property
    def input_shardings(self) -> Sequence[Sharding]: ...
    @property
    def output_shardings(self) -> Sequence[Sharding]: ...
    @property
    def output_shapes(self) -> Sequence[tuple[int, ...]]: ...


class Executor(Protocol):
    """Runs compiled programs on one mesh."""

    mesh: Mesh

    def run_compiled(
        self, compiled: CompiledProgram, leaves: Sequence[Any]
    ) -> list[ShardedTensor]: ...


_LOCAL: dict[Mesh, LocalMesh] = {}


def executor_for(mesh: Mesh) -> Executor:
    """The DistributedMesh of ``mesh`` under torch.distributed, else its (cached) LocalMesh."""
    distributed = distributed_executor(mesh)
    if distributed is not None:
        return distributed
    local = _LOCAL.get(mesh)
    if local is None:
        local = _LOCAL[mesh] = LocalMesh(mesh)
    return local
