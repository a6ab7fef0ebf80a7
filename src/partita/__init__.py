"""partita: whole-program SPMD sharding for PyTorch."""

from __future__ import annotations

import importlib

import partita.values.serialization  # noqa: F401  (lets torch.load(weights_only=True) read partita values)
from partita import data, distributed, options, presets
from partita.distributed import is_main_process, process_count, process_index
from partita.errors import (
    AnnotationError,
    ArgumentError,
    ArgumentTypeError,
    AutoShardingWarning,
    CacheEntryError,
    CaptureError,
    CheckpointError,
    CompileCacheWarning,
    CompilerError,
    DistributedError,
    DtypeError,
    ExecutionError,
    ExplicitCollectiveError,
    HandlerCodeError,
    ImplicitCollectiveWarning,
    IndexRangeError,
    InputError,
    InternalError,
    JitArgumentError,
    JoinTimeoutError,
    LaunchError,
    MemoryLimitError,
    MeshError,
    MetaTensorError,
    OptionError,
    PartitaError,
    PartitaWarning,
    PipelineError,
    PlanMismatchError,
    RecompileWarning,
    RematerializationError,
    RematerializationWarning,
    ReplicaMismatchError,
    ReplicatedOpWarning,
    ReplicationError,
    RuleError,
    RuleRegistrationError,
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
from partita.frontend.annotate import clear_sharding, mark_sharding
from partita.frontend.jit import JitStats, Jitted, jit
from partita.frontend.reshard import reshard
from partita.frontend.scan_layers import scan_layers
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
from partita.options import CompileOptions
from partita.partition import CollectiveRecord, Plan
from partita.pipeline import Pipeline, PipelineReport, pipeline, pipeline_report
from partita.report.visualize import format_sharding, visualize_sharding
from partita.rules import FactorRule, einsum_rule, register_rule
from partita.training.train import TrainStep, train_step
from partita.values.mesh import HybridMesh, Mesh
from partita.values.spec import P, PartitionSpec, Sharding
from partita.values.tensor import Shard, ShardedTensor
from partita.virtual import compile, last_plan, metrics, sync, use_spmd

__version__ = "0.1.0"

__all__ = [
    "AnnotationError",
    "ArgumentError",
    "ArgumentTypeError",
    "AutoShardingWarning",
    "CacheEntryError",
    "CaptureError",
    "CheckpointError",
    "CollectiveRecord",
    "CompileCacheWarning",
    "CompileOptions",
    "CompilerError",
    "DistributedError",
    "DtypeError",
    "ExecutionError",
    "ExplicitCollectiveError",
    "FactorRule",
    "HandlerCodeError",
    "HybridMesh",
    "ImplicitCollectiveWarning",
    "IndexRangeError",
    "InputError",
    "InternalError",
    "JitArgumentError",
    "JitStats",
    "Jitted",
    "JoinTimeoutError",
    "LaunchError",
    "MemoryLimitError",
    "Mesh",
    "MeshError",
    "MetaTensorError",
    "OptionError",
    "P",
    "PartitaError",
    "PartitaWarning",
    "PartitionSpec",
    "Pipeline",
    "PipelineError",
    "PipelineReport",
    "Plan",
    "PlanMismatchError",
    "RecompileWarning",
    "RematerializationError",
    "RematerializationWarning",
    "ReplicaMismatchError",
    "ReplicatedOpWarning",
    "ReplicationError",
    "RuleError",
    "RuleRegistrationError",
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
    "pipeline",
    "pipeline_report",
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
