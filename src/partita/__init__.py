"""partita: whole-program SPMD sharding for PyTorch."""

from __future__ import annotations

from partita.api import mark_sharding
from partita.errors import (
    AnnotationError,
    CaptureError,
    MeshError,
    PartitaError,
    PartitaWarning,
    RematerializationError,
    RematerializationWarning,
    ShardingConflictError,
    ShardingError,
    SpecError,
    UnsupportedOpError,
)
from partita.jit import Jitted, jit
from partita.mesh import HybridMesh, Mesh
from partita.partition import CollectiveRecord, Plan
from partita.spec import P, PartitionSpec, Sharding
from partita.tensor import Shard, ShardedTensor, clear_sharding, reshard
from partita.visualize import format_sharding, visualize_sharding

__version__ = "0.1.0"

__all__ = [
    "AnnotationError",
    "CaptureError",
    "CollectiveRecord",
    "HybridMesh",
    "Jitted",
    "Mesh",
    "MeshError",
    "P",
    "PartitaError",
    "PartitaWarning",
    "PartitionSpec",
    "Plan",
    "RematerializationError",
    "RematerializationWarning",
    "Shard",
    "ShardedTensor",
    "Sharding",
    "ShardingConflictError",
    "ShardingError",
    "SpecError",
    "UnsupportedOpError",
    "__version__",
    "clear_sharding",
    "format_sharding",
    "jit",
    "mark_sharding",
    "reshard",
    "visualize_sharding",
]
