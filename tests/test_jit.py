"""Tests of partita.jit: every program a user brings (constants, modules, in-place updates,
data-dependent code), the bounded compile cache and its recompile warning; always checked
against the eager, unsharded program."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

import partita
from partita import CaptureError, JitArgumentError, Mesh, P, RecompileWarning
from partita.frontend.jit import DEFAULT_CACHE_LIMIT, RECOMPILE_WARNING_AT

MESH = Mesh.create((2, 2), ("data", "model"))


def _seeded(*shapes: tuple[int, ...]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=g) for s in shapes]


# --- tensor constants are inputs ----------------------------------------------------------------


def test_closed_over_tensor_and_literals():
    # Before: KeyError: (_tensor_constant0, None) in propagation.
    (x, c) = _seeded((8, 4), (4,))

    def fn(x):
        empty = torch.tensor([])
        return x * c * torch.tensor(2.0) + empty.sum()

    step = partita.jit(fn, mesh=MESH, in_specs=(P("data", None),))
    torch.testing.assert_close(step(x).full(), fn(x))
    plan = step.lower(x)
    assert len(plan.input_shardings) == 4  # x, then c and the two literals
    assert all(s.is_replicated for s in plan.input_shardings[1:])
    c.mul_(3)  # the program reads the closed-over tensor when it runs, not when it compiled
    torch.testing.assert_close(step(x).full(), fn(x))
    assert step.cache_size == 1


def test_closed_over_module_is_lifted():
    (x,) = _seeded((8, 4))
    linear = nn.Linear(4, 6)
    step = partita.jit(lambda x: linear(x).relu(), mesh=MESH, in_specs=(P("data", None),))
    with torch.no_grad():
        torch.testing.assert_close(step(x).full(), linear(x).relu())


# --- nn.Module ----------------------------------------------------------------------------------


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def test_module_equals_eager():
    model = _model()
    (x,) = _seeded((8, 16))
    step = partita.jit(model, mesh=MESH, in_specs=(P("data", None),))
    with torch.no_grad():
        want = model(x)
    torch.testing.assert_close(step(x).full(), want)
    # the weights are inputs, fetched on every call: an update is seen without recompiling
    with torch.no_grad():
        model[0].weight.mul_(2)
        want = model(x)
    torch.testing.assert_close(step(x).full(), want)
    assert step.cache_size == 1
    # a parameter whose shape changed is a new signature
    model[2] = nn.Linear(32, 3)
    with torch.no_grad():
        torch.testing.assert_close(step(x).full(), model(x))
    assert step.cache_size == 2


def test_module_train_and_eval_are_two_programs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    (x,) = _seeded((4, 8))
    step = partita.jit(model, mesh=MESH)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(step(x).full(), model(x))
    model.train()
    out = step(x).full()
    assert (out == 0).any() and step.cache_size == 2  # dropout now drops
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(step(x).full(), model(x))
    assert step.cache_size == 2


def test_module_weights_sharded_by_param_specs():
    model = _model()
    (x,) = _seeded((8, 16))
    step = partita.jit(
        model,
        mesh=MESH,
        in_specs=P("data", None),
        param_specs={"0.weight": P("model", None), "2.*": P()},
    )
    plan = step.lower(x)
    # params first (0.weight, 0.bias, 2.weight, 2.bias), then x
    specs = [str(s.spec) for s in plan.input_shardings]
    assert specs[0] == "P('model', None)" and specs[4] == "P('data', None)"
    assert all(s == "P()" or s == "P(None,)" or "model" not in s for s in specs[1:])
    with torch.no_grad():
        torch.testing.assert_close(step(x).full(), model(x))
    # a preset plan works too
    tp = partita.jit(model, mesh=MESH, in_specs=(P("data", None),), param_specs="fsdp")
    with torch.no_grad():
        torch.testing.assert_close(tp(x).full(), model(x))


def test_param_specs_errors():
    with pytest.raises(ValueError, match=r"preset keys \['nope'\] match no parameter"):
        partita.jit(_model(), mesh=MESH, param_specs={"nope": P("model")})
    with pytest.raises(JitArgumentError, match=r"param_specs=.*shards the weights of an nn.Mod"):
        partita.jit(lambda x: x, mesh=MESH, param_specs={"w": P()})


# --- in-place updates of inputs take effect ------------------------------------------------------


def test_in_place_update_of_a_plain_tensor():
    # Before: silently dropped (x kept its old value).
    def fn(x):
        x.add_(1)
        x[0] = 5.0
        return x * 2

    (x,) = _seeded((4, 4))
    want_x = x.clone()
    want = fn(want_x)
    step = partita.jit(fn, mesh=MESH, in_specs=(P("data", None),))
    torch.testing.assert_close(step(x).full(), want)
    torch.testing.assert_close(x, want_x)


def test_in_place_update_of_a_sharded_tensor():
    (x,) = _seeded((4, 4))
    xs = partita.mark_sharding(x.clone(), MESH, P("data", "model"))
    step = partita.jit(lambda t: t.mul_(3).sum(), mesh=MESH)
    torch.testing.assert_close(step(xs).full(), (x * 3).sum())
    assert xs.sharding.spec == P("data", "model")
    torch.testing.assert_close(xs.full(), x * 3)
    xr = partita.mark_sharding(x.clone(), MESH, P())  # replicated: one copy for all devices
    step(xr)
    torch.testing.assert_close(xr.full(), x * 3)


class _Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.running_mean.mul_(0.9).add_(0.1 * x.mean(0))
        return x - self.running_mean


def test_in_place_update_of_a_module_buffer():
    (x,) = _seeded((8, 4))
    eager, jitted = _Norm(), _Norm()
    step = partita.jit(jitted, mesh=MESH, in_specs=(P("data", None),))
    for _ in range(2):
        torch.testing.assert_close(step(x).full(), eager(x))
        torch.testing.assert_close(jitted.running_mean, eager.running_mean)
    assert step.cache_size == 1


# --- slices, splits -----------------------------------------------------------------------------


def test_open_slice_forward_and_backward():
    # x[..., 2:] traced to slice_scatter(..., end=2**63-1) in the backward.
    def fn(x):
        x = x.clone().requires_grad_(True)
        y = (x[..., 2:] ** 2).sum()
        return torch.autograd.grad(y, x)[0]

    (x,) = _seeded((4, 8))
    for spec in (P("data", None), P(None, "model")):
        step = partita.jit(fn, mesh=MESH, in_specs=(spec,))
        torch.testing.assert_close(step(x).full(), fn(x))


class _Tempered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)
        self.temperature = 1.0
        self.calls = 0

    def forward(self, x: torch.Tensor, count: bool = False) -> torch.Tensor:
        if count:
            self.calls += 1
        return self.drop(self.lin(x)) / self.temperature * max(self.calls, 1)


def test_a_module_attribute_changed_between_calls_recompiles():
    """jit(module) kept the value a plain attribute had when it was traced: after
    ``m.temperature = 0.5`` or ``m.drop.p = 0.0`` it silently computed the old program."""
    m = _Tempered()
    x = torch.randn(4, 8)
    step = partita.jit(m, mesh=MESH, in_specs=(P("data", None),))
    m.eval()
    torch.testing.assert_close(step(x).full(), m(x))
    m.temperature = 0.5
    torch.testing.assert_close(step(x).full(), m(x))
    m.train()
    m.drop.p = 0.0
    torch.testing.assert_close(step(x).full(), m(x))
    assert step.cache_size == 3


def test_a_submodule_swapped_for_another_class_recompiles():
    """A submodule replaced by one of another class with the same plain attributes (``nn.ReLU``
    and ``nn.SiLU`` both hold only ``training`` and ``inplace``) gave the same signature, so the
    call ran the program traced with the old one: the signature names each submodule's class."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    step = partita.jit(m, mesh=MESH, in_specs=(P("data", None),))
    x = torch.randn(4, 4)
    with torch.no_grad():
        torch.testing.assert_close(step(x).full(), m(x))
        m[1] = nn.SiLU()
        torch.testing.assert_close(step(x).full(), m(x))
    assert step.cache_size == 2


def test_a_forward_that_changes_module_attributes_warns():
    """A forward that counts its calls in a Python attribute ran once, at trace time: later
    calls replayed the traced count without a word. It now warns, naming the attribute."""
    m = _Tempered().eval()
    step = partita.jit(m, mesh=MESH, in_specs=(P("data", None),))
    with pytest.warns(partita.PartitaWarning, match=r"'calls' of _Tempered \(0 -> 1\).*buffer"):
        step(torch.randn(4, 8), count=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(torch.randn(4, 8), count=True)  # the traced program, under the new value too
    assert m.calls == 1  # not traced again


def test_an_argument_that_requires_grad_records_no_history():
    """The per-device program ran with autograd on over an argument that requires grad: its
    results carried history, and ops without complex autograd (the slice_scatter of stft's
    backward) refused to run."""

    def fn(x):
        spec = torch.stft(x, n_fft=8, hop_length=2, window=torch.ones(8), return_complex=True)
        return torch.autograd.grad(spec.abs().sum(), x)[0]

    x = torch.randn(2, 24, requires_grad=True)
    out = partita.jit(fn, mesh=MESH, in_specs=(P("data", None),))(x)
    torch.testing.assert_close(out.full(), fn(x))
    assert not out.full().requires_grad and x.grad is None


@pytest.mark.parametrize(
    "fn",
    [
        lambda a, b: torch.ops.aten.slice_scatter(a, b, 2, 4, 2**63 - 1),
        lambda a, b: torch.slice_scatter(a, b, dim=-1, start=-4),
    ],
)
def test_slice_scatter_bounds_under_a_batched_mesh(fn):
    a, b = torch.zeros(2, 4, 8), torch.ones(2, 4, 4)
    got = partita.jit(fn, mesh=MESH, in_specs=(P("data"), P("data")))(a, b)
    assert torch.equal(got.full(), fn(a, b))


@pytest.mark.parametrize(
    "fn",
    [
        lambda a: torch.unbind(a, 1),
        lambda a: torch.unbind(a, -1),
        lambda a: torch.split(a, [1, 3], dim=1),
    ],
)
def test_unbind_and_split_dims(fn):
    (a,) = _seeded((4, 4))
    got = partita.jit(fn, mesh=MESH)(a)
    for g, w in zip(got, fn(a), strict=True):
        torch.testing.assert_close(g.full(), w)


# --- data-dependent code ------------------------------------------------------------------------


def test_item_names_the_line():
    def fn(x):
        return x * x.sum().item()

    line = fn.__code__.co_firstlineno + 1
    with pytest.raises(CaptureError, match=rf"test_jit.py:{line} in fn: .*data-dependent"):
        partita.jit(fn, mesh=MESH)(torch.ones(4))


# --- the compile cache --------------------------------------------------------------------------


def test_cache_is_lru_and_bounded():
    step = partita.jit(lambda x: x * 2, mesh=MESH, cache_limit=2)
    a, b, c = torch.ones(2), torch.ones(3), torch.ones(4)
    step(a)
    step(b)
    step(a)  # a is now the most recently used
    step(c)  # evicts b
    assert step.cache_size == 2
    keys = [k[1][0] for k in step._cache]
    assert keys == [(2,), (4,)]
    step(b)  # recompiles, evicts a
    assert [k[1][0] for k in step._cache] == [(4,), (3,)]
    assert DEFAULT_CACHE_LIMIT == partita.jit(lambda x: x, mesh=MESH).cache_limit == 64


def test_cache_limit_is_checked():
    with pytest.raises(JitArgumentError, match=r"cache_limit=0.*must be an int >= 1 \(default 64"):
        partita.jit(lambda x: x, mesh=MESH, cache_limit=0)


def test_recompile_warning_names_what_changes():
    step = partita.jit(lambda x, w: x @ w, mesh=MESH)
    w = torch.ones(4, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in range(1, RECOMPILE_WARNING_AT + 3):
            step(torch.ones(n, 4), w)
    recompiles = [w for w in caught if issubclass(w.category, RecompileWarning)]
    assert len(recompiles) == 1  # once, at the 8th signature
    text = str(recompiles[0].message)
    assert re.search(
        r"compiled 8 distinct input signatures; what keeps changing: the shape of x "
        r"\(\(1, 4\), \(2, 4\), \(3, 4\), \(4, 4\), \.\.\.\)\. .*cache keeps the last 64.*"
        r"pad inputs to a few fixed shapes",
        text,
    ), text
    assert "args[1]" not in text and "shape of w" not in text


def test_recompile_warning_for_a_static_argument_and_a_sharding():
    step = partita.jit(lambda x, k: x * k, mesh=MESH)
    with pytest.warns(RecompileWarning, match=r"the value of k \(a static argument: 0, 1"
                      r".*pass a changing number as a tensor"):  # fmt: skip
        for k in range(RECOMPILE_WARNING_AT):
            step(torch.ones(4), k)
    step = partita.jit(lambda x: x + 1, mesh=MESH)
    specs = [
        P(), P("data"), P("model"), P(None, "data"), P(None, "model"), P("data", "model"),
        P("model", "data"), P(("data", "model")),
    ]  # fmt: skip
    x = torch.ones(4, 4)
    with pytest.warns(RecompileWarning, match=r"the sharding of x \(.*reshard the arg"):
        for spec in specs:
            step(partita.mark_sharding(x, MESH, spec))


def test_module_leaf_names_in_the_warning():
    model = nn.Linear(4, 2)
    step = partita.jit(model, mesh=MESH)
    with pytest.warns(RecompileWarning, match=r"the shape of args\[0\] \(\(1, 4\)"):
        with torch.no_grad():
            for n in range(1, RECOMPILE_WARNING_AT + 1):
                step(torch.ones(n, 4))


def test_docs_jit_examples_run():
    import pathlib

    text = (pathlib.Path(__file__).parents[1] / "docs" / "jit.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 4
    scope: dict[str, object] = {}
    for block in blocks:
        exec(compile(block, "docs/jit.md", "exec"), scope)


# --- the same under torch.distributed (4 Gloo processes) -----------------------------------------

_DIST_SCRIPT = """
import sys
import torch
from torch import nn
import partita
import partita.distributed as pd
from partita import Mesh, P

pd.initialize()
mesh = Mesh.create((2, 2), ("data", "model"))
g = torch.Generator().manual_seed(0)
x, c = torch.randn(8, 4, generator=g), torch.randn(4, generator=g)
results = {}
closure = partita.jit(lambda x: x * c + torch.tensor(1.0), mesh=mesh, in_specs=P("data", None))
results["closure"] = closure(x).full()
counts = torch.zeros(4)
partita.jit(lambda t, x: t.add_(x.sum(0)).sum(), mesh=mesh)(counts, x)
results["counts"] = counts
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))
fwd = partita.jit(model, mesh=mesh, in_specs=(P("data", None),),
                  param_specs={"0.weight": P("model", None)})
results["model"] = fwd(x).full()
results["running_mean"] = model[1].running_mean.clone()
if pd.is_main_process():
    torch.save(results, sys.argv[1])
"""


@pytest.mark.slow
@pytest.mark.usefixtures("rank_zygote")  # ranks forked from a pre-imported process
def test_constants_modules_and_updates_under_torch_distributed(tmp_path):
    from partita.runtime.launch import spawn

    script = tmp_path / "jit_dist.py"
    script.write_text(_DIST_SCRIPT)
    out = tmp_path / "out.pt"
    results = spawn([str(script), str(out)], 4, timeout=180)
    assert all(r.returncode == 0 for r in results), "\n".join(r.stderr[-2000:] for r in results)
    got = torch.load(out)
    g = torch.Generator().manual_seed(0)
    x, c = torch.randn(8, 4, generator=g), torch.randn(4, generator=g)
    torch.testing.assert_close(got["closure"], x * c + 1)
    torch.testing.assert_close(got["counts"], x.sum(0))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))
    with torch.no_grad():
        torch.testing.assert_close(got["model"], model(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["running_mean"], model[1].running_mean)


def test_dict_in_specs_match_by_key_not_position() -> None:
    """A spec dict written in another key order than the argument's annotates by key (pytree
    broadcasting alone pairs dict entries by position)."""
    mesh = Mesh.create((2, 4), ("x", "y"))
    args = {"a": torch.randn(8, 4), "b": torch.randn(6, 5)}
    step = partita.jit(
        lambda d: {"a": d["a"] * 2, "b": d["b"] + 1},
        mesh=mesh,
        in_specs=({"b": P(), "a": P("x", None)},),
    )
    plan = step.lower(args)
    assert plan.input_shardings[0].spec == P("x", None)  # "a" comes first in the value
    assert plan.input_shardings[1].is_replicated
    out = step(args)
    torch.testing.assert_close(out["a"].full(), args["a"] * 2)


def test_a_changed_layout_after_the_cache_hit_path_recompiles_and_says_why() -> None:
    """A repeated call skips the in_specs broadcast and the spec building (jit_signature), but
    every leaf's shape, dtype and sharding are still read: a changed one is a new signature,
    the result still equals eager, and the warning names the leaf that changed."""
    step = partita.jit(
        lambda p, x: p["w"] * x + p["b"], mesh=MESH, in_specs=({"w": P(), "b": P()}, P("data"))
    )
    b = partita.mark_sharding(torch.arange(4.0), MESH, P())
    x = torch.randn(4, 4)
    specs = [
        P(), P("data"), P("model"), P(None, "data"), P(None, "model"), P("data", "model"),
        P("model", "data"), P(("data", "model")),
    ]  # fmt: skip
    w = torch.randn(4, 4)
    with pytest.warns(
        RecompileWarning,
        match=r"compiled 8 distinct.*the sharding of p\['w'\] "
        r"\(P\(None, None\), P\('data', None\)",
    ):
        for n, spec in enumerate(specs, 1):
            for _ in range(2):  # the second call hits the cache
                out = step({"w": partita.mark_sharding(w, MESH, spec), "b": b}, x)
                torch.testing.assert_close(out.full(), w * x + torch.arange(4.0))
            assert step.cache_size == n
    assert step.lower({"w": w, "b": b}, x).input_shardings[2].spec == P("data", None)
    step.in_specs = ({"w": P(), "b": P()}, P("model"))  # a new in_specs is read at once
    assert step.lower({"w": w, "b": b}, x).input_shardings[2].spec == P("model", None)
    step({"w": w, "b": b}, x.double())  # a plain tensor's dtype is part of the key too
    assert step.cache_size == 10 and step._compiles == 10
