"""shard_map regions on the virtual device (``partita.use_spmd``), against eager PyTorch.

A region called on lazy tensors inside the ordinary loop (forward, ``loss.backward()``,
``opt.step()``, ``partita.sync()``) is recorded op by op and compiled through the same manual
path as in ``partita.jit``: an MLP whose middle is a region trains like the same MLP written
on global tensors; every collective's value and gradient equals the unsharded math (fully and
partially manual); the user's mistakes raise the same typed errors at the call.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import partita
from partita import Mesh, P
from partita.errors import ReplicationError, ShardMapError, VirtualDeviceError
from partita.partition.manual import USER_COLLECTIVE
from partita.virtual import disk_cache
from partita.virtual import state as virtual_state
from test_shard_map import B, _cases

MESH = Mesh.create((2, 4), ("data", "model"))


@pytest.fixture(scope="module")
def dev() -> torch.device:
    return partita.use_spmd(MESH)


def _last_plan() -> partita.Plan:
    """The Plan of the program the last sync compiled (the newest entry of the step cache)."""
    program = next(reversed(virtual_state.get().programs.values()))
    assert program.compiled is not None
    return program.compiled.plan


# --- an MLP whose middle is a region, trained ------------------------------------------------


def _middle(h: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor) -> torch.Tensor:
    """Tensor parallel over 'model' on a 'data' block of the batch (Megatron's MLP)."""
    return partita.psum(torch.relu(h @ wa) @ wb, "model")


class _MLP(nn.Module):
    def __init__(self, region: Callable[..., torch.Tensor] | None) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.inp = nn.Linear(4, 8)
        self.wa = nn.Parameter(torch.randn(8, 16, generator=g) * 0.3)
        self.wb = nn.Parameter(torch.randn(16, 8, generator=g) * 0.3)
        self.out = nn.Linear(8, 2)
        self.region = region

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if self.region is None:  # the same math on global tensors
            h = torch.relu(h @ self.wa) @ self.wb
        else:
            h = self.region(h, self.wa, self.wb)
        return self.out(h)


def test_mlp_with_a_region_trains_like_eager(dev: torch.device) -> None:
    region = partita.shard_map(
        _middle,
        mesh=MESH,
        in_specs=(P("data", None), P(None, "model"), P("model", None)),
        out_specs=P("data", None),
    )
    torch.manual_seed(0)
    ref = _MLP(None)
    model = copy.deepcopy(ref)
    model.region = region
    model = model.to(dev)
    # Laid out as the region reads them (replicated, they would be sliced on entry and their
    # updates gathered back).
    partita.mark_sharding(model.wa, MESH, P(None, "model"))
    partita.mark_sharding(model.wb, MESH, P("model", None))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    partita.sync()  # ops an earlier test left recorded are not this loop's first step
    virtual_state.get().programs.clear()
    partita.metrics(reset=True)
    for _ in range(3):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
        want = ((ref(x) - y) ** 2).mean()
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        xd = partita.mark_sharding(x.to(dev), MESH, P("data", None))
        loss = ((model(xd) - y.to(dev)) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        partita.sync()
        torch.testing.assert_close(loss.item(), want.item(), atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q.full(), p.detach(), atol=1e-5, rtol=1e-5, msg=name)
    # One program for the three steps: the region's boundaries are the same ops every step.
    assert partita.metrics().compiles == 1, str(partita.metrics())
    # The region went through the manual path: the body's collectives are the user's psum on
    # the local [8 / 2, 8] block, its transpose's (h's cotangent, invariant over 'model', summed
    # over it), and the sums over 'data' of the cotangents of wa and wb (replicated over 'data').
    plan = _last_plan()
    users = [
        (c.kind, c.mesh_axes, c.shape) for c in plan.collectives if USER_COLLECTIVE in c.reason
    ]
    assert sorted(users) == [
        ("all_reduce", ("data",), (4, 8)),
        ("all_reduce", ("data",), (8, 4)),
        ("all_reduce", ("model",), (4, 8)),
        ("all_reduce", ("model",), (4, 8)),
    ]
    assert not [c for c in plan.collectives if c.kind == "all_gather"]  # no weight gathered


# --- every collective, forward and gradient ------------------------------------------------


# (label, the region's manual axes (None: all of them), the axis its collectives run over)
_REGIONS = [
    ("m", None, "model"),
    ("m-partial", ["model"], "model"),
    ("dm", None, ("data", "model")),
]
_BOTH_AXES = ("psum", "all_gather", "ppermute")


def test_collectives_and_gradients_equal_unsharded(dev: torch.device) -> None:
    """Each collective in its own region (fully manual over 'model', partially manual over
    'model' with 'data' splitting the columns around it, and over both axes for three of them),
    all in one recorded step: values and gradients equal the unsharded math."""
    cases = []
    g = torch.Generator().manual_seed(2)
    for label, manual, axis in _REGIONS:
        n = MESH.axes_size((axis,) if isinstance(axis, str) else axis)
        for name, (body, cols, out_spec, ref) in _cases(n).items():
            if label == "dm" and name not in _BOTH_AXES:
                continue
            x = torch.randn(n * B, cols, generator=g)
            cot = torch.randn(ref(x).shape, generator=g)
            region = partita.shard_map(
                lambda xb, body=body, axis=axis: body(xb, axis),
                mesh=MESH,
                in_specs=P(axis),
                out_specs=out_spec(axis),
                axes=manual,
            )
            cases.append((f"{label}/{name}", region, ref, x, cot, manual and cols % 2 == 0))
    leaves, outs = [], []
    for _, region, _, x, _cot, split_columns in cases:
        xd = x.to(dev)
        if split_columns:  # a 2-D program around a partially manual region
            partita.mark_sharding(xd, MESH, P(None, "data"))
        xd.requires_grad_()
        leaves.append(xd)
        outs.append(region(torch.sin(xd)))
    sum((o * c.to(dev)).sum() for o, (*_, c, _s) in zip(outs, cases, strict=True)).backward()
    partita.sync()
    for (label, _, ref, x, cot, _s), out, xd in zip(cases, outs, leaves, strict=True):
        x = x.detach().requires_grad_()
        want = ref(torch.sin(x))
        (want * cot).sum().backward()
        torch.testing.assert_close(out.full(), want.detach(), atol=1e-5, rtol=1e-5, msg=label)
        assert xd.grad is not None, label
        torch.testing.assert_close(xd.grad.full(), x.grad, atol=1e-5, rtol=1e-5, msg=label)


# --- the user's mistakes ---------------------------------------------------------------------


def test_mistakes_are_the_same_typed_errors(dev: torch.device) -> None:
    x = torch.ones(8, 4, device=dev) * 2.0  # a pending value
    with pytest.raises(ShardMapError, match="out_specs is missing"):
        partita.shard_map(lambda b: b, mesh=MESH, in_specs=P("data"), out_specs=None)(x)
    with pytest.raises(ReplicationError, match=r"varies over \['data'\].*psum"):
        partita.shard_map(lambda b: b, mesh=MESH, in_specs=P("data"), out_specs=P())(x)
    with pytest.raises(ShardMapError, match="dim 1 has size 4, which 8 devices do not divide"):
        partita.shard_map(
            lambda b: b, mesh=MESH, in_specs=P(None, ("data", "model")), out_specs=P()
        )(x)
    with pytest.raises(ShardMapError, match=r"names mesh axes \['data'\] that are not manual"):
        partita.shard_map(
            lambda b: partita.psum(b, "data"),
            mesh=MESH,
            in_specs=P(None, "model"),
            out_specs=P(None, "model"),
            axes=["model"],
        )(x)
    with pytest.raises(ShardMapError, match="no in_spec, and it is computed in this step"):
        partita.shard_map(lambda b: b, mesh=MESH, out_specs=P("data"))(x)
    other = Mesh.create((8,), ("i",))
    with pytest.raises(VirtualDeviceError, match="switched on for"):
        partita.shard_map(lambda b: b, mesh=other, in_specs=P("i"), out_specs=P("i"))(x)
    # The half-recorded regions do not spoil the step: a correct region after them is exact,
    # and a CPU tensor among its arguments is an input like any other (not run on the CPU).
    ok = partita.shard_map(
        lambda b, c: partita.psum((b * c).sum(0, keepdim=True), "data"),
        mesh=MESH,
        in_specs=(P("data"), P()),
        out_specs=P(),
    )(x, torch.arange(4.0))
    # Data keeps its own layout as in_spec when none is given.
    data = partita.mark_sharding(torch.ones(8, 4).to(dev), MESH, P("data", None))
    sums = partita.shard_map(lambda b: partita.psum(b.sum(0), "data"), mesh=MESH, out_specs=P())(
        data
    )
    torch.testing.assert_close(ok.full(), 16.0 * torch.arange(4.0)[None])
    torch.testing.assert_close(sums.full(), torch.full((4,), 8.0))


# --- the persistent compile cache ------------------------------------------------------------


def _cached_step(cache_dir: str, shift_keys: bool = False) -> dict:
    """One step with a region on the virtual device, compiled through ``cache_dir``: its loss,
    a gradient and the metrics. ``shift_keys``: create another region's boundary first, as a
    process that ran other programs before would have."""
    if shift_keys:
        from partita.capture.manual import Boundary, new_boundary

        replicated = P().to_sharding(MESH, 1)
        new_boundary(Boundary(replicated, (3,), (3,), ("data", "model"), what="another"))
    dev = partita.use_spmd(MESH, cache_dir=cache_dir)
    virtual_state.get().programs.clear()
    partita.metrics(reset=True)
    g = torch.Generator().manual_seed(3)
    wa = torch.randn(8, 16, generator=g).to(dev).requires_grad_()
    wb = torch.randn(16, 8, generator=g).to(dev).requires_grad_()
    x = partita.mark_sharding(torch.randn(8, 8, generator=g).to(dev), MESH, P("data", None))
    region = partita.shard_map(
        _middle,
        mesh=MESH,
        in_specs=(P("data", None), P(None, "model"), P("model", None)),
        out_specs=P("data", None),
    )
    loss = region(torch.tanh(x), wa, wb).square().mean()
    loss.backward()
    assert wa.grad is not None
    m = partita.metrics()
    return {
        "loss": loss.item(),
        "grad": wa.grad.cpu().tolist(),
        "compiles": m.compiles,
        "disk_hits": m.disk_hits,
    }


@pytest.mark.slow
def test_a_second_process_reuses_the_cached_step_with_a_region(
    dev: torch.device, tmp_path: Path
) -> None:
    """Boundary keys are part of the step's cache key: they must mean the same boundary in
    every process (a per-process counter would give another process a wrong or no program)."""
    try:
        first = _cached_step(str(tmp_path))
    finally:
        disk_cache.set_directory(None)
    assert (first["compiles"], first["disk_hits"]) == (1, 0)
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[2]); "
        "from test_shard_map_virtual import _cached_step; "
        "print(json.dumps(_cached_step(sys.argv[1], shift_keys=True)))"
    )
    tests = str(Path(__file__).resolve().parent)
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path), tests],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    second = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (second["compiles"], second["disk_hits"]) == (0, 1)
    assert (second["loss"], second["grad"]) == (first["loss"], first["grad"])
