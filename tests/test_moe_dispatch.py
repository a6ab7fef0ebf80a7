"""The hand-written mixture of experts: ``tok, slot = torch.where(idx == e)`` then
``index_add``. ``nonzero`` is traced padded to a static bound (capture/bounded.py), so it
compiles once under ``jit`` and ``train_step`` and trains under every preset equal to
``torch.optim``; the uses that would let the padding reach the numbers are CaptureErrors."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import partita
from partita import CaptureError, Mesh, P
from partita.training import train_step

from adamw_parity import AdamWParity  # isort: skip

MESH = Mesh.create((2, 4), ("data", "model"))
PLANS = ("dp", "fsdp", "tp", "fsdp+tp")


class WhereMoE(nn.Module):
    """Top-2 of 8 experts, each an MLP in an nn.ModuleList, routed by torch.where."""

    def __init__(self, d: int = 16, h: int = 32, experts: int = 8, k: int = 2) -> None:
        super().__init__()
        self.k = k
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, d)) for _ in range(experts)
        )
        self.head = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        probs = self.router(flat).softmax(-1)
        weights, idx = probs.topk(self.k, -1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(idx == e)
            if tok.numel() == 0:  # eager skips idle experts; traced, the bound is static
                continue
            out = out.index_add(0, tok, expert(flat[tok]) * weights[tok, slot, None])
        return self.head(out.reshape(b, t, d) + x)


class MixtralStyleMoE(WhereMoE):
    """transformers' eager Mixtral loop: one-hot expert mask, ``torch.where`` of its row,
    ``hidden[None, top_x]`` and ``index_add_`` in place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        probs = self.router(flat).softmax(-1)
        weights, idx = probs.topk(self.k, -1)
        out = torch.zeros_like(flat)
        mask = F.one_hot(idx, num_classes=len(self.experts)).permute(2, 1, 0)
        for e, expert in enumerate(self.experts):
            slot, top_x = torch.where(mask[e])
            state = flat[None, top_x].reshape(-1, d)
            y = expert(state) * weights[top_x, slot, None]
            out.index_add_(0, top_x, y.to(flat.dtype))
        return self.head(out.reshape(b, t, d) + x)


def _batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(4, 6, 16, generator=g), torch.randn(4, 6, 16, generator=g)) for _ in range(n)
    ]


def train_like_torch_optim(
    model: nn.Module,
    plan: Any,
    *,
    loss_fn: Any = F.mse_loss,
    batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    batch_spec: Any = None,
) -> Any:
    """Train ``model`` under ``plan`` beside a copy under ``torch.optim.AdamW`` (lr 1e-2, the
    default eps 1e-8): the loss of every step, AdamW's moments after every step (the mean and
    RMS of each gradient) and the final parameters agree to 1e-5, the parameters give or take
    what the moments' difference makes of AdamW's update (``tests/adamw_parity.py``: an update
    divides a gradient near zero by eps, so a gradient below eps, rounded in another order,
    moves its element by ~1e-5 in one step; its gradient is what is compared there). Returns
    the step."""
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    parity = AdamWParity(ref_opt, [n for n, _ in ref.named_parameters()], rtol=1e-5, atol=1e-5)
    step = train_step(model, loss_fn, opt, mesh=MESH, param_specs=plan, batch_spec=batch_spec)
    for x, y in _batches() if batches is None else batches:
        got = step((x, y))
        ref_opt.zero_grad()
        loss = loss_fn(ref(x), y)
        loss.backward()
        ref_opt.step()
        torch.testing.assert_close(got, loss.detach(), rtol=1e-5, atol=1e-5)
        parity.after_step(step.state_dict()["optimizer"]["state"])
    parity.check_parameters(step.full_parameters())
    return step


def _assert_trains_like_torch_optim(model: nn.Module, plan: str) -> None:
    assert train_like_torch_optim(model, plan).stats.signatures == 1


@pytest.mark.parametrize(
    "plan", [p if p == "fsdp+tp" else pytest.param(p, marks=pytest.mark.slow) for p in PLANS]
)
def test_where_moe_trains_like_torch_optim(plan: str) -> None:
    torch.manual_seed(0)
    _assert_trains_like_torch_optim(WhereMoE(), plan)


@pytest.mark.parametrize("plan", [pytest.param("dp", marks=pytest.mark.slow), "fsdp+tp"])
def test_mixtral_style_loop_trains_like_torch_optim(plan: str) -> None:
    torch.manual_seed(0)
    _assert_trains_like_torch_optim(MixtralStyleMoE(), plan)


def test_jit_compiles_once_whatever_the_routing() -> None:
    torch.manual_seed(0)
    model = WhereMoE().eval()
    step = partita.jit(model, mesh=MESH, in_specs=(P("data", None, None),))
    for x, _ in _batches(3):
        torch.testing.assert_close(step(x).full(), model(x), rtol=1e-5, atol=1e-5)
    assert step.stats.signatures == 1


def _idle_expert(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert 1 gets no row: eagerly its rows are empty tensors; traced, all padding."""
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    idx = (x.sum(-1) > 1e6).long()  # every row to expert 0
    (tok,) = torch.where(idx == 1)
    out = (x * 2).index_add(0, tok, x[tok] @ w)
    gx, gw = torch.autograd.grad(out.square().sum(), (x, w))
    return gx, gw


def test_an_idle_expert_gets_zero_gradient() -> None:
    x, w = torch.randn(8, 16), torch.randn(16, 16)
    got = partita.jit(_idle_expert, mesh=MESH, in_specs=(P("data", None), P()))(x, w)
    want = _idle_expert(x, w)
    assert torch.count_nonzero(want[1]) == 0
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.full(), b, rtol=1e-5, atol=1e-5)


def test_padded_indices_in_arithmetic_are_refused() -> None:
    def fn(mask: torch.Tensor) -> torch.Tensor:
        (rows,) = torch.where(mask)
        return rows * 2  # the padding (-1) would become -2

    step = partita.jit(fn, mesh=MESH, in_specs=(P(),))
    with pytest.raises(
        CaptureError,
        match=r"aten.mul.Tensor gets the indices of the nonzero .* at test_moe_dispatch.py:\d+ "
        r"in fn.*"
        r"is not a gather or an accumulating scatter.*nonzero_static",
    ):
        step(torch.tensor([True, False, True, True]))


def test_overwriting_by_padded_indices_is_refused() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        (rows,) = torch.where(x > 0)
        out = torch.zeros_like(x)
        out[rows] = x[rows]  # index_put without accumulate: padded rows would write row 0
        return out

    step = partita.jit(fn, mesh=MESH, in_specs=(P(),))
    with pytest.raises(CaptureError, match=r"writes by them without accumulate=True"):
        step(torch.randn(8))
