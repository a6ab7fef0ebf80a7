"""The hand-written mixture of experts on the virtual device: a pending ``nonzero`` / one-argument
``torch.where`` is recorded padded to a static bound (virtual/bounded.py), so a training loop
compiles its step once whatever the routing and equals eager torch.optim; any other use of the
padded indices reads their exact value."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import partita
from partita import Mesh
from partita.virtual import recording
from partita.virtual import state as virtual_state

from adamw_parity import AdamWParity  # isort: skip
from test_moe_dispatch import MixtralStyleMoE, WhereMoE, _batches  # isort: skip

MESH = Mesh.create((2, 4), ("data", "model"))


@pytest.fixture
def dev() -> torch.device:
    dev = partita.use_spmd(MESH)
    virtual_state.get().programs.clear()
    recording.forget_guides()
    partita.metrics(reset=True)
    return dev


@pytest.mark.parametrize("cls", [WhereMoE, MixtralStyleMoE])
def test_where_moe_compiles_once_and_trains_like_torch_optim(
    dev: torch.device, cls: type[nn.Module]
) -> None:
    torch.manual_seed(0)
    model = cls()
    ref = copy.deepcopy(model)
    model.to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    parity = AdamWParity(ref_opt, [n for n, _ in ref.named_parameters()], rtol=1e-5, atol=1e-5)
    for x, y in _batches(4):  # a different routing each step
        opt.zero_grad()
        loss = F.mse_loss(model(x.to(dev)), y.to(dev))
        loss.backward()
        opt.step()
        ref_opt.zero_grad()
        want = F.mse_loss(ref(x), y)
        want.backward()
        ref_opt.step()
        torch.testing.assert_close(loss.cpu(), want.detach(), rtol=1e-5, atol=1e-5)
        state = opt.state_dict()["state"]
        parity.after_step({i: {k: v.cpu() for k, v in s.items()} for i, s in state.items()})
    parity.check_parameters({name: p.cpu() for name, p in model.named_parameters()})
    assert partita.metrics().compiles == 1, partita.metrics().recompile_reasons


def test_other_uses_of_the_indices_read_their_exact_value(dev: torch.device) -> None:
    x = torch.randn(12, 4)
    d = x.to(dev)
    (rows,) = torch.where(d.sum(-1) > 0)  # pending mask: padded to 12 rows
    (want,) = torch.where(x.sum(-1) > 0)
    assert rows.shape == (12,)  # the bound, not the count
    torch.testing.assert_close((rows * 2).cpu(), want * 2)  # arithmetic: exact
    assert rows.max().item() == want.max().item()
    torch.testing.assert_close(rows.cpu(), want)  # .cpu(): exact
    torch.testing.assert_close(
        d[rows].cpu(), x[want].new_zeros(12, 4).index_copy(0, torch.arange(len(want)), x[want])
    )  # a gather: the true rows, then zeros for the padding


def test_a_data_mask_runs_at_once_exactly(dev: torch.device) -> None:
    mask = torch.tensor([True, False, True, False]).to(dev)  # data: its value is known now
    (rows,) = torch.where(mask)
    assert rows.shape == (2,)
    torch.testing.assert_close(rows.cpu(), torch.tensor([0, 2]))


def test_padded_indices_stay_masked_across_a_sync(dev: torch.device) -> None:
    """The padding is a property of the tensor, not of one step's recording: after a sync, a
    gather and an index_add by the same indices still keep it out of the numbers."""
    from partita.virtual.bounded import _BOUNDED

    x = torch.randn(10, 3)
    d = x.to(dev)
    (rows,) = torch.where(d[:, 0] > 0)
    partita.sync()
    (want,) = torch.where(x[:, 0] > 0)
    got = torch.zeros(10, 3, device=dev).index_add(0, rows, d[rows] * 2)
    torch.testing.assert_close(got.cpu(), torch.zeros(10, 3).index_add(0, want, x[want] * 2))
    assert _BOUNDED.live
    del rows, got
    import gc

    gc.collect()
    assert not _BOUNDED.live  # none alive: ops are not looked at any more
