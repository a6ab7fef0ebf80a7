"""The persistent compile cache: compiled steps saved as plain JSON, reused by later processes.

Opt-in: ``partita.use_spmd(mesh, cache_dir=...)`` or the ``compile_cache`` option (environment
variable ``PARTITA_COMPILE_CACHE``, see :mod:`partita.options`) names a directory. A file per
compiled step, named by the SHA-256 of the step's structural key, the mesh (shape, axis names,
device ids) and the partita and torch versions, holds the per-device fx graph (ops by qualified
name, arguments as tagged JSON values), the input and output shardings and shapes, the in-place
updates, any tensor constants as lists of numbers, and the SHA-256 of all of that.

A cache file is a program this process will run, so reading one trusts nothing in it:

* the directory (after symbolic links) and the file must be owned by the current user and not
  writable by group or others, the file a regular file (not a link); otherwise the directory or
  file is not used. This is what stops another user: anyone who can write a file can also
  recompute its hash.
* the stored hash must match the content (an edited, truncated or corrupted file is ignored);
* every function the graph calls is looked up by its exact name in a closed table (ops of
  ``torch.ops.aten``, ``prims`` and ``partita``, and ``operator.getitem``), and keyword, node,
  dtype and layout names are checked too: :mod:`partita.virtual.cache_program`. Nothing is
  imported, unpickled, or resolved by walking attributes.

A file that fails a check is ignored with a :class:`~partita.errors.CompileCacheWarning` naming
it and why; the step compiles as if it were absent (and the new file replaces it). A directory
that cannot be created, read or written (a file in its place, no permission, a full disk) is
one warning per process and the steps run uncached. partita creates the directory with mode
0o700 and writes each file with mode 0o600 under a temporary name, then renames it into place.

A step whose key or graph holds something without a stable plain form is not saved. Steps read
from disk run on the LocalMesh; under torch.distributed they are compiled as usual. This module
does not compile.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import secrets
import stat
from collections.abc import Hashable
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from partita import options
from partita.errors import CompileCacheWarning, warn
from partita.values.mesh import Mesh
from partita.values.spec import Sharding
from partita.virtual.cache_program import NotPlainError, RejectedError, from_data, to_data
from partita.virtual.program import StepProgram

__all__ = ["FORMAT", "directory", "load", "save", "set_directory"]

#: The file format version (a file of another version is ignored).
FORMAT = 2

_DIR: list[Path | None] = [None]
#: The directory problems already reported in this process (one warning each).
_WARNED: set[tuple[str, str]] = set()

_FIX_PRIVATE = (
    "A cache file is a program this process runs, so partita only uses a directory and files "
    "that you own and that no one else can write. Fix: make it private (chmod 700 {root}, and "
    "chown it to yourself), or point cache_dir= / PARTITA_COMPILE_CACHE at a directory of your "
    "own such as ~/.cache/partita. Until then steps compile as usual and are not saved."
)


class _UnusableError(Exception):
    """The cache directory must not be used; the message says why and the fix."""


def set_directory(path: str | os.PathLike[str] | None) -> None:
    """Save compiled steps in ``path`` (created, mode 0o700, if missing). None drops this
    setting: the ``compile_cache`` option (``PARTITA_COMPILE_CACHE``) applies again, and with
    it unset the cache is off."""
    _DIR[0] = None if path is None else Path(os.path.expanduser(os.fspath(path)))


def directory() -> Path | None:
    """The cache directory in use, if any (``set_directory`` first, then the ``compile_cache``
    option of :func:`partita.options.current`)."""
    if _DIR[0] is not None:
        return _DIR[0]
    configured = options.current().compile_cache
    return Path(os.path.expanduser(os.fspath(configured))) if configured else None


def _versions() -> str:
    try:
        partita_version = metadata.version("partita")
    except metadata.PackageNotFoundError:
        partita_version = "unknown"
    return f"partita={partita_version} torch={torch.__version__}"


def _canonical(x: Any) -> str:
    """A text form of a key part that is the same in every process (or NotPlainError)."""
    if isinstance(x, (tuple, list)):
        return "(" + ",".join(_canonical(v) for v in x) + ")"
    if isinstance(x, torch._ops.OpOverload):
        return str(x)
    if isinstance(x, Sharding):
        return f"Sharding({x.dim_axes!r},{x.partial!r},{x.reduce_op!r})"
    if isinstance(x, Mesh):
        return f"Mesh({x.shape!r},{x.axis_names!r},{x.device_ids!r})"
    if callable(x) and hasattr(x, "__qualname__") and not isinstance(x, type):
        return f"{x.__module__}.{x.__qualname__}"
    text = repr(x)
    if " at 0x" in text or text.startswith("<"):
        raise NotPlainError(text)
    return text


def _path(key: Hashable, mesh: Mesh) -> Path | None:
    root = directory()
    if root is None:
        return None
    try:
        text = "\n".join((_canonical(key), _canonical(mesh), _versions(), str(FORMAT)))
    except NotPlainError:
        return None
    return root / f"{hashlib.sha256(text.encode()).hexdigest()}.json"


def _digest(data: dict[str, Any]) -> str:
    """The SHA-256 of a file's content (every field but the hash itself), as stored in it."""
    body = {k: v for k, v in data.items() if k != "sha256"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


# --- files -------------------------------------------------------------------------------


def _warn_once(root: Path, problem: str, message: str) -> None:
    if (str(root), problem) in _WARNED:
        return
    _WARNED.add((str(root), problem))
    warn(message, CompileCacheWarning)


def _not_private(st: os.stat_result, what: str) -> str | None:
    """Why a directory or file with status ``st`` is not the current user's alone (or None)."""
    euid = os.geteuid()
    if st.st_uid != euid:
        return f"the {what} is owned by uid {st.st_uid}, not by you (uid {euid})"
    writable = [who for who, bit in (("group", 0o020), ("others", 0o002)) if st.st_mode & bit]
    if writable:
        return (
            f"the {what} is writable by {' and '.join(writable)} (mode {stat.filemode(st.st_mode)})"
        )
    return None


def _open_directory(root: Path, *, create: bool) -> int | None:
    """A descriptor of ``root``, checked private (None: it does not exist and ``create`` is
    False). Raises _UnusableError (not private) or OSError (cannot create or open it)."""
    if create and not os.path.lexists(root):
        root.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(root, 0o700)
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        if create:
            raise
        return None
    try:
        problem = _not_private(os.fstat(fd), "directory")
    except OSError:
        os.close(fd)
        raise
    if problem is not None:
        os.close(fd)
        real = os.path.realpath(root)
        where = f"{root} (a symbolic link to {real})" if real != os.path.abspath(root) else root
        raise _UnusableError(
            f"partita compile cache: not using {where}: {problem}. "
            + _FIX_PRIVATE.format(root=real)
        )
    return fd


def _unusable_directory(root: Path, e: _UnusableError) -> None:
    _warn_once(root, "private", str(e))


def _unreadable_directory(root: Path, e: OSError, doing: str) -> None:
    reason = e.strerror or str(e)
    if e.filename is not None and os.fspath(e.filename) != os.fspath(root):
        reason = f"{reason} ({os.fspath(e.filename)})"
    if os.path.lexists(root) and not root.is_dir():
        reason = "it is not a directory"
    _warn_once(
        root,
        f"{doing}:{reason}",
        f"partita compile cache: cannot {doing} {root}: {reason}. The steps run normally, "
        f"without the cache. Fix: point cache_dir= / PARTITA_COMPILE_CACHE at a directory you "
        f"can read and write (partita creates it if missing), free disk space if it is full, "
        f"or turn the cache off (unset PARTITA_COMPILE_CACHE).",
    )


def _write(fd: int, blob: bytes) -> None:
    """Write ``blob`` to the new file ``fd`` and close it."""
    with os.fdopen(fd, "wb") as f:
        f.write(blob)


def _write_atomically(dfd: int, name: str, blob: bytes) -> None:
    """``name`` in the directory ``dfd`` holds ``blob`` (mode 0o600): written under a
    temporary name and renamed, so a reader never sees half a file."""
    tmp = f".{name}.{secrets.token_hex(8)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    fd = os.open(tmp, flags, 0o600, dir_fd=dfd)
    try:
        _write(fd, blob)
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dfd)
        raise


def save(key: Hashable, mesh: Mesh, program: StepProgram) -> None:
    """Write ``program`` for ``key`` (nothing when the cache is off or it has no plain form;
    a warning, once per problem, when the directory is not private or cannot be written)."""
    path = _path(key, mesh)
    if path is None:
        return
    try:
        data: dict[str, Any] = {"format": FORMAT, "versions": _versions(), **to_data(program)}
        data["sha256"] = _digest(data)
        blob = json.dumps(data).encode()
    except (NotPlainError, TypeError, ValueError):  # e.g. a complex constant: not JSON
        return
    root = path.parent
    try:
        dfd = _open_directory(root, create=True)
    except _UnusableError as e:
        _unusable_directory(root, e)
        return
    except OSError as e:
        _unreadable_directory(root, e, "save compiled steps in")
        return
    if dfd is None:  # not reached: create=True made it or raised
        return
    try:
        _write_atomically(dfd, path.name, blob)
    except OSError as e:
        _unreadable_directory(root, e, "save compiled steps in")
    finally:
        os.close(dfd)


def load(key: Hashable, mesh: Mesh) -> StepProgram | None:
    """The program saved for ``key`` on ``mesh``, or None (absent, or ignored with a
    CompileCacheWarning: not private, failing its hash, or naming what it may not)."""
    path = _path(key, mesh)
    if path is None:
        return None
    root = path.parent
    try:
        dfd = _open_directory(root, create=False)
    except _UnusableError as e:
        _unusable_directory(root, e)
        return None
    except OSError as e:
        _unreadable_directory(root, e, "read compiled steps from")
        return None
    if dfd is None:
        return None
    try:
        blob = _read(dfd, path.name)
        return None if blob is None else from_data(_checked(blob), mesh)
    except RejectedError as e:
        warn(
            f"partita compile cache: ignored {path}: {e}. The step compiles as usual and a new "
            f"file replaces it. If you did not change the file, someone else may be able to "
            f"write to {root}: check who owns it and its mode (chmod 700 {root}).",
            CompileCacheWarning,
        )
        return None
    except OSError as e:
        _unreadable_directory(root, e, "read compiled steps from")
        return None
    finally:
        os.close(dfd)


def _read(dfd: int, name: str) -> bytes | None:
    """The bytes of the file ``name`` in the directory ``dfd`` once checked private (None:
    absent)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(name, flags, dir_fd=dfd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise RejectedError(
                "it is a symbolic link; a cache file must be a regular file"
            ) from None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise RejectedError("it is not a regular file")
        problem = _not_private(st, "file")
        if problem is not None:
            raise RejectedError(problem)
        return f.read()


def _checked(blob: bytes) -> dict[str, Any]:
    """The content of a file whose format, versions and hash are right (else RejectedError)."""
    try:
        data = json.loads(blob)
    except (ValueError, UnicodeDecodeError) as e:
        raise RejectedError(f"it is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise RejectedError("it is not a JSON object")
    if data.get("format") != FORMAT or data.get("versions") != _versions():
        raise RejectedError(
            f"it is format {data.get('format')!r} of {data.get('versions')!r}; this process "
            f"reads format {FORMAT} of {_versions()!r}"
        )
    if data.get("sha256") != _digest(data):
        raise RejectedError(
            "its content does not match the SHA-256 stored in it (changed after partita wrote "
            "it: edited, truncated or corrupted)"
        )
    return data
