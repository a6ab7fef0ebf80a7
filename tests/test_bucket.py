"""Bucketing (``partition.bucket``): fused collectives compute exactly what the unfused ones do,
in fewer calls, and the Plan still attributes every byte to a value.

Every program runs on the simulated mesh twice, with ``PARTITA_BUCKET_BYTES=0`` (off) and with
bucketing on, and the two results are compared exactly. The real-process executor's fused ops
are checked in ``test_overlap.py``.
"""

from __future__ import annotations

import copy
import math
import operator

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import fx, nn

from partita import Mesh, P
from partita.errors import CompilerError, OptionError
from partita.ir.buckets import BUCKET_OPS
from partita.ir.collectives import COLLECTIVE_OPS
from partita.options import CompileOptions
from partita.partition.bucket import DEFAULT_BUCKET_BYTES, bucket_collectives
from partita.partition.plan import CollectiveRecord, Plan
from partita.training import train_step

ops = torch.ops.partita


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8)
    )


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(64, 16, generator=g), torch.randn(64, 8, generator=g)


def _train(
    monkeypatch: pytest.MonkeyPatch,
    setting: str,
    mesh: Mesh,
    plan: str,
    clip: float | None,
    regather: bool | None = None,
) -> tuple[list[float], dict[str, torch.Tensor], Plan]:
    monkeypatch.setenv("PARTITA_BUCKET_BYTES", setting)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    options = None if regather is None else {"regather": regather}
    step = train_step(
        model, F.mse_loss, opt, mesh=mesh, param_specs=plan, max_grad_norm=clip, options=options
    )
    losses = [float(step(_batch(i))) for i in range(2)]
    step.sync_to_module()
    return (
        losses,
        {k: v.detach().clone() for k, v in model.named_parameters()},
        step.lower(_batch()),
    )


@pytest.fixture(scope="module")
def fsdp_runs() -> dict[str, tuple[list[float], dict[str, torch.Tensor], Plan]]:
    """An MLP, FSDP on (4,) with gradient clipping: bucketing off and on (the default)."""
    mp = pytest.MonkeyPatch()
    mesh = Mesh.create((4,), ("data",))
    try:
        runs = {s: _train(mp, s, mesh, "fsdp", 1.0) for s in ("0", "")}
        runs["regather"] = _train(mp, "", mesh, "fsdp", 1.0, regather=True)
        return runs
    finally:
        mp.undo()


def test_fused_fsdp_training_equals_unfused(fsdp_runs: dict) -> None:
    base_losses, base_params, _ = fsdp_runs["0"]
    for setting in ("",):
        losses, params, _ = fsdp_runs[setting]
        assert losses == base_losses, setting
        for k, v in base_params.items():
            torch.testing.assert_close(params[k], v, rtol=0, atol=0, msg=f"{setting} {k}")


def test_fsdp_step_gathers_the_parameters_in_one_call(fsdp_runs: dict) -> None:
    _, _, off = fsdp_runs["0"]
    _, _, on = fsdp_runs[""]
    before, after = off.call_counts(), on.call_counts()
    assert before["all_gather"] >= 4 and before["reduce_scatter"] >= 4, off.explain()
    # The MLP fits one 4 MiB bucket: one all_gather and one reduce_scatter per step,
    # and the clipping norms' scalar all_reduces fused as well.
    assert after["all_gather"] == 1 and after["reduce_scatter"] == 1, on.explain()
    assert after["all_reduce"] < before["all_reduce"]
    # Records stay one per value: the same bytes, attributed to the same values.
    assert on.counts() == off.counts()
    assert [(c.value, c.bytes) for c in on.collectives] == [
        (c.value, c.bytes) for c in off.collectives
    ]
    assert sum(on.bucket_bytes(b) for b in on.buckets) <= on.bytes_per_device


def test_explain_lists_buckets(fsdp_runs: dict) -> None:
    _, _, on = fsdp_runs[""]
    text = on.explain()
    assert "buckets:" in text and "bucket 0: " in text
    assert fsdp_runs["0"][2].buckets == []
    assert "buckets:" not in fsdp_runs["0"][2].explain()


# --- the pass on hand-made programs ------------------------------------------------------------


def _record(kind: str, value: str) -> CollectiveRecord:
    return CollectiveRecord(kind, ("x",), ((0, 1),), (4,), torch.float32, value, "test")


def _chain() -> tuple[fx.GraphModule, Plan]:
    """``a = all_reduce(x)``, ``b = all_reduce(2 a)``, ``c = all_reduce(3 x)``: b depends on a."""
    g = fx.Graph()
    x = g.placeholder("x")
    x3 = g.call_function(torch.ops.aten.mul.Tensor, (x, 3.0))
    a = g.call_function(ops.all_reduce.default, (x, "sum", ["x"], 2))
    a2 = g.call_function(torch.ops.aten.mul.Tensor, (a, 2.0))
    b = g.call_function(ops.all_reduce.default, (a2, "sum", ["x"], 2))
    c = g.call_function(ops.all_reduce.default, (x3, "sum", ["x"], 2))
    g.output((b, c))
    plan = Plan(Mesh.create((2,), ("x",)))
    plan.collectives = [_record("all_reduce", n) for n in ("a", "b", "c")]
    return fx.GraphModule(nn.Module(), g), plan


def test_dependent_collectives_are_not_fused() -> None:
    gm, plan = _chain()
    before = copy.deepcopy(gm)
    bucket_collectives(gm, plan, 1 << 20)
    fused = [n for n in gm.graph.nodes if n.target in BUCKET_OPS]
    assert len(fused) == 1 and [b.members for b in plan.buckets] == [(0, 2)]
    # b reads a's result, so it stays alone and runs after the bucket.
    (alone,) = [n for n in gm.graph.nodes if n.target in COLLECTIVE_OPS]
    order = list(gm.graph.nodes)
    assert order.index(fused[0]) < order.index(alone)
    assert all(n.target is operator.getitem for n in fused[0].users)
    x = torch.randn(4)
    for got, want in zip(gm(x), before(x), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert all(n.meta["bytes"] == 16 for n in gm.graph.nodes if n.target in COLLECTIVE_OPS)


def test_bucketing_off_leaves_the_program_alone() -> None:
    gm, plan = _chain()
    code = gm.code
    bucket_collectives(gm, plan, 0)
    assert gm.code == code and plan.buckets == []


def test_plan_that_does_not_match_the_program_is_a_compiler_error() -> None:
    gm, plan = _chain()
    plan.collectives = plan.collectives[:2]
    with pytest.raises(CompilerError, match=r"has 3 collectives but its Plan records 2.*"
                       r"PARTITA_BUCKET_BYTES=0"):  # fmt: skip
        bucket_collectives(gm, plan, 1 << 20)


def test_bucket_size_option(monkeypatch: pytest.MonkeyPatch) -> None:
    from partita.options import current

    monkeypatch.delenv("PARTITA_BUCKET_BYTES", raising=False)
    assert current().bucket_bytes == DEFAULT_BUCKET_BYTES == 4 << 20
    monkeypatch.setenv("PARTITA_BUCKET_BYTES", "4000000")
    assert current().bucket_bytes == 4_000_000
    monkeypatch.setenv("PARTITA_BUCKET_BYTES", "lots")
    with pytest.raises(OptionError, match=r"PARTITA_BUCKET_BYTES='lots': must be a whole number"):
        current()
    with pytest.raises(OptionError, match=r"bucket_bytes=-1\): bucket_bytes must be an int >= 0"):
        CompileOptions(bucket_bytes=-1)


def test_partition_takes_the_knob() -> None:
    from partita.capture import trace
    from partita.partition import partition
    from partita.propagate import propagate

    mesh = Mesh.create((4,), ("data",))

    def f(w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return w * 2, b * 2

    args = (torch.randn(8, 8), torch.randn(8))
    plans = {}
    for cap in (0, 1 << 20):
        prog = trace(f, args, {}, in_specs=(P("data"), P("data")), out_specs=(P(), P()), mesh=mesh)
        propagate(prog.graph_module, mesh)
        _, plans[cap] = partition(prog.graph_module, mesh, CompileOptions(bucket_bytes=cap))
    assert plans[0].call_counts()["all_gather"] == 2
    assert plans[1 << 20].call_counts()["all_gather"] == 1


# --- memory ------------------------------------------------------------------------------------


def test_memory_estimate_follows_live_ranges() -> None:
    from partita.partition.memory import estimate_memory

    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))  # 16 B
    v = g.call_function(torch.ops.aten.view.default, (a, [2, 2]))  # a view: no new bytes
    b = g.call_function(torch.ops.aten.mul.Tensor, (v, 3.0))  # a (via v) still live: 48 B
    c = g.call_function(torch.ops.aten.add.Tensor, (b, 1.0))  # a is dead: 16 + 16 + 16
    g.output(c)
    est = estimate_memory(fx.GraphModule(nn.Module(), g), [torch.empty(4, device="meta")])
    assert est.peak == 48 and est.inputs == 16
    assert est.at_peak == {"inputs": 16, "gathered": 0, "other": 32}
    assert est.peak_node in ("mul_tensor_1", "add_tensor")


def test_plan_memory_counts_gathered_parameters(fsdp_runs: dict) -> None:
    _, _, on = fsdp_runs[""]
    est = on.memory()
    shards = sum(math.prod(t.shape) * t.element_size() for t in on.local_inputs)
    assert est.inputs == shards
    # FSDP gathers every parameter (one bucket, kept from forward to backward).
    params = sum(
        math.prod(c.shape) * 4 for c in on.collectives if c.kind == "all_gather"
    )  # fmt: skip
    assert est.at_peak["gathered"] <= params and est.peak >= est.inputs
    assert "MiB per device" in str(est)


def test_plan_memory_needs_a_program() -> None:
    with pytest.raises(ValueError, match=r"has no per-device program attached.*partition\(\)"):
        Plan(Mesh.create((2,), ("x",))).memory()


# --- re-gathering (partition.regather) ---------------------------------------------------------


def test_regather_training_equals_keeping(fsdp_runs: dict) -> None:
    keep_losses, keep_params, _ = fsdp_runs[""]
    losses, params, _ = fsdp_runs["regather"]
    assert losses == keep_losses
    for k, v in keep_params.items():
        torch.testing.assert_close(params[k], v, rtol=0, atol=0, msg=k)


def test_regather_gathers_the_middle_weight_again(fsdp_runs: dict) -> None:
    _, _, keep = fsdp_runs[""]
    _, _, again = fsdp_runs["regather"]
    # Linear 0's weight is not read by the backward (the input needs no gradient), Linear 2's
    # is read by it right after the forward (no other gather in between: kept), biases never:
    # only Linear 1's weight is gathered a second time.
    extra = [c for c in again.collectives if c.reason.startswith("gathered again for the backward")]
    assert len(extra) == 1 and extra[0].kind == "all_gather" and extra[0].shape == (32, 32)
    assert extra[0].value in {c.value for c in keep.collectives if c.kind == "all_gather"}
    assert again.counts() == {**keep.counts(), "all_gather": keep.counts()["all_gather"] + 1}
    assert again.bytes_per_device == keep.bytes_per_device + extra[0].bytes
    # the re-gather is its own call, never fused with the forward's gathers
    assert again.call_counts()["all_gather"] == keep.call_counts()["all_gather"] + 1


def test_regather_lowers_the_memory_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """Six layers, no buckets: keeping, five gathered weights are alive when the backward starts."""
    import partita
    from partita.presets import param_specs
    from partita.training import init_opt_state, make_train_step

    monkeypatch.setenv("PARTITA_BUCKET_BYTES", "0")
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(6)))
    mesh = Mesh.create((4,), ("data",))
    params = {k: v.detach() for k, v in model.named_parameters()}
    specs = param_specs("fsdp", model, mesh)
    state = init_opt_state(params, "sgd")
    sspecs = {k: P() if k == "step" else specs for k in state}
    in_specs = (specs, {}, sspecs, (P("data"),) * 2)
    batch = (torch.randn(128, 64), torch.randn(128, 64))
    peaks = {}
    for again in (False, True):
        step = partita.jit(
            make_train_step(model, F.mse_loss, "sgd"), mesh=mesh, in_specs=in_specs,
            options={"regather": again},
        )  # fmt: skip
        peaks[again] = step.lower(params, {}, state, batch).memory()
    # the four middle weights (16 KiB each, gathered) are freed after the forward and the
    # last layer's weight (read by the backward right away) is kept
    assert peaks[False].at_peak["gathered"] - peaks[True].at_peak["gathered"] == 4 * 16384
    assert peaks[True].peak < peaks[False].peak, peaks


def test_regather_option(monkeypatch: pytest.MonkeyPatch) -> None:
    from partita.options import current

    monkeypatch.delenv("PARTITA_REGATHER", raising=False)
    assert current().regather is False
    monkeypatch.setenv("PARTITA_REGATHER", "1")
    assert current().regather is True
    monkeypatch.setenv("PARTITA_REGATHER", "sometimes")
    with pytest.raises(OptionError, match=r"PARTITA_REGATHER='sometimes': must be one of 1/"):
        current()
    with pytest.raises(OptionError, match=r"regather='yes'\): regather must be True or False"):
        CompileOptions(regather="yes")  # type: ignore[arg-type]
