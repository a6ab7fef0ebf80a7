"""The checkpoint directory on disk: what it holds, how a save replaces it, how a crash is undone.

A partita checkpoint is a directory holding DCP's files (``.metadata`` and
``__<rank>_<i>.distcp``) and partita's manifest ``partita.json``: the format, the save's id and
time, and every other file's size and sha256. The manifest is written last, so a directory whose
manifest is valid and whose listed files are all there with their sizes is *complete*. The
manifest is what recognises a checkpoint of ours: :func:`prepare` lets a save replace only an
empty directory or a partita checkpoint holding nothing but its listed files, and refuses
anything else before touching the disk.

A save to ``<path>`` goes through these filesystem steps (rank 0 does all but
``files_written``); :data:`CRASH_POINTS` names the moment after each, where a crash can stop it:

=====================  ========================================================================
``restored``           :func:`prepare`: if ``<path>`` is missing or empty, the newest complete
                       left-over renamed back to ``<path>`` (only then)
``leftovers_removed``  :func:`prepare`: the other left-overs deleted
``files_written``      every process wrote its files into ``<path>.tmp-<id>`` (DCP)
``manifest_written``   ``partita.json`` written into the temporary (now complete)
``old_moved_aside``    the previous ``<path>`` renamed to ``<path>.old-<id>``
``new_renamed``        ``<path>.tmp-<id>`` renamed to ``<path>``
``old_removed``        ``<path>.old-<id>`` deleted
=====================  ========================================================================

Recovery (:func:`resolve` for a load, :func:`prepare` for the next save): when ``<path>``
holds a checkpoint, it is the checkpoint and every ``<path>.tmp-*`` / ``<path>.old-*`` beside
it is a left-over; when ``<path>`` is missing or empty (a crash between the two renames), the
newest *complete* left-over is the checkpoint: load reads it where it is, the next save renames
it back to ``<path>``. A complete directory is never deleted while ``<path>`` holds none.
This module does not talk to other processes; :mod:`partita.checkpoint.sync` does.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

from partita.errors import CheckpointError, PartitaWarning

__all__ = [
    "CRASH_POINTS",
    "MANIFEST",
    "Manifest",
    "digest",
    "leftovers",
    "new_id",
    "prepare",
    "publish",
    "read_manifest",
    "refuse_foreign",
    "remove_temporary",
    "resolve",
    "temporary",
    "verify_file",
]

#: partita's file in a checkpoint directory: the format and every other file's size and sha256.
MANIFEST = "partita.json"
FORMAT = "partita.checkpoint"
VERSION = 1

#: Where a save can be stopped by a crash, in order (see the module docstring).
CRASH_POINTS = (
    "restored",
    "leftovers_removed",
    "files_written",
    "manifest_written",
    "old_moved_aside",
    "new_renamed",
    "old_removed",
)


def step_done(point: str) -> None:
    """Called after each filesystem step of a save (:data:`CRASH_POINTS`); does nothing.

    The fault-injection script (``tests/dist_scripts/faults.py``) replaces it with one that
    calls ``os._exit`` at a chosen point, to test that every point recovers.
    """


@dataclass(frozen=True)
class Manifest:
    """What ``partita.json`` records: the save's id and time, ``{file: (bytes, sha256)}``."""

    save_id: str
    created: float
    files: dict[str, tuple[int, str]]

    def to_json(self) -> str:
        files = {name: {"bytes": n, "sha256": h} for name, (n, h) in sorted(self.files.items())}
        body = {"format": FORMAT, "version": VERSION, "id": self.save_id,
                "created": self.created, "files": files}  # fmt: skip
        return json.dumps(body, indent=1)


def new_id() -> str:
    return f"{uuid.uuid4().int % (1 << 62):016x}"


def temporary(path: Path, save_id: str) -> Path:
    """Where a save writes before the rename: ``<path>.tmp-<id>``."""
    return path.with_name(f"{path.name}.tmp-{save_id}")


def _aside(path: Path, save_id: str) -> Path:
    return path.with_name(f"{path.name}.old-{save_id}")


def leftovers(path: Path) -> list[Path]:
    """The ``<path>.tmp-<id>`` / ``<path>.old-<id>`` directories beside ``path`` (ours only:
    ``<id>`` is 16 hex digits, as :func:`new_id` draws)."""
    pattern = re.compile(rf"{re.escape(path.name)}\.(tmp|old)-[0-9a-f]{{16}}")
    if not path.parent.is_dir():
        return []
    return sorted(p for p in path.parent.iterdir() if pattern.fullmatch(p.name))


def digest(file: Path) -> str:
    """The sha256 of ``file``'s bytes (hex)."""
    with open(file, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- the manifest ------------------------------------------------------------------------------


def _damaged(file: Path, why: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint: {str(file)!r} is not a valid partita manifest ({why}): the checkpoint's "
        f"list of files and checksums is damaged. Nothing was read or changed. Load an earlier "
        "checkpoint (or copy this one again); to save here, delete the directory yourself."
    )


def read_manifest(directory: Path) -> Manifest | None:
    """``directory``'s manifest; None if it has none, a CheckpointError if it is damaged."""
    file = directory / MANIFEST
    if not file.is_file():
        return None
    try:
        body = json.loads(file.read_text())
        if body.get("format") != FORMAT:
            raise _damaged(file, f"format {body.get('format')!r}, not {FORMAT!r}")
        if body.get("version") != VERSION:
            raise CheckpointError(
                f"checkpoint: {str(file)!r} has format version {body.get('version')!r}; this "
                f"partita reads version {VERSION}. Nothing was read or changed. Load it with the "
                "partita version that saved it."
            )
        files = {
            str(name): (int(entry["bytes"]), str(entry["sha256"]))
            for name, entry in body["files"].items()
        }
        return Manifest(str(body["id"]), float(body["created"]), files)
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise _damaged(file, f"{type(e).__name__}: {e}") from e


def _write_manifest(directory: Path, manifest: Manifest) -> None:
    part = directory / f"{MANIFEST}.part"
    with open(part, "w") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, directory / MANIFEST)
    _fsync_dir(directory)


def _complete(directory: Path) -> Manifest | None:
    """``directory``'s manifest if it has one and every listed file has its size, else None."""
    try:
        manifest = read_manifest(directory)
    except CheckpointError:
        return None
    if manifest is None:
        return None
    for name, (size, _) in manifest.files.items():
        file = directory / name
        if not file.is_file() or file.stat().st_size != size:
            return None
    return manifest


def verify_file(directory: Path, name: str, manifest: Manifest) -> None:
    """Check ``directory/name`` against its size and sha256 in ``manifest``."""
    file = directory / name
    if name not in manifest.files:
        raise CheckpointError(
            f"checkpoint.load: {str(file)!r} is read by this checkpoint's .metadata but is not "
            f"listed in its {MANIFEST}: the directory was changed after the save. Nothing was "
            "loaded. Load an earlier checkpoint, or copy this one again from where it was saved."
        )
    size, want = manifest.files[name]
    if not file.is_file():
        raise CheckpointError(
            f"checkpoint.load: {str(file)!r} is missing ({MANIFEST} lists it with {size} bytes): "
            "the checkpoint is incomplete (copied in part?). Nothing was loaded. Load an "
            "earlier checkpoint, or copy this one again from where it was saved."
        )
    got = digest(file)
    if got != want:
        have = file.stat().st_size
        raise CheckpointError(
            f"checkpoint.load: {str(file)!r} does not match its checksum in {MANIFEST} "
            f"(sha256 {want[:16]}... over {size} bytes recorded at save; {have} bytes with sha256 "
            f"{got[:16]}... now): the file is damaged (a changed byte, a truncated or partial "
            "copy). Nothing was loaded. Load an earlier checkpoint, or copy this one again "
            "from where it was saved."
        )


# --- save: before writing, and publishing ---------------------------------------------------


def _foreign(path: Path) -> str | None:
    """Why ``path`` must not be replaced by a save (None if it may: missing, an empty
    directory, or a partita checkpoint holding only its own files)."""
    if not path.exists():
        return None
    if not path.is_dir():
        return "it is a file, not a directory"
    entries = sorted(p.name for p in path.iterdir())
    if not entries:
        return None
    try:
        manifest = read_manifest(path)
    except CheckpointError as e:
        return f"its {MANIFEST} is damaged ({e})"
    if manifest is None:
        dcp = " (a torch.distributed.checkpoint without partita's manifest)" if (
            ".metadata" in entries) else ""  # fmt: skip
        shown = entries[:8] + (["..."] if len(entries) > 8 else [])
        return f"it holds {shown}{dcp} and no {MANIFEST}, so it is not a partita checkpoint"
    others = [n for n in entries if n not in manifest.files and n != MANIFEST]
    if others:
        return (
            f"it is a partita checkpoint but also holds {others[:8]}, which are not its files "
            "(replacing the checkpoint would delete them)"
        )
    return None


def refuse_foreign(path: Path) -> None:
    why = _foreign(path)
    if why is not None:
        raise CheckpointError(
            f"checkpoint.save to {str(path)!r}: {why}. A save replaces the directory at its path "
            f"as a whole, so it writes only to a new or empty directory or over an earlier "
            f"partita checkpoint (recognised by its {MANIFEST}). Nothing was written, moved or "
            "deleted. Save to a new path (e.g. a subdirectory per step), or move those files "
            "away first."
        )


def _newest_complete(found: list[Path]) -> tuple[Path, Manifest] | None:
    complete = [(p, m) for p in found if (m := _complete(p)) is not None]
    if not complete:
        return None
    return max(complete, key=lambda pm: (pm[1].created, pm[0].name.split(".")[-1]))


def _missing_or_empty(path: Path) -> bool:
    return not path.exists() or (path.is_dir() and not any(path.iterdir()))


def prepare(path: Path) -> str:
    """Before a save writes anything (rank 0): refuse a foreign ``path``, recover, clean up.

    Returns a fresh save id. Nothing is touched if ``path`` is refused.
    """
    refuse_foreign(path)
    found = leftovers(path)
    if _missing_or_empty(path):
        newest = _newest_complete(found)
        if newest is not None:
            warnings.warn(
                f"checkpoint.save to {str(path)!r}: the path held no checkpoint and "
                f"{newest[0].name!r} beside it is the complete checkpoint an interrupted save "
                "left (between its two renames); it is renamed back to the path first.",
                PartitaWarning,
                stacklevel=5,
            )
            os.replace(newest[0], path)
            _fsync_dir(path.parent)
            step_done("restored")
            found.remove(newest[0])
    if found:
        warnings.warn(
            f"checkpoint.save to {str(path)!r}: removing {[p.name for p in found]}, left by "
            "earlier saves to this path that did not finish (killed processes); the path holds "
            "the last completed checkpoint. Nothing to do, unless another job is saving to "
            "this same path (don't).",
            PartitaWarning,
            stacklevel=5,
        )
        for p in found:
            shutil.rmtree(p, ignore_errors=True)
    step_done("leftovers_removed")
    return new_id()


def publish(path: Path, save_id: str, digests: dict[str, tuple[int, str]]) -> None:
    """After every process wrote its files (rank 0): the manifest, then the renames.

    ``digests`` are the files the processes hashed; anything else in the temporary directory
    (DCP's ``.metadata``) is hashed here. If a step raises, the previous checkpoint is put
    back at ``path`` when it had been moved aside.
    """
    tmp, aside = temporary(path, save_id), _aside(path, save_id)
    step_done("files_written")
    files = dict(digests)
    for p in sorted(tmp.iterdir()):
        if p.name not in files:
            files[p.name] = (p.stat().st_size, digest(p))
    _write_manifest(tmp, Manifest(save_id, time.time(), files))
    step_done("manifest_written")
    refuse_foreign(path)  # something may have been written to the path while we saved
    try:
        if path.exists():
            os.replace(path, aside)
            step_done("old_moved_aside")
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        step_done("new_renamed")
    except BaseException:  # an error or Ctrl-C: put the previous checkpoint back
        if not path.exists() and aside.exists():
            os.replace(aside, path)
        raise
    shutil.rmtree(aside, ignore_errors=True)
    step_done("old_removed")


def remove_temporary(path: Path, save_id: str) -> None:
    """Delete a failed save's temporary directory (rank 0; unless it was renamed already)."""
    shutil.rmtree(temporary(path, save_id), ignore_errors=True)


# --- load: which directory -----------------------------------------------------------------


def resolve(path: Path) -> tuple[Path, Manifest | None]:
    """The directory a load reads for ``path``, and its manifest (None: a plain DCP
    checkpoint, read without checksums)."""
    found = leftovers(path)
    if (path / MANIFEST).is_file() or (path / ".metadata").is_file():
        if found:
            warnings.warn(
                f"checkpoint.load from {str(path)!r}: {[p.name for p in found]} beside it are "
                "left by saves to this path that did not finish (killed processes); they are "
                "not read, the checkpoint at the path is the last completed save. The next "
                "checkpoint.save to this path deletes them (or delete them yourself).",
                PartitaWarning,
                stacklevel=5,
            )
        return path, read_manifest(path)
    newest = _newest_complete(found) if _missing_or_empty(path) else None
    if newest is not None:
        warnings.warn(
            f"checkpoint.load from {str(path)!r}: the path holds no checkpoint; reading "
            f"{newest[0].name!r} beside it, the complete checkpoint a save interrupted between "
            "its two renames left. The next checkpoint.save to this path renames it back first.",
            PartitaWarning,
            stacklevel=5,
        )
        return newest[0], newest[1]
    names = [p.name for p in found]
    raise CheckpointError(
        f"checkpoint.load: {str(path)!r} is not a checkpoint (no {str(path / '.metadata')!r}"
        f"{'; the directory does not exist' if not path.exists() else ''}). "
        f"{f'Left-over incomplete saves beside it: {names}. ' if names else ''}"
        "Pass the path a completed checkpoint.save wrote."
    )
