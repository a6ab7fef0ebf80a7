"""``use_spmd(mesh, auto=True)``: which inputs of a step auto-sharding may lay out."""

from __future__ import annotations

import torch

from partita.values.tensor import ShardedTensor
from partita.virtual import recording
from partita.virtual.cell import Cell

__all__ = ["open_inputs_of"]


def open_inputs_of(rec: recording.Recording) -> set[int]:
    """The positions of the step's inputs that are plain (hence replicated) data
    ``mark_sharding`` did not annotate: auto-sharding chooses their layout."""
    return {
        i
        for i, (_, value) in enumerate(rec.inputs)
        if isinstance(value, Cell)
        and value.annotation is None
        and isinstance(value.data, torch.Tensor)
        and not isinstance(value.data, ShardedTensor)
    }
