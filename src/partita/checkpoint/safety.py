"""Never a mismatched or damaged checkpoint read: checks before and while every load.

A load reads DCP's ``.metadata`` (after checking its sha256 against the checkpoint's
manifest, :mod:`partita.checkpoint.directory`) and checks the whole request against it *before*
reading any tensor: every key present (or listed as missing), every size and dtype equal, every
file there and long enough for the bytes the metadata says it holds. While DCP reads, each data
file is checked against its sha256 before its first byte is used, and errors raised while
reading are re-raised naming the tensor being read. Every failure is a
:class:`~partita.errors.CheckpointError`. This module builds no state dicts and writes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from partita.checkpoint.directory import Manifest, verify_file
from partita.checkpoint.tiles import Tiles
from partita.errors import CheckpointError

__all__ = [
    "NamingReader",
    "check_request",
    "read_metadata",
    "unwrap",
]


def unwrap(e: BaseException) -> BaseException:
    """The first underlying error of a DCP ``CheckpointException`` (one per failing rank)."""
    if isinstance(e, CheckpointException):
        for inner, _trace in e.failures.values():
            return unwrap(inner)
    return e


def read_metadata(directory: Path, manifest: Manifest | None) -> Metadata:
    """DCP's ``.metadata`` of the checkpoint in ``directory`` (a pickle, read as DCP reads it),
    after checking it against its sha256 in the manifest (when the checkpoint has one)."""
    if manifest is not None:
        verify_file(directory, ".metadata", manifest)
    try:
        return FileSystemReader(directory).read_metadata()
    except Exception as e:
        raise CheckpointError(
            f"checkpoint.load: {str(directory / '.metadata')!r} cannot be read "
            f"({type(e).__name__}: {e}); the file is damaged. Load an earlier checkpoint."
        ) from e


def _describe(value: Any) -> tuple[torch.Size, torch.dtype] | None:
    if isinstance(value, Tiles):
        return value.size, value.dtype
    if isinstance(value, torch.Tensor):
        return value.size(), value.dtype
    return None


def check_request(
    path: Path,
    metadata: Metadata,
    request: Mapping[str, Any],
    *,
    optional: tuple[str, ...] = (),
    ignored: tuple[str, ...] = (),
) -> None:
    """Check a flat ``{fqn: target}`` load request against the checkpoint, files included.

    Keys starting with a prefix in ``optional`` may be absent from the checkpoint (the caller
    skips them); checkpoint tensors that nobody asked for are an error (a different model)
    unless they start with a prefix in ``ignored``.
    """
    saved = metadata.state_dict_metadata
    missing = [k for k in request if k not in saved and not k.startswith(optional)]
    unexpected = [
        k
        for k, md in saved.items()
        if isinstance(md, TensorStorageMetadata) and k not in request and not k.startswith(ignored)
    ]
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint.load from {str(path)!r}: the checkpoint does not hold the same "
            f"tensors as this model: missing {missing[:8]}{' ...' if len(missing) > 8 else ''}"
            f" ({len(missing)}), not in this model {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)}). It was saved from a "
            "different model (or configuration). Nothing was loaded. Load it into the model it "
            "was saved from, or load a subset with partita.checkpoint.load_tensors."
        )
    for key, target in request.items():
        md = saved.get(key)
        want = _describe(target)
        if md is None or want is None:
            continue
        if not isinstance(md, TensorStorageMetadata) or isinstance(md, BytesStorageMetadata):
            raise CheckpointError(
                f"checkpoint.load: {key!r} is saved as a Python object, but this model holds a "
                f"tensor of shape {tuple(want[0])} ({want[1]}) under that name. Nothing was "
                "loaded. The checkpoint is of a different model."
            )
        if md.size != want[0] or md.properties.dtype != want[1]:
            raise CheckpointError(
                f"checkpoint.load: {key!r} is saved with shape {tuple(md.size)} and dtype "
                f"{md.properties.dtype}, but this model holds shape {tuple(want[0])} and dtype "
                f"{want[1]}. Nothing was loaded. The checkpoint is of a different model "
                "configuration (or precision); load it into a model built like the one saved."
            )
    _check_files(path, metadata, request)


def _check_files(path: Path, metadata: Metadata, request: Mapping[str, Any]) -> None:
    sizes: dict[str, int] = {}
    for index, info in (metadata.storage_data or {}).items():
        if index.fqn not in request:
            continue
        name = info.relative_path
        if name not in sizes:
            file = path / name
            sizes[name] = file.stat().st_size if file.is_file() else -1
        end = info.offset + info.length
        if sizes[name] < end:
            state = "is missing" if sizes[name] < 0 else f"has {sizes[name]} bytes"
            raise CheckpointError(
                f"checkpoint.load: tensor {index.fqn!r} (chunk at offsets "
                f"{tuple(index.offset or ())}) is stored in {str(path / name)!r} at bytes "
                f"{info.offset}..{end}, but the file {state}: the checkpoint is incomplete or "
                "truncated (copied while being written?). Nothing was loaded. Load an earlier "
                "checkpoint, or copy this one again."
            )


class NamingReader(FileSystemReader):
    """DCP's FileSystemReader that checks every file it reads against the manifest's sha256
    first (each file once), and remembers which tensor it is reading, for error messages."""

    def __init__(self, path: Path, manifest: Manifest | None) -> None:
        super().__init__(path)
        self.manifest = manifest
        self.verified: set[str] = set()

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool) -> None:
        super().set_up_storage_reader(metadata, is_coordinator)
        self._names = {id(info): index.fqn for index, info in self.storage_data.items()}
        self.reading = ""

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        self.reading = self._names.get(id(sinfo), "")
        return super()._slice_file(file, sinfo)

    def read_data(self, plan: Any, planner: Any) -> Any:
        if self.manifest is not None:
            names = {self.storage_data[item.storage_index].relative_path for item in plan.items}
            for name in sorted(names - self.verified):
                verify_file(Path(self.path), name, self.manifest)
                self.verified.add(name)
        try:
            return super().read_data(plan, planner)
        except Exception as e:
            raise CheckpointError(
                f"checkpoint.load: reading tensor {self.reading!r} from {str(self.path)!r} "
                f"failed ({type(e).__name__}: {str(e)[:200]}): the file is damaged. Nothing was "
                "loaded. Load an earlier checkpoint."
            ) from e
