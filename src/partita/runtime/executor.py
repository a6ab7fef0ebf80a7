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

import torch
from torch import fx

from partita.errors import MetaTensorError
from partita.runtime.dist_tensor import DistributedShardedTensor
from partita.runtime.distributed import distributed_executor
from partita.runtime.local import LocalMesh
from partita.values.mesh import Mesh
from partita.values.spec import Sharding
from partita.values.tensor import ShardedTensor

__all__ = ["CompiledProgram", "Executor", "check_has_data", "executor_for", "storage_of"]


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


def storage_of(x: ShardedTensor) -> torch.Tensor:
    """The tensor that holds ``x``'s data in this process, for its device and dtype (no copy):
    its held value, this rank's shards under torch.distributed, else its stacked storage."""
    if x.held is not None:
        return x.held[0]
    if isinstance(x, DistributedShardedTensor):
        return x.addressable_data
    return x.stacked


def check_has_data(leaves: Sequence[Any], where: str, names: Sequence[str] | None = None) -> None:
    """Refuse to run on meta tensors (shapes without data): a :class:`MetaTensorError` naming
    the first one (by ``names[i]``, else its position). ``lower()`` needs no data; running
    does.

    Example:
        >>> check_has_data([torch.ones(2)], "partita.jit(f)")   # real data: nothing to say
    """
    for i, leaf in enumerate(leaves):
        storage = storage_of(leaf) if isinstance(leaf, ShardedTensor) else leaf
        if isinstance(storage, torch.Tensor) and storage.is_meta:
            shape, name = tuple(leaf.shape), names[i] if names and i < len(names) else f"input {i}"
            raise MetaTensorError(
                f"{where}: {name} (shape {shape}, {leaf.dtype}) is on the meta device: it "
                f"has a shape but no data, so the program cannot run (lower() and the Plan "
                f"work without data; running needs it). Materialise the model, "
                f"model.to_empty(device='cpu') and then initialise it (model.apply(init), "
                f"reset_parameters()) or load a checkpoint into it (load_state_dict), before "
                f"building the step or jit from it, and pass batches of real tensors."
            )
