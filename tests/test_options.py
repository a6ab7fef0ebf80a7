"""One options value (``partita.options``) reaching every entry point through one pipeline.

The environment, ``using()`` blocks and per-call ``options=`` give one ``CompileOptions``; it is
part of every compile cache key, and it reaches the stages the same way from ``partita.jit``,
``partita.train_step`` and the virtual device (``partita.use_spmd``): the same program with the
same options is the same Plan through all three.
"""

from __future__ import annotations

import re
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the PyTorch convention

import partita
from partita import CompileOptions, Mesh, OptionError, P, RematerializationError
from partita.options import KNOBS, current, environment, resolve, using
from partita.runtime.compiled import stats_for
from partita.virtual import state as vstate

MESH = Mesh.create((2, 4), ("data", "model"))
DOCS = Path(__file__).resolve().parents[1] / "docs"

#: A value each knob's variable refuses, and what the message says it accepts.
BAD = {
    "strict": ("maybe", "one of 1/true/on/yes or 0/false/off/no"),
    "replicate_unsupported": ("2", "one of 1/true/on/yes"),
    "collectives": ("loud", "one of auto, explicit, warn"),
    "regather": ("sometimes", "one of 1/true"),
    "inductor": ("fast", "one of 1/true"),
    "bucket_bytes": ("4MB", "a whole number of bytes"),
    "overlap_bytes": ("-5", "a whole number of bytes"),
    "scan_layers": ("auto", "one of 1/true"),
    "trace_flat_at": ("soon", "a whole number >= 0"),
    "check_replicas": ("y", "one of 1/true"),
    "join_timeout": ("0", "a finite number of seconds > 0"),
    "collective_timeout": ("forever", "a number of seconds > 0"),
    "virtual_device": ("enabled", "one of 1/true"),
    "compile_in_child": ("maybe", "auto or one of 1/true/on/yes or 0/false/off/no"),
}


@pytest.fixture(scope="module")
def dev() -> torch.device:
    return partita.use_spmd(MESH)


@pytest.mark.parametrize("knob", [k for k in KNOBS if k.name in BAD], ids=lambda k: k.name)
def test_a_bad_environment_value_is_an_option_error(
    knob: partita.options.Knob, monkeypatch: pytest.MonkeyPatch
) -> None:
    value, accepts = BAD[knob.name]
    monkeypatch.setenv(knob.env, value)
    with pytest.raises(OptionError, match=re.escape(f"{knob.env}={value!r}: must be {accepts}")):
        current()
    with pytest.raises(OptionError, match=re.escape(f"It sets {knob.name}")):
        environment({knob.env: value})


def test_every_variable_is_read_with_one_vocabulary(monkeypatch: pytest.MonkeyPatch) -> None:
    for text, value in [("1", True), ("TRUE", True), ("on", True), ("No", False), ("off", False)]:
        monkeypatch.setenv("PARTITA_STRICT", text)
        monkeypatch.setenv("PARTITA_SCAN_LAYERS", text)
        assert current().strict is value and current().scan_layers is value
    for text, value in [("auto", None), ("Off", False), ("1", True)]:  # None: the default's
        monkeypatch.setenv("PARTITA_COMPILE_IN_CHILD", text)
        assert current().compile_in_child is value
    with pytest.raises(OptionError, match="compile_in_child must be None, True or False"):
        CompileOptions(compile_in_child="auto")  # the variable's word; in Python: None
    monkeypatch.setenv("PARTITA_BUCKET_BYTES", "0")
    monkeypatch.setenv("PARTITA_COLLECTIVES", "Explicit")
    assert (current().bucket_bytes, current().collectives) == (0, "explicit")


def test_using_nests_and_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PARTITA_REGATHER", "1")
    assert current().regather is True
    with using(regather=False, strict=True) as outer:
        assert (outer.regather, outer.strict) == (False, True)
        with using(strict=False, bucket_bytes=0) as inner:
            assert (inner.regather, inner.strict, inner.bucket_bytes) == (False, False, 0)
        assert current() == outer
    assert (current().regather, current().strict) == (True, False)
    with pytest.raises(OptionError, match=r"using: no option named 'stric'.*strict"):
        with using(stric=True):
            pass
    with pytest.raises(OptionError, match=r"collectives='loud'\): collectives must be one of"):
        with using(collectives="loud"):
            pass


def test_using_is_per_thread() -> None:
    seen: dict[str, bool] = {}
    inside, done = threading.Event(), threading.Event()

    def other() -> None:
        inside.wait(10)
        seen["other"] = current().strict  # the main thread's block is not this thread's
        with using(strict=True):
            seen["other_own"] = current().strict
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with using(strict=True):
        inside.set()
        done.wait(10)
        seen["main"] = current().strict
    thread.join(10)
    assert seen == {"other": False, "other_own": True, "main": True}


def test_resolve_takes_a_value_a_dict_or_none() -> None:
    full = CompileOptions(strict=True)
    assert resolve(full) is full
    with using(regather=True):
        assert resolve({"strict": True}) == current().replace(strict=True, regather=True)
        assert resolve({"strict": True}).regather is True
        assert resolve(None).regather is True
    with pytest.raises(OptionError, match=r"options=\['strict'\]: expected a partita"):
        resolve(["strict"])  # type: ignore[arg-type]
    with pytest.raises(OptionError, match=r"replace: no option named 'compile_programs'"):
        partita.jit(torch.sin, mesh=MESH, options={"compile_programs": True})


def test_options_are_part_of_the_jit_cache_key() -> None:
    step = partita.jit(lambda x: x.cumsum(0), mesh=MESH, in_specs=(P("data"),))
    x = torch.randn(8)
    plain = step.lower(x)
    assert step.cache_size == 1
    with using(bucket_bytes=0):
        assert step.lower(x) is not plain and step.cache_size == 2
    assert step.lower(x) is plain and step.cache_size == 2  # the first options again: a hit
    # a runtime-only knob (not keyed) does not recompile
    with using(collective_timeout=5.0):
        assert step.lower(x) is plain and step.cache_size == 2
    fixed = partita.jit(lambda x: x.cumsum(0), mesh=MESH, in_specs=(P("data"),),
                        options=CompileOptions())  # fmt: skip
    fixed.lower(x)
    with using(collectives="explicit"):  # a full CompileOptions is taken as is
        fixed.lower(x)
    assert fixed.cache_size == 1


def test_options_are_part_of_the_virtual_device_step_key(dev: torch.device) -> None:
    vstate.get().programs.clear()
    x = torch.randn(8, 4)
    outs = []
    for changes in ({}, {"bucket_bytes": 0}, {}):
        with using(**changes):
            xd = x.to(dev)
            partita.mark_sharding(xd, MESH, P("data", None))
            y = (xd * 2).sum(0)
            partita.sync()
            outs.append(y.cpu())
    assert sorted(p.options.bucket_bytes for p in vstate.get().programs.values()) == [0, 4 << 20]
    for out in outs:
        torch.testing.assert_close(out, (x * 2).sum(0))


def test_strict_reaches_a_virtual_device_step(dev: torch.device) -> None:
    """A step whose annotation asks for a full rematerialization (rows split over 'data' to
    rows split over 'model': no collective moves those tiles) warns by default and raises
    RematerializationError under ``using(strict=True)``."""
    vstate.get().programs.clear()
    x = torch.randn(8, 4)

    def step() -> torch.Tensor:
        xd = x.to(dev)
        partita.mark_sharding(xd, MESH, P("data", None))
        y = xd * 2
        partita.mark_sharding(y, MESH, P("model", None))
        partita.sync()
        return y

    with pytest.warns(partita.RematerializationWarning, match="involuntary full remat"):
        torch.testing.assert_close(step().cpu(), x * 2)
    vstate.get().programs.clear()
    with using(strict=True), pytest.raises(RematerializationError, match="involuntary full"):
        step()
    vstate.get().programs.clear()


@pytest.mark.slow
def test_inductor_reaches_a_virtual_device_step(dev: torch.device) -> None:
    """Under ``using(inductor=True)`` the step's per-device program runs Inductor-
    compiled regions (runtime.compiled's record of that program)."""
    vstate.get().programs.clear()
    x, w = torch.randn(8, 4), torch.randn(4, 6)
    for enabled in (False, True):
        with using(inductor=enabled):
            xd, wd = x.to(dev), w.to(dev)
            partita.mark_sharding(xd, MESH, P("data", None))
            y = torch.relu(xd @ wd).sum(1)
            partita.sync()
            torch.testing.assert_close(y.cpu(), torch.relu(x @ w).sum(1), rtol=1e-5, atol=1e-5)
    plain, compiled = vstate.get().programs.values()
    assert stats_for(plain.local).regions == 0
    assert compiled.options.inductor and stats_for(compiled.local).regions >= 1


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _collectives(plan: partita.Plan) -> list[tuple[str, tuple[str, ...], int]]:
    return sorted((c.kind, tuple(c.mesh_axes), c.bytes) for c in plan.collectives)


@pytest.mark.parametrize("changes", [{}, {"regather": True, "bucket_bytes": 0}])
def test_the_same_program_is_the_same_plan_through_jit_train_step_and_use_spmd(
    changes: dict, dev: torch.device
) -> None:
    """A forward and a training step, each compiled three ways under the same options: the
    collective records (kind, axes, bytes) are the same."""
    x = torch.randn(8, 8)
    specs = {"0.weight": P("model", None), "2.weight": P(None, "model")}
    with using(**changes), warnings.catch_warnings():
        warnings.simplefilter("ignore", partita.PartitaWarning)
        # jit of the module's forward
        fwd = partita.jit(_model(), mesh=MESH, in_specs=(P("data", None),), param_specs=specs)
        by_jit = fwd.lower(x)
        # the same forward recorded on the virtual device
        model = _model().to(dev)
        for name, spec in specs.items():
            partita.mark_sharding(model.get_parameter(name), MESH, spec)
        xd = x.to(dev)
        partita.mark_sharding(xd, MESH, P("data", None))
        vstate.get().programs.clear()
        with torch.no_grad():
            y = model(xd)
            partita.sync()
        (program,) = vstate.get().programs.values()
        by_device = program.compiled.plan
        torch.testing.assert_close(y.cpu(), _model()(x), rtol=1e-5, atol=1e-5)
        # a training step: train_step against jit of the same functional step and specs
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        train = partita.train_step(model, F.mse_loss, opt, mesh=MESH, param_specs="fsdp")
        batch = (x, torch.randn(8, 4))
        by_train_step = train.lower(batch)
        pspecs, bspecs, sspecs = train._specs()
        same = partita.jit(
            train._fn,
            mesh=MESH,
            in_specs=(pspecs, bspecs, sspecs, P(), train.batch_spec),
            out_specs=(P(), pspecs, bspecs, sspecs),
        )
        by_jit_train = same.lower(*train._args(batch))
    assert _collectives(by_device) == _collectives(by_jit)
    assert by_device.counts() == by_jit.counts()
    assert by_train_step.explain() == by_jit_train.explain()
    assert _collectives(by_train_step) == _collectives(by_jit_train)
    assert by_train_step.counts()  # fsdp: gathers and reduce-scatters
    # the options reached both: bucketing off fuses nothing, on it fuses the small gathers
    assert bool(by_train_step.buckets) == bool(by_jit_train.buckets) == (not changes)


def test_docs_options_lists_every_knob() -> None:
    text = (DOCS / "options.md").read_text()
    defaults = CompileOptions()
    for knob in KNOBS:
        row = next((ln for ln in text.splitlines() if ln.startswith(f"| `{knob.name}`")), None)
        assert row is not None, f"docs/options.md has no row for {knob.name}"
        assert f"`{knob.env}`" in row and f"`{getattr(defaults, knob.name)!r}`" in row, row
    listed = [ln.split("`")[1] for ln in text.splitlines() if ln.startswith("| `")]
    assert listed == [k.name for k in KNOBS], "docs/options.md lists an option that is gone"
    assert "options.md" in (DOCS.parent / "mkdocs.yml").read_text()


def test_the_recompile_warning_names_changing_options() -> None:
    step = partita.jit(lambda x: x * 2, mesh=MESH, in_specs=(P("data"),))
    x = torch.randn(8)
    with pytest.warns(partita.RecompileWarning, match=r"what keeps changing: the options"):
        for i in range(8):
            with using(bucket_bytes=i):
                step(x)


def test_options_read_while_running_come_from_jits_options_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """check_calls, check_replicas and trace_flat_at are read as a program runs (not in its
    key): a jit's options= reached the compile only, and the run read the current options."""
    from partita.runtime.executor import executor_for

    seen: list[tuple[bool, int | None]] = []
    executor = executor_for(MESH)
    real = type(executor).run_compiled

    def spy(self: Any, compiled: Any, leaves: Any) -> Any:
        now = partita.options.current()
        seen.append((now.check_calls, now.trace_flat_at))
        return real(self, compiled, leaves)

    monkeypatch.setattr(type(executor), "run_compiled", spy)
    x = torch.randn(8)
    partita.jit(lambda t: t * 2, mesh=MESH, in_specs=(P("data"),))(x)
    step = partita.jit(
        lambda t: t * 3,
        mesh=MESH,
        in_specs=(P("data"),),
        options={"check_calls": False, "trace_flat_at": 5},
    )
    torch.testing.assert_close(step(x).full(), x * 3)
    before = partita.options.current()  # the suite sets PARTITA_TRACE_FLAT_AT
    assert seen == [(before.check_calls, before.trace_flat_at), (False, 5)]
    assert partita.options.current().check_calls  # only while it ran
