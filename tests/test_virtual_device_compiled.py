"""``partita.compile(step_fn)``: a step captured once it repeats, then replayed without Python.

Every run is checked against the same loop run eagerly on the CPU, unsharded. The function's
calls are counted with a Python counter: a replay does not run it (the documented semantics).
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the PyTorch convention
from torch import nn

import partita
from partita import Mesh, P
from partita.virtual import recording
from partita.virtual import state as virtual_state

MESH = Mesh.create((2, 4), ("data", "model"))


@pytest.fixture(scope="module")
def dev() -> torch.device:
    return partita.use_spmd(MESH)


def _batches(n: int, batch: int = 4, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, 8, generator=g), torch.randn(batch, 4, generator=g)) for _ in range(n)
    ]


def _models(
    dev: torch.device, capturable: bool = True, lr: float | torch.Tensor = 1e-2, shard: bool = True
) -> tuple[nn.Module, Any, nn.Module, Any]:
    """An MLP on the device (fsdp+tp-like specs, or replicated) with its AdamW, and its eager
    twin."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model = copy.deepcopy(ref).to(dev)
    if shard:
        partita.mark_sharding(model[0].weight, MESH, P("model", "data"))
        partita.mark_sharding(model[2].weight, MESH, P(None, "model"))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, capturable=capturable)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    return model, opt, ref, ref_opt


def _eager_step(ref: nn.Module, ref_opt: Any, x: torch.Tensor, y: torch.Tensor) -> float:
    loss = F.mse_loss(ref(x), y)
    loss.backward()
    ref_opt.step()
    ref_opt.zero_grad()
    return loss.item()


def _same_params(model: nn.Module, ref: nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.cpu(), q, atol=1e-5, rtol=1e-5, msg=name)


def _counted(fn: Callable[..., Any]) -> tuple[Any, list[int]]:
    calls = [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return fn(*args, **kwargs)

    counted.__name__ = counted.__qualname__ = fn.__name__
    return partita.compile(counted), calls


def test_compiled_step_replays_and_equals_eager(dev: torch.device) -> None:
    """8 calls with capturable AdamW and an lr schedule on a device tensor lr (stepped outside
    the step: its update is synced before each replay) equal eager; the function ran 3 times
    (warm-up, then two equal calls), 5 replays; a new batch shape runs the function again and
    is captured apart; a parameter resharded by mark_sharding is not replayed stale."""
    model, opt, ref, ref_opt = _models(dev, lr=torch.tensor(1e-2).to(dev))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1 / (1 + s))

    def eager_step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = _eager_step(ref, ref_opt, x, y)
        ref_sched.step()
        return loss

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x, y = x.to(dev), y.to(dev)  # CPU arguments: the step moves them
        partita.mark_sharding(x, MESH, P("data", None))
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    step, calls = _counted(train_step)
    virtual_state.get().programs.clear()
    recording.forget_guides()
    partita.metrics(reset=True)
    for x, y in _batches(8):
        loss = step(x, y)
        sched.step()
        assert loss.device == dev and not loss.requires_grad
        assert loss.item() == pytest.approx(eager_step(x, y), abs=1e-5)
    _same_params(model, ref)
    m = partita.metrics()
    assert calls[0] == 3, str(m)
    assert m.compiled_step_replays == 5
    # The step's program (twice if the warm-up call differs), and the scheduler's lr update
    # (recorded outside the step, synced before the next call).
    assert m.compiles in (2, 3), str(m)
    assert "compiled step train_step: captured after 3 calls" in str(m)
    assert "compiled_step_replays=5" in str(m)

    for x, y in _batches(4, batch=2, seed=1):  # another signature: run, then captured apart
        loss = step(x, y)
        sched.step()
        assert loss.item() == pytest.approx(eager_step(x, y), abs=1e-5)
    assert (calls[0], m.compiled_step_replays) == (6, 6)
    assert len(step.signatures) == 2

    partita.clear_sharding(model[0].weight)  # re-annotating takes clearing first
    partita.mark_sharding(model[0].weight, MESH, P(None, "model"))  # a captured input
    x, y = _batches(1, seed=2)[0]
    loss = step(x, y)
    sched.step()
    assert loss.item() == pytest.approx(eager_step(x, y), abs=1e-5)
    assert calls[0] == 7, "a resharded parameter must not replay the stale capture"
    line = m.compiled_steps["train_step"]
    assert line.startswith("capture dropped: input") and "P(None, 'model')" in line, line
    _same_params(model, ref)

    step.reset()
    x, y = _batches(1, seed=3)[0]
    step(x, y)
    assert calls[0] == 8 and not step.signatures[next(iter(step.signatures))].capture


def _not_capturable(
    dev: torch.device,
    train_step: Callable[..., Any],
    *,
    capturable: bool = True,
    after: Callable[[Any], None] | None = None,
) -> str:
    """Run ``train_step(model, opt, x, y)`` 4 times beside eager: losses and parameters equal,
    the function ran every call; returns its line in ``partita.metrics()``. (Replicated: the
    reasons do not depend on the sharding, and the programs compile faster.)"""
    model, opt, ref, ref_opt = _models(dev, capturable=capturable, shard=False)
    step, calls = _counted(
        functools.update_wrapper(functools.partial(train_step, model, opt), train_step)
    )
    for x, y in _batches(4):
        loss = step(x.to(dev), y.to(dev))
        if after is not None:
            after(opt)
        assert float(loss) == pytest.approx(_eager_step(ref, ref_opt, x, y), abs=1e-5)
    _same_params(model, ref)
    assert calls[0] == 4
    line = partita.metrics().compiled_steps[step.name]
    assert "captured after" not in line
    return line


def _plain(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_non_capturable_adamw_runs_every_call_and_says_why(dev: torch.device) -> None:
    """AdamW(capturable=False) computes its bias corrections in Python: each call's floats
    differ, so the step is never captured; it equals eager and the line names the fix."""
    line = _not_capturable(dev, _plain, capturable=False)
    assert re.search(
        r"not captured yet: the Python float of op \d+ \(aten\._foreach_\w+\.\w+\) at .*was "
        r".* in one call and .* in the next .*Fix: torch\.optim\.AdamW\(\.\.\., "
        r"capturable=True\)",
        line,
    ), line


def _host_counter(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    _COUNTER.add_(1)  # host state changing each step, read by a device op
    loss = F.mse_loss(model(x), y)
    loss = loss + loss * 0 * _COUNTER  # the op reads the CPU tensor
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _grads_outside(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss  # opt.zero_grad() after the call: the gradients outlive the step


def _reads_item(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), y)
    assert loss.item() >= 0  # a sync inside the step
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


_COUNTER = torch.zeros(())


@pytest.mark.parametrize(
    ("train_step", "match"),
    [
        (_host_counter, r"the host value read by op \d+ \(aten\.\w+\.\w+\) at .*changed between "
         r"two calls .*Fix: keep it on the device"),
        (_grads_outside, r"a tensor the step made \(\[[\d, ]+\] torch\.float32 by op \d+ "
         r"\(aten\.\w+\.\w+\).*is "
         r"still alive after the call and is not returned .*Fix: zero the gradients"),
        (_reads_item, r"the function synced 1 time\(s\) inside the call .*Fix: return the value"),
    ],
)  # fmt: skip
def test_not_capturable_reasons(
    dev: torch.device, train_step: Callable[..., Any], match: str
) -> None:
    """Host state changing each call, gradients left alive, a sync inside the step: the
    function runs every call, trains as eager, and the metrics line says why, with the fix."""
    after = (lambda opt: opt.zero_grad()) if train_step is _grads_outside else None
    line = _not_capturable(dev, train_step, after=after)
    assert re.search(match, line), line


def test_nested_returns_in_place_arguments_and_signatures(dev: torch.device) -> None:
    """A step updating a device argument and a non-argument tensor in place, reading a CPU
    argument, returning a dict of tensors inside a tuple with a plain value: replays equal
    eager; a keyword's new value is a new signature; a CPU argument read only in Python is
    compared by value; an unhashable argument is never captured."""
    w = torch.zeros(4, 8).to(dev)
    partita.mark_sharding(w, MESH, P(None, "model"))
    acc = torch.zeros(4).to(dev)
    w_ref, acc_ref = torch.zeros(4, 8), torch.zeros(4)

    def accumulate(x: torch.Tensor, acc: torch.Tensor, scale: torch.Tensor, *, k: float) -> Any:
        w.add_(x * k * scale)  # w: read and updated, not an argument; scale: a CPU argument
        acc.add_(x.sum(1))  # an argument updated in place
        return {"total": w.sum(), "parts": (w[0] * 1, [acc * 2])}, "tag"

    step, calls = _counted(accumulate)
    g = torch.Generator().manual_seed(0)
    for i in range(7):
        k = 2.0 if i < 5 else 3.0
        x = torch.randn(4, 8, generator=g)
        scale = torch.tensor(1.0 + i)  # a new value each call: read by the replay too
        (out, tag) = step(x.to(dev), acc, scale, k=k)
        w_ref.add_(x * k * scale)
        acc_ref.add_(x.sum(1))
        assert tag == "tag" and set(out) == {"total", "parts"}
        torch.testing.assert_close(out["total"].cpu(), w_ref.sum())
        torch.testing.assert_close(out["parts"][0].cpu(), w_ref[0])
        torch.testing.assert_close(out["parts"][1][0].cpu(), acc_ref * 2)
        torch.testing.assert_close(acc.cpu(), acc_ref)
    torch.testing.assert_close(w.cpu(), w_ref)
    assert calls[0] == 5, "3 calls to capture k=2.0 (2 replays), then k=3.0 runs again"
    assert len(step.signatures) == 2

    scaled = partita.compile(lambda x, n: x * float(n))  # n: read in Python, not by an op
    two = [scaled(torch.ones(2).to(dev), torch.tensor(2.0)).cpu() for _ in range(4)]
    assert partita.metrics().compiled_step_replays > 0 and all(t.tolist() == [2, 2] for t in two)
    assert scaled(torch.ones(2).to(dev), torch.tensor(3.0)).cpu().tolist() == [3, 3]
    assert (
        partita.metrics()
        .compiled_steps["<lambda>"]
        .startswith(
            "capture dropped: the CPU argument leaf 1, not read by the program, has another value"
        )
    )

    unhashable = partita.compile(lambda x, opts: x * 2)
    for _ in range(4):
        unhashable(torch.ones(2).to(dev), bytearray(b"x"))
    line = partita.metrics().compiled_steps["<lambda>"]
    assert re.search(r"not capturable: argument leaf 1 is a bytearray, which is not hashable", line)


def test_steps_that_cannot_be_replayed_say_why(dev: torch.device) -> None:
    """A step that alternates between two programs, one returning a CPU tensor, one with no
    device op: each runs every call, gives eager's values, and says why."""
    w = torch.zeros(4).to(dev)
    parity = [0]

    def alternating(x: torch.Tensor) -> torch.Tensor:
        parity[0] += 1
        return x * 2 if parity[0] % 2 else x + 2

    def host_result(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, torch.ones(2)

    def host_only(x: torch.Tensor) -> int:
        return 1

    lines = {}
    for fn in (alternating, host_result, host_only):
        step, calls = _counted(fn)
        got = [step(w + i) for i in range(4)]
        assert calls[0] == 4, fn.__name__
        lines[fn.__name__] = partita.metrics().compiled_steps[fn.__name__]
        if fn is alternating:
            assert [t.cpu().tolist() for t in got] == [
                [i * 2] * 4 if i % 2 == 0 else [i + 2] * 4 for i in range(4)
            ]
    assert re.search(
        r"not captured yet: two consecutive calls recorded different steps \(op 0 changed: "
        r"aten\.mul\.Tensor\(2\) became aten\.add\.Tensor\(2\)\)",
        lines["alternating"],
    ), lines["alternating"]
    assert re.search(
        r"return value leaf 1 \(Tensor \[2\]\) is not a tensor the step computed on the device",
        lines["host_result"],
    ), lines["host_result"]
    assert lines["host_only"].startswith("not capturable: the call recorded no device op")


def test_a_new_mesh_drops_the_capture(dev: torch.device) -> None:
    """A capture is for the mesh it was compiled on: after use_spmd(another mesh) the function
    runs again (and is captured for that mesh)."""
    w = torch.zeros(4).to(dev)

    def add_one() -> torch.Tensor:
        w.add_(1)
        return w * 1

    step, calls = _counted(add_one)
    assert [step().cpu()[0].item() for _ in range(4)] == [1, 2, 3, 4] and calls[0] == 3
    try:
        partita.use_spmd(Mesh.create((4, 2), ("data", "model")))
        assert step().cpu()[0].item() == 5 and calls[0] == 4
        assert (
            partita.metrics()
            .compiled_steps["add_one"]
            .startswith("capture dropped: the virtual device's mesh changed from Mesh(")
        )
    finally:
        partita.use_spmd(MESH)


def test_a_tensor_made_and_updated_in_the_step_is_replayed_from_its_first_value(
    dev: torch.device,
) -> None:
    """A device tensor the step makes from no argument and then updates in place is a constant
    of the step: each replay starts from the value it was made with, not the updated one."""
    w = torch.zeros(4).to(dev)

    def step_fn(x: torch.Tensor) -> torch.Tensor:
        buf = torch.ones(4, device=dev)  # data made inside the step
        buf.add_(x)  # recorded: the program updates it
        w.add_(buf)
        return buf * 1

    step, calls = _counted(step_fn)
    want = torch.zeros(4)
    for i in range(5):
        got = step(torch.full((4,), float(i)).to(dev))
        want += 1 + i
        torch.testing.assert_close(got.cpu(), torch.full((4,), 1.0 + i))
    torch.testing.assert_close(w.cpu(), want)
    assert calls[0] == 3
