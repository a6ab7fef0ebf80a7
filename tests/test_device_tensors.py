"""Device tensors answer as ShardedTensors do (issue 27): ``.sharding``, ``.local_shards``,
``visualize_sharding``, ``clear_sharding`` and re-annotation, each checked on both kinds
against the same expectations; ``ShardedTensor.to(dev)`` / ``make_global(device=...)`` in one
process; ``mark_sharding`` on module weights off the device and in a forward run eagerly; the
last step's Plan. The multi-process data path is tests/test_device_loop_dist.py.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the PyTorch convention
from rich.console import Console
from torch import nn

import partita
from partita import AnnotationError, Mesh, P, ShardedTensor, ShardingError
from partita.data import GlobalBatchLoader, make_global
from partita.virtual import VirtualDeviceError
from partita.virtual import state as virtual_state

MESH = Mesh.create((2, 4), ("data", "model"))
VALUE = torch.arange(32.0).reshape(8, 4)


@pytest.fixture(scope="module")
def dev() -> torch.device:
    return partita.use_spmd(MESH)


def _sharded(value: torch.Tensor, spec: Any, dev: torch.device) -> ShardedTensor:
    del dev
    return partita.mark_sharding(value.clone(), MESH, spec)


def _on_device(value: torch.Tensor, spec: Any, dev: torch.device) -> torch.Tensor:
    return partita.mark_sharding(value.clone().to(dev), MESH, spec)


KINDS: dict[str, Callable[[torch.Tensor, Any, torch.device], Any]] = {
    "ShardedTensor": _sharded,
    "device tensor": _on_device,
}
kinds = pytest.mark.parametrize("make", KINDS.values(), ids=KINDS.keys())


def _shards(x: Any) -> list[tuple[int, tuple[slice, ...], int, list[Any]]]:
    return [(s.device, s.index, s.replica_id, s.unpadded_data.tolist()) for s in x.local_shards]


@kinds
def test_sharding_and_spec(make: Callable[..., Any], dev: torch.device) -> None:
    x = make(VALUE, P("data", "model"), dev)
    assert x.sharding == P("data", "model").to_sharding(MESH, 2)
    assert x.spec == P("data", "model")
    assert x.is_annotated


@kinds
def test_local_shards_are_snapshots_with_the_same_tiles(
    make: Callable[..., Any], dev: torch.device
) -> None:
    x = make(VALUE, P("data", None), dev)
    expected = _shards(_sharded(VALUE, P("data", None), dev))
    assert _shards(x) == expected
    assert expected[4] == (4, (slice(4, 8), slice(0, 4)), 0, VALUE[4:].tolist())
    for shard in x.local_shards:
        shard.data.fill_(-1)  # a snapshot: the tensor does not change
    assert x.full().tolist() == VALUE.tolist()


@kinds
def test_local_shard_views_see_the_storage(make: Callable[..., Any], dev: torch.device) -> None:
    x = make(VALUE, P("data", None), dev)
    views, again = x.local_shard_views, x.local_shard_views
    assert [v.data.data_ptr() for v in views] == [v.data.data_ptr() for v in again]
    assert [v.data.data_ptr() for v in views] != [s.data.data_ptr() for s in x.local_shards]
    assert [(v.device, v.index) for v in views] == [(s.device, s.index) for s in x.local_shards]


def test_an_unmarked_device_tensor_is_replicated_and_not_annotated(dev: torch.device) -> None:
    x = VALUE.to(dev)
    assert x.sharding == P(None, None).to_sharding(MESH, 2) and not x.is_annotated
    assert [s.unpadded_data.tolist() for s in x.local_shards] == [VALUE.tolist()] * MESH.size
    # a value a step computed: its layout is what the step produced, and it is not annotated
    y = _on_device(VALUE, P("data", None), dev) * 2
    assert y.sharding.spec == P("data", None) and not y.is_annotated
    assert partita.mark_sharding(y, MESH, P(None, "model")) is y  # any spec: no annotation yet
    assert y.sharding.spec == P(None, "model") and y.full().tolist() == (VALUE * 2).tolist()


@kinds
def test_visualize_sharding_is_the_same(make: Callable[..., Any], dev: torch.device) -> None:
    def shown(x: Any) -> str:
        out = io.StringIO()
        partita.visualize_sharding(x, console=Console(file=out, width=120, color_system=None))
        return out.getvalue()

    x = make(VALUE, P("data", "model"), dev)
    assert shown(x) == shown(_sharded(VALUE, P("data", "model"), dev))
    assert "rows 4:8" in shown(x)
    assert partita.format_sharding(x) == partita.format_sharding(
        P("data", "model").to_sharding(MESH, 2), (8, 4)
    )


def test_visualize_sharding_of_a_plain_tensor_names_the_fix() -> None:
    with pytest.raises(ShardingError, match=r"got a Tensor on cpu.*partita\.mark_sharding\(x"):
        partita.visualize_sharding(torch.zeros(4))  # type: ignore[arg-type]


@kinds
def test_the_same_annotation_again_is_a_no_op(make: Callable[..., Any], dev: torch.device) -> None:
    x = make(VALUE, P("data", None), dev)
    assert partita.mark_sharding(x, MESH, P("data", None)) is x
    assert partita.mark_sharding(x, MESH, ("data", None)) is x  # PyTorch/XLA's tuple form


@kinds
def test_another_annotation_must_be_cleared_first(
    make: Callable[..., Any], dev: torch.device
) -> None:
    x = make(VALUE, P("data", None), dev)
    with pytest.raises(AnnotationError, match=r"must be cleared first.*P\('data', None\)"):
        partita.mark_sharding(x, MESH, P(None, "model"))
    assert x.sharding.spec == P("data", None) and x.full().tolist() == VALUE.tolist()


@kinds
def test_clear_then_mark_reshards_in_place(make: Callable[..., Any], dev: torch.device) -> None:
    x = make(VALUE, P("data", None), dev)
    assert partita.clear_sharding(x) is x
    assert not x.is_annotated
    assert x.sharding.spec == P("data", None)  # no data moves at clear
    assert partita.mark_sharding(x, MESH, P(None, "model")) is x
    assert x.is_annotated and x.sharding.spec == P(None, "model")
    assert x.full().tolist() == VALUE.tolist()
    assert _shards(x) == _shards(_sharded(VALUE, P(None, "model"), dev))


def test_a_parameter_on_the_device_stays_annotated_across_steps(dev: torch.device) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2).to(dev)
    weight = model.weight
    assert partita.mark_sharding(model.weight, MESH, P(None, "model")) is weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        F.mse_loss(model(VALUE.to(dev)), torch.zeros(8, 2).to(dev)).backward()
        opt.step()
        opt.zero_grad()
        partita.sync()
    assert model.weight is weight and weight.is_annotated and weight.data.is_annotated
    with pytest.raises(AnnotationError, match="must be cleared first"):
        partita.mark_sharding(model.weight, MESH, P("model", None))


def test_clear_sharding_of_a_plain_tensor_still_raises() -> None:
    with pytest.raises(ShardingError, match="carries no annotation to clear"):
        partita.clear_sharding(torch.zeros(2))


# --- a ShardedTensor onto the device ---------------------------------------------------------


def test_sharded_tensor_to_device_copies_its_storage_in_its_layout(dev: torch.device) -> None:
    x = partita.mark_sharding(VALUE.clone(), MESH, P("data", None))
    before = partita.metrics().upload_bytes
    t = x.to(dev)
    assert t.device == dev and t.is_annotated and t.sharding == x.sharding
    assert t.local_shard_views[5].data.data_ptr() != x.stacked[5].data_ptr()  # a copy
    x.stacked.fill_(-1)  # changing x afterwards leaves the device's value alone, as for .to()
    assert partita.metrics().upload_bytes - before == VALUE.numel() * 4  # held: each tile once
    assert "upload_bytes=" in str(partita.metrics())
    torch.testing.assert_close((t * 2).cpu(), VALUE * 2)
    double = partita.mark_sharding(VALUE.clone(), MESH, P("data", None)).to(dev, torch.float64)
    assert double.dtype == torch.float64 and double.sharding.spec == P("data", None)
    torch.testing.assert_close(double.cpu(), VALUE.double())


def test_sharded_tensor_to_device_of_another_mesh(dev: torch.device) -> None:
    x = partita.mark_sharding(VALUE.clone(), Mesh.create((8,), ("data",)), P("data", None))
    with pytest.raises(VirtualDeviceError, match=r"lives on Mesh\(data=8\).*make_global"):
        x.to(dev)


def test_copying_a_cpu_tensor_in_counts_its_bytes(dev: torch.device) -> None:
    before = partita.metrics().upload_bytes
    VALUE.to(dev)
    assert partita.metrics().upload_bytes - before == VALUE.numel() * 4


def test_make_global_and_the_loader_on_the_device(dev: torch.device) -> None:
    t = make_global(VALUE, MESH, P("data"), device=dev)
    assert t.device == dev and t.is_annotated and t.sharding.spec == P("data", None)
    batches = [(VALUE, VALUE[:, 0].long())]
    ((x, y),) = list(GlobalBatchLoader(batches, MESH, P("data"), device=dev))
    assert x.device == y.device == dev and y.sharding.spec == P("data")
    torch.testing.assert_close(x.cpu(), VALUE)
    loader = GlobalBatchLoader(batches, MESH, P("data"), device=dev)
    list(loader)
    assert (loader.per_process_batch_size, loader.global_batch_size) == (8, 8)


def test_a_loop_fed_by_make_global_equals_eager(dev: torch.device) -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model.load_state_dict(ref.state_dict())
    model = model.to(dev)
    partita.mark_sharding(model[0].weight, MESH, P("model", None))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
        xb, yb = (
            make_global(x, MESH, P("data"), device=dev),
            make_global(y, MESH, P("data"), device=dev),
        )
        loss = F.mse_loss(model(xb), yb)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = F.mse_loss(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-6)


# --- mark_sharding off the device ------------------------------------------------------------


class _Marked(nn.Module):
    """A forward that annotates its activation, PyTorch/XLA style."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = partita.mark_sharding(torch.tanh(self.fc(x)), MESH, P("data", "model"))
        return self.out(h)


def test_a_marked_forward_runs_eagerly_as_the_reference() -> None:
    torch.manual_seed(0)
    model = _Marked()
    out = model(VALUE)
    assert type(out) is torch.Tensor and out.grad_fn is not None
    out.sum().backward()  # the unsharded reference trains: mark_sharding was the identity
    assert model.fc.weight.grad is not None
    # the same model under jit: the annotation applies, the values are the reference's
    jitted = partita.jit(model, mesh=MESH, in_specs=P("data"))
    torch.testing.assert_close(jitted(VALUE).full(), model(VALUE).detach())
    plan = jitted.lower(VALUE)
    assert "P('data', 'model')" in plan.explain(values=True)


def test_a_marked_forward_still_checks_the_spec() -> None:
    class Bad(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return partita.mark_sharding(x, MESH, P("data", "model", None))

    with pytest.raises(Exception, match="rank"):
        Bad()(VALUE)


def test_mark_sharding_of_data_at_top_level_still_builds_a_sharded_tensor() -> None:
    x = partita.mark_sharding(VALUE, MESH, P("data", None))
    assert isinstance(x, ShardedTensor) and x.spec == P("data", None)


def _input_shardings(plan: Any) -> dict[str, Any]:
    return dict(zip(plan.input_names.values(), plan.input_shardings, strict=False))


def test_mark_sharding_on_a_weight_applies_to_jit_and_train_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    jitted = partita.jit(model, mesh=MESH, in_specs=P("data"))
    assert _input_shardings(jitted.lower(VALUE))["parameter '0.weight'"].spec == P(None, None)
    out = partita.mark_sharding(model[0].weight, MESH, P("model", None))
    assert isinstance(out, ShardedTensor)  # the data API's result, as before
    shardings = _input_shardings(jitted.lower(VALUE))  # after jit(): a new program
    assert shardings["parameter '0.weight'"].spec == P("model", None)
    assert shardings["parameter '2.weight'"].spec == P(None, None)
    torch.testing.assert_close(jitted(VALUE).full(), model(VALUE).detach())
    # the mark wins over train_step's preset
    step = partita.train_step(
        model,
        lambda out, y: F.mse_loss(out, y),
        torch.optim.SGD(model.parameters(), lr=0.1),
        mesh=MESH,
        param_specs="fsdp",
    )
    assert step.param_specs["0.weight"] == P("model", None)
    assert step.param_specs["2.weight"] != P("model", None)


def test_a_weight_marked_over_another_mesh_is_an_error() -> None:
    model = nn.Linear(4, 2)
    partita.mark_sharding(model.weight, Mesh.create((8,), ("data",)), P("data", None))
    with pytest.raises(ShardingError, match=r"parameter 'weight' .* was marked with"):
        partita.jit(model, mesh=MESH, in_specs=P("data")).lower(VALUE)


# --- the last step's Plan --------------------------------------------------------------------


def test_last_plan(dev: torch.device) -> None:
    x = _on_device(VALUE, P("data", None), dev)
    assert (x * 2).sum().item() == VALUE.sum().item() * 2
    plan = partita.last_plan()
    assert plan is partita.virtual.last_plan()
    assert isinstance(plan, partita.Plan)
    assert "all_reduce" in plan.explain()


def test_last_plan_before_any_step(dev: torch.device) -> None:
    virtual_state.reset()
    try:
        with pytest.raises(VirtualDeviceError, match="has run no step yet"):
            partita.last_plan()
    finally:
        partita.use_spmd(MESH)


def test_converting_or_copying_a_marked_weight_keeps_its_annotation(dev: torch.device) -> None:
    model = nn.Linear(4, 8).to(dev)
    partita.mark_sharding(model.weight, MESH, P("model", None))
    twin = copy.deepcopy(model)
    model.to(torch.float64)
    for w in (model.weight, twin.weight):
        assert w.is_annotated and w.sharding.spec == P("model", None)
        with pytest.raises(AnnotationError, match="must be cleared first"):
            partita.mark_sharding(w, MESH, P(None, "model"))


def test_a_marked_weight_is_re_marked_after_clearing() -> None:
    model = nn.Linear(4, 2)
    partita.mark_sharding(model.weight, MESH, P("model", None))
    partita.mark_sharding(model.weight, MESH, P("model", None))  # the same: fine
    with pytest.raises(AnnotationError, match=r"must be cleared first.*param_specs"):
        partita.mark_sharding(model.weight, MESH, P(None, "model"))
    assert partita.clear_sharding(model.weight) is model.weight
    partita.mark_sharding(model.weight, MESH, P(None, "model"))
    jitted = partita.jit(model, mesh=MESH, in_specs=P("data"))
    assert _input_shardings(jitted.lower(VALUE))["parameter 'weight'"].spec == P(None, "model")
    partita.clear_sharding(model.weight)
    assert _input_shardings(jitted.lower(VALUE))["parameter 'weight'"].spec == P(None, None)


def test_a_weight_marked_off_the_device_still_moves_to_it(dev: torch.device) -> None:
    model = nn.Linear(4, 8)
    weight = model.weight
    partita.mark_sharding(model.weight, MESH, P("model", None))
    model.to(dev)  # swaps the parameter's tensor: a weak reference to it would refuse
    assert model.weight is weight and model.weight.device == dev
    assert not model.weight.is_annotated  # marks on the device are the device's
    partita.mark_sharding(model.weight, MESH, P(None, "model"))
    assert model.weight.sharding.spec == P(None, "model")
