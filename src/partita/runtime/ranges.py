"""partita's work in the PyTorch profiler: named ranges for the step, segments and collectives.

Under ``torch.profiler.profile()`` (or ``torch.autograd.profiler.profile``) the executors open
a ``record_function`` range around:

- the step: ``partita.step LocalMesh(Mesh(data=2, model=4))`` (or ``DistributedMesh ...
  rank 3``);
- each segment of the LocalMesh (``partita.segment 2.0 (41 ops)``: the local ops run as one
  vmap call between mesh ops; ``runtime.segments``);
- each collective or fused call, named by ``partition.ranges`` with its kind, mesh axes,
  per-device bytes, its index in ``Plan.collectives`` and the user's line
  (``partita.all_gather[model] 1536 B #3 @ gpt.py:88 in forward``). On a DistributedMesh
  whose collectives overlap, the launch carries that name and the wait for its bytes
  ``partita.wait all_gather[model] 1536 B #3 ...``; the Gloo/NCCL calls fall inside them.

Off the profiler this costs one check per step: :func:`enabled` is read once, and the
executors then take their path without ranges (``bench/bench_profiler_ranges.py``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import fx
from torch.autograd.profiler import record_function

from partita.ir import node_meta

__all__ = ["Range", "close", "enabled", "name_of", "range_names", "step_name"]

_NAMES: weakref.WeakKeyDictionary[fx.GraphModule, dict[str, str]] = weakref.WeakKeyDictionary()


def enabled() -> bool:
    """Whether a profiler records ``record_function`` ranges now (read once per step)."""
    return bool(torch.autograd.profiler._is_profiler_enabled)


class Range:
    """An open ``record_function`` range; :meth:`close` ends it (also on an error)."""

    __slots__ = ("_rf",)

    def __init__(self, name: str) -> None:
        self._rf = record_function(name)
        self._rf.__enter__()

    def close(self) -> None:
        """End the range."""
        self._rf.__exit__(None, None, None)


def close(*spans: Range | None) -> None:
    """End the ranges still open, innermost first (after an error in a step)."""
    for span in spans:
        if span is not None:
            span.close()


def op_name(node: fx.Node) -> str:
    """A mesh op node's range name: the Plan's (``partition.ranges``) or, for a program not
    named while partitioning, its op, mesh axes and bytes."""
    name = node_meta.range_name(node)
    if name is not None:
        return name
    op = str(getattr(node.target, "__name__", node.target)).split(".")[0]
    nbytes = node_meta.collective_bytes(node)
    return f"partita.{op}" + (f" {nbytes} B" if nbytes else "")


def range_names(gm: fx.GraphModule) -> dict[str, str]:
    """``{node name: range name}`` of every mesh op of ``gm`` (computed once per program)."""
    names = _NAMES.get(gm)
    if names is None:
        names = _NAMES[gm] = {
            n.name: op_name(n)
            for n in gm.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("partita.")
        }
    return names


def step_name(executor: Any) -> str:
    """The step's range name: ``partita.step LocalMesh(Mesh(data=2, model=4))``."""
    return f"partita.step {executor!r}"


def name_of(step: Any, index: int, names: dict[str, str]) -> str:
    """The range name of one step of a LocalMesh's plan (``runtime.segments``): a segment,
    a mesh op or fused call, a bucket's member, a per-device selection or a contraction."""
    nodes = getattr(step, "nodes", None)
    if nodes is not None:  # a Segment
        return f"partita.segment {index} ({len(nodes)} ops)"
    name = names.get(step.name)
    if name is not None:
        return name
    return f"partita.{getattr(step.target, '__name__', step.target)} {step.name}"


_RANGED: weakref.WeakKeyDictionary[fx.GraphModule, Any] = weakref.WeakKeyDictionary()


def ranged(program: fx.GraphModule, gm: fx.GraphModule, executor: Any) -> Any:
    """A DistributedMesh's bound ``program`` (of per-device program ``gm``) whose step runs in
    a range and each mesh op, launch and wait in one named after it (built once per program).

    The bound program's mesh ops carry the per-device program's node name in their ``node``
    argument; a wait reads it from its launch."""
    runner = _RANGED.get(program)
    if runner is not None:
        return runner
    names = range_names(gm)
    graph = fx.Graph()
    graph.output(graph.graph_copy(program.graph, {}))
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        name = names.get(str(node.kwargs.get("node", "")))
        launch = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        if name is None and launch is not None and node.target == executor.wait:
            name = names.get(str(launch.kwargs.get("node", "")))
            name = None if name is None else "partita.wait " + name.removeprefix("partita.")
        if name is not None:
            node.target = _in_range(node.target, name)
    inner = fx.GraphModule(program, graph, class_name="RankProgramInRanges")
    step = step_name(executor)

    def run(*args: Any) -> Any:
        with record_function(step):
            return inner(*args)

    runner = _RANGED[program] = run
    return runner


def _in_range(fn: Any, name: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        with record_function(name):
            return fn(*args, **kwargs)

    call.__name__ = call.__qualname__ = getattr(fn, "__name__", "mesh_op")
    return call
