"""Schedulers that move betas or momentum (OneCycleLR, CyclicLR) train as with torch.optim."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import partita
from partita import Mesh
from partita.errors import TrainInputError

MESH = Mesh.create((2, 2), ("data", "model"))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def _run(make_opt, make_sched, steps: int = 6, build_sched_first: bool = True):
    model = _model()
    ref = copy.deepcopy(model)
    opt, ref_opt = make_opt(model), make_opt(ref)
    sched = make_sched(opt) if build_sched_first else None
    step = partita.train_step(model, F.mse_loss, opt, mesh=MESH, param_specs="fsdp")
    sched = sched or make_sched(opt)  # a scheduler built after the step adds its group keys
    ref_sched = make_sched(ref_opt)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
        loss = step((x, y))
        ref_loss = F.mse_loss(ref(x), y)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        sched.step()
        ref_sched.step()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-6, atol=1e-6)
    full = step.full_parameters()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=1e-5, atol=1e-6)
    return opt


@pytest.mark.parametrize("build_sched_first", [True, False])
def test_one_cycle_cycles_adams_beta1(build_sched_first: bool) -> None:
    opt = _run(
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=8),
        build_sched_first=build_sched_first,
    )
    assert opt.param_groups[0]["betas"][0] != 0.95  # it did move


def test_cyclic_lr_cycles_sgd_momentum_per_group() -> None:
    def make_opt(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(
            [{"params": m[0].parameters()}, {"params": m[2].parameters(), "momentum": 0.5}],
            lr=0.05, momentum=0.9, nesterov=True,
        )  # fmt: skip

    def make_sched(o: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.CyclicLR(
            o, base_lr=0.01, max_lr=0.1, step_size_up=2, base_momentum=0.6, max_momentum=0.95
        )

    _run(make_opt, make_sched)


def test_momentum_switched_off_is_still_a_change_the_step_refuses() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = partita.train_step(model, F.mse_loss, opt, mesh=MESH, param_specs="fsdp")
    step((torch.randn(8, 8), torch.randn(8, 4)))
    opt.param_groups[0]["momentum"] = 0.5  # a new value: read at the next call
    step((torch.randn(8, 8), torch.randn(8, 4)))
    opt.param_groups[0]["momentum"] = 0.0  # no buffer any more: another update
    with pytest.raises(TrainInputError, match=r"momentum 'nonzero' -> '0'"):
        step((torch.randn(8, 8), torch.randn(8, 4)))


@pytest.mark.parametrize("kind", ["adamw", "adam", "sgd"])
def test_a_weight_decay_schedule_set_in_the_loop(kind: str) -> None:
    """DINO-style: ``param_group["weight_decay"] = schedule[it]`` before every step."""
    schedule = [0.04, 0.1, 0.2, 0.3, 0.4, 0.5]

    def make_opt(m: nn.Module) -> torch.optim.Optimizer:
        if kind == "sgd":
            return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=0.04)
        cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
        return cls(m.parameters(), lr=1e-2, weight_decay=0.04)

    class WeightDecaySchedule:
        def __init__(self, opt: torch.optim.Optimizer) -> None:
            self.opt, self.it = opt, 0

        def step(self) -> None:
            self.it += 1
            for group in self.opt.param_groups:
                group["weight_decay"] = schedule[self.it]

    _run(make_opt, WeightDecaySchedule, steps=5)


@pytest.mark.parametrize("how", ["state_dict", "checkpoint"])
def test_resuming_a_one_cycle_run_restores_the_cycled_betas(how: str, tmp_path) -> None:
    """Saved mid-cycle, loaded into a fresh step: the next update uses the saved betas."""
    import partita.checkpoint as ckpt

    def make(model: nn.Module):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=8)
        return opt, sched

    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(6)]
    ref = _model()
    ref_opt, ref_sched = make(ref)
    for x, y in batches:
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_sched.step()
    model = _model()
    opt, sched = make(model)
    step = partita.train_step(model, F.mse_loss, opt, mesh=MESH, param_specs="fsdp")
    for x, y in batches[:3]:
        step((x, y))
        sched.step()
    saved = step.state_dict()
    if how == "checkpoint":
        ckpt.save(step, tmp_path / "run", scheduler=sched)
    model2 = _model()
    opt2, sched2 = make(model2)
    step2 = partita.train_step(model2, F.mse_loss, opt2, mesh=MESH, param_specs="fsdp")
    if how == "checkpoint":
        ckpt.load(step2, tmp_path / "run", scheduler=sched2)
    else:
        step2.load_state_dict(saved)
        sched2.load_state_dict(sched.state_dict())
    assert opt2.param_groups[0]["betas"] == opt.param_groups[0]["betas"]
    for x, y in batches[3:]:
        step2((x, y))
        sched2.step()
    full = step2.full_parameters()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=1e-5, atol=1e-6)
