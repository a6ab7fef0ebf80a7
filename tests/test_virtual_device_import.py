"""``import partita`` leaves torch as it was; the first ``use_spmd`` registers the device.

The import checks run in fresh interpreters (this session's conftest registers the device).
The device's state is one :class:`~partita.virtual.state.DeviceState`.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import threading

import pytest
import torch

import partita
from partita import Mesh
from partita.virtual import state as virtual_state

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"

#: Prints, as JSON, what partita could change in torch: before the import, after it, and after
#: ``use_spmd``.
_SNAPSHOTS = """
import json, sys, torch
import torch.optim.optimizer as optimizer
import torch.serialization
import torch.utils._pytree as pytree

def snapshot():
    return {
        "backend": torch._C._get_privateuse1_backend_name(),
        "torch.spmd": hasattr(torch, "spmd"),
        "foreach_types": [t.__name__ for t in optimizer._foreach_supported_types],
        "kernels": {
            key: sorted(torch._C._dispatch_get_registrations_for_dispatch_key(key))
            for key in ("PrivateUse1", "AutogradPrivateUse1", "AutocastPrivateUse1")
        },
        "ops": sorted(torch._C._dispatch_get_all_op_names()),
        "pytree": sorted(map(repr, pytree.SUPPORTED_NODES)),
        "safe_globals": sorted(map(repr, torch.serialization.get_safe_globals())),
    }

before = snapshot()
import partita
imported = snapshot()
partita.use_spmd(partita.Mesh.create((2,), ("x",)))
print(json.dumps([before, imported, snapshot()]))
"""


def _python(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env
    )


@pytest.mark.slow
def test_import_changes_nothing_in_torch_and_use_spmd_registers() -> None:
    proc = _python(_SNAPSHOTS)
    assert proc.returncode == 0, proc.stderr
    before, imported, switched = json.loads(proc.stdout)
    # What import may add: partita's own ops (torch.library definitions under partita::, new
    # names, nothing of torch's changed) and its value classes on torch.load's allowlist
    # (partita.serialization, so torch.load(weights_only=True) reads a ShardedTensor).
    new_ops = set(imported["ops"]) - set(before["ops"])
    assert new_ops and all(op.startswith("partita::") for op in new_ops), new_ops
    assert set(before["ops"]) <= set(imported["ops"])
    added = set(imported["safe_globals"]) - set(before["safe_globals"])
    assert added == {repr(c) for c in partita.values.serialization.SAFE_GLOBALS}
    for key in ("backend", "torch.spmd", "foreach_types", "kernels", "pytree"):
        assert imported[key] == before[key], key
    # use_spmd: the PrivateUse1 backend renamed, its kernels, torch.optim's foreach list.
    assert (before["backend"], switched["backend"]) == ("privateuseone", "spmd")
    assert switched["torch.spmd"]
    assert "LazyTensor" in switched["foreach_types"]
    assert "LazyTensor" not in imported["foreach_types"]
    for key in ("PrivateUse1", "AutogradPrivateUse1", "AutocastPrivateUse1"):
        assert len(switched["kernels"][key]) > len(imported["kernels"][key]), key
    assert "aten::empty_strided" in switched["kernels"]["PrivateUse1"]


_BACKWARD_FIRST = """
import torch
import partita
from partita import P
{prepare}
w = torch.ones(2, requires_grad=True)
(w * 2).sum().backward()  # the process's first backward(), on the CPU
mesh = partita.Mesh.create((2,), ("x",))
x = partita.mark_sharding(torch.ones(4, 2), mesh, P("x", None))
print((x + 1).full().sum().item())  # a ShardedTensor op outside jit: no backward, it runs
dev = partita.use_spmd(mesh)
v = torch.ones(2, device=dev, requires_grad=True)
(v * 3).sum().backward()
print(v.grad.cpu().tolist())
"""


@pytest.mark.slow
def test_use_spmd_after_a_backward_says_to_register_first() -> None:
    proc = _python(_BACKWARD_FIRST.format(prepare=""))
    assert proc.returncode != 0
    assert proc.stdout.split() == ["16.0"]
    assert "VirtualDeviceError" in proc.stderr
    assert "ran a backward() before the virtual device was registered" in proc.stderr
    assert "partita.virtual.register_device()" in proc.stderr
    proc = _python(_BACKWARD_FIRST.format(prepare="partita.virtual.register_device()"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["16.0", "[3.0,", "3.0]"]


def test_a_late_registration_is_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    from partita.virtual import device

    def no_queue(*args: object, **kwargs: object) -> None:
        raise RuntimeError("0 <= device.index() && device.index() < device_ready_queues_.size()")

    with monkeypatch.context() as m:
        m.setattr(torch.autograd, "grad", no_queue)
        assert device._backward_runs() is False
    registration = virtual_state.get().registration
    assert registration is not None and registration.backward_runs
    monkeypatch.setattr(registration, "backward_runs", False)
    with pytest.raises(partita.VirtualDeviceError, match=r"before the first backward\(\)"):
        partita.use_spmd(Mesh.create((2,), ("x",)))


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_the_engine_check_runs_under_no_grad(mode: str) -> None:
    from partita.virtual import device

    with getattr(torch, mode)():
        assert device._backward_runs()  # the registered device's backward runs


def test_one_state_for_every_thread() -> None:
    seen: list[virtual_state.DeviceState] = []
    threads = [threading.Thread(target=lambda: seen.append(virtual_state.get())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(s is virtual_state.get() for s in seen) and len(seen) == 8


def test_reset_keeps_the_registration_and_the_tensors() -> None:
    mesh = Mesh.create((2,), ("x",))
    dev = partita.use_spmd(mesh)
    x = torch.arange(4.0).to(dev)
    y = x * 2
    partita.sync()
    device = virtual_state.get()
    registration, epoch = device.registration, device.epoch
    assert device.programs and partita.metrics().syncs >= 1
    virtual_state.reset()
    assert virtual_state.get() is device
    assert device.registration is registration and device.epoch == epoch
    assert not device.programs and device.mesh is None and partita.metrics().syncs == 0
    dev = partita.use_spmd(mesh)
    torch.testing.assert_close((y + x).cpu(), torch.arange(4.0) * 3)
    assert partita.metrics().compiles == 1
