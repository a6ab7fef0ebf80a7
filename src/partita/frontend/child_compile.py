"""Compile in a forked child process: the calling process never imports or holds the compiler.

Under the ``compile_in_child`` option (``PARTITA_COMPILE_IN_CHILD=1``), ``partita.jit`` compiles
a new input signature in a child process (``os.fork`` of this one, so the function, its
arguments and the module are there as they are here) that traces, propagates and partitions,
and hands back over a pipe only what running and inspecting need: the per-device program (its
nodes: op, name, target by name, arguments and their plain ``meta`` entries), the Plan
without its fake tensors (the per-device inputs' shapes, dtypes and devices instead:
:class:`~partita.partition.memory.InputShape`), and the program's call convention (argument
and result trees, constants, in-place updates, each input's shape and dtype; not the global
graph). So this process never imports what tracing imports (``torch._dynamo``, about 340 modules)
and keeps none of the compile's objects or the heap it leaves behind (issue 32:
docs/performance.md, "Compiling in a child process").

What does not cross is compiled here as before: a program with control-flow bodies (the
per-device program has submodules), one whose Plan does not pickle (an auto-sharding report may
not), one whose tracing changed a Python attribute of the module (that change must happen here
too), and any compile the child could not do: an error in the user's function is then raised
here, with its usual type and traceback; one the child alone hit (torch refuses autograd in a
fork of a process that already ran a backward: then later compiles do not fork at all) says
so in a PartitaWarning, once per process. Warnings the child raised are raised again here. The
bytes are pickled by this process's own child and read back over the pipe they share; nothing
is read from a file.

``torch.library`` wraps the kernels of partita's own ops (``partita::sdpa``) so that their first
call imports ``torch._dynamo`` (to mark them as not for Dynamo to trace); :func:`no_dynamo_import`
marks them directly, so that running the program does not import it either.
"""

from __future__ import annotations

import dataclasses
import importlib
import operator
import os
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from partita.errors import PartitaError, PartitaWarning, warn
from partita.partition.memory import InputShape

__all__ = [
    "available",
    "compile_in_child",
    "compiled_where",
    "decode",
    "encode",
    "no_dynamo_import",
]

#: The node ``meta`` entries of a per-device program that cross (plain values; the runtime and
#: the Plan's reports read them).
META = ("origin", "local_shape", "source", "range_name", "bucket_members", "bytes")


class _NotCrossingError(PartitaError):
    """Raised in the child only: its compile's result cannot be handed back (the reason is
    the message); the calling process compiles again itself and says why in a warning."""


def available() -> bool:
    """Whether this platform can fork (Linux, macOS; not Windows)."""
    return hasattr(os, "fork")


class _Ref:
    """A node argument in transit: the name of the node it refers to."""

    def __init__(self, name: str) -> None:
        self.name = name


def _target(t: Any) -> tuple[str, ...]:
    if isinstance(t, torch._ops.OpOverload):
        return ("op", t.namespace, t._schema.name.split("::")[-1], t._overloadname)
    if t is operator.getitem:
        return ("getitem",)
    # a function by its module, or a method of a class (``Tensor.new_tensor``) by the class's
    module = getattr(t, "__module__", None) or getattr(getattr(t, "__objclass__", None),
                                                       "__module__", None)  # fmt: skip
    name = ("fn", str(module), str(getattr(t, "__qualname__", "")))
    if module is None or _resolve(name) is not t:
        raise _NotCrossingError(f"{t!r} is not reachable by name")
    return name


def _resolve(t: tuple[str, ...]) -> Any:
    if t[0] == "op":
        return getattr(getattr(getattr(torch.ops, t[1]), t[2]), t[3])
    if t[0] == "getitem":
        return operator.getitem
    try:
        obj: Any = importlib.import_module(t[1])
    except ImportError:
        return None
    for part in t[2].split("."):
        obj = getattr(obj, part, None)
    return obj


def encode(gm: fx.GraphModule) -> list[tuple[Any, ...]]:
    """``gm``'s nodes as plain tuples (names for node references, targets by name). A graph
    of anything but placeholders, function calls and its output does not cross."""
    out = []
    for n in gm.graph.nodes:
        if n.op not in ("placeholder", "call_function", "output"):
            raise _NotCrossingError(f"a {n.op} node ({n.name}) does not cross")
        args, kwargs = pytree.tree_map_only(fx.Node, lambda x: _Ref(x.name), (n.args, n.kwargs))
        target = n.target if n.op != "call_function" else _target(n.target)
        meta = {k: n.meta[k] for k in META if k in n.meta}
        out.append((n.op, n.name, target, args, kwargs, meta))
    return out


def decode(nodes: list[tuple[Any, ...]]) -> fx.GraphModule:
    """The GraphModule :func:`encode` described (same nodes, names, arguments and meta)."""
    graph, env = fx.Graph(), dict[str, fx.Node]()
    for op, name, target, args, kwargs, meta in nodes:
        args, kwargs = pytree.tree_map_only(_Ref, lambda r: env[r.name], (args, kwargs))
        if op == "output":
            node = graph.output(args[0])
        elif op == "placeholder":
            node = graph.placeholder(target)
        else:
            node = graph.create_node(op, _resolve(target), args, kwargs, name=name)
        node.meta.update(meta)
        env[name] = node
    return fx.GraphModule(torch.nn.Module(), graph)


class _Input:
    """A placeholder of the global program as the cross-rank check reads it (its shape and
    dtype: ``runtime.plan_check.input_lines``)."""

    def __init__(self, val: Any) -> None:
        self.meta = {"val": None if val is None else InputShape(tuple(val.shape), val.dtype,
                                                                 val.device)}  # fmt: skip


def _payload(compiled: Any) -> dict[str, Any]:
    """What crosses: every field of ``compiled`` with its graphs and fake tensors replaced."""
    plan, program = compiled.plan, compiled.program
    if plan.bodies:
        raise _NotCrossingError("a program with control-flow bodies does not cross")
    shapes = [
        InputShape(tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor) else x
        for x in plan.local_inputs
    ]
    plan = dataclasses.replace(plan, local_program=None, local_inputs=shapes, _memory=None,
                               _values=None)  # fmt: skip
    inputs = [_Input(n.meta.get("val")) for n in program.input_nodes]
    program = dataclasses.replace(program, graph_module=None, input_nodes=inputs, annotations={})
    fields = {f.name: getattr(compiled, f.name) for f in dataclasses.fields(compiled)}
    fields.update(program=program, plan=plan, local=encode(compiled.local))
    return fields


#: Set once a child could not use autograd: this process ran a backward before it forked
#: (torch refuses autograd in a fork of it); later compiles go straight here.
_AUTOGRAD_FORK = "autograd's threading in combination with fork"
_STATE = {"forks": True, "warned": False}


def compile_in_child(build: Callable[[], Any], changed: Callable[[], bool] = bool) -> Any:
    """``build()`` (a :class:`~partita.frontend.pipeline.Compiled`) run in a forked child and
    rebuilt here. It runs here instead when its result does not cross, when it fails in the
    child, or when ``changed()`` (asked in the child after ``build``) is true: the compile had
    an effect on the child's objects that this process must see too. When it then succeeds here,
    a PartitaWarning (once per process) says why the child did not."""
    if not _STATE["forks"]:
        return build()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: compile, send, exit without running the parent's cleanup
        try:
            os.close(read)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fields = _payload(build())
            if changed():
                raise _NotCrossingError("tracing changed a Python attribute of the module")
            data = pickle.dumps(([(str(w.message), w.category) for w in caught], fields))
        except BaseException as e:  # what this process compiles again; the reason, for a warning
            cause = f"{e}; {e.__cause__}" if e.__cause__ is not None else str(e)
            data = pickle.dumps((None, f"{type(e).__name__}: {cause}"[:2000]))
        try:
            with os.fdopen(write, "wb") as f:
                f.write(data)
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    with warnings.catch_warnings():  # torch's TreeSpec unpickling warns of its own deprecation
        warnings.simplefilter("ignore", FutureWarning)
        got: tuple[Any, Any] = pickle.loads(data) if data else (None, "the child exited")
    said, fields = got  # written by our own child, over our own pipe
    if said is not None:
        for message, category in said:
            warn(message, category)
        return _rebuild(fields)
    compiled = build()  # the usual compile here: the error it raises, or the program
    _STATE["forks"] = _AUTOGRAD_FORK not in fields
    if not _STATE["warned"]:
        _STATE["warned"] = True
        warn(f"compile_in_child: the child process did not compile this program ({fields}); "
             f"it was compiled in this process.", PartitaWarning)  # fmt: skip
    return compiled


def compiled_where(
    options: Any, build: Callable[[], Any], changed: Callable[[], bool] = bool
) -> Any:
    """``build()`` in a child process under ``options.compile_in_child`` (where this platform
    forks), else here."""
    if not (options.compile_in_child and available()):
        return build()
    compiled = compile_in_child(build, changed)
    no_dynamo_import()
    return compiled


def _rebuild(fields: dict[str, Any]) -> Any:
    from partita.frontend.pipeline import Compiled

    local = decode(fields.pop("local"))
    plan = fields["plan"]
    plan.local_program = local
    return Compiled(local=local, **fields)


def no_dynamo_import() -> None:
    """Mark the kernels of partita's ops as not for Dynamo to trace without importing it.

    ``torch.library`` wraps each registered kernel in ``torch._disable_dynamo``, which imports
    ``torch._dynamo`` at the kernel's first call to wrap it once. The disabled function it caches
    is set to the kernel itself: Dynamo never traces into a custom op's kernel (it records the op).
    Through torch's private attributes; where they are missing, nothing changes.
    """
    from partita.capture import ops as partita_ops

    for op in (partita_ops.sdpa, partita_ops.sdpa_backward):
        for fn in getattr(op, "_backend_fns", {}).values():
            kernel = getattr(fn, "__wrapped__", None)
            if kernel is not None and not hasattr(kernel, "__dynamo_disable"):
                kernel.__dynamo_disable = kernel
