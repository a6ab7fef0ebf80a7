"""The one compile pipeline: a function and its inputs' specs -> a :class:`Compiled` program.

:func:`compile_function` runs the three stages in order (the first two are
:func:`propagated_program`), ``capture.trace`` (the program, its
inputs annotated), ``propagate`` (a sharding on every value) and ``partition`` (the per-device
program and its :class:`~partita.partition.Plan`), with one
:class:`~partita.options.CompileOptions` value for all of them. It is the only place in
``src/`` that chains them: ``partita.jit`` (and so ``train_step``), the virtual device's steps
(``virtual.program``) and ``partita.reshard`` (``relayout``) each call it for one input
signature, and keep only what is their own (turning a call's arguments into leaves and specs,
caching, running, recording).

Specs are given *flat*, one ``PartitionSpec`` (or None: propagation chooses) per leaf of
``(args, kwargs)``: a front end broadcasts the user's spec tree once, as ``jax.shard_map``
does, and this module never sees a tree of specs.

Example:
    >>> mesh = Mesh.create((2,), ("x",))
    >>> compiled = compile_function(torch.sin, (torch.ones(4),), {}, mesh=mesh,
    ...                             specs=[P("x")], options=CompileOptions())
    >>> compiled.output_shardings[0].spec, compiled.plan.counts()
    (P('x'), {})
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from partita import capture
from partita.capture.gc_pause import gc_paused
from partita.capture.kv_cache import flatten_registering_caches
from partita.capture.spec_tree import unflatten_args
from partita.options import CompileOptions
from partita.partition import Plan, partition
from partita.propagate import propagate
from partita.report.explain import format_program
from partita.runtime.executor import storage_of
from partita.values.mesh import Mesh
from partita.values.spec import PartitionSpec, Sharding
from partita.values.tensor import ShardedTensor

__all__ = ["Compiled", "compile_auto", "compile_function", "propagated_program"]


@dataclass
class Compiled:
    """One compiled input signature: the global program, the per-device program, the Plan,
    and the options it was compiled with (the executors read ``options.inductor`` and
    ``options.overlap_bytes`` from here)."""

    program: capture.Program
    local: fx.GraphModule
    plan: Plan
    input_shardings: list[Sharding]
    output_shardings: list[Sharding]
    output_shapes: list[tuple[int, ...]]
    options: CompileOptions
    #: Wall seconds spent tracing, propagating and partitioning this signature.
    partition_seconds: float = 0.0


def compile_function(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    mesh: Mesh,
    specs: Sequence[PartitionSpec | None],
    out_specs: Any = None,
    options: CompileOptions,
    rewrite: Callable[[fx.GraphModule], Any] | None = None,
) -> Compiled:
    """Trace ``fn(*args, **kwargs)``, propagate and partition it for ``mesh``.

    Args:
        fn: a function of pytrees of tensors (non-tensor leaves are static).
        args, kwargs: its inputs; a ShardedTensor stands for its global value (only shapes
            and dtypes are read: nothing runs).
        mesh: the mesh.
        specs: one spec per leaf of ``(args, kwargs)`` (None on a non-tensor leaf, or to let
            propagation choose), in ``pytree`` order.
        out_specs: a prefix of the result pytree with specs (None: propagation chooses).
        options: every knob of the stages (``strict``, ``replicate_unsupported``,
            ``collectives``, ``regather``, ``bucket_bytes``) and of the run, kept in the result.
        rewrite: called on the propagated program before it is partitioned (auto-sharding
            writes its solution there: ``partita.auto.realize``).
    """
    start = time.perf_counter()
    # The three stages build graphs that all live on: no cyclic GC in between (gc_pause).
    with gc_paused():
        prog = propagated_program(
            fn, args, kwargs, mesh=mesh, specs=specs, out_specs=out_specs,
            replicate_unsupported=options.replicate_unsupported,
        )  # fmt: skip
        gm = prog.graph_module
        if rewrite is not None:
            rewrite(gm)
        local, plan = partition(gm, mesh, options)
        plan.program_text = format_program(gm)
    (out_node,) = [n for n in gm.graph.nodes if n.op == "output"]
    shapes = [tuple(n.meta["val"].shape) for n in pytree.tree_leaves(out_node.args[0])]
    # An output sharding equal to an input's is that very object: a loop feeding the outputs
    # back (a training step's state) then finds its inputs' shardings by identity.
    same = {s: s for s in plan.input_shardings}
    return Compiled(
        program=prog,
        local=local,
        plan=plan,
        input_shardings=list(plan.input_shardings),
        output_shardings=[same.get(s, s) for s in plan.output_shardings],
        output_shapes=shapes,
        options=options,
        partition_seconds=time.perf_counter() - start,
    )


def _example(x: ShardedTensor) -> torch.Tensor:
    """A tensor of ``x``'s global shape and dtype on the device of its storage (a ShardedTensor
    of meta storage, from a module built on the meta device, traces on meta)."""
    return torch.empty(x.shape, dtype=x.dtype, device=storage_of(x).device)


def propagated_program(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    mesh: Mesh | None,
    specs: Sequence[PartitionSpec | None] | None = None,
    in_specs: Any = None,
    out_specs: Any = None,
    replicate_unsupported: bool = False,
    run: bool = True,
) -> capture.Program:
    """The first two stages: ``fn`` traced, then propagated (every node carries
    ``meta["sharding"]``). Input specs are ``specs``, one per leaf, or ``in_specs``, a prefix
    of ``args`` (for ``partita.frontend.annotate.propagate_program``, which stops here).
    ``run=False`` stops after tracing (auto-sharding reads the unpropagated program)."""
    leaves, tree = flatten_registering_caches((args, kwargs or {}))
    examples = [_example(x) if isinstance(x, ShardedTensor) else x for _, x in leaves]
    targs, tkwargs = unflatten_args(examples, tree)
    with gc_paused():
        prog = capture.trace(
            fn, tuple(targs), tkwargs, in_specs=in_specs, leaf_specs=specs,
            out_specs=out_specs, mesh=mesh,
        )  # fmt: skip
        if run:
            propagate(prog.graph_module, mesh, replicate_unsupported=replicate_unsupported)
    return prog


def compile_auto(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    mesh: Mesh,
    specs: Sequence[PartitionSpec | None],
    open_leaves: set[int],
    options: CompileOptions,
    presets: dict[str, list[PartitionSpec | None]],
    out_specs_of: Callable[[list[PartitionSpec | None]], Any] = lambda specs: None,
    names: dict[int, str] | None = None,
    groups: Sequence[Sequence[int]] = (),
    ties: Sequence[tuple[int, int]] = (),
) -> Compiled:
    """Auto-sharding (``partita.auto``, docs/auto.md): the solver chooses the specs of the
    ``open_leaves`` (the others are ``specs``, the user's), scored beside ``presets`` (full
    spec lists); every candidate compiles through :func:`compile_function`. The winner's
    Plan carries the report as ``plan.auto``."""
    from partita.auto import AutoProblem, choose

    prog = propagated_program(fn, args, kwargs, mesh=mesh, specs=list(specs), run=False)

    def build(
        leaf_specs: list[PartitionSpec | None],
        rewrite: Callable[[fx.GraphModule], Any] | None = None,
    ) -> Compiled:
        return compile_function(
            fn, args, kwargs, mesh=mesh, specs=leaf_specs, out_specs=out_specs_of(leaf_specs),
            options=options, rewrite=rewrite,
        )  # fmt: skip

    problem = AutoProblem(
        prog, mesh, list(specs), set(open_leaves), build, names=dict(names or {}),
        groups=groups, ties=ties, presets=presets, objective=options.auto_objective,
        time_limit=options.auto_time_limit, memory_limit=options.memory_limit,
        replicate_unsupported=options.replicate_unsupported, bucket_bytes=options.bucket_bytes,
    )  # fmt: skip
    compiled, _ = choose(problem)
    return cast(Compiled, compiled)
