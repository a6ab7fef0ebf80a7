"""DCP planners that understand :class:`~partita.checkpoint.tiles.Tiles` leaves.

Both subclass DCP's default planners, so everything else in a state dict (plain tensors,
nested dicts, Python scalars) is handled exactly as ``torch.distributed.checkpoint`` handles
it, and the global plan is validated by DCP (every chunk inside its tensor, no two chunks
overlapping, the chunks covering it). Only ``Tiles`` leaves get partita's chunk lists.

One change beyond that: :class:`LoadPlanner` reads non-tensor entries with
``torch.load(..., weights_only=True)`` where DCP's default planner unpickles them with
``weights_only=False`` (see ``docs/checkpointing.md``). This module does no file handling.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import (
    _create_read_items,
    _create_write_items,
    create_read_items_for_chunk_list,
)

from partita.checkpoint.tiles import Tiles

__all__ = ["LoadPlanner", "SavePlanner"]


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner; a ``Tiles`` leaf becomes one SHARD write per chunk."""

    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        for fqn, obj in self.state_dict.items():
            if not isinstance(obj, Tiles):
                items += _create_write_items(fqn, obj)
                continue
            for offsets, data in obj.chunks.items():
                items.append(
                    WriteItem(
                        index=MetadataIndex(fqn, offsets),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets=offsets, sizes=data.size()),
                            properties=TensorProperties.create_from_tensor(data),
                            size=obj.size,
                        ),
                    )
                )
        plan = SavePlan(items)
        if self.flatten_state_dict:
            plan = dataclasses.replace(plan, planner_data=self.mappings)
        self.plan = plan
        return plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        if not isinstance(obj, Tiles):
            return super().lookup_object(index)
        assert index.offset is not None  # DCP indexes a chunk of a tensor by its offset
        data = obj.chunks[torch.Size(index.offset)]
        # a tile is a view of the stacked storage: torch.save would write all of it
        return data.clone() if data.untyped_storage().nbytes() != data.nbytes else data


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner; a ``Tiles`` leaf is filled chunk by chunk (resharding:
    DCP computes the overlap of every saved chunk with every chunk this process reads)."""

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        # DCP's version first rebuilds every leaf (to materialise meta-device tensors), which
        # would replace the Tiles this planner fills by copies; partita has no meta tensors.
        self.original_state_dict = state_dict
        self.state_dict, self.mappings = flatten_state_dict(state_dict)
        self.flatten_state_dict = True
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None  # set by set_up_planner, as in DCP
        items: list[ReadItem] = []
        for fqn, obj in self.state_dict.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if md is None:  # partita.checkpoint.safety checked which keys may be absent
                continue
            if isinstance(obj, Tiles):
                chunks = [ChunkStorageMetadata(o, d.size()) for o, d in obj.chunks.items()]
                items += create_read_items_for_chunk_list(fqn, md, chunks)  # type: ignore[arg-type]
            else:
                items += _create_read_items(fqn, md, obj)
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, Tiles):
            assert index.offset is not None  # DCP indexes a chunk of a tensor by its offset
            return obj.chunks[torch.Size(index.offset)]
        return super().lookup_tensor(index)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # weights_only: plain Python containers, numbers, strings and tensors only
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
