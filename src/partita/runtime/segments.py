"""How the LocalMesh cuts a per-device program: segments of local ops between mesh ops.

A node's segment is the number of mesh ops (``partita.ir.collectives``, fused buckets) on its
longest path from the inputs; each segment becomes its own ``GraphModule`` run as nested
``torch.vmap`` calls, one per mesh axis its inputs vary along (outermost first), traced to a
flat graph of batched aten ops once its eager runs with one input signature have cost as
much as that trace (``runtime.flat_trace``; ``partita.runtime.local`` says why), in which
``runtime.flat_matmul`` folds broadcast bmms and ``runtime.flat_foreach`` runs independent
elementwise ops (an optimizer update's) as ``_foreach`` calls.
A depth's segment is cut further where a contraction's operands are complete
(``runtime.step_order``), so the contraction runs there and its operands can go.
This module builds and runs segments; :class:`~partita.runtime.local.LocalMesh` runs the
mesh ops between them.
"""

from __future__ import annotations

import operator
import traceback
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, fx

from partita.errors import CompilerError, UnsupportedOpError
from partita.ir import node_meta
from partita.ir.buckets import BUCKET_OPS
from partita.ir.collectives import MESH_OPS
from partita.propagate.bodies import is_control_flow
from partita.runtime.compiled import CompileStats, compile_graph
from partita.runtime.device_index import DeviceTake, find_device_takes, take_inputs
from partita.runtime.device_route import RoutedTake, route_permutes
from partita.runtime.flat_trace import (
    FlatTracer,
    no_fallback_warning,
    significant_strides,
    timed_run,
    trace_flat,
    vmap_axis,
)
from partita.runtime.step_order import chunks_at_contractions, last_uses
from partita.runtime.subgraph import copy_nodes
from partita.values.mesh import Mesh

__all__ = [
    "STEP_OPS",
    "Axes",
    "Pattern",
    "Segment",
    "SegmentPlan",
    "plan_segments",
    "segment_error",
]

aten = torch.ops.aten

_TO_RESHAPE = {aten.view.default, aten._unsafe_view.default}
#: Memory formats that only exist for one rank (4 and 5): not for the stacked values.
_RANK_BOUND_FORMATS = (torch.channels_last, torch.channels_last_3d)
# Steps run outside vmap: the mesh ops and the fused (bucketed) ones, whose results are lists
# that the bucket's getitem nodes take apart (also outside vmap).
STEP_OPS = frozenset((*MESH_OPS, *BUCKET_OPS))

#: The mesh axes one value varies along, one flag per mesh dim (``partita.runtime.local``).
Axes = tuple[bool, ...]
Pattern = tuple[Axes, ...]  # one Axes per value


@dataclass
class Segment:
    """Local ops that run as one vmap call: ``gm(*inputs) -> tuple(outputs)``."""

    gm: fx.GraphModule
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    nodes: list[fx.Node]
    vmapped: dict[Pattern, tuple[Callable[..., Any], Pattern]] = field(default_factory=dict)
    flat: dict[Hashable, Callable[..., Any]] = field(default_factory=dict)
    #: The eager runs so far, over all signatures (``runtime.flat_trace``).
    tracer: FlatTracer = field(default_factory=FlatTracer)
    inductor: dict[Hashable, Callable[..., Any]] = field(default_factory=dict)
    #: Whether the last run went through a flat graph (or needed no vmap): once every
    #: segment's does, the whole step can be traced (``runtime.fused_step``).
    ran_flat: bool = False

    def run(
        self,
        values: list[tuple[Any, Axes]],
        ndim: int,
        compile_stats: CompileStats | None = None,
        trace_at: int | None = None,
    ) -> list[tuple[Any, Axes]]:
        """Outputs ``(value, axes)`` for inputs ``(value, axes)`` on a mesh of ``ndim`` dims;
        with ``compile_stats``, through Inductor (``runtime.compiled``), which it records;
        ``trace_at``: the ``trace_flat_at`` option (``runtime.flat_trace``)."""
        with no_fallback_warning():
            return self._run(values, ndim, compile_stats, trace_at)

    def _run(
        self,
        values: list[tuple[Any, Axes]],
        ndim: int,
        compile_stats: CompileStats | None,
        trace_at: int | None = None,
    ) -> list[tuple[Any, Axes]]:
        args = [v for v, _ in values]
        pattern = tuple(a for _, a in values)
        fn, out_pattern = self._vmapped(pattern, ndim)
        self.ran_flat = False
        if compile_stats is not None:
            return list(
                zip(
                    self._compiled(fn, args, pattern, out_pattern, compile_stats)(*args),
                    out_pattern,
                    strict=True,
                )
            )
        if fn is not self.gm:
            # Once its eager runs cost as much as tracing (runtime.flat_trace), vmap(segment)
            # is traced to a flat graph of batched aten ops, which then runs without
            # functorch's per-op overhead.
            key = _signature(args, pattern, out_pattern)
            if key is not None:
                flat = self.flat.get(key)
                if flat is None:
                    if not self.tracer.due(len(self.nodes), trace_at):
                        outs = timed_run(fn, args, self.tracer)
                        return list(zip(outs, out_pattern, strict=True))
                    flat = trace_flat(fn, args, len(self.nodes))
                    if flat is None:  # another thread traces: this run keeps the vmaps
                        return list(zip(fn(*args), out_pattern, strict=True))
                    self.flat[key] = flat
                self.ran_flat = isinstance(flat, fx.GraphModule)  # not vmap's fn kept
                fn = flat
        else:
            self.ran_flat = True
        return list(zip(fn(*args), out_pattern, strict=True))

    def _compiled(
        self,
        fn: Callable[..., Any],
        args: list[Any],
        pattern: Pattern,
        out_pattern: Pattern,
        stats: CompileStats,
    ) -> Callable[..., Any]:
        """The segment compiled for this signature: its flat batched graph (traced at once,
        not at the second run: compiling is the expensive part), or the segment itself when
        nothing is batched. A segment whose vmap cannot be traced flat stays uncompiled."""
        key = _signature(args, pattern, out_pattern)
        if key is None:
            return fn
        hit = self.inductor.get(key)
        if hit is None:
            graph = fn if fn is self.gm else self.flat.get(key) or trace_flat(fn, args)
            if graph is None:  # another thread traces: compiled at a later run
                return fn
            if isinstance(graph, fx.GraphModule):
                self.flat[key] = graph
                hit = compile_graph(graph, args, stats, self.gm.__class__.__name__)
            else:
                stats.skipped.append(f"{self.gm.__class__.__name__}: vmap not traceable")
                hit = fn
            self.inductor[key] = hit
        return hit

    def _vmapped(self, pattern: Pattern, ndim: int) -> tuple[Callable[..., Any], Pattern]:
        """The callable for inputs varying along mesh axes as ``pattern`` says, and the axes
        each output varies along: one ``vmap`` per mesh axis some input varies along, nested
        in mesh order, so an input that varies along fewer axes is read once per the devices
        it differs on (a value replicated over ``model`` is computed once per ``data`` row)."""
        hit = self.vmapped.get(pattern)
        if hit is not None:
            return hit
        # Under vmap an op's result varies along an axis exactly when one of its inputs does.
        none = (False,) * ndim
        varies = dict(zip(self.inputs, pattern, strict=True))
        for node in self.nodes:
            ins = [varies.get(n, none) for n in node.all_input_nodes]
            varies[node] = tuple(any(p[a] for p in ins) for a in range(ndim))
        out_pattern = tuple(varies[n] for n in self.outputs)
        fn: Callable[..., Any] = self.gm
        for a in reversed(range(ndim)):  # the innermost vmap is the last mesh axis
            if any(p[a] for p in pattern):
                fn = vmap_axis(
                    fn,
                    tuple(0 if p[a] else None for p in pattern),
                    tuple(0 if p[a] else None for p in out_pattern),
                )
        self.vmapped[pattern] = (fn, out_pattern)
        return fn, out_pattern


def _signature(args: list[Any], pattern: Pattern, out_pattern: Pattern) -> Hashable | None:
    """What a traced flat graph depends on: the mesh axes each input varies along, and every
    input's shape, strides (those of its dims of size 1 left out), dtype and device."""
    if not all(isinstance(a, Tensor) for a in args):
        return None  # rare (non-tensor graph inputs): stay with vmap
    return (
        pattern,
        out_pattern,
        tuple((a.shape, significant_strides(a), a.dtype, a.device) for a in args),
    )


@dataclass
class SegmentPlan:
    """A graph cut into segments and mesh calls, in execution order."""

    placeholders: list[fx.Node]
    steps: list[Segment | fx.Node]
    output: Any  # the output node's argument (a pytree of nodes and constants)
    #: ``index_select`` steps whose index is a per-device constant (``runtime.device_index``).
    takes: dict[fx.Node, DeviceTake | RoutedTake] = field(default_factory=dict)
    #: Per step, the values nothing reads after it (not graph outputs): the LocalMesh drops
    #: them there, so a step holds what the program still needs, not every value so far.
    frees: list[tuple[fx.Node, ...]] = field(default_factory=list)


def plan_segments(gm: fx.GraphModule, mesh: Mesh | None = None) -> SegmentPlan:
    """Cut ``gm`` into segments of local ops separated by mesh ops (see the module doc).
    With ``mesh``, selections at a per-device index are steps too (``runtime.device_index``),
    and the nodes that only compute their index do not run."""
    graph = gm.graph
    takes: dict[fx.Node, DeviceTake | RoutedTake] = {}
    skipped: set[fx.Node] = set()
    if mesh is not None:
        takes, skipped = find_device_takes(gm, mesh)  # type: ignore[assignment]
        route_permutes(mesh, takes, skipped)  # through collective_permutes: runtime.device_route
    depth: dict[fx.Node, int] = {}
    placeholders: list[fx.Node] = []
    mesh_nodes: list[fx.Node] = []
    buckets = {
        n
        for n in graph.nodes
        if n.op == "call_function" and (n.target in BUCKET_OPS or is_control_flow(n))
    }
    contractions: list[fx.Node] = []
    by_depth: dict[int, list[fx.Node]] = {}
    output: Any = None
    for node in graph.nodes:
        if node.op == "placeholder":
            placeholders.append(node)
            depth[node] = 0
            continue
        if node.op == "output":
            output = node.args[0]
            continue
        if node.op not in ("call_function", "get_attr"):
            raise UnsupportedOpError(
                f"LocalMesh cannot run node {node.name!r} of kind {node.op!r}; a per-device "
                f"program holds only call_function and get_attr nodes."
            )
        _check_not_random(node)
        if node in skipped:
            depth[node] = 0
            continue
        if node in takes:  # depends on its input only: its index is a constant
            depth[node] = max(depth[i] for i in take_inputs(node, takes[node])) + 1
            mesh_nodes.append(node)
            continue
        d = max((depth[i] for i in node.all_input_nodes), default=0)
        if node.target in STEP_OPS or is_control_flow(node) or node.op == "get_attr":
            depth[node] = d + 1
            mesh_nodes.append(node)
        elif _is_contraction(node):
            depth[node] = d
            contractions.append(node)
        elif node.target is operator.getitem and node.args[0] in buckets:
            depth[node] = d
            mesh_nodes.append(node)
        else:
            depth[node] = d
            by_depth.setdefault(d, []).append(node)
    chunks = {
        d: chunks_at_contractions(nodes, [c for c in contractions if depth[c] == d])
        for d, nodes in by_depth.items()
    }
    seg_of = {n: (d, k) for d, cs in chunks.items() for k, (ns, _) in enumerate(cs) for n in ns}
    users_at: dict[fx.Node, set[Any]] = {}  # where each value is read: segment or -1 (outside)
    for node in graph.nodes:
        if node in skipped:
            continue
        where = seg_of.get(node, -1)
        for i in take_inputs(node, takes[node]) if node in takes else node.all_input_nodes:
            users_at.setdefault(i, set()).add(where)
    steps: list[Segment | fx.Node] = []
    last = max([*by_depth, *(depth[m] for m in (*mesh_nodes, *contractions))], default=0)
    for d in range(last + 1):
        steps += [m for m in mesh_nodes if depth[m] == d]
        done: set[fx.Node] = set()
        for k, (nodes, ready) in enumerate(chunks.get(d, [])):
            if nodes:
                steps.append(_build_segment(gm, nodes, (d, k), users_at))
            steps += ready
            done.update(ready)
        steps += [c for c in contractions if depth[c] == d and c not in done]
    frees = last_uses(placeholders, steps, takes, output)
    return SegmentPlan(placeholders, steps, output, takes, frees)


#: Mesh ops that can take a sum already made over their whole group (``LocalMesh._contract``).
SUMMING_OPS = frozenset(
    (
        torch.ops.partita.reduce_scatter.default,
        torch.ops.partita.reduce_scatter_bucket.default,
        torch.ops.partita.all_reduce.default,
        torch.ops.partita.all_reduce_bucket.default,
    )
)


def _is_contraction(node: fx.Node) -> bool:
    """An ``mm`` (or ``addmm`` with its defaults) read only by a sum or avg reduction (a
    weight gradient under data parallelism, a row-parallel matmul): it runs outside its
    segment, where the per-device products and their sum are one matmul over the joined
    slices (``runtime.contraction``)."""
    if len(node.users) != 1:
        return False
    if node.target is aten.addmm.default:
        if node.kwargs or len(node.args) != 3 or not isinstance(node.args[0], fx.Node):
            return False
    elif node.target is not aten.mm.default:
        return False
    (user,) = node.users
    if user.target not in SUMMING_OPS:
        return False
    op = user.kwargs.get("reduce_op", next((a for a in user.args if isinstance(a, str)), None))
    return op in ("sum", "avg")


def _vmap_ready(new: fx.Node) -> None:
    if new.target in _TO_RESHAPE:
        new.target = aten.reshape.default
    if new.kwargs.get("memory_format") in _RANK_BOUND_FORMATS:
        # vmap adds the device dim, so channels_last would see rank 5; a functional program
        # cannot observe memory format, so the copy keeps its input's.
        new.kwargs = {**new.kwargs, "memory_format": torch.preserve_format}


def _build_segment(
    gm: fx.GraphModule,
    nodes: list[fx.Node],
    seg: tuple[int, int],
    users_at: dict[fx.Node, set[Any]],
) -> Segment:
    graph, inputs, env = copy_nodes(nodes, _vmap_ready)
    outputs = [n for n in nodes if users_at.get(n, set()) - {seg}]
    graph.output(tuple(env[n] for n in outputs))
    name = f"Segment{seg[0]}" + (f"_{seg[1]}" if seg[1] > 1 else "")
    seg_gm = fx.GraphModule(gm, graph, class_name=name)
    return Segment(gm=seg_gm, inputs=inputs, outputs=outputs, nodes=nodes)


def segment_error(segment: Segment, e: Exception) -> CompilerError:
    """Name the local op that failed (from the traceback's generated-code line) with the
    global op and the user's source line it was lowered from."""
    by_name = {n.name: n for n in segment.gm.graph.nodes}
    failed = None
    for frame in traceback.extract_tb(e.__traceback__):
        if frame.filename.startswith("<eval_with_key>") and frame.line and " = " in frame.line:
            failed = by_name.get(frame.line.split(" = ", 1)[0].strip(), failed)
    if failed is not None:
        where = (
            f"local op {failed.target} (%{failed.name}), lowered from "
            f"{node_meta.origin(failed) or 'an unknown op'} at "
            f"{node_meta.source(failed) or 'source line unknown'}"
        )
    else:
        ops = sorted({str(node_meta.origin(n) or n.target) for n in segment.nodes})
        where = f"one of the local ops {ops}"
    first = (str(e).strip().splitlines() or [""])[0]
    return CompilerError(
        f"The per-device program failed at {where}: {type(e).__name__}: {first}. The "
        f"partitioner produced a local call that does not fit its local shapes: a bug in "
        f"partita; {CompilerError.WORKAROUND}"
    )


def _check_not_random(node: fx.Node) -> None:
    tags = getattr(node.target, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags:
        raise UnsupportedOpError(
            f"LocalMesh cannot run the random op {node.target} (node {node.name!r}) yet: each "
            f"simulated device would need its own random stream. Remove the randomness from "
            f"the program (dropout p=0, random tensors passed in as inputs)."
        )
