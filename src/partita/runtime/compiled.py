"""Compiled per-device programs: the local-op regions of a per-device program run by Inductor.

Under the ``inductor`` option (``options={"inductor": True}``,
``partita.options.using(inductor=True)`` or ``PARTITA_INDUCTOR=1``) both
executors compile the *local* parts of the per-device program with Inductor
(``torch._inductor.compile``: C++/OpenMP kernels on CPU) and keep the mesh ops outside, as
graph breaks:

* the LocalMesh compiles each segment (``runtime.segments``) as it runs: the flat graph of
  batched aten ops its vmap traces to, or the segment itself when no input is batched;
* the DistributedMesh cuts its bound, overlap-scheduled rank program (:func:`compile_regions`)
  into *regions*: maximal runs of consecutive aten ops between mesh-op launches and waits, so
  the collectives stay where the overlap schedule put them, and compiles each region.

A region is compiled the first time it runs, for the shapes, strides and dtypes of its
arguments (:class:`CompiledRegion`; one compile per signature, kept for the program's
lifetime). Compile cost is recorded per per-device program in :class:`CompileStats`
(:func:`stats_for`), which ``Jitted.stats`` reports beside partita's own compile time. A region
Inductor cannot compile runs uncompiled (its reason is kept in ``CompileStats.skipped``); the
results are the uncompiled program's up to Inductor's fp32 reassociation (fused reductions sum
in another order: about 1e-6 relative).

This module does not decide where collectives go or run them; it only compiles local ops.
"""

from __future__ import annotations

import copy
import operator
import time
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, fx

from partita.runtime.subgraph import copy_nodes

__all__ = [
    "CompileStats",
    "CompiledRegion",
    "compile_graph",
    "compile_regions",
    "stats_for",
]

# Ops that only re-describe memory: a region of nothing else is not worth a C++ compile.
_VIEW_OPS = {
    torch.ops.aten.reshape.default,
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.expand.default,
    torch.ops.aten.permute.default,
    torch.ops.aten.t.default,
    torch.ops.aten.transpose.int,
    torch.ops.aten.squeeze.dim,
    torch.ops.aten.unsqueeze.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.select.int,
    torch.ops.aten.alias.default,
    torch.ops.aten.detach.default,
}


@dataclass
class CompileStats:
    """What compiling one per-device program with Inductor cost.

    ``regions``: graphs Inductor compiled; ``seconds``: wall seconds spent compiling them;
    ``skipped``: regions left uncompiled, each with why.
    """

    regions: int = 0
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)


_STATS: weakref.WeakKeyDictionary[fx.GraphModule, CompileStats] = weakref.WeakKeyDictionary()


def stats_for(gm: fx.GraphModule) -> CompileStats:
    """The (mutable) compile record of the per-device program ``gm``; empty until it runs."""
    stats = _STATS.get(gm)
    if stats is None:
        stats = _STATS[gm] = CompileStats()
    return stats


def signature(args: Sequence[Any]) -> Hashable | None:
    """What a compiled graph depends on: every input's shape, strides, dtype and device
    (None when an input is not a tensor: such a region stays uncompiled)."""
    if not all(isinstance(a, Tensor) for a in args):
        return None
    return tuple((a.shape, a.stride(), a.dtype, a.device) for a in args)


def compile_graph(
    gm: fx.GraphModule, args: Sequence[Any], stats: CompileStats, name: str
) -> Callable[..., Any]:
    """``gm`` compiled by Inductor for ``args``'s signature (``gm`` itself if it cannot be).

    ``gm`` holds aten ops and returns a tuple. Example:
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> gm = make_fx(lambda a: (a.sin() + 1,))(torch.ones(3))
        >>> fn = compile_graph(gm, [torch.ones(3)], CompileStats(), "example")  # doctest: +SKIP
    """
    if not any(
        n.op == "call_function" and n.target not in _VIEW_OPS and n.target is not operator.getitem
        for n in gm.graph.nodes
    ):
        return gm  # only views: nothing for a kernel to do
    start = time.perf_counter()
    # Inductor may rewrite the graph it is given; the uncompiled path keeps using ``gm``.
    fresh = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    try:
        fn = _inductor(fresh, args)
    except Exception as e:  # an op Inductor cannot lower: the uncompiled graph is still right
        first = (str(e).strip().splitlines() or [""])[0]
        stats.skipped.append(f"{name}: {type(e).__name__}: {first[:200]}")
        return gm
    stats.regions += 1
    stats.seconds += time.perf_counter() - start
    return _checked_first_call(fn, gm, stats, name)


def _checked_first_call(
    fn: Callable[..., Any], gm: fx.GraphModule, stats: CompileStats, name: str
) -> Callable[..., Any]:
    """``fn``, except that if its first call fails the region runs uncompiled from then on.

    Inductor checks each custom op's outputs against the strides its fake kernel promised;
    an op whose kernel and fake disagree fails there, not at compile time. The uncompiled
    graph then gives the right values (or raises the program's own error).
    """
    state: dict[str, Callable[..., Any]] = {}

    def call(*args: Any) -> Any:
        chosen = state.get("fn")
        if chosen is not None:
            return chosen(*args)
        try:
            out = fn(*args)
        except Exception as e:
            first = (str(e).strip().splitlines() or [""])[0]
            stats.skipped.append(f"{name}: first run failed: {type(e).__name__}: {first[:200]}")
            stats.regions -= 1
            state["fn"] = gm
            return gm(*args)
        state["fn"] = fn
        return out

    return call


def _inductor(gm: fx.GraphModule, args: Sequence[Tensor]) -> Callable[..., Any]:
    """Inductor's compile of ``gm`` for fake copies of ``args`` (static shapes and strides).

    The fake mode carries a ShapeEnv because Inductor's on-disk graph cache needs one (without
    it every process recompiles every region: seconds each instead of milliseconds).
    """
    from torch._inductor import compile as inductor_compile  # heavy: imported only when asked
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    fake = [mode.from_tensor(a, static_shapes=True) for a in args]
    return inductor_compile(gm, fake)


class CompiledRegion:
    """A graph of local ops compiled on its first call for each argument signature."""

    def __init__(self, gm: fx.GraphModule, stats: CompileStats, name: str) -> None:
        self.gm = gm
        self.stats = stats
        self.name = name
        self._by_signature: dict[Hashable, Callable[..., Any]] = {}

    def __call__(self, *args: Any) -> Any:
        key = signature(args)
        if key is None:
            return self.gm(*args)
        fn = self._by_signature.get(key)
        if fn is None:
            fn = self._by_signature[key] = compile_graph(self.gm, args, self.stats, self.name)
        return fn(*args)


def _is_local(node: fx.Node) -> bool:
    """An aten op Inductor may compile, or an element of one's tuple or list result (mesh ops,
    launches, waits and the elements of a bucket's results are not). Elements stay with their
    op: a list (``split``) cannot be a compiled region's output."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return isinstance(node.args[0], fx.Node) and _is_local(node.args[0])
    return isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "aten"


def compile_regions(gm: fx.GraphModule, stats: CompileStats) -> fx.GraphModule:
    """``gm`` with every maximal run of consecutive aten ops replaced by a
    :class:`CompiledRegion` call; the other nodes (mesh ops, launches and waits) keep their
    place, so a schedule that overlaps collectives with compute is kept.

    Example: ``a = mm(x, w); b = relu(a); g = all_reduce(b); c = add(g, 1)`` becomes
    ``(a, b) = region0(x, w); g = all_reduce(b); (c,) = region1(g)`` (only the values read
    after a region leave it).
    """
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    runs: list[list[fx.Node]] = []
    for node in nodes:
        if _is_local(node):
            if runs and runs[-1][-1].next is node and _is_local(runs[-1][-1]):
                runs[-1].append(node)
            else:
                runs.append([node])
    region_of = {n: i for i, run in enumerate(runs) for n in run}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    done: set[int] = set()
    for node in gm.graph.nodes:
        i = region_of.get(node)
        if i is None:
            env[node] = graph.node_copy(node, lambda a: env[a])
        elif i not in done:
            done.add(i)
            _emit_region(gm, runs[i], f"region{i}", graph, env, stats)
    return fx.GraphModule(gm, graph, class_name="CompiledRankProgram")


def _emit_region(
    gm: fx.GraphModule,
    run: list[fx.Node],
    name: str,
    graph: fx.Graph,
    env: dict[fx.Node, fx.Node],
    stats: CompileStats,
) -> None:
    """Build ``run`` as its own graph module, and call it from ``graph`` (filling ``env``)."""
    inside = set(run)
    sub, inputs, sub_env = copy_nodes(run)
    outputs = [n for n in run if any(u not in inside for u in n.users)]
    sub.output(tuple(sub_env[n] for n in outputs))
    region = CompiledRegion(fx.GraphModule(gm, sub, class_name=name), stats, name)

    def call(*args: Any) -> Any:
        return region(*args)

    call.__name__ = call.__qualname__ = name  # fx names the graph's node after it
    result = graph.call_function(call, tuple(env[a] for a in inputs))
    for k, node in enumerate(outputs):
        env[node] = graph.call_function(operator.getitem, (result, k))
