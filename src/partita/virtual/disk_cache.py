"""The persistent compile cache: compiled steps saved as plain JSON, reused by later processes.

Opt-in: ``partita.use_spmd(mesh, cache_dir=...)`` or the ``PARTITA_COMPILE_CACHE`` environment
variable names a directory. A file per compiled step, named by the SHA-256 of the step's
structural key, the mesh (shape, axis names, device ids) and the partita and torch versions,
holds the per-device fx graph (ops by qualified name, arguments as tagged JSON values), the
input and output shardings and shapes, the in-place updates and any tensor constants as lists of
numbers. Reading it imports nothing and unpickles nothing: an op name resolves only under
``torch.ops`` (or ``operator.getitem``), anything else makes the file unusable, and an
unusable, stale or corrupt file is ignored (the step compiles as if it were absent).

A step whose key or graph holds something without a stable plain form is not saved. Steps read
from disk run on the LocalMesh; under torch.distributed they are compiled as usual. This module
does not compile.
"""

from __future__ import annotations

import hashlib
import json
import operator
import os
import tempfile
from collections.abc import Hashable
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch import fx

from partita.errors import CacheEntryError
from partita.mesh import Mesh
from partita.spec import Sharding
from partita.virtual.program import StepProgram

__all__ = ["ENV_VAR", "FORMAT", "directory", "load", "save", "set_directory"]

#: The environment variable naming the cache directory.
ENV_VAR = "PARTITA_COMPILE_CACHE"
#: The file format version (a file of another version is ignored).
FORMAT = 1

_DIR: list[Path | None] = [None]


class _NotPlainError(Exception):
    """A value has no stable plain-data form (the step is not saved)."""


def set_directory(path: str | os.PathLike[str] | None) -> None:
    """Save compiled steps in ``path`` (created if missing); None turns the cache off."""
    _DIR[0] = None if path is None else Path(path)


def directory() -> Path | None:
    """The cache directory in use, if any (``set_directory`` first, then the env var)."""
    if _DIR[0] is not None:
        return _DIR[0]
    env = os.environ.get(ENV_VAR)
    return Path(env) if env else None


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
    (tag, value), *_ = x.items()
    if tag == "float":
        return float(value)
    if tag == "node":
        return nodes[value]
    if tag == "tuple":
        return tuple(_decode(v, nodes) for v in value)
    if tag == "slice":
        return slice(*(_decode(v, nodes) for v in value))
    if tag == "dtype":
        return _torch_attr(value, torch.dtype)
    if tag == "device":
        return torch.device(value)
    if tag == "torch":
        return _torch_attr(value, (torch.memory_format, torch.layout))
    raise CacheEntryError(f"unknown tag {tag!r}")


def _torch_attr(name: str, kind: Any) -> Any:
    value = getattr(torch, name, None)
    if not isinstance(value, kind):
        raise CacheEntryError(f"torch.{name} is not a {kind}")
    return value


def _target_name(target: Any) -> str:
    if target is operator.getitem:
        return "operator.getitem"
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}::{target._opname}.{target._overloadname}"
    raise _NotPlainError(repr(target))


def _resolve(name: str) -> Any:
    if name == "operator.getitem":
        return operator.getitem
    namespace, rest = name.split("::", 1)
    op_name, overload = rest.rsplit(".", 1)
    return getattr(getattr(getattr(torch.ops, namespace), op_name), overload)


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


def save(key: Hashable, mesh: Mesh, program: StepProgram) -> None:
    """Write ``program`` for ``key`` (nothing when the cache is off or it has no plain form)."""
    path = _path(key, mesh)
    if path is None:
        return
    try:
        data = {
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
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written to a temporary file and renamed: a reader never sees half a file.
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
        json.dump(data, f)
    os.replace(f.name, path)


def load(key: Hashable, mesh: Mesh) -> StepProgram | None:
    """The program saved for ``key`` on ``mesh``, or None (absent, stale or unusable)."""
    path = _path(key, mesh)
    if path is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT or data.get("versions") != _versions():
            return None
        return _program(data, mesh)
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError):
        return None


def _program(data: dict[str, Any], mesh: Mesh) -> StepProgram:
    graph = fx.Graph()
    nodes: dict[str, fx.Node] = {}
    for row in data["graph"]:
        args = _decode(row["args"], nodes)
        kwargs = {k: _decode(v, nodes) for k, v in row["kwargs"].items()}
        if row["op"] == "placeholder":
            node = graph.placeholder(row["name"])
        elif row["op"] == "output":
            node = graph.output(args[0])
        else:
            node = graph.call_function(_resolve(row["target"]), args, kwargs)
            node.name = row["name"]
        node.meta["origin"], node.meta["source"] = row["origin"], row["source"]
        nodes[row["name"]] = node
    local = fx.GraphModule(torch.nn.Module(), graph)

    def sharding(d: dict[str, Any]) -> Sharding:
        return Sharding(mesh, tuple(tuple(a) for a in d["dim_axes"]), tuple(d["partial"]), d["op"])

    constants = tuple(
        torch.tensor(c["values"], dtype=_torch_attr(c["dtype"], torch.dtype)).reshape(c["shape"])
        for c in data["constants"]
    )
    return StepProgram(
        local=local,
        input_shardings=[sharding(s) for s in data["input_shardings"]],
        output_shardings=[sharding(s) for s in data["output_shardings"]],
        output_shapes=[tuple(s) for s in data["output_shapes"]],
        constants=constants,
        mutated_inputs=tuple(data["mutated_inputs"]),
        n_results=int(data["n_results"]),
    )
