"""partita: whole-program SPMD sharding for PyTorch."""

from __future__ import annotations

from partita.errors import (
    AnnotationError,
    CaptureError,
    MeshError,
    PartitaError,
    RematerializationError,
    ShardingConflictError,
    ShardingError,
    SpecError,
    UnsupportedOpError,
)
from partita.mesh import HybridMesh, Mesh
from partita.spec import P, PartitionSpec, Sharding

__version__ = "0.1.0"

__all__ = [
    "AnnotationError",
    "CaptureError",
    "HybridMesh",
    "Mesh",
    "MeshError",
    "P",
    "PartitaError",
    "PartitionSpec",
    "RematerializationError",
    "Sharding",
    "ShardingConflictError",
    "ShardingError",
    "SpecError",
    "UnsupportedOpError",
    "__version__",
]
