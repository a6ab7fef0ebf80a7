"""Sharding presets as data: which PartitionSpec each parameter of a model gets.

A preset answers one question — *how is each parameter split over the mesh?* — and nothing else:
the batch gets one spec, and propagation derives every activation, gradient and optimizer
temporary from those annotations. (The word *plan* is kept for the report of what a compiled
program communicates, :class:`partita.Plan`.) A
preset is any of:

* a name: ``"dp"``, ``"fsdp"``, ``"tp"``, ``"fsdp+tp"`` (the :class:`StandardPreset` kinds);
* a :class:`StandardPreset` (a preset with other mesh axis names);
* a dict ``{parameter name or fnmatch pattern: spec}`` (first matching key wins; parameters no
  key matches are replicated);
* a callable ``fn(name, param) -> spec or None`` (None: replicated).

:func:`param_specs` turns any of them into ``{name: PartitionSpec}`` for a model and mesh.

The presets:

* ``dp``: every parameter replicated.
* ``fsdp``: one dim of each parameter over ``data`` (dim 0 if the axis size divides it, else
  the largest dim it divides; else replicated).
* ``tp``: Megatron. Column-parallel linears split their output features (and bias) over
  ``model``, row-parallel linears their input features; everything else is replicated.
* ``fsdp+tp``: ``tp``, plus one remaining dim of each parameter over ``data``.
* ``ep``: expert parallel. The 3-D expert weights ``[experts, ., .]`` of a module named
  ``experts`` split their experts dim over the expert axis (``expert_axis``, by default
  ``model``: on a ``(data, model)`` mesh the axis the batch does not use), each expert's
  matrices whole; everything else replicated.
* ``fsdp+ep``: ``ep``, plus one remaining dim of each parameter over ``data``.

The default batch spec (:func:`default_batch_spec`) is ``P('data')`` when the mesh has the
``data`` axis, else replicated.

Which parameters ``tp`` splits, and along which dim, is :mod:`partita.presets.roles`' job: column
and row linears by module type and name (``q_proj``, ``c_attn``, ``o_proj``, T5's ``q`` /
``wi_0`` / ``wo``...), fused projections (``qkv_proj``, ``gate_up_proj``: contiguous blocks of
the fused output dim), BERT's ``dense`` layers by module path, 3-D expert weights by their
experts dim; key/value projections of grouped-query models stay replicated when the heads would
not stay whole. Embeddings and the output head stay replicated under ``tp`` (``fsdp+tp``
shards them over ``data``) unless ``StandardPreset(kind, vocab_parallel=True)``: then the token
embedding (the largest ``nn.Embedding``) and the output head split the vocabulary over
``model``. A dim is only split when the mesh axis size divides it, so no preset creates padded
shards. :func:`explain_param_specs` gives every parameter's spec with the reason (which rule,
or why it stayed replicated), :func:`format_param_specs` prints it as a table, and
:func:`split_fraction` measures how much of a model a preset splits.

This module does not trace or shard anything; it only computes specs.
"""

from __future__ import annotations

import fnmatch
import io
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from rich import box
from rich.console import Console
from rich.table import Table
from torch import nn

from partita.errors import ArgumentError, ArgumentTypeError, SpecError
from partita.presets.roles import (
    COLUMN_NAMES,
    EXPERT_NAMES,
    FUSED_NAMES,
    HEAD_NAMES,
    PATH_ROLES,
    ROW_NAMES,
    TPRole,
    expert_roles,
    tp_roles,
    vocab_roles,
)
from partita.values.annotations import marked_param_specs
from partita.values.mesh import Mesh
from partita.values.spec import PartitionSpec, as_spec

__all__ = [
    "COLUMN_NAMES",
    "EXPERT_NAMES",
    "FUSED_NAMES",
    "HEAD_NAMES",
    "PATH_ROLES",
    "PRESETS",
    "ROW_NAMES",
    "ParamRow",
    "PresetLike",
    "StandardPreset",
    "default_batch_spec",
    "explain_param_specs",
    "format_param_specs",
    "param_specs",
    "split_fraction",
]


@dataclass(frozen=True)
class ParamRow:
    """One parameter in :func:`explain_param_specs`: its spec and why the preset chose it."""

    name: str
    shape: tuple[int, ...]
    spec: PartitionSpec
    reason: str


@dataclass(frozen=True)
class StandardPreset:
    """A standard preset: ``kind`` is ``"dp"``, ``"fsdp"``, ``"tp"``, ``"fsdp+tp"``, ``"ep"``
    or ``"fsdp+ep"`` (``expert_axis``: the mesh axis of the ``ep`` kinds' experts dim).

    Example:
        >>> mesh = Mesh.create((2, 4), ("batch", "mp"))
        >>> preset = StandardPreset("fsdp+tp", data_axis="batch", model_axis="mp")
        >>> param_specs(preset, nn.Sequential(nn.Linear(8, 16)), mesh)["0.weight"]
        P('batch', None)
    """

    kind: str
    data_axis: str = "data"
    model_axis: str = "model"
    vocab_parallel: bool = False
    expert_axis: str = "model"

    def __post_init__(self) -> None:
        if self.kind not in PRESETS:
            raise ArgumentError(
                f"unknown preset {self.kind!r}; the presets are {sorted(PRESETS)}. Pass a dict "
                "{parameter name or pattern: spec} or a callable (name, param) -> spec instead."
            )

    @property
    def uses_data(self) -> bool:
        return self.kind != "tp"

    @property
    def uses_model(self) -> bool:
        return self.kind in ("tp", "fsdp+tp")

    @property
    def uses_experts(self) -> bool:
        return self.kind in ("ep", "fsdp+ep")

    def specs(self, model: nn.Module, mesh: Mesh) -> dict[str, PartitionSpec]:
        """``{parameter name: spec}`` for every trainable and frozen parameter of ``model``."""
        return {row.name: row.spec for row in self.explain(model, mesh)}

    def explain(self, model: nn.Module, mesh: Mesh) -> list[ParamRow]:
        """One :class:`ParamRow` per parameter: the spec and the reason for it."""
        self._check_axes(mesh)
        roles = tp_roles(model) if self.uses_model else {}
        if self.uses_model and self.vocab_parallel:
            roles.update(vocab_roles(model))
        if self.uses_experts:
            roles = expert_roles(model, self.expert_axis)
        rows = []
        for name, p in model.named_parameters():
            dims: list[Any] = [None] * p.ndim
            reasons = []
            if self.uses_model:
                reasons.append(self._model_part(roles.get(name), p.shape, dims, mesh))
            elif self.uses_experts and name in roles:
                reasons.append(self._model_part(roles[name], p.shape, dims, mesh))
            if self.kind in ("fsdp", "fsdp+tp", "fsdp+ep"):
                size = mesh.axis_size(self.data_axis)
                dim = _fsdp_dim(p.shape, dims, size)
                if dim is not None:
                    dims[dim] = self.data_axis
                    reasons.append(f"fsdp: dim {dim} over {self.data_axis!r}")
                else:
                    reasons.append(f"fsdp: no free dim divisible by {self.data_axis}={size}")
            if self.kind == "dp":
                reasons.append("dp: every parameter replicated")
            rows.append(ParamRow(name, tuple(p.shape), PartitionSpec(*dims), "; ".join(reasons)))
        return rows

    def _model_part(
        self, role: TPRole | None, shape: torch.Size, dims: list[Any], mesh: Mesh
    ) -> str:
        """Split ``dims[role.dim]`` over the model (or expert) axis if it divides; say what
        happened."""
        if role is None:
            return "replicated over model: no tp rule names this parameter"
        if role.dim is None:
            return role.reason
        axis = self.expert_axis if self.uses_experts else self.model_axis
        size = mesh.axis_size(axis)
        if shape[role.dim] % size:
            return f"replicated over {axis}: {role.reason}, but {axis}={size} does not divide dim {role.dim} (size {shape[role.dim]})"  # noqa: E501
        if role.heads is not None and role.heads % size:
            return f"replicated over {axis}: {role.reason}, but its {role.heads} heads do not split {size} ways (whole heads only)"  # noqa: E501
        dims[role.dim] = axis
        return role.reason

    def _check_axes(self, mesh: Mesh) -> None:
        for used, axis, role in (
            (self.kind not in ("dp", "tp", "ep"), self.data_axis, "data"),
            (self.uses_model, self.model_axis, "model"),
            (self.uses_experts, self.expert_axis, "expert"),
        ):
            if used and axis not in mesh.axis_names:
                raise ArgumentError(
                    f"preset {self.kind!r} splits parameters over a {role} mesh axis named "
                    f"{axis!r}, but {mesh!r} has none. Name the mesh axes ('data', 'model') "
                    f"or pass param_specs=partita.presets.StandardPreset({self.kind!r}, "
                    f"{role}_axis=<one of {list(mesh.axis_names)}>)."
                )


PRESETS = ("dp", "fsdp", "tp", "fsdp+tp", "ep", "fsdp+ep")

PresetLike = (
    str
    | StandardPreset
    | Mapping[str, Any]
    | Callable[[str, torch.Tensor], PartitionSpec | tuple[Any, ...] | None]
)


def _fsdp_dim(shape: torch.Size, taken: list[Any], size: int) -> int | None:
    """Dim 0 if it is free and ``size`` divides it, else the largest free divisible dim."""
    free = [d for d in range(len(shape)) if taken[d] is None and shape[d] % size == 0]
    if not free:
        return None
    if 0 in free:
        return 0
    return max(free, key=lambda d: shape[d])


def explain_param_specs(preset: PresetLike, model: nn.Module, mesh: Mesh) -> list[ParamRow]:
    """Each parameter's name, shape, spec and the reason ``preset`` gave it that spec.

    The rows say which preset rule split a parameter, and why the others stay replicated (no
    rule names them, the mesh axis does not divide the dim, too few heads to keep them whole).
    :func:`format_param_specs` prints them as a table.

    Example:
        >>> mesh = Mesh.create((4,), ("model",))
        >>> model = nn.ModuleDict({"q_proj": nn.Linear(8, 8), "norm": nn.LayerNorm(8)})
        >>> [(r.name, r.spec) for r in explain_param_specs("tp", model, mesh)][:2]
        [('q_proj.weight', P('model', None)), ('q_proj.bias', P('model'))]
        >>> explain_param_specs("tp", model, mesh)[2].reason
        'replicated over model: no tp rule names this parameter'
    """
    if isinstance(preset, str):
        preset = StandardPreset(preset)
    named = dict(model.named_parameters())
    if isinstance(preset, StandardPreset):
        rows = preset.explain(model, mesh)
    elif isinstance(preset, Mapping):
        unused = [k for k in preset if not any(_matches(k, n) for n in named)]
        if unused:
            raise ArgumentError(
                f"preset keys {unused} match no parameter of {type(model).__name__}; its "
                f"parameters are {list(named)[:8]}{' ...' if len(named) > 8 else ''}."
            )
        rows = []
        for name, p in named.items():
            key = _key_for(preset, name)
            why = "no key matches: replicated" if key is None else f"preset key {key!r}"
            spec = None if key is None else preset[key]
            rows.append(ParamRow(name, tuple(p.shape), spec, why))  # type: ignore[arg-type]
    elif callable(preset):
        rows = [
            ParamRow(name, tuple(p.shape), preset(name, p), "the preset callable")  # type: ignore[arg-type]
            for name, p in named.items()
        ]
    else:
        raise ArgumentTypeError(
            f"preset must be a preset name {list(PRESETS)}, a dict or a callable, got {preset!r}."
        )
    return [_checked(row, named[row.name].ndim, mesh) for row in rows]


def _checked(row: ParamRow, ndim: int, mesh: Mesh) -> ParamRow:
    spec = as_spec(row.spec)
    try:
        spec.to_sharding(mesh, ndim)
    except Exception as e:
        raise SpecError(
            f"preset gives parameter {row.name!r} (shape {row.shape}) the spec "
            f"{spec}, which does not fit {mesh!r}: {e}"
        ) from e
    return ParamRow(row.name, row.shape, spec, row.reason)


def param_specs(preset: PresetLike, model: nn.Module, mesh: Mesh) -> dict[str, PartitionSpec]:
    """Resolve ``preset`` to ``{parameter name: PartitionSpec}`` for ``model`` on ``mesh``.

    Example:
        >>> mesh = Mesh.create((8,), ("data",))
        >>> param_specs("fsdp", nn.Linear(4, 16), mesh)
        {'weight': P('data', None), 'bias': P('data')}
        >>> param_specs({"*.weight": P(None, "data")}, nn.Sequential(nn.Linear(8, 2)), mesh)
        {'0.weight': P(None, 'data'), '0.bias': P()}
    """
    marked = marked_param_specs(model, mesh)  # a weight's own mark_sharding wins
    return {
        row.name: marked.get(row.name, row.spec) for row in explain_param_specs(preset, model, mesh)
    }


def split_fraction(specs: Mapping[str, PartitionSpec], model: nn.Module, mesh_axis: str) -> float:
    """The fraction of ``model``'s parameter elements whose spec splits a dim over
    ``mesh_axis`` (how much of the model a tensor-parallel preset shards)."""
    named = dict(model.named_parameters())
    total = sum(p.numel() for p in named.values())
    split = sum(
        named[name].numel()
        for name, spec in specs.items()
        if any(mesh_axis == e or (isinstance(e, tuple) and mesh_axis in e) for e in spec)
    )
    return split / total if total else 0.0


def format_param_specs(rows: list[ParamRow], *, width: int = 140) -> str:
    """``explain_param_specs`` rows as a text table (rich): name, shape, spec, reason."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False)
    for column in ("parameter", "shape", "spec", "reason"):
        table.add_column(column, no_wrap=column != "reason", overflow="fold")
    for row in rows:
        table.add_row(row.name, str(list(row.shape)), str(row.spec), row.reason)
    console = Console(file=io.StringIO(), width=width, color_system=None)
    console.print(table)
    text = console.file.getvalue()  # type: ignore[attr-defined]
    return "\n".join(line.rstrip() for line in text.splitlines()) + "\n"


def _matches(key: str, name: str) -> bool:
    return key == name or fnmatch.fnmatchcase(name, key)


def _key_for(preset: Mapping[str, Any], name: str) -> str | None:
    """The preset key for ``name``: the name itself, else the first matching pattern."""
    if name in preset:
        return name
    for key in preset:
        if fnmatch.fnmatchcase(name, key):
            return key
    return None


def default_batch_spec(preset: PresetLike, mesh: Mesh) -> PartitionSpec:
    """``P(data axis)`` when the mesh has the preset's data axis, else ``P()`` (replicated)."""
    axis = preset.data_axis if isinstance(preset, StandardPreset) else "data"
    return PartitionSpec(axis) if axis in mesh.axis_names else PartitionSpec()
