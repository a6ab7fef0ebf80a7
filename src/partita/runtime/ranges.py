"""partita's work in the PyTorch profiler: named ranges for the step, segments and collectives.

Under ``torch.profiler.profile()`` (or ``torch.autograd.profiler.profile``) the executors open
a ``record_function`` range around:

- the step: ``partita.step LocalMesh(Mesh(data=2, model=4))`` (or ``DistributedMesh ...
  rank 3``);
- each segment of the LocalMesh (``partita.segment 2.0 (41 ops)``: the local ops run as one
  vmap call between mesh ops; ``runtime.segments``);
- each collective or fused call, named by ``partition.ranges`` with its kind, mesh axes,
  per-device bytes, its index in ``Plan.collectives`` and the user's line
  (``partita.all_gather[model] 1536 B #3 @ gpt.py:88 in forward``). A collective_permute
  that the LocalMesh folds into the selection reading it (``runtime.device_route``) has its
  range around that selection. On a DistributedMesh
  whose collectives overlap, the launch carries that name and the wait for its bytes
  ``partita.wait all_gather[model] 1536 B #3 ...``; the Gloo/NCCL calls fall inside them.
  A program's first run there, which measures its values for the overlap schedule
  (``runtime.overlap.first_run``), runs each collective synchronously in its range: no waits.

Off the profiler this costs one check per step: :func:`enabled` is read once, and the
executors then take their path without ranges (``bench/bench_profiler_ranges.py``).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx
from torch.autograd.profiler import record_function

from partita.ir import node_meta

__all__ = ["Range", "close", "enabled", "name_of", "range_names", "step_name", "step_names"]

_PERMUTE = torch.ops.partita.collective_permute.default

_NAMES: weakref.WeakKeyDictionary[fx.GraphModule, dict[str, str]] = weakref.WeakKeyDictionary()


def enabled() -> bool:
    """Whether a profiler records ``record_function`` ranges now (read once per step)."""
    return bool(torch.autograd.profiler._is_profiler_enabled)


class Range:
    """Open ``record_function`` ranges, each inside the one before; :meth:`close` ends them
    (also on an error)."""

    __slots__ = ("_rfs",)

    def __init__(self, *names: str) -> None:
        self._rfs = [record_function(name) for name in names]
        for rf in self._rfs:
            rf.__enter__()

    def close(self) -> None:
        """End the ranges, innermost first."""
        for rf in reversed(self._rfs):
            rf.__exit__(None, None, None)


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
    op = _target(node)
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


def name_of(step: Any, index: int, names: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    """The range names of one step of a LocalMesh's plan (``runtime.segments``): a segment, a
    mesh op or fused call, a bucket's member, a per-device selection or a contraction; a
    selection that reads through collective_permutes (``runtime.device_route``) is in their
    ranges too, one inside the other (:func:`step_names`)."""
    nodes = getattr(step, "nodes", None)
    if nodes is not None:  # a Segment
        return (f"partita.segment {index} ({len(nodes)} ops)",)
    found = names.get(step.name)
    if found is not None:
        return found
    return (f"partita.{_target(step)} {step.name}",)


_STEP_NAMES: weakref.WeakKeyDictionary[fx.GraphModule, dict[str, tuple[str, ...]]] = (
    weakref.WeakKeyDictionary()
)


def step_names(gm: fx.GraphModule, steps: Sequence[Any]) -> dict[str, tuple[str, ...]]:
    """For a LocalMesh running ``gm`` as ``steps``: ``{node name: range names}`` of its mesh
    ops, and of each selection the collective_permutes that do not run were folded into (the
    simulated mesh reads their rows where they were sent from: ``runtime.device_route``), so
    every collective of the Plan has one range (around the first selection reading its rows).
    Computed once per program."""
    found = _STEP_NAMES.get(gm)
    if found is not None:
        return found
    names: dict[str, tuple[str, ...]] = {k: (v,) for k, v in range_names(gm).items()}
    order = {s: i for i, s in enumerate(steps) if isinstance(s, fx.Node)}
    for node in gm.graph.nodes:
        if node.target is not _PERMUTE or node in order or len(node.users) != 1:
            continue
        (reader,) = node.users
        readers = list(reader.users) if reader.target is torch.ops.aten.cat.default else [reader]
        takes = sorted((r for r in readers if r in order), key=order.__getitem__)
        if takes:  # in the range of the first selection that reads its rows
            base = names.get(takes[0].name, (f"partita.{_target(takes[0])} {takes[0].name}",))
            names[takes[0].name] = (*base, *names.get(node.name, (op_name(node),)))
    _STEP_NAMES[gm] = names
    return names


_RANGED: weakref.WeakKeyDictionary[fx.GraphModule, Any] = weakref.WeakKeyDictionary()


def ranged(program: fx.GraphModule, gm: fx.GraphModule, executor: Any) -> Any:
    """A DistributedMesh's bound ``program`` (of per-device program ``gm``) whose step runs in
    a range and each mesh op, launch and wait in one named after it (built once per program)."""
    runner = _RANGED.get(program)
    if runner is None:
        inner, step = ranged_module(program, gm, executor), step_name(executor)

        def runner(*args: Any) -> Any:
            with record_function(step):
                return inner(*args)

        _RANGED[program] = runner
    return runner


def ranged_module(program: fx.GraphModule, gm: fx.GraphModule, executor: Any) -> fx.GraphModule:
    """A copy of a DistributedMesh's bound ``program`` (of per-device program ``gm``) whose
    mesh ops, launches and waits each run in a range named after them; its nodes keep
    ``program``'s names (the first run measures values by name: ``runtime.overlap``).

    The bound program's mesh ops carry the per-device program's node name in their ``node``
    argument; a wait reads it from its launch."""
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
    return fx.GraphModule(program, graph, class_name="RankProgramInRanges")


def _in_range(fn: Any, name: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        with record_function(name):
            return fn(*args, **kwargs)

    call.__name__ = call.__qualname__ = getattr(fn, "__name__", "mesh_op")
    return call


def _target(node: fx.Node) -> str:
    """``aten.index_select.default`` -> ``index_select``."""
    return str(getattr(node.target, "__name__", node.target)).split(".")[0]
