"""Compile a ``partita.jit`` step in a forked child process and run it in the parent.

A probe of issue 32 (partita's peak RSS against FSDP2's on 4 Gloo processes), used by
``bench_rss_phases.py --child`` and ``bench_distributed.py``'s ``child`` rows: how much of the
training process's memory is the compiler's (the modules tracing imports, the objects it keeps,
the heap it leaves with holes). The child (``os.fork`` of the rank, before anything is compiled)
traces, propagates and partitions; it sends back over a pipe only what running needs: the
per-device program (its nodes: op, name, target by name, arguments, the few plain ``meta``
entries), the input and output shardings and shapes, the options, and the program's call
convention (input and output trees, constants, in-place updates; no graph). The parent never
imports what the compile imports (``torch._dynamo``, ``torch._inductor.config``, ...) and holds
none of its objects. The parent runs the program through the same executor as ``Jitted``.

Not partita's API: no Plan in the parent (``lower`` is the child's), a fork of a process whose
Gloo threads are running (the child uses none of them and exits with ``os._exit``), and the
payload is pickled over a pipe between the parent and its own child (never a file).
"""

from __future__ import annotations

import dataclasses
import operator
import os
import pickle
from types import SimpleNamespace
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from partita.frontend.reshard import write_back
from partita.runtime.executor import executor_for
from partita.values.tensor import ShardedTensor

#: The node ``meta`` entries the runtime reads of a per-device program (all plain values).
META = ("origin", "local_shape", "source", "range_name", "bucket_members", "bytes")


def _target(t: Any) -> tuple[str, ...]:
    if isinstance(t, torch._ops.OpOverload):
        return ("op", t.namespace, t._schema.name.split("::")[-1], t._overloadname)
    if t is operator.getitem:
        return ("getitem",)
    return ("fn", t.__module__, t.__qualname__)


def _resolve(t: tuple[str, ...]) -> Any:
    if t[0] == "op":
        return getattr(getattr(getattr(torch.ops, t[1]), t[2]), t[3])
    if t[0] == "getitem":
        return operator.getitem
    import importlib

    obj: Any = importlib.import_module(t[1])
    for part in t[2].split("."):
        obj = getattr(obj, part)
    return obj


class _Ref:
    """A node argument in transit: the name of the node it refers to."""

    def __init__(self, name: str) -> None:
        self.name = name


def encode(gm: fx.GraphModule) -> list[tuple[Any, ...]]:
    """``gm``'s nodes as plain tuples (names for node references, targets by name)."""
    out = []
    for n in gm.graph.nodes:
        args, kwargs = pytree.tree_map_only(fx.Node, lambda x: _Ref(x.name), (n.args, n.kwargs))
        target = n.target if n.op in ("placeholder", "output") else _target(n.target)
        meta = {k: n.meta[k] for k in META if k in n.meta}
        out.append((n.op, n.name, target, args, kwargs, meta))
    return out


def decode(nodes: list[tuple[Any, ...]]) -> fx.GraphModule:
    """The GraphModule :func:`encode` described."""
    graph, env = fx.Graph(), {}
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
    """A placeholder of the global program as the cross-rank check reads it."""

    def __init__(self, val: Any) -> None:
        plain = None if val is None else SimpleNamespace(shape=tuple(val.shape), dtype=val.dtype)
        self.meta = {"val": plain}


def _payload(compiled: Any) -> bytes:
    program = compiled.program
    # the cross-rank check reads each input's shape and dtype (``plan_check.input_lines``)
    inputs = [_Input(n.meta.get("val")) for n in program.input_nodes]
    lite = dataclasses.replace(program, graph_module=None, input_nodes=inputs, annotations={})
    return pickle.dumps({
        "nodes": encode(compiled.local), "program": lite,
        "input_shardings": compiled.input_shardings, "output_shardings": compiled.output_shardings,
        "output_shapes": compiled.output_shapes, "options": compiled.options,
    })  # fmt: skip


def compile_in_child(step: Any, *args: Any) -> SimpleNamespace:
    """``step.lower(*args)`` in a forked child; what :func:`run` needs, without the Plan."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: compile, send, exit without running any parent's cleanup
        code = 1
        try:
            os.close(read)
            step.lower(*args)
            data = _payload(next(reversed(step._cache.values())))
            with os.fdopen(write, "wb") as f:
                f.write(data)
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    if status != 0 or not data:
        raise RuntimeError(f"the compile child failed (status {status})")
    got = pickle.loads(data)  # noqa: S301 - our own child's bytes, over our own pipe
    got["local"] = decode(got.pop("nodes"))
    return SimpleNamespace(**got)


def no_dynamo_import() -> None:
    """Keep ``partita::sdpa``'s CPU kernels from importing ``torch._dynamo`` at their first call.

    ``torch.library`` wraps a registered kernel in ``torch._disable_dynamo``, which imports
    ``torch._dynamo`` (and with it ~340 modules, ~30 MB) the first time the kernel runs, to
    mark it as not for Dynamo to trace; no Dynamo runs in this process. The probe sets the
    cached "disabled" function to the kernel itself, through torch's private attributes.
    """
    import partita.capture.ops as partita_ops

    for op in (partita_ops.sdpa, partita_ops.sdpa_backward):
        for fn in op._backend_fns.values():
            kernel = fn.__wrapped__
            kernel.__dynamo_disable = kernel


def run(compiled: SimpleNamespace, mesh: Any, *args: Any) -> Any:
    """What ``Jitted.__call__`` does with a compiled signature, for :func:`compile_in_child`'s."""
    program = compiled.program
    leaves, _ = pytree.tree_flatten((tuple(args), {}))
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor | ShardedTensor)]
    tensors += program.constants
    with torch.no_grad():
        results = executor_for(mesh).run_compiled(compiled, tensors)
    for i, new in program.input_updates(results):
        write_back(tensors[i], new)
    return program.unflatten_outputs(results)
