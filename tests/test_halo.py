"""The halo handler (partition/halo/): windowed dims sharded over mesh axes lower to a halo
exchange with neighbours; every sharded program equals the unsharded one."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import partita
from partita import Mesh, P
from partita.partition.halo import Geo, halo_plan
from programs import MESH, canonical_cases

MESHES = {
    "2": Mesh.create((2,), ("x",)),
    "2x2": Mesh.create((2, 2), ("x", "y")),
    "4": Mesh.create((4,), ("x",)),
}


def run(fn, mesh, in_specs, out_specs, *args):
    """Run ``fn`` sharded, check it equals the unsharded run, return the Plan."""
    jitted = partita.jit(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = jitted.lower(*args)
        out = jitted(*args)
    ref = fn(*args)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    refs = ref if isinstance(ref, (tuple, list)) else (ref,)
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs, strict=True):
        torch.testing.assert_close(o.full(), r, atol=1e-4, rtol=1e-4)
    return plan


def permutes(plan):
    return [c for c in plan.collectives if c.kind == "collective_permute"]


def spatial_spec(mesh: Mesh, ndim: int) -> P:
    """[n, c, *spatial]: the first spatial dim over the first mesh axis, the second over the
    second (2-d meshes)."""
    spec = [None] * ndim
    spec[2] = mesh.axis_names[0]
    if mesh.ndim > 1 and ndim > 3:
        spec[3] = mesh.axis_names[1]
    return P(*spec)


# --- canonical cases ---------------------------------------------------------------------------


def _case(name):
    (case,) = [c for c in canonical_cases() if c.name == name]
    return case


def test_t22_pad_two_permutes_of_two_columns():
    case = _case("T22")
    plan = run(case.fn, MESH, case.in_specs, case.out_specs, *case.args)
    assert [c.kind for c in plan.collectives] == ["collective_permute"] * 2
    assert [c.shape for c in plan.collectives] == [(16, 2), (16, 2)]
    assert all(c.mesh_axes == ("y",) for c in plan.collectives)
    assert all(c.groups == ((0, 1, 2, 3), (4, 5, 6, 7)) for c in plan.collectives)
    assert all("halo exchange" in c.reason for c in plan.collectives)


def test_t23_conv_two_permutes_of_one_row():
    case = _case("T23")
    plan = run(case.fn, MESH, case.in_specs, case.out_specs, *case.args)
    assert [c.kind for c in plan.collectives] == ["collective_permute"] * 2
    # x [8,4,32,32] P('x',None,'y',None): local [4,4,8,32]; one row each way
    assert [c.shape for c in plan.collectives] == [(4, 4, 1, 32), (4, 4, 1, 32)]
    assert all(c.mesh_axes == ("y",) and "halo exchange" in c.reason for c in plan.collectives)
    assert "halo exchange" in plan.explain()


def test_halo_plan_geometry():
    # T22: 32 -> 40 columns over 4 devices: 2 real columns from each neighbour
    h = halo_plan(Geo(dim=1, n=32, m=40, kernel=1, stride=1, pad=4, dil=1), 4)
    assert h is not None and (h.lh, h.rh, h.c_in, h.c_out, h.w) == (2, 2, 8, 10, 10)
    # T23: 3x3 padding 1 on 32 rows over 4 devices: one row each way, same window everywhere
    h = halo_plan(Geo(dim=2, n=32, m=32, kernel=3, stride=1, pad=1, dil=1), 4)
    assert h is not None and (h.lh, h.rh, h.step) == (1, 1, 0)
    # a kernel reaching past the neighbour's tile: no halo plan (gather)
    assert halo_plan(Geo(dim=2, n=8, m=8, kernel=7, stride=1, pad=3, dil=1), 4) is None


# --- forward ops against the unsharded op -------------------------------------------------------


def _conv_params(rng: random.Random, nd: int):
    k = [rng.randint(1, 4) for _ in range(nd)]
    s = [rng.randint(1, 3) for _ in range(nd)]
    d = [rng.randint(1, 2) for _ in range(nd)]
    p = [rng.randint(0, 2) for _ in range(nd)]
    size = [rng.randint(max(1, (k[i] - 1) * d[i] + 1 - 2 * p[i]), 13) for i in range(nd)]
    return k, s, d, p, size


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("seed", range(4))
def test_conv_random(mesh_name, nd, seed):
    rng = random.Random(100 * nd + seed + len(mesh_name))
    mesh = MESHES[mesh_name]
    k, s, d, p, size = _conv_params(rng, nd)
    x, w, b = torch.randn(2, 3, *size), torch.randn(4, 3, *k), torch.randn(4)
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[nd]
    spec = spatial_spec(mesh, 2 + nd)
    run(lambda x, w, b: conv(x, w, b, s, p, d), mesh, (spec, P(), P()), spec, x, w, b)


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("op", ["max", "avg", "pad"])
def test_pool_and_pad_random(mesh_name, seed, op):
    rng = random.Random(seed * 31 + len(mesh_name) + len(op))
    mesh = MESHES[mesh_name]
    k = [rng.randint(1, 4) for _ in range(2)]
    s = [rng.randint(1, 3) for _ in range(2)]
    d = [rng.randint(1, 2) for _ in range(2)] if op == "max" else [1, 1]
    p = [rng.randint(0, k[i] // 2) for i in range(2)]
    ceil = rng.random() < 0.3
    size = [rng.randint((k[i] - 1) * d[i] + 1, 13) for i in range(2)]
    x = torch.randn(2, 3, *size)
    spec = spatial_spec(mesh, 4)
    out_specs = spec
    if op == "max":
        out_specs = (spec, spec)  # indices too: global positions, equal to the unsharded op's

        def fn(x):
            return F.max_pool2d(x, k, s, p, d, ceil_mode=ceil, return_indices=True)
    elif op == "avg":
        include = rng.random() < 0.5

        def fn(x):
            return F.avg_pool2d(x, k, s, p, ceil_mode=ceil, count_include_pad=include)
    else:
        pads = [rng.randint(-2, 5) for _ in range(4)]
        value = rng.choice([0.0, 1.5])

        def fn(x):
            return F.pad(x, pads, value=value)

    run(fn, mesh, (spec,), out_specs, x)


def test_max_pool_edges_are_minus_inf():
    """All-negative input: a zero from the permute at an edge would win the max."""
    x = -torch.rand(2, 3, 10, 8) - 1.0
    mesh = MESHES["4"]
    spec = P(None, None, "x", None)
    plan = run(lambda x: F.max_pool2d(x, 3, 1, 1), mesh, (spec,), spec, x)
    assert len(permutes(plan)) == 2


def test_uneven_padding_garbage_does_not_leak():
    """exp(x) of an uneven shard holds exp(0) = 1 in its padding; 10 rows on 4 devices."""
    x = torch.randn(2, 3, 10, 6)
    w = torch.randn(4, 3, 3, 3)
    mesh = MESHES["4"]
    spec = P(None, None, "x", None)
    run(lambda x, w: F.conv2d(x.exp(), w, padding=1), mesh, (spec, P()), spec, x, w)
    run(lambda x: F.pad(x.exp(), (0, 0, 2, 3), value=-2.0), mesh, (spec,), spec, x)
    run(lambda x: F.max_pool2d(x.exp(), 3, 2, 1), mesh, (spec,), spec, x)


def test_gather_fallback_when_halo_exceeds_shard():
    """Kernel 7 on 8 rows over 4 devices: 3 rows needed from a neighbour holding 2."""
    x, w = torch.randn(2, 3, 8, 5), torch.randn(4, 3, 7, 1)
    mesh = MESHES["4"]
    spec = P(None, None, "x", None)
    plan = run(lambda x, w: F.conv2d(x, w, padding=(3, 0)), mesh, (spec, P()), spec, x, w)
    assert not permutes(plan)
    assert [c.kind for c in plan.collectives] == ["all_gather"]


def test_bias_added_once_with_sharded_input_channels():
    x, w, b = torch.randn(2, 4, 8, 8), torch.randn(3, 4, 3, 3), torch.randn(3)
    mesh = MESHES["2x2"]
    xs = P(None, "y", "x", None)
    ws = P(None, "y", None, None)
    plan = run(
        lambda x, w, b: F.conv2d(x, w, b, padding=1), mesh, (xs, ws, P()), P(None, None, "x", None),
        x, w, b,
    )  # fmt: skip
    assert len(permutes(plan)) == 2
    assert any(c.kind == "all_reduce" and c.mesh_axes == ("y",) for c in plan.collectives)


# --- backward ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("op", ["conv", "max", "avg"])
@pytest.mark.parametrize("seed", range(2))
def test_backward_random(mesh_name, op, seed):
    rng = random.Random(seed * 7 + len(op) + len(mesh_name))
    mesh = MESHES[mesh_name]
    k = [rng.randint(1, 4) for _ in range(2)]
    s = [rng.randint(1, 3) for _ in range(2)]
    d = [rng.randint(1, 2) for _ in range(2)] if op != "avg" else [1, 1]
    p = [rng.randint(0, k[i] // 2) for i in range(2)]
    size = [rng.randint((k[i] - 1) * d[i] + 1, 13) for i in range(2)]
    x, w, b = torch.randn(2, 3, *size), torch.randn(4, 3, *k), torch.randn(4)

    def fn(x, w, b):
        x, w, b = x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
        if op == "conv":
            y = F.conv2d(x, w, b, s, p, d)
        elif op == "max":
            y = F.max_pool2d(x, k, s, p, d) * 1.0
        else:
            y = F.avg_pool2d(x, k, s, p)
        loss = (y * y).sum() + y.sum() * (w.sum() + b.sum())
        if op == "conv":
            return torch.autograd.grad(loss, (x, w, b))
        return torch.autograd.grad(loss, (x,))

    spec = spatial_spec(mesh, 4)
    out_specs = (spec, P(), P()) if op == "conv" else (spec,)
    run(fn, mesh, (spec, P(), P()), out_specs, x, w, b)


def test_conv_training_step():
    """Two conv layers, a ReLU and an SGD update, H sharded over x, W over y (halo both ways);
    the updated weights equal the unsharded step's."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 12, 10)
    w1, b1 = torch.randn(4, 3, 3, 3) * 0.3, torch.randn(4) * 0.1
    w2 = torch.randn(2, 4, 3, 3) * 0.3

    def step(x, w1, b1, w2):
        w1, b1, w2 = w1.requires_grad_(), b1.requires_grad_(), w2.requires_grad_()
        h = F.relu(F.conv2d(x, w1, b1, padding=1))
        y = F.conv2d(h, w2, padding=1, stride=2)
        loss = (y * y).mean()
        g1, gb1, g2 = torch.autograd.grad(loss, (w1, b1, w2))
        return loss.reshape(1), w1 - 0.1 * g1, b1 - 0.1 * gb1, w2 - 0.1 * g2

    mesh = MESHES["2x2"]
    spec = P(None, None, "x", "y")
    plan = run(step, mesh, (spec, P(), P(), P()), (P(), P(), P(), P()), x, w1, b1, w2)
    reasons = [c.reason for c in permutes(plan)]
    assert reasons and all("halo exchange" in r for r in reasons)
    assert any("back to the" in r for r in reasons)  # the input gradient's halo goes home
