"""What eager autograd does around a model's parameters, kept by ``train_step``: gradient hooks
on parameters and gradients that a nested ``.backward()`` accumulates into ``.grad``. Each is
trained against the same model with ``torch.optim``."""

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


def _trains_like_torch(make: Callable[[], nn.Module], shard: str = "fsdp+tp") -> None:
    """``make()`` twice (hooks do not survive copy.deepcopy): one for torch, one for partita."""
    ref, model = make(), make()
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    step = train_step(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), mesh=MESH,
                      param_specs=shard)  # fmt: skip
    for _ in range(2):
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        opt.step()
        step((x, y))
    got = step.full_parameters()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p, msg=name)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_parameter_gradient_hooks_run() -> None:
    """``p.register_hook`` (a gradient scaled or masked) was ignored: the step differentiates
    leaves that stand for the parameters, and the hooks live on the Parameters."""
    mask = torch.ones(4, 16)
    mask[1] = 0

    def make() -> nn.Module:
        model = _mlp()
        model[0].weight.register_hook(lambda g: g * 0.5)
        model[2].weight.register_hook(lambda g: g * mask)  # one output row frozen
        return model

    _trains_like_torch(make)


def test_a_post_accumulate_grad_hook_is_refused() -> None:
    def make() -> nn.Module:
        model = _mlp()
        model[0].bias.register_post_accumulate_grad_hook(lambda p: None)
        return model

    with pytest.raises(TrainInputError, match=r"'0\.bias' has a post-accumulate-grad hook"):
        _trains_like_torch(make)


class _Recompute(torch.autograd.Function):
    """A reversible-layer style Function: the backward recomputes its layer and calls
    ``.backward()`` on it, so the layer's parameters get their gradient in ``.grad``."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, layer: Callable[..., torch.Tensor]) -> torch.Tensor:
        ctx.layer = layer  # type: ignore[attr-defined]
        ctx.save_for_backward(x)  # type: ignore[attr-defined]
        with torch.no_grad():
            return layer(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        (x,) = ctx.saved_tensors  # type: ignore[attr-defined]
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            ctx.layer(x).backward(grad)  # type: ignore[attr-defined]
        return x.grad, None


class _Reversible(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre, self.mid, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(_Recompute.apply(self.pre(x), self.mid))


def test_gradients_a_nested_backward_accumulates_are_used() -> None:
    """``mid``'s gradient reaches eager only through ``.grad`` (the nested backward): the step
    took it for an unused parameter and never updated it (Reformer's reversible layers)."""
    _trains_like_torch(_Reversible, shard="dp")
