"""``partita.jit``: compile a function once per input signature, run it sharded.

``jit(fn, mesh=, in_specs=, out_specs=, strict=False)`` returns a :class:`Jitted` callable.
Calling it with ShardedTensors or plain tensors traces ``fn`` (``partita.capture``), propagates
shardings (``partita.propagate``), partitions (``partita.partition``) and runs the per-device
program on the simulated mesh (``partita.runtime.local``). ``.lower(*args)`` stops before running
and returns the :class:`~partita.partition.Plan`.

Input shardings: a ShardedTensor argument keeps its own sharding; a plain tensor is sharded as
``in_specs`` says, and is *replicated* when ``in_specs`` gives it no spec (so a plain tensor and a
replicated ShardedTensor are the same input signature and share one compiled program).

This module only ties the stages together; it holds no sharding logic.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from partita import capture
from partita.capture.trace import _broadcast_specs
from partita.explain import format_program
from partita.layout import shard_tensor
from partita.mesh import Mesh
from partita.partition import Plan, partition
from partita.propagate import propagate
from partita.runtime.distributed import distributed_executor
from partita.runtime.local import LocalMesh
from partita.spec import P, PartitionSpec, Sharding
from partita.tensor import ShardedTensor

__all__ = ["Compiled", "Jitted", "jit"]


@dataclass
class Compiled:
    """One compiled signature: the global program, the per-device program and the Plan."""

    program: capture.Program
    local: fx.GraphModule
    plan: Plan
    input_shardings: list[Sharding]
    output_shardings: list[Sharding]
    output_shapes: list[tuple[int, ...]]


class Jitted:
    """A function compiled for a mesh; see :func:`jit`."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        mesh: Mesh,
        in_specs: Any = None,
        out_specs: Any = None,
        strict: bool = False,
        replicate_unsupported: bool = False,
    ) -> None:
        if not isinstance(mesh, Mesh):
            raise TypeError(f"partita.jit needs mesh=Mesh(...), got {mesh!r}")
        self.fn = fn
        self.mesh = mesh
        self.in_specs = in_specs
        self.out_specs = out_specs
        self.strict = strict
        self.replicate_unsupported = replicate_unsupported
        self._cache: dict[Hashable, Compiled] = {}
        self._executor = LocalMesh(mesh)
        functools.update_wrapper(self, fn)

    # --- signatures ------------------------------------------------------------------------

    def _specs_and_key(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[list[Any], list[Any], Hashable]:
        leaves, tree = pytree.tree_flatten((args, kwargs))
        n_args = pytree.tree_structure(args).num_leaves
        name = getattr(self.fn, "__name__", "fn")
        user = [None] * len(leaves)
        if self.in_specs is not None:
            user[:n_args] = _broadcast_specs(self.in_specs, args, "in_specs", name)
        specs: list[PartitionSpec | None] = []
        key: list[Hashable] = [tree]
        for leaf, spec in zip(leaves, user, strict=True):
            if isinstance(leaf, ShardedTensor):
                if leaf.mesh != self.mesh:
                    raise ValueError(
                        f"{name}: an argument lives on {leaf.mesh!r}, but the function was "
                        f"compiled for {self.mesh!r}. Reshard it onto the jit's mesh first."
                    )
                sharding = leaf.sharding
            elif isinstance(leaf, torch.Tensor):
                sharding = (spec or P()).to_sharding(self.mesh, leaf.ndim)
            else:
                specs.append(None)
                key.append(("static", _hashable(leaf)))
                continue
            specs.append(sharding.spec)
            key.append((tuple(leaf.shape), leaf.dtype, sharding))
        return leaves, specs, tuple(key)

    def _compile(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Compiled, list[Any]]:
        leaves, specs, key = self._specs_and_key(args, kwargs)
        compiled = self._cache.get(key)
        if compiled is None:
            trace_leaves = [
                torch.empty(leaf.shape, dtype=leaf.dtype)
                if isinstance(leaf, ShardedTensor)
                else leaf
                for leaf in leaves
            ]
            targs, tkwargs = pytree.tree_unflatten(
                trace_leaves, pytree.tree_structure((args, kwargs))
            )
            n_args = pytree.tree_structure(args).num_leaves
            in_specs = pytree.tree_unflatten(specs[:n_args], pytree.tree_structure(args))
            prog = capture.trace(
                self.fn,
                tuple(targs),
                tkwargs,
                in_specs=tuple(in_specs),
                out_specs=self.out_specs,
                mesh=self.mesh,
            )
            # Keyword tensors carry no annotation: propagation chooses their sharding.
            propagate(
                prog.graph_module, self.mesh, replicate_unsupported=self.replicate_unsupported
            )
            local, plan = partition(prog.graph_module, self.mesh, strict=self.strict)
            plan.program_text = format_program(prog.graph_module)
            (out_node,) = [n for n in prog.graph_module.graph.nodes if n.op == "output"]
            shapes = [tuple(n.meta["val"].shape) for n in pytree.tree_leaves(out_node.args[0])]
            compiled = Compiled(
                prog, local, plan, plan.input_shardings, plan.output_shardings, shapes
            )
            self._cache[key] = compiled
        return compiled, leaves

    # --- public ----------------------------------------------------------------------------

    def lower(self, *args: Any, **kwargs: Any) -> Plan:
        """Compile for these arguments and return the Plan, without running anything."""
        return self._compile(args, kwargs)[0].plan

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        compiled, leaves = self._compile(args, kwargs)
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor | ShardedTensor)]
        distributed = distributed_executor(self.mesh)  # None unless torch.distributed is up
        if distributed is not None:
            return compiled.program.unflatten_outputs(distributed.run_compiled(compiled, tensors))
        stacked = []
        for leaf, sharding in zip(tensors, compiled.input_shardings, strict=True):
            if isinstance(leaf, ShardedTensor):
                if leaf.sharding != sharding:  # only if a plain spec and an annotation disagree
                    leaf = ShardedTensor.from_global(leaf.full(), sharding)
                stacked.append(leaf.stacked)
            elif sharding.is_replicated:
                # A stride-0 view: the executor keeps it unbatched, so work on replicated
                # values (a data-parallel optimizer update) runs once, not once per device.
                stacked.append(leaf.unsqueeze(0).expand(self.mesh.size, *leaf.shape))
            else:
                stacked.append(shard_tensor(leaf, sharding))
        outs = self._executor.run(compiled.local, stacked)
        results = [
            ShardedTensor.from_stacked(o, s, shape)
            for o, s, shape in zip(
                outs, compiled.output_shardings, compiled.output_shapes, strict=True
            )
        ]
        return compiled.program.unflatten_outputs(results)

    @property
    def cache_size(self) -> int:
        return len(self._cache)


def _hashable(x: Any) -> Hashable:
    try:
        hash(x)
    except TypeError:
        return repr(x)
    return x


def jit(
    fn: Callable[..., Any] | None = None,
    *,
    mesh: Mesh,
    in_specs: Any = None,
    out_specs: Any = None,
    strict: bool = False,
    replicate_unsupported: bool = False,
) -> Any:
    """Compile ``fn`` for ``mesh``: annotate a few inputs, get every collective it needs.

    Args:
        fn: a function of tensors (pytrees of them; other arguments are static).
        mesh: the device mesh.
        in_specs: a P (or None) per positional argument, or a matching pytree prefix. Plain
            tensors without a spec are replicated; ShardedTensors keep their sharding.
        out_specs: the same for the results (None lets propagation decide).
        strict: raise instead of warning on an involuntary full rematerialization.
        replicate_unsupported: run ops without a sharding rule on gathered inputs.

    Example:
        >>> mesh = Mesh.create((2, 4), ("data", "model"))
        >>> step = partita.jit(lambda x, w: x @ w, mesh=mesh,
        ...                    in_specs=(P("data", None), P(None, "model")))
        >>> out = step(torch.randn(8, 16), torch.randn(16, 32))   # a ShardedTensor
        >>> print(step.lower(torch.randn(8, 16), torch.randn(16, 32)).explain())
    """

    def wrap(f: Callable[..., Any]) -> Jitted:
        return Jitted(
            f,
            mesh=mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            strict=strict,
            replicate_unsupported=replicate_unsupported,
        )

    return wrap if fn is None else wrap(fn)
