"""The virtual device's cache-hit fast path: a step that repeats the previous one op by op.

Each test checks the results against the same code run eagerly on the CPU, unsharded, and
reads ``partita.metrics()``: how many steps took the fast path, and why a step left it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import partita
from partita import Mesh, P
from partita.virtual import recording
from partita.virtual import state as virtual_state

MESH = Mesh.create((2, 4), ("data", "model"))


@pytest.fixture(scope="module")
def dev() -> torch.device:
    return partita.use_spmd(MESH)


@pytest.fixture
def fresh(dev: torch.device) -> torch.device:
    """Empty step cache and metrics: each test counts its own compilations."""
    virtual_state.get().programs.clear()
    recording.forget_guides()
    partita.metrics(reset=True)
    return dev


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _train(model: nn.Module, dev: torch.device | None, steps: int) -> tuple[list[float], nn.Module]:
    """AdamW with an lr schedule, and a Python float of the loop's own that changes per step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    g = torch.Generator().manual_seed(3)
    losses = []
    for i in range(steps):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
        if dev is not None:
            x, y = x.to(dev), y.to(dev)
            partita.mark_sharding(x, MESH, P("data", None))
        scale = 1.0 + 0.25 * i  # changes every step: lifted, not baked into the program
        loss = ((model(x) - y) ** 2).mean() * scale
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        if dev is not None:
            partita.sync()
        losses.append(loss.item())
    return losses, model


def test_fast_path_equals_eager_with_an_lr_schedule(fresh: torch.device) -> None:
    ref = _mlp()
    model = copy.deepcopy(ref).to(fresh)
    partita.mark_sharding(model[0].weight, MESH, P("model", None))
    losses, model = _train(model, fresh, steps=6)
    ref_losses, ref = _train(ref, None, steps=6)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.cpu(), q.detach(), rtol=1e-5, atol=1e-5)
    m = partita.metrics()
    assert m.compiles == 1
    # Step 1 initialises AdamW's state (data, not recorded), so the steps from the third on
    # repeat their predecessor op by op.
    assert m.fast_path_hits >= 4, str(m)
    assert "fast_path_hits=" in str(m)


def test_a_changed_constant_leaves_the_fast_path_and_says_why(fresh: torch.device) -> None:
    x = torch.arange(12.0).reshape(4, 3)
    xd = x.to(fresh)
    for limit in (5.0, 5.0, 5.0, 7.0):
        torch.testing.assert_close(torch.clamp(xd, max=limit).cpu(), torch.clamp(x, max=limit))
    m = partita.metrics()
    assert m.fast_path_hits == 2
    assert m.compiles == 2
    assert len(m.fast_path_misses) == 1
    assert (
        "op 0 (aten.clamp.default): argument 2 is 7.0, the previous step had 5.0"
        in (m.fast_path_misses[0])
    )
    assert "left the fast path: op 0" in str(m)


def test_a_new_input_shape_leaves_the_fast_path_and_says_why(fresh: torch.device) -> None:
    for rows in (4, 4, 2):
        x = torch.arange(rows * 3.0).reshape(rows, 3)
        torch.testing.assert_close((x.to(fresh) * 2).cpu(), x * 2)
    (miss,) = partita.metrics().fast_path_misses
    assert miss.startswith("input 0 of the step is [2, 3] torch.float32"), miss
    assert "the previous step had [4, 3] torch.float32" in miss


def test_a_new_sharding_leaves_the_fast_path(fresh: torch.device) -> None:
    x = torch.arange(32.0).reshape(8, 4)
    for spec in (P("data", None), P("data", None), P(None, "model")):
        xd = partita.mark_sharding(x.to(fresh), MESH, spec)
        torch.testing.assert_close((xd + 1).cpu(), x + 1)
    m = partita.metrics()
    assert m.compiles == 2
    (miss,) = m.fast_path_misses
    assert "input 0 of the step is [8, 4] torch.float32 P(None, 'model')" in miss, miss


def test_alternating_steps_each_follow_their_own_predecessor(fresh: torch.device) -> None:
    # A loop alternating two programs (a training step, an evaluation) is guided by the step
    # that followed the same program last time.
    x = torch.arange(8.0).reshape(2, 4)
    xd = x.to(fresh)
    for _ in range(4):
        torch.testing.assert_close((xd * 2).sum().cpu(), (x * 2).sum())
        torch.testing.assert_close(torch.relu(xd - 3).cpu(), torch.relu(x - 3))
    m = partita.metrics()
    assert m.compiles == 2
    assert m.fast_path_hits >= 5, str(m)


def test_lerp_weight_is_lifted_on_either_side_of_one_half(fresh: torch.device) -> None:
    # lerp's formula depends on |weight| < 0.5: the branch is part of the step's key, the
    # weight itself a program input (an EMA whose decay changes every step compiles twice).
    a, b = torch.arange(6.0).reshape(2, 3), torch.full((2, 3), 10.0)
    ad, bd = a.to(fresh), b.to(fresh)
    for w in (0.1, 0.3, 0.7, 0.9):
        torch.testing.assert_close(ad.lerp(bd, w).cpu(), a.lerp(b, w))
    m = partita.metrics()
    assert m.compiles == 2
    assert m.fast_path_hits == 2
    assert m.fast_path_misses == ["op 0 (aten.lerp.Scalar): its keyword arguments changed"]


def test_a_miss_in_the_middle_of_a_step_records_the_rest_in_full(fresh: torch.device) -> None:
    # The ops before the difference were made from the guide, the ones after by shape
    # inference; the step is one program either way and equals eager.
    x = torch.arange(12.0).reshape(4, 3)
    xd = x.to(fresh)
    for dim in (0, 0, 1):
        y, ref = xd * 2 + 1, x * 2 + 1
        got = y.sum(dim=dim) - y.mean()
        torch.testing.assert_close(got.cpu(), ref.sum(dim=dim) - ref.mean())
    m = partita.metrics()
    assert (m.compiles, m.fast_path_hits) == (2, 1)
    (miss,) = m.fast_path_misses
    assert miss.startswith("op 2 (aten.sum.dim_IntList): argument 1 is [1]"), miss


def test_a_guide_is_found_only_for_the_program_that_ran_before_it() -> None:
    """Guides are keyed by ``id(program)``: once a program is gone (evicted, or the programs
    cleared), a new program can have its id, and must not get the old one's guide (the
    fast path would then check the step against another program's recording)."""
    from types import SimpleNamespace

    from partita.virtual import recording

    gone, new, guide = object(), object(), object()
    last = SimpleNamespace(program=new)
    device = SimpleNamespace(guides={id(new): (gone, guide)})  # an id reused by `new`
    assert recording._guide_after(device, last) is last
    device.guides = {id(new): (new, guide)}
    assert recording._guide_after(device, last) is guide


def test_a_freed_cpu_tensor_does_not_lend_its_copy_to_the_next(fresh: torch.device) -> None:
    """A CPU tensor an op reads is copied once per version, found again by ``id(t)``. One
    freed during the step gives its id to the next tensor allocated (CPython reuses the
    address at once), which must get its own copy: it used to read the freed one's values,
    a wrong answer that came and went with the allocator's state."""
    x = torch.zeros(4).to(fresh)
    outs = []
    for i in range(6):
        c = torch.full((4,), float(i))
        outs.append(x + c)
        del c
    assert [o.cpu().tolist() for o in outs] == [[float(i)] * 4 for i in range(6)]
    # The next step repeats the first one (the fast path) with other values: still right.
    x = torch.zeros(4).to(fresh)
    outs = []
    for i in range(6):
        c = torch.full((4,), float(10 + i))
        outs.append(x + c)
        del c
    assert [o.cpu().tolist() for o in outs] == [[float(10 + i)] * 4 for i in range(6)]
