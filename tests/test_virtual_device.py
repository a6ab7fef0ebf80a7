"""The SPMD virtual device: an unchanged PyTorch loop on ``partita.use_spmd(mesh)``.

Every result is checked against the same code run eagerly on the CPU, unsharded.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the PyTorch convention
from torch import nn

import partita
from partita import Mesh, P
from partita.models import GPT, GPTConfig
from partita.virtual import VirtualDeviceError, check_torch, disk_cache, recording
from partita.virtual import state as virtual_state

MESH = Mesh.create((2, 4), ("data", "model"))
CFG = GPTConfig(n_layer=1, n_head=2, d_model=16, vocab_size=32, seq_len=8, bias=False)
STEPS = 20


def _param_specs(model: nn.Module) -> dict[str, P]:
    presets = partita.presets
    return presets.param_specs("fsdp+tp", model, MESH)


def _batches(n: int, batch: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, 32, (batch, 8), generator=g),
            torch.randint(0, 32, (batch, 8), generator=g),
        )
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def dev() -> torch.device:
    return partita.use_spmd(MESH)


@pytest.fixture(scope="module")
def gpt_run(dev: torch.device) -> dict:
    """The issue's loop for STEPS steps beside eager; then one step with a new batch shape."""
    torch.manual_seed(0)
    model = GPT(CFG)
    ref = copy.deepcopy(model)
    first_weight = model.head.weight
    model = model.to(dev)
    specs = _param_specs(model)
    for name, spec in specs.items():
        assert partita.mark_sharding(model.get_parameter(name), MESH, spec) is not None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))  # lr changes
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (1 + s))
    # Programs of earlier tests in this process (same mesh) would be the "closest" cached
    # program for the recompilation reason below, and the step that followed one of them a
    # guide the first step here is compared with (a "left the fast path" line): this loop
    # starts from an empty cache and no guides, whichever test files ran before it.
    virtual_state.get().programs.clear()
    recording.forget_guides()
    partita.metrics(reset=True)
    losses, ref_losses = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", partita.RematerializationWarning)
        for xb, yb in _batches(STEPS):
            x, y = xb.to(dev), yb.to(dev)
            partita.mark_sharding(x, MESH, P("data", None))
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            partita.sync()
            losses.append(loss.item())
            ref_loss = F.cross_entropy(ref(xb).flatten(0, 1), yb.flatten())
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            ref_sched.step()
            ref_losses.append(ref_loss.item())
        m = partita.metrics()
        after_loop = (m.compiles, m.cache_hits, m.syncs, list(m.recompile_reasons))
        fast_path = (m.fast_path_hits, list(m.fast_path_misses))
        params = {n: p.cpu() for n, p in model.named_parameters()}
        ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
        xb, yb = _batches(1, batch=2)[0]  # a new batch shape: one recompilation, explained
        x, y = xb.to(dev), yb.to(dev)
        partita.mark_sharding(x, MESH, P("data", None))
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    return {
        "model": model,
        "specs": specs,
        "first_weight": first_weight,
        "losses": losses,
        "ref_losses": ref_losses,
        "params": params,
        "ref_params": ref_params,
        "after_loop": after_loop,
        "fast_path": fast_path,
        "after_shape_change": partita.metrics(),
    }


@pytest.mark.slow  # the 20-step loop on 8 simulated devices: ~20 s
def test_gpt_loop_equals_eager(gpt_run: dict) -> None:
    torch.testing.assert_close(gpt_run["losses"], gpt_run["ref_losses"], rtol=1e-5, atol=1e-5)
    for name, value in gpt_run["ref_params"].items():
        torch.testing.assert_close(gpt_run["params"][name], value, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # the 20-step loop on 8 simulated devices: ~20 s
def test_gpt_loop_compiles_once_with_an_lr_schedule(gpt_run: dict) -> None:
    assert gpt_run["after_loop"] == (1, STEPS - 1, STEPS, [])


@pytest.mark.slow  # the 20-step loop on 8 simulated devices: ~20 s
def test_gpt_loop_takes_the_fast_path(gpt_run: dict) -> None:
    # Every step after the first repeats its predecessor op by op (its losses and parameters
    # equal eager: test_gpt_loop_equals_eager); the new batch shape leaves the fast path.
    assert gpt_run["fast_path"] == (STEPS - 1, [])
    miss = gpt_run["after_shape_change"].fast_path_misses[-1]
    assert miss.startswith("input "), miss
    assert "[2, 8] torch.int64 (strides (8, 1), offset 0), the previous step had [4, 8]" in miss


@pytest.mark.slow  # the 20-step loop on 8 simulated devices: ~20 s
def test_new_batch_shape_recompiles_and_says_why(gpt_run: dict) -> None:
    m = gpt_run["after_shape_change"]
    assert m.compiles == 2
    (reason,) = m.recompile_reasons
    assert "changed from [4, 8] torch.int64 P('data', None) to [2, 8]" in reason
    assert "recompiled: input" in str(m)


@pytest.mark.slow  # the 20-step loop on 8 simulated devices: ~20 s
def test_parameters_keep_identity_and_sharding(gpt_run: dict) -> None:
    model = gpt_run["model"]
    weight = model.head.weight
    assert weight is gpt_run["first_weight"] and isinstance(weight, nn.Parameter)
    assert weight.device == torch.device("spmd", 0)
    data = weight._cell.data
    assert isinstance(data, partita.ShardedTensor)
    assert data.spec == gpt_run["specs"]["head.weight"]
    assert set(model.state_dict()) == set(gpt_run["ref_params"])


def test_state_dict_saves_and_loads(dev: torch.device) -> None:
    """``torch.save`` writes a device tensor's value, as for an XLA tensor, so the default
    ``torch.load`` (``weights_only=True``) reads it back on the device, or on the CPU with
    ``map_location`` (it used to pickle partita's tensor class, which weights_only refuses)."""
    import io

    torch.manual_seed(0)
    ref = nn.Linear(4, 8)
    model = copy.deepcopy(ref).to(dev)
    partita.mark_sharding(model.weight, MESH, P("model", None))
    with torch.no_grad():
        model.bias.mul_(2)  # pending when saved: saving syncs it
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()))
    assert loaded["weight"].device == torch.device("spmd", 0)
    torch.testing.assert_close(loaded["weight"].cpu(), ref.weight.detach())
    torch.testing.assert_close(loaded["bias"].cpu(), 2 * ref.bias.detach())
    on_cpu = torch.load(io.BytesIO(buf.getvalue()), map_location="cpu")
    assert type(on_cpu["bias"]) is torch.Tensor
    torch.testing.assert_close(on_cpu["bias"], 2 * ref.bias.detach())
    twin = copy.deepcopy(model)  # a copy keeps values and sharding, and is its own tensor
    assert partita.virtual.sharded(twin.weight).spec == P("model", None)
    with torch.no_grad():
        model.weight.zero_()
    torch.testing.assert_close(twin.weight.cpu(), ref.weight.detach())
    fresh = nn.Linear(4, 8).to(dev)
    fresh.load_state_dict(ref.state_dict())  # CPU values into device parameters
    torch.testing.assert_close(fresh.weight.cpu(), ref.weight.detach())


def test_mark_sharding_lays_data_out_in_place(dev: torch.device) -> None:
    value = torch.arange(15.0).reshape(5, 3)
    x = value.to(dev)
    assert partita.mark_sharding(x, MESH, P("model", None)) is x
    data = x._cell.data
    assert data.spec == P("model", None) and data.local_shape == (2, 3)  # 5 rows: zero padded
    torch.testing.assert_close(x.cpu(), value)


def test_mark_sharding_on_a_pending_tensor_records_an_annotation(dev: torch.device) -> None:
    a, b = torch.randn(8, 4), torch.randn(4, 8)
    out = a.to(dev) @ b.to(dev)
    assert partita.mark_sharding(out, MESH, P(None, "model")) is out
    partita.sync()
    assert out._cell.data.spec == P(None, "model")
    torch.testing.assert_close(out.cpu(), a @ b)


def test_mark_sharding_on_another_mesh_is_refused(dev: torch.device) -> None:
    x = torch.ones(4, 4).to(dev)
    other = Mesh.create((8,), ("x",))
    with pytest.raises(VirtualDeviceError, match="one step runs on one mesh"):
        partita.mark_sharding(x, other, P("x", None))


def test_in_place_updates_of_views(dev: torch.device) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        x[0].add_(1)
        x.t().mul_(2).add_(1)
        v = x.view(-1)
        v[3:5].sub_(7)
        return x

    value = torch.randn(3, 4)
    x = value.to(dev)
    f(x)
    torch.testing.assert_close(x.cpu(), f(value.clone()))


def test_batch_norm_running_stats_update_when_output_unused(dev: torch.device) -> None:
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(4)
    lazy_bn = copy.deepcopy(bn).to(dev)
    value = torch.randn(8, 4) + 3
    bn(value)
    lazy_bn(value.to(dev))  # the output is dropped: only the running stats change
    partita.sync()
    torch.testing.assert_close(lazy_bn.running_mean.cpu(), bn.running_mean)
    torch.testing.assert_close(lazy_bn.running_var.cpu(), bn.running_var)


def test_dropout_inside_checkpoint_repeats_its_mask_like_eager(dev: torch.device) -> None:
    """checkpoint restores the device's RNG state to recompute its block: the recomputed
    dropout must draw the forward's mask (partita.virtual.draws), and the generator end where
    eager leaves it."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    lin, head = nn.Linear(8, 16), nn.Linear(16, 4)
    ref = nn.ModuleList([lin, head])
    model = copy.deepcopy(ref).to(dev)

    def run(m: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
        block = lambda a: F.dropout(torch.tanh(m[0](a)), 0.5, training=True)  # noqa: E731
        return m[1](checkpoint(block, x, use_reentrant=False)).sum()

    x = torch.randn(8, 8)
    torch.manual_seed(1)
    run(model, x.to(dev)).backward()
    partita.sync()
    after = torch.rand(3)
    torch.manual_seed(1)
    run(ref, x).backward()
    torch.testing.assert_close(model[0].weight.grad.cpu(), ref[0].weight.grad)
    assert torch.equal(after, torch.rand(3))


def test_a_step_with_dropout_draws_where_eager_does(dev: torch.device) -> None:
    """A step's draws take the generator where the sync left it, even when the Python thread
    draws on the CPU right after the sync (a step that runs in the background would race)."""
    x = torch.ones(8, 8)
    torch.manual_seed(1)
    y = F.dropout(x.to(dev), 0.5, training=True)
    partita.sync()
    after = torch.rand(3)  # before the step's result is read
    torch.manual_seed(1)
    assert torch.equal(y.cpu(), F.dropout(x, 0.5, training=True))
    assert torch.equal(after, torch.rand(3))


def test_cpu_tensors_are_read_when_recorded(dev: torch.device) -> None:
    lr = torch.tensor(0.5)
    x = torch.ones(4).to(dev)
    y = x * lr
    lr.fill_(3.0)  # a scheduler updating a tensor lr after the op was recorded
    torch.testing.assert_close(y.cpu(), torch.full((4,), 0.5))


def test_item_and_print_sync(dev: torch.device) -> None:
    x = torch.arange(4.0).to(dev) * 2
    assert x._cell.is_pending
    assert x.sum().item() == 12.0
    assert "device='spmd:0'" in repr(x) and "6." in repr(x)


def test_old_torch_gets_a_clear_error() -> None:
    with pytest.raises(VirtualDeviceError, match=r"needs torch >= 2\.9, but torch 2\.6 is"):
        check_torch((2, 6))


def test_eager_ops_on_sharded_tensors(dev: torch.device) -> None:
    value = torch.randn(8, 16)
    x = partita.mark_sharding(value, MESH, P("data", None))
    y = 2 * x - x / 4 + 1
    assert isinstance(y, partita.ShardedTensor)
    torch.testing.assert_close(y.full(), 2 * value - value / 4 + 1)
    model = nn.Sequential(nn.Linear(16, 4), nn.ReLU())
    out = model(x)
    assert isinstance(out, partita.ShardedTensor) and out.spec == P("data", None)
    torch.testing.assert_close(out.full(), model(value))
    torch.testing.assert_close(x.cpu(), value)


def test_eager_ops_on_another_mesh_are_refused(dev: torch.device) -> None:
    x = partita.mark_sharding(torch.ones(8), Mesh.create((8,), ("x",)), P("x"))
    with pytest.raises(VirtualDeviceError, match=r"operations outside partita\.jit run on"):
        x + 1


SCRIPT = Path(__file__).parent / "dist_scripts" / "virtual_cache.py"


def _cache_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("virtual_cache", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_a_second_process_reuses_the_persistent_cache(dev: torch.device, tmp_path: Path) -> None:
    try:
        first = _cache_script().run(str(tmp_path))
    finally:
        disk_cache.set_directory(None)
    assert (first["compiles"], first["disk_hits"]) == (1, 0)
    (saved,) = tmp_path.glob("*.json")
    assert json.loads(saved.read_text())["format"] == disk_cache.FORMAT  # plain JSON
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    second = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (second["compiles"], second["disk_hits"]) == (0, 1)
    assert second["losses"] == first["losses"]


@pytest.mark.slow
@pytest.mark.usefixtures("rank_zygote")  # ranks forked from a pre-imported process
def test_the_loop_under_torch_distributed_equals_the_local_mesh(dev: torch.device) -> None:
    from partita.runtime.launch import spawn

    mesh = Mesh.create((1, 2), ("data", "model"))
    try:
        local = _cache_script().run(None, steps=3, mesh=mesh)
        compiled = _cache_script().run_compiled(steps=6, mesh=mesh)
    finally:
        partita.use_spmd(MESH)
    results = spawn([str(SCRIPT.parent / "virtual_dist.py")], 2, timeout=300)
    assert all(r.returncode == 0 for r in results), [r.stderr[-2000:] for r in results]
    got = json.loads(results[0].stdout.strip().splitlines()[-1])
    torch.testing.assert_close(got["losses"], local["losses"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["weight"], local["weight"], rtol=1e-5, atol=1e-5)
    assert got["compiles"] == 1
    # partita.compile under torch.distributed: captured after 3 calls, 3 replays, as local.
    got = got["compiled"]
    assert (got["calls"], got["replays"]) == (compiled["calls"], compiled["replays"]) == (3, 3)
    torch.testing.assert_close(got["losses"], compiled["losses"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["weight"], compiled["weight"], rtol=1e-5, atol=1e-5)


def test_a_tampered_cache_file_is_ignored(dev: torch.device, tmp_path: Path) -> None:
    def run_once() -> tuple[int, int]:
        virtual_state.get().programs.clear()  # forget the in-memory programs: only disk helps
        partita.metrics(reset=True)
        disk_cache.set_directory(tmp_path)
        try:
            x = torch.arange(12.0).reshape(4, 3).to(dev)
            partita.mark_sharding(x, MESH, P("data", None))
            torch.testing.assert_close((x * 3).cpu(), torch.arange(12.0).reshape(4, 3) * 3)
        finally:
            disk_cache.set_directory(None)
        m = partita.metrics()
        return m.compiles, m.disk_hits

    assert run_once() == (1, 0)
    assert run_once() == (0, 1)
    (saved,) = tmp_path.glob("*.json")
    data = json.loads(saved.read_text())
    for row in data["graph"]:
        if row["target"]:
            row["target"] = "os::system.default"  # never resolved: only the op table loads
    saved.write_text(json.dumps(data))
    with pytest.warns(partita.CompileCacheWarning, match=r"does not match the SHA-256"):
        assert run_once() == (1, 0)
    data["sha256"] = disk_cache._digest(data)  # as whoever edits it would recompute it
    saved.write_text(json.dumps(data))
    with pytest.warns(partita.CompileCacheWarning, match=r"'os::system\.default' as a function"):
        assert run_once() == (1, 0)


def test_another_privateuse1_backend_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from partita.virtual import device

    monkeypatch.setattr(virtual_state.get(), "registration", None)  # as if not registered yet
    monkeypatch.setattr(torch._C, "_get_privateuse1_backend_name", lambda: "npu")
    with pytest.raises(VirtualDeviceError, match=r"already registered as 'npu'.*cannot become"):
        device.register(lambda *a: None, lambda *a: None)


def test_a_step_before_use_spmd_says_what_to_call(
    dev: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = torch.ones(4).to(dev) * 2
    monkeypatch.setattr(virtual_state.get(), "mesh", None)
    with pytest.raises(VirtualDeviceError, match=r"Call dev = partita\.use_spmd\(mesh\) first"):
        partita.sync()
    monkeypatch.undo()
    torch.testing.assert_close(x.cpu(), torch.full((4,), 2.0))  # the step was kept


def test_priority_is_refused_on_device_tensors(dev: torch.device) -> None:
    x = torch.ones(4, 4).to(dev)
    with pytest.raises(ValueError, match="only applies to annotations inside a captured"):
        partita.mark_sharding(x, MESH, P("data", None), priority=1)


def test_sharded_needs_a_device_tensor() -> None:
    with pytest.raises(TypeError, match=r"takes a tensor of the virtual device .*\.to\(dev\)"):
        partita.virtual.sharded(torch.ones(2))


def test_the_next_step_records_while_a_step_runs(dev: torch.device) -> None:
    value = torch.arange(8.0)
    w = value.to(dev)
    partita.mark_sharding(w, MESH, P("data"))
    y = w * 2
    w.mul_(3)
    partita.sync()  # runs in the background (LocalMesh)
    z = y + 1  # recorded on values the running step computes
    w.add_(1)  # an in-place update of a value the running step updates
    partita.sync()
    torch.testing.assert_close(z.cpu(), value * 2 + 1)
    torch.testing.assert_close(w.cpu(), value * 3 + 1)
    assert partita.virtual.sharded(w).spec == P("data")  # the layout mark_sharding gave it


def test_partita_shows_no_accelerator() -> None:
    """The device registered at import answered is_available() == True, so torch (and DCP's
    writer, which asked it for streams) took it for an accelerator before use_spmd; after
    use_spmd, DataLoader(pin_memory=True) pinned each batch for it and raised
    NotImplementedError (a Python backend has no pinned-memory allocator). It is never
    reported as an accelerator: the loader does not pin, as on any CPU machine."""
    code = (
        "import torch, partita\n"
        "print(torch.accelerator.is_available(), torch._utils._get_available_device_type())\n"
        "dev = partita.use_spmd(partita.Mesh.create((2,), ('data',)))\n"
        "print(torch.accelerator.is_available(), torch._utils._get_available_device_type())\n"
        "with torch.random.fork_rng():\n"  # it asked the device for its RNG state: none
        "    torch.rand(1)\n"
        "print('fork_rng ok')\n"
        "import warnings; warnings.simplefilter('ignore')\n"
        "data = torch.utils.data.TensorDataset(torch.arange(8.0))\n"
        "loader = torch.utils.data.DataLoader(data, batch_size=4, pin_memory=True)\n"
        "print([b.to(dev).sum().item() for (b,) in loader])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split("\n")
    assert out[:4] == ["False None", "False None", "fork_rng ok", "[6.0, 22.0]"], out


def test_work_pending_on_one_mesh_runs_there_before_another_mesh(dev: torch.device) -> None:
    """A value recorded on one mesh and not read yet belongs to that mesh: ``use_spmd`` with
    another mesh runs it there first, so the new mesh's next step holds only its own ops (it
    used to compile both into one step on the new mesh, and its Plan counted the other's
    collectives)."""
    other = Mesh.create((4, 2), ("data", "model"))
    torch.manual_seed(0)
    w0, x0 = torch.randn(16, 8), torch.randn(8, 16)
    try:
        dev_a = partita.use_spmd(other)
        w = w0.to(dev_a)
        partita.mark_sharding(w, other, P(None, "model"))
        x = x0.to(dev_a)
        partita.mark_sharding(x, other, P("data", None))
        y = (x @ w).sum(0)  # pending on `other`, kept alive
        pending = virtual_state.get().recording
        assert pending is not None and pending.ops
    finally:
        partita.use_spmd(MESH)
    assert virtual_state.get().recording is None  # run on `other` when the mesh changed
    u = torch.ones(8, 4).to(dev)
    partita.mark_sharding(u, MESH, P("data", "model"))
    assert (u * 3).sum().item() == 96.0
    plan = partita.last_plan()
    assert plan is not None and plan.counts() == {"all_reduce": 1}, plan.summary()
    torch.testing.assert_close(y.cpu(), (x0 @ w0).sum(0), rtol=1e-5, atol=1e-5)
