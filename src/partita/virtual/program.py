"""One compiled step of the virtual device: compile a replay function, run it on the mesh.

:func:`compile_step` calls the compile pipeline
(:func:`partita.frontend.pipeline.compile_function`), as
``partita.jit`` does for one input signature: inputs annotated with their data's sharding,
plain tensors replicated, with the step's :class:`~partita.options.CompileOptions`.
:meth:`StepProgram.run` feeds the per-device program the inputs' stacked shards on the
LocalMesh (or this rank's shards under torch.distributed) and returns the results and the new
values of the inputs updated in place, as ShardedTensors. This module holds no sharding logic
and does not record ops.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from partita.capture.rng import random_ops
from partita.frontend.auto_inputs import dim0_spec as _dim0
from partita.frontend.pipeline import Compiled, compile_auto, compile_function
from partita.options import CompileOptions
from partita.runtime.executor import check_has_data, executor_for
from partita.values.mesh import Mesh
from partita.values.spec import P, PartitionSpec, Sharding
from partita.values.tensor import ShardedTensor

__all__ = ["StepProgram", "compile_step"]


@dataclass
class StepProgram:
    """A compiled step.

    Attributes:
        local: the per-device program.
        input_shardings / output_shardings / output_shapes: of its flattened inputs/outputs.
        constants: tensors the program uses that are not step inputs (fed last).
        mutated_inputs: inputs the step updates in place (their new values follow the results).
        n_results: how many outputs are results (the values of the live tensors).
        compiled: the jit form, for the distributed executor (None when read from disk).
        options: the options it was compiled with (the executors read ``inductor`` here;
            set again when read from disk, whose key holds them).
    """

    local: fx.GraphModule
    input_shardings: list[Sharding]
    output_shardings: list[Sharding]
    output_shapes: list[tuple[int, ...]]
    constants: tuple[torch.Tensor, ...]
    mutated_inputs: tuple[int, ...]
    n_results: int
    compiled: Compiled | None = None
    options: CompileOptions = field(default_factory=CompileOptions)

    @functools.cached_property
    def draws_random(self) -> bool:
        """Whether the program draws from the CPU generator (dropout, ``torch.rand``...)."""
        draws = {torch.ops.partita.global_random_draw.default, *random_ops()}
        return any(n.op == "call_function" and n.target in draws for n in self.local.graph.nodes)

    def run(
        self, mesh: Mesh, inputs: Sequence[Any]
    ) -> tuple[list[ShardedTensor], list[tuple[int, ShardedTensor]]]:
        """Run on ``inputs`` (ShardedTensors, plain tensors = replicated): the results, and
        ``(input index, new value)`` for each input the step updated in place (the caller
        rebinds its cell; nothing is copied, and under torch.distributed the new value is this
        process's shards)."""
        tensors = [*inputs, *self.constants]
        check_has_data(tensors, "the virtual device's step")
        executor = executor_for(mesh)
        # Under torch.distributed the executor checks that every process runs the same
        # program, which needs the jit form; steps read from disk are used only without a
        # process group.
        outs = executor.run_compiled(self if self.compiled is None else self.compiled, tensors)
        updates = list(zip(self.mutated_inputs, outs[self.n_results :], strict=True))
        return outs[: self.n_results], updates


def compile_step(
    replay: Callable[..., list[torch.Tensor]],
    inputs: Sequence[Any],
    mesh: Mesh,
    options: CompileOptions,
    open_inputs: set[int] | None = None,
) -> StepProgram:
    """Compile ``replay(*inputs)`` for ``mesh`` with ``options`` (the compile pipeline).

    ``open_inputs`` (``use_spmd(mesh, auto=True)``): the inputs whose sharding auto-sharding
    chooses (``pipeline.compile_auto``), scored beside keeping them replicated and splitting
    their dim 0 over the mesh; the others keep their data's sharding."""
    specs: list[PartitionSpec | None] = [
        x.spec if isinstance(x, ShardedTensor) else P() for x in inputs
    ]
    if open_inputs:
        replicated = list(specs)
        batch = [
            _dim0(mesh, x) if i in open_inputs else s
            for i, (x, s) in enumerate(zip(inputs, specs, strict=True))
        ]
        compiled = compile_auto(
            replay, tuple(inputs), {}, mesh=mesh,
            specs=[None if i in open_inputs else s for i, s in enumerate(specs)],
            open_leaves=set(open_inputs), options=options,
            presets={"replicated": replicated, "batch": batch},
            names={i: f"input {i}" for i in open_inputs},
        )  # fmt: skip
    else:
        compiled = compile_function(
            replay, tuple(inputs), {}, mesh=mesh, specs=specs, options=options
        )
    prog = compiled.program
    return StepProgram(
        local=compiled.local,
        input_shardings=list(compiled.input_shardings),
        output_shardings=list(compiled.output_shardings),
        output_shapes=compiled.output_shapes,
        constants=tuple(prog.constants),
        mutated_inputs=tuple(prog.mutated_inputs),
        n_results=prog.num_results,
        compiled=compiled,
        options=options,
    )
