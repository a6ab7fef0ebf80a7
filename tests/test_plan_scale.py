"""Planning without the hardware: meta-device models lower, and any mesh size plans.

A model built under ``torch.device("meta")`` has shapes but no data. ``jit(...).lower``,
``train_step(...).lower`` and the virtual device's step compile it to the same Plan as the
real model (collectives, bytes, shardings); ``Plan.memory()`` works on it; running it is a
:class:`~partita.MetaTensorError`. A mesh of 16,384 devices lowers, its device groups computed
on demand (``DeviceGroups``), never stored per device.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import partita
import partita.virtual
from partita import Mesh, MetaTensorError, P
from partita.values.mesh import DeviceGroups

MESH = Mesh.create((2, 4), ("data", "model"))

# The virtual device test below runs after other tests' backward(): register the device at
# import, before any test runs (as docs/virtual-device.md says a test session does).
partita.virtual.register_device()


def _mlp(device: str) -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))


def _batch(device: str, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ones(n, 16, device=device), torch.ones(n, 16, device=device)


def _step(device: str, mesh: Mesh = MESH) -> partita.TrainStep:
    model = _mlp(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return partita.train_step(model, F.mse_loss, opt, mesh=mesh, param_specs="fsdp+tp")


def _same_plan(a: partita.Plan, b: partita.Plan) -> None:
    assert a.explain() == b.explain()
    assert a.bytes_per_device == b.bytes_per_device
    assert a.collectives == b.collectives
    assert a.input_shardings == b.input_shardings


def test_train_step_of_a_meta_model_lowers_to_the_real_models_plan() -> None:
    meta = _step("meta").lower(_batch("meta"))
    real = _step("cpu").lower(_batch("cpu"))
    assert meta.collectives  # fsdp+tp moves data: the comparison is not of two empty plans
    _same_plan(meta, real)


def test_jit_of_a_meta_module_lowers_to_the_real_modules_plan() -> None:
    def lowered(device: str) -> partita.Plan:
        fwd = partita.jit(
            _mlp(device), mesh=MESH, in_specs=(P("data", None),), param_specs="fsdp+tp"
        )
        return fwd.lower(_batch(device)[0])

    _same_plan(lowered("meta"), lowered("cpu"))


def test_memory_of_a_meta_plan_equals_the_real_plans() -> None:
    meta = _step("meta").lower(_batch("meta")).memory()
    real = _step("cpu").lower(_batch("cpu")).memory()
    assert meta.peak == real.peak > 0
    assert meta.at_peak == real.at_peak


def test_running_a_meta_train_step_says_it_needs_data() -> None:
    step = _step("meta")
    step.lower(_batch("meta"))
    with pytest.raises(MetaTensorError, match=r"parameter '0\.weight'.*meta device.*to_empty"):
        step(_batch("meta"))


def test_running_a_jitted_meta_module_says_it_needs_data() -> None:
    fwd = partita.jit(_mlp("meta"), mesh=MESH, in_specs=(P("data", None),))
    with pytest.raises(MetaTensorError, match=r"no data.*load_state_dict"):
        fwd(_batch("meta")[0])


def test_the_virtual_devices_step_of_a_meta_model_plans_and_refuses_to_run() -> None:
    dev = partita.use_spmd(MESH)

    def recorded(device: str) -> tuple[partita.Plan, torch.Tensor]:
        model = _mlp(device).to(dev)
        for name, spec in partita.presets.param_specs("fsdp+tp", model, MESH).items():
            partita.mark_sharding(model.get_parameter(name), MESH, spec)
        x, y = (t.to(dev) for t in _batch(device))
        partita.mark_sharding(x, MESH, P("data", None))
        loss = F.mse_loss(model(x), y)
        loss.backward()
        partita.sync()
        return partita.last_plan(), loss

    real, _ = recorded("cpu")
    meta, loss = recorded("meta")
    assert meta.collectives
    _same_plan(meta, real)
    with pytest.raises(MetaTensorError, match=r"virtual device's step.*meta device"):
        loss.item()


def test_a_16384_device_mesh_lowers_a_small_mlp() -> None:
    mesh = Mesh.create((64, 256), ("data", "model"))
    plan = _step("meta", mesh).lower(_batch("meta", 64))
    small = _step("meta").lower(_batch("meta"))
    assert plan.collectives and plan.mesh is mesh
    assert {c.kind for c in plan.collectives} <= {c.kind for c in small.collectives} | {
        "all_to_all"
    }
    record = plan.collectives[0]
    assert isinstance(record.groups, DeviceGroups)
    assert len(record.groups) * len(record.groups[0]) == mesh.size
    assert plan.memory().peak > 0
    assert "groups:" in plan.explain()  # printed shortened, not 16,384 ids


def test_device_groups_are_computed_on_demand_and_equal_the_lists() -> None:
    groups = MESH.device_groups(("model",))
    assert len(groups) == 2 and groups.size == 4
    assert groups == ((0, 1, 2, 3), (4, 5, 6, 7)) == tuple(tuple(g) for g in MESH.groups(["model"]))
    assert list(groups) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert groups[1] == (4, 5, 6, 7) and groups[-1] == groups[1]
    assert hash(groups) == hash(((0, 1, 2, 3), (4, 5, 6, 7)))
    assert MESH.device_groups(("data", "model")) == (tuple(range(8)),)
    assert MESH.device_groups(()) == tuple((d,) for d in range(8))
    with pytest.raises(IndexError, match="2 device groups"):
        groups[2]


def test_a_big_mesh_is_built_without_a_list_per_device() -> None:
    mesh = Mesh.create((64, 256), ("data", "model"))
    assert mesh.size == 16384 and mesh.axis_size("model") == 256
    groups = mesh.device_groups(("data",))
    assert len(groups) == 256 and groups[255][63] == 16383
    assert mesh.position(16383) == 16383 and mesh.coords(300) == {"data": 1, "model": 44}
    assert repr(mesh) == "Mesh(data=64, model=256)"


def _permute_sources_by_loop(src, dst, partial):  # type: ignore[no-untyped-def]
    """The reference: the per-device loop the planner used before (one device at a time)."""
    from partita.values.layout import tile_coords

    mesh = src.mesh
    coords = [tuple(int(c) for c in np.unravel_index(p, mesh.shape)) for p in range(mesh.size)]
    part = [mesh.axis_index(a) for a in partial]
    key_src = [
        (*t, *(c[i] for i in part)) for t, c in zip(tile_coords(src).tolist(), coords, strict=True)
    ]
    key_dst = [
        (*t, *(c[i] for i in part)) for t, c in zip(tile_coords(dst).tolist(), coords, strict=True)
    ]
    senders: dict[tuple[int, ...], list[int]] = {}
    for p, k in enumerate(key_src):
        if k != key_dst[p]:
            senders.setdefault(k, []).append(p)
    return [p if key_src[p] == k else senders[k].pop(0) for p, k in enumerate(key_dst)]


@pytest.mark.parametrize(
    ("shape", "src", "dst", "partial"),
    [
        ((4, 4), P("x", "y"), P("y", "x"), ()),
        ((2, 4, 2), P(("x", "z"), "y"), P("y", ("z", "x")), ()),
        ((4, 2, 2), P("y", None), P("z", None), ("x",)),
        ((2, 2, 2), P(("x", "y")), P(("y", "x")), ("z",)),
    ],
)
def test_permute_sources_equal_the_per_device_loop(shape, src, dst, partial) -> None:  # type: ignore[no-untyped-def]
    from partita.values.layout import permute_sources

    mesh = Mesh.create(shape, ("x", "y", "z")[: len(shape)])
    a = src.to_sharding(mesh, 2 if len(src) == 2 else 1)
    b = dst.to_sharding(mesh, a.ndim)
    q, _ = permute_sources(a, b, partial)
    assert q.tolist() == _permute_sources_by_loop(a, b, partial)
