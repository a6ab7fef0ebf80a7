"""LocalMesh: run a per-device program for every device of a mesh inside one process.

Every value is held *stacked*: ``[mesh.size, *local_shape]``, the shard of mesh position ``p``
at ``stacked[p]`` (see :mod:`partita.layout`). Local ops run once over the whole stack, never in
a Python loop over devices; mesh ops (``partita.collectives``) run as tensor ops on the stack
through ``partita.runtime.stacked.STACKED_IMPLS``. A fused bucket (``partita.collectives_bucket``)
runs member by member, exactly as its members would; the overlap schedule of real processes
does not apply here (nothing to overlap in one process).

How. The graph is cut, once per graph module, into *segments*: maximal sets of local ops that
need no mesh op between them (a node's segment is the number of mesh ops on its longest path
from the inputs). Each segment becomes its own ``GraphModule`` and runs as one
``torch.vmap(segment)`` call, so a data-parallel training step is two vmap calls and one mesh op
per gradient. The second time a segment runs with the same input shapes and strides, its vmap is
traced (``make_fx``, fake tensors) to a flat graph of batched aten ops (``mm`` on ``[n * b, k]``,
``bmm``, ...) that runs from then on without functorch's per-op overhead; a segment whose
batching rules cannot be traced stays with vmap. ``view``/``_unsafe_view`` become ``reshape``
in both (vmap may move the device dim, after which a view can fail).

Unbatched values. A value identical on every device is kept *unbatched* (its local shape, no
device dim) and enters vmap with ``in_dims=None``, so the work on it (an optimizer update of
replicated parameters, a constant) is done once, not ``mesh.size`` times. Unbatched values
come from: inputs whose device dim has stride 0 (``t.expand(n, *t.shape)``); ops with no
tensor inputs (``zeros``, ``arange``, constants); ops whose inputs are all unbatched; and
``all_reduce``/``all_gather`` over the whole mesh (and any mesh op result with a stride-0
device dim). They are broadcast only where they meet a mesh op, and an unbatched graph output
is returned as a stride-0 ``expand`` view (read-only in spirit; clone it before writing).

What this module does not do: random ops (an ``UnsupportedOpError`` names the op), graphs
edited after their first ``run`` (the cached plan is keyed by the graph module), a graph output
that is a tuple-valued node rather than its ``getitem`` elements, and any real device or
process group (that is ``runtime/distributed.py``).
"""

from __future__ import annotations

import operator
import traceback
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from partita.collectives import MESH_OPS
from partita.collectives_bucket import BUCKET_OPS
from partita.errors import CompilerError, PartitaError, UnsupportedOpError
from partita.layout import check_strided
from partita.mesh import Mesh

__all__ = ["LocalMesh"]

aten = torch.ops.aten

_TO_RESHAPE = {aten.view.default, aten._unsafe_view.default}
#: Memory formats that only exist for one rank (4 and 5): not for the stacked values.
_RANK_BOUND_FORMATS = (torch.channels_last, torch.channels_last_3d)
# Mesh ops whose result is the same on every member of the group: over the whole mesh it is
# the same on every device, so the result can stay unbatched.
_REPLICATING_OPS = {
    torch.ops.partita.all_reduce.default,
    torch.ops.partita.all_gather.default,
    torch.ops.partita.all_reduce_bucket.default,
    torch.ops.partita.all_gather_bucket.default,
}
# Steps run outside vmap: the mesh ops and the fused (bucketed) ones, whose results are lists
# that the bucket's getitem nodes take apart (also outside vmap).
_STEP_OPS = frozenset((*MESH_OPS, *BUCKET_OPS))

Pattern = tuple[bool, ...]  # batched or not, one flag per value


@dataclass
class _Segment:
    """Local ops that run as one vmap call: ``gm(*inputs) -> tuple(outputs)``."""

    gm: fx.GraphModule
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    nodes: list[fx.Node]
    vmapped: dict[Pattern, tuple[Callable[..., Any], Pattern]] = field(default_factory=dict)
    flat: dict[Hashable, Callable[..., Any] | None] = field(default_factory=dict)

    def run(self, values: list[tuple[Any, bool]]) -> list[tuple[Any, bool]]:
        """Outputs ``(value, batched)`` for inputs ``(value, batched)``."""
        args = [v for v, _ in values]
        fn, out_pattern = self._vmapped(tuple(b for _, b in values))
        if fn is not self.gm:
            # The second run with the same signature traces vmap(segment) to a flat graph of
            # batched aten ops, which then runs without functorch's per-op overhead.
            key = _signature(args, out_pattern)
            if key is not None:
                if key not in self.flat:
                    self.flat[key] = None  # seen once
                else:
                    if self.flat[key] is None:
                        self.flat[key] = _trace_flat(fn, args)
                    fn = self.flat[key]  # type: ignore[assignment]
        return list(zip(fn(*args), out_pattern, strict=True))

    def _vmapped(self, pattern: Pattern) -> tuple[Callable[..., Any], Pattern]:
        """The callable for inputs batched as ``pattern``, and which outputs are batched."""
        hit = self.vmapped.get(pattern)
        if hit is not None:
            return hit
        # Under vmap an op's result is batched exactly when one of its inputs is.
        batched = dict(zip(self.inputs, pattern, strict=True))
        for node in self.nodes:
            batched[node] = any(batched.get(n, False) for n in node.all_input_nodes)
        out_pattern = tuple(batched[n] for n in self.outputs)
        fn: Callable[..., Any] = self.gm
        if any(pattern):
            fn = torch.vmap(
                self.gm,
                in_dims=tuple(0 if b else None for b in pattern),
                out_dims=tuple(0 if b else None for b in out_pattern),
            )
        self.vmapped[pattern] = (fn, out_pattern)
        return fn, out_pattern


def _signature(args: list[Any], out_pattern: Pattern) -> Hashable | None:
    """What a traced flat graph depends on: every input's shape, strides, dtype and device."""
    if not all(isinstance(a, Tensor) for a in args):
        return None  # rare (non-tensor graph inputs): stay with vmap
    return out_pattern, tuple((a.shape, a.stride(), a.dtype, a.device) for a in args)


def _trace_flat(fn: Callable[..., Any], args: list[Any]) -> Callable[..., Any]:
    try:
        flat = make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*args)
    except Exception:  # a batching rule that make_fx cannot trace: vmap stays correct
        return fn
    for node in flat.graph.nodes:
        if node.target in _TO_RESHAPE:  # traced on fake strides; reshape is safe on any
            node.target = aten.reshape.default
    flat.recompile()
    return flat


@dataclass
class _Plan:
    """A graph cut into segments and mesh calls, in execution order."""

    placeholders: list[fx.Node]
    steps: list[_Segment | fx.Node]
    output: Any  # the output node's argument (a pytree of nodes and constants)


class LocalMesh:
    """A simulated mesh: every device's program runs in this process on stacked values.

    Args:
        mesh: the mesh whose devices are simulated; values are ``[mesh.size, *local]``.

    Example:
        >>> mesh = Mesh.create((4,), ("x",))
        >>> gm = make_fx(lambda a, b: torch.mm(a, b).relu())(torch.ones(2, 3), torch.ones(3, 5))
        >>> (out,) = LocalMesh(mesh).run(gm, [torch.ones(4, 2, 3), torch.ones(4, 3, 5)])
        >>> out.shape
        torch.Size([4, 2, 5])
    """

    def __init__(self, mesh: Mesh) -> None:
        if not isinstance(mesh, Mesh):
            raise TypeError(f"LocalMesh(mesh) needs a partita Mesh, got {type(mesh).__name__}.")
        self.mesh = mesh
        self._plans: weakref.WeakKeyDictionary[fx.GraphModule, _Plan] = weakref.WeakKeyDictionary()

    def __repr__(self) -> str:
        return f"LocalMesh({self.mesh!r})"

    def run(self, gm: fx.GraphModule, stacked_inputs: Sequence[Any]) -> list[Any]:
        """Run the per-device program ``gm`` on every device at once.

        ``stacked_inputs`` has one entry per placeholder: a tensor ``[mesh.size, *local]`` (a
        stride-0 device dim marks a value identical on every device) or a non-tensor passed
        through. Returns the flattened graph outputs, tensors stacked ``[mesh.size, *local]``.
        """
        plan = self._plans.get(gm)
        if plan is None:
            plan = self._plans[gm] = _make_plan(gm)
        if len(stacked_inputs) != len(plan.placeholders):
            raise ValueError(
                f"LocalMesh.run: the graph has {len(plan.placeholders)} inputs "
                f"({', '.join(n.name for n in plan.placeholders)}), got {len(stacked_inputs)}."
            )
        n = self.mesh.size
        env: dict[fx.Node, tuple[Any, bool]] = {}
        for node, x in zip(plan.placeholders, stacked_inputs, strict=True):
            env[node] = self._read_input(node, x)
        for step in plan.steps:
            if isinstance(step, _Segment):
                try:
                    outs = step.run([env[i] for i in step.inputs])
                except PartitaError:
                    raise
                except Exception as e:
                    raise _segment_error(step, e) from e
                env.update(zip(step.outputs, outs, strict=True))
            elif step.target is operator.getitem:  # one member of a bucket's results
                env[step] = env[step.args[0]][0][step.args[1]]
            else:
                env[step] = self._run_mesh_op(step, env)
        leaves, _ = pytree.tree_flatten(plan.output)
        results = []
        for leaf in leaves:
            if not isinstance(leaf, fx.Node):
                results.append(leaf)
                continue
            value, b = env[leaf]
            results.append(_broadcast(value, n) if isinstance(value, Tensor) and not b else value)
        return results

    def _read_input(self, node: fx.Node, x: Any) -> tuple[Any, bool]:
        n = self.mesh.size
        if not isinstance(x, Tensor):
            return x, False
        check_strided(x, f"LocalMesh.run: input {node.name!r}")
        if x.dim() == 0 or x.shape[0] != n:
            raise ValueError(
                f"LocalMesh.run: input {node.name!r} has shape {tuple(x.shape)}, but stacked "
                f"values have a leading device dim of size {n} for {self.mesh!r}. Pass "
                f"[{n}, *local_shape] (ShardedTensor.stacked), or t.expand({n}, *t.shape) for a "
                f"value identical on every device."
            )
        if n > 1 and x.stride(0) == 0:
            return x[0], False
        return x, True

    def _run_mesh_op(self, node: fx.Node, env: dict[fx.Node, tuple[Any, bool]]) -> tuple[Any, bool]:
        from partita.runtime.stacked import STACKED_BUCKET_IMPLS, STACKED_IMPLS  # lazily

        n = self.mesh.size

        def stacked(a: Any) -> Any:
            if not isinstance(a, fx.Node):
                return a
            value, b = env[a]
            return _broadcast(value, n) if isinstance(value, Tensor) and not b else value

        args, kwargs = pytree.tree_map(stacked, (node.args, node.kwargs))
        try:
            impl = STACKED_IMPLS.get(node.target) or STACKED_BUCKET_IMPLS[node.target]
            out = impl(self.mesh, *args, **kwargs)
        except Exception as e:
            raise RuntimeError(
                f"LocalMesh: mesh op {node.target} at node {node.name!r} failed on stacked "
                f"inputs of shapes {[tuple(a.shape) for a in args if isinstance(a, Tensor)]}: {e}"
            ) from e
        group_size = kwargs.get("group_size", args[-1]) if node.target in _REPLICATING_OPS else 0

        def unbatch(o: Tensor) -> tuple[Tensor, bool]:
            if n > 1 and (group_size == n or o.stride(0) == 0):
                return o[0], False
            return o, True

        if isinstance(out, list):  # a bucket: (value, batched) per member
            return [unbatch(o) for o in out], True
        return unbatch(out)


def _broadcast(value: Tensor, n: int) -> Tensor:
    """An unbatched value as a stacked one: a stride-0 view, no copy."""
    return value.expand(n, *value.shape)


def _make_plan(gm: fx.GraphModule) -> _Plan:
    """Cut ``gm`` into segments of local ops separated by mesh ops (see the module doc)."""
    graph = gm.graph
    depth: dict[fx.Node, int] = {}
    placeholders: list[fx.Node] = []
    mesh_nodes: list[fx.Node] = []
    buckets = {n for n in graph.nodes if n.op == "call_function" and n.target in BUCKET_OPS}
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
        d = max((depth[i] for i in node.all_input_nodes), default=0)
        if node.target in _STEP_OPS:
            depth[node] = d + 1
            mesh_nodes.append(node)
        elif node.target is operator.getitem and node.args[0] in buckets:
            depth[node] = d
            mesh_nodes.append(node)
        else:
            depth[node] = d
            by_depth.setdefault(d, []).append(node)
    local = {node for nodes in by_depth.values() for node in nodes}
    users_at: dict[fx.Node, set[int]] = {}  # where each value is read: segment or -1 (outside)
    for node in graph.nodes:
        where = depth[node] if node in local else -1
        for i in node.all_input_nodes:
            users_at.setdefault(i, set()).add(where)
    steps: list[_Segment | fx.Node] = []
    last = max([*by_depth, *(depth[m] for m in mesh_nodes)], default=0)
    for d in range(last + 1):
        steps += [m for m in mesh_nodes if depth[m] == d]
        if d in by_depth:
            steps.append(_build_segment(gm, by_depth[d], d, users_at))
    return _Plan(placeholders=placeholders, steps=steps, output=output)


def _build_segment(
    gm: fx.GraphModule, nodes: list[fx.Node], d: int, users_at: dict[fx.Node, set[int]]
) -> _Segment:
    inside = set(nodes)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[fx.Node] = []

    def arg(i: fx.Node) -> fx.Node:
        if i not in env:
            inputs.append(i)
            env[i] = graph.placeholder(f"in_{i.name}")
        return env[i]

    # Placeholders first: collect every outside input before copying nodes.
    for node in nodes:
        for i in node.all_input_nodes:
            if i not in inside:
                arg(i)
    for node in nodes:
        new = graph.node_copy(node, arg)
        if new.target in _TO_RESHAPE:
            new.target = aten.reshape.default
        if new.kwargs.get("memory_format") in _RANK_BOUND_FORMATS:
            # vmap adds the device dim, so channels_last would see rank 5; a functional program
            # cannot observe memory format, so the copy keeps its input's.
            new.kwargs = {**new.kwargs, "memory_format": torch.preserve_format}
        env[node] = new
    outputs = [n for n in nodes if users_at.get(n, set()) - {d}]
    graph.output(tuple(env[n] for n in outputs))
    seg_gm = fx.GraphModule(gm, graph, class_name=f"Segment{d}")
    return _Segment(gm=seg_gm, inputs=inputs, outputs=outputs, nodes=nodes)


def _segment_error(segment: _Segment, e: Exception) -> CompilerError:
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
            f"{failed.meta.get('origin', 'an unknown op')} at "
            f"{failed.meta.get('source') or 'source line unknown'}"
        )
    else:
        ops = sorted({str(n.meta.get("origin", n.target)) for n in segment.nodes})
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
