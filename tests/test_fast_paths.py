"""The per-call fast paths of a steady loop never serve a stale program or skip a check.

``partita.jit`` reuses its last call's signature (``frontend.last_call``), the LocalMesh its
last check of each output's held shape (``runtime.local``), ``train_step`` its last batch
checks and hyperparameter tensors (``training.per_call``), and the fused step folds the ops
that read no input (``runtime.flat_constants``). Each test changes one thing the fast path
depends on between two calls and checks that the result is what eager (or the full check)
gives: each fails if its fast path ignored that change.
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn
from torch.fx.experimental.proxy_tensor import make_fx

import partita
from partita import Mesh, MetaTensorError, P, ShardingError, TrainInputError
from partita.frontend import signature
from partita.runtime.flat_constants import fold_constants
from partita.runtime.fused_step import direct_forward
from partita.runtime.local import LocalMesh
from partita.training.per_call import HyperTensors, batch_signature

MESH = Mesh.create((2, 2), ("data", "model"))


def _counting_keys(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    real = signature.Signatures.key

    def key(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(signature.Signatures, "key", key)
    return calls


def test_a_repeated_signature_builds_no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _counting_keys(monkeypatch)
    f = partita.jit(lambda d, x: d["w"] * x, mesh=MESH, in_specs=({"w": P()}, P("data")))
    w, x = torch.randn(4, 4), torch.randn(4, 4)
    for _ in range(3):
        torch.testing.assert_close(f({"w": w}, x).full(), w * x)
    assert calls[0] == 1  # the later calls matched the last signature


@pytest.mark.parametrize(
    "change", ["shape", "dtype", "sharding", "plain", "key order", "namedtuple", "options"]
)
def test_a_change_after_the_fast_path_recompiles(
    monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    calls = _counting_keys(monkeypatch)
    pair = collections.namedtuple("pair", ["a", "b"])

    def fn(d, x):  # type: ignore[no-untyped-def]
        a, b = (d["a"], d["b"]) if isinstance(d, dict) else (d.a, d.b)
        return (a - b) * x

    f = partita.jit(fn, mesh=MESH)
    g = torch.Generator().manual_seed(0)
    a, b, x = (torch.randn(4, 6, generator=g) for _ in range(3))
    sa = partita.mark_sharding(a, MESH, P("data", None))
    for _ in range(3):
        torch.testing.assert_close(f({"a": sa, "b": b}, x).full(), fn({"a": a, "b": b}, x))
    assert calls[0] == 1  # the fast path ran the later calls
    d = {"a": sa, "b": b}
    if change == "shape":
        d = {"a": partita.mark_sharding(torch.randn(8, 6), MESH, P("data")), "b": b[:1]}
        x = torch.randn(8, 6)
    elif change == "dtype":
        x = x.double()
        d = {"a": partita.mark_sharding(a.double(), MESH, P("data")), "b": b.double()}
    elif change == "sharding":
        d = {"a": partita.mark_sharding(a, MESH, P("model", None)), "b": b}
    elif change == "plain":
        d = {"a": a, "b": b}
    elif change == "key order":
        d = {"b": b, "a": sa}
    plain = {k: v.full() if isinstance(v, partita.ShardedTensor) else v for k, v in d.items()}
    want = fn(plain, x.full() if isinstance(x, partita.ShardedTensor) else x)
    if change == "options":
        with partita.options.using(bucket_bytes=0):
            out = f(d, x)
    else:
        out = f(pair(a, b) if change == "namedtuple" else d, x)
    assert out.dtype == want.dtype and tuple(out.shape) == tuple(want.shape)
    torch.testing.assert_close(out.full(), want)
    assert f.cache_size == 2


def test_a_static_argument_is_keyed_at_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-tensor leaf is compared by value in the key: no fast path for such a call."""
    calls = _counting_keys(monkeypatch)
    f = partita.jit(lambda x, k: x * k, mesh=MESH)
    x = torch.randn(4, 6)
    for k in (2, 2, 3):
        torch.testing.assert_close(f(x, k).full(), x * k)
    assert calls[0] == 3 and f.cache_size == 2


def test_a_module_mark_between_calls_recompiles() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    f = partita.jit(model, mesh=MESH, in_specs=(P("data", None),))
    x = torch.randn(4, 8)
    with torch.no_grad():
        want = model(x)
    for _ in range(2):
        torch.testing.assert_close(f(x).full(), want)
    partita.mark_sharding(model.weight, MESH, P("model", None))
    assert f.lower(x).input_shardings[0].spec == P("model", None)
    torch.testing.assert_close(f(x).full(), want)
    assert f.cache_size == 2


# --- the LocalMesh's outputs ----------------------------------------------------------------


def test_an_output_of_another_held_shape_is_checked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    f = partita.jit(lambda x: x * 2, mesh=MESH, in_specs=(P("data"),))
    x = torch.randn(4, 6)
    for _ in range(2):
        torch.testing.assert_close(f(x).full(), x * 2)
    real = LocalMesh._execute

    def wider(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return [(torch.cat([v, v], -1), axes) for v, axes in real(self, *args, **kwargs)]

    monkeypatch.setattr(LocalMesh, "_execute", wider)
    with pytest.raises(ShardingError, match="from_held"):
        f(x)


# --- train_step -------------------------------------------------------------------------------


def _step() -> tuple[partita.TrainStep, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mesh = Mesh.create((2,), ("data",))
    return partita.train_step(model, F.cross_entropy, opt, mesh=mesh), model


def test_a_batch_of_another_signature_is_checked_again() -> None:
    step, _ = _step()
    x, t = torch.randn(4, 6), torch.randint(0, 3, (4,))
    for _ in range(2):
        step((x, t))
    with pytest.raises(TrainInputError, match="0 rows"):
        step((x[:0], t[:0]))
    with pytest.raises(TrainInputError, match="float64"):
        step((x.double(), t))
    with pytest.raises(MetaTensorError, match="meta device"):
        step((x.to("meta"), t))
    step.batch_spec = P(None, None, "data")  # a spec that cannot fit, on the same batch
    with pytest.raises(TrainInputError, match="does not fit"):
        step((x, t))


def test_hyperparameter_tensors_are_made_again_only_when_a_value_changes() -> None:
    hyper = HyperTensors()
    first = hyper.now({"lr": [0.1], "weight_decay": [0.0]})
    assert hyper.now({"lr": [0.1], "weight_decay": [0.0]})["lr"] is first["lr"]
    changed = hyper.now({"lr": [0.05], "weight_decay": [0.0]})
    assert changed["lr"].item() == 0.05 and first["lr"].item() == 0.1


def test_a_learning_rate_change_reaches_the_step() -> None:
    step, model = _step()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, t = torch.randn(4, 6), torch.randint(0, 3, (4,))
    for lr in (0.1, 0.1, 0.5, 0.5):
        step.optimizer.param_groups[0]["lr"] = opt.param_groups[0]["lr"] = lr
        loss = step((x, t))
        opt.zero_grad()
        want = F.cross_entropy(ref(x), t)
        want.backward()
        opt.step()
        torch.testing.assert_close(loss, want.detach())
    for k, v in step.full_parameters().items():
        torch.testing.assert_close(v, dict(ref.named_parameters())[k].detach())


def test_batch_signature_only_for_plain_tensors() -> None:
    x = torch.zeros(2, 3)
    assert batch_signature((x, {"m": x})) == batch_signature((x.clone(), {"m": x}))
    assert batch_signature((x, x)) != batch_signature((x, x.double()))
    assert batch_signature((x, nn.Parameter(x))) is None  # not a plain tensor: full checks


# --- folding the fused graph's constants ------------------------------------------------------


def test_ops_of_constants_fold_and_give_the_same_results() -> None:
    def fn(x: Tensor) -> Tensor:
        idx = torch.arange(6) - 2
        mask = (idx >= 0) & (idx < 3)
        return torch.where(mask, x, torch.zeros(())) + idx.clamp(min=0)

    x = torch.randn(6)
    gm = make_fx(fn)(x)
    want = gm(x)
    assert fold_constants(gm) > 0
    assert not any("arange" in str(n.target) for n in gm.graph.nodes)
    y = torch.randn(6)
    torch.testing.assert_close(gm(y), fn(y))
    torch.testing.assert_close(gm(x), want)


def test_a_constant_written_in_place_or_returned_is_not_folded() -> None:
    def fn(x: Tensor) -> tuple[Tensor, Tensor]:
        acc = torch.zeros(3)
        acc.add_(x)  # written per run: not a constant
        return acc * 2, torch.arange(3.0)  # returned: the caller may write it

    gm = make_fx(fn)(torch.ones(3))
    fold_constants(gm)
    a, r = gm(torch.ones(3))
    r.add_(100)
    b, r2 = gm(torch.full((3,), 2.0))
    torch.testing.assert_close(a, torch.full((3,), 2.0))
    torch.testing.assert_close(b, torch.full((3,), 4.0))
    torch.testing.assert_close(r2, torch.arange(3.0))


def test_direct_forward_runs_the_graph_unchanged() -> None:
    def fn(x: Tensor) -> tuple[Tensor, Tensor]:
        return torch.ops.aten.mm(x, x.t()), x.contiguous(memory_format=torch.contiguous_format)

    x = torch.randn(3, 4)
    gm = make_fx(fn)(x)
    forward = direct_forward(gm)
    for got, want in zip(forward(gm, x), gm(x), strict=True):
        assert torch.equal(got, want)
    assert "torch.ops.aten.mm.default" in gm.code  # the graph and its code stay as they were
