"""Sharded checkpoints on ``torch.distributed.checkpoint``: save on one mesh, load on another.

``partita.checkpoint.save(step, path)`` writes a TrainStep's state (or a dict of
ShardedTensors) with DCP, each process writing only the tiles it owns;
``partita.checkpoint.load(step, path)`` reads it back into whatever mesh and plan ``step`` has
now. The files are an ordinary DCP checkpoint named like ``model.state_dict()`` and
``get_optimizer_state_dict``, so plain PyTorch loads them too, plus partita's manifest
``partita.json`` (every file's sha256, checked on load; what marks a directory a save may
replace). See ``docs/checkpointing.md``.
"""

from __future__ import annotations

from partita.checkpoint.api import load, save
from partita.errors import CheckpointError

__all__ = ["CheckpointError", "load", "save"]
