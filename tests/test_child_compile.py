"""``compile_in_child``: partita.jit compiles in a forked child process and runs what it hands
back (``partita.frontend.child_compile``); the results, the Plan and the errors are the same as
compiling here, and the process never imports ``torch._dynamo``. On 4 Gloo processes:
``test_distributed.py::test_compile_in_child_equals_compiling_here``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import partita
from partita import Mesh, P
from partita.errors import CaptureError, PartitaWarning
from partita.frontend import child_compile
from partita.runtime import plan_check
from partita.training import init_opt_state, make_train_step

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not child_compile.available(), reason="needs os.fork")


def _step(child: bool) -> tuple[partita.Jitted, dict, dict, tuple]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    mesh = Mesh.create((2, 2), ("data", "model"))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    specs = {k: P("model", None) if k.endswith("weight") else P() for k in params}
    step = partita.jit(
        make_train_step(model, F.mse_loss, "adamw", lr=1e-2), mesh=mesh,
        in_specs=(specs, {}, {"step": P(), "exp_avg": specs, "exp_avg_sq": specs},
                  (P("data"), P("data"))),
        options={"compile_in_child": child},
    )  # fmt: skip
    batch = (torch.randn(8, 8, generator=torch.Generator().manual_seed(1)), torch.ones(8, 4))
    return step, params, init_opt_state(params), batch


def _compare() -> None:
    """The same step compiled in a child and here: same results bit for bit, same Plan. Run in
    a fresh process (``__main__``): torch refuses autograd in a fork of a process that already
    ran a backward, and a test process has (it would compile here, after a warning)."""
    runs = []
    for child in (True, False):  # the child first, before this process runs any backward
        step, params, state, batch = _step(child)
        plan = step.lower(params, {}, state, batch)
        losses = []
        for _ in range(2):
            loss, params, _, state = step(params, {}, state, batch)
            losses.append(loss.full())
        compiled = next(iter(step._cache.values()))  # lower's (the steps add a signature)
        runs.append((plan, losses, {k: v.full() for k, v in params.items()}, compiled))
    (there, got, got_params, crossed), (here, want, want_params, kept) = runs
    assert kept.program.graph_module is not None
    assert crossed.program.graph_module is None  # it crossed: the global graph stayed behind
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    for k, w in want_params.items():
        assert torch.equal(got_params[k], w), k
    assert there.counts() == here.counts()
    assert there.bytes_per_device == here.bytes_per_device
    assert there.input_names == here.input_names
    assert there.memory().peak == here.memory().peak  # from the inputs' shapes, no fake tensors
    assert crossed.local.code == kept.local.code
    # what the cross-rank checks' messages read of the inputs (runtime.plan_check)
    assert plan_check.input_lines(crossed) == plan_check.input_lines(kept)
    assert [plan_check.input_name(crossed, i) for i in range(len(kept.program.input_nodes))] == [
        plan_check.input_name(kept, i) for i in range(len(kept.program.input_nodes))
    ]
    print("same")


def test_same_results_and_plan_as_compiling_here() -> None:
    proc = subprocess.run(
        [sys.executable, __file__], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("same"), proc.stdout


def test_after_a_backward_it_compiles_here_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(child_compile._STATE, "forks", True)
    monkeypatch.setitem(child_compile._STATE, "warned", False)
    torch.ones(2, requires_grad=True).sum().backward()  # autograd's threads now run here
    step, params, state, batch = _step(True)
    with pytest.warns(PartitaWarning, match="did not compile this program.*autograd"):
        step.lower(params, {}, state, batch)
    assert next(iter(step._cache.values())).program.graph_module is not None  # compiled here
    assert not child_compile._STATE["forks"]  # and the next compile does not try


def test_encode_decode_keeps_nodes_and_meta() -> None:
    step, params, state, batch = _step(False)
    step.lower(params, {}, state, batch)
    (compiled,) = step._cache.values()
    gm = child_compile.decode(child_compile.encode(compiled.local))
    assert gm.code == compiled.local.code
    for a, b in zip(gm.graph.nodes, compiled.local.graph.nodes, strict=True):
        assert (a.name, a.op, a.target) == (b.name, b.op, b.target)
        assert a.meta == {k: b.meta[k] for k in child_compile.META if k in b.meta}


def test_a_compile_error_is_the_usual_one() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return x * float(x.sum().item())  # needs a value: a CaptureError naming this line

    mesh = Mesh.create((2,), ("x",))
    step = partita.jit(fn, mesh=mesh, in_specs=(P("x"),), options={"compile_in_child": True})
    with pytest.raises(CaptureError, match="item"):
        step(torch.ones(4))


def test_the_process_never_imports_dynamo() -> None:
    """What the option is for: tracing imports ``torch._dynamo`` (and ~340 modules with it);
    compiled in a child, neither compiling nor running (attention included) imports it here."""
    code = textwrap.dedent("""
        import sys
        import torch
        import torch.nn.functional as F
        import partita
        from partita import Mesh, P

        def fn(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum(-1)

        args = [torch.randn(4, 2, 8, 16, generator=torch.Generator().manual_seed(i))
                for i in range(3)]
        mesh = Mesh.create((2,), ("data",))
        step = partita.jit(fn, mesh=mesh, in_specs=(P("data"),) * 3,
                           options={"compile_in_child": True})
        out = step(*args).full()
        assert torch.allclose(out, fn(*args), atol=1e-5), "wrong result"
        print("dynamo imported:", "torch._dynamo" in sys.modules)
    """)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dynamo imported: False" in proc.stdout, proc.stdout


#: A process of one Gloo rank: where the default compiles, with and without an eager backward
#: that started autograd's device threads first (``backward``: a CPU-only backward does not),
#: and under ``compile_in_child=False``.
DEFAULT = textwrap.dedent("""
    import sys, tempfile, warnings
    import torch
    import torch.distributed as dist
    import partita
    from partita import Mesh, P
    from partita.errors import PartitaWarning
    from partita.frontend import child_compile

    warnings.simplefilter("error", PartitaWarning)  # the default never warns here
    from partita.training import init_opt_state, make_train_step
    mesh = Mesh.create((2,), ("data",))
    model = torch.nn.Linear(4, 2)
    params = {k: v.detach() for k, v in model.named_parameters()}
    batch = (torch.randn(8, 4), torch.randn(8, 2))

    def where(options=None):  # tracing a training step runs autograd
        step = partita.jit(make_train_step(model, torch.nn.functional.mse_loss, "sgd", lr=0.1),
                           mesh=mesh, in_specs=(None, None, None, (P("data"), P("data"))),
                           options=options)
        step.lower(params, {}, init_opt_state(params, "sgd"), batch)
        (compiled,) = step._cache.values()
        return "child" if compiled.program.graph_module is None else "here"

    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0,
                            world_size=1)
    if sys.argv[1] == "backward":  # with a device beside the CPU, autograd starts threads
        partita.virtual.register_device()  # then torch refuses autograd in a fork
        torch.ones(2, requires_grad=True).sum().backward()
    print("distributed", where())
    print("dynamo imported:", "torch._dynamo" in sys.modules)
    print("forks", child_compile._STATE["forks"])
    print("off", where({"compile_in_child": False}))
    dist.destroy_process_group()
    print("local", where())
""")


def _default(*argv: str) -> str:
    proc = subprocess.run([sys.executable, "-c", DEFAULT, *argv], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_the_default_compiles_in_a_child_under_torch_distributed_only() -> None:
    out = _default("plain")
    assert "local here" in out  # a LocalMesh (one process) compiles here
    assert "distributed child" in out and "dynamo imported: False" in out
    assert "off here" in out  # compile_in_child=False turns it off


def test_the_default_after_a_backward_compiles_here_without_a_warning() -> None:
    out = _default("backward")  # a PartitaWarning would be an error there
    assert "distributed here" in out and "forks False" in out


@pytest.fixture
def fresh_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(child_compile._STATE, "forks", True)
    monkeypatch.setitem(child_compile._STATE, "warned", False)


def test_a_hung_child_is_stopped_and_this_process_compiles(
    fresh_state: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(child_compile, "STALL_SECONDS", 1.0)
    parent = os.getpid()

    def build() -> str:
        while os.getpid() != parent:  # the child waits without using CPU, as a deadlock does
            time.sleep(60)
        return "compiled here"

    with pytest.warns(PartitaWarning, match="used no CPU for 1 s and was stopped"):
        assert child_compile.compile_in_child(build, loud=False) == "compiled here"
    assert not child_compile._STATE["forks"]


def test_a_child_that_dies_is_not_waited_for_and_the_default_is_silent(
    fresh_state: None, recwarn: pytest.WarningsRecorder
) -> None:
    parent = os.getpid()

    def build() -> str:
        if os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
        return "compiled here"

    assert child_compile.compile_in_child(build, loud=False) == "compiled here"
    assert not [w for w in recwarn if issubclass(w.category, PartitaWarning)]
    assert not child_compile._STATE["forks"]


def test_a_parallel_kernel_in_the_child_does_not_wait_for_openmp() -> None:
    """OpenMP's worker threads are not in a forked child: its first parallel kernel waited for
    them forever (GNU libgomp) once this process had run one on two threads."""
    code = textwrap.dedent("""
        import os, torch
        from partita.frontend import child_compile
        torch.set_num_threads(2)
        x = torch.randn(4_000_000)
        x.mul(2).sum()  # OpenMP's pool now has a worker thread
        parent = os.getpid()
        def build():
            if os.getpid() != parent:
                x.mul(2).sum()
                os._exit(0)  # no result: this process compiles (here, returns)
            return "compiled here"
        print(child_compile.compile_in_child(build, loud=False))
    """)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compiled here" in proc.stdout


if __name__ == "__main__":
    _compare()
