"""The cost model (partita.cost) and the Plan's step estimate (partition/estimate.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import partita
from partita import P
from partita.cost import (
    PROFILES,
    Hardware,
    Link,
    collective_time,
    get_profile,
    link_of,
    node_bytes,
    node_flops,
    op_time,
    wire_bytes,
)
from partita.cost.model import ring_steps
from partita.errors import ArgumentError
from partita.values.mesh import Mesh


@pytest.mark.parametrize(
    ("kind", "steps", "wire"),
    [
        ("all_gather", 3, 3 / 4 * 1024),
        ("reduce_scatter", 3, 3 / 4 * 1024),
        ("all_to_all", 3, 3 / 4 * 1024),
        ("all_reduce", 6, 2 * 3 / 4 * 1024),
        ("collective_permute", 1, 1024),
    ],
)
def test_ring_model_per_kind(kind: str, steps: int, wire: float) -> None:
    assert ring_steps(kind, 4) == steps
    assert wire_bytes(kind, 1024, 4) == pytest.approx(wire)
    link = Link(bandwidth=1e9, latency=1e-5)
    assert collective_time(kind, 1024, 4, link) == pytest.approx(steps * 1e-5 + wire / 1e9)


def test_a_group_of_one_costs_nothing() -> None:
    assert collective_time("all_reduce", 1 << 20, 1, Link(1e9, 1e-5)) == 0.0
    assert wire_bytes("all_gather", 1 << 20, 1) == 0.0


def test_unknown_kind_and_profile_are_typed_errors() -> None:
    with pytest.raises(ArgumentError, match="unknown collective kind 'broadcast'"):
        wire_bytes("broadcast", 8, 2)
    with pytest.raises(ArgumentError, match=r"unknown hardware profile 'tpu'.*cpu-gloo"):
        get_profile("tpu")
    assert get_profile(PROFILES["cpu-gloo"]) is PROFILES["cpu-gloo"]


def test_roofline_takes_the_slower_bound_and_the_launch_floor() -> None:
    hw = Hardware("x", 1e12, 1e11, 1 << 30, 8, Link(1e11, 1e-6), Link(1e10, 1e-5), 1e-6)
    assert op_time(1e12, 0, hw) == pytest.approx(1.0)  # compute-bound
    assert op_time(0, 1e11, hw) == pytest.approx(1.0)  # memory-bound
    assert op_time(1, 1, hw) == pytest.approx(1e-6)  # the launch floor


def test_the_link_follows_the_hosts_a_group_spans() -> None:
    hw = PROFILES["h100-nvlink-ib"]  # 8 devices per host
    mesh = Mesh.create((4, 8), ("data", "model"))  # a row of 8 is one host
    assert link_of(hw, mesh, ["model"]) == hw.intra_host
    assert link_of(hw, mesh, ["data"]) == hw.inter_host
    assert link_of(hw, mesh, ["data", "model"]) == hw.inter_host
    assert link_of(hw, Mesh.create((8, 4), ("data", "model")), ["data"]) == hw.inter_host
    big = Mesh.create((64, 256), ("data", "model"))  # 16,384 devices: vectorised
    assert link_of(hw, big, ["model"]) == hw.inter_host


def test_flops_use_torchs_formulas_and_views_are_free() -> None:
    gm = make_fx(lambda a, b: torch.relu(a @ b).t(), tracing_mode="fake")(
        torch.randn(64, 32), torch.randn(32, 16)
    )
    by_op = {n.target: n for n in gm.graph.nodes if n.op == "call_function"}
    mm = by_op[torch.ops.aten.mm.default]
    assert node_flops(mm) == 2 * 64 * 32 * 16
    assert node_bytes(mm) == 4 * (64 * 32 + 32 * 16 + 64 * 16)
    assert node_flops(by_op[torch.ops.aten.relu.default]) == 64 * 16
    assert node_flops(by_op[torch.ops.aten.t.default]) == 0


def test_a_plans_estimate_adds_each_collective_on_its_link() -> None:
    mesh = Mesh.create((2, 4), ("data", "model"))
    f = partita.jit(
        lambda x, w: (x @ w).sum(0), mesh=mesh, in_specs=(P("data", "model"), P("model"))
    )
    plan = f.lower(torch.randn(8, 16), torch.randn(16, 4))
    assert plan.collectives, "x @ w contracts over 'model': a partial to reduce"
    est = plan.estimate("h100-nvlink-ib")
    hw = PROFILES["h100-nvlink-ib"]
    expected = sum(
        hw.collective_seconds(c.kind, c.bytes, mesh, c.mesh_axes) for c in plan.collectives
    )
    assert est.communication == pytest.approx(expected)
    assert est.flops >= 2 * 4 * 4 * 4  # the local mm: [4, 4] @ [4, 4]
    assert est.total == pytest.approx(est.compute + est.communication)
    assert "h100-nvlink-ib" in str(est)


def test_collective_calls_count_a_bucket_once() -> None:
    from partita.partition.estimate import collective_calls

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    step = partita.train_step(
        model,
        torch.nn.functional.mse_loss,
        torch.optim.AdamW(model.parameters()),
        mesh=Mesh.create((4,), ("data",)),
        param_specs="fsdp",
    )
    plan = step.lower((torch.randn(8, 16), torch.randn(8, 4)))
    calls = collective_calls(plan)
    assert plan.buckets, "fsdp buckets its gathers and reductions"
    assert len(calls) == sum(plan.call_counts().values()) < len(plan.collectives)
    assert sum(b for _, b, _ in calls) == plan.bytes_per_device
    # every call its whole overhead (no call window): the sum of the calls' times
    whole = dataclasses.replace(PROFILES["cpu-gloo"], call_window=0.0)
    summed = sum(whole.collective_seconds(k, b, plan.mesh, a) for k, b, a in calls)
    assert plan.estimate(whole).communication == pytest.approx(summed)
    # with the window a call after little compute waits less: what each axis spares is off
    # the same sum, and the step's first call (nothing before it is known) pays it whole
    hw = PROFILES["cpu-gloo"]
    assert hw.call_window > 0
    est = plan.estimate(hw)
    spared = sum(est.spared.values())
    assert est.communication == pytest.approx(summed - spared)
    assert 0 < spared <= (len(calls) - 1) * hw.call_overhead


def test_call_overhead_is_added_once_per_call_of_a_real_group() -> None:
    hw = PROFILES["h100-nvlink-ib"]
    busy = dataclasses.replace(hw, call_overhead=1e-3)
    mesh = Mesh.create((2, 4), ("data", "model"))
    base = hw.collective_seconds("all_reduce", 1 << 20, mesh, ["model"])
    assert busy.collective_seconds("all_reduce", 1 << 20, mesh, ["model"]) == pytest.approx(
        base + 1e-3
    )
    one = Mesh.create((1, 8), ("data", "model"))
    assert busy.collective_seconds("all_reduce", 1 << 20, one, ["data"]) == 0.0  # no peers
    assert "per collective call: 1e+03 us" in busy.describe()


def test_attention_flops_are_torchs_formulas_for_fused_attention() -> None:
    """partita::sdpa / sdpa_backward count what torch's flop_counter counts for aten's fused
    attention kernels of the same shapes (they were 0: a partita op)."""
    from torch.utils.flop_counter import FlopCounterMode

    import partita.capture.ops  # noqa: F401  (defines partita::sdpa)

    def attention(q, k, v, g):  # type: ignore[no-untyped-def]
        out, lse = torch.ops.partita.sdpa(q, k, v, None, 0.0, True, None)
        return torch.ops.partita.sdpa_backward(g, q, k, v, out, lse, None, 0.0, True, None)

    q, k, v, g = (torch.randn(2, 4, 16, 8) for _ in range(4))
    gm = make_fx(attention, tracing_mode="fake")(q, k, v, g)
    by_op = {n.target: n for n in gm.graph.nodes if n.op == "call_function"}
    aten = torch.ops.aten
    meta = [t.to("meta") for t in (q, k, v)]
    with FlopCounterMode(display=False) as forward:
        out, lse, s, o = aten._scaled_dot_product_efficient_attention(*meta, None, True, True)
    with FlopCounterMode(display=False) as backward:
        aten._scaled_dot_product_efficient_attention_backward(
            out, *meta, None, out, lse, s, o, 0.0, [True, True, True, False], True
        )
    fwd, bwd = by_op[torch.ops.partita.sdpa.default], by_op[torch.ops.partita.sdpa_backward.default]
    assert node_flops(fwd) == forward.get_total_flops() == 2 * (2 * 2 * 4 * 16 * 8 * 16)
    assert node_flops(bwd) == backward.get_total_flops() == 5 * (2 * 2 * 4 * 16 * 8 * 16)
    # bytes: the operands and results, as for any op that computes
    assert node_bytes(fwd) == 4 * (3 * 2 * 4 * 16 * 8 + 2 * 4 * 16 * 8 + 2 * 4 * 16)
    assert node_bytes(bwd) > 0


def test_op_overhead_is_added_to_the_roofline_and_the_cache_serves_the_first_bytes() -> None:
    base = Hardware("x", 1e12, 1e9, 1 << 30, 8, Link(1e11, 1e-6), Link(1e10, 1e-5), 1e-6)
    eager = dataclasses.replace(base, op_overhead=1e-5)
    assert op_time(1e12, 0, eager) == pytest.approx(1.0 + 1e-5)  # compute-bound, plus dispatch
    assert op_time(0, 1e9, eager) == pytest.approx(1.0 + 1e-5)  # memory-bound, plus dispatch
    assert op_time(0, 0, eager) == pytest.approx(1e-5)  # above the 1 us launch floor
    assert op_time(0, 0, base) == pytest.approx(1e-6)  # no overhead: the floor, as before
    cached = dataclasses.replace(base, cache_bytes=1e6, cache_bandwidth=1e10)
    assert op_time(0, 5e5, cached) == pytest.approx(5e5 / 1e10)  # all inside the cache
    assert op_time(0, 3e6, cached) == pytest.approx(1e6 / 1e10 + 2e6 / 1e9)  # 1 MB, then 2 MB
    assert op_time(1e12, 3e6, cached) == pytest.approx(1.0)  # still the slower bound
    assert "10 us added" in eager.describe()
    assert cached.copy_seconds(3e6) == op_time(0, 3e6, cached)  # no copy rate: the roofline
    copying = dataclasses.replace(eager, copy_bandwidth=5e8)
    assert copying.copy_seconds(1e9) == pytest.approx(2.0 + 1e-5)  # its own rate, plus dispatch
    assert copying.copy_seconds(0) == pytest.approx(1e-5)
    assert dataclasses.replace(copying, op_overhead=0.0).copy_seconds(0) == 1e-6  # the floor


def test_call_overhead_grows_with_the_compute_since_the_previous_call() -> None:
    hw = dataclasses.replace(PROFILES["h100-nvlink-ib"], call_overhead=2e-3, call_window=4e-3)
    assert hw.call_seconds(None) == pytest.approx(2e-3)  # not known: the whole overhead
    assert hw.call_seconds(0.0) == 0.0  # right behind another call
    assert hw.call_seconds(1e-3) == pytest.approx(0.5e-3)  # a quarter of the window
    assert hw.call_seconds(9e-3) == pytest.approx(2e-3)  # beyond the window: the whole
    mesh = Mesh.create((2, 4), ("data", "model"))
    whole = hw.collective_seconds("all_reduce", 1 << 20, mesh, ["model"])
    behind = hw.collective_seconds("all_reduce", 1 << 20, mesh, ["model"], compute_before=0.0)
    assert whole - behind == pytest.approx(2e-3)
    no_window = dataclasses.replace(hw, call_window=0.0)  # every call the whole overhead
    assert no_window.call_seconds(0.0) == pytest.approx(2e-3)
    assert "2e+03 us (after 4e+03 us of compute or more" in hw.describe()
    assert "of compute" not in no_window.describe()
