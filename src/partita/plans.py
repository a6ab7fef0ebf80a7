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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from partita.mesh import Mesh
from partita.spec import PartitionSpec, as_spec

__all__ = [
    "COLUMN_NAMES",
    "HEAD_NAMES",
    "PLANS",
    "ROW_NAMES",
    "PlanLike",
    "StandardPlan",
    "default_batch_spec",
    "param_specs",
]

COLUMN_NAMES = frozenset(
    {
        "qkv", "c_attn", "q_proj", "k_proj", "v_proj", "query", "key", "value", "in_proj",
        "query_key_value", "Wqkv", "fc", "fc1", "c_fc", "up_proj", "gate_proj", "w1", "w3",
        "wi", "dense_h_to_4h",
    }
)  # fmt: skip
ROW_NAMES = frozenset(
    {"proj", "out_proj", "o_proj", "c_proj", "down_proj", "fc2", "w2", "wo", "dense_4h_to_h"}
)


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
        roles = _linear_roles(model) if self.uses_model else {}
        if self.uses_model and self.vocab_parallel:
            roles.update(_vocab_roles(model))
        out: dict[str, PartitionSpec] = {}
        for name, p in model.named_parameters():
            dims: list[Any] = [None] * p.ndim
            if self.uses_model and name in roles:
                dim = roles[name]
                if dim is not None and p.shape[dim] % mesh.axis_size(self.model_axis) == 0:
                    dims[dim] = self.model_axis
            if self.kind in ("fsdp", "fsdp+tp"):
                dim = _fsdp_dim(p.shape, dims, mesh.axis_size(self.data_axis))
                if dim is not None:
                    dims[dim] = self.data_axis
            out[name] = PartitionSpec(*dims)
        return out


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


def _linear_roles(model: nn.Module) -> dict[str, int | None]:
    """``{parameter name: dim split by tensor parallelism}`` for column / row linears."""
    roles: dict[str, int | None] = {}
    for module_name, module in model.named_modules():
        leaf = module_name.rsplit(".", 1)[-1]
        if leaf in COLUMN_NAMES:
            role = "column"
        elif leaf in ROW_NAMES:
            role = "row"
        else:
            continue
        if isinstance(module, nn.Linear):
            out_dim, in_dim = 0, 1  # weight [out, in]
        elif type(module).__name__ == "Conv1D":  # GPT-2 style: weight [in, out]
            out_dim, in_dim = 1, 0
        else:
            continue
        prefix = f"{module_name}." if module_name else ""
        if role == "column":
            roles[prefix + "weight"] = out_dim
            roles[prefix + "bias"] = 0  # the bias is split like the output features
        else:
            roles[prefix + "weight"] = in_dim
            roles[prefix + "bias"] = None  # added after the all-reduce: replicated
    return roles


def _vocab_roles(model: nn.Module) -> dict[str, int | None]:
    """The token embedding (the largest ``nn.Embedding``) and the output head: vocab dim 0."""
    embeddings = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    roles: dict[str, int | None] = {}
    if embeddings:
        name, _ = max(embeddings, key=lambda nm: nm[1].num_embeddings)
        roles[f"{name}.weight" if name else "weight"] = 0
    for module_name, module in model.named_modules():
        if module_name.rsplit(".", 1)[-1] in HEAD_NAMES and isinstance(module, nn.Linear):
            roles[f"{module_name}.weight"] = 0  # column parallel: logits split by vocabulary
            roles[f"{module_name}.bias"] = 0
    return roles


def param_specs(plan: PlanLike, model: nn.Module, mesh: Mesh) -> dict[str, PartitionSpec]:
    """Resolve ``plan`` to ``{parameter name: PartitionSpec}`` for ``model`` on ``mesh``.

    Example:
        >>> mesh = Mesh.create((8,), ("data",))
        >>> param_specs("fsdp", nn.Linear(4, 16), mesh)
        {'weight': P('data', None), 'bias': P('data')}
        >>> param_specs({"*.weight": P(None, "data")}, nn.Sequential(nn.Linear(8, 2)), mesh)
        {'0.weight': P(None, 'data'), '0.bias': P()}
    """
    if isinstance(plan, str):
        plan = StandardPlan(plan)
    named = dict(model.named_parameters())
    if isinstance(plan, StandardPlan):
        raw: dict[str, Any] = dict(plan.specs(model, mesh))
    elif isinstance(plan, Mapping):
        raw = {name: _lookup(plan, name) for name in named}
        unused = [k for k in plan if not any(_matches(k, n) for n in named)]
        if unused:
            raise ValueError(
                f"plan keys {unused} match no parameter of {type(model).__name__}; its "
                f"parameters are {list(named)[:8]}{' ...' if len(named) > 8 else ''}."
            )
    elif callable(plan):
        raw = {name: plan(name, p) for name, p in named.items()}
    else:
        raise TypeError(
            f"plan must be a preset name {list(PLANS)}, a dict or a callable, got {plan!r}."
        )
    out: dict[str, PartitionSpec] = {}
    for name, spec in raw.items():
        spec = as_spec(spec)
        try:
            spec.to_sharding(mesh, named[name].ndim)
        except Exception as e:
            raise ValueError(
                f"plan gives parameter {name!r} (shape {tuple(named[name].shape)}) the spec "
                f"{spec}, which does not fit {mesh!r}: {e}"
            ) from e
        out[name] = spec
    return out


def _matches(key: str, name: str) -> bool:
    return key == name or fnmatch.fnmatchcase(name, key)


def _lookup(plan: Mapping[str, Any], name: str) -> Any:
    if name in plan:
        return plan[name]
    for key, spec in plan.items():
        if fnmatch.fnmatchcase(name, key):
            return spec
    return None


def default_batch_spec(plan: PlanLike, mesh: Mesh) -> PartitionSpec:
    """``P(data axis)`` when the mesh has the plan's data axis, else ``P()`` (replicated)."""
    axis = plan.data_axis if isinstance(plan, StandardPlan) else "data"
    return PartitionSpec(axis) if axis in mesh.axis_names else PartitionSpec()
