"""A recurrent model's collectives per training step do not grow with its sequence (issue 32).

The causes, each with its own case (all checked against the unsharded program):

* ``nn.LSTM`` concatenates its per-step outputs ``[B, H]`` into ``[T*B, H]`` and views that as
  ``[T, B, H]`` (and autograd does the same with the gradients): capture turns the pair into a
  stack (``capture/stack.py``), which keeps the batch split with no collective.
* ``[T, B, E] -> [T*B, E]`` with ``B`` split cannot keep ``B``'s split: the split moves to
  ``T`` (one all_to_all) instead of the merged value being computed whole on every device.
* Under FSDP a lookup follows its (batch-split) indices and the table is gathered, instead of
  splitting the embedding dim and with it every step's hidden state.
* Under FSDP the per-step weight-gradient addends stay partial sums and are reduce-scattered
  once, though the optimizer wants the total split.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import partita
from partita import Mesh, P
from partita.training import train_step
from test_partial_sums import LM, assert_trains_as_unsharded, lm_batches, lm_loss, lm_opt

MESH = Mesh.create((4,), ("data",))


def _mesh(plan: str) -> Mesh:
    if plan == "fsdp+tp":
        return Mesh.create((2, 4), ("data", "model"))
    return Mesh.create((8,), ("data",))


def _kinds(plan: Any) -> list[str]:
    return [c.kind for c in plan.collectives]


@pytest.mark.parametrize("plan", ["dp", "fsdp", "fsdp+tp"])
def test_lstm_collectives_do_not_grow_with_the_sequence(plan: str) -> None:
    """The bench's model (``bench/bench_lstm.py``): the same collectives at 8, 16 and 32 steps.
    Before the fixes: 26/40/68 (dp), 180/347/681 (fsdp), 158/298/578 (fsdp+tp)."""
    counts = {}
    for seq in (8, 16, 32):
        torch.manual_seed(0)
        model = LM()
        step = train_step(model, lm_loss, lm_opt(model), mesh=_mesh(plan), param_specs=plan)
        counts[seq] = sorted(_kinds(step.lower(lm_batches(seq, 1)[0])))  # compiled, not run
    assert counts[8] == counts[16] == counts[32], {s: len(c) for s, c in counts.items()}


@pytest.mark.parametrize("kind", [torch.nn.GRU, torch.nn.RNN])
def test_gru_and_rnn_collectives_do_not_grow_under_fsdp(kind: type[torch.nn.Module]) -> None:
    """Before: 159/302 (GRU) and 61/108 (RNN) collectives at 8/16 steps."""
    counts = {}
    for seq in (8, 16):
        torch.manual_seed(0)
        model = LM(kind)
        step = train_step(model, lm_loss, lm_opt(model), mesh=_mesh("fsdp"), param_specs="fsdp")
        counts[seq] = sorted(_kinds(step.lower(lm_batches(seq, 1)[0])))  # compiled, not run
    assert counts[8] == counts[16], {s: len(c) for s, c in counts.items()}


def test_recurrent_lm_trains_as_unsharded_under_fsdp_tp() -> None:
    torch.manual_seed(0)
    model = LM(torch.nn.LSTM, vocab=20, hidden=16)
    ref = LM(torch.nn.LSTM, vocab=20, hidden=16)
    ref.load_state_dict(model.state_dict())
    step = train_step(model, lm_loss, lm_opt(model), mesh=_mesh("fsdp+tp"), param_specs="fsdp+tp")
    assert_trains_as_unsharded(step, ref, lm_batches(6, 3, vocab=20))


def test_cat_of_steps_viewed_back_keeps_the_batch_split() -> None:
    """``cat`` of batch-split ``[B, H]`` steps along dim 0, viewed as ``[T, B, H]``: a stack,
    no collective (it re-tiled every step's rows before)."""
    x = torch.randn(5, 8, 6)

    def fn(x: torch.Tensor) -> torch.Tensor:
        steps = [torch.tanh(x[t]) * (t + 1) for t in range(x.shape[0])]
        return torch.cat(steps, 0).view(x.shape[0], x.shape[1], -1)

    step = partita.jit(fn, mesh=MESH, in_specs=(P(None, "data", None),))
    plan = step.lower(x)
    assert plan.collectives == [], plan.explain()
    out = step(x)
    assert out.sharding.spec == P(None, "data", None)
    torch.testing.assert_close(out.full(), fn(x))


def test_cat_with_another_use_keeps_its_value() -> None:
    """The cat stays for a use that is not the reshape; both results equal unsharded."""
    x = torch.randn(3, 8, 4)

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = torch.cat([x[0], x[1] * 2, x[2] - 1], 0)
        return c.view(3, 8, 4), c.sum(0)

    step = partita.jit(fn, mesh=MESH, in_specs=(P(None, "data", None),))
    a, b = step(x)
    want_a, want_b = fn(x)
    torch.testing.assert_close(a.full(), want_a)
    torch.testing.assert_close(b.full(), want_b)


def test_time_major_merge_moves_the_split_to_time() -> None:
    """``[T, B, E] -> [T*B, E]`` with ``B`` split, then a matmul: the split moves to ``T`` (one
    all_to_all), the matmul runs on a split of the rows (before: gathered, computed whole)."""
    x, w = torch.randn(8, 12, 6), torch.randn(6, 5)

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.relu(x.reshape(-1, 6) @ w)

    step = partita.jit(fn, mesh=MESH, in_specs=(P(None, "data", None), P()))
    plan = step.lower(x, w)
    assert _kinds(plan) == ["all_to_all"], plan.explain()
    out = step(x, w)
    assert out.sharding.spec == P("data", None)
    torch.testing.assert_close(out.full(), fn(x, w))


def test_fsdp_lookup_follows_its_indices() -> None:
    """A table split over ``data`` along its columns meets batch-split ids: the lookup keeps
    the batch split and the table is gathered (before: the embedding dim was split)."""
    table, ids = torch.randn(10, 8), torch.randint(0, 10, (8, 3))

    def fn(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, table) * 2

    step = partita.jit(fn, mesh=MESH, in_specs=(P(None, "data"), P("data", None)))
    out = step(table, ids)
    assert out.sharding.spec == P("data", None, None)
    torch.testing.assert_close(out.full(), fn(table, ids))


def test_split_gradient_of_a_loop_is_reduce_scattered_once() -> None:
    """``w - sum_t x_t^T y_t`` with ``w`` split over ``data`` (an FSDP update): each addend
    contracts the batch (a partial sum); they are added as partial sums and the total is
    reduce-scattered once (before: once per addend)."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(8, 6, generator=g) for _ in range(5)]
    ys = [torch.randn(8, 4, generator=g) for _ in range(5)]
    w = torch.randn(6, 4, generator=g)

    def fn(w: torch.Tensor, *xy: torch.Tensor) -> torch.Tensor:
        grad = xy[0].t() @ xy[5]
        for t in range(1, 5):
            grad = grad + xy[t].t() @ xy[5 + t]
        return w - 0.1 * grad

    specs = (P("data", None), *[P("data", None)] * 10)
    step = partita.jit(fn, mesh=MESH, in_specs=specs)
    plan = step.lower(w, *xs, *ys)
    assert _kinds(plan) == ["reduce_scatter"], plan.explain()
    torch.testing.assert_close(step(w, *xs, *ys).full(), fn(w, *xs, *ys), rtol=1e-5, atol=1e-5)
