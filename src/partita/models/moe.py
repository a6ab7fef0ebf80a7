"""A mixture-of-experts layer in GShard's formulation (Lepikhin et al., 2020): routing as
dense dispatch and combine tensors, the experts as one 3-D weight per projection.

Tokens come in *groups* (here: one sequence of the batch is one group). The router picks the
top-k experts of each token; each expert takes at most ``capacity`` tokens of a group, in
token order (first the tokens' first choices, then their second ones). ``dispatch[g, s, e,
c]`` is 1 when token ``s`` of group ``g`` is the ``c``-th token expert ``e`` takes, and
``combine`` is ``dispatch`` times the token's gate weight for that expert:

    expert_in  = einsum("gsec,gsd->gecd", dispatch, x)       # [groups, experts, capacity, d]
    expert_out = w_out(act(w_in(expert_in)))                 # per expert: "gecd,edh->gech"
    y          = einsum("gsec,gecd->gsd", combine, expert_out)

Written for one device, it is what a partitioner shards. With the groups split over the
devices and the experts dim of the weights split over the same devices (``param_specs="ep"``,
the batch split over every mesh axis), ``expert_in`` is made where the tokens are and used where
the experts are: the partitioner moves it with an all-to-all, and ``expert_out`` back with
another (docs/models.md, "Experts"). As in GShard, one annotation says so: given ``mesh=``,
the layer marks ``expert_in`` and ``expert_out`` split over ``expert_axis`` on the experts dim
(and the other mesh axes on the groups dim); without it (or run eagerly) nothing is marked and
propagation chooses (it gathers the expert weights instead, as fsdp would).

``capacity_factor=None`` is dropless: the capacity is the group size (no expert takes a token
twice, so no token is ever dropped), at the cost of ``experts x group`` rows per group;
``capacity_factor=f`` gives ``ceil(f * k * group / experts)`` rows, and the tokens past an
expert's capacity skip that expert (their residual path carries them), as in GShard.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from partita.frontend.annotate import mark_sharding
from partita.partition.plan import Plan
from partita.values.mesh import Mesh
from partita.values.spec import PartitionSpec

__all__ = ["ExpertLayer", "GShardMoE", "capacity", "expert_report"]


def capacity(group: int, experts: int, top_k: int, capacity_factor: float | None) -> int:
    """Rows per expert and group: the group size (dropless) or ``ceil(f * k * group / E)``."""
    if capacity_factor is None:
        return group
    return max(1, math.ceil(capacity_factor * top_k * group / experts))


class GShardMoE(nn.Module):
    """Top-k routed experts (two-layer MLPs) with a residual connection.

    Args:
        d: model width. h: expert hidden width. experts: number of experts.
        top_k: experts per token. capacity_factor: None (dropless) or GShard's factor.
        mesh, expert_axis: mark the experts' inputs and outputs split over ``expert_axis``
            on the experts dim (expert parallelism); None: no annotation.
    """

    routed_tokens: torch.Tensor
    kept_tokens: torch.Tensor

    def __init__(
        self,
        d: int,
        h: int,
        experts: int,
        top_k: int = 2,
        capacity_factor: float | None = None,
        mesh: Mesh | None = None,
        expert_axis: str = "model",
    ) -> None:
        super().__init__()
        self.top_k, self.capacity_factor = top_k, capacity_factor
        self.mesh, self.expert_axis = mesh, expert_axis
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = _Experts(d, h, experts)
        # The load of the last call, per expert: the rows the router sent (tokens x top-k
        # choices) and those within capacity (the rest were dropped). In the state_dict, so
        # TrainStep.sync_to_module() copies them back, as batch-norm statistics.
        self.register_buffer("routed_tokens", torch.zeros(experts, dtype=torch.long))
        self.register_buffer("kept_tokens", torch.zeros(experts, dtype=torch.long))

    def routing(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dispatch, combine, aux_loss)`` for ``x [groups, group, d]``: the 0/1 dispatch
        tensor and the combine weights ``[groups, group, experts, capacity]``, and the
        load-balancing loss (the fraction of tokens per expert times its mean probability)."""
        g, s, _ = x.shape
        e = self.router.out_features
        cap = capacity(s, e, self.top_k, self.capacity_factor)
        probs = self.router(x).softmax(-1)  # [g, s, e]
        gates, idx = probs.topk(self.top_k, -1)  # [g, s, k]
        dispatch = x.new_zeros(g, s, e, cap)
        combine = x.new_zeros(g, s, e, cap)
        taken = x.new_zeros(g, 1, e)  # rows each expert has given out so far
        kept = torch.zeros(e, dtype=torch.long, device=x.device)
        for j in range(self.top_k):
            mask = F.one_hot(idx[..., j], e).to(x.dtype)  # [g, s, e]
            position = (torch.cumsum(mask, 1) - 1 + taken) * mask  # the row of each token
            keep = mask * (position < cap).to(x.dtype)
            kept = kept + (keep > 0).long().sum((0, 1))
            taken = taken + mask.sum(1, keepdim=True)
            slot = F.one_hot(position.long().clamp(max=cap - 1), cap).to(x.dtype)  # [g,s,e,c]
            dispatch = dispatch + keep.unsqueeze(-1) * slot
            combine = combine + (keep * gates[..., j : j + 1]).unsqueeze(-1) * slot
        density = F.one_hot(idx[..., 0], e).to(x.dtype).mean(1)  # [g, e]
        aux = (density * probs.mean(1)).sum(-1).mean() * e
        with torch.no_grad():
            self.routed_tokens.copy_(F.one_hot(idx, e).sum((0, 1, 2)))
            self.kept_tokens.copy_(kept)
        return dispatch, combine, aux

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(y, aux_loss)`` for ``x [groups, group, d]``."""
        dispatch, combine, aux = self.routing(x)
        expert_in = self._by_expert(self._by_group(torch.einsum("gsec,gsd->gecd", dispatch, x)))
        expert_out = self._by_group(self._by_expert(self.experts(expert_in)))
        y = torch.einsum("gsec,gecd->gsd", combine, expert_out)
        return x + y, aux

    def _by_group(self, t: torch.Tensor) -> torch.Tensor:
        """``t [groups, experts, capacity, d]`` marked split over every mesh axis on the
        groups dim, where the tokens are (when the layer has a mesh)."""
        if self.mesh is None:
            return t
        spec = PartitionSpec(tuple(self.mesh.axis_names), None, None, None)
        return _Mark.apply(t, self.mesh, spec)

    def _by_expert(self, t: torch.Tensor) -> torch.Tensor:
        """``t [groups, experts, capacity, d]`` marked split over the expert axis on the
        experts dim, the groups over the other mesh axes (when the layer has a mesh)."""
        if self.mesh is None:
            return t
        rest = tuple(a for a in self.mesh.axis_names if a != self.expert_axis)
        spec = PartitionSpec(rest or None, self.expert_axis, None, None)
        return _Mark.apply(t, self.mesh, spec)


class _Mark(torch.autograd.Function):
    """``mark_sharding`` of a value and of its gradient: the backward's all-to-alls mirror
    the forward's."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, mesh: Mesh, spec: PartitionSpec) -> torch.Tensor:
        ctx.mesh, ctx.spec = mesh, spec
        return mark_sharding(t.view_as(t), mesh, spec)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if not torch.compiler.is_compiling():  # eager: a plain gradient (partita traces it)
            return grad, None, None
        return mark_sharding(grad, ctx.mesh, ctx.spec), None, None


class _Experts(nn.Module):
    """Every expert's MLP as 3-D weights ``[experts, in, out]`` (a module named ``experts``,
    whose ``w1``/``w2`` the presets recognise)."""

    def __init__(self, d: int, h: int, experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, d, h) / math.sqrt(d))
        self.w2 = nn.Parameter(torch.randn(experts, h, d) / math.sqrt(h))

    def forward(self, expert_in: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(torch.einsum("gecd,edh->gech", expert_in, self.w1))
        return torch.einsum("gech,ehd->gecd", hidden, self.w2)


@dataclass(frozen=True)
class ExpertLayer:
    """One ``experts`` module of a model under a preset, and what a step moves for it.

    Attributes:
        name: the module's path.
        experts: the experts it holds.
        weight_bytes: the bytes of its 3-D expert weights (all experts, unsharded).
        weight_bytes_per_device: those a device holds under the specs.
        all_to_alls, all_to_all_bytes: the all-to-alls that move its tokens to the experts
            and back (the dispatch and the combine, forward and backward: 4 for a
            ``GShardMoE`` under ``ep``) and their per-device bytes. The Plan's all-to-alls are
            shared evenly among the layers in order (a model whose only all-to-alls are its
            layers' dispatches and combines, as ``GShardMoE`` layers under ``ep``).
        routed_tokens: per expert, the rows the router sent it in the layer's last call
            (tokens x top-k choices; a ``GShardMoE``'s ``routed_tokens`` buffer), or None when
            the layer records none.
        kept_tokens: those within the expert's capacity (the others were dropped), or None.
    """

    name: str
    experts: int
    weight_bytes: int
    weight_bytes_per_device: int
    all_to_alls: int
    all_to_all_bytes: int
    routed_tokens: tuple[int, ...] | None = None
    kept_tokens: tuple[int, ...] | None = None

    @property
    def imbalance(self) -> float | None:
        """The load imbalance of the last call: the busiest expert's routed rows over the
        mean (1.0 is balanced; ``experts`` means one expert got every row), or None."""
        if not self.routed_tokens or sum(self.routed_tokens) == 0:
            return None
        return max(self.routed_tokens) * len(self.routed_tokens) / sum(self.routed_tokens)

    @property
    def dropped_tokens(self) -> int | None:
        """The rows past an expert's capacity in the last call (0 when dropless), or None."""
        if self.routed_tokens is None or self.kept_tokens is None:
            return None
        return sum(self.routed_tokens) - sum(self.kept_tokens)


def expert_report(
    plan: Plan,
    model: nn.Module,
    specs: dict[str, PartitionSpec],
    mesh: Mesh,
    buffers: Mapping[str, Any] | None = None,
) -> list[ExpertLayer]:
    """Per ``experts`` module of ``model``: expert weight bytes per device under ``specs``,
    the dispatch / combine all-to-alls of ``plan`` (a step's Plan) and the tokens per expert
    of the layer's last call (its parent's ``routed_tokens`` / ``kept_tokens`` buffers, as a
    ``GShardMoE`` records them), read from ``buffers`` (by name: a ``TrainStep``'s
    ``step.buffers``, full tensors or ShardedTensors) or else from the module itself (eager,
    the virtual device, or after ``step.sync_to_module()``)."""
    layers = [(n, m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] == "experts"]
    a2a = [c for c in plan.collectives if c.kind == "all_to_all"]
    per = len(a2a) // max(len(layers), 1)
    out = []
    for i, (name, module) in enumerate(layers):
        full = local = experts = 0
        for pname, p in module.named_parameters(recurse=False):
            if p.ndim != 3:
                continue
            experts = p.shape[0]
            spec = specs.get(f"{name}.{pname}", PartitionSpec())
            split = math.prod(mesh.axes_size(_axes(a)) for a in spec.entries if a is not None)
            full += p.numel() * p.element_size()
            local += p.numel() * p.element_size() // split
        mine = a2a[i * per : (i + 1) * per] if per else []
        moved = sum(c.bytes for c in mine)
        parent = name.rpartition(".")[0]
        routed, kept = (_counts(model, buffers, parent, k) for k in ("routed", "kept"))
        out.append(ExpertLayer(name, experts, full, local, len(mine), moved, routed, kept))
    return out


def _counts(
    model: nn.Module, buffers: Mapping[str, Any] | None, parent: str, kind: str
) -> tuple[int, ...] | None:
    """The ``{kind}_tokens`` buffer of module ``parent`` as Python ints, or None."""
    key = f"{parent}.{kind}_tokens" if parent else f"{kind}_tokens"
    value = None if buffers is None else buffers.get(key)
    if value is None:
        value = dict(model.named_buffers()).get(key)
    if value is None:
        return None
    full = value.full() if hasattr(value, "full") else value
    return tuple(int(v) for v in full.cpu().tolist())


def _axes(entry: Any) -> tuple[str, ...]:
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)
