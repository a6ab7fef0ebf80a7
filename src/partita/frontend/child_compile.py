"""Compile in a forked child process: the calling process never imports or holds the compiler.

Where the ``compile_in_child`` option says (by default under torch.distributed, where a
DistributedMesh runs the program; ``True``: on every mesh; ``False``: never), ``partita.jit``
compiles a new input signature in a child process (``os.fork`` of this one, so the function, its
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
here, with its usual type and traceback; a failure of the child alone (torch refuses autograd in
a fork of a process that already ran a backward; a child that crashed, or used no CPU for
:data:`STALL_SECONDS` and was killed) stops this process forking for later compiles. Under
``True`` a PartitaWarning says why, once per process; under the default only a hung child is
worth one. Warnings the child raised are raised again here. The bytes are pickled by this
process's own child and read back over the pipe they share; nothing is read from a file.

Fork safety: the child runs only the forking thread; other threads' locks it could need are
partita's tracing lock (held across the fork, so no other thread is tracing) and OpenMP's pool
(its threads are not in the child: the child sets torch to one thread, otherwise its first
parallel kernel waits forever). Gloo's threads are not touched: the child runs no collective.
Under CUDA (initialised here) nothing forks by default.

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
import select
import signal
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed
from torch import fx
from torch.utils import _pytree as pytree

from partita.capture.threads import TRACING
from partita.errors import PartitaError, PartitaWarning, warn
from partita.partition.memory import InputShape

__all__ = [
    "STALL_SECONDS",
    "available",
    "by_default",
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
    """A placeholder of the global program as the cross-rank checks read it: its name (the
    replica check's message: ``runtime.plan_check.input_name``), shape and dtype
    (``input_lines``)."""

    def __init__(self, name: str, val: Any) -> None:
        self.name = name
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
    inputs = [_Input(n.name, n.meta.get("val")) for n in program.input_nodes]
    program = dataclasses.replace(program, graph_module=None, input_nodes=inputs, annotations={})
    fields = {f.name: getattr(compiled, f.name) for f in dataclasses.fields(compiled)}
    fields.update(program=program, plan=plan, local=encode(compiled.local))
    return fields


#: Set once a child failed where this process then compiled: it ran a backward before it
#: forked (torch refuses autograd in a fork of it), or the child crashed or hung; later
#: compiles of this process do not fork.
_AUTOGRAD_FORK = "autograd's threading in combination with fork"
_STATE = {"forks": True, "warned": False}
#: Seconds a child may go without using any CPU before it is taken as hung and stopped (its
#: CPU time is read from ``/proc``; where that is missing, a child is waited for until it ends).
STALL_SECONDS = 60.0


def compile_in_child(
    build: Callable[[], Any], changed: Callable[[], bool] = bool, loud: bool = True
) -> Any:
    """``build()`` (a :class:`~partita.frontend.pipeline.Compiled`) run in a forked child and
    rebuilt here. It runs here instead when its result does not cross, when it fails in the
    child, or when ``changed()`` (asked in the child after ``build``) is true: the compile had
    an effect on the child's objects that this process must see too. When it then succeeds
    here, a PartitaWarning (once per process) says why the child did not if ``loud`` (or the
    child hung)."""
    if not _STATE["forks"]:
        return build()
    read, write = os.pipe()
    with TRACING, warnings.catch_warnings():  # no other thread of this process traces now
        # Python 3.12+ warns that forking a threaded process may deadlock the child: this
        # child runs no other thread's code, sets OpenMP aside and is stopped if it hangs.
        warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        _child(build, changed, read, write)
    os.close(write)
    data = _receive(read, pid)
    with warnings.catch_warnings():  # torch's TreeSpec unpickling warns of its own deprecation
        warnings.simplefilter("ignore", FutureWarning)
        got: tuple[Any, Any] = pickle.loads(data) if data else (None, (False, _gone(data)))
    said, fields = got  # written by our own child, over our own pipe
    if said is not None:
        for message, category in said:
            warn(message, category)
        return _rebuild(fields)
    per_program, reason = fields
    compiled = build()  # the usual compile here: the error it raises, or the program
    _STATE["forks"] = per_program  # the child failed where this process did not: stop forking
    if (loud or data is None) and not _STATE["warned"]:
        _STATE["warned"] = True
        warn(f"compile_in_child: the child process did not compile this program ({reason}); "
             f"it was compiled in this process.", PartitaWarning)  # fmt: skip
    return compiled


def _gone(data: bytes | None) -> str:
    if data is None:
        return f"it used no CPU for {STALL_SECONDS:g} s and was stopped"
    return "the child exited without a result"


def _child(build: Callable[[], Any], changed: Callable[[], bool], read: int, write: int) -> Any:
    """The child: compile, send the result or why not, exit without the parent's cleanup."""
    try:
        os.close(read)
        # OpenMP's worker threads did not cross the fork: a parallel region would wait for
        # them forever (GNU libgomp). One thread runs the kernels inline; tracing on fake
        # tensors runs none, so nothing computed changes.
        torch.set_num_threads(1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fields = _payload(build())
        if changed():
            raise _NotCrossingError("tracing changed a Python attribute of the module")
        data = pickle.dumps(([(str(w.message), w.category) for w in caught], fields))
    except BaseException as e:  # what the parent compiles again; whether for this program only
        cause = f"{e}; {e.__cause__}" if e.__cause__ is not None else str(e)
        reason = f"{type(e).__name__}: {cause}"[:2000]
        data = pickle.dumps((None, (isinstance(e, _NotCrossingError), reason)))
    try:
        with os.fdopen(write, "wb") as f:
            f.write(data)
    finally:
        os._exit(0)


def _receive(fd: int, pid: int) -> bytes | None:
    """All the child wrote to ``fd`` until it closed it; None if the child used no CPU for
    :data:`STALL_SECONDS` (then it is killed). The child is reaped either way."""
    chunks: list[bytes] = []
    cpu, since = _cpu_ticks(pid), time.monotonic()
    try:
        while True:
            if select.select([fd], [], [], 1.0)[0]:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    return b"".join(chunks)
                chunks.append(chunk)
                since = time.monotonic()
                continue
            now = _cpu_ticks(pid)
            if now is None or now != cpu:
                cpu, since = now, time.monotonic()
            elif time.monotonic() - since > STALL_SECONDS:
                os.kill(pid, signal.SIGKILL)
                return None
    finally:
        os.close(fd)
        os.waitpid(pid, 0)


def _cpu_ticks(pid: int) -> int | None:
    """The CPU time process ``pid`` used so far, in clock ticks (None where ``/proc`` is not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime
    except (OSError, IndexError, ValueError):
        return None


def by_default() -> bool:
    """Where ``compile_in_child`` is None (the default) forks: under torch.distributed (a
    DistributedMesh runs the program), and not once this process initialised CUDA (a fork
    cannot use it)."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return distributed and not torch.cuda.is_initialized()


def compiled_where(
    options: Any, build: Callable[[], Any], changed: Callable[[], bool] = bool
) -> Any:
    """``build()`` in a child process where ``options.compile_in_child`` says (None: under
    torch.distributed, silently compiling here when the child cannot; True: always, saying
    so; False: never) and this platform forks, else here."""
    wanted = options.compile_in_child
    if not ((by_default() if wanted is None else wanted) and available()):
        return build()
    compiled = compile_in_child(build, changed, loud=wanted is True)
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
