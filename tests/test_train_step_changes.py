"""Changes to the model or the optimizer after ``train_step`` was built: the step owns the
training state, so each one a PyTorch loop would see is a TrainInputError naming it (they were
silently ignored), and the learning rate, which the step reads per call, is not."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from partita import Mesh
from partita.errors import TrainInputError
from partita.training import train_step

MESH = Mesh.create((2, 2), ("data", "model"))
BATCH = (torch.randn(8, 8), torch.randn(8, 4))


def _built() -> tuple[nn.Module, torch.optim.Optimizer, Callable[..., torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    step = train_step(model, F.mse_loss, opt, mesh=MESH, param_specs="fsdp")
    step(BATCH)
    return model, opt, step


def _replace_weight(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """A new Parameter under the name, its version counter the old one's: the snapshot's
    (requires_grad, version) pair alone matched, and the new weight was ignored."""
    old = model[0].weight
    new = torch.empty_like(old)
    while new._version < old._version:
        new.zero_()
    assert new._version == old._version
    model[0].weight = nn.Parameter(new)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda m, o: m[0].weight.requires_grad_(False), r"'0\.weight' was frozen"),
        (lambda m, o: o.param_groups[0].update(weight_decay=0.5), r"weight_decay '0' -> 'nonzero'"),
        (lambda m, o: o.param_groups[0].update(eps=1e-6), r"eps 1e-08 -> 1e-06"),
        (lambda m, o: m.load_state_dict(m.state_dict()), r"'0\.weight' of the module was written"),
        (lambda m, o: nn.init.zeros_(m[2].bias), r"'2\.bias' of the module was written in place"),
        (_replace_weight, r"'0\.weight' of the module was replaced by another tensor"),
    ],
    ids=["freeze", "weight_decay", "eps", "load_state_dict", "init", "replaced"],
)
def test_a_change_after_building_is_an_error(change: Callable[..., object], match: str) -> None:
    model, opt, step = _built()
    with torch.no_grad():
        change(model, opt)
    with pytest.raises(TrainInputError, match=match + r".*step\.load_state_dict"):
        step(BATCH)


def test_the_learning_rate_and_the_steps_own_writes_are_not_changes() -> None:
    _, opt, step = _built()
    opt.param_groups[0]["lr"] = 1e-3
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)  # adds initial_lr to the group
    step(BATCH)
    sched.step()
    step.sync_to_module()  # writes the module's parameters: the step's own write
    step.load_state_dict(step.state_dict())
    step(BATCH)
