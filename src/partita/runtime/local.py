"""LocalMesh: run a per-device program for every device of a mesh inside one process.

Every value is held *stacked*: ``[mesh.size, *local_shape]``, the shard of mesh position ``p``
at ``stacked[p]`` (see :mod:`partita.values.layout`). Local ops run once over the whole stack,
never in a Python loop over devices; mesh ops (``partita.ir.collectives``) run as tensor ops on
the stack through ``partita.runtime.stacked.STACKED_IMPLS``. A fused bucket (``partita.ir.buckets``)
runs member by member, exactly as its members would; the overlap schedule of real processes
does not apply here (nothing to overlap in one process).

How. The graph is cut, once per graph module, into *segments*: maximal sets of local ops that
need no mesh op between them (a node's segment is the number of mesh ops on its longest path
from the inputs). Each segment becomes its own ``GraphModule`` and runs as one
``torch.vmap(segment)`` call, so a data-parallel training step is two vmap calls and one mesh op
per gradient. Once a segment's eager runs with the same input shapes and strides have cost
as much as tracing it would (``runtime.flat_trace``), its vmap is traced (``make_fx``, fake
tensors) to a flat graph of batched aten ops (``mm`` on ``[n * b, k]``, ``bmm``, ...) that runs
from then on without functorch's per-op overhead; a segment whose batching rules cannot be
traced stays with vmap. Each step drops the values nothing reads after it.
``view``/``_unsafe_view`` become ``reshape`` in both (vmap may move the device dim, after
which a view can fail). Under the ``inductor`` option each segment is compiled by Inductor
instead, on its first run (``runtime.compiled``). Once every segment runs flat, the whole step
(segments and the steps between them) is traced to one graph per input signature and runs as
one call (``runtime.fused_step``), except under Inductor, under the profiler and with control
flow.

Values vary along some mesh axes. A value identical along a mesh axis is held once per
position of the *other* axes: ``(value, axes)`` with ``axes`` one flag per mesh dim and
``value`` of shape ``[*(mesh.shape[i] for the axes it varies along), *local]``. A segment runs
as nested vmaps, one per mesh axis some input varies along (``runtime.segments``), each input
entering with ``in_dims=None`` for the axes it does not vary along; so the work on a value
replicated over ``model`` (activations after a row-parallel all_reduce, under 2-D tensor
parallelism) runs once per ``data`` row, and on a value identical on every device (an
optimizer update of replicated parameters, a constant) once, not ``mesh.size`` times. A
value's axes come from: a ShardedTensor input's sharding (its replicated axes; replica 0 is
read, as ``full()`` does) or a plain input's (``layout.shard_compact``: only the distinct
tiles are cut); a stacked input whose device dim has stride 0 (``t.expand(n, *t.shape)``);
ops (an op's result varies along an axis when one of its inputs does, so ops with no tensor
inputs vary along none); and mesh ops (an all_reduce or all_gather result varies along its
input's axes less the group's; the others along their input's and the group's axes). An
all_reduce, all_gather or reduce_scatter runs on the value as held (``runtime.held``: a sum,
flatten or split of its leading dims, no per-device work); the other mesh ops read values
spread to ``[n, *local]``. A value is spread so only there and as a graph
output of ``run``: a stride-0 ``expand`` view for a value identical everywhere (read-only in
spirit; clone it before writing), a copy for one that varies along some axes only.
``run_compiled`` (``partita.jit``) hands such an output out held instead
(``ShardedTensor.from_held``: copied to ``[n, *local]`` only if read so), and reads a held
input as it is; a plain input is cut as a view of the caller's tensor, not a copy. Matmuls whose
operands vary along different axes are folded into one ``mm`` in the traced flat graph
(``runtime.flat_matmul``) instead of a ``bmm`` over broadcast copies. A matmul read only by a
sum over mesh axes runs as one matmul over the joined slices of its contraction dim
(``runtime.contraction``), and an ``index_select`` at a per-device constant index (a slice
at a device-dependent offset) as a step outside vmap: a view where it can be, else one copy
of the output (``runtime.device_index``); one that selects from collective_permuted pieces
reads the rows where they were sent from, and the permutes do not run
(``runtime.device_route``). Attention over devices holding heads side by side folds them
into the heads dim (``capture.ops``), so its inputs and result are not copied.

What this module does not do: random ops (an ``UnsupportedOpError`` names the op), graphs
edited after their first ``run`` (the cached plan is keyed by the graph module), a graph output
that is a tuple-valued node rather than its ``getitem`` elements, and any real device or
process group (that is ``runtime/distributed.py``).
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor, fx
from torch.utils import _pytree as pytree

from partita.errors import ArgumentError, ArgumentTypeError, PartitaError
from partita.options import CompileOptions, current
from partita.propagate.bodies import is_control_flow
from partita.runtime import ranges
from partita.runtime.compiled import stats_for
from partita.runtime.control_flow import run_control_flow
from partita.runtime.device_index import run_take, take_inputs
from partita.runtime.fused_step import FusedStep, Held
from partita.runtime.mesh_steps import run_contraction, run_mesh_op
from partita.runtime.segments import Axes, Segment, SegmentPlan, plan_segments, segment_error
from partita.values.held import stack_held
from partita.values.layout import check_strided, shard_compact, shard_tensor
from partita.values.mesh import Mesh
from partita.values.tensor import ShardedTensor

__all__ = ["LocalMesh"]

aten = torch.ops.aten


class LocalMesh:
    """A simulated mesh: every device's program runs in this process on stacked values.

    Args:
        mesh: the mesh whose devices are simulated; values are ``[mesh.size, *local]``.

    Example:
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> mesh = Mesh.create((4,), ("x",))
        >>> gm = make_fx(lambda a, b: torch.mm(a, b).relu())(torch.ones(2, 3), torch.ones(3, 5))
        >>> (out,) = LocalMesh(mesh).run(gm, [torch.ones(4, 2, 3), torch.ones(4, 3, 5)])
        >>> out.shape
        torch.Size([4, 2, 5])
    """

    def __init__(self, mesh: Mesh) -> None:
        if not isinstance(mesh, Mesh):
            raise ArgumentTypeError(
                f"LocalMesh(mesh) needs a partita Mesh, got {type(mesh).__name__}."
            )
        self.mesh = mesh
        self._plans: weakref.WeakKeyDictionary[fx.GraphModule, SegmentPlan] = (
            weakref.WeakKeyDictionary()
        )
        self._fused: weakref.WeakKeyDictionary[fx.GraphModule, FusedStep | None] = (
            weakref.WeakKeyDictionary()
        )
        #: per compiled program, per output: the (sharding, global shape, value shape, axes)
        #: its last value was checked with (``run_compiled``)
        self._checked: weakref.WeakKeyDictionary[fx.GraphModule, list[Any]] = (
            weakref.WeakKeyDictionary()
        )

    def __repr__(self) -> str:
        return f"LocalMesh({self.mesh!r})"

    def run_compiled(self, compiled: Any, leaves: Sequence[Any]) -> list[ShardedTensor]:
        """Run a compiled signature (``runtime.executor.CompiledProgram``) on global arguments.

        ``leaves`` are ShardedTensors or plain tensors holding the whole value; each is cut
        into its devices' tiles as ``compiled.input_shardings`` says. Returns one
        ShardedTensor per output. An output that varies along some mesh axes only stays held
        once per position of those (``ShardedTensor.from_held``); such an input is read as held.
        """
        values = []
        borrowed: set[int] = set()  # storages of plain inputs read in place, not copied
        for leaf, sharding in zip(leaves, compiled.input_shardings, strict=True):
            if isinstance(leaf, ShardedTensor):
                if leaf.sharding is not sharding and leaf.sharding != sharding:
                    # only if a plain spec and an annotation disagree
                    leaf = ShardedTensor.from_global(leaf.full(), sharding)
                # Rows along a replicated axis hold the same tile (what ``full`` reads back
                # from replica 0), so only replica 0 of each is read.
                held = leaf.held
                values.append(held or self._compact(leaf.stacked, sharding.replicated_axes))
            elif not sharding.partial:
                # Only the distinct tiles: the work on a value replicated along an axis (a
                # data-parallel optimizer update) runs once per tile, not once per device.
                # Read in place (no op writes an input); an output sharing its storage is
                # copied below, so no result aliases the caller's tensor.
                values.append(self._axes_value(shard_compact(leaf, sharding, copy=False)))
                borrowed.add(leaf.untyped_storage().data_ptr())
            else:
                values.append(self._compact(shard_tensor(leaf, sharding)))
        # inductor is the program's; trace_flat_at (not keyed) is read as it runs
        trace_at = current().trace_flat_at
        outs = self._execute(compiled.local, values, compiled.options.inductor, trace_at, held=True)
        checked = self._checked.get(compiled.local)
        if checked is None or len(checked) != len(outs):
            checked = self._checked[compiled.local] = [None] * len(outs)
        results = []
        for i, ((value, axes), s, shape) in enumerate(
            zip(outs, compiled.output_shardings, compiled.output_shapes, strict=True)
        ):
            if borrowed and value.numel() and value.untyped_storage().data_ptr() in borrowed:
                value = value.clone()
            # from_held checks the value's shape against the sharding; an output whose value
            # shape and axes are those it had last time for the same sharding and global
            # shape (the steady loop) passed that check: wrapped as from_held would wrap it.
            last = checked[i]
            if last is not None and last[0] is s and last[1] is shape and last[3] == axes:
                if value.shape == last[2]:
                    results.append(ShardedTensor(None, s, shape, held=(value, last[3])))
                    continue
            out = ShardedTensor.from_held(value, axes, s, shape)
            checked[i] = (s, shape, value.shape, out.held[1])  # type: ignore[index]
            results.append(out)
        return results

    def run(
        self,
        gm: fx.GraphModule,
        stacked_inputs: Sequence[Any],
        options: CompileOptions | None = None,
    ) -> list[Any]:
        """Run the per-device program ``gm`` on every device at once.

        ``stacked_inputs`` has one entry per placeholder: a tensor ``[mesh.size, *local]`` (a
        stride-0 device dim marks a value identical on every device) or a non-tensor passed
        through. Returns the flattened graph outputs, tensors stacked ``[mesh.size, *local]``.
        ``options`` (None: the current ones): ``inductor`` runs each segment compiled by
        Inductor (``runtime.compiled``; the cost is recorded in
        ``runtime.compiled.stats_for(gm)``), ``trace_flat_at`` (``runtime.flat_trace``).
        """
        plan = self._plan(gm)
        if len(stacked_inputs) != len(plan.placeholders):
            raise ArgumentError(
                f"LocalMesh.run: the graph has {len(plan.placeholders)} inputs "
                f"({', '.join(n.name for n in plan.placeholders)}), got {len(stacked_inputs)}."
            )
        values = [
            self._read_input(node, x)
            for node, x in zip(plan.placeholders, stacked_inputs, strict=True)
        ]
        opts = options or current()
        return self._execute(gm, values, opts.inductor, opts.trace_flat_at)

    def _plan(self, gm: fx.GraphModule) -> SegmentPlan:
        plan = self._plans.get(gm)
        if plan is None:
            plan = self._plans[gm] = plan_segments(gm, self.mesh)
        return plan

    def _execute(
        self,
        gm: fx.GraphModule,
        values: list[Held],
        inductor: bool,
        trace_at: int | None,
        held: bool = False,
    ) -> list[Any]:
        """The graph's flattened outputs, stacked; with ``held``, as ``(value, axes)``.
        ``trace_at``: the ``trace_flat_at`` option (``runtime.flat_trace``). Once its
        segments run flat, the whole step runs as one traced graph (``runtime.fused_step``),
        except under Inductor and under the profiler (whose ranges need the steps)."""
        fused = None if inductor or ranges.enabled() else self._fused_step(gm)
        if fused is None:
            outs = self._interpret(gm, values, inductor, trace_at)
        else:
            steps = self._plan(gm).steps
            outs = fused.run(
                values,
                lambda v: self._interpret(gm, v, False, trace_at),
                lambda: all(s.ran_flat for s in steps if isinstance(s, Segment)),
                trace_at,
            )
        if held:
            return outs
        return [self._stacked(v, axes) for v, axes in outs]

    def _fused_step(self, gm: fx.GraphModule) -> FusedStep | None:
        """The program's fused steps; None for a program with control flow (its loops read
        their predicates' values)."""
        if gm in self._fused:
            return self._fused[gm]
        steps = self._plan(gm).steps
        flow = any(not isinstance(s, Segment) and is_control_flow(s) for s in steps)
        fused = self._fused[gm] = None if flow else FusedStep(len(gm.graph.nodes))
        return fused

    def _interpret(
        self,
        gm: fx.GraphModule,
        values: list[Held],
        inductor: bool,
        trace_at: int | None,
    ) -> list[Held]:
        """The graph's flattened outputs as ``(value, axes)``, one step after the other."""
        plan = self._plan(gm)
        ndim = self.mesh.ndim
        stats = stats_for(gm) if inductor else None
        env: dict[fx.Node, Any] = dict(zip(plan.placeholders, values, strict=True))
        # under a profiler: named ranges (runtime.ranges); off it, this one check per step
        whole = span = None
        if ranges.enabled():
            names, whole = ranges.step_names(gm, plan.steps), ranges.Range(ranges.step_name(self))
        try:
            for k, (step, frees) in enumerate(zip(plan.steps, plan.frees, strict=True)):
                if whole is not None:
                    span = ranges.Range(*ranges.name_of(step, k, names))
                if isinstance(step, Segment):
                    try:
                        outs = step.run([env[i] for i in step.inputs], ndim, stats, trace_at)
                    except PartitaError:
                        raise
                    except Exception as e:
                        raise segment_error(step, e) from e
                    env.update(zip(step.outputs, outs, strict=True))
                elif step.target is operator.getitem:  # one member of a bucket's results
                    bucket, member = cast(fx.Node, step.args[0]), cast(int, step.args[1])
                    env[step] = env[bucket][member]
                elif step in plan.takes:  # a selection at a per-device index
                    take = plan.takes[step]
                    env[step] = run_take(take, [env[i] for i in take_inputs(step, take)], self.mesh)
                elif step.op == "get_attr":  # a control-flow body: run_control_flow reads it
                    env[step] = None
                elif is_control_flow(step):  # a loop or a branch (runtime.control_flow)
                    run = lambda g, v: self._execute(g, v, inductor, trace_at, held=True)  # noqa: E731
                    env[step] = run_control_flow(gm, step, env, run, self.mesh.shape)
                elif step.target in (aten.mm.default, aten.addmm.default):  # a contraction
                    env[step] = self._contract(step, env)
                else:
                    env[step] = run_mesh_op(self.mesh, step, env, self._compact, self._stacked)
                if span is not None:
                    span.close()
                    span = None
                for node in frees:  # nothing reads it later: its memory can go now
                    del env[node]
        finally:
            ranges.close(span, whole)
        leaves, _ = pytree.tree_flatten(plan.output)
        return [env[x] if isinstance(x, fx.Node) else (x, ()) for x in leaves]

    def _contract(self, node: fx.Node, env: dict[fx.Node, Any]) -> tuple[Tensor, Any]:
        """A contraction step (``runtime.mesh_steps.run_contraction``)."""
        return run_contraction(self.mesh, node, env)

    def _read_input(self, node: fx.Node, x: Any) -> tuple[Any, Axes]:
        n = self.mesh.size
        if not isinstance(x, Tensor):
            return x, (False,) * self.mesh.ndim
        check_strided(x, f"LocalMesh.run: input {node.name!r}")
        if x.dim() == 0 or x.shape[0] != n:
            raise ArgumentError(
                f"LocalMesh.run: input {node.name!r} has shape {tuple(x.shape)}, but stacked "
                f"values have a leading device dim of size {n} for {self.mesh!r}. Pass "
                f"[{n}, *local_shape] (ShardedTensor.stacked), or t.expand({n}, *t.shape) for a "
                f"value identical on every device."
            )
        return self._compact(x)

    def _compact(self, x: Tensor, same_along: Sequence[str] = ()) -> tuple[Tensor, Axes]:
        """A stacked ``[n, *local]`` tensor as ``(value, axes)``: the mesh axes it varies
        along kept as leading dims, the others (size 1, stride 0, or in ``same_along``) read
        at index 0 (a view)."""
        mesh = self.mesh
        if x.stride(0) == 0:
            return x.select(0, 0), (False,) * mesh.ndim
        y = x.view(mesh.shape + x.shape[1:])
        strides = y.stride()
        same = {mesh.axis_index(a) for a in same_along} if same_along else ()
        axes = tuple(
            size > 1 and strides[i] != 0 and i not in same for i, size in enumerate(mesh.shape)
        )
        return _select_first(y, axes), axes

    def _axes_value(self, y: Tensor) -> tuple[Tensor, Axes]:
        """``[*k, *local]`` with ``k[i]`` 1 or ``mesh.shape[i]`` as ``(value, axes)``."""
        axes = tuple(k > 1 for k in y.shape[: self.mesh.ndim])
        return _select_first(y, axes), axes

    def _stacked(self, value: Any, axes: Axes) -> Any:
        """A ``(value, axes)`` as the stacked ``[n, *local]``: a view when it varies along
        every axis or none (stride 0), a copy otherwise."""
        if not isinstance(value, Tensor):
            return value
        return stack_held(value, axes, self.mesh.shape)


def _select_first(y: Tensor, axes: Axes) -> Tensor:
    """``y`` read at index 0 of each leading dim whose ``axes`` flag is off (a view)."""
    for i in range(len(axes) - 1, -1, -1):
        if not axes[i]:
            y = y.select(i, 0)
    return y
