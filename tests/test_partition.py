"""Partitioner and jit behaviours not covered by the op table or the canonical cases."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import partita
import partita.partition.lower as lower_module
from partita import Mesh, P
from partita.partition import partition
from partita.partition.resharding import LocalValues
from partita.propagate import propagate

MESH = Mesh.create((2, 4), ("data", "model"))


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _attention_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    q = q.requires_grad_()
    with torch.enable_grad():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.autograd.grad(out.square().sum(), q)[0]


@pytest.mark.parametrize("fn", [_attention, _attention_grad])
def test_attention_sharded_over_batch_and_heads_needs_no_communication(fn: object) -> None:
    q, k, v = (torch.randn(4, 8, 16, 8) for _ in range(3))
    specs = (P("data", "model"),) * 3
    step = partita.jit(fn, mesh=MESH, in_specs=specs, out_specs=P("data", "model"))
    assert step.lower(q, k, v).collectives == []
    torch.testing.assert_close(step(q, k, v).full(), fn(q, k, v), rtol=1e-5, atol=1e-5)


def test_plain_and_replicated_inputs_share_one_compiled_program() -> None:
    step = partita.jit(lambda a, b: a @ b, mesh=MESH, in_specs=(P("data"), None))
    a, b = torch.randn(8, 4), torch.randn(4, 6)
    step(a, b)
    step(a, partita.mark_sharding(b, MESH, P()))
    assert step.cache_size == 1
    step(a, partita.mark_sharding(b, MESH, P(None, "model")))  # a new sharding: a new program
    assert step.cache_size == 2


def test_arange_over_a_sharded_dim_is_built_locally() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x + torch.arange(3, 3 + 2 * x.shape[0], 2, dtype=x.dtype)[:, None]

    x = torch.randn(10, 4)  # 10 rows on 2 devices along 'data', uneven on 'model' below
    for spec in (P("data"), P("model"), P(("data", "model"))):
        step = partita.jit(f, mesh=MESH, in_specs=(spec,), out_specs=spec)
        assert step.lower(x).collectives == []
        torch.testing.assert_close(step(x).full(), f(x))


def test_addmm_with_a_sharded_contraction_adds_the_bias_once() -> None:
    def f(b: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.addmm(b, x, w)

    b, x, w = torch.randn(6), torch.randn(8, 12), torch.randn(12, 6)
    step = partita.jit(f, mesh=MESH, in_specs=(None, P(None, "model"), P("model")))
    assert [c.kind for c in step.lower(b, x, w).collectives] == ["all_reduce"]
    torch.testing.assert_close(step(b, x, w).full(), f(b, x, w), rtol=1e-5, atol=1e-5)


def test_a_transposed_weight_is_gathered_once_for_forward_and_backward() -> None:
    mesh = Mesh.create((8,), ("data",))

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        w = w.requires_grad_()
        with torch.enable_grad():
            y = F.linear(x, w)
            return torch.autograd.grad(y.square().sum(), w)[0]

    x, w = torch.randn(64, 16), torch.randn(32, 16)
    step = partita.jit(f, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data"))
    kinds = [c.kind for c in step.lower(x, w).collectives]
    assert kinds.count("all_gather") == 1 and kinds.count("reduce_scatter") == 1
    torch.testing.assert_close(step(x, w).full(), f(x, w), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("rows", "keep", "spec", "kinds"),
    [
        (16, 10, P("model"), ["collective_permute"]),  # T09's re-align: one shift
        (32, 30, P("data"), ["collective_permute"]),
        (32, 30, P(None), []),
        (32, 30, P(None, "model"), []),  # another dim is split: the slice is local
        (16, 13, P("model"), []),  # tiles of 4 stay tiles of 4: nothing moves (T11)
        # a tile needs rows from further left: only the missing rows move (partition/retile.py)
        (17, 3, P("model"), ["collective_permute"] * 2),
        (20, 13, P(("data", "model")), ["collective_permute"] * 3),
    ],
)
def test_a_prefix_slice_of_a_sharded_dim(rows: int, keep: int, spec: P, kinds: list[str]) -> None:
    def f(a: torch.Tensor) -> torch.Tensor:
        return a[:keep].exp()  # exp: padding becomes garbage, which must not leak

    a = torch.randn(rows, 5)
    step = partita.jit(f, mesh=MESH, in_specs=(spec,), out_specs=spec)
    assert [c.kind for c in step.lower(a).collectives] == kinds
    torch.testing.assert_close(step(a).full(), f(a))


# --- zero-size dims ----------------------------------------------------------------------------

ZERO_CASES = {
    "elementwise": (lambda a: a.exp() + 1, ((0, 6),)),
    "matmul": (lambda a, b: a @ b, ((0, 6), (6, 5))),
    "matmul_empty_contraction": (lambda a, b: a @ b, ((3, 0), (0, 5))),
    "sum_over_zero": (lambda a: a.sum(0), ((0, 6),)),
    "sum_over_other": (lambda a: a.sum(1), ((0, 6),)),
    "reshape": (lambda a: a.reshape(0, 3, 2), ((0, 6),)),
    "cat": (lambda a, b: torch.cat([a, b], 0), ((0, 6), (3, 6))),
}


@pytest.mark.parametrize("spec", [P("data", "model"), P(None, "model"), P("model", None)])
@pytest.mark.parametrize("name", sorted(ZERO_CASES))
def test_zero_size_dims_sharded_on_the_zero_dim_or_another(name: str, spec: P) -> None:
    """A size-0 dim split across devices (tiles of size 0) used to divide by zero in the
    piecewise-permute planner."""
    fn, shapes = ZERO_CASES[name]
    args = tuple(torch.randn(s) for s in shapes)
    step = partita.jit(fn, mesh=MESH, in_specs=(spec,) * len(args))
    torch.testing.assert_close(step(*args).full(), fn(*args))


@pytest.mark.parametrize("shape", [(0, 8), (4, 0), (0, 0)])
def test_zero_size_reshard_between_annotations(shape: tuple[int, int]) -> None:
    def fn(a: torch.Tensor) -> torch.Tensor:
        b = partita.mark_sharding(a * 2, MESH, P(None, ("data", "model")))
        return partita.mark_sharding(b + 1, MESH, P("model", "data"))

    a = torch.randn(shape)
    out = partita.jit(fn, mesh=MESH, in_specs=(P("data", "model"),))(a)
    torch.testing.assert_close(out.full(), a * 2 + 1)
    assert out.local_shards[0].data.shape == (-(-shape[0] // 4), -(-shape[1] // 2))


def test_the_per_device_program_generates_its_code_only_when_read() -> None:
    """Bucketing edits the per-device graph after lowering: generating its Python code at each
    step was a quarter of partitioning a GPT, and the runtimes run graphs they build anyway."""
    from partita.capture import trace
    from partita.partition import partition
    from partita.propagate import propagate

    def f(a: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return (x @ a).relu() + (x @ b).relu()  # two partial sums reduced in one bucket

    args = (torch.randn(8, 8), torch.randn(8, 8), torch.randn(4, 8))
    specs = (P("data"), P("data"), P())
    program = trace(f, args, in_specs=specs, mesh=MESH)
    propagate(program.graph_module, MESH)
    local, plan = partition(program.graph_module, MESH, {"bucket_bytes": 1 << 20})
    assert [b.kind for b in plan.buckets] == ["all_reduce"]
    assert type(local)._needs_recompile()  # no code generated so far
    assert "all_reduce_bucket" in local.code  # generated now, from the bucketed graph
    step = partita.jit(f, mesh=MESH, in_specs=specs)
    torch.testing.assert_close(step(*args).full(), f(*args))


def test_memoised_lowering_gives_the_program_of_lowering_every_op(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lowering memoises what an op's rule and assignment decide (``memo_by_rule``) and
    adds its nodes bare (``LocalValues.emit``): the per-device program and the Plan are those
    of working each op out anew and adding nodes with ``graph.call_function``."""

    def layers(x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
        for w in ws:  # one matmul rule (equal shapes) under three assignments, one repeated
            x = torch.relu(x @ w)
        return x.to(torch.float64).sum()  # _to_copy(x, dtype=...): an op with kwargs

    col, row = P(None, "model"), P("model", None)
    specs = (P("data"), [col, row, P(), col, row])
    ws = [torch.randn(8, 8) for _ in specs[1]]
    gm = partita.capture.trace(layers, (torch.randn(4, 8), ws), in_specs=specs, mesh=MESH)
    propagate(gm.graph_module, MESH)
    memoised, plan = partition(gm.graph_module, MESH)
    keys: list[tuple[object, ...]] = []

    def every_time(memo: object, key: tuple[object, ...], rule: object, compute: Any) -> Any:
        keys.append(key)
        return compute()

    def call_function(low: Any, target: Any, args: Any, kwargs: Any = None) -> Any:
        return low.graph.call_function(target, args, kwargs)

    monkeypatch.setattr(lower_module, "memo_by_rule", every_time)
    monkeypatch.setattr(LocalValues, "emit", call_function)
    anew, plan_anew = partition(gm.graph_module, MESH)
    assert memoised.code == anew.code and plan == plan_anew
    assert len(set(keys)) < len(keys) * 3 // 4  # the last two layers repeat the first two
