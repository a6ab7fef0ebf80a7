"""A compiled step (:class:`~partita.virtual.program.StepProgram`) as plain data and back,
for the compile cache (:mod:`partita.virtual.disk_cache`, which owns the files).

:func:`to_data` gives JSON-ready values: the per-device fx graph as rows (node kind, name, the
function called, arguments as tagged values), the shardings, shapes, in-place updates and tensor
constants as lists of numbers. :func:`from_data` rebuilds the program and trusts nothing in the
data: every function a row calls is looked up by its exact name in a closed table, the ops of
``torch.ops.aten``, ``torch.ops.prims`` and ``torch.ops.partita``
(:func:`partita.ir.op_lookup.find_op`; not the aten ops that read or write a file they are given by
name) and :data:`PYTHON_CALLABLES`; keyword names must be the op's argument names and node names
plain identifiers (both reach the Python code fx generates); dtypes and layouts come from a table
of torch's names. Anything else is a :class:`RejectedError` saying why. Nothing is imported,
unpickled or resolved by walking attributes.
"""

from __future__ import annotations

import keyword
import operator
from typing import Any

import torch
from torch import fx

from partita.errors import CacheEntryError
from partita.ir import node_meta
from partita.ir.op_lookup import find_op, torch_constant
from partita.partition.special.random_draw import draw_target
from partita.values.mesh import Mesh
from partita.values.spec import Sharding
from partita.virtual.program import StepProgram

__all__ = [
    "ALLOWED_NAMESPACES",
    "PYTHON_CALLABLES",
    "NotPlainError",
    "RejectedError",
    "from_data",
    "to_data",
]

#: The ``torch.ops`` namespaces whose ops a cache file may call (by exact name).
ALLOWED_NAMESPACES = frozenset({"aten", "prims", "partita"})
#: Ops of those namespaces a cache file may not call: they read or write a file named by a
#: string argument.
_DENIED_OPS = frozenset({"aten::save", "aten::from_file"})
#: The Python functions a cache file may call, by the name the file gives them.
PYTHON_CALLABLES: dict[str, Any] = {"operator.getitem": operator.getitem}


class NotPlainError(Exception):
    """A value has no stable plain-data form (the step is not saved)."""


class RejectedError(Exception):
    """Data that must not be loaded; the message says why."""


def to_data(program: StepProgram) -> dict[str, Any]:
    """``program`` as JSON-ready values (NotPlainError if some part has no plain form)."""
    return {
        "graph": _graph_data(program.local),
        "input_shardings": [_sharding(s) for s in program.input_shardings],
        "output_shardings": [_sharding(s) for s in program.output_shardings],
        "output_shapes": [list(s) for s in program.output_shapes],
        "constants": [_tensor(t) for t in program.constants],
        "mutated_inputs": list(program.mutated_inputs),
        "n_results": program.n_results,
    }


def from_data(data: dict[str, Any], mesh: Mesh) -> StepProgram:
    """The program ``to_data`` gave, on ``mesh`` (RejectedError if the data is not one)."""
    try:
        return _build(data, mesh)
    # CacheEntryError (a ValueError): what the checks below find; the others: what torch and
    # Python raise on data of the wrong shape
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, RuntimeError) as e:
        raise RejectedError(f"it is malformed ({type(e).__name__}: {e})") from None


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
    raise NotPlainError(repr(x))


def _decode(x: Any, nodes: dict[str, fx.Node]) -> Any:
    if not isinstance(x, (dict, list)):
        return x
    if isinstance(x, list):
        return [_decode(v, nodes) for v in x]
    if len(x) != 1:
        raise CacheEntryError(f"a tagged value has one key, got {sorted(x)}")
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
            raise CacheEntryError(f"a device is a string, got {value!r}")
        return torch.device(value)
    if tag == "torch":
        return _constant(value, (torch.memory_format, torch.layout))
    raise CacheEntryError(f"unknown tag {tag!r}")


def _constant(name: Any, kind: type | tuple[type, ...]) -> Any:
    value = torch_constant(name, kind)
    if value is None:
        raise CacheEntryError(f"torch.{name} is not a {kind}")
    return value


def _target_name(target: Any) -> str:
    for name, fn in PYTHON_CALLABLES.items():
        if target is fn:
            return name
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}::{target._opname}.{target._overloadname}"
    raise NotPlainError(repr(target))


def _resolve(name: Any) -> Any:
    """The function a file names, from the closed table only (else RejectedError)."""
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
            raise RejectedError(
                f"it calls {name!r}, an op that reads or writes a file it is given by name; a "
                f"cache file may not call it"
            )
        op = find_op(namespace, op_name, overload, ALLOWED_NAMESPACES)
    if op is None:
        raise RejectedError(
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


def _graph_data(gm: fx.GraphModule) -> list[dict[str, Any]]:
    rows = []
    for node in gm.graph.nodes:
        if node.op not in ("placeholder", "call_function", "output"):
            raise NotPlainError(node.op)
        rows.append(
            {
                "op": node.op,
                "name": node.name,
                "target": _target_name(node.target) if node.op == "call_function" else None,
                "args": _encode(tuple(node.args)),
                "kwargs": {k: _encode(v) for k, v in node.kwargs.items()},
                "origin": node_meta.origin(node) or "",
                "source": node_meta.source(node) or "",
            }
        )
    return rows


def _check_draw(args: tuple[Any, ...]) -> None:
    """A random draw names the aten op it runs: it must be one (the same exact-name lookup)."""
    op = args[1] if len(args) > 1 else None
    if draw_target(op) is None:
        raise RejectedError(
            f"its partita::global_random_draw names {op!r} as the op to run, which is not an "
            f"aten op named 'packet.overload'"
        )


def _identifier(name: Any) -> str:
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise CacheEntryError(f"a node name must be a plain identifier, got {name!r}")
    return name


def _build(data: dict[str, Any], mesh: Mesh) -> StepProgram:
    graph = fx.Graph()
    nodes: dict[str, fx.Node] = {}
    rows = data["graph"]
    for i, row in enumerate(rows):
        name = _identifier(row["name"])
        if name in nodes:
            raise CacheEntryError(f"two nodes are named {name!r}")
        args = _decode(row["args"], nodes)
        if not isinstance(args, tuple) or not isinstance(row["kwargs"], dict):
            raise CacheEntryError("a node's args are a tuple and its kwargs an object")
        kwargs = {k: _decode(v, nodes) for k, v in row["kwargs"].items()}
        if row["op"] == "placeholder":
            node = graph.placeholder(name)
        elif row["op"] == "output":
            if i != len(rows) - 1 or len(args) != 1 or kwargs:
                raise CacheEntryError("the output node comes last, with one argument")
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
                raise CacheEntryError(f"{row['target']} has no argument named {unknown}")
            if target is torch.ops.partita.global_random_draw.default:
                _check_draw(args)
            node = graph.call_function(target, args, kwargs)
            node.name = name
        else:
            raise CacheEntryError(f"unknown node kind {row['op']!r}")
        node_meta.set_origin_once(node, str(row["origin"]))
        node_meta.set_source(node, str(row["source"]))
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
        raise CacheEntryError(f"mutated_inputs are input positions, got {mutated!r}")
    return StepProgram(
        local=local,
        input_shardings=[sharding(s) for s in data["input_shardings"]],
        output_shardings=[sharding(s) for s in data["output_shardings"]],
        output_shapes=[tuple(s) for s in data["output_shapes"]],
        constants=constants,
        mutated_inputs=mutated,
        n_results=int(data["n_results"]),
    )
