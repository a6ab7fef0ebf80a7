"""Sharding plans as data: which PartitionSpec each parameter of a model gets.

A plan answers one question — *how is each parameter split over the mesh?* — and nothing else:
the batch gets one spec, and propagation derives every activation, gradient and optimizer
temporary from those annotations. A plan is any of:

* a name: ``"dp"``, ``"fsdp"``, ``"tp"``, ``"fsdp+tp"`` (the :class:`StandardPlan` presets);
* a :class:`StandardPlan` (a preset with other mesh axis names);
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

The default batch spec (:func:`default_batch_spec`) is ``P('data')`` when the mesh has the
``data`` axis, else replicated.

Column and row linears are found by module type (``nn.Linear``, and the transposed ``Conv1D``
of GPT-2-style models) and the last part of the module's name (``qkv``, ``q_proj``, ``c_attn``,
``fc``, ``up_proj``... are column; ``proj``, ``o_proj``, ``c_proj``, ``down_proj``... are row):
see :data:`COLUMN_NAMES` and :data:`ROW_NAMES`. Embeddings and the output head stay
replicated under ``tp`` (``fsdp+tp`` shards them over ``data``) unless
``StandardPlan(kind, vocab_parallel=True)``: then the token embedding (the largest
``nn.Embedding``) and the output head (a linear named in :data:`HEAD_NAMES`) split the vocabulary
over ``model``. A dim is only split when the
mesh axis size divides it, so no preset creates padded shards.

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

from partita.mesh import Mesh
from partita.spec import PartitionSpec, as_spec

__all__ = [
    "COLUMN_NAMES",
    "EXPERT_NAMES",
    "FUSED_NAMES",
    "HEAD_NAMES",
    "PATH_ROLES",
    "PLANS",
    "ROW_NAMES",
    "ParamRow",
    "PlanLike",
    "StandardPlan",
    "default_batch_spec",
    "explain_param_specs",
    "format_param_specs",
    "param_specs",
    "split_fraction",
]

COLUMN_NAMES = frozenset(
    {
        "qkv", "c_attn", "q_proj", "k_proj", "v_proj", "query", "key", "value", "in_proj",
        "query_key_value", "Wqkv", "qkv_proj", "fc", "fc1", "c_fc", "fc_in", "up_proj",
        "gate_proj", "gate_up_proj", "w1", "w3", "wi", "wi_0", "wi_1", "q", "k", "v",
        "dense_h_to_4h",
    }
)  # fmt: skip
ROW_NAMES = frozenset(
    {
        "proj", "out_proj", "o_proj", "c_proj", "down_proj", "fc2", "fc_out", "w2", "wo", "o",
        "dense_4h_to_h",
    }
)  # fmt: skip
# Column linears whose output features are several tensors side by side (q|k|v, gate|up).
FUSED_NAMES = frozenset(
    {"qkv", "c_attn", "qkv_proj", "query_key_value", "Wqkv", "in_proj", "gate_up_proj"}
)
# Linears a leaf name cannot classify (BERT's and Phi's "dense"): fnmatch patterns on the whole
# module path, first match wins. BERT: attention.output.dense (row), intermediate.dense
# (column), output.dense (row); Phi-1/2 and GPT-NeoX: the attention's dense (row).
PATH_ROLES: tuple[tuple[str, str], ...] = (
    ("*attention.output.dense", "row"),
    ("*intermediate.dense", "column"),
    ("*output.dense", "row"),
    ("*self_attn.dense", "row"),
    ("*attention.dense", "row"),
)
# 3-D expert weights [experts, ., .] of a module named "experts" (Mixtral, Qwen-MoE): dim 0.
EXPERT_NAMES = frozenset({"gate_up_proj", "up_proj", "gate_proj", "down_proj", "w1", "w2", "w3"})
KV_NAMES = frozenset({"k_proj", "v_proj", "key", "value", "k", "v"})


@dataclass(frozen=True)
class ParamRow:
    """One parameter in :func:`explain_param_specs`: its spec and why the plan chose it."""

    name: str
    shape: tuple[int, ...]
    spec: PartitionSpec
    reason: str


@dataclass(frozen=True)
class _Role:
    dim: int | None  # the dim split over the model mesh axis; None: replicated on purpose
    reason: str
    heads: int | None = None  # attention heads in the split dim (keep them whole)


@dataclass(frozen=True)
class StandardPlan:
    """A preset plan: ``kind`` is ``"dp"``, ``"fsdp"``, ``"tp"`` or ``"fsdp+tp"``.

    Example:
        >>> mesh = Mesh.create((2, 4), ("batch", "mp"))
        >>> plan = StandardPlan("fsdp+tp", data_axis="batch", model_axis="mp")
        >>> param_specs(plan, nn.Sequential(nn.Linear(8, 16)), mesh)["0.weight"]
        P('batch', None)
    """

    kind: str
    data_axis: str = "data"
    model_axis: str = "model"
    vocab_parallel: bool = False

    def __post_init__(self) -> None:
        if self.kind not in PLANS:
            raise ValueError(
                f"unknown plan {self.kind!r}; the presets are {sorted(PLANS)}. Pass a dict "
                "{parameter name or pattern: spec} or a callable (name, param) -> spec instead."
            )

    @property
    def uses_data(self) -> bool:
        return self.kind != "tp"

    @property
    def uses_model(self) -> bool:
        return self.kind in ("tp", "fsdp+tp")

    def specs(self, model: nn.Module, mesh: Mesh) -> dict[str, PartitionSpec]:
        """``{parameter name: spec}`` for every trainable and frozen parameter of ``model``."""
        return {row.name: row.spec for row in self.explain(model, mesh)}

    def explain(self, model: nn.Module, mesh: Mesh) -> list[ParamRow]:
        """One :class:`ParamRow` per parameter: the spec and the reason for it."""
        self._check_axes(mesh)
        roles = _tp_roles(model) if self.uses_model else {}
        if self.uses_model and self.vocab_parallel:
            roles.update(_vocab_roles(model))
        rows = []
        for name, p in model.named_parameters():
            dims: list[Any] = [None] * p.ndim
            reasons = []
            if self.uses_model:
                reasons.append(self._model_part(roles.get(name), p.shape, dims, mesh))
            if self.kind in ("fsdp", "fsdp+tp"):
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
        self, role: _Role | None, shape: torch.Size, dims: list[Any], mesh: Mesh
    ) -> str:
        """Split ``dims[role.dim]`` over the model axis if it divides; say what happened."""
        if role is None:
            return "replicated over model: no tp rule names this parameter"
        if role.dim is None:
            return role.reason
        size = mesh.axis_size(self.model_axis)
        if shape[role.dim] % size:
            return f"replicated over model: {role.reason}, but {self.model_axis}={size} does not divide dim {role.dim} (size {shape[role.dim]})"  # noqa: E501
        if role.heads is not None and role.heads % size:
            return f"replicated over model: {role.reason}, but its {role.heads} heads do not split {size} ways (whole heads only)"  # noqa: E501
        dims[role.dim] = self.model_axis
        return role.reason

    def _check_axes(self, mesh: Mesh) -> None:
        for used, axis, role in (
            (self.uses_data and self.kind != "dp", self.data_axis, "data"),
            (self.uses_model, self.model_axis, "model"),
        ):
            if used and axis not in mesh.axis_names:
                raise ValueError(
                    f"plan {self.kind!r} splits parameters over a {role} mesh axis named "
                    f"{axis!r}, but {mesh!r} has none. Name the mesh axes ('data', 'model') "
                    f"or pass plan=partita.plans.StandardPlan({self.kind!r}, "
                    f"{role}_axis=<one of {list(mesh.axis_names)}>)."
                )


PLANS = ("dp", "fsdp", "tp", "fsdp+tp")
HEAD_NAMES = frozenset({"head", "lm_head", "output", "embed_out"})

PlanLike = (
    str
    | StandardPlan
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


def _linear_role(module_name: str) -> str | None:
    """``"column"``, ``"row"`` or None, from the module's path (patterns) or leaf name."""
    for pattern, role in PATH_ROLES:
        if fnmatch.fnmatchcase(module_name, pattern):
            return role
    leaf = module_name.rsplit(".", 1)[-1]
    if leaf in COLUMN_NAMES:
        return "column"
    if leaf in ROW_NAMES:
        return "row"
    return None


def _kv_heads(model: nn.Module) -> int | None:
    """Key/value heads of a grouped-query model (``config.num_key_value_heads``), if fewer
    than the query heads; None otherwise."""
    config = getattr(model, "config", None)
    kv = getattr(config, "num_key_value_heads", None)
    heads = getattr(config, "num_attention_heads", None)
    return kv if isinstance(kv, int) and isinstance(heads, int) and kv < heads else None


def _tp_roles(model: nn.Module) -> dict[str, _Role]:
    """``{parameter name: role}`` for column / row linears and 3-D expert weights."""
    roles: dict[str, _Role] = {}
    kv_heads = _kv_heads(model)
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        leaf = module_name.rsplit(".", 1)[-1]
        if leaf == "experts":
            roles.update(_expert_roles(prefix, module))
            continue
        role = _linear_role(module_name)
        if role is None:
            continue
        if isinstance(module, nn.Linear):
            out_dim, in_dim = 0, 1  # weight [out, in]
        elif type(module).__name__ == "Conv1D":  # GPT-2 style: weight [in, out]
            out_dim, in_dim = 1, 0
        else:
            continue
        if role == "row":
            why = f"row-parallel linear ({leaf}): input features over model"
            roles[prefix + "weight"] = _Role(in_dim, why)
            # added after the all-reduce: replicated
            roles[prefix + "bias"] = _Role(None, "row-parallel bias: added once, replicated")
            continue
        if leaf in FUSED_NAMES:
            why = f"fused column-parallel linear ({leaf}): output features over model, contiguous blocks (docs/models.md)"  # noqa: E501
        else:
            why = f"column-parallel linear ({leaf}): output features over model"
        heads = kv_heads if leaf in KV_NAMES else None
        roles[prefix + "weight"] = _Role(out_dim, why, heads)
        roles[prefix + "bias"] = _Role(0, why, heads)  # split like the output features
    return roles


def _expert_roles(prefix: str, experts: nn.Module) -> dict[str, _Role]:
    """3-D expert weights ``[experts, ., .]``: the experts dim over model (expert parallel)."""
    return {
        prefix + name: _Role(0, f"expert weights ({name}): experts dim over model")
        for name, p in experts.named_parameters(recurse=False)
        if p.ndim == 3 and name in EXPERT_NAMES
    }


def _vocab_roles(model: nn.Module) -> dict[str, _Role]:
    """The token embedding (the largest ``nn.Embedding``) and the output head: vocab dim 0."""
    embeddings = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    roles: dict[str, _Role] = {}
    if embeddings:
        name, _ = max(embeddings, key=lambda nm: nm[1].num_embeddings)
        why = "vocab parallel: token embedding rows over model"
        roles[f"{name}.weight" if name else "weight"] = _Role(0, why)
    for module_name, module in model.named_modules():
        if module_name.rsplit(".", 1)[-1] in HEAD_NAMES and isinstance(module, nn.Linear):
            why = "vocab parallel: output head, logits split by vocabulary"  # column parallel
            roles[f"{module_name}.weight"] = _Role(0, why)
            roles[f"{module_name}.bias"] = _Role(0, why)
    return roles


def explain_param_specs(plan: PlanLike, model: nn.Module, mesh: Mesh) -> list[ParamRow]:
    """Each parameter's name, shape, spec and the reason ``plan`` gave it that spec.

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
    if isinstance(plan, str):
        plan = StandardPlan(plan)
    named = dict(model.named_parameters())
    if isinstance(plan, StandardPlan):
        rows = plan.explain(model, mesh)
    elif isinstance(plan, Mapping):
        unused = [k for k in plan if not any(_matches(k, n) for n in named)]
        if unused:
            raise ValueError(
                f"plan keys {unused} match no parameter of {type(model).__name__}; its "
                f"parameters are {list(named)[:8]}{' ...' if len(named) > 8 else ''}."
            )
        rows = []
        for name, p in named.items():
            key = _key_for(plan, name)
            why = "no key matches: replicated" if key is None else f"plan key {key!r}"
            spec = None if key is None else plan[key]
            rows.append(ParamRow(name, tuple(p.shape), spec, why))  # type: ignore[arg-type]
    elif callable(plan):
        rows = [
            ParamRow(name, tuple(p.shape), plan(name, p), "the plan callable")  # type: ignore[arg-type]
            for name, p in named.items()
        ]
    else:
        raise TypeError(
            f"plan must be a preset name {list(PLANS)}, a dict or a callable, got {plan!r}."
        )
    return [_checked(row, named[row.name].ndim, mesh) for row in rows]


def _checked(row: ParamRow, ndim: int, mesh: Mesh) -> ParamRow:
    spec = as_spec(row.spec)
    try:
        spec.to_sharding(mesh, ndim)
    except Exception as e:
        raise ValueError(
            f"plan gives parameter {row.name!r} (shape {row.shape}) the spec "
            f"{spec}, which does not fit {mesh!r}: {e}"
        ) from e
    return ParamRow(row.name, row.shape, spec, row.reason)


def param_specs(plan: PlanLike, model: nn.Module, mesh: Mesh) -> dict[str, PartitionSpec]:
    """Resolve ``plan`` to ``{parameter name: PartitionSpec}`` for ``model`` on ``mesh``.

    Example:
        >>> mesh = Mesh.create((8,), ("data",))
        >>> param_specs("fsdp", nn.Linear(4, 16), mesh)
        {'weight': P('data', None), 'bias': P('data')}
        >>> param_specs({"*.weight": P(None, "data")}, nn.Sequential(nn.Linear(8, 2)), mesh)
        {'0.weight': P(None, 'data'), '0.bias': P()}
    """
    return {row.name: row.spec for row in explain_param_specs(plan, model, mesh)}


def split_fraction(specs: Mapping[str, PartitionSpec], model: nn.Module, mesh_axis: str) -> float:
    """The fraction of ``model``'s parameter elements whose spec splits a dim over
    ``mesh_axis`` (how much of the model a tensor-parallel plan shards)."""
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


def _key_for(plan: Mapping[str, Any], name: str) -> str | None:
    """The plan key for ``name``: the name itself, else the first matching pattern."""
    if name in plan:
        return name
    for key in plan:
        if fnmatch.fnmatchcase(name, key):
            return key
    return None


def default_batch_spec(plan: PlanLike, mesh: Mesh) -> PartitionSpec:
    """``P(data axis)`` when the mesh has the plan's data axis, else ``P()`` (replicated)."""
    axis = plan.data_axis if isinstance(plan, StandardPlan) else "data"
    return PartitionSpec(axis) if axis in mesh.axis_names else PartitionSpec()
