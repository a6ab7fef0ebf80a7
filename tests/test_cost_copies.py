"""The runtime's copies around each collective call (cost/copies.py) against runtime.dist_ops."""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import fx

import partita
from partita.cost import PROFILES
from partita.cost.copies import call_copies
from partita.models import GPT, GPTConfig
from partita.runtime import comm, dist_ops
from partita.runtime.donate import donated_all_reduces
from partita.values.mesh import Mesh

from runtime_copies import Copies  # isort: skip

CFG = GPTConfig(n_layer=2, n_head=4, d_model=64, vocab_size=128, seq_len=32)


class _Work:
    def wait(self) -> None:
        pass


def _runtime_copies(node: fx.Node, vals: dict[fx.Node, Any], donate: bool) -> tuple[list, list]:
    """The copies ``runtime.dist_ops`` makes for ``node`` at its launch and at its wait, run on
    zeros of its operands' shapes with the Gloo calls stubbed out (a group in torch order)."""
    kind = node.target._schema.name.split("::")[-1]  # type: ignore[union-attr]
    n = int(node.args[-1])  # type: ignore[arg-type]

    def real(a: Any) -> Any:
        if isinstance(a, fx.Node):
            v = vals[a]
            return torch.zeros(v.shape, dtype=v.dtype).as_strided(v.shape, v.stride())
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], fx.Node):
            return [real(x) for x in a]
        return a

    group = comm.Group(pg=None, members=tuple(range(n)), torch_order=tuple(range(n)), index=0)
    extra = {"donate": donate} if kind == "all_reduce" else {}
    op = getattr(dist_ops, kind)(group, *[real(a) for a in node.args[:-1]], node.name, **extra)
    launch, wait = Copies(), Copies()
    with launch:
        next(op)
    with wait:
        dist_ops.run(op)
    return launch.sizes, wait.sizes


@pytest.mark.parametrize(
    ("preset", "shape"), [("dp", (4,)), ("fsdp", (4,)), ("tp", (2, 2)), ("fsdp+tp", (2, 2))]
)
def test_the_counted_copies_are_those_the_runtime_makes(
    preset: str, shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("ALL_GATHER", "REDUCE_SCATTER"):
        monkeypatch.setattr(dist_ops, name, lambda *a, **k: _Work())
    stub = types.SimpleNamespace(
        all_reduce=lambda *a, **k: _Work(), all_to_all_single=lambda *a, **k: _Work()
    )
    monkeypatch.setattr(dist_ops, "dist", stub)

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, CFG.vocab_size), targets.reshape(-1))

    torch.manual_seed(0)
    model = GPT(CFG)
    mesh = Mesh.create(shape, ("data", "model")[: len(shape)])
    step = partita.train_step(
        model, loss, torch.optim.AdamW(model.parameters()), mesh=mesh, param_specs=preset
    )
    ids = torch.randint(0, CFG.vocab_size, (8, CFG.seq_len))
    plan = step.lower((ids, ids))
    vals = plan._local_values()
    graph = plan.local_program.graph
    donated = donated_all_reduces(graph)
    counted = 0
    for node in graph.nodes:
        kind = getattr(node.target, "_schema", None)
        name = kind.name.split("::")[-1] if kind is not None else ""
        if node.op != "call_function" or not hasattr(dist_ops, name) or name == "run":
            continue
        launch, wait = _runtime_copies(node, vals, node.name in donated)
        if name == "all_reduce" and node.name not in donated:
            assert launch[:1] == [2 * vals[node.args[0]].numel() * 4]  # its clone: not counted
            launch = launch[1:]
        assert call_copies(node, vals) == (launch, wait), node.name
        counted += len(launch) + len(wait)
    if preset != "tp":
        assert counted > 0  # every bucket packs at least


def test_the_estimate_adds_the_copies_to_the_compute_where_they_run() -> None:
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, CFG.vocab_size), targets.reshape(-1))

    torch.manual_seed(0)
    model = GPT(CFG)
    step = partita.train_step(
        model,
        loss,
        torch.optim.AdamW(model.parameters()),
        mesh=Mesh.create((4,), ("data",)),
        param_specs="fsdp",
    )
    ids = torch.randint(0, CFG.vocab_size, (8, CFG.seq_len))
    plan = step.lower((ids, ids))
    hw = dataclasses.replace(PROFILES["cpu-gloo"], copy_bandwidth=0.0)  # the roofline's rate
    est, plain = plan.estimate(hw), plan.estimate(hw, overlap=False)
    vals = plan._local_values()
    sizes: list[int] = []
    for node in plan.local_program.graph.nodes:
        if node.op == "call_function" and str(node.target).startswith("partita."):
            launch, wait = call_copies(node, vals)
            sizes += launch + wait
    expected = sum(hw.op_seconds(0, b) for b in sizes)  # each a memory-bound op
    assert expected > 0
    assert est.copies == pytest.approx(expected)
    assert plain.copies == pytest.approx(expected)
    assert plain.total == pytest.approx(plain.compute + plain.communication)
    # a profile with the copies' own rate prices them by it, and no other op
    slow = dataclasses.replace(hw, copy_bandwidth=hw.memory_bandwidth / 4)
    by_rate = plan.estimate(slow, overlap=False)
    assert (
        by_rate.copies == pytest.approx(sum(slow.copy_seconds(b) for b in sizes))
        and by_rate.copies > 2 * plain.copies
    )
    assert by_rate.compute - by_rate.copies == pytest.approx(plain.compute - plain.copies)
    # the calls' overheads grow with the compute before them, which the copies are part of
    assert by_rate.communication >= plain.communication
