"""Partial sums stay partial through linear ops and are reduced once (``propagate.linear``).

A matmul that contracts a split dim leaves each device one addend of its result. Adding two
such partial sums, viewing one, or scaling one by a replicated factor keeps the sum pending:
the Plan reduces the final value once instead of every operand. The recurrent case is the
reason: autograd adds one partial weight gradient per time step, so an LSTM's gradient
reductions per step would otherwise grow with the sequence (issue 32). Every case is checked
against the unsharded program.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import partita
from partita import Mesh, P
from partita.training import train_step

MESH = Mesh.create((4,), ("data",))


def _jit(fn: Callable[..., torch.Tensor], *args: torch.Tensor, specs: Any) -> Any:
    step = partita.jit(fn, mesh=MESH, in_specs=specs)
    return step, step.lower(*args)


def _reductions(plan: Any) -> int:
    return sum(1 for c in plan.collectives if c.kind in ("all_reduce", "reduce_scatter"))


def test_sum_of_partial_sums_is_reduced_once() -> None:
    """``x1 @ w1 + (x2 @ w2).t().t() * s - x3 @ w3``: three partial sums, one reduction."""
    g = torch.Generator().manual_seed(0)
    x1, x2, x3 = (torch.randn(6, 8, generator=g) for _ in range(3))
    w1, w2, w3 = (torch.randn(8, 5, generator=g) for _ in range(3))
    s = torch.randn(5, generator=g)

    def fn(*a: torch.Tensor) -> torch.Tensor:
        x1, x2, x3, w1, w2, w3, s = a
        return x1 @ w1 + (x2 @ w2).t().t() * s - x3 @ w3

    args = (x1, x2, x3, w1, w2, w3, s)
    split, whole = P(None, "data"), P("data", None)
    step, plan = _jit(fn, *args, specs=(split, split, split, whole, whole, whole, P()))
    assert _reductions(plan) == 1, plan.explain()
    assert plan.shardings["add"].partial == ("data",)  # the Plan shows the pending sum
    torch.testing.assert_close(step(*args).full(), fn(*args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("name", "fn"),
    [
        # p + r: r is whole on every device, so the sum would count it once per device
        ("partial + replicated", lambda p, r: p + r),
        # p * p is not linear in the addends
        ("partial * partial", lambda p, r: p * p),
        # r / p neither
        ("replicated / partial", lambda p, r: r / p),
        # 1 - p: a scalar is not an addend
        ("1 - partial", lambda p, r: 1 - p),
        # exp is not linear
        ("exp(partial)", lambda p, r: p.exp()),
    ],
)
def test_nonlinear_uses_reduce_first(name: str, fn: Callable[..., torch.Tensor]) -> None:
    g = torch.Generator().manual_seed(1)
    x, w, r = torch.randn(6, 8, generator=g), torch.randn(8, 5, generator=g), torch.randn(6, 5)

    def prog(x: torch.Tensor, w: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return fn(x @ w, r)

    step, plan = _jit(prog, x, w, r, specs=(P(None, "data"), P("data", None), P()))
    assert plan.shardings[plan_result_name(plan)].partial == (), name
    torch.testing.assert_close(step(x, w, r).full(), prog(x, w, r), rtol=1e-5, atol=1e-5)


def plan_result_name(plan: Any) -> str:
    """The name of the program's last op (its result)."""
    return list(plan.shardings)[-1]


def test_float16_partial_sums_are_reduced_before_adding() -> None:
    """Two float16 addends of one device can overflow where their sums would not."""
    x = torch.tensor([[30000.0, 30000.0], [-30000.0, -30000.0]]).half().t().contiguous()
    w = torch.ones(2, 1, dtype=torch.float16)

    def prog(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w + x @ w

    mesh = Mesh.create((2,), ("data",))
    step = partita.jit(prog, mesh=mesh, in_specs=(P(None, "data"), P("data", None)))
    plan = step.lower(x, w)
    assert plan.shardings["add"].partial == ()
    assert torch.isfinite(step(x, w).full()).all()


class LM(nn.Module):
    """A small recurrent language model (the issue's: about 70 K parameters with an LSTM)."""

    def __init__(self, kind: type[nn.Module] = nn.LSTM, vocab: int = 100, hidden: int = 88):
        super().__init__()
        self.embed = nn.Embedding(vocab, 64)
        self.rnn = kind(64, hidden, batch_first=True)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.embed(x))
        return self.out(h)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def lm_batches(seq: int, n: int, vocab: int = 100) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seq)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (16, seq), generator=g)
        out.append((ids, torch.roll(ids, -1, 1)))
    return out


def lm_opt(model: nn.Module) -> torch.optim.Optimizer:
    """SGD: AdamW divides by ``sqrt(v) + eps``, so a gradient element near zero moves its
    weight by ~``lr`` with either sign, and the order of the sums decides it (it does so for
    one weight of the LSTM here, sharded or not: ``tests/test_train_step.py`` explains)."""
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def lm_step(model: nn.Module, plan: str) -> Any:
    mesh = Mesh.create((8,), ("data",))
    return train_step(model, lm_loss, lm_opt(model), mesh=mesh, param_specs=plan)


def test_lstm_gradient_reductions_do_not_grow_with_the_sequence() -> None:
    """Under dp every weight gradient is reduced once per step, whatever the sequence length:
    the per-time-step contributions are added as partial sums first."""
    counts = {}
    for seq in (8, 32):
        torch.manual_seed(0)
        step = lm_step(LM(), "dp")
        counts[seq] = _reductions(step.lower(lm_batches(seq, 1)[0]))  # compiled, not run
    assert counts[8] == counts[32], counts


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU])
@pytest.mark.parametrize("plan", ["dp", "fsdp"])
def test_recurrent_lm_trains_as_unsharded(kind: type[nn.Module], plan: str) -> None:
    torch.manual_seed(0)
    model = LM(kind, vocab=20, hidden=16)
    ref = copy.deepcopy(model)
    assert_trains_as_unsharded(lm_step(model, plan), ref, lm_batches(5, 3, vocab=20))


def assert_trains_as_unsharded(step: Any, ref: nn.Module, batches: Any) -> None:
    """``step`` (a train_step of a copy of ``ref``) gives eager torch's losses on ``batches``
    and ends with its parameters (1e-5)."""
    opt = lm_opt(ref)
    for inputs, targets in batches:
        got = step((inputs, targets))
        opt.zero_grad()
        want = lm_loss(ref(inputs), targets)
        want.backward()
        opt.step()
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
    for name, p in step.full_parameters().items():
        torch.testing.assert_close(p, dict(ref.named_parameters())[name], rtol=1e-5, atol=1e-5)
