"""``partita.pipeline``: a stack of identical layers as one module whose layers are split over a
mesh axis and run as a pipeline of micro-batches.

:func:`pipeline` checks the layers, stacks each parameter of theirs into one ``[L, ...]``
parameter (in the schedule's storage order, so that the stage axis splitting dim 0 gives each
stage its own layers) and marks it ``P(stage_axis)``: ``partita.train_step`` and ``partita.jit``
of a module shard it so whatever preset the rest of the model gets. The returned
:class:`Pipeline` is an ``nn.Module``: put it where the layers were (``model.blocks =
partita.pipeline(model.blocks, ...)``) and call it on ``[batch, ...]`` activations.

Inside a traced program (``jit``, ``train_step``) a call splits the batch into micro-batches
and runs the region of :mod:`partita.pipeline.body`: the batch as ``[D, M, b, ...]`` (``D`` the
batch axes' size; within each of the ``D`` blocks of rows, micro-batch ``m`` is the ``m``-th run
of ``b`` rows), the batch axes splitting dim 0 and the stage axis the micro-batches, in and out.
So a batch split over the batch axes stays split without moving a row, and the output comes
back split over the batch axes and the stage axis on its rows (``P((*batch_axes, stage))``):
the code after the pipeline works on ``1 / S`` of the rows per stage. Outside
one (plain tensors) it runs the layers one after another on the whole batch, in the user's
order: the same function, unsharded, e.g. for evaluation.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from partita.capture.annotate import is_tracing
from partita.errors import PipelineError
from partita.manual.shard_map import shard_map
from partita.pipeline.body import stage_body
from partita.pipeline.schedule import SCHEDULES, Schedule
from partita.presets import PresetLike, param_specs
from partita.values.annotations import mark_parameter
from partita.values.mesh import Mesh
from partita.values.spec import P

__all__ = ["Pipeline", "pipeline"]


class Pipeline(nn.Module):
    """``L`` identical layers stacked and run as a pipeline over a mesh axis; see
    :func:`pipeline`.

    Attributes:
        stack: a copy of the first layer whose parameters are the stacked ``[L, ...]`` ones
            (position ``p`` holds the user's layer ``schedule.storage_order()[p]``).
        schedule: the :class:`~partita.pipeline.schedule.Schedule`.
        mesh, stage_axis, batch_axes, remat: as given to :func:`pipeline`.
    """

    def __init__(
        self,
        layers: nn.ModuleList | Sequence[nn.Module],
        *,
        mesh: Mesh,
        stage_axis: str,
        microbatches: int,
        schedule: str,
        rounds: int | None,
        remat: bool,
        batch_axes: Sequence[str] | None,
        layer_specs: PresetLike | None = None,
    ) -> None:
        super().__init__()
        layers = list(layers)
        names = _check_layers(list(layers))
        if stage_axis not in mesh.axis_names:
            raise PipelineError(
                f"partita.pipeline: stage_axis={stage_axis!r} is not an axis of {mesh!r}. Name "
                f"one of {list(mesh.axis_names)}, or build the mesh with a stage axis, e.g. "
                f"Mesh.create((4, 2), ('stage', 'data'))."
            )
        stages = mesh.shape[mesh.axis_names.index(stage_axis)]
        self.schedule = _schedule(len(layers), stages, microbatches, schedule, rounds)
        if microbatches % stages:
            raise PipelineError(
                f"partita.pipeline: microbatches={microbatches} is not a multiple of the "
                f"{stages} stages of {stage_axis!r}: the pipeline's input and output are split "
                f"over the stages by micro-batch (M / S each). Use a multiple of {stages}."
            )
        if batch_axes is None:
            batch_axes = ("data",) if "data" in mesh.axis_names and stage_axis != "data" else ()
        bad = [a for a in batch_axes if a not in mesh.axis_names or a == stage_axis]
        if bad:
            raise PipelineError(
                f"partita.pipeline: batch_axes={tuple(batch_axes)} names {bad}, which are not "
                f"axes of {mesh!r} other than the stage axis {stage_axis!r}. The batch axes "
                f"split each micro-batch's rows (data parallelism); name mesh axes for them."
            )
        self.mesh, self.stage_axis, self.remat = mesh, stage_axis, remat
        self.batch_axes = tuple(batch_axes)
        self.names = names
        order = self.schedule.storage_order()
        inner = self._layer_specs(layer_specs, layers[0])
        self.stack = copy.deepcopy(layers[0])
        for name in names:
            parts = [dict(layer.named_parameters())[name].detach() for layer in layers]
            stacked = nn.Parameter(torch.stack([parts[i] for i in order]).clone())
            _set_parameter(self.stack, name, stacked)
            entries = (*inner[name], *[None] * (stacked.ndim - 1 - len(inner[name])))
            mark_parameter(stacked, P(stage_axis, *entries).to_sharding(mesh, stacked.ndim))
        body = stage_body(self.schedule, self.stack, names, stage_axis, self.batch_axes, remat)
        # [batch blocks, M, rows, ...]: the batch axes split dim 0, the stage axis the
        # micro-batches (each stage holds M / S of them, in and out).
        io = P(self.batch_axes or None, stage_axis)
        self._region = shard_map(
            body,
            mesh=mesh,
            in_specs=({n: P(stage_axis) for n in names}, io),
            out_specs=io,
            axes=(stage_axis, *self.batch_axes),
        )

    def _layer_specs(self, preset: PresetLike | None, layer: nn.Module) -> dict[str, P]:
        """One layer's specs over the axes the region leaves to propagation (checked)."""
        specs = param_specs(preset if preset is not None else "dp", layer, self.mesh)
        own = {self.stage_axis, *self.batch_axes}
        for name, spec in specs.items():
            used = sorted(own & {self.mesh.axis_name(a) for a in spec.mesh_axes})
            if used:
                raise PipelineError(
                    f"partita.pipeline: layer_specs gives parameter {name!r} the spec {spec}, "
                    f"which uses {used}: the stage axis {self.stage_axis!r} splits the stack "
                    f"and the batch axes {self.batch_axes} split the micro-batches. Split a "
                    f"layer's weights over the other axes only (e.g. 'model' for tensor "
                    f"parallelism)."
                )
        return specs

    # --- running -----------------------------------------------------------------------------

    def forward(self, x: Tensor) -> Tensor:
        """``x [batch, ...] -> [batch, ...]``: the layers in order, pipelined when traced."""
        stacked: dict[str, Tensor] = dict(self.stack.named_parameters())
        if not (is_tracing() or x.device.type == "spmd"):
            return self._sequential(x, stacked)
        sch = self.schedule
        b = x.shape[0]
        split = self.mesh.axes_size(self.batch_axes) if self.batch_axes else 1
        if b % (sch.microbatches * split):
            raise PipelineError(
                f"partita.pipeline: a batch of {b} rows cannot be cut into "
                f"microbatches={sch.microbatches} micro-batches of equal rows split "
                f"{split} ways over the batch axes {self.batch_axes}: {b} is not a multiple "
                f"of {sch.microbatches * split}. Pad the batch, or change microbatches=."
            )
        xs = x.reshape(split, sch.microbatches, b // (split * sch.microbatches), *x.shape[1:])
        return self._region(stacked, xs).reshape(x.shape)

    def _sequential(self, x: Tensor, stacked: dict[str, Tensor]) -> Tensor:
        where = {layer: p for p, layer in enumerate(self.schedule.storage_order())}
        for layer in range(self.schedule.layers):
            p = where[layer]
            x = torch.func.functional_call(self.stack, {n: stacked[n][p] for n in self.names}, (x,))
        return x

    # --- the user's layers ---------------------------------------------------------------------

    def unstack(self, tensors: dict[str, Tensor], prefix: str = "stack.") -> dict[str, Tensor]:
        """Stacked tensors (``{prefix + name: [L, ...]}``, e.g. trained parameters or their
        optimizer moments) as the user's layers' ``{"<layer>.<name>": tensor}``."""
        out: dict[str, Tensor] = {}
        for p, layer in enumerate(self.schedule.storage_order()):
            for n in self.names:
                out[f"{layer}.{n}"] = tensors[prefix + n][p]
        return dict(sorted(out.items(), key=lambda kv: (int(kv[0].split(".")[0]), kv[0])))

    def extra_repr(self) -> str:
        s = self.schedule
        return (
            f"schedule={s.kind!r}, layers={s.layers}, stages={s.stages} over "
            f"{self.stage_axis!r}, microbatches={s.microbatches}, rounds={s.rounds}, "
            f"batch_axes={self.batch_axes}, remat={self.remat}"
        )


def pipeline(
    layers: nn.ModuleList | Sequence[nn.Module],
    *,
    mesh: Mesh,
    stage_axis: str = "stage",
    microbatches: int,
    schedule: str = "gpipe",
    rounds: int | None = None,
    remat: bool = True,
    batch_axes: Sequence[str] | None = None,
    layer_specs: PresetLike | None = None,
) -> Pipeline:
    """Run ``layers`` (identical modules, ``[batch, ...] -> [batch, ...]`` each) as a pipeline
    over the mesh axis ``stage_axis``.

    Args:
        layers: ``L`` modules of one class with the same parameter names and shapes and no
            buffers (a transformer's blocks). Their values are copied; the originals are left.
        mesh: the mesh the program runs on.
        stage_axis: the mesh axis whose ``S`` devices are the stages.
        microbatches: ``M``, the micro-batches each batch is cut into (a multiple of ``S``:
            the input and output are split over the stages by micro-batch).
        schedule: ``"gpipe"`` (stage ``s`` holds layers ``s*L/S`` to ``(s+1)*L/S - 1``) or
            ``"circular"`` (each stage holds ``rounds`` chunks, micro-batches go round the
            stages ``rounds`` times; needs ``M >= S``).
        rounds: the circular schedule's rounds ``V`` (``L`` divisible by ``S * V``; default
            ``L / S``, one layer per chunk).
        remat: recompute each stage's chunk in the backward instead of keeping its activations.
        batch_axes: the mesh axes that split each micro-batch's rows (data parallelism);
            default ``("data",)`` if the mesh has it. Other axes stay with propagation.
        layer_specs: how one layer's parameters are split over the other axes (tensor
            parallelism), as ``param_specs`` of ``train_step`` for one layer: a preset such as
            ``StandardPreset("tp")``, a dict or a callable; default replicated. The stacked
            parameter's spec is ``P(stage_axis, *layer spec)``.

    Returns:
        a :class:`Pipeline` module (``model.blocks = partita.pipeline(model.blocks, ...)``).

    Example:
        >>> mesh = Mesh.create((4, 2), ("stage", "data"))
        >>> blocks = [nn.Linear(8, 8) for _ in range(8)]
        >>> pipe = pipeline(blocks, mesh=mesh, microbatches=4)
        >>> pipe.stack.weight.shape, round(pipe.schedule.bubble_fraction, 3)
        (torch.Size([8, 8, 8]), 0.429)
    """
    return Pipeline(
        layers,
        mesh=mesh,
        stage_axis=stage_axis,
        microbatches=microbatches,
        schedule=schedule,
        rounds=rounds,
        remat=remat,
        batch_axes=batch_axes,
        layer_specs=layer_specs,
    )


def _schedule(n: int, stages: int, microbatches: int, kind: str, rounds: int | None) -> Schedule:
    if kind not in SCHEDULES:
        Schedule(kind, stages, microbatches, 1, 1)  # raises the error naming the schedules
    v = 1 if kind == "gpipe" else (rounds if rounds is not None else max(n // stages, 1))
    if n % (stages * v):
        per = "S" if kind == "gpipe" else f"S * rounds = {stages} * {v}"
        raise PipelineError(
            f"partita.pipeline: {n} layers cannot be split evenly into {stages} stages"
            f"{'' if kind == 'gpipe' else f' of {v} rounds'}: {n} is not a multiple of {per}"
            f"{'' if kind == 'gpipe' else f' = {stages * v}'}. Give a multiple of it, or "
            f"another {'stage axis size' if kind == 'gpipe' else 'rounds='}."
        )
    return Schedule(kind, stages, microbatches, v, n // (stages * v))


def _check_layers(layers: list[nn.Module]) -> list[str]:
    """The parameter names of the layers, checked to be the same (and shapes) in each."""
    if not layers:
        raise PipelineError("partita.pipeline: no layers given; pass a list of modules.")
    first = layers[0]
    if any(True for _ in first.buffers()):
        raise PipelineError(
            f"partita.pipeline: layer 0 ({type(first).__name__}) has buffers "
            f"{[n for n, _ in first.named_buffers()]}; a pipeline stacks parameters only. "
            f"Use layers without buffers (LayerNorm rather than BatchNorm)."
        )
    want = {n: (tuple(p.shape), p.dtype) for n, p in first.named_parameters()}
    for i, layer in enumerate(layers):
        got = {n: (tuple(p.shape), p.dtype) for n, p in layer.named_parameters()}
        if type(layer) is not type(first) or got != want:
            diff = sorted(set(got.items()) ^ set(want.items()))[:4]
            raise PipelineError(
                f"partita.pipeline: layer {i} ({type(layer).__name__}) is not like layer 0 "
                f"({type(first).__name__}): the layers of a pipeline must be one class with "
                f"the same parameters (names, shapes, dtypes); these differ: {diff}. Pipeline "
                f"only the repeated blocks and run the rest outside."
            )
    return list(want)


def _set_parameter(module: nn.Module, dotted: str, value: nn.Parameter) -> None:
    owner: Any = module
    *path, leaf = dotted.split(".")
    for part in path:
        owner = getattr(owner, part)
    setattr(owner, leaf, value)
