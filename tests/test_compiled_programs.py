"""Compiled per-device programs (``runtime.compiled``): Inductor-compiled local ops give the
uncompiled program's results, on the LocalMesh and on Gloo processes, compiled once.

Inductor compiles are slow (seconds each on a cold cache, and Inductor's first use in a process
costs 5-15 s on 2 cores): one compiled train step is shared by the module, and the tests that
compile are marked slow. Tolerance: Inductor fuses reductions and may sum in another order, so fp32
results agree to about 1e-6 relative, not bit for bit.
"""

from __future__ import annotations

import operator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

import partita
import partita.runtime.compiled as compiled_module
from partita import Mesh, P
from partita.errors import OptionError
from partita.ir import collectives as coll
from partita.runtime.compiled import CompileStats, compile_regions
from partita.runtime.launch import spawn

SCRIPTS = Path(__file__).parent / "dist_scripts"
MESH = Mesh.create((4,), ("data",))
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _train(inductor: bool, steps: int = 2) -> tuple[list[torch.Tensor], Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = partita.train_step(
        model, F.mse_loss, opt, mesh=MESH, param_specs="fsdp",
        options={"inductor": inductor},
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        losses.append(step((torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g))))
    return losses, step


@pytest.fixture(scope="module")
def fsdp_runs() -> dict[str, tuple[list[torch.Tensor], Any]]:
    return {"plain": _train(False), "compiled": _train(True)}


@pytest.mark.slow  # Inductor's first compile in a process: 10-50 s here
def test_compiled_fsdp_step_equals_uncompiled(fsdp_runs: dict[str, Any]) -> None:
    (plain_losses, plain), (losses, step) = fsdp_runs["plain"], fsdp_runs["compiled"]
    for a, b in zip(losses, plain_losses, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    want = plain.full_parameters()
    for name, value in step.full_parameters().items():
        torch.testing.assert_close(value, want[name], **TOL, msg=name)
    stats = step.stats
    assert stats.inductor_regions > 0 and stats.inductor_seconds > 0, stats
    assert stats.skipped == (), stats.skipped
    assert plain.stats.inductor_regions == 0 and plain.stats.inductor_seconds == 0


@pytest.mark.slow  # Inductor's first compile in a process: 10-50 s here
def test_a_compiled_program_compiles_once(fsdp_runs: dict[str, Any]) -> None:
    _, step = fsdp_runs["compiled"]
    before = step.stats
    step((torch.randn(8, 16), torch.randn(8, 8)))
    after = step.stats
    assert after.inductor_regions == before.inductor_regions
    assert after.inductor_seconds == before.inductor_seconds
    assert after.signatures == 1 and after.partition_seconds > 0


def _with_a_collective() -> fx.GraphModule:
    def f(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = torch.split(x @ w, [2, 3], dim=1)  # a list: its getitems stay in the region
        h = torch.relu(torch.cat([b, a], dim=1))
        s = coll.all_reduce(h, "sum", ["data"], 4)
        return s * 2 + 1, h.sum()

    return make_fx(f)(torch.randn(2, 3), torch.randn(3, 5))


def test_regions_are_the_runs_of_local_ops_between_mesh_ops() -> None:
    """mm, split, cat, relu | all_reduce | mul, add, sum: two regions, the collective stays
    between (a list-valued split with its getitems inside: on 4 Gloo ranks the GPT's 19
    regions failed in Inductor when the list was a region's output)."""
    program = _with_a_collective()
    gm = compile_regions(program, CompileStats())
    calls = [n.target.__name__ for n in gm.graph.nodes if n.op == "call_function"]
    calls = [c for c in calls if c != "getitem"]
    assert calls == ["region0", "all_reduce.default", "region1"], calls
    region0 = next(n for n in gm.graph.nodes if n.op == "call_function")
    outputs = [u for u in region0.users if u.target is operator.getitem]
    assert len(outputs) == 1, "only relu's result leaves region0 (the split list stays inside)"


def test_a_region_inductor_cannot_compile_runs_uncompiled(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(gm: fx.GraphModule, args: Any) -> Any:
        raise NotImplementedError("no lowering for this op\nmore")

    monkeypatch.setattr(compiled_module, "_inductor", fail)
    stats = CompileStats()
    args = [torch.randn(2, 3), torch.randn(3, 5)]
    gm = make_fx(lambda x, w: (torch.relu(x @ w),))(*args)
    fn = compiled_module.compile_graph(gm, args, stats, "region0")
    assert fn is gm and stats.regions == 0
    assert stats.skipped == ["region0: NotImplementedError: no lowering for this op"]
    torch.testing.assert_close(fn(*args)[0], torch.relu(args[0] @ args[1]))


def test_inductor_option(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PARTITA_INDUCTOR", raising=False)
    assert partita.options.current().inductor is False
    monkeypatch.setenv("PARTITA_INDUCTOR", "1")
    assert partita.options.current().inductor is True
    monkeypatch.setenv("PARTITA_INDUCTOR", "fast")
    with pytest.raises(OptionError, match=r"PARTITA_INDUCTOR='fast': must be one of 1/"):
        partita.options.current()
    monkeypatch.delenv("PARTITA_INDUCTOR")
    with pytest.raises(OptionError, match=r"inductor='yes'\): .*must be True or False"):
        partita.jit(lambda x: x, mesh=MESH, in_specs=(P(),), options={"inductor": "yes"})


@pytest.mark.slow
@pytest.mark.usefixtures("rank_zygote")  # ranks forked from a pre-imported process
def test_gloo_compiled_step_equals_uncompiled(tmp_path: Path) -> None:
    out = tmp_path / "compiled.pt"
    results = spawn([str(SCRIPTS / "compiled_programs.py"), str(out)], 2, timeout=600)
    assert all(r.returncode == 0 for r in results), "\n".join(
        f"rank {r.rank}: {r.returncode}\n{r.stderr[-2500:]}" for r in results
    )
    got = torch.load(out)
    (plain_losses, plain), (losses, params) = got["plain"], got["compiled"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain_losses), **TOL)
    for name, value in params.items():
        torch.testing.assert_close(value, plain[name], **TOL, msg=name)
    regions, skipped = got["stats"]
    assert regions > 0 and skipped == ()
    # TrainStep.memory() on a DistributedMesh counts what the LocalMesh's step holds per device
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    local = partita.train_step(
        model, F.mse_loss, opt, mesh=Mesh.create((2,), ("data",)), param_specs="fsdp"
    )
    local((torch.randn(8, 16), torch.randn(8, 8)))
    assert got["memory"] == local.memory()


def test_sdpa_kernels_return_the_strides_of_their_fakes() -> None:
    """A compiled region checks a custom op's outputs against its fake's strides: the CPU
    kernel's logsumexp came back [B, L, H]-strided and failed there."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 16, 4, 8, generator=g).transpose(1, 2) for _ in range(3))
    real = torch.ops.partita.sdpa(q, k, v, None, 0.0, True, None)
    grads = torch.ops.partita.sdpa_backward(real[0], q, k, v, *real, None, 0.0, True, None)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fake = torch.ops.partita.sdpa(fq, fk, fv, None, 0.0, True, None)
        fgrads = torch.ops.partita.sdpa_backward(fake[0], fq, fk, fv, *fake, None, 0.0, True, None)
    for r, f in zip((*real, *grads), (*fake, *fgrads), strict=True):
        assert (r.shape, r.stride()) == (f.shape, f.stride())


def test_a_region_whose_first_compiled_run_fails_runs_uncompiled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As a custom op whose kernel's strides differ from its fake's fails in Inductor's code."""

    def compiled_but_broken(gm: fx.GraphModule, args: Any) -> Any:
        def run(*a: Any) -> Any:
            raise AssertionError("expected size 8==8, stride 1==128 at dim=1")

        return run

    monkeypatch.setattr(compiled_module, "_inductor", compiled_but_broken)
    stats = CompileStats()
    args = [torch.randn(2, 3), torch.randn(3, 5)]
    gm = make_fx(lambda x, w: (torch.relu(x @ w),))(*args)
    fn = compiled_module.compile_graph(gm, args, stats, "region3")
    for _ in range(2):
        torch.testing.assert_close(fn(*args)[0], torch.relu(args[0] @ args[1]))
    assert stats.regions == 0
    assert stats.skipped == ["region3: first run failed: AssertionError: expected size 8==8, "
                             "stride 1==128 at dim=1"]  # fmt: skip
