"""``partita.checkpoint``: sharded DCP checkpoints that reshard on load and never corrupt.

Every resume is checked against the uninterrupted run: train 2 steps on one mesh and plan,
save, and compare the next 3 steps of (a) the same run continued and (b) a fresh step on
another mesh / plan (or plain PyTorch) that loaded the checkpoint: losses and final parameters
to 1e-5 (the plans reduce in different orders). The multi-process case (4 Gloo processes) is in
``test_gloo_resume_and_save`` (slow).
"""

from __future__ import annotations

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
    with pytest.raises(CheckpointError, match=r"reading tensor '.+' .*damaged"):
        ckpt.load(step, bad)
    (bad / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match=r"\.metadata' cannot be read"):
        ckpt.load(step, bad)
    with pytest.raises(CheckpointError, match=r"is not a checkpoint .*does not exist"):
        ckpt.load(step, tmp_path / "nowhere")
    (tmp_path / "nowhere.tmp-1234").mkdir()  # what a SIGKILLed save leaves: never read
    with pytest.raises(
        CheckpointError, match=r"incomplete saves beside it: \['nowhere.tmp-1234'\]"
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
