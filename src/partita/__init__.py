"""partita: whole-program SPMD sharding for PyTorch."""

from __future__ import annotations

import importlib

import partita.serialization  # noqa: F401  (lets torch.load(weights_only=True) read partita values)
from partita import data, distributed, options, presets
from partita.api import clear_sharding, mark_sharding
from partita.distributed import is_main_process, process_count, process_index
from partita.errors import (
    AnnotationError,
    CaptureError,
    CheckpointError,
    CompileCacheWarning,
    CompilerError,
    DistributedError,
    DtypeError,
    ExplicitCollectiveError,
    ImplicitCollectiveWarning,
    InputError,
    JitArgumentError,
    JoinTimeoutError,
    MeshError,
    OptionError,
    PartitaError,
    PartitaWarning,
    PlanMismatchError,
    RecompileWarning,
    RematerializationError,
    RematerializationWarning,
    ReplicaMismatchError,
    ReplicatedOpWarning,
    ReplicationError,
    ShardingConflictError,
    ShardingError,
    ShardMapError,
    ShardMapWarning,
    SpecError,
    StateDictError,
    TrainInputError,
    UnsupportedOpError,
    VirtualDeviceError,
)
from partita.jit import JitStats, Jitted, jit
from partita.manual import (
    all_gather,
    all_to_all,
    axis_index,
    axis_size,
    pmax,
    pmean,
    ppermute,
    psum,
    psum_scatter,
    shard_map,
)
from partita.mesh import HybridMesh, Mesh
from partita.options import CompileOptions
from partita.partition import CollectiveRecord, Plan
from partita.relayout import reshard
from partita.rules import FactorRule, einsum_rule, register_rule
from partita.scan_layers import scan_layers
from partita.spec import P, PartitionSpec, Sharding
from partita.tensor import Shard, ShardedTensor
from partita.training.train import TrainStep, train_step
from partita.virtual import compile, last_plan, metrics, sync, use_spmd
from partita.visualize import format_sharding, visualize_sharding

__version__ = "0.1.0"

__all__ = [
    "AnnotationError",
    "CaptureError",
    "CheckpointError",
    "CollectiveRecord",
    "CompileCacheWarning",
    "CompileOptions",
    "CompilerError",
    "DistributedError",
    "DtypeError",
    "ExplicitCollectiveError",
    "FactorRule",
    "HybridMesh",
    "ImplicitCollectiveWarning",
    "InputError",
    "JitArgumentError",
    "JitStats",
    "Jitted",
    "JoinTimeoutError",
    "Mesh",
    "MeshError",
    "OptionError",
    "P",
    "PartitaError",
    "PartitaWarning",
    "PartitionSpec",
    "Plan",
    "PlanMismatchError",
    "RecompileWarning",
    "RematerializationError",
    "RematerializationWarning",
    "ReplicaMismatchError",
    "ReplicatedOpWarning",
    "ReplicationError",
    "Shard",
    "ShardMapError",
    "ShardMapWarning",
    "ShardedTensor",
    "Sharding",
    "ShardingConflictError",
    "ShardingError",
    "SpecError",
    "StateDictError",
    "TrainInputError",
    "TrainStep",
    "UnsupportedOpError",
    "VirtualDeviceError",
    "__version__",
    "all_gather",
    "all_to_all",
    "axis_index",
    "axis_size",
    "checkpoint",
    "clear_sharding",
    "compile",
    "data",
    "distributed",
    "einsum_rule",
    "format_sharding",
    "is_main_process",
    "jit",
    "last_plan",
    "mark_sharding",
    "metrics",
    "options",
    "pmax",
    "pmean",
    "ppermute",
    "presets",
    "process_count",
    "process_index",
    "psum",
    "psum_scatter",
    "register_rule",
    "reshard",
    "scan_layers",
    "shard_map",
    "sync",
    "train_step",
    "use_spmd",
    "visualize_sharding",
]


def __getattr__(name: str) -> object:
    """Modules loaded on first use.

    ``partita.checkpoint`` imports ``torch.distributed.checkpoint``, about a quarter of
    ``import partita``'s time (every process of a job pays it), so it loads when first named.
    """
    if name == "checkpoint":
        return importlib.import_module("partita.checkpoint")
    raise AttributeError(f"module 'partita' has no attribute {name!r}")
