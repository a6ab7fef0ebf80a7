"""Faults of a training step: a captured step after its tensors change, threads, ``t.data``.

``partita.compile`` replays a captured step only while what it read is held as at the capture
(each change below makes the function run and be captured again, and the run equals eager
torch step for step); one compiled step, ``partita.jit`` and ``partita.train_step`` called
from several threads run their calls in turn, and two threads with their own ``jit`` or
``train_step`` train at once; ``t.data = x`` on the virtual device does what it does eagerly.
"""

from __future__ import annotations

import copy
import re
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the PyTorch convention
from torch import nn

import partita
from partita import Mesh, P
from partita.errors import VirtualDeviceError
from partita.virtual import sharded

from test_virtual_device_compiled import _eager_step, _same_params  # isort: skip

MESH = Mesh.create((2, 4), ("data", "model"))


@pytest.fixture(scope="module")
def dev() -> torch.device:
    return partita.use_spmd(MESH)


def _batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(n)]


class _Mode(nn.Module):
    """A layer that computes another thing in training and in eval mode."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) if self.training else torch.tanh(x)


def _models(dev: torch.device, mode: bool = False) -> tuple[nn.Module, Any, nn.Module, Any]:
    """A sharded MLP on the device with a capturable AdamW, and its eager twin."""
    torch.manual_seed(0)
    mid: nn.Module = _Mode() if mode else nn.ReLU()
    ref = nn.Sequential(nn.Linear(8, 16), mid, nn.Linear(16, 4))
    model = copy.deepcopy(ref).to(dev)
    partita.mark_sharding(model[0].weight, MESH, P("model", "data"))
    partita.mark_sharding(model[2].weight, MESH, P(None, "model"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    return model, opt, ref, ref_opt


def _compiled(dev: torch.device, model: nn.Module, opt: Any) -> tuple[Any, list[int]]:
    calls = [0]

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        loss = F.mse_loss(model(x.to(dev)), y.to(dev))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return partita.compile(train_step), calls


def _freeze(model: nn.Module, opt: Any) -> None:
    model[0].weight.requires_grad_(False)


def _swap(model: nn.Module, opt: Any) -> None:  # the optimizer keeps the old Parameter
    new = torch.ones(4, 16, device=model[2].bias.device) / 8  # frozen: no gradient kept
    model[2].weight = nn.Parameter(new, requires_grad=False)


def _set_data(model: nn.Module, opt: Any) -> None:
    model[2].weight.data = torch.ones(4, 16, device=model[2].bias.device) / 8


def _lr(model: nn.Module, opt: Any) -> None:
    for group in opt.param_groups:
        group["lr"] = 0.05


def _train_mode(model: nn.Module, opt: Any) -> None:
    model.eval()


def _opt_state(model: nn.Module, opt: Any) -> None:
    state = copy.deepcopy(opt.state_dict())
    for entry in state["state"].values():
        entry["exp_avg"] = entry["exp_avg"] * 3
    opt.load_state_dict(state)


CHANGES: dict[str, tuple[Callable[[nn.Module, Any], None], str]] = {
    "requires_grad_": (_freeze, "had requires_grad=True and now has False"),
    "parameter swapped": (_swap, "the Linear module holding tensors the step reads changed"),
    ".data replaced": (_set_data, r"was given another value \(t.data = x\)"),
    "lr set": (_lr, "the AdamW optimizer over tensors the step reads changed"),
    "eval()": (_train_mode, "the Sequential module holding tensors the step reads changed"),
    "optimizer load_state_dict": (_opt_state, "the AdamW optimizer over tensors"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_after_capture_runs_the_function_again(dev: torch.device, change: str) -> None:
    """Captured after 3 calls, replayed twice; then the change (made to the eager twin too):
    the function runs again, the line in partita.metrics() names the change, and every loss
    and parameter equals eager torch's."""
    apply, reason = CHANGES[change]
    model, opt, ref, ref_opt = _models(dev, mode=change == "eval()")
    step, calls = _compiled(dev, model, opt)
    for i, (x, y) in enumerate(_batches(9)):
        if i == 5:
            apply(model, opt)
            apply(ref, ref_opt)
            assert calls[0] == 3  # captured, two replays
        loss = step(x, y)
        assert loss.item() == pytest.approx(_eager_step(ref, ref_opt, x, y), abs=1e-5), (change, i)
        if i == 5:
            line = partita.metrics().compiled_steps["train_step"]
            assert line.startswith("capture dropped: "), line
            assert re.search(reason, line), line
            assert calls[0] == 4
    _same_params(model, ref)
    assert calls[0] == 6, "after the change: captured again after 3 calls"


def test_loading_a_checkpoint_needs_no_reset(dev: torch.device) -> None:
    """partita.checkpoint.load (model and optimizer) into a captured step: the next calls train
    from the loaded values, as eager does after load_state_dict, without step.reset()."""
    model, opt, ref, ref_opt = _models(dev)
    step, calls = _compiled(dev, model, opt)
    path = tempfile.mkdtemp()
    saved: tuple[Any, Any] = ({}, {})
    for i, (x, y) in enumerate(_batches(10)):
        if i == 2:
            partita.checkpoint.save(model, path, optimizer=opt)
            saved = copy.deepcopy(ref.state_dict()), copy.deepcopy(ref_opt.state_dict())
        if i == 6:
            assert calls[0] == 3
            partita.checkpoint.load(model, path, optimizer=opt)
            ref.load_state_dict(saved[0])
            ref_opt.load_state_dict(saved[1])
        loss = step(x, y)
        assert loss.item() == pytest.approx(_eager_step(ref, ref_opt, x, y), abs=1e-5), i
    _same_params(model, ref)
    assert calls[0] > 3


def test_module_load_state_dict_is_read_by_the_replay(dev: torch.device) -> None:
    """Module.load_state_dict copies into the same tensors: the replay reads the new values."""
    model, opt, ref, ref_opt = _models(dev)
    step, calls = _compiled(dev, model, opt)
    for i, (x, y) in enumerate(_batches(7)):
        assert i < 5 or calls[0] == 3  # replayed
        if i == 5:
            new = {k: v * 0.5 for k, v in ref.state_dict().items()}
            model.load_state_dict(new)
            ref.load_state_dict(new)
        loss = step(x, y)
        assert loss.item() == pytest.approx(_eager_step(ref, ref_opt, x, y), abs=1e-5), i
    _same_params(model, ref)


def test_autocast_around_a_captured_call_runs_the_function_again(dev: torch.device) -> None:
    """A function captured in float32 and then called under torch.autocast (or no_grad) is
    another signature: it runs and returns what eager autocast gives, not the float32 replay."""
    torch.manual_seed(0)
    ref = nn.Linear(8, 4)
    model = copy.deepcopy(ref).to(dev)
    partita.mark_sharding(model.weight, MESH, P("model", None))
    calls = [0]

    @partita.compile
    def forward(x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return model(x.to(dev)) * 1

    x = torch.randn(4, 8)
    for _ in range(4):
        torch.testing.assert_close(forward(x).cpu(), ref(x), atol=1e-6, rtol=1e-6)
    assert calls[0] == 3
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        got = forward(x).cpu()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = ref(x)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want.detach(), atol=1e-2, rtol=2e-2)  # bfloat16 roundings
    with torch.no_grad():
        torch.testing.assert_close(forward(x).cpu(), ref(x), atol=1e-6, rtol=1e-6)
    assert calls[0] == 5


def _in_threads(fn: Callable[[int], None], n: int = 2) -> None:
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            fn(k)
        except BaseException as e:  # re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread did not finish in 300 s"
    if errors:
        raise errors[0]


def test_one_compiled_step_from_two_threads(dev: torch.device) -> None:
    """2 threads x 4 calls of one compiled step are 8 optimizer steps (the calls run in turn):
    the same batch each time, so the result is eager's 8 steps whatever the order."""
    model, opt, ref, ref_opt = _models(dev)
    step, calls = _compiled(dev, model, opt)
    x, y = _batches(1)[0]
    losses: list[float] = []

    def four(k: int) -> None:
        for _ in range(4):
            losses.append(step(x, y).item())  # read while the other thread's call runs

    _in_threads(four)
    eager = [_eager_step(ref, ref_opt, x, y) for _ in range(8)]
    assert sorted(losses) == pytest.approx(sorted(eager), abs=1e-5)
    _same_params(model, ref)
    assert all(float(s["step"].cpu()) == 8 for s in opt.state.values())
    assert calls[0] == 3


def test_two_threads_train_their_own_models_on_the_device(dev: torch.device) -> None:
    """Two threads each train their own model on the virtual device at once (no compile,
    reading the loss every step): their ops share the one recording, one at a time, and every
    loss and parameter equals the thread's eager twin."""

    def train(k: int) -> None:
        model, opt, ref, ref_opt = _models(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for x, y in _batches(4, seed=k):
            loss = F.mse_loss(model(x.to(dev)), y.to(dev))
            loss.backward()
            opt.step()
            opt.zero_grad()
            assert loss.item() == pytest.approx(_eager_step(ref, ref_opt, x, y), abs=1e-5), k
        _same_params(model, ref)

    _in_threads(train)


def _f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w).sum(0)


def test_jit_from_two_threads() -> None:
    """One jit called from two threads (compiling two signatures), then two threads each with
    their own jit at once: every result equals eager."""
    mesh = Mesh.create((2,), ("data",))
    shared = partita.jit(_f, mesh=mesh, in_specs=(P("data", None), P()))

    def calls(k: int, j: Any = None) -> None:
        g = torch.Generator().manual_seed(k)
        for i in range(4):
            own = j or partita.jit(_f, mesh=mesh, in_specs=(P("data", None), P()))
            x, w = torch.randn(8 + 2 * (i % 2), 4 + k, generator=g), torch.randn(4 + k, 4)
            torch.testing.assert_close(own(x, w).full(), _f(x, w))

    _in_threads(lambda k: calls(k, shared))
    _in_threads(calls)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_train_step_from_two_threads() -> None:
    """Two threads each with their own train_step train at once, and one train_step called
    from two threads takes 2 x 2 steps: each equals torch.optim on one device."""
    mesh = Mesh.create((2,), ("data",))
    batch = (torch.randn(8, 8), torch.randn(8, 4))

    def eager(steps: int) -> nn.Module:
        ref = _mlp()
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for _ in range(steps):
            F.mse_loss(ref(batch[0]), batch[1]).backward()
            opt.step()
            opt.zero_grad()
        return ref

    def new_step() -> Any:
        model = _mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return partita.train_step(model, F.mse_loss, opt, mesh=mesh)

    steps = [new_step(), new_step()]

    def train(k: int, step: Any = None) -> None:
        for _ in range(2):
            (step or steps[k])(batch)

    _in_threads(train)
    shared = new_step()
    _in_threads(lambda k: train(k, shared))
    for s, n in ((steps[0], 2), (steps[1], 2), (shared, 4)):
        ref = eager(n)
        for name, q in ref.named_parameters():
            torch.testing.assert_close(s.params[name].full(), q, atol=1e-5, rtol=1e-5)


def test_data_assignment_shares_the_value(dev: torch.device) -> None:
    """t.data = x (and t.set_(x)): t holds x's value, shape and dtype (x's later in-place
    updates show in t), for plain and sharded tensors, pending or not; a module parameter's
    .data reassignment is what the next forward reads; a CPU value is refused with the fix."""
    t = torch.zeros(4, 2).to(dev)
    partita.mark_sharding(t, MESH, P("data", None))
    x = torch.arange(8.0).reshape(4, 2).to(dev)
    partita.mark_sharding(x, MESH, P(None, "model"))
    t.data = x
    torch.testing.assert_close(t.cpu(), torch.arange(8.0).reshape(4, 2))
    x.add_(1)
    torch.testing.assert_close(t.cpu(), torch.arange(8.0).reshape(4, 2) + 1)
    t.data = (x * 2).half()  # pending, another dtype and sharding kept
    assert t.dtype == torch.float16
    torch.testing.assert_close(t.cpu(), ((torch.arange(8.0).reshape(4, 2) + 1) * 2).half())
    t.data = torch.ones(3).to(dev)  # another shape
    assert t.shape == (3,)
    torch.testing.assert_close(t.cpu(), torch.ones(3))
    y = torch.arange(5.0).to(dev)
    t.set_(y)  # the same as t.data = y
    y.mul_(2)
    assert t.shape == (5,)
    torch.testing.assert_close(t.cpu(), torch.arange(5.0) * 2)

    ref = nn.Linear(4, 2)
    model = copy.deepcopy(ref).to(dev)
    partita.mark_sharding(model.weight, MESH, P("model", None))
    new = torch.randn(2, 4)
    ref.weight.data = new.clone()
    model.weight.data = new.to(dev)
    assert isinstance(model.weight, nn.Parameter) and model.weight.requires_grad
    inp = torch.randn(3, 4)
    torch.testing.assert_close(model(inp.to(dev)).cpu(), ref(inp))
    assert sharded(model.weight).sharding.spec == P(None, None)  # new's layout, as in eager

    with pytest.raises(VirtualDeviceError, match=r"t.data = x: t \(\[2, 4\] torch.float32\) is"):
        model.weight.data = torch.zeros(2, 4)
