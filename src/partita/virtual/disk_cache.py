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
* every function the graph calls is looked up by its exact name in a closed table: ops of
  ``torch.ops.aten``, ``torch.ops.prims`` and ``torch.ops.partita`` (:func:`partita.op_lookup.
  find_op`; not the two aten ops that read or write a named file) and ``operator.getitem``.
  Keyword names must be the op's argument names, node names plain identifiers, dtypes and
  layouts names from a table. Nothing is imported, unpickled, or resolved by walking attributes.

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
import keyword
import operator
import os
import secrets
import stat
from collections.abc import Hashable
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch import fx

from partita import options
from partita.errors import CompileCacheWarning, warn
from partita.mesh import Mesh
from partita.op_lookup import find_op, torch_constant
from partita.partition.special.random_draw import draw_target
from partita.spec import Sharding
from partita.virtual.program import StepProgram

__all__ = ["ALLOWED_NAMESPACES", "FORMAT", "PYTHON_CALLABLES", "directory", "load", "save",
           "set_directory"]  # fmt: skip

#: The file format version (a file of another version is ignored).
FORMAT = 2
#: The ``torch.ops`` namespaces whose ops a cache file may call (by exact name).
ALLOWED_NAMESPACES = frozenset({"aten", "prims", "partita"})
#: Ops of those namespaces a cache file may not call: they read or write a file named by a
#: string argument.
_DENIED_OPS = frozenset({"aten::save", "aten::from_file"})
#: The Python functions a cache file may call, by the name the file gives them.
PYTHON_CALLABLES: dict[str, Any] = {"operator.getitem": operator.getitem}

_DIR: list[Path | None] = [None]
#: The directory problems already reported in this process (one warning each).
_WARNED: set[tuple[str, str]] = set()

_FIX_PRIVATE = (
    "A cache file is a program this process runs, so partita only uses a directory and files "
    "that you own and that no one else can write. Fix: make it private (chmod 700 {root}, and "
    "chown it to yourself), or point cache_dir= / PARTITA_COMPILE_CACHE at a directory of your "
    "own such as ~/.cache/partita. Until then steps compile as usual and are not saved."
)


class _NotPlainError(Exception):
    """A value has no stable plain-data form (the step is not saved)."""


class _RejectedError(Exception):
    """A cache file that must not be used; the message says why."""


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
    """A text form of a key part that is the same in every process (or _NotPlainError)."""
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
        raise _NotPlainError(text)
    return text


def _path(key: Hashable, mesh: Mesh) -> Path | None:
    root = directory()
    if root is None:
        return None
    try:
        text = "\n".join((_canonical(key), _canonical(mesh), _versions(), str(FORMAT)))
    except _NotPlainError:
        return None
    return root / f"{hashlib.sha256(text.encode()).hexdigest()}.json"


def _digest(data: dict[str, Any]) -> str:
    """The SHA-256 of a file's content (every field but the hash itself), as stored in it."""
    body = {k: v for k, v in data.items() if k != "sha256"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


# --- values ------------------------------------------------------------------------------


def _encode(x: Any) -> Any:
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return {"float": repr(x)}
    if isinstance(x, fx.Node):
        return {"node": x.name}
    if isinstance(x, list):
        return [_encode(v) for v in x]
    if isinstance(x, tuple):
        return {"tuple": [_encode(v) for v in x]}
    if isinstance(x, slice):
        return {"slice": [_encode(x.start), _encode(x.stop), _encode(x.step)]}
    if isinstance(x, torch.dtype):
        return {"dtype": str(x).removeprefix("torch.")}
    if isinstance(x, torch.device):
        return {"device": str(x)}
    if isinstance(x, (torch.memory_format, torch.layout)):
        return {"torch": str(x).removeprefix("torch.")}
    raise _NotPlainError(repr(x))


def _decode(x: Any, nodes: dict[str, fx.Node]) -> Any:
    if not isinstance(x, (dict, list)):
        return x
    if isinstance(x, list):
        return [_decode(v, nodes) for v in x]
    if len(x) != 1:
        raise ValueError(f"a tagged value has one key, got {sorted(x)}")
    ((tag, value),) = x.items()
    if tag == "float":
        return float(value)
    if tag == "node":
        return nodes[value]
    if tag == "tuple":
        return tuple(_decode(v, nodes) for v in value)
    if tag == "slice":
        return slice(*(_decode(v, nodes) for v in value))
    if tag == "dtype":
        return _constant(value, torch.dtype)
    if tag == "device":
        if not isinstance(value, str):
            raise TypeError(f"a device is a string, got {value!r}")
        return torch.device(value)
    if tag == "torch":
        return _constant(value, (torch.memory_format, torch.layout))
    raise ValueError(f"unknown tag {tag!r}")


def _constant(name: Any, kind: type | tuple[type, ...]) -> Any:
    value = torch_constant(name, kind)
    if value is None:
        raise ValueError(f"torch.{name} is not a {kind}")
    return value


def _target_name(target: Any) -> str:
    for name, fn in PYTHON_CALLABLES.items():
        if target is fn:
            return name
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}::{target._opname}.{target._overloadname}"
    raise _NotPlainError(repr(target))


def _resolve(name: Any) -> Any:
    """The function a file names, from the closed table only (else _RejectedError)."""
    if isinstance(name, str) and name in PYTHON_CALLABLES:
        return PYTHON_CALLABLES[name]
    table = (
        f"ops of torch.ops.{', torch.ops.'.join(sorted(ALLOWED_NAMESPACES))} named exactly "
        f"'namespace::op.overload', and {', '.join(PYTHON_CALLABLES)}"
    )
    op = None
    if isinstance(name, str) and "::" in name and "." in name.split("::", 1)[1]:
        namespace, rest = name.split("::", 1)
        op_name, overload = rest.rsplit(".", 1)
        if f"{namespace}::{op_name}" in _DENIED_OPS:
            raise _RejectedError(
                f"it calls {name!r}, an op that reads or writes a file it is given by name; a "
                f"cache file may not call it"
            )
        op = find_op(namespace, op_name, overload, ALLOWED_NAMESPACES)
    if op is None:
        raise _RejectedError(
            f"it names {name!r} as a function to call, which is not in the table of what a "
            f"cache file may call ({table})"
        )
    return op


def _sharding(s: Sharding) -> dict[str, Any]:
    return {
        "dim_axes": [list(d) for d in s.dim_axes],
        "partial": list(s.partial),
        "op": s.reduce_op,
    }


def _tensor(t: torch.Tensor) -> dict[str, Any]:
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "values": t.detach().reshape(-1).tolist()}  # fmt: skip


# --- files -------------------------------------------------------------------------------


def _graph_data(gm: fx.GraphModule) -> list[dict[str, Any]]:
    rows = []
    for node in gm.graph.nodes:
        if node.op not in ("placeholder", "call_function", "output"):
            raise _NotPlainError(node.op)
        rows.append(
            {
                "op": node.op,
                "name": node.name,
                "target": _target_name(node.target) if node.op == "call_function" else None,
                "args": _encode(tuple(node.args)),
                "kwargs": {k: _encode(v) for k, v in node.kwargs.items()},
                "origin": str(node.meta.get("origin") or ""),
                "source": str(node.meta.get("source") or ""),
            }
        )
    return rows


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
        data: dict[str, Any] = {
            "format": FORMAT,
            "versions": _versions(),
            "graph": _graph_data(program.local),
            "input_shardings": [_sharding(s) for s in program.input_shardings],
            "output_shardings": [_sharding(s) for s in program.output_shardings],
            "output_shapes": [list(s) for s in program.output_shapes],
            "constants": [_tensor(t) for t in program.constants],
            "mutated_inputs": list(program.mutated_inputs),
            "n_results": program.n_results,
        }
    except _NotPlainError:
        return
    data["sha256"] = _digest(data)
    blob = json.dumps(data).encode()
    root = path.parent
    try:
        dfd = _open_directory(root, create=True)
    except _UnusableError as e:
        _unusable_directory(root, e)
        return
    except OSError as e:
        _unreadable_directory(root, e, "save compiled steps in")
        return
    assert dfd is not None  # created above
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
        return None if blob is None else _program(_checked(blob), mesh)
    except _RejectedError as e:
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
            raise _RejectedError(
                "it is a symbolic link; a cache file must be a regular file"
            ) from None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise _RejectedError("it is not a regular file")
        problem = _not_private(st, "file")
        if problem is not None:
            raise _RejectedError(problem)
        return f.read()


def _checked(blob: bytes) -> dict[str, Any]:
    """The content of a file whose format, versions and hash are right (else _RejectedError)."""
    try:
        data = json.loads(blob)
    except (ValueError, UnicodeDecodeError) as e:
        raise _RejectedError(f"it is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise _RejectedError("it is not a JSON object")
    if data.get("format") != FORMAT or data.get("versions") != _versions():
        raise _RejectedError(
            f"it is format {data.get('format')!r} of {data.get('versions')!r}; this process "
            f"reads format {FORMAT} of {_versions()!r}"
        )
    if data.get("sha256") != _digest(data):
        raise _RejectedError(
            "its content does not match the SHA-256 stored in it (changed after partita wrote "
            "it: edited, truncated or corrupted)"
        )
    return data


def _program(data: dict[str, Any], mesh: Mesh) -> StepProgram:
    try:
        return _build(data, mesh)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, RuntimeError) as e:
        raise _RejectedError(f"it is malformed ({type(e).__name__}: {e})") from None


def _check_draw(args: tuple[Any, ...]) -> None:
    """A random draw names the aten op it runs: it must be one (the same exact-name lookup)."""
    op = args[1] if len(args) > 1 else None
    if draw_target(op) is None:
        raise _RejectedError(
            f"its partita::global_random_draw names {op!r} as the op to run, which is not an "
            f"aten op named 'packet.overload'"
        )


def _identifier(name: Any) -> str:
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(f"a node name must be a plain identifier, got {name!r}")
    return name


def _build(data: dict[str, Any], mesh: Mesh) -> StepProgram:
    graph = fx.Graph()
    nodes: dict[str, fx.Node] = {}
    rows = data["graph"]
    for i, row in enumerate(rows):
        name = _identifier(row["name"])
        if name in nodes:
            raise ValueError(f"two nodes are named {name!r}")
        args = _decode(row["args"], nodes)
        if not isinstance(args, tuple) or not isinstance(row["kwargs"], dict):
            raise TypeError("a node's args are a tuple and its kwargs an object")
        kwargs = {k: _decode(v, nodes) for k, v in row["kwargs"].items()}
        if row["op"] == "placeholder":
            node = graph.placeholder(name)
        elif row["op"] == "output":
            if i != len(rows) - 1 or len(args) != 1 or kwargs:
                raise ValueError("the output node comes last, with one argument")
            node = graph.output(args[0])
        elif row["op"] == "call_function":
            target = _resolve(row["target"])
            allowed = (
                {a.name for a in target._schema.arguments}
                if isinstance(target, torch._ops.OpOverload)
                else set()
            )
            unknown = sorted(set(kwargs) - allowed)
            if unknown:
                raise ValueError(f"{row['target']} has no argument named {unknown}")
            if target is torch.ops.partita.global_random_draw.default:
                _check_draw(args)
            node = graph.call_function(target, args, kwargs)
            node.name = name
        else:
            raise ValueError(f"unknown node kind {row['op']!r}")
        node.meta["origin"], node.meta["source"] = str(row["origin"]), str(row["source"])
        nodes[name] = node
    graph.lint()
    local = fx.GraphModule(torch.nn.Module(), graph)

    def sharding(d: dict[str, Any]) -> Sharding:
        return Sharding(mesh, tuple(tuple(a) for a in d["dim_axes"]), tuple(d["partial"]), d["op"])

    constants = tuple(
        torch.tensor(c["values"], dtype=_constant(c["dtype"], torch.dtype)).reshape(c["shape"])
        for c in data["constants"]
    )
    mutated = tuple(data["mutated_inputs"])
    if not all(isinstance(i, int) for i in mutated):
        raise TypeError(f"mutated_inputs are input positions, got {mutated!r}")
    return StepProgram(
        local=local,
        input_shardings=[sharding(s) for s in data["input_shardings"]],
        output_shardings=[sharding(s) for s in data["output_shardings"]],
        output_shapes=[tuple(s) for s in data["output_shapes"]],
        constants=constants,
        mutated_inputs=mutated,
        n_results=int(data["n_results"]),
    )
