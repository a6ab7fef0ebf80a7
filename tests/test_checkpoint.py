"""``partita.checkpoint``: sharded DCP checkpoints that reshard on load and never corrupt.

Every resume is checked against the uninterrupted run: train 2 steps on one mesh and plan,
save, and compare the next 3 steps of (a) the same run continued and (b) a fresh step on
another mesh / plan (or plain PyTorch) that loaded the checkpoint: losses and final parameters
to 1e-5 (the plans reduce in different orders). The multi-process case (4 Gloo processes) is in
``test_gloo_resume_and_save`` (slow).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

import partita
import partita.checkpoint as ckpt
from partita import Mesh, P, ShardedTensor
from partita.errors import CheckpointError, PartitaWarning
from partita.models import GPT, GPTConfig
from partita.training import TrainStep, train_step

CFG = GPTConfig(n_layer=1, n_head=4, d_model=16, vocab_size=32, seq_len=8, bias=False)
TOL = {"rtol": 1e-5, "atol": 1e-5}
SCRIPTS = Path(__file__).resolve().parent / "dist_scripts"


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batches(n: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, CFG.vocab_size, (8, CFG.seq_len), generator=g)
        out.append((ids, torch.roll(ids, -1, 1)))
    return out


def fresh(mesh: Mesh, plan: str, cfg: GPTConfig = CFG) -> tuple[TrainStep, Any]:
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return train_step(model, loss_fn, opt, mesh=mesh, param_specs=plan), sched


def run(step: TrainStep, sched: Any, data: list[Any]) -> list[float]:
    out = []
    for batch in data:
        out.append(float(step(batch)))
        sched.step()
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """2 steps on (2, 4) under fsdp+tp, a checkpoint, then 3 more steps (the reference)."""
    path = tmp_path_factory.mktemp("ckpt") / "step2"
    step, sched = fresh(Mesh.create((2, 4), ("data", "model")), "fsdp+tp")
    data = batches()
    run(step, sched, data[:2])
    ckpt.save(step, path, scheduler=sched, extra={"position": 2, "name": "run-a"})
    losses = run(step, sched, data[2:])
    return {"path": path, "losses": losses, "params": step.full_parameters(), "data": data}


def test_resume_on_another_mesh_and_plan_equals_the_uninterrupted_run(saved: dict) -> None:
    step, sched = fresh(Mesh.create((8,), ("data",)), "fsdp")
    extra = ckpt.load(step, saved["path"], scheduler=sched)
    assert extra == {"position": 2, "name": "run-a"}
    assert step.optimizer.param_groups[0]["lr"] == pytest.approx(5e-3)  # StepLR, 2 steps
    losses = run(step, sched, saved["data"][2:])
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(saved["losses"]), **TOL)
    for name, value in step.full_parameters().items():
        torch.testing.assert_close(value, saved["params"][name], **TOL, msg=name)
    # the loaded values kept this step's own shardings (fsdp on (8,)): resharded on load
    assert step.params["blocks.0.mlp.fc.weight"].spec == step.param_specs["blocks.0.mlp.fc.weight"]


def test_plain_torch_resumes_from_the_checkpoint(saved: dict) -> None:
    torch.manual_seed(1)  # different initial weights: everything must come from the checkpoint
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    sd = {**model.state_dict(), "optimizer": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=saved["path"])  # no partita involved
    set_optimizer_state_dict(model, opt, sd.pop("optimizer"))
    model.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-3)
    losses = []
    for ids, targets in saved["data"][2:]:
        opt.zero_grad()
        loss = loss_fn(model(ids), targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        opt.param_groups[0]["lr"] *= 0.5 if len(losses) == 2 else 1.0  # StepLR(2, 0.5)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(saved["losses"]), **TOL)
    for name, value in model.named_parameters():
        torch.testing.assert_close(value.detach(), saved["params"][name], **TOL, msg=name)


def test_parameter_groups_save_and_resume_each_groups_lr(tmp_path: Path) -> None:
    """Two groups (decay on matrices only, their own lr schedules): a resumed run on another
    mesh gets each group's lr back and continues like the uninterrupted one."""

    def build(mesh: Mesh) -> tuple[TrainStep, Any]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        decay = [p for p in model.parameters() if p.dim() == 2]
        rest = [p for p in model.parameters() if p.dim() == 1]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "lr": 3e-2}]
        opt = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda i: 0.5**i, lambda i: 1 / (1 + i)])
        return train_step(model, F.mse_loss, opt, mesh=mesh, param_specs="fsdp"), sched

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(4)]
    step, sched = build(Mesh.create((4,), ("data",)))
    run(step, sched, data[:2])
    ckpt.save(step, tmp_path / "groups", scheduler=sched)
    want = run(step, sched, data[2:])
    resumed, resumed_sched = build(Mesh.create((2,), ("data",)))
    ckpt.load(resumed, tmp_path / "groups", scheduler=resumed_sched)
    lrs = [group["lr"] for group in resumed.optimizer.param_groups]
    assert lrs == pytest.approx([1e-2 * 0.25, 3e-2 / 3])
    torch.testing.assert_close(
        torch.tensor(run(resumed, resumed_sched, data[2:])), torch.tensor(want)
    )
    for name, value in resumed.full_parameters().items():
        torch.testing.assert_close(value, step.full_parameters()[name], **TOL, msg=name)


def test_shards_are_written_once_without_padding(tmp_path: Path) -> None:
    mesh = Mesh.create((2, 4), ("data", "model"))
    x = torch.arange(54.0).reshape(9, 6)  # 9 rows over 2 (5 + 4), 6 cols over 4 (2,2,2,0)
    y = torch.randn(5)
    tensors = {
        "x": ShardedTensor.from_global(x, P("data", "model").to_sharding(mesh, 2)),
        "y": ShardedTensor.from_global(y, P().to_sharding(mesh, 1)),  # 8 replicas
        "z": torch.ones(3, dtype=torch.int64),
    }
    ckpt.save(tensors, tmp_path / "c")
    md = dcp.FileSystemReader(tmp_path / "c").read_metadata().state_dict_metadata
    chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in md["x"].chunks)
    assert chunks == [((r, c), (n, 2)) for r, n in ((0, 5), (5, 4)) for c in (0, 2, 4)]
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in md["y"].chunks] == [((0,), (5,))]
    # reshard on load: onto (4,) by columns, and into plain tensors
    other = Mesh.create((4,), ("data",))
    templates = {
        "x": ShardedTensor.from_global(torch.zeros(9, 6), P(None, "data").to_sharding(other, 2)),
        "y": torch.zeros(5),
    }
    got = ckpt.load(templates, tmp_path / "c")
    assert got["x"].spec == P(None, "data") and torch.equal(got["x"].full(), x)
    assert torch.equal(got["y"], y)
    plain = {"x": torch.zeros(9, 6), "z": torch.zeros(3, dtype=torch.int64)}
    dcp.load(plain, checkpoint_id=tmp_path / "c")
    assert torch.equal(plain["x"], x) and plain["z"].tolist() == [1, 1, 1]


def test_a_failed_save_leaves_the_previous_checkpoint_loadable(
    saved: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "c"
    mesh = Mesh.create((2,), ("data",))
    old = {"w": ShardedTensor.from_global(torch.arange(4.0), P("data").to_sharding(mesh, 1))}
    ckpt.save(old, path)
    new = {"w": ShardedTensor.from_global(torch.ones(4), P("data").to_sharding(mesh, 1))}

    def crash(*args: object, **kwargs: object) -> None:
        raise OSError("disk full (injected)")

    monkeypatch.setattr(dcp.FileSystemWriter, "finish", crash)  # dies before .metadata
    with pytest.raises(CheckpointError, match=r"disk full \(injected\).*unchanged and still load"):
        ckpt.save(new, path)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # the temporary dir is gone
    assert torch.equal(ckpt.load(old, path)["w"].full(), torch.arange(4.0))
    ckpt.save(new, path)  # overwriting works once the save completes
    assert torch.equal(ckpt.load(old, path)["w"].full(), torch.ones(4))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_damaged_checkpoints_are_typed_errors_naming_the_tensor(
    saved: dict, tmp_path: Path
) -> None:
    step, _ = fresh(Mesh.create((2,), ("data",)), "fsdp")
    before = step.full_parameters()
    bad = _copy(saved["path"], tmp_path / "truncated")
    (data,) = bad.glob("*.distcp")
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"tensor '.+' .*truncated.*Nothing was loaded"):
        ckpt.load(step, bad)
    data.unlink()
    with pytest.raises(CheckpointError, match=r"tensor '.+' .*the file is missing"):
        ckpt.load(step, bad)
    bad = _copy(saved["path"], tmp_path / "garbage")
    (data,) = bad.glob("*.distcp")
    raw = bytearray(data.read_bytes())
    raw[: len(raw) // 2] = bytes(len(raw) // 2)  # same length, zeroed: torch.load fails
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=rf"'{data}' does not match its checksum in"):
        ckpt.load(step, bad)  # the checksum names the file before torch.load trips on it
    (bad / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match=r"\.metadata' does not match its checksum"):
        ckpt.load(step, bad)
    (bad / "partita.json").unlink()  # a plain DCP checkpoint: no checksums to check
    with pytest.raises(CheckpointError, match=r"\.metadata' cannot be read"):
        ckpt.load(step, bad)
    shutil.copy(saved["path"] / ".metadata", bad / ".metadata")
    with pytest.raises(CheckpointError, match=r"reading tensor '.+' .*damaged"):
        ckpt.load(step, bad)
    with pytest.raises(CheckpointError, match=r"is not a checkpoint .*does not exist"):
        ckpt.load(step, tmp_path / "nowhere")
    (tmp_path / "nowhere.tmp-00000000000004d2").mkdir()  # what a SIGKILLed save leaves: never read
    with pytest.raises(
        CheckpointError, match=r"incomplete saves beside it: \['nowhere.tmp-00000000000004d2'\]"
    ):
        ckpt.load(step, tmp_path / "nowhere")
    for name, value in step.full_parameters().items():  # nothing changed
        assert torch.equal(value, before[name]), name


def test_a_checkpoint_of_another_model_is_a_typed_error(saved: dict) -> None:
    mesh = Mesh.create((2,), ("data",))
    wider, _ = fresh(mesh, "fsdp", GPTConfig(**{**CFG.__dict__, "d_model": 32}))
    with pytest.raises(CheckpointError, match=r"'.+' is saved with shape \(\d+, 16\).*\(\d+, 32\)"):
        ckpt.load(wider, saved["path"])
    deeper, _ = fresh(mesh, "fsdp", GPTConfig(**{**CFG.__dict__, "n_layer": 2}))
    with pytest.raises(CheckpointError, match=r"missing \['blocks\.1\..*different model"):
        ckpt.load(deeper, saved["path"])
    wrong = {"blocks.0.mlp.fc.weight": torch.zeros(64, 16, dtype=torch.float64)}
    with pytest.raises(CheckpointError, match=r"'blocks.0.mlp.fc.weight' .*dtype torch.float32"):
        ckpt.load(wrong, saved["path"])
    with pytest.raises(CheckpointError, match=r"scheduler= is restored into a TrainStep"):
        ckpt.load(wrong, saved["path"], scheduler=object())


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(CFG.vocab_size, CFG.d_model)
        self.head = nn.Linear(CFG.d_model, CFG.vocab_size)
        self.head.weight = self.tok_emb.weight  # one tensor, two names

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.tok_emb(ids))


def test_tied_weights_save_once_and_load(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = train_step(model, loss_fn, opt, mesh=Mesh.create((2,), ("data",)), param_specs="fsdp")
    step(batches(1)[0])
    ckpt.save(step, tmp_path / "c")
    md = dcp.FileSystemReader(tmp_path / "c").read_metadata().state_dict_metadata
    assert "tok_emb.weight" in md and "head.weight" not in md  # one tensor, saved once
    plain = TiedLM()
    sd = plain.state_dict()  # both names, one storage: loading one fills both
    dcp.load(sd, checkpoint_id=tmp_path / "c", planner=DefaultLoadPlanner(allow_partial_load=True))
    want = step.full_parameters()["tok_emb.weight"]
    assert torch.equal(plain.head.weight.detach(), want)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    with pytest.raises(CheckpointError, match=r"holds no learning-rate scheduler state"):
        ckpt.load(step, tmp_path / "c", scheduler=sched)
    torch.manual_seed(1)
    other = TiedLM()
    again = train_step(other, loss_fn, torch.optim.AdamW(other.parameters(), lr=1e-2),
                       mesh=Mesh.create((2,), ("data",)), param_specs="dp")  # fmt: skip
    ckpt.load(again, tmp_path / "c")
    assert torch.equal(again.full_parameters()["tok_emb.weight"], want)
    assert again.state_dict()["model"]["head.weight"].equal(want)  # the tie holds


@pytest.mark.slow
@pytest.mark.usefixtures("rank_zygote")  # ranks forked from a pre-imported process
def test_gloo_resume_and_save(saved: dict, tmp_path: Path) -> None:
    """4 Gloo processes load the (2, 4) fsdp+tp checkpoint on (4,) under fsdp, train 3 steps
    (losses equal the uninterrupted run) and save; a second save that fails on one rank leaves
    that checkpoint loadable; plain torch then loads what they wrote."""
    from partita.runtime.launch import spawn

    out = tmp_path / "dist"
    argv = [str(SCRIPTS / "checkpoint_resume.py"), str(saved["path"]), str(out)]
    results = spawn(argv, 4, timeout=180)
    assert all(r.returncode == 0 for r in results), "\n".join(
        f"--- rank {r.rank}: {r.returncode}\n{r.stdout[-1500:]}\n{r.stderr[-2500:]}"
        for r in results
    )
    losses = torch.load(out / "losses.pt")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(saved["losses"]), **TOL)
    files = sorted(p.name for p in (out / "final").glob("*.distcp"))
    assert len(files) == 4  # every process wrote its own shards
    model = GPT(CFG)
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=out / "final")
    for name, value in sd.items():
        torch.testing.assert_close(value, saved["params"][name], **TOL, msg=name)
    # rank 2's writer failed in the second save: every rank raised, "final" stayed loadable
    assert (out / "failed_save.txt").read_text() == "CheckpointError on every rank; reloaded"


@pytest.mark.slow  # one subprocess (~4 s)
def test_a_sigkilled_save_leaves_the_last_checkpoint(tmp_path: Path) -> None:
    """A real SIGKILL midway through a save (after DCP wrote the first tensor of B)."""
    path = tmp_path / "c"
    script = SCRIPTS / "checkpoint_kill.py"
    done = subprocess.run([sys.executable, str(script), str(path)], capture_output=True)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    (tmp,) = sorted(tmp_path.glob("c.tmp-*"))
    assert [p.name for p in tmp.iterdir()] == ["__0_0.distcp"]  # half written, no .metadata
    mesh = Mesh.create((2,), ("data",))
    template = {
        "w": ShardedTensor.from_global(torch.zeros(4, 2), P(None, "data").to_sharding(mesh, 2)),
        "b": torch.zeros(3),
    }
    with pytest.warns(PartitaWarning, match=rf"\['{tmp.name}'\] beside it .*not read"):
        got = ckpt.load(template, path)
    assert torch.equal(got["w"].full(), torch.arange(8.0).reshape(4, 2))  # checkpoint A
    assert torch.equal(got["b"], torch.arange(3.0))
    with pytest.warns(PartitaWarning, match=rf"removing \['{tmp.name}'\].*did not finish"):
        ckpt.save({"b": torch.full((3,), 7.0)}, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no left-overs any more: no warning
        assert torch.equal(ckpt.load({"b": torch.zeros(3)}, path)["b"], torch.full((3,), 7.0))


VMESH = Mesh.create((2, 4), ("data", "model"))
VSPECS = {"0.weight": P("model", None), "0.bias": P("model"), "2.weight": P(None, "model")}


def _virtual_mlp(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    dev = partita.use_spmd(VMESH)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(dev)
    for name, spec in VSPECS.items():
        partita.mark_sharding(model.get_parameter(name), VMESH, spec)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _virtual_step(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> float:
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
    dev = torch.device("spmd", 0)
    x, y = x.to(dev), y.to(dev)
    partita.mark_sharding(x, VMESH, P("data", None))
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    partita.sync()
    return loss.item()


def test_virtual_device_model_and_optimizer_save_and_load_in_place(tmp_path: Path) -> None:
    model, opt = _virtual_mlp(0)
    for i in range(2):
        _virtual_step(model, opt, i)
    ckpt.save(model, tmp_path / "v", optimizer=opt)
    other, other_opt = _virtual_mlp(1)  # another init, no optimizer state yet
    params = [id(p) for p in other.parameters()]
    ckpt.load(other, tmp_path / "v", optimizer=other_opt)
    assert [id(p) for p in other.parameters()] == params  # in place: same Parameter objects
    for (name, a), b in zip(model.named_parameters(), other.parameters(), strict=True):
        assert torch.equal(a.cpu(), b.cpu()), name
        assert partita.virtual.sharded(b).sharding == partita.virtual.sharded(a).sharding
    assert other_opt.state_dict()["state"][0]["step"] == 2
    assert _virtual_step(other, other_opt, 2) == pytest.approx(_virtual_step(model, opt, 2))
    for (name, a), b in zip(model.named_parameters(), other.parameters(), strict=True):
        torch.testing.assert_close(a.cpu(), b.cpu(), **TOL, msg=name)
    ckpt.save(model, tmp_path / "w")
    with pytest.raises(CheckpointError, match=r"holds no optimizer state .*without optimizer="):
        ckpt.load(other, tmp_path / "w", optimizer=other_opt)
    with pytest.raises(CheckpointError, match=r"optimizer=.*target is a dict.*leave optimizer="):
        ckpt.save({"b": torch.zeros(1)}, tmp_path / "x", optimizer=opt)


def test_virtual_device_optimizer_saved_before_its_first_step_loads(tmp_path: Path) -> None:
    """An optimizer with no state yet saved, then loading failed with KeyError: 'state'."""
    model, opt = _virtual_mlp(0)
    ckpt.save(model, tmp_path / "v", optimizer=opt)
    other, other_opt = _virtual_mlp(1)
    ckpt.load(other, tmp_path / "v", optimizer=other_opt)
    assert other_opt.state_dict()["state"] == {}
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a.cpu(), b.cpu())
    assert _virtual_step(other, other_opt, 0) == pytest.approx(_virtual_step(model, opt, 0))


def test_virtual_device_model_keeps_scheduler_extra_and_rng(tmp_path: Path) -> None:
    """scheduler=, extra= and the RNG state were refused for a virtual-device model."""
    model, opt = _virtual_mlp(0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for i in range(2):
        _virtual_step(model, opt, i)
        sched.step()
    torch.manual_seed(123)
    ckpt.save(model, tmp_path / "v", optimizer=opt, scheduler=sched, extra={"batch": 7})
    draw = torch.rand(3)
    other, other_opt = _virtual_mlp(1)
    other_sched = torch.optim.lr_scheduler.StepLR(other_opt, step_size=1, gamma=0.5)
    extra = ckpt.load(other, tmp_path / "v", optimizer=other_opt, scheduler=other_sched)
    assert extra == {"batch": 7}
    assert other_sched.get_last_lr() == sched.get_last_lr()
    assert torch.equal(torch.rand(3), draw)  # the RNG state was restored too
    assert ckpt.load(other, tmp_path / "v") == {"batch": 7}  # scheduler= is optional


# --- what a save refuses, what a load checks ---------------------------------------------


def _tensors(value: float) -> dict[str, Any]:
    mesh = Mesh.create((2,), ("data",))
    w = torch.full((4,), value)
    return {"w": ShardedTensor.from_global(w, P("data").to_sharding(mesh, 1))}


def _listing(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_save_refuses_a_directory_that_is_not_a_partita_checkpoint(tmp_path: Path) -> None:
    """A save into a directory of other files used to delete them without a word."""
    logs = tmp_path / "run"
    logs.mkdir()
    (logs / "train.log").write_text("step 1 loss 2.0\n")
    (logs / "notes.md").write_text("# notes\n")
    before = _listing(tmp_path)
    with pytest.raises(
        CheckpointError,
        match=r"'.*run': it holds \['notes.md', 'train.log'\] and no partita.json, so it is "
        r"not a partita checkpoint\. .*Nothing was written, moved or deleted\. Save to a new",
    ):
        ckpt.save(_tensors(1.0), logs)
    assert _listing(tmp_path) == before  # nothing touched, no temporary beside it
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match=r"'.*file': it is a file, not a directory"):
        ckpt.save(_tensors(1.0), tmp_path / "file")
    dcp.save({"x": torch.ones(2)}, checkpoint_id=tmp_path / "plain")  # DCP, not partita's
    with pytest.raises(CheckpointError, match=r"\(a torch.distributed.checkpoint without"):
        ckpt.save(_tensors(1.0), tmp_path / "plain")
    # an earlier partita checkpoint is replaced; an empty directory is fine
    (tmp_path / "empty").mkdir()
    ckpt.save(_tensors(1.0), tmp_path / "empty")
    ckpt.save(_tensors(2.0), tmp_path / "empty")
    assert torch.equal(
        ckpt.load(_tensors(0.0), tmp_path / "empty")["w"].full(), torch.full((4,), 2.0)
    )
    # ... unless someone put a file of their own into it
    (tmp_path / "empty" / "train.log").write_text("mine")
    with pytest.raises(CheckpointError, match=r"also holds \['train.log'\], which are not its"):
        ckpt.save(_tensors(3.0), tmp_path / "empty")
    assert (tmp_path / "empty" / "train.log").read_text() == "mine"


def test_manifest_lists_every_file_with_its_sha256(tmp_path: Path) -> None:
    ckpt.save(_tensors(1.0), tmp_path / "c")
    body = json.loads((tmp_path / "c" / "partita.json").read_text())
    assert body["format"] == "partita.checkpoint" and body["version"] == 1
    files = sorted(p.name for p in (tmp_path / "c").iterdir() if p.name != "partita.json")
    assert sorted(body["files"]) == files == [".metadata", "__0_0.distcp"]
    for name, entry in body["files"].items():
        data = (tmp_path / "c" / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_a_flipped_byte_is_an_error_naming_the_file(tmp_path: Path) -> None:
    """A changed byte inside a tensor's raw data used to load silently."""
    ckpt.save(_tensors(1.0), tmp_path / "c")
    (data,) = (tmp_path / "c").glob("*.distcp")
    raw = bytearray(data.read_bytes())
    at = raw.rindex(torch.full((2,), 1.0).numpy().tobytes())  # a shard's raw float data
    raw[at + 1] ^= 0x10
    data.write_bytes(bytes(raw))
    with pytest.raises(
        CheckpointError, match=rf"'{data}' does not match its checksum in partita.json"
    ):
        ckpt.load(_tensors(0.0), tmp_path / "c")
    manifest = tmp_path / "c" / "partita.json"
    body = json.loads(manifest.read_text())
    del body["files"][data.name]
    manifest.write_text(json.dumps(body))
    with pytest.raises(CheckpointError, match=r"is read by this checkpoint's .metadata but is "
                       r"not listed in its partita.json"):  # fmt: skip
        ckpt.load(_tensors(0.0), tmp_path / "c")
    data.unlink()
    ckpt.save(_tensors(1.0), tmp_path / "d")
    (tmp_path / "d" / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"\.metadata' is missing \(partita.json lists it"):
        ckpt.load(_tensors(0.0), tmp_path / "d")
    manifest.write_text(json.dumps({**body, "version": 99}))
    with pytest.raises(CheckpointError, match=r"has format version 99; this partita reads "
                       r"version 1\..*Load it with the partita version that saved it"):  # fmt: skip
        ckpt.load(_tensors(0.0), tmp_path / "c")
    manifest.write_text("{not json")
    with pytest.raises(CheckpointError, match=r"partita.json' is not a valid partita manifest"):
        ckpt.load(_tensors(0.0), tmp_path / "c")
    with pytest.raises(CheckpointError, match=r"'.*c': its partita.json is damaged"):
        ckpt.save(_tensors(2.0), tmp_path / "c")  # not ours to replace any more


def _step() -> TrainStep:
    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return train_step(model, F.mse_loss, opt, mesh=Mesh.create((2,), ("data",)), param_specs="dp")


def test_extra_holds_only_what_loads_back(tmp_path: Path) -> None:
    """np.float64, datetime and Path in extra= used to save, then fail to load ("damaged")."""
    import numpy as np

    step = _step()
    extra = {
        "best": np.float64(1.25),
        "epoch": np.int64(3),
        "ok": np.bool_(True),
        "history": [1, 2.5, "x", None, (True, torch.ones(2))],
        "nested": {"a": {"b": np.float32(0.5)}},
    }
    ckpt.save(step, tmp_path / "c", extra=extra)
    got = ckpt.load(step, tmp_path / "c")
    assert got["best"] == 1.25 and type(got["best"]) is float
    assert got["epoch"] == 3 and type(got["epoch"]) is int
    assert got["ok"] is True and got["nested"] == {"a": {"b": 0.5}}
    assert got["history"][:4] == [1, 2.5, "x", None]
    assert got["history"][4][0] is True and torch.equal(got["history"][4][1], torch.ones(2))
    refused = [
        ({"when": datetime.datetime(2026, 12, 3)}, r"extra\['when'\] is not a type a "
         r"checkpoint can load back \(datetime.datetime .*when.isoformat\(\)"),
        ({"run": {"dir": Path("/tmp/run")}}, r"extra\['run'\]\['dir'\] is not a type .*"
         r"\(pathlib.PosixPath PosixPath\('/tmp/run'\)\).*str\(path\)"),
        ({"h": [1, np.ones(2)]}, r"extra\['h'\]\[1\] .*numpy.ndarray.*torch.from_numpy"),
        ({"by_step": {1: 0.5}}, r"extra\['by_step'\]\[1\] is a dict key that is not a str.*"
         r"would load as '1'"),
        ({"empty": {}}, r"extra\['empty'\] is an empty dict .*Leave extra\['empty'\] out"),
        ({"a.b": 1, "a": {"b": 2}}, r"two entries of extra get the same checkpoint name "
         r"\(duplicated flatten key extra.a.b\)"),
        ([1], r"extra is a list; it must be a dict"),
        ({"w": _tensors(1.0)["w"]}, r"extra\['w'\] is not a type .*Save a plain tensor: "
         r"\.full\(\) of a ShardedTensor"),
    ]  # fmt: skip
    for bad, message in refused:
        with pytest.raises(CheckpointError, match=message):
            ckpt.save(step, tmp_path / "refused", extra=bad)
        assert not (tmp_path / "refused").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no temporary either


def test_a_crash_between_the_renames_is_recovered(tmp_path: Path) -> None:
    """The previous checkpoint moved aside, the new one complete beside it, no path: load
    reads the new one where it is, and the next save puts it back before going on.
    (tests/test_faults.py crashes a real 2-process save at every point.)"""
    path = tmp_path / "c"
    ckpt.save(_tensors(1.0), path)
    ckpt.save(_tensors(2.0), tmp_path / "new")
    path.rename(tmp_path / "c.old-00000000000000a1")
    (tmp_path / "new").rename(tmp_path / "c.tmp-00000000000000a1")
    with pytest.warns(PartitaWarning, match=r"reading 'c.tmp-00000000000000a1' beside it"):
        assert torch.equal(ckpt.load(_tensors(0.0), path)["w"].full(), torch.full((4,), 2.0))
    (tmp_path / "c.tmp-00000000000000b2").mkdir()  # an incomplete one: never chosen
    with pytest.warns(PartitaWarning) as caught:
        ckpt.save({"x": torch.zeros(1)}, path)
    assert "'c.tmp-00000000000000a1' beside it is the complete checkpoint" in str(caught[0].message)
    assert "removing ['c.old-00000000000000a1', 'c.tmp-00000000000000b2']" in str(caught[1].message)
    assert [p.name for p in tmp_path.iterdir()] == ["c"]


def test_a_failed_rename_puts_the_previous_checkpoint_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "c"
    ckpt.save(_tensors(1.0), path)
    real = os.replace

    def failing(src: Any, dst: Any) -> None:
        if Path(src).name.startswith("c.tmp-"):
            raise OSError("rename failed (injected)")
        real(src, dst)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(CheckpointError, match=r"publishing the checkpoint failed on rank 0: "
                       r"OSError: rename failed \(injected\)"):  # fmt: skip
        ckpt.save(_tensors(2.0), path)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["c"]
    assert torch.equal(ckpt.load(_tensors(0.0), path)["w"].full(), torch.full((4,), 1.0))


def test_a_relative_path_saves_and_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    ckpt.save(_tensors(1.0), "run/")
    ckpt.save(_tensors(2.0), Path("run"))
    assert torch.equal(ckpt.load(_tensors(0.0), "./run")["w"].full(), torch.full((4,), 2.0))
    assert [p.name for p in tmp_path.iterdir()] == ["run"]
