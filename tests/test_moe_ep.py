"""Expert parallelism: the ``ep`` / ``fsdp+ep`` presets and GShard's all-to-all dispatch.

On the (2, 4) mesh with 8 experts: the ``ep`` presets keep each expert's weights whole and
split the experts over ``model`` (a quarter of the expert bytes per device); the GShard layer
(``partita.models.moe``) with its tokens split over all 8 devices moves its dispatched tokens
to their experts with one all-to-all and back with another, forward and backward, and trains
equal to the unsharded program."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from partita import Mesh, P
from partita.errors import ArgumentError
from partita.models.moe import GShardMoE, capacity, expert_report
from partita.presets import StandardPreset, param_specs
from partita.training import train_step

from test_moe_dispatch import train_like_torch_optim  # isort: skip

MESH = Mesh.create((2, 4), ("data", "model"))
TOKENS = P(("data", "model"))  # GShard: the groups over every device
D, H, E = 16, 32, 8
G, S = 8, 8  # 8 groups (one per device) of 8 tokens


class Net(nn.Module):
    """Linear -> GShard MoE (residual) -> Linear; the loss adds the router's auxiliary loss."""

    def __init__(self, top_k: int = 1, capacity_factor: float | None = 1.0, ep: bool = True):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.moe = GShardMoE(D, H, E, top_k, capacity_factor, mesh=MESH if ep else None)
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, aux = self.moe(self.inp(x))
        return self.out(y), aux


def loss_fn(out: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    y, aux = out
    return F.mse_loss(y, target) + 0.01 * aux


def _batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(G, S, D, generator=g), torch.randn(G, S, D, generator=g)) for _ in range(n)
    ]


def _train(model: nn.Module, plan: Any) -> Any:
    return train_like_torch_optim(
        model, plan, loss_fn=loss_fn, batches=_batches(), batch_spec=TOKENS
    )


def test_ep_presets_split_whole_experts() -> None:
    model = Net()
    ep = param_specs("ep", model, MESH)
    assert ep["moe.experts.w1"] == P("model", None, None)
    assert ep["moe.experts.w2"] == P("model", None, None)
    assert ep["inp.weight"] == P(None, None) and ep["moe.router.weight"] == P(None, None)
    fsdp_ep = param_specs("fsdp+ep", model, MESH)
    assert fsdp_ep["moe.experts.w1"] == P("model", None, "data")  # the largest free dim
    assert fsdp_ep["inp.weight"] == P("data", None)
    other = StandardPreset("ep", expert_axis="data")
    assert param_specs(other, model, MESH)["moe.experts.w2"] == P("data", None, None)


def test_ep_preset_names_a_missing_expert_axis() -> None:
    with pytest.raises(ArgumentError, match=r"expert mesh axis named 'experts'.*expert_axis="):
        param_specs(StandardPreset("ep", expert_axis="experts"), Net(), MESH)


@pytest.mark.parametrize("plan", ["ep", "fsdp+ep"])
def test_gshard_moe_expert_parallel_trains_like_unsharded(plan: str) -> None:
    torch.manual_seed(0)
    step = _train(Net(), plan)
    # a quarter of the experts' bytes per device (whole experts, 8 over model=4)
    for name in ("moe.experts.w1", "moe.experts.w2"):
        p = step.params[name]
        local = math.prod(p.local_shape) * p.dtype.itemsize
        want = math.prod(p.shape) * p.dtype.itemsize // 4
        assert local == (want if plan == "ep" else want // 2), name
    # the dispatch and the combine: one all-to-all each, forward and backward
    a2a = [c for c in step.plan.collectives if c.kind == "all_to_all"]
    assert len(a2a) == 4, [c.reason for c in a2a]
    assert all(c.mesh_axes == ("model",) for c in a2a)
    # top-1, capacity factor 1, 8 experts, 8 tokens per group: E x C = S, so each moves every
    # token's hidden vector once: tokens x hidden x 4 bytes over the 8 devices
    assert capacity(S, E, 1, 1.0) * E == S
    for c in a2a:
        assert c.bytes * MESH.size == G * S * D * 4
    (layer,) = expert_report(step.plan, step.model, param_specs(plan, step.model, MESH), MESH)
    assert (layer.name, layer.experts, layer.all_to_alls) == ("moe.experts", 8, 4)
    assert layer.weight_bytes == 2 * E * D * H * 4
    assert layer.weight_bytes_per_device == layer.weight_bytes // (4 if plan == "ep" else 8)
    assert layer.all_to_all_bytes == 4 * G * S * D * 4 // MESH.size


@pytest.mark.slow
def test_dropless_top2_expert_parallel_trains_like_unsharded() -> None:
    torch.manual_seed(0)
    _train(Net(top_k=2, capacity_factor=None), "ep")


def test_without_the_annotation_the_expert_weights_are_gathered() -> None:
    """The same layer with no mesh: correct, but propagation gathers the experts instead."""
    torch.manual_seed(0)
    step = _train(Net(ep=False), "ep")
    kinds = [c.kind for c in step.plan.collectives]
    assert "all_gather" in kinds


def test_expert_report_gives_the_load_of_the_last_step() -> None:
    """The tokens per expert a step's router sent (and kept within capacity), read from the
    TrainStep's buffers: equal to the same forward run eagerly; imbalance = max / mean."""
    torch.manual_seed(0)
    model = Net(top_k=2, capacity_factor=1.0)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = train_step(model, loss_fn, opt, mesh=MESH, param_specs="ep", batch_spec=TOKENS)
    x, y = _batches(1)[0]
    step((x, y))
    ref(x)
    specs = param_specs("ep", model, MESH)
    (layer,) = expert_report(step.plan, model, specs, MESH, buffers=step.buffers)
    want_routed = tuple(ref.moe.routed_tokens.tolist())
    want_kept = tuple(ref.moe.kept_tokens.tolist())
    assert (layer.routed_tokens, layer.kept_tokens) == (want_routed, want_kept)
    assert sum(want_routed) == G * S * 2  # every token's two choices
    assert layer.imbalance == pytest.approx(max(want_routed) / (G * S * 2 / E))
    assert layer.dropped_tokens == sum(want_routed) - sum(want_kept)
    assert layer.dropped_tokens > 0  # capacity factor 1 at top-2 drops some
    # without the step's buffers: the module's own (not updated by the step: zeros)
    (unsynced,) = expert_report(step.plan, model, specs, MESH)
    assert unsynced.routed_tokens == (0,) * E and unsynced.imbalance is None
    step.sync_to_module()
    (synced,) = expert_report(step.plan, model, specs, MESH)
    assert synced.routed_tokens == want_routed


def test_expert_report_without_recorded_load() -> None:
    """A layer that records no load (experts in a plain module) reports None."""
    from partita.models.moe import ExpertLayer

    layer = ExpertLayer("experts", 4, 0, 0, 0, 0)
    assert (layer.routed_tokens, layer.imbalance, layer.dropped_tokens) == (None, None, None)
